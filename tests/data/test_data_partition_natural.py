"""The natural partition: one client per group id (writer, user) of each domain's train split,
its val/test that group's own samples; min_samples drops small groups and says so; it scales to
tens of thousands of groups. Plus the typed config keys of the kinds issue 43 added."""
import pickle
import time

import numpy as np
import pytest

from raysim.config import load_config
from raysim.core.errors import UserError
from raysim.data.partition import make_partition
from raysim.data.splits import ArraySplit, MultiDomainDataset, group_carve


def split(groups, labels=None, classes=4):
    n = len(groups)
    labels = np.arange(n) % classes if labels is None else labels
    return ArraySplit(np.zeros((n, 1, 1, 1), np.uint8), labels, (0,), (1,), groups=groups)


def writers(domains: dict[str, int], seed=0, carve=(0.2, 0.2)) -> MultiDomainDataset:
    """Per domain, that many writers with 1..30 samples each, carved train/val/test per writer
    (group_carve), group ids made unique across domains and not contiguous."""
    rng = np.random.default_rng(seed)
    splits, base = {}, 0
    for d, n_writers in domains.items():
        sizes = rng.integers(1, 31, n_writers)
        ids = base + 3 * rng.permutation(n_writers)  # ids with gaps, unrelated to the order
        groups = np.repeat(ids, sizes)[rng.permutation(sizes.sum())]
        tr, va, te = group_carve(groups, *carve, rng)
        splits[d] = {s: split(groups[pos]) for s, pos in (("train", tr), ("val", va), ("test", te))}
        base += 3 * n_writers
    return MultiDomainDataset("writers", splits, ["0", "1", "2", "3"])


DS = writers({"a": 40, "b": 25})


def test_one_client_per_group_in_ascending_order_with_its_own_val_and_test():
    p = make_partition(DS, {"kind": "natural"}, seed=0)
    for d in DS.domains:
        train = DS.split(d, "train").groups
        ids = np.unique(train)
        clients = p.clients(d)
        assert len(clients) == ids.size  # exactly one client per group
        for c, gid in zip(clients, ids):
            s = p.shard(c)
            assert s.domain == d
            assert np.array_equal(s.train, np.flatnonzero(train == gid))  # all of it, nothing else
            for which in ("val", "test"):
                groups = DS.split(d, which).groups
                assert np.array_equal(getattr(s, which), np.flatnonzero(groups == gid))  # its own group's
    assert p.num_clients == 65 and list(p.clients("b")) == list(range(40, 65))  # grouped by domain
    assert p.notes == []
    assert p.all_num_samples("train").sum() == sum(len(DS.split(d, "train")) for d in DS.domains)
    # every val/test sample belongs to its writer's client (each writer has train samples)
    for which in ("val", "test"):
        assert p.all_num_samples(which).sum() == sum(len(DS.split(d, which)) for d in DS.domains)


def test_shared_test_gives_every_client_the_domains_whole_val_and_test():
    p = make_partition(DS, {"kind": "natural", "shared_test": True, "domains": ["b"]}, seed=0)
    assert p.domains == ("b",) and p.num_clients == 25
    s = p.shard(7)
    assert np.array_equal(s.test, np.arange(len(DS.split("b", "test"))))
    assert np.array_equal(s.val, np.arange(len(DS.split("b", "val"))))


def test_min_samples_drops_small_groups_and_says_so():
    train = np.repeat([5, 9, 2, 7], [6, 2, 4, 1])  # group sizes 6, 2, 4, 1 (ids 5, 9, 2, 7)
    ds = MultiDomainDataset("tiny", {"only": {"train": split(train), "val": split([9, 5, 7]),
                                              "test": split([2, 2, 7, 5, 11])}}, ["0", "1", "2", "3"])
    p = make_partition(ds, {"kind": "natural", "min_samples": 3}, seed=0)
    assert p.num_clients == 2  # groups 2 and 5 (ascending); 9 and 7 dropped
    assert [p.shard(c).train.tolist() for c in range(2)] == [[8, 9, 10, 11], [0, 1, 2, 3, 4, 5]]
    assert [p.shard(c).test.tolist() for c in range(2)] == [[0, 1], [3]]
    assert [p.shard(c).val.tolist() for c in range(2)] == [[], [1]]
    assert p.notes == [
        "natural partition: dropped 2 of 4 groups (3 training samples) with fewer than 3 training samples "
        "in domain 'only'",
        "natural partition: 2 val and 2 test samples of domain 'only' belong to no client's group"]
    text = p.describe()
    assert all(note in text for note in p.notes)
    with pytest.raises(UserError, match="min_samples=7 leaves no client"):
        make_partition(ds, {"kind": "natural", "min_samples": 7}, seed=0)


def test_a_dataset_without_groups_is_one_line():
    no_groups = ArraySplit(np.zeros((8, 1, 1, 1), np.uint8), np.arange(8) % 2, (0,), (1,))
    plain = MultiDomainDataset("plain", {"x": {s: no_groups for s in ("train", "val", "test")}}, ["0", "1"])
    with pytest.raises(UserError) as err:
        make_partition(plain, {"kind": "natural"}, 0)
    message = str(err.value)
    assert "natural needs per-sample group ids" in message and "'plain'" in message and "\n" not in message
    with pytest.raises(UserError, match="natural by='label': only 'group'"):
        make_partition(DS, {"kind": "natural", "by": "label"}, 0)


