"""Ditto — Li, Hu, Beirami, Smith, "Ditto: Fair and Robust Federated Learning Through
Personalization", ICML 2021 (Algorithm 1).

Client k, round t, receives w^t (its state: the personal model v_k, a copy of the first global
model it receives; with ``lam: auto`` also lambda_k, the lambda v_k was last trained with):
    Lambda = {lam}, or with lam: auto the grid lam_grid (the paper's {0.1, 1, 2})
    for every batch (x, y) of E epochs, one step of each solver on the same batch (code, FLGo):
        global:    w   <- w   - eta grad L_k(w)                                   (FedAvg's local step)
        personal:  v_l <- v_l - eta ( grad L_k(v_l) + l (v_l - w^t) ),  v_l from v_k, for each l in Lambda
                                                                             (w^t: as received, frozen)
    v_k, lambda_k <- the v_l, l with the best accuracy on the client's validation split
                     (one l: that one, no validation pass)
    upload w; keep v_k.        Server: FedAvg over w.
Each client is scored with v_k (its BN statistics included); the global and lodo protocols score w.
The proximal term covers the trainable parameters.

Where the default comes from (``raysim methods ditto``): lambda = 1, the value of every run script
of the official code (litian96/ditto, ``--lam=1``). The FDSE configs set FDSE's own values (Office
0.01, PACS 1e-4, from the FDSE repo). The solvers' form is the official code's too: one step of
each on the same batch (the code takes the personal step first; the two are independent, both
anchored at the frozen w^t), with the proximal gradient lambda (v_k - w^t).

``lam: auto`` is the paper's own choice of lambda. Its experimental setup: "For each device, we
select lambda locally based on its local validation data", from {0.1, 1, 2} ({0.05, 0.1, 0.2}
where the device judges the attack strong), and a fixed lambda = 1 on devices with fewer than 4
validation samples (0.1 under a strong attack). The paper does not say when; the official code
(``--dynamic_lam``) chooses at every local step, taking that step with each candidate and keeping
the one whose model has the lowest validation loss. Here (ours) the choice is made every round the
client trains: each candidate trains its own copy of v_k through the round, on the same batches,
and the copy with the highest validation accuracy becomes v_k (ties: the lower validation loss, the
code's criterion; then the grid's order). Every round, as the code re-chooses throughout, because
the best lambda moves as w^t improves; per round, not per step, because a validation pass per step
and candidate would cost more than the training. A client with no validation split or fewer than
4 validation samples trains with lambda = 1 alone. lambda_k is reported as the train metric
``lam`` (per client, and its mean as ALL).

Cost per round against a fixed lambda, with the 3-value grid: the personal solver runs 3 times
(forward and backward: 4 passes per batch instead of 2, so 2x a fixed-lambda Ditto's training
compute), plus 3 forward passes over the validation split; the host holds 3 personal models and
their optimizers instead of 1. The upload and the server are unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from raysim.core.contract import ClientContext, Method, SpareModels, Upload
from raysim.core.errors import UserError
from raysim.core.hparams import Hparams, Space
from raysim.core.settings import setting
from raysim.core.tensors import load_tensors
from raysim.core.training import evaluate

PAPER_GRID = (0.1, 1.0, 2.0)  # the paper's candidates where no strong attack is assumed
FALLBACK_LAM = 1.0  # the paper's lambda on a device with too few validation samples to choose
MIN_VAL_SAMPLES = 4  # the paper: "fewer than 4" validation samples -> the fixed lambda


@dataclass(frozen=True)
class DittoHparams(Hparams):
    lam: float | str = setting(1.0, ge=0, expected="a number >= 0 or 'auto'", source="official code's run scripts (litian96/ditto --lam=1)", doc="lambda; FDSE's grid {1e-4, 1e-3, 1e-2, 0.1, 1}; 'auto': each client picks its own from lam_grid every round by validation accuracy (the paper's setup)")
    lam_grid: tuple[float, ...] = setting(PAPER_GRID, ge=0, source="paper's experimental setup (no strong attack; strong: 0.05, 0.1, 0.2); chosen every round the client trains (ours: the paper does not say when, the official code's --dynamic_lam chooses every local step)", doc="lam: auto's candidates")

    def __post_init__(self):
        if isinstance(self.lam, str) and self.lam != "auto":
            raise UserError(f"hyperparameter 'hp.ditto.lam' = {self.lam!r}: expected a number >= 0 or 'auto'")
        if not self.lam_grid:
            raise UserError("hyperparameter 'hp.ditto.lam_grid' = (): expected a non-empty list of numbers >= 0")

    @classmethod
    def search_space(cls):
        return {"lam": Space.log(1e-4, 1.0)}  # FDSE A7.4


def personal_objective(loss: torch.Tensor, personal: dict, anchor: dict, lam: float) -> torch.Tensor:
    """L_k(v) + (lambda / 2) ||v - w^t||^2 over the parameters."""
    return loss + 0.5 * lam * sum(((p - anchor[k]) ** 2).sum() for k, p in personal.items())


class PersonalSolver:
    """One copy of v_k trained with one lambda through the round (lam: auto trains one per grid value)."""

    def __init__(self, lam: float, model: nn.Module, opt: torch.optim.Optimizer):
        self.lam, self.model, self.opt = lam, model, opt
        self.loss_sum = 0.0

    def step(self, ctx: ClientContext, x, y, anchor: dict) -> None:
        """v_l <- v_l - eta ( grad L_k(v_l) + l (v_l - w^t) ), beside the client's own step."""
        loss = personal_objective(F.cross_entropy(self.model(x), y), dict(self.model.named_parameters()), anchor, self.lam)
        ctx.step(loss, self.opt, clip=self.model.parameters(), record=False)
        self.loss_sum = self.loss_sum + loss.detach().double()


