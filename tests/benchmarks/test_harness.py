"""The benchmark harness's equivalence check on a tiny workload: the plain PyTorch loop and
raysim (2 hosts) must produce the same FedAvg model from the same seed, and the check must see
a difference when the computations differ. No timing assertions."""
import os
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks import run as bench_run  # noqa: E402
from benchmarks.plain import run_plain, weights_diff  # noqa: E402
from benchmarks.raysim_runner import run_raysim  # noqa: E402
from benchmarks.workloads import raysim_config, workload_a, workload_b, workload_c  # noqa: E402


DOMAINS = ["usps", "mnist"]  # two small domains keep the test fast


def tiny(kind: str = "silo") -> dict:
    if kind == "silo":  # one client per domain (one per host), 40 images each
        spec = workload_a(rounds=2)
        spec["partition"] = {"kind": "per_domain", "train_size": 40, "domains": DOMAINS}
    else:  # cross-device: 20 clients of 16 images, 4 per round
        spec = workload_b(rounds=2, num_clients=20, per_round=4)
        spec["partition"].update(samples_per_client=16, domains=DOMAINS)
        spec["eval_clients"] = 5
    return spec


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    yield 1
    torch.set_num_threads(before)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["silo", "device"])
def test_plain_loop_and_raysim_compute_the_same_model(ray_session, tmp_path, one_thread, kind):
    spec = tiny(kind)
    plain = run_plain(spec, threads=one_thread)
    ours = run_raysim(spec, str(tmp_path / "run"), hosts=2)
    assert len(plain["round_seconds"]) == len(ours["round_seconds"]) == 2
    assert weights_diff(plain["weights"], ours["weights"]) == 0.0
    assert plain["final_eval"]["AVG"] == pytest.approx(ours["final_eval"]["AVG"], abs=0)
    assert plain["final_eval"]["ALL"] == pytest.approx(ours["final_eval"]["ALL"], abs=0)


@pytest.mark.slow
def test_check_detects_a_different_computation(one_thread):
    spec = tiny()
    a = run_plain(spec, threads=one_thread, rounds=1)
    other = dict(spec, seed=1)  # other initial weights and batch order
    b = run_plain(other, threads=one_thread, rounds=1)
    assert weights_diff(a["weights"], b["weights"]) > 1e-3
    assert weights_diff(a["weights"], {k: v for k, v in list(a["weights"].items())[1:]}) == float("inf")


def test_specs_become_valid_raysim_configs():
    for spec in (workload_a(), workload_b(), workload_c(num_clients=100_000)):
        cfg = raysim_config(spec, hosts=2)
        assert cfg.runtime.num_hosts == 2 and cfg.method == spec["method"]
        assert cfg.eval.every == spec["rounds"]  # evaluation after the last round only, like the plain loop
    assert raysim_config(workload_c()).data.partition["num_clients"] == 100_000


def test_scale_bookkeeping():
    spec = workload_c(rounds=3, num_clients=1000, per_round=100)
    holders = bench_run.clients_with_state(spec)
    assert 100 < holders <= 300
    per_client = bench_run.state_bytes_per_client(spec)
    bn_floats = 4 * (16 + 32)  # small_cnn: BN(16), BN(32), each weight, bias, mean, var
    assert per_client >= bn_floats * 4


def test_table_and_ratio_lines(capsys):
    rows = [{"workload": "A", "arm": "plain", "resources": "1 process, 2 threads", "ray_start": None,
             "startup": 1.0, "round_median": 2.0, "round_mean": 2.1, "rounds_total": 4.2, "rounds": 2,
             "test_avg": 0.5, "diff": 0.0},
            {"workload": "A", "arm": "flower", "na": "flower: not available: no wheel"}]
    text = bench_run.table(rows)
    assert "flower: not available: no wheel" in text
    assert text.splitlines()[2].startswith("| A | plain | 1 process, 2 threads |")