def test_own_val_test_needs_their_group_ids_shared_does_not():
    ds = MultiDomainDataset("half", {"x": {"train": split([1, 1, 2]),
                                           "val": ArraySplit(np.zeros((2, 1, 1, 1), np.uint8), [0, 1], (0,), (1,)),
                                           "test": split([2, 1])}}, ["0", "1", "2", "3"])
    with pytest.raises(UserError, match="domain 'x''s val split of 'half' has no group ids; set shared_test: true"):
        make_partition(ds, {"kind": "natural"}, 0)
    assert make_partition(ds, {"kind": "natural", "shared_test": True}, 0).shard(1).val.tolist() == [0, 1]
    one = MultiDomainDataset("one", {"x": {"train": split([4, 4]), "val": split([4, 6]), "test": split([6, 4, 4])}},
                             ["0", "1", "2", "3"])
    own = make_partition(one, {"kind": "natural"}, 0).shard(0)  # a domain's only client: still its own group's
    assert own.val.tolist() == [0] and own.test.tolist() == [1, 2]


def test_same_for_every_seed_and_travels_intact():
    p, q = make_partition(DS, {"kind": "natural"}, 0), make_partition(DS, {"kind": "natural"}, 5)
    back = pickle.loads(pickle.dumps(p))
    for c in range(p.num_clients):
        for which in ("train", "val", "test"):
            assert np.array_equal(getattr(p.shard(c), which), getattr(q.shard(c), which))
            assert np.array_equal(getattr(p.shard(c), which), getattr(back.shard(c), which))


def test_twenty_thousand_groups_build_in_well_under_a_second():
    rng = np.random.default_rng(0)
    n_groups = 20_000
    sizes = rng.integers(1, 30, n_groups)
    groups = np.repeat(rng.permutation(n_groups) * 7, sizes)[rng.permutation(sizes.sum())]
    test_groups = groups[rng.permutation(groups.size)[: groups.size // 5]]
    ds = MultiDomainDataset("femnist-like", {"w": {"train": split(groups), "val": split(test_groups[:1000]),
                                                   "test": split(test_groups)}}, ["0", "1", "2", "3"])
    t0 = time.perf_counter()
    p = make_partition(ds, {"kind": "natural", "min_samples": 5}, seed=0)
    counts = p.all_num_samples("train")
    last = p.shard(p.num_clients - 1)
    seconds = time.perf_counter() - t0
    print(f"\nnatural partition, {groups.size:,} samples in {n_groups:,} groups: {seconds * 1000:.0f} ms")
    assert seconds < 1.0, seconds
    kept = np.unique(groups)[np.bincount(np.unique(groups, return_inverse=True)[1]) >= 5]
    assert p.num_clients == kept.size and counts.min() >= 5 and counts.sum() == np.isin(groups, kept).sum()
    assert np.all(groups[last.train] == kept[-1]) and np.all(test_groups[last.test] == kept[-1])
    assert p.notes[0].startswith(f"natural partition: dropped {n_groups - kept.size:,} of {n_groups:,} groups (")


BAD = [  # (partition, what the one-line message says)
    ({"kind": "natural", "by": "writer"}, "'data.partition.by' = 'writer': expected 'group'"),
    ({"kind": "natural", "min_samples": 0}, "'data.partition.min_samples' = 0: expected at least 1"),
    ({"kind": "natural", "clients_per_domain": 3}, "unknown config key 'data.partition.clients_per_domain'"),
    ({"kind": "shard", "clients_per_domain": 4}, "kind shard needs num_shards_per_partition, shard_size or both"),
    ({"kind": "shard", "shard_size": 0}, "'data.partition.shard_size' = 0: expected at least 1"),
    ({"kind": "shard", "shard_size": 9, "keep_incomplete_shard": "yes"},
     "'data.partition.keep_incomplete_shard' = 'yes': expected bool"),
    ({"kind": "shard", "shard_size": 9, "partition_by": "writer"}, "'data.partition.partition_by' = 'writer'"),
    ({"kind": "shard", "shard_size": 9, "alpha": 1}, "unknown config key 'data.partition.alpha'"),
    ({"kind": "pathological", "clients_per_domain": 4}, "kind pathological needs num_classes_per_partition"),
    ({"kind": "pathological", "num_classes_per_partition": 2, "class_assignment_mode": "greedy"},
     "'data.partition.class_assignment_mode' = 'greedy': expected one of 'random', 'deterministic'"),
    ({"kind": "pathological", "num_classes_per_partition": 2, "clients_per_domain": [0, 0]}, "gives no clients"),
    ({"kind": "dirichlet", "alpha": 1, "min_size": 5, "self_balancing": True}, "do not mix; give one family"),
    ({"kind": "dirichlet", "alpha": 1, "self_balancing": "yes"}, "'data.partition.self_balancing' = 'yes'"),
    ({"kind": "dirichlet", "alpha": 1, "min_partition_size": -2}, "'data.partition.min_partition_size' = -2"),
]


@pytest.mark.parametrize("partition,message", BAD)
def test_a_bad_new_partition_key_is_one_line_naming_it(partition, message):
    with pytest.raises(UserError) as err:
        load_config(raw={"method": "fedavg", "data": {"dataset": "digits5", "partition": partition}})
    assert message in str(err.value) and "\n" not in str(err.value)
