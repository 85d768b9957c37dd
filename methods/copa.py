"""COPA — G. Wu, S. Gong, "Collaborative Optimization and Aggregation for Decentralized Domain
Generalization and Adaptation", ICCV 2021 (its domain-generalization part; baselines spec 5.5).

Model: a domain-invariant feature extractor F with hybrid batch-instance normalization (IBN-Net-a
style: the first half of each early BN layer's channels instance-normalised) and one classifier
head C_k per source client. Round t, client k, from F^{t-1} and the bank of heads {C_j^{t-1}}:
    L_k = CE(C_k(F(x)), y) + 1/|J| sum_{j in J} CE(C_j^frozen(F(x)), y),   J = the other clients'
          trained heads ("collaboration of frozen classifiers": they are not updated, but their
          loss trains F to suit every domain's head)
    upload F_k and C_k.
Server: F^t = the weighted mean of the F_k (BN buffers too); C_k^t = client k's uploaded head (a bank,
not averaged); broadcast F and every head. Test (any domain, the unseen one included): the ensemble
of the heads on F(x), p(y|x) = mean_j softmax(C_j(F(x))).

COPA's code is not public and the equations were not read (spec 5.5, 8.3); what we took ([R], not
verified against the paper):
* the loss above: own CE plus the mean of the frozen foreign heads' CEs (weight 1 / (N - 1) when
  every head is in the bank); round 1 has no trained foreign head, so own CE only; the heads used
  are those of round t - 1;
* the ensemble is the mean softmax over the trained heads (every head before any is trained);
* IBN-a: the first ``ibn_fraction`` of the extractor's 2-D BN layers (module order, residual
  shortcuts excluded) become IN on the first half of their channels + BN on the rest, initialised
  from the BN they replace (so pretrained weights carry over); ``ibn_fraction: 0`` keeps plain BN;
* the extractor's SGD includes the own head only; the frozen heads get no gradient step.
The decentralised domain-adaptation part (prediction agreement on a target) is not needed for DG.

Where the defaults come from (``raysim methods copa``): COPA released no code and its loss weights,
schedule and IBN placement were not recovered (spec 8.3), so both defaults are ours: the frozen
heads' CE weighted like the own head's (``frozen_weight = 1``), and IBN-a in the first half of the
extractor's BN layers (``ibn_fraction = 0.5``; IBN-Net-a puts IN in the shallow layers only).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from raysim.core.contract import ClientContext, Method, Upload, client_weight
from raysim.core.hparams import Hparams, Space
from raysim.models.base import Net
from raysim.core.settings import setting

HEADS = "heads."


@dataclass(frozen=True)
class COPAHparams(Hparams):
    frozen_weight: float = setting(1.0, ge=0, source="ours: the paper's weights are unknown, no code (spec 5.5 [R], 8.3)", doc="weight of the frozen heads' mean CE")
    ibn_fraction: float = setting(0.5, ge=0, le=1, source="ours: COPA's IBN placement is unknown (spec 5.5 [R])", doc="share of the early BN layers made IBN-a")

    @classmethod
    def search_space(cls):
        return {"frozen_weight": Space.choice(0.5, 1.0, 2.0)}  # ours: COPA's weights are [U] (spec 8.3)


# ----------------------------------------------------------------------------- the equations

def ensemble_log_probs(logits: list[torch.Tensor]) -> torch.Tensor:
    """log mean_j softmax(logits_j): heads with probabilities (0.9, 0.1) and (0.3, 0.7) give
    log (0.6, 0.4)."""
    probs = torch.stack([F.softmax(l, dim=-1) for l in logits]).mean(dim=0)
    return torch.log(probs.clamp_min(torch.finfo(probs.dtype).tiny))


def copa_loss(own: torch.Tensor, frozen: list[torch.Tensor], y: torch.Tensor,
              frozen_weight: float = 1.0) -> torch.Tensor:
    """CE(own) + w * mean_j CE(frozen_j); CE(own) alone without frozen heads."""
    loss = F.cross_entropy(own, y)
    if frozen:
        loss = loss + frozen_weight * torch.stack([F.cross_entropy(l, y) for l in frozen]).mean()
    return loss


# ----------------------------------------------------------------------------- the model

class IBN(nn.Module):
    """IBN-Net-a's hybrid norm: InstanceNorm (affine) on the first half of the channels, BN on the rest."""

    def __init__(self, channels: int):
        super().__init__()
        self.half = channels // 2
        self.IN = nn.InstanceNorm2d(self.half, affine=True)
        self.BN = nn.BatchNorm2d(channels - self.half)

    @classmethod
    def replacing(cls, bn: nn.BatchNorm2d) -> "IBN":
        ibn = cls(bn.num_features)
        h = ibn.half
        with torch.no_grad():
            if bn.affine:
                ibn.IN.weight.copy_(bn.weight[:h]), ibn.IN.bias.copy_(bn.bias[:h])
                ibn.BN.weight.copy_(bn.weight[h:]), ibn.BN.bias.copy_(bn.bias[h:])
            if bn.track_running_stats:
                ibn.BN.running_mean.copy_(bn.running_mean[h:]), ibn.BN.running_var.copy_(bn.running_var[h:])
        return ibn

    def forward(self, x):
        a, b = torch.split(x, [self.half, x.shape[1] - self.half], dim=1)
        return torch.cat([self.IN(a.contiguous()), self.BN(b.contiguous())], dim=1)


