"""benchmarks/gpu_check.sh, the GPU check of issue 40: its CPU smoke prints the one table with every
row, without CUDA it is one line and exit 2, a step past its time limit ends with all its processes,
and the rows read run.py's arms, the host-count comparison and the paper-scale runs as they should
(PASS, MISS, ERROR). No timing assertions."""
import json
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks import gpu_check  # noqa: E402
from benchmarks.run import DEVICE_TARGETS  # noqa: E402

SH = os.path.join(REPO, "benchmarks", "gpu_check.sh")


def _env():
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env["PYTHON"] = sys.executable
    return env


def _table(stdout: str) -> list[list[str]]:
    rows = [line for line in stdout.splitlines() if line.startswith("| ") and not line.startswith("| step ")]
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in rows]


def _kind(check: str) -> tuple[str, str]:
    """(workload, best | h1 | cohort) of an (a)/(c) row's check."""
    w = check.split(":")[0]
    return w, "cohort" if "cohorts" in check else "h1" if "1 host /" in check else "best"


def test_cpu_smoke_prints_the_table_with_every_row(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    r = subprocess.run(["bash", SH, "--device", "cpu", "--out", str(out), "--work", str(work)],
                       capture_output=True, text=True, env=_env(), cwd=str(tmp_path), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = _table(r.stdout)
    assert all(len(row) == 5 for row in rows)
    assert len({(row[0], row[1]) for row in rows}) == len(rows) == len(DEVICE_TARGETS) + 4  # + (b), (d) x 2, time
    bench = {_kind(row[1]): row for row in rows if row[0] in ("(a)", "(c)")}
    names = {"raysim_best/plain": "best", "raysim_h1/plain": "h1", "cohort/plain": "cohort"}
    assert set(bench) == {(w, names[name]) for w, name in DEVICE_TARGETS}
    for (w, name), (op, bound) in DEVICE_TARGETS.items():
        row = bench[(w, names[name])]
        assert row[0] == ("(c)" if name == "cohort/plain" else "(a)") and row[3] == f"{op} {bound:g}"
        if w in ("D", "P"):  # the smoke's workloads: measured, judged
            assert row[4] in ("PASS", "MISS") and "s vs" in row[2]
        else:
            assert row[4] == "-" and row[2] == "not run in this mode"
    det = next(row for row in rows if row[0] == "(b)")
    assert det[2] == "2 hosts = 1 host; 4 hosts = 1 host" and det[3:] == ["bitwise equal", "PASS"]
    paper = [row for row in rows if row[0] == "(d)"]
    assert [row[1].split(",")[0] for row in paper] == ["FedAvg", "FDSE"]
    assert all(row[4] == "PASS" and "rounds (main run)" in row[2] for row in paper)
    assert rows[-1][0] == "all" and rows[-1][4] in ("PASS", "MISS")
    assert "(d) rounds from measured pilots: rounds = " in r.stdout
    assert set(os.listdir(out)) == {"gpu_check.md", "gpu_check.json", "gpu_check.log", "bench_table.md",
                                    "bench_arms.jsonl"}
    assert (out / "gpu_check.md").read_text().strip() == r.stdout.strip()
    raw = json.loads((out / "gpu_check.json").read_text())
    assert [(a["workload"], a["arm"]) for a in raw["arms"]] == [
        (w, arm) for w in ("D", "P") for arm in ("plain", "raysim H=1", "raysim H=2", "raysim cohorts K=auto")]
    assert raw["steps"]["det"]["compare"]["4"]["weights_equal"] is True


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_it_says_so_in_one_line_and_exits_2(tmp_path):
    r = subprocess.run(["bash", SH, "--out", str(tmp_path / "out")], capture_output=True, text=True, env=_env(),
                       timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    err = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(err) == 1 and "needs CUDA" in err[0] and "gpu_check.sh --device cpu" in err[0]
    assert not (tmp_path / "out").exists()


def test_a_step_past_its_limit_ends_with_every_process_it_started(tmp_path):
    """A step's process and its children (Ray's, run.py's arms) end at its time limit."""
    pids = tmp_path / "pids"
    job = gpu_check.Job("sleepers", ["det"], ["bash", "-c", f"sleep 120 & echo $! > {pids}; "
                                                          f"bash -c 'sleep 120 & echo $! >> {pids}; wait' & wait"],
                        str(tmp_path / "log"), timeout=0.5)
    gpu_check.run_job(job)
    assert job.rc == "timeout"
    children = [int(p) for p in pids.read_text().split()]
    assert len(children) == 2
    assert all(gpu_check._zombie(p) for p in children)  # gone (or a zombie of an ended parent)
    assert gpu_check.why(job) == "its step ran out of its 0 s"


ARM = {"same": True, "tolerance": 0.05}


def _arm(w, arm, median=None, **kw):
    if median is None:
        return {"workload": w, "arm": arm, **kw}
    return {**ARM, "workload": w, "arm": arm, "round_median": median, "max_abs_diff": 0.0, **kw}


def test_bench_rows_read_run_pys_arms_as_its_ratios():
    arms = [_arm("D", "plain", 1.0), _arm("D", "raysim H=1", 1.2), _arm("D", "raysim H=4", 0.8),
            _arm("D", "raysim cohorts K=auto", 0.15),
            _arm("A", "plain", 1.0), _arm("A", "raysim H=1", 1.5), _arm("A", "raysim H=4", 1.1),
            _arm("B", "plain", 2.0), _arm("B", "raysim H=1", not_available="FAILED: out of memory"),
            _arm("B", "raysim H=4", 1.0, same=False, max_abs_diff=0.3),
            _arm("B", "raysim cohorts K=auto", not_available="FAILED: raysim B failed (exit 1)")]
    rows = gpu_check.bench_rows(arms, ("A", "B", "D", "P"), "its step ran out of its 200 s")
    assert len(rows) == len(DEVICE_TARGETS)
    got = {_kind(r.check): (r.measured, r.result) for r in rows}
    assert got[("D", "best")] == ("0.8 at H=4 (0.800 s vs 1.000 s)", "PASS")
    assert got[("D", "h1")] == ("1.2 (1.200 s vs 1.000 s)", "PASS")
    assert got[("D", "cohort")] == ("0.15 (0.150 s vs 1.000 s)", "PASS")
    assert got[("A", "best")][1] == "MISS"  # 1.1 > 1.0
    assert got[("A", "h1")][1] == "MISS"  # 1.5 > 1.3
    assert got[("B", "h1")] == ("raysim H=1: FAILED: out of memory", "ERROR")
    assert got[("B", "best")][1] == "ERROR" and "weights differ from the plain loop's by 0.3" in got[("B", "best")][0]
    assert got[("B", "cohort")] == ("raysim cohorts K=auto: FAILED: raysim B failed (exit 1)", "ERROR")
    assert got[("P", "cohort")] == ("no result: its step ran out of its 200 s", "ERROR")
    assert got[("B6", "cohort")] == ("not run in this mode", "-")


def test_det_and_paper_rows():
    equal = {"weights_equal": True, "max_abs_diff": 0.0, "metrics_equal": True, "metric_rows": 90,
             "metric_rows_differing": None}
    ok = {"rounds": 2, "hosts": [1, 2, 4], "status": "ok", "compare": {"2": equal, "4": equal}}
    assert gpu_check.det_rows(ok, "")[0].result == "PASS"
    off = dict(ok, compare={"2": equal, "4": {**equal, "weights_equal": False, "max_abs_diff": 3e-7,
                                                "metrics_equal": False, "metric_rows_differing": 12}})
    (row,) = gpu_check.det_rows(off, "")
    assert row.result == "MISS" and row.measured == ("2 hosts = 1 host; 4 hosts: model max |diff| 3e-07, metrics "
                                                     "differ (12 of 90 values)")
    (row,) = gpu_check.det_rows(dict(ok, compare={"2": equal}, status=None), "its step ran out of its 180 s")
    assert row.result == "ERROR" and row.measured.endswith("4 hosts: no result (its step ran out of its 180 s)")

    res = {"rounds": 30, "round_seconds": [2.0] + [1.0] * 28 + [1.5], "startup_seconds": 8.0,
           "final_eval": {"AVG": 0.8512}}
    mode = gpu_check.mode_of("cuda", True)
    paper = {"status": "ok", "runs": {"fedavg": {"pilot": res, "main": res}, "fdse": {"pilot": res, "main": res}}}
    rows = gpu_check.paper_rows(paper, "", mode)
    assert [r.result for r in rows] == ["PASS", "PASS"]
    assert rows[0].check.startswith("FedAvg, digits5, ResNet-10, 32 px")
    assert rows[0].measured == "30 rounds (main run), 1.00 s a round, start-up 8.0 s, test AVG 0.8512"
    cut = {"runs": {"fedavg": {"pilot": dict(res, rounds=2, round_seconds=[2.0, 1.5])}}}
    rows = gpu_check.paper_rows(cut, "its step ran out of its 100 s", mode)
    assert rows[0].result == "ERROR" and "(pilot only)" in rows[0].measured and rows[0].measured.endswith(
        "main run: its step ran out of its 100 s")
    assert rows[1].measured == "no result: its step ran out of its 100 s"


def test_a_cuda_workers_command_has_no_ray_flag_which_only_the_cpu_smoke_takes():
    """2026-11-29's first H200 run: the cuda workers got --ray, which parses as an error (exit 2)."""
    cuda = gpu_check.worker_cmd("py", gpu_check.mode_of("cuda", False), "/w", ["prep", "det"], 1.0)
    assert cuda[2:4] == ["--device", "cuda"] and "--ray" not in cuda
    assert "--ray" in gpu_check.worker_cmd("py", gpu_check.mode_of("cpu", True), "/w", ["det"], 1.0)


def test_targets_only_keeps_the_arms_a_target_reads():
    from benchmarks.run import targeted

    assert targeted("P", ("cohort/plain",)) and not targeted("P", ("raysim_best/plain", "raysim_h1/plain"))
    assert targeted("A", ("raysim_h1/plain",)) and not targeted("A", ("cohort/plain",))
    assert all(targeted(w, ("raysim_best/plain",)) and targeted(w, ("cohort/plain",)) for w in ("B", "D", "B6"))
