"""Evaluation as the papers define it: AVG over domains, the selected round, unseen clients built
and adapted as each paper does, results over seeds."""
import math
import os
import re

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch

from raysim.config import load_config
from raysim.core.errors import UserError
from raysim.engine.messages import SplitScores
from raysim.engine.metrics import MetricsLog
from raysim.app.report import paired_comparison
from raysim.app.tables import summarize

TINY = {
    "method": "fedavg", "rounds": 1, "seed": 3,
    "data": {"dataset": "digits5", "options": {"image_size": 16}, "partition": {"kind": "per_domain", "train_size": 48}},
    "model": {"name": "small_cnn", "norm": "bn"},
    "train": {"epochs": 1, "batch_size": 16, "lr": 0.05},
    "eval": {"every": 1},
    "runtime": {"num_hosts": 1, "cpus_per_host": 1},
}


def tiny(*overrides):
    return load_config(raw=TINY, overrides=list(overrides))


def metrics(run_dir):
    return pq.read_table(os.path.join(run_dir, "metrics.parquet")).to_pandas()


# ----------------------------------------------------------------------------- AVG = mean over domains

def test_avg_is_the_mean_over_domains_with_3_1_1_1_1_clients():
    """Domain a has three clients, b..e one each. Counts chosen so that the mean over clients
    (AVG_clients), the train-size-weighted mean and the mean over domains all differ."""
    domain = {0: "a", 1: "a", 2: "a", 3: "b", 4: "c", 5: "d", 6: "e"}
    correct = {0: 9, 1: 5, 2: 1, 3: 4, 4: 6, 5: 2, 6: 7}
    n = {0: 10, 1: 10, 2: 20, 3: 8, 4: 8, 5: 4, 6: 10}
    n_train = {0: 100, 1: 300, 2: 100, 3: 80, 4: 80, 5: 40, 6: 100}
    results = {c: {"test": SplitScores(correct=correct[c], loss_sum=0.5 * n[c], num_samples=n[c], num_train=n_train[c])}
               for c in domain}
    log = MetricsLog()
    head = log.add_eval(4, results, domain.__getitem__)
    # by hand: pooled a = 15/40; b = 4/8; c = 6/8; d = 2/4; e = 7/10
    domain_mean = (15 / 40 + 4 / 8 + 6 / 8 + 2 / 4 + 7 / 10) / 5
    client_mean = (0.9 + 0.5 + 0.05 + 0.5 + 0.75 + 0.5 + 0.7) / 7
    weighted = (100 * 0.9 + 300 * 0.5 + 100 * 0.05 + 80 * 0.5 + 80 * 0.75 + 40 * 0.5 + 100 * 0.7) / 800
    assert head["test"]["AVG"] == pytest.approx(domain_mean)
    assert head["test"]["AVG_clients"] == pytest.approx(client_mean)
    rows = log.table().to_pandas()
    fed = rows[(rows.client == -1) & (rows.metric == "accuracy")].set_index("domain").value
    assert fed["AVG"] == pytest.approx(domain_mean) and fed["AVG_clients"] == pytest.approx(client_mean)
    assert fed["AVG_weighted"] == pytest.approx(weighted) and fed["ALL"] == pytest.approx(34 / 70)
    assert fed["a"] == pytest.approx(15 / 40)
    assert len({round(v, 6) for v in (domain_mean, client_mean, weighted, 34 / 70)}) == 4


@pytest.mark.slow
def test_a_run_with_unequal_clients_per_domain_writes_avg_and_avg_clients(ray_session, tmp_path):
    from raysim.app.experiment import run
    run(tiny("data.partition.clients_per_domain=[3,1,1,1,1]"), out=str(tmp_path), progress=False)
    df = metrics(tmp_path)
    test = df[(df.split == "test") & (df.metric == "accuracy")]
    fed = test[test.client == -1].set_index("domain").value
    domains = ["mnist", "mnistm", "usps", "synth", "svhn"]
    assert fed["AVG"] == pytest.approx(np.mean([fed[d] for d in domains]))
    assert fed["AVG_clients"] == pytest.approx(test[test.client >= 0].value.mean())
    assert len(test[test.client >= 0]) == 7
    assert "AVG_clients" in open(tmp_path / "summary.md").read()  # shown where the two differ


# ----------------------------------------------------------------------------- the selected round

