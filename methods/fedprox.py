"""FedProx — Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020.

    client: min_w  F_k(w) + (mu / 2) * ||w - w^{t-1}||^2     (proximal term, Eq. 2)
    server: FedAvg's weighted mean.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from raysim.methods.base import ClientContext, Hparams, Method, Space, Upload
from raysim.training import train_epochs


@dataclass(frozen=True)
class FedProxHparams(Hparams):
    mu: float = 0.01

    @classmethod
    def search_space(cls):
        return {"mu": Space.log(1e-3, 1.0)}


class FedProx(Method):
    name = "fedprox"
    Hparams = FedProxHparams
    paper = "Li et al., MLSys 2020"

    def local_update(self, ctx: ClientContext) -> Upload:
        anchor = {n: p.detach().clone() for n, p in ctx.model.named_parameters()}

        def proximal(model, x, y, logits):
            return proximal_term(dict(model.named_parameters()), anchor, self.hp.mu)

        stats = train_epochs(ctx, extra_loss=proximal if self.hp.mu > 0 else None)
        return self.upload(ctx, stats)


def proximal_term(params: dict[str, torch.Tensor], anchor: dict[str, torch.Tensor], mu: float):
    """(mu / 2) * ||w - w^{t-1}||^2 over the model's parameters."""
    return 0.5 * mu * sum(((params[n] - anchor[n]) ** 2).sum() for n in params)
