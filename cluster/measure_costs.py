"""Per-client costs the 1M-client plan in cluster/README.md extrapolates from.

    .venv/bin/python cluster/measure_costs.py [--clients 64] [--json costs.json]

Runs raysim's own code in one process (one torch thread, as a host with cpus_per_host=1 runs):
a ClientHost and a Server built from a config (no Ray actors, so nothing but the work itself is
timed), on workload C's shape: digits5 at 3x32x32, small_cnn with BN, cross-device clients of
64 training images, batch 32, one local epoch (2 steps). For FedBN and FDSE it measures

* the persistent state a client keeps between rounds (bytes in memory, bytes as torch.save
  writes them) and what it uploads;
* the local step per client (round 2, so FDSE's regularizer is on), and per SGD step;
* the host-side partial sum per upload (weighted-mean methods) and the server's aggregation
  for K uploads (FDSE: min-norm consensus + similarity mix, which grow with K);
* the server state FDSE keeps per client ever sampled (its personalised DSE mix);
* spilling: raysim.engine.store.ClientStateStore writing a state to disk and reading it back;
* Ray's object store: ray.put + ray.get of one host's round result (a local Ray, 1 CPU);
* data shards: reading one client's row group through pyarrow.fs (raysim.data.shards).

Times are the median (and min) of repeats, wall-clock, and CPU time of this process; on a
machine shared with other jobs the CPU time is the better estimate of the uncontended cost.
"""
from __future__ import annotations

import argparse
import atexit
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def config(method: str, num_clients: int):
    from raysim.config import load_config
    return load_config(raw={
        "method": method, "rounds": 2, "seed": 0,
        "data": {"dataset": "digits5", "partition": {"kind": "cross_device", "num_clients": num_clients,
                                                     "samples_per_client": 64, "overlap": True}},
        "model": {"name": "small_cnn", "norm": "bn"},
        "train": {"epochs": 1, "batch_size": 32, "lr": 0.01},
        "runtime": {"num_hosts": 1, "cpus_per_host": 1, "torch_threads": 1},
    })


def scratch(prefix: str) -> str:
    """A temporary folder removed when the script ends."""
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, True)
    return path


def timed(fn, repeat: int = 5):
    """(result, median wall s, min wall s, median cpu s) of ``fn()``."""
    walls, cpus, out = [], [], None
    for _ in range(repeat):
        w0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    return out, statistics.median(walls), min(walls), statistics.median(cpus)


