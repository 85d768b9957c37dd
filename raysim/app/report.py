"""Render a run's summary table (the papers' shapes) and accuracy curves from metrics.parquet.

A run directory is ``[<method>/][seed-<s>/][holdout-<domain>/]metrics.parquet``: one folder per
method of a comparison, per seed of a multi-seed run, per held-out domain of leave-one-domain-out.

The headline is the round that ``eval.select`` picks in each federation (best validation AVG by
default); the final round is always shown beside it, and the best *test* round only labelled as
the selection that peeks at the test split. AVG is the mean over domains (the papers' AVG); the
clients' mean, AVG_clients, is shown beside it wherever the two differ. Over several seeds every
cell is mean ± std (sample standard deviation, ddof 1), and each method is compared with the first
one listed: the mean of the per-seed differences, how many seeds it wins and a paired t-test.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import pandas as pd

from raysim.core.errors import UserError
from raysim.engine.metrics import COLUMNS, SCHEMA
from raysim.core.files import writing

AGGREGATES = ("AVG", "ALL", "AVG_clients", "AVG_weighted")
SELECT_LABELS = {
    "val": "best validation AVG",
    "val_weighted": "best train-size-weighted mean of the clients' validation accuracies (FDSE's code)",
    "test": "best test AVG, which peeks at the test split (the selection DapperFL reports)",
    "final": "the final round",
}


@dataclass
class Summary:
    """One federation's evaluated rounds, reduced to the rounds a table shows."""
    method: str
    domains: list[str]
    rule: str  # eval.select actually applied ("final" when there is no validation split)
    selected_round: int
    selected: dict[str, float]  # domain/AVG/ALL/AVG_clients -> test accuracy at the selected round
    final_round: int
    final: dict[str, float]
    peek_round: int  # the round with the best test AVG (optimistic: it peeks at the test split)
    peek: dict[str, float]
    unadapted: dict[str, float] | None = None  # an unseen client before adaptation, selected round


def summarize(df: pd.DataFrame, method: str = "", rule: str = "val") -> Summary:
    glob = df[(df.client == -1) & (df.metric == "accuracy")]
    test = glob[glob.split == "test"]
    if test.empty:
        raise UserError("metrics hold no test accuracy rows (was anything evaluated?)")
    domains = [d for d in dict.fromkeys(test.domain) if d not in AGGREGATES]
    final_round = int(test["round"].max())

    def best(split: str, domain: str) -> int | None:
        rows = glob[(glob.split == split) & (glob.domain == domain)]
        if rows.empty:
            return None  # earliest round among ties
        return int(rows.sort_values(["value", "round"], ascending=[False, True]).iloc[0]["round"])

    def at(rnd: int, split: str = "test") -> dict[str, float]:
        rows = glob[(glob.split == split) & (glob["round"] == rnd)]
        return {d: float(v) for d, v in zip(rows.domain, rows.value)}

    picks = {"val": lambda: best("val", "AVG"), "val_weighted": lambda: best("val", "AVG_weighted"),
             "test": lambda: best("test", "AVG"), "final": lambda: final_round}
    selected_round = picks[rule]()
    if selected_round is None:
        rule, selected_round = "final", final_round
    peek_round = best("test", "AVG")
    unadapted = at(selected_round, "test_unadapted") or None
    return Summary(method, domains, rule, selected_round, at(selected_round), final_round, at(final_round),
                   peek_round, at(peek_round), unadapted)


# ----------------------------------------------------------------------------- the run's layout

def method_dirs(run_dir: str) -> dict[str, str]:
    """{method: its folder} for a single run or a comparison."""
    if _is_run(run_dir):
        return {_method_of(run_dir): run_dir}
    found = {}
    if os.path.isdir(run_dir):
        for name in sorted(os.listdir(run_dir)):
            if _is_run(os.path.join(run_dir, name)):
                found[name] = os.path.join(run_dir, name)
    listed = _config(run_dir).get("methods") or []  # the config's order: the first is the reference
    order = [m for m in listed if m in found] + [m for m in found if m not in listed]
    return {m: found[m] for m in order}


def _subdirs(d: str, prefix: str) -> dict[str, str]:
    if not os.path.isdir(d):
        return {}
    return {n[len(prefix):]: os.path.join(d, n) for n in sorted(os.listdir(d))
            if n.startswith(prefix) and os.path.isdir(os.path.join(d, n))}


def _holdout_dirs(d: str) -> dict[str, str]:
    return {k: v for k, v in _subdirs(d, "holdout-").items() if os.path.isfile(os.path.join(v, "metrics.parquet"))}


