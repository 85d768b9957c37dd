"""Splits (the unit a client trains on) and the multi-domain dataset that holds them.

A ``Split`` is an indexable set of (image, label) pairs. Training code only calls
``labels`` (partitioners need them up front) and ``tensors(idx, train, generator)``,
so in-memory and on-disk datasets look the same to the engine:

* ``ArraySplit`` keeps uint8 images once and, lazily, a normalised float copy, so
  ``tensors()`` on the training hot path is one ``index_select``.
* ``FileSplit`` keeps (path, label) pairs and decodes/resizes on demand, for real
  datasets far larger than memory.
* ``ConcatSplit`` chains splits without copying (used for a domain's ``"all"`` split).

Augmentation draws randomness only from the ``torch.Generator`` it is given, so a
client step keyed by (seed, round, client) is reproducible.
"""

from __future__ import annotations

import os
from typing import Callable, Sequence

import numpy as np
import torch

from raysim.core.errors import UserError

SPLITS = ("train", "val", "test")
#: the extra split name every dataset answers: the whole domain, without duplicates
ALL = "all"

NORMALIZATIONS = {
    # FedBN's Normalize((0.5,)*3, (0.5,)*3): maps [0, 1] to [-1, 1]
    "half": ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
    "imagenet": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
    # ToTensor only (FDSE, FedBN Office/DomainNet): values stay in [0, 1]
    "none": ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0)),
}

# Above this many bytes a split normalises per batch instead of caching floats (4x uint8).
FLOAT_CACHE_LIMIT = int(os.environ.get("RAYSIM_FLOAT_CACHE_MB", "1024")) * 2**20


def resolve_normalization(spec, channels: int = 3) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """'half' | 'imagenet' | 'none' | (mean, std) -> per-channel (mean, std) tuples."""
    if isinstance(spec, str):
        if spec not in NORMALIZATIONS:
            raise UserError(
                f"normalize={spec!r} is not known; expected one of {sorted(NORMALIZATIONS)} "
                "or a (mean, std) pair"
            )
        mean, std = NORMALIZATIONS[spec]
    else:
        try:
            mean, std = spec
            mean = tuple(float(m) for m in np.broadcast_to(np.asarray(mean, float), (channels,)))
            std = tuple(float(s) for s in np.broadcast_to(np.asarray(std, float), (channels,)))
        except (TypeError, ValueError) as e:
            raise UserError(f"normalize={spec!r}: expected a name or a (mean, std) pair ({e})") from None
        if min(std) <= 0:
            raise UserError(f"normalize={spec!r}: std must be positive")
    return tuple(mean[:channels]), tuple(std[:channels])


def as_index(idx, n: int) -> np.ndarray:
    """Positions as an int64 array, bounds-checked (negative positions are rejected)."""
    a = np.asarray(idx)
    if a.dtype == bool:
        raise IndexError("boolean masks are not positions; use np.flatnonzero(mask)")
    a = a.astype(np.int64, copy=False).reshape(-1)
    if a.size and (a.min() < 0 or a.max() >= n):
        raise IndexError(f"index out of range for a split of {n} items (got {a.min()}..{a.max()})")
    return a


class Split:
    """Base class: ``len``, ``labels`` and ``tensors``; subclasses add storage.

    ``groups``: None, or one int64 id per sample naming who produced it (a writer, a user, a
    speaker), the same id in a domain's train, val and test; the natural partition makes one
    client per group.
    """

    labels: np.ndarray
    groups: np.ndarray | None = None
    image_shape: tuple[int, int, int]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    augment: Callable | None

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def images(self, idx) -> np.ndarray:
        """uint8 (N, H, W, C) images after resizing, before augmentation/normalisation."""
        raise NotImplementedError

    def tensors(self, idx, train: bool = False, generator: torch.Generator | None = None):
        """(float32 N,C,H,W normalised, int64 N) for the given positions.

        ``train=True`` applies the dataset's train-time augmentation (if any), drawing
        randomness only from ``generator`` (torch's global generator if None).
        """
        raise NotImplementedError

    # shared tail of tensors(): augmentation in [0, 1] space, then normalisation
    def _finish(self, x01: torch.Tensor, train: bool, generator) -> torch.Tensor:
        if train and self.augment is not None and x01.shape[0]:
            x01 = self.augment(x01, generator)
        mean = torch.tensor(self.mean, dtype=torch.float32).view(1, -1, 1, 1)
        std = torch.tensor(self.std, dtype=torch.float32).view(1, -1, 1, 1)
        return x01.sub_(mean).div_(std) if x01.is_contiguous() else (x01 - mean) / std

    def __repr__(self) -> str:
        return f"{type(self).__name__}(n={len(self)}, image_shape={self.image_shape})"


