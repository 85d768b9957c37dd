"""Dropout drawn from the running client's keyed generator, never from the process-wide one.

``nn.Dropout`` draws its masks from torch's global generator, so a run's numbers would depend on
which clients shared a host and in which order they trained. Every model of the zoo uses
:class:`KeyedDropout` instead (:func:`keyed_dropout` swaps any ``nn.Dropout`` a builder made), and
the engine installs, for the duration of each client step or label-free adaptation, a generator
keyed by (seed, round, client, purpose) on the host's device (:func:`dropout_generator`). A
train-mode pass with dropout outside any such step fails loudly rather than draw from the global
generator. Evaluation (eval mode) draws nothing.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

_generators: list[torch.Generator] = []  # innermost last
_masks: list[list[torch.Tensor] | None] = []  # client cohorts: the masks of the pass under way, in call order


@contextlib.contextmanager
def cohort_masks(masks: list[torch.Tensor] | None):
    """Inside, each train-mode :class:`KeyedDropout` takes the next of ``masks`` instead of drawing
    one: client cohorts (:mod:`raysim.engine.cohort`) draw every client's masks from its own
    generator outside ``vmap`` and pass them in. None: no masks (a model without dropout)."""
    _masks.append(None if masks is None else list(masks))
    try:
        yield
    finally:
        _masks.pop()


@contextlib.contextmanager
def dropout_generator(generator: torch.Generator):
    """Dropout masks inside come from ``generator`` (on the device the activations are on)."""
    _generators.append(generator)
    try:
        yield generator
    finally:
        _generators.pop()


class KeyedDropout(nn.Dropout):
    """``nn.Dropout`` (zero with probability p, scale the rest by 1 / (1 - p)) with its masks drawn
    from the generator :func:`dropout_generator` installed."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if _masks and _masks[-1] is not None:
            if self.p == 1.0:
                return torch.zeros_like(x)
            keep = _masks[-1].pop(0)
            out = x * keep / (1.0 - self.p)
            return x.copy_(out) if self.inplace else out
        if not _generators:
            raise RuntimeError("a train-mode pass through dropout outside a client step: raysim draws dropout "
                               "masks only from a client's keyed generator (raysim.models.dropout)")
        if self.p == 1.0:
            return torch.zeros_like(x)
        generator = _generators[-1]
        keep = torch.empty(x.shape, dtype=x.dtype, device=generator.device).bernoulli_(1.0 - self.p,
                                                                                      generator=generator)
        out = x * keep.to(x.device) / (1.0 - self.p)
        if self.inplace:
            return x.copy_(out)
        return out


def keyed_dropout(model: nn.Module) -> nn.Module:
    """``model`` with every ``nn.Dropout`` replaced by a :class:`KeyedDropout` of the same p (in place)."""
    for parent in model.modules():
        for name, child in list(parent.named_children()):
            if type(child) is nn.Dropout:
                setattr(parent, name, KeyedDropout(child.p, child.inplace))
    return model
