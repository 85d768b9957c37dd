"""Render a run's summary table (the papers' shape) and accuracy curves from metrics.parquet.

Two selections are reported, never mixed: the final round, and the round with the best
validation AVG accuracy (model selection that never looks at the test split).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import pandas as pd

from raysim.errors import UserError
from raysim.metrics import read

AGGREGATES = ("AVG", "ALL")


@dataclass
class Summary:
    method: str
    domains: list[str]
    final_round: int
    best_round: int | None  # best validation AVG accuracy; None without a val split
    final: dict[str, float]  # domain/AVG/ALL -> test accuracy at the final round
    best: dict[str, float]  # ... at the best-validation round
    peek_round: int = 0  # the round with the best test AVG: an optimistic selection that peeks
    peek: dict | None = None  # at the test split, reported only because several papers use it


def summarize(df: pd.DataFrame, method: str = "") -> Summary:
    glob = df[(df.client == -1) & (df.metric == "accuracy")]
    test = glob[glob.split == "test"]
    if test.empty:
        raise UserError("metrics hold no test accuracy rows (was anything evaluated?)")
    domains = [d for d in dict.fromkeys(test.domain) if d not in AGGREGATES]
    final_round = int(test["round"].max())
    val_avg = glob[(glob.split == "val") & (glob.domain == "AVG")]
    best_round = None
    if not val_avg.empty:  # earliest round among ties
        best_round = int(val_avg.sort_values(["value", "round"], ascending=[False, True]).iloc[0]["round"])

    def at(rnd):
        rows = test[test["round"] == rnd]
        return {d: float(v) for d, v in zip(rows.domain, rows.value)}

    test_avg = test[test.domain == "AVG"]
    peek_round = int(test_avg.sort_values(["value", "round"], ascending=[False, True]).iloc[0]["round"])
    return Summary(method, domains, final_round, best_round, at(final_round),
                   at(best_round) if best_round is not None else {}, peek_round, at(peek_round))


def _row(name: str, cols: list[str], values: dict) -> str:
    cells = [f"{100 * values[c]:.2f}" if c in values else "–" for c in cols]
    return f"| {name} | " + " | ".join(cells) + " |"


def summary_markdown(summaries: list[Summary], title: str = "") -> str:
    domains = list(dict.fromkeys(d for s in summaries for d in s.domains))
    cols = domains + list(AGGREGATES)
    head = "| method | " + " | ".join(cols) + " |\n|---|" + "---|" * len(cols)
    out = [f"# {title}".rstrip(), ""] if title else []
    out += ["Test accuracy (%) per domain; AVG = mean of the clients' accuracies, "
            "ALL = accuracy over all clients' pooled test samples.", ""]
    out += [f"## Final round", "", head]
    out += [_row(f"{s.method} (round {s.final_round})", cols, s.final) for s in summaries]
    if any(s.best_round is not None for s in summaries):
        out += ["", "## Best-validation round (selected by validation AVG accuracy)", "", head]
        out += [_row(f"{s.method} (round {s.best_round})", cols, s.best) for s in summaries
                if s.best_round is not None]
    out += ["", "## Best test round (peeks at the test split; shown only to compare with papers that select this way)",
            "", head]
    out += [_row(f"{s.method} (round {s.peek_round})", cols, s.peek) for s in summaries]
    return "\n".join(out) + "\n"


def plot_curves(frames: dict[str, pd.DataFrame], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(frames)
    cols = min(n, 4)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False, sharey=True)
    flat = axes.ravel()
    for ax in flat[n:]:
        ax.axis("off")
    for ax, (name, df) in zip(flat, frames.items()):
        rows = df[(df.client == -1) & (df.metric == "accuracy") & (df.split == "test")]
        for dom, g in rows.groupby("domain", sort=False):
            g = g.sort_values("round")
            style = {"linewidth": 2.5, "color": "black"} if dom == "AVG" else {"linewidth": 1.2}
            if dom == "ALL":
                style = {"linewidth": 1.5, "color": "gray", "linestyle": "--"}
            ax.plot(g["round"], 100 * g["value"], label=dom, **style)
        ax.set_title(name)
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
    for row in axes:
        row[0].set_ylabel("test accuracy (%)")
    flat[0].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def method_dirs(run_dir: str) -> dict[str, str]:
    """{method: its folder} for a single run or a comparison (a folder holds metrics.parquet, or
    holdout-<domain>/ folders for leave-one-domain-out)."""
    if _is_run(run_dir):
        return {_method_of(run_dir): run_dir}
    found = {}
    if os.path.isdir(run_dir):
        for name in sorted(os.listdir(run_dir)):
            if _is_run(os.path.join(run_dir, name)):
                found[name] = os.path.join(run_dir, name)
    return found


def _is_run(d: str) -> bool:
    return os.path.isfile(os.path.join(d, "metrics.parquet")) or bool(_holdout_dirs(d))


def _holdout_dirs(d: str) -> dict[str, str]:
    if not os.path.isdir(d):
        return {}
    return {n[len("holdout-"):]: os.path.join(d, n) for n in sorted(os.listdir(d))
            if n.startswith("holdout-") and os.path.isfile(os.path.join(d, n, "metrics.parquet"))}


def lodo_markdown(results: dict[str, dict[str, Summary]], title: str = "") -> str:
    """The FedDG table: one column per held-out domain (accuracy of the global model on 100% of
    it), plus their average; the round is selected by the source clients' validation accuracy."""
    domains = list(dict.fromkeys(d for per in results.values() for d in per))
    head = "| method | " + " | ".join(domains) + " | Avg |\n|---|" + "---|" * (len(domains) + 1)
    out = [f"# {title}".rstrip(), ""] if title else []
    out += ["Leave-one-domain-out: accuracy (%) on each unseen domain; Avg = mean over held-out domains.", ""]
    for label, pick in (("Final round", lambda s: s.final), ("Best source-validation round", lambda s: s.best),
                        ("Best target round (peeks at the target: the selection some FedDG papers report)",
                         lambda s: s.peek)):
        out += [f"## {label}", "", head]
        for method, per in results.items():
            accs = [pick(per[d]).get("ALL") if d in per else None for d in domains]
            cells = [f"{100 * a:.2f}" if a is not None else "–" for a in accs]
            known = [a for a in accs if a is not None]
            avg = f"{100 * sum(known) / len(known):.2f}" if known and len(known) == len(accs) else "–"
            out.append(f"| {method} | " + " | ".join(cells) + f" | {avg} |")
        out.append("")
    return "\n".join(out)


