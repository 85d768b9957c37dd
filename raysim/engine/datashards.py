"""A federation's client data read from pre-written Parquet shards (``data.shards: URI``).

``raysim data shard CONFIG URI`` cuts the config's partition once and writes it with
``raysim.data.shards.write_shards`` on any ``pyarrow.fs`` filesystem (a local path,
``file://``, ``s3://``, ``gs://``, ``hdfs://``). A run with ``data.shards: URI`` then never
loads the dataset: the server and the driver read only the small manifest and index (domains,
classes, image shape, per-client sample counts), and each ClientHost reads only its own
clients' row groups, on whichever node it was placed. Same partition, same normalisation and
augmentation preset, same arrays: the metrics equal the run that loads the dataset itself.

Layout under URI::

    federation.json                 what the shards were cut for (dataset, options, partition,
                                    seed), the dataset's domains, the held-out domains (if any)
    manifest.json, index.parquet, clients-*.parquet      the partition's clients
    holdout-<domain>/source/...     leave-one-domain-out: the source clients of that federation
    holdout-<domain>/target/...     and its unseen-domain client

A run checks ``federation.json`` against its own config and refuses shards cut for another
dataset, options, partition or seed with one line saying which key differs.
"""
from __future__ import annotations

import json
import posixpath

import numpy as np
import pyarrow.fs as pafs

from raysim.data.shards import read_index, resolve_uri, read_manifest, read_shard
from raysim.data.splits import SPLITS
from raysim.core.errors import UserError, first_line

INDEX_FILE = "federation.json"
FORMAT_VERSION = 1


def fingerprint(cfg) -> dict:
    """What determines the clients' data: dataset, its options, the partition (less the per-run
    holdout), the seed. JSON-normalised so it compares equal after a round trip."""
    spec = dict(cfg.data.partition)
    spec.pop("holdout", None)
    raw = {"dataset": cfg.data.dataset, "options": dict(cfg.data.options), "partition": spec,
           "seed": int(cfg.seed)}
    return json.loads(json.dumps(raw, sort_keys=True, default=str))


def holdout_dir(root: str, holdout: str, role: str) -> str:
    return posixpath.join(root, f"holdout-{holdout}", role)


def _read_json(fs, path: str, what: str) -> dict:
    try:
        with fs.open_input_stream(path) as f:
            return json.loads(f.read().decode())
    except (FileNotFoundError, OSError, ValueError) as e:
        raise UserError(f"data.shards: {path} cannot be read ({first_line(e)}); {what}") from None


def open_index(uri: str) -> tuple[pafs.FileSystem, str, dict]:
    fs, root = resolve_uri(uri, None)
    index = _read_json(fs, posixpath.join(root, INDEX_FILE), "write the shards with: raysim data shard CONFIG URI")
    if index.get("format_version") != FORMAT_VERSION:
        raise UserError(f"data.shards: {uri} has format version {index.get('format_version')}; this raysim "
                        f"reads {FORMAT_VERSION}; rewrite them with: raysim data shard CONFIG URI")
    return fs, root, index


def check_matches(cfg, index: dict, uri: str) -> None:
    want, have = fingerprint(cfg), index.get("config") or {}
    for key in ("dataset", "options", "partition", "seed"):
        if want.get(key) != have.get(key):
            raise UserError(f"data.shards: {uri} was cut for {key} = {have.get(key)!r} but this run has "
                            f"{want.get(key)!r}; rewrite them with: raysim data shard CONFIG {uri}")


def dataset_domains(cfg) -> list[str]:
    """The dataset's domains, from the shards' index when ``data.shards`` is set (no data load)."""
    if cfg.data.shards:
        _, _, index = open_index(cfg.data.shards)
        check_matches(cfg, index, cfg.data.shards)
        return list(index["domains"])
    from raysim.data import load
    return list(load(cfg.data.dataset, root=cfg.data.root, seed=cfg.seed, **cfg.data.options).domains)


class ShardPartition:
    """The parts of ``raysim.data.partition.Partition`` the engine uses, from a shard manifest:
    client ids, domains and sample counts without any image; ``read(cid)`` fetches one client."""

    def __init__(self, fs: pafs.FileSystem, root: str, manifest: dict | None = None):
        self.fs, self.root = fs, root
        self.manifest = m = manifest or read_manifest(root, fs)
        self.num_clients = int(m["num_clients"])
        self.domains = tuple(m["domains"])
        self.spec = dict(m["partition"]["spec"])
        self.seed = int(m["partition"]["seed"])
        self._blocks = [(d, int(first), int(n)) for d, first, n in m["domain_blocks"]]
        self._counts = None

    def __len__(self) -> int:
        return self.num_clients

    def _check(self, cid: int) -> int:
        cid = int(cid)
        if not 0 <= cid < self.num_clients:
            raise IndexError(f"client id {cid} outside 0..{self.num_clients - 1}")
        return cid

    def domain(self, cid: int) -> str:
        cid = self._check(cid)
        return next(d for d, first, n in self._blocks if first <= cid < first + n)

    def clients(self, domain: str) -> range:
        for d, first, n in self._blocks:
            if d == domain:
                return range(first, first + n)
        raise UserError(f"no clients of domain {domain!r}; these shards have {', '.join(self.domains)}")

    def _index(self) -> dict:
        if self._counts is None:
            t = read_index(self.root, self.fs)
            self._counts = {s: t[s].to_numpy() for s in SPLITS}
        return self._counts

    def all_num_samples(self, split: str = "train") -> np.ndarray:
        if split not in SPLITS:
            raise UserError(f"split {split!r} is not one of {', '.join(SPLITS)}")
        return self._index()[split]

    def num_samples(self, cid: int, split: str = "train") -> int:
        return int(self.all_num_samples(split)[self._check(cid)])

    def read(self, cid: int):
        """One client's ShardData (ArraySplits per split), reading only its row group. Its images
        stay uint8 and are normalised per batch (a float copy per client would take 4x the memory
        on a host of thousands of clients; the values are the same)."""
        return read_shard(self.root, self._check(cid), filesystem=self.fs, manifest=self.manifest, cache="none")


class FederationShards:
    """The shards of one federation of ``cfg``: its clients and (leave-one-domain-out) its target."""

    def __init__(self, cfg):
        uri = cfg.data.shards
        fs, root, index = open_index(uri)
        check_matches(cfg, index, uri)
        self.uri, self.index = uri, index
        holdout = dict(cfg.data.partition).get("holdout")
        if holdout is None:
            if index.get("holdouts"):
                raise UserError(f"data.shards: {uri} holds leave-one-domain-out federations "
                                f"{index['holdouts']}; this run holds no domain out")
            self.partition, self.target = ShardPartition(fs, root), None
        else:
            if holdout not in (index.get("holdouts") or []):
                raise UserError(f"data.shards: {uri} holds no federation with domain {holdout!r} held out "
                                f"(it has {index.get('holdouts') or 'none'}); rewrite them with: "
                                f"raysim data shard CONFIG {uri}")
            self.partition = ShardPartition(fs, holdout_dir(root, holdout, "source"))
            self.target = ShardPartition(fs, holdout_dir(root, holdout, "target"))
        m = self.partition.manifest
        self.classes = tuple(m["classes"])
        self.num_classes = len(self.classes)
        self.image_shape = tuple(int(v) for v in m["image_shape"])
        self.domains = tuple(index["domains"])
