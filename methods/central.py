"""DeepAll — the centralised reference of the federated domain-generalization tables (gPerXAN,
CSAC): one model trained with plain SGD on the pooled training data of every source client.

The engine gives the federation one client holding all the clients' data (``pools_clients``), so
a "round" is E epochs over the pooled data and the global model is that one model. No federation,
no privacy: an upper reference, not a method to deploy. No hyperparameters of its own.
"""
from __future__ import annotations

from dataclasses import dataclass

from raysim.core.contract import Method
from raysim.core.hparams import Hparams


@dataclass(frozen=True)
class CentralHparams(Hparams):
    pass


class Central(Method):
    name = "central"
    Hparams = CentralHparams
    paper = "DeepAll: centralised training on the pooled source data"
    shares = "no federation: one model trained on the pooled clients' data"
    pools_clients = True
