"""Checkpoints of a whole federation: server state, every client's state, the metrics so far.

Layout: ``RUN_DIR/checkpoints/round-000012/{meta.json, server.pt, clients.pt, metrics.parquet}``.
A checkpoint is written into ``round-000012.tmp`` and renamed into place, so a crash mid-write
leaves the previous one intact; a write that fails (no space, no permission, a read-only file
system) removes its ``.tmp`` folder and re-raises the original error. Tensors are stored with
``torch.save`` and read back with ``torch.load(weights_only=True)``: loading never executes code.
The sampler and every generator are keyed by (seed, round, client), so the round number is their
whole position.

meta.json is the checkpoint's manifest: the round, the config fingerprint, and the SHA-256 of
every other file (``"sha256": {"server.pt": ..., "clients.pt": ..., "metrics.parquet": ...}``).
Loading checks them before reading a file, and checks the loaded server and client state for
NaN or infinite values; either fault makes the checkpoint unreadable, so :func:`latest` falls
back to the one before (and, with none left, the run starts again from round 1).

``checkpoint.keep`` prunes only the checkpoints of the config being written (meta.json's
``config``) older than the one just written: another config's in the folder (which
:mod:`raysim.engine.runstate` refuses before a run starts) never push this run's own out.

Format versions: 3 (this one) adds the checksums. Format 2 (the same files, no ``sha256``) still
loads, unverified, with a one-line warning; anything else is refused.
"""
from __future__ import annotations

import functools
import dataclasses
import hashlib
import json
import os
import shutil

import pyarrow.parquet as pq

from raysim.core.errors import UserError, first_line
from raysim.core.files import write_atomically

FORMAT_VERSION = 3  # 3: meta.json holds each file's SHA-256; 2: a client is {"state": ..., "trained": ...}
READABLE_VERSIONS = (2, 3)  # 2 loads unverified (no checksums), with a warning
_DATA_FILES = ("server.pt", "clients.pt", "metrics.parquet")  # checksummed in meta.json
_FILES = ("meta.json", *_DATA_FILES)


def config_fingerprint(cfg) -> str:
    """What a checkpoint must agree with to be resumed: everything but where and how it runs."""
    d = cfg.to_dict()
    d.pop("runtime", None)
    d.pop("checkpoint", None)
    d.pop("name", None)
    d.pop("paper", None)
    d.pop("tracking", None)
    if "server" in d and _default_server(d["server"], type(cfg.server)):
        d.pop("server")  # the fingerprint of every run before server optimizers existed
    if d.get("clients", {}).get("selection") == dataclasses.asdict(type(cfg.clients.selection)()):
        d["clients"].pop("selection")  # uniform: the fingerprint of every run before selections were a setting
    for key, cls in (("schedule", type(cfg.schedule)), ("stop", type(cfg.stop))):
        if d.get(key) == dataclasses.asdict(cls()):
            d.pop(key)  # the defaults: the fingerprint of every run before schedules existed
    if d.get("eval", {}).get("every_s", 0) is None:
        d["eval"].pop("every_s")
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _default_server(section: dict, cls) -> bool:
    """The ``server`` section at its defaults, or as every config.yaml written before the betas
    followed the form recorded it (betas [0.9, 0.99], then everyone's default): either way the
    fingerprint runs had before, so their folders still resume (with the betas their config.yaml says)."""
    default = dataclasses.asdict(cls())
    return section == default or {**section, "betas": None} == default and list(section["betas"] or ()) == [0.9, 0.99]


def checkpoint_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def write(run_dir: str, rnd: int, cfg, server_state: dict, client_states: dict, metrics_table, keep: int) -> str:
    """Write round ``rnd``'s checkpoint. Any failure (an OSError such as ENOSPC, EACCES or EROFS,
    or an interrupt) removes the partial ``round-NNNNNN.tmp`` and re-raises the original error
    unchanged; earlier checkpoints are never touched before the new one is complete."""
    root = checkpoint_dir(run_dir)
    final = os.path.join(root, f"round-{rnd:06d}")
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    import torch  # not at the top: the driver of a run without checkpoints never needs torch

    try:
        os.makedirs(tmp)
        for name, obj in (("server.pt", server_state), ("clients.pt", client_states)):
            write_atomically(os.path.join(tmp, name), functools.partial(_save, torch, obj), keep_error=True)
        write_atomically(os.path.join(tmp, "metrics.parquet"), lambda path: pq.write_table(metrics_table, path),
                         keep_error=True)
        sha256 = {name: _digest_and_sync(os.path.join(tmp, name)) for name in _DATA_FILES}
        meta = {"format_version": FORMAT_VERSION, "round": rnd, "method": cfg.method,
                "config": config_fingerprint(cfg), "clients": len(client_states), "sha256": sha256}
        write_atomically(os.path.join(tmp, "meta.json"), functools.partial(_write_meta, meta), keep_error=True)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)  # the folder appears whole: the one rename outside raysim.core.files
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _sync_dir(root)
    if keep > 0:
        _prune(run_dir, rnd, meta["config"], keep)
    return final


