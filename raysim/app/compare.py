"""``raysim compare RUN_DIR...``: one table across any set of run directories.

A run directory is what ``raysim run`` writes (listed back by :mod:`raysim.app.rundir`): one federation
(``metrics.parquet``), or ``[<method>/][seed-<s>/][holdout-<domain>/]metrics.parquet``. Every
federation is reduced by :func:`raysim.app.tables.summarize` at the round its own config's
``eval.select`` picks, exactly as ``summary.md`` does; cells are test accuracy (%), mean ± std
(ddof 1) when seeds repeat. Rows are methods (``--by method``; a method found in several run
directories is labelled with its run, ``fdse (abl_local)``), or (method, seed) with ``--by seed``.
Leave-one-domain-out runs get one column per held-out domain (accuracy on it, ``ALL``) and their
mean, Avg; ``--by holdout`` shows only such runs. Where a run's config has a ``paper:`` section
(``{source, dataset, metrics: {AVG: {method: [mean, std]}, ...}}``) the published AVG (and ALL)
stand beside ours with the difference, Δ = ours − paper, in points; summary.md ends with the same
table (:func:`beside_paper`).

Rows say what ran (``fedavg + server adam``), and a line above the table says where the runs are
not like for like: another dataset, partition, protocol or number of rounds (they are shown, not
refused: a comparison across datasets is sometimes the point).

``--out DIR`` writes compare.md, compare.csv and compare.png (test AVG against rounds, one line per
row, a ± std band over seeds); the Markdown is printed either way.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from raysim.app.plots import save_figure, sim_clock
from raysim.app.rundir import (config_dict, failed_federations, holdout_dirs, method_dirs, read_metrics, seed_dirs,
                               unfinished_line)
from raysim.app.tables import (AGGREGATES, SELECT_LABELS, Ran, Summary, first_federation, markdown_table,
                                partition_text, pct, ran, select_rule, summarize)
from raysim.core.errors import UserError
from raysim.core.files import write_atomically, write_text


@dataclass
class Entry:
    """One method of one run directory: its federations' summaries and metrics, per seed."""
    run_dir: str
    method: str
    lodo: bool
    summaries: dict = field(default_factory=dict)  # seed -> Summary, or seed -> {held-out domain: Summary}
    frames: dict = field(default_factory=dict)  # seed -> DataFrame, or seed -> {held-out domain: DataFrame}
    paper: dict = field(default_factory=dict)
    label: str = ""
    folder: str = ""  # its folder in the run directory (the run directory itself for one federation)
    ran: Ran | None = None  # what it ran (its first federation's config.yaml)


def _paper(run_dir: str, method_dir: str) -> dict:
    """The ``paper:`` section of the run's config.yaml, else of the method's first federation."""
    for d in (run_dir, method_dir, *seed_dirs(method_dir).values()):
        paper = config_dict(d).get("paper")
        if isinstance(paper, dict) and paper.get("metrics"):
            return paper
    return {}


def load(run_dir: str) -> list[Entry]:
    """Every method of a run directory, summarized at each federation's selected round."""
    if not os.path.isdir(run_dir):
        raise UserError(f"not a run directory: {run_dir} (no such folder)")
    dirs = method_dirs(run_dir)
    if not dirs:
        raise UserError(f"not a run directory: no metrics.parquet in {run_dir} or its "
                        f"<method>/[seed-<s>/][holdout-<domain>/] folders")
    entries = []
    for name, d in dirs.items():
        seeds = seed_dirs(d)
        lodo = any(holdout_dirs(sd) for sd in seeds.values())
        e = Entry(run_dir, name, lodo, paper=_paper(run_dir, d), folder=d, ran=ran(d))
        for seed, sd in seeds.items():
            holdouts = holdout_dirs(sd)
            if lodo:
                e.frames[seed] = {dom: read_metrics(hd) for dom, hd in holdouts.items()}
                e.summaries[seed] = {dom: summarize(df, name, select_rule(hd))
                                     for (dom, hd), df in zip(holdouts.items(), e.frames[seed].values())}
            else:
                if not os.path.isfile(os.path.join(sd, "metrics.parquet")):
                    raise UserError(f"no metrics.parquet in {sd}")
                e.frames[seed] = read_metrics(sd)
                e.summaries[seed] = summarize(e.frames[seed], name, select_rule(sd))
        entries.append(e)
    return entries


