"""Partitions materialised as Parquet shards on any ``pyarrow.fs`` filesystem.

Layout under ROOT: ``manifest.json`` (dataset, domains, classes, image shape, encoding,
normalisation, augmentation, clients per file, and optionally the ``config`` the partition
was cut for), ``index.parquet`` (every client's train/val/test counts, so a server knows the
federation's sizes without reading any image) and ``clients-<first id>.parquet`` files,
each holding ``clients_per_file`` consecutive clients, **one row group per client**. A
worker reads one client by opening one file and reading only that client's row group
(found from the row-group statistics of ``client_id``), so it never downloads other
clients' images. ``clients_per_file=1`` (default) gives one file per client;
larger values keep the file count sane for 100k-client federations.

Rows: client_id, domain, split ('train'/'val'/'test'), position (into the dataset split
the shard was cut from), label, image (raw uint8 H*W*C bytes, or PNG).
"""

from __future__ import annotations

import io
import json
import os
import posixpath
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raysim.data.augment import make_augment, preset_name
from raysim.data.partition import Partition, client_data
from raysim.data.splits import SPLITS, ArraySplit, resolve_normalization
from raysim.core.errors import UserError
from raysim.core.files import write_atomically, write_bytes

FORMAT_VERSION = 1
SCHEMA = pa.schema([
    ("client_id", pa.int64()),
    ("domain", pa.string()),
    ("split", pa.string()),
    ("position", pa.int64()),
    ("label", pa.int64()),
    ("image", pa.binary()),
])


def resolve_uri(uri_or_path, filesystem) -> tuple[pafs.FileSystem, str]:
    s = os.fspath(uri_or_path)
    if filesystem is not None:
        return filesystem, s.rstrip("/") or "/"
    if "://" in s:
        try:
            return pafs.FileSystem.from_uri(s)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError) as e:
            raise UserError(f"shards: cannot open {s}: {e}") from None
    return pafs.LocalFileSystem(), os.path.abspath(s)


def _file_name(first: int) -> str:
    return f"clients-{first:07d}.parquet"


def _encode(images: np.ndarray, fmt: str) -> list[bytes]:
    if fmt == "raw":
        return [img.tobytes() for img in images]
    from PIL import Image

    out = []
    for img in images:
        buf = io.BytesIO()
        Image.fromarray(img[..., 0] if img.shape[-1] == 1 else img).save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


def _decode(blobs, fmt: str, shape_hwc: tuple[int, int, int]) -> np.ndarray:
    n = len(blobs)
    out = np.empty((n,) + shape_hwc, np.uint8)
    if fmt == "raw":
        for i, b in enumerate(blobs):
            out[i] = np.frombuffer(b, np.uint8).reshape(shape_hwc)
        return out
    from PIL import Image

    for i, b in enumerate(blobs):
        a = np.asarray(Image.open(io.BytesIO(b)))
        out[i] = a.reshape(shape_hwc)
    return out


def _client_table(ds, part: Partition, cid: int, fmt: str) -> pa.Table:
    shard = part.shard(cid)
    cols = {k: [] for k in SCHEMA.names}
    for s in SPLITS:
        split, pos = client_data(ds, shard, s)
        if pos.size == 0:
            continue
        imgs = split.images(pos)
        n = pos.size
        cols["client_id"] += [cid] * n
        cols["domain"] += [shard.domain] * n
        cols["split"] += [s] * n
        cols["position"] += pos.tolist()
        cols["label"] += split.labels[pos].tolist()
        cols["image"] += _encode(imgs, fmt)
    return pa.table(cols, schema=SCHEMA)


INDEX_SCHEMA = pa.schema([("client_id", pa.int64()), ("train", pa.int64()), ("val", pa.int64()),
                          ("test", pa.int64())])