def frame(rows):
    return pd.DataFrame([{"round": r, "client": -1, "domain": d, "split": s, "metric": "accuracy", "value": v}
                         for r, s, d, v in rows])


def test_selection_rules_pick_their_rounds():
    rows = []
    for rnd, val, val_w, test in ((5, 0.50, 0.70, 0.40), (10, 0.80, 0.60, 0.45), (15, 0.70, 0.75, 0.60),
                                  (20, 0.80, 0.65, 0.55)):
        rows += [(rnd, "val", "AVG", val), (rnd, "val", "AVG_weighted", val_w), (rnd, "test", "AVG", test),
                 (rnd, "test", "ALL", test), (rnd, "test", "mnist", test)]
    df = frame(rows)
    picked = {rule: summarize(df, "m", rule) for rule in ("val", "val_weighted", "test", "final")}
    assert picked["val"].selected_round == 10  # ties: the earliest
    assert picked["val_weighted"].selected_round == 15
    assert picked["test"].selected_round == 15 and picked["final"].selected_round == 20
    assert picked["val"].selected["AVG"] == 0.45 and picked["val"].peek_round == 15
    no_val = summarize(df[df.split == "test"], "m", "val")  # nothing to select on: the final round
    assert no_val.rule == "final" and no_val.selected_round == 20


def test_paired_comparison_by_hand():
    # differences b - a: +1, +3 (points); c - a: -2, +2
    lines = paired_comparison({"a": {0: 0.50, 1: 0.60}, "b": {0: 0.51, 1: 0.63}, "c": {0: 0.48, 1: 0.62}})
    b = next(line for line in lines if line.startswith("| b "))
    c = next(line for line in lines if line.startswith("| c "))
    # t = mean / (sd / sqrt(2)) = 2 / (1.414 / 1.414) = 2 on 1 df: p = 1 - 2 atan(2) / pi
    p_b = 1 - 2 * math.atan(2.0) / math.pi
    assert f"+2.00 ± {math.sqrt(2):.2f}" in b and "2/2" in b and f"{p_b:.3f}" in b
    assert "+0.00 ±" in c and "1/2" in c and "1.000" in c


# ----------------------------------------------------------------------------- config

def test_seeds_and_select_config():
    cfg = tiny("seeds=[0,1,2]")
    assert cfg.seed_list() == [0, 1, 2] and cfg.for_seed(2).seed == 2 and cfg.for_seed(2).seeds is None
    assert load_config(raw={**TINY, "seeds": [4, 5]}, overrides=["seed=7"]).seed_list() == [7]
    for bad, msg in (("seeds=[]", "seeds"), ("seeds=[1,1]", "twice"), ("seeds=[a]", "seeds"),
                     ("eval.select=best", "eval.select")):
        with pytest.raises(UserError, match=msg):
            tiny(bad)


# ----------------------------------------------------------------------------- seeds

@pytest.mark.slow
def test_seeds_run_every_method_per_seed_and_summarize_mean_std_and_pairs(ray_session, tmp_path):
    from raysim.app.experiment import run
    run(tiny("methods=[fedavg,fedbn]", "seeds=[0,1]"), out=str(tmp_path), progress=False)
    for m in ("fedavg", "fedbn"):
        for s in (0, 1):
            assert os.path.isfile(tmp_path / m / f"seed-{s}" / "metrics.parquet")
    assert metrics(tmp_path / "fedavg" / "seed-0").equals(metrics(tmp_path / "fedavg" / "seed-0"))
    a0, a1 = (metrics(tmp_path / "fedavg" / f"seed-{s}") for s in (0, 1))
    assert not a0.value.equals(a1.value)  # the seeds really differ
    text = open(tmp_path / "summary.md").read()
    assert "mean ± std over seeds 0, 1" in text and " ± " in text
    assert "## Paired comparison with fedavg" in text and "| fedbn |" in re.sub(" +", " ", text)
    from raysim.app.report import render
    assert render(str(tmp_path)) == text  # raysim report re-renders the same


# ----------------------------------------------------------------------------- unseen clients on a host

