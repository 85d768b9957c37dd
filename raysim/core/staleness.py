"""Staleness weights s(τ) of asynchronous aggregation: how much an upload trained from a model τ
server steps old counts (τ = 0: trained from the current model, weight 1 for every kind).

    sqrt        s(τ) = 1 / √(1 + τ)                         FedBuff (Nguyen et al., AISTATS 2022)
    constant    s(τ) = 1                                    FedAsync's "constant" (Xie et al. 2019)
    polynomial  s(τ) = (1 + τ)^(−a)                         FedAsync's "polynomial"
    hinge       s(τ) = 1 if τ ≤ b, else 1 / (a (τ − b) + 1)  FedAsync's "hinge"

Pure functions of τ and the kind's parameters.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

KINDS = ("sqrt", "constant", "polynomial", "hinge")


@dataclass(frozen=True)
class Staleness:
    """One staleness weighting: its kind and parameters ``a`` (polynomial, hinge) and ``b`` (hinge)."""

    kind: str = "sqrt"
    a: float = 0.5
    b: float = 4.0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"staleness kind {self.kind!r}: expected one of {', '.join(KINDS)}")

    def weight(self, tau: int) -> float:
        """s(τ) for an upload τ ≥ 0 server steps stale."""
        if tau < 0:
            raise ValueError(f"staleness τ = {tau} < 0")
        if self.kind == "sqrt":
            return 1.0 / math.sqrt(1.0 + tau)
        if self.kind == "constant":
            return 1.0
        if self.kind == "polynomial":
            return (1.0 + tau) ** (-self.a)
        return 1.0 if tau <= self.b else 1.0 / (self.a * (tau - self.b) + 1.0)
