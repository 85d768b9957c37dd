"""The normalization layers of gPerXAN and of its Table 4 ablation, and where they go.

* :class:`XAN`  eXplicitly Assembled Normalization (paper Eq. 2): a BatchNorm2d and an
  InstanceNorm2d(affine) applied to the same input, their *outputs* mixed by two scalar
  ratios per layer,  h_hat = w_bn * BN(h) + w_in * IN(h),  [w_bn, w_in] = softmax([s_bn, s_in]).
* :class:`IBN`  IBN-Net-a's I-BN (Pan et al., ECCV 2018), the "I-BN" row of Table 4:
  IN on the first half of the channels, BN on the other half, concatenated.
* :func:`place`  module surgery: the chosen BatchNorm2d layers of a built zoo model become
  XAN / IBN layers, initialised from the BN they replace (pretrained statistics included).

State-dict keys of one XAN layer at slot ``S`` (e.g. ``features.layer1.0.bn1``):
    BN side  S.bn.weight, S.bn.bias, S.bn.running_mean, S.bn.running_var,
             S.bn.num_batches_tracked, S.score_bn
    IN side  S.inst.weight, S.inst.bias, S.score_in

Defaults here are the official code's (``eXplicitOptimizedNorm2d``): softmax-mixed scores both
initialised to 1, eps and momentum of the BN replaced (PyTorch's 1e-5 / 0.1); IBN-Net-a's
half split (Pan et al.); the DenseNet placement is the paper's Sec. 4.2 (Camelyon17). The
method's ``hp.gperxan`` settings choose among them.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from raysim.core.errors import UserError

MIXES = ("softmax", "linear")
SCORE_INITS = ("random", "ones")
IN_AFFINE_INITS = ("default", "copy_bn")


class XAN(nn.Module):
    """h_hat = w_bn * BN(h) + w_in * IN(h) on (B, C, H, W) inputs (paper Eq. 2).

    ``mix="softmax"``: [w_bn, w_in] = softmax([score_bn, score_in]) (ratios that sum to one;
    the official code's parameterisation). ``mix="linear"``: w = the raw scores (Eq. 2 read
    literally, no constraint). BN: batch statistics in training (running statistics updated
    with ``momentum``), running statistics in eval. IN: per-sample, per-channel statistics in
    both modes, no running statistics.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1,
                 mix: str = "softmax", score_init: str = "ones"):
        super().__init__()
        if mix not in MIXES:
            raise UserError(f"XAN: mix={mix!r}; expected one of {', '.join(MIXES)}")
        if score_init not in SCORE_INITS:
            raise UserError(f"XAN: score_init={score_init!r}; expected one of {', '.join(SCORE_INITS)}")
        self.mix = mix
        self.bn = nn.BatchNorm2d(num_features, eps=eps, momentum=momentum)
        self.inst = nn.InstanceNorm2d(num_features, eps=eps, affine=True, track_running_stats=False)
        if score_init == "ones":  # the official code: both scores 1.0 -> ratios 0.5 / 0.5
            s_bn, s_in = torch.ones(()), torch.ones(())
        else:  # the paper: "randomly initialized" (U[0, 1), from the model-init seed)
            s_bn, s_in = torch.rand(()), torch.rand(())
        self.score_bn = nn.Parameter(s_bn)
        self.score_in = nn.Parameter(s_in)

    def ratios(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w_bn, w_in)."""
        if self.mix == "softmax":
            w = torch.softmax(torch.stack([self.score_bn, self.score_in]), dim=0)
            return w[0], w[1]
        return self.score_bn, self.score_in

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w_bn, w_in = self.ratios()
        return w_bn * self.bn(x) + w_in * self.inst(x)

    def extra_repr(self) -> str:
        return f"mix={self.mix}"


class IBN(nn.Module):
    """IBN-Net-a's I-BN: IN(affine) on channels [0, h), BN on [h, C), h = int(C * ratio)."""

    def __init__(self, num_features: int, ratio: float = 0.5, eps: float = 1e-5, momentum: float = 0.1):
        super().__init__()
        self.half = int(num_features * ratio)
        if not 0 < self.half < num_features:
            raise UserError(f"IBN: {num_features} channels cannot be split at ratio {ratio}")
        self.inst = nn.InstanceNorm2d(self.half, eps=eps, affine=True, track_running_stats=False)
        self.bn = nn.BatchNorm2d(num_features - self.half, eps=eps, momentum=momentum)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = torch.split(x, [self.half, x.shape[1] - self.half], dim=1)
        return torch.cat([self.inst(a.contiguous()), self.bn(b.contiguous())], dim=1)


# ----------------------------------------------------------------------------- placement

_STAGE = re.compile(r"^(layer\d+|denseblock\d+|transition\d+|final)$")

# Sec. 4.2, Camelyon17 (DenseNet-121): "BN layers in the first dense block and the following
# transition block" -> XAN (6 dense layers x 2 + 1 = 13 layers); the stem's bn0 stays plain BN
# (the spec's literal reading; add "stem" to include it).
DENSENET_XAN_STAGES = ("denseblock1", "transition1")


def _candidates(model: nn.Module) -> list[tuple[str, str]]:
    """(full name, name inside ``features``) of every BatchNorm2d of the feature extractor."""
    if not hasattr(model, "features"):
        raise UserError("gperxan: the model has no 'features' trunk (zoo models have features + head)")
    return [(f"features.{n}", n) for n, m in model.features.named_modules()
            if type(m) is nn.BatchNorm2d]


