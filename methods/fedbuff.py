"""FedBuff — Nguyen et al., "Federated Learning with Buffered Asynchronous Aggregation",
AISTATS 2022 (arXiv 2106.06639), Alg. 1:

    client i: from the model x_{v_i} it downloaded, E epochs of SGD -> y_i; uploads Δ_i = y_i − x_{v_i}
    server:   keeps C clients training; once K uploads arrived,
              Δ̄ = (1/K) Σ_i s(τ_i) Δ_i,   s(τ) = 1 / √(1 + τ)   (τ_i: server steps since i's download)
              x ← ServerOpt(x, Δ̄)                                (SGD with server lr and momentum)

The timeline (who is in flight, arrival order, τ) is the engine's (``schedule: {kind: buffered}``,
raysim.engine.timeline); the fold and the step along Δ̄ are raysim.core.buffered's, so this file
holds only what FedBuff sets: the buffered schedule, K, s(τ), equal client weights and the server
optimizer. Defaults (raysim's choice, stated in docs/results.md): K = 10 and equal weights
(the first author's FLSim example config, sent140_fedbuff_config.json: buffer_size 10,
EqualExampleWeight); server momentum 0.9 (same config) at server lr 1 (FedAvgM's form): that config
sums the buffer (lr 0.7 on Σ, ~7 on the mean at K = 10) where Alg. 1 divides by K, as here; the
paper's per-dataset server lrs were not checked against its appendix. C is ``clients_per_round``
unless ``schedule.concurrency`` says otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass

from raysim.core.contract import ClientContext, LocalLoss, Upload, cross_entropy
from raysim.core.hparams import Hparams
from raysim.core.staleness import Staleness
from raysim.methods.fedavg import FedAvg


@dataclass(frozen=True)
class FedBuffHparams(Hparams):
    pass


class FedBuff(FedAvg):
    name = "fedbuff"
    Hparams = FedBuffHparams
    paper = "Nguyen et al., AISTATS 2022"
    shares = "shares the whole model's update; keeps nothing (server: buffered, staleness-weighted, with momentum)"
    schedule = "buffered"
    buffer = 10  # K
    staleness = Staleness("sqrt")  # s(τ) = 1 / √(1 + τ)
    server_optimizer = "momentum"  # SGD with server momentum 0.9 (server.momentum), server lr 1 (server.lr)

    def upload(self, ctx: ClientContext, stats: dict) -> Upload:
        up = super().upload(ctx, stats)
        up.weight = 1.0  # Δ̄ = (1/K) Σ s(τ_i) Δ_i: every client counts once
        return up

    def local_loss(self, ctx: ClientContext) -> LocalLoss:
        return LocalLoss(cross_entropy)
