"""Experiment tracking: every federation's metrics in TensorBoard and, optionally, MLflow.

Two round-loop callbacks (:class:`raysim.engine.loop.Callback`), added by
:func:`raysim.app.experiment.federation` from the config's ``tracking`` section:

* :class:`TensorBoardWriter` (``tracking.tensorboard``, on by default): event files in the
  federation's own ``<run_dir>/tb/``, so ``tensorboard --logdir runs/`` shows every method, seed and
  held-out domain of a comparison as a run of its own. The resolved config is written as hparams.
* :class:`MLflowLogger` (``tracking.mlflow_uri``): one MLflow run per federation, named
  ``<method>/seed-<s>[/holdout-<domain>]``, with the flattened config as params, the same metrics
  (step = round), and ``summary.md`` / ``curves.png`` as artifacts once the driver has rendered them
  (:func:`log_report`). Needs the optional extra: ``pip install raysim[mlflow]``.

Both only read the rows the round added to the :class:`raysim.engine.metrics.MetricsLog` (what
``metrics.parquet`` holds); nothing is recomputed. Tags, from a row (client, domain, split, metric):

* federation rows (client -1) of an evaluated split: ``test/AVG``, ``test/ALL``, ``test/<domain>``,
  ``test/AVG_clients``, ``test/AVG_weighted`` (accuracy), ``test/loss/<domain>``, ``test/loss/ALL``
  (and the same under ``val/``);
* other federation rows: ``train/loss`` (and any other training metric a method reports, averaged
  over the round's clients), ``comm/bytes_up``, ``comm/bytes_down``, ``clock/<name>`` (the simulated
  clock), ``server/<name>``;
* per-client training rows: ``train/loss/client_<k>`` (and ``train/<metric>/client_<k>``), for
  federations of at most ``tracking.client_scalars`` clients (100 by default): a cross-device
  federation would add up to a tag per client it ever sampled, thousands that neither TensorBoard
  nor an MLflow server shows usefully (``metrics.parquet`` keeps every client's rows).

Both run in the driver process (callbacks never run on Ray workers).
"""
from __future__ import annotations

import json
import math
import os
import re
import sys
import time

from raysim.core.errors import UserError, first_line
from raysim.core.files import write_json, writing
from raysim.engine.loop import Callback
from raysim.engine.messages import RoundSummary

EVAL_SPLITS = ("val", "test")
MLFLOW_STATE = "mlflow_run.json"  # <run_dir>/mlflow_run.json: the federation's MLflow run (resume, artifacts)
PARAM_VALUE_CHARS = 500  # MLflow's limit on a param's value before 2.x servers raised it; safe everywhere
REPORT_ARTIFACTS = ("summary.md", "curves.png")
_UNSAFE = re.compile(r"[^\w\-./ ]")  # what MLflow allows in a metric name (TensorBoard allows more)


def tracking_callbacks(cfg, run_dir: str) -> list[Callback]:
    """The callbacks ``cfg.tracking`` asks for; a missing package is a UserError here, before the
    federation starts anything."""
    t = getattr(cfg, "tracking", None)
    if t is None:
        return []
    callbacks: list[Callback] = []
    if t.tensorboard:
        callbacks.append(TensorBoardWriter(cfg, run_dir))
    if t.mlflow_uri:
        callbacks.append(MLflowLogger(cfg, run_dir))
    return callbacks


# ----------------------------------------------------------------------------- rows -> tags

def tag_of(client: int, domain: str, split: str, metric: str) -> str | None:
    """The scalar's name for one metrics row, or None for rows not tracked (per-client evaluation)."""
    if client >= 0:
        return _safe(f"{split}/{metric}/client_{client}") if split == "train" else None
    if split in EVAL_SPLITS:
        return _safe(f"{split}/{domain}" if metric == "accuracy" else f"{split}/{metric}/{domain}")
    return _safe(f"{split}/{metric}" if domain == "ALL" else f"{split}/{metric}/{domain}")


