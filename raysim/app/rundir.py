"""The run folder's guards: one writer at a time, the same command resumes its own run, and a
failed write said in one line.

* :class:`RunLock`: ``RUN_DIR/raysim.lock`` holds the writer's pid, host and start time. A second
  ``raysim run`` on a held folder is refused; a lock whose holder is gone (same host and its pid
  dead or reused, the same Slurm job requeued, or another host's lock not refreshed for
  ``LOCK_STALE_S``) is taken over with a warning.
* :func:`holds_run_of`: whether ``RUN_DIR`` already holds a run of this config (then rerunning
  the same command resumes it); a different config there is refused, naming what differs.
* :class:`WriteFailed` and :func:`writing`: an ``OSError`` at a write (no space, no permission, a
  read-only file system) as one line naming the file and the original error; :func:`intact`
  says what the folder still holds.
* :func:`plan`: the federations of a config and their folders; :func:`method_dirs`,
  :func:`seed_dirs`, :func:`holdout_dirs` list them back from a run folder, and
  :func:`read_metrics`, :func:`read_config`, :func:`config_dict` read one (what ``report``,
  ``compare`` and the methods' summary sections see of a run).
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
import socket
import sys
import threading
import time

from raysim.core.errors import UserError, first_line
from raysim.core.files import write_json
from raysim.engine.datashards import dataset_domains

LOCK = "raysim.lock"
LOCK_REFRESH_S = 30.0  # the holder touches its lock this often ...
LOCK_STALE_S = 120.0  # ... and another host takes over a lock untouched this long


# ----------------------------------------------------------------------------- one writer

class RunLock:
    """``with RunLock(run_dir):`` the command's writer lock (see the module's docstring)."""

    def __init__(self, run_dir: str, warn=None):
        self.run_dir, self.path = run_dir, os.path.join(run_dir, LOCK)
        self.warn = warn or _warn
        self.me = {"pid": os.getpid(), "host": socket.gethostname(), "started": _process_start(os.getpid()),
                   "since": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)[:500],
                   "slurm_job": os.environ.get("SLURM_JOB_ID"),
                   "slurm_restart": _int(os.environ.get("SLURM_RESTART_COUNT"))}
        self._stop = threading.Event()
        self._thread = None

    def __enter__(self) -> "RunLock":
        os.makedirs(self.run_dir, exist_ok=True)
        for _ in range(3):  # a takeover races another taker at most once or twice
            try:  # the lock appears whole (a hard link of a written file), or not at all
                write_json(self.path, self.me, exclusive=True)
            except FileExistsError:
                holder = _read_json(self.path)
                gone = self._holder_gone(holder)
                if gone is None:
                    raise UserError(self._held_message(holder)) from None
                self.warn(f"raysim: warning: taking over {self.path} ({gone})")
                with contextlib.suppress(FileNotFoundError):
                    os.remove(self.path)
                continue
            self._thread = threading.Thread(target=self._refresh, name="raysim-lock", daemon=True)
            self._thread.start()
            return self
        raise UserError(self._held_message(_read_json(self.path)))

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        holder = _read_json(self.path)
        if holder and holder.get("pid") == self.me["pid"] and holder.get("host") == self.me["host"]:
            with contextlib.suppress(OSError):
                os.remove(self.path)

    def _refresh(self) -> None:
        """Keep the lock's mtime fresh: the sign of life a host that cannot see this pid reads."""
        while not self._stop.wait(LOCK_REFRESH_S):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def _holder_gone(self, holder: dict | None) -> str | None:
        """Why the holder is gone (the lock may be taken over), or None while it may be alive."""
        age = _age(self.path)
        if not holder:  # created but not yet written, or damaged: give a starting writer a moment
            return f"an unreadable lock file, {age:.0f} s old" if age > 10 else None
        pid, host = holder.get("pid"), holder.get("host")
        if host == self.me["host"]:
            if pid == self.me["pid"]:
                return None
            if not _pid_alive(pid):
                return f"left by pid {pid} on {host}, which is gone"
            started = holder.get("started")
            if started is not None and _process_start(pid) not in (None, started):
                return f"left by pid {pid} on {host}; that pid now belongs to another process"
            return None
        job = holder.get("slurm_job")
        if job and job == self.me["slurm_job"] and (holder.get("slurm_restart") or 0) < (self.me["slurm_restart"] or 0):
            return f"left by Slurm job {job} before it was requeued (restart {self.me['slurm_restart']})"
        if age > LOCK_STALE_S:
            return f"left by pid {pid} on {host}, not refreshed for {age:.0f} s"
        return None

    def _held_message(self, holder: dict | None) -> str:
        who = (f"pid {holder.get('pid')} on {holder.get('host')}, since {holder.get('since')}"
               if holder else "a raysim that is starting")
        tail = ""
        if holder and holder.get("host") != self.me["host"]:
            tail = (f"; a lock another host stops refreshing is taken over after {LOCK_STALE_S:.0f} s, or "
                    f"delete {self.path} if that run is gone")
        return (f"{self.run_dir} is being written by another raysim ({who}): one run per folder at a time; "
                f"wait for it or choose another --out{tail}")


