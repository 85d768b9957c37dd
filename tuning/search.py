"""``raysim tune``: hyperparameter search on Ray Tune with Optuna's sampler.

    spec (tune config)  ->  Tuner(raysim_trial with a placement group per federation,
                                  ConcurrencyLimiter(OptunaSearch(sampler, on-disk storage)),
                                  ASHA / median / no scheduler on the per-round reports)
                        ->  trials.parquet, best.yaml, search.png

The search directory (``--out``, default ``runs/tune/<name>``) holds everything: ``search.yaml``
(the resolved search, compared on resume), ``optuna.journal`` (the Optuna study), ``tune/`` (Tune's
experiment state), ``trials/<NNN_id>/`` (each federation's run directory) and the outputs.
A failed trial is retried ``max_failures`` times (Tune's FailureConfig), each retry continuing its
federation from its last checkpoint; the cause of a failure is printed, and kept in trials.parquet.
Running the same command again restores the search and says what it runs: finished trials are
kept (never re-run), interrupted and failed ones continue from their last checkpoint, and the
remaining ones are sampled.

One search per directory at a time: the search holds ``raysim.lock`` there (``RunLock``, as
``raysim run`` does). raysim reads no pickle from the directory (a trial's error is read from
Tune's ``error.txt``; the pickled copy Tune writes beside it is removed at once), but restoring a
search is Tune's own ``Tuner.restore``, which unpickles Tune's state in ``tune/``: a directory
another user owns or could have written to is refused before anything is read from it.
"""
from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import re
import shutil
import stat
import time
import warnings

import yaml

from raysim.app.rundir import LOCK, RunLock
from raysim.config import get_path, set_path
from raysim.engine import checkpoint
from raysim.core.errors import RunFailed, UserError, first_line
from raysim.core.files import WriteFailed, write_atomically, write_text
from raysim.tuning import outputs
from raysim.tuning import space as sp
from raysim.tuning.spec import SAMPLERS, TuneSpec, load_spec
from raysim.tuning.trial import (TrialContext, check_fits, make_trainable, num_hosts_for, read_json,
                                 trial_bundles)

STUDY = "raysim"
EXPERIMENT = "tune"  # Tune's experiment folder inside the search directory
BACKUP = "tune-backup"  # the last readable copy of Tune's experiment state

from ray.tune import Callback
from ray.tune.search import ConcurrencyLimiter
from ray.tune.search.optuna import OptunaSearch


def main(path, overrides=(), out: str | None = None, address: str | None = None) -> int:
    """Run (or resume) the search described by the tune config at ``path``; returns an exit code."""
    _quiet()
    spec = load_spec(path, list(overrides or []))
    out = os.path.abspath(out or os.path.join("runs", "tune", spec.name))
    result = run_search(spec, out, address=address)
    return result["exit_code"]


def run_search(spec: TuneSpec, out: str, address: str | None = None, echo=print) -> dict:
    """The search itself (also the programmatic entry point); returns the trials table and paths.

    One search per directory: a second one on the same ``out`` is refused in one line while the
    first holds its lock. Everything the search writes is writable by this user only (see
    :func:`check_owned`)."""
    _quiet()
    make_sampler(spec), make_scheduler(spec)  # option mistakes fail before anything is written
    check_owned(out)
    with private_writes(), RunLock(out):
        return _search(spec, out, address, echo)