def round_scalars(log, rnd: int, clients: bool = True) -> dict[str, float]:
    """{tag: value} of the rows ``log`` (a MetricsLog) holds for round ``rnd``; ``clients``: the
    per-client rows too."""
    out = {}
    for _, client, domain, split, metric, value in log.round_rows(rnd):
        if client >= 0 and not clients:
            continue
        tag = tag_of(int(client), str(domain), str(split), str(metric))
        if tag is not None:
            out[tag] = float(value)
    return out


def client_scalars(cfg, num_clients: int) -> bool:
    """Whether a federation of ``num_clients`` clients gets per-client scalars (``tracking.client_scalars``)."""
    most = cfg.tracking.client_scalars
    return most is None or num_clients <= most


def _safe(tag: str) -> str:
    return _UNSAFE.sub("_", tag)


# ----------------------------------------------------------------------------- config -> params

def flat_config(cfg) -> dict[str, str | int | float | bool]:
    """The resolved config as dotted keys with scalar values (lists and empty sections as JSON text,
    None as "null"); the ``paper`` section (published numbers, never used by a run) is left out."""
    raw = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)
    raw.pop("paper", None)
    out: dict = {}

    def walk(node, prefix):
        if isinstance(node, dict) and node:
            for k, v in node.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        elif isinstance(node, bool) or isinstance(node, str):
            out[prefix] = node
        elif isinstance(node, (int, float)):
            out[prefix] = node if not isinstance(node, float) or math.isfinite(node) else str(node)
        elif node is None:
            out[prefix] = "null"
        else:  # lists, tuples, {}
            out[prefix] = json.dumps(node, default=str, sort_keys=True)
    walk(raw, "")
    return out


def run_name(cfg) -> str:
    """The federation's label: ``tracking.run_name``, else ``<method>/seed-<s>[/holdout-<domain>]``
    (a named variant: its name in place of the method's)."""
    if cfg.tracking.run_name:
        return cfg.tracking.run_name
    holdout = (cfg.data.partition or {}).get("holdout")
    label = getattr(cfg, "variant", None) or cfg.method
    return "/".join([str(label), f"seed-{cfg.seed}"] + ([f"holdout-{holdout}"] if holdout else []))


