"""What summary.md (:mod:`raysim.app.report`) and compare.md (:mod:`raysim.app.compare`) share: one
federation's evaluated rounds reduced to the rounds a table shows (:func:`summarize`, at the round
its config's ``eval.select`` picks), the Markdown cells (:func:`pct`, :func:`markdown_table`), and
what a federation ran, read back from its folder (:func:`ran`: method, hyperparameters off their
defaults, server optimizer, selection; its row's label).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

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


# ----------------------------------------------------------------------------- what ran

@dataclass
class Ran:
    """What one federation ran, as its folder records it (config.yaml; hosts.json for the number of
    clients): the lines summary.md opens with, and the row's label."""
    entry_dir: str  # the entry's folder in its run (the run folder itself for one entry)
    folder: str  # its first federation's folder (first seed, first held-out domain)
    name: str  # the entry's folder's name: a variant's name, or the method's key
    method: str  # the method (a plugin's module:Class)
    variant: str | None
    config: object | None  # its ExperimentConfig (None when its config.yaml does not load here)
    cls: type | None = None  # the method's class (None when it does not import here)
    hparams: list[str] = field(default_factory=list)  # "mu=1.0 (default 0.01)": those off their defaults
    server: str = ""  # "adam (lr 0.01, betas [0.9, 0.99], tau 0.001); the method's own: sgd (lr 1)"
    server_changed: str = ""  # "adam", "sgd lr 0.5": where the config changed the method's own step; "" if not
    selection: str = ""

    @property
    def label(self) -> str:
        """The row: its name, and ``+ server adam`` where the config changed the server step of a
        method shown by its own name (``fedavg`` with server.optimizer=adam is FedAdam's numbers);
        a named variant's name is the user's account of what it changes."""
        if self.server_changed and self.variant is None:
            return f"{self.name} + server {self.server_changed}"
        return self.name


def ran(folder: str) -> Ran:
    """:class:`Ran` of an entry's folder in a run (what its first federation's folder records)."""
    from raysim.app import rundir
    from raysim.core.contract import Method
    from raysim.methods import registry

    entry_dir, folder = folder, first_federation(folder)
    name, method, variant = rundir.name_of(folder), rundir.method_of(folder), rundir.variant_of(folder)
    try:
        cfg = rundir.read_config(folder)
    except UserError:
        cfg = None
    out = Ran(entry_dir, folder, name, method, variant, cfg)
    try:
        out.cls = registry.get(method)
    except Exception:  # a method (a plugin) that does not import here: its name only
        return out
    if cfg is None:
        return out
    key = rundir.method_key(method)
    try:
        hp = out.cls.hparams_from(cfg.hp.get(key), prefix=f"hp.{key}")
    except UserError:  # written by another version of the method
        hp = None
    out.hparams = _changed_hparams(out.cls, hp) if hp is not None else [f"(hp.{key} does not load here)"]
    if out.cls.aggregate is not Method.aggregate:
        out.server = "the method's own server step (no server optimizer)"
    else:
        out.server, out.server_changed = _server_line(out.cls, cfg.server, key)
    out.selection = selection_text(out.cls, hp, cfg) + schedule_text(out.cls, cfg)
    return out


def schedule_text(cls, cfg) -> str:
    """``""`` for synchronous rounds; a buffered schedule's C, K and s(τ) otherwise."""
    from dataclasses import replace
    s = cfg.schedule
    if (s.kind or cls.schedule) != "buffered":
        return ""
    staleness = replace(cls.staleness, **{k: v for k, v in (("kind", s.staleness), ("a", s.staleness_a),
                                                              ("b", s.staleness_b)) if v is not None})
    c = s.concurrency or cfg.clients_per_round
    k = s.buffer or min(cls.buffer or 10, c or 10)
    params = {"polynomial": f", a {value_text(staleness.a)}", "hinge": f", a {value_text(staleness.a)}, b {value_text(staleness.b)}"}
    stale = f"; arrivals over {s.max_staleness} steps stale dropped" if s.max_staleness is not None else ""
    return (f"; buffered (asynchronous): {c if c else 'every'} clients in flight, a server step every {k} "
            f"arrival{'s' if k != 1 else ''}, staleness weight {staleness.kind}{params.get(staleness.kind, '')}{stale}")


