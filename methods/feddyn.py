"""FedDyn — Acar, Zhao, Matas Navarro, Mattina, Whatmough, Saligrama, "Federated Learning Based on
Dynamic Regularization", ICLR 2021 (Algorithm 1).

Client k in S, round t, from theta^{t-1} (its state: g_k, the gradient of its last local optimum, 0 at first):
    theta_k = argmin_theta  L_k(theta) - <g_k, theta> + (alpha / 2) ||theta - theta^{t-1}||^2   (E epochs of SGD)
    g_k <- g_k - alpha (theta_k - theta^{t-1})
Server (state: h, 0 at first):
    h       <- h - (alpha / N) sum_{k in S} (theta_k - theta^{t-1})          (N: all clients)
    theta^t  = (1 / |S|) sum_{k in S} theta_k - h / alpha                    (the scored model)
The linear and quadratic terms, g_k and h cover the trainable parameters; BN running statistics
are averaged plainly.

Where the default comes from (``raysim methods feddyn``): alpha = 0.01, the official code's
(alpemreacar/FedDyn: ``alpha_coef = 1e-2`` in its CIFAR-10 and synthetic examples); it is also in
FDSE's grid (FLGo's default is 0.1). Two forms of the official code have no switch here (FDSE ran
FLGo's, which is this file's): it scales alpha per client, alpha / (n_k / mean_j n_j) (the same as
uniform alpha when the clients hold equal data), and the accuracies it reports are those of plain
means of client models (the round's, or every client's latest), while theta^t (with the -h / alpha
correction) is what it sends to the clients and what is scored here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from raysim.core.contract import ClientContext, LocalLoss, Method, Upload, cross_entropy
from raysim.core.hparams import Hparams, Space
from raysim.core.settings import setting


@dataclass(frozen=True)
class FedDynHparams(Hparams):
    alpha: float = setting(0.01, gt=0, source="official code (alpemreacar/FedDyn examples: alpha_coef = 1e-2)", doc="in FDSE's grid {0.001, 0.01, 0.03, 0.1} (FLGo default 0.1)")

    @classmethod
    def search_space(cls):
        return {"alpha": Space.choice(0.001, 0.01, 0.03, 0.1)}  # FDSE A7.4


def dynamic_regularizer(params: dict, g: dict, anchor: dict, alpha: float) -> torch.Tensor:
    """- <g_k, theta> + (alpha / 2) ||theta - theta^{t-1}||^2 over the parameters."""
    return sum(-(g[k] * p).sum() + 0.5 * alpha * ((p - anchor[k]) ** 2).sum() for k, p in params.items())


def server_step(prev: dict, mean: dict, h: dict, alpha: float, sampled: int, total: int) -> tuple[dict, dict]:
    """(theta^t, h) from theta^{t-1}, the round's mean model and h, over the keys of ``h``
    (the parameters); other entries take the mean."""
    h_new = {k: h[k] - alpha * (sampled / total) * (mean[k] - prev[k]) for k in h}  # (1/N) sum_S = (|S|/N) mean_S
    theta = {k: (mean[k] - h_new[k] / alpha).to(prev[k].dtype) if k in h else mean[k] for k in prev}
    return theta, h_new


class FedDyn(Method):
    name = "feddyn"
    Hparams = FedDynHparams
    paper = "Acar et al., ICLR 2021"
    shares = 'shares the whole model; keeps its dynamic-regularizer gradient g_k'

    def init_server(self, model):
        return {**super().init_server(model), "h": _zeros(model)}

    def init_client_state(self, client_id, model):
        return {"g": _zeros(model)}

    def local_loss(self, ctx: ClientContext) -> LocalLoss:
        """The client step as a per-batch loss: g_k and theta^{t-1} are the client's tensors it reads."""
        anchor = {k: p.detach().clone() for k, p in ctx.model.named_parameters() if p.requires_grad}  # theta^{t-1}
        g = {k: v.to(ctx.device) for k, v in ctx.state["g"].items()}
        return LocalLoss(self.batch_loss, tensors={"g": g, "anchor": anchor},
                         finish=lambda ctx: self.finish(ctx, g, anchor))

    def batch_loss(self, forward, params, batch, mine):
        """L_k on the batch - <g_k, theta> + (alpha / 2) ||theta - theta^{t-1}||^2, over the parameters in g_k."""
        g = mine["g"]  # the cross-entropy first: the order autograd sums a parameter's gradients in
        return cross_entropy(forward, params, batch, mine) + dynamic_regularizer(
            {k: p for k, p in params.items() if k in g}, g, mine["anchor"], self.hp.alpha)

    def finish(self, ctx: ClientContext, g: dict, anchor: dict) -> Upload:
        """g_k <- g_k - alpha (theta_k^t - theta^{t-1}), and the upload (uniform weight)."""
        model, alpha = ctx.model, self.hp.alpha
        params = dict(model.named_parameters())
        ctx.state["g"] = {k: (g[k] - alpha * (params[k].detach() - anchor[k])).cpu() for k in g}
        return Upload(tensors={k: v.detach() for k, v in model.state_dict().items()}, weight=1.0,  # 1/|S|
                      metrics=ctx.stats())

    def aggregate(self, state, uploads, round):
        theta, h = server_step(state["global"], uploads.mean, state["h"], self.hp.alpha, len(uploads.clients),
                               self.setup.num_clients)
        return {**state, "global": theta, "h": h}


def _zeros(model) -> dict:
    """Zeros like each trainable parameter, on the CPU (kept between rounds)."""
    return {k: torch.zeros(p.shape, dtype=p.dtype) for k, p in model.named_parameters() if p.requires_grad}