def _prune(run_dir: str, rnd: int, config: str, keep: int) -> None:
    """Delete the checkpoints of ``config`` older than round ``rnd``'s, beyond the newest ``keep``
    (round ``rnd``'s counted). Never the one just written or a newer one, never another config's
    nor one whose meta.json does not say (pruning by round number alone once deleted a run's own
    checkpoints where another run's higher-numbered ones sat in the folder)."""
    older = [r for r in list_rounds(run_dir) if r < rnd and recorded_config(run_dir, r) == config]
    for old in older[:max(len(older) - (keep - 1), 0)]:
        shutil.rmtree(os.path.join(checkpoint_dir(run_dir), f"round-{old:06d}"), ignore_errors=True)


def recorded_config(run_dir: str, rnd: int) -> str | None:
    """The config fingerprint round ``rnd``'s checkpoint records in its meta.json; None where
    meta.json is unreadable (the resume falls back past such a checkpoint)."""
    meta = _read_json(os.path.join(checkpoint_dir(run_dir), f"round-{rnd:06d}", "meta.json"))
    config = (meta or {}).get("config")
    return config if isinstance(config, str) else None


def _read_json(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write_meta(meta: dict, path: str) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(meta, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())  # every file durable before the rename makes the folder visible


def _save(torch, obj, path: str) -> None:
    """torch.save that fails with the file system's own OSError (ENOSPC, EDQUOT, EIO...): torch
    turns a failed write into a RuntimeError ("unexpected pos", "file write failed") that hides
    it, so the writes go through a sink that keeps the first OSError and raises it afterwards."""
    with open(path, "wb") as fh:
        sink = _Sink(fh)
        torch.save(obj, sink)
        if sink.error is not None:
            raise sink.error
        fh.flush()  # a buffered tail that no longer fits fails here, as an OSError


class _Sink:
    def __init__(self, fh):
        self.fh, self.error = fh, None

    def write(self, data) -> int:
        size = memoryview(data).nbytes
        if self.error is None:
            try:
                self.fh.write(data)
            except OSError as err:
                self.error = err  # the rest is dropped: the file is discarded anyway
        return size

    def flush(self) -> None:
        if self.error is None:
            try:
                self.fh.flush()
            except OSError as err:
                self.error = err


def _digest_and_sync(path: str) -> str:
    """The file's SHA-256 as it reads back, and the file flushed to disk."""
    with open(path, "rb") as fh:
        digest = hashlib.file_digest(fh, "sha256").hexdigest()
        os.fsync(fh.fileno())
    return digest


def _digest(path: str) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _sync_dir(path: str) -> None:
    """Make the rename durable (best effort: not every file system lets a directory be synced)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def list_rounds(run_dir: str) -> list[int]:
    root = checkpoint_dir(run_dir)
    if not os.path.isdir(root):
        return []
    rounds = []
    for name in os.listdir(root):
        if name.startswith("round-") and not name.endswith(".tmp"):
            try:
                rounds.append(int(name[len("round-"):]))
            except ValueError:
                continue
    return sorted(rounds)


def read(run_dir: str, rnd: int, cfg, warn=None) -> dict:
    """Load one checkpoint; any damage or mismatch is a UserError naming the file. ``warn``
    (a callable taking one line) hears about a format-2 checkpoint, which has no checksums."""
    d = os.path.join(checkpoint_dir(run_dir), f"round-{rnd:06d}")
    meta_path = os.path.join(d, "meta.json")
    try:
        with open(meta_path, encoding="utf-8") as fh:
            meta = json.load(fh)
        if not isinstance(meta, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as err:
        raise UserError(f"checkpoint file {meta_path} is unreadable ({first_line(err, limit=200)})") from None
    version = meta.get("format_version")
    if version not in READABLE_VERSIONS:
        raise UserError(f"checkpoint {d} has format version {version!r}; this raysim reads versions "
                        f"{', '.join(map(str, READABLE_VERSIONS))}")
    if meta.get("round") != rnd:
        raise UserError(f"checkpoint file {meta_path} is damaged (it says round {meta.get('round')!r} "
                        f"in the folder of round {rnd})")
    if meta.get("config") != config_fingerprint(cfg):
        raise UserError(f"checkpoint {d} was written by a different config (method, data, model, train, "
                        "eval, seed or rounds changed); resume with the run's own config.yaml")
    sha256 = meta.get("sha256") if version >= 3 else None
    if version >= 3 and not (isinstance(sha256, dict) and all(isinstance(sha256.get(n), str) for n in _DATA_FILES)):
        raise UserError(f"checkpoint file {meta_path} is damaged (its sha256 table is missing or incomplete)")
    if sha256 is None and warn is not None:
        warn(f"raysim: warning: checkpoint {d} is format {version}, without checksums: loading it unverified")
    import torch

    def verified(name: str) -> str:
        path = os.path.join(d, name)
        if sha256 is not None:
            try:
                ok = _digest(path) == sha256[name]
            except OSError as err:
                raise UserError(f"checkpoint file {path} is unreadable ({first_line(err, limit=200)})") from None
            if not ok:
                raise UserError(f"checkpoint file {path} is unreadable: damaged (its SHA-256 is not "
                                "the one meta.json recorded)")
        return path

    out = {"round": meta["round"]}
    for key, name in (("server", "server.pt"), ("clients", "clients.pt")):
        path = verified(name)
        try:
            out[key] = torch.load(path, weights_only=True)
        except Exception as err:  # truncated, corrupted, or not a checkpoint at all
            raise UserError(f"checkpoint file {path} is unreadable ({first_line(err, limit=200)})") from None
        where = _non_finite(out[key], torch)
        if where is not None:
            if sha256 is None:
                raise UserError(f"checkpoint damaged: {path} (round {rnd}) holds NaN or infinite values "
                                f"at {where}")
            raise UserError(f"checkpoint {path} (round {rnd}) holds NaN or infinite values at {where} "
                            "although its checksum matches: the state was already non-finite when it was "
                            "written")
    path = verified("metrics.parquet")
    try:
        out["metrics"] = pq.read_table(path)
    except Exception as err:
        raise UserError(f"checkpoint file {path} is unreadable ({first_line(err, limit=200)})") from None
    return out


def _non_finite(obj, torch, where: str = "") -> str | None:
    """Where (a key path such as ``[3]['state']['fc.weight']``) the first floating-point tensor
    holding a NaN or an infinity sits in a loaded state, or None."""
    if isinstance(obj, torch.Tensor):
        if (obj.is_floating_point() or obj.is_complex()) and not bool(torch.isfinite(obj).all()):
            return where or "the top level"
        return None
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        return None
    for k, v in items:
        found = _non_finite(v, torch, f"{where}[{k!r}]")
        if found is not None:
            return found
    return None


def latest(run_dir: str, cfg, warn=print) -> dict | None:
    """The newest readable checkpoint, falling back past damaged ones (each named in a one-line
    warning); None when none is left, and the run starts again from round 1."""
    rounds = list_rounds(run_dir)
    for i in reversed(range(len(rounds))):
        try:
            return read(run_dir, rounds[i], cfg, warn=warn)
        except UserError as err:
            if "different config" in str(err) or "format version" in str(err):
                raise
            then = "trying the previous checkpoint" if i else "no checkpoint left: starting again from round 1"
            warn(f"raysim: warning: {err}; {then}")
    return None


def intact(run_dir: str) -> str:
    """What the federation's folder still holds: its newest checkpoint and metrics.parquet's rounds."""
    rounds = list_rounds(run_dir)
    parts = [f"the checkpoint of round {rounds[-1]} is intact" if rounds else "no checkpoint was written"]
    path = os.path.join(run_dir, "metrics.parquet")
    if os.path.isfile(path):
        try:
            import pyarrow.compute as pc
            import pyarrow.parquet as pq
            last = pc.max(pq.read_table(path, columns=["round"]).column("round")).as_py()
            parts.append(f"metrics.parquet holds rounds up to {last}")
        except Exception:  # damaged by the failed write
            parts.append("metrics.parquet is unreadable")
    return ", ".join(parts)