def label_entries(entries: list[Entry]) -> None:
    """``fdse``, or ``fdse (abl_local)`` when several run directories hold fdse; a row says what
    ran (``fedavg + server adam``: :attr:`raysim.app.tables.Ran.label`)."""
    runs = list(dict.fromkeys(e.run_dir for e in entries))
    bases = [os.path.basename(os.path.normpath(r)) for r in runs]
    short = {r: (b if bases.count(b) == 1 else os.path.normpath(r)) for r, b in zip(runs, bases)}
    shown = {id(e): e.ran.label if e.ran is not None else e.method for e in entries}
    count = {}
    for e in entries:
        count[shown[id(e)]] = count.get(shown[id(e)], 0) + 1
    for e in entries:
        e.label = shown[id(e)] if count[shown[id(e)]] == 1 else f"{shown[id(e)]} ({short[e.run_dir]})"


# ----------------------------------------------------------------------------- like for like

def _setup(e: Entry) -> dict[str, str]:
    """What must match for two rows to be compared: dataset, partition, protocol and rounds (its
    first federation's config.yaml)."""
    raw = config_dict(first_federation(e.folder))
    data, ev = raw.get("data") or {}, raw.get("eval") or {}
    protocol = str(ev.get("protocol", "personalized"))
    if protocol == "lodo":
        protocol += f", target {(data.get('partition') or {}).get('target_test', 'all')}"
    return {"dataset": str(data.get("dataset", "?")), "partition": partition_text(data.get("partition")),
            "protocol": protocol, "rounds": str(raw.get("rounds", "?"))}


def unlike(entries: list[Entry]) -> str:
    """One line saying in what the rows differ (dataset, partition, protocol, rounds) and which
    rows have which; "" when they are like for like."""
    setups = {e.label: _setup(e) for e in entries}
    parts = []
    for key in ("dataset", "partition", "protocol", "rounds"):
        by_value: dict[str, list[str]] = {}
        for label, setup in setups.items():
            by_value.setdefault(setup[key], []).append(label)
        if len(by_value) > 1:
            shown = "; ".join(f"{value}: {', '.join(rows)}" for value, rows in by_value.items())
            parts.append(f"{key} ({shown})")
    if not parts:
        return ""
    return ("**Not like for like:** these rows differ in " + ", ".join(parts)
            + "; their accuracies are not comparable as they stand.")


# ----------------------------------------------------------------------------- values

def _values(e: Entry, seed) -> dict[str, float | None]:
    """{column: accuracy (fraction)} of one seed of an entry at its selected round(s)."""
    s = e.summaries[seed]
    if not e.lodo:
        return {k: v for k, v in s.selected.items() if k in s.domains or k in ("AVG", "ALL")}
    out = {dom: summ.selected.get("ALL") for dom, summ in s.items()}
    known = [v for v in out.values() if v is not None]
    out["Avg"] = sum(known) / len(known) if known and len(known) == len(out) else None
    return out


def _rounds(e: Entry, seeds: list) -> tuple[str, str]:
    """(the selection rule(s), the selected rounds) of the given seeds."""
    summ: list[Summary] = []
    for seed in seeds:
        s = e.summaries[seed]
        summ += list(s.values()) if e.lodo else [s]
    rules = "; ".join(dict.fromkeys(x.rule for x in summ))
    return rules, ", ".join(str(x.selected_round) for x in summ)


@dataclass
class Row:
    label: str
    entry: Entry
    seeds: list
    values: dict[str, list]  # column -> one fraction (or None) per seed


