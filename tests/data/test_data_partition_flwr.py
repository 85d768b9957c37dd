"""raysim's Flower Datasets partitioners against flwr-datasets itself.

tests/data/fixtures/flwr_partitions.json holds partitions flwr-datasets 0.6.1 made
(benchmarks/flwr_partition_crosscheck.py, run in its side venv): IidPartitioner,
DirichletPartitioner (with and without self_balancing, one case redrawn 5 times for its
min_partition_size), ShardPartitioner (every way of sizing shards) and PathologicalPartitioner
(each class_assignment_mode, one leaving classes out). Every case is reproduced EXACTLY, sample
for sample, by raysim's pure functions handed ``np.random.default_rng(seed)`` as flwr seeds
itself; no case falls back to comparing label statistics. The config kinds then apply the same
functions within each domain with raysim's keyed generators."""
import json
import os
import subprocess

import numpy as np
import pytest

from raysim.core.errors import UserError
from raysim.data.partition import (_rng, flwr_dirichlet_partitions, iid_partitions, make_partition,
                                   pathological_partitions, shard_partitions)
from raysim.data.splits import ArraySplit, MultiDomainDataset

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
FIXTURE = os.path.join(HERE, "fixtures", "flwr_partitions.json")

with open(FIXTURE, encoding="utf-8") as fh:
    FLWR = json.load(fh)
LABELS = np.asarray(FLWR["labels"], np.int64)


def raysim_partitions(labels, name: str, params: dict, seed) -> list[np.ndarray]:
    """raysim's function for flwr's partitioner ``name`` and its parameters (flwr's names)."""
    params = dict(params)
    k = params.pop("num_partitions")
    params.pop("shuffle", None)  # reorders inside a partition only
    rng = np.random.default_rng(seed)
    if name == "IidPartitioner":
        return iid_partitions(labels.size, k)
    function = {"DirichletPartitioner": flwr_dirichlet_partitions, "ShardPartitioner": shard_partitions,
                "PathologicalPartitioner": pathological_partitions}[name]
    return function(labels, k, rng=rng, **params)


def case_id(case) -> str:
    return f"{case['partitioner']}-{'-'.join(f'{k}={v}' for k, v in case['params'].items())}-seed{case['seed']}"


@pytest.mark.parametrize("case", FLWR["cases"], ids=case_id)
def test_raysim_reproduces_flwr_datasets_exactly(case):
    got = raysim_partitions(LABELS, case["partitioner"], case["params"], case["seed"])
    assert [g.tolist() for g in got] == case["partitions"]


def test_the_fixture_covers_every_partitioner_and_mode():
    cases = FLWR["cases"]
    assert {c["partitioner"] for c in cases} == {"IidPartitioner", "DirichletPartitioner", "ShardPartitioner",
                                                   "PathologicalPartitioner"}
    modes = {c["params"].get("class_assignment_mode", "random") for c in cases
             if c["partitioner"] == "PathologicalPartitioner"}
    assert modes == {"random", "deterministic", "first-deterministic"}
    assert os.path.getsize(FIXTURE) < 200_000


