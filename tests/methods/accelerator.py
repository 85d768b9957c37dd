"""A stand-in accelerator for placement tests on a machine without one.

``torch.device("meta")`` becomes, inside :func:`simulated_accelerator`, a device whose tensors hold
real values (kept on the CPU underneath) but obey an accelerator's placement rules:

* an operation that mixes its tensors with CPU tensors fails, as on a GPU ("Expected all tensors to
  be on the same device"), except what a GPU allows: CPU scalars (0-dim), ``copy_`` and CPU index
  tensors in advanced indexing;
* ``.cpu()`` / ``.to("cpu")`` give a plain CPU tensor, ``.to("meta")`` / factories with
  ``device="meta"`` give one on the accelerator, ``.item()`` / ``float()`` read the value.

So a method step runs with every value it would have on the CPU, and what it leaves on the device
or mixes across devices shows. (Plain ``meta`` tensors hold no values: methods that read a loss or
a mask would stop there.)
"""
from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

DEVICE = torch.device("meta")
# what a GPU accepts from the CPU: copies, and CPU index tensors in advanced indexing (t[idx])
_ALLOW_MIXED = {torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default, torch.ops.aten.set_.source_Tensor,
                torch.ops.aten.index.Tensor, torch.ops.aten.index_put_.default, torch.ops.aten.index_put.default,
                torch.ops.aten._index_put_impl_.default}


class OnAccelerator(torch.Tensor):
    """A CPU tensor (``inner``) that reports the accelerator as its device."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        if isinstance(inner, torch.nn.Parameter):
            inner = inner.detach()
        assert type(inner) is torch.Tensor and inner.device.type == "cpu", type(inner)
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, strides=inner.stride(),
                                                   storage_offset=inner.storage_offset(), dtype=inner.dtype,
                                                   device=DEVICE, requires_grad=inner.requires_grad,
                                                   layout=inner.layout)

    def __init__(self, inner: torch.Tensor):
        self.inner = inner

    def __repr__(self):
        return f"OnAccelerator({self.inner!r})"

    def __tensor_flatten__(self):
        return ["inner"], None

    @staticmethod
    def __tensor_unflatten__(inner_tensors, meta, outer_size, outer_stride):
        return OnAccelerator(inner_tensors["inner"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        ours = [t for t in flat if isinstance(t, OnAccelerator)]
        cpu = [t for t in flat if isinstance(t, torch.Tensor) and not isinstance(t, OnAccelerator)
               and t.dim() > 0]
        if func is torch.ops.aten._local_scalar_dense.default:
            return args[0].inner.item()
        if func is torch.ops.aten._to_copy.default:
            target = kwargs.get("device")
            src = args[0].inner if isinstance(args[0], OnAccelerator) else args[0]
            rest = {k: v for k, v in kwargs.items() if k != "device"}
            out = func(src, **rest)
            if target is not None and torch.device(target).type == "cpu":
                return out
            return OnAccelerator(out)
        if ours and cpu and func not in _ALLOW_MIXED:
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two "
                               f"devices, {DEVICE} (simulated accelerator) and cpu! ({func})")
        if _is_accelerator(kwargs.get("device")):  # new_zeros & co. inherit the wrapper's device
            kwargs = {**kwargs, "device": torch.device("cpu")}
        unwrapped_args, unwrapped_kwargs = tree_map(_unwrap, (args, kwargs))
        out = func(*unwrapped_args, **unwrapped_kwargs)
        if func._schema.is_mutable or func.__name__.endswith("_"):
            # in place: the inner tensor changed; return the argument it was applied to
            first = args[0]
            if isinstance(first, OnAccelerator) and isinstance(out, torch.Tensor) and out is first.inner:
                return first
        return tree_map(_wrap, out)


def _unwrap(x):
    return x.inner if isinstance(x, OnAccelerator) else x


def _wrap(x):
    if isinstance(x, torch.Tensor) and not isinstance(x, OnAccelerator):
        return OnAccelerator(x)
    return x


def _is_accelerator(device) -> bool:
    return device is not None and torch.device(device) == DEVICE


class _Placement(TorchDispatchMode):
    """Every aten operation that would create a tensor on ``meta`` (``.to("meta")``, factories with
    ``device="meta"``, the zeros autograd makes for a gradient) creates it on the CPU, wrapped."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_accelerator(kwargs.get("device")) and not any(isinstance(a, OnAccelerator) for a in tree_flatten(args)[0]):
            out = func(*args, **{**kwargs, "device": torch.device("cpu")})
            if args and isinstance(args[0], torch.Tensor) and isinstance(out, torch.Tensor) \
                    and out.untyped_storage().data_ptr() == args[0].untyped_storage().data_ptr():
                out = out.clone()  # a move to another device always copies
            return tree_map(_wrap, out)
        return func(*args, **kwargs)


class _FromData(TorchFunctionMode):
    """``torch.tensor(data, device="meta")`` and ``torch.as_tensor``: built from Python data below
    the dispatcher, so :class:`_Placement` never sees them."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.tensor, torch.as_tensor) and _is_accelerator(kwargs.get("device")):
            return OnAccelerator(func(*args, **{**kwargs, "device": "cpu"}).clone())
        return func(*args, **kwargs)


@contextlib.contextmanager
def simulated_accelerator():
    """Inside: ``torch.device("meta")`` is the simulated accelerator (module docstring)."""
    with _FromData(), _Placement():
        yield DEVICE


def on_accelerator(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every parameter and buffer on the simulated accelerator (in place)."""
    with torch.no_grad():
        for module in model.modules():
            for name, p in list(module._parameters.items()):
                if p is not None:
                    module._parameters[name] = torch.nn.Parameter(OnAccelerator(p.detach().clone()),
                                                                  requires_grad=p.requires_grad)
            for name, b in list(module._buffers.items()):
                if b is not None:
                    module._buffers[name] = OnAccelerator(b.detach().clone())
    return model


def devices(tree, prefix: str = "") -> dict[str, str]:
    """``{path: device type}`` of every tensor in a nested dict / list."""
    out = {}
    if isinstance(tree, torch.Tensor):
        out[prefix] = "accelerator" if isinstance(tree, OnAccelerator) or tree.device == DEVICE else tree.device.type
    elif isinstance(tree, dict):
        for k, v in tree.items():
            out.update(devices(v, f"{prefix}/{k}"))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(devices(v, f"{prefix}/{i}"))
    return out
