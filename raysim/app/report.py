"""Render a run's summary table (the papers' shapes) and accuracy curves from metrics.parquet.

A run directory is ``[<method>/][seed-<s>/][holdout-<domain>/]metrics.parquet``: one folder per
method of a comparison, per seed of a multi-seed run, per held-out domain of leave-one-domain-out.

summary.md opens with what ran (:func:`what_ran`: the data, participation and protocol, and per
federation its method, hyperparameters off their defaults, server optimizer and selection); a row
is labelled with what ran (``fedavg + server adam``). The headline is the round that
``eval.select`` picks in each federation (best validation AVG by default); the final round is
always shown beside it, and the best *test* round only labelled as the selection that peeks at the
test split; where those rounds coincide in every federation, one table says so. AVG is the mean
over domains (the papers' AVG); the clients' mean, AVG_clients, is shown beside it wherever the two differ. Over several seeds every
cell is mean ± std (sample standard deviation, ddof 1), and each method is compared with the first
one listed: the mean of the per-seed differences, how many seeds it wins and a paired t-test.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import pandas as pd

from raysim.app import rundir
from raysim.app.compare import beside_paper
from raysim.app.plots import plot_curves, plot_time_curves, sim_clock
from raysim.app.tables import (SELECT_LABELS, Ran, Summary, data_text, markdown_table, participation_text, pct,
                                protocol_text, ran, select_rule, summarize, value_text)
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


def _coinciding(sections: list[tuple[str, str, object]], every: list[Summary]) -> list[list[int]]:
    """Groups of ``sections`` (title, short name, round of a Summary) whose rounds are the same in
    every federation: their tables would be the same table."""
    groups: list[list[int]] = []
    for i, (_, _, round_of) in enumerate(sections):
        same = next((g for g in groups if all(round_of(s) == sections[g[0]][2](s) for s in every)), None)
        if same is None:
            groups.append([i])
        else:
            same.append(i)
    return groups


def _group_title(sections, group: list[int]) -> str:
    title = sections[group[0]][0]
    if len(group) == 1:
        return title
    also = [sections[i][1] for i in group[1:]]
    return f"{title}; here also {' and '.join(also)} (the rounds coincide in every federation)"


def summary_markdown(runs: dict[str, dict], title: str = "", header: list[str] | None = None) -> str:
    """The per-domain table: ``runs[row][seed] = Summary`` (seed None for a single-seed run);
    ``header``: the lines that say what ran (:func:`what_ran`). Where the selected, final and best
    test rounds are the same round in every federation, their tables are one."""
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
    out += header or []
    out += ["Test accuracy (%) per domain; AVG = mean over domains (the papers' AVG), ALL = accuracy over all "
            "clients' pooled test samples" + ("; AVG_clients = mean over clients" if differ else "") + ".", ""]
    sections = [(f"Selected round: {_rule_line(every)}", "the selected round", lambda s: s.selected_round),
                ("Final round", "the final round", lambda s: s.final_round)]
    if any(s.rule != "test" for s in every):
        sections.append(("Best test round (peeks at the test split; shown only to compare with papers that select "
                         "this way)", "the best test round", lambda s: s.peek_round))
    picks = [lambda s: (s.selected_round, s.selected), lambda s: (s.final_round, s.final),
             lambda s: (s.peek_round, s.peek)]
    for n, group in enumerate(_coinciding(sections, every)):
        out += ([""] if n else []) + [f"## {_group_title(sections, group)}{_seed_note(seeds)}", ""]
        out += _table(rows(picks[group[0]], True), cols)
        if group[0] == 0 and not single:
            out += ["", "Selected rounds: " + "; ".join(
                f"{name} " + ", ".join(str(s.selected_round) for s in per.values()) for name, per in runs.items())]
    if not single:
        avg = {name: {k: s.selected["AVG"] for k, s in per.items()} for name, per in runs.items()}
        out += ["", "## AVG per seed (selected round)", ""]
        out += markdown_table(["method"] + [f"seed {k}" for k in seeds],
                              [[name] + [pct([avg[name].get(k)]) for k in seeds] for name in runs]).splitlines()
        if len(runs) > 1:
            out += ["", f"## Paired comparison with {next(iter(runs))} (AVG at the selected round)", ""]
            out += paired_comparison(avg)
    return "\n".join(out) + "\n"


def lodo_markdown(runs: dict[str, dict], title: str = "", header: list[str] | None = None) -> str:
    """The FedDG table: ``runs[row][seed][held-out domain] = Summary``; one column per held-out
    domain (accuracy on 100% of it, or its test split) and their mean, Avg. The selected, final
    and best target rounds' tables are one where those rounds coincide in every federation."""
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
    out += header or []
    out += ["Leave-one-domain-out: accuracy (%) on each unseen domain; Avg = mean over held-out domains.", ""]
    selected = values(lambda s: s.selected)
    rounds = [(f"Selected round: {_rule_line(every)}", "the selected round", lambda s: s.selected_round),
              ("Final round", "the final round", lambda s: s.final_round)]
    picks = [selected, values(lambda s: s.final)]
    if any(s.rule != "test" for s in every):
        rounds.append(("Best target round (peeks at the target: the selection some FedDG papers report)",
                       "the best target round", lambda s: s.peek_round))
        picks.append(values(lambda s: s.peek))
    sections = [(_group_title(rounds, g), picks[g[0]]) for g in _coinciding(rounds, every)]
    if any(s.unadapted for s in every):
        sections.insert(1, ("Selected round, before the unseen client's label-free adaptation "
                            "(methods that adapt; the others as above)", values(lambda s: s.unadapted or s.selected)))
    for label, vals in sections:
        out += [f"## {label}{_seed_note(seeds)}", ""] + _table(rows(vals), cols) + [""]
    if len(seeds) > 1 and len(runs) > 1:
        avg = {name: {k: v["Avg"] for k, v in per.items() if v["Avg"] is not None} for name, per in selected.items()}
        out += [f"## Paired comparison with {next(iter(runs))} (Avg at the selected round)", ""]
        out += paired_comparison(avg, "Avg") + [""]
    return "\n".join(out)


