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

import os

import numpy as np
import pandas as pd

from raysim.app import rundir
from raysim.app.compare import beside_paper
from raysim.app.plots import plot_curves, plot_time_curves, sim_clock
from raysim.app.tables import SELECT_LABELS, Summary, markdown_table, pct, select_rule, summarize
from raysim.core.errors import UserError
from raysim.core.files import write_text


# ----------------------------------------------------------------------------- statistics

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

def _table(rows: dict[str, dict[str, list]], cols: list[str], first: str = "method") -> list[str]:
    return markdown_table([first] + cols, [[name] + [pct(per_col.get(c, [None])) for c in cols]
                                           for name, per_col in rows.items()]).splitlines()


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
                              [[name] + [pct([avg[name].get(k)]) for k in seeds] for name in runs]).splitlines()
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



# ----------------------------------------------------------------------------- render

def method_section(folder: str, metrics: pd.DataFrame) -> str:
    """What the method itself adds to the summary: its ``report_markdown(config, metrics)`` hook,
    given the federation's config and metrics as :mod:`raysim.app.rundir` reads them."""
    from raysim.methods import registry
    try:
        cls = registry.get(rundir.method_of(folder))
    except UserError:  # a folder named after no method of this build
        return ""
    text = cls.report_markdown(rundir.read_config(folder), metrics)
    return f"\n{text.rstrip()}\n" if text else ""


def _exchanges(dirs: dict[str, str]) -> str:
    """Which methods of the run send data-derived statistics between clients, and what."""
    from raysim.methods import registry
    lines = []
    for name, folder in dirs.items():
        try:
            what = registry.get(rundir.method_of(folder)).exchanges  # the folder's method (a plugin's spec)
        except UserError:
            continue
        if what:
            lines.append(f"- {name}: {what}")
    if not lines:
        return ""
    return "\n## Data-derived statistics exchanged between clients\n\n" + "\n".join(lines) + "\n"


def render(run_dir: str) -> str:
    """(Re-)write summary.md and curves.png of a run directory; return the summary text."""
    dirs = rundir.method_dirs(run_dir)
    if not dirs:
        raise UserError(f"no metrics.parquet found in {run_dir} or its method folders")
    title = os.path.basename(os.path.normpath(run_dir))
    panels: dict[str, list[pd.DataFrame]] = {}
    runs: dict[str, dict] = {}
    first: dict[str, tuple[str, pd.DataFrame]] = {}  # method -> (folder, metrics) of its first seed
    lodo = False
    for name, d in dirs.items():
        runs[name] = {}
        for seed, sd in rundir.seed_dirs(d).items():
            holdouts = rundir.holdout_dirs(sd)
            if holdouts:
                lodo = True
                runs[name][seed] = {}
                for dom, hd in holdouts.items():  # each federation's own config says its eval.select
                    df = rundir.read_metrics(hd)
                    panels.setdefault(f"{name} / {dom}", []).append(df)
                    runs[name][seed][dom] = summarize(df, name, select_rule(hd))
            else:
                df = rundir.read_metrics(sd)
                panels.setdefault(name, []).append(df)
                runs[name][seed] = summarize(df, name, select_rule(sd))
                first.setdefault(name, (sd, df))
    if lodo:
        text = lodo_markdown(runs, title)
    else:
        text = summary_markdown(runs, title)
        text += "".join(method_section(*first[name]) for name in dirs)
    text += _exchanges(dirs) + beside_paper(run_dir)
    write_text(os.path.join(run_dir, "summary.md"), text)
    plot_curves(panels, os.path.join(run_dir, "curves.png"))
    if any(sim_clock(df) is not None for frames in panels.values() for df in frames):
        plot_time_curves(panels, os.path.join(run_dir, "curves_time.png"))
    return text
