"""Simulated time each method of a multi-seed run needs to reach the reference method's final AVG.

    python benchmarks/time_to_target.py RUN_DIR [--reference fedavg]

RUN_DIR is a ``seeds: [...]`` run with client profiles (``<method>/seed-<s>/metrics.parquet`` with
``clock`` rows). Per seed, the target is the reference's final test AVG at that seed; a method's
time is the simulated clock at its first evaluated round at or above it. Prints one Markdown row
per method: final AVG, simulated seconds of the whole run, and the time to the target (mean ± std
over the seeds that reached it, and how many did). DapperFL's Table 1 companion figure."""
from __future__ import annotations

import argparse
import glob
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from time_curves import avg_over_time, load  # noqa: E402


def _mean_std(values: list[float]) -> str:
    if not values:
        return "–"
    return f"{np.mean(values):.1f}" + (f" ± {np.std(values, ddof=1):.1f}" if len(values) > 1 else "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument("--reference", default="fedavg")
    ap.add_argument("--target", type=float, help="a fixed target test AVG in %% (instead of the reference's per seed)")
    ap.add_argument("--at", default="", help="also the test AVG at these simulated seconds, e.g. 60,120,180 "
                    "(the last evaluation at or before each)")
    args = ap.parse_args(argv)
    curves = {}  # method -> seed -> curve
    for path in sorted(glob.glob(os.path.join(args.run_dir, "*", "seed-*", "metrics.parquet"))):
        method, seed = path.split(os.sep)[-3], int(path.split(os.sep)[-2][len("seed-"):])
        curves.setdefault(method, {})[seed] = avg_over_time(load(os.path.dirname(path)))
    if args.target is not None:
        targets = {s: args.target for by_seed in curves.values() for s in by_seed}
        what = f"{args.target:g}%"
    else:
        targets = {s: c.avg.iloc[-1] for s, c in curves[args.reference].items()}
        what = f"{args.reference}'s final AVG"
    at = [float(t) for t in args.at.split(",") if t.strip()]
    print(f"| method | final AVG | " + "".join(f"AVG at {t:g} s | " for t in at)
          + f"simulated s (whole run) | s to reach {what} | seeds reaching it |")
    print("|---|---|" + "---|" * len(at) + "---|---|---|")
    for method, by_seed in curves.items():
        hits = [c[c.avg >= targets[s]].seconds.iloc[0] for s, c in by_seed.items()
                if s in targets and not c[c.avg >= targets[s]].empty]
        at_cells = "".join(_mean_std([c[c.seconds <= t].avg.iloc[-1] for c in by_seed.values()
                                      if not c[c.seconds <= t].empty]) + " | " for t in at)
        print(f"| {method} | {_mean_std([c.avg.iloc[-1] for c in by_seed.values()])} | {at_cells}"
              f"{_mean_std([c.seconds.iloc[-1] for c in by_seed.values()])} | {_mean_std(hits)} | "
              f"{len(hits)}/{len(by_seed)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
