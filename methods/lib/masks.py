"""Pruning masks: how many of a layer's channels a ratio prunes, which ones (the highest scores
kept) and holding the pruned entries at 0 (DapperFL, FedMP, FedDrop, NeFL)."""
from __future__ import annotations

import math

import torch
from torch import nn


def num_pruned(size: int, rho: float) -> int:
    """round(rho * size), halves rounded up (with the paper's ratios and widths there are none)."""
    return min(size, int(math.floor(rho * size + 0.5 + 1e-9)))


def num_kept(size: int, rho: float) -> int:
    """size - round(rho * size) (halves rounded up, DapperFL's rule), at least 1."""
    return max(1, size - num_pruned(size, rho))


def top_mask(scores: torch.Tensor, keep: int) -> torch.Tensor:
    """Boolean mask keeping the ``keep`` highest scores (ties: the lower index)."""
    mask = torch.zeros(scores.numel(), dtype=torch.bool, device=scores.device)
    if keep > 0:
        order = torch.argsort(scores.detach().double(), descending=True, stable=True)
        mask[order[:keep]] = True
    return mask


@torch.no_grad()
def apply_masks(model: nn.Module, masks: dict[str, torch.Tensor]) -> None:
    """w <- w * M in place for every ``{parameter key: mask}`` (DapperFL Alg. 1 line 4, and after
    every step of a pruned or dropped-out sub-model: the entries outside it held at 0)."""
    params = dict(model.named_parameters())
    for key, m in masks.items():
        p = params[key]
        p.mul_(m.to(p.device, p.dtype))
