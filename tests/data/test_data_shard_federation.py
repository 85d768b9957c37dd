"""data.shards: a federation read from pre-written shards, without loading the dataset, gives every
client the same arrays, domains and counts as the federation that loads the dataset."""
import os

import numpy as np
import pytest
import torch

import raysim.data
from raysim.config import load_config
from raysim.core.errors import UserError
from raysim.app.sharding import write_federation_shards
from raysim.engine.federation import Federation

RAW = {
    "method": "fedbn", "rounds": 1, "seed": 1,
    "data": {"dataset": "rotated_mnist", "options": {"augment": "crop_flip"},
             "partition": {"kind": "per_domain", "domains": ["0", "45"], "clients_per_domain": 2}},
    "model": {"name": "small_cnn", "norm": "bn"},
}


def cfg(*overrides, raw=RAW):
    return load_config(raw=raw, overrides=list(overrides))


@pytest.fixture(scope="module")
def shard_uri(tmp_path_factory, data_cache):
    uri = f"file://{tmp_path_factory.mktemp('fedshards')}/s"
    write_federation_shards(cfg(), uri)
    return uri


@pytest.fixture
def no_dataset(monkeypatch):
    """Any dataset load fails: the shard path must not need one."""
    monkeypatch.setattr(raysim.data, "load", lambda *a, **k: pytest.fail("the dataset was loaded"))


def same_client_data(a, b, train_aug: bool = True):
    for s in ("train", "val", "test"):
        va, vb = getattr(a, s), getattr(b, s)
        assert len(va) == len(vb) and np.array_equal(va.labels, vb.labels)
        if len(va):
            xa = torch.cat([x for x, _ in va.eval_batches(64, "cpu")])
            xb = torch.cat([x for x, _ in vb.eval_batches(64, "cpu")])
            assert torch.equal(xa, xb)
    assert a.num_train == b.num_train
    if train_aug and a.num_train:  # the same shuffled, augmented batches from the same generator
        ga, gb = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
        for (xa, ya), (xb, yb) in zip(a.train.batches(16, ga, "cpu"), b.train.batches(16, gb, "cpu")):
            assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_shard_federation_equals_dataset_federation(shard_uri, monkeypatch):
    plain = Federation(cfg())
    ref = {c: plain.client_data(c) for c in range(plain.num_clients)}
    setup = plain.setup
    monkeypatch.setattr(raysim.data, "load", lambda *a, **k: pytest.fail("the dataset was loaded"))
    fed = Federation(cfg(f"data.shards={shard_uri}"))
    assert fed.num_clients == 4 and fed.num_targets == 0
    assert fed.setup == setup
    assert fed.domains == ("0", "15", "30", "45", "60", "75")
    assert [fed.domain(c) for c in range(4)] == ["0", "0", "45", "45"]
    assert [fed.partition.num_samples(c) for c in range(4)] == [plain.partition.num_samples(c) for c in range(4)]
    for c in range(4):
        same_client_data(ref[c], fed.client_data(c))


def test_local_path_is_made_absolute_and_checked(tmp_path, monkeypatch, data_cache):
    monkeypatch.chdir(tmp_path)
    c = cfg("data.shards=rel/shards")
    assert c.data.shards == str(tmp_path / "rel" / "shards")
    with pytest.raises(UserError, match="data.shards' is empty"):
        cfg("data.shards=' '")
    with pytest.raises(UserError, match=r"federation.json cannot be read .*raysim data shard CONFIG URI"):
        Federation(c).num_clients


def test_shards_cut_for_another_config_are_refused(shard_uri, no_dataset):
    with pytest.raises(UserError, match=r"was cut for seed = 1 but this run has 2; rewrite them"):
        Federation(cfg("seed=2", f"data.shards={shard_uri}")).num_clients
    with pytest.raises(UserError, match=r"was cut for partition = .* but this run has"):
        Federation(cfg("data.partition.clients_per_domain=3", f"data.shards={shard_uri}")).num_clients
    with pytest.raises(UserError, match="holds no federation with domain '45' held out"):
        Federation(cfg("data.partition.holdout='45'", f"data.shards={shard_uri}")).num_clients


def test_leave_one_domain_out_shards(tmp_path, data_cache):
    raw = {**RAW, "eval": {"protocol": "lodo", "holdout": "45"},
           "data": {"dataset": "rotated_mnist", "partition": {"kind": "per_domain", "domains": ["0", "45"]}}}
    uri = str(tmp_path / "lodo")
    index = write_federation_shards(cfg(raw=raw), uri)
    assert index["holdouts"] == ["45"]
    assert sorted(os.listdir(tmp_path / "lodo" / "holdout-45")) == ["source", "target"]
    from raysim.app.rundir import lodo_holdouts
    assert lodo_holdouts(cfg(f"data.shards={uri}", raw=raw)) == ["45"]
    plain = Federation(cfg("data.partition.holdout='45'", raw=raw))
    fed = Federation(cfg("data.partition.holdout='45'", f"data.shards={uri}", raw=raw))
    assert (fed.num_clients, fed.num_targets) == (plain.num_clients, plain.num_targets) == (1, 1)
    assert fed.domain(1) == "45" and fed.setup == plain.setup
    for c in range(2):  # the source client and the unseen-domain target (test = the whole domain)
        same_client_data(plain.client_data(c), fed.client_data(c))
    with pytest.raises(UserError, match="holds leave-one-domain-out federations"):
        Federation(cfg(f"data.shards={uri}", "eval.protocol=personalized", raw=raw)).num_clients


def test_cli_data_shard(tmp_path, data_cache, capsys):
    import yaml
    from raysim.cli import main
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(RAW))
    assert main(["data", "shard", str(path), str(tmp_path / "out"), "seed=2", "--clients-per-file", "2"]) == 0
    out = capsys.readouterr().out
    assert f"raysim run {path} seed=2 data.shards={tmp_path / 'out'}" in out
    assert sorted(os.listdir(tmp_path / "out")) == ["clients-0000000.parquet", "clients-0000002.parquet",
                                                    "federation.json", "index.parquet", "manifest.json"]
    assert main(["data", "shard", str(path), "nosuchfs://x/y"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("raysim: error: shards: cannot open nosuchfs://x/y") and len(err.strip().splitlines()) == 1
