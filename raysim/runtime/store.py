"""Per-client persistent state on a host, with idle clients spilled to local disk.

A virtual client is state, not a process: its personal tensors, statistics and method objects
live here between rounds. When the states held in memory exceed the host's budget, the least
recently used ones are written to disk with ``torch.save`` and read back with
``torch.load(weights_only=True)`` (tensors, numbers, strings, lists and dicts only: no code runs
on load), so 100k clients fit in a bounded footprint.
"""
from __future__ import annotations

import io
import os
import tempfile
from collections import OrderedDict

import torch


def state_nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(state_nbytes(v) for v in obj.values()) + 64
    if isinstance(obj, (list, tuple)):
        return sum(state_nbytes(v) for v in obj) + 64
    return 64


class ClientStateStore:
    def __init__(self, memory_budget_bytes: float, spill_dir: str | None = None):
        self.budget = memory_budget_bytes
        self._mem: OrderedDict[int, dict] = OrderedDict()  # LRU order: oldest first
        self._sizes: dict[int, int] = {}
        self._on_disk: set[int] = set()
        self._spill_dir = spill_dir
        self.bytes_in_memory = 0
        self.spills = 0

    def __contains__(self, client_id: int) -> bool:
        return client_id in self._mem or client_id in self._on_disk

    def __len__(self) -> int:
        return len(self._mem) + len(self._on_disk)

    @property
    def spill_dir(self) -> str:
        if self._spill_dir is None:
            self._spill_dir = tempfile.mkdtemp(prefix="raysim-spill-")
        os.makedirs(self._spill_dir, exist_ok=True)
        return self._spill_dir

    def _path(self, client_id: int) -> str:
        return os.path.join(self.spill_dir, f"client-{client_id}.pt")

    def get(self, client_id: int) -> dict | None:
        if client_id in self._mem:
            self._mem.move_to_end(client_id)
            return self._mem[client_id]
        if client_id in self._on_disk:
            path = self._path(client_id)
            state = torch.load(path, weights_only=True)
            self._on_disk.discard(client_id)
            os.remove(path)
            self._remember(client_id, state)
            return state
        return None

    def put(self, client_id: int, state: dict) -> None:
        if client_id in self._mem:
            self.bytes_in_memory -= self._sizes[client_id]
            del self._mem[client_id]
        self._on_disk.discard(client_id)
        self._remember(client_id, state)

    def _remember(self, client_id: int, state: dict) -> None:
        size = state_nbytes(state)
        self._mem[client_id] = state
        self._sizes[client_id] = size
        self.bytes_in_memory += size
        while self.bytes_in_memory > self.budget and len(self._mem) > 1:
            self._spill_oldest()

    def _spill_oldest(self) -> None:
        client_id, state = self._mem.popitem(last=False)
        self.bytes_in_memory -= self._sizes.pop(client_id)
        path = self._path(client_id)
        tmp = path + ".tmp"
        torch.save(state, tmp)
        os.replace(tmp, path)
        self._on_disk.add(client_id)
        self.spills += 1

    def items(self):
        """Every (client_id, state), loading spilled ones without keeping them (for checkpoints)."""
        for cid in sorted(set(self._mem) | self._on_disk):
            if cid in self._mem:
                yield cid, self._mem[cid]
            else:
                yield cid, torch.load(self._path(cid), weights_only=True)


def to_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()