def read_only(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    a.setflags(write=False)
    return a


def as_groups(groups, n: int) -> np.ndarray | None:
    """Per-sample group ids as a read-only int64 array of length ``n`` (None stays None)."""
    if groups is None:
        return None
    g = np.asarray(groups).reshape(-1)
    if g.shape[0] != n:
        raise ValueError(f"{n} samples but {g.shape[0]} group ids")
    if g.size and not np.issubdtype(g.dtype, np.integer):
        raise ValueError(f"group ids must be integers, got {g.dtype} (map names to ids first)")
    return read_only(g.astype(np.int64, copy=False))


class ArraySplit(Split):
    """uint8 images (N, C, H, W) held once; normalised floats cached on first use."""

    def __init__(self, images: np.ndarray, labels, mean, std, augment=None, cache: str = "auto", groups=None):
        images = np.asarray(images)
        if images.dtype != np.uint8 or images.ndim != 4:
            raise ValueError(f"ArraySplit wants uint8 (N,C,H,W), got {images.dtype} {images.shape}")
        labels = np.asarray(labels, dtype=np.int64).reshape(-1)
        if labels.shape[0] != images.shape[0]:
            raise ValueError(f"{images.shape[0]} images but {labels.shape[0]} labels")
        self._u8 = read_only(images)
        self.labels = read_only(labels)
        self.groups = as_groups(groups, labels.shape[0])
        self.image_shape = tuple(int(s) for s in images.shape[1:])
        self.mean, self.std = tuple(mean), tuple(std)
        self.augment = augment
        if cache not in ("auto", "float", "none"):
            raise ValueError(f"cache={cache!r}")
        self._cache_mode = cache
        self._float: torch.Tensor | None = None

    @property
    def uint8(self) -> np.ndarray:
        """The stored (N, C, H, W) uint8 array (read-only)."""
        return self._u8

    def _use_cache(self) -> bool:
        if self._cache_mode == "auto":
            return self._u8.size * 4 <= FLOAT_CACHE_LIMIT
        return self._cache_mode == "float"

    def _normalised_all(self) -> torch.Tensor:
        if self._float is None:
            x = torch.from_numpy(np.array(self._u8)).float().div_(255.0)
            self._float = self._finish(x, False, None)
        return self._float

    def images(self, idx) -> np.ndarray:
        i = as_index(idx, len(self))
        return np.ascontiguousarray(self._u8[i].transpose(0, 2, 3, 1))

    def tensors(self, idx, train: bool = False, generator: torch.Generator | None = None):
        i = as_index(idx, len(self))
        y = torch.from_numpy(self.labels[i].copy())
        augmenting = train and self.augment is not None
        if self._use_cache() and not augmenting:
            return self._normalised_all().index_select(0, torch.from_numpy(i)), y
        x01 = torch.from_numpy(self._u8[i]).float().div_(255.0)
        return self._finish(x01, train, generator), y

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_float"] = None  # never ship the float cache
        return state


class DecodedSplit(Split):
    """A split whose ``images`` decodes (N, H, W, 3) uint8 on demand (files, Parquet rows):
    ``tensors`` is those images in [0, 1], augmented and normalised."""

    def _set_decoding(self, labels: np.ndarray, groups, image_size: int, mean, std, augment,
                      cache_images: bool) -> None:
        self.labels = read_only(labels)
        self.groups = as_groups(groups, labels.shape[0])
        self.image_size = int(image_size)
        self.image_shape = (3, self.image_size, self.image_size)
        self.mean, self.std = tuple(mean), tuple(std)
        self.augment = augment
        self.cache_images = cache_images
        self._decoded: dict[int, np.ndarray] = {}

    def tensors(self, idx, train: bool = False, generator: torch.Generator | None = None):
        i = as_index(idx, len(self))
        x = torch.from_numpy(self.images(i)).permute(0, 3, 1, 2).float().div_(255.0).contiguous()
        return self._finish(x, train, generator), torch.from_numpy(self.labels[i].copy())


class FileSplit(DecodedSplit):
    """(path, label) pairs decoded with PIL, resized to ``image_size`` on demand.

    ``cache_images=True`` keeps each decoded, resized uint8 image after first use: worth
    it when a host re-reads the same client data every round and memory allows.
    """

    def __init__(self, paths: Sequence[str], labels, image_size: int, mean, std, augment=None,
                 cache_images: bool = False, groups=None):
        self.paths = list(map(str, paths))
        labels = np.asarray(labels, dtype=np.int64).reshape(-1)
        if labels.shape[0] != len(self.paths):
            raise ValueError(f"{len(self.paths)} paths but {labels.shape[0]} labels")
        self._set_decoding(labels, groups, image_size, mean, std, augment, cache_images)

    def _decode(self, i: int) -> np.ndarray:
        if self.cache_images and i in self._decoded:
            return self._decoded[i]
        from PIL import Image, UnidentifiedImageError

        path = self.paths[i]
        try:
            with Image.open(path) as im:
                im = im.convert("RGB")
                if im.size != (self.image_size, self.image_size):
                    im = im.resize((self.image_size, self.image_size), Image.BILINEAR)
                a = np.asarray(im, dtype=np.uint8)
        except FileNotFoundError:
            raise UserError(f"image file {path} is missing (listed by the dataset)") from None
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
            # an image larger than Pillow's limit (Image.MAX_IMAGE_PIXELS) is the dataset's too
            raise UserError(f"image file {path} cannot be decoded: {e}") from None
        if self.cache_images:
            self._decoded[i] = a
        return a

    def images(self, idx) -> np.ndarray:
        i = as_index(idx, len(self))
        out = np.empty((i.size, self.image_size, self.image_size, 3), np.uint8)
        for k, j in enumerate(i):
            out[k] = self._decode(int(j))
        return out

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_decoded"] = {}
        return state


class ConcatSplit(Split):
    """Several splits seen as one, without copying (positions run part after part)."""

    def __init__(self, parts: Sequence[Split]):
        parts = [p for p in parts]
        if not parts:
            raise ValueError("ConcatSplit needs at least one part")
        self.parts = parts
        self.labels = read_only(np.concatenate([p.labels for p in parts]))
        if all(p.groups is not None for p in parts):
            self.groups = read_only(np.concatenate([p.groups for p in parts]))
        self.offsets = np.cumsum([0] + [len(p) for p in parts])
        self.image_shape = parts[0].image_shape
        self.mean, self.std, self.augment = parts[0].mean, parts[0].std, parts[0].augment

    def _route(self, idx):
        i = as_index(idx, len(self))
        which = np.searchsorted(self.offsets, i, side="right") - 1
        return i, which

    def images(self, idx) -> np.ndarray:
        i, which = self._route(idx)
        out = np.empty((i.size,) + tuple(np.roll(self.image_shape, -1)), np.uint8)
        for k, p in enumerate(self.parts):
            sel = np.flatnonzero(which == k)
            if sel.size:
                out[sel] = p.images(i[sel] - self.offsets[k])
        return out

    def tensors(self, idx, train: bool = False, generator: torch.Generator | None = None):
        i, which = self._route(idx)
        x = torch.empty((i.size,) + tuple(self.image_shape), dtype=torch.float32)
        for k, p in enumerate(self.parts):
            sel = np.flatnonzero(which == k)
            if sel.size:
                x[torch.from_numpy(sel)] = p.tensors(i[sel] - self.offsets[k], train, generator)[0]
        return x, torch.from_numpy(self.labels[i].copy())


class MultiDomainDataset:
    """Named domains, each with ``train``/``val``/``test`` splits (and ``all``).

    ``info`` records how the data was made (preset, normalisation, augmentation, split
    protocol) so runs can log it. ``group_names`` (data with groups): the name of each group
    id the splits' ``groups`` hold, ids being unique across the dataset.
    """

    group_names: tuple[str, ...] | None = None

    def __init__(self, name: str, splits: dict[str, dict[str, Split]], classes: Sequence[str],
                 info: dict | None = None, group_names: Sequence[str] | None = None):
        self.name = name
        self.domains = tuple(splits)
        if not self.domains:
            raise UserError(f"dataset {name!r} has no domains")
        for d, s in splits.items():
            missing = [k for k in SPLITS if k not in s]
            if missing:
                raise ValueError(f"domain {d!r} lacks splits {missing}")
        self._splits = {d: dict(s) for d, s in splits.items()}
        self.classes = tuple(map(str, classes))
        self.num_classes = len(self.classes)
        first = next(iter(splits.values()))["train"]
        self.image_shape = tuple(first.image_shape)
        self.info = dict(info or {})
        if group_names is not None:
            self.group_names = tuple(map(str, group_names))

    def split(self, domain: str, split: str) -> Split:
        if domain not in self._splits:
            raise UserError(
                f"dataset {self.name!r} has no domain {domain!r}; valid: {', '.join(self.domains)}"
            )
        if split == ALL and ALL not in self._splits[domain]:
            parts = [self._splits[domain][s] for s in SPLITS]
            self._splits[domain][ALL] = ConcatSplit(parts)
        if split not in self._splits[domain]:
            raise UserError(f"split {split!r} is not one of {', '.join(SPLITS + (ALL,))}")
        return self._splits[domain][split]

    def sizes(self) -> dict[str, dict[str, int]]:
        return {d: {s: len(self._splits[d][s]) for s in SPLITS} for d in self.domains}

    def __repr__(self) -> str:
        sz = ", ".join(f"{d}={sum(v.values())}" for d, v in self.sizes().items())
        return (f"MultiDomainDataset({self.name!r}, classes={self.num_classes}, "
                f"image_shape={self.image_shape}, {sz})")


def stratified_carve(labels: np.ndarray, val_fraction: float, test_fraction: float,
                     rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Seeded per-class split of positions into train/val/test (each sorted).

    Used wherever a release has no official split: the fractions are rounded per
    class, so every class keeps its share in every split.
    """
    labels = np.asarray(labels)
    return _carve((np.flatnonzero(labels == c) for c in np.unique(labels)), val_fraction, test_fraction, rng)


def _carve(buckets, val_fraction: float, test_fraction: float,
           rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each bucket's positions (ascending), shuffled in turn by ``rng`` and cut into its rounded
    test and val shares, at least one position left to train; the three unions, sorted."""
    if not (0 <= val_fraction and 0 <= test_fraction and val_fraction + test_fraction < 1):
        raise UserError(
            f"val_fraction={val_fraction}, test_fraction={test_fraction}: need both >= 0 and a sum < 1"
        )
    tr, va, te = [], [], []
    for pos in buckets:
        pos = pos[rng.permutation(pos.size)]
        n_te = int(round(pos.size * test_fraction))
        n_va = int(round(pos.size * val_fraction))
        if n_te + n_va >= pos.size:  # keep at least one training example per bucket
            n_te, n_va = min(n_te, max(pos.size - 1, 0)), max(min(n_va, pos.size - 1 - n_te), 0)
        te.append(pos[:n_te])
        va.append(pos[n_te:n_te + n_va])
        tr.append(pos[n_te + n_va:])
    cat = lambda xs: np.sort(np.concatenate(xs)).astype(np.int64) if xs else np.zeros(0, np.int64)
    return cat(tr), cat(va), cat(te)


def group_carve(groups: np.ndarray, val_fraction: float, test_fraction: float,
                rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Seeded split of positions into train/val/test within each group (``split_by: group``).

    Every group keeps its share in every split, so a client made of one group (the natural
    partition) evaluates on its own held-out samples; a group keeps at least one training
    sample. Groups are visited in ascending id order, each with its own slice of ``rng``'s stream.
    """
    groups = np.asarray(groups).reshape(-1)
    order = np.argsort(groups, kind="stable")  # within a group, positions stay ascending
    ids, starts = np.unique(groups[order], return_index=True)
    bounds = np.append(starts, groups.size)
    return _carve((order[bounds[k]:bounds[k + 1]] for k in range(ids.size)), val_fraction, test_fraction, rng)