def _rows(entries: list[Entry], by: str) -> list[Row]:
    rows = []
    for e in entries:
        per_seed = {seed: _values(e, seed) for seed in e.summaries}
        cols = list(dict.fromkeys(c for v in per_seed.values() for c in v))
        if by == "seed":
            for seed, v in per_seed.items():
                label = e.label if seed is None else f"{e.label} seed {seed}"
                rows.append(Row(label, e, [seed], {c: [v.get(c)] for c in cols}))
        else:
            rows.append(Row(e.label, e, list(per_seed), {c: [v.get(c) for v in per_seed.values()] for c in cols}))
    return rows


def _mean_std(values: list) -> tuple[float | None, float | None]:
    vals = [100 * v for v in values if v is not None and not math.isnan(v)]
    if not vals or len(vals) < len(values):
        return None, None
    return float(np.mean(vals)), (float(np.std(vals, ddof=1)) if len(vals) > 1 else None)


def _paper_figure(e: Entry, metric: str) -> tuple[float | None, float | None]:
    """(mean, std) the paper reports for this entry's method, in %; ``Avg`` reads ``AVG`` too."""
    metrics = e.paper.get("metrics") or {}
    per = metrics.get(metric) or (metrics.get("AVG") or metrics.get("Avg") if metric in ("AVG", "Avg") else None)
    fig = (per or {}).get(e.method)
    if fig is None:
        return None, None
    fig = list(fig) if isinstance(fig, (list, tuple)) else [fig]
    try:
        mean = float(fig[0])
    except (TypeError, ValueError, IndexError):
        return None, None
    std = fig[1] if len(fig) > 1 and isinstance(fig[1], (int, float)) else None
    return mean, (float(std) if std is not None else None)


def _fmt(mean, std) -> str:
    if mean is None:
        return "–"
    return f"{mean:.2f}" + (f" ± {std:.2f}" if std is not None else "")


# ----------------------------------------------------------------------------- tables

def _table(rows: list[Row], lodo: bool) -> tuple[str, pd.DataFrame, list[str]]:
    """(Markdown table, CSV frame, notes) of rows of one kind (standard or leave-one-domain-out)."""
    cols = list(dict.fromkeys(c for r in rows for c in r.values if c not in AGGREGATES and c != "Avg"))
    cols += ["Avg"] if lodo else ["AVG", "ALL"]
    avg = "Avg" if lodo else "AVG"
    paper_metrics = [m for m in (avg, "ALL") if m in cols
                     and any(_paper_figure(r.entry, m)[0] is not None for r in rows)]
    header = ["method"] + cols
    for m in paper_metrics:
        header += [f"paper {m}", f"Δ {m}"]
    header += ["seeds", "selected round"]
    md_rows, csv_rows = [], []
    for r in rows:
        cells = [r.label] + [pct(r.values.get(c, [None] * len(r.seeds))) for c in cols]
        rec = {"row": r.label, "method": r.entry.method, "run": r.entry.run_dir,
               "seeds": ";".join("" if s is None else str(s) for s in r.seeds), "n_seeds": len(r.seeds)}
        for c in cols:
            rec[c], rec[f"{c} std"] = _mean_std(r.values.get(c, [None] * len(r.seeds)))
        for m in paper_metrics:
            pm, ps = _paper_figure(r.entry, m)
            ours = rec[m]
            delta = ours - pm if ours is not None and pm is not None else None
            cells += [_fmt(pm, ps), "–" if delta is None else f"{delta:+.2f}"]
            rec[f"paper {m}"], rec[f"paper {m} std"], rec[f"Δ {m}"] = pm, ps, delta
        # per-domain figures of the paper, in the CSV only
        for c in cols:
            if c not in paper_metrics:
                pm, ps = _paper_figure(r.entry, c)
                if pm is not None:
                    rec[f"paper {c}"], rec[f"paper {c} std"] = pm, ps
        rule, rounds = _rounds(r.entry, r.seeds)
        cells += [", ".join("–" if s is None else str(s) for s in r.seeds), f"{rule}: {rounds}"]
        rec["select"], rec["selected rounds"] = rule, rounds
        md_rows.append(cells)
        csv_rows.append(rec)
    notes = []
    for e in dict.fromkeys(r.entry.run_dir for r in rows):
        paper = next((r.entry.paper for r in rows if r.entry.run_dir == e and r.entry.paper), None)
        if paper and paper_metrics:
            what = paper.get("source") or "the paper"
            notes.append(f"paper figures for {os.path.basename(os.path.normpath(e))}: {what}"
                         + (f" ({paper['dataset']})" if paper.get("dataset") else ""))
    return markdown_table(header, md_rows), pd.DataFrame(csv_rows), notes


