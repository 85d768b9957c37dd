"""Update compression: what a client's upload becomes before it leaves the client, and its size.

* Top-k sparsification with error feedback (Stich, Cordonnier, Jaggi, NeurIPS 2018; Karimireddy et
  al., ICML 2019): the client adds its residual e to its update, sends the k = ceil(f · d)
  largest-magnitude entries of Δ + e over the whole update (d entries), and keeps the rest as its
  next residual: e' = Δ + e − topk(Δ + e). Sent: k values and k indices (4 bytes each).
* Stochastic uniform quantization (QSGD, Alistarh et al., NeurIPS 2017), unbiased: per tensor v
  with s = 2^(b−1) − 1 levels, each entry becomes ||v|| · sign(v_i) · l_i / s, where l_i is
  floor(s |v_i| / ||v||) or one more, the latter with probability s |v_i| / ||v|| − floor(·), so
  E[q(v)] = v. Sent: b bits per entry (a sign and b − 1 bits of level) and the norm (4 bytes).

Integer tensors (BN's ``num_batches_tracked``) pass through and are counted at their own size.
"""
from __future__ import annotations

import math

import torch

from raysim.core.tensors import Tensors

KINDS = ("topk", "quantize")


def _floating(tensors: Tensors) -> list[str]:
    return [k for k in tensors if tensors[k].is_floating_point()]


def _other_bytes(tensors: Tensors) -> int:
    return sum(v.numel() * v.element_size() for v in tensors.values() if not v.is_floating_point())


def topk(update: Tensors, fraction: float, residual: Tensors | None) -> tuple[Tensors, Tensors, int]:
    """(the sparse update sent, dense with zeros; the new residual; bytes sent) for top-k with error
    feedback over the whole update's floating-point entries. Ties at the k-th magnitude go to the
    lower flat index (a stable sort), so the choice is a function of the values."""
    keys = _floating(update)
    corrected = {k: update[k] + residual[k] if residual and k in residual else update[k].clone() for k in keys}
    flat = torch.cat([corrected[k].reshape(-1) for k in keys]) if keys else torch.zeros(0)
    d = flat.numel()
    k = min(d, max(1, math.ceil(fraction * d))) if d else 0
    order = torch.sort(flat.abs(), descending=True, stable=True).indices[:k]
    mask = torch.zeros(d, dtype=torch.bool, device=flat.device)
    mask[order] = True
    sent, new_residual, at = {}, {}, 0
    for key in keys:
        v = corrected[key]
        keep = mask[at:at + v.numel()].reshape(v.shape)
        at += v.numel()
        sent[key] = torch.where(keep, v, torch.zeros_like(v))
        new_residual[key] = torch.where(keep, torch.zeros_like(v), v)
    out = {key: sent[key] if key in sent else update[key] for key in update}
    return out, new_residual, 8 * k + _other_bytes(update)


def quantize(update: Tensors, bits: int, generator: torch.Generator) -> tuple[Tensors, int]:
    """(the dequantized update the server folds, bytes sent) for QSGD with ``bits`` bits per entry;
    draws in the tensors' key order from ``generator``."""
    levels = 2 ** (bits - 1) - 1
    out, sent = {}, 0
    for key in sorted(update):
        v = update[key]
        if not v.is_floating_point():
            out[key] = v
            continue
        norm = v.double().norm()
        sent += math.ceil(v.numel() * bits / 8) + 4
        if norm == 0:
            out[key] = torch.zeros_like(v)
            continue
        scaled = v.double().abs() / norm * levels
        low = scaled.floor()
        u = torch.rand(v.shape, generator=generator, dtype=torch.float64, device=generator.device).to(v.device)
        level = low + (u < scaled - low).double()
        out[key] = (norm * torch.sign(v.double()) * level / levels).to(v.dtype)
    return {k: out[k] for k in update}, sent + _other_bytes(update)
