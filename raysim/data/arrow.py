"""Images stored in Parquet or Arrow files, read lazily with pyarrow alone (``data.dataset: parquet``).

``data.root`` is one of:

* a folder of ``.parquet`` files and/or Arrow IPC files (``.arrow``, ``.feather``, ``.ipc``;
  IPC file or streaming format), searched recursively in sorted order. A file whose path
  names a split (``train-00000-of-00002.parquet``, ``data/test/0.parquet``: a path part or
  a file name starting with train, validation, valid, val, dev or test) holds that split;
* a Hugging Face ``save_to_disk`` folder (``data-0000x-of-0000n.arrow`` in Arrow streaming
  format, ``state.json`` listing them, ``dataset_info.json``), read without ``datasets``;
* a ``DatasetDict.save_to_disk`` folder (``dataset_dict.json``, one such folder per split):
  train, validation (val, valid, dev) and test become raysim's splits;
* a single Parquet or Arrow file.

Where official splits exist, the missing ones are carved from train; otherwise every domain
is carved into train/val/test: per class (``split_by='class'``, default) or within each group
(``split_by='group'``: a group's val and test samples are its own).

Columns (options name them; the defaults are the first present of): image ``image``/``img``
(binary image bytes, a path string relative to the file's folder, or HF's Image struct
{bytes, path}); label ``label``/``labels`` (integers, whose names come from HF's ClassLabel
metadata where present, or class-name strings); group ``group``/``user_id``/``writer_id``/
``client_id`` (optional, integers or strings); domain ``domain`` (optional; without it one
domain named after the root). Group and class names become ids in sorted order (numeric when
every name is an integer), groups once across the whole dataset (``ds.group_names``).

Lazy: opening reads only the label, group and domain columns and the files' metadata. An
``ArrowSplit`` decodes images on demand, reading only the Parquet row groups (or the
memory-mapped Arrow record batches) that hold the asked rows, and counts what it reads
(``chunk_reads``, ``rows_decoded``); pickled (shipped to a Ray actor) it carries file paths
and per-row indices, never image data.
"""

from __future__ import annotations

import collections
import io
import json
import os
import re
import threading
from pathlib import Path

import numpy as np

from raysim.data.folders import (GENERIC_PRESETS, carve_positions, check_split_by, name_ids, preprocessing,
                                 resolve_options, split_rng)
from raysim.data.splits import SPLITS, DecodedSplit, MultiDomainDataset, read_only, as_index
from raysim.core.errors import UserError

PARQUET_SUFFIXES = (".parquet", ".pq")
IPC_SUFFIXES = (".arrow", ".feather", ".ipc")
DEFAULT_COLUMNS = {
    "image": ("image", "img"),
    "label": ("label", "labels"),
    "group": ("group", "user_id", "writer_id", "client_id"),
    "domain": ("domain",),
}
# split names found in releases -> raysim's
SPLIT_NAMES = {"train": "train", "validation": "val", "valid": "val", "val": "val", "dev": "val", "test": "test"}
_SPLIT_IN_NAME = re.compile(r"^(train|validation|valid|val|dev|test)(?:[-_.]|$)", re.IGNORECASE)
# Parquet row groups kept after a read, by bytes: a client's batches revisit the same few groups
CHUNK_CACHE_BYTES = int(os.environ.get("RAYSIM_CHUNK_CACHE_MB", "64")) * 2**20
MAX_OPEN_FILES = 64  # data files a process keeps open (least recently read closed first): one per user is common


