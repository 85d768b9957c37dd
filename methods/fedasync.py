"""FedAsync — Xie, Koyejo, Gupta, "Asynchronous Federated Optimization", arXiv 1903.03934 (Alg. 1):

    client: from x_τ (the model it downloaded), SGD on f(x; z) + (ρ / 2) ||x − x_τ||² -> x_new
    server: every arrival at once (K = 1):
            α_t = α · s(t − τ)                  (s: constant, polynomial (1 + t − τ)^(−a), hinge)
            x_t = (1 − α_t) x_{t−1} + α_t x_new

The arrival order and staleness t − τ are the engine's (``schedule: {kind: buffered, buffer: 1}``,
raysim.engine.timeline). The client's proximal term is FedProx's with μ = ρ (the authors' code,
xcgoner/async_fl, applies it as w ← (1 − γρ) w + γρ x_τ before each SGD step: the same step).
Defaults: α = 0.6, polynomial s with a = 0.5, ρ = 0.005, the CIFAR-10 values secondary accounts of
the paper's experiments give (FLGo's fedasync takes the same); the authors' run script uses α = 0.8,
halved at 40% of training. Not checked against the PDF: stated in docs/results.md.
"""
from __future__ import annotations

from dataclasses import dataclass

from raysim.core.buffered import BufferedUploads
from raysim.core.hparams import Hparams, Space
from raysim.core.settings import setting
from raysim.core.staleness import Staleness
from raysim.methods.fedprox import FedProx


@dataclass(frozen=True)
class FedAsyncHparams(Hparams):
    alpha: float = setting(0.6, gt=0, le=1, source="Xie et al. 2019, CIFAR-10 (alpha in {0.6, 0.9}; secondary accounts, FLGo); authors' script 0.8",
                           doc="mixing weight α of an arrival with staleness 0")
    rho: float = setting(0.005, ge=0, source="Xie et al. 2019, CIFAR-10 (rho in {0.005, 0.01}; secondary accounts, FLGo mu)",
                         doc="ρ of the client's proximal term (ρ/2)||x − x_τ||²")

    @property
    def mu(self) -> float:
        """FedProx's μ: the client step is FedProx's with μ = ρ."""
        return self.rho

    @classmethod
    def search_space(cls):
        return {"alpha": Space.uniform(0.1, 1.0)}


class FedAsync(FedProx):
    name = "fedasync"
    Hparams = FedAsyncHparams
    paper = "Xie, Koyejo, Gupta, arXiv:1903.03934, 2019"
    shares = "shares the whole model (local proximal term to the model it downloaded); keeps nothing"
    schedule = "buffered"
    buffer = 1  # every arrival at once
    buffer_fixed = True
    staleness = Staleness("polynomial", a=0.5)  # s(t − τ) = (1 + t − τ)^(−a)
    fold_staleness = False  # s weights the mix below, not the upload: the fold gives Δ itself

    def buffered_step(self, state: dict, uploads: BufferedUploads, step: int) -> dict:
        (client,) = uploads.clients
        alpha_t = self.hp.alpha * uploads.staleness_weights[client]  # α · s(t − τ)
        x, base = state["global"], uploads.bases[client]
        new = {}
        for k, v in uploads.mean.items():  # x_new = x_τ + Δ: the client's model
            if v.is_floating_point() and k in base:
                new[k] = ((1 - alpha_t) * x[k] + alpha_t * (base[k] + v)).to(x[k].dtype)
            else:
                new[k] = v
        return {**state, "global": {**x, **new}}