def _search(spec: TuneSpec, out: str, address: str | None, echo) -> dict:
    from ray import tune
    from raysim.engine.cluster import ray_session, shipped_plugins

    import ray
    from raysim.app.configs import load_checked
    from raysim.app.preflight import preflight

    base = spec.base_config()
    address = address or base.runtime.address
    local = not (address or os.environ.get("RAY_ADDRESS"))
    run_raw = spec.run_experiment()
    # a data, model or layout mistake: one line before Ray starts and before the search's folder
    # (inside a trial, a Ray task found it a minute later)
    preflight(load_checked(raw=run_raw), address, own_ray=not ray.is_initialized())
    resume = prepare_dir(out, spec)
    if get_path(run_raw, "tracking.mlflow_experiment") is None:  # MLflow: one experiment per search
        set_path(run_raw, "tracking.mlflow_experiment", spec.name)
    echo(f"raysim tune: {spec.method}, {spec.trials} trials x {spec.rounds} rounds, "
         f"{spec.metric} ({spec.mode}), sampler {spec.sampler['kind']}, scheduler {spec.scheduler['kind']}")
    echo(f"  space: {sp.describe(spec.space)}")
    # a plugin method or dataset reaches every trial and its federation's actors
    datasets = [] if base.data.shards else [base.data.dataset]
    with ray_session(address, base.runtime, methods=[spec.method], datasets=datasets):
        bundles = trial_bundles(base.runtime, num_hosts_for(run_raw), spec.resources["trial_cpus"])
        check_fits(bundles, local)
        ctx = TrialContext(run_experiment=run_raw, search_dir=out, rounds=spec.rounds, plugins=shipped_plugins())
        trainable = make_trainable(ctx, bundles, spec.resources["strategy"])
        exp_dir = os.path.join(out, EXPERIMENT)
        if resume:
            # say what the restore runs: interrupted and failed trials continue from their last
            # checkpoint (a failed one gets its max_failures retries afresh), the rest are sampled
            echo("  " + resume_plan(saved_trials(exp_dir, out), spec.trials, _shown(out)))
            check_owned(out)  # Tune unpickles its state: what repair_state copied in is checked too
            tuner = tune.Tuner.restore(exp_dir, trainable=trainable, resume_unfinished=True,
                                       resume_errored=True)
        else:
            echo(f"  search directory: {out}; one trial = {len(bundles) - 1} host(s), bundles {bundles}")
            tuner = build_tuner(spec, trainable, out)
        grid = tuner.fit()
        rows = collect_rows(grid, spec, out)
    return finish(spec, rows, out, echo)


def build_tuner(spec: TuneSpec, trainable, out: str):
    from ray import tune

    searcher = make_searcher(spec, out)
    tune_config = tune.TuneConfig(
        search_alg=RaysimLimiter(searcher, max_concurrent=spec.max_concurrent),
        scheduler=make_scheduler(spec), num_samples=spec.trials, reuse_actors=False,
        trial_name_creator=trial_name, trial_dirname_creator=trial_name)
    run_config = tune.RunConfig(
        name=EXPERIMENT, storage_path=out, verbose=0, callbacks=[Progress(spec.metric, spec.trials, out)],
        failure_config=tune.FailureConfig(max_failures=spec.max_failures),
        checkpoint_config=tune.CheckpointConfig(num_to_keep=1))
    return tune.Tuner(trainable, tune_config=tune_config, run_config=run_config)


# ----------------------------------------------------------------------------- search pieces

def make_sampler(spec: TuneSpec):
    import optuna

    opts = {k: v for k, v in spec.sampler.items() if k not in ("kind",)}
    kind = spec.sampler["kind"]
    if kind == "tpe" and spec.max_concurrent > 1:
        opts.setdefault("constant_liar", True)  # concurrent trials: do not sample on top of each other
    if kind == "qmc":
        opts.setdefault("scramble", True)
    cls = getattr(optuna.samplers, SAMPLERS[kind])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return cls(**opts)
    except (TypeError, ValueError, ImportError) as err:
        raise UserError(f"sampler {kind} with {opts}: {first_line(err)}") from None


def make_searcher(spec: TuneSpec, out: str):
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    storage = JournalStorage(JournalFileBackend(os.path.join(out, "optuna.journal")))
    return RaysimOptunaSearch(space=sp.to_optuna(spec.space), metric=spec.metric, mode=spec.mode,
                              sampler=make_sampler(spec), study_name=STUDY, storage=storage,
                              points_to_evaluate=[dict(p) for p in spec.initial_points] or None)


def make_scheduler(spec: TuneSpec):
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, MedianStoppingRule

    s = dict(spec.scheduler)
    kind = s.pop("kind")
    if kind == "none":
        return FIFOScheduler()
    try:
        if kind == "asha":
            return ASHAScheduler(time_attr="round", metric=spec.metric, mode=spec.mode, max_t=spec.rounds, **s)
        return MedianStoppingRule(time_attr="round", metric=spec.metric, mode=spec.mode, **s)
    except (TypeError, ValueError, AssertionError) as err:
        raise UserError(f"scheduler {kind}: {first_line(err)}") from None


