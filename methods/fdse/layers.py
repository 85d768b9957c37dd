"""FDSE's layer decomposition (Sec. 4.1, Eqs. 2-3, Tables A6/A7).

Every conv layer and every hidden FC layer of a backbone becomes a DSE block:

    X_DFE = f_DFE * X                                   DFE conv, ceil(T/G) channels   (shared)
    X_DSE = f_DSE * ReLU(BN_DSE(X_DFE))                 BN_DSE + depthwise cheap op    (personalized)
    X_out = ReLU(BN_DFE(Concat(ReLU(BN_DSE(X_DFE)), X_DSE)[:T]))   BN_DFE              (shared)

The concat keeps one identity copy of each of the t = ceil(T/G) channels (GhostNet's identity
mapping, Table A7 row 3) next to the G-1 cheap copies, so the identity counts among the G
channels of Eq. 3. For an FC layer the DFE is ``Linear(S, t)`` and the cheap op with ``dw = 1``
is a per-channel scale (a depthwise 1x1 conv on the [B, t, 1, 1] view); its BN_DFE is a
BatchNorm1d.

Submodule names are the contract with :mod:`raysim.methods.fdse`: ``dfe`` and ``bn_dfe`` are
shared, ``bn_dse`` and ``cheap`` are the DSE (personalized) part, and BN_DSE's running
statistics never leave the client.

:func:`decompose` applies the decomposition to any zoo model whose ``features`` is an
``nn.Sequential`` of ``layer [, norm] , ReLU`` groups (``cnn6``, ``alexnet_fdse``, ``alexnet``,
``small_cnn``, ``mnist_cnn``): each such group becomes one DSE block under the layer's slot name
(``features.conv1``), the group's norm and ReLU slots disappear into it, and every other module
(pooling, flatten, dropout) stays where it was. The head is not decomposed (Table A6 row 9).
"""
from __future__ import annotations

import math
from collections import OrderedDict

import torch
from torch import nn

from raysim.core.errors import UserError
from raysim.models.norm import is_norm

ACTIVATIONS = ("relu", "none")


def _act(name: str) -> nn.Module:
    if name == "relu":
        return nn.ReLU(inplace=False)
    if name == "none":
        return nn.Identity()
    raise UserError(f"FDSE dse_act {name!r}: expected one of {', '.join(ACTIVATIONS)}")


class DSEConv(nn.Module):
    """DSEBlock(S, T, k, stride, pad, G, dw) of Table A7 for conv layers."""

    def __init__(self, in_ch: int, out_ch: int, kernel_size: int, stride: int = 1, padding: int = 0,
                 G: int = 2, dw: int = 3, dse_act: str = "relu"):
        super().__init__()
        if G < 2:
            raise UserError(f"FDSE G = {G}: expected at least 2 (G = 1 leaves no DSE operator)")
        t = math.ceil(out_ch / G)
        self.out_channels, self.inner, self.G = out_ch, t, G
        self.dfe = nn.Conv2d(in_ch, t, kernel_size, stride=stride, padding=padding, bias=True)
        self.bn_dse = nn.BatchNorm2d(t)
        self.act_dse = _act(dse_act)
        self.cheap = nn.Conv2d(t, t * (G - 1), dw, stride=1, padding=dw // 2, groups=t, bias=False)
        self.bn_dfe = nn.BatchNorm2d(out_ch)
        self.act = nn.ReLU(inplace=True)

    def deskew(self, x: torch.Tensor) -> torch.Tensor:
        """The DSE output Z, i.e. the input of BN_DFE (what the consistency loss regularizes)."""
        h = self.act_dse(self.bn_dse(self.dfe(x)))
        return torch.cat([h, self.cheap(h)], dim=1)[:, :self.out_channels]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.bn_dfe(self.deskew(x)))


