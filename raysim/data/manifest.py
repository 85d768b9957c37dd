"""A CSV manifest of images: the dataset as the user already has it listed (``data.root: FILE.csv``).

Header row, then one row per image with the columns ``path,label[,group][,domain]`` (any
order; other columns are ignored). ``path`` is relative to the manifest's folder, or
absolute; ``label`` is a class name; ``group`` names who produced the sample (a writer, a
user, a speaker); ``domain`` names its domain (without the column: one domain named after the
manifest's file stem). Names become ids in sorted order (numeric order when every name is an
integer; domains are ordered the same way), groups once across the whole dataset, so
``ds.group_names[id]`` is the group's name.

No split column: a seeded carve per domain, by class (``split_by='class'``, the default) or
within each group (``split_by='group'``: a group's val/test samples are its own).
"""

from __future__ import annotations

import csv
import os
from pathlib import Path

import numpy as np

from raysim.data.folders import (GENERIC_PRESETS, FileChecker, carve_positions, check_split_by, name_ids,
                                 preprocessing, resolve_options, split_rng)
from raysim.data.splits import SPLITS, FileSplit, MultiDomainDataset
from raysim.core.errors import UserError

COLUMNS = ("path", "label", "group", "domain")
REQUIRED = ("path", "label")


class ManifestSplit(FileSplit):
    """A FileSplit that names the manifest and line of an image it cannot read."""

    def __init__(self, paths, labels, image_size, mean, std, augment=None, cache_images=False, groups=None,
                 manifest: str = "", lines=None):
        super().__init__(paths, labels, image_size, mean, std, augment, cache_images=cache_images, groups=groups)
        self.manifest = manifest
        self.lines = np.asarray(lines, dtype=np.int64)

    def _decode(self, i: int) -> np.ndarray:
        try:
            return super()._decode(i)
        except UserError as e:
            raise UserError(f"{self.manifest} line {self.lines[i]}: {e}") from None


def read_manifest(path: Path, missing: str) -> dict[str, list]:
    """{column: values} for the manifest's rows (paths made absolute, files checked to exist),
    plus ``line``: each row's line number in the file."""
    if missing not in ("error", "skip"):
        raise UserError(f"manifest: missing={missing!r}: expected 'error' or 'skip'")
    try:
        f = open(path, newline="", encoding="utf-8-sig")
    except OSError as e:
        raise UserError(f"manifest {path} cannot be read: {e}") from None
    base = path.parent
    chk = FileChecker()
    with f:
        reader = csv.reader(f)
        try:
            header = next(reader, None)
        except csv.Error as e:
            raise UserError(f"manifest {path} line 1 is not CSV: {e}") from None
        if not header:
            raise UserError(f"manifest {path} is empty; expected a header row path,label[,group][,domain]")
        names = [h.strip().lower() for h in header]
        lacking = [c for c in REQUIRED if c not in names]
        if lacking:
            raise UserError(f"manifest {path}: the header row lacks column(s) {', '.join(lacking)}; expected "
                            f"path,label[,group][,domain], found {','.join(header)}")
        where = {c: names.index(c) for c in COLUMNS if c in names}
        out: dict[str, list] = {c: [] for c in where}
        out["line"] = []
        try:
            for row in reader:
                line = reader.line_num
                if not row or all(not v.strip() for v in row):
                    continue
                if len(row) != len(header):
                    raise UserError(f"manifest {path} line {line}: {len(row)} fields, the header has {len(header)}")
                values = {c: row[k].strip() for c, k in where.items()}
                empty = [c for c, v in values.items() if not v]
                if empty:
                    raise UserError(f"manifest {path} line {line}: no value for {', '.join(empty)}")
                image = os.path.join(base, values["path"])  # an absolute path stays as it is
                if not chk.exists(image):
                    if missing == "skip":
                        continue
                    raise UserError(f"manifest {path} line {line}: image file {image} does not exist "
                                    "(pass missing='skip' to use only the images present)")
                values["path"] = image
                for c, v in values.items():
                    out[c].append(v)
                out["line"].append(line)
        except csv.Error as e:
            raise UserError(f"manifest {path} line {reader.line_num} is not CSV: {e}") from None
    if not out["line"]:
        raise UserError(f"manifest {path} lists no images")
    return out


def load_manifest(root, seed: int = 0, preset: str = "default", image_size: int | None = None, normalize=None,
                  augment=None, val_fraction: float | None = None, test_fraction: float | None = None,
                  split_by: str = "class", missing: str = "error",
                  cache_images: bool = False) -> MultiDomainDataset:
    """``root``: the manifest CSV (or a folder holding ``manifest.csv``); see the module docstring."""
    if root is None:
        raise UserError("manifest needs root=FILE.csv with a header row path,label[,group][,domain]")
    path = Path(root).expanduser().absolute()
    if path.is_dir():
        path = path / "manifest.csv"
    if not path.is_file():
        raise UserError(f"manifest: {path} does not exist (expected a CSV file path,label[,group][,domain])")
    opts = resolve_options("manifest", GENERIC_PRESETS, preset, dict(
        image_size=image_size, normalize=normalize, augment=augment, val_fraction=val_fraction,
        test_fraction=test_fraction, cache_images=cache_images))
    size, mean, std, aug = preprocessing("manifest", opts)
    rows = read_manifest(path, missing)
    has_groups = "group" in rows
    check_split_by("manifest", split_by, has_groups, f"{path} has no group column")
    class_ids = name_ids(rows["label"])
    labels = np.array([class_ids[v] for v in rows["label"]], dtype=np.int64)
    group_ids = name_ids(rows["group"]) if has_groups else None
    groups = np.array([group_ids[v] for v in rows["group"]], dtype=np.int64) if has_groups else None
    domain_of = np.array(rows["domain"] if "domain" in rows else [path.stem] * labels.size, dtype=object)
    paths = np.array(rows["path"], dtype=object)
    lines = np.array(rows["line"], dtype=np.int64)
    splits = {}
    for d in name_ids(domain_of):  # sorted (numerically where every name is an integer)
        mine = np.flatnonzero(domain_of == d)
        parts = carve_positions(labels[mine], None if groups is None else groups[mine], split_by,
                                opts["val_fraction"], opts["test_fraction"], split_rng(seed, "manifest", d))
        splits[d] = {}
        for s, pos in zip(SPLITS, parts):
            rows_of = mine[pos]
            splits[d][s] = ManifestSplit(paths[rows_of].tolist(), labels[rows_of], size, mean, std, aug,
                                         cache_images=bool(opts["cache_images"]),
                                         groups=None if groups is None else groups[rows_of],
                                         manifest=str(path), lines=lines[rows_of])
    keep = ("preset", "image_size", "normalize", "augment", "val_fraction", "test_fraction")
    info = {**{k: opts[k] for k in keep}, "split": "carve", "split_by": split_by, "root": str(path)}
    if has_groups:
        info["groups"] = len(group_ids)
    return MultiDomainDataset("manifest", splits, list(class_ids), info,
                              group_names=list(group_ids) if has_groups else None)