class RaysimOptunaSearch(OptunaSearch):
    """OptunaSearch over an on-disk study that survives being restored, and agrees with Tune.

    The study lives in ``optuna.journal`` and can be ahead of Tune's last experiment snapshot:
    a trial may already be complete in the study when Tune replays it, and a trial asked for
    after the snapshot is unknown to Tune. The first is ignored, the second marked failed.

    Tune tells the searcher about a trial once, when it is done with it: a trial retried after a
    failure is not told until it completes (its value recorded) or fails for good (recorded
    failed, once). A failed trial that a rerun of the search completes cannot be reopened in
    Optuna (finished trials are immutable): its result is added as a completed trial with the same
    parameters (user attributes ``tune_trial_id`` and ``rerun_of``, the failed trial's number).
    """

    def on_trial_result(self, trial_id, result):
        import optuna
        if trial_id in self._completed_trials or self._finished(trial_id):
            return  # a rerun of a trial the study already holds as failed
        try:
            super().on_trial_result(trial_id, result)
        except (optuna.exceptions.UpdateFinishedTrialError, KeyError):
            pass

    def on_trial_complete(self, trial_id, result=None, error=False):
        if trial_id not in self._ot_trials:
            return
        old = self._finished(trial_id)
        if old is None:
            return super().on_trial_complete(trial_id, result=result, error=error)
        value = (result or {}).get(self.metric)
        if not error and value is not None and old.state.name == "FAIL" and not self._rerun_recorded(trial_id):
            import optuna
            self._ot_study.add_trial(optuna.trial.create_trial(
                params=old.params, distributions=old.distributions, value=value,
                user_attrs={"tune_trial_id": trial_id, "rerun_of": old.number}))
        self._completed_trials.add(trial_id)

    def _finished(self, trial_id):
        """The study's record of the trial if it is already finished there, else None."""
        ot_trial = self._ot_trials.get(trial_id)
        if ot_trial is None:
            return None
        frozen = next((t for t in self._ot_study.get_trials(deepcopy=False) if t.number == ot_trial.number), None)
        return frozen if frozen is not None and frozen.state.is_finished() else None

    def _rerun_recorded(self, trial_id) -> bool:
        return any(t.user_attrs.get("tune_trial_id") == trial_id for t in self._ot_study.get_trials(deepcopy=False))

    def restore(self, checkpoint_path):
        super().restore(checkpoint_path)
        from optuna.trial import TrialState
        known = {t.number for t in self._ot_trials.values()}
        for t in self._ot_study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            if t.number not in known:
                try:
                    self._ot_study.tell(t.number, state=TrialState.FAIL)
                except Exception:  # already settled by another path
                    pass


class RaysimLimiter(ConcurrencyLimiter):
    """ConcurrencyLimiter that also passes on the end of a trial it no longer counts: a trial
    that had failed for good, re-run by a rerun of the search (the limiter forgot it when it
    failed, and would keep its result from the study)."""

    def on_trial_complete(self, trial_id, result=None, error=False):
        if trial_id in self.live_trials:
            return super().on_trial_complete(trial_id, result=result, error=error)
        self.searcher.on_trial_complete(trial_id, result=result, error=error)


def trial_name(trial) -> str:
    """``003_1f46143d``: the trial's number (Tune's creation counter, from 1) and its id."""
    return f"{trial_number(trial.experiment_tag):03d}_{trial.trial_id}"


