"""Per-client persistent state on a host, with idle clients spilled to local disk.

A virtual client is state, not a process: its personal tensors, statistics and method objects
live here between rounds. When the states held in memory exceed the host's budget, the least
recently used ones are written to disk with ``torch.save`` and read back with
``torch.load(weights_only=True)`` (tensors, numbers, strings, lists and dicts only: no code runs
on load), so 100k clients fit in a bounded footprint.

In memory, an idle client's state is kept *packed*: the bytes of all its tensors in one buffer,
plus a layout (keys, dtypes, shapes, offsets) shared by every client whose state has the same
structure. A FedBN client of a small CNN keeps ten tensors of ~800 bytes in all; as ten torch
tensors they would cost ~6 KB of Python and allocator overhead, packed they cost ~1 KB. ``get``
hands back tensors that are views of the buffer (in-place updates land in the stored state, as
they would without packing); ``put`` packs the new state. States holding anything else than
plain CPU tensors, numbers, strings, None, lists, tuples and dicts are kept as they are.

With a device budget (``runtime.device_state_mb`` on a GPU host) a state whose tensors a client
step left on the device (:func:`raysim.core.tensors.keep_state_on`) stays there, the least recently
used beyond the budget moving to CPU memory (packed) and from there to disk as above: a client
that trains again soon loads its state device to device.
"""
from __future__ import annotations

import io
import os
import tempfile
from collections import OrderedDict

import numpy as np
import torch

from raysim.core.files import write_atomically
from raysim.core.tensors import leaves, to_device

_ALIGN = 16  # every tensor starts at a multiple of the largest element size
_LAYOUTS_MAX = 1024  # distinct state layouts shared between clients (beyond: kept per client)


class _Unpackable(Exception):
    pass


class Packed:
    """One client's state as (shared layout, its scalar leaves, one byte buffer)."""
    __slots__ = ("layout", "values", "buf")

    def __init__(self, layout, values, buf):
        self.layout, self.values, self.buf = layout, values, buf


