"""SCAFFOLD — Karimireddy, Kale, Mohri, Reddi, Stich, Suresh, "SCAFFOLD: Stochastic Controlled
Averaging for Federated Learning", ICML 2020 (Algorithm 1).

Server state: the global model x and the server control variate c (both start at 0 for c).
Client state: its control variate c_i (starts at 0, as FLGo does).

Client i in S, round t (Alg. 1 lines 7-13):
    y <- x
    K steps:   y <- y - eta_l (g_i(y) - c_i + c)
               (the correction is the gradient of <c - c_i, y>, added to the loss, so clipping and
               weight decay act on the corrected gradient as in FLGo)
    c_i+ <- c_i - c + (x - y) / (K eta_l)          option II (default)
          | grad f_i(x), one pass over D_i       option I
    upload  Delta y_i = y - x,  Delta c_i = c_i+ - c_i;  keep c_i <- c_i+

Server (lines 16-17):
    x <- x + eta_g (1/|S|) sum_i Delta y_i            (uniform over the round's clients)
    c <- c + (1/N) sum_i Delta c_i                    (N: all clients)

Control variates cover the trainable parameters; BN running statistics are averaged plainly
(which is what eta_g = 1 gives them). K is the number of optimizer steps actually taken, eta_l
this round's learning rate.

Devices: every variate SCAFFOLD keeps between rounds (the server's c, each client's c_i) lives on
the CPU whatever device trains; a client moves c and c_i to ctx.device for the
round's arithmetic with its model and stores c_i+ back on the CPU (the upload may stay on the
device: the engine moves it).

Where the defaults come from (``raysim methods scaffold`` lists each one's source): eta_g = 1 is
the paper's default and FLGo's (the SCAFFOLD FDSE ran); option II is FLGo's (the paper offers I,
possibly more stable, and II, cheaper: ``option: I``); c and c_i start at 0 (Alg. 1; FLGo).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from raysim.core.contract import ClientContext, LocalLoss, Method, Upload, cross_entropy
from raysim.core.hparams import Hparams, Space
from raysim.core.settings import setting
from raysim.core.tensors import cpu_copy


@dataclass(frozen=True)
class ScaffoldHparams(Hparams):
    eta_g: float = setting(1.0, gt=0, source="paper (default eta_g = 1); FLGo eta=1.0 agrees (spec 2.1)", doc="global step size")
    option: str = setting("II", one_of=("I", "II"), source="FLGo, the code FDSE ran (spec 2.1 pitfall 1); the paper offers both", doc="c_i+ of Alg. 1 line 12")

    @classmethod
    def search_space(cls):
        return {"eta_g": Space.log(0.1, 1.0)}


def control_update(c_i: dict, c: dict, x: dict, y: dict, steps: int, lr: float) -> dict:
    """Option II: c_i+ = c_i - c + (x - y) / (K eta_l)."""
    return {k: c_i[k] - c[k] + (x[k] - y[k]) / (steps * lr) for k in c_i}


def correction(params: dict, drift: dict) -> torch.Tensor:
    """<c - c_i, y> over the parameters (``drift`` = c - c_i): its gradient is the correction."""
    return sum((d * params[k]).sum() for k, d in drift.items())


class Scaffold(Method):
    name = "scaffold"
    Hparams = ScaffoldHparams
    paper = "Karimireddy et al., ICML 2020"
    shares = 'shares the model and control-variate updates; keeps its client control variate'
    uploads_beside_model = "its control-variate update (Upload.statistics)"

    def init_server(self, model):
        return {**super().init_server(model), "c": zero_variates(model)}

    def broadcast(self, state, round):
        return {**super().broadcast(state, round), "c": state["c"]}

    def init_client_state(self, client_id, model):
        return {"c": zero_variates(model)}

    def local_loss(self, ctx: ClientContext) -> LocalLoss:
        """Alg. 1 lines 7-11 as a per-batch loss: the drift c - c_i is the client's tensor it reads
        (option I's full gradient at x is taken first)."""
        model, dev = ctx.model, ctx.device
        c = {k: v.to(dev) for k, v in ctx.payload["c"].items()}  # (kept on the CPU between rounds)
        c_i = {k: v.to(dev) for k, v in ctx.state["c"].items()}
        x = {k: v.detach().clone() for k, v in model.state_dict().items()}
        c_new = None
        if self.hp.option == "I":
            c_new = full_gradient(ctx)
            model.load_state_dict(x)  # the pass moved the BN statistics: train from x as received
        drift = {k: c[k] - c_i[k] for k in c_i}
        return LocalLoss(self.batch_loss, tensors=drift,
                         finish=lambda ctx: self.finish(ctx, x, c, c_i, c_new))

    def batch_loss(self, forward, params, batch, drift):
        """f_i on the batch + <c - c_i, y>: its gradient is g_i(y) - c_i + c."""
        return cross_entropy(forward, params, batch, drift) + correction(params, drift)

    def finish(self, ctx: ClientContext, x: dict, c: dict, c_i: dict, c_new: dict | None) -> Upload:
        """Alg. 1 lines 12-13 on the trained model: c_i+ (option II from the model's move), the upload."""
        model = ctx.model
        stats = ctx.stats()
        y = {k: v.detach() for k, v in model.state_dict().items()}
        if self.hp.option == "II":
            c_new = control_update(c_i, c, x, y, max(stats["steps"], 1), ctx.lr)
        delta_c = {k: c_new[k] - c_i[k] for k in c_i}
        ctx.state["c"] = cpu_copy(c_new)
        return Upload(tensors=y, weight=1.0, metrics=stats, statistics=delta_c)  # uniform means over S

    def aggregate(self, state, uploads, round):
        x, mean = state["global"], uploads.mean
        eta = self.hp.eta_g
        new_x = {}
        for k, v in x.items():
            y_bar = mean[k]
            new_x[k] = y_bar if eta == 1.0 or k not in state["c"] else (v + eta * (y_bar - v)).to(v.dtype)
        share = len(uploads.clients) / self.setup.num_clients  # (1/N) sum_S = (|S|/N) mean_S
        c = {k: v + share * uploads.statistics[k] for k, v in state["c"].items()}  # statistics: mean of Delta c_i
        return {**state, "global": new_x, "c": c}


def zero_variates(model) -> dict:
    """c = 0 (or c_i = 0) for every trainable parameter, on the CPU whatever the model's device."""
    return {k: torch.zeros(p.shape, dtype=torch.float32) for k, p in model.named_parameters() if p.requires_grad}


def full_gradient(ctx: ClientContext) -> dict:
    """Option I: grad f_i(x), the mean over one pass of the batch gradients at the received x."""
    model = ctx.model
    sums, batches = {}, 0
    for xb, yb in ctx.batches(1, max_steps=None):  # one pass, no step
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(xb), yb).backward()
        for k, p in model.named_parameters():
            if p.grad is not None:
                sums[k] = sums.get(k, 0) + p.grad.detach()
        batches += 1
    model.zero_grad(set_to_none=True)
    return {k: sums.get(k, torch.zeros_like(p)) / max(batches, 1)
            for k, p in model.named_parameters() if p.requires_grad}
