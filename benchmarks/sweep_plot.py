"""Accuracy against a swept setting, one line per method (DapperFL's Fig. 3: accuracy vs pruning ratio).

    python benchmarks/sweep_plot.py 0.2=runs/fig3-0.2 0.4=runs/fig3-0.4 ... --xlabel "pruning ratio" --out fig3.png

Each VALUE=RUN_DIR is one run of the sweep (configs/dapperfl/fig3/rho_VALUE.yaml); every method of it
is read at its selected round (the config's eval.select) and its test AVG plotted at VALUE. Prints the
table it plots."""
from __future__ import annotations

import argparse

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from raysim.app.compare import load  # noqa: E402
from raysim.app.plots import save_figure  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="VALUE=RUN_DIR")
    ap.add_argument("--xlabel", default="setting")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    points: dict[str, dict[float, float]] = {}
    for spec in args.runs:
        value, _, run_dir = spec.partition("=")
        for e in load(run_dir):
            avgs = [100 * s.selected["AVG"] for s in e.summaries.values()]
            points.setdefault(e.method, {})[float(value)] = sum(avgs) / len(avgs)
    xs = sorted({x for p in points.values() for x in p})
    print(f"| method | " + " | ".join(f"{x:g}" for x in xs) + " |")
    print("|---|" + "---|" * len(xs))
    fig, ax = plt.subplots(figsize=(6, 4))
    for method, p in points.items():
        print(f"| {method} | " + " | ".join(f"{p[x]:.2f}" if x in p else "–" for x in xs) + " |")
        ax.plot(sorted(p), [p[x] for x in sorted(p)], marker="o", label=method)
    ax.set_xlabel(args.xlabel)
    ax.set_ylabel("test AVG (%)")
    save_figure(fig, ax, args.out)
    print(f"figure: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