def _check_uniform(ds, part: Partition) -> None:
    """A manifest holds one normalisation and one augmentation preset: refuse data that has more."""
    seen = set()
    for d in part.domains:
        s = ds.split(d, "train")
        name = preset_name(s.augment)
        if name is None:
            raise UserError(f"shards: domain {d!r} uses a custom augmentation ({s.augment!r}); shards can "
                            "only record a named preset")
        seen.add((tuple(s.mean), tuple(s.std), name))
    if len(seen) > 1:
        raise UserError(f"shards: the domains use different normalisations or augmentations {sorted(seen)}; "
                        "shards need one for all")


def write_shards(ds, part: Partition, uri_or_path, filesystem: pafs.FileSystem | None = None,
                 image_format: str = "raw", clients_per_file: int = 1, config: dict | None = None) -> str:
    """Write every client of ``part`` under ``uri_or_path``; returns the root path used.

    ``image_format``: 'raw' (uint8 bytes, fastest to read) or 'png' (smaller). ``config``
    (JSON-able) is stored in the manifest, so a reader can check the shards were cut for it.
    """
    if image_format not in ("raw", "png"):
        raise UserError(f"shards: image_format={image_format!r}: expected 'raw' or 'png'")
    if int(clients_per_file) < 1:
        raise UserError(f"shards: clients_per_file={clients_per_file}: expected >= 1")
    _check_uniform(ds, part)
    fs, root = resolve_uri(uri_or_path, filesystem)
    fs.create_dir(root, recursive=True)
    c, h, w = ds.image_shape
    first = ds.split(part.domain(0), "train") if part.num_clients else None
    manifest = {
        "format_version": FORMAT_VERSION, "dataset": ds.name, "domains": list(part.domains),
        "classes": list(ds.classes), "image_shape": [c, h, w], "image_format": image_format,
        "num_clients": part.num_clients, "clients_per_file": int(clients_per_file),
        "mean": list(first.mean) if first is not None else None,
        "std": list(first.std) if first is not None else None,
        # a preset name, so readers rebuild the same train-time augmentation
        "augment": preset_name(first.augment) if first is not None else None,
        "augment_repr": repr(first.augment) if first is not None else None,
        "partition": {"spec": part.spec, "seed": part.seed},
        # [domain, first client id, clients]: a client's domain even when it holds no rows
        "domain_blocks": [[d, int(r.start), len(r)] for d, r in ((d, part.clients(d)) for d in part.domains)],
        "config": config,
    }
    meta = {b"raysim": json.dumps({"image_shape": [c, h, w], "image_format": image_format}).encode()}
    k = int(clients_per_file)
    for first in range(0, part.num_clients, k):
        clients = range(first, min(first + k, part.num_clients))

        def write_clients(tmp: str, clients=clients) -> None:
            with fs.open_output_stream(tmp) as out:
                with pq.ParquetWriter(out, SCHEMA.with_metadata(meta)) as writer:
                    for cid in clients:
                        t = _client_table(ds, part, cid, image_format)
                        if t.num_rows:  # one row group per client (none for an empty client)
                            writer.write_table(t, row_group_size=max(t.num_rows, 1))

        write_atomically(posixpath.join(root, _file_name(first)), write_clients, filesystem=fs)
    index = pa.table({"client_id": np.arange(part.num_clients, dtype=np.int64),
                      **{s: np.asarray(part.all_num_samples(s), np.int64) for s in SPLITS}}, schema=INDEX_SCHEMA)

    def write_index(tmp: str) -> None:
        with fs.open_output_stream(tmp) as out:
            pq.write_table(index, out)

    write_atomically(posixpath.join(root, "index.parquet"), write_index, filesystem=fs)
    # the manifest last: a folder with a manifest is complete
    write_bytes(posixpath.join(root, "manifest.json"), json.dumps(manifest, indent=1, default=str).encode(),
                filesystem=fs)
    return root