def make_ibn(features: nn.Module, fraction: float) -> list[str]:
    """Replace the first ``fraction`` of the 2-D BN layers (module order, shortcut BNs excluded)
    by IBN-a; returns their names."""
    bns = [n for n, m in features.named_modules() if isinstance(m, nn.BatchNorm2d) and "downsample" not in n
           and m.num_features >= 2]
    chosen = bns[:int(len(bns) * fraction)]
    for name in chosen:
        parent_name, _, attr = name.rpartition(".")
        parent = features.get_submodule(parent_name) if parent_name else features
        setattr(parent, attr, IBN.replacing(getattr(parent, attr)))
    return chosen


class COPANet(nn.Module):
    """F = ``features``; ``heads`` = one classifier per source client; forward = the ensemble of
    the trained heads (the ``trained`` buffer marks them; all heads before any is trained)."""

    def __init__(self, backbone: Net, num_heads: int):
        super().__init__()
        self.features = backbone.features
        self.feature_dim, self.num_classes = backbone.feature_dim, backbone.num_classes
        self.input_shape = backbone.input_shape
        self.heads = nn.ModuleList([nn.Linear(self.feature_dim, self.num_classes) for _ in range(num_heads)])
        self.register_buffer("trained", torch.zeros(num_heads))

    def active(self) -> list[int]:
        on = [j for j in range(len(self.heads)) if float(self.trained[j]) > 0]
        return on or list(range(len(self.heads)))

    def forward(self, x):
        z = self.features(x)
        return ensemble_log_probs([self.heads[j](z) for j in self.active()])


class COPA(Method):
    name = "copa"
    Hparams = COPAHparams
    paper = "Wu & Gong, ICCV 2021"
    shares = 'shares the feature extractor and a bank of per-client heads (not averaged)'
    uploads_beside_model = "its own classifier head (Upload.extras)"

    def build_model(self) -> nn.Module:
        backbone = super().build_model()
        if self.hp.ibn_fraction > 0:
            make_ibn(backbone.features, self.hp.ibn_fraction)
        return COPANet(backbone, self.setup.num_clients)

    def local_update(self, ctx: ClientContext) -> Upload:
        model, k = ctx.model, ctx.client_id  # training clients are 0..N-1: client k owns head k
        own = model.heads[k]
        frozen = [j for j in range(len(model.heads)) if j != k and float(model.trained[j]) > 0]
        for j in frozen:
            model.heads[j].requires_grad_(False)
        params = list(model.features.parameters()) + list(own.parameters())
        opt = ctx.optimizer(params)
        try:
            for x, y in ctx.batches():
                z = model.features(x)
                loss = copa_loss(own(z), [model.heads[j](z) for j in frozen], y, self.hp.frozen_weight)
                ctx.step(loss, opt, clip=params)
        finally:
            for j in frozen:
                model.heads[j].requires_grad_(True)
        sd = model.state_dict()
        up = Upload(tensors={n: v.detach() for n, v in sd.items() if n.startswith("features.")},
                    weight=client_weight(ctx), metrics=ctx.stats())
        up.extras = {"head": k, "head_tensors": {n[len(f"{HEADS}{k}."):]: v.detach().cpu().clone()
                                                 for n, v in sd.items() if n.startswith(f"{HEADS}{k}.")}}
        return up

    def aggregate(self, state, uploads, round):
        glob = {**state["global"], **uploads.mean}  # F: the weighted mean
        trained = glob["trained"].clone()
        for e in uploads.extras.values():  # C_k: the client's own head, into the bank
            k = e["head"]
            for n, v in e["head_tensors"].items():
                glob[f"{HEADS}{k}.{n}"] = v.to(glob[f"{HEADS}{k}.{n}"].dtype)
            trained[k] = 1.0
        glob["trained"] = trained
        return {**state, "global": glob}
