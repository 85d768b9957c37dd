"""FedAvg — McMahan et al., "Communication-Efficient Learning of Deep Networks from
Decentralized Data", AISTATS 2017.

    server: w^{t} = sum_k (n_k / n) w_k^{t}
    client: w_k^{t} = E epochs of SGD on D_k starting from w^{t-1}

Everything in the model (parameters and BN buffers) is shared and averaged. No hyperparameters
of its own: lr, epochs and batch size are the experiment's (``train``).
"""
from __future__ import annotations

from dataclasses import dataclass

from raysim.core.contract import LocalLoss, Method, cross_entropy
from raysim.core.hparams import Hparams
from raysim.core.tensors import tensors_nbytes


@dataclass(frozen=True)
class FedAvgHparams(Hparams):
    pass


class FedAvg(Method):
    name = "fedavg"
    Hparams = FedAvgHparams
    paper = "McMahan et al., AISTATS 2017"
    shares = 'shares the whole model; keeps nothing'
    # The base Method already is FedAvg: broadcast the global tensors, train with SGD,
    # upload everything, aggregate by the n_k-weighted mean.

    def local_loss(self, ctx):
        return LocalLoss(cross_entropy)  # client cohorts: the step is SGD on the cross-entropy

    def upload_floor(self, model):
        personal = self.personal_keys(model)  # every client uploads the rest of its model
        return tensors_nbytes({k: v for k, v in model.state_dict().items() if k not in personal})