def fmt_s(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s >= 1e-3 else f"{s * 1e6:.0f} us"


def measure_method(method: str, k: int, ray_ok: bool) -> dict:
    from raysim.core.aggregation import WeightedMean
    from raysim.core.contract import Upload
    from raysim.engine.host import ClientHost
    from raysim.core.tensors import tensors_nbytes
    from raysim.engine.server import Server
    from raysim.engine.store import ClientStateStore, Packed, state_nbytes, to_bytes

    cfg = config(method, num_clients=max(k, 10))
    torch.set_num_threads(1)
    server = Server(cfg)
    server.start()
    host = ClientHost(0, cfg, num_hosts=1, gpu_ids=[])  # all clients; gpu_ids given: no Ray needed
    host.start()
    torch.set_num_threads(1)
    m = server.method
    out = {"method": method, "clients": k}

    def one_round(rnd: int, timing: bool):
        payload = m.broadcast(server.state, rnd)
        personal = {c: m.client_payload(server.state, c, rnd) for c in range(k)}
        personal = {c: p for c, p in personal.items() if p is not None}
        results, per_client, per_client_cpu = [], [], []
        for c in range(k):
            w0, c0 = time.perf_counter(), time.process_time()
            r = host.train_round(rnd, [payload], [c], {c: personal[c]} if c in personal else None)
            per_client.append(time.perf_counter() - w0)
            per_client_cpu.append(time.process_time() - c0)
            results.append(r)
        if timing:
            out["train_client_s"] = statistics.median(per_client)
            out["train_client_cpu_s"] = statistics.median(per_client_cpu)
            out["train_client_min_s"] = min(per_client)
        return payload, personal, results

    one_round(1, timing=False)  # FDSE: no regularizer in round 1; warms every code path
    payload, personal, results = one_round(2, timing=True)
    out["steps_per_client"] = results[0].client_metrics[0].get("steps")
    out["train_step_cpu_s"] = out["train_client_cpu_s"] / max(out["steps_per_client"] or 1, 1)
    out["payload_bytes"] = tensors_nbytes(payload)
    out["personal_payload_bytes"] = tensors_nbytes(personal[0]) if personal else 0
    out["upload_bytes"] = results[0].bytes_up
    states = [st for _, st in host.store.items()]  # copies, as a checkpoint reads them
    out["state_bytes"] = statistics.median(state_nbytes(s) for s in states)
    packed = [st for st in host.store._mem.values() if isinstance(st, Packed)]
    out["state_packed_bytes"] = statistics.median(len(p.buf) for p in packed) if packed else None
    out["state_serialized_bytes"] = statistics.median(len(to_bytes(s)) for s in states)

    # aggregation: the host's float64 partial sum per upload (mean methods), the server's step
    shared = {n: v for n, v in host.model.state_dict().items() if n in payload["global"]}
    mean_aggregation = isinstance(m.aggregator, WeightedMean)
    if mean_aggregation:
        def add_one():
            partial = m.aggregator.start()
            for c in (0, 1):
                m.aggregator.add(partial, c, Upload(shared, 64.0))
        _, med, lo, cpu = timed(add_one, 20)
        out["host_sum_per_upload_cpu_s"] = cpu / 2
    hosts = [dataclasses.replace(r, host=i) for i, r in enumerate(results)]  # one client each, as if on k hosts
    before = server.state

    def aggregate():
        server.state = before
        return server.aggregate(2, *hosts)
    _, med, lo, cpu = timed(aggregate, 3)
    out["server_aggregate_s"], out["server_aggregate_cpu_s"] = med, cpu
    out["server_aggregate_per_upload_cpu_s"] = cpu / k
    if method == "fdse":
        mixes = server.state["dse"]
        out["server_state_per_client_bytes"] = tensors_nbytes(next(iter(mixes.values())))
        out["server_state_per_client_tensors"] = len(next(iter(mixes.values())))
        out["server_aggregate_scaling"] = fdse_scaling(m, server, results[0].uploads[0], before)

    # spilling: a store with no memory budget spills every state but the newest
    spill_dir = scratch("raysim-measure-spill-")
    store = ClientStateStore(0, spill_dir)
    n = 200
    clones = [_clone(states[i % k]) for i in range(n)]
    w0, c0 = time.perf_counter(), time.process_time()
    for i in range(n):
        store.put(i, clones[i])
    out["spill_write_s"] = (time.perf_counter() - w0) / (n - 1)
    out["spill_write_cpu_s"] = (time.process_time() - c0) / (n - 1)
    w0, c0 = time.perf_counter(), time.process_time()
    for i in range(n - 1):
        store.get(i)  # reads it back (and the store spills another to stay in budget)
    out["spill_read_write_s"] = (time.perf_counter() - w0) / (n - 1)
    out["spill_read_write_cpu_s"] = (time.process_time() - c0) / (n - 1)
    out["spill_read_s"] = out["spill_read_write_s"] - out["spill_write_s"]

    if method == "fedbn":  # a state as big as the model (CSAC's frozen reference, FDSE post_train)
        big = {"reference": {n: v.detach().clone() for n, v in host.model.state_dict().items()}}
        out["model_state_bytes"] = state_nbytes(big)
        store = ClientStateStore(0, scratch("raysim-measure-spill-"))
        n = 50
        w0, c0 = time.perf_counter(), time.process_time()
        for i in range(n):
            store.put(i, _clone(big))
        out["spill_model_write_s"] = (time.perf_counter() - w0) / (n - 1)
        out["spill_model_write_cpu_s"] = (time.process_time() - c0) / (n - 1)
        w0 = time.perf_counter()
        for i in range(n - 1):
            store.get(i)
        out["spill_model_read_s"] = (time.perf_counter() - w0) / (n - 1) - out["spill_model_write_s"]

    if ray_ok:
        out.update(object_store(results[0], k, personal[0] if personal else None))
    return out


def _clone(obj):
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone(v) for v in obj)
    return obj


