"""The GPU check of issue 40 in one command: the issue's targets beside what one GPU measures, in one table.

    source .gpu/setup.sh && bash benchmarks/gpu_check.sh      # on a GPU machine: about 8 minutes
    bash benchmarks/gpu_check.sh --device cpu                 # the CPU smoke: tiny sizes, seconds
    bash benchmarks/gpu_check.sh --device cpu --ray           # the GPU's code path on the CPU (minutes)

Steps, one after the other, each in its own process with its own time limit (a step that fails or
runs out of time gives ERROR rows; the others still run):

* (b) ``det``: workload B (run.py's, 2 rounds) with ``runtime.deterministic`` on 1, 2 and 4 hosts
  (``gpus_per_host`` 1/H): the final global model and ``metrics.parquet`` (less its "comm" rows:
  bytes per host depend on the layout) must be bitwise equal, the comparison of
  tests/app/test_experiment.py's host-layout test.
* (a) ``bench``: ``benchmarks/run.py --device cuda --quick --only A,B,D,P,B6 --cohort-size auto
  --no-pfl --targets-only``: the plain GPU loop (the reference), raysim per-client at 1 and 4 hosts
  and (c) the cohort arm, every arm's weights checked against the plain loop's; only the arms a
  target reads (P has no per-client target, A no cohort one: 2026-11-29's H200 run lost B6 to
  time). R (ResNet-10) is left to (d), pfl to run.py itself (no side venv on a fresh machine).
* (c) cohorts: run.py's cohort arm run with ``runtime.cohort_size: auto`` (K from the GPU memory
  free, at most 64, at most a chunk's clients), so it shares (a)'s plain-loop reference.
* (d) ``paper``: FedAvg and FDSE on digits5 with ResNet-10 at 32 px in FDSE's cross-silo protocol
  (``configs/fdse/digits5.yaml``: 5 clients of 743 images, one per domain). The rounds come from a
  measured pilot: each method first runs 2 rounds (its start-up and the second round, evaluation
  included, are timed), then both run again with as many rounds as the time left holds.

The table's targets are run.py's ``DEVICE_TARGETS`` (issue 31's, for one H100/H200): raysim
per-client at the best host count <= 1.0x the plain GPU loop's median round, at one host <= 1.3x;
cohorts <= 0.2x on D and P (0.3x on B, 0.5x on B6). Outputs, in ``--out`` (default
``${OUT:-benchmarks/out/gpu_check}``), at most 8 files: ``gpu_check.md`` (the table),
``gpu_check.json`` (every figure), ``gpu_check.log`` (the steps' output), and run.py's
``bench.log``, ``bench_table.md``, ``bench_arms.jsonl``, ``bench_results.json``. The runs
themselves go to a work folder (``--work``; a temporary one by default, removed at the end).

``--device cpu`` (the smoke) runs the same steps with tiny sizes (12 clients of 16 images at 16 px,
1-2 rounds) in one process, the federations on raysim's in-process backend and (a) as run.py's
device benchmark with its arms in this process, workloads D and P; with ``--ray`` the steps run as on
a GPU (own processes, Ray actors, run.py as a subprocess with ``--device cpu --only D --rounds 1``).
On the CPU the speed targets mean nothing: the smoke shows that the check runs and reads its results.

Exit status: 0 when every step ran (a MISS is a measurement), 1 when a row is ERROR, 2 when CUDA is
asked for and absent (one line) or the arguments are wrong.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks import run as bench  # noqa: E402 - no torch: the driver never imports it

BUDGET_S = 480.0  # the whole check on one H100, Ray's starts included
FINISH_S = 10.0  # kept for the table and the copies at the end
PAPER_RESERVE_S = 90.0  # what (d) is left at least, whatever (a) takes (it took 78 s on an H200)
BENCH_WORKLOADS = ("A", "B", "D", "P", "B6")
PAPER_METHODS = ("fedavg", "fdse")
DET_HOSTS = (1, 2, 4)
OUT_FILES = ("gpu_check.md", "gpu_check.json", "gpu_check.log", "bench.log", "bench_table.md", "bench_arms.jsonl",
             "bench_results.json")


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def one_line(err: BaseException | str, limit: int = 300) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


# ----------------------------------------------------------------------------- what each mode runs

@dataclass(frozen=True)
class Mode:
    """The device, and how big each step is there."""

    device: str  # cuda | cpu
    ray: bool  # Ray actors and own processes (always on cuda); False: the in-process smoke
    bench_workloads: tuple = BENCH_WORKLOADS
    det_rounds: int = 2
    pilot_rounds: int = 2
    paper_rounds: tuple = (2, 300)  # (d)'s main run: at least, at most
    image_size: int = 32
    paper_model: str = "resnet10"

    @property
    def smoke(self) -> bool:
        return self.device == "cpu"

    @property
    def name(self) -> str:
        if not self.smoke:
            return "cuda"
        return "cpu smoke through Ray (--ray)" if self.ray else "cpu smoke (in process)"


def mode_of(device: str, ray: bool) -> Mode:
    if device == "cuda":
        return Mode("cuda", True)
    # in one process the smoke trains (d) with small_cnn: ResNet-10's backward and FDSE's aggregation
    # of its 4.9M parameters take seconds of a CPU; --ray keeps ResNet-10, as on the GPU
    return Mode("cpu", ray, bench_workloads=("D",) if ray else ("D", "P"), det_rounds=2, pilot_rounds=1, paper_rounds=(1, 2), image_size=16,
                paper_model="resnet10" if ray else "small_cnn")


def tiny(spec: dict) -> dict:
    """A run.py workload at the smoke's size: 16 px, 12 clients of 16 images (4 a round), 4
    evaluated; a cross-silo one keeps its clients with 16 images each and small test slices."""
    spec = json.loads(json.dumps(spec))
    spec["data_options"] = {**spec.get("data_options", {}), "image_size": 16}
    part = spec["partition"]
    if part["kind"] == "cross_device":
        part.update(num_clients=12, samples_per_client=16)
        spec.update(clients_per_round=4, eval_clients=4)
    else:
        part.update(train_size=16, shared_test=False)
    return spec


def host_runtime(mode: Mode, hosts: int, **extra) -> dict:
    """runtime.* for H hosts: on cuda as run.py's device benchmark places them (1/H GPU and 1 CPU
    each, clients' data on the GPU); on the CPU within the machine's cores."""
    if mode.device == "cuda":
        rt = {"gpus_per_host": 1.0 / hosts, "cpus_per_host": 1, "device_data_mb": bench.DEVICE_DATA_MB}
    else:
        rt = {"cpus_per_host": min(1.0, (os.cpu_count() or 1) / hosts)}
    return {**rt, **extra}


# ----------------------------------------------------------------------------- the steps (worker side)

class Record:
    """A step's figures as JSON in the work folder, rewritten after every change (a step stopped
    at its time limit leaves what it had)."""

    def __init__(self, work: str, step: str):
        self.path = os.path.join(work, "steps", f"{step}.json")
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self.data: dict = {"step": step, "started": time.time()}
        self.save()

    def update(self, **kv) -> None:
        self.data.update(kv)
        self.save()

    def save(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(self.data, fh, indent=1, default=str)
        os.replace(tmp, self.path)


def read_step(work: str, step: str) -> dict:
    try:
        with open(os.path.join(work, "steps", f"{step}.json"), encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return {}


def run_federation(cfg, run_dir: str, backend=None, weights: bool = False) -> dict:
    """One federation of ``cfg`` (Ray actors, or ``backend``): its times, final evaluation and,
    with ``weights``, the final global model (taken from the server after the last round)."""
    from raysim.app.experiment import federation

    final: dict = {}

    def on_round(rnd, summary, evaluation):
        if weights and rnd == cfg.rounds:
            state = fed.backend.get(fed.server.export_state.remote())["global"]
            final["weights"] = {k: v.detach().to("cpu", copy=True) for k, v in state.items()}

    fed = federation(cfg, run_dir, progress=False, on_round=on_round, backend=backend)
    res = fed.run()
    return {"startup_seconds": res.startup_seconds, "round_seconds": list(res.round_seconds),
            "seconds": res.seconds, "rounds": res.rounds_done, "final_eval": res.last_eval.get("test", {}),
            "final_val": res.last_eval.get("val", {}), "weights": final.get("weights")}


def metrics_frame(run_dir: str):
    """metrics.parquet less its "comm" rows (bytes moved per host depend on the layout), as
    tests/app/test_experiment.py compares host layouts."""
    import pyarrow.parquet as pq
    df = pq.read_table(os.path.join(run_dir, "metrics.parquet")).to_pandas()
    return df[df.split != "comm"].reset_index(drop=True)


def compare_runs(ref: dict, ref_dir: str, other: dict, other_dir: str) -> dict:
    """Bitwise: every tensor of the final global model torch.equal, the metrics DataFrame.equals."""
    import torch

    from benchmarks.plain import weights_diff
    a, b = ref["weights"], other["weights"]
    same_keys = a is not None and b is not None and set(a) == set(b)
    w_equal = same_keys and all(torch.equal(a[k], b[k]) for k in a)
    diff = weights_diff(a, b) if same_keys else None
    ma, mb = metrics_frame(ref_dir), metrics_frame(other_dir)
    m_equal = bool(ma.equals(mb))
    differing = None
    if not m_equal and ma.shape == mb.shape:
        differing = int((ma.value != mb.value).sum())
    return {"weights_equal": bool(w_equal), "max_abs_diff": diff, "metrics_equal": m_equal,
            "metric_rows": int(len(ma)), "metric_rows_differing": differing}


class Worker:
    """Runs steps in this process (``gpu_check.py --worker STEP,...``): one Ray instance for all of
    them where the mode uses Ray, else raysim's in-process backend."""

    def __init__(self, mode: Mode, work: str, deadline: float):
        self.mode, self.work, self.deadline = mode, work, deadline
        self._session = None  # the Ray instance, started by the first step that needs it

    def backend(self):
        """Where a federation's server and hosts live: Ray actors (on this worker's one Ray instance,
        started at the first call: a failure to start is that step's error), or this process."""
        if not self.mode.ray:
            from raysim.engine.backend import InProcess
            return InProcess()
        if self._session is None:
            from raysim.engine.cluster import ray_session
            session = ray_session(None)
            session.__enter__()
            self._session = session
        return None

    def run(self, steps: list[str]) -> int:
        failed = 0
        try:
            for step in steps:
                rec = Record(self.work, step)
                t0, c0 = time.perf_counter(), time.process_time()
                log(f"step {step} ({self.mode.name})")
                try:
                    getattr(self, f"step_{step}")(rec)
                    rec.update(status="ok")
                except Exception as err:  # noqa: BLE001 - one step's failure is a row, not the end
                    failed += 1
                    rec.update(status="error", error=one_line(err), traceback=traceback.format_exc())
                    traceback.print_exc()  # into the step's log (gpu_check.log)
                    log(f"step {step} failed: {one_line(err)}")
                rec.update(seconds=time.perf_counter() - t0, cpu_seconds=time.process_time() - c0)
        finally:
            if self._session is not None:
                self._session.__exit__(None, None, None)
        return 1 if failed else 0

    # ---- data
    def step_prep(self, rec: Record) -> None:
        """Every digits5 rendering the steps use, generated and cached before anything is timed
        (the hosts would otherwise each render it at once)."""
        import platform
        from importlib.metadata import version

        import torch

        from raysim.data import load
        sizes = sorted({self.mode.image_size, 28 if self.mode.device == "cuda" else self.mode.image_size})
        for size in sizes:
            load("digits5", seed=0, image_size=size)
        rec.update(image_sizes=sizes, python=platform.python_version(), torch=torch.__version__,
                   ray=version("ray"), cpus=os.cpu_count())

    # ---- (b)
    def step_det(self, rec: Record) -> None:
        """Workload B with runtime.deterministic on 1, 2 and 4 hosts: bitwise the same."""
        import torch

        from benchmarks.workloads import raysim_config, workload_b
        spec = workload_b(rounds=self.mode.det_rounds)
        if self.mode.smoke:
            spec = tiny(spec)
        before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
                  torch.backends.cudnn.benchmark)
        runs: dict = {}
        rec.update(workload="B", rounds=spec["rounds"], clients=spec["partition"]["num_clients"],
                   per_round=spec["clients_per_round"], hosts=list(DET_HOSTS), runs={}, compare={})
        try:
            for h in DET_HOSTS:
                cfg = raysim_config(spec, hosts=h, runtime=host_runtime(self.mode, h, deterministic=True))
                run_dir = os.path.join(self.work, "det", f"hosts{h}")
                res = run_federation(cfg, run_dir, self.backend(), weights=True)
                runs[h] = (res, run_dir)
                rec.data["runs"][str(h)] = {k: v for k, v in res.items() if k != "weights"}
                if h != DET_HOSTS[0]:
                    ref, ref_dir = runs[DET_HOSTS[0]]
                    rec.data["compare"][str(h)] = compare_runs(ref, ref_dir, res, run_dir)
                rec.save()
        finally:  # the in-process hosts set this process's flags: put them back for the next steps
            torch.use_deterministic_algorithms(before[0])
            torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[1], before[2]

    # ---- (a) and (c), in this process (the smoke); on cuda and with --ray run.py runs as its own step
    def step_bench(self, rec: Record) -> None:
        """run.py's device benchmark at the smoke's size, its arms in this process: the plain loop,
        raysim per-client at 1 and 2 hosts and the cohort arm (``cohort_size`` auto)."""
        out = os.path.join(self.work, "bench")
        os.makedirs(out, exist_ok=True)
        b = InProcessBench(out, 600, bench.device_tolerance("cpu", False, None), "cpu", False)
        for w in self.mode.bench_workloads:
            bench.device_workload(b, tiny(bench.DEVICE_WORKLOADS[w](1)), (1, 2), "auto", None)
        rec.update(workloads=list(self.mode.bench_workloads), failed=b.failed, ratios=[list(r) for r in b.ratios])
        with open(os.path.join(out, "table.md"), "w", encoding="utf-8") as fh:
            fh.write(bench.table(b.rows, ["device cpu (gpu_check smoke: tiny workloads, arms in one process)"]) + "\n")

    # ---- (d)
    def paper_config(self, method: str, rounds: int):
        """FDSE's digits5 protocol (configs/fdse/digits5.yaml) with ResNet-10 at 32 px, one method."""
        from raysim.config import load_config, read_yaml
        raw = read_yaml(os.path.join(REPO, "configs", "fdse", "digits5.yaml"))
        for key in ("methods", "seeds"):
            raw.pop(key, None)
        raw.update(name=f"gpu-check-{method}", method=method, seed=0, rounds=rounds,
                   model={"name": self.mode.paper_model, "norm": "bn"})
        data = raw["data"]
        data["options"] = {**data.get("options", {}), "image_size": self.mode.image_size}
        if self.mode.smoke:  # two clients of 8 images, small val/test slices
            data["partition"] = {**data["partition"], "train_size": 8, "shared_test": False,
                                 "domains": ["usps", "mnist"]}
        raw["eval"] = {**raw["eval"], "every": rounds}  # evaluated after the last round
        if self.mode.device == "cuda":  # one host per client, each a fifth of the GPU
            raw["runtime"] = {"num_hosts": 5, **host_runtime(self.mode, 5)}
        return load_config(raw=raw)

    def step_paper(self, rec: Record) -> None:
        """Each method's pilot (start-up and a round timed), then both with as many rounds as fit."""
        pilot = self.mode.pilot_rounds
        lo, hi = self.mode.paper_rounds
        rec.update(model=self.mode.paper_model, image_size=self.mode.image_size, pilot_rounds=pilot, runs={})
        timing = {}
        for m in PAPER_METHODS:
            res = run_federation(self.paper_config(m, pilot), os.path.join(self.work, "paper", f"{m}-pilot"),
                                 self.backend())
            res.pop("weights")
            rec.data["runs"][m] = {"pilot": res}
            rec.save()
            timing[m] = (res["startup_seconds"], res["round_seconds"][-1])  # the last: steady, and evaluates
        left = self.deadline - time.time() - 10.0  # Ray's and the actors' end
        startup = sum(s for s, _ in timing.values())
        per_round = sum(r for _, r in timing.values())
        fit = int((left - startup) // max(per_round, 1e-6))
        rounds = max(lo, min(hi, fit))
        rec.update(rounds=rounds, rounds_fit=fit, seconds_left=left,
                   rule=f"rounds = (time left {left:.0f} s - start-ups {startup:.1f} s) // sum of the pilots' "
                        f"last rounds {per_round:.2f} s = {fit}, within [{lo}, {hi}]")
        if fit < max(lo, pilot + 1):
            rec.update(main="skipped: the pilots are the runs (no time for more rounds)")
            return
        for m in PAPER_METHODS:
            res = run_federation(self.paper_config(m, rounds), os.path.join(self.work, "paper", m), self.backend())
            res.pop("weights")
            rec.data["runs"][m]["main"] = res
            rec.save()


class InProcessBench(bench.DeviceBench):
    """run.py's DeviceBench with its arms in this process: the plain loop by ``run_plain``, raysim
    on the in-process backend (the smoke's (a); run.py itself starts a process and Ray per arm)."""

    def plain_arm(self, spec: dict):
        from benchmarks.plain import run_plain, save_result
        out = os.path.join(self.out, f"{spec['name']}-plain-{self.device}")
        try:
            res = run_plain(spec, threads=1, device=self.device, deterministic=self.deterministic)
        except Exception as err:  # noqa: BLE001 - an arm's failure, as run.py reports it
            raise RuntimeError(f"plain {spec['name']} failed: {one_line(err)}") from err
        save_result(out, res)
        return res, out

    def raysim(self, spec, tag, memory=False, hosts=2, runtime=None):
        from benchmarks.plain import save_result
        from benchmarks.workloads import raysim_config
        from raysim.engine.backend import InProcess
        out = os.path.join(self.out, f"{spec['name']}-{tag}")
        try:
            res = run_federation(raysim_config(spec, hosts=hosts, runtime=runtime), os.path.join(out, "run"),
                                 InProcess(), weights=True)
        except Exception as err:  # noqa: BLE001 - an arm's failure, as run.py reports it
            raise RuntimeError(f"raysim {spec['name']} failed: {one_line(err)}") from err
        save_result(out, res)
        return res, out


# ----------------------------------------------------------------------------- the table (driver side)

@dataclass
class Row:
    step: str
    check: str
    measured: str
    target: str
    result: str  # PASS | MISS | ERROR | - (not run in this mode)


@dataclass
class Job:
    """One process the driver runs with a time limit: a worker (some steps) or run.py."""

    name: str
    steps: list
    cmd: list
    log: str
    timeout: float = 0.0
    rc: int | str | None = None
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)


