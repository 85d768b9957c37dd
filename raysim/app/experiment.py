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
import time

from raysim.app.configs import check_methods, load_checked, method_keys
from raysim.config import ExperimentConfig, dump_yaml
from raysim.core.errors import Interrupted, RunFailed, UserError
from raysim.engine.metrics import MetricsWriter
from raysim.app.progress import LiveBoard, ProgressCallback, live_terminal
from raysim.app.rundir import LOCK, RunLock, has_progress, holds_run_of, plan
from raysim.core.files import WriteFailed, writing
from raysim.engine.loop import Callback, FederationResult, FederationRun, finished
from raysim.app.tracking import log_report, tracking_callbacks

__all__ = ["run", "run_method", "federation", "resume_config", "FederationResult"]


def default_run_dir(cfg: ExperimentConfig) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = cfg.name or "-".join(method_keys(cfg))
    return os.path.join("runs", f"{name}-{stamp}")


def run(cfg: ExperimentConfig, out: str | None = None, address: str | None = None,
        progress: bool = True, resume: bool = False) -> list[FederationResult]:
    """Run every method of ``cfg`` (once per seed of ``cfg.seeds``) on the same data; return one
    FederationResult per federation. With ``resume``, federations already finished are skipped and the
    others continue from their last checkpoint. ``out`` holding a run of this same config that got
    somewhere resumes it too (so a supervisor reruns the same command); another config's run is
    refused. One writer per folder: ``out/raysim.lock`` (raysim.app.rundir.RunLock)."""
    import ray

    from raysim.app.preflight import preflight
    from raysim.engine.cluster import no_leftover_ray_processes

    check_methods(cfg)
    own_ray = not ray.is_initialized()  # a Ray node this call starts, and ends, itself (or a joined cluster)
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
            return _run(cfg, run_dir, address, progress, resume)
    except KeyboardInterrupt as err:
        hint = (f"; resume with: raysim run --resume {run_dir}" if os.path.isfile(os.path.join(run_dir, "config.yaml"))
                and has_progress(run_dir) else "")
        raise Interrupted(f"interrupted{hint}", signal=getattr(err, "signal", 2)) from None
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


def _run(cfg: ExperimentConfig, run_dir: str, address: str | None, progress: bool, resume: bool) -> list[FederationResult]:
    from raysim.app import report
    from raysim.engine.cluster import quiet_worker_death_notices, ray_session

    if not resume:
        with writing(os.path.join(run_dir, "config.yaml")):
            dump_yaml(cfg, os.path.join(run_dir, "config.yaml"))
    names = method_keys(cfg)
    jobs = [(one, sub) for one, sub in plan(cfg, run_dir) if not (resume and finished(sub))]
    # on a terminal, one live table for every federation (rows updated in place, the final table
    # left on screen); otherwise plain progress lines
    board = LiveBoard(title=f"raysim {cfg.name or '-'.join(names)}") if progress and jobs and live_terminal() else None
    if resume and not jobs and progress:
        print(f"raysim: every federation in {run_dir} has finished; its summary is rendered again", file=sys.stderr)
    results = []
    if jobs:  # a finished run's rerun only renders its summary again: no Ray
        with ray_session(address or cfg.runtime.address, cfg.runtime, methods=cfg.method_names()):
            quiet_worker_death_notices()
            try:
                if board is not None:
                    board.start()
                results = _run_federations(jobs, progress, resume, show_seed=bool(cfg.seeds), board=board,
                                           top=run_dir)
            finally:
                if board is not None:
                    board.stop()
    try:
        text = report.render(run_dir)
    except WriteFailed as err:
        raise RunFailed(f"{err}; every federation finished and its metrics.parquet is intact; render the "
                        f"summary again with: raysim report {run_dir}") from None
    log_report(cfg, run_dir)  # summary.md and curves.png into each federation's MLflow run
    if progress:
        print(text)
        print(f"run directory: {run_dir}")
    return results


def federation(cfg: ExperimentConfig, run_dir: str, progress: bool | str = True, on_round=None,
               show_seed: bool = False, backend=None, board: LiveBoard | None = None,
               top: str | None = None) -> FederationRun:
    """One federation with the driver's callbacks: metrics.parquet, a progress line (a row of
    ``board``, the driver's live table, if given), and ``on_round(round, summary, evaluation or
    None)`` if given (Tune reports through it).
    ``backend=raysim.engine.backend.InProcess()`` runs it without Ray actors (debugging).
    ``top``: the folder the command was given, which its resume hints name (default ``run_dir``)."""
    holdout = (cfg.data.partition or {}).get("holdout")
    method = method_keys(cfg)[0]
    label = method + (f"[{holdout}]" if holdout else "") + (f"[seed {cfg.seed}]" if show_seed else "")
    detail = ", ".join(([f"holdout {holdout}"] if holdout else []) + ([f"seed {cfg.seed}"] if show_seed else []))
    callbacks = [MetricsWriter(run_dir),
                 ProgressCallback(cfg.rounds, label, progress, board=board, method=method, detail=detail),
                 *tracking_callbacks(cfg, run_dir)]  # TensorBoard, MLflow (cfg.tracking)
    if on_round is not None:
        callbacks.append(RoundFunction(on_round))
    fed = FederationRun(cfg, run_dir, callbacks, backend)
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
                     board: LiveBoard | None = None, top: str | None = None) -> list[FederationResult]:
    """Run the federations one after another, or as many at once as the cluster fits: they are
    independent (every draw is keyed by seed, round and client), so the results are the same."""
    from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

    from raysim.engine.cluster import parallel_slots

    slots = parallel_slots(jobs[0][0], len(jobs)) if jobs else 1
    if slots <= 1:
        return [federation(one, sub, progress, show_seed=show_seed, board=board, top=top).run(resume=resume)
                for one, sub in jobs]
    if progress and board is None:
        print(f"raysim: running {len(jobs)} federations, {slots} at a time", file=sys.stderr)

    def one_federation(one, sub):
        result = federation(one, sub, "lines" if progress else False, show_seed=show_seed,
                            board=board, top=top).run(resume=resume)
        if progress and board is None:  # on the live table, the row says so
            print(f"raysim: {os.path.relpath(sub)} done: {result.rounds_done} rounds in {result.seconds:.0f} s",
                  file=sys.stderr)
        return result

    pool = ThreadPoolExecutor(max_workers=slots, thread_name_prefix="federation")
    try:
        futures = [pool.submit(one_federation, one, sub) for one, sub in jobs]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        for f in futures:
            if f in done and f.exception() is not None:
                raise f.exception()
        return [f.result() for f in futures]
    except KeyboardInterrupt as err:
        hint = f"; resume with: raysim run --resume {top}" if top else ""
        raise Interrupted(f"interrupted; finished federations are kept{hint}", signal=getattr(err, "signal", 2)) from None
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def resume_config(run_dir: str, overrides: list[str]) -> ExperimentConfig:
    """The run's own config; only runtime.* may be changed on resume."""
    bad = [o for o in overrides if not o.split("=", 1)[0].startswith("runtime.")]
    if bad:
        raise UserError(f"--resume continues the run as configured; only runtime.* overrides are allowed, "
                        f"got {bad[0]!r}")
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(path):
        raise UserError(f"--resume {run_dir}: no config.yaml there (is it a raysim run directory?)")
    return load_checked(path, overrides)


def num_clients(cfg: ExperimentConfig) -> int:
    """How many clients ``cfg``'s federation has (its data partition's, or its shards')."""
    from raysim.engine.federation import Federation
    return Federation(cfg).num_clients
