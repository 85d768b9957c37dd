"""End-to-end runs on real Ray actors (the session's Ray instance: 2 CPUs, 1 logical GPU)."""
import os
import re

import pyarrow.parquet as pq
import pytest

from raysim.config import load_config
from raysim.core.errors import UserError
from raysim.app.experiment import run

TINY = {
    "method": "fedavg", "rounds": 2, "seed": 3,
    "data": {"dataset": "digits5", "partition": {"kind": "per_domain", "train_size": 64}},
    "model": {"name": "small_cnn", "norm": "bn"},
    "train": {"epochs": 1, "batch_size": 16, "lr": 0.05, "momentum": 0.5},
    "eval": {"every": 1},
    "runtime": {"num_hosts": 1, "cpus_per_host": 1},
}


def tiny(*overrides):
    return load_config(raw=TINY, overrides=list(overrides))


def metrics(run_dir):
    return pq.read_table(os.path.join(run_dir, "metrics.parquet")).to_pandas()


@pytest.fixture(scope="module")
def fedbn_one_host(ray_session, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("fedbn1"))
    run(tiny("method=fedbn"), out=out, progress=False)
    return out


def test_run_directory_has_config_metrics_summary_curves(fedbn_one_host):
    files = set(os.listdir(fedbn_one_host))
    assert {"config.yaml", "metrics.parquet", "summary.md", "curves.png"} <= files
    df = metrics(fedbn_one_host)
    assert list(df.columns) == ["round", "client", "domain", "split", "metric", "value"]
    assert set(df.metric) >= {"accuracy", "loss", "bytes_up", "bytes_down"}
    clients = df[(df.client >= 0) & (df.split == "test") & (df.metric == "accuracy")]
    assert sorted(clients.client.unique()) == [0, 1, 2, 3, 4]
    glob = df[(df.client == -1) & (df.split == "test") & (df.metric == "accuracy")]
    assert {"AVG", "ALL", "mnist", "usps"} <= set(glob.domain)
    # one client per domain, each with its domain's test set: AVG (over domains) = the clients' mean
    for rnd, g in clients.groupby("round"):
        avg = glob[(glob["round"] == rnd) & (glob.domain == "AVG")].value.item()
        assert avg == pytest.approx(g.value.mean())
    summary = open(os.path.join(fedbn_one_host, "summary.md")).read()
    assert "| fedbn" in summary and "## Selected round: best validation AVG" in summary


@pytest.mark.parametrize("runtime", [
    ["runtime.num_hosts=2"],
    ["runtime.num_hosts=null", "runtime.clients_per_host=1", "runtime.cpus_per_host=0.4"],
])
@pytest.mark.slow
def test_same_metrics_whatever_the_host_layout(fedbn_one_host, tmp_path, runtime):
    out = str(tmp_path / "run")
    run(tiny("method=fedbn", *runtime), out=out, progress=False)
    a, b = metrics(fedbn_one_host), metrics(out)
    a = a[a.split != "comm"].reset_index(drop=True)
    b = b[b.split != "comm"].reset_index(drop=True)
    assert a.equals(b)


def test_fractional_gpu_hosts_fall_back_to_cpu(ray_session, tmp_path):
    """Four hosts at 0.25 logical GPU each share the one declared GPU; torch sees no CUDA -> CPU."""
    import ray
    from raysim.engine.cluster import create_pool

    cfg = tiny("runtime.num_hosts=4", "runtime.cpus_per_host=0.5", "runtime.gpus_per_host=0.25")
    hosts, owner, pg = create_pool(cfg, 4, 5)  # digits5 per_domain: 5 clients
    try:
        info = ray.get([h.ready.remote() for h in hosts])
        assert [i["device"] for i in info] == ["cpu"] * 4
        assert [i["clients"] for i in info] == [2, 1, 1, 1]
        assert owner(4) == 0
    finally:
        for h in hosts:
            ray.kill(h)
        ray.util.remove_placement_group(pg)


def test_more_gpus_than_the_cluster_has_is_a_user_error(ray_session, tmp_path):
    with pytest.raises(UserError, match="needs 2 GPU"):
        run(tiny("runtime.num_hosts=2", "runtime.gpus_per_host=1"), out=str(tmp_path), progress=False)


def test_more_clients_per_round_than_clients(ray_session, tmp_path):
    with pytest.raises(UserError, match="clients_per_round = 9 but the federation has 5 clients"):
        run(tiny("clients_per_round=9"), out=str(tmp_path), progress=False)


