"""The run folder's guards: one writer at a time, the same command resumes its own run, and a
failed write said in one line.

* :class:`RunLock`: ``RUN_DIR/raysim.lock`` holds the writer's pid, host and start time. A second
  ``raysim run`` on a held folder is refused (exit 2; exit 75, try later, when the holder is on
  another host: its lock is taken over once that host stops refreshing it); a lock whose holder is
  gone (same host and its pid dead or reused, the same Slurm job requeued, or another host's lock
  not refreshed for ``LOCK_STALE_S``) is taken over with a warning, by one taker only.
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
import secrets
import socket
import sys
import threading
import time

from raysim.core.errors import TryLater, UserError, first_line
from raysim.core.files import write_json, writing
from raysim.engine.datashards import dataset_domains

LOCK = "raysim.lock"
LOCK_REFRESH_S = 30.0  # the holder touches its lock this often ...
LOCK_STALE_S = 120.0  # ... and another host takes over a lock untouched this long
TAKEOVER_WAIT_S = 5.0  # how long to wait for another process's takeover of a stale lock to end


# ----------------------------------------------------------------------------- one writer

class RunLock:
    """``with RunLock(run_dir):`` the command's writer lock (see the module's docstring).

    A lock file is created whole or not at all: a hard link of a written file, which fails when
    the name exists. A stale lock is removed only by the one process that claims it first: the
    claim is ``raysim.lock.takeover-<its token>``, created the same way, so it exists once per
    stale lock. The claimer checks that the lock is still the one it judged stale, removes it,
    drops its claim and creates its own lock like any newcomer. A lock is thus never removed by
    two takers (the race of remove-then-create, where a second taker removed the first one's
    fresh lock), and a taker that dies holding a claim leaves a claim that is itself stale.

    Why link, not ``flock`` or ``rename``: ``link(2)`` and ``unlink(2)`` are atomic on an NFS
    server (the classic NFS-safe lock file), whereas ``flock`` is local to one client on some
    mounts (``local_lock=flock``, ``nolock``) and absent on others (Lustre without ``-o flock``),
    and a rename moves whatever file holds the name at that moment, so the renamer cannot tell
    whether it moved the stale lock or a fresh one."""

    def __init__(self, run_dir: str, warn=None):
        self.run_dir, self.path = run_dir, os.path.join(run_dir, LOCK)
        self.warn = warn or _warn
        self.me = {"pid": os.getpid(), "host": socket.gethostname(), "started": _process_start(os.getpid()),
                   "since": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)[:500],
                   "slurm_job": os.environ.get("SLURM_JOB_ID"),
                   "slurm_restart": _int(os.environ.get("SLURM_RESTART_COUNT")),
                   "token": secrets.token_hex(8)}
        self._stop = threading.Event()
        self._thread = None

    def __enter__(self) -> "RunLock":
        os.makedirs(self.run_dir, exist_ok=True)
        deadline = time.monotonic() + TAKEOVER_WAIT_S
        while not _create_once(self.path, self.me):
            lock = _LockFile.read(self.path)
            if lock is None:  # removed since: try again (a name that exists but opens as nothing, at most 5 s)
                if time.monotonic() > deadline:
                    raise UserError(f"{self.path} exists but is not a lock file that can be read (a dangling "
                                    "link?); delete it if no raysim is writing this folder")
                time.sleep(0.01)
                continue
            gone = self._holder_gone(lock)
            if gone is None:
                raise self._refusal(lock)
            if self._remove_stale(lock):
                self.warn(f"raysim: warning: taking over {self.path} ({gone})")
            elif time.monotonic() > deadline:
                raise TryLater(f"another raysim is taking over the stale lock {self.path}; try again")
            else:  # another process claimed it first: its lock appears in a moment
                time.sleep(0.01)
        self._thread = threading.Thread(target=self._refresh, name="raysim-lock", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        lock = _LockFile.read(self.path)
        if lock is not None and lock.ident == self.me["token"]:
            with contextlib.suppress(OSError):
                os.remove(self.path)

    def _refresh(self) -> None:
        """Keep the lock's mtime fresh: the sign of life a host that cannot see this pid reads."""
        while not self._stop.wait(LOCK_REFRESH_S):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def _remove_stale(self, lock: "_LockFile", depth: int = 0) -> bool:
        """Remove ``lock`` (the run's lock, or a claim on one) if this process is the one that
        claims it; False if another process claimed it first."""
        claim = f"{self.path}.takeover-{lock.ident}"
        if not _create_once(claim, self.me):
            held = _LockFile.read(claim)
            if held is not None and depth < 2 and self._holder_gone(held) is not None:
                self._remove_stale(held, depth + 1)  # its claimer died mid-takeover
            return False
        try:
            now = _LockFile.read(lock.path)
            if now is None or now.ident != lock.ident:  # already taken over (this claim came after)
                return False
            with contextlib.suppress(FileNotFoundError):
                os.remove(lock.path)
            return True
        finally:
            with contextlib.suppress(OSError):
                os.remove(claim)

    def _holder_gone(self, lock: "_LockFile") -> str | None:
        """Why the holder is gone (the lock may be taken over), or None while it may be alive."""
        holder, age = lock.holder, lock.age
        if not holder:  # damaged: give a starting writer a moment (an older raysim wrote in place)
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

    def _refusal(self, lock: "_LockFile") -> Exception:
        """A live holder on this host: a UserError (exit 2); another host's lock that is not yet
        stale: TryLater (exit 75), since it is taken over once that host stops refreshing it."""
        holder = lock.holder
        who = (f"pid {holder.get('pid')} on {holder.get('host')}, since {holder.get('since')}"
               if holder else "a raysim that is starting")
        held = f"{self.run_dir} is being written by another raysim ({who})"
        if holder and holder.get("host") != self.me["host"]:
            at = time.strftime("%H:%M:%S", time.localtime(time.time() + LOCK_STALE_S - lock.age))
            return TryLater(f"{held}, whose lock was refreshed {lock.age:.0f} s ago: it is taken over if not "
                            f"refreshed for {LOCK_STALE_S:.0f} s, at {at} at the earliest; try again then, or "
                            f"delete {self.path} if that run is gone")
        return UserError(f"{held}: one run per folder at a time; wait for it or choose another --out")


