"""Partitioners: disjointness, sizes, determinism, label skew, errors, LODO, 100k clients."""
import pickle
import time
import tracemalloc

import numpy as np
import pytest

from raysim.data.partition import ClientShard, client_data, leave_one_domain_out, make_partition
from raysim.data.splits import ArraySplit, MultiDomainDataset
from raysim.core.errors import UserError


def toy(sizes=None, classes=10, seed=0):
    """Tiny in-memory dataset: {domain: (train, val, test)} sizes, balanced labels."""
    sizes = sizes or {"a": (1000, 100, 200), "b": (600, 60, 120), "c": (300, 30, 60)}
    rng = np.random.default_rng(seed)
    splits = {}
    for d, ns in sizes.items():
        splits[d] = {}
        for s, n in zip(("train", "val", "test"), ns):
            y = rng.permutation(np.arange(n) % classes)
            splits[d][s] = ArraySplit(np.zeros((n, 1, 2, 2), np.uint8), y, (0,), (1,))
    return MultiDomainDataset("toy", splits, [str(c) for c in range(classes)])


DS = toy()


def shards(part):
    return [part.shard(c) for c in range(part.num_clients)]


def assert_disjoint_within_domains(part, split="train"):
    for d in part.domains:
        seen = set()
        for c in part.clients(d):
            idx = getattr(part.shard(c), split)
            assert len(set(idx.tolist())) == idx.size
            assert not (set(idx.tolist()) & seen), (d, c)
            seen |= set(idx.tolist())


def same(p, q):
    return all(np.array_equal(getattr(a, s), getattr(b, s)) and a.domain == b.domain
               for a, b in zip(shards(p), shards(q)) for s in ("train", "val", "test"))


def test_one_client_per_domain_default():
    p = make_partition(DS, {"kind": "per_domain"}, seed=0)
    assert p.num_clients == 3 and [p.domain(c) for c in range(3)] == ["a", "b", "c"]
    s = p.shard(1)
    assert isinstance(s, ClientShard) and s.client_id == 1 and s.domain == "b"
    assert np.array_equal(s.train, np.arange(600))  # the whole train split
    assert np.array_equal(s.test, np.arange(120)) and np.array_equal(s.val, np.arange(60))  # shared_test default
    assert p.num_samples(2, "train") == 300 and p.num_samples(2, "test") == 60
    split, idx = client_data(DS, s, "test")
    assert split is DS.split("b", "test") and idx is s.test


def test_clients_per_domain_disjoint_and_sized():
    p = make_partition(DS, {"kind": "per_domain", "clients_per_domain": 4}, seed=0)
    assert p.num_clients == 12 and list(p.clients("b")) == [4, 5, 6, 7]
    assert_disjoint_within_domains(p)
    assert_disjoint_within_domains(p, "val")
    assert_disjoint_within_domains(p, "test")
    assert sorted(np.concatenate([p.shard(c).train for c in p.clients("a")]).tolist()) == list(range(1000))
    assert [p.num_samples(c) for c in p.clients("c")] == [75] * 4
    assert [p.num_samples(c, "test") for c in p.clients("a")] == [50] * 4  # proportional slices
    assert p.all_num_samples("train").tolist() == [250] * 4 + [150] * 4 + [75] * 4
    mixed = make_partition(DS, {"kind": "per_domain", "clients_per_domain": {"a": 2, "c": 1}}, seed=0)
    assert mixed.domains == ("a", "c") and mixed.num_clients == 3


