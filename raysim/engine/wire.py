"""How tensors cross between Ray processes: as their raw bytes.

Torch pickles a tensor's storage through ``torch.save`` into a byte string, which Ray then copies
into its object store, and the receiver rebuilds it through ``torch.load``: for a host's float64
partial sums (3.8 MB for workload D's MLP) that is about 8 ms of CPU per transfer, paid once per
host per round, and once per host per server step in a buffered schedule. Here a CPU tensor
travels as a flat byte array (pickle protocol 5 hands it to the object store out of band, one
copy) and arrives as a private, writable copy: the same bits, dtype and shape, about half the CPU.

A :class:`raysim.core.tensors.ReadOnlyTensors` (a host's partial sums, which the server only reads)
travels the same way but arrives without the copy: its tensors are views of the received bytes,
in Ray's shared memory, kept alive by the tensors themselves.

What it changes for the receiver: a tensor arrives contiguous, owning its storage (a view sends
only its own elements, not its base's whole storage; two tensors that shared a storage arrive as
two). Everything else travels as torch pickles it: parameters and other subclasses, tensors that
require grad, GPU tensors, sparse, quantized or conjugate-view tensors.

:func:`install` registers this in the calling process; the server, every host and the driver call
it once Ray is up. The receiving process needs nothing: the pickle names
:func:`tensor_from_wire`."""
from __future__ import annotations

import warnings

import numpy as np
import torch

from raysim.core.tensors import ReadOnlyTensors

_installed = False


def travels_as_bytes(t: torch.Tensor) -> bool:
    """Whether ``t`` takes the byte path (else torch's own pickling)."""
    return (type(t) is torch.Tensor and t.device.type == "cpu" and t.layout == torch.strided
            and not t.requires_grad and not t.is_quantized and not t.is_conj() and not t.is_neg()
            and not t.__dict__ and t.is_contiguous())


def tensor_to_wire(t: torch.Tensor):
    """What travels for ``t``: ``("bytes", uint8 array, dtype name, shape)``, or torch's own
    reduction of it."""
    if travels_as_bytes(t):
        raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8)
        return "bytes", raw, str(t.dtype).removeprefix("torch."), tuple(t.shape)
    rebuild, args = t.__reduce_ex__(5)  # torch's own: what Ray would have pickled for it
    return "torch", rebuild, args


def tensor_from_wire(sent, copy: bool = True) -> torch.Tensor:
    """The tensor :func:`tensor_to_wire` sent, writable and its own (the received bytes may be a
    read-only view of Ray's object store: they are copied once); ``copy=False``: a view of those
    bytes, for a receiver that only reads."""
    if sent[0] == "torch":
        _, rebuild, args = sent
        return rebuild(*args)
    _, raw, dtype, shape = sent
    dtype = getattr(torch, dtype)
    if raw.size == 0:
        return torch.empty(shape, dtype=dtype)
    if copy:
        return torch.from_numpy(np.array(raw, copy=True)).view(dtype).reshape(shape)
    with warnings.catch_warnings():  # torch warns that a read-only buffer's tensor must not be written: it is not
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(raw).view(dtype).reshape(shape)


def read_only_to_wire(tensors: ReadOnlyTensors) -> dict:
    return {k: tensor_to_wire(t) for k, t in tensors.items()}


def read_only_from_wire(sent: dict) -> ReadOnlyTensors:
    return ReadOnlyTensors({k: tensor_from_wire(v, copy=False) for k, v in sent.items()})


def install() -> None:
    """Send this process's CPU tensors as bytes from now on (once Ray is connected; idempotent)."""
    global _installed
    import ray
    if _installed or not ray.is_initialized():
        return
    from ray.util import register_serializer
    register_serializer(torch.Tensor, serializer=tensor_to_wire, deserializer=tensor_from_wire)
    register_serializer(ReadOnlyTensors, serializer=read_only_to_wire, deserializer=read_only_from_wire)
    _installed = True