def seed_dirs(d: str) -> dict[int | None, str]:
    """{seed: folder} of a method's folder; {None: d} when it ran one seed."""
    found = {}
    for key, path in _subdirs(d, "seed-").items():
        if key.isdigit() and (os.path.isfile(os.path.join(path, "metrics.parquet")) or _holdout_dirs(path)):
            found[int(key)] = path
    return dict(sorted(found.items())) or {None: d}


def _is_run(d: str) -> bool:
    if os.path.isfile(os.path.join(d, "metrics.parquet")) or _holdout_dirs(d):
        return True
    return None not in seed_dirs(d)


def _config(run_dir: str) -> dict:
    import yaml
    try:
        with open(os.path.join(run_dir, "config.yaml"), encoding="utf-8") as fh:
            raw = yaml.safe_load(fh)
    except (OSError, yaml.YAMLError):
        return {}
    return raw if isinstance(raw, dict) else {}


def _method_of(run_dir: str) -> str:
    raw = _config(run_dir)
    return raw.get("method") or (raw.get("methods") or [None])[0] or os.path.basename(os.path.normpath(run_dir))


def _select_rule(run_dir: str) -> str:
    rule = (_config(run_dir).get("eval") or {}).get("select", "val")
    return rule if rule in SELECT_LABELS else "val"


def _read(d: str) -> pd.DataFrame:
    """A federation's metrics.parquet; a damaged file or one that is not raysim's long format
    (a column missing or of another type) is one UserError line."""
    import pyarrow.parquet as pq

    path = os.path.join(d, "metrics.parquet")
    try:
        table = pq.read_table(path)
    except Exception as err:  # a corrupted or truncated file
        raise UserError(f"cannot read {path}: {str(err).splitlines()[0]}") from None
    missing = [c for c in COLUMNS if c not in table.column_names]
    if missing:
        raise UserError(f"{path} is not a raysim metrics file: it lacks the column(s) {', '.join(missing)} "
                        f"(expected {', '.join(COLUMNS)})")
    try:
        return table.select(list(COLUMNS)).cast(SCHEMA).to_pandas()
    except Exception as err:  # e.g. value stored as text
        raise UserError(f"{path} is not a raysim metrics file: its columns do not convert to "
                        f"{SCHEMA.to_string().replace(chr(10), ', ')} ({str(err).splitlines()[0]})") from None


# ----------------------------------------------------------------------------- numbers -> cells

def _pct(values: list[float]) -> str:
    """One cell: a percentage, or mean ± std over seeds."""
    vals = [100 * v for v in values if v is not None and not math.isnan(v)]
    if not vals or len(vals) < len(values):
        return "–"
    if len(vals) == 1:
        return f"{vals[0]:.2f}"
    return f"{np.mean(vals):.2f} ± {np.std(vals, ddof=1):.2f}"


def _cell(value) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(header: list[str], rows: list[list]) -> str:
    """A Markdown table (pandas' ``to_markdown``, through tabulate); cells are kept as written."""
    return pd.DataFrame([[_cell(v) for v in r] for r in rows], columns=header).to_markdown(index=False, disable_numparse=True)


def _table(rows: dict[str, dict[str, list]], cols: list[str], first: str = "method") -> list[str]:
    return markdown_table([first] + cols, [[name] + [_pct(per_col.get(c, [None])) for c in cols]
                                           for name, per_col in rows.items()]).splitlines()


def paired_comparison(values: dict[str, dict[int, float]], metric: str = "AVG") -> list[str]:
    """Each method against the first: mean of the per-seed differences (points), seeds won, and
    the two-sided paired t-test p-value (scipy.stats.ttest_rel) over the seeds both ran."""
    from scipy import stats
    names = list(values)
    ref = names[0]
    rows = []
    for name in names[1:]:
        seeds = sorted(set(values[name]) & set(values[ref]))
        diffs = np.array([100 * (values[name][s] - values[ref][s]) for s in seeds])
        if not len(diffs):
            continue
        spread = f" ± {np.std(diffs, ddof=1):.2f}" if len(diffs) > 1 else ""
        p = "–"
        if len(diffs) > 1 and np.std(diffs) > 0:
            p = f"{stats.ttest_rel([values[name][s] for s in seeds], [values[ref][s] for s in seeds]).pvalue:.3f}"
        rows.append([name, f"{np.mean(diffs):+.2f}{spread}", f"{int((diffs > 0).sum())}/{len(diffs)}", p])
    return markdown_table(["method", f"{metric} − {ref} (points, mean ± std)", "seeds won", "paired t-test p"],
                          rows).splitlines()


# ----------------------------------------------------------------------------- tables

def _rule_line(summaries: list[Summary]) -> str:
    rules = list(dict.fromkeys(s.rule for s in summaries))
    return "; ".join(SELECT_LABELS[r] for r in rules)


def _seed_note(seeds: list) -> str:
    if len(seeds) <= 1 or seeds == [None]:
        return ""
    return f"; mean ± std over seeds {', '.join(str(s) for s in seeds)}"