def toy(domains=("a", "b"), n=600, classes=10, seed=0) -> MultiDomainDataset:
    rng = np.random.default_rng(seed)
    splits = {d: {s: ArraySplit(np.zeros((m, 1, 1, 1), np.uint8), rng.permutation(np.arange(m) % classes), (0,), (1,))
                  for s, m in zip(("train", "val", "test"), (n, n // 10, n // 5))} for d in domains}
    return MultiDomainDataset("toy", splits, [str(c) for c in range(classes)])


DS = toy()


@pytest.mark.parametrize("spec,function,purpose", [
    ({"kind": "shard", "clients_per_domain": 5, "num_shards_per_partition": 2},
     lambda y, k, rng: shard_partitions(y, k, num_shards_per_partition=2, rng=rng), "partition/shard"),
    ({"kind": "pathological", "clients_per_domain": 6, "num_classes_per_partition": 3},
     lambda y, k, rng: pathological_partitions(y, k, num_classes_per_partition=3, rng=rng), "partition/pathological"),
    ({"kind": "dirichlet", "clients_per_domain": 4, "alpha": 0.5, "self_balancing": True},
     lambda y, k, rng: flwr_dirichlet_partitions(y, k, alpha=0.5, self_balancing=True, rng=rng),
     "partition/flwr_dirichlet"),
])
def test_each_domain_gets_the_function_with_its_own_generator(spec, function, purpose):
    p = make_partition(DS, spec, seed=3)
    for d in DS.domains:
        clients = p.clients(d)
        expected = function(DS.split(d, "train").labels, len(clients), _rng(3, purpose, d))
        assert [p.shard(c).train.tolist() for c in clients] == [e.tolist() for e in expected]
    assert p.shard(0).val.size and p.num_samples(0, "test") > 0  # val/test dealt as dirichlet's are


def test_flwr_keys_select_flwrs_draw_and_the_families_do_not_mix():
    easyfl = make_partition(DS, {"kind": "dirichlet", "clients_per_domain": 4, "alpha": 0.5}, 0)
    flwr = make_partition(DS, {"kind": "dirichlet", "clients_per_domain": 4, "alpha": 0.5,
                               "min_partition_size": 10}, 0)
    assert any(not np.array_equal(easyfl.shard(c).train, flwr.shard(c).train) for c in range(8))
    with pytest.raises(UserError, match=r"min_size \(EasyFL/FedLab's draw\) and self_balancing .* do not mix"):
        make_partition(DS, {"kind": "dirichlet", "clients_per_domain": 4, "alpha": 0.5, "min_size": 5,
                            "self_balancing": False}, 0)
    with pytest.raises(UserError, match="partition_by='writer': raysim partitions by 'label' only"):
        make_partition(DS, {"kind": "shard", "clients_per_domain": 2, "shard_size": 10, "partition_by": "writer"}, 0)


def test_shard_partitions_are_disjoint_cover_and_few_classes():
    y = LABELS
    every = shard_partitions(y, 7, shard_size=45, keep_incomplete_shard=True, rng=np.random.default_rng(0))
    assert sorted(np.concatenate(every).tolist()) == list(range(y.size))  # every shard dealt: a cover
    two = shard_partitions(y, 10, num_shards_per_partition=2, rng=np.random.default_rng(0))
    flat = np.concatenate(two)
    assert np.unique(flat).size == flat.size == 10 * 2 * (y.size // 20)  # disjoint, equal shards
    # a shard of label-sorted data spans at most a few classes; two shards about twice that
    assert max(np.unique(y[x]).size for x in two) <= 6
    with pytest.raises(UserError, match="shard: 10 clients x 2 shards of 100 need 2000 train images; the split has"):
        shard_partitions(y, 10, num_shards_per_partition=2, shard_size=100, rng=np.random.default_rng(0))
    with pytest.raises(UserError, match="make 5 shards of 240, fewer than the 6 clients"):
        shard_partitions(y, 6, shard_size=240, rng=np.random.default_rng(0))


@pytest.mark.parametrize("mode", ["random", "deterministic", "first-deterministic"])
def test_pathological_partitions_hold_exactly_their_classes(mode):
    y = LABELS
    parts = pathological_partitions(y, 12, num_classes_per_partition=3, class_assignment_mode=mode,
                                    rng=np.random.default_rng(5))
    flat = np.concatenate(parts)
    assert np.unique(flat).size == flat.size  # disjoint
    assert all(np.unique(y[x]).size == 3 for x in parts)
    used = np.unique(y[flat])
    assert sorted(flat.tolist()) == np.flatnonzero(np.isin(y, used)).tolist()  # a used class: all of it
    with pytest.raises(UserError, match="num_classes_per_partition=11: expected 1..10"):
        pathological_partitions(y, 4, num_classes_per_partition=11, rng=np.random.default_rng(0))


def test_a_class_given_to_no_client_is_noted():
    p = make_partition(DS, {"kind": "pathological", "clients_per_domain": 2, "num_classes_per_partition": 2,
                            "class_assignment_mode": "deterministic", "domains": ["a"]}, 0)
    # client 0 holds classes 0 and 1, client 1 classes 1 and 2
    assert p.notes == ["pathological partition: classes [3, 4, 5, 6, 7, 8, 9] of domain 'a' go to no client "
                       "(420 train samples unused)"]
    assert p.notes[0] in p.describe()


@pytest.mark.slow
def test_the_fixture_is_what_flwr_datasets_makes_now(tmp_path):
    """Regenerates the fixture in the side venv (benchmarks/.venv-flwrds, built by
    ``python -m benchmarks.flwr_datasets_env``) and finds it unchanged."""
    from benchmarks import flwr_datasets_env

    py = flwr_datasets_env.python()
    if not os.path.exists(py):
        pytest.skip("no Flower Datasets venv (python -m benchmarks.flwr_datasets_env builds it)")
    out = tmp_path / "flwr.json"
    subprocess.run([py, os.path.join(REPO, "benchmarks", "flwr_partition_crosscheck.py"), "--out", str(out)],
                   check=True, capture_output=True, text=True, timeout=600)
    fresh = json.loads(out.read_text())
    assert fresh["labels"] == FLWR["labels"]
    for new, old in zip(fresh["cases"], FLWR["cases"], strict=True):
        assert new == old, case_id(old)
        got = raysim_partitions(LABELS, new["partitioner"], new["params"], new["seed"])
        assert [g.tolist() for g in got] == new["partitions"]
