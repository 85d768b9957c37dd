"""Checkpoints of a whole federation: server state, every client's state, the metrics so far.

Layout: ``RUN_DIR/checkpoints/round-000012/{meta.json, server.pt, clients.pt, metrics.parquet}``.
A checkpoint is written into ``round-000012.tmp`` and renamed into place, so a crash mid-write
leaves the previous one intact. Tensors are stored with ``torch.save`` and read back with
``torch.load(weights_only=True)``: loading never executes code. The sampler and every generator
are keyed by (seed, round, client), so the round number is their whole position.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil

import pyarrow.parquet as pq

from raysim.errors import UserError

FORMAT_VERSION = 2  # 2: a client is stored as {"state": ..., "trained": ...} (the engine never writes into method state)
_FILES = ("meta.json", "server.pt", "clients.pt", "metrics.parquet")


def config_fingerprint(cfg) -> str:
    """What a checkpoint must agree with to be resumed: everything but where and how it runs."""
    d = cfg.to_dict()
    d.pop("runtime", None)
    d.pop("checkpoint", None)
    d.pop("name", None)
    d.pop("paper", None)
    d.pop("tracking", None)
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def checkpoint_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def write(run_dir: str, rnd: int, cfg, server_state: dict, client_states: dict, metrics_table, keep: int) -> str:
    root = checkpoint_dir(run_dir)
    final = os.path.join(root, f"round-{rnd:06d}")
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    import torch  # not at the top: the driver of a run without checkpoints never needs torch

    torch.save(server_state, os.path.join(tmp, "server.pt"))
    torch.save(client_states, os.path.join(tmp, "clients.pt"))
    pq.write_table(metrics_table, os.path.join(tmp, "metrics.parquet"))
    meta = {"format_version": FORMAT_VERSION, "round": rnd, "method": cfg.method,
            "config": config_fingerprint(cfg), "clients": len(client_states)}
    with open(os.path.join(tmp, "meta.json"), "w", encoding="utf-8") as fh:
        json.dump(meta, fh)
    for name in _FILES:  # durable before the rename makes it visible
        _fsync(os.path.join(tmp, name))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in list_rounds(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(os.path.join(root, f"round-{old:06d}"), ignore_errors=True)
    return final


def _fsync(path: str) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


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


def read(run_dir: str, rnd: int, cfg) -> dict:
    """Load one checkpoint; any damage or mismatch is a UserError naming the file."""
    d = os.path.join(checkpoint_dir(run_dir), f"round-{rnd:06d}")
    meta_path = os.path.join(d, "meta.json")
    try:
        with open(meta_path, encoding="utf-8") as fh:
            meta = json.load(fh)
    except (OSError, ValueError) as err:
        raise UserError(f"checkpoint file {meta_path} is unreadable ({_first_line(err)})") from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise UserError(f"checkpoint {d} has format version {meta.get('format_version')!r}; this raysim "
                        f"reads version {FORMAT_VERSION}")
    if meta.get("config") != config_fingerprint(cfg):
        raise UserError(f"checkpoint {d} was written by a different config (method, data, model, train, "
                        "eval, seed or rounds changed); resume with the run's own config.yaml")
    import torch

    out = {"round": meta["round"]}
    for key, name in (("server", "server.pt"), ("clients", "clients.pt")):
        path = os.path.join(d, name)
        try:
            out[key] = torch.load(path, weights_only=True)
        except Exception as err:  # truncated, corrupted, or not a checkpoint at all
            raise UserError(f"checkpoint file {path} is unreadable ({_first_line(err)})") from None
    path = os.path.join(d, "metrics.parquet")
    try:
        out["metrics"] = pq.read_table(path)
    except Exception as err:
        raise UserError(f"checkpoint file {path} is unreadable ({_first_line(err)})") from None
    return out


def latest(run_dir: str, cfg, warn=print) -> dict | None:
    """The newest readable checkpoint (falling back past damaged ones, each named in a warning)."""
    for rnd in reversed(list_rounds(run_dir)):
        try:
            return read(run_dir, rnd, cfg)
        except UserError as err:
            if "different config" in str(err) or "format version" in str(err):
                raise
            warn(f"raysim: warning: {err}; trying the previous checkpoint")
    return None


def _first_line(err: Exception) -> str:
    text = str(err).strip().splitlines()
    return text[0][:200] if text else type(err).__name__
