"""The harness's new pieces that need no side venv: workloads D and P as raysim configs, the
steps-per-round count behind the cost-per-client-step figures, the --noisy busy loop, the TARGET
lines and the table's conditions line. (The pfl, FLGo and Flower arms run in their own venvs and
are exercised by ``benchmarks/run.py`` itself.) No timing assertions."""
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks import run as bench_run  # noqa: E402
from benchmarks.workloads import WORKLOADS, raysim_config, workload_b, workload_d, workload_p  # noqa: E402


def test_new_workloads_are_valid_raysim_configs():
    for make, per_round in ((workload_d, 100), (workload_p, 50)):
        spec = make(rounds=3)
        cfg = raysim_config(spec, hosts=2)
        assert cfg.method == "fedavg" and cfg.clients_per_round == per_round
        assert cfg.data.partition["num_clients"] == 1000 and cfg.data.partition["samples_per_client"] == 50
        assert cfg.train.batch_size == 10 and cfg.eval.every == 3
        assert spec["model"] == {"name": "mlp" if make is workload_d else "small_cnn", "norm": "none"}
    assert raysim_config(workload_d()).data.options["image_size"] == 28
    assert set(WORKLOADS) == {"A", "B", "D", "P"}


def test_steps_per_round_counts_every_sampled_clients_batches():
    spec = workload_b(rounds=2, num_clients=20, per_round=4)
    spec["partition"].update(samples_per_client=16, domains=["usps", "mnist"])
    spec["train"] = dict(spec["train"], batch_size=5)
    assert bench_run.steps_per_round(spec) == 4 * 4  # 4 clients x ceil(16 / 5) steps


def test_noise_runs_pinned_only_while_started():
    noise = bench_run.Noise(cpu=0)
    noise.start()
    try:
        pid = noise.proc.pid
        assert noise.proc.poll() is None
        assert os.sched_getaffinity(pid) == {0}
    finally:
        noise.stop("test arm")
    assert noise.proc is None
    assert noise.log and noise.log[0]["arm"] == "test arm"
    assert "CPU 0" in noise.describe()


def test_target_lines():
    ratios = [("D", "raysim/plain", 1.1), ("D", "flower/raysim", 4.0), ("B", "raysim/plain_1thread", 0.8),
              ("P", "raysim/plain", 9.0)]
    quiet = bench_run.target_lines(ratios, noisy=False)
    assert "TARGET D raysim/plain <= 1.2: 1.1 met" in quiet
    assert "TARGET D flower/raysim >= 10: 4 missed" in quiet
    assert not any(" B " in ln or " P " in ln for ln in quiet)  # B's is a --noisy target; P has none
    assert "TARGET B raysim/plain_1thread (noisy) <= 0.85: 0.8 met" in bench_run.target_lines(ratios, noisy=True)


@pytest.mark.parametrize("conditions", [None, ["--noisy: a busy loop"]])
def test_table_conditions_line(conditions):
    rows = [{"workload": "D", "arm": "pfl", "na": "pfl: not available: no wheel"}]
    lines = bench_run.table(rows, conditions).splitlines()
    offset = len(conditions or [])
    if conditions:
        assert lines[0] == "conditions: --noisy: a busy loop"
    assert lines[offset].startswith("| workload | arm |")
    assert lines[offset + 2].startswith("| D | pfl | pfl: not available: no wheel |")
    assert lines[offset + 1].count("|") == lines[offset].count("|") == lines[offset + 2].count("|")
