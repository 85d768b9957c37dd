"""What a client step computes, for the simulated clock: every pass, counted where it runs.

A method's client step may run passes beside its training steps: Ditto's personal solver, MOON's
frozen references, ELCFS's meta-step, FedADG's discriminator and generator, SCAFFOLD option I's
gradient pass, DapperFL's BN pass. Counting ``steps x batch x model`` charges none of them, and a
method cannot be trusted to declare them. :class:`ComputeMeter` sees them all: while a client step
runs, a process-wide forward hook on every conv and linear layer charges

* each forward:  positions x non-zero weight entries x batch (the multiply-accumulates of the layer
  that actually ran: a pruned or dropped-out sub-model's zeroed filters cost nothing, a frozen
  reference, a discriminator or a generator costs what it is, and the batch is the real one);
* each backward through the layer: the same again for the gradient of its input, and again for the
  gradient of its weight when the weight trains: the usual convention that a trained layer's
  backward costs 2 x its forward (charged for the first layer too, whose input needs no gradient),
  and a frozen layer that a gradient passes through 1 x.

Norms, activations and pooling are not counted (the convention of :func:`raysim.models.count_flops`),
nor the probe pass :func:`raysim.models.count_flops` runs to measure a model (bookkeeping).
The sums stay on the layer's device; reading :attr:`ComputeMeter.macs` syncs once.
"""
from __future__ import annotations

import torch
from torch import nn

from raysim.models.flops import probing

# the layers whose multiply-accumulates the meter counts (the cohort step counts the same ones)
METERED_LAYERS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)


# a float's bits as the signed integer of its width: x != 0.0 exactly where those bits are neither 0
# (+0.0) nor the integer's minimum (-0.0), NaN and denormals included
_BITS = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16,
         torch.bfloat16: torch.int16}


def count_nonzero(weight: torch.Tensor) -> torch.Tensor:
    """``torch.count_nonzero(weight)``, the same int64 count. On the CPU the weight's bits are
    counted as integers, which vectorizes where the float count does not (a 200 x 2352 float32
    weight: ~0.11 ms against ~0.24 ms on one core; counting cost an MLP's training step ~25%), and
    checked for -0.0 (the integer minimum) with one ``amin``; a weight holding -0.0 (a masked
    negative weight) gets the float count. On a GPU the count stays as it is: no branch on a
    device value, no sync."""
    bits = _BITS.get(weight.dtype)
    if weight.device.type == "cpu" and bits is not None and weight.numel():
        as_int = weight.view(bits)
        if int(as_int.amin()) != torch.iinfo(bits).min:
            return torch.count_nonzero(as_int)
    return torch.count_nonzero(weight)


class ComputeMeter:
    """``with ComputeMeter() as meter: method.local_update(ctx)``, then ``meter.macs``."""

    def __init__(self):
        self._sums: dict[torch.device, torch.Tensor] = {}
        self._nnz: dict[int, tuple[int, int, torch.Tensor]] = {}  # id(weight) -> (version, data_ptr, count)
        self._handle = None

    def __enter__(self) -> "ComputeMeter":
        self._handle = nn.modules.module.register_module_forward_hook(self._forward)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()
        self._handle = None
        self._nnz.clear()

    @property
    def macs(self) -> float:
        """Multiply-accumulates of every pass so far (forward and backward)."""
        return float(sum(float(s) for s in self._sums.values()))

    def _nonzero(self, weight: torch.Tensor) -> torch.Tensor:
        """Non-zero entries of ``weight``, recounted only when it changed (training steps change it)."""
        key, version = id(weight), (weight._version, weight.data_ptr())
        hit = self._nnz.get(key)
        if hit is None or hit[:2] != version:
            hit = self._nnz[key] = (*version, count_nonzero(weight.detach()))
        return hit[2]

    def _add(self, device: torch.device, macs: torch.Tensor) -> None:
        total = self._sums.get(device)
        self._sums[device] = macs.to(torch.float64) if total is None else total + macs

    def _forward(self, module: nn.Module, inputs, output) -> None:
        if not isinstance(module, METERED_LAYERS) or not isinstance(output, torch.Tensor) or probing():
            return
        weight = module.weight
        if isinstance(module, nn.Linear):
            rows = output.numel() // output.shape[-1]  # every leading dimension: batch (x tokens)
        else:
            rows = output.shape[0] * output.shape[2:].numel()  # batch x output positions
        macs = self._nonzero(weight) * rows
        self._add(output.device, macs)
        if output.requires_grad:  # a backward pass may come through this layer: charge it when it does
            passes = 1 + int(weight.requires_grad)  # input gradient (+ weight gradient)
            output.register_hook(lambda grad, macs=macs, passes=passes, device=output.device:
                                 self._add(device, macs * passes))