def what_ran(rans: list[Ran]) -> list[str]:
    """summary.md's opening: the data, rounds, seeds, participation and protocol (as the first
    federation's config.yaml records them), then each entry's method, hyperparameters off their
    defaults, server optimizer and selection, and the settings it has unlike the first."""
    first = rans[0]
    out = ["## What ran", ""]
    cfg = first.config
    if cfg is not None:
        seeds = list(rundir.seed_dirs(first.entry_dir))
        seeds = f"seeds {', '.join(str(k) for k in seeds)}" if seeds != [None] else f"seed {cfg.seed}"
        out += [f"- data: {data_text(cfg)}", f"- rounds: {cfg.rounds}; {seeds}",
                f"- participation: {participation_text(first.folder, cfg)}",
                f"- protocol: {protocol_text(cfg, rans)}"]
    for r in rans:
        out.append(f"- **{r.label}**: {_federation_text(r, first)}")
    return out + [""]


def _federation_text(r: Ran, first: Ran) -> str:
    from raysim.app.rundir import config_differences
    what = [f"method {r.method}" + (f" (variant {r.variant})" if r.variant else "")]
    if r.cls is None or r.config is None:
        return what[0] + " (its method does not import here: settings not shown)"
    defaults = "none" if not dataclasses.fields(r.cls.Hparams) else "the method's defaults"
    what.append("hyperparameters: " + ("; ".join(r.hparams) if r.hparams else defaults))
    what.append(f"server: {r.server}")
    what.append(f"selection: {r.selection}")
    if r is not first and first.config is not None:  # what a variant or per_method sets apart from the first
        skip = ("method", "variant", "hp", "server", "seed", "name", "tracking", "checkpoint", "runtime", "paper")
        own = [f"{k} {value_text(b)}" for k, a, b in config_differences(
            first.config.to_dict(), r.config.to_dict(), skip=skip) if k != "data.partition.holdout"]
        if own:
            what.append("unlike the first: " + ", ".join(own))
    return "; ".join(what)


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


def privacy_section(panels: dict[str, list[pd.DataFrame]]) -> str:
    """The privacy each federation spent (raysim.core.stages): ε after its last round at its δ, the
    noise multiplier z and the clip C of its last round; one line per row, its seeds' values
    joined where they differ (a seed that stopped early, an adaptive clip)."""
    rows = []
    for row, frames in panels.items():
        seen = []
        for df in frames:
            server = df[(df.split == "server") & df.metric.isin(["epsilon", "noise_multiplier", "clip"])]
            if "epsilon" not in set(server.metric):
                continue
            last = server[server["round"] == server["round"].max()].set_index("metric").value
            seen.append([str(int(server["round"].max())), f"{last['epsilon']:.3g}", f"{last['noise_multiplier']:.4g}",
                         f"{last.get('clip', float('nan')):.4g}"])
        if seen:
            rows.append([row] + [", ".join(dict.fromkeys(cells)) for cells in zip(*seen)])
    if not rows:
        return ""
    return ("\n## Privacy spent\n\nClient-level (ε, δ)-DP of each federation after its last round (dp-accounting; "
            "δ as configured, 1/N by default), its noise multiplier z and clip norm C (seeds' values joined where "
            "they differ):\n\n" + markdown_table(["federation", "rounds", "ε", "z", "C"], rows) + "\n")