def fdse_scaling(m, server, upload, before) -> dict:
    """FDSE's server step for K = 10..400 uploads (copies of one upload with noise)."""
    from raysim.core.aggregation import AllUploads
    from raysim.core.contract import Upload
    res = {}
    for K in (10, 50, 100, 200, 400):
        g = torch.Generator().manual_seed(K)
        each = {c: Upload({n: v + 1e-3 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
                           for n, v in upload.tensors.items()}, 64.0, {}, {}) for c in range(K)}
        ups = AllUploads(each)
        c0 = time.process_time()
        m.aggregate(before, ups, 2)
        res[K] = time.process_time() - c0
    return res


def object_store(result, k: int, personal=None) -> dict:
    """ray.put + ray.get of a host's round result, and ray.put of small per-client payloads, in a
    local Ray (1 CPU)."""
    import ray

    from raysim.engine.cluster import start_local_ray
    start_local_ray(num_cpus=1, log_to_driver=False)  # as `raysim run` does: loopback only, token auth
    try:
        def roundtrip():
            return ray.get(ray.put(result))
        _, med, lo, cpu = timed(roundtrip, 10)
        out = {"object_store_roundtrip_s": med, "object_store_roundtrip_per_upload_s": med / k}
        if personal is not None:  # the server's ray.put of one client's personal payload
            _, med, lo, cpu = timed(lambda: [ray.put(personal) for _ in range(200)], 3)
            out["object_store_put_personal_s"] = med / 200
        return out
    finally:
        ray.shutdown()


def measure_shards(k: int) -> dict:
    """Writing and reading clients' row groups (raw uint8) on the local filesystem."""
    from raysim.data.shards import read_manifest, read_shard
    from raysim.app.sharding import write_federation_shards

    out = {}
    n = max(k, 10)
    cfg = config("fedbn", num_clients=n)
    for per_file in (1, 100):
        root = scratch("raysim-measure-shards-")
        w0 = time.perf_counter()
        write_federation_shards(cfg, root, clients_per_file=per_file)
        out[f"shard_write_s_per_file_{per_file}"] = (time.perf_counter() - w0) / n
        mf = read_manifest(root)
        _, med, lo, cpu = timed(lambda: [read_shard(root, c, manifest=mf, cache="none") for c in range(k)], 3)
        out[f"shard_read_s_per_client_per_file_{per_file}"] = med / k
        out[f"shard_read_cpu_s_per_client_per_file_{per_file}"] = cpu / k
        out["shard_bytes_per_client"] = sum(os.path.getsize(os.path.join(root, f)) for f in os.listdir(root)
                                            if f.startswith("clients-")) / n
    return out