def read_arms(path: str) -> list[dict]:
    try:
        with open(path, encoding="utf-8") as fh:
            return [json.loads(line) for line in fh if line.strip()]
    except OSError:
        return []


def _hosts_of(arm: str) -> int | None:
    return int(arm.split("=", 1)[1]) if arm.startswith("raysim H=") else None


def _arm_problem(a: dict) -> str | None:
    if "not_available" in a:
        return one_line(a["not_available"], 200)
    if not a.get("same"):
        return f"weights differ from the plain loop's by {a.get('max_abs_diff'):.3g} > {a.get('tolerance'):g}"
    return None


def bench_rows(arms: list[dict], workloads: tuple, why_missing: str) -> list[Row]:
    """The (a)/(c) rows of run.py's DEVICE_TARGETS from its arms.jsonl, each ratio as run.py takes
    it: an arm's median round over the plain loop's, only where its weights agree."""
    rows = []
    by_w: dict[str, list[dict]] = {}
    for a in arms:
        by_w.setdefault(a["workload"], []).append(a)
    checks = {"raysim_best/plain": "raysim per-client, best host count / plain GPU loop",
              "raysim_h1/plain": "raysim per-client, 1 host / plain GPU loop",
              "cohort/plain": "raysim cohorts (cohort_size auto), 1 host / plain GPU loop"}
    order = sorted(bench.DEVICE_TARGETS, key=lambda k: (list(checks).index(k[1]), BENCH_WORKLOADS.index(k[0])))
    for w, name in order:
        op, bound = bench.DEVICE_TARGETS[(w, name)]
        step = "(c)" if name.startswith("cohort") else "(a)"
        row = Row(step, f"{w}: {checks[name]} (median round)", "", f"{op} {bound:g}", "ERROR")
        rows.append(row)
        if w not in workloads:
            row.measured, row.result = "not run in this mode", "-"
            continue
        mine = by_w.get(w, [])
        plain = next((a for a in mine if a["arm"] == "plain"), None)
        if plain is None:
            row.measured = f"no result: {why_missing}"
            continue
        if "not_available" in plain:
            row.measured = f"plain loop: {one_line(plain['not_available'], 200)}"
            continue
        base = plain["round_median"]
        if name == "cohort/plain":
            cands = [a for a in mine if a["arm"].startswith("raysim cohorts")]
        elif name == "raysim_h1/plain":
            cands = [a for a in mine if _hosts_of(a["arm"]) == 1]
        else:
            cands = [a for a in mine if _hosts_of(a["arm"]) is not None]
        good = [a for a in cands if _arm_problem(a) is None]
        if not good:
            row.measured = ("; ".join(f"{a['arm']}: {_arm_problem(a)}" for a in cands) if cands
                            else f"no result: {why_missing}")
            continue
        best = min(good, key=lambda a: a["round_median"])
        ratio = best["round_median"] / base
        at = f" at H={_hosts_of(best['arm'])}" if name == "raysim_best/plain" else ""
        row.measured = f"{ratio:.3g}{at} ({best['round_median']:.3f} s vs {base:.3f} s)"
        row.result = "PASS" if (ratio <= bound if op == "<=" else ratio >= bound) else "MISS"
    return rows