def test_nan_loss_stops_with_client_and_round_and_keeps_metrics(ray_session, tmp_path):
    with pytest.raises(UserError, match=r"loss became nan for client \d \(domain \w+\) in round \d"):
        run(tiny("train.lr=1e30", "rounds=3", "train.momentum=0.0"), out=str(tmp_path), progress=False)
    assert os.path.isfile(tmp_path / "config.yaml")


@pytest.mark.slow
def test_leave_one_domain_out_trains_on_sources_and_tests_the_unseen_domain(ray_session, tmp_path):
    run(tiny("eval.protocol=lodo", "eval.holdout=usps", "rounds=1", "runtime.num_hosts=2"),
        out=str(tmp_path), progress=False)
    df = metrics(tmp_path / "holdout-usps")
    trained = df[(df.split == "val") & (df.client >= 0)]
    assert set(trained.domain) == {"mnist", "mnistm", "synth", "svhn"}
    target = df[(df.split == "test") & (df.client >= 0)]
    assert set(target.domain) == {"usps"} and set(target.client) == {4}
    assert set(df[df.split == "train"].domain) == {"mnist", "mnistm", "synth", "svhn", "ALL"}
    summary = open(tmp_path / "summary.md").read()
    assert "Leave-one-domain-out" in summary and "| usps | Avg |" in re.sub(" +", " ", summary)


@pytest.mark.slow
def test_held_out_domains_run_in_parallel_with_the_same_metrics(ray_session, tmp_path):
    """One host per federation on the session's 2 CPUs: two held-out domains train at once, and a
    held-out domain gives the metrics it gives when run alone."""
    from raysim.engine.cluster import parallel_slots
    base = ("eval.protocol=lodo", "eval.holdout=all", "rounds=1", "runtime.num_hosts=1",
            "data.partition.train_size=32")
    assert parallel_slots(tiny(*base), 5) == 2
    run(tiny(*base), out=str(tmp_path / "parallel"), progress=False)
    for domain in ("mnist", "mnistm", "usps", "synth", "svhn"):
        assert len(metrics(tmp_path / "parallel" / f"holdout-{domain}")) > 0, domain
    run(tiny(*base, "eval.holdout=usps", "runtime.parallel_federations=1"), out=str(tmp_path / "sequential"),
        progress=False)
    a, b = (metrics(tmp_path / mode / "holdout-usps") for mode in ("parallel", "sequential"))
    assert a.equals(b)


def test_unknown_holdout_domain(ray_session, tmp_path):
    with pytest.raises(UserError, match="eval.holdout = 'nowhere' is not a domain of digits5"):
        run(tiny("eval.protocol=lodo", "eval.holdout=nowhere"), out=str(tmp_path), progress=False)


@pytest.mark.slow
def test_post_train_eval_point_scores_the_model_as_it_left_training(ray_session, tmp_path):
    """FedAvg's round 1 evaluated post-train is each client's model after one local epoch from the
    common initial model: exactly Local's round-1 model (received, it would be the average)."""
    fedavg, local = str(tmp_path / "fedavg"), str(tmp_path / "local")
    run(tiny("eval.point=post_train"), out=fedavg, progress=False)
    run(tiny("method=local"), out=local, progress=False)

    def accuracy(run_dir, rnd):
        df = metrics(run_dir)
        return df[(df["round"] == rnd) & (df.metric == "accuracy")].reset_index(drop=True)

    assert accuracy(fedavg, 1).equals(accuracy(local, 1))
    assert not accuracy(fedavg, 2).value.equals(accuracy(local, 2).value)  # round 2 starts from the average


def test_the_drivers_late_imports_run_in_a_daemon_thread_while_ray_starts():
    """In a fresh driver none of them is imported by raysim.app.experiment itself (so the thread,
    started just before ray.init, is what takes them off the first round's path)."""
    import json
    import subprocess
    import sys

    script = ("import json, sys, raysim.app.experiment as e\n"
              "names = e.WARM_IMPORTS + ('torch.utils.tensorboard', 'pandas')\n"
              "before = [n for n in names if n in sys.modules]\n"
              "t = e.warm_imports(tensorboard=True)\n"
              "daemon = t.daemon\n"
              "t.join(120)\n"
              "print(json.dumps({'before': before, 'after': [n for n in names if n in sys.modules], 'daemon': daemon}))\n")
    out = json.loads(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                                    timeout=180).stdout.strip().splitlines()[-1])
    assert out["before"] == [] and out["daemon"]
    assert set(out["after"]) == {"raysim.engine.server", "raysim.engine.host", "raysim.app.report",
                                 "torch.utils.tensorboard", "pandas"}
