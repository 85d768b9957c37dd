"""Buffered (asynchronous) aggregation's server side: what a server step receives and FedBuff's
update of the global model (which methods can run buffered: raysim.core.contract.buffered_refusal).

A buffered step folds the K uploads that arrived (raysim.engine.timeline), each a delta
Δ_i = y_i − x_{v_i} against the model version v_i its client trained from. The host that trained
a job scales its delta by its staleness weight s(τ_i) in the delta's own dtype
(:func:`staleness_scaled`) and folds it with its client weight w_i (n_k, or 1), so the server's
reduce gives FedBuff's buffered update (Nguyen et al., AISTATS 2022, Alg. 1, with w_i = 1):

    Δ̄ = Σ_i w_i s(τ_i) Δ_i / Σ_i w_i          (w_i = 1: (1/K) Σ_i s(τ_i) Δ_i)

and the server optimizer (``server:``; FedBuff's server lr and momentum) steps along Δ̄ exactly as a
synchronous round's step goes along Δ = mean − x (raysim.core.server_optimizers). With every
arrival fresh (τ = 0) and K = every client in flight, Δ̄ is the synchronous round's mean update.

Why s(τ_i) is applied to the delta and not folded into the weight: the fold's float64 products
of a float32 delta with an integer weight are exact, so their sum does not depend on how the
uploads are grouped over hosts (1, 2 or 4 hosts give the same bits, as in a synchronous round);
a fractional weight w_i s(τ_i) rounds each product, and the grouping then shows in the last bits.

A method whose step uses s(τ) itself (FedAsync's mixing weight α s(t − τ)) sets
``Method.fold_staleness = False``: its deltas fold unscaled and the step reads
:attr:`BufferedUploads.staleness_weights`.

Integer buffers (BN's ``num_batches_tracked``) are not deltas: the hosts fold the clients' own
values and the step takes their w-weighted mean, as a synchronous round does.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from raysim.core.tensors import Tensors


@dataclass
class BufferedUploads:
    """One buffered step's uploads, as the server step sees them."""

    mean: Tensors
    """Δ̄ = Σ w_i s_i Δ_i / Σ w_i over the floating-point tensors (s_i = 1 where the method's step
    applies s(τ) itself); the clients' own values' w-weighted mean for integer ones."""
    weight: float
    """Σ_i w_i: the clients' weights (K where every w_i = 1)."""
    clients: list[int]
    """The folded clients, ascending."""
    staleness: dict[int, int] = field(default_factory=dict)
    """Client -> τ: server steps between its dispatch and this step."""
    staleness_weights: dict[int, float] = field(default_factory=dict)
    """Client -> s(τ), the schedule's staleness weight of its upload."""
    bases: dict[int, Tensors] = field(default_factory=dict)
    """Client -> the global tensors of the version it trained from (x_{v_i}), for steps that mix
    models (FedAsync) rather than add deltas."""

    def delta(self) -> Tensors:
        """Δ̄ = Σ w_i s_i Δ_i / Σ w_i over the floating-point tensors (FedBuff's buffered update)."""
        return {k: v for k, v in self.mean.items() if v.is_floating_point()}


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


def staleness_scaled(delta: Tensors, s: float, in_place: bool = False) -> Tensors:
    """s · Δ for a delta upload's floating-point tensors, rounded once in their own dtype (what a
    FedBuff client's update becomes before the fold); integer tensors as they are. s = 1: ``delta``.
    ``in_place``: into ``delta``'s own tensors (a host's private delta, read once by its fold: no
    new buffer per job; the same bits as a new one)."""
    if s == 1.0:
        return delta
    if in_place:
        for v in delta.values():
            if v.is_floating_point():
                v.mul_(s)
        return delta
    return {k: v * s if v.is_floating_point() else v for k, v in delta.items()}
