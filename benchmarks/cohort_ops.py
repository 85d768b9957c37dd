"""Where a cohort round's time goes, client by client: the operations a host runs per client in
each phase of one round with client cohorts (``runtime.cohort_size``), its round times, and on a
GPU a ``torch.profiler`` table of that round.

On a GPU a small model's round with cohorts is launch-bound: every PyTorch operation costs its
dispatch and (most) a kernel launch whatever its size, so the operations a host runs *per client*
(loading its model, its batches, its upload and fold), not the vectorized steps, decide the
round. The counts are the same on the CPU (the same code runs; only the batches are cut on the
CPU there instead of read from device-resident data), so this is the figure to watch between GPU
sessions. One host in this process (no Ray), run.py's workload, ``--rounds`` rounds; the counts
are of round 2, the profile of round 3.

    python benchmarks/cohort_ops.py                         # CPU, workload D, K = 64
    python benchmarks/cohort_ops.py --device cuda --profile # on a GPU, with torch.profiler's table
    python benchmarks/cohort_ops.py --workload B --cohort-size 16

Prints a table (and writes it to ``--out``, default ``$OUT`` else benchmarks/out/cohort_ops):
operations per client by where they run (the two innermost raysim functions on the stack).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if REPO not in sys.path:
    sys.path.insert(0, REPO)

COUNTED_ROUND = 2  # its operations counted (the counter's own cost makes it slower: not a timed round)
PROFILED_ROUND = 3  # with --profile, under torch.profiler


class OpCounter:
    """Every ATen operation run inside it, counted by the two innermost functions of raysim's own
    code (``raysim/``, ``methods/``) on the Python stack."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        self.counts: collections.Counter = collections.Counter()
        counts, roots = self.counts, (os.path.join(REPO, "raysim"), os.path.join(REPO, "methods"))

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                frame, where = sys._getframe(1), []
                while frame is not None and len(where) < 2:
                    path = frame.f_code.co_filename
                    if path.startswith(roots):
                        where.append(f"{os.path.basename(path)[:-3]}.{frame.f_code.co_name}")
                    frame = frame.f_back
                counts[" < ".join(where) or "(outside raysim)"] += 1
                return func(*args, **(kwargs or {}))
        self.mode = Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def config(workload: str, cohort_size, rounds: int, device: str):
    """run.py's workload on one host; on a GPU with the clients' data kept there, as run.py's
    device arms keep it (batches cut on the GPU)."""
    from benchmarks.run import DEVICE_DATA_MB
    from benchmarks.workloads import DEVICE_WORKLOADS, raysim_config
    cfg = raysim_config(DEVICE_WORKLOADS[workload](rounds), hosts=1)
    extra = {"device_data_mb": float(DEVICE_DATA_MB)} if device == "cuda" else {}
    return dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, cohort_size=cohort_size, **extra))


def measure(workload: str, cohort_size, rounds: int, device: str, profile: bool) -> dict:
    """One federation with one in-process host on ``device``; round ``COUNTED_ROUND``'s operations
    counted, round ``PROFILED_ROUND`` profiled (``profile``), every round timed."""
    import torch
    from raysim.app.experiment import federation
    from raysim.engine import host as host_mod
    from raysim.engine.backend import InProcess, _Handle

    class OneHost(InProcess):  # the host on the GPU where there is one (InProcess's hosts take the CPU)
        def launch_pool(self, cfg, num_hosts):
            hosts = [_Handle(host_mod.ClientHost(h, cfg, num_hosts, gpu_ids=[0] if device == "cuda" else []),
                             cfg.model.name) for h in range(num_hosts)]
            return hosts, [h.start.remote() for h in hosts], None

    torch.set_num_threads(1)
    counter, table, clients = OpCounter(), [], collections.Counter()
    train = host_mod.ClientHost.train_clients

    def counted(self, rnd, payload_box, client_ids, *args, **kwargs):
        if rnd == COUNTED_ROUND:
            clients["n"] += len(client_ids)
            with counter:
                return train(self, rnd, payload_box, client_ids, *args, **kwargs)
        if rnd != PROFILED_ROUND or not profile:
            return train(self, rnd, payload_box, client_ids, *args, **kwargs)
        from torch.profiler import ProfilerActivity, profile as torch_profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with torch_profile(activities=acts) as prof:
            out = train(self, rnd, payload_box, client_ids, *args, **kwargs)
            if device == "cuda":
                torch.cuda.synchronize()
        sort = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
        table.append(prof.key_averages().table(sort_by=sort, row_limit=25))
        return out

    host_mod.ClientHost.train_clients = counted
    try:
        with tempfile.TemporaryDirectory() as out:
            t0 = time.perf_counter()
            result = federation(config(workload, cohort_size, rounds, device), out, progress=False, backend=OneHost()).run()
            wall = time.perf_counter() - t0
    finally:
        host_mod.ClientHost.train_clients = train
    n = max(clients["n"], 1)
    return {"workload": workload, "cohort_size": cohort_size, "device": device, "clients": clients["n"],
            "ops": sum(counter.counts.values()), "ops_per_client": sum(counter.counts.values()) / n,
            "by_place": {k: v / n for k, v in counter.counts.most_common()},
            "round_seconds": list(result.round_seconds), "wall_s": wall, "profile": table[0] if table else None}


def render(r: dict) -> str:
    rs = r["round_seconds"]
    head = [f"# cohort_ops: workload {r['workload']}, cohort_size {r['cohort_size']}, {r['device']}", "",
            f"round {COUNTED_ROUND}: {r['clients']} clients, {r['ops']} ATen operations on the host, "
            f"{r['ops_per_client']:.1f} per client",
            "round seconds: " + ", ".join(f"{s:.3f}" for s in rs) + f" (round {COUNTED_ROUND} counted: slower)", "",
            "| operations per client | where (innermost raysim functions) |", "|--:|:--|"]
    rows = [f"| {v:.1f} | {k} |" for k, v in r["by_place"].items() if v >= 0.05]
    tail = ["", f"torch.profiler, round {PROFILED_ROUND}:", "```", r["profile"], "```"] if r["profile"] else []
    return "\n".join(head + rows + tail)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--workload", default="D", help="run.py's device workload (default D)")
    p.add_argument("--cohort-size", default="64", help="runtime.cohort_size (default 64; 'auto' on a GPU)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--profile", action="store_true", help=f"torch.profiler's table of round {PROFILED_ROUND} as well")
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "out", "cohort_ops"))
    ns = p.parse_args(argv)
    least = PROFILED_ROUND if ns.profile else COUNTED_ROUND
    if ns.rounds < least:
        p.error(f"--rounds must be at least {least} (round {COUNTED_ROUND} is counted, {PROFILED_ROUND} profiled)")
    if ns.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            print("cohort_ops: error: --device cuda needs CUDA, and torch sees no GPU here; without "
                  "--device the counts run on the CPU", file=sys.stderr)
            return 2
    k = ns.cohort_size if ns.cohort_size == "auto" else int(ns.cohort_size)
    r = measure(ns.workload, k, ns.rounds, ns.device, ns.profile)
    text = render(r)
    print(text)
    os.makedirs(ns.out, exist_ok=True)
    with open(os.path.join(ns.out, "cohort_ops.md"), "w", encoding="utf-8") as fh:
        fh.write(text + "\n")
    with open(os.path.join(ns.out, "cohort_ops.json"), "w", encoding="utf-8") as fh:
        json.dump(r, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
