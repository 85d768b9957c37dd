"""FedAvg + MixStyle — Zhou, Yang, Qiao, Xiang, "Domain Generalization with MixStyle", ICLR 2021,
run at every client of FedAvg (gPerXAN Tables 2-3's "FedAvg w/ MixStyle"; baselines spec 7).

MixStyle is a plug-in layer after early conv blocks, active in training only, with probability p
per forward pass (one draw for the batch). For a feature map x of shape B x C x H x W:
    mu_i = mean_hw x_i,  sigma_i = sqrt(var_hw x_i + eps)        instance statistics (population var)
    lambda_i ~ Beta(alpha, alpha),  j = perm(i)                    a random shuffle of the batch
    gamma_mix = lambda_i sigma_i + (1 - lambda_i) sigma_j,  beta_mix = lambda_i mu_i + (1 - lambda_i) mu_j
    out_i = gamma_mix * (x_i - mu_i) / sigma_i + beta_mix
Server: plain FedAvg (the layer has no parameters or buffers). Scored: the global model (no
MixStyle at test time).

Choices:
* p = 0.5, alpha = 0.1, eps = 1e-6: the paper's defaults and the authors' release's
  (KaiyangZhou/mixstyle-release, ``MixStyle(p=0.5, alpha=0.1, eps=1e-6)``). One form differs from the
  release, with no switch: the release takes the unbiased variance over H x W (torch's default),
  this file the population one; sigma differs by a factor sqrt(HW / (HW - 1)), about 1% at 7 x 7.
* Where: the paper puts MixStyle after res1, res2 and res3 of a ResNet (not res4: "early layers"
  hold style, late ones semantics). Here: after the first three residual stages of a ResNet, and
  after every conv block but the last, at most three, of a plain CNN (small_cnn: pool1; cnn6:
  pool1, pool2; AlexNet: pool1, pool2, conv3) [R]. A ResNet's stem gets an identity placeholder
  (the block helper inserts after the first n blocks).
* The shuffle: each client holds one domain, so the paper's random-shuffle mode (its
  single-domain case) is the only one; the cross-domain "domain label" mode cannot apply.
* mu and sigma are detached (no gradient through the statistics), as in the authors' release;
  the paper text does not say [U].
* Randomness: the gate, lambda and the shuffle come from the client's keyed generator; without
  one (any train-mode pass outside local training, e.g. BN-statistics collection) the layer is
  the identity, so it never draws from the global RNG.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from raysim.core.contract import ClientContext, Method, Upload
from raysim.core.hparams import Hparams, Space
from raysim.models.blocks import block_ends, insert_after_blocks
from raysim.core.settings import setting
from raysim.core.training import train_epochs

PREFIX = "mixstyle"


@dataclass(frozen=True)
class MixStyleHparams(Hparams):
    p: float = setting(0.5, ge=0, le=1, source="paper; code agrees (mixstyle-release p=0.5)", doc="probability a MixStyle layer mixes a batch")
    alpha: float = setting(0.1, gt=0, source="paper; code agrees (mixstyle-release alpha=0.1)", doc="Beta(alpha, alpha) of the mixing weight")
    eps: float = setting(1e-6, gt=0, source="official code (mixstyle-release eps=1e-6)")

    @classmethod
    def search_space(cls):
        return {"p": Space.uniform(0.1, 0.9), "alpha": Space.log(0.05, 1.0)}


def mix_styles(x: torch.Tensor, lam: torch.Tensor, perm: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """MixStyle's mix: each instance's (mu, sigma) replaced by lam * own + (1 - lam) * those of
    instance ``perm[i]`` (statistics detached, population variance + eps under the root)."""
    mu = x.mean(dim=(2, 3), keepdim=True).detach()
    sigma = (x.var(dim=(2, 3), keepdim=True, unbiased=False) + eps).sqrt().detach()
    lam = lam.to(x.dtype).view(-1, 1, 1, 1)
    mu_mix = lam * mu + (1 - lam) * mu[perm]
    sigma_mix = lam * sigma + (1 - lam) * sigma[perm]
    return sigma_mix * (x - mu) / sigma + mu_mix


class MixStyle(nn.Module):
    """The identity in eval mode, for batches of one, and without a generator."""

    def __init__(self, p: float = 0.5, alpha: float = 0.1, eps: float = 1e-6):
        super().__init__()
        self.p, self.alpha, self.eps = p, alpha, eps
        self.generator: torch.Generator | None = None  # the client's keyed generator, set per round

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.generator
        if not self.training or g is None or x.shape[0] < 2 or float(torch.rand(1, generator=g)) > self.p:
            return x
        b = x.shape[0]
        # Beta draws through numpy, seeded from the keyed generator (torch's Beta takes no generator)
        rng = np.random.default_rng(int(torch.randint(0, 2 ** 62, (1,), generator=g)))
        lam = torch.from_numpy(rng.beta(self.alpha, self.alpha, size=b)).to(x.device)
        perm = torch.randperm(b, generator=g).to(x.device)
        return mix_styles(x, lam, perm, self.eps)

    def extra_repr(self) -> str:
        return f"p={self.p}, alpha={self.alpha}"


def mixstyle_sites(features: nn.Sequential) -> list[bool]:
    """For each conv block of ``features`` up to the last one that gets MixStyle, whether it does:
    a ResNet's residual stages 1-3 (not its stem), else every block but the last, at most three."""
    ends = block_ends(features)
    if "layer1" in ends:  # a ResNet: [stem, layer1, ..., layer4]
        return [e in ("layer1", "layer2", "layer3") for e in ends[:ends.index("layer3") + 1]]
    return [True] * min(3, max(len(ends) - 1, 1))


class FedAvgMixStyle(Method):
    name = "fedavg_mixstyle"
    Hparams = MixStyleHparams
    paper = "Zhou et al., ICLR 2021 (MixStyle), inside FedAvg"
    shares = 'shares the whole model (MixStyle in training); keeps nothing'

    def build_model(self) -> nn.Module:
        model = super().build_model()
        hp = self.hp
        sites = iter(mixstyle_sites(model.features))
        insert_after_blocks(model, lambda c: MixStyle(hp.p, hp.alpha, hp.eps) if next(sites) else nn.Identity(),
                            PREFIX, blocks=len(mixstyle_sites(model.features)), owner=self.name)
        return model

    def local_update(self, ctx: ClientContext) -> Upload:
        layers = [m for m in ctx.model.modules() if isinstance(m, MixStyle)]
        for layer in layers:
            layer.generator = ctx.generator
        try:
            stats = train_epochs(ctx)
        finally:
            for layer in layers:
                layer.generator = None
        return self.upload(ctx, stats)
