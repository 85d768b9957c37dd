"""What idle client state really costs in a host's memory: N FedBN states (the BN tensors of
``small_cnn``) put into raysim's ClientStateStore, RSS growth against the state's bytes.

    python benchmarks/store_mem.py 100000 OUT_DIR
"""
from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
import time


def rss() -> int:
    with open("/proc/self/statm", "rb") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(n: int) -> dict:
    import torch

    from raysim.core.tensors import bn_keys
    from raysim.models import build
    from raysim.engine.store import ClientStateStore

    model = build("small_cnn", num_classes=10, in_channels=3, input_size=32, norm="bn")
    keys = bn_keys(model)
    personal = {k: v.detach().clone() for k, v in model.state_dict().items() if k in keys}
    with tempfile.TemporaryDirectory() as spill:
        store = ClientStateStore(1e15, spill)  # no spilling: everything stays in memory
        gc.collect()
        before = rss()
        t0 = time.perf_counter()
        for c in range(n):
            store.put(c, {"personal": {k: v + c for k, v in personal.items()}})
        put_s = time.perf_counter() - t0
        gc.collect()
        grown = rss() - before
        t0 = time.perf_counter()
        for c in range(0, n, max(1, n // 1000)):
            store.get(c)
        get_us = (time.perf_counter() - t0) / len(range(0, n, max(1, n // 1000))) * 1e6
    return {"clients": n, "state_bytes": store.bytes_in_memory, "rss_growth": grown,
            "ratio": grown / store.bytes_in_memory, "put_us": put_s / n * 1e6, "get_us": get_us,
            "tensors_per_client": len(personal)}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    n, out = int(argv[0]), argv[1]
    os.makedirs(out, exist_ok=True)
    res = measure(n)
    with open(os.path.join(out, "result.json"), "w", encoding="utf-8") as fh:
        json.dump(res, fh)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