def summary_markdown(runs: dict[str, dict], title: str = "") -> str:
    """The per-domain table: ``runs[method][seed] = Summary`` (seed None for a single-seed run)."""
    every = [s for per in runs.values() for s in per.values()]
    seeds = list(dict.fromkeys(k for per in runs.values() for k in per))
    domains = list(dict.fromkeys(d for s in every for d in s.domains))
    differ = any(abs(s.selected.get("AVG_clients", s.selected["AVG"]) - s.selected["AVG"]) > 1e-9
                 or abs(s.final.get("AVG_clients", s.final["AVG"]) - s.final["AVG"]) > 1e-9 for s in every)
    cols = domains + ["AVG", "ALL"] + (["AVG_clients"] if differ else [])
    single = seeds == [None]

    def rows(pick, with_round: bool):
        out = {}
        for name, per in runs.items():
            label = name
            if with_round and single:
                label = f"{name} (round {pick(per[None])[0]})"
            out[label] = {c: [pick(s)[1].get(c) for s in per.values()] for c in cols}
        return out

    out = [f"# {title}".rstrip(), ""] if title else []
    out += ["Test accuracy (%) per domain; AVG = mean over domains (the papers' AVG), ALL = accuracy over all "
            "clients' pooled test samples" + ("; AVG_clients = mean over clients" if differ else "") + ".", ""]
    out += [f"## Selected round: {_rule_line(every)}{_seed_note(seeds)}", ""]
    out += _table(rows(lambda s: (s.selected_round, s.selected), True), cols)
    if not single:
        out += ["", "Selected rounds: " + "; ".join(
            f"{name} " + ", ".join(str(s.selected_round) for s in per.values()) for name, per in runs.items())]
    out += ["", f"## Final round{_seed_note(seeds)}", ""]
    out += _table(rows(lambda s: (s.final_round, s.final), True), cols)
    if any(s.rule != "test" for s in every):
        out += ["", f"## Best test round (peeks at the test split; shown only to compare with papers that select "
                f"this way){_seed_note(seeds)}", ""]
        out += _table(rows(lambda s: (s.peek_round, s.peek), True), cols)
    if not single:
        avg = {name: {k: s.selected["AVG"] for k, s in per.items()} for name, per in runs.items()}
        out += ["", "## AVG per seed (selected round)", ""]
        out += markdown_table(["method"] + [f"seed {k}" for k in seeds],
                              [[name] + [_pct([avg[name].get(k)]) for k in seeds] for name in runs]).splitlines()
        if len(runs) > 1:
            out += ["", f"## Paired comparison with {next(iter(runs))} (AVG at the selected round)", ""]
            out += paired_comparison(avg)
    return "\n".join(out) + "\n"


def lodo_markdown(runs: dict[str, dict], title: str = "") -> str:
    """The FedDG table: ``runs[method][seed][held-out domain] = Summary``; one column per held-out
    domain (accuracy on 100% of it, or its test split) and their mean, Avg."""
    every = [s for per in runs.values() for by_dom in per.values() for s in by_dom.values()]
    seeds = list(dict.fromkeys(k for per in runs.values() for k in per))
    domains = list(dict.fromkeys(d for per in runs.values() for by_dom in per.values() for d in by_dom))
    cols = domains + ["Avg"]

    def values(pick) -> dict[str, dict[int | None, dict[str, float | None]]]:
        out = {}
        for name, per in runs.items():
            out[name] = {}
            for seed, by_dom in per.items():
                accs = {d: (pick(by_dom[d]) or {}).get("ALL") if d in by_dom else None for d in domains}
                known = [a for a in accs.values() if a is not None]
                accs["Avg"] = sum(known) / len(known) if known and len(known) == len(domains) else None
                out[name][seed] = accs
        return out

    def rows(vals):
        return {name: {c: [v[c] for v in per.values()] for c in cols} for name, per in vals.items()}

    out = [f"# {title}".rstrip(), ""] if title else []
    out += ["Leave-one-domain-out: accuracy (%) on each unseen domain; Avg = mean over held-out domains.", ""]
    selected = values(lambda s: s.selected)
    sections = [(f"Selected round: {_rule_line(every)}", selected), ("Final round", values(lambda s: s.final))]
    if any(s.unadapted for s in every):
        sections.append(("Selected round, before the unseen client's label-free adaptation "
                         "(methods that adapt; the others as above)",
                         values(lambda s: s.unadapted or s.selected)))
    if any(s.rule != "test" for s in every):
        sections.append(("Best target round (peeks at the target: the selection some FedDG papers report)",
                         values(lambda s: s.peek)))
    for label, vals in sections:
        out += [f"## {label}{_seed_note(seeds)}", ""] + _table(rows(vals), cols) + [""]
    if len(seeds) > 1 and len(runs) > 1:
        avg = {name: {k: v["Avg"] for k, v in per.items() if v["Avg"] is not None} for name, per in selected.items()}
        out += [f"## Paired comparison with {next(iter(runs))} (Avg at the selected round)", ""]
        out += paired_comparison(avg, "Avg") + [""]
    return "\n".join(out)