def stage_of(rel: str) -> str:
    """The stage a trunk BN belongs to: ``layerK`` of a residual net, ``denseblockK`` /
    ``transitionK`` / ``final`` (the norm after the last block, torchvision's norm5) of a dense
    net, else ``stem`` (norms outside every stage: ResNet's ``bn1``, DenseNet's ``bn0``; every
    norm of a plain CNN such as cnn6 / small_cnn)."""
    first = rel.split(".")[0]
    return first if _STAGE.match(first) else "stem"


def select(model: nn.Module, stages: str, kind: str) -> list[str]:
    """Full names of the BatchNorm2d layers ``kind`` ("xan" | "ibn") replaces.

    ``stages``: "all" (every BN of the trunk), "auto" (xan: all, the official code's PACS
    rule, except on a DenseNet: denseblock1 + transition1, the paper's Camelyon17 rule;
    ibn: IBN-Net-a's layer1-layer3 on a ResNet, every BN on a plain CNN), or a comma list of
    stages (``stem``, ``layer1``, ``denseblock1``, ``transition1``, ``final``, ...) and/or
    exact slot names inside ``features`` (``bn1``, ``layer2.0.downsample.bn``). For ibn,
    inside residual stages only the first norm of each block (``layerK.i.bn1``) is replaced,
    as in IBN-Net-a; ibn has no rule for a DenseNet.
    """
    cands = _candidates(model)
    present = sorted({stage_of(rel) for _, rel in cands})
    dense = any(s.startswith("denseblock") for s in present)
    if kind == "ibn" and dense:
        raise UserError("gperxan: norm=ibn (IBN-Net-a's I-BN, Table 4's ablation on ResNet-50) has no "
                        "placement rule for a DenseNet; use norm=xan/perxan/bn")
    spec = stages.strip()
    if spec == "auto" and kind == "xan" and dense:
        spec = ",".join(s for s in DENSENET_XAN_STAGES if s in present)
    elif spec == "auto":
        spec = "all" if kind == "xan" or not any(s.startswith("layer") for s in present) \
            else ",".join(s for s in ("layer1", "layer2", "layer3") if s in present)
    if spec == "all":
        chosen = cands
    else:
        tokens = [t.strip() for t in spec.split(",") if t.strip()]
        names = {rel for _, rel in cands}
        unknown = [t for t in tokens if t not in present and t not in names]
        if unknown or not tokens:
            raise UserError(f"gperxan: stages={stages!r}: unknown stage(s) {unknown or [stages]}; "
                            f"this model has stages {', '.join(present)} (or 'all', 'auto', or slot names)")
        chosen = [(full, rel) for full, rel in cands if stage_of(rel) in tokens or rel in tokens]
    if kind == "ibn" and any(s != "stem" for s in present):  # a residual net: first norm of each block
        chosen = [(full, rel) for full, rel in chosen
                  if stage_of(rel) != "stem" and re.fullmatch(r"\w+\.\d+\.bn1", rel)]
    return [full for full, _ in chosen]


def place(model: nn.Module, names: list[str], kind: str, *, mix: str = "softmax",
          score_init: str = "ones", in_affine_init: str = "default") -> nn.Module:
    """Replace each named BatchNorm2d of ``model`` by an XAN (kind "xan") or IBN (kind "ibn").

    The new layer's BN takes the replaced BN's affine and running statistics (so a pretrained
    BN initialises the BN side, paper Sec. 4.2); the IN affine is (1, 0) or, with
    ``in_affine_init="copy_bn"``, a copy of the BN affine (of the IN channels, for IBN).
    """
    if in_affine_init not in IN_AFFINE_INITS:
        raise UserError(f"gperxan: in_affine_init={in_affine_init!r}; expected one of "
                        f"{', '.join(IN_AFFINE_INITS)}")
    for name in names:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, leaf)
        c = old.num_features
        sd = old.state_dict()
        if kind == "xan":
            new = XAN(c, eps=old.eps, momentum=old.momentum, mix=mix, score_init=score_init)
            new.bn.load_state_dict(sd)
            idx = slice(0, c)
        elif kind == "ibn":
            new = IBN(c, eps=old.eps, momentum=old.momentum)
            h = new.half
            new.bn.load_state_dict({k: (v[h:] if v.dim() == 1 else v) for k, v in sd.items()})
            idx = slice(0, h)
        else:
            raise ValueError(kind)
        if in_affine_init == "copy_bn":
            with torch.no_grad():
                new.inst.weight.copy_(old.weight[idx])
                new.inst.bias.copy_(old.bias[idx])
        new.to(old.weight.device)
        setattr(parent, leaf, new)
    return model


def xan_layers(model: nn.Module) -> list[tuple[str, XAN]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, XAN)]


def bn_side_keys(model: nn.Module, with_score: bool = True) -> set[str]:
    """State-dict keys of the BN side of every XAN layer (affine, running statistics, batch
    counter) and, with ``with_score``, its mixture score s_bn."""
    keys = set()
    for name, m in xan_layers(model):
        keys |= {f"{name}.bn.{k}" for k in m.bn.state_dict()}
        if with_score:
            keys.add(f"{name}.score_bn")
    return keys
