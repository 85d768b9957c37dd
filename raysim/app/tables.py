"""What summary.md (:mod:`raysim.app.report`) and compare.md (:mod:`raysim.app.compare`) share: one
federation's evaluated rounds reduced to the rounds a table shows (:func:`summarize`, at the round
its config's ``eval.select`` picks), and the Markdown cells (:func:`pct`, :func:`markdown_table`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from raysim.app.rundir import config_dict
from raysim.core.errors import UserError

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
    """A federation's metrics (long format) at the round ``rule`` picks (``eval.select``; the final
    round where its validation split was not evaluated), the final round and the best test round."""
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


def select_rule(folder: str) -> str:
    """The ``eval.select`` a federation's own config.yaml names ("val" without one)."""
    rule = (config_dict(folder).get("eval") or {}).get("select", "val")
    return rule if rule in SELECT_LABELS else "val"


# ----------------------------------------------------------------------------- numbers -> cells

def pct(values: list[float]) -> str:
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