def det_rows(det: dict, why_missing: str) -> list[Row]:
    hosts = det.get("hosts") or list(DET_HOSTS)
    check = (f"B, {det.get('rounds', '?')} rounds, runtime.deterministic: final model and metrics of "
             f"{', '.join(map(str, hosts))} hosts")
    row = Row("(b)", check, "", "bitwise equal", "ERROR")
    compare = det.get("compare") or {}
    parts = []
    for h in hosts[1:]:
        c = compare.get(str(h))
        if c is None:
            continue
        if c["weights_equal"] and c["metrics_equal"]:
            parts.append(f"{h} hosts = 1 host")
        else:
            w = "model equal" if c["weights_equal"] else f"model max |diff| {c['max_abs_diff']:.3g}"
            m = "metrics equal" if c["metrics_equal"] else \
                f"metrics differ ({c['metric_rows_differing']} of {c['metric_rows']} values)"
            parts.append(f"{h} hosts: {w}, {m}")
    missing = [h for h in hosts[1:] if str(h) not in compare]
    if missing:
        error = det.get("error") or why_missing
        parts.append(f"{', '.join(map(str, missing))} hosts: no result ({error})")
        row.measured = "; ".join(parts)
        return [row]
    row.measured = "; ".join(parts)
    row.result = "PASS" if all(c["weights_equal"] and c["metrics_equal"] for c in compare.values()) else "MISS"
    return [row]