class Progress(Callback):
    """One line per finished, failed or retried trial instead of Tune's status tables; and a backup
    of Tune's last readable experiment state (Tune copies its state into the search directory in
    place, so a search killed during that copy would leave nothing to restore from)."""

    def __init__(self, metric: str, total: int, out: str):
        self.metric, self.total, self.finished, self.out = metric, total, 0, out
        self.exp_dir, self.backup_dir = os.path.join(out, EXPERIMENT), os.path.join(out, BACKUP)
        self._last_check, self._last_sig = 0.0, None

    def on_step_end(self, iteration, trials, **info):
        now = time.monotonic()
        if now - self._last_check >= 0.5:
            self._last_check = now
            self._last_sig = backup_state(self.exp_dir, self.backup_dir, self._last_sig)

    def _count(self, trials, trial) -> int:
        return 1 + sum(1 for t in trials if t is not trial and t.status in ("TERMINATED", "ERROR"))

    def on_trial_start(self, iteration, trials, trial, **info):
        # A trial that had failed for good (its ``finished`` record says so) starts again only in
        # a rerun of the search: it gets its retries afresh (Tune would go on counting).
        marker = os.path.join(self.out, "trials", trial_name(trial), "finished")
        if _read_text(marker) == "error":
            trial.run_metadata.num_failures = 0
            os.remove(marker)

    def on_trial_complete(self, iteration, trials, trial, **info):
        self.finished = self._count(trials, trial)
        r = trial.last_result or {}
        value = r.get(self.metric)
        shown = outputs.shown(self.metric, value)  # an accuracy in percent
        reason = stop_reason(r, error=False)
        note = " (finished before the restore; not re-run)" if r.get("replayed") else ""
        retries = trial.run_metadata.num_failures
        if retries and not note:
            note = f" after {retries} retr{'y' if retries == 1 else 'ies'}"
        params = ", ".join(f"{sp.short_name(k)}={outputs._fmt(v)}" for k, v in (trial.config or {}).items())
        self._mark(trial, reason)
        print(f"  trial {trial_number(trial.experiment_tag)} [{self.finished}/{self.total}] {params}: "
              f"{self.metric} {shown} after round {r.get('round', 0)}/{r.get('rounds_total', '?')} "
              f"({reason}){note}", flush=True)

    def on_trial_recover(self, iteration, trials, trial, **info):
        drop_error_pickle(trial)
        run_dir = os.path.join(self.out, "trials", trial_name(trial))
        rounds = checkpoint.list_rounds(run_dir)
        where = f"its round-{rounds[-1]} checkpoint" if rounds else "round 1 (no checkpoint yet)"
        n = trial.run_metadata.num_failures
        print(f"  trial {trial_number(trial.experiment_tag)} failed (attempt {_read_int(os.path.join(run_dir, 'attempts'), n)}): "
              f"{error_line(trial_error(trial))}; retrying from {where} (retry {n} of {trial.max_failures})",
              flush=True)

    def on_trial_error(self, iteration, trials, trial, **info):
        drop_error_pickle(trial)
        self.finished = self._count(trials, trial)
        self._mark(trial, "error")
        attempts = _read_int(os.path.join(self.out, "trials", trial_name(trial), "attempts"), 0)
        print(f"  trial {trial_number(trial.experiment_tag)} [{self.finished}/{self.total}] failed"
              f"{f' after {attempts} attempts' if attempts > 1 else ''}: {error_line(trial_error(trial))}",
              flush=True)

    def _mark(self, trial, reason: str) -> None:
        """``trials/<name>/finished``: the driver's record that Tune is done with the trial."""
        try:
            d = os.path.join(self.out, "trials", trial_name(trial))
            os.makedirs(d, exist_ok=True)
            write_text(os.path.join(d, "finished"), reason + "\n")
        except (OSError, WriteFailed):
            pass


def trial_error(trial) -> str | None:
    """The trial's error as Tune recorded it in text (``error.txt``: one record per failure, the
    latest last); None if there is none to read. Never its pickled copy: see drop_error_pickle."""
    try:
        if trial.error_file and os.path.isfile(trial.error_file):
            with open(trial.error_file, encoding="utf-8", errors="replace") as fh:
                return fh.read()
    except OSError:  # diagnostics only: an unreadable record is an "unknown error"
        pass
    return None


def drop_error_pickle(trial) -> None:
    """Remove the pickle of a trial's exception that Tune writes beside its text copy, and Tune's
    note of it. Tune unpickles that file for its ResultGrid; raysim reads the text, so no pickle
    of an error is left in the search directory for anyone to load. Tune calls the callbacks
    right after writing it, before its state is saved."""
    with contextlib.suppress(OSError, TypeError, AttributeError):
        if trial.pickled_error_file:
            os.remove(trial.pickled_error_file)
    with contextlib.suppress(AttributeError):
        trial.run_metadata.pickled_error_filename = None


# ----------------------------------------------------------------------------- Tune's state files

STATE_FILES = ("experiment_state-{}.json", "search_gen_state-{}.json", "searcher-state-{}.pkl")


def _state_groups(exp_dir: str) -> list[str]:
    """Session stamps of the saved experiment states, oldest first."""
    names = glob.glob(os.path.join(exp_dir, "experiment_state-*.json"))
    return sorted(os.path.basename(n)[len("experiment_state-"):-len(".json")] for n in names)


def _valid(path: str) -> bool:
    try:
        if os.path.basename(path).startswith("experiment_state-"):
            with open(path, encoding="utf-8") as fh:
                json.load(fh)
            return True
        with open(path, "rb") as fh:  # the others are pickles: a complete one ends with STOP
            fh.seek(-1, os.SEEK_END)
            return fh.read(1) == b"."
    except (OSError, ValueError):
        return False


def _group_ok(exp_dir: str, stamp: str) -> bool:
    return all(_valid(os.path.join(exp_dir, t.format(stamp))) for t in STATE_FILES)


