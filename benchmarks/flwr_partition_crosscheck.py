"""Partitions made by Flower Datasets' own partitioners, for raysim's to be held to.

Run in the side venv (``python -m benchmarks.flwr_datasets_env`` builds it):

    benchmarks/.venv-flwrds/bin/python benchmarks/flwr_partition_crosscheck.py \
        --out tests/data/fixtures/flwr_partitions.json

It makes a fixed label array (1,200 labels over 10 classes of uneven sizes, from numpy with a
fixed seed; the array is written into the fixture, so the test never regenerates it), wraps it
as ``datasets.Dataset.from_dict({"label": ..., "idx": ...})`` (``idx``: each row's position, to
map ShardPartitioner's label-sorted rows back), runs IidPartitioner, DirichletPartitioner,
ShardPartitioner and PathologicalPartitioner for a few (parameters, seed), and writes every
partition as its sorted positions. ``tests/data/test_data_partition_flwr.py`` checks that
raysim's pure partition functions, handed ``np.random.default_rng(seed)``, give the same lists.
Needs only numpy, ``datasets`` and ``flwr_datasets``: raysim is not imported.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

import numpy as np

N_LABELS, N_CLASSES, LABEL_SEED = 1200, 10, 20240
# (partitioner, parameters, seed): flwr-datasets' own parameter names; partition_by is 'label'
CASES = [
    ("IidPartitioner", {"num_partitions": 7}, None),
    ("IidPartitioner", {"num_partitions": 1}, None),
    ("DirichletPartitioner", {"num_partitions": 10, "alpha": 0.5}, 42),
    ("DirichletPartitioner", {"num_partitions": 10, "alpha": 0.5, "shuffle": False}, 42),
    ("DirichletPartitioner", {"num_partitions": 5, "alpha": 0.1, "min_partition_size": 0,
                              "self_balancing": True}, 7),
    ("DirichletPartitioner", {"num_partitions": 20, "alpha": 1.0, "min_partition_size": 5,
                              "self_balancing": True}, 1),
    ("DirichletPartitioner", {"num_partitions": 8, "alpha": 0.3, "min_partition_size": 20}, 3),
    # redrawn: 5 draws before every partition has 30 (flwr stops after 11)
    ("DirichletPartitioner", {"num_partitions": 10, "alpha": 0.2, "min_partition_size": 30}, 1),
    ("DirichletPartitioner", {"num_partitions": 10, "alpha": 0.2, "min_partition_size": 30,
                              "self_balancing": True}, 7),
    ("ShardPartitioner", {"num_partitions": 10, "num_shards_per_partition": 2}, 42),
    ("ShardPartitioner", {"num_partitions": 10, "shard_size": 45}, 1),
    ("ShardPartitioner", {"num_partitions": 7, "shard_size": 45, "keep_incomplete_shard": True}, 2),
    ("ShardPartitioner", {"num_partitions": 7, "num_shards_per_partition": 3,
                          "keep_incomplete_shard": True}, 5),
    ("ShardPartitioner", {"num_partitions": 5, "num_shards_per_partition": 2, "shard_size": 60}, 9),
    ("PathologicalPartitioner", {"num_partitions": 10, "num_classes_per_partition": 2}, 42),
    ("PathologicalPartitioner", {"num_partitions": 12, "num_classes_per_partition": 3,
                                 "class_assignment_mode": "deterministic"}, 0),
    ("PathologicalPartitioner", {"num_partitions": 15, "num_classes_per_partition": 2,
                                 "class_assignment_mode": "first-deterministic"}, 3),
    ("PathologicalPartitioner", {"num_partitions": 4, "num_classes_per_partition": 2}, 0),
]


def make_labels() -> np.ndarray:
    """1,200 labels, class sizes uneven (shares 1:2:...:10 shuffled), order shuffled."""
    rng = np.random.default_rng(LABEL_SEED)
    shares = rng.permutation(np.arange(1, N_CLASSES + 1)) / np.arange(1, N_CLASSES + 1).sum()
    sizes = np.floor(shares * N_LABELS).astype(int)
    sizes[: N_LABELS - sizes.sum()] += 1
    return rng.permutation(np.repeat(np.arange(N_CLASSES), sizes))


def run_case(dataset, name: str, params: dict, seed) -> list[list[int]]:
    import flwr_datasets.partitioner as fp

    cls = getattr(fp, name)
    kwargs = dict(params)
    if name != "IidPartitioner":
        kwargs.update(partition_by="label", seed=seed)
    partitioner = cls(**kwargs)
    partitioner.dataset = dataset
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flwr warns on every Dirichlet redraw and on unused classes
        return [sorted(int(i) for i in partitioner.load_partition(j)["idx"])
                for j in range(partitioner.num_partitions)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                  "tests", "data", "fixtures", "flwr_partitions.json"))
    args = ap.parse_args(argv)
    try:
        import datasets
        from importlib.metadata import version
    except ImportError:
        print("run this in Flower Datasets' venv: python -m benchmarks.flwr_datasets_env builds it", file=sys.stderr)
        return 2
    labels = make_labels()
    ds = datasets.Dataset.from_dict({"label": labels.tolist(), "idx": list(range(labels.size))})
    cases = [{"partitioner": name, "params": params, "seed": seed, "partitions": run_case(ds, name, params, seed)}
             for name, params, seed in CASES]
    fixture = {"made_with": {p: version(p) for p in ("flwr-datasets", "datasets", "numpy")},
               "labels": labels.tolist(), "cases": cases}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(fixture, fh, separators=(",", ":"))
        fh.write("\n")
    print(f"{len(cases)} cases, {os.path.getsize(args.out):,} bytes -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
