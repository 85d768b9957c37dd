"""Accuracy against simulated time for several runs in one figure (the deadline experiment).

    python benchmarks/time_curves.py RUN_DIR[=LABEL] ... --out deadline.png

Each RUN_DIR is a run with client profiles (its metrics.parquet has the ``clock`` rows). Prints,
per run, the simulated time it took, its final and best test AVG, and when it first reached the
final AVG of the first run."""
from __future__ import annotations

import argparse
import os

import pandas as pd

from raysim.app.plots import plot_time_curves, sim_clock


def load(run_dir: str) -> pd.DataFrame:
    return pd.read_parquet(os.path.join(run_dir, "metrics.parquet"))


def avg_over_time(df: pd.DataFrame) -> pd.DataFrame:
    clock = sim_clock(df)
    acc = df[(df.client == -1) & (df.split == "test") & (df.domain == "AVG") & (df.metric == "accuracy")]
    acc = acc.sort_values("round")
    return pd.DataFrame({"round": acc["round"].values, "seconds": clock.reindex(acc["round"].values).values,
                         "avg": 100 * acc.value.values})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="RUN_DIR or RUN_DIR=LABEL")
    ap.add_argument("--out", required=True, help="the figure (.png)")
    args = ap.parse_args(argv)
    panels, curves = {}, {}
    for spec in args.runs:
        path, _, label = spec.partition("=")
        df = load(path)
        panels[label or os.path.basename(path.rstrip("/"))] = [df]
        curves[label or os.path.basename(path.rstrip("/"))] = avg_over_time(df)
    plot_time_curves(panels, args.out)
    target = next(iter(curves.values())).avg.iloc[-1]
    print(f"| run | rounds | simulated s | final AVG | best AVG | s to reach {target:.2f} |")
    print("|---|---|---|---|---|---|")
    for name, c in curves.items():
        hit = c[c.avg >= target]
        print(f"| {name} | {int(c['round'].iloc[-1])} | {c.seconds.iloc[-1]:.1f} | {c.avg.iloc[-1]:.2f} | "
              f"{c.avg.max():.2f} | {hit.seconds.iloc[0]:.1f} |" if not hit.empty else
              f"| {name} | {int(c['round'].iloc[-1])} | {c.seconds.iloc[-1]:.1f} | {c.avg.iloc[-1]:.2f} | {c.avg.max():.2f} | not reached |")
    print(f"figure: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