def paper_rows(paper: dict, why_missing: str, mode: Mode) -> list[Row]:
    rows = []
    runs = paper.get("runs") or {}
    names = {"fedavg": "FedAvg", "fdse": "FDSE"}
    for m in PAPER_METHODS:
        model = {"resnet10": "ResNet-10"}.get(mode.paper_model, mode.paper_model)
        row = Row("(d)", f"{names[m]}, digits5, {model}, {mode.image_size} px, FDSE's cross-silo protocol",
                  "", "runs to its end", "ERROR")
        rows.append(row)
        r = runs.get(m) or {}
        res = r.get("main") or r.get("pilot")
        if res is None:
            row.measured = f"no result: {paper.get('error') or why_missing}"
            continue
        kind = "main run" if "main" in r else "pilot only"
        rounds = res["round_seconds"]
        steady = rounds[1:-1] if len(rounds) >= 3 else rounds
        acc = res.get("final_eval", {}).get("AVG")
        plural = "s" if res["rounds"] != 1 else ""
        row.measured = (f"{res['rounds']} round{plural} ({kind}), {statistics.median(steady):.2f} s a round, "
                        f"start-up {res['startup_seconds']:.1f} s, test AVG {'-' if acc is None else f'{acc:.4f}'}")
        if "main" not in r and paper.get("status") != "ok":
            row.measured += f"; main run: {paper.get('error') or why_missing}"
            continue
        row.result = "PASS"
    return rows