def _warn(text: str) -> None:
    print(f"raysim: warning: {text}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- TensorBoard

def _summary_writer():
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise UserError("tracking.tensorboard needs the 'tensorboard' package: pip install tensorboard "
                        "(or set tracking.tensorboard=false)") from None
    return SummaryWriter


def _quiet_event_writer_threads() -> None:
    """TensorBoard writes its event files from a thread of its own, whose failed write (a full disk,
    a read-only file system) Python would print as a traceback; the run's next write in the main
    thread fails the same way and says so in one line, so that thread's OSError is dropped."""
    import threading

    previous = threading.excepthook
    if getattr(previous, "_raysim_quiet", False):
        return

    def excepthook(args):
        if issubclass(args.exc_type, OSError) and type(args.thread).__name__ == "_AsyncWriterThread":
            return
        previous(args)

    excepthook._raysim_quiet = True
    threading.excepthook = excepthook


class TensorBoardWriter(Callback):
    """Per-round scalars and the config's hparams in ``<run_dir>/tb/``. Each round is recorded
    once: a round replayed after a lost host or server (identical by construction) is skipped,
    and a restarted driver's new event file hides what earlier ones logged from its first round on."""

    def __init__(self, cfg, run_dir: str):
        self.cfg, self.logdir = cfg, os.path.join(run_dir, "tb")
        self._writer_cls = _summary_writer()
        _quiet_event_writer_threads()
        self.writer = None
        self.recorded = 0  # the last round written
        self.clients = True  # per-client scalars (tracking.client_scalars), decided by the federation's size

    def on_start(self, run) -> None:
        self.clients = client_scalars(self.cfg, run.n)
        done = run.log.last_round()  # > 0 when resumed from a checkpoint
        earlier = os.path.isdir(self.logdir) and any(n.startswith("events.") for n in os.listdir(self.logdir))
        with writing(self.logdir):
            self.writer = self._writer_cls(self.logdir, purge_step=done + 1 if done or earlier else None,
                                           flush_secs=30)
        self.recorded = done
        if not earlier:
            self._write_hparams()

    def _write_hparams(self) -> None:
        from torch.utils.tensorboard.summary import hparams

        metrics = {f"{s}/AVG": 0.0 for s in self.cfg.eval.splits}
        metrics["train/loss"] = 0.0
        try:
            for summary in hparams(flat_config(self.cfg), metrics):
                self.writer._get_file_writer().add_summary(summary)
        except Exception as err:  # the scalars matter more than the hparams table
            _warn(f"TensorBoard hparams not written ({first_line(err, with_type=True, limit=300)})")

    def on_round(self, rnd: int, summary: RoundSummary, evaluation, log) -> None:
        if self.writer is None or rnd <= self.recorded:  # a replayed round: recorded already
            return
        self.recorded = rnd
        from tensorboard.compat.proto.summary_pb2 import Summary

        # the round's scalars as one event (what add_scalar writes one event per tag for: the same
        # tags, steps and float32 values to TensorBoard; 200 add_scalar calls took ~20 ms of the
        # driver's time between two rounds, one event of 200 values ~0.3 ms)
        values = [Summary.Value(tag=tag, simple_value=value)
                  for tag, value in round_scalars(log, rnd, self.clients).items()]
        with writing(self.logdir):
            if values:
                self.writer._get_file_writer().add_summary(Summary(value=values), global_step=rnd)
            if evaluation is not None:
                self.writer.flush()

    def on_end(self, log) -> None:
        if self.writer is not None:
            writer, self.writer = self.writer, None
            with writing(self.logdir):
                writer.close()


# ----------------------------------------------------------------------------- MLflow

def _mlflow_client(uri: str):
    try:
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise UserError(f"tracking.mlflow_uri = {uri!r} needs MLflow: pip install raysim[mlflow]") from None
    return MlflowClient(tracking_uri=uri)


class MLflowLogger(Callback):
    """One MLflow run per federation: params (the flattened config), metrics (step = round), tags,
    and ``config.yaml`` / ``metrics.parquet`` as artifacts at the end. Its run id is kept in
    ``<run_dir>/mlflow_run.json``: a resumed federation continues the same run, and
    :func:`log_report` finds it. A tracking server that fails mid-run is warned about once and the
    federation goes on without it."""

    def __init__(self, cfg, run_dir: str):
        self.cfg, self.run_dir = cfg, run_dir
        self.uri = cfg.tracking.mlflow_uri
        self.client = _mlflow_client(self.uri)
        self.run_id = None
        self.recorded = 0  # the last round logged (a replayed round is not logged twice)
        self.clients = True  # per-client metrics (tracking.client_scalars), decided by the federation's size

    def on_start(self, run) -> None:
        self.clients = client_scalars(self.cfg, run.n)
        self.recorded = run.log.last_round()
        try:
            self._open(resumed=run.log.last_round() > 0)
        except UserError:
            raise
        except Exception as err:
            raise UserError(f"MLflow at tracking.mlflow_uri = {self.uri!r}: {first_line(err, with_type=True, limit=300)}") from None

    def _open(self, resumed: bool) -> None:
        from mlflow.entities import Param, RunTag

        state = _read_state(self.run_dir)
        if resumed and state and state.get("tracking_uri") == self.uri:
            try:
                self.client.update_run(state["run_id"], status="RUNNING")
                self.run_id = state["run_id"]
                return
            except Exception as err:
                _warn(f"MLflow run {state['run_id']} not continued ({first_line(err, with_type=True, limit=300)}); starting a new one")
        cfg = self.cfg
        exp_id = _experiment_id(self.client, cfg.tracking.mlflow_experiment or cfg.name or "raysim")
        holdout = (cfg.data.partition or {}).get("holdout")
        tags = {"raysim.method": str(cfg.method), "raysim.seed": str(cfg.seed),
                "raysim.run_dir": os.path.abspath(self.run_dir)}
        if holdout:
            tags["raysim.holdout"] = str(holdout)
        if getattr(cfg, "variant", None):
            tags["raysim.variant"] = str(cfg.variant)
        made = self.client.create_run(exp_id, run_name=run_name(cfg), tags=tags)
        self.run_id = made.info.run_id
        _write_state(self.run_dir, {"tracking_uri": self.uri, "experiment_id": exp_id, "run_id": self.run_id})
        params = [Param(k[:250], _param_value(v)) for k, v in flat_config(cfg).items()]
        self.client.log_batch(self.run_id, params=params, tags=[RunTag("raysim.config", "config.yaml")])

    def on_round(self, rnd: int, summary: RoundSummary, evaluation, log) -> None:
        if self.run_id is None or rnd <= self.recorded:
            return
        self.recorded = rnd
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(tag, value, now, rnd) for tag, value in round_scalars(log, rnd, self.clients).items()]
        self._guard(lambda: self.client.log_batch(self.run_id, metrics=metrics), f"round {rnd}'s metrics")

    def on_end(self, log) -> None:
        run_id = self.run_id
        if run_id is None:
            return
        for name in ("config.yaml", "metrics.parquet"):
            path = os.path.join(self.run_dir, name)
            if os.path.isfile(path):
                self._guard(lambda p=path: self.client.log_artifact(run_id, p), name)
        status = "FINISHED" if log.last_round() >= self.cfg.rounds else "FAILED"
        self._guard(lambda: self.client.set_terminated(run_id, status=status), "the run's status")
        self.run_id = None

    def _guard(self, fn, what: str) -> None:
        try:
            fn()
        except Exception as err:
            _warn(f"MLflow at {self.uri}: {what} not logged ({first_line(err, with_type=True, limit=300)}); the federation goes on "
                  "without MLflow")
            self.run_id = None


