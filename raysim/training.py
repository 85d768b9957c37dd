"""The local training loop every method starts from: plain SGD over the client's shuffled data.

Methods add their terms through ``extra_loss`` (FedProx's proximal term, FDSE's consistency
regularizer, ...) or write their own loop when the paper's step differs more than that.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from raysim.errors import TrainingDiverged


def make_sgd(ctx, params=None) -> torch.optim.Optimizer:
    t = ctx.train
    return torch.optim.SGD(ctx.model.parameters() if params is None else params, lr=ctx.lr,
                           momentum=t.momentum, weight_decay=t.weight_decay)


def train_epochs(ctx, extra_loss: Callable | None = None, optimizer: torch.optim.Optimizer | None = None,
                 epochs: int | None = None, after_step: Callable | None = None) -> dict:
    """Train ``ctx.model`` for ``train.epochs`` epochs (or ``train.max_steps`` steps).

    ``extra_loss(model, x, y, logits) -> tensor`` is added to the cross-entropy.
    ``after_step(model)`` runs after each optimizer step (masks, clipping of weights, ...).
    Returns ``{"loss": mean total loss, "steps": n}``.
    """
    model, t = ctx.model, ctx.train
    model.train()
    opt = optimizer or make_sgd(ctx)
    total, steps = 0.0, 0
    for _ in range(epochs or t.epochs):
        for x, y in ctx.data.batches(t.batch_size, ctx.generator, ctx.device):
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            if extra_loss is not None:
                loss = loss + extra_loss(model, x, y, logits)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if t.grad_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
            opt.step()
            if after_step is not None:
                after_step(model)
            value = loss.item()
            if not math.isfinite(value):
                raise TrainingDiverged(ctx.client_id, ctx.domain, ctx.round, value)
            total += value
            steps += 1
            if t.max_steps and steps >= t.max_steps:
                return {"loss": total / steps, "steps": steps}
    return {"loss": total / max(steps, 1), "steps": steps}


@torch.no_grad()
def evaluate(model, split, batch_size: int, device) -> dict:
    """Sum of correct predictions and of the loss over a split (summed, so pools combine exactly)."""
    model.eval()
    correct, loss_sum, n = 0, 0.0, 0
    for x, y in split.eval_batches(batch_size, device):
        logits = model(x)
        loss_sum += F.cross_entropy(logits, y, reduction="sum").item()
        correct += int((logits.argmax(1) == y).sum())
        n += len(y)
    return {"correct": correct, "loss_sum": loss_sum, "n": n}