def test_fraction_and_train_size():
    p = make_partition(DS, {"kind": "per_domain", "clients_per_domain": 3, "fraction": 0.2}, seed=0)
    assert [p.num_samples(c) for c in range(p.num_clients)] == [200] * 3 + [120] * 3 + [60] * 3
    assert [p.num_samples(c, "val") for c in p.clients("a")] == [20] * 3  # 20% of val each
    assert_disjoint_within_domains(p)
    f = make_partition(DS, {"kind": "per_domain", "train_size": 50, "domains": ["c", "a"]}, seed=0)
    assert f.domains == ("c", "a") and f.domain(0) == "c"  # clients follow the given domain order
    assert [f.num_samples(c) for c in range(2)] == [50, 50]
    assert f.shard(0).test.size == 60  # one client per domain: the full test set
    seq = make_partition(DS, {"kind": "per_domain", "train_size": 50, "shuffle": False}, seed=0)
    assert np.array_equal(seq.shard(0).train, np.arange(50))  # FedBN's consecutive partitions
    dapper = make_partition(DS, {"kind": "per_domain", "num_clients": 10, "assign": "random", "fraction": 0.1}, 3)
    assert dapper.num_clients == 10 and set(dapper.domains) == {"a", "b", "c"}


def test_too_many_samples_is_an_error():
    with pytest.raises(UserError, match=r"4 clients x 100 train images exceed domain 'c'"):
        make_partition(DS, {"kind": "per_domain", "clients_per_domain": 4, "train_size": 100}, 0)
    with pytest.raises(UserError, match="exceed domain 'a'"):
        make_partition(DS, {"kind": "per_domain", "clients_per_domain": 6, "fraction": 0.2}, 0)
    with pytest.raises(UserError, match="301 clients exceed domain 'c'"):
        make_partition(DS, {"kind": "per_domain", "clients_per_domain": 301}, 0)
    with pytest.raises(UserError, match="samples_per_client=400 exceeds domain 'c'"):
        make_partition(DS, {"kind": "cross_device", "num_clients": 30, "samples_per_client": 400, "overlap": True}, 0)
    with pytest.raises(UserError, match="overlap: true"):
        make_partition(DS, {"kind": "cross_device", "num_clients": 30, "samples_per_client": 100}, 0)
    with pytest.raises(UserError, match="min_size"):
        make_partition(DS, {"kind": "dirichlet", "clients_per_domain": 40, "alpha": 0.5, "domains": ["c"]}, 0)


def test_bad_specs():
    with pytest.raises(UserError, match="kind='iid' is not known; valid: per_domain, dirichlet, cross_device"):
        make_partition(DS, {"kind": "iid"}, 0)
    with pytest.raises(UserError, match=r"unknown key\(s\) \['alpha'\]"):
        make_partition(DS, {"kind": "per_domain", "alpha": 1}, 0)
    with pytest.raises(UserError, match="unknown domain 'z'"):
        make_partition(DS, {"kind": "per_domain", "domains": ["z"]}, 0)
    with pytest.raises(UserError, match="fraction or train_size"):
        make_partition(DS, {"kind": "per_domain", "fraction": 0.1, "train_size": 3}, 0)
    with pytest.raises(UserError, match="alpha > 0"):
        make_partition(DS, {"kind": "dirichlet", "clients_per_domain": 2}, 0)


@pytest.mark.parametrize("spec", [
    {"kind": "per_domain", "clients_per_domain": 3},
    {"kind": "per_domain", "clients_per_domain": 2, "fraction": 0.3},
    {"kind": "dirichlet", "clients_per_domain": 4, "alpha": 0.5},
    {"kind": "cross_device", "num_clients": 50},
    {"kind": "cross_device", "num_clients": 300, "samples_per_client": 50, "overlap": True},
])
def test_same_seed_same_shards_different_seed_different(spec):
    a, b, c = (make_partition(DS, spec, s) for s in (7, 7, 8))
    assert same(a, b)
    assert not same(a, c)
    assert same(a, pickle.loads(pickle.dumps(a)))  # travels to hosts intact
    assert_disjoint_within_domains(a, "val")