def backup_state(exp_dir: str, backup_dir: str, last_sig=None):
    """Copy the newest state into ``backup_dir`` when it changed and is readable."""
    groups = _state_groups(exp_dir)
    if not groups:
        return last_sig
    stamp = groups[-1]
    paths = [os.path.join(exp_dir, t.format(stamp)) for t in STATE_FILES]
    try:
        sig = tuple((os.stat(p).st_mtime_ns, os.stat(p).st_size) for p in paths)
    except OSError:
        return last_sig
    if sig == last_sig or not _group_ok(exp_dir, stamp):
        return last_sig
    os.makedirs(backup_dir, exist_ok=True)
    for old in os.listdir(backup_dir):
        if stamp not in old:
            os.remove(os.path.join(backup_dir, old))
    for p in paths:
        write_atomically(os.path.join(backup_dir, os.path.basename(p)), lambda tmp, p=p: shutil.copyfile(p, tmp))
    return sig


def repair_state(exp_dir: str, backup_dir: str) -> bool:
    """Make the newest saved state readable before a restore: a state cut short by a kill is
    replaced by the backup (or dropped, falling back to an older one). True if one remains."""
    groups = _state_groups(exp_dir)
    if groups and _group_ok(exp_dir, groups[-1]):
        return True
    backups = _state_groups(backup_dir) if os.path.isdir(backup_dir) else []
    for stamp in groups:  # drop every unreadable group; Tune picks the newest by name
        if not _group_ok(exp_dir, stamp):
            for t in STATE_FILES:
                p = os.path.join(exp_dir, t.format(stamp))
                if os.path.exists(p):
                    os.remove(p)
    if backups and _group_ok(backup_dir, backups[-1]):
        for t in STATE_FILES:
            backup = os.path.join(backup_dir, t.format(backups[-1]))
            write_atomically(os.path.join(exp_dir, os.path.basename(backup)),
                             lambda tmp, backup=backup: shutil.copyfile(backup, tmp))
    groups = _state_groups(exp_dir)
    return bool(groups) and _group_ok(exp_dir, groups[-1])


# ----------------------------------------------------------------------------- results

def trial_number(name: str) -> int:
    """The number in front of a trial's name or experiment tag (``3_lr=0.1``, ``003_1f46143d``)."""
    try:
        return int(str(name).split("_", 1)[0])
    except ValueError:
        return 0


def stop_reason(metrics: dict, error: bool, finished: bool = True) -> str:
    if error:
        return "error"
    if not metrics or "round" not in metrics:
        return "unfinished"
    if metrics.get("diverged"):
        return "diverged"
    if metrics["round"] >= metrics.get("rounds_total", metrics["round"]):
        return "completed"
    return "early_stopped" if finished else "unfinished"


def error_line(err) -> str:
    """One line for a trial's failure: a UserError's own message; otherwise the real exception's
    type and the first line of its message. Ray wraps an exception raised in a trial in a
    RayTaskError (its ``cause`` is the real one); a trial whose worker process died gets an
    ActorDiedError, whose first line is completed by the worker's exit type."""
    if err is None:
        return "unknown error"
    if isinstance(err, str):  # Tune's text record of the error (error.txt)
        return _text_error_line(err)
    real = err
    while _is_task_error(real) and getattr(real, "cause", None) is not None:
        real = real.cause
    seen, e = set(), real
    while e is not None and id(e) not in seen:  # a UserError anywhere in the chain says it best
        seen.add(id(e))
        if isinstance(e, UserError):
            return first_line(e)
        e = e.__cause__ or e.__context__
    if _is_task_error(real):  # no cause to unwrap: the traceback's last line
        return _text_error_line(str(real))
    message = first_line(real, default="")
    if isinstance(real, RunFailed):  # the round loop's advice to run --resume is not for a trial
        message = message.split("; resume with:", 1)[0].split("; rerun with:", 1)[0]
    exit_type = re.search(r"Worker exit type: (\w+)", str(real))
    line = f"{type(real).__name__}: {message}" if message else type(real).__name__
    if exit_type:
        line += f" (worker exit type {exit_type.group(1)})"
    return line[:300]


def _is_task_error(err) -> bool:
    return type(err).__name__.startswith("RayTaskError")