class _LockFile:
    """A lock file as read once: its holder (None if unreadable), identity and age."""

    def __init__(self, path: str, holder: dict | None, ident: str, age: float):
        self.path, self.holder, self.ident, self.age = path, holder, ident, age

    @classmethod
    def read(cls, path: str) -> "_LockFile | None":
        """None if there is no such file. The identity is the holder's random token (a lock
        written by an older raysim has none: its inode stands in)."""
        try:
            with open(path, "rb") as fh:
                st = os.fstat(fh.fileno())
                text = fh.read()
        except FileNotFoundError:
            return None
        try:
            holder = json.loads(text)
        except ValueError:
            holder = None
        holder = holder if isinstance(holder, dict) else None
        token = holder.get("token") if holder else None
        ident = token if isinstance(token, str) and token.isalnum() else f"i{st.st_dev:x}-{st.st_ino}"
        return cls(path, holder, ident, time.time() - st.st_mtime)


def _create_once(path: str, record: dict) -> bool:
    """Create ``path`` holding ``record`` (JSON) unless it exists; True if this call created it
    (:func:`raysim.core.files.write_atomically`'s exclusive write: the file appears whole, and
    only one link to a name can succeed)."""
    try:
        write_json(path, record, exclusive=True)
    except FileExistsError:
        return False
    return True


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