def compare_markdown(entries: list[Entry], by: str = "method") -> tuple[str, pd.DataFrame, list[Row]]:
    if by == "holdout":
        entries = [e for e in entries if e.lodo]
        if not entries:
            raise UserError("--by holdout needs leave-one-domain-out runs (holdout-<domain>/ folders); "
                            "none of the given run directories has one")
    rows = _rows(entries, by)
    rules = list(dict.fromkeys(x.rule for e in entries for s in e.summaries.values()
                               for x in (s.values() if e.lodo else [s])))
    multi = any(len(r.seeds) > 1 for r in rows)
    differ = unlike(entries)
    failed = [f"{os.path.join(run, folder)} ({line})" for run in dict.fromkeys(e.run_dir for e in entries)
              for folder, line in failed_federations(run)]
    left_out = ["Left out, their method raised (see each folder's error.txt): " + "; ".join(failed), ""] if failed else []
    unfinished = unfinished_line(list(dict.fromkeys(e.run_dir for e in entries)))
    left_out += [unfinished, ""] if unfinished else []
    out = ["# Comparison", "",
           "Runs: " + ", ".join(dict.fromkeys(e.run_dir for e in entries)), ""] + ([differ, ""] if differ else []) + left_out + [
           f"Test accuracy (%) at each federation's selected round ({'; '.join(SELECT_LABELS[r] for r in rules)})"
           + ("; mean ± std over seeds (ddof 1)" if multi else "") + "."]
    frames = []
    for lodo in (False, True):
        part = [r for r in rows if r.entry.lodo == lodo]
        if not part:
            continue
        table, frame, notes = _table(part, lodo)
        explain = ("Leave-one-domain-out: accuracy on each held-out domain; Avg = their mean."
                   if lodo else "AVG = mean over domains, ALL = all clients' pooled test samples.")
        if any(_paper_figure(r.entry, "AVG")[0] is not None or _paper_figure(r.entry, "Avg")[0] is not None
               for r in part):
            explain += " Δ = ours − paper (points)."
        out += ["", explain, "", table]
        out += [""] + [f"- {n}" for n in notes] if notes else []
        frames.append(frame.assign(kind="lodo" if lodo else "standard"))
    return "\n".join(out) + "\n", pd.concat(frames, ignore_index=True), rows


def beside_paper(run_dir: str) -> str:
    """summary.md's section: the published numbers of the config's ``paper:`` section beside ours,
    as ``raysim compare`` shows them (Δ = ours − paper); "" without a ``paper:`` section."""
    paper = config_dict(run_dir).get("paper")
    if not (isinstance(paper, dict) and paper.get("metrics")):
        return ""
    entries = load(run_dir)
    label_entries(entries)
    md = compare_markdown(entries)[0]
    body = [ln for ln in md.splitlines() if not ln.startswith(("# Comparison", "Runs: "))]
    return "\n## Beside the published numbers\n\n" + "\n".join(body).strip() + "\n"


# ----------------------------------------------------------------------------- curves

