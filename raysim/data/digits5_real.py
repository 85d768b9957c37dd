"""``digits5_real``: the real Digits-Five from a folder, in its two public layouts.

* FedBN's ``digit_dataset.zip``: ROOT/{MNIST,SVHN,USPS,SynthDigits,MNIST_M}/{train,test}.pkl,
  each a pickled (uint8 images, labels) pair (FedBN's own 80/20 re-split).
* The M3SDA/KD3A ``.mat`` files: mnist_data.mat, mnistm_with_label.mat,
  svhn_{train,test}_32x32.mat, syn_number.mat, usps_28x28.mat.

Domains are named as in the offline ``digits5`` (mnist, mnistm, usps, synth, svhn) so a
config can switch between them. Images are held in memory (``ArraySplit``), resized to
``image_size`` and made 3-channel, like FedBN's transforms. Neither release has a val split:
val is the *last* ``val_fraction`` of each train list, so the leading FedBN partitions
(train_part0 = the first 743 images) stay intact; partition with
``train_size: 743, shuffle: false`` for FedBN's exact per-client data.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from raysim.data.augment import make_augment
from raysim.data.digits5 import resize_rgb
from raysim.data.folders import require_dir, resolve_options
from raysim.data.pickled import load_arrays
from raysim.data.splits import ArraySplit, MultiDomainDataset, resolve_normalization
from raysim.core.errors import UserError

DOMAINS = ("mnist", "mnistm", "usps", "synth", "svhn")
FEDBN_FOLDERS = {"mnist": "MNIST", "mnistm": "MNIST_M", "usps": "USPS", "synth": "SynthDigits", "svhn": "SVHN"}
PRESETS = {
    # FedBN / FedWon: 28x28, 3 channels, Normalize(0.5, 0.5), no augmentation
    "default": dict(image_size=28, normalize="half", augment="none", val_fraction=0.1, domains=DOMAINS),
    # DapperFL: 32x32, ImageNet normalisation, RandomCrop(pad 4) + flip; MNIST, USPS, SVHN, SYN
    "dapperfl": dict(image_size=32, normalize="imagenet", augment="crop_flip", val_fraction=0.1,
                     domains=("mnist", "usps", "svhn", "synth")),
}


def _labels(y, where: str) -> np.ndarray:
    y = np.asarray(y)
    if y.ndim == 2 and y.shape[1] == 10:  # one-hot (mnist_data.mat, mnistm_with_label.mat)
        y = y.argmax(1)
    y = y.reshape(-1).astype(np.int64)
    if y.size and (y.min() < 0 or y.max() > 9):
        raise UserError(f"{where}: labels outside 0..9 (min {y.min()}, max {y.max()})")
    return y


def _images(x, where: str) -> np.ndarray:
    """Any of N,H,W / N,H,W,C / N,C,H,W, uint8 or float in [0,1] -> uint8 N,H,W[,C]."""
    x = np.asarray(x)
    if x.ndim == 4 and x.shape[1] in (1, 3) and x.shape[-1] not in (1, 3):
        x = x.transpose(0, 2, 3, 1)
    if x.ndim == 4 and x.shape[-1] == 1:
        x = x[..., 0]
    if x.ndim not in (3, 4):
        raise UserError(f"{where}: expected images shaped N,H,W[,C], got {x.shape}")
    if x.dtype != np.uint8:
        x = x.astype(np.float64)
        x = np.clip(np.round(x * 255 if x.max() <= 1.0 else x), 0, 255).astype(np.uint8)
    return x


def _load_pkl(path: Path):
    if not path.is_file():
        raise UserError(f"digits5_real: {path} does not exist (FedBN layout: <DOMAIN>/train.pkl, test.pkl)")
    try:
        x, y = load_arrays(path)  # numpy arrays only: a pickle naming anything else is refused
    except Exception as e:
        raise UserError(f"digits5_real: {path} is not a pickled (images, labels) pair: {e}") from None
    return _images(x, str(path)), _labels(y, str(path))


def _mat(path: Path) -> dict:
    from scipy.io import loadmat

    if not path.is_file():
        raise UserError(f"digits5_real: {path} does not exist (.mat layout)")
    try:
        return loadmat(path)
    except Exception as e:
        raise UserError(f"digits5_real: {path} cannot be read as a .mat file: {e}") from None


def _key(m: dict, path: Path, *names):
    for n in names:
        if n in m:
            return m[n]
    raise UserError(f"digits5_real: {path} has none of the keys {', '.join(names)}")


def _load_mat_domain(root: Path, d: str, size: int):
    """{'train': (x, y), 'test': (x, y)} from the M3SDA-style .mat files."""
    if d == "mnist":
        p = root / "mnist_data.mat"
        m = _mat(p)
        k = "32" if size == 32 and "train_32" in m else "28"
        return {s: (_images(_key(m, p, f"{s}_{k}"), str(p)), _labels(_key(m, p, f"label_{s}"), str(p)))
                for s in ("train", "test")}
    if d == "mnistm":
        p = root / "mnistm_with_label.mat"
        m = _mat(p)
        return {s: (_images(_key(m, p, s), str(p)), _labels(_key(m, p, f"label_{s}"), str(p)))
                for s in ("train", "test")}
    if d == "svhn":
        out = {}
        for s in ("train", "test"):
            p = root / f"svhn_{s}_32x32.mat"
            m = _mat(p)
            x = np.asarray(_key(m, p, "X")).transpose(3, 0, 1, 2)  # (32,32,3,N) -> N,32,32,3
            y = np.asarray(_key(m, p, "y")).reshape(-1).astype(np.int64)
            out[s] = (_images(x, str(p)), _labels(np.where(y == 10, 0, y), str(p)))  # 10 means digit 0
        return out
    if d == "synth":
        p = root / "syn_number.mat"
        m = _mat(p)
        return {s: (_images(_key(m, p, f"{s}_data"), str(p)), _labels(_key(m, p, f"{s}_label"), str(p)))
                for s in ("train", "test")}
    if d == "usps":
        p = root / "usps_28x28.mat"
        m = _mat(p)
        cell = _key(m, p, "dataset")
        try:
            return {s: (_images(cell[i][0], str(p)), _labels(cell[i][1], str(p)))
                    for i, s in enumerate(("train", "test"))}
        except (IndexError, TypeError):
            raise UserError(f"digits5_real: {p}: 'dataset' is not the 2x2 cell of (images, labels)") from None
    raise AssertionError(d)


def load_digits5_real(root, seed: int = 0, preset: str = "default", layout: str = "auto",
                      domains: Sequence[str] | None = None, image_size: int | None = None, normalize=None,
                      augment=None, val_fraction: float | None = None) -> MultiDomainDataset:
    """The real Digits-Five from ROOT (``layout``: 'fedbn', 'mat' or 'auto')."""
    if root is None:
        raise UserError("digits5_real needs root=DIR (FedBN's digit_dataset folder or the .mat files)")
    root = require_dir(root, "digits5_real")
    opts = resolve_options("digits5_real", PRESETS, preset, dict(
        image_size=image_size, normalize=normalize, augment=augment, val_fraction=val_fraction, domains=domains))
    if layout == "auto":
        base = root / "data" if (root / "data" / "MNIST").is_dir() else root
        layout = "fedbn" if (base / "MNIST").is_dir() or (base / "SVHN").is_dir() else "mat"
    else:
        base = root
    if layout not in ("fedbn", "mat"):
        raise UserError(f"digits5_real: layout={layout!r}: expected 'fedbn', 'mat' or 'auto'")
    for d in opts["domains"]:
        if d not in DOMAINS:
            raise UserError(f"digits5_real: unknown domain {d!r}; valid: {', '.join(DOMAINS)}")
    size = int(opts["image_size"])
    vf = float(opts["val_fraction"])
    if not 0 <= vf < 1:
        raise UserError(f"digits5_real: val_fraction={vf}: expected 0 <= f < 1")
    mean, std = resolve_normalization(opts["normalize"])
    aug = make_augment(opts["augment"])
    splits = {}
    for d in opts["domains"]:
        if layout == "fedbn":
            raw = {s: _load_pkl(base / FEDBN_FOLDERS[d] / f"{s}.pkl") for s in ("train", "test")}
        else:
            raw = _load_mat_domain(base, d, size)
        xtr, ytr = raw["train"]
        if len(xtr) != len(ytr) or len(raw["test"][0]) != len(raw["test"][1]):
            raise UserError(f"digits5_real: {d}: image and label counts differ")
        cut = len(ytr) - int(round(len(ytr) * vf))
        parts = {"train": (xtr[:cut], ytr[:cut]), "val": (xtr[cut:], ytr[cut:]), "test": raw["test"]}
        splits[d] = {s: ArraySplit(_resize_chunked(x, size), y, mean, std, aug) for s, (x, y) in parts.items()}
    info = {"root": str(root), "layout": layout, "preset": preset, "normalize": opts["normalize"],
            "augment": opts["augment"], "image_size": size,
            "splits": f"release train (last {vf:.0%} as val) / release test"}
    return MultiDomainDataset("digits5_real", splits, [str(c) for c in range(10)], info)


def _resize_chunked(x: np.ndarray, size: int, chunk: int = 20000) -> np.ndarray:
    if len(x) == 0:
        return np.zeros((0, 3, size, size), np.uint8)
    return np.concatenate([resize_rgb(x[i:i + chunk], size) for i in range(0, len(x), chunk)])