def selection_text(cls, hp, cfg) -> str:
    """Which clients trained: the method's own ``select``, or the selection it ran with."""
    from raysim.core.contract import Method
    from raysim.core.selection import from_config
    if cls.select is not Method.select:
        return "the method's own select"
    try:
        chosen = cls(hp, None).selection(from_config(cfg.clients.selection)) if hp is not None else None
    except Exception:  # a method that cannot be built without a federation, or a refused combination
        chosen = None
    if chosen is None or chosen.kind == "uniform":
        return "uniform at random among the online clients" if chosen is not None else "(not known here)"
    return f"{chosen.describe()}, asking {chosen.asks}"


def first_federation(folder: str) -> str:
    """A method's folder's first federation (its first seed's, first held-out domain's)."""
    from raysim.app import rundir
    seed_dir = next(iter(rundir.seed_dirs(folder).values()))
    return next(iter(rundir.holdout_dirs(seed_dir).values()), seed_dir)


def value_text(v) -> str:
    """A setting as summary.md shows it: ``0.01``, ``[0.9, 0.99]``, ``null``."""
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, (tuple, list)):
        return "[" + ", ".join(value_text(x) for x in v) + "]"
    return "null" if v is None else str(v)


def _defaults(cls) -> dict:
    out = {}
    for f in dataclasses.fields(cls.Hparams):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            out[f.name] = f.default_factory()  # type: ignore[misc]
    return out


def _changed_hparams(cls, hp) -> list[str]:
    """``name=value (default d)`` of each hyperparameter of ``hp`` off the method's default."""
    defaults = _defaults(cls)
    return [f"{f.name}={value_text(getattr(hp, f.name))} (default {value_text(defaults.get(f.name))})"
            for f in dataclasses.fields(hp) if f.name not in defaults or getattr(hp, f.name) != defaults[f.name]]


def _server_line(cls, server, key: str) -> tuple[str, str]:
    """(the server optimizer and its settings, what the config changed of the method's own: "" if nothing)."""
    from raysim.core.server_optimizers import DEFAULT_LR, resolve
    opt, own = resolve(server, cls.server_optimizer, key), resolve(None, cls.server_optimizer, key)
    used = _used_settings(opt)
    settings = [f"lr {value_text(opt.lr)}"] + [f"{k} {value_text(getattr(opt, k))}" for k in used]
    line = f"{opt.name} ({', '.join(settings)})" + (": the plain mean" if opt.plain_mean else "")
    if [getattr(opt, k) for k in ("name", "lr", *used)] == [getattr(own, k) for k in ("name", "lr", *used)]:
        # (settings its step does not read do not count: an old config's betas beside sgd)
        return line + " (the method's own)", ""
    line += f"; the method's own: {own.name} (lr {value_text(own.lr)})"
    return line, " ".join([opt.name] + ([f"lr {value_text(opt.lr)}"] if opt.lr != DEFAULT_LR[opt.name] else [])
                          + [f"{name} {value_text(getattr(opt, name))}" for name in used
                             if getattr(opt, name) != getattr(own, name)])


def _used_settings(opt) -> tuple[str, ...]:
    """The settings besides lr that ``opt``'s step reads."""
    from raysim.core.server_optimizers import ADAPTIVE
    if opt.name == "momentum":
        return ("momentum",)
    if opt.name == "adagrad" and opt.form == "code":
        return ("tau", "form")  # Keras Adagrad: no first moment, and it never reads β2
    return ("betas", "tau", "form") if opt.name in ADAPTIVE else ()


# ----------------------------------------------------------------------------- what a run shares

def partition_text(partition: dict | None) -> str:
    """``per_domain (train_size 64)``: a partition's kind and settings (its held-out domain aside)."""
    part = {k: v for k, v in (partition or {}).items() if k not in ("holdout", "target_test")}
    kind = part.pop("kind", "per_domain")
    return kind + (f" ({', '.join(f'{k} {value_text(v)}' for k, v in part.items())})" if part else "")


def data_text(cfg) -> str:
    """``digits5 (image_size 16), partition per_domain (train_size 64)``."""
    options = ", ".join(f"{k} {value_text(v)}" for k, v in (cfg.data.options or {}).items())
    return (f"{cfg.data.dataset}" + (f" ({options})" if options else "")
            + (f" from {cfg.data.root}" if cfg.data.root else "") + f", partition {partition_text(cfg.data.partition)}")


