"""Local (a.k.a. SingleSet / Standalone) — no federation: each client trains alone on its own
data and is evaluated with its own model. The lower baseline of every paper here.

Under the global and lodo protocols, where a single model is asked for, it is the uniform mean of
the clients' local models (one-shot model averaging after local training): the only model a
server could build without the clients ever training together. No hyperparameters of its own:
its budget is the experiment's rounds x epochs (FedWon spec 9.16: R x E epochs).
"""
from __future__ import annotations

from dataclasses import dataclass

from raysim.core.contract import LocalLoss, Method, cross_entropy
from raysim.core.hparams import Hparams


@dataclass(frozen=True)
class LocalHparams(Hparams):
    pass


class Local(Method):
    name = "local"
    Hparams = LocalHparams
    paper = "the Standalone/SingleSet baseline"
    shares = 'shares nothing; every client trains alone'

    def personal_keys(self, model):
        return set(model.state_dict().keys())  # the whole model stays on the client

    def local_loss(self, ctx):
        return LocalLoss(cross_entropy)  # client cohorts: the step is SGD on the cross-entropy

    # Nothing is shared, so the weighted mean is empty and the server state never changes.
