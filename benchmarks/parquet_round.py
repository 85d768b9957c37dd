"""One round of a federation on a lazy Parquet dataset: which rows the engine decoded.

Runs a config (default: a natural partition of the dataset ``benchmarks/parquet_clients.py --dir``
wrote, 100 clients a round, 100 clients evaluated) in this process (``debug``: no Ray, so every
host's reads are counted here), counting every image the ``parquet`` dataset decodes, by (file,
row). Then compares them with the rows of the clients the metrics say trained (their train rows)
and were evaluated (their test rows): any other row decoded is printed as a leak.

    python benchmarks/parquet_round.py --root DIR [--out RUN_DIR]
"""
from __future__ import annotations

import argparse
import collections
import resource
import tempfile
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", required=True, help="the Parquet folder (benchmarks/parquet_clients.py --dir)")
    p.add_argument("--clients-per-round", type=int, default=100)
    p.add_argument("--out", help="run folder (default: a temporary one)")
    args = p.parse_args()

    import pandas as pd

    import raysim
    from raysim.app.experiment import run
    from raysim.data import arrow, load
    from raysim.data.partition import make_partition

    decoded: collections.Counter = collections.Counter()
    plain = arrow.ArrowSplit._decode

    def counting(self, value, file, row):
        decoded[(self.files.paths[file], row)] += 1
        return plain(self, value, file, row)

    arrow.ArrowSplit._decode = counting  # counts, decodes as ever
    options = {"split_by": "group", "image_size": 28, "normalize": "half"}  # as data.options below
    cfg = raysim.load_config(None, [
        "name=parquet_round", "method=fedavg", "rounds=1", "seed=0",
        f"clients_per_round={args.clients_per_round}", "data.dataset=parquet", f"data.root={args.root}",
        "data.options={split_by: group, image_size: 28, normalize: half}",
        "data.partition={kind: natural, by: group}", "model.name=small_cnn", "train.batch_size=8",
        "eval={every: 1, protocol: global, splits: [test], clients: 100, select: final}",
        "runtime.num_hosts=2"])
    out = args.out or tempfile.mkdtemp(prefix="parquet_round_")
    t0 = time.perf_counter()
    run(cfg, out, progress=False, debug=True)
    seconds = time.perf_counter() - t0

    ds = load("parquet", root=args.root, seed=0, **options)
    part = make_partition(ds, {"kind": "natural", "by": "group"}, 0)
    metrics = pd.read_parquet(f"{out}/metrics.parquet")
    trained = sorted(set(metrics[(metrics.split == "train") & (metrics.client >= 0)].client))
    evaluated = sorted(set(metrics[(metrics.split == "test") & (metrics.client >= 0)].client))

    def rows(cid: int, which: str) -> set:
        shard = part.shard(cid)
        split = ds.split(shard.domain, shard.split_name(which))
        pos = getattr(shard, which)
        return {(split.files.paths[int(f)], int(r)) for f, r in zip(split.file_index[pos], split.file_row[pos])}

    wanted = set().union(*(rows(c, "train") for c in trained), *(rows(c, "test") for c in evaluated))
    leaked = set(decoded) - wanted
    total = sum(len(s) for d in ds.domains for s in (ds.split(d, "train"), ds.split(d, "val"), ds.split(d, "test")))
    print(f"federation: {part.num_clients:,} clients, {total:,} rows; 1 round of {len(trained)} clients, "
          f"{len(evaluated)} clients evaluated, {seconds:.1f} s (in one process, 2 hosts)")
    print(f"rows decoded: {len(decoded):,} distinct ({sum(decoded.values()):,} decodes) for {len(wanted):,} rows of "
          f"those clients; rows of any other client decoded: {len(leaked)}")
    print(f"peak RSS of the process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    if leaked:
        raise SystemExit(f"{len(leaked)} rows of other clients were decoded, e.g. {sorted(leaked)[:3]}")


if __name__ == "__main__":
    main()
