"""Camelyon17-WILDS v1.0 read straight from ``metadata.csv`` + ``patches/`` (no ``wilds``
package: it pulls in its own torch stack). One domain per hospital (``center`` 0..4), as
DomainBed's WILDSCamelyon and gPerXAN do.

Splits per hospital: the default carves a seeded stratified 80/10/10; ``preset='gperxan'``
carves 80/20 train/val (targets are tested whole, by leave-one-domain-out); ``split='wilds'``
uses the release's ``split`` column (0 = train, 1 = val) with no test split.
"""

from __future__ import annotations

import numpy as np

from raysim.data.folders import build, carve, check_files, require_dir, resolve_options, split_rng
from raysim.data.splits import MultiDomainDataset
from raysim.core.errors import UserError

CLASSES = ["normal", "tumor"]
PRESETS = {
    "default": dict(image_size=96, normalize="imagenet", augment="flip_jitter", split="carve",
                    val_fraction=0.1, test_fraction=0.1),
    "gperxan": dict(image_size=96, normalize="imagenet", augment="flip_jitter", split="carve",
                    val_fraction=0.2, test_fraction=0.0),
}
REQUIRED = ("patient", "node", "x_coord", "y_coord", "tumor", "center")


def load_camelyon17(root, seed: int = 0, preset: str = "default", split: str | None = None,
                    missing: str = "error", image_size: int | None = None, normalize=None, augment=None,
                    val_fraction: float | None = None, test_fraction: float | None = None,
                    cache_images: bool = False) -> MultiDomainDataset:
    """ROOT[/camelyon17_v1.0]/metadata.csv + patches/patient_P_node_N/patch_patient_P_node_N_x_X_y_Y.png."""
    import pandas as pd

    if root is None:
        raise UserError("camelyon17 needs root=DIR holding camelyon17_v1.0/metadata.csv and patches/")
    root = require_dir(root, "camelyon17")
    opts = resolve_options("camelyon17", PRESETS, preset, dict(
        split=split, image_size=image_size, normalize=normalize, augment=augment, val_fraction=val_fraction,
        test_fraction=test_fraction, cache_images=cache_images))
    base = root / "camelyon17_v1.0" if (root / "camelyon17_v1.0").is_dir() else root
    meta = base / "metadata.csv"
    if not meta.is_file():
        raise UserError(f"camelyon17: {meta} does not exist (expected the WILDS v1.0 release)")
    try:
        df = pd.read_csv(meta, index_col=0, dtype={"patient": "str"})
    except Exception as e:
        raise UserError(f"camelyon17: {meta} cannot be read as CSV: {e}") from None
    lacking = [c for c in REQUIRED if c not in df.columns]
    if lacking:
        raise UserError(f"camelyon17: {meta} lacks columns {', '.join(lacking)}")
    patient = df["patient"].astype(str).str.zfill(3)
    node, xs, ys = (df[c].astype(int).astype(str) for c in ("node", "x_coord", "y_coord"))
    folder = "patient_" + patient + "_node_" + node
    paths = (str(base / "patches") + "/" + folder + "/patch_" + folder + "_x_" + xs + "_y_" + ys + ".png").tolist()
    labels = df["tumor"].astype(int).to_numpy()
    if not set(np.unique(labels)) <= {0, 1}:
        raise UserError(f"camelyon17: {meta}: tumor labels must be 0/1")
    center = df["center"].astype(int).to_numpy()
    mode = opts["split"]
    if mode not in ("carve", "wilds"):
        raise UserError(f"camelyon17: split={mode!r}: expected 'carve' or 'wilds'")
    if mode == "wilds" and "split" not in df.columns:
        raise UserError(f"camelyon17: split='wilds' needs a 'split' column in {meta}")
    per_domain = {}
    for h in sorted(np.unique(center)):
        rows = np.flatnonzero(center == h)
        items = check_files([(paths[i], int(labels[i])) for i in rows], missing, str(meta))
        d = f"hospital_{h}"
        if mode == "carve":
            per_domain[d] = carve(items, opts["val_fraction"], opts["test_fraction"], split_rng(seed, "camelyon17", d))
        else:
            keep = {p for p, _ in items}
            sp = df["split"].to_numpy()
            per_domain[d] = {
                "train": [(paths[i], int(labels[i])) for i in rows if sp[i] == 0 and paths[i] in keep],
                "val": [(paths[i], int(labels[i])) for i in rows if sp[i] == 1 and paths[i] in keep],
                "test": [],
            }
    return build("camelyon17", per_domain, CLASSES, opts, {"root": str(base)})
