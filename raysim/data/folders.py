"""Real datasets that live in folders the user points to: shared machinery + folder layouts.

Every loader here ends the same way: per domain, lists of (path, label) for train / val /
test become ``FileSplit``s with one preprocessing (resize, normalisation, train-time
augmentation). Options come from a per-dataset *preset* named after the paper whose
protocol it reproduces; explicit keyword arguments override the preset. The default
preset of every dataset gives non-empty train, val and test splits, so per-client
evaluation works everywhere; paper presets may leave a split empty (e.g. gPerXAN has no
test split: it tests on whole held-out domains, see ``partition.leave_one_domain_out``).

Where a release has no official split, a fixed, seeded, stratified one is carved
(``stratified_carve``), seeded by the ``seed`` given to ``load``.

Layouts handled in this module (see references/data.md section 5):
``imagefolder`` ROOT/<domain>/<class>/<image> (or, with ``layout='domain/group/class'``,
ROOT/<domain>/<group>/<class>/<image>: one folder per writer/user); ``vlcs`` (DomainBed);
``office_home``; ``office_caltech10`` (folders, or FedBN's ``{site}_train.pkl``/``{site}_test.pkl``).

Loaders of data with groups (a writer, a user per sample) take ``split_by``: 'class' (the
stratified carve) or 'group' (``group_carve``: each group's val/test samples are its own).
"""

from __future__ import annotations

import os
import re
import zlib
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from raysim.data.augment import make_augment
from raysim.data.pickled import load_arrays
from raysim.data.splits import (ALL, SPLITS, FileSplit, MultiDomainDataset, group_carve,
                                resolve_normalization, stratified_carve)
from raysim.core.errors import UserError

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff")

# ------------------------------------------------------------------ shared helpers


def resolve_options(dataset: str, presets: dict, preset: str, given: dict) -> dict:
    """The preset's options with every non-None keyword in ``given`` on top."""
    if preset not in presets:
        raise UserError(f"{dataset}: preset={preset!r} is not known; valid: {', '.join(presets)}")
    out = dict(presets[preset])
    out.update({k: v for k, v in given.items() if v is not None})
    out["preset"] = preset
    return out


def require_dir(path, what: str) -> Path:
    p = Path(path).expanduser().absolute()
    if not p.is_dir():
        raise UserError(f"{what}: folder {p} does not exist" if not p.exists()
                        else f"{what}: {p} is not a folder")
    return p


def find_dir(root: Path, candidates: Iterable[str], must_contain: Sequence[str], what: str) -> Path:
    """The first of root/<candidate> holding all of ``must_contain`` (case-insensitive)."""
    for c in candidates:
        p = root / c if c else root
        if p.is_dir():
            names = {n.lower() for n in os.listdir(p)}
            if all(m.lower() in names for m in must_contain):
                return p
    raise UserError(
        f"{what}: {root} does not look like the dataset; expected folders "
        f"{', '.join(must_contain)} in it or in one of: {', '.join(c for c in candidates if c)}"
    )


def child_ci(parent: Path, name: str, alternatives: Sequence[str] = ()) -> Path | None:
    """parent/<name> matched case-insensitively (also trying ``alternatives``), or None."""
    want = [name.lower()] + [a.lower() for a in alternatives]
    entries = {n.lower(): n for n in os.listdir(parent)}
    for w in want:
        if w in entries:
            return parent / entries[w]
    return None


def list_images(folder: Path) -> list[Path]:
    """Image files under ``folder`` (recursively), in a fixed sorted order."""
    out = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames.sort()
        for f in sorted(filenames):
            if f.lower().endswith(IMAGE_EXTENSIONS) and not f.startswith("."):
                out.append(Path(dirpath) / f)
    return out


def split_rng(seed: int, dataset: str, domain: str) -> np.random.Generator:
    key = [int(seed) % 2**64, zlib.crc32(dataset.encode()), zlib.crc32(domain.encode())]
    return np.random.default_rng(np.random.SeedSequence(key))


