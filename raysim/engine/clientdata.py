"""A client's slice of a dataset split, resident on its host, served as tensor batches.

Batches are cut from index permutations drawn from the client's round generator, so the same
(seed, round, client) gives the same batches on any host.

With a :class:`DeviceBudget` (``runtime.device_data_mb`` on a GPU host) a view keeps its
normalised images and labels on the device once first used and cuts batches there: no per-batch
preparation on the CPU and no host-to-device copy per step. The batches are the same values.

A host keeps each client's views in a :class:`ClientViews`; a method sees them only through the
contract's :class:`~raysim.core.contract.ClientData` (``ClientViews.for_method``), never the views
themselves.
"""
from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from raysim.core.contract import ClientData


class DeviceBudget:
    """Bytes of client data one host may keep on its device (``runtime.device_data_mb``).

    Shared by all the host's views, so the total stays bounded however many clients it holds; a
    view gives its bytes back when it is dropped (the host's ClientDataCache evicts old clients)."""

    def __init__(self, device, megabytes: float):
        self.device = torch.device(device)
        self.capacity = int(megabytes * 2**20)
        self.used = 0

    def reserve(self, nbytes: int) -> bool:
        if self.used + nbytes > self.capacity:
            return False
        self.used += nbytes
        return True

    def release(self, nbytes: int) -> None:
        self.used -= nbytes


def device_budget(device, megabytes: float) -> DeviceBudget | None:
    """The host's budget; None (batches prepared on the CPU and copied, as always) when it is 0 or
    the device is the CPU, where a second copy of the data would only cost memory."""
    device = torch.device(device)
    if megabytes <= 0 or device.type == "cpu":
        return None
    return DeviceBudget(device, megabytes)


@dataclass
class ClientViews:
    """A client's data as its host keeps it: a :class:`SplitView` per split, and the number of
    training examples its aggregation weight counts."""
    train: "SplitView"
    val: "SplitView"
    test: "SplitView"
    num_train: int

    def for_method(self) -> ClientData:
        """The same data as a method sees it: the contract's ClientData, which serves these views
        without exposing them."""
        return ClientData(self.train, self.val, self.test, self.num_train)


def keep_on_device(data: ClientViews, budget: DeviceBudget | None) -> ClientViews:
    """``data`` with its views drawing on ``budget``; unchanged without one."""
    if budget is None:
        return data
    return dataclasses.replace(data, **{s: SplitView(getattr(data, s).split, getattr(data, s).indices, budget)
                                        for s in ("train", "val", "test")})


def applies_augmentation(split) -> bool:
    """Whether ``split.tensors(train=True)`` augments (a ConcatSplit: any of its parts)."""
    parts = getattr(split, "parts", None)
    return any(map(applies_augmentation, parts)) if parts else getattr(split, "augment", None) is not None


class SplitView:
    """A client's part of a dataset split (its ``indices``): the engine's implementation of
    :class:`raysim.core.contract.ClientSplit`."""

    def __init__(self, split, indices: np.ndarray, budget: DeviceBudget | None = None):
        self.split = split
        self.indices = np.asarray(indices, dtype=np.int64)
        self.budget = budget
        self._resident: tuple[torch.Tensor, torch.Tensor] | None = None  # (images, labels) on budget.device

    def __len__(self) -> int:
        return len(self.indices)

    @property
    def labels(self) -> np.ndarray:
        return self.split.labels[self.indices]

    @property
    def classes(self) -> tuple[int, ...]:
        return tuple(int(c) for c in np.unique(self.labels))

    @property
    def normalisation(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """The split's (mean, std): a batch holds ``(pixels - mean) / std``."""
        return tuple(self.split.mean), tuple(self.split.std)

    def resident(self, device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The view's normalised images and labels on ``device``, made once (on the CPU with the
        split's own ``tensors``, so every value is the one a CPU-cut batch has); None without a
        budget for this device or while they do not fit in what is left of it."""
        if self._resident is None and self.budget is not None and torch.device(device) == self.budget.device:
            nbytes = len(self.indices) * (4 * int(np.prod(self.split.image_shape)) + 8)
            if self.budget.reserve(nbytes):
                x, y = self.split.tensors(self.indices, train=False, generator=None)
                self._resident = (x.to(self.budget.device), y.to(self.budget.device))
                weakref.finalize(self, self.budget.release, nbytes)
        return self._resident

    def batches(self, batch_size: int, generator: torch.Generator, device, drop_last: bool = False):
        n = len(self.indices)
        order = torch.randperm(n, generator=generator)
        stop = n - (n % batch_size) if drop_last else n
        # augmentation runs on the CPU batch, drawing from the generator: those stay on the CPU path
        resident = None if applies_augmentation(self.split) else self.resident(device)
        if resident is not None:
            x_all, y_all = resident
            order = order.to(x_all.device, non_blocking=True)
            for start in range(0, stop, batch_size):
                pos = order[start:start + batch_size]
                yield x_all.index_select(0, pos), y_all.index_select(0, pos)
            return
        order = order.numpy()
        for start in range(0, stop, batch_size):
            idx = self.indices[order[start:start + batch_size]]
            x, y = self.split.tensors(idx, train=True, generator=generator)
            yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    def unlabeled_batches(self, batch_size: int, generator: torch.Generator, device):
        """One shuffled pass over the images without their labels and without train-time
        augmentation (label-free adaptation); a final batch of one image is left out (BN)."""
        n = len(self.indices)
        order = torch.randperm(n, generator=generator)
        resident = self.resident(device)
        for start in range(0, n, batch_size):
            pos = order[start:start + batch_size]
            if len(pos) < 2 and n > 1:
                continue
            if resident is not None:
                yield resident[0].index_select(0, pos.to(resident[0].device, non_blocking=True))
                continue
            x, _ = self.split.tensors(self.indices[pos.numpy()], train=False, generator=None)
            yield x.to(device, non_blocking=True)

    def eval_batches(self, batch_size: int, device):
        """The view in order; copies are queued without waiting (a blocking copy would wait for
        the device at every batch)."""
        resident = self.resident(device)
        for start in range(0, len(self.indices), batch_size):
            if resident is not None:  # copies: a batch is the caller's to change, as on the CPU path
                yield resident[0][start:start + batch_size].clone(), resident[1][start:start + batch_size].clone()
                continue
            x, y = self.split.tensors(self.indices[start:start + batch_size], train=False, generator=None)
            yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_resident"], state["budget"] = None, None  # a copy elsewhere cuts its batches on the CPU
        return state
