"""LG-FedAvg — Liang, Liu, Ziyin, Allen, Auerbach, Brent, Salakhutdinov, Morency, "Think Locally,
Act Globally: Federated Learning with Local and Global Representations", NeurIPS 2019 FL workshop
(arXiv 2001.01523, Algorithm 1).

The model is split into local representation layers phi_k (the lower layers, never leaving the
client) and global layers omega (the top ``global_layers`` weight layers, ending in the
classifier; a norm layer right after a global layer belongs to it: AlexNet's fc2 + bn7).
    client k: trains [phi_k, omega] with CE for E epochs; uploads omega_k
    server:   omega = the mean of the omega_k, sent to every client
Each client is scored with [phi_k, omega]. The official code averages uniformly: set
``train.weighting: uniform`` to reproduce it (with equal client sizes the two agree). No FedAvg
warm start (the official scripts load a pre-trained FedAvg model; the seeds train from scratch).
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from raysim.contract import Method
from raysim.errors import UserError
from raysim.hparams import Hparams, Space
from raysim.models.norm import is_norm
from raysim.settings import setting


@dataclass(frozen=True)
class LGFedAvgHparams(Hparams):
    global_layers: int = setting(2, ge=1)  # the official num_layers_keep = 2: the last two weight layers

    @classmethod
    def search_space(cls):
        return {"global_layers": Space.choice(1, 2, 3)}


def global_modules(model: nn.Module, count: int) -> list[str]:
    """The module names of the global part: the last ``count`` conv/linear layers, with the norm
    layers that follow the first of them."""
    order = [(n, m) for n, m in model.named_modules() if n and (isinstance(m, (nn.Conv2d, nn.Linear)) or is_norm(m))]
    weights = [i for i, (_, m) in enumerate(order) if isinstance(m, (nn.Conv2d, nn.Linear))]
    if count > len(weights):
        raise UserError(f"lg_fedavg: hp.lg_fedavg.global_layers = {count} but the model has {len(weights)} weight layers")
    return [n for n, _ in order[weights[-count]:]]


class LGFedAvg(Method):
    name = "lg_fedavg"
    Hparams = LGFedAvgHparams
    paper = "Liang et al., NeurIPS 2019 FL workshop"
    shares = 'shares the top (global) layers; keeps the lower representation layers'

    def personal_keys(self, model):
        """phi_k: every state entry outside the global layers."""
        top = tuple(f"{n}." for n in global_modules(model, self.hp.global_layers))
        return {k for k in model.state_dict() if not k.startswith(top)}
