"""Client selection: which online clients train in a round, as a setting of its own
(``clients.selection``) that composes with any method and any server step.

A selection works in two phases, so that no code runs twice and nothing is raised through it:

1. ``candidates(state, ctx)``: the clients whose local loss of the round's model it needs (none:
   ``[]``, and phase 2 follows at once). The engine sends them the round's model; their hosts
   answer with the mean cross-entropy over their training data (eval mode, forward passes only),
   charged to the simulated clock and to the round's ``bytes_down``.
2. ``choose(state, ctx, losses)``: the clients that train, ``losses`` mapping each candidate to its
   answer in the order the candidates were given (nan: its device could not hold the model).

``ctx.rng`` is one generator for both phases (the server keeps it between them), keyed by (seed,
round, server, "sample"): the selection's only randomness. A selection's own state (rpow-d's last
losses) lives in the server's state under ``"selection"`` and is updated after each round's server
step from the training losses of the clients aggregated (``observe``).

``uniform`` (the default) is FedAvg's draw: m clients uniformly without replacement.
``power_of_choice`` is Cho, Wang, Joshi, AISTATS 2022 (arXiv 2010.01243), pow-d:

    1. candidates A: d clients drawn without replacement, client k with probability p_k = n_k / n
    2. each k in A computes F_k(w^t), its local loss of the global model, and sends it
    3. S^t: the m clients of A with the highest F_k(w^t)

rpow-d (``variant: rpow-d``) asks nothing: F_k is the client's mean training loss the last round it
was aggregated, and a client that never was ranks first (an infinite loss, as the Flower baseline's),
so every client is tried before the stale losses decide. cpow-d is not offered. Ties keep the order
the candidates were drawn in (a stable sort), which is random. Clients offline this round are not
candidates; d is clamped to the clients online, and with m or fewer online every one trains (no
draw, no query).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from raysim.core.errors import UserError

STATE_KEY = "selection"  # where a selection keeps its state in the server's state


@dataclass
class SelectionContext:
    """What a selection (or a method's own ``select``) sees of a round, on the server."""

    round: int  # 1-based
    online: Sequence[int]  # the clients online this round, ascending (a range, an array or a list)
    m: int  # clients per round (clients_per_round, or fraction x clients)
    rng: Any  # numpy Generator keyed by (seed, round, server, "sample"): the selection's only randomness
    num_train: Callable[[int], int] = field(repr=False, default=None)  # client id -> its training-set size n_k


class Selection:
    """FedAvg's draw: ``ctx.m`` of the online clients uniformly without replacement (all of them
    when there are no more)."""

    kind = "uniform"
    asks = "nothing"  # what it asks of the clients, for summaries

    def init_state(self) -> dict | None:
        """Its state in the server's state (None: it keeps none)."""
        return None

    def candidates(self, state: dict | None, ctx: SelectionContext) -> list[int]:
        """The clients whose local loss it needs before it chooses (none by default)."""
        return []

    def choose(self, state: dict | None, ctx: SelectionContext, losses: dict[int, float]) -> list[int]:
        online = ctx.online
        if ctx.m >= len(online):
            return [int(c) for c in online]
        return sorted(int(online[int(i)]) for i in ctx.rng.choice(len(online), size=ctx.m, replace=False))

    def observe(self, state: dict | None, losses: dict[int, float]) -> dict | None:
        """Its state after a round whose aggregated clients reported these mean training losses."""
        return state

    def describe(self) -> str:
        return self.kind


class PoissonSampling(Selection):
    """Each online client trains with probability q = m / N on its own (N the clients online: every
    client without availability profiles), so a round has m clients on average and may have none:
    the sampling the classic DP-SGD / DP-FedAvg analysis assumes (raysim.core.privacy)."""

    kind = "poisson"

    def choose(self, state: dict | None, ctx: SelectionContext, losses: dict[int, float]) -> list[int]:
        online = np.asarray(ctx.online, dtype=np.int64)
        if ctx.m >= len(online):
            return online.tolist()
        drawn = ctx.rng.random(len(online)) < ctx.m / len(online)
        return online[drawn].tolist()

    def describe(self) -> str:
        return "poisson (each client with probability m / N)"


@dataclass(frozen=True)
class PowerOfChoice(Selection):
    """Power-of-Choice (module docstring): pow-d asks d candidates for their loss, rpow-d ranks by
    the last training losses."""

    d: int | None = None  # candidates per round; None: 2m
    variant: str = "pow-d"  # "pow-d" | "rpow-d"
    where: str = "clients.selection"  # the config key that set it, for its one-line errors

    kind = "power_of_choice"

    @property
    def asks(self) -> str:
        return "the d candidates' local loss of the global model" if self.variant == "pow-d" else "nothing"

    def init_state(self) -> dict | None:
        return {"last_loss": {}} if self.variant == "rpow-d" else None

    def _d(self, ctx: SelectionContext) -> int:
        d = 2 * ctx.m if self.d is None else self.d
        if d < ctx.m:
            raise UserError(f"{self.where}.d = {d} is below the {ctx.m} clients per round: Power-of-Choice picks "
                            f"m of d candidates (d >= m)")
        return min(d, len(ctx.online))

    def _draw(self, ctx: SelectionContext) -> list[int]:
        online = ctx.online
        d = self._d(ctx)
        if ctx.m >= len(online):
            return []
        n_k = np.array([ctx.num_train(c) for c in online], dtype=np.float64)
        drawn = ctx.rng.choice(len(online), size=d, replace=False, p=n_k / n_k.sum())  # step 1
        return [int(online[int(i)]) for i in drawn]

    def candidates(self, state, ctx: SelectionContext) -> list[int]:
        return self._draw(ctx) if self.variant == "pow-d" else []  # step 2 asks them

    def choose(self, state, ctx: SelectionContext, losses: dict[int, float]) -> list[int]:
        if ctx.m >= len(ctx.online):
            self._d(ctx)  # d < m is still an error
            return [int(c) for c in ctx.online]
        if self.variant == "pow-d":
            candidates = list(losses)
        else:
            candidates = self._draw(ctx)
            losses = {k: state["last_loss"].get(k, math.inf) for k in candidates}
        return sorted(highest(candidates, [losses[k] for k in candidates], ctx.m))  # step 3

    def observe(self, state, losses: dict[int, float]):
        if self.variant != "rpow-d":
            return state
        return {"last_loss": {**state["last_loss"], **{int(c): float(v) for c, v in losses.items()}}}

    def describe(self) -> str:
        return f"power_of_choice ({self.variant}, d {'2m' if self.d is None else self.d})"


def highest(candidates: list[int], losses: list[float], m: int) -> list[int]:
    """The ``m`` candidates with the highest loss (nan, a client that could not answer, lowest);
    equal losses keep the candidates' order."""
    order = sorted(range(len(candidates)), key=lambda i: -losses[i] if losses[i] == losses[i] else math.inf)
    return [candidates[i] for i in order[:m]]


KINDS = {"uniform": Selection, "poisson": PoissonSampling, "power_of_choice": PowerOfChoice}


def from_config(section) -> Selection:
    """The selection ``clients.selection`` configures (a :class:`raysim.config.SelectionConfig`, or None)."""
    kind = getattr(section, "kind", "uniform")
    if kind == "uniform":
        return Selection()
    if kind == "poisson":
        return PoissonSampling()
    return PowerOfChoice(d=section.d, variant=section.variant)