def _text_error_line(text: str) -> str:
    """The latest failure of Tune's text record (``error.txt``: ``Failure # N (occurred at ...)``
    and the error's text, per failure; or one error's text), in the words error_line gives the
    exception itself: a UserError's message; else the traceback's last ``Type: message`` line (the
    innermost exception, its module path and a resume hint cut); Ray's text for a dead actor
    (which names no type) as its ActorDiedError, with the worker's exit type."""
    text = re.split(r"(?m)^Failure # \d+ \(occurred at [^)\n]*\)$", text)[-1]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return "unknown error"
    if lines[0].startswith("The actor died"):
        exit_type = re.search(r"Worker exit type: (\w+)", text)
        return (f"ActorDiedError: {lines[0]}"
                + (f" (worker exit type {exit_type.group(1)})" if exit_type else ""))[:300]
    for line in reversed(lines):
        if "UserError:" in line or "TrainingDiverged:" in line:
            return line.split("Error:", 1)[1].strip()[:300]
        if re.match(r"^[\w.]+(Error|Exception|Failed|Interrupt)\b.*?: ", line):
            line = re.sub(r"^(?:\w+\.)+(?=\w+: )", "", line)  # raysim.core.errors.RunFailed -> RunFailed
            return line.split("; resume with:", 1)[0].split("; rerun with:", 1)[0][:300]
    return lines[0][:300]


def collect_rows(grid, spec: TuneSpec, out: str) -> list[dict]:
    """One row per trial from Tune's ResultGrid (plus each trial's ledger for attempts)."""
    statuses, configs = {}, {}
    try:  # trial status tells an interrupted trial from one a scheduler stopped
        for t in grid._experiment_analysis.trials:
            statuses[t.trial_id], configs[t.trial_id] = t.status, dict(t.config or {})
    except AttributeError:
        pass
    rows = []
    for result in grid:
        m = dict(result.metrics or {})
        config = dict(result.config or {})
        name = os.path.basename(str(result.path).rstrip("/"))  # trial_name(): "003_1f46143d"
        trial_id = m.get("trial_id") or name.split("_", 1)[-1]
        status = statuses.get(trial_id)
        config = config or configs.get(trial_id, {})
        finished = status in (None, "TERMINATED", "ERROR")
        run_dir = os.path.join(out, "trials", name)
        if result.error is not None and "round" not in m:
            # a worker killed between writing its ledger and reporting to Tune: the ledger's last
            # round is what the trial got to (shown; an errored trial is never picked as best)
            reports = (read_json(os.path.join(run_dir, "progress.json")) or {}).get("reports") or []
            m = {**reports[-1], **m} if reports else m
        ledger = read_json(os.path.join(run_dir, "result.json")) or {}
        attempts = _read_int(os.path.join(run_dir, "attempts"), m.get("attempt", 0))
        row = {"trial": trial_number(name), "trial_id": trial_id,
               **{k: sp.plain(config.get(k)) for k in spec.space},
               "objective": m.get(spec.metric), "val_avg_final": m.get("val_avg"),
               "val_avg_best": m.get("val_avg_best"), "val_all_final": m.get("val_all"),
               "val_all_best": m.get("val_all_best"), "train_loss_final": m.get("train_loss"),
               "rounds_run": m.get("round", 0), "rounds": spec.rounds,
               "stop_reason": stop_reason(m, result.error is not None, finished),
               "attempts": attempts, "seconds": ledger.get("seconds", m.get("time_total_s")),
               "error": error_line(result.error) if result.error is not None else None,
               "run_dir": run_dir}
        rows.append(row)
    return rows


def finish(spec: TuneSpec, rows: list[dict], out: str, echo=print) -> dict:
    """Write the three outputs and print the table; the exit code says how it went."""
    df = outputs.trials_frame(rows, list(spec.space))
    outputs.write_trials(df, os.path.join(out, "trials.parquet"))
    best = outputs.pick_best(df, spec.mode)
    best_path = os.path.join(out, "best.yaml")
    if best is not None:
        outputs.write_best(spec, best, best_path, out)
    outputs.plot_search(df, spec, os.path.join(out, "search.png"), best)
    echo("")
    echo(outputs.format_table(df, spec))
    counts = df["stop_reason"].value_counts().to_dict()
    echo("")
    echo(f"{len(df)} trials: " + ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in counts.items()))
    failed = df[df["stop_reason"] == "error"]
    for _, row in failed.iterrows():
        echo(f"  trial {int(row['trial'])} failed after {int(row['attempts'])} attempt"
             f"{'s' if row['attempts'] != 1 else ''}: {row['error'] or 'unknown error'}")
    if len(failed):
        echo(f"  (Tune's full record: {os.path.join(_shown(out), EXPERIMENT, '<trial>', 'error.txt')}; "
             "run the same command again to re-run failed trials from their last checkpoint)")
    unfinished = counts.get("unfinished", 0) + max(0, spec.trials - len(df))
    if best is not None:
        echo(f"best: trial {int(best['trial'])}, {spec.metric} = {outputs.shown(spec.metric, best['objective'])} "
             f"-> {best_path} (re-run: raysim run {_shown(best_path)})")
    echo(f"wrote {os.path.join(out, 'trials.parquet')}, search.png" + (", best.yaml" if best is not None else ""))
    if unfinished:
        echo(f"{unfinished} trial(s) unfinished: run the same command again to continue the search")
        code = 130
    elif best is None:
        errors = df[df["error"].notna()]
        first = errors["error"].iloc[0] if len(errors) else "no trial reported a validation metric"
        raise UserError(f"no trial of the search finished: {first}")
    else:
        code = 0
    return {"exit_code": code, "trials": df, "best": best, "out": out}


