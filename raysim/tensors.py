"""Named-tensor helpers shared by the engine and the methods."""
from __future__ import annotations

import torch
from torch import nn

Tensors = dict[str, torch.Tensor]


def load_tensors(model: nn.Module, tensors: Tensors) -> None:
    """Copy named tensors into ``model``'s parameters and buffers in place (no re-allocation)."""
    if not tensors:
        return
    own = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for k, v in tensors.items():
            dst = own[k]
            dst.copy_(v.to(dst.device, dst.dtype) if v.device != dst.device or v.dtype != dst.dtype else v)


def cpu_copy(tensors: Tensors) -> Tensors:
    """A detached CPU copy of each tensor. What a method keeps between rounds (the server's state,
    a client's state) lives on the CPU whatever device trained it: the host keeps many clients'
    records, spills idle ones to disk and hands them to other hosts; only the round's work runs on
    the device. (On the CPU this is a plain copy: values are bit-for-bit the same.)"""
    return {k: v.detach().to("cpu", copy=True) for k, v in tensors.items()}


def tensors_nbytes(tensors) -> int:
    """Bytes of the tensors in a (nested) dict: what a payload or an upload weighs."""
    total = 0
    for v in tensors.values():
        if isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
        elif isinstance(v, dict):
            total += tensors_nbytes(v)
    return total


def bn_keys(model: nn.Module) -> set[str]:
    """State-dict keys of every batch-norm layer (weights, biases, running stats)."""
    keys = set()
    for name, mod in model.named_modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm):
            for k in mod.state_dict().keys():
                keys.add(f"{name}.{k}" if name else k)
    return keys
