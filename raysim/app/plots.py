"""The figures of a run folder: curves.png (test accuracy per round, one panel per federation) and
curves_time.png (test AVG against the simulated clock), and :func:`save_figure`, which
``raysim compare`` and the benchmarks' plots finish theirs with. Every figure is written through
:func:`raysim.core.files.write_atomically`: a reader never sees half a PNG.
"""
from __future__ import annotations

import pandas as pd

from raysim.core.files import write_atomically


def write_png(fig, path: str) -> None:
    """The figure as ``path`` (PNG, atomically), then closed."""
    import matplotlib.pyplot as plt
    try:
        # the temporary's name ends in .tmp, so the format is named rather than guessed from it
        write_atomically(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    finally:
        plt.close(fig)


def plot_curves(panels: dict[str, list[pd.DataFrame]], path: str) -> None:
    """One panel per federation (method, held-out domain): test accuracy per domain, AVG thick;
    over several seeds the mean, with a ± std band around AVG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(panels)
    cols = min(n, 4)
    nrows = -(-n // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3.6 * nrows), squeeze=False, sharey=True)
    flat = axes.ravel()
    for ax in flat[n:]:
        ax.axis("off")
    for ax, (name, frames) in zip(flat, panels.items()):
        rows = pd.concat([df[(df.client == -1) & (df.metric == "accuracy") & (df.split == "test")
                             & ~df.domain.isin(("AVG_clients", "AVG_weighted"))].assign(seed=i)
                          for i, df in enumerate(frames)])
        for dom, g in rows.groupby("domain", sort=False):
            by_round = g.groupby("round")["value"]
            mean = 100 * by_round.mean()
            style = {"linewidth": 1.2}
            if dom == "AVG":
                style = {"linewidth": 2.5, "color": "black"}
            elif dom == "ALL":
                style = {"linewidth": 1.5, "color": "gray", "linestyle": "--"}
            ax.plot(mean.index, mean.values, label=dom, marker="o" if len(mean) <= 3 else None, **style)
            if dom == "AVG" and len(frames) > 1:
                std = 100 * by_round.std(ddof=1).fillna(0.0)
                ax.fill_between(mean.index, (mean - std).values, (mean + std).values, color="black", alpha=0.15)
        ax.set_title(name + (f" ({len(frames)} seeds)" if len(frames) > 1 else ""))
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
    for row in axes:
        row[0].set_ylabel("test accuracy (%)")
    flat[0].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    write_png(fig, path)


def save_figure(fig, ax, path: str) -> None:
    """Grid, legend, then write the figure atomically (a reader never sees half a PNG)."""
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    write_png(fig, path)


def sim_clock(df: pd.DataFrame) -> pd.Series | None:
    """Simulated seconds elapsed at the end of each round or server step (client profiles' clock:
    the ``sim_time`` rows; a run written before they existed, its rounds' durations added up), or None."""
    clock = df[df.split == "clock"]
    rows = clock[clock.metric == "sim_time"].sort_values("round")
    if not rows.empty:
        return pd.Series(rows.value.values, index=rows["round"].values)
    rows = clock[clock.metric == "sim_round_s"].sort_values("round")
    if rows.empty:
        return None
    return pd.Series(rows.value.cumsum().values, index=rows["round"].values)


def plot_time_curves(panels: dict[str, list[pd.DataFrame]], path: str) -> None:
    """Test AVG against simulated time (the clock of the client profiles), one line per seed,
    beside curves.png's AVG against rounds; every panel in one figure."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, frames in panels.items():
        for i, df in enumerate(frames):
            clock = sim_clock(df)
            acc = df[(df.client == -1) & (df.split == "test") & (df.domain == "AVG") & (df.metric == "accuracy")]
            if clock is None or acc.empty:
                continue
            acc = acc.sort_values("round")
            ax.plot(clock.reindex(acc["round"].values).values, 100 * acc.value.values, marker=".",
                    label=name if i == 0 else None, color=f"C{list(panels).index(name) % 10}", alpha=0.85)
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("test AVG (%)")
    save_figure(fig, ax, path)

