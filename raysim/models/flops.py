"""Parameter and compute footprints.

Convention of :func:`count_flops`: multiply-accumulates (MACs) of conv and linear layers for
ONE input sample, measured by forward hooks on a real forward pass (so any input size and
any control flow are handled):

* conv: ``H_out * W_out * C_out * (C_in / groups) * k_h * k_w`` (= positions x weight numel);
* linear: ``in_features * out_features`` per row;
* biases, norms, activations, pooling and additions are not counted.

``count_norm=True`` adds 2 per output element of every norm layer, thop's convention, which
DapperFL's tables use: ResNet-10 at 32 px is then exactly their 254.17M (253.43M without).

``nonzero_only=True`` counts ``positions x nnz(weight)`` instead, so a MAC whose weight is
zero is not counted: zeroed output channels (whole filters), zeroed input channels, and any
unstructured zeros all reduce the figure. This is the real footprint of a masked model,
where DapperFL's tables report the nominal ``(1 - rho) x dense``.
Custom conv types are counted when they subclass nn.Conv2d (WSConv does); their weight as
stored is what ``nonzero_only`` inspects.
"""
from __future__ import annotations

import contextlib
from typing import Sequence

import torch
from torch import nn

from raysim.models.norm import is_norm


_probing = 0  # > 0 inside probe()


@contextlib.contextmanager
def probe():
    """A forward pass that measures a model (:func:`count_flops`, a method's sub-model sizes):
    bookkeeping of the simulator, not a device's compute, so the simulated clock does not charge it."""
    global _probing
    _probing += 1
    try:
        yield
    finally:
        _probing -= 1


def probing() -> bool:
    """Whether a :func:`probe` pass is running."""
    return _probing > 0


def count_params(model: nn.Module, nonzero_only: bool = False, trainable_only: bool = False) -> int:
    """Parameters (not buffers); ``nonzero_only`` counts entries that are not exactly zero."""
    total = 0
    for p in model.parameters():
        if trainable_only and not p.requires_grad:
            continue
        total += int(torch.count_nonzero(p.detach())) if nonzero_only else p.numel()
    return total


def count_flops(model: nn.Module, input_shape: Sequence[int] | None = None,
                nonzero_only: bool = False, count_norm: bool = False) -> int:
    """MACs of conv/linear layers for one sample of shape ``input_shape`` = (C, H, W).

    Defaults to the model's published ``input_shape``. The model is run once in eval mode
    under no_grad (running statistics untouched); every module's mode is then restored.
    """
    if input_shape is None:
        input_shape = getattr(model, "input_shape", None)
        if input_shape is None:
            raise ValueError("input_shape is required for a model without an input_shape attribute")
    counts: list[int] = []

    def weight_count(module: nn.Module) -> int:
        w = module.weight.detach()
        return int(torch.count_nonzero(w)) if nonzero_only else w.numel()

    def conv_hook(module, inputs, output):
        positions = output.shape[2:].numel()  # per sample: spatial positions of the output
        counts.append(positions * weight_count(module))

    def linear_hook(module, inputs, output):
        rows = output.numel() // output.shape[-1] // output.shape[0]  # per sample (1 for (B, F))
        counts.append(rows * weight_count(module))

    def norm_hook(module, inputs, output):
        counts.append(2 * output[0].numel())  # per sample; norm ops are counted densely

    handles = []
    for m in model.modules():
        if count_norm and is_norm(m):
            handles.append(m.register_forward_hook(norm_hook))
        if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            handles.append(m.register_forward_hook(conv_hook))
        elif isinstance(m, nn.Linear):
            handles.append(m.register_forward_hook(linear_hook))
    modes = {m: m.training for m in model.modules()}  # restored one by one: FixBN-style mixed modes
    try:
        p = next(model.parameters(), None)
        device = p.device if p is not None else torch.device("cpu")
        dtype = p.dtype if p is not None and p.is_floating_point() else torch.float32
        model.eval()
        with torch.no_grad(), probe():
            model(torch.zeros(1, *input_shape, device=device, dtype=dtype))
    finally:
        for h in handles:
            h.remove()
        for m, training in modes.items():
            m.training = training
    return sum(counts)
