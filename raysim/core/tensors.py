"""Named-tensor helpers shared by the engine and the methods, and the engine's one host<->device
move (:func:`to_device`): where each tensor lives between rounds is the placement rule of
:mod:`raysim.core.contract`."""
from __future__ import annotations

import contextlib
import contextvars
from collections import Counter

import torch
from torch import nn

Tensors = dict[str, torch.Tensor]


# ----------------------------------------------------------------------------- host <-> device moves

class Transfers:
    """What :func:`to_device` was asked to place, by purpose (``what``): ``calls`` (on a CPU host
    too, where nothing crosses: the count a CPU test can check) and ``tensors`` that crossed
    between CPU and device memory. Read by the transfer-count test; cheap enough to keep always on
    (two counter updates per call, not per tensor)."""

    def __init__(self):
        self.calls: Counter = Counter()
        self.tensors: Counter = Counter()

    def reset(self) -> None:
        self.calls.clear()
        self.tensors.clear()


TRANSFERS = Transfers()


def leaves(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from leaves(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from leaves(v)


def to_device(tree, device, what: str = "tensors", copy: bool = False, non_blocking: bool = False):
    """``tree`` (a tensor, or nested dicts / lists / tuples holding tensors and anything else) with
    every tensor on ``device``: every move between CPU and device memory in the engine goes through
    here (:data:`TRANSFERS` counts them by ``what``).

    A tensor already there is handed back as it is (the same object: on a CPU host a payload stays
    the object Ray gave), or copied with ``copy``. ``non_blocking`` (device -> CPU): the copy lands
    in pinned memory without waiting for the device; call :func:`wait_for` before reading it.
    Values never change: a move copies bits."""
    device = torch.device(device)
    crossed = 0

    def move(t: torch.Tensor) -> torch.Tensor:
        nonlocal crossed
        if t.device == device:
            return t.detach().clone() if copy else t
        crossed += 1
        if non_blocking and device.type == "cpu" and t.device.type == "cuda":
            out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
            return out.copy_(t.detach(), non_blocking=True)
        return t.detach().to(device, copy=True, non_blocking=non_blocking)

    def walk(x):
        if isinstance(x, torch.Tensor):
            return move(x)
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, tuple) and not hasattr(x, "_fields"):
            return tuple(walk(v) for v in x)
        return x

    out = walk(tree)
    TRANSFERS.calls[what] += 1
    TRANSFERS.tensors[what] += crossed
    return out


def wait_for(tree) -> None:
    """Wait until the non-blocking copies into ``tree``'s CPU tensors have landed (one device
    sync, only when a device is in use)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


# where a client's kept tensors go (:func:`cpu_copy`): the CPU, or during a client step on a host
# with runtime.device_state_mb room left, its device (raysim.engine.store keeps them there)
_STATE_DEVICE: contextvars.ContextVar = contextvars.ContextVar("raysim_state_device", default=None)


@contextlib.contextmanager
def keep_state_on(device):
    """Inside: :func:`cpu_copy` copies to ``device`` (None: the CPU) — the host's device-resident
    client state (``runtime.device_state_mb``)."""
    token = _STATE_DEVICE.set(None if device is None or torch.device(device).type == "cpu" else torch.device(device))
    try:
        yield
    finally:
        _STATE_DEVICE.reset(token)


def load_tensors(model: nn.Module, tensors: Tensors) -> None:
    """Copy named tensors into ``model``'s parameters and buffers in place (no re-allocation); a
    tensor on another device comes through :func:`to_device` (a payload is already on the host's
    device: device to device)."""
    if not tensors:
        return
    own = model.state_dict(keep_vars=True)
    elsewhere = {k: v for k, v in tensors.items() if v.device != own[k].device}
    if elsewhere:
        device = own[next(iter(elsewhere))].device
        tensors = {**tensors, **to_device(elsewhere, device, what="load")}
    with torch.no_grad():
        for k, v in tensors.items():
            dst = own[k]
            dst.copy_(v.to(dst.device, dst.dtype) if v.device != dst.device or v.dtype != dst.dtype else v)


def cpu_copy(tensors: Tensors) -> Tensors:
    """A detached copy of each tensor for a method to keep between rounds: on the CPU (the
    placement rule of :mod:`raysim.core.contract`: the server's state and a client's state live on the
    CPU whatever device trained them; the host keeps many clients' records, spills idle ones to
    disk and hands them to other hosts), or on the host's device during a client step that
    ``runtime.device_state_mb`` lets keep its state there. (On the CPU this is a plain copy:
    values are bit-for-bit the same.)"""
    return to_device(dict(tensors), _STATE_DEVICE.get() or "cpu", what="state", copy=True)


class ReadOnlyTensors(dict):
    """Named tensors their receiver only reads (a host's partial sums, which the server reduces
    into buffers of its own). Where they cross a process boundary they arrive as views of the
    sent bytes in Ray's shared memory, not as private copies (:mod:`raysim.engine.wire`): they must
    not be written (a write would change the stored object for every reader; nothing stops it).
    Within one process they are the sender's tensors."""


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