def _experiment_id(client, name: str) -> str:
    exp = client.get_experiment_by_name(name)
    if exp is None:
        try:
            return client.create_experiment(name)
        except Exception:  # created meanwhile by a federation running beside this one
            exp = client.get_experiment_by_name(name)
            if exp is None:
                raise
    if exp.lifecycle_stage != "active":
        raise UserError(f"MLflow experiment {name!r} is deleted; restore it or set tracking.mlflow_experiment")
    return exp.experiment_id


def _param_value(v) -> str:
    text = str(v)
    return text if len(text) <= PARAM_VALUE_CHARS else text[:PARAM_VALUE_CHARS - 3] + "..."


def _read_state(run_dir: str) -> dict | None:
    try:
        with open(os.path.join(run_dir, MLFLOW_STATE), encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def _write_state(run_dir: str, state: dict) -> None:
    os.makedirs(run_dir, exist_ok=True)
    write_json(os.path.join(run_dir, MLFLOW_STATE), state, keep_error=True)  # on_start says what failed


def log_report(cfg, run_dir: str) -> None:
    """After the driver rendered ``summary.md`` and ``curves.png`` (once every federation ended):
    log them as artifacts of every MLflow run of the run directory (each federation's
    ``mlflow_run.json`` below ``run_dir``). Failures are warnings."""
    if not getattr(getattr(cfg, "tracking", None), "mlflow_uri", None):
        return
    files = [os.path.join(run_dir, n) for n in REPORT_ARTIFACTS if os.path.isfile(os.path.join(run_dir, n))]
    if not files:
        return
    clients = {}
    for root, dirs, names in os.walk(run_dir):
        dirs[:] = sorted(d for d in dirs if d not in ("tb", "checkpoints"))
        state = _read_state(root) if MLFLOW_STATE in names else None
        if not state:
            continue
        uri = state["tracking_uri"]
        try:
            client = clients.get(uri) or clients.setdefault(uri, _mlflow_client(uri))
            for path in files:
                client.log_artifact(state["run_id"], path)
        except Exception as err:
            _warn(f"MLflow at {uri}: {', '.join(REPORT_ARTIFACTS)} not logged to run {state['run_id']} "
                  f"({first_line(err, with_type=True, limit=300)})")
