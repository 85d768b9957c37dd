"""Search spaces: the method's declared ``Space`` ranges, the user's overrides, and their Optuna form.

A searched hyperparameter is named by its dotted experiment-config key (``hp.fdse.lam``,
``train.lr``); a sampled trial is a ``{dotted key: value}`` dict applied on top of the base
experiment. In a tune config a space entry is one of::

    hp.fdse.lam: {loguniform: [0.01, 1.0]}   # also uniform: [low, high], int: [low, high] (inclusive)
    hp.fdse.G: {choice: [2, 4, 8]}
    tau: default                             # the method's declared range (a bare name is hp.<method>.NAME)
    hp.fdse.tau: fixed                       # not searched: keeps the experiment's value (also: null)
"""
from __future__ import annotations

import copy
import math
from typing import Any

from raysim.config import set_path
from raysim.core.errors import UserError
from raysim.core.hparams import Space

KINDS = ("loguniform", "uniform", "int", "choice")
FIXED = (None, "fixed", "none", False)
# Experiment keys a search may vary. runtime.* and data.* are left out on purpose: they change the
# federation's shape (hosts, clients), which every trial must share to be reserved the same way.
SEARCHABLE_PREFIXES = ("hp.", "train.", "model.")
SEARCHABLE_KEYS = ("clients_per_round", "fraction")


# ----------------------------------------------------------------------------- parsing

def parse_spec(key: str, spec: Any) -> Space:
    """One user entry (``{loguniform: [lo, hi]}`` ...) as a ``Space``; a UserError names the key."""
    where = f"search space entry '{key}'"
    if isinstance(spec, Space):
        return check_space(key, spec)
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in KINDS:
        raise UserError(f"{where} = {spec!r}: expected one of {{loguniform: [low, high]}}, "
                        "{uniform: [low, high]}, {int: [low, high]}, {choice: [a, b, ...]}, 'default' or 'fixed'")
    kind, args = next(iter(spec.items()))
    if kind == "choice":
        if not isinstance(args, list) or not args:
            raise UserError(f"{where}: choice needs a non-empty list, got {args!r}")
        return check_space(key, Space.choice(*args))
    if not isinstance(args, list) or len(args) != 2:
        raise UserError(f"{where}: {kind} needs [low, high], got {args!r}")
    return check_space(key, Space(kind, args[0], args[1]))


def check_space(key: str, space: Space) -> Space:
    where = f"search space entry '{key}'"
    if space.kind not in KINDS:
        raise UserError(f"{where}: unknown kind {space.kind!r}; expected one of {', '.join(KINDS)}")
    if space.kind == "choice":
        choices = tuple(space.choices or ())
        if not choices:
            raise UserError(f"{where}: choice needs at least one option")
        bad = [c for c in choices if not (c is None or isinstance(c, (bool, int, float, str)))]
        if bad:
            raise UserError(f"{where}: choice options must be numbers, strings, booleans or null, got {bad[0]!r}")
        if len(set(map(repr, choices))) != len(choices):
            raise UserError(f"{where}: choice lists an option twice: {list(choices)}")
        return Space("choice", choices=choices)
    lo, hi = space.low, space.high
    number = (int,) if space.kind == "int" else (int, float)
    for v in (lo, hi):
        if not isinstance(v, number) or isinstance(v, bool) or not math.isfinite(v):
            what = "integers" if space.kind == "int" else "finite numbers"
            raise UserError(f"{where}: {space.kind} bounds must be {what}, got [{lo!r}, {hi!r}]")
    if not lo < hi:
        raise UserError(f"{where}: {space.kind} needs low < high, got [{lo!r}, {hi!r}]")
    if space.kind == "loguniform" and lo <= 0:
        raise UserError(f"{where}: loguniform needs low > 0, got [{lo!r}, {hi!r}]")
    if space.kind == "int":
        return Space("int", int(lo), int(hi))
    return Space(space.kind, float(lo), float(hi))


def declared_space(method_cls, method: str) -> dict[str, Space]:
    """The method's default space, keyed ``hp.<method>.<field>``."""
    return {f"hp.{method}.{k}": check_space(f"hp.{method}.{k}", v)
            for k, v in method_cls.Hparams.search_space().items()}


def full_key(key: str, method: str) -> str:
    """A bare name (no dot) is one of the tuned method's hyperparameters."""
    return key if "." in key else f"hp.{method}.{key}"


