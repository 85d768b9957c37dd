"""FedFA — Zhou & Konukoglu, "FedFA: Federated Feature Augmentation", ICLR 2023 (the FedFA of FDSE's
Table 1: feature augmentation after the conv blocks; not FLGo's unrelated `fedfa`; spec 4.2).

An FFA layer after every conv block (FDSE A7.2 on AlexNet's first five layers; small_cnn: after
pool1 and pool2; cnn6: after pool1, pool2 and the conv3 block) is active in training only, with
probability p per forward pass (one draw for the batch). For x of shape B x C x H x W:
    mu_i = mean_hw x_i,  sigma_i = sqrt(var_hw x_i + eps)                   instance statistics
    S2_mu = var_i mu_i + eps,  S2_sigma = var_i sigma_i + eps              the client's variance (batch)
    running mu_bar <- 0.99 mu_bar + 0.01 mean_i mu_i   (sigma_bar likewise; buffers, averaged by FedAvg)
    r_c = 1 / (1 + 1 / (S2bar_c + eps)),  g_c = C r_c / sum_c' r_c'       S2bar: the client-sharing variance
    S2hat = (1 + g) * S2                                                   (for mu and for sigma)
    out = (sigma + e2 * sqrt(S2hat_sigma)) * (x - mu) / sigma + (mu + e1 * sqrt(S2hat_mu)),   e ~ N(0, 1)
Server: FedAvg of every parameter and buffer; then, per FFA layer, S2bar_mu = Var_k(mu_bar_k) and
S2bar_sigma = Var_k(sigma_bar_k) across the round's clients: one scalar over the K x C matrix copied
to every channel (the released code and FDSE's port: then g = 1 whatever the clients' statistics;
``shared_var: scalar_code``, the default), or per channel (the paper's equation; ``per_channel``).
Data exchange: each client uploads its per-channel running feature means and stds (2 C floats per
FFA layer), the server broadcasts their cross-client variances.

Where the defaults come from (``raysim methods fedfa``): the authors' released code (tfzhou/FedFA),
the form the paper's settings were run with. p = 0.5, momentum 0.99 and eps = 1e-6 are its
FFALayer's defaults. Where the paper's equation and the code differ, the code's form is the default
and the paper's a switch:
  * ``shared_var: scalar_code`` (code: ``torch.var`` of the stacked K x C statistics is one number);
    ``per_channel`` is the paper's per-channel client-sharing variance. FDSE ran the code's form.
  * No switch: the paper's Algorithm 1 restarts each client's running statistics (mu_bar = 0,
    sigma_bar = 1) every round; the code, and this file, keep the FedAvg-ed buffers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from raysim.core.contract import ClientContext, Method, Upload
from raysim.core.hparams import Hparams
from raysim.models.blocks import insert_after_blocks
from raysim.core.settings import setting
from raysim.core.training import train_epochs

FFA = "ffa"  # module-name prefix of the inserted layers


@dataclass(frozen=True)
class FedFAHparams(Hparams):
    p: float = setting(0.5, ge=0, le=1, source="official code (tfzhou/FedFA FFALayer prob=0.5)", doc="probability an FFA layer augments a batch")
    momentum: float = setting(0.99, ge=0, lt=1, source="official code (tfzhou/FedFA FFALayer momentum1=0.99)", doc="of the running statistics")
    eps: float = setting(1e-6, gt=0, source="official code (tfzhou/FedFA FFALayer eps=1e-6)")
    shared_var: str = setting("scalar_code", one_of=("per_channel", "scalar_code"), source="official code (tfzhou/FedFA FedFAComm: one scalar variance); FDSE's port agrees", doc="scalar_code: the code's | per_channel: the paper's equation")


class FFALayer(nn.Module):
    """Feature statistics augmentation; the identity in eval mode and for batches of one."""

    def __init__(self, channels: int, p: float = 0.5, momentum: float = 0.99, eps: float = 1e-6):
        super().__init__()
        self.p, self.momentum, self.eps = p, momentum, eps
        self.register_buffer("running_mean", torch.zeros(channels))
        self.register_buffer("running_std", torch.ones(channels))
        self.register_buffer("shared_var_mean", torch.zeros(channels))
        self.register_buffer("shared_var_std", torch.zeros(channels))
        self.generator: torch.Generator | None = None  # the client's keyed generator, set per round

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or x.shape[0] < 2 or float(torch.rand(1, generator=self.generator)) > self.p:
            return x
        mu = x.mean(dim=(2, 3))
        sigma = (x.var(dim=(2, 3)) + self.eps).sqrt()
        with torch.no_grad():
            self.running_mean.mul_(self.momentum).add_((1 - self.momentum) * mu.mean(0))
            self.running_std.mul_(self.momentum).add_((1 - self.momentum) * sigma.mean(0))
        return self.augment(x, mu, sigma, torch.randn((2, *mu.shape), generator=self.generator).to(x.device, x.dtype))

    def augment(self, x: torch.Tensor, mu: torch.Tensor, sigma: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """x with its statistics (mu, sigma) replaced by resampled ones (``noise``: e1, e2)."""
        beta = mu + noise[0] * self.spread(mu, self.shared_var_mean)
        gamma = sigma + noise[1] * self.spread(sigma, self.shared_var_std)
        return gamma[..., None, None] * (x - mu[..., None, None]) / sigma[..., None, None] + beta[..., None, None]

    def spread(self, stat: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
        """sqrt(S2hat): the batch variance of a statistic, scaled up by the client-sharing variance."""
        var = stat.var(dim=0) + self.eps
        r = 1.0 / (1.0 + 1.0 / (shared + self.eps))
        return ((1.0 + r.numel() * r / r.sum()) * var).sqrt()


class FedFA(Method):
    name = "fedfa"
    Hparams = FedFAHparams
    paper = "Zhou & Konukoglu, ICLR 2023"
    shares = 'shares the model and per-channel feature statistics; keeps nothing'
    exchanges = "per-channel running means and stds of each client's intermediate features (2 C floats per FFA layer)"

    def build_model(self) -> nn.Module:
        model = super().build_model()
        hp = self.hp
        insert_after_blocks(model, lambda c: FFALayer(c, hp.p, hp.momentum, hp.eps), FFA, owner=self.name)
        return model

    def local_update(self, ctx: ClientContext) -> Upload:
        ffa = ffa_layers(ctx.model)
        for layer in ffa.values():
            layer.generator = ctx.generator  # the gate and the noise: the client's keyed generator
        try:
            stats = train_epochs(ctx)
        finally:
            for layer in ffa.values():
                layer.generator = None
        up = self.upload(ctx, stats)
        up.extras = {"ffa": {n: (m.running_mean.detach().cpu().clone(), m.running_std.detach().cpu().clone())
                             for n, m in ffa.items()}}
        return up

    def aggregate(self, state, uploads, round):
        state = super().aggregate(state, uploads, round)  # FedAvg of every parameter and buffer
        stats = [e["ffa"] for e in uploads.extras.values() if "ffa" in e]
        if len(stats) < 2:
            return state
        new_global = dict(state["global"])
        for name in stats[0]:
            for i, suffix in enumerate(("shared_var_mean", "shared_var_std")):
                stacked = torch.stack([s[name][i] for s in stats])  # K x C
                var = stacked.var(dim=0) if self.hp.shared_var == "per_channel" else stacked.var().expand(stacked.shape[1])
                new_global[f"{name}.{suffix}"] = var.clone()
        return {**state, "global": new_global}


def ffa_layers(model: nn.Module) -> dict[str, FFALayer]:
    return {n: m for n, m in model.named_modules() if isinstance(m, FFALayer)}
