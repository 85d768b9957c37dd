"""A federation's folder knows the config that wrote it: the check that it is the config being run.

Every piece of a federation's state records the fingerprint of its config
(:func:`raysim.engine.checkpoint.config_fingerprint`): each checkpoint's meta.json (``config``),
status.json (``config``) and metrics.parquet (its schema's metadata,
:data:`raysim.engine.metrics.CONFIG_KEY`). :func:`check` refuses, in one line, a folder whose state
does not match: state without a config.yaml (no one can tell which config wrote it), a config.yaml
edited after its run (its fingerprint is not the one the state records), and state of another
config (e.g. another run's checkpoints). A run folder is resumed, continued or called finished
only for its own config.

Folders written before status.json and metrics.parquet carried the fingerprint: such a piece
contradicts nothing. Their checkpoints always recorded it (format 2 on), and are checked; a
folder without any fingerprinted piece is taken as its config.yaml says.
"""
from __future__ import annotations

import json
import os

from raysim.core.errors import UserError
from raysim.engine import checkpoint
from raysim.engine.metrics import recorded_config as metrics_config

CONFIG = "config.yaml"
STATUS = "status.json"
METRICS = "metrics.parquet"


def read_status(run_dir: str) -> dict:
    """The federation's status.json ({} when it has none or it does not read)."""
    try:
        with open(os.path.join(run_dir, STATUS), encoding="utf-8") as fh:
            status = json.load(fh)
    except (OSError, ValueError):
        return {}
    return status if isinstance(status, dict) else {}


def recorded(run_dir: str) -> dict[str, str | None]:
    """{piece of state: the config fingerprint it records} for each piece in ``run_dir``
    (status.json, metrics.parquet, ``checkpoints/round-NNNNNN``); None for a piece written before
    it carried one, or too damaged to say."""
    out: dict[str, str | None] = {}
    if os.path.isfile(os.path.join(run_dir, STATUS)):
        config = read_status(run_dir).get("config")
        out[STATUS] = config if isinstance(config, str) else None
    if os.path.isfile(os.path.join(run_dir, METRICS)):
        out[METRICS] = metrics_config(os.path.join(run_dir, METRICS))
    for rnd in checkpoint.list_rounds(run_dir):
        out[f"checkpoints/round-{rnd:06d}"] = checkpoint.recorded_config(run_dir, rnd)
    return out


def check(run_dir: str, cfg) -> None:
    """Refuse (a one-line UserError saying what is wrong and what to do) a federation folder
    whose state is not ``cfg``'s; a folder without state passes."""
    state = recorded(run_dir)
    if not state:
        return
    config_path = os.path.join(run_dir, CONFIG)
    if not os.path.isfile(config_path):
        raise UserError(f"{run_dir} holds a run's {_named(state)} but no {CONFIG}, so which config wrote them "
                        f"cannot be told; choose another --out (or put that run's {CONFIG} back to continue it)")
    known = {piece: config for piece, config in state.items() if config is not None}
    if not known:  # written before status.json and metrics.parquet carried the fingerprint, no checkpoint
        return
    written = _fingerprint_of(config_path)
    configs = set(known.values())
    if len(configs) == 1 and written not in configs:
        raise UserError(f"{config_path} does not match its run's state: {_named(known)} {_record(known)} config "
                        f"{configs.pop()}, {CONFIG} is config {written} (edited after the run, or another run's "
                        f"state left in the folder); put back the {CONFIG} the run was written with, or run "
                        "this config with another --out")
    this = checkpoint.config_fingerprint(cfg)
    foreign = {piece: config for piece, config in known.items() if config != this}
    if foreign:
        raise UserError(f"{run_dir} holds {_named(foreign)} of another config (config "
                        f"{', '.join(sorted(set(foreign.values())))}; this run's is config {this}); "
                        "choose another --out")


def _fingerprint_of(config_path: str) -> str:
    """The fingerprint of a folder's config.yaml as a resume loads it."""
    from raysim.config import load_config
    from raysim.methods import registry
    try:
        return checkpoint.config_fingerprint(load_config(config_path, method_key=registry.name_of))
    except UserError as err:
        raise UserError(f"{config_path} does not load ({err}); it cannot be checked against its run's "
                        "state") from None


def _named(pieces) -> str:
    """status.json, metrics.parquet and the checkpoints of rounds 4, 8."""
    rounds = [int(p.rsplit("-", 1)[1]) for p in pieces if p.startswith("checkpoints/")]
    names = [p for p in pieces if not p.startswith("checkpoints/")]
    if rounds:
        names.append(f"the checkpoint{'s' if len(rounds) > 1 else ''} of round{'s' if len(rounds) > 1 else ''} "
                     f"{', '.join(map(str, rounds))}")
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _record(pieces) -> str:
    return "records" if len(pieces) == 1 else "record"
