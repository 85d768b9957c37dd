"""FedBN — Li et al., "FedBN: Federated Learning on Non-IID Features via Local Batch
Normalization", ICLR 2021.

FedAvg, except that every batch-norm layer (affine weight and bias, running mean and variance)
stays on its client: "average every key except those of BN layers". Each client is evaluated
with its own BN layers.
"""
from __future__ import annotations

from dataclasses import dataclass

from raysim.methods.base import Hparams, Method, bn_keys


@dataclass(frozen=True)
class FedBNHparams(Hparams):
    pass


class FedBN(Method):
    name = "fedbn"
    Hparams = FedBNHparams
    paper = "Li et al., ICLR 2021"

    def personal_keys(self, model):
        return bn_keys(model)