def test_dirichlet_label_skew():
    def class_shares(alpha):
        p = make_partition(DS, {"kind": "dirichlet", "clients_per_domain": 5, "alpha": alpha, "min_size": 5}, 1)
        assert_disjoint_within_domains(p)
        # every train image of the domain is used exactly once
        assert sorted(np.concatenate([p.shard(c).train for c in p.clients("a")]).tolist()) == list(range(1000))
        labels = DS.split("a", "train").labels
        return np.array([np.bincount(labels[p.shard(c).train], minlength=10) / p.num_samples(c)
                         for c in p.clients("a")])

    flat = class_shares(1000.0)
    skew = class_shares(0.1)
    assert np.abs(flat - 0.1).max() < 0.06  # ~uniform: every client sees every class ~10%
    assert skew.max(1).mean() > 0.4  # most of a client's data from few classes
    assert (skew == 0).sum() > 10  # many (client, class) pairs empty


def test_cross_device_layouts():
    p = make_partition(DS, {"kind": "cross_device", "num_clients": 30}, 0)
    assert [len(p.clients(d)) for d in "abc"] == [10, 10, 10]
    assert [p.num_samples(c) for c in p.clients("c")] == [30] * 10  # even share of the pool
    assert_disjoint_within_domains(p)
    prop = make_partition(DS, {"kind": "cross_device", "num_clients": 19, "spread": "proportional"}, 0)
    assert [len(prop.clients(d)) for d in "abc"] == [10, 6, 3]
    assert prop.domain(18) == "c" and prop.domain(9) == "a"
    ov = make_partition(DS, {"kind": "cross_device", "num_clients": 300, "samples_per_client": 40, "overlap": True}, 0)
    s = ov.shard(250)
    assert s.domain == "c" and s.train.size == 40 and len(set(s.train.tolist())) == 40
    assert s.train.max() < 300


def test_cross_device_100k_is_fast_and_lazy():
    ds = toy({d: (3500, 500, 1000) for d in ("mnist", "mnistm", "usps", "synth", "svhn")})  # digits5's sizes
    tracemalloc.start()
    t0 = time.perf_counter()
    p = make_partition(ds, {"kind": "cross_device", "num_clients": 100_000, "samples_per_client": 20,
                            "overlap": True}, seed=0)
    n = p.all_num_samples("train")
    first, last = p.shard(0), p.shard(99_999)
    seconds = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    print(f"\ncross_device 100k clients: {seconds * 1000:.1f} ms, peak {peak / 2**20:.1f} MiB")
    assert seconds < 2.0, seconds
    assert peak < 16 * 2**20, peak  # arrays per domain, not 100k shards
    assert p.num_clients == 100_000 and n.sum() == 2_000_000
    assert [len(p.clients(d)) for d in ds.domains] == [20_000] * 5
    assert first.domain == "mnist" and last.domain == "svhn" and last.train.size == 20
    assert np.array_equal(last.train, p.shard(99_999).train)  # computed on demand, same every time
    assert p.shard(12_345).val.size <= 1 and p.num_samples(0, "test") in (0, 1)
    # without samples_per_client every client gets an even, disjoint share of the pool
    q = make_partition(toy({"a": (100_000, 10, 10)}), {"kind": "cross_device", "num_clients": 100_000}, 0)
    assert q.num_samples(77_777) == 1


def test_leave_one_domain_out():
    src, tgt = leave_one_domain_out(DS, "b", {"kind": "per_domain", "clients_per_domain": 2}, seed=0)
    assert "b" not in src.domains and src.domains == ("a", "c") and src.num_clients == 4
    assert tgt.num_clients == 1 and tgt.domain(0) == "b"
    t = tgt.shard(0)
    assert t.test_split == "all"
    split, idx = client_data(DS, t, "test")
    assert len(split) == 600 + 60 + 120 and np.array_equal(idx, np.arange(780))  # 100% of the domain
    assert np.array_equal(t.train, np.arange(600)) and np.array_equal(t.val, np.arange(60))
    same_src = make_partition(DS, {"kind": "per_domain", "clients_per_domain": 2, "domains": ["a", "c"]}, 0)
    assert same(src, same_src)
    _, test_only = leave_one_domain_out(DS, "c", None, 0, target_test="test")
    assert test_only.shard(0).test.size == 60 and test_only.shard(0).split_name("test") == "test"
    with pytest.raises(UserError, match="unknown domain 'x'"):
        leave_one_domain_out(DS, "x", None, 0)
