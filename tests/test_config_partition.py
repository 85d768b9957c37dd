"""data.partition is typed per kind (raysim.core.partition_spec): a wrong key or value is a one-line
error when the config is loaded (and so from `raysim run --check`), while the config keeps the
mapping as written; a partition larger than the data is one line from `--check` too, before any
training (raysim.app.preflight); the declared defaults are the ones make_partition uses; no run
reads `paper`."""
import ast
import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest
import yaml

from raysim.config import dump_yaml, load_config
from raysim.core.errors import UserError
from raysim.core.partition_spec import HOLDOUT_KEYS, KINDS, SPECS, partition_spec
from raysim.data.partition import make_partition
from raysim.data.splits import ArraySplit, MultiDomainDataset
from raysim.engine.datashards import fingerprint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the fewest keys each kind needs (dirichlet: with clients enough for its defaults to matter)
MINIMAL = {
    "per_domain": {"kind": "per_domain"},
    "dirichlet": {"kind": "dirichlet", "alpha": 1, "clients_per_domain": 4},
    "cross_device": {"kind": "cross_device", "num_clients": 12},
    "natural": {"kind": "natural"},
    "shard": {"kind": "shard", "clients_per_domain": 4, "num_shards_per_partition": 2},
    "pathological": {"kind": "pathological", "clients_per_domain": 4, "num_classes_per_partition": 2},
}


def config(partition) -> dict:
    return {"method": "fedavg", "data": {"dataset": "digits5", "partition": partition}}


BAD = [  # (partition, what the message says)
    ({"kind": "iid"}, "'data.partition.kind' = 'iid': expected one of per_domain, dirichlet, cross_device"),
    ({"train_size": 10}, "'data.partition' must be a mapping with a 'kind'"),
    ({"kind": "per_domain", "alpha": 0.5}, "unknown config key 'data.partition.alpha'"),
    ({"kind": "per_domain", "train_size": "many"}, "'data.partition.train_size' = 'many': expected int"),
    ({"kind": "per_domain", "train_size": 0}, "'data.partition.train_size' = 0: expected at least 1"),
    ({"kind": "per_domain", "fraction": 1.5}, "'data.partition.fraction' = 1.5: expected a number in (0, 1]"),
    ({"kind": "per_domain", "fraction": 0.1, "train_size": 10}, "give fraction or train_size, not both"),
    ({"kind": "per_domain", "num_clients": 10}, "num_clients only with assign: random"),
    ({"kind": "per_domain", "assign": "random"}, "assign: random needs num_clients"),
    ({"kind": "per_domain", "assign": "greedy", "num_clients": 9}, "'data.partition.assign' = 'greedy'"),
    ({"kind": "per_domain", "clients_per_domain": {"mnist": -1}}, "'data.partition.clients_per_domain'"),
    ({"kind": "per_domain", "clients_per_domain": [0, 0]}, "gives no clients"),
    ({"kind": "per_domain", "domains": []}, "'data.partition.domains' = []"),
    ({"kind": "per_domain", "domains": ["mnist", "mnist"]}, "distinct domain names"),
    ({"kind": "per_domain", "shuffle": "yes"}, "'data.partition.shuffle' = 'yes': expected bool"),
    ({"kind": "per_domain", "target_test": "val"}, "'data.partition.target_test' = 'val'"),
    ({"kind": "dirichlet", "clients_per_domain": 4}, "kind dirichlet needs alpha"),
    ({"kind": "dirichlet", "alpha": 0}, "'data.partition.alpha' = 0.0: expected a positive number"),
    ({"kind": "dirichlet", "alpha": 1, "min_size": -1}, "'data.partition.min_size' = -1"),
    ({"kind": "cross_device"}, "kind cross_device needs num_clients"),
    ({"kind": "cross_device", "num_clients": 9, "spread": "wide"}, "'data.partition.spread' = 'wide'"),
]


@pytest.mark.parametrize("partition,message", BAD)
def test_a_bad_partition_is_one_line_at_load(partition, message):
    with pytest.raises(UserError) as err:
        load_config(raw=config(partition))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_per_method_partition_is_checked_too():
    raw = {**config({"kind": "per_domain"}), "methods": ["fedavg", "fedbn"], "method": None,
           "per_method": {"fedbn": {"data": {"partition": {"kind": "per_domain", "fraction": 2}}}}}
    with pytest.raises(UserError, match=r"in per_method.fedbn: config key 'data.partition.fraction' = 2"):
        load_config(raw=raw)


@pytest.mark.parametrize("override,message", [
    ("data.partition.alpha=0.5", "unknown config key 'data.partition.alpha'"),
    ("data.partition.train_size=-3", "'data.partition.train_size' = -3: expected at least 1"),
])
def test_run_check_reports_a_bad_partition_in_one_line(override, message):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "raysim", "run", "--check",
                           os.path.join(ROOT, "configs", "quickstart.yaml"), override],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr


