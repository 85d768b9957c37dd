"""Method name -> class. A method registers itself by being listed here."""
from __future__ import annotations

import importlib
import importlib.util

from raysim.core.errors import UserError

# name -> "module:Class"; imported lazily so a broken optional method never blocks the others.
_METHODS = {
    "fedavg": "raysim.methods.fedavg:FedAvg",
    "fedavgm": "raysim.methods.fedopt:FedAvgM",
    "fedadagrad": "raysim.methods.fedopt:FedAdagrad",
    "fedadam": "raysim.methods.fedopt:FedAdam",
    "fedyogi": "raysim.methods.fedopt:FedYogi",
    "fedprox": "raysim.methods.fedprox:FedProx",
    "fedbn": "raysim.methods.fedbn:FedBN",
    "local": "raysim.methods.local:Local",
    "fdse": "raysim.methods.fdse:FDSE",
    "fedwon": "raysim.methods.fedwon:FedWon",
    "fedavg_gn": "raysim.methods.normbaselines:FedAvgGN",
    "fedavg_ln": "raysim.methods.normbaselines:FedAvgLN",
    "silobn": "raysim.methods.normbaselines:SiloBN",
    "fixbn": "raysim.methods.normbaselines:FixBN",
    "dapperfl": "raysim.methods.dapperfl:DapperFL",
    "gperxan": "raysim.methods.gperxan:GPerXAN",
    "gfedavg": "raysim.methods.gperxan:GFedAvg",
    "csac": "raysim.methods.csac:CSAC",
    "scaffold": "raysim.methods.scaffold:Scaffold",
    "feddyn": "raysim.methods.feddyn:FedDyn",
    "moon": "raysim.methods.moon:MOON",
    "ditto": "raysim.methods.ditto:Ditto",
    "lg_fedavg": "raysim.methods.lg_fedavg:LGFedAvg",
    "partialfed": "raysim.methods.partialfed:PartialFed",
    "fedheal": "raysim.methods.fedheal:FedHEAL",
    "fedfa": "raysim.methods.fedfa:FedFA",
    "fpl": "raysim.methods.fpl:FPL",
    "central": "raysim.methods.central:Central",
    "fedsr": "raysim.methods.fedsr:FedSR",
    "feddg_ga": "raysim.methods.feddg_ga:FedDGGA",
    "elcfs": "raysim.methods.elcfs:ELCFS",
    "ccst": "raysim.methods.ccst:CCST",
    "copa": "raysim.methods.copa:COPA",
    "fedadg": "raysim.methods.fedadg:FedADG",
    "fedavg_mixstyle": "raysim.methods.mixstyle:FedAvgMixStyle",
    "fedavg_rsc": "raysim.methods.rsc:FedAvgRSC",
    "feddrop": "raysim.methods.feddrop:FedDrop",
    "fedmp": "raysim.methods.fedmp:FedMP",
    "nefl": "raysim.methods.nefl:NeFL",
    "powerofchoice": "raysim.methods.powerofchoice:PowerOfChoice",
}


def register(name: str, target: str | type) -> None:
    """Add a method: ``"module:Class"`` (importable wherever the run's actors start), or the class
    itself (this process only: in-process use and tests)."""
    _METHODS[name] = target


def _installed(name: str) -> bool:
    target = _METHODS[name]
    return not isinstance(target, str) or importlib.util.find_spec(target.split(":")[0]) is not None


def names() -> list[str]:
    """Methods available in this build."""
    return sorted(n for n in _METHODS if _installed(n))


def get(name: str):
    if not isinstance(name, str) or name not in _METHODS or not _installed(name):
        raise UserError(f"unknown method {name!r}; available: {', '.join(names())}")
    target = _METHODS[name]
    if not isinstance(target, str):
        return target
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)
