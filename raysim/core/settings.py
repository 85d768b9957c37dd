"""Typed settings declared once: a dataclass field states its type, default and allowed values,
and one function turns a user's mapping into the dataclass or a one-line error.

    @dataclass
    class TrainConfig:
        epochs: int = setting(1, ge=1)
        weighting: str = setting("samples", one_of=("samples", "uniform"))

``build(TrainConfig, {"epochs": 0}, "train")`` raises ``UserError("config key 'train.epochs' = 0:
expected at least 1")``. Experiment configs and method hyperparameters (``hp.<method>.<name>``)
use the same declarations and the same messages; checks that relate two settings stay where the
settings are used.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from raysim.core.errors import UserError


@dataclass(frozen=True)
class Allowed:
    """What a setting may hold beyond its type: bounds and/or a list of values. On a tuple-valued
    setting the bounds apply to each element."""
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    one_of: tuple | None = None
    expected: str | None = None  # the message's own wording, when the generated one reads badly

    def describe(self) -> str:
        if self.expected:
            return self.expected
        if self.one_of is not None:
            shown = [repr(v) if isinstance(v, str) else str(v) for v in self.one_of]
            return f"{shown[0]} or {shown[1]}" if len(shown) == 2 else "one of " + ", ".join(shown)
        lo = ("[", self.ge) if self.ge is not None else ("(", self.gt) if self.gt is not None else None
        hi = ("]", self.le) if self.le is not None else (")", self.lt) if self.lt is not None else None
        if lo and hi:
            return f"a number in {lo[0]}{_num(lo[1])}, {_num(hi[1])}{hi[0]}"
        if self.gt == 0:
            return "a positive number"
        if self.ge is not None:
            return f"at least {_num(self.ge)}" if float(self.ge) >= 1 else f">= {_num(self.ge)}"
        if self.gt is not None:
            return f"> {_num(self.gt)}"
        if self.le is not None:
            return f"<= {_num(self.le)}"
        return f"< {_num(self.lt)}"

    def admits(self, value) -> bool:
        if isinstance(value, (tuple, list)):
            return all(self.admits(v) for v in value)
        if self.one_of is not None and value not in self.one_of:
            return False
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return not ((self.ge is not None and value < self.ge) or (self.gt is not None and value <= self.gt)
                        or (self.le is not None and value > self.le) or (self.lt is not None and value >= self.lt))
        return self.one_of is None or value in self.one_of


def _num(x) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def setting(default=dataclasses.MISSING, *, default_factory=dataclasses.MISSING, source: str | None = None,
            doc: str | None = None, **allowed):
    """A dataclass field with its allowed values (``ge``, ``gt``, ``le``, ``lt``, ``one_of``,
    ``expected``); ``None`` always passes where the type admits it. ``source`` says where the
    default comes from (a method's hyperparameters: "paper Eq. 3", "official code", "ours: ..."),
    ``doc`` what the setting means (the paper's symbol, what each value does); ``raysim methods
    NAME`` shows both (:func:`field_doc`)."""
    meta = {"allowed": Allowed(**allowed)} if allowed else {}
    if source is not None:
        meta["source"] = source
    if doc is not None:
        meta["doc"] = doc
    if default_factory is not dataclasses.MISSING:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


def field_doc(f: dataclasses.Field) -> str:
    """A setting's ``doc`` ("" where it declares none)."""
    return f.metadata.get("doc", "")


# ----------------------------------------------------------------------------- types

def type_name(tp) -> str:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is tuple:
        return "a list"
    return {type(None): "null"}.get(tp, getattr(tp, "__name__", str(tp)))


def coerce(value, tp, key: str, what: str = "config key"):
    """``value`` as type ``tp`` (ints where floats are expected, ``1e-3`` strings as numbers,
    lists as tuples), or a UserError naming ``key``."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        inner = None  # a mapping given for a section that may be null: the section's own error
        for option in typing.get_args(tp):
            try:
                return coerce(value, option, key, what)
            except UserError as err:
                if dataclasses.is_dataclass(option) and isinstance(value, dict):
                    inner = err
        if inner is not None:
            raise inner
    elif tp is type(None):
        if value is None:
            return None
    elif tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(float(value)):
                raise UserError(f"{what} '{key}' = {value!r}: expected a finite number")
            return float(value)
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is str:
        if isinstance(value, str):
            return value
    elif origin is tuple:  # tuple[X, ...]: a list or tuple of X (a lone X is a list of one)
        (item, *_), items = typing.get_args(tp), value if isinstance(value, (list, tuple)) else [value]
        try:
            return tuple(coerce(v, item, key, what) for v in items)
        except UserError:
            pass
        raise UserError(f"{what} '{key}' = {value!r}: expected a list of {type_name(item)}")
    elif tp in (dict, list) or origin in (dict, list):
        if isinstance(value, origin or tp):
            return copy.deepcopy(value)
    elif dataclasses.is_dataclass(tp):
        return build(tp, value, key, what)
    raise UserError(f"{what} '{key}' = {value!r}: expected {type_name(tp)}")


def check(obj, prefix: str = "", what: str = "config key") -> None:
    """Every declared ``Allowed`` of a built dataclass instance (values already typed)."""
    for f in dataclasses.fields(obj):
        allowed = f.metadata.get("allowed")
        value = getattr(obj, f.name)
        if allowed is not None and value is not None and not allowed.admits(value):
            key = f"{prefix}.{f.name}" if prefix else f.name
            raise UserError(f"{what} '{key}' = {value!r}: expected {allowed.describe()}")


def build(cls, raw, prefix: str = "", what: str = "config key"):
    """``cls(**raw)`` with every key known, typed and allowed, or a one-line UserError."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        where = f"config section '{prefix}'" if prefix else "config"
        raise UserError(f"{where} must be a mapping of keys to values, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:  # (hyperparameters: Hparams.from_dict names the method first)
            raise UserError(f"unknown {what} '{dotted}'; valid keys here: {', '.join(names)}")
        kwargs[key] = coerce(value, hints[key], dotted, what)
    obj = cls(**kwargs)
    check(obj, prefix, what)
    return obj