def _int(text) -> int | None:
    try:
        return int(text)
    except (TypeError, ValueError):
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
    """The domains a leave-one-domain-out run holds out in turn (``eval.holdout``: ``all``, one
    domain, or a list; a number names a domain too, as YAML reads rotated_mnist's ``75``)."""
    domains = dataset_domains(cfg)  # from the shards' index under data.shards: no data load
    if cfg.eval.holdout == "all":
        return domains
    asked = [str(d) for d in (cfg.eval.holdout if isinstance(cfg.eval.holdout, list) else [cfg.eval.holdout])]
    unknown = [d for d in asked if d not in domains]
    if unknown:
        raise UserError(f"eval.holdout = {unknown[0]!r} is not a domain of {cfg.data.dataset}; "
                        f"expected 'all' or one of: {', '.join(domains)}")
    return asked



def with_holdout(cfg, holdout: str):
    """A copy of ``cfg`` whose federation holds ``holdout``'s clients out of training (the one
    place a partition's ``holdout`` is set)."""
    one = copy.deepcopy(cfg)
    one.data.partition = {**one.data.partition, "holdout": holdout}
    return one


def plan(cfg, run_dir: str) -> list[tuple[object, str]]:
    """(config, folder) of every federation of ``cfg``: entry of ``methods`` x seed x held-out domain.

    One entry: the run folder is the federation's; several: ``<name>/``, the entry's name (a named
    variant's; a method's key: a plugin ``module:Class``'s class name); with ``seeds``: ``seed-<s>/``
    below; leave-one-domain-out: ``holdout-<domain>/`` below that."""
    from raysim.app.configs import method_config, method_keys
    names, seeds = method_keys(cfg), cfg.seed_list()
    holdouts = lodo_holdouts(cfg) if cfg.eval.protocol == "lodo" else [None]
    out = []
    for name in names:
        for seed in seeds:
            for holdout in holdouts:
                sub = run_dir if len(names) == 1 else os.path.join(run_dir, name)
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
ERROR = "error.txt"  # a federation whose method raised: its traceback (raysim.engine.loop)
CONFIG = "config.yaml"


def method_dirs(run_dir: str) -> dict[str, str]:
    """{entry: its folder} of a run folder: itself for a one-method run, its ``<name>/`` folders
    for a comparison, in the order its config lists them (the first is the reference). An entry is
    shown by its name (:func:`name_of`: a variant's name, a method's key), as its folder."""
    if _is_run(run_dir):
        return {name_of(run_dir): run_dir}
    found = {}
    if os.path.isdir(run_dir):
        for name in sorted(os.listdir(run_dir)):
            if _is_run(os.path.join(run_dir, name)):
                found[name] = os.path.join(run_dir, name)
    listed = [m if isinstance(m, str) else m.get("name") if isinstance(m, dict) else None
              for m in config_dict(run_dir).get("methods") or []]
    # a folder is its entry's name; its config.yaml names the entry as the run's list does: a
    # variant by its name (``variant``), a method by its spec (``method``)
    rank = {m: i for i, m in enumerate(listed) if isinstance(m, str)}
    ranked = {f: rank.get(_listed_as(found[f]), rank.get(f)) for f in found}
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
        if key.isdigit() and (_has_results(path) or holdout_dirs(path)):
            found[int(key)] = path
    return dict(sorted(found.items())) or {None: method_dir}


def holdout_dirs(seed_dir: str) -> dict[str, str]:
    """{held-out domain: federation folder} of a leave-one-domain-out seed's folder ({} otherwise)."""
    return {k: v for k, v in _subdirs(seed_dir, "holdout-").items() if _has_results(v)}


def _subdirs(d: str, prefix: str) -> dict[str, str]:
    if not os.path.isdir(d):
        return {}
    return {n[len(prefix):]: os.path.join(d, n) for n in sorted(os.listdir(d))
            if n.startswith(prefix) and os.path.isdir(os.path.join(d, n))}


def _is_run(d: str) -> bool:
    if _has_results(d) or holdout_dirs(d):
        return True
    return None not in seed_dirs(d)


def _has_results(folder: str) -> bool:
    """A federation's folder with metrics to show: not one whose method raised (its error.txt)."""
    return os.path.isfile(os.path.join(folder, METRICS)) and not os.path.isfile(os.path.join(folder, ERROR))


