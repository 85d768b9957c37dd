"""Layers inserted after a network's conv blocks (FedFA's FFA layers, MixStyle): a block starts at
a child of ``features`` that holds a conv and runs up to the next one, or to the first flatten,
linear, dropout or global pooling."""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import torch
from torch import nn

from raysim.core.errors import UserError


def block_ends(features: nn.Sequential) -> list[str]:
    """The names of the last child of each conv block of ``features``."""
    ends, in_block, last = [], False, None
    stop = (nn.Flatten, nn.Linear, nn.Dropout, nn.AdaptiveAvgPool2d)
    for name, child in features.named_children():
        has_conv = isinstance(child, nn.Conv2d) or any(isinstance(m, nn.Conv2d) for m in child.modules())
        if has_conv or isinstance(child, stop):
            if in_block:
                ends.append(last)
            in_block = has_conv
        last = name
    if in_block:
        ends.append(last)
    return ends


def insert_after_blocks(model: nn.Module, make: Callable[[int], nn.Module], prefix: str,
                        blocks: int | None = None, owner: str = "") -> list[str]:
    """Insert ``make(channels)`` after the first ``blocks`` (all) conv blocks of ``model.features``,
    named ``<prefix>_<block end>``; returns the inserted modules' names."""
    features = getattr(model, "features", None)
    if not isinstance(features, nn.Sequential):
        raise UserError(f"{owner or prefix}: the model has no sequential 'features' to insert layers into")
    ends = block_ends(features)[:blocks]
    widths = _output_channels(model, ends)
    layers, names = [], []
    for name, child in features.named_children():
        layers.append((name, child))
        if name in ends:
            layers.append((f"{prefix}_{name}", make(widths[name])))
            names.append(f"features.{prefix}_{name}")
    model.features = nn.Sequential(OrderedDict(layers))
    return names


def _output_channels(model: nn.Module, ends: list[str]) -> dict[str, int]:
    """The channels each block end outputs (one dummy forward at the model's input shape)."""
    widths, hooks = {}, []
    modules = dict(model.features.named_children())
    for name in ends:
        hooks.append(modules[name].register_forward_hook(
            lambda m, i, out, name=name: widths.__setitem__(name, int(out.shape[1]))))
    was = model.training
    model.eval()
    with torch.no_grad():
        model(torch.zeros(1, *model.input_shape))
    model.train(was)
    for h in hooks:
        h.remove()
    return widths
