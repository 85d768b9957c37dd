"""The local training loop every method starts from: plain SGD over the client's shuffled data.

Methods add their terms through ``extra_loss`` (FedProx's proximal term, FDSE's consistency
regularizer, ...) or write their own loop when the paper's step differs more than that.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

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


def batchnorms(model: nn.Module) -> list[nn.Module]:
    """Every batch-norm layer that keeps running statistics."""
    return [m for m in model.modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]


@torch.no_grad()
def collect_bn_stats(model: nn.Module, batches) -> dict:
    """Running mean/var of every BN layer re-estimated from scratch as the plain average over
    ``batches`` (train-mode forward passes, no gradient); returns those entries of the state dict.
    ``batches`` yields images or (images, labels); labels are never read. The batch counters are
    left as they were. DapperFL's recovered statistics; FedBN's adaptation to an unseen client
    (FDSE Alg. 2: "collect local statistics")."""
    bns = batchnorms(model)
    if not bns:
        return {}
    saved = [(m.momentum, m.num_batches_tracked.clone(), m.running_mean.clone(), m.running_var.clone())
             for m in bns]
    was_training = model.training
    for m in bns:
        m.reset_running_stats()
        m.momentum = None  # cumulative average
    model.train()
    seen = 0
    for batch in batches:
        model(batch[0] if isinstance(batch, (tuple, list)) else batch)
        seen += 1
    model.train(was_training)
    for m, (mom, count, mean, var) in zip(bns, saved):
        m.momentum = mom
        m.num_batches_tracked.copy_(count)
        if seen == 0:  # no data: keep the statistics as they were
            m.running_mean.copy_(mean)
            m.running_var.copy_(var)
    names = {id(m): n for n, m in model.named_modules()}
    out = {}
    for m in bns:
        prefix = f"{names[id(m)]}." if names[id(m)] else ""
        out[prefix + "running_mean"] = m.running_mean.detach().clone()
        out[prefix + "running_var"] = m.running_var.detach().clone()
    return out