def failed_federations(run_dir: str) -> list[tuple[str, str]]:
    """(folder relative to ``run_dir``, the error's line) of every federation below ``run_dir``
    whose method raised: the listings above leave them out, and report and compare say so."""
    out = []
    for root, dirs, names in os.walk(run_dir):
        dirs[:] = sorted(d for d in dirs if d not in ("checkpoints", "tb"))
        if ERROR in names:
            try:
                with open(os.path.join(root, ERROR), encoding="utf-8") as fh:
                    lines = [ln.strip() for ln in fh if ln.strip()]
            except OSError:
                lines = []
            out.append((os.path.relpath(root, run_dir), lines[-1] if lines else "see error.txt"))
    return out


def unfinished_federations(run_dir: str) -> list[tuple[str, int | None, int]]:
    """(folder relative to ``run_dir``, the last round its metrics hold, the rounds its config
    plans) of every federation below ``run_dir`` whose metrics stop before its config's last round
    and that did not finish (status.json): still running, or stopped (its method's error aside:
    :func:`failed_federations`). Report and compare show such a federation at the rounds it has,
    and say so."""
    import pyarrow.parquet as pq
    from raysim.engine import runstate
    out = []
    for root, dirs, names in os.walk(run_dir):
        dirs[:] = sorted(d for d in dirs if d not in ("checkpoints", "tb"))
        if "metrics.parquet" not in names or ERROR in names or runstate.read_status(root).get("finished") is True:
            continue
        try:
            rounds = pq.read_table(os.path.join(root, "metrics.parquet"), columns=["round"]).column("round")
            last = int(max(rounds.to_pylist())) if len(rounds) else None
        except Exception:  # unreadable: read_metrics says so where it is read
            last = None
        planned = config_dict(root).get("rounds")
        if isinstance(planned, int) and (last is None or last < planned):  # (metrics of its own: none planned)
            out.append((os.path.relpath(root, run_dir), last, planned))
    return out


def unfinished_line(run_dirs: list[str]) -> str:
    """One line naming the unfinished federations of ``run_dirs`` ("" when every one finished)."""
    parts = [f"{os.path.normpath(os.path.join(run, folder)) if len(run_dirs) > 1 else folder} "
             f"(round {'?' if last is None else last} of {planned})"
             for run in run_dirs for folder, last, planned in unfinished_federations(run)]
    if not parts:
        return ""
    return ("**Unfinished** (still running, or stopped before their last round; each is shown at the "
            "rounds it has): " + "; ".join(parts) + ".")


def method_of(folder: str) -> str:
    """The method a folder ran: its config's ``method`` (or the first entry of ``methods``, a
    variant's ``method``), else the folder's name."""
    raw = config_dict(folder)
    first = _first_entry(raw)
    first = first.get("method") if isinstance(first, dict) else first
    return raw.get("method") or first or os.path.basename(os.path.normpath(folder))


def variant_of(folder: str) -> str | None:
    """The named variant a folder ran: its config's ``variant`` (a federation's config.yaml), or
    the name of a variant that is the first entry of its ``methods`` (a multi-seed run's top
    config.yaml); None: its method's own."""
    raw = config_dict(folder)
    first = _first_entry(raw)
    variant = raw.get("variant") or (first.get("name") if isinstance(first, dict) else None)
    return variant if isinstance(variant, str) else None


def _first_entry(raw: dict):
    listed = raw.get("methods")
    return listed[0] if isinstance(listed, list) and listed else None


def name_of(folder: str) -> str:
    """How a run shows a federation's folder: its variant's name, else its method's key."""
    return variant_of(folder) or method_key(method_of(folder))


def _listed_as(folder: str) -> str:
    """A comparison's folder as the run's ``methods`` lists it: a variant's name, else a method's spec."""
    return variant_of(folder) or method_of(folder)


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