def _method_of(run_dir: str) -> str:
    import yaml
    try:
        with open(os.path.join(run_dir, "config.yaml"), encoding="utf-8") as fh:
            return yaml.safe_load(fh).get("method") or os.path.basename(run_dir)
    except (OSError, AttributeError):
        return os.path.basename(os.path.normpath(run_dir))


def _read(d: str) -> pd.DataFrame:
    path = os.path.join(d, "metrics.parquet")
    try:
        return read(path)
    except Exception as err:  # a corrupted or truncated file
        raise UserError(f"cannot read {path}: {str(err).splitlines()[0]}") from None


def _method_sections(run_dir: str) -> str:
    """What the method itself adds to the summary (its ``report_markdown`` hook)."""
    from raysim.methods import registry
    try:
        cls = registry.get(_method_of(run_dir))
    except UserError:  # a folder named after no method of this build
        return ""
    text = cls.report_markdown(run_dir)
    return f"\n{text.rstrip()}\n" if text else ""


def render(run_dir: str) -> str:
    """(Re-)write summary.md and curves.png of a run directory; return the summary text."""
    dirs = method_dirs(run_dir)
    if not dirs:
        raise UserError(f"no metrics.parquet found in {run_dir} or its method folders")
    title = os.path.basename(os.path.normpath(run_dir))
    if any(_holdout_dirs(d) for d in dirs.values()):
        frames, lodo = {}, {}
        for name, d in dirs.items():
            lodo[name] = {}
            for dom, hd in _holdout_dirs(d).items():
                frames[f"{name} / {dom}"] = _read(hd)
                lodo[name][dom] = summarize(frames[f"{name} / {dom}"], name)
        text = lodo_markdown(lodo, title)
    else:
        frames = {name: _read(d) for name, d in dirs.items()}
        text = summary_markdown([summarize(df, name) for name, df in frames.items()], title)
        text += "".join(_method_sections(d) for d in dirs.values())
    tmp = os.path.join(run_dir, "summary.md.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, os.path.join(run_dir, "summary.md"))
    plot_curves(frames, os.path.join(run_dir, "curves.png"))
    return text
