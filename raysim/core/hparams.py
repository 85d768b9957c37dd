"""A method's hyperparameters: a frozen dataclass of the paper's defaults, declared with
:func:`raysim.core.settings.setting` (type, allowed values), and the ranges a search explores.

    @dataclass(frozen=True)
    class FDSEHparams(Hparams):
        lam: float = setting(0.1, ge=0)
        dse_agg: str = setting("attention", one_of=("attention", "local", "mean"))

        @classmethod
        def search_space(cls):
            return {"lam": Space.log(0.01, 1.0)}
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from raysim.core.errors import UserError
from raysim.core.settings import build


@dataclass(frozen=True)
class Space:
    """A search range for one hyperparameter (read by tuning/ to build Tune/Optuna spaces)."""
    kind: str  # "loguniform" | "uniform" | "int" | "choice"
    low: float | None = None
    high: float | None = None
    choices: tuple | None = None

    @staticmethod
    def log(low: float, high: float) -> "Space":
        return Space("loguniform", low, high)

    @staticmethod
    def uniform(low: float, high: float) -> "Space":
        return Space("uniform", low, high)

    @staticmethod
    def integer(low: int, high: int) -> "Space":
        return Space("int", low, high)

    @staticmethod
    def choice(*options) -> "Space":
        return Space("choice", choices=tuple(options))


@dataclass(frozen=True)
class Hparams:
    """Base of every method's hyperparameters; subclasses add fields with the paper's defaults."""

    @classmethod
    def search_space(cls) -> dict[str, Space]:
        return {}

    @classmethod
    def from_dict(cls, values: dict | None, prefix: str = "hp", method: str = "") -> "Hparams":
        """Typed, checked construction from a user mapping (config ``hp.<method>``)."""
        values = dict(values or {})
        names = [f.name for f in dataclasses.fields(cls)]
        for key in values:
            if key not in names:
                raise UserError(f"unknown hyperparameter '{prefix}.{key}'{f' for method {method}' if method else ''}; "
                                f"valid: {', '.join(names) or '(none)'}")
        return build(cls, values, prefix, what="hyperparameter")