def pack(state, layouts: dict | None = None) -> Packed | None:
    """``state`` packed, or None when it holds something that is not a plain CPU tensor (of a
    dtype numpy knows: not bfloat16), number, string, None, list, tuple or dict (the store then
    keeps it as it is)."""
    arrays: list = []
    values: list = []
    offset = [0]

    def walk(obj):
        if isinstance(obj, torch.Tensor):
            if type(obj) is not torch.Tensor:  # nn.Parameter and other subclasses stay as they are
                raise _Unpackable
            try:  # numpy() refuses GPU, sparse, quantized, grad-requiring and conj/neg-bit tensors
                a = obj.numpy()
            except (TypeError, RuntimeError):
                raise _Unpackable from None
            start = offset[0]
            offset[0] = start + -(-a.nbytes // _ALIGN) * _ALIGN
            arrays.append((start, a))
            return ("T", start, a.size, a.dtype, a.shape)
        kind = type(obj)
        if kind is dict:
            return ("D", tuple((k, walk(v)) for k, v in obj.items()))
        if kind is list:
            return ("L", tuple(walk(v) for v in obj))
        if kind is tuple:
            return ("U", tuple(walk(v) for v in obj))
        if obj is None or kind in (int, float, str, bool):
            values.append(obj)
            return ("V", len(values) - 1)
        raise _Unpackable

    try:
        layout = walk(state)
    except _Unpackable:
        return None
    if not arrays or offset[0] == 0:
        return None
    if layouts is not None:  # share one layout object between clients of the same structure
        try:
            shared = layouts.get(layout)
        except TypeError:  # an unhashable dict key
            return None
        if shared is not None:
            layout = shared
        elif len(layouts) < _LAYOUTS_MAX:
            layouts[layout] = layout
    buf = bytearray(offset[0])
    flat = np.frombuffer(buf, dtype=np.uint8)
    for start, a in arrays:
        if a.size:
            flat[start:start + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    return Packed(layout, tuple(values), buf)


def unpack(p: Packed, copy: bool = False):
    """The state again; its tensors are views of the packed buffer unless ``copy``."""
    buf = p.buf

    def build(node):
        tag = node[0]
        if tag == "T":
            _, start, count, dtype, shape = node
            a = (np.frombuffer(buf, dtype=dtype, count=count, offset=start).reshape(shape) if count
                 else np.empty(shape, dtype=dtype))
            t = torch.from_numpy(a)
            return t.clone() if copy else t
        if tag == "D":
            return {k: build(v) for k, v in node[1]}
        if tag == "L":
            return [build(v) for v in node[1]]
        if tag == "U":
            return tuple(build(v) for v in node[1])
        return p.values[node[1]]

    return build(p.layout)


def state_nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(state_nbytes(v) for v in obj.values()) + 64
    if isinstance(obj, (list, tuple)):
        return sum(state_nbytes(v) for v in obj) + 64
    return 64


def same_record(a, b) -> bool:
    """Whether two client records hold the same values: the same containers and keys, tensors of
    the same dtype, shape and elements, other leaves equal."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and a.device == b.device and bool(torch.equal(a, b)))
    if isinstance(a, dict) or isinstance(b, dict):
        return (isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys()
                and all(same_record(a[k], b[k]) for k in a))
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return (type(a) is type(b) and len(a) == len(b) and all(same_record(x, y) for x, y in zip(a, b)))
    try:
        return type(a) is type(b) and bool(a == b)
    except (TypeError, ValueError):  # an array's elementwise comparison: not judged, so kept
        return False


def _on_device(state) -> bool:
    return any(t.device.type != "cpu" for t in leaves(state))


class ClientStateStore:
    def __init__(self, memory_budget_bytes: float, spill_dir: str | None = None, device_budget_bytes: float = 0):
        self.budget = memory_budget_bytes
        self.device_budget = device_budget_bytes
        self._dev: OrderedDict[int, dict] = OrderedDict()  # states kept on the device, LRU order
        self.bytes_on_device = 0
        self._mem: OrderedDict[int, dict] = OrderedDict()  # LRU order: oldest first
        self._sizes: dict[int, int] = {}
        self._on_disk: set[int] = set()
        self._spill_dir = spill_dir
        self.bytes_in_memory = 0
        self.spills = 0
        self._layouts: dict = {}

    def __contains__(self, client_id: int) -> bool:
        return client_id in self._dev or client_id in self._mem or client_id in self._on_disk

    def __len__(self) -> int:
        return len(self._dev) + len(self._mem) + len(self._on_disk)

    @property
    def spill_dir(self) -> str:
        if self._spill_dir is None:
            self._spill_dir = tempfile.mkdtemp(prefix="raysim-spill-")
        os.makedirs(self._spill_dir, exist_ok=True)
        return self._spill_dir

    def _path(self, client_id: int) -> str:
        return os.path.join(self.spill_dir, f"client-{client_id}.pt")

    def get(self, client_id: int) -> dict | None:
        if client_id in self._dev:
            self._dev.move_to_end(client_id)
            return self._dev[client_id]
        if client_id in self._mem:
            self._mem.move_to_end(client_id)
            state = self._mem[client_id]
            return unpack(state) if isinstance(state, Packed) else state
        if client_id in self._on_disk:
            path = self._path(client_id)
            state = torch.load(path, weights_only=True)
            self._on_disk.discard(client_id)
            os.remove(path)
            self._remember(client_id, state)
            return self.get(client_id)
        return None

    def put(self, client_id: int, state: dict) -> None:
        if client_id in self._dev:
            self.bytes_on_device -= self._sizes.pop(client_id)
            del self._dev[client_id]
        if client_id in self._mem:
            self.bytes_in_memory -= self._sizes[client_id]
            del self._mem[client_id]
        self._on_disk.discard(client_id)
        if _on_device(state):
            size = state_nbytes(state)
            if size <= self.device_budget:
                self._dev[client_id], self._sizes[client_id] = state, size
                self.bytes_on_device += size
                while self.bytes_on_device > self.device_budget:
                    self._to_memory_oldest()
                return
            state = to_device(state, "cpu", what="state")  # over the device budget by itself
        self._remember(client_id, state)

    def _to_memory_oldest(self) -> None:
        """The least recently used state on the device moves to CPU memory (one transfer)."""
        client_id, state = self._dev.popitem(last=False)
        self.bytes_on_device -= self._sizes.pop(client_id)
        self._remember(client_id, to_device(state, "cpu", what="state"))

    def _remember(self, client_id: int, state: dict) -> None:
        size = state_nbytes(state)
        packed = pack(state, self._layouts)
        self._mem[client_id] = state if packed is None else packed
        self._sizes[client_id] = size
        self.bytes_in_memory += size
        while self.bytes_in_memory > self.budget and len(self._mem) > 1:
            self._spill_oldest()

    def _spill_oldest(self) -> None:
        client_id, state = self._mem.popitem(last=False)
        self.bytes_in_memory -= self._sizes.pop(client_id)
        if isinstance(state, Packed):
            state = unpack(state, copy=True)
        write_atomically(self._path(client_id), lambda tmp: torch.save(state, tmp))
        self._on_disk.add(client_id)
        self.spills += 1

    def items(self):
        """Every (client_id, state), loading spilled ones without keeping them (for checkpoints)."""
        for cid in sorted(set(self._dev) | set(self._mem) | self._on_disk):
            if cid in self._dev:  # a checkpoint and another host read CPU tensors
                yield cid, to_device(self._dev[cid], "cpu", what="state")
            elif cid in self._mem:
                state = self._mem[cid]
                yield cid, unpack(state, copy=True) if isinstance(state, Packed) else state
            else:
                yield cid, torch.load(self._path(cid), weights_only=True)


def to_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()
