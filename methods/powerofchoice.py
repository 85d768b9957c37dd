"""Power-of-Choice — Cho, Wang, Joshi, "Towards Understanding Biased Client Selection in
Federated Learning", AISTATS 2022 (arXiv 2010.01243). Selection biased towards the clients whose
local loss of the global model is highest converges faster (the paper's bound); pow-d, each round:

    1. candidates A: d clients drawn without replacement, client k with probability p_k = n_k / n
    2. each k in A computes F_k(w^t), its local loss of the global model, and sends it
    3. S^t: the m clients of A with the highest F_k(w^t), ties broken at random
    then the clients of S^t train and the server averages, as FedAvg

* pow-d (``variant: pow-d``, default): step 2 asks the candidates
  (:meth:`SelectionContext.local_losses <raysim.core.contract.SelectionContext.local_losses>`):
  the mean cross-entropy of w^t over the client's training data, forward passes in eval mode,
  charged to the candidates' simulated clock.
* rpow-d (``variant: rpow-d``): no query; F_k is the client's mean training loss (over its local
  steps) the last round it trained, and a client that never trained ranks first (an infinite
  loss, as the Flower baseline's), so every client is tried before the stale losses decide.
* not offered: cpow-d (F_k estimated on b samples).

Ties: the candidates are ranked by a stable sort, so equal losses keep the order they were drawn
in, which is random. Clients offline this round are not candidates; d is clamped to the clients
online, and with m or fewer online every one trains (no draw, no query). The server step is
FedAvg's n_k-weighted mean (the paper's update averages the m selected models equally: the same
where the clients hold equal data, as in ``configs/baselines/digits5_poc.yaml``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from raysim.core.aggregation import update_bank
from raysim.core.contract import ClientContext, LocalLoss, Method, SelectionContext, Upload, cross_entropy
from raysim.core.errors import UserError
from raysim.core.hparams import Hparams
from raysim.core.settings import setting


@dataclass(frozen=True)
class PowerOfChoiceHparams(Hparams):
    d: int | None = setting(None, ge=1, source="ours: 2m, the smallest d of the paper's FMNIST runs (m = 3, d in {6, 9, 15}; the Flower baseline's default d = 6)",
                               doc="candidates per round, at least m; null: 2m")
    variant: str = setting("pow-d", one_of=("pow-d", "rpow-d"), source="paper: pow-d, the base strategy (cpow-d and rpow-d are its cheaper variants)",
                           doc="rpow-d: the clients' last training losses, no query")


class PowerOfChoice(Method):
    name = "powerofchoice"
    Hparams = PowerOfChoiceHparams
    paper = "Cho, Wang, Joshi, AISTATS 2022"
    shares = ('shares the whole model; keeps nothing; pow-d candidates send their local loss of the global model, '
              'rpow-d clients their training loss')

    def init_server(self, model) -> dict:
        return {**super().init_server(model), "last_loss": {}}  # rpow-d: client id -> its last training loss

    def select(self, state: dict, ctx: SelectionContext) -> list[int]:
        online, m = ctx.online, ctx.m
        d = 2 * m if self.hp.d is None else self.hp.d
        if d < m:
            raise UserError(f"hp.powerofchoice.d = {d} is below the {m} clients per round: Power-of-Choice picks "
                            f"m of d candidates (d >= m)")
        if m >= len(online):
            return [int(c) for c in online]
        d = min(d, len(online))
        n_k = np.array([ctx.num_train(c) for c in online], dtype=np.float64)
        drawn = ctx.rng.choice(len(online), size=d, replace=False, p=n_k / n_k.sum())  # step 1
        candidates = [int(online[int(i)]) for i in drawn]
        if self.hp.variant == "pow-d":  # step 2
            losses = ctx.local_losses(candidates)
        else:
            losses = [state["last_loss"].get(k, math.inf) for k in candidates]
        return sorted(highest(candidates, losses, m))  # step 3

    def local_loss(self, ctx: ClientContext) -> LocalLoss:
        return LocalLoss(cross_entropy)  # client cohorts: FedAvg's step

    def upload(self, ctx: ClientContext, stats: dict) -> Upload:
        up = super().upload(ctx, stats)
        if self.hp.variant == "rpow-d":
            up.extras["loss"] = float(stats["loss"])  # the mean of its mini-batch losses this round
        return up

    def aggregate(self, state: dict, uploads, round: int) -> dict:
        state = super().aggregate(state, uploads, round)
        return {**state, "last_loss": update_bank(state["last_loss"], uploads, "loss")}


def highest(candidates: list[int], losses: list[float], m: int) -> list[int]:
    """The ``m`` candidates with the highest loss (nan, a client that could not answer, lowest);
    equal losses keep the candidates' order."""
    order = sorted(range(len(candidates)), key=lambda i: -losses[i] if losses[i] == losses[i] else math.inf)
    return [candidates[i] for i in order[:m]]
