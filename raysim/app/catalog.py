"""The method catalog: ``raysim methods`` (every registered method, one table) and
``raysim methods NAME`` (one method: paper, description, hyperparameters with their allowed values
and search space, the data-derived statistics it exchanges, the configs that use it).
"""
from __future__ import annotations

import dataclasses
import os
import sys
import typing

from raysim.core.errors import first_line
from raysim.core.settings import field_doc
from raysim.app.rundir import read_yaml_dict
from raysim.app.tables import markdown_table

# One line on what a method sends to the server and what stays on the client. The registry is the
# list of methods; a method missing here is described from its hooks (``_derived_line``).


def _derived_line(cls) -> str:
    from raysim.core.contract import Method
    if getattr(cls, "pools_clients", False):
        return "no federation: one model trained on the pooled clients' data"
    if getattr(cls, "personal_keys", None) is not getattr(Method, "personal_keys", None):
        return "shares the model but its personal tensors (personal_keys); keeps those"
    return "shares the whole model"


def shares_line(name: str, cls) -> str:
    return getattr(cls, "shares", "") or _derived_line(cls)


# ----------------------------------------------------------------------------- configs

def configs_by_method(root: str | None = None) -> dict[str, list[str]]:
    """{method: [``configs/...`` paths]} from every readable YAML among the shipped configs
    (:func:`raysim.app.shipped.shipped_configs`; ``root``: another folder)."""
    from raysim.app.shipped import shipped_configs
    root = root or str(shipped_configs())
    base = os.path.dirname(root)
    found: dict[str, list[str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for fn in sorted(filenames):
            if not fn.endswith((".yaml", ".yml")):
                continue
            path = os.path.join(dirpath, fn)
            raw = read_yaml_dict(path)  # {} for a file that does not read as a mapping: skipped
            listed = []
            if isinstance(raw.get("method"), str):
                listed.append(raw["method"])
            if isinstance(raw.get("methods"), list):
                listed += [m.get("method") if isinstance(m, dict) else m for m in raw["methods"]]  # a variant's method
            listed = [m for m in listed if isinstance(m, str)]
            for m in dict.fromkeys(listed):
                found.setdefault(m, []).append(os.path.relpath(path, base))
    return found


# ----------------------------------------------------------------------------- one method

def description(cls) -> str:
    """The first paragraph of the class docstring (its own) or of its module's docstring; the
    second too when the first is only the paper's title."""
    doc = cls.__dict__.get("__doc__") or sys.modules[cls.__module__].__doc__ or ""
    paras = [" ".join(line.strip() for line in p.strip().splitlines()) for p in doc.strip().split("\n\n")]
    paras = [p for p in paras if p]
    if not paras:
        return ""
    text = paras[0]
    if len(text) < 200 and len(paras) > 1:
        text += "\n\n" + paras[1]
    return text


def _num(x) -> str:
    if isinstance(x, (tuple, list)):
        return "[" + ", ".join(_num(v) for v in x) + "]"
    if x is None or isinstance(x, bool):  # as YAML spells them
        return {None: "null", True: "true", False: "false"}[x]
    if isinstance(x, int):
        return str(x)
    if not isinstance(x, float):
        return repr(x) if isinstance(x, str) else str(x)
    return f"{x:g}"


def allowed_text(f: dataclasses.Field) -> str:
    """A field's allowed values from ``setting(..., ge=, gt=, le=, lt=, one_of=)``."""
    a = f.metadata.get("allowed")
    if a is None:
        return ""
    parts = []
    if a.one_of is not None:
        parts.append("one of: " + ", ".join(_num(v) for v in a.one_of))
    for op, v in ((">=", a.ge), (">", a.gt), ("<=", a.le), ("<", a.lt)):
        if v is not None:
            parts.append(f"{op} {_num(v)}")
    if not parts and a.expected:
        parts.append(a.expected)
    return ", ".join(parts)


def default_source(f) -> str:
    """Where a setting's default comes from (``setting(..., source=...)``), "" when undeclared."""
    return f.metadata.get("source", "")


def space_text(space) -> str:
    """A search range (raysim.core.hparams.Space) as ``log(0.01, 1)``, ``uniform(0.1, 0.9)``, ``choice(...)``."""
    if space is None:
        return ""
    kind = {"loguniform": "log", "uniform": "uniform", "int": "int"}.get(space.kind, space.kind)
    if space.kind == "choice":
        return "choice(" + ", ".join(_num(v) for v in (space.choices or ())) + ")"
    return f"{kind}({_num(space.low)}, {_num(space.high)})"


def _type_text(tp) -> str:
    import types

    from raysim.core.settings import type_name
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_type_text(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is tuple:
        args = typing.get_args(tp)
        return f"list of {type_name(args[0])}" if args else "list"
    return type_name(tp)


def hparam_rows(cls) -> list[list[str]]:
    hp = cls.Hparams
    hints = typing.get_type_hints(hp)
    space = hp.search_space() or {}
    rows = []
    for f in dataclasses.fields(hp):
        if f.default is not dataclasses.MISSING:
            default = _num(f.default)
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = _num(f.default_factory())  # type: ignore[misc]
        else:
            default = "(required)"
        rows.append([f.name, _type_text(hints.get(f.name, f.type)), default, default_source(f) or "–",
                     allowed_text(f) or "any", space_text(space.get(f.name)) or "–", field_doc(f)])
    return rows


def server_step_table(cls) -> str:
    """The ``server`` settings a FedOpt variant runs with at their defaults, and where each comes
    from (``raysim.config.ServerConfig``): its η, and which form of the step (``server.form``)."""
    from raysim.config import ServerConfig
    from raysim.core.server_optimizers import resolve

    opt = resolve(None, cls.server_optimizer, cls.name)
    used = {"lr"} | ({"momentum"} if opt.name == "momentum" else {"betas", "tau", "form"})
    rows = [[f.name, _num(getattr(opt, f.name)), default_source(f) or "–", field_doc(f)]
            for f in dataclasses.fields(ServerConfig) if f.name in used]
    return markdown_table(["name", "default", "default from", "note"], rows)


def method_markdown(name: str) -> str:
    from raysim.core.contract import buffered_refusal as refusal
    from raysim.core.stages import refusal as stage_refusal
    from raysim.engine.cohort import cohort_ready
    from raysim.methods import registry
    cls = registry.get(name)  # UserError naming the available methods
    key = registry.name_of(name)  # a plugin module:Class: its class's name keys hp.<key>
    title = name if key == name else f"{key} (`{name}`, a method of your own)"
    out = [f"# {title}", "", f"**Paper:** {cls.paper or '–'}", ""]
    desc = description(cls)
    if desc:
        out += [desc, ""]
    out += [f"**Shares / keeps:** {shares_line(name, cls)}", ""]
    out += ["**Exchanges data-derived statistics between clients:** "
            + (f"yes: {cls.exchanges}" if cls.exchanges else "no (nothing beyond the model)"), ""]
    out += ["**Client cohorts** (`runtime.cohort_size`): " + ("yes: its step is a per-batch loss (`local_loss`)"
            if cohort_ready(cls) else "no: its clients train one by one"), ""]
    why = refusal(cls)
    out += ["**Buffered schedule** (`schedule.kind: buffered`): "
            + (f"no: {why}" if why else ("yes, its default" if cls.schedule == "buffered" else "yes")
               + f" (K = {cls.buffer or 10}, staleness weight {cls.staleness.kind})"), ""]
    why = stage_refusal(cls)
    out += ["**Privacy and compression stages** (`privacy:`, `compression:`): " + (f"no: {why}" if why else "yes"), ""]
    rows = hparam_rows(cls)
    out += [f"## Hyperparameters (`hp.{key}.<name>`)", ""]
    if rows:
        out += [markdown_table(["name", "type", "default", "default from", "allowed", "search space", "note"], rows), ""]
    else:
        out += ["(none)", ""]
    if cls.server_optimizer != "sgd":
        out += [f"## Server step (`server.<name>`: {cls.server_optimizer})", "", server_step_table(cls), ""]
    cfgs = configs_by_method().get(name, [])
    out += ["## Configs", ""] + ([f"- {c}" for c in cfgs] if cfgs else ["(none under configs/)"])
    return "\n".join(out) + "\n"


def _short_configs(name: str, paths: list[str], most: int = 4) -> str:
    """``fdse/digits5, baselines/digits5_all, ... (+N more)``: the table's configs cell."""
    shown = [os.path.splitext(p)[0].removeprefix("configs" + os.sep) for p in paths]
    if not shown:
        return "–"
    more = f" (+{len(shown) - most} more: raysim methods {name})" if len(shown) > most else ""
    return ", ".join(shown[:most]) + more


def catalog_markdown() -> str:
    from raysim.core.contract import buffered_refusal as refusal
    from raysim.core.stages import refusal as stage_refusal
    from raysim.engine.cohort import cohort_ready
    from raysim.methods import registry
    cfgs = configs_by_method()
    rows = []
    for name in registry.names():
        try:
            cls = registry.get(name)
        except Exception as err:  # an optional method that fails to import: list it, say why
            rows.append([name, f"(cannot import: {first_line(err)})",
                         "", "", "", "", "", ""])
            continue
        buffered = "default" if cls.schedule == "buffered" else "no" if refusal(cls) else "yes"
        rows.append([name, cls.paper or "–", shares_line(name, cls), "yes" if cls.exchanges else "no",
                     "yes" if cohort_ready(cls) else "no", buffered, "no" if stage_refusal(cls) else "yes",
                     _short_configs(name, cfgs.get(name, []))])
    return markdown_table(["method", "paper", "shares / keeps", "exchanges data stats", "cohorts", "buffered",
                           "privacy / compression", "configs"], rows) + "\n"


def methods(name: str | None = None) -> str:
    if name is None:
        return catalog_markdown()
    return method_markdown(name)
