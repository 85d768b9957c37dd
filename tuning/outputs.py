"""A search's outputs, from one row per trial:

* ``trials.parquet`` - one row per trial: its hyperparameters (one column per dotted key), the
  objective, final and best validation metrics, rounds run, stop reason, attempts, seconds, error;
* ``best.yaml``      - the best trial's complete experiment config (``raysim run best.yaml``);
* ``search.png``     - the objective against each searched hyperparameter.

The best trial is the best *completed* one (all rounds run): an early-stopped trial's value comes
from fewer rounds, so re-running its config would not reproduce it. Only when no trial completed
does it fall back to the best trial with a value.

Accuracies are stored as Tune and Optuna see them, fractions (trials.parquet too); what a person
reads (the printed lines and table, best.yaml's header, search.png's axis) shows them in percent,
labelled, as the rest of raysim does (:func:`shown`).
"""
from __future__ import annotations

import math
import os

import yaml

from raysim.core.files import write_atomically, write_text
from raysim.tuning import space as sp

STOP_REASONS = ("completed", "early_stopped", "diverged", "error", "unfinished")
METRIC_COLUMNS = ("objective", "val_avg_final", "val_avg_best", "val_all_final", "val_all_best",
                  "train_loss_final")
TAIL_COLUMNS = ("rounds_run", "rounds", "stop_reason", "attempts", "seconds", "error", "run_dir")


def is_accuracy(metric: str) -> bool:
    """The validation metrics (``val_*``) are accuracies, stored as fractions; ``train_loss`` is not."""
    return metric.startswith("val_")