class FileChecker:
    """Existence checks through one directory listing per folder (fast on big trees)."""

    def __init__(self):
        self._listing: dict[str, set[str]] = {}

    def exists(self, path: str) -> bool:
        d, f = os.path.split(path)
        names = self._listing.get(d)
        if names is None:
            try:
                names = set(os.listdir(d))
            except OSError:
                names = set()
            self._listing[d] = names
        return f in names


def check_files(items: list[tuple[str, int]], missing: str, listed_in: str) -> list[tuple[str, int]]:
    """Keep listed files that exist; ``missing='error'`` raises on the first absent one."""
    if missing not in ("error", "skip"):
        raise UserError(f"missing={missing!r}: expected 'error' or 'skip'")
    chk = FileChecker()
    kept = []
    for path, label in items:
        if chk.exists(path):
            kept.append((path, label))
        elif missing == "error":
            raise UserError(f"{listed_in} names image {path}, which does not exist "
                            "(pass missing='skip' to use only the images present)")
    return kept


SPLIT_BY = ("class", "group")


def check_split_by(name: str, split_by: str, has_groups: bool, no_groups_why: str = "") -> str:
    """``split_by`` validated: 'class' always; 'group' only for data that has groups."""
    if split_by not in SPLIT_BY:
        raise UserError(f"{name}: split_by={split_by!r}: expected 'class' (stratified carve) or 'group' "
                        "(carve within each group)")
    if split_by == "group" and not has_groups:
        raise UserError(f"{name}: split_by='group' needs a group per sample, and this data has none"
                        + (f" ({no_groups_why})" if no_groups_why else ""))
    return split_by


