"""FedBN — Li et al., "FedBN: Federated Learning on Non-IID Features via Local Batch
Normalization", ICLR 2021.

FedAvg, except that every batch-norm layer (affine weight and bias, running mean and variance)
stays on its client: "average every key except those of BN layers". Each client is evaluated
with its own BN layers.

An unseen client (a held-out domain; FDSE Sec. 5.4, Alg. 2) starts from the shared layers and the
mean of the clients' BN layers, then collects its own BN statistics in one train-mode pass over
its unlabeled data before it is evaluated (FDSE's Alg. 2 and text: 1 epoch; the FDSE code makes 5).
No hyperparameters of its own.
"""
from __future__ import annotations

from dataclasses import dataclass

from raysim.core.contract import LocalLoss, Method, cross_entropy
from raysim.core.hparams import Hparams
from raysim.core.tensors import bn_keys
from raysim.core.training import collect_bn_stats


@dataclass(frozen=True)
class FedBNHparams(Hparams):
    pass


class FedBN(Method):
    name = "fedbn"
    Hparams = FedBNHparams
    paper = "Li et al., ICLR 2021"
    shares = 'shares all but the BatchNorm layers; keeps BN affine and statistics'

    def personal_keys(self, model):
        return bn_keys(model)

    def local_loss(self, ctx):
        return LocalLoss(cross_entropy)  # client cohorts: the step is SGD on the cross-entropy

    def adapt_to_unseen(self, model, client):
        """FDSE's Alg. 2: one epoch of forward passes collects the target's BN statistics."""
        collect_bn_stats(model, client.unlabeled_batches(client.train.batch_size))
        return True
