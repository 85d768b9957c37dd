"""The local loop every method starts from, evaluation, and BN statistics collection.

A method with its own client step writes its loop with the context's primitives
(``ctx.optimizer()``, ``ctx.batches()``, ``ctx.step(loss, opt)``, ``ctx.stats()``);
:func:`train_epochs` is that loop on the plain cross-entropy, :func:`train_local_loss` the loop a
method's per-batch loss (``Method.local_loss``) stands for.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def train_epochs(ctx, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """E epochs of SGD on the cross-entropy (``train.epochs``, at most ``train.max_steps`` steps)."""
    opt = optimizer or ctx.optimizer()
    for x, y in ctx.batches():
        ctx.step(F.cross_entropy(ctx.model(x), y), opt)
    return ctx.stats()


def train_local_loss(method, ctx, spec):
    """The client step ``spec`` (a :class:`~raysim.core.contract.LocalLoss`) stands for, one client
    alone: ``spec.loss`` on each of ``ctx.batches()`` under the model's own forward, one
    ``ctx.step`` each, then ``spec.finish(ctx)`` (default: ``method.upload(ctx, ctx.stats())``).
    ``Method.local_update`` runs it, so a method that writes its step as a loss for client cohorts
    writes it once, and the cohort and the lone client train the same step."""
    model = ctx.model
    params = dict(model.named_parameters())  # the same tensors every step: the loss reads them as they train
    opt = ctx.optimizer(lr=spec.lr)
    for batch in ctx.batches():
        ctx.step(spec.loss(model, params, batch, spec.tensors), opt)
    return spec.finish(ctx) if spec.finish is not None else method.upload(ctx, ctx.stats())


@torch.no_grad()
def evaluate(model, split, batch_size: int, device) -> dict:
    """Sum of correct predictions and of the loss over a split (summed, so pools combine exactly).

    Both sums stay on the device (the loss in float64, as a Python float would add it; the count in
    int64) and are read once at the end, so no batch waits for the device."""
    model.eval()
    correct = torch.zeros((), dtype=torch.int64, device=device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    n = 0
    for x, y in split.eval_batches(batch_size, device):
        logits = model(x)
        loss_sum += F.cross_entropy(logits, y, reduction="sum").to(torch.float64)
        correct += (logits.argmax(1) == y).sum()
        n += len(y)
    return {"correct": int(correct), "loss_sum": float(loss_sum), "n": n}


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