def batch_normalisation_overhead() -> dict:
    """Per-batch cost of normalising uint8 images (cache='none') vs the float cache."""
    import numpy as np
    from raysim.data.splits import ArraySplit
    x = np.random.default_rng(0).integers(0, 255, (64, 3, 32, 32), dtype=np.uint8)
    y = np.zeros(64, np.int64)
    idx = np.arange(32)
    out = {}
    for mode in ("float", "none"):
        s = ArraySplit(x, y, (0.5,) * 3, (0.5,) * 3, cache=mode)
        s.tensors(idx)
        _, med, lo, cpu = timed(lambda: s.tensors(idx), 50)
        out[f"batch32_tensors_{mode}_s"] = lo
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=32, help="clients trained per method (default 32)")
    p.add_argument("--no-ray", action="store_true", help="skip the object-store measurement")
    p.add_argument("--json", help="write the numbers to this file")
    ns = p.parse_args()
    res = {"load_average": os.getloadavg(), "cpu_count": os.cpu_count(), "torch": torch.__version__}
    for method in ("fedbn", "fdse"):
        res[method] = measure_method(method, ns.clients, not ns.no_ray)
    res["shards"] = measure_shards(ns.clients)
    res["batch"] = batch_normalisation_overhead()
    res["load_average_end"] = os.getloadavg()
    for method in ("fedbn", "fdse"):
        r = res[method]
        print(f"{method}: state {r['state_bytes'] / 1e3:.1f} kB of tensors ({(r['state_packed_bytes'] or 0) / 1e3:.1f} kB "
              f"packed in the store), {r['state_serialized_bytes'] / 1e3:.1f} kB saved; upload {r['upload_bytes'] / 1e3:.1f} kB; payload {r['payload_bytes'] / 1e3:.1f} kB "
              f"(+{r['personal_payload_bytes'] / 1e3:.1f} kB personal)")
        print(f"  local step: {fmt_s(r['train_client_s'])} per client wall (min {fmt_s(r['train_client_min_s'])}), "
              f"{fmt_s(r['train_client_cpu_s'])} CPU, {r['steps_per_client']} SGD steps "
              f"({fmt_s(r['train_step_cpu_s'])} CPU per step)")
        if "host_sum_per_upload_cpu_s" in r:
            print(f"  host partial sum: {fmt_s(r['host_sum_per_upload_cpu_s'])} CPU per upload")
        print(f"  server aggregate of {r['clients']} uploads: {fmt_s(r['server_aggregate_cpu_s'])} CPU "
              f"({fmt_s(r['server_aggregate_per_upload_cpu_s'])} per upload)")
        if "server_aggregate_scaling" in r:
            print("  FDSE server step CPU by K uploads: "
                  + ", ".join(f"K={k}: {fmt_s(v)}" for k, v in r["server_aggregate_scaling"].items()))
            print(f"  FDSE server state per client sampled: {r['server_state_per_client_bytes'] / 1e3:.1f} kB "
                  f"in {r['server_state_per_client_tensors']} tensors")
        print(f"  spill: write {fmt_s(r['spill_write_s'])} ({fmt_s(r['spill_write_cpu_s'])} CPU), "
              f"read {fmt_s(r['spill_read_s'])} per client")
        if "spill_model_write_s" in r:
            print(f"  spill of a model-sized state ({r['model_state_bytes'] / 1e3:.0f} kB): write "
                  f"{fmt_s(r['spill_model_write_s'])} ({fmt_s(r['spill_model_write_cpu_s'])} CPU), "
                  f"read {fmt_s(r['spill_model_read_s'])}")
        if "object_store_roundtrip_s" in r:
            print(f"  object store put+get of a host result: {fmt_s(r['object_store_roundtrip_s'])} "
                  f"({fmt_s(r['object_store_roundtrip_per_upload_s'])} per upload)")
        if "object_store_put_personal_s" in r:
            print(f"  ray.put of one personal payload: {fmt_s(r['object_store_put_personal_s'])}")
    s = res["shards"]
    print(f"shards: {s['shard_bytes_per_client'] / 1e3:.1f} kB per client; read "
          f"{fmt_s(s['shard_read_s_per_client_per_file_1'])} per client (1 per file), "
          f"{fmt_s(s['shard_read_s_per_client_per_file_100'])} (100 per file)")
    b = res["batch"]
    print(f"batch of 32 to tensors: {fmt_s(b['batch32_tensors_float_s'])} cached, {fmt_s(b['batch32_tensors_none_s'])} uint8")
    print(f"load average {res['load_average']} -> {res['load_average_end']} on {res['cpu_count']} CPUs")
    if ns.json:
        with open(ns.json, "w") as fh:
            json.dump(res, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