class DSELinear(nn.Module):
    """The FC variant (Table A6 rows 7-8: DSEBlock(S, T, 1, 1, -, G, dw=1)); padding is 0."""

    def __init__(self, in_features: int, out_features: int, G: int = 2, dw: int = 1, dse_act: str = "relu"):
        super().__init__()
        if G < 2:
            raise UserError(f"FDSE G = {G}: expected at least 2 (G = 1 leaves no DSE operator)")
        t = math.ceil(out_features / G)
        self.out_features, self.inner, self.G = out_features, t, G
        self.dfe = nn.Linear(in_features, t)
        self.bn_dse = nn.BatchNorm1d(t)  # = BatchNorm2d(t) on the [B, t, 1, 1] map
        self.act_dse = _act(dse_act)
        # On a 1x1 map only the centre tap of a dw x dw kernel ever sees data, so dw = 1.
        self.cheap = nn.Conv2d(t, t * (G - 1), dw, stride=1, padding=dw // 2, groups=t, bias=False)
        self.bn_dfe = nn.BatchNorm1d(out_features)
        self.act = nn.ReLU(inplace=True)

    def deskew(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act_dse(self.bn_dse(self.dfe(x)))
        c = self.cheap(h[:, :, None, None]).flatten(1)
        return torch.cat([h, c], dim=1)[:, :self.out_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.bn_dfe(self.deskew(x)))


DSE_BLOCKS = (DSEConv, DSELinear)


def dse_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The DSE blocks of ``model`` in forward (registration) order, l = 1..L."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, DSE_BLOCKS)]


def decompose(model: nn.Module, G: int = 2, dw: int = 3, dw_fc: int = 1, dse_act: str = "relu") -> nn.Module:
    """Replace every ``conv|linear [, norm], ReLU`` group of ``model.features`` by a DSE block.

    ``model`` is modified in place (its ``features`` is rebuilt) and returned. The new blocks
    are initialised with PyTorch's defaults, in layer order, from the global RNG (the engine
    builds the model under the run seed).
    """
    feats = getattr(model, "features", None)
    if not isinstance(feats, nn.Sequential):
        raise UserError(f"FDSE decomposes zoo models whose 'features' is an nn.Sequential of "
                        f"layer-norm-ReLU groups (cnn6, alexnet_fdse, alexnet, small_cnn, mnist_cnn); "
                        f"{type(model).__name__} is not one")
    items = list(feats.named_children())
    out: OrderedDict[str, nn.Module] = OrderedDict()
    i, blocks = 0, 0
    while i < len(items):
        name, mod = items[i]
        if isinstance(mod, (nn.Conv2d, nn.Linear)):
            j = i + 1
            if j < len(items) and (is_norm(items[j][1]) or isinstance(items[j][1], nn.Identity)):
                j += 1  # the layer's norm slot: replaced by BN_DFE
            if j >= len(items) or not isinstance(items[j][1], nn.ReLU):
                raise UserError(f"FDSE: layer '{name}' of {type(model).__name__} is not followed by "
                                f"[norm,] ReLU; cannot decompose it into a DSE block")
            if isinstance(mod, nn.Conv2d):
                if mod.groups != 1 or mod.dilation != (1, 1) or mod.kernel_size[0] != mod.kernel_size[1]:
                    raise UserError(f"FDSE: conv '{name}' (groups/dilation/non-square kernel) is not supported")
                out[name] = DSEConv(mod.in_channels, mod.out_channels, mod.kernel_size[0], mod.stride[0],
                                    mod.padding[0], G=G, dw=dw, dse_act=dse_act)
            else:
                out[name] = DSELinear(mod.in_features, mod.out_features, G=G, dw=dw_fc, dse_act=dse_act)
            blocks += 1
            i = j + 1
        else:
            out[name] = mod
            i += 1
    if blocks == 0:
        raise UserError(f"FDSE: {type(model).__name__} has no conv/linear layer to decompose")
    model.features = nn.Sequential(out)
    return model
