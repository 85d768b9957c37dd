"""Numbers that must not move when the engine or the method contract is refactored.

Runs every registered method for three tiny rounds on digits5 (a checkpoint after round 2) and
writes, per method: every client's training loss and validation/test accuracy per round, and the
server's and clients' state tensors of the round-2 checkpoint. ``--compare A B`` then reports
which numbers differ: metrics must be identical; tensors are listed with their max |difference|.

    python benchmarks/method_fingerprint.py --out before.pt          # on the old code
    python benchmarks/method_fingerprint.py --out after.pt           # on the new code
    python benchmarks/method_fingerprint.py --compare before.pt after.pt

It uses only ``load_config``, ``experiment.run`` and the run directory, which both sides share.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

TINY = {
    "rounds": 3, "seed": 5,
    "data": {"dataset": "digits5", "options": {"image_size": 16},
             "partition": {"kind": "per_domain", "train_size": 40}},
    "model": {"name": "small_cnn", "norm": "bn"},
    "train": {"epochs": 2, "batch_size": 16, "lr": 0.05, "momentum": 0.5, "grad_clip": 10.0},
    "eval": {"every": 1, "splits": ["val", "test"]},
    "runtime": {"num_hosts": 2, "cpus_per_host": 1, "parallel_federations": 1},
    "checkpoint": {"every": 2, "keep": 1},
    "hp": {"csac": {"stage1_epochs": 1}},
}


def fingerprint(out: str, methods: list[str] | None = None) -> None:
    from raysim.config import load_config
    from raysim.app.experiment import run
    from raysim.methods import registry
    from raysim.engine.metrics import read

    names = methods or registry.names()
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        # a method that runs buffered by default (fedbuff, fedasync) needs the clock's device levels
        clocked = {"clients": {"profiles": {"levels": [{"name": "fast", "flops": 2.0e9}, {"name": "slow", "flops": 0.5e9}],
                                            "assign": "round_robin"}}}
        buffered = {n: clocked for n in names if registry.get(n).schedule == "buffered"}
        cfg = load_config(raw={**TINY, "methods": names, "per_method": buffered})
        run(cfg, out=tmp, progress=False)
        for name in names:
            d = os.path.join(tmp, name) if len(names) > 1 else tmp
            df = read(os.path.join(d, "metrics.parquet"))
            rows = df[(df.client >= 0) & (((df.split == "train") & (df.metric == "loss"))
                                          | (df.split.isin(["val", "test"]) & (df.metric == "accuracy")))]
            ckpt = os.path.join(d, "checkpoints", "round-000002")
            result[name] = {
                "metrics": {(int(r), int(c), s, m): float(v) for r, c, s, m, v in
                            zip(rows["round"], rows.client, rows.split, rows.metric, rows.value)},
                "server": torch.load(os.path.join(ckpt, "server.pt"), weights_only=True),
                "clients": torch.load(os.path.join(ckpt, "clients.pt"), weights_only=True),
            }
    torch.save(result, out)
    print(f"{len(names)} methods -> {out}")


def _tensors(tree, prefix=""):
    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from _tensors(v, f"{prefix}/{k}")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _tensors(v, f"{prefix}/{i}")


def _method_states(clients: dict) -> dict:
    """Each client's method state: since checkpoint format 2 the engine stores a record
    ``{"state": ..., ["trained": ...]}`` around it."""
    return {c: r["state"] if isinstance(r, dict) and "state" in r and set(r) <= {"state", "trained"} else r
            for c, r in clients.items()}


def compare(a_path: str, b_path: str) -> int:
    a, b = (torch.load(p, weights_only=True) for p in (a_path, b_path))
    bad = 0
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            print(f"{name}: only in {'the first' if name in a else 'the second'} file")
            continue
        ma, mb = a[name]["metrics"], b[name]["metrics"]
        diff = [k for k in ma if ma[k] != mb.get(k)] + [k for k in mb if k not in ma]
        worst = max((abs(ma[k] - mb[k]) for k in diff if k in ma and k in mb), default=0.0)
        print(f"{name}: {len(ma)} metric values, {len(diff)} differ (max |diff| {worst:.3g})")
        bad += bool(diff)
        for part in ("server", "clients"):
            ta = {k: v for k, v in _tensors(_method_states(a[name][part]) if part == "clients" else a[name][part])}
            tb = {k: v for k, v in _tensors(_method_states(b[name][part]) if part == "clients" else b[name][part])}
            print(f"  {part}: {len(set(ta) & set(tb))} tensors compared")
            for k in sorted(set(ta) & set(tb)):
                x, y = ta[k], tb[k]
                if x.shape != y.shape or x.dtype != y.dtype:
                    print(f"  {part}{k}: shape/dtype {tuple(x.shape)} {x.dtype} vs {tuple(y.shape)} {y.dtype}")
                elif not torch.equal(x, y):
                    d = (x.double() - y.double()).abs().max().item()
                    print(f"  {part}{k}: max |diff| {d:.3g}")
            only = sorted(set(ta) ^ set(tb))
            if only:
                print(f"  {part}: {len(only)} tensors in one file only, e.g. {only[:3]}")
    return 1 if bad else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out")
    p.add_argument("--methods", nargs="*")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"))
    ns = p.parse_args(argv)
    if ns.compare:
        return compare(*ns.compare)
    fingerprint(ns.out or "fingerprint.pt", ns.methods)
    return 0


if __name__ == "__main__":
    sys.exit(main())
