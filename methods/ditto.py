"""Ditto — Li, Hu, Beirami, Smith, "Ditto: Fair and Robust Federated Learning Through
Personalization", ICML 2021 (Algorithm 1).

Client k, round t, receives w^t (its state: the personal model v_k, a copy of the first global
model it receives):
    for every batch (x, y) of E epochs, one step of each solver on the same batch (code, FLGo):
        global:    w   <- w   - eta grad L_k(w)                                   (FedAvg's local step)
        personal:  v_k <- v_k - eta ( grad L_k(v_k) + lambda (v_k - w^t) )        (w^t: as received, frozen)
    upload w; keep v_k.        Server: FedAvg over w.
Each client is scored with v_k (its BN statistics included); the global and lodo protocols score w.
The proximal term covers the trainable parameters.

Where the default comes from (``raysim methods ditto``): lambda = 1, the value of every run script
of the official code (litian96/ditto, ``--lam=1``); the paper lets each device pick lambda on its
validation data ({0.1, 1, 2} unless the attack is strong), falling back to 1. The FDSE configs set FDSE's
own values (Office 0.01, PACS 1e-4, from the FDSE repo). The solvers' form is the official code's
too: one step of each on the same batch (the code takes the personal step first; the two are
independent, both anchored at the frozen w^t), with the proximal gradient lambda (v_k - w^t).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from raysim.core.contract import ClientContext, Method, SpareModels, Upload
from raysim.core.hparams import Hparams, Space
from raysim.core.settings import setting
from raysim.core.tensors import load_tensors


@dataclass(frozen=True)
class DittoHparams(Hparams):
    lam: float = setting(1.0, ge=0, source="official code's run scripts (litian96/ditto --lam=1)", doc="lambda; FDSE's grid {1e-4, 1e-3, 1e-2, 0.1, 1}")

    @classmethod
    def search_space(cls):
        return {"lam": Space.log(1e-4, 1.0)}  # FDSE A7.4


def personal_objective(loss: torch.Tensor, personal: dict, anchor: dict, lam: float) -> torch.Tensor:
    """L_k(v) + (lambda / 2) ||v - w^t||^2 over the parameters."""
    return loss + 0.5 * lam * sum(((p - anchor[k]) ** 2).sum() for k, p in personal.items())


class Ditto(Method):
    name = "ditto"
    Hparams = DittoHparams
    paper = "Li et al., ICML 2021"
    shares = 'shares the global model; keeps a personal model v_k'

    def __init__(self, hp, setup):
        super().__init__(hp, setup)
        self.spares = SpareModels()  # the personal model's instance on this host

    def local_update(self, ctx: ClientContext) -> Upload:
        model, lam = ctx.model, self.hp.lam
        received = {k: v.detach().clone() for k, v in model.state_dict().items()}
        anchor = {k: received[k] for k, p in model.named_parameters() if p.requires_grad}  # w^t, frozen
        v = self.spares.get("personal", model, ctx.state.get("v", received), trainable=True)
        opt_w, opt_v = ctx.optimizer(), ctx.optimizer(v.parameters())
        personal_sum = 0.0
        for x, y in ctx.batches():
            ctx.step(F.cross_entropy(model(x), y), opt_w)  # the global solver
            loss_v = personal_objective(F.cross_entropy(v(x), y), dict(v.named_parameters()), anchor, lam)
            ctx.step(loss_v, opt_v, clip=v.parameters(), record=False)  # the personal solver
            personal_sum = personal_sum + loss_v.detach().double()
        stats = ctx.stats()
        stats["personal_loss"] = float(personal_sum) / max(stats["steps"], 1)
        ctx.state["v"] = {k: t.detach().cpu().clone() for k, t in v.state_dict().items()}
        return self.upload(ctx, stats)

    def post_train_state(self, ctx):
        return {k: v.clone() for k, v in ctx.state["v"].items()}

    def eval_model(self, model, payload, state):
        """The personal model v_k (the global model before the client's first round)."""
        self.load_client_model(model, payload, state)
        load_tensors(model, state.get("v", {}))
        return model