# ----------------------------------------------------------------------------- the directory

def prepare_dir(out: str, spec: TuneSpec) -> bool:
    """Create or check the search directory; True when it holds a search to resume."""
    from ray import tune

    record = _normalise(spec.record())
    rec_path = os.path.join(out, "search.yaml")
    exp_dir = os.path.join(out, EXPERIMENT)
    if os.path.isfile(rec_path):
        with open(rec_path, encoding="utf-8") as fh:
            old = yaml.safe_load(fh) or {}
        old.setdefault("max_failures", record["max_failures"])  # searches begun before the key existed
        diff = _diff(old, record)
        if diff:
            raise UserError(f"{out} holds a different search ({'; '.join(diff[:4])}); rerun it with the "
                            "same config and overrides to resume it, or choose a new --out")
        if tune.Tuner.can_restore(exp_dir) and repair_state(exp_dir, os.path.join(out, BACKUP)):
            return True
        for stale in ("optuna.journal", EXPERIMENT, BACKUP):  # interrupted before Tune saved anything
            p = os.path.join(out, stale)
            if os.path.isdir(p):
                shutil.rmtree(p)
            elif os.path.exists(p):
                os.remove(p)
    elif os.path.isdir(out) and [n for n in os.listdir(out) if not n.startswith(LOCK)]:  # (our own lock)
        raise UserError(f"{out} exists and is not a raysim search directory; choose another --out")
    os.makedirs(out, exist_ok=True)
    write_text(rec_path, "# The resolved search (raysim tune). A rerun of the same search resumes it.\n"
               + yaml.safe_dump(record, sort_keys=False))
    return False


def check_owned(out: str) -> None:
    """Refuse a search directory that another user owns or could have written to: the directory,
    Tune's state in it (``tune/``, which ``Tuner.restore`` unpickles: pickles run code) and its
    backup (copied back into ``tune/`` after a kill). Each must belong to this user and be
    writable by no one else; a UserError names the first that is not."""
    me = os.getuid()
    for top in (out, os.path.join(out, EXPERIMENT), os.path.join(out, BACKUP)):
        for folder, dirs, names in os.walk(top) if top != out else [(out, [], [])]:
            for path in [folder] + [os.path.join(folder, n) for n in dirs + names]:
                try:
                    st = os.lstat(path)
                except FileNotFoundError:
                    continue
                why = (f"owned by uid {st.st_uid}" if st.st_uid != me
                       else "writable by others" if st.st_mode & stat.S_IWOTH and not stat.S_ISLNK(st.st_mode)
                       else "writable by its group" if st.st_mode & stat.S_IWGRP and not stat.S_ISLNK(st.st_mode)
                       else None)
                if why:
                    fix = "choose another --out" if st.st_uid != me else f"run: chmod -R go-w {out}"
                    raise UserError(
                        f"{path} is {why}: raysim tune resumes a search by unpickling Tune's state in {out}, "
                        f"which runs code, so it uses only a search directory that this user (uid {me}) "
                        f"alone can write; {fix}")


@contextlib.contextmanager
def private_writes():
    """Files and folders created inside are writable by this user only (the umask plus go-w),
    whatever the umask was (002 is common): a later resume accepts them (check_owned)."""
    old = os.umask(0o077)
    os.umask(old | 0o022)
    try:
        yield
    finally:
        os.umask(old)


def _normalise(obj):
    return yaml.safe_load(yaml.safe_dump(obj, sort_keys=False))


def _diff(old, new, prefix="") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k in list(old) + [k for k in new if k not in old]:
            out += _diff(old.get(k), new.get(k), f"{prefix}{k}.")
        return out
    if old != new:
        return [f"{prefix[:-1]}: {old!r} -> {new!r}"]
    return []