# ----------------------------------------------------------------------------- curves

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
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def save_figure(fig, ax, path: str) -> None:
    """Grid, legend, then write the figure atomically (a reader never sees half a PNG)."""
    import matplotlib.pyplot as plt
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def _clock(df: pd.DataFrame) -> pd.Series | None:
    """Simulated seconds elapsed at the end of each round (client profiles' clock), or None."""
    rows = df[(df.split == "clock") & (df.metric == "sim_round_s")].sort_values("round")
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
            clock = _clock(df)
            acc = df[(df.client == -1) & (df.split == "test") & (df.domain == "AVG") & (df.metric == "accuracy")]
            if clock is None or acc.empty:
                continue
            acc = acc.sort_values("round")
            ax.plot(clock.reindex(acc["round"].values).values, 100 * acc.value.values, marker=".",
                    label=name if i == 0 else None, color=f"C{list(panels).index(name) % 10}", alpha=0.85)
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("test AVG (%)")
    save_figure(fig, ax, path)


# ----------------------------------------------------------------------------- render

def _method_sections(run_dir: str) -> str:
    """What the method itself adds to the summary (its ``report_markdown`` hook)."""
    from raysim.methods import registry
    try:
        cls = registry.get(_method_of(run_dir))
    except UserError:  # a folder named after no method of this build
        return ""
    text = cls.report_markdown(run_dir)
    return f"\n{text.rstrip()}\n" if text else ""


def _exchanges(dirs: dict[str, str]) -> str:
    """Which methods of the run send data-derived statistics between clients, and what."""
    from raysim.methods import registry
    lines = []
    for name in dirs:
        try:
            what = registry.get(name).exchanges
        except UserError:
            continue
        if what:
            lines.append(f"- {name}: {what}")
    if not lines:
        return ""
    return "\n## Data-derived statistics exchanged between clients\n\n" + "\n".join(lines) + "\n"


def _beside_paper(run_dir: str) -> str:
    """The published numbers of the config's ``paper:`` section beside ours, as ``raysim compare``
    shows them (Δ = ours − paper)."""
    paper = _config(run_dir).get("paper")
    if not (isinstance(paper, dict) and paper.get("metrics")):
        return ""
    from raysim.app.compare import label_entries, compare_markdown, load
    entries = load(run_dir)
    label_entries(entries)
    md = compare_markdown(entries)[0]
    body = [ln for ln in md.splitlines() if not ln.startswith(("# Comparison", "Runs: "))]
    return "\n## Beside the published numbers\n\n" + "\n".join(body).strip() + "\n"


def render(run_dir: str) -> str:
    """(Re-)write summary.md and curves.png of a run directory; return the summary text."""
    dirs = method_dirs(run_dir)
    if not dirs:
        raise UserError(f"no metrics.parquet found in {run_dir} or its method folders")
    title = os.path.basename(os.path.normpath(run_dir))
    panels: dict[str, list[pd.DataFrame]] = {}
    runs: dict[str, dict] = {}
    lodo = False
    for name, d in dirs.items():
        runs[name] = {}
        for seed, sd in seed_dirs(d).items():
            holdouts = _holdout_dirs(sd)
            if holdouts:
                lodo = True
                runs[name][seed] = {}
                for dom, hd in holdouts.items():  # each federation's own config says its eval.select
                    df = _read(hd)
                    panels.setdefault(f"{name} / {dom}", []).append(df)
                    runs[name][seed][dom] = summarize(df, name, _select_rule(hd))
            else:
                df = _read(sd)
                panels.setdefault(name, []).append(df)
                runs[name][seed] = summarize(df, name, _select_rule(sd))
    if lodo:
        text = lodo_markdown(runs, title)
    else:
        text = summary_markdown(runs, title)
        text += "".join(_method_sections(next(iter(seed_dirs(d).values()))) for d in dirs.values())
    text += _exchanges(dirs) + _beside_paper(run_dir)
    summary = os.path.join(run_dir, "summary.md")
    with writing(summary):
        with open(summary + ".tmp", "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(summary + ".tmp", summary)
    with writing(os.path.join(run_dir, "curves.png")):
        plot_curves(panels, os.path.join(run_dir, "curves.png"))
    if any(_clock(df) is not None for frames in panels.values() for df in frames):
        with writing(os.path.join(run_dir, "curves_time.png")):
            plot_time_curves(panels, os.path.join(run_dir, "curves_time.png"))
    return text
