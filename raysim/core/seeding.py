"""Every random draw comes from a generator keyed by (seed, round, client, purpose).

That is what makes a run independent of how clients are spread over hosts, of the order hosts
finish in, and of a host being restarted mid-round.
"""
from __future__ import annotations

import zlib

import numpy as np

SERVER = -1


def _key(seed: int, rnd: int, client: int, purpose: str) -> list[int]:
    return [int(seed) & 0xFFFFFFFF, int(rnd), int(client) + 1, zlib.crc32(purpose.encode())]


def generator_for(seed: int, rnd: int, client: int, purpose: str, device=None) -> "torch.Generator":
    """A torch generator keyed by (seed, round, client, purpose), on ``device`` (default the CPU: a
    device's own generator draws there without a copy, with that device's random stream)."""
    import torch  # here: the driver imports this module for rng_for and never needs torch

    state = np.random.SeedSequence(_key(seed, rnd, client, purpose)).generate_state(1, np.uint64)[0]
    return torch.Generator(device=device or "cpu").manual_seed(int(state))


def rng_for(seed: int, rnd: int, client: int, purpose: str) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(_key(seed, rnd, client, purpose)))