def _pid_alive(pid) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    try:  # a zombie is as good as gone
        with open(f"/proc/{pid}/stat", encoding="utf-8") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _process_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux), to tell a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _age(path: str) -> float:
    try:
        return time.time() - os.stat(path).st_mtime
    except OSError:
        return 0.0


def _int(text) -> int | None:
    try:
        return int(text)
    except (TypeError, ValueError):
        return None


def _read_json(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


# ----------------------------------------------------------------------------- same command resumes

_PROGRESS = ("metrics.parquet", "status.json", "checkpoints")


def has_progress(run_dir: str) -> bool:
    """Whether any federation below ``run_dir`` got somewhere: metrics, a status or checkpoints."""
    return bool(progress(run_dir))


def progress(run_dir: str) -> list[str]:
    """The pieces of state below ``run_dir`` (its metrics, statuses, checkpoint folders), as paths
    relative to it."""
    found = []
    for root, dirs, names in os.walk(run_dir):
        found += [os.path.relpath(os.path.join(root, n), run_dir) for n in _PROGRESS if n in names or n in dirs]
        dirs[:] = sorted(d for d in dirs if d not in ("tb", "checkpoints"))
    return found


def holds_run_of(cfg, run_dir: str) -> bool:
    """True when ``run_dir`` holds a run of ``cfg`` that got somewhere (the command resumes it);
    False when it holds none. A run of another config (anything but ``runtime`` differs) is a
    UserError naming the first differences; so is a folder whose state does not match its own
    config.yaml (none there, one edited after the run, another config's checkpoints:
    :func:`raysim.engine.runstate.check`)."""
    path = os.path.join(run_dir, "config.yaml")
    found = progress(run_dir)
    if not found:
        return False
    if not os.path.isfile(path):
        raise UserError(f"--out {run_dir} holds a run's state ({', '.join(found[:3])}"
                        f"{' ...' if len(found) > 3 else ''}) but no config.yaml, so which config wrote it cannot "
                        "be told; choose another --out (or put that run's config.yaml back to continue it)")
    from raysim.app.configs import load_checked
    from raysim.engine import runstate
    try:
        there = load_checked(path)
    except UserError as err:
        raise UserError(f"--out {run_dir} holds a run whose config.yaml does not load ({err}); "
                        "choose another --out") from None
    for one, sub in plan(there, run_dir):  # the folder against its own config.yaml first: edited since?
        runstate.check(sub, one)
    diff = config_differences(_as_run(there), _as_run(cfg))
    if diff:
        shown = "; ".join(f"{k}: {a!r} there, {b!r} here" for k, a, b in diff[:3])
        more = f" and {len(diff) - 3} more" if len(diff) > 3 else ""
        raise UserError(f"--out {run_dir} holds a run of another config ({shown}{more}); choose another --out, "
                        f"or continue that run with: raysim run --resume {run_dir}")
    return True


def _as_run(cfg) -> dict:
    """A config as its run folder records it: a one-method run's folder is that federation's, whose
    config.yaml is the method's own (``for_method``: ``method: x`` for ``methods: [x]``)."""
    from raysim.app.configs import method_config
    names = cfg.method_names()
    return (method_config(cfg, names[0]) if len(names) == 1 else cfg).to_dict()


def config_differences(there: dict, here: dict, skip=("runtime",)) -> list[tuple[str, object, object]]:
    """(dotted key, value there, value here) wherever two config dicts differ, ``skip`` aside."""
    out = []

    def walk(a, b, prefix):
        if isinstance(a, dict) and isinstance(b, dict):
            for k in list(a) + [k for k in b if k not in a]:
                key = f"{prefix}.{k}" if prefix else str(k)
                if not prefix and k in skip:
                    continue
                walk(a.get(k), b.get(k), key)
        elif _norm(a) != _norm(b):
            out.append((prefix, a, b))

    walk(there, here, "")
    return out


def _norm(v):
    return [_norm(x) for x in v] if isinstance(v, (list, tuple)) else v


# ----------------------------------------------------------------------------- the federations of a config

def lodo_holdouts(cfg) -> list[str]:
    """The domains a leave-one-domain-out run holds out in turn (``eval.holdout``)."""
    domains = dataset_domains(cfg)  # from the shards' index under data.shards: no data load
    if cfg.eval.holdout == "all":
        return domains
    if cfg.eval.holdout not in domains:
        raise UserError(f"eval.holdout = {cfg.eval.holdout!r} is not a domain of {cfg.data.dataset}; "
                        f"expected 'all' or one of: {', '.join(domains)}")
    return [cfg.eval.holdout]



def with_holdout(cfg, holdout: str):
    """A copy of ``cfg`` whose federation holds ``holdout``'s clients out of training (the one
    place a partition's ``holdout`` is set)."""
    one = copy.deepcopy(cfg)
    one.data.partition = {**one.data.partition, "holdout": holdout}
    return one


def plan(cfg, run_dir: str) -> list[tuple[object, str]]:
    """(config, folder) of every federation of ``cfg``: method x seed x held-out domain.

    One method: the run folder is the federation's; several: ``<method>/`` (a plugin
    ``module:Class``: its class's name); with ``seeds``: ``seed-<s>/`` below; leave-one-domain-out:
    ``holdout-<domain>/`` below that."""
    from raysim.app.configs import method_config
    from raysim.methods import registry
    names, seeds = cfg.method_names(), cfg.seed_list()
    holdouts = lodo_holdouts(cfg) if cfg.eval.protocol == "lodo" else [None]
    out = []
    for name in names:
        for seed in seeds:
            for holdout in holdouts:
                sub = run_dir if len(names) == 1 else os.path.join(run_dir, registry.name_of(name))
                one = method_config(cfg, name)
                if cfg.seeds:
                    one = one.for_seed(seed)
                    sub = os.path.join(sub, f"seed-{seed}")
                if holdout is not None:
                    one = with_holdout(one, holdout)
                    sub = os.path.join(sub, f"holdout-{holdout}")
                out.append((one, sub))
    return out


# ----------------------------------------------------------------------------- the federations of a run folder

METRICS = "metrics.parquet"
CONFIG = "config.yaml"


def method_dirs(run_dir: str) -> dict[str, str]:
    """{method: its folder} of a run folder: itself for a one-method run, its ``<method>/``
    folders for a comparison, in the order its config lists them (the first is the reference).
    A method is shown by its key (a plugin ``module:Class`` by its class's name, as its folder)."""
    if _is_run(run_dir):
        return {method_key(method_of(run_dir)): run_dir}
    found = {}
    if os.path.isdir(run_dir):
        for name in sorted(os.listdir(run_dir)):
            if _is_run(os.path.join(run_dir, name)):
                found[name] = os.path.join(run_dir, name)
    listed = config_dict(run_dir).get("methods") or []
    listed = [m for m in listed if isinstance(m, str)]
    # a folder is its method's key; its config.yaml names the method as the run's list does
    rank = {m: i for i, m in enumerate(listed)}
    ranked = {f: rank.get(method_of(found[f]), rank.get(f)) for f in found}
    order = sorted((f for f in found if ranked[f] is not None), key=lambda f: ranked[f])
    order += [f for f in found if ranked[f] is None]
    return {m: found[m] for m in order}


def method_key(name: str) -> str:
    """How a run shows a method: its name, or a plugin ``module:Class``'s class name (the spec
    itself where the module does not import here)."""
    from raysim.methods import registry
    try:
        return registry.name_of(name)
    except UserError:
        return name


def seed_dirs(method_dir: str) -> dict[int | None, str]:
    """{seed: folder} of a method's folder; {None: method_dir} when it ran one seed."""
    found = {}
    for key, path in _subdirs(method_dir, "seed-").items():
        if key.isdigit() and (os.path.isfile(os.path.join(path, METRICS)) or holdout_dirs(path)):
            found[int(key)] = path
    return dict(sorted(found.items())) or {None: method_dir}


def holdout_dirs(seed_dir: str) -> dict[str, str]:
    """{held-out domain: federation folder} of a leave-one-domain-out seed's folder ({} otherwise)."""
    return {k: v for k, v in _subdirs(seed_dir, "holdout-").items() if os.path.isfile(os.path.join(v, METRICS))}


def _subdirs(d: str, prefix: str) -> dict[str, str]:
    if not os.path.isdir(d):
        return {}
    return {n[len(prefix):]: os.path.join(d, n) for n in sorted(os.listdir(d))
            if n.startswith(prefix) and os.path.isdir(os.path.join(d, n))}


def _is_run(d: str) -> bool:
    if os.path.isfile(os.path.join(d, METRICS)) or holdout_dirs(d):
        return True
    return None not in seed_dirs(d)


def method_of(folder: str) -> str:
    """The method a folder ran: its config's ``method`` (or first of ``methods``), else the folder's name."""
    raw = config_dict(folder)
    return raw.get("method") or (raw.get("methods") or [None])[0] or os.path.basename(os.path.normpath(folder))


def read_yaml_dict(path: str) -> dict:
    """A YAML file's mapping; {} when it is missing, unreadable, not YAML or not a mapping (a
    listing skips such a file rather than failing on it)."""
    import yaml
    try:
        with open(path, encoding="utf-8") as fh:
            raw = yaml.safe_load(fh)
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return {}
    return raw if isinstance(raw, dict) else {}


def config_dict(folder: str) -> dict:
    """A folder's config.yaml as written, a plain dict ({} without a readable one): the keys a
    listing needs (``methods``' order, ``eval.select``, ``paper``) whatever the schema is today."""
    return read_yaml_dict(os.path.join(folder, CONFIG))


def read_config(folder: str):
    """A federation's config.yaml as an :class:`raysim.config.ExperimentConfig` (the schema's
    checks; each method checks its own ``hp``), or None when the folder has none."""
    from raysim.config import load_config
    path = os.path.join(folder, CONFIG)
    if not os.path.isfile(path):
        return None
    try:
        return load_config(path)
    except UserError as err:
        raise UserError(f"{path} does not load: {err}") from None


def read_metrics(folder: str):
    """A federation's metrics.parquet as a DataFrame of raysim's long format
    (:data:`raysim.engine.metrics.COLUMNS`); a damaged file, or one that is not that format (a
    column missing or of another type), is one UserError line."""
    import pyarrow.parquet as pq

    from raysim.engine.metrics import COLUMNS, SCHEMA
    path = os.path.join(folder, METRICS)
    try:
        table = pq.read_table(path)
    except Exception as err:  # a corrupted or truncated file
        raise UserError(f"cannot read {path}: {first_line(err)}") from None
    missing = [c for c in COLUMNS if c not in table.column_names]
    if missing:
        raise UserError(f"{path} is not a raysim metrics file: it lacks the column(s) {', '.join(missing)} "
                        f"(expected {', '.join(COLUMNS)})")
    try:
        return table.select(list(COLUMNS)).cast(SCHEMA).to_pandas()
    except Exception as err:  # e.g. value stored as text
        raise UserError(f"{path} is not a raysim metrics file: its columns do not convert to "
                        f"{SCHEMA.to_string().replace(chr(10), ', ')} ({first_line(err)})") from None


def _warn(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
