"""Client cohorts in the real round loop (Server and ClientHost in this process, InProcess backend):
for every method that opts in (``Method.local_loss``), two rounds with ``runtime.cohort_size`` 3
and 8 give the metrics of the per-client path within 1e-5 relative, and the same simulated-clock
figures (``sim_*``: the meter sees every client's passes). The clients hold 20, 10 and 5 samples
(batches of 8: 3, 2 and 1 steps, short last batches), with momentum, weight decay, clipping and BN."""
import os

import pyarrow.parquet as pq
import pytest
import torch

from raysim.config import load_config
from raysim.app.experiment import federation
from raysim.engine import cohort
from raysim.engine.backend import InProcess
from raysim.engine.cohort import train_cohort

LEVELS = [{"name": "fast", "flops": 1.0e9, "up_mbps": 10, "down_mbps": 50},
          {"name": "slow", "flops": 1.0e8, "up_mbps": 1, "down_mbps": 5}]
RAW = {
    "rounds": 2, "seed": 3,
    "data": {"dataset": "digits5", "options": {"image_size": 16},
             "partition": {"kind": "per_domain", "train_size": 20, "clients_per_domain": [1, 2, 4],
                           "domains": ["mnist", "usps", "svhn"]}},
    "model": {"name": "small_cnn", "norm": "bn"},
    "train": {"epochs": 1, "batch_size": 8, "lr": 0.05, "momentum": 0.5, "weight_decay": 1e-3, "grad_clip": 1.0},
    "eval": {"every": 1, "splits": ["test"]},
    "runtime": {"num_hosts": 1},
    "clients": {"profiles": {"levels": LEVELS}},
}
OPTED = ["fedavg", "fedprox", "fedbn", "local", "silobn", "fedavg_gn", "fedwon", "scaffold", "feddyn"]



pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors (tests/conftest.py)


def run(method, out, *overrides):
    cfg = load_config(raw={**RAW, "method": method}, overrides=list(overrides))
    federation(cfg, str(out), progress=False, backend=InProcess()).run()
    df = pq.read_table(os.path.join(out, "metrics.parquet")).to_pandas()
    keys = [c for c in df.columns if c != "value"]
    return df.sort_values(keys).reset_index(drop=True)


def same(a, b, tol=1e-5):
    assert len(a) == len(b) and (a.drop(columns="value") == b.drop(columns="value")).all().all()
    clock = a.metric.str.startswith("sim_") | a.metric.isin(["steps", "completed"])
    assert (a.value[clock] == b.value[clock]).all()  # the same passes charged
    rel = ((a.value - b.value).abs() / a.value.abs().clip(lower=1e-3)).max()
    assert rel <= tol, rel
    return rel


@pytest.mark.parametrize("method", OPTED)
def test_a_round_in_cohorts_is_the_per_client_round(method, tmp_path, monkeypatch):
    sizes = []  # the cohorts trained (not a silent fallback to the per-client path)

    def spy(model, members, meter=False):
        sizes.append(len(members))
        return train_cohort(model, members, meter)
    monkeypatch.setattr(cohort, "train_cohort", spy)
    hp = ["hp.fedwon.agc=false"] if method == "fedwon" else []
    ref = run(method, tmp_path / "alone", *hp)
    assert ref.metric.str.startswith("sim_compute").any() and not sizes
    for k in (3, 8):
        got = run(method, tmp_path / f"k{k}", *hp, f"runtime.cohort_size={k}")
        assert sizes == ([3, 3, 1] * 2 if k == 3 else [7] * 2), sizes  # 7 clients, 2 rounds
        sizes.clear()
        print(f"{method} K={k}: max relative difference {same(ref, got):.2e}")


def test_cohorts_on_two_hosts_with_moved_records_and_post_train_evaluation(tmp_path, monkeypatch):
    """Every client trained on another host than its own (its record travels there and back) and
    scored as it left training (eval.point post_train): cohorts change nothing but rounding."""
    from raysim.testing import ElsewherePlan
    sizes = []

    def spy(model, members, meter=False):
        sizes.append(len(members))
        return train_cohort(model, members, meter)
    monkeypatch.setattr(cohort, "train_cohort", spy)

    def run_elsewhere(out, *overrides):
        cfg = load_config(raw={**RAW, "method": "fedbn"},
                          overrides=["runtime.num_hosts=2", "eval.point=post_train", *overrides])
        fed = federation(cfg, str(out), progress=False, backend=InProcess())
        fed.plan = ElsewherePlan
        fed.run()
        df = pq.read_table(os.path.join(out, "metrics.parquet")).to_pandas()
        return df.sort_values([c for c in df.columns if c != "value"]).reset_index(drop=True)

    ref = run_elsewhere(tmp_path / "alone")
    got = run_elsewhere(tmp_path / "k3", "runtime.cohort_size=3")
    assert sizes and max(sizes) > 1
    same(ref, got)
