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
from raysim.app.rundir import RunLock, has_progress, holds_run_of, plan
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
        progress: bool = True, resume: bool = False) -> list[FederationResult]:
    """Run every method of ``cfg`` (once per seed of ``cfg.seeds``) on the same data; return one
    FederationResult per federation. With ``resume``, federations already finished are skipped and the
    others continue from their last checkpoint. ``out`` holding a run of this same config that got
    somewhere resumes it too (so a supervisor reruns the same command); another config's run is
    refused. One writer per folder: ``out/raysim.lock`` (raysim.app.rundir.RunLock)."""
    import ray

    from raysim.engine.cluster import no_leftover_ray_processes

    check_methods(cfg)
    run_dir = out or default_run_dir(cfg)
    own_ray = not ray.is_initialized()  # a Ray node this call starts, and ends, itself (or a joined cluster)
    try:
        with writing(run_dir):
            os.makedirs(run_dir, exist_ok=True)
        with RunLock(run_dir), (no_leftover_ray_processes() if own_ray else contextlib.nullcontext()):
            if not resume and holds_run_of(cfg, run_dir):
                resume = True
                if progress:
                    print(f"raysim: {run_dir} holds a run of this config: continuing it", file=sys.stderr)
            return _run(cfg, run_dir, address, progress, resume)
    except KeyboardInterrupt as err:
        hint = (f"; resume with: raysim run --resume {run_dir}" if os.path.isfile(os.path.join(run_dir, "config.yaml"))
                and has_progress(run_dir) else "")
        raise Interrupted(f"interrupted{hint}", signal=getattr(err, "signal", 2)) from None


def _run(cfg: ExperimentConfig, run_dir: str, address: str | None, progress: bool, resume: bool) -> list[FederationResult]:
    from raysim.app import report
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
    callbacks = [MetricsWriter(run_dir, cfg),
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
