"""One trial = one whole federation, reserved as one placement group.

Bundle 0 is the trial's own (the Tune function that drives the federation, plus the Server's
CPUs); bundle 1+h is ClientHost h with ``runtime.cpus_per_host`` CPUs and ``runtime.gpus_per_host``
GPUs, exactly as ``raysim run`` reserves them. ``raysim.engine.cluster.create_pool`` sees the
trial's group and places host h on bundle 1+h, so a trial never competes with another for its
hosts, and Tune starts a trial only once its whole group fits.

The trial reports after every evaluated round: ``round``, ``val_avg``/``val_all`` (latest),
``val_avg_best``/``val_all_best`` (running maxima), ``train_loss``. It keeps a ledger in its run
directory (``progress.json`` per round, ``result.json`` when done): a search restored after an
interruption replays a finished trial's reports instead of running its federation again. A trial
started again (Tune's retry after a failure, a restored search, a rerun of a failed trial) continues
its federation from the newest checkpoint in its run directory (``checkpoint.every``), or from
round 0 without one; its earlier reports up to there stand.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from raysim.config import set_path
from raysim.core import files
from raysim.core.errors import UserError, first_line
from raysim.tuning import space as sp

if TYPE_CHECKING:
    from raysim.engine.messages import RoundSummary

HEAD_MEMORY = 64 * 2**20  # bytes; keeps bundle 0 non-empty when the trial itself asks for 0 CPUs


# ----------------------------------------------------------------------------- resources

def trial_bundles(runtime, num_hosts: int, trial_cpus: float = 0.0) -> list[dict]:
    """``[{trial + server}] + [{host}] * num_hosts`` for ``tune.PlacementGroupFactory``.

    Tune drops an empty first bundle (and the hosts would shift to 0..H-1), so bundle 0 always
    carries a little logical memory next to its CPUs.
    """
    head = {"CPU": float(trial_cpus) + float(runtime.server_cpus), "memory": HEAD_MEMORY}
    host = {"CPU": float(runtime.cpus_per_host)}
    if runtime.gpus_per_host:
        host["GPU"] = float(runtime.gpus_per_host)
    return [head] + [dict(host) for _ in range(num_hosts)]


def placement_factory(bundles: list[dict], strategy: str = "PACK"):
    from ray import tune
    return tune.PlacementGroupFactory(bundles, strategy=strategy)


def num_hosts_for(run_raw: dict) -> int:
    """How many ClientHosts a trial's federation starts (``host_layout`` of its client count).

    Computed once, in a Ray task that builds the federation's partition: that also fills the
    dataset cache before trials start (so concurrent trials do not all generate it) and turns
    a data error into one clear message instead of one failed trial after another.
    """
    import ray
    from raysim.app.configs import load_checked
    from raysim.engine.cluster import with_plugins
    from raysim.engine.layout import host_layout

    try:
        n = ray.get(ray.remote(**with_plugins(dict(num_cpus=0, max_retries=0)))(_count_clients).remote(run_raw))
    except ray.exceptions.RayTaskError as err:
        cause = getattr(err, "cause", None)
        if isinstance(cause, UserError):  # e.g. a dataset root that does not exist
            raise UserError(first_line(cause)) from None
        raise
    return host_layout(load_checked(raw=run_raw).runtime, n)[0]


def _count_clients(run_raw: dict) -> int:
    from raysim.app.configs import load_checked
    from raysim.app.experiment import num_clients
    return num_clients(load_checked(raw=run_raw))


def check_fits(bundles: list[dict], local: bool) -> None:
    """A trial whose group can never be placed would wait forever: fail now on a local Ray,
    warn on a cluster (an autoscaler may still add nodes)."""
    import ray

    total = ray.cluster_resources()
    short = []
    for res in ("CPU", "GPU"):
        need = sum(b.get(res, 0.0) for b in bundles)
        if need > total.get(res, 0.0) + 1e-9:
            short.append(f"{need:g} {res} (Ray has {total.get(res, 0.0):g})")
    if not short:
        return
    hosts = len(bundles) - 1
    msg = (f"one trial needs {' and '.join(short)}: {hosts} host(s) x {bundles[1] if hosts else {}} plus "
           f"{bundles[0].get('CPU', 0):g} CPU for the trial and server; lower runtime.num_hosts, "
           "runtime.cpus_per_host or runtime.gpus_per_host")
    if local:
        raise UserError(msg)
    print(f"raysim tune: warning: {msg}", flush=True)


# ----------------------------------------------------------------------------- the trainable

@dataclass
class TrialContext:
    """What every trial needs besides its sampled hyperparameters (pickled into the trainable)."""
    run_experiment: dict  # TuneSpec.run_experiment()
    search_dir: str
    rounds: int
    # the plugins' modules for the trial's actors where the driver's Ray was connected before the
    # search (raysim.engine.cluster.shipped); None: the job's runtime_env carries them
    plugins: dict | None = None


def make_trainable(ctx: TrialContext, bundles: list[dict], strategy: str):
    from ray import tune

    def raysim_trial(config):
        from raysim.engine.cluster import shipped

        with shipped(ctx.plugins):
            run_trial(config, ctx)

    return tune.with_resources(raysim_trial, placement_factory(bundles, strategy))


class Tracker:
    """Per-round reports with running maxima."""

    def __init__(self, rounds: int, attempt: int, earlier: list[dict] = ()):
        """``earlier``: an earlier attempt's reports; those of rounds this attempt runs again
        (it resumed from an older checkpoint, or from round 0) are dropped as it reaches them."""
        self.rounds, self.attempt = rounds, attempt
        self.reports: list[dict] = [dict(r) for r in earlier]
        self.last_loss = math.nan
        self.last_round = 0
        self._rebest()

    def _rebest(self) -> None:
        self.best = {k: max([r[k] for r in self.reports], default=-math.inf) for k in ("val_avg", "val_all")}

    def update(self, rnd: int, summary: RoundSummary | None, evaluation: dict | None) -> dict | None:
        if self.reports and self.reports[-1]["round"] >= rnd:  # a round run again replaces its report
            self.reports = [r for r in self.reports if r["round"] < rnd]
            self._rebest()
        self.last_round = rnd
        self.last_loss = float(summary.train_loss) if summary is not None else math.nan
        if not evaluation or "val" not in evaluation:
            return None
        val = evaluation["val"]
        report = {"round": rnd, "rounds_total": self.rounds, "val_avg": float(val["AVG"]),
                  "val_all": float(val["ALL"]), "train_loss": self.last_loss, "diverged": 0,
                  "attempt": self.attempt, "replayed": 0}
        for k in ("val_avg", "val_all"):
            self.best[k] = max(self.best[k], report[k])
            report[f"{k}_best"] = self.best[k]
        self.reports.append(report)
        return report

    def diverged(self, rnd: int) -> dict:
        """A NaN loss ends the trial: its latest accuracy counts as 0 (no usable model); the best
        so far stands, since that model existed."""
        report = {"round": rnd, "rounds_total": self.rounds, "val_avg": 0.0, "val_all": 0.0,
                  "train_loss": math.inf, "diverged": 1, "attempt": self.attempt, "replayed": 0}
        for k in ("val_avg", "val_all"):
            self.best[k] = max(self.best[k], 0.0)
            report[f"{k}_best"] = self.best[k]
        self.reports.append(report)
        return report


def run_trial(params: dict, ctx: TrialContext) -> None:
    """The Tune function: run one federation with ``params`` and report its evaluated rounds."""
    from ray import tune
    from raysim.app.configs import load_checked
    from raysim.app.experiment import federation

    run_dir = os.path.join(ctx.search_dir, "trials", tune.get_context().get_trial_name())
    done = read_json(os.path.join(run_dir, "result.json"))
    if done is not None:  # finished before an interruption: replay, do not run it again
        for report in done["reports"]:
            tune.report({**report, "replayed": 1})
        return
    os.makedirs(run_dir, exist_ok=True)
    attempt = _bump_attempts(run_dir)
    # A retry (Tune's FailureConfig, or a rerun of the search) continues the federation from its
    # last checkpoint in the run directory (round 0 without one): its earlier rounds stand.
    resume = attempt > 1
    earlier = (read_json(os.path.join(run_dir, "progress.json")) or {}).get("reports", []) if resume else []
    raw = sp.apply_params(ctx.run_experiment, params)
    # The Server's CPUs are reserved in bundle 0; the actor itself asks for none so that Ray's
    # capture of child actors into the trial's group cannot put it on a host's bundle.
    set_path(raw, "runtime.server_cpus", 0.0)
    # each trial is tracked like a `raysim run` federation (TensorBoard in its run directory, MLflow
    # if configured), named after the trial so a search's runs line up with trials.parquet
    set_path(raw, "tracking.run_name", os.path.basename(run_dir))
    cfg = load_checked(raw=raw)
    _write_placement(run_dir)
    tracker = Tracker(cfg.rounds, attempt, earlier)
    t0 = time.time()

    def on_round(rnd, summary, evaluation):
        report = tracker.update(rnd, summary, evaluation)
        if report is None:
            return
        write_json(os.path.join(run_dir, "progress.json"), {"params": params, "reports": tracker.reports})
        if rnd < cfg.rounds:
            tune.report(dict(report))  # blocks until Tune asks for more: a stopped trial ends here
        # the last round is reported after the federation returns (so metrics.parquet gets written)

    try:
        federation(cfg, run_dir, progress=False, on_round=on_round).run(resume=resume)
        stop = "completed"
    except UserError as err:
        if not str(err).startswith("training diverged"):
            raise
        tracker.diverged(min(tracker.last_round + 1, cfg.rounds))
        stop = "diverged"
    if not tracker.reports:
        raise UserError("the federation finished without a validation evaluation to report")
    # The ledger first: Tune may stop the trial at its final report and never return from it.
    write_json(os.path.join(run_dir, "result.json"),
               {"params": params, "reports": tracker.reports, "stop": stop, "attempt": attempt,
                "seconds": time.time() - t0})
    tune.report(dict(tracker.reports[-1]))


def _bump_attempts(run_dir: str) -> int:
    path = os.path.join(run_dir, "attempts")
    try:
        with open(path) as fh:
            n = int(fh.read().strip() or 0)
    except (OSError, ValueError):
        n = 0
    files.write_text(path, f"{n + 1}\n")
    return n + 1


def _write_placement(run_dir: str) -> None:
    """Where this trial's federation lives: its placement group and bundles (for debugging)."""
    try:
        import ray
        from ray.util.placement_group import get_current_placement_group
        pg = get_current_placement_group()
        info = {"placement_group": pg.id.hex() if pg is not None else None,
                "bundles": pg.bundle_specs if pg is not None else None,
                "node": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}
        write_json(os.path.join(run_dir, "placement.json"), info)
    except Exception:  # diagnostics only
        pass


def read_json(path: str):
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def write_json(path: str, obj) -> None:
    """Atomic: a trial killed mid-write leaves the previous file, never half of one."""
    files.write_json(path, obj, indent=1, default=_jsonable)


def _jsonable(v):
    v = sp.plain(v)
    if isinstance(v, (int, float, str, bool)) or v is None:
        return v
    return str(v)