def _shown(path: str) -> str:
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def saved_trials(exp_dir: str, out: str) -> list[dict]:
    """The trials of Tune's newest saved experiment state: number, name and status, where a trial
    saved as running counts as failed if the driver saw it fail for good, and as finished if its
    run directory holds its result (it replays its reports)."""
    groups = _state_groups(exp_dir)
    if not groups:
        return []
    with open(os.path.join(exp_dir, f"experiment_state-{groups[-1]}.json"), encoding="utf-8") as fh:
        state = json.load(fh)
    trials = []
    for trial_json, _ in state.get("trial_data", []):
        t = json.loads(trial_json) if isinstance(trial_json, str) else trial_json
        number = trial_number(t.get("experiment_tag", ""))
        name = f"{number:03d}_{t.get('trial_id')}"
        status, run_dir = t.get("status"), os.path.join(out, "trials", name)
        if status not in ("TERMINATED", "ERROR"):
            # Tune can save a trial that failed for good as still running (when its worker had died,
            # Tune does not save the failed state): its ``finished`` record says so
            if _read_text(os.path.join(run_dir, "finished")) == "error":
                status = "ERROR"
            elif os.path.isfile(os.path.join(run_dir, "result.json")):
                status = "TERMINATED"
        trials.append({"trial": number, "name": name, "status": status})
    return sorted(trials, key=lambda t: t["trial"])


def resume_plan(saved: list[dict], total: int, out: str) -> str:
    """What a rerun runs, in one line: e.g. ``search complete: 12 trials; re-running 1 failed
    trial (trial 7) from its last checkpoint``."""
    failed = [t["trial"] for t in saved if t["status"] == "ERROR"]
    interrupted = [t["trial"] for t in saved if t["status"] not in ("TERMINATED", "ERROR")]
    done = len(saved) - len(failed) - len(interrupted)
    to_sample = max(0, total - len(saved))
    if not interrupted and not to_sample:
        if not failed:
            return f"search complete: {done} trials; nothing to re-run (rewriting its outputs)"
        return (f"search complete: {len(saved)} trials; re-running {_trials_phrase(failed, 'failed')} "
                f"{'from its' if len(failed) == 1 else 'each from its'} last checkpoint")
    parts = [f"continuing {_trials_phrase(interrupted, 'interrupted')}" if interrupted else None,
             f"re-running {_trials_phrase(failed, 'failed')}" if failed else None,
             f"sampling {to_sample} more" if to_sample else None]
    return (f"resuming the search in {out}: {done} of {total} trials finished; "
            + ", ".join(p for p in parts if p) + (" (each from its last checkpoint)" if interrupted or failed else ""))


def _trials_phrase(numbers: list[int], kind: str) -> str:
    """``1 failed trial (trial 7)``, ``2 failed trials (trials 3, 7)``."""
    many = len(numbers) != 1
    return (f"{len(numbers)} {kind} trial{'s' if many else ''} "
            f"(trial{'s' if many else ''} {', '.join(str(n) for n in numbers)})")


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read().strip()
    except OSError:
        return None


def _read_int(path: str, default=0) -> int:
    try:
        with open(path) as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return int(default or 0)


class _TrialFailureFilter(logging.Filter):
    def filter(self, record) -> bool:
        msg = str(record.msg)
        return not (msg.startswith("Trial task failed for trial") or msg.startswith("Trials did not complete"))


def _quiet() -> None:
    """Keep Ray Tune and Optuna to warnings; our own lines say what happens."""
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    os.environ.setdefault("RAY_CHDIR_TO_TRIAL_DIR", "0")
    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", "2")  # snapshot often: cheap next to a federation
    try:
        import optuna
        optuna.logging.set_verbosity(optuna.logging.WARNING)
    except ImportError:  # pragma: no cover
        pass
    logging.getLogger("ray.tune").setLevel(logging.WARNING)
    # a failed trial is one line of ours (its cause; retried or not) and its full traceback stays in
    # Tune's error.txt: not Tune's logged traceback of every failure and its closing list
    for name in ("ray.tune.execution.tune_controller", "ray.tune.tune"):
        log = logging.getLogger(name)
        if not any(isinstance(f, _TrialFailureFilter) for f in log.filters):
            log.addFilter(_TrialFailureFilter())
    # a restored trial that never reported has no result files yet; Tune warns about each
    logging.getLogger("ray.tune.analysis.experiment_analysis").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="optuna")
    warnings.filterwarnings("ignore", category=FutureWarning, module="ray")
