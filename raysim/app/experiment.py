"""The driver: start (or join) Ray, run every federation of a config, write the run directory.

    run(cfg) -> one federation per method x seed x held-out domain (raysim.engine.loop),
                side by side when the cluster fits several -> summary.md and curves.png on top.

A federation reports through callbacks: metrics.parquet (MetricsWriter), its progress line
(ProgressCallback), and whatever the caller adds (Tune's reporting, a test's probe).
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

from raysim.app.configs import check_methods, load_checked, method_keys
from raysim.config import ExperimentConfig, dump_yaml
from raysim.core.errors import (Interrupted, MethodFailed, RunFailed, TrainingDiverged, UserError, first_line,
                                 forget_signal, signal_of)
from raysim.engine.metrics import MetricsWriter
from raysim.app.progress import LiveBoard, ProgressCallback, for_terminal, live_terminal
from raysim.app.rundir import LOCK, RunLock, has_progress, holds_run_of, plan
from raysim.core.files import WriteFailed, writing
from raysim.engine import runstate
from raysim.engine.loop import Callback, FederationResult, FederationRun, finished
from raysim.app.tracking import log_report, tracking_callbacks

__all__ = ["run", "run_method", "federation", "resume_config", "FederationResult"]


def default_run_dir(cfg: ExperimentConfig) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = cfg.name or "-".join(method_keys(cfg))
    return os.path.join("runs", f"{name}-{stamp}")


def run(cfg: ExperimentConfig, out: str | None = None, address: str | None = None,
        progress: bool = True, resume: bool = False, debug: bool = False) -> list[FederationResult]:
    """Run every method of ``cfg`` (once per seed of ``cfg.seeds``) on the same data; return one
    FederationResult per federation. With ``resume``, federations already finished are skipped and the
    others continue from their last checkpoint. ``out`` holding a run of this same config that got
    somewhere resumes it too (so a supervisor reruns the same command); another config's run is
    refused. One writer per folder: ``out/raysim.lock`` (raysim.app.rundir.RunLock).

    A federation whose method raises (a bug) or diverges stops alone: the others run to the end,
    the summary shows what finished, then :class:`MethodFailed` (or the divergence's UserError)
    names what failed. Any other error, Ctrl-C or SIGTERM ends every federation within seconds.
    ``debug``: no Ray at all; every federation in this process, one after another (the InProcess
    backend), so ``breakpoint()`` and pdb work inside a method."""
    import ray

    from raysim.app.preflight import preflight
    from raysim.engine.cluster import no_leftover_ray_processes

    check_methods(cfg)
    forget_signal()
    own_ray = not ray.is_initialized() and not debug  # a Ray node this call starts, and ends, itself
    preflight(cfg, address=address, own_ray=own_ray)  # every mistake found without training: before Ray, before the folder
    run_dir = out or default_run_dir(cfg)
    made, held = folders_to_make(run_dir), False
    try:
        with writing(run_dir):
            os.makedirs(run_dir, exist_ok=True)
        with RunLock(run_dir), (no_leftover_ray_processes() if own_ray else contextlib.nullcontext()):
            held = True  # the folder is this command's to remove (another writer's lock refuses it above)
            if not resume and holds_run_of(cfg, run_dir):
                resume = True
                if progress:
                    print(f"raysim: {run_dir} holds a run of this config: continuing it", file=sys.stderr)
            return _run(cfg, run_dir, address, progress, resume, debug)
    except KeyboardInterrupt as err:
        hint = (f"; resume with: raysim run --resume {run_dir}" if os.path.isfile(os.path.join(run_dir, "config.yaml"))
                and has_progress(run_dir) else "")
        raise Interrupted(f"interrupted{hint}", signal=signal_of(err)) from None
    except UserError:
        if held:
            remove_unstarted(made)
        raise


# what a run writes before its first round: nothing that a rerun of a corrected command needs
_UNSTARTED = frozenset({"config.yaml", "hosts.json", LOCK})


def folders_to_make(run_dir: str) -> list[str]:
    """The folders ``os.makedirs(run_dir)`` would create, outermost first ([] where it exists)."""
    missing, path = [], os.path.abspath(run_dir)
    while not os.path.exists(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return missing[::-1]


def remove_unstarted(made: list[str]) -> None:
    """Remove the run folder this command made (``made``: :func:`folders_to_make`'s list) after a
    user error ended the run before any federation got anywhere: it holds only the config, the
    hosts' placement and TensorBoard's header files, and a corrected command starts afresh. A
    folder holding progress, or any other file, is kept. Faults (a lost actor, Ctrl-C, a full disk)
    keep theirs: their messages name it for ``raysim run --resume``."""
    if not made:
        return
    run_dir = made[-1]
    if not os.path.isdir(run_dir) or has_progress(run_dir):
        return
    for root, dirs, files in os.walk(run_dir):
        if os.path.basename(root) == "tb":  # TensorBoard's event files: the config's hparams, no round yet
            dirs[:] = []
            continue
        if set(files) - _UNSTARTED:
            return
    import shutil
    shutil.rmtree(run_dir, ignore_errors=True)
    for parent in reversed(made[:-1]):  # runs/, if this command made it and nothing else is there
        try:
            os.rmdir(parent)
        except OSError:
            break


def _run(cfg: ExperimentConfig, run_dir: str, address: str | None, progress: bool, resume: bool,
         debug: bool = False) -> list[FederationResult]:
    from raysim.engine.cluster import quiet_worker_death_notices, ray_session

    if not resume:
        with writing(os.path.join(run_dir, "config.yaml")):
            dump_yaml(cfg, os.path.join(run_dir, "config.yaml"))
    names = method_keys(cfg)
    jobs = [(one, sub) for one, sub in plan(cfg, run_dir) if not (resume and finished(sub, one))]
    # on a terminal, one live table for every federation (rows updated in place, the final table
    # left on screen); otherwise plain progress lines
    board = LiveBoard(title=f"raysim {cfg.name or '-'.join(names)}") if progress and jobs and live_terminal() else None
    if resume and not jobs and progress:
        print(f"raysim: every federation in {run_dir} has finished; its summary is rendered again", file=sys.stderr)
    results, failed = [], []
    if jobs:  # a finished run's rerun only renders its summary again: no Ray
        # a plugin method or dataset reaches every actor (Ray's runtime_env: cluster.ray_session)
        datasets = [one.data.dataset for one, _ in jobs if not one.data.shards]
        ray_or_not = contextlib.nullcontext() if debug else ray_session(address or cfg.runtime.address, cfg.runtime,
                                                                         methods=cfg.method_names(), datasets=datasets)
        if not debug:
            warm_imports(tensorboard=cfg.tracking.tensorboard)
        with ray_or_not:
            if not debug:
                quiet_worker_death_notices()
            try:
                if board is not None:
                    board.start()
                results, failed = _run_federations(jobs, progress, resume, show_seed=bool(cfg.seeds), board=board,
                                                   top=run_dir, debug=debug)
            finally:
                if board is not None:
                    board.stop()
    if len(failed) == len(jobs) == 1:  # one federation: its own error, traceback and all
        raise failed[0][1]
    text = None
    if len(failed) < len(jobs) or not jobs:
        from raysim.app import report
        try:
            text = report.render(run_dir)
        except WriteFailed as err:
            raise RunFailed(f"{err}; every federation finished and its metrics.parquet is intact; render the "
                            f"summary again with: raysim report {run_dir}") from None
        log_report(cfg, run_dir)  # summary.md and curves.png into each federation's MLflow run
        if progress:
            print(for_terminal(text))
            print(f"run directory: {run_dir}")
    if failed:
        raise _failed_federations(failed, len(jobs), run_dir, rendered=text is not None)
    return results


# What the driver imports only once Ray is up (the actors' classes, TensorBoard's writer) or after
# round 1 (pandas, through pyarrow's first table and the summary): imported by a thread while
# ray.init waits on Ray's processes, they are off the first round's path (docs/results.md §11).
WARM_IMPORTS = ("raysim.engine.server", "raysim.engine.host", "raysim.app.report")


def warm_imports(tensorboard: bool = True) -> threading.Thread:
    """Import :data:`WARM_IMPORTS` (and TensorBoard's writer) in a daemon thread, now."""
    import importlib

    names = WARM_IMPORTS + (("torch.utils.tensorboard",) if tensorboard else ())

    def run() -> None:
        for name in names:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - the import that needs it raises it again, where it is read
                return

    thread = threading.Thread(target=run, name="raysim-warm-imports", daemon=True)
    thread.start()
    return thread


# A federation's own failure, which ends it alone: its method's bug, or its training diverging
OWN_FAILURES = (MethodFailed, TrainingDiverged)
# How long the driver waits for the other federations to end on a stop: one in its round loop ends
# within a poll slice (0.5 s), its files written, then its actors (END_ACTORS_S); one still starting
# may hang in a Ray call a draining GCS never answers (an actor class's export, after a SIGTERM to
# the process group), and has nothing to write. 4 s: room for a loaded machine's slow threads, and
# a comparison's SIGTERM still ends in ~7 s at worst here (3.5 s when no federation is starting).
STOP_GRACE_S = 4.0


def _failed_federations(failed: list, total: int, run_dir: str, rendered: bool) -> Exception:
    """The one error for federations that failed on their own, the others finished: a method's
    bug (exit 1) before a divergence (a user's setting, exit 2)."""
    names = "; ".join(f"{os.path.relpath(sub, run_dir)}: {getattr(err, 'short', None) or first_line(err)}"
                      for sub, err in failed)
    done = (f"the other {total - len(failed)} finished and summary.md shows them; " if rendered else "")
    line = (f"{len(failed)} of {total} federations failed ({names}); {done}fix, then rerun the same command "
            "(finished federations are kept)")
    if any(isinstance(err, MethodFailed) for _, err in failed):
        return MethodFailed(line)
    return UserError(line)


def federation(cfg: ExperimentConfig, run_dir: str, progress: bool | str = True, on_round=None,
               show_seed: bool = False, backend=None, board: LiveBoard | None = None,
               top: str | None = None, stop=None) -> FederationRun:
    """One federation with the driver's callbacks: metrics.parquet, a progress line (a row of
    ``board``, the driver's live table, if given), and ``on_round(round, summary, evaluation or
    None)`` if given (Tune reports through it).
    ``backend=raysim.engine.backend.InProcess()`` runs it without Ray actors (debugging).
    ``top``: the folder the command was given, which its resume hints name (default ``run_dir``);
    ``stop``: a ``threading.Event`` that ends the federation early (raysim.engine.loop.FederationRun)."""
    holdout = (cfg.data.partition or {}).get("holdout")
    method = method_keys(cfg)[0]
    label = method + (f"[{holdout}]" if holdout else "") + (f"[seed {cfg.seed}]" if show_seed else "")
    detail = ", ".join(([f"holdout {holdout}"] if holdout else []) + ([f"seed {cfg.seed}"] if show_seed else []))
    callbacks = [MetricsWriter(run_dir, cfg),
                 ProgressCallback(cfg.rounds, label, progress, board=board, method=method, detail=detail),
                 *tracking_callbacks(cfg, run_dir)]  # TensorBoard, MLflow (cfg.tracking)
    if on_round is not None:
        callbacks.append(RoundFunction(on_round))
    fed = FederationRun(cfg, run_dir, callbacks, backend, stop=stop)
    fed.resume_dir = top or run_dir
    return fed


class RoundFunction(Callback):
    """A plain ``f(round, summary, evaluation)`` as a round-loop callback."""

    def __init__(self, fn):
        self.fn = fn

    def on_round(self, rnd, summary, evaluation, log) -> None:
        self.fn(rnd, summary, evaluation)


def run_method(cfg: ExperimentConfig, run_dir: str, progress: bool = True, on_round=None) -> FederationResult:
    """One federation of one method."""
    return federation(cfg, run_dir, progress=progress, on_round=on_round).run()


def _run_federations(jobs: list, progress: bool, resume: bool, show_seed: bool = False,
                     board: LiveBoard | None = None, top: str | None = None,
                     debug: bool = False) -> tuple[list[FederationResult], list[tuple[str, Exception]]]:
    """Run the federations one after another, or as many at once as the cluster fits: they are
    independent (every draw is keyed by seed, round and client), so the results are the same.

    Returns (the finished federations' results, [(folder, error)] of those that failed on their
    own: :data:`OWN_FAILURES`, each said on stderr as it happens). Any other error, Ctrl-C or
    SIGTERM sets ``stop``: every federation still running ends within a second or two (they are
    waited for, at most ``STOP_GRACE_S``, before Ray is shut down), and the error is raised."""
    import queue

    from raysim.engine.backend import InProcess
    from raysim.engine.cluster import parallel_slots

    stop = threading.Event()
    results, failed = {}, []

    def own_failure(sub: str, err: Exception) -> None:
        failed.append((sub, err))
        if len(jobs) > 1:  # one federation alone: the CLI prints it
            text = getattr(err, "traceback", "")
            print((text.rstrip() + "\n" if text else "") + f"raysim: {os.path.relpath(sub)}: {first_line(err)}",
                  file=sys.stderr)

    def one_federation(one, sub, lines):
        result = federation(one, sub, lines, show_seed=show_seed, board=board, top=top, stop=stop,
                            backend=InProcess() if debug else None).run(resume=resume)
        if lines == "lines" and board is None:  # on the live table, the row says so
            print(f"raysim: {os.path.relpath(sub)} done: {result.rounds_done} rounds in {result.seconds:.0f} s",
                  file=sys.stderr)
        return result

    slots = 1 if debug or not jobs else parallel_slots(jobs[0][0], len(jobs))
    try:
        if slots <= 1:
            for i, (one, sub) in enumerate(jobs):
                try:
                    results[i] = one_federation(one, sub, progress)
                except OWN_FAILURES as err:
                    own_failure(sub, err)
            return list(results.values()), failed
        if progress and board is None:
            print(f"raysim: running {len(jobs)} federations, {slots} at a time", file=sys.stderr)
        ended: queue.Queue = queue.Queue()  # (job index, result, error) as each federation ends

        def in_thread(i: int, one, sub) -> None:
            try:
                ended.put((i, one_federation(one, sub, "lines" if progress else False), None))
            except BaseException as err:  # noqa: BLE001 -- handed to the driver's thread
                ended.put((i, None, err))

        started = running = 0
        try:
            while started < len(jobs) or running:
                while running < slots and started < len(jobs):  # daemon threads: an ending driver never waits
                    threading.Thread(target=in_thread, args=(started, *jobs[started]), daemon=True,
                                     name=f"federation-{started}").start()
                    started, running = started + 1, running + 1
                try:
                    i, result, err = ended.get(timeout=0.5)
                except queue.Empty:
                    continue
                running -= 1
                if err is None:
                    results[i] = result
                elif isinstance(err, OWN_FAILURES):
                    own_failure(jobs[i][1], err)
                else:
                    raise err
            return [results[i] for i in sorted(results)], failed
        finally:
            stop.set()  # a no-op once all are done; else every federation still running ends now
            deadline = time.monotonic() + STOP_GRACE_S
            while running and time.monotonic() < deadline:
                try:
                    ended.get(timeout=max(0.0, deadline - time.monotonic()))
                    running -= 1
                except queue.Empty:
                    break
    except KeyboardInterrupt as err:
        hint = f"; resume with: raysim run --resume {top}" if top else ""
        raise Interrupted(f"interrupted; finished federations are kept{hint}", signal=signal_of(err)) from None


def resume_config(run_dir: str, overrides: list[str]) -> ExperimentConfig:
    """The run's own config; only runtime.* may be changed on resume. A folder whose state does
    not match it (its config.yaml edited since, another config's checkpoints) is refused."""
    bad = [o for o in overrides if not o.split("=", 1)[0].startswith("runtime.")]
    if bad:
        raise UserError(f"--resume continues the run as configured; only runtime.* overrides are allowed, "
                        f"got {bad[0]!r}")
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(path):
        raise UserError(f"--resume {run_dir}: no config.yaml there (is it a raysim run directory?)")
    cfg = load_checked(path, overrides)
    for one, sub in plan(cfg, run_dir):
        runstate.check(sub, one)
    return cfg


def num_clients(cfg: ExperimentConfig) -> int:
    """How many clients ``cfg``'s federation has (its data partition's, or its shards')."""
    from raysim.engine.federation import Federation
    return Federation(cfg).num_clients
