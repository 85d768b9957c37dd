"""The raysim arm: one federation of a spec through the engine (``raysim.app.experiment``).

Ray start-up (``ray.init``), the federation's start-up (server and host actors, data loading)
and each round are timed separately. With ``memory=True`` the resident memory of this process
and all its descendants (the Ray driver, raylet, GCS, the server and host workers) is sampled
throughout, and the final global weights are fetched from the server after the last round
(outside the timed rounds) for the equivalence check.

    python benchmarks/raysim_runner.py SPEC.json OUT_DIR --hosts 2 [--memory]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def run_raysim(spec: dict, run_dir: str, hosts: int = 2, memory: bool = False, fetch_weights: bool = True,
               runtime: dict | None = None) -> dict:
    import ray

    from benchmarks.procmem import PeakSampler, TreeCPU
    from benchmarks.workloads import raysim_config
    from raysim.app.experiment import federation
    from raysim.engine.cluster import ray_session

    cfg = raysim_config(spec, hosts=hosts, runtime=runtime)
    sampler = PeakSampler() if memory else None
    out: dict = {"hosts": hosts}
    final: dict = {}
    mem_at: dict = {}
    cpu_at: dict = {}
    tree_cpu: list = []

    def on_round(rnd, summary, evaluation):
        # runs in the driver after the round's time was taken
        if not tree_cpu:  # every process of the federation exists by now
            tree_cpu.append(TreeCPU())
        cpu_at[rnd] = tree_cpu[0]()
        if sampler is not None:
            mem_at[rnd] = sampler.sample(rescan=True)
        if rnd == cfg.rounds and fetch_weights:
            final["weights"] = ray.get(fed.server.export_state.remote())["global"]

    started_ray = not ray.is_initialized()
    t0 = time.perf_counter()
    if sampler is not None:
        sampler.__enter__()
    try:
        with ray_session(None, cfg.runtime):
            out["ray_start_seconds"] = time.perf_counter() - t0 if started_ray else 0.0
            if sampler is not None:
                out["rss_after_ray_start"] = sampler.sample(rescan=True)
            fed = federation(cfg, run_dir, progress=False, on_round=on_round)
            t1 = time.perf_counter()
            res = fed.run()
            out["total_seconds"] = time.perf_counter() - t1
    finally:
        if sampler is not None:
            sampler.__exit__(None, None, None)
    # CPU seconds of every process (driver, raylet, GCS, server, hosts) between the ends of
    # consecutive rounds: rounds 2..R
    out["round_cpu"] = [cpu_at[r] - cpu_at[r - 1] for r in sorted(cpu_at) if r - 1 in cpu_at]
    out.update(startup_seconds=res.startup_seconds, round_seconds=list(res.round_seconds),
               final_eval=res.last_eval.get("test", {}), num_clients=fed.n)
    if sampler is not None:
        # base: the sum just before round 1 starts (Ray, server and hosts up, data loaded)
        t_rounds = t1 + res.startup_seconds
        before = [v for t, v in sampler.samples if t <= t_rounds]
        out.update(peak_rss=sampler.peak, rss_before_rounds=before[-1] if before else None,
                   rss_after_round={int(k): v for k, v in mem_at.items()})
    if fetch_weights:
        out["weights"] = final.get("weights")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("spec")
    p.add_argument("out")
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--memory", action="store_true")
    p.add_argument("--runtime", default="{}", help="extra runtime.* settings (JSON)")
    ns = p.parse_args(argv)
    with open(ns.spec, encoding="utf-8") as fh:
        spec = json.load(fh)
    os.makedirs(ns.out, exist_ok=True)
    res = run_raysim(spec, os.path.join(ns.out, "run"), hosts=ns.hosts, memory=ns.memory,
                     runtime=json.loads(ns.runtime))
    from benchmarks.plain import save_result
    save_result(ns.out, res)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