def _is_ipc_file_format(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(6) == b"ARROW1"


class ArrowFiles:
    """The data files of one dataset and how to read one chunk (a Parquet row group, an Arrow
    record batch) of their image column; shared by its splits. Open files and cached chunks
    belong to the process: pickling keeps the paths and chunk bounds only."""

    def __init__(self, paths: list[str], kinds: list[str], bounds: list[np.ndarray], image_column: str,
                 image_kind: str):
        self.paths, self.kinds = list(paths), list(kinds)
        self.bounds = [read_only(np.asarray(b, dtype=np.int64)) for b in bounds]  # chunk row starts, + end
        self.image_column, self.image_kind = image_column, image_kind
        self._open: collections.OrderedDict = collections.OrderedDict()  # file -> its reader, most recent last
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._cached_bytes = 0
        self._lock = threading.Lock()  # a host may cut batches for several clients at once

    @property
    def total_chunks(self) -> int:
        return int(sum(len(b) - 1 for b in self.bounds))

    def chunk_of(self, file: int, rows: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.bounds[file], rows, side="right") - 1

    def _handle(self, file: int):
        """The file's reader, opened on first use; at most MAX_OPEN_FILES stay open (a dataset of a
        file per user would otherwise hold thousands of descriptors in every host)."""
        h = self._open.get(file)
        if h is not None:
            self._open.move_to_end(file)
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            path = self.paths[file]
            try:
                if self.kinds[file] == "parquet":
                    h = pq.ParquetFile(path)
                elif _is_ipc_file_format(path):
                    h = pa.ipc.open_file(pa.memory_map(path))
                else:  # streaming format (HF save_to_disk): batches are zero-copy slices of the map
                    h = list(pa.ipc.open_stream(pa.memory_map(path)))
            except (OSError, pa.ArrowException) as e:
                raise UserError(f"parquet: data file {path} cannot be read any more: {e}") from None
            self._open[file] = h
            while len(self._open) > MAX_OPEN_FILES:
                _, oldest = self._open.popitem(last=False)
                if hasattr(oldest, "close"):  # a ParquetFile: its descriptor now (a memory map goes with its data)
                    oldest.close()
        return h

    def chunk(self, file: int, chunk: int):
        """(the image column of that chunk, whether it was read now rather than found cached)."""
        with self._lock:
            return self._chunk(file, chunk)

    def _chunk(self, file: int, chunk: int):
        key = (file, chunk)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key], False
        h = self._handle(file)
        kind = self.kinds[file]
        if kind == "parquet":
            col = h.read_row_group(chunk, columns=[self.image_column]).column(0).combine_chunks()
            if col.nbytes <= CHUNK_CACHE_BYTES:
                self._cache[key] = col
                self._cached_bytes += col.nbytes
                while self._cached_bytes > CHUNK_CACHE_BYTES:
                    _, old = self._cache.popitem(last=False)
                    self._cached_bytes -= old.nbytes
            return col, True
        batch = h.get_batch(chunk) if hasattr(h, "get_batch") else h[chunk]
        return batch.column(self.image_column), True

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_open"], state["_cache"], state["_cached_bytes"] = collections.OrderedDict(), collections.OrderedDict(), 0
        del state["_lock"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()


class ArrowSplit(DecodedSplit):
    """Rows of Parquet/Arrow files (``file_index``, ``file_row`` per position), decoded on demand.

    ``chunk_reads`` counts the chunks (row groups, record batches) read, keyed (file index,
    chunk index); ``rows_decoded`` the images decoded. ``cache_images=True`` keeps each decoded
    image after first use.
    """

    def __init__(self, files: ArrowFiles, file_index, file_row, labels, image_size: int, mean, std,
                 augment=None, groups=None, cache_images: bool = False):
        self.files = files
        self.file_index = read_only(np.asarray(file_index, dtype=np.int32).reshape(-1))
        self.file_row = read_only(np.asarray(file_row, dtype=np.int64).reshape(-1))
        labels = np.asarray(labels, dtype=np.int64).reshape(-1)
        if not labels.shape[0] == self.file_index.shape[0] == self.file_row.shape[0]:
            raise ValueError("ArrowSplit: file_index, file_row and labels differ in length")
        self._set_decoding(labels, groups, image_size, mean, std, augment, cache_images)
        self.chunk_reads: collections.Counter = collections.Counter()
        self.rows_decoded = 0

    def _decode(self, value, file: int, row: int) -> np.ndarray:
        from PIL import Image, UnidentifiedImageError

        path = self.files.paths[file]
        where = f"{path} row {row} (counting from 0)"
        if self.files.image_kind == "struct":  # HF Image: bytes, else a path
            value = value if value is None else (value.get("bytes") or value.get("path"))
        if value is None:
            raise UserError(f"parquet: {where} has no image in column {self.files.image_column!r}")
        source = io.BytesIO(value) if isinstance(value, (bytes, bytearray)) else os.path.join(
            os.path.dirname(path), value)
        try:
            with Image.open(source) as im:
                im = im.convert("RGB")
                if im.size != (self.image_size, self.image_size):
                    im = im.resize((self.image_size, self.image_size), Image.BILINEAR)
                a = np.asarray(im, dtype=np.uint8)
        except FileNotFoundError:
            raise UserError(f"parquet: {where} names image file {source}, which does not exist") from None
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
            raise UserError(f"parquet: the image in {where} cannot be decoded: {e}") from None
        self.rows_decoded += 1
        return a

    def images(self, idx) -> np.ndarray:
        i = as_index(idx, len(self))
        s = self.image_size
        out = np.empty((i.size, s, s, 3), np.uint8)
        todo = np.ones(i.size, bool)
        if self.cache_images and self._decoded:
            for k, j in enumerate(i):
                a = self._decoded.get(int(j))
                if a is not None:
                    out[k], todo[k] = a, False
        want = np.flatnonzero(todo)
        if not want.size:
            return out
        files, rows = self.file_index[i[want]], self.file_row[i[want]]
        for f in np.unique(files):
            in_f = np.flatnonzero(files == f)
            chunks = self.files.chunk_of(int(f), rows[in_f])
            for c in np.unique(chunks):
                col, read = self.files.chunk(int(f), int(c))
                if read:
                    self.chunk_reads[int(f), int(c)] += 1
                start = self.files.bounds[f][c]
                for k in in_f[chunks == c]:
                    row = int(rows[k])
                    a = self._decode(col[row - start].as_py(), int(f), row)
                    out[want[k]] = a
                    if self.cache_images:
                        self._decoded[int(i[want[k]])] = a
        return out

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_decoded"], state["chunk_reads"], state["rows_decoded"] = {}, collections.Counter(), 0
        return state


# ------------------------------------------------------------------ finding the files


def _hf_dataset_files(folder: Path) -> list[Path]:
    """A save_to_disk folder's data files, in ``state.json``'s order where it lists them."""
    state = folder / "state.json"
    if state.is_file():
        try:
            names = [d["filename"] for d in json.loads(state.read_text())["_data_files"]]
            return [folder / n for n in names]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UserError(f"parquet: {state} is not a save_to_disk state.json ({e})") from None
    return sorted(p for p in folder.iterdir() if p.suffix in IPC_SUFFIXES + PARQUET_SUFFIXES and p.is_file())


def _split_named_by(rel: Path) -> str | None:
    for part in list(rel.parent.parts) + [rel.name]:
        m = _SPLIT_IN_NAME.match(part)
        if m:
            return SPLIT_NAMES[m.group(1).lower()]
    return None


def find_files(root: Path) -> tuple[str, dict[str | None, list[Path]], list[str]]:
    """(layout, {raysim split or None (no split): data files}, split names left out) for ``root``."""
    if root.is_file():
        if root.suffix not in PARQUET_SUFFIXES + IPC_SUFFIXES:
            raise UserError(f"parquet: {root} is not a .parquet or .arrow file")
        return "file", {None: [root]}, []
    if not root.is_dir():
        raise UserError(f"parquet: {root} does not exist (expected a folder of Parquet or Arrow files)")
    listing = root / "dataset_dict.json"
    if listing.is_file():
        try:
            names = list(json.loads(listing.read_text())["splits"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UserError(f"parquet: {listing} is not a DatasetDict listing ({e})") from None
        out, ignored = {}, []
        for name in names:
            ours = SPLIT_NAMES.get(str(name).lower())
            if ours is None or ours in out:
                ignored.append(str(name))
                continue
            if not (root / name).is_dir():
                raise UserError(f"parquet: {listing} lists split {name!r} but {root / name} is not a folder")
            out[ours] = _hf_dataset_files(root / name)
        if not out:
            raise UserError(f"parquet: {listing} lists splits {', '.join(map(str, names))}; none is train, "
                            "validation or test")
        return "dataset_dict", out, ignored
    if (root / "state.json").is_file():
        return "save_to_disk", {None: _hf_dataset_files(root)}, []
    found = sorted((p for p in root.rglob("*") if p.suffix in PARQUET_SUFFIXES + IPC_SUFFIXES and p.is_file()
                    and not any(part.startswith(".") for part in p.relative_to(root).parts)),
                   key=lambda p: str(p.relative_to(root)))
    if not found:
        raise UserError(f"parquet: {root} holds no .parquet or .arrow files")
    named = {p: _split_named_by(p.relative_to(root)) for p in found}
    if all(s is None for s in named.values()):
        return "folder", {None: found}, []
    unnamed = [str(p.relative_to(root)) for p, s in named.items() if s is None]
    if unnamed:
        raise UserError(f"parquet: in {root} some files name a split (train-..., test-...) and some do not "
                        f"({', '.join(unnamed[:3])}); put each file under its split's name, or none")
    out = {}
    for p, s in named.items():
        out.setdefault(s, []).append(p)
    return "folder", out, []


# ------------------------------------------------------------------ reading the small columns


def _kind(path: Path) -> str:
    return "parquet" if path.suffix in PARQUET_SUFFIXES else "ipc"


def _schema(path: Path, kind: str):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if kind == "parquet":
            return pq.read_schema(path)
        source = pa.memory_map(str(path))
        if _is_ipc_file_format(str(path)):
            return pa.ipc.open_file(source).schema
        return pa.ipc.open_stream(source).schema
    except FileNotFoundError:
        raise UserError(f"parquet: data file {path} does not exist") from None
    except (OSError, pa.ArrowException) as e:
        raise UserError(f"parquet: {path} is not a readable {'Parquet' if kind == 'parquet' else 'Arrow'} "
                        f"file: {e}") from None


def _read_columns(path: Path, kind: str, columns: list[str]):
    """(a pyarrow Table of ``columns``, chunk row starts + end) without touching other columns' data."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if kind == "parquet":
            pf = pq.ParquetFile(path)
            sizes = [pf.metadata.row_group(k).num_rows for k in range(pf.metadata.num_row_groups)]
            table = pf.read(columns=columns)
        else:
            source = pa.memory_map(str(path))
            if _is_ipc_file_format(str(path)):
                reader = pa.ipc.open_file(source)
                batches = [reader.get_batch(k) for k in range(reader.num_record_batches)]
                schema = reader.schema
            else:
                reader = pa.ipc.open_stream(source)
                batches, schema = list(reader), reader.schema
            sizes = [b.num_rows for b in batches]
            # zero-copy slices of the map: only these columns' pages are touched
            table = pa.Table.from_batches([b.select(columns) for b in batches], pa.schema(
                [schema.field(c) for c in columns]))
    except (OSError, pa.ArrowException) as e:
        raise UserError(f"parquet: {path} cannot be read: {e}") from None
    return table, np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])


def _class_names_from_metadata(schema, folder: Path, column: str) -> list[str] | None:
    """HF ClassLabel names of ``column``: from the schema's ``huggingface`` metadata or dataset_info.json."""
    sources = []
    meta = schema.metadata or {}
    if b"huggingface" in meta:
        try:
            hf = json.loads(meta[b"huggingface"])
            sources.append(hf.get("info", hf).get("features", {}))
        except (ValueError, AttributeError):
            pass
    info = folder / "dataset_info.json"
    if info.is_file():
        try:
            sources.append(json.loads(info.read_text()).get("features", {}))
        except (OSError, ValueError, AttributeError):
            pass
    for features in sources:
        feat = features.get(column) if isinstance(features, dict) else None
        if isinstance(feat, dict) and isinstance(feat.get("names"), list):
            return [str(n) for n in feat["names"]]
    return None


def _pick(schema_names: list[str], wanted: str | None, role: str, path: Path, required: bool) -> str | None:
    """The column for ``role``: the one the options name (which must exist), else the first default present."""
    if wanted is not None:
        if wanted not in schema_names:
            raise UserError(f"parquet: {path} has no column {wanted!r} ({role}_column); its columns: "
                            f"{', '.join(schema_names)}")
        return wanted
    for c in DEFAULT_COLUMNS[role]:
        if c in schema_names:
            return c
    if required:
        raise UserError(f"parquet: {path} has no {role} column (looked for {', '.join(DEFAULT_COLUMNS[role])}; "
                        f"name it with {role}_column); its columns: {', '.join(schema_names)}")
    return None


def _image_kind(field, path: Path) -> str:
    import pyarrow as pa

    t = field.type
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        return "bytes"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "path"
    if pa.types.is_struct(t) and {t.field(k).name for k in range(t.num_fields)} & {"bytes", "path"}:
        return "struct"
    raise UserError(f"parquet: column {field.name!r} of {path} holds {t}; expected image bytes (binary), a "
                    "path (string) or Hugging Face's Image struct {bytes, path}")


def _values(table, column: str, path: Path, role: str, offset: int = 0) -> np.ndarray:
    """A column as numpy (integers, or str objects); a missing value is an error naming its row."""
    import pyarrow as pa
    import pyarrow.compute as pc

    col = table.column(column)
    if col.null_count:
        row = int(pc.index(pc.is_null(col), True).as_py())
        raise UserError(f"parquet: {path} row {row + offset} (counting from 0) has no {role} in column {column!r}")
    if pa.types.is_dictionary(col.type):
        col = col.cast(col.type.value_type)
    if pa.types.is_integer(col.type):
        return col.to_numpy().astype(np.int64)
    if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
        return col.to_numpy().astype(object)
    raise UserError(f"parquet: column {column!r} ({role}) of {path} holds {col.type}; expected integers or strings")


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    """Per-file values as one array; names (str) throughout if some files hold integers and some strings."""
    if len({a.dtype.kind for a in parts if a.size}) > 1:
        parts = [a.astype(str).astype(object) for a in parts]
    return np.concatenate(parts)


def encode(values: np.ndarray) -> tuple[np.ndarray, list[str]]:
    """(ids 0..n-1, names): distinct values in sorted order (numeric when every name is an integer)."""
    uniq, inverse = np.unique(values, return_inverse=True)
    names = [str(u) for u in uniq]
    ids = name_ids(names)
    perm = np.array([ids[n] for n in names], dtype=np.int64)
    order = sorted(ids, key=ids.get)
    return perm[inverse.reshape(-1)] if perm.size else np.zeros(0, np.int64), order


# ------------------------------------------------------------------ the loader


def load_parquet(root, seed: int = 0, preset: str = "default", image_size: int | None = None, normalize=None,
                 augment=None, val_fraction: float | None = None, test_fraction: float | None = None,
                 split_by: str = "class", image_column: str | None = None, label_column: str | None = None,
                 group_column: str | None = None, domain_column: str | None = None,
                 cache_images: bool = False) -> MultiDomainDataset:
    """A folder of Parquet or Arrow files, or a Hugging Face save_to_disk folder (module docstring)."""
    if root is None:
        raise UserError("parquet needs root=DIR: a folder of Parquet or Arrow files, or a Hugging Face "
                        "save_to_disk folder")
    check_split_by("parquet", split_by, True)  # the name; whether there are groups is known once a file is read
    root = Path(root).expanduser().absolute()
    opts = resolve_options("parquet", GENERIC_PRESETS, preset, dict(
        image_size=image_size, normalize=normalize, augment=augment, val_fraction=val_fraction,
        test_fraction=test_fraction, cache_images=cache_images))
    size, mean, std, aug = preprocessing("parquet", opts)
    layout, by_split, ignored = find_files(root)

    # which columns: decided on the first file, required of every file
    paths = [p for files in by_split.values() for p in files]
    split_of_file = [s for s, files in by_split.items() for _ in files]
    kinds = [_kind(p) for p in paths]
    first = _schema(paths[0], kinds[0])
    names0 = list(first.names)
    cols = {"image": _pick(names0, image_column, "image", paths[0], True),
            "label": _pick(names0, label_column, "label", paths[0], True),
            "group": _pick(names0, group_column, "group", paths[0], False),
            "domain": _pick(names0, domain_column, "domain", paths[0], False)}
    if split_by == "group" and cols["group"] is None:
        raise UserError(f"parquet: split_by='group' needs a group column, and {paths[0]} has none (looked for "
                        f"{', '.join(DEFAULT_COLUMNS['group'])}; name it with group_column); its columns: "
                        f"{', '.join(names0)}")
    image_kind = _image_kind(first.field(cols["image"]), paths[0])
    small = [c for c in (cols["label"], cols["group"], cols["domain"]) if c is not None]

    labels, groups, domains, bounds, file_rows = [], [], [], [], []
    for k, (p, kind) in enumerate(zip(paths, kinds)):
        schema = first if k == 0 else _schema(p, kind)
        for role, c in cols.items():
            if c is not None and c not in schema.names:
                raise UserError(f"parquet: {p} has no column {c!r} ({role}), which {paths[0]} has; its columns: "
                                f"{', '.join(schema.names)}")
        if k and _image_kind(schema.field(cols["image"]), p) != image_kind:
            raise UserError(f"parquet: column {cols['image']!r} of {p} holds {schema.field(cols['image']).type}, "
                            f"unlike {paths[0]}")
        table, b = _read_columns(p, kind, small)
        labels.append(_values(table, cols["label"], p, "label"))
        if cols["group"] is not None:
            groups.append(_values(table, cols["group"], p, "group"))
        if cols["domain"] is not None:
            domains.append(_values(table, cols["domain"], p, "domain"))
        bounds.append(b)
        file_rows.append(table.num_rows)
    n = int(sum(file_rows))
    if not n:
        raise UserError(f"parquet: the data files under {root} hold no rows")
    file_index = np.repeat(np.arange(len(paths), dtype=np.int32), file_rows)
    file_row = np.concatenate([np.arange(r, dtype=np.int64) for r in file_rows]) if n else np.zeros(0, np.int64)

    # labels: integers keep their value (names from HF ClassLabel metadata), strings are class names
    kinds_of_labels = {lab.dtype.kind for lab in labels if lab.size}
    if len(kinds_of_labels) > 1:
        raise UserError(f"parquet: column {cols['label']!r} holds integers in some files and strings in others")
    all_labels = np.concatenate(labels) if labels else np.zeros(0, np.int64)
    if all_labels.dtype.kind == "O":
        y, classes = encode(all_labels)
    else:
        y = all_labels.astype(np.int64)
        if y.size and y.min() < 0:
            bad = int(np.flatnonzero(y < 0)[0])
            raise UserError(f"parquet: {paths[file_index[bad]]} row {file_row[bad]} (counting from 0) has label "
                            f"{y[bad]}; labels must be class ids >= 0 (an unlabelled split? leave its files out)")
        named = _class_names_from_metadata(first, paths[0].parent, cols["label"])
        top = int(y.max()) + 1 if y.size else 0
        classes = named if named is not None and len(named) >= top else [str(c) for c in range(top)]
    g, group_names = (encode(_joined(groups)) if groups else (None, None))
    if domains:
        dom, domain_names = encode(_joined(domains))
    else:
        dom, domain_names = np.zeros(n, np.int64), [root.stem if root.is_file() else root.name]
    split_col = np.repeat(np.array([SPLITS.index(s) if s else -1 for s in split_of_file], np.int8), file_rows)

    files = ArrowFiles([str(p) for p in paths], kinds, bounds, cols["image"], image_kind)
    official = set(by_split) - {None}
    if official and "train" not in official:
        raise UserError(f"parquet: {root} has splits {', '.join(sorted(official))} but no train split")
    splits = {}
    for code, d in enumerate(domain_names):
        in_d = dom == code
        parts = {}
        if official:
            for s in official:
                parts[s] = np.flatnonzero(in_d & (split_col == SPLITS.index(s)))
            missing = [s for s in ("val", "test") if s not in official]
            if missing:  # carve what the release lacks out of its train split
                tr = parts["train"]
                carved = carve_positions(y[tr], None if g is None else g[tr], split_by,
                                         opts["val_fraction"] if "val" in missing else 0.0,
                                         opts["test_fraction"] if "test" in missing else 0.0,
                                         split_rng(seed, "parquet", d))
                parts["train"] = tr[carved[0]]
                for s, pos in zip(("val", "test"), carved[1:]):
                    if s in missing:
                        parts[s] = tr[pos]
        else:
            rows = np.flatnonzero(in_d)
            carved = carve_positions(y[rows], None if g is None else g[rows], split_by, opts["val_fraction"],
                                     opts["test_fraction"], split_rng(seed, "parquet", d))
            parts = {s: rows[pos] for s, pos in zip(SPLITS, carved)}
        splits[d] = {s: ArrowSplit(files, file_index[r], file_row[r], y[r], size, mean, std, aug,
                                   groups=None if g is None else g[r], cache_images=bool(opts["cache_images"]))
                     for s, r in parts.items()}
    keep = ("preset", "image_size", "normalize", "augment", "val_fraction", "test_fraction")
    info = {**{k: opts[k] for k in keep}, "root": str(root), "layout": layout,
            "split": ("official" if official >= set(SPLITS) else "official+carve") if official else "carve",
            "split_by": split_by, "columns": {k: v for k, v in cols.items() if v is not None},
            "files": len(paths), "chunks": files.total_chunks}
    if ignored:
        info["ignored_splits"] = ignored
    if group_names is not None:
        info["groups"] = len(group_names)
    return MultiDomainDataset("parquet", splits, classes, info, group_names=group_names)
