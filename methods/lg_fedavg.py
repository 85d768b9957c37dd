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

Where the default comes from (``raysim methods lg_fedavg``): ``global_layers = 2``, the official
code's CIFAR-10 runs (pliang279/LG-FedAvg: ``--num_layers_keep 2``; MNIST: 3; argparse default 1),
and spec 3.2's choice for FDSE's AlexNet (fc2 + bn7 and the head). One caveat, no switch: the
code counts the kept layers from the end of each network's ``weight_keys`` list, which for its
CIFAR CNN is ordered fc1, fc2, fc3, conv2, conv1, so its CIFAR runs share the two *conv* layers and
keep the fc layers local; the MNIST MLP's list is in forward order (top layers shared, as the paper
describes). The top-layer reading here is the paper's.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from raysim.core.contract import Method
from raysim.core.errors import UserError
from raysim.core.hparams import Hparams, Space
from raysim.models.norm import is_norm
from raysim.core.settings import setting


@dataclass(frozen=True)
class LGFedAvgHparams(Hparams):
    global_layers: int = setting(2, ge=1, source="official code's CIFAR-10 scripts (--num_layers_keep 2); spec 3.2 for AlexNet", doc="the last two weight layers are global")

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