def carve_positions(labels: np.ndarray, groups: np.ndarray | None, split_by: str, val_fraction: float,
                    test_fraction: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Seeded train/val/test positions: per class (``stratified_carve``) or per group (``group_carve``)."""
    if split_by == "group":
        return group_carve(groups, val_fraction, test_fraction, rng)
    return stratified_carve(labels, val_fraction, test_fraction, rng)


def name_ids(values: Iterable) -> dict[str, int]:
    """Distinct names -> ids 0..n-1 in sorted order; numeric order when every name is an integer
    (so writer '10' comes after writer '9', and class '2' keeps id 2 among 0..9)."""
    names = {str(v) for v in values}
    if all(re.fullmatch(r"-?[0-9]+", n) for n in names):
        ordered = sorted(names, key=lambda n: (int(n), n))
    else:
        ordered = sorted(names)
    return {n: i for i, n in enumerate(ordered)}


def carve(items: list[tuple], val_fraction: float, test_fraction: float,
          rng: np.random.Generator, split_by: str = "class") -> dict[str, list[tuple]]:
    """(path, label[, group]) items -> {split: items}; ``split_by='group'`` carves within groups."""
    labels = np.array([it[1] for it in items], dtype=np.int64)
    groups = np.array([it[2] for it in items], dtype=np.int64) if split_by == "group" else None
    parts = carve_positions(labels, groups, split_by, val_fraction, test_fraction, rng)
    return {s: [items[i] for i in idx] for s, idx in zip(SPLITS, parts)}


def preprocessing(name: str, opts: dict):
    """(image size, mean, std, train-time augmentation) from a loader's resolved options."""
    mean, std = resolve_normalization(opts["normalize"])
    aug = make_augment(opts["augment"])
    size = int(opts["image_size"])
    if not 8 <= size <= 1024:
        raise UserError(f"{name}: image_size={size}: expected 8..1024")
    return size, mean, std, aug


def build(name: str, per_domain: dict[str, dict[str, list[tuple]]], classes: Sequence[str],
          opts: dict, info: dict, group_names: Sequence[str] | None = None) -> MultiDomainDataset:
    """(path, label) lists per domain and split -> a dataset of FileSplits.

    With ``group_names`` the items are (path, label, group id) and every split carries groups.
    """
    size, mean, std, aug = preprocessing(name, opts)
    cache_images = bool(opts.get("cache_images", False))
    splits = {}
    for d, parts in per_domain.items():
        splits[d] = {}
        if ALL not in parts:  # the whole domain, each file once (splits may overlap)
            seen = set()
            parts = {**parts, ALL: [it for s in SPLITS for it in parts.get(s, [])
                                    if not (it[0] in seen or seen.add(it[0]))]}
        for s in list(SPLITS) + [ALL]:
            items = parts.get(s, [])
            groups = None if group_names is None else np.array([it[2] for it in items], dtype=np.int64)
            splits[d][s] = FileSplit([it[0] for it in items], [it[1] for it in items], size, mean, std,
                                     aug, cache_images=cache_images, groups=groups)
        if not len(splits[d]["train"]) + len(splits[d]["val"]) + len(splits[d]["test"]):
            raise UserError(f"{name}: domain {d!r} has no images")
    keep = ("preset", "image_size", "normalize", "augment", "split", "val_fraction", "test_fraction")
    info = {**{k: opts[k] for k in keep if k in opts}, **info}
    return MultiDomainDataset(name, splits, classes, info, group_names=group_names)


def scan_class_folders(domain_dir: Path, domain: str, classes: list[str] | None,
                       class_map: dict | None, strict: bool) -> list[tuple[str, str]]:
    """[(path, class name)] for domain_dir/<class folder>/**/<image>.

    A folder's class is ``class_map[domain][folder]`` if mapped, else the folder name.
    Folders whose class is not in ``classes`` are an error when ``strict`` (the dataset's
    fixed class list), and skipped otherwise (the caller chose a class subset).
    """
    mapping = (class_map or {}).get(domain, {})
    wanted = {c.lower(): c for c in classes} if classes is not None else None
    out = []
    for folder in sorted(e.name for e in os.scandir(domain_dir) if e.is_dir() and not e.name.startswith(".")):
        cls = mapping.get(folder, folder)
        if wanted is not None:
            if cls.lower() not in wanted:
                if strict:
                    raise UserError(
                        f"class folder {domain_dir / folder} is not one of the classes "
                        f"{', '.join(classes)}; map it with class_map={{'{domain}': {{'{folder}': CLASS}}}}")
                continue
            cls = wanted[cls.lower()]
        out.extend((str(p), cls) for p in list_images(domain_dir / folder))
    return out


# ------------------------------------------------------------------ imagefolder (generic)

GENERIC_PRESETS = {
    "default": dict(image_size=224, normalize="imagenet", augment="none", val_fraction=0.1, test_fraction=0.2),
}


def _folder_dataset(name: str, root: Path, domain_dirs: dict[str, Path], classes: list[str] | None,
                    class_map: dict | None, strict: bool, seed: int, opts: dict, info: dict):
    scanned = {d: scan_class_folders(p, d, classes, class_map, strict) for d, p in domain_dirs.items()}
    if classes is None:
        classes = sorted({c for items in scanned.values() for _, c in items})
    index = {c: i for i, c in enumerate(classes)}
    per_domain = {}
    for d, items in scanned.items():
        if not items:
            raise UserError(f"{name}: no images found under {domain_dirs[d]} (expected <class>/<image> files)")
        labelled = [(p, index[c]) for p, c in items]
        per_domain[d] = carve(labelled, opts["val_fraction"], opts["test_fraction"], split_rng(seed, name, d))
    opts = {**opts, "split": "carve"}
    return build(name, per_domain, classes, opts, {"root": str(root), **info})


IMAGEFOLDER_LAYOUTS = ("domain/class", "domain/group/class")


def _grouped_folder_dataset(name: str, root: Path, domain_dirs: dict[str, Path], classes: list[str] | None,
                            class_map: dict | None, seed: int, opts: dict, split_by: str):
    """<domain>/<group>/<class>/<image>: the group folder names become group ids, one id per
    name across the whole dataset (sorted, numerically when every name is an integer)."""
    scanned = {}
    for d, p in domain_dirs.items():
        groups = sorted(e.name for e in os.scandir(p) if e.is_dir() and not e.name.startswith("."))
        scanned[d] = [(path, c, g) for g in groups
                      for path, c in scan_class_folders(p / g, d, classes, class_map, False)]
        if not scanned[d]:
            raise UserError(f"{name}: no images found under {p} (layout domain/group/class expects "
                            "<group>/<class>/<image> files)")
    if classes is None:
        classes = sorted({c for items in scanned.values() for _, c, _ in items})
    index = {c: i for i, c in enumerate(classes)}
    group_ids = name_ids(g for items in scanned.values() for _, _, g in items)
    per_domain = {}
    for d, items in scanned.items():
        labelled = [(p, index[c], group_ids[g]) for p, c, g in items]
        per_domain[d] = carve(labelled, opts["val_fraction"], opts["test_fraction"], split_rng(seed, name, d),
                              split_by)
    opts = {**opts, "split": "carve"}
    info = {"root": str(root), "layout": "domain/group/class", "split_by": split_by, "groups": len(group_ids)}
    return build(name, per_domain, classes, opts, info, group_names=list(group_ids))


def load_imagefolder(root, seed: int = 0, domains: Sequence[str] | None = None,
                     classes: Sequence[str] | None = None, class_map: dict | None = None,
                     preset: str = "default", image_size: int | None = None, normalize=None, augment=None,
                     val_fraction: float | None = None, test_fraction: float | None = None,
                     cache_images: bool = False, layout: str = "domain/class",
                     split_by: str = "class") -> MultiDomainDataset:
    """ROOT/<domain>/<class>/<image>: any multi-domain image folder.

    Domains are the sub-folders of ROOT (or ``domains``); classes are the sorted union of
    class folder names (or ``classes``, which then selects a subset); ``class_map`` renames
    folders per domain ({domain: {folder: class}}). No official split: a seeded, stratified
    train/val/test carve (default 70/10/20).

    ``layout='domain/group/class'`` reads ROOT/<domain>/<group>/<class>/<image>, one folder per
    writer or user: every split carries the group ids (names in ``ds.group_names``), and
    ``split_by='group'`` carves each group's own val/test samples instead of per class.
    """
    if root is None:
        raise UserError("imagefolder needs root=DIR holding <domain>/<class>/<image> folders")
    if layout not in IMAGEFOLDER_LAYOUTS:
        raise UserError(f"imagefolder: layout={layout!r}: expected one of {', '.join(IMAGEFOLDER_LAYOUTS)}")
    grouped = layout == "domain/group/class"
    check_split_by("imagefolder", split_by, grouped,
                   "layout domain/class has no group folders; use layout='domain/group/class'")
    root = require_dir(root, "imagefolder")
    opts = resolve_options("imagefolder", GENERIC_PRESETS, preset, dict(
        image_size=image_size, normalize=normalize, augment=augment, val_fraction=val_fraction,
        test_fraction=test_fraction, cache_images=cache_images))
    found = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    if domains is None:
        domains = found
    for d in domains:
        if d not in found:
            raise UserError(f"imagefolder: domain folder {root / d} does not exist; found: {', '.join(found) or 'none'}")
    if not domains:
        raise UserError(f"imagefolder: {root} has no domain folders (expected <domain>/"
                        f"{'<group>/' if grouped else ''}<class>/<image>)")
    cls = list(classes) if classes is not None else None
    if grouped:
        return _grouped_folder_dataset("imagefolder", root, {d: root / d for d in domains}, cls, class_map, seed,
                                       opts, split_by)
    return _folder_dataset("imagefolder", root, {d: root / d for d in domains}, cls, class_map, False, seed, opts, {})


# ------------------------------------------------------------------ VLCS (DomainBed layout)

VLCS_CLASSES = ["bird", "car", "chair", "dog", "person"]
VLCS_DOMAINS = ["Caltech101", "LabelMe", "SUN09", "VOC2007"]
VLCS_PRESETS = {
    "default": dict(image_size=224, normalize="imagenet", augment="flip", val_fraction=0.1, test_fraction=0.2),
    # CSAC: RSC's lists (~70/30 train/test) are not public in a fixed form: carve 70/30
    "csac": dict(image_size=224, normalize="imagenet", augment="csac", val_fraction=0.0, test_fraction=0.3),
}


def load_vlcs(root, seed: int = 0, domains: Sequence[str] | None = None, classes: Sequence[str] | None = None,
              class_map: dict | None = None, preset: str = "default", image_size: int | None = None,
              normalize=None, augment=None, val_fraction: float | None = None,
              test_fraction: float | None = None, cache_images: bool = False) -> MultiDomainDataset:
    """VLCS in DomainBed's layout ROOT[/VLCS]/{Caltech101,LabelMe,SUN09,VOC2007}/<class>/.

    Domains are the domain folders present (or ``domains``); the five classes are
    bird, car, chair, dog, person (``class_map`` renames folders, ``classes`` picks a
    subset). VLCS has no split files in DomainBed's copy: a seeded stratified carve.
    """
    if root is None:
        raise UserError("vlcs needs root=DIR (DomainBed layout: VLCS/{Caltech101,LabelMe,SUN09,VOC2007}/<class>/)")
    root = require_dir(root, "vlcs")
    opts = resolve_options("vlcs", VLCS_PRESETS, preset, dict(
        image_size=image_size, normalize=normalize, augment=augment, val_fraction=val_fraction,
        test_fraction=test_fraction, cache_images=cache_images))
    base = root / "VLCS" if (root / "VLCS").is_dir() else root
    found = sorted(e.name for e in os.scandir(base) if e.is_dir() and not e.name.startswith("."))
    if domains is None:
        domains = [d for d in VLCS_DOMAINS if d in found] or found
    for d in domains:
        if d not in found:
            raise UserError(f"vlcs: domain folder {base / d} does not exist; found: {', '.join(found) or 'none'}")
    if not domains:
        raise UserError(f"vlcs: {base} has no domain folders; expected {', '.join(VLCS_DOMAINS)}")
    strict = classes is None
    cls = list(classes) if classes is not None else VLCS_CLASSES
    return _folder_dataset("vlcs", root, {d: base / d for d in domains}, cls, class_map, strict, seed, opts, {})


# ------------------------------------------------------------------ Office-Home

OFFICE_HOME_DOMAINS = ["Art", "Clipart", "Product", "Real_World"]
# tllib's class list (references/data.md 5.4); folders are matched case-insensitively
OFFICE_HOME_CLASSES = [
    "Alarm_Clock", "Backpack", "Batteries", "Bed", "Bike", "Bottle", "Bucket", "Calculator", "Calendar",
    "Candles", "Chair", "Clipboards", "Computer", "Couch", "Curtains", "Desk_Lamp", "Drill", "Eraser",
    "Exit_Sign", "Fan", "File_Cabinet", "Flipflops", "Flowers", "Folder", "Fork", "Glasses", "Hammer",
    "Helmet", "Kettle", "Keyboard", "Knives", "Lamp_Shade", "Laptop", "Marker", "Monitor", "Mop", "Mouse",
    "Mug", "Notebook", "Oven", "Pan", "Paper_Clip", "Pen", "Pencil", "Postit_Notes", "Printer", "Push_Pin",
    "Radio", "Refrigerator", "Ruler", "Scissors", "Screwdriver", "Shelf", "Sink", "Sneakers", "Soda",
    "Speaker", "Spoon", "TV", "Table", "Telephone", "ToothBrush", "Toys", "Trash_Can", "Webcam",
]
OFFICE_HOME_PRESETS = {
    "default": dict(image_size=224, normalize="imagenet", augment="flip", val_fraction=0.1, test_fraction=0.1),
    # gPerXAN: 90/10 train/val per source domain; the target domain is tested whole (LODO)
    "gperxan": dict(image_size=224, normalize="imagenet", augment="flip_jitter", val_fraction=0.1,
                    test_fraction=0.0),
}


def load_office_home(root, seed: int = 0, preset: str = "default", image_size: int | None = None,
                     normalize=None, augment=None, val_fraction: float | None = None,
                     test_fraction: float | None = None, cache_images: bool = False) -> MultiDomainDataset:
    """Office-Home: ROOT[/OfficeHomeDataset_10072016|/office_home]/{Art,Clipart,Product,Real World}/<65 classes>/.

    The domain folder 'Real World' (original zip) or 'Real_World' (tllib) is domain
    ``Real_World``. No official split: a seeded stratified carve.
    """
    if root is None:
        raise UserError("office_home needs root=DIR holding Art/ Clipart/ Product/ 'Real World'/")
    root = require_dir(root, "office_home")
    opts = resolve_options("office_home", OFFICE_HOME_PRESETS, preset, dict(
        image_size=image_size, normalize=normalize, augment=augment, val_fraction=val_fraction,
        test_fraction=test_fraction, cache_images=cache_images))
    base = find_dir(root, ["", "OfficeHomeDataset_10072016", "office_home", "OfficeHome"],
                    ["Art", "Clipart", "Product"], "office_home")
    dirs = {}
    for d in OFFICE_HOME_DOMAINS:
        p = child_ci(base, d, ["Real World"] if d == "Real_World" else ())
        if p is None:
            raise UserError(f"office_home: domain folder {base / d} does not exist")
        dirs[d] = p
    return _folder_dataset("office_home", root, dirs, OFFICE_HOME_CLASSES, None, True, seed, opts, {})


# ------------------------------------------------------------------ Office-Caltech-10

OFFICE_CALTECH_DOMAINS = ["amazon", "caltech", "dslr", "webcam"]
# FedBN's label_dict order (references/data.md 5.2)
OFFICE_CALTECH_CLASSES = ["back_pack", "bike", "calculator", "headphones", "keyboard", "laptop_computer",
                          "monitor", "mouse", "mug", "projector"]
# folder spellings seen in public copies -> FedBN's class names
OFFICE_CALTECH_ALIASES = {"backpack": "back_pack", "laptop": "laptop_computer"}
OFFICE_CALTECH_PRESETS = {
    # FedBN / FedWon: Resize 256, flip + rotation(+-30), no mean/std normalisation
    "default": dict(image_size=256, normalize="none", augment="flip_rotate30", val_fraction=0.1,
                    test_fraction=0.2, split="auto"),
    # FDSE (FLGo): random 80/10/10, Resize 256, ToTensor only, no augmentation
    "fdse": dict(image_size=256, normalize="none", augment="none", val_fraction=0.1, test_fraction=0.1,
                 split="carve"),
    # DapperFL: ImageFolder order, sample k is train iff k mod 10 <= 7; 32 px, ImageNet norm
    "dapperfl": dict(image_size=32, normalize="imagenet", augment="crop_flip", val_fraction=0.0,
                     test_fraction=0.2, split="mod10"),
}


def _read_pickle_pair(path: Path):
    try:
        a, b = load_arrays(path)  # numpy arrays only: a pickle naming anything else is refused
    except Exception as e:
        raise UserError(f"{path} is not a pickled (paths, labels) pair as FedBN writes ({e})") from None
    return list(a), list(b)


def load_office_caltech10(root, seed: int = 0, preset: str = "default", split: str | None = None,
                          image_size: int | None = None, normalize=None, augment=None,
                          val_fraction: float | None = None, test_fraction: float | None = None,
                          missing: str = "error", cache_images: bool = False) -> MultiDomainDataset:
    """Office-Caltech-10 (amazon, caltech, dslr, webcam; FedBN's class order).

    Layouts: folders ROOT[/office_caltech_10]/{amazon,caltech,dslr,webcam}/<class>/*.jpg, or
    FedBN's ``{site}_train.pkl`` / ``{site}_test.pkl`` = (paths, text labels), paths relative
    to the pickles' parent folder. ``split``: 'fedbn' (the pickles' split; val = the last
    int(0.4 * min train size) of each train list, FedBN's validation), 'carve' (seeded
    stratified), 'mod10' (DapperFL), 'auto' (fedbn if the pickles exist, else carve).
    Partition with ``train_size: 62, shuffle: false`` for FedBN's per-client subset.
    """
    if root is None:
        raise UserError("office_caltech10 needs root=DIR holding amazon/ caltech/ dslr/ webcam/ (or FedBN's *.pkl)")
    root = require_dir(root, "office_caltech10")
    opts = resolve_options("office_caltech10", OFFICE_CALTECH_PRESETS, preset, dict(
        split=split, image_size=image_size, normalize=normalize, augment=augment, val_fraction=val_fraction,
        test_fraction=test_fraction, cache_images=cache_images))
    base = root / "office_caltech_10" if (root / "office_caltech_10").is_dir() else root
    has_pkl = all((base / f"{d}_train.pkl").exists() and (base / f"{d}_test.pkl").exists()
                  for d in OFFICE_CALTECH_DOMAINS)
    mode = opts["split"]
    if mode == "auto":
        mode = "fedbn" if has_pkl else "carve"
    if mode not in ("fedbn", "carve", "mod10"):
        raise UserError(f"office_caltech10: split={mode!r}: expected auto, fedbn, carve or mod10")
    index = {c: i for i, c in enumerate(OFFICE_CALTECH_CLASSES)}
    per_domain = {}
    if mode == "fedbn":
        if not has_pkl:
            raise UserError(f"office_caltech10: split='fedbn' needs {base}/<site>_train.pkl and _test.pkl")
        lists = {}
        for d in OFFICE_CALTECH_DOMAINS:
            for s in ("train", "test"):
                pkl = base / f"{d}_{s}.pkl"
                paths, text = _read_pickle_pair(pkl)
                items = []
                for p, t in zip(paths, text):
                    t = str(t).lower()
                    if t not in index:
                        raise UserError(f"{pkl}: label {t!r} is not one of {', '.join(OFFICE_CALTECH_CLASSES)}")
                    items.append((p, index[t]))
                # FedBN joins the stored paths onto the data folder (the pickles' parent)
                anchor = base.parent if items and (base.parent / items[0][0]).exists() else base
                items = [(str(anchor / p), lab) for p, lab in items]
                lists[d, s] = check_files(items, missing, str(pkl))
        min_train = min(len(lists[d, "train"]) for d in OFFICE_CALTECH_DOMAINS)
        n_val = int(0.4 * min_train)
        for d in OFFICE_CALTECH_DOMAINS:
            tr = lists[d, "train"]
            per_domain[d] = {"train": tr[:len(tr) - n_val], "val": tr[len(tr) - n_val:], "test": lists[d, "test"]}
        opts["val_fraction"] = opts["test_fraction"] = None
    else:
        scanned = {}
        for d in OFFICE_CALTECH_DOMAINS:
            p = child_ci(base, d)
            if p is None:
                raise UserError(f"office_caltech10: domain folder {base / d} does not exist")
            scanned[d] = [(path, index[c]) for path, c in
                          scan_class_folders(p, d, OFFICE_CALTECH_CLASSES, {d: OFFICE_CALTECH_ALIASES}, True)]
            if not scanned[d]:
                raise UserError(f"office_caltech10: no images under {p}")
        for d, items in scanned.items():
            if mode == "carve":
                per_domain[d] = carve(items, opts["val_fraction"], opts["test_fraction"],
                                      split_rng(seed, "office_caltech10", d))
            else:  # DapperFL: ImageFolder's sorted sample list, k mod 10 <= 7 -> train
                per_domain[d] = {"train": [it for k, it in enumerate(items) if k % 10 <= 7], "val": [],
                                 "test": [it for k, it in enumerate(items) if k % 10 > 7]}
    opts["split"] = mode
    return build("office_caltech10", per_domain, OFFICE_CALTECH_CLASSES, opts, {"root": str(root)})