# ----------------------------------------------------------------------------- the driver

def cuda_problem(python: str) -> str | None:
    """Why this machine cannot run the GPU check (None if it can). Without an NVIDIA device node
    it answers at once; otherwise torch is asked (in a child: this process never opens CUDA)."""
    if not any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia/version")):
        return "no NVIDIA device on this machine (/dev/nvidiactl missing)"
    try:
        r = subprocess.run([python, "-c", "import torch; print(torch.__version__, torch.cuda.is_available())"],
                           capture_output=True, text=True, timeout=120, env=child_env())
    except subprocess.TimeoutExpired:
        return "torch did not answer within 120 s whether it sees CUDA"
    words = r.stdout.split()
    if r.returncode != 0 or len(words) < 2:
        last = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}"
        return f"torch does not import: {one_line(last)}"
    if words[1] != "True":
        return f"torch {words[0]} sees no CUDA device (torch.cuda.is_available() is False)"
    return None


def child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def end_tree(pid: int) -> None:
    """SIGTERM to the process and all its descendants (Ray's GCS, raylet and workers, run.py's
    arms), by id; SIGKILL to those left after 5 s."""
    from benchmarks.procmem import tree_pids
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 2.0)):
        pids = tree_pids(pid)
        for p in pids:
            try:
                os.kill(p, sig)
            except (ProcessLookupError, PermissionError):
                pass
        t_end = time.time() + wait
        while time.time() < t_end and any(os.path.exists(f"/proc/{p}") and not _zombie(p) for p in pids):
            time.sleep(0.2)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
        return stat[stat.rfind(b")") + 2:].split()[0] == b"Z"
    except OSError:
        return True