TOO_BIG = {  # per kind, a partition rotated_mnist's ~660 training images per domain cannot hold
    "per_domain": ({"kind": "per_domain", "clients_per_domain": 4, "train_size": 200},
                   "partition: 4 clients x 200 train images exceed domain '0''s "),
    "dirichlet": ({"kind": "dirichlet", "alpha": 1, "clients_per_domain": 10, "min_size": 100},
                  "partition: 10 clients x min_size 100 exceed domain '0''s "),
    "cross_device": ({"kind": "cross_device", "num_clients": 12, "samples_per_client": 400},
                     "partition: 2 clients x 400 samples exceed domain '0''s "),
    # (rotated_mnist has no per-sample group ids: the natural partition cannot be made at all)
    "natural": ({"kind": "natural"}, "partition: natural needs per-sample group ids"),
    "shard": ({"kind": "shard", "clients_per_domain": 10, "num_shards_per_partition": 2, "shard_size": 40},
              "partition: shard: 10 clients x 2 shards of 40 need 800 train images; domain '0' has "),
    "pathological": ({"kind": "pathological", "clients_per_domain": 1000, "num_classes_per_partition": 2},
                     "partition: 1000 clients exceed domain '0''s "),
}


@pytest.mark.parametrize("kind", KINDS)
def test_a_partition_larger_than_the_data_is_one_line_before_training(kind):
    from raysim.app.configs import load_checked
    from raysim.app.preflight import preflight

    partition, message = TOO_BIG[kind]
    cfg = load_checked(raw={"method": "fedavg", "data": {"dataset": "rotated_mnist", "partition": partition}})
    with pytest.raises(UserError) as err:
        preflight(cfg, own_ray=False)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


@pytest.mark.parametrize("kind", KINDS)
def test_each_kinds_defaults_round_trip(kind, tmp_path):
    spec = partition_spec(MINIMAL[kind])
    assert type(spec) is SPECS[kind] and spec.kind == kind
    # the typed spec, written out in full, reads back as itself
    assert partition_spec(dataclasses.asdict(spec)) == spec
    # the config keeps the mapping as written (no defaults filled in, 1 stays an int), and its
    # config.yaml reads back to the same config
    cfg = load_config(raw=config(MINIMAL[kind]))
    assert cfg.data.partition == MINIMAL[kind]
    assert [type(v) for v in cfg.data.partition.values()] == [type(v) for v in MINIMAL[kind].values()]
    assert fingerprint(cfg)["partition"] == MINIMAL[kind]  # what data shards were cut for
    dump_yaml(cfg, tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert again.to_dict() == cfg.to_dict()
    dump_yaml(again, tmp_path / "again.yaml")
    assert (tmp_path / "again.yaml").read_bytes() == (tmp_path / "config.yaml").read_bytes()


def tiny_dataset() -> MultiDomainDataset:
    rng = np.random.default_rng(0)
    splits = {}
    for d, sizes in {"a": (120, 20, 30), "b": (80, 10, 20)}.items():
        splits[d] = {s: ArraySplit(np.zeros((n, 1, 2, 2), np.uint8), rng.permutation(np.arange(n) % 4), (0,), (1,),
                                   groups=np.arange(n) % 5)  # (writers, for the natural partition)
                     for s, n in zip(("train", "val", "test"), sizes)}
    return MultiDomainDataset("tiny", splits, ["0", "1", "2", "3"])


@pytest.mark.parametrize("kind", KINDS)
def test_the_declared_defaults_are_the_partitions(kind):
    """Every key spelled out at its declared default builds the same partition as the fewest keys."""
    ds = tiny_dataset()
    full = {k: v for k, v in dataclasses.asdict(partition_spec(MINIMAL[kind])).items() if k not in HOLDOUT_KEYS}
    p, q = make_partition(ds, MINIMAL[kind], seed=3), make_partition(ds, full, seed=3)
    assert p.num_clients == q.num_clients > 0
    for c in range(p.num_clients):
        a, b = p.shard(c), q.shard(c)
        assert a.domain == b.domain
        assert all(np.array_equal(getattr(a, s), getattr(b, s)) for s in ("train", "val", "test"))


def test_no_engine_module_reads_the_report_only_paper_section():
    engine = os.path.join(ROOT, "raysim", "engine")
    readers = []
    for name in sorted(os.listdir(engine)):
        if name.endswith(".py"):
            with open(os.path.join(engine, name), encoding="utf-8") as fh:
                tree = ast.parse(fh.read())
            readers += [f"{name}:{n.lineno}" for n in ast.walk(tree)
                        if isinstance(n, ast.Attribute) and n.attr == "paper"]
    assert readers == []
