"""Normalisation factory: every norm layer of every zoo model is created here.

Methods that swap normalisation (FedBN keeps it local, FedWon removes it, gPerXAN replaces
it with XAN, FedAvg+GN/LN change its type) therefore change one argument, not the network.

``norm`` is a :data:`NormSpec`:

* ``"bn"``   BatchNorm2d after convs, BatchNorm1d after linear layers.
* ``"gn"``   GroupNorm. Groups: a model's own table where its paper gives one (FedWon Tables
  5 and 6), otherwise :func:`gn_groups` (FedWon App. A.2's rule for ResNet/MobileNetV2).
* ``"ln"``   after convs GroupNorm(1, C): statistics over (C, H, W) per sample with a
  per-channel affine, which is what FedWon's "FedAvg+LN" baseline is ("sets the number of
  groups in GN to 1"). After linear layers nn.LayerNorm(C), the same computation on (B, C).
* ``"in"``   InstanceNorm2d(C, affine=True), no running statistics. Undefined on (B, C)
  vectors, so a model with norm after linear layers refuses it.
* ``"none"`` nn.Identity: no normalisation (FedWon, "FedAvg w/o BN").
* a callable ``norm(num_features, dim) -> nn.Module``; ``dim`` is 2 after convs and 1 after
  linear layers.

Zoo models name every norm slot with "bn" in its attribute name (``bn1``, ``downsample.bn``),
whatever the norm type, as torchvision does; FedBN-style code that keeps keys containing
"bn" local therefore catches every norm layer and nothing else.
"""
from __future__ import annotations

from typing import Callable, Union

from torch import nn

from raysim.core.errors import UserError

NormFactory = Callable[[int, int], nn.Module]
NormSpec = Union[str, NormFactory]

NORM_NAMES = ("bn", "gn", "ln", "in", "none")

# Module types counted as normalisation (tests, norm="none" checks, layer lookup).
NORM_TYPES = (nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.LayerNorm,
              nn.modules.instancenorm._InstanceNorm, nn.LocalResponseNorm)


def gn_groups(num_features: int) -> int:
    """FedWon's GroupNorm rule: 32 groups, 8 below 32 channels, fewer if 32 (8) does not divide C.

    "Fewer" is the largest divisor of C not above the target, which gives FedWon's stated
    24 groups for 144 channels (MobileNetV2) and 32 for every ResNet width.
    """
    target = 32 if num_features >= 32 else 8
    for g in range(min(target, num_features), 0, -1):
        if num_features % g == 0:
            return g
    return 1


def check_norm(norm: NormSpec) -> NormSpec:
    """Validate a norm spec early, so that a typo fails before any layer is built."""
    if callable(norm):
        return norm
    if isinstance(norm, str) and norm.lower() in NORM_NAMES:
        return norm.lower()
    raise UserError(f"unknown norm {norm!r}; valid norms: {', '.join(NORM_NAMES)} "
                    f"or a callable norm(num_features, dim) -> nn.Module")


def make_norm(norm: NormSpec, num_features: int, dim: int = 2, *,
              groups: int | None = None) -> nn.Module:
    """One norm layer for ``num_features`` channels; ``dim`` 2 after convs, 1 after linear layers.

    ``groups`` overrides the GroupNorm group count for ``"gn"`` only (a model's published table).
    """
    if dim not in (1, 2):
        raise ValueError(f"dim must be 1 (after linear) or 2 (after conv), got {dim}")
    norm = check_norm(norm)
    if callable(norm):
        module = norm(num_features, dim)
        if not isinstance(module, nn.Module):
            raise UserError(f"norm callable returned {type(module).__name__}, expected an nn.Module")
        return module
    if norm == "bn":
        return nn.BatchNorm2d(num_features) if dim == 2 else nn.BatchNorm1d(num_features)
    if norm == "gn":
        g = groups if groups is not None else gn_groups(num_features)
        return nn.GroupNorm(g, num_features)
    if norm == "ln":
        return nn.GroupNorm(1, num_features) if dim == 2 else nn.LayerNorm(num_features)
    if norm == "in":
        if dim == 1:
            raise UserError("norm 'in' (instance norm) is undefined after a linear layer; "
                            "use a model variant without norm in its FC layers, or pass a callable")
        return nn.InstanceNorm2d(num_features, affine=True)
    return nn.Identity()  # "none"


def is_norm(module: nn.Module) -> bool:
    return isinstance(module, NORM_TYPES)
