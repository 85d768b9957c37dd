"""What the tests of the domain-generalisation methods COPA, FedADG, FedDG-GA and FedSR (baselines
spec 5) share: a federation of 3 clients and 10 rounds (``setup``), a client's round on its 8
training and 6 validation images (``context``), a client step on one fixed batch
(``one_batch_context``), and a snapshot of the global RNGs to check a step leaves them alone
(``global_rng``, ``same_rng``). The defaults differ from ``small_cnn_harness``'s (3 clients, not 2;
round 1, not 2; a validation split; no method in the context), so the two stay apart.
Imported as ``from dg_client_harness import ...``: pytest puts this folder on ``sys.path``."""
import random

import numpy as np
import torch

from raysim.config import TrainConfig
from raysim import testing
from raysim.testing import client_context, random_client_data


def setup(n=3, rounds=10):
    return testing.setup(num_clients=n, rounds=rounds)  # 3 classes of 1 x 8 x 8 images, small_cnn with BN


def context(model, payload, state, cid=0, rnd=1, lr=0.1, epochs=1):
    """8 training and 6 validation images of client ``cid`` (seeded with it)."""
    return client_context(None, model, random_client_data(seed=cid, num_val=6), client_id=cid, round=rnd,
                          payload=payload, state=state, train=TrainConfig(epochs=epochs, batch_size=4, lr=lr), seed=7)


def global_rng():
    return torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()


def same_rng(a, b):
    return torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]


def one_batch_context(model, data, state=None, epochs=1, lr=0.1):
    """``data``: one fixed batch per epoch (no shuffling), the data of the hand-computed client steps."""
    return client_context(None, model, data, state=state or {},
                          train=TrainConfig(epochs=epochs, batch_size=data.num_train, lr=lr), seed=7)
