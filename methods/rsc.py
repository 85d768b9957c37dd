"""FedAvg + RSC — Huang, Wang, Xing, Huang, "Self-Challenging Improves Cross-Domain
Generalization", ECCV 2020 (Representation Self-Challenging), run at every client of FedAvg
(gPerXAN Tables 2-3's "FedAvg w/ RSC"; baselines spec 7).

The network splits into a feature extractor and the rest, z = the last conv feature map
(B x C x H x W, before global pooling / flattening). Per training batch (paper, Alg. 1):
    g = d( sum_i h(z_i)[y_i] ) / dz                     gradient of the true-class logit w.r.t. z
    spatial-wise (probability 1/2): g~_i = mean_c g_i   (H x W);   channel-wise: g~_i = mean_hw g_i (C)
    q_i = the (1 - p) quantile of g~_i;  m_i = 0 where g~_i >= q_i, else 1   (mute the top-p share)
    batch percentage: only the b share of samples whose true-class confidence drops most under
        the mask, softmax(h(z_i))[y_i] - softmax(h(z_i * m_i))[y_i], keep m_i; the others m_i = 1
    L = CE(h(z * m), y),  one SGD step on it (the gradient through z trains the extractor)
Server: plain FedAvg. Scored: the global model (no muting at test time).

Choices:
* p = 1/3 (feature dropping percentage) and b = 1/3 (batch percentage): the paper's values, and
  DomainBed's port's defaults. The muted side of the batch percentage: the b share with the largest
  confidence drop, as the authors' release does (DeLightCMU/RSC keeps the mask on the b share of
  samples with the largest drop) and DomainBed's port (unmasked: the samples below the (1 - b)
  percentile of the drop).
* Forms of the authors' release with no switch here (which of them produced the paper's numbers is
  unclear; the defaults follow the paper's Algorithm 1): its spatial score is Grad-CAM-like,
  sum_c z * mean_hw g, not mean_c g; its channel variant drops ceil(C / 3.2) channels, not C / 3; and
  its batch percentage grows with the epoch (0.3, then +0.2 every 10 epochs), which has no
  counterpart in federated rounds.
* Spatial vs channel: one fair coin per batch from the client's keyed generator (the paper picks
  one of the two at random each iteration).
* Ties at the quantile are muted (>=); the quantile is torch.quantile's linear interpolation.
* The gradient for the mask is taken with the current parameters and no second-order graph; z
  is not re-computed (one extractor forward per step, as in the paper).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from raysim.core.contract import ClientContext, Method, Upload
from raysim.core.errors import UserError
from raysim.core.hparams import Hparams, Space
from raysim.core.settings import setting


@dataclass(frozen=True)
class RSCHparams(Hparams):
    drop_f: float = setting(1 / 3, gt=0, lt=1, source="paper; code: 1/3 of the locations (1/3.2 of the channels)", doc="feature dropping percentage p")
    drop_b: float = setting(1 / 3, gt=0, le=1, source="paper; DomainBed's port agrees (the code schedules it from 0.3)", doc="batch percentage b")

    @classmethod
    def search_space(cls):
        return {"drop_f": Space.uniform(0.1, 0.5), "drop_b": Space.uniform(0.1, 1.0)}


def rsc_mask(grad: torch.Tensor, drop_f: float, spatial: bool) -> torch.Tensor:
    """The per-sample 0/1 mask muting the top ``drop_f`` share of the gradient-averaged
    locations (spatial: mean over channels) or channels (mean over H x W), shaped to broadcast on
    a B x C x H x W map."""
    b = grad.shape[0]
    score = grad.mean(dim=1, keepdim=True) if spatial else grad.mean(dim=(2, 3), keepdim=True)
    flat = score.reshape(b, -1)
    q = torch.quantile(flat, 1 - drop_f, dim=1, keepdim=True)
    return (flat < q).to(grad.dtype).view_as(score)


def batch_select(p_before: torch.Tensor, p_after: torch.Tensor, drop_b: float) -> torch.Tensor:
    """The samples whose true-class confidence drops most (the ``drop_b`` share, at least one):
    a bool vector."""
    change = p_before - p_after
    k = max(1, int(round(drop_b * len(change))))
    keep = torch.zeros_like(change, dtype=torch.bool)
    keep[torch.topk(change, k).indices] = True
    return keep


def challenge_mask(z: torch.Tensor, y: torch.Tensor, classify, drop_f: float, drop_b: float,
                   spatial: bool) -> torch.Tensor:
    """RSC's mask for a (detached) feature map z: mute the features with the largest gradient of
    the true-class logit, on the ``drop_b`` share of samples whose confidence drops most."""
    z = z.detach().requires_grad_(True)
    logits = classify(z)
    grad, = torch.autograd.grad(logits.gather(1, y[:, None]).sum(), z)
    mask = rsc_mask(grad, drop_f, spatial)
    with torch.no_grad():
        before = F.softmax(logits, 1).gather(1, y[:, None]).squeeze(1)
        after = F.softmax(classify(z * mask), 1).gather(1, y[:, None]).squeeze(1)
        chosen = batch_select(before, after, drop_b)
    return torch.where(chosen.view(-1, *[1] * (z.dim() - 1)), mask, torch.ones_like(mask))


def conv_split(features: nn.Sequential) -> int:
    """The index of the first child of ``features`` past the conv trunk (pooling, flatten, linear)."""
    stop = (nn.Flatten, nn.Linear, nn.Dropout, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)
    for i, child in enumerate(features):
        if isinstance(child, stop):
            return i
    raise UserError("fedavg_rsc: the model's features have no pooling/flatten after their conv layers")


class FedAvgRSC(Method):
    name = "fedavg_rsc"
    Hparams = RSCHparams
    paper = "Huang et al., ECCV 2020 (RSC), inside FedAvg"
    shares = 'shares the whole model (RSC in training); keeps nothing'

    def local_update(self, ctx: ClientContext) -> Upload:
        model, hp = ctx.model, self.hp
        cut = conv_split(model.features)
        trunk, rest = model.features[:cut], model.features[cut:]

        def classify(z):
            return model.head(rest(z))

        opt = ctx.optimizer()
        for x, y in ctx.batches():
            z = trunk(x)
            spatial = bool(torch.rand(1, generator=ctx.generator) < 0.5)
            mask = challenge_mask(z.detach(), y, classify, hp.drop_f, hp.drop_b, spatial)
            ctx.step(F.cross_entropy(classify(z * mask), y), opt)
        return self.upload(ctx, ctx.stats())
