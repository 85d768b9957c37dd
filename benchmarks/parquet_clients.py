"""What the lazy ``parquet`` dataset reads for a few clients of a large federation.

Writes a Parquet dataset of CLIENTS writers (default 10,000), PER_CLIENT 28x28 grey PNG images
each (default 8), rows sorted by writer, ROW_GROUP rows per row group (default 64); then, in a
fresh process (so writing leaves no trace in its memory), opens it with
``load("parquet", split_by="group")`` and reads the training data of READ random clients
(default 100) as a natural one-client-per-writer partition gives it (the train positions of each
writer, computed here with numpy from the split's groups). Prints rows decoded against the rows
of those clients, row groups read of the file's total, the reading process's peak RSS
(``resource.getrusage``) against its peak before opening (after a warm-up on the file's first row
group, so library code and one-time set-up are not counted) and against the file's size, the peak
of Arrow's memory pool (what Arrow itself ever held), and the open and read times.

    python benchmarks/parquet_clients.py [--clients 10000] [--per-client 8] [--row-group 64]
                                         [--read 100] [--dir DIR] [--json OUT.json]
"""
from __future__ import annotations

import argparse
import io
import json
import os
import resource
import subprocess
import sys
import tempfile
import time


def peak_rss() -> int:
    """This process's peak resident set size in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def write(path: str, clients: int, per_client: int, row_group: int, seed: int = 0) -> None:
    """One Parquet file: image (PNG bytes), label (0..9), writer_id; sorted by writer."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    rng = np.random.default_rng(seed)
    schema = pa.schema([("image", pa.binary()), ("label", pa.int64()), ("writer_id", pa.int64())])
    block = max(1, 4096 // per_client)  # clients per write: bounded memory while writing
    with pq.ParquetWriter(path, schema) as w:
        for first in range(0, clients, block):
            ids = np.arange(first, min(first + block, clients))
            n = ids.size * per_client
            pixels = rng.integers(0, 64, (n, 28, 28), dtype=np.uint8)  # faint noise: PNGs of ~0.6 KB
            pixels[:, 8:20, 8:20] += 128
            images = []
            for k in range(n):
                buf = io.BytesIO()
                Image.fromarray(pixels[k], "L").save(buf, "PNG")
                images.append(buf.getvalue())
            table = pa.table({"image": images, "label": rng.integers(0, 10, n),
                              "writer_id": np.repeat(ids, per_client)}, schema=schema)
            w.write_table(table, row_group_size=row_group)


def measure(path: str, read: int, seed: int = 0) -> dict:
    """Open ``path`` lazily and read ``read`` random clients' training data (this process only)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raysim.data import load

    # warm up on the file's first row group alone: code paged in and one-time set-up are not data
    with tempfile.TemporaryDirectory() as tmp:
        pq.write_table(pq.ParquetFile(path).read_row_group(0), os.path.join(tmp, "w.parquet"))
        warm = load("parquet", root=os.path.join(tmp, "w.parquet"), image_size=28, split_by="group")
        warm.split("w", "train").tensors([0])
        del warm
    pool = pa.default_memory_pool()
    pool.release_unused()
    pool_before = pool.max_memory()
    before = peak_rss()
    t0 = time.perf_counter()
    ds = load("parquet", root=path, seed=seed, image_size=28, normalize="none", split_by="group")
    open_s = time.perf_counter() - t0
    after_open = peak_rss()
    (domain,) = ds.domains
    train = ds.split(domain, "train")
    # the natural partition: client k = writer k's train positions
    order = np.argsort(train.groups, kind="stable")
    starts = np.searchsorted(train.groups[order], np.arange(len(ds.group_names) + 1))
    chosen = np.random.default_rng(seed).choice(len(ds.group_names), size=min(read, len(ds.group_names)),
                                                replace=False)
    t0 = time.perf_counter()
    rows = 0
    for c in chosen:
        positions = np.sort(order[starts[c]:starts[c + 1]])
        x, _ = train.tensors(positions)
        rows += x.shape[0]
    read_s = time.perf_counter() - t0
    return {"file_bytes": os.path.getsize(path), "rows_in_file": int(sum(ds.sizes()[domain].values())),
            "clients": len(ds.group_names), "clients_read": int(chosen.size), "rows_of_clients": rows,
            "rows_decoded": train.rows_decoded, "row_groups_read": int(sum(train.chunk_reads.values())),
            "distinct_row_groups_read": len(train.chunk_reads), "row_groups_total": ds.info["chunks"],
            "rss_before_open": before, "peak_rss_after_open": after_open, "peak_rss": peak_rss(),
            "open_s": open_s, "read_s": read_s, "arrow_pool_peak": pool.max_memory(),
            "arrow_pool_peak_before": pool_before,
            "pickled_train_split_bytes": len(__import__("pickle").dumps(train))}


def measure_eager(path: str) -> dict:
    """For reference: the peak RSS growth of reading the whole file into one table (this process only)."""
    import pyarrow.parquet as pq

    with tempfile.TemporaryDirectory() as tmp:  # the same warm-up as measure()'s
        pq.write_table(pq.ParquetFile(path).read_row_group(0), os.path.join(tmp, "w.parquet"))
        pq.read_table(os.path.join(tmp, "w.parquet"))
    before = peak_rss()
    t0 = time.perf_counter()
    table = pq.read_table(path)
    return {"eager_read_s": time.perf_counter() - t0, "eager_rss_growth": peak_rss() - before,
            "eager_table_bytes": table.nbytes}


def report(r: dict) -> str:
    mb = lambda b: f"{b / 2**20:.1f} MiB"
    return "\n".join([
        f"file: {r['rows_in_file']:,} rows of {r['clients']:,} clients, {mb(r['file_bytes'])}, "
        f"{r['row_groups_total']:,} row groups",
        f"open: {r['open_s']:.2f} s",
        f"read {r['clients_read']} clients' train data: {r['read_s']:.2f} s",
        f"rows decoded: {r['rows_decoded']:,} for {r['rows_of_clients']:,} rows of those clients",
        f"row groups read: {r['row_groups_read']:,} ({r['distinct_row_groups_read']:,} distinct) "
        f"of {r['row_groups_total']:,} ({100 * r['distinct_row_groups_read'] / r['row_groups_total']:.1f}%)",
        f"peak RSS: {mb(r['peak_rss'])} (before opening {mb(r['rss_before_open'])}, after opening "
        f"{mb(r['peak_rss_after_open'])}; growth {mb(r['peak_rss'] - r['rss_before_open'])} "
        f"against a {mb(r['file_bytes'])} file)",
        f"peak of Arrow's memory pool: {mb(r['arrow_pool_peak'])} (after the warm-up "
        f"{mb(r['arrow_pool_peak_before'])})",
        f"for reference, reading the whole file into a table: {r['eager_read_s']:.2f} s, peak RSS growth "
        f"{mb(r['eager_rss_growth'])} (the table {mb(r['eager_table_bytes'])})",
        f"a pickled train split (what an actor is sent): {r['pickled_train_split_bytes'] / 1024:.0f} KiB",
    ])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=10_000)
    p.add_argument("--per-client", type=int, default=8)
    p.add_argument("--row-group", type=int, default=64)
    p.add_argument("--read", type=int, default=100)
    p.add_argument("--dir", help="folder for the dataset (kept; default: a temporary folder)")
    p.add_argument("--json", help="also write the numbers to this JSON file")
    p.add_argument("--measure", help=argparse.SUPPRESS)  # a child: measure this file
    p.add_argument("--eager", action="store_true", help=argparse.SUPPRESS)  # ... reading it whole
    ns = p.parse_args(argv)
    if ns.measure:
        print(json.dumps(measure_eager(ns.measure) if ns.eager else measure(ns.measure, ns.read)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        folder = ns.dir or tmp
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"writers-{ns.clients}x{ns.per_client}-rg{ns.row_group}.parquet")
        if not os.path.exists(path):
            t0 = time.perf_counter()
            write(path + ".tmp", ns.clients, ns.per_client, ns.row_group)
            os.replace(path + ".tmp", path)
            print(f"wrote {path} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.environ.get("PYTHONPATH", "")])}
        result = {}
        for extra in ([], ["--eager"]):  # each in a fresh process: its peak RSS is its own
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--measure", path, "--read",
                                  str(ns.read)] + extra, check=True, capture_output=True, text=True, env=env)
            result.update(json.loads(out.stdout.strip().splitlines()[-1]))
    result.update(per_client=ns.per_client, row_group=ns.row_group)
    print(report(result))
    if ns.json:
        with open(ns.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