def resolve_space(method_cls, method: str, user: dict | None) -> dict[str, Space]:
    """The method's declared space with the user's entries merged over it (key by key)."""
    declared = declared_space(method_cls, method)
    space = dict(declared)
    if user is not None and not isinstance(user, dict):
        raise UserError(f"tune config key 'space' must map config keys to ranges, got {type(user).__name__}")
    for raw_key, spec in (user or {}).items():
        if not isinstance(raw_key, str) or not raw_key:
            raise UserError(f"search space key {raw_key!r} must be a config key such as train.lr")
        key = full_key(raw_key, method)
        check_key(key, method, method_cls)
        if isinstance(spec, str) and spec.lower() in ("fixed", "none"):
            spec = None
        if spec in FIXED:
            space.pop(key, None)
        elif spec == "default":
            if key not in declared:
                have = ", ".join(declared) or "none"
                raise UserError(f"search space entry '{key}' = default, but method {method} declares no "
                                f"range for it (declared: {have})")
            space[key] = declared[key]
        else:
            space[key] = parse_spec(key, spec)
    if not space:
        raise UserError(f"the search space is empty: method {method} declares no hyperparameter ranges; "
                        "add some under 'space', e.g. space: {train.lr: {loguniform: [0.001, 0.1]}}")
    return dict(sorted(space.items()))


def check_key(key: str, method: str, method_cls) -> None:
    if key.startswith("hp."):
        parts = key.split(".")
        if len(parts) != 3 or parts[1] != method:
            raise UserError(f"search space key '{key}': the search tunes method {method}; its "
                            f"hyperparameters are hp.{method}.NAME")
        import dataclasses
        fields = [f.name for f in dataclasses.fields(method_cls.Hparams)]
        if parts[2] not in fields:
            raise UserError(f"search space key '{key}': method {method} has no hyperparameter "
                            f"'{parts[2]}'; valid: {', '.join(fields) or '(none)'}")
        return
    if key.startswith(SEARCHABLE_PREFIXES) or key in SEARCHABLE_KEYS:
        return
    raise UserError(f"search space key '{key}' cannot be searched; searchable keys are hp.{method}.*, "
                    "train.*, model.*, clients_per_round and fraction (runtime.* and data.* fix the "
                    "federation's shape, which every trial shares)")


# ----------------------------------------------------------------------------- Optuna

def to_optuna(space: dict[str, Space]) -> dict:
    """``{key: optuna distribution}`` for ``OptunaSearch(space=...)``."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    out = {}
    for key, s in space.items():
        if s.kind == "loguniform":
            out[key] = FloatDistribution(s.low, s.high, log=True)
        elif s.kind == "uniform":
            out[key] = FloatDistribution(s.low, s.high)
        elif s.kind == "int":
            out[key] = IntDistribution(int(s.low), int(s.high))
        else:
            out[key] = CategoricalDistribution(list(s.choices))
    return out


def contains(space: Space, value) -> bool:
    if space.kind == "choice":
        return any(value == c and isinstance(value, bool) == isinstance(c, bool) for c in space.choices)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if space.kind == "int" and not float(value).is_integer():
        return False
    return space.low <= value <= space.high


def endpoints(space: Space) -> list:
    """Values that exercise a space's corners (checked against the experiment config up front)."""
    if space.kind == "choice":
        return list(space.choices)
    return [space.low, space.high]


# ----------------------------------------------------------------------------- applying values

def apply_params(raw: dict, params: dict) -> dict:
    """A copy of the experiment dict with ``{dotted key: value}`` set."""
    out = copy.deepcopy(raw)
    for key, value in params.items():
        set_path(out, key, plain(value))
    return out


def plain(value):
    """numpy scalars (Optuna hands some back) as Python numbers, so YAML and the config accept them."""
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        try:
            return value.item()
        except (TypeError, ValueError):
            return value
    return value


def describe(space: dict[str, Space]) -> str:
    parts = []
    for key, s in space.items():
        if s.kind == "choice":
            parts.append(f"{key} in {list(s.choices)}")
        else:
            parts.append(f"{key} ~ {s.kind}[{s.low:g}, {s.high:g}]")
    return "; ".join(parts)


def short_name(key: str) -> str:
    """``hp.fdse.lam`` -> ``lam``; ``train.lr`` -> ``lr`` (for plots and console lines)."""
    return key.rsplit(".", 1)[-1] if key.startswith("hp.") or key.startswith("train.") else key


def as_jsonable(space: dict[str, Space]) -> dict:
    return {k: ({"choice": list(s.choices)} if s.kind == "choice" else {s.kind: [s.low, s.high]})
            for k, s in space.items()}


__all__ = ["Space", "parse_spec", "resolve_space", "to_optuna", "apply_params",
           "contains", "endpoints", "describe", "as_jsonable", "short_name"]
