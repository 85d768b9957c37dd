"""Buffered (asynchronous) aggregation's server side: what a server step receives and FedBuff's
update of the global model (which methods can run buffered: raysim.core.contract.buffered_refusal).

A buffered step folds the K uploads that arrived (raysim.engine.timeline), each a delta
Δ_i = y_i − x_{v_i} against the model version v_i its client trained from, weighted by its
client weight w_i (n_k, or 1) times its staleness weight s(τ_i). The hosts' fold gives the
aggregator's weighted mean of those deltas, Σ w_i s_i Δ_i / Σ w_i s_i; with Σ w_i s_i and Σ w_i the
server has FedBuff's buffered update (Nguyen et al., AISTATS 2022, Alg. 1, with w_i = 1):

    Δ̄ = Σ_i w_i s(τ_i) Δ_i / Σ_i w_i          (w_i = 1: (1/K) Σ_i s(τ_i) Δ_i)

and the server optimizer (``server:``; FedBuff's server lr and momentum) steps along Δ̄ exactly as a
synchronous round's step goes along Δ = mean − x (raysim.core.server_optimizers). With every
arrival fresh (τ = 0) and K = every client in flight, Δ̄ is the synchronous round's mean update.

Integer buffers (BN's ``num_batches_tracked``) are not deltas: the hosts fold the clients' own
values and the step takes their mean, as a synchronous round does.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from raysim.core.tensors import Tensors


@dataclass
class BufferedUploads:
    """One buffered step's uploads, as the server step sees them."""

    mean: Tensors
    """Σ w_i s_i Δ_i / Σ w_i s_i over the floating-point tensors (the deltas' weighted mean); the
    clients' own values' weighted mean for integer ones."""
    scaled_weight: float
    """Σ_i w_i s(τ_i)."""
    weight: float
    """Σ_i w_i: the clients' weights without staleness (K where every w_i = 1)."""
    clients: list[int]
    """The folded clients, ascending."""
    staleness: dict[int, int] = field(default_factory=dict)
    """Client -> τ: server steps between its dispatch and this step."""
    bases: dict[int, Tensors] = field(default_factory=dict)
    """Client -> the global tensors of the version it trained from (x_{v_i}), for steps that mix
    models (FedAsync) rather than add deltas."""

    def delta(self) -> Tensors:
        """Δ̄ = Σ w_i s_i Δ_i / Σ w_i over the floating-point tensors (FedBuff's buffered update)."""
        scale = self.scaled_weight / self.weight if self.weight > 0 else 0.0
        return {k: v * scale for k, v in self.mean.items() if v.is_floating_point()}


def step_target(global_: Tensors, uploads: BufferedUploads) -> Tensors:
    """The tensors a synchronous round's mean would be for the same step: x + Δ̄ for floating-point
    tensors, the clients' mean for integer ones; a server optimizer's ``update(x, target)`` then
    steps along target − x = Δ̄ (:meth:`raysim.core.server_optimizers.ServerOptimizer.update`)."""
    delta = uploads.delta()
    out = {}
    for k, v in uploads.mean.items():
        if k in delta and k in global_:
            out[k] = (global_[k] + delta[k]).to(global_[k].dtype)
        else:
            out[k] = v
    return out


def delta_upload(tensors: Tensors, base: Tensors) -> Tensors:
    """What a client's buffered upload folds: y − x_v for its floating-point tensors the broadcast
    holds, its own value (a copy) for the others; new tensors (the model's are overwritten by the
    next client)."""
    out = {}
    for k, y in tensors.items():
        x = base.get(k)
        out[k] = y - x if x is not None and y.is_floating_point() else y.clone()
    return out
