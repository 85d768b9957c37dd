"""The asynchronous arm (issue 41): workload D's federation (1,000 registered clients, mlp) with
five device levels, synchronous rounds of 100 clients against the buffered schedule with 100 in
flight and a server step every 10 arrivals, for the same number of client updates. Prints client
updates per wall second of the loop (start-up excluded) for both, and their ratio.

On a shared 2-core machine one pair's ratio moves by +-0.1 from run to run; ``--pairs N`` runs N
pairs in one Ray session, the order swapped every other pair (which arm runs first never favours
one), and prints each pair's ratio, then their median, mean ± std and range.

    python benchmarks/async_arm.py [--updates 1000] [--hosts 2] [--pairs 1]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.workloads import raysim_config, workload_d  # noqa: E402

LEVELS = [{"name": f"C{i + 1}", "flops": f, "up_mbps": 10, "down_mbps": 50}
          for i, f in enumerate((2.0e10, 1.6e10, 1.2e10, 0.8e10, 0.4e10))]


def config(buffered: bool, updates: int, hosts: int):
    from raysim.config import load_config
    per_round, buffer = 100, 10
    rounds = updates // (buffer if buffered else per_round)
    raw = raysim_config(workload_d(rounds=rounds, per_round=per_round), hosts=hosts).to_dict()
    raw["clients"]["profiles"]["levels"] = LEVELS
    raw["clients"]["profiles"]["assign"] = "round_robin"
    raw["checkpoint"]["every"] = 0
    raw["checkpoint"]["minutes"] = None
    raw["tracking"]["tensorboard"] = False
    if buffered:
        raw["schedule"].update(kind="buffered", concurrency=per_round, buffer=buffer)
    return load_config(raw=raw)


ARMS = (("synchronous rounds of 100", False), ("buffered, C 100, K 10", True))


def run_arm(name: str, buffered: bool, updates: int, hosts: int) -> float:
    """One federation of the arm; prints its figures and returns client updates per wall second."""
    from raysim.app.experiment import federation
    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        result = federation(config(buffered, updates, hosts), out, progress=False).run()
        loop = sum(result.round_seconds)
        rate = updates / loop
        print(f"{name:28s} {result.rounds_done:4d} steps  loop {loop:6.1f} s  "
              f"(start-up {result.startup_seconds:.1f} s, all {time.perf_counter() - t0:.1f} s)  "
              f"{rate:7.1f} client updates / wall s", flush=True)
    return rate


def main() -> None:
    import statistics

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--updates", type=int, default=1000, help="client updates per arm (default 1000)")
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=1, help="pairs of runs, the order swapped every other pair")
    args = ap.parse_args()
    ratios = []
    for pair in range(args.pairs):
        arms = ARMS if pair % 2 == 0 else ARMS[::-1]
        rates = {buffered: run_arm(name, buffered, args.updates, args.hosts) for name, buffered in arms}
        ratios.append(rates[True] / rates[False])
        print(f"buffered / synchronous throughput: {ratios[-1]:.2f} (target >= 0.9)", flush=True)
    if len(ratios) > 1:
        print(f"{len(ratios)} pairs: median {statistics.median(ratios):.2f}, mean {statistics.mean(ratios):.2f} "
              f"+- {statistics.stdev(ratios):.2f}, range {min(ratios):.2f}-{max(ratios):.2f} (target >= 0.9)")


if __name__ == "__main__":
    main()