def shown(metric: str, value) -> str:
    """``value`` of ``metric`` as a person reads it: an accuracy in percent (``75.00%``), a loss
    as is (``0.4321``), ``-`` for none."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{100 * float(value):.2f}%" if is_accuracy(metric) else f"{float(value):.4f}"


def axis_label(metric: str) -> str:
    """``metric`` with its unit where it has one: ``val_avg_best (%)``."""
    return f"{metric} (%)" if is_accuracy(metric) else metric


def trials_frame(rows: list[dict], space_keys: list[str]):
    """rows -> DataFrame with a stable column order, sorted by trial number."""
    import pandas as pd

    cols = ["trial", "trial_id", *space_keys, *METRIC_COLUMNS, *TAIL_COLUMNS]
    df = pd.DataFrame([{c: r.get(c) for c in cols} for r in rows], columns=cols)
    if len(df):
        df = df.sort_values("trial", kind="stable").reset_index(drop=True)
    for c in METRIC_COLUMNS + ("seconds",):
        df[c] = pd.to_numeric(df[c], errors="coerce").astype("float64")
    for c in ("trial", "rounds_run", "rounds", "attempts"):
        df[c] = pd.to_numeric(df[c], errors="coerce").fillna(0).astype("int64")
    for c in ("trial_id", "stop_reason", "error", "run_dir"):
        df[c] = df[c].astype("object").where(df[c].notna(), None)
    for key in space_keys:  # a choice of mixed types cannot be one parquet column: store as text
        kinds = {_kind(v) for v in df[key] if v is not None}
        if len(kinds) > 1:
            df[key] = df[key].map(lambda v: None if v is None else str(v))
    return df


def _kind(v) -> str:
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, (int, float)) or hasattr(v, "dtype"):
        return "number"
    return type(v).__name__


def write_trials(df, path: str) -> None:
    write_atomically(path, lambda tmp: df.to_parquet(tmp, index=False))


def pick_best(df, mode: str):
    """The best row (a Series) or None: completed trials first, ties to the earliest trial."""
    if not len(df):
        return None
    scored = df[df["objective"].notna()]
    completed = scored[scored["stop_reason"] == "completed"]
    pool = completed if len(completed) else scored[scored["stop_reason"].isin(["early_stopped", "unfinished"])]
    if not len(pool):
        return None
    values = pool["objective"] if mode == "max" else -pool["objective"]
    return pool.loc[values.idxmax()]


def write_best(spec, row, path: str, search_dir: str) -> dict:
    """best.yaml: the base experiment with the best trial's hyperparameters, complete and valid."""
    params = {k: sp.plain(row[k]) for k in spec.space}
    cfg = spec.experiment_config(params)
    cfg.name = f"{spec.name}-best"
    header = [
        f"# Best trial of the search in {search_dir}: trial {int(row['trial'])} ({row['trial_id']}),",
        f"# {spec.metric} = {shown(spec.metric, row['objective'])} after {int(row['rounds_run'])}/{int(row['rounds'])} rounds "
        f"({row['stop_reason']}).",
        "# Searched: " + ", ".join(f"{k} = {_fmt(v)}" for k, v in params.items()),
        f"# Re-run: raysim run {path}",
    ]
    write_text(path, "\n".join(header) + "\n" + yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    return params


def plot_search(df, spec, path: str, best=None) -> None:
    """One panel per searched hyperparameter: the objective of every trial against its value."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    keys = list(spec.space)
    ncols = min(len(keys), 3)
    nrows = math.ceil(len(keys) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.4 * nrows), squeeze=False)
    styles = {"completed": dict(marker="o", facecolors="C0", edgecolors="C0", label="completed"),
              "early_stopped": dict(marker="o", facecolors="none", edgecolors="C1", label="stopped early"),
              "diverged": dict(marker="x", c="C3", label="diverged"),
              "unfinished": dict(marker="s", facecolors="none", edgecolors="0.5", label="unfinished")}
    scored = df[df["objective"].notna()]
    scale = 100.0 if is_accuracy(spec.metric) else 1.0  # accuracies drawn in percent
    for i, key in enumerate(keys):
        ax = axes[i // ncols][i % ncols]
        s = spec.space[key]
        xs_all, ticks = _positions(scored[key], s)
        for reason, style in styles.items():
            mask = (scored["stop_reason"] == reason).to_numpy()
            if mask.any():
                ax.scatter([x for x, m in zip(xs_all, mask) if m], scale * scored["objective"][mask], s=36,
                           **style)
        if best is not None:
            bx, _ = _positions([best[key]], s)
            ax.scatter(bx, [scale * best["objective"]], marker="*", s=220, c="gold", edgecolors="k", zorder=5,
                       label="best")
        if s.kind == "loguniform":  # the whole searched range, decades only
            ax.set_xscale("log")
            ax.set_xlim(s.low / 1.25, s.high * 1.25)
            ax.xaxis.set_minor_formatter(NullFormatter())
        elif s.kind in ("uniform", "int"):
            pad = 0.04 * (s.high - s.low)
            ax.set_xlim(s.low - pad, s.high + pad)
        if ticks is not None:
            ax.set_xticks(range(len(ticks)), [str(t) for t in ticks])
        ax.set_xlabel(key)
        ax.set_ylabel(axis_label(spec.metric))
        ax.grid(alpha=0.3)
        if i == 0:
            ax.legend(fontsize=7, loc="best")
    for j in range(len(keys), nrows * ncols):
        axes[j // ncols][j % ncols].axis("off")
    n_done = int((df["stop_reason"] == "completed").sum())
    fig.suptitle(f"{spec.name}: {spec.method}, {len(df)} trials ({n_done} completed), "
                 f"{spec.metric} ({spec.mode})", fontsize=10)
    fig.tight_layout()
    image_format = os.path.splitext(path)[1][1:] or matplotlib.rcParams["savefig.format"]  # not the temp name's
    write_atomically(path, lambda tmp: fig.savefig(tmp, dpi=100, format=image_format))
    plt.close(fig)


def _positions(values, s):
    if s.kind != "choice":
        return [float(v) for v in values], None
    labels = [str(c) for c in s.choices]
    return [labels.index(str(v)) if str(v) in labels else -1 for v in values], list(s.choices)


def format_table(df, spec) -> str:
    """The trials as a console table (hyperparameters by their short names)."""
    import pandas as pd

    if not len(df):
        return "(no trials)"
    view = pd.DataFrame({"trial": df["trial"]})
    for key in spec.space:
        view[sp.short_name(key)] = [_fmt(v) for v in df[key]]
    view[axis_label(spec.metric)] = [shown(spec.metric, v) for v in df["objective"]]
    view["rounds"] = [f"{r}/{t}" for r, t in zip(df["rounds_run"], df["rounds"])]
    view["stop"] = df["stop_reason"]
    return view.to_string(index=False)


def _fmt(v) -> str:
    v = sp.plain(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        return f"{v:.4g}"
    return str(v)