def best_on_validation(solvers: list[PersonalSolver], ctx: ClientContext) -> PersonalSolver:
    """The solver whose model scores best on the client's validation split: the highest accuracy,
    ties to the lower loss, then to the first; a lone solver without a validation pass."""
    if len(solvers) == 1:
        return solvers[0]
    batch_size = max(ctx.train.batch_size, 256)
    scores = [evaluate(s.model, ctx.data.val, batch_size, ctx.device) for s in solvers]
    best = max(range(len(solvers)), key=lambda i: (scores[i]["correct"], -scores[i]["loss_sum"], -i))
    return solvers[best]


class Ditto(Method):
    name = "ditto"
    Hparams = DittoHparams
    paper = "Li et al., ICML 2021"
    shares = 'shares the global model; keeps a personal model v_k'

    def __init__(self, hp, setup):
        super().__init__(hp, setup)
        self.spares = SpareModels()  # the personal models' instances on this host

    def lambdas(self, ctx: ClientContext) -> tuple[float, ...]:
        """This round's candidate lambdas: the fixed lam, or (auto) the grid where the client has
        validation data enough to choose, the paper's fallback lambda otherwise."""
        if self.hp.lam != "auto":
            return (self.hp.lam,)
        val = ctx.data.val
        return self.hp.lam_grid if val is not None and len(val) >= MIN_VAL_SAMPLES else (FALLBACK_LAM,)

    def local_update(self, ctx: ClientContext) -> Upload:
        model = ctx.model
        received = {k: v.detach().clone() for k, v in model.state_dict().items()}
        anchor = {k: received[k] for k, p in model.named_parameters() if p.requires_grad}  # w^t, frozen
        start = ctx.state.get("v", received)
        opt_w = ctx.optimizer()
        solvers = []
        for i, lam in enumerate(self.lambdas(ctx)):
            v = self.spares.get(f"personal {i}", model, start, trainable=True)
            solvers.append(PersonalSolver(lam, v, ctx.optimizer(v.parameters())))
        for x, y in ctx.batches():
            ctx.step(F.cross_entropy(model(x), y), opt_w)  # the global solver
            for solver in solvers:
                solver.step(ctx, x, y, anchor)  # the personal solver(s)
        chosen = best_on_validation(solvers, ctx)
        stats = ctx.stats()
        stats["personal_loss"] = float(chosen.loss_sum) / max(stats["steps"], 1)
        ctx.state["v"] = {k: t.detach().cpu().clone() for k, t in chosen.model.state_dict().items()}
        if self.hp.lam == "auto":
            stats["lam"] = ctx.state["lam"] = chosen.lam
        return self.upload(ctx, stats)

    def post_train_state(self, ctx):
        return {k: v.clone() for k, v in ctx.state["v"].items()}

    def eval_model(self, model, payload, state):
        """The personal model v_k (the global model before the client's first round)."""
        self.load_client_model(model, payload, state)
        load_tensors(model, state.get("v", {}))
        return model
