"""Name -> builder registry, and :func:`build`, the one entry point the engine uses."""
from __future__ import annotations

import inspect
import os
from typing import Any, Callable

from torch import nn

from raysim.core.errors import UserError
from raysim.models.dropout import keyed_dropout
from raysim.models.norm import check_norm

_BUILDERS: dict[str, Callable[..., nn.Module]] = {}


def register(name: str):
    """Register a keyword-only builder ``fn(*, num_classes, in_channels, input_size, norm, conv, ...)``.

    The builder's own defaults are the published configuration of that model (e.g.
    mnist_cnn: 1x28x28, no norm), which :func:`build` uses for any argument left unset.
    """
    def deco(fn):
        if name in _BUILDERS:
            raise ValueError(f"model {name!r} registered twice")
        _BUILDERS[name] = fn
        return fn
    return deco


def available() -> list[str]:
    return sorted(_BUILDERS)


def builder(name: str) -> Callable[..., nn.Module]:
    try:
        return _BUILDERS[name]
    except KeyError:
        raise UserError(f"unknown model {name!r}; valid models: {', '.join(available())}") from None


def options(name: str) -> dict[str, Any]:
    """The keyword arguments ``name`` accepts, with their defaults."""
    sig = inspect.signature(builder(name))
    return {p.name: p.default for p in sig.parameters.values()}


def build(name: str, num_classes: int = 10, in_channels: int | None = None,
          input_size: int | None = None, norm: Any = "default",
          pretrained: str | None = None, **kw) -> nn.Module:
    """Build zoo model ``name``.

    ``in_channels``/``input_size`` None and ``norm`` "default" (or None) mean the model's
    published configuration: norm "bn" everywhere except ``mnist_cnn`` ("none"); see
    :func:`options`. ``pretrained`` is a local state_dict file (torchvision or raysim key
    layout); ``conv`` and model-specific options pass through ``kw``.
    """
    fn = builder(name)
    accepted = options(name)
    args: dict[str, Any] = {"num_classes": int(num_classes), **kw}
    if in_channels is not None:
        args["in_channels"] = int(in_channels)
    if input_size is not None:
        args["input_size"] = int(input_size)
    if norm is not None and not (isinstance(norm, str) and norm.lower() == "default"):
        args["norm"] = check_norm(norm)
    if pretrained is not None:
        from raysim.models.pretrained import check_file
        pretrained = os.fspath(pretrained)
        check_file(pretrained)  # before building a 25M-parameter network
        if "pretrained" in accepted:
            args["pretrained"] = pretrained
    unknown = sorted(set(args) - set(accepted))
    if unknown:
        raise UserError(f"model {name!r} does not accept option(s) {', '.join(unknown)}; "
                        f"valid options: {', '.join(sorted(accepted))}")
    model = fn(**args)
    if pretrained is not None and "pretrained" not in accepted:
        from raysim.models.pretrained import load_pretrained
        load_pretrained(model, pretrained)
    return keyed_dropout(model)  # dropout masks from the client's keyed generator (raysim.models.dropout)