def tiny_domains():
    from raysim.data.splits import ArraySplit, MultiDomainDataset
    rng = np.random.default_rng(0)
    splits = {}
    for k, d in enumerate("abcd"):
        splits[d] = {s: ArraySplit((rng.integers(0, 255, (n, 1, 8, 8)) // (k + 1)).astype(np.uint8),
                                   rng.integers(0, 3, n), (0.5,), (0.5,))
                     for s, n in (("train", 12), ("val", 4), ("test", 10))}
    return MultiDomainDataset("tiny", splits, ["0", "1", "2"])


def lodo_host_round(method, monkeypatch, rounds=2, **hp):
    """Server and ClientHost objects in this process (no actors): rounds of training on domains
    a-c, then the evaluation of the held-out domain d."""
    import raysim.data
    from raysim.engine.host import ClientHost
    from raysim.engine.server import Server
    monkeypatch.setattr(raysim.data, "load", lambda *a, **k: tiny_domains())
    cfg = load_config(raw={
        "method": method, "rounds": rounds, "seed": 1,
        "data": {"dataset": "rotated_mnist", "partition": {"kind": "per_domain", "holdout": "d"}},
        "model": {"name": "small_cnn", "norm": "bn"},
        "train": {"epochs": 1, "batch_size": 4, "lr": 0.05},
        "eval": {"protocol": "lodo"}, "runtime": {"num_hosts": 1}, "hp": {method: hp} if hp else {}})
    server, host = Server(cfg), ClientHost(0, cfg, num_hosts=1, gpu_ids=[])
    server.start()
    host.start()
    for rnd in range(1, rounds + 1):
        sampled = server.sample(rnd)
        box, personal = server.broadcast(rnd, sampled)
        server.aggregate(rnd, host.train_round(rnd, box, sampled, personal))
    box, _ = server.broadcast(rounds, [], False)
    out = host.evaluate(rounds, box, {0: ["val"], 3: ["test"]}, "lodo")
    return server, host, out


def test_fdse_unseen_domain_model_has_trained_dse_and_data_estimated_bn_dse_stats(ray_session, monkeypatch):
    server, host, out = lodo_host_round("fdse", monkeypatch, adapt_epochs=2, adapt_batch=4)
    assert set(out[3]) == {"test", "test_unadapted"} and out[3]["test"].num_samples == 26  # the whole domain
    assert set(out[0]) == {"val"}
    sd = host.model.state_dict()  # the unseen client's model, as evaluated
    dse = [k for k in sd if ".bn_dse." in k or ".cheap." in k]
    stats = [k for k in dse if "running_" in k]
    assert dse and stats
    for k in dse:
        if k.endswith("num_batches_tracked"):
            continue
        assert not torch.equal(sd[k], host._init_sd[k]), k  # trained, not the initialisation
    for k in stats:  # estimated from data: not 0/1, and re-estimated on the target, not the sources' mean
        assert not torch.equal(sd[k], server.personal_mean[k]), k
    assert set(server.personal_mean) == set(host.method.personal_keys(host.model))


def test_fedbn_unseen_domain_collects_its_bn_statistics(ray_session, monkeypatch):
    from raysim.core.training import collect_bn_stats
    server, host, out = lodo_host_round("fedbn", monkeypatch)
    assert set(out[3]) == {"test", "test_unadapted"}
    sd = host.model.state_dict()
    bn_stats = [k for k in server.personal_mean if "running_" in k]
    assert bn_stats
    # the BN layers start from the clients' mean (affine and statistics), then Alg. 2 replaces the
    # statistics by the target's own: one pass over its images, averaged
    for k in server.personal_mean:
        if "running_" not in k and not k.endswith("num_batches_tracked"):
            assert torch.equal(sd[k], server.personal_mean[k]), k
    import ray
    probe = host.evaluator.global_model(ray.get(server.broadcast(2, [], False)[0][0]))
    expected = collect_bn_stats(probe, host.evaluator.unseen_client(3, 2).unlabeled_batches(4))  # the same images, same order
    for k in bn_stats:
        assert torch.allclose(sd[k], expected[k], atol=1e-6), k
        assert not torch.allclose(sd[k], server.personal_mean[k]), k


def test_fedavg_has_no_adaptation_and_local_evaluates_the_mean_model(ray_session, monkeypatch):
    _, _, out = lodo_host_round("fedavg", monkeypatch, rounds=1)
    assert set(out[3]) == {"test"}
    server, host, out = lodo_host_round("local", monkeypatch, rounds=1)
    assert set(out[3]) == {"test"}
    sd = host.model.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in server.personal_mean.items())  # one-shot averaging
