"""The device benchmark (``benchmarks/run.py --device``) end to end on the CPU: its smoke test
(``--device cpu --rounds 2 --only B``: the plain loop, raysim at 1 and 2 hosts, the cohort arm),
each arm's result appended as it finishes, every arm's weights equal to the plain loop's.
No timing assertions."""
import json
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN = os.path.join(REPO, "benchmarks", "run.py")


def _env():
    return {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}


@pytest.mark.slow
def test_device_benchmark_smoke_on_cpu(tmp_path):
    out = tmp_path / "bench"
    r = subprocess.run([sys.executable, RUN, "--device", "cpu", "--rounds", "2", "--only", "B", "--out", str(out)],
                       capture_output=True, text=True, env=_env(), cwd=REPO, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    arms = [json.loads(line) for line in (out / "arms.jsonl").read_text().splitlines()]
    names = [a["arm"] for a in arms]
    assert names[:3] == ["plain", "raysim H=1", "raysim H=2"] and names[3].startswith("raysim cohorts")
    for a in arms[:3]:  # exact on the CPU: the same computation
        assert a["workload"] == "B" and len(a["round_seconds"]) == 2
        assert a["same"] and a["max_abs_diff"] <= a["tolerance"] == 1e-6
    cohort = arms[3]
    assert "not_available" in cohort or cohort["same"]  # within its own tolerance (rounding: run.COHORT_TOLERANCE)
    for a in arms:  # printed as each finished
        assert f"ARM B {a['arm']}" in r.stdout
    assert "RATIO B raysim_h1/plain" in r.stdout and "RATIO B raysim_best/plain" in r.stdout
    res = json.loads((out / "results.json").read_text())
    assert res["device"] == "cpu" and res["hosts"] == [1, 2] and res["failed"] == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_a_gpu_is_one_line_error(tmp_path):
    r = subprocess.run([sys.executable, RUN, "--device", "cuda", "--quick", "--out", str(tmp_path)],
                       capture_output=True, text=True, env=_env(), cwd=REPO, timeout=300)
    assert r.returncode == 2
    err = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(err) == 1 and "no CUDA device" in err[0] and "--device cpu" in err[0]
    assert not (tmp_path / "arms.jsonl").exists()