def _failed_section(failed: list[tuple[str, str]]) -> str:
    """The federations left out of the tables because their method raised."""
    if not failed:
        return ""
    lines = [f"- {folder}: {line} (traceback in {folder}/error.txt)" for folder, line in failed]
    return "\n## Failed, not in the tables (the method raised)\n\n" + "\n".join(lines) + "\n"


def time_section(panels: dict[str, list[pd.DataFrame]]) -> str:
    """summary.md's simulated-time table (runs with client profiles): each row's simulated hours
    and the rounds and hours it took to reach the first row's final test AVG (mean over seeds; the
    target is fixed by that row, whatever the others do); "" without a clock."""
    curves = {}
    for name, frames in panels.items():
        for df in frames:
            clock = sim_clock(df)
            acc = df[(df.client == -1) & (df.split == "test") & (df.domain == "AVG") & (df.metric == "accuracy")]
            if clock is not None and not acc.empty:
                acc = acc.sort_values("round")
                curves.setdefault(name, []).append((acc["round"].to_numpy(), clock.reindex(acc["round"]).to_numpy(),
                                                    100 * acc.value.to_numpy(), float(clock.iloc[-1])))
    if not curves:
        return ""
    reference = next(iter(curves))
    target = float(np.mean([c[2][-1] for c in curves[reference]]))
    rows = []
    for name, seeds in curves.items():
        reached = [(int(r[i]), t[i]) for r, t, a, _ in seeds for i in [int(np.argmax(a >= target))] if (a >= target).any()]
        hours = [end / 3600 for *_, end in seeds]
        rows.append([name, f"{np.mean(hours):.4g}", f"{np.mean([c[2][-1] for c in seeds]):.2f}",
                     f"{np.mean([r for r, _ in reached]):.0f}" if reached else "–",
                     f"{np.mean([t for _, t in reached]) / 3600:.4g}" if reached else "–",
                     f"{len(reached)}/{len(seeds)}"])
    table = markdown_table(["federation", "simulated hours", "final test AVG", "rounds to target",
                            "simulated hours to target", "seeds reaching it"], rows)
    return (f"\n## Simulated time\n\nThe clock of the client profiles (a buffered schedule's rounds are server "
            f"steps). Target: {reference}'s final test AVG, {target:.2f} (mean over its seeds); a federation "
            f"reaches it at its first evaluated round at or above it. curves_time.png draws test AVG against "
            f"simulated time.\n\n{table}\n")


def render(run_dir: str) -> str:
    """(Re-)write summary.md and curves.png of a run directory; return the summary text."""
    dirs = rundir.method_dirs(run_dir)
    failed = rundir.failed_federations(run_dir)
    if not dirs:
        if failed:
            raise UserError(f"{run_dir} holds no finished federation: "
                            + "; ".join(f"{f} failed ({line}; see its error.txt)" for f, line in failed))
        raise UserError(f"no metrics.parquet found in {run_dir} or its method folders")
    title = os.path.basename(os.path.normpath(run_dir))
    rans = {name: ran(d) for name, d in dirs.items()}
    header = what_ran(list(rans.values()))
    labels = {name: r.label for name, r in rans.items()}  # the rows say what ran
    panels: dict[str, list[pd.DataFrame]] = {}
    runs: dict[str, dict] = {}
    first: dict[str, tuple[str, pd.DataFrame]] = {}  # row -> (folder, metrics) of its first seed
    lodo = False
    for name, d in dirs.items():
        row = labels[name]
        runs[row] = {}
        for seed, sd in rundir.seed_dirs(d).items():
            holdouts = rundir.holdout_dirs(sd)
            if holdouts:
                lodo = True
                runs[row][seed] = {}
                for dom, hd in holdouts.items():  # each federation's own config says its eval.select
                    df = rundir.read_metrics(hd)
                    panels.setdefault(f"{row} / {dom}", []).append(df)
                    runs[row][seed][dom] = summarize(df, row, select_rule(hd))
            else:
                df = rundir.read_metrics(sd)
                panels.setdefault(row, []).append(df)
                runs[row][seed] = summarize(df, row, select_rule(sd))
                first.setdefault(row, (sd, df))
    if lodo:
        text = lodo_markdown(runs, title, header)
    else:
        text = summary_markdown(runs, title, header)
        text += "".join(method_section(*first[row]) for row in runs)
    unfinished = rundir.unfinished_line([run_dir])
    text += time_section(panels)
    text += privacy_section(panels)
    text += _exchanges(dirs) + beside_paper(run_dir) + _failed_section(failed) + (
        "\n## Unfinished\n\n" + unfinished + "\n" if unfinished else "")
    write_text(os.path.join(run_dir, "summary.md"), text)
    plot_curves(panels, os.path.join(run_dir, "curves.png"))
    if any(sim_clock(df) is not None for frames in panels.values() for df in frames):
        plot_time_curves(panels, os.path.join(run_dir, "curves_time.png"))
    return text