def _avg_curve(e: Entry, seed) -> pd.Series | None:
    """Test AVG per round of one federation (lodo: the mean over held-out domains of ALL)."""
    def series(df: pd.DataFrame, domain: str) -> pd.Series:
        rows = df[(df.client == -1) & (df.metric == "accuracy") & (df.split == "test") & (df.domain == domain)]
        return rows.groupby("round")["value"].mean()

    frames = e.frames[seed]
    if not e.lodo:
        s = series(frames, "AVG")
        return s if len(s) else None
    parts = [series(df, "ALL") for df in frames.values()]
    if not parts or any(not len(p) for p in parts):
        return None
    return pd.concat(parts, axis=1, join="inner").mean(axis=1)


def plot_compare(rows: list[Row], path: str) -> None:
    """Test AVG against rounds, one line per row; the mean with a ± std band over seeds."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for i, r in enumerate(rows):
        curves = [c for c in (_avg_curve(r.entry, s) for s in r.seeds) if c is not None]
        if not curves:
            continue
        table = pd.concat(curves, axis=1, join="inner")
        mean = 100 * table.mean(axis=1)
        color = f"C{i % 10}"
        ax.plot(mean.index, mean.values, label=r.label + (f" ({len(curves)} seeds)" if len(curves) > 1 else ""),
                color=color, marker="o" if len(mean) <= 3 else None, linewidth=1.8)
        if len(curves) > 1:
            std = 100 * table.std(axis=1, ddof=1).fillna(0.0)
            ax.fill_between(mean.index, (mean - std).values, (mean + std).values, color=color, alpha=0.15)
    ax.set_xlabel("round")
    ax.set_ylabel("test AVG (%)" + (" / held-out Avg" if any(r.entry.lodo for r in rows) else ""))
    save_figure(fig, ax, path)


def plot_compare_time(rows: list[Row], path: str) -> bool:
    """Test AVG against simulated hours (client profiles' clock), one line per seed, a colour per
    row: where rounds are server steps of different lengths (buffered schedules, deadlines) the
    time axis is the fair one. False (nothing drawn) where no federation has a clock."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    drawn = False
    for i, r in enumerate(rows):
        if r.entry.lodo:
            continue
        for j, seed in enumerate(r.seeds):
            clock, curve = sim_clock(r.entry.frames[seed]), _avg_curve(r.entry, seed)
            if clock is None or curve is None:
                continue
            hours = clock.reindex(curve.index).to_numpy() / 3600
            ax.plot(hours, 100 * curve.to_numpy(), color=f"C{i % 10}", linewidth=1.4, alpha=0.85,
                    label=r.label + (f" ({len(r.seeds)} seeds)" if len(r.seeds) > 1 else "") if j == 0 else None)
            drawn = True
    if drawn:
        ax.set_xlabel("simulated hours")
        ax.set_ylabel("test AVG (%)")
        save_figure(fig, ax, path)
    else:
        plt.close(fig)
    return drawn


# ----------------------------------------------------------------------------- the command

def compare(run_dirs: list[str], by: str = "method", out: str | None = None) -> str:
    """The Markdown table; with ``out``, also compare.md, compare.csv and compare.png there."""
    if by not in ("method", "seed", "holdout"):
        raise UserError(f"--by {by!r}: expected method, seed or holdout")
    entries = [e for d in dict.fromkeys(os.path.normpath(d) for d in run_dirs) for e in load(d)]
    label_entries(entries)
    text, frame, rows = compare_markdown(entries, by)
    if out:
        try:
            os.makedirs(out, exist_ok=True)
        except OSError as err:
            raise UserError(f"cannot create --out folder {out}: {err.strerror or err}") from None
        write_text(os.path.join(out, "compare.md"), text)
        write_atomically(os.path.join(out, "compare.csv"), lambda tmp: frame.to_csv(tmp, index=False))
        plot_compare(rows, os.path.join(out, "compare.png"))
        timed = plot_compare_time(rows, os.path.join(out, "compare_time.png"))
        text += (f"\nwritten: {os.path.join(out, 'compare.md')}, compare.csv, compare.png"
                 + (", compare_time.png" if timed else "") + "\n")
    return text