def num_clients(folder: str, cfg) -> int | None:
    """How many clients trained in a federation: its hosts.json (every client, held-out targets
    among them), else its metrics' client rows where every client was evaluated; None if unknown."""
    import json
    import os

    from raysim.app import rundir
    lodo = cfg.eval.protocol == "lodo"
    try:
        df = rundir.read_metrics(folder)
    except UserError:
        return None
    clients = df[df.client >= 0]
    trained = set(clients[clients.split != "test"].client) if lodo else set(clients.client)
    targets = len(set(clients[clients.split == "test"].client) - trained) if lodo else 0  # the unseen domain's
    try:
        with open(os.path.join(folder, "hosts.json"), encoding="utf-8") as fh:
            n = int(json.load(fh)["hosts"][0]["client_range"][1]) - targets
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        n = len(trained) if cfg.eval.clients == "all" else 0
    return n if n > 0 else None


def participation_text(folder: str, cfg) -> str:
    """``3 of 5 clients per round``, and what limits who is online (profiles' availability, a
    trace, a deadline)."""
    n = num_clients(folder, cfg)
    if n is not None and cfg.clients_per_round is not None and n < cfg.clients_per_round:
        n = None  # a count the folder does not support
    of = f" of {n}" if n is not None else ""
    if cfg.clients_per_round is not None:
        text = f"{cfg.clients_per_round}{of} clients per round"
    elif cfg.fraction is not None:
        text = (f"{max(1, int(round(cfg.fraction * n)))} of {n} clients per round (fraction {value_text(cfg.fraction)})"
                if n is not None else f"a fraction {value_text(cfg.fraction)} of the clients per round")
    else:
        text = f"every client{f' ({n})' if n is not None else ''} every round"
    profiles = cfg.clients.profiles
    levels = profiles.levels if isinstance(profiles.levels, list) else []
    avail = [f"{lv.get('name', i)} {value_text(lv['availability'])}" for i, lv in enumerate(levels)
             if isinstance(lv, dict) and "availability" in lv]
    limits = []
    if profiles.trace:
        limits.append(f"online as the trace {profiles.trace} says")
    elif avail:
        limits.append("a client is online with its device level's probability (" + ", ".join(avail) + ")")
    if cfg.clients.deadline_s is not None:
        limits.append(f"a client later than the {value_text(cfg.clients.deadline_s)} s deadline (simulated) leaves the round")
    return text + ("; " + "; ".join(limits) if limits else "; every client always online")


LODO_SELECT = {
    "val": "best validation AVG of the source clients",
    "val_weighted": "best train-size-weighted validation accuracy of the source clients",
    "test": "best accuracy on the held-out domain (peeks at the target)",
    "final": "the final round",
}


def held_out_text(holdout) -> str:
    """``eval.holdout`` in words."""
    if holdout == "all":
        return "each domain held out in turn"
    if isinstance(holdout, list) and len(holdout) > 1:
        return f"{', '.join(map(str, holdout))} held out in turn"
    return f"{holdout[0] if isinstance(holdout, list) else holdout} held out"


def protocol_text(cfg, rans: list[Ran]) -> str:
    """How the federations were scored: the protocol, and under leave-one-domain-out what was
    scored, how the round was chosen and whether the unseen domain's adaptation ran."""
    e = cfg.eval
    every = f"evaluated every {e.every} rounds and after the last" if e.every > 1 else "evaluated every round"
    who = "" if e.clients == "all" else f", {e.clients} clients evaluated"
    if e.protocol == "personalized":
        model = ("as it left local training" if e.point == "post_train" else "as it receives it for the next round")
        return f"personalized: each client's own model ({model}, eval.point {e.point}) on its test split; {every}{who}"
    if e.protocol == "global":
        return f"global: the server's model on every client's test split; {every}{who}"
    target = cfg.data.partition.get("target_test", "all")
    scored = ("the whole held-out domain (train, val and test; data.partition.target_test all)" if target == "all"
              else "the held-out domain's test split (data.partition.target_test test)")
    if not e.adapt:
        adapt = "off (eval.adapt false): every method scored as trained"
    else:
        from raysim.core.contract import Method
        does = [r.name for r in rans if r.cls is not None and r.cls.adapt_to_unseen is not Method.adapt_to_unseen]
        rest = [r.name for r in rans if r.name not in does]
        adapt = ("on (eval.adapt): " + (f"{', '.join(does)} adapt{'s' if len(does) == 1 else ''} to the unseen "
                 "domain's unlabeled data before it is scored" if does else "no method here adapts")
                 + (f"; {', '.join(rest)} {'has' if len(rest) == 1 else 'have'} no adaptation step" if does and rest else ""))
    return (f"leave-one-domain-out ({held_out_text(e.holdout)}); "
            f"scored on {scored}; round chosen by {LODO_SELECT.get(e.select, e.select)} (eval.select {e.select}); "
            f"label-free adaptation {adapt}; {every}")