@dataclass
class ShardData:
    """One client's data read back: ``Split``-like arrays per split, ready for training."""

    client_id: int
    domain: str | None
    splits: dict = field(default_factory=dict)     # split -> ArraySplit
    positions: dict = field(default_factory=dict)  # split -> positions in the source dataset split

    def split(self, which: str) -> ArraySplit:
        return self.splits[which]

    @property
    def train(self) -> ArraySplit:
        return self.splits["train"]

    @property
    def val(self) -> ArraySplit:
        return self.splits["val"]

    @property
    def test(self) -> ArraySplit:
        return self.splits["test"]


def read_manifest(uri_or_path, filesystem: pafs.FileSystem | None = None) -> dict:
    fs, root = resolve_uri(uri_or_path, filesystem)
    path = posixpath.join(root, "manifest.json")
    try:
        with fs.open_input_stream(path) as f:
            return json.loads(f.read().decode())
    except (FileNotFoundError, OSError) as e:
        raise UserError(f"shards: {path} cannot be read ({e}); is this a raysim shard folder?") from None


def read_index(uri_or_path, filesystem: pafs.FileSystem | None = None) -> pa.Table:
    """Every client's train/val/test counts (columns client_id, train, val, test)."""
    fs, root = resolve_uri(uri_or_path, filesystem)
    path = posixpath.join(root, "index.parquet")
    try:
        with fs.open_input_file(path) as f:
            return pq.read_table(f)
    except (FileNotFoundError, OSError) as e:
        raise UserError(f"shards: {path} cannot be read ({e}); rewrite the shards with this raysim") from None


def read_shard(uri_or_path, client_id: int, filesystem: pafs.FileSystem | None = None,
               manifest: dict | None = None, augment=None, cache: str = "auto") -> ShardData:
    """Read only ``client_id``'s row group back as a ``ShardData`` of ArraySplits.

    Normalisation and augmentation follow the manifest (pass ``augment`` to override);
    pass a ``manifest`` already read to skip that small read per client. ``cache`` is the
    ArraySplit float-cache mode ('none' keeps only the uint8 images: 4x less memory per client,
    the same values, normalised per batch).
    """
    fs, root = resolve_uri(uri_or_path, filesystem)
    m = manifest or read_manifest(root, fs)
    cid = int(client_id)
    if not 0 <= cid < m["num_clients"]:
        raise UserError(f"shards: client {cid} outside 0..{m['num_clients'] - 1} in {root}")
    k = m["clients_per_file"]
    path = posixpath.join(root, _file_name(cid - cid % k))
    try:
        f = fs.open_input_file(path)
    except (FileNotFoundError, OSError) as e:
        raise UserError(f"shards: {path} cannot be opened ({e})") from None
    with f:
        pf = pq.ParquetFile(f)
        col = pf.schema_arrow.get_field_index("client_id")
        groups = []
        for g in range(pf.num_row_groups):
            st = pf.metadata.row_group(g).column(col).statistics
            if st is None or not st.has_min_max or st.min <= cid <= st.max:
                groups.append(g)
        table = pf.read_row_groups(groups) if groups else SCHEMA.empty_table()
    if table.num_rows:
        table = table.filter(pc.equal(table["client_id"], cid))
    c, h, w = m["image_shape"]
    mean, std = resolve_normalization((m["mean"], m["std"]), c) if m.get("mean") else resolve_normalization("none", c)
    aug = make_augment(augment if augment is not None else m.get("augment"))
    split_col = np.asarray(table["split"].to_pylist(), dtype=object)
    images = table["image"].to_pylist()
    labels = table["label"].to_numpy()
    positions = table["position"].to_numpy()
    domain = next((d for d, first, n in m.get("domain_blocks", []) if first <= cid < first + n), None)
    out = ShardData(cid, domain)
    for s in SPLITS:
        sel = np.flatnonzero(split_col == s)
        x = _decode([images[i] for i in sel], m["image_format"], (h, w, c))
        out.splits[s] = ArraySplit(np.ascontiguousarray(x.transpose(0, 3, 1, 2)), labels[sel], mean, std, aug,
                                   cache=cache)
        out.positions[s] = positions[sel]
    return out