def run_job(job: Job) -> None:
    """The job's process with its output in its log; at its time limit it and its descendants end."""
    log(f"{job.name}: {' '.join(os.path.relpath(c, REPO) if c.startswith(REPO) else c for c in job.cmd[1:])} "
        f"(limit {job.timeout:.0f} s)")
    t0 = time.perf_counter()
    with open(job.log, "w", encoding="utf-8") as fh:
        p = subprocess.Popen(job.cmd, stdout=fh, stderr=subprocess.STDOUT, env=child_env(), cwd=REPO)
        try:
            job.rc = p.wait(timeout=max(job.timeout, 1.0))
        except subprocess.TimeoutExpired:
            end_tree(p.pid)
            p.wait()
            job.rc = "timeout"
        except KeyboardInterrupt:  # Ctrl-C: nothing of the check stays behind
            end_tree(p.pid)
            raise
    job.seconds = time.perf_counter() - t0
    ended = f"ran out of its {job.timeout:.0f} s" if job.rc == "timeout" else f"exit {job.rc}"
    log(f"{job.name}: {ended} after {job.seconds:.0f} s")


def why(job: Job | None) -> str:
    if job is None:
        return "not run"
    if job.rc == "timeout":
        return f"its step ran out of its {job.timeout:.0f} s"
    if job.rc not in (0, None):
        return f"its step exited {job.rc} (see {'bench.log' if job.steps == ['bench'] else 'gpu_check.log'})"
    return "none recorded"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="the GPU check of issue 40: one table of its targets beside the "
                                            "measured figures")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (default): the check on a GPU; cpu: the smoke, tiny sizes")
    p.add_argument("--ray", action="store_true",
                   help="with --device cpu: the steps through Ray and run.py, as on a GPU")
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(REPO, "benchmarks", "out", "gpu_check"),
                   help="where the table, the JSON and the logs go (default $OUT, else benchmarks/out/gpu_check)")
    p.add_argument("--work", default=None, help="where the runs go (default: a temporary folder, removed at the end)")
    p.add_argument("--budget-s", type=float, default=None, help=f"the whole check's seconds (default {BUDGET_S:g} on "
                                                               "cuda, 600 for the smoke)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: run these steps here
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.ray and ns.device != "cpu":
        p.error("--ray goes with --device cpu (on cuda the steps always run through Ray)")
    mode = mode_of(ns.device, ns.ray)
    if ns.worker:
        return Worker(mode, ns.work, ns.deadline or time.time() + 600).run(ns.worker.split(","))
    t_start = time.time()
    budget = ns.budget_s or (BUDGET_S if ns.device == "cuda" else 600.0)
    python = sys.executable
    if ns.device == "cuda":
        problem = cuda_problem(python)
        if problem:
            print(f"gpu_check: error: the GPU check needs CUDA: {problem}; the CPU smoke runs with "
                  f"`bash benchmarks/gpu_check.sh --device cpu`", file=sys.stderr)
            return 2
    out = os.path.abspath(ns.out)
    os.makedirs(out, exist_ok=True)
    for name in OUT_FILES:  # a previous check's files would pass for this one's
        if os.path.exists(os.path.join(out, name)):
            os.remove(os.path.join(out, name))
    work = os.path.abspath(ns.work) if ns.work else tempfile.mkdtemp(prefix="gpu_check-")
    os.makedirs(work, exist_ok=True)
    try:
        return drive(mode, out, work, t_start, budget, python)
    finally:
        if not ns.work:
            shutil.rmtree(work, ignore_errors=True)


def worker_cmd(python: str, mode: Mode, work: str, steps: list[str], deadline: float) -> list[str]:
    ray_flag = ["--ray"] if mode.ray and mode.device == "cpu" else []  # on cuda the steps always run through Ray
    return ([python, os.path.abspath(__file__), "--device", mode.device] + ray_flag +
            ["--work", work, "--worker", ",".join(steps), "--deadline", f"{deadline:.1f}"])


def drive(mode: Mode, out: str, work: str, t_start: float, budget: float, python: str) -> int:
    """The jobs one after another, each within what the budget leaves; then the table."""
    deadline = t_start + budget
    left = lambda: deadline - time.time()  # noqa: E731
    logs = os.path.join(work, "logs")
    os.makedirs(logs, exist_ok=True)
    jobs: dict[str, Job] = {}
    if mode.ray:
        first = Job("(b) determinism", ["prep", "det"], [], os.path.join(logs, "det.log"))
        first.timeout = min(180.0, left() - PAPER_RESERVE_S - 120.0) if mode.device == "cuda" else left() / 3
        first.cmd = worker_cmd(python, mode, work, first.steps, time.time() + first.timeout)
        jobs["det"] = first
        run_job(first)
        bench_out = os.path.join(work, "bench")
        cmd = [python, os.path.join(HERE, "run.py"), "--device", mode.device, "--out", bench_out,
               "--only", ",".join(mode.bench_workloads), "--cohort-size", "auto", "--no-pfl", "--timeout", "120",
               "--targets-only"]
        cmd += ["--quick"] if mode.device == "cuda" else ["--rounds", "1"]
        bench_job = Job("(a)+(c) run.py", ["bench"], cmd, os.path.join(logs, "bench.log"))
        reserve = PAPER_RESERVE_S if mode.device == "cuda" else left() / 3
        bench_job.timeout = max(60.0, left() - reserve - FINISH_S)
        jobs["bench"] = bench_job
        run_job(bench_job)
        paper = Job("(d) paper scale", ["paper"], [], os.path.join(logs, "paper.log"))
        paper.timeout = max(30.0, left() - FINISH_S)
        paper.cmd = worker_cmd(python, mode, work, paper.steps, time.time() + paper.timeout - 5.0)
        jobs["paper"] = paper
        run_job(paper)
    else:  # the smoke: every step in one process
        smoke = Job("smoke", ["prep", "det", "bench", "paper"], [], os.path.join(logs, "smoke.log"))
        smoke.timeout = max(30.0, left() - FINISH_S)
        smoke.cmd = worker_cmd(python, mode, work, smoke.steps, time.time() + smoke.timeout - 5.0)
        jobs["det"] = jobs["bench"] = jobs["paper"] = smoke
        run_job(smoke)
    return report(mode, out, work, jobs, t_start, budget)


def step_error(work: str, step: str, job: Job) -> str:
    rec = read_step(work, step)
    return rec.get("error") or why(job)


def step_time(rec: dict, job: Job) -> str:
    """A step's seconds for the summary line (run.py's: its process's)."""
    if job.steps == ["bench"]:
        return f"{job.seconds:.0f} s" + (" (ran out of time)" if job.rc == "timeout" else "")
    if "seconds" in rec:
        return f"{rec['seconds']:.0f} s"
    if rec:
        return "stopped (its process ran out of time)" if job.rc == "timeout" else "stopped"
    return "not run"


def report(mode: Mode, out: str, work: str, jobs: dict[str, Job], t_start: float, budget: float) -> int:
    prep, det, paper = (read_step(work, s) for s in ("prep", "det", "paper"))
    bench_step = read_step(work, "bench")
    arms_path = os.path.join(work, "bench", "arms.jsonl")
    arms = read_arms(arms_path)
    rows = bench_rows(arms, mode.bench_workloads, bench_step.get("error") or why(jobs.get("bench")))
    rows += det_rows(det, step_error(work, "det", jobs["det"]) if det.get("status") != "ok" else "")
    rows += paper_rows(paper, step_error(work, "paper", jobs["paper"]), mode)
    total = time.time() - t_start
    rows.append(Row("all", "the whole check's wall time", f"{total:.0f} s", f"<= {budget:.0f} s",
                    "PASS" if total <= budget else "MISS"))
    counts = {r: sum(1 for x in rows if x.result == r) for r in ("PASS", "MISS", "ERROR", "-")}
    machine = (f"Python {prep.get('python', '?')}, torch {prep.get('torch', '?')}, ray {prep.get('ray', '?')}, "
               f"{prep.get('cpus', '?')} CPUs{bench.gpu_name(mode.device)}")
    head = [f"# GPU check (issue 40), {mode.name}, {time.strftime('%Y-%m-%d %H:%M:%S')}", "",
            f"machine: {machine}"]
    if mode.smoke:
        head.append("smoke: tiny sizes on the CPU; the targets are the GPU's, so PASS/MISS here only shows that "
                    "the check measures and reads its results")
    if "rule" in paper:
        head.append(f"(d) rounds from measured pilots: {paper['rule']}")
    lines = ["| step | check | measured | target | result |", "|---|---|---|---|---|"]
    lines += [f"| {r.step} | {r.check} | {r.measured} | {r.target} | {r.result} |" for r in rows]
    split = [f"{name} {step_time(rec, job)}" for name, rec, job in
             (("prep", prep, jobs["det"]), ("(b)", det, jobs["det"]), ("(a)+(c)", bench_step, jobs["bench"]),
              ("(d)", paper, jobs["paper"]))]
    tail = [f"steps: {'; '.join(split)}; total {total:.0f} s of {budget:.0f} s",
            f"{counts['PASS']} PASS, {counts['MISS']} MISS, {counts['ERROR']} ERROR"
            + (f", {counts['-']} not run in this mode" if counts["-"] else "") + f"; files in {out}"]
    text = "\n".join(head + [""] + lines + [""] + tail)
    print(text, flush=True)
    with open(os.path.join(out, "gpu_check.md"), "w", encoding="utf-8") as fh:
        fh.write(text + "\n")
    raw = {"mode": mode.name, "device": mode.device, "budget_s": budget, "seconds": total,
           "rows": [r.__dict__ for r in rows], "jobs": {k: {"name": j.name, "rc": j.rc, "seconds": j.seconds,
                                                          "timeout": j.timeout} for k, j in jobs.items()},
           "steps": {"prep": prep, "det": det, "bench": bench_step, "paper": paper}, "arms": arms}
    with open(os.path.join(out, "gpu_check.json"), "w", encoding="utf-8") as fh:
        json.dump(raw, fh, indent=1, default=str)
    with open(os.path.join(out, "gpu_check.log"), "w", encoding="utf-8") as fh:
        for j in {id(j): j for j in jobs.values()}.values():
            if j.steps == ["bench"]:
                continue  # run.py's own log is bench.log
            fh.write(f"==== {j.name}: {' '.join(j.cmd)} (exit {j.rc}, {j.seconds:.0f} s)\n")
            try:
                with open(j.log, encoding="utf-8", errors="replace") as src:
                    fh.write(src.read())
            except OSError:
                pass
    bench_job = jobs.get("bench")
    copies = {"bench_table.md": os.path.join(work, "bench", "table.md"), "bench_arms.jsonl": arms_path,
              "bench_results.json": os.path.join(work, "bench", "results.json")}
    if bench_job is not None and bench_job.steps == ["bench"]:
        copies["bench.log"] = bench_job.log
    for name, src in copies.items():
        if os.path.isfile(src):
            shutil.copyfile(src, os.path.join(out, name))
    return 1 if counts["ERROR"] else 0


if __name__ == "__main__":
    sys.exit(main())
