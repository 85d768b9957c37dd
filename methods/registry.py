"""Method name -> class. A method registers itself by being listed here."""
from __future__ import annotations

import importlib

from raysim.errors import UserError

# name -> "module:Class"; imported lazily so a broken optional method never blocks the others.
_METHODS = {
    "fedavg": "raysim.methods.fedavg:FedAvg",
    "fedprox": "raysim.methods.fedprox:FedProx",
    "fedbn": "raysim.methods.fedbn:FedBN",
    "local": "raysim.methods.local:Local",
}


def names() -> list[str]:
    return sorted(_METHODS)


def get(name: str):
    if not isinstance(name, str) or name not in _METHODS:
        raise UserError(f"unknown method {name!r}; available: {', '.join(names())}")
    module, cls = _METHODS[name].split(":")
    return getattr(importlib.import_module(module), cls)
