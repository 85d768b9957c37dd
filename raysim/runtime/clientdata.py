"""A client's slice of a dataset split, resident on its host, served as tensor batches.

Batches are cut from index permutations drawn from the client's round generator, so the same
(seed, round, client) gives the same batches on any host.
"""
from __future__ import annotations

import numpy as np
import torch


class SplitView:
    def __init__(self, split, indices: np.ndarray):
        self.split = split
        self.indices = np.asarray(indices, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.indices)

    @property
    def labels(self) -> np.ndarray:
        return self.split.labels[self.indices]

    def batches(self, batch_size: int, generator: torch.Generator, device, drop_last: bool = False):
        n = len(self.indices)
        order = torch.randperm(n, generator=generator).numpy()
        stop = n - (n % batch_size) if drop_last else n
        for start in range(0, stop, batch_size):
            idx = self.indices[order[start:start + batch_size]]
            x, y = self.split.tensors(idx, train=True, generator=generator)
            yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    def unlabeled_batches(self, batch_size: int, generator: torch.Generator, device):
        """One shuffled pass over the images without their labels and without train-time
        augmentation (label-free adaptation); a final batch of one image is left out (BN)."""
        n = len(self.indices)
        order = torch.randperm(n, generator=generator).numpy()
        for start in range(0, n, batch_size):
            idx = self.indices[order[start:start + batch_size]]
            if len(idx) < 2 and n > 1:
                continue
            x, _ = self.split.tensors(idx, train=False, generator=None)
            yield x.to(device, non_blocking=True)

    def eval_batches(self, batch_size: int, device):
        for start in range(0, len(self.indices), batch_size):
            x, y = self.split.tensors(self.indices[start:start + batch_size], train=False, generator=None)
            yield x.to(device), y.to(device)
