"""One federation's life: a Server actor, a host pool, the round loop, checkpoints and recovery.

Everything said to the outside world goes through callbacks (:class:`Callback`): metrics files,
progress lines, Tune reports. A lost ClientHost or a lost Server is replaced and the federation
rolls back to its last checkpoint (or to round 0, which is always reproducible) and replays: every
draw is keyed by (seed, round, client), so the metrics come out identical to an undisturbed run's.
Up to ``runtime.max_restarts`` losses in a row without progress are replaced; the count starts
again once a round past the furthest one that failed completes (a fault window, not a run budget).

Every wait on the actors has a deadline (:mod:`raysim.engine.watchdog`): a stopped or wedged
actor is treated as lost, and a driver whose own Ray node is gone ends with exit 75 for a
supervisor to rerun. An exception raised by the method's code (or raysim's) on a host or the
server is a bug, not a fault: it is never replayed; the federation stops with its traceback,
printed and written to ``RUN_DIR/error.txt`` (:class:`raysim.core.errors.MethodFailed`).

Checkpoints: after every ``checkpoint.every``-th round and whenever ``checkpoint.minutes`` of wall
time passed since the last one (the interval stretched to 20 x the last write's time), so a lost
driver or server costs at most that much work.
"""
from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from dataclasses import dataclass

from raysim.engine import checkpoint, runstate
from raysim.config import AUTO_COHORT_MAX, dump_yaml
from raysim.engine.layout import host_layout
from raysim.core.errors import Interrupted, MethodFailed, RunFailed, TryLater, UserError, signal_of
from raysim.engine.messages import LocalLosses, LossQuery, RoundSummary, TrainedClients, TrainJobs, box
from raysim.engine.metrics import MetricsLog
from raysim.core.files import WriteFailed, describe, free_space_note, write_json, write_text, writing
from raysim.engine.backend import RayActors
from raysim.engine.balance import Costs, Paces, least_chunk, plan_for
from raysim.engine.cluster import local_ray_failure, owner_of, plain_reason
from raysim.engine.watchdog import NodeGone, Stalled, Stopped, Watchdog
from raysim.core.seeding import SERVER, rng_for

SERVER_CHECK_S = 10.0  # how long a Server has to answer a health check when hosts were lost
END_ACTORS_S = 1.0  # after a stop or a signal, how long the actors' ending is waited for (ms on a live node)
# buffered schedule: a window of server steps returns each host's folded sums of every step at once
# (float64, about twice the model's bytes a step); at most this much, so big models take short windows
WINDOW_BYTES = 256 * 2**20
CHECKPOINT_COST_CAP = 20  # the time rule waits at least 20 x the last checkpoint's write time (<= ~5% of a run)


@dataclass
class FederationResult:
    """What one federation's run returns (its metrics are in ``run_dir``)."""

    method: str
    run_dir: str
    rounds_done: int
    seconds: float
    """Wall seconds of the whole run, start-up included."""
    startup_seconds: float
    round_seconds: list[float]
    last_eval: dict
    """The last evaluated round's headline, {split: {"AVG", "ALL", "AVG_clients"}}."""
    host_restarts: int = 0
    server_restarts: int = 0


class Callback:
    """What the round loop reports; override what you need."""

    def on_start(self, run: "FederationRun") -> None:
        """The pool is up and the loop starts (``run.server``, ``run.hosts`` exist)."""

    def on_round(self, rnd: int, summary: RoundSummary, evaluation: dict | None, log: MetricsLog) -> None:
        """After every round that completed (``evaluation`` None on rounds without one)."""

    def on_end(self, log: MetricsLog) -> None:
        """When the loop stops, finished or not."""


class FederationRun:
    """One federation of ``cfg`` (a single method, seed and held-out domain) in ``run_dir``."""

    def __init__(self, cfg, run_dir: str, callbacks=(), backend=None, stop=None):
        """``backend``: where the server and hosts live (Ray actors by default; InProcess for
        debugging); ``stop``: a ``threading.Event`` the driver sets to end this federation early
        (another federation of the comparison failed, Ctrl-C): it ends within a second."""
        self.cfg, self.run_dir = cfg, run_dir
        self.callbacks = list(callbacks)
        self.backend = backend or RayActors()
        self.watchdog = Watchdog(cfg.runtime.stall_timeout_s, stop=stop, warn=_warn, node_failure=local_ray_failure)
        self.server_node = None  # the Ray node the Server runs on (a replacement avoids it)
        self.doing = "start-up"  # what the driver waits on, for the watchdog's lines
        self.starting = True  # actors are (re)starting: the watchdog gives them a start-up floor
        self.server = None
        self.hosts, self.pg = [], None
        self._unawaited = []  # start() refs of hosts launched before the server was ready
        self.log = MetricsLog()
        self.host_restarts = self.server_restarts = 0
        self.faults = FaultWindow(cfg.runtime.max_restarts)
        self.resume_dir = run_dir  # the folder ``raysim run --resume`` takes (a comparison's top folder)
        self._ckpt_at, self._ckpt_seconds = time.monotonic(), 0.0  # the last checkpoint: when, how long
        # runtime.balance: how a round's clients are spread over the hosts (raysim.engine.balance)
        self.plan = plan_for(cfg)
        self.state_bytes: dict[int, int] = {}  # stored-state size of each client that has a record
        self.paces = Paces()  # each host's seconds per client and per example, from its own chunks
        self.client_examples: dict[int, int] = {}  # training examples of each client trained so far
        self.buffered = False  # schedule.kind buffered (raysim.engine.timeline): server steps, not rounds
        self.sim_time = 0.0  # simulated seconds at the end of the last round (client profiles)
        self._training_ahead: list = []  # buffered: the hosts' durations of jobs trained after the last step
        self._homecoming: list = []  # buffered: the last step's records going back to their owners
        self._next_jobs = None  # buffered: the jobs the last step dispatched (None: ask the server)
        self._window: list[RoundSummary] = []  # buffered: the summaries of the window's steps still to log
        self._queued = False  # buffered: the last step came from a window, which its first step's time paid
        self._next_trained = None  # buffered: the hosts' calls already training the next window's first jobs

    # ------------------------------------------------------------------ lifecycle
    def run(self, resume: bool = False) -> FederationResult:
        cfg = self.cfg
        config_path = os.path.join(self.run_dir, "config.yaml")
        runstate.check(self.run_dir, cfg)  # state of another config, or a config.yaml edited since: refused
        with writing(config_path):
            os.makedirs(self.run_dir, exist_ok=True)
            if not resume or not os.path.isfile(config_path):
                dump_yaml(cfg, config_path)
        t_start = time.perf_counter()
        round_seconds, last_eval, rnd, failure = [], {}, 0, None
        with writing(os.path.join(self.run_dir, "error.txt")):  # a bug's record, from a run this one replaces
            if os.path.isfile(os.path.join(self.run_dir, "error.txt")):
                os.remove(os.path.join(self.run_dir, "error.txt"))
        try:
            self.server = self.backend.server(cfg)
            server_started = self.server.start.remote()
            self._launch_hosts_early()
            self.info = self._call(server_started)
            self.server_node = self._call(self.server.ready.remote()).get("node_id")
            self.n = self.info["num_clients"]
            self.num_hosts, _ = host_layout(cfg.runtime, self.n)
            self._start_hosts()
            self.domain_of = self.info["client_domains"].__getitem__
            self.buffered = self.info.get("buffered", False)
            if self.info.get("privacy") and not resume:
                _warn(f"raysim: {self.info['privacy']}")  # the noise a target ε chose, before round 1
            for note in self.info.get("partition_notes", ()) if not resume else ():
                _warn(f"raysim: {note}")  # e.g. the groups a natural partition dropped as too small
            self.requests = eval_requests(cfg, eval_clients(cfg, self.n), self.info)
            rnd = self._restore(checkpoint.latest(self.run_dir, cfg, warn=_warn) if resume else None) + 1
            startup = time.perf_counter() - t_start
            self.starting = False
            for cb in self.callbacks:
                cb.on_start(self)
            self._ckpt_at = time.monotonic()
            while rnd <= cfg.rounds:
                t0 = time.perf_counter()
                try:
                    summary, evaluation = self._round(rnd)
                    if self._checkpoint_due(rnd):
                        self._checkpoint(rnd)
                except ActorLost as lost:
                    rnd = self._recover(lost, rnd) + 1
                    continue
                self.faults.completed(rnd)
                last_eval = evaluation or last_eval
                round_seconds.append(time.perf_counter() - t0)
                if not self._queued:  # a window's steps after its first took no calls of their own
                    self.watchdog.observe(round_seconds[-1])
                for cb in self.callbacks:
                    cb.on_round(rnd, summary, evaluation, self.log)
                if self._time_is_up():  # stop.sim_hours reached: the federation is done
                    break
                rnd += 1
            rnd = min(rnd, cfg.rounds)
            _write_status(self.run_dir, cfg, finished=True, rounds=rnd, startup_seconds=startup,
                          round_seconds=round_seconds, host_restarts=self.host_restarts,
                          server_restarts=self.server_restarts)
        except BaseException as err:  # noqa: BLE001 -- mapped to one line, re-raised below
            failure = self._failure(err, rnd)
        self._end(failure)
        if failure is not None:
            raise failure
        return FederationResult(cfg.method, self.run_dir, rnd, time.perf_counter() - t_start, startup, round_seconds,
                                last_eval, self.host_restarts, self.server_restarts)

    def _failure(self, err: BaseException, rnd: int) -> BaseException:
        """What the run raises for ``err``: Ctrl-C, lost actors and failed writes as one line with
        what is intact and how to resume; a lost local Ray node as TryLater (exit 75); an exception
        of the method's code (or raysim's) as MethodFailed with its traceback, also written to
        ``error.txt``; a stop the driver asked for, user errors and run failures as they are."""
        where = f"in round {rnd}" if rnd else "during start-up"
        if isinstance(err, KeyboardInterrupt):
            return Interrupted(f"interrupted {where}; {self._resume_hint()}", signal=signal_of(err))
        if isinstance(err, OSError):  # a write no `writing(...)` named
            err = WriteFailed(getattr(err, "filename", None) or f"a file in {self.run_dir}", err)
        if isinstance(err, WriteFailed):
            return RunFailed(f"{err}; {checkpoint.intact(self.run_dir)}; {self._resume_hint()}")
        if isinstance(err, (Stopped, UserError, RunFailed)) or not isinstance(err, Exception):
            return err
        if isinstance(err, NodeGone):
            return TryLater(f"{err}; the federation stopped {where}; rerun the same command when Ray is back "
                            f"(cluster/supervise.sh does); {self._resume_hint()}")
        if isinstance(err, self.backend.lost()) and not self.backend.is_code_error(err):  # before the loop
            err = ActorLost([], plain_reason(err), server=self.server is None or not self.backend.alive(self.server),
                            out_of_memory=self.backend.out_of_memory(err))
        if isinstance(err, ActorLost) and err.out_of_memory and not rnd:
            return RunFailed(f"out of memory during start-up: Ray's memory monitor killed {err.what} while it "
                             "loaded the data; lower runtime.num_hosts (each host holds its clients' data and a "
                             "model), data.options.image_size or the partition's train_size, or free memory "
                             "on this machine")
        if isinstance(err, ActorLost):
            return RunFailed(f"{err.what} {err.was} lost {where} ({err.reason}); {self._resume_hint()}")
        return self._bug(err, where)

    def _bug(self, err: Exception, where: str) -> MethodFailed:
        """A method's (or raysim's) exception: its traceback into ``error.txt``, not replayed."""
        text = self.backend.traceback(err)
        path = os.path.join(self.run_dir, "error.txt")
        try:
            write_text(path, f"{self.cfg.method} raised {where}:\n\n{text}")
        except WriteFailed:  # the traceback is still shown
            path = None
        what = self.backend.error_line(err)
        saved = f"the traceback is above and in {path}" if path else "the traceback is above"
        return MethodFailed(f"{self.cfg.method} failed {where}: {what} ({saved}); an error in code is not "
                            f"replayed: fix it, then {self._resume_hint()}", text, short=f"{what}, {where}")

    def _end(self, failure: BaseException | None) -> None:
        """The callbacks' on_end and the actors' end. After a failure, their own errors are dropped
        (a full disk fails the metrics write again: the first error is the one to report)."""
        first = None
        for cb in self.callbacks:
            try:
                cb.on_end(self.log)
            except Exception as err:
                first = first or err
        if isinstance(failure, (Interrupted, Stopped, TryLater)):
            # Ray itself may be going down with the driver (a SIGTERM to the process group, as scancel
            # sends, ends Ray's own processes too), and a call to it may then never return: the
            # actors are ended in the background, waited for a few seconds at most
            ended = threading.Thread(target=self._stop, name="raysim-end-actors", daemon=True)
            ended.start()
            ended.join(END_ACTORS_S)
            return
        try:
            self._stop()
        except Exception as err:
            first = first or err
        if failure is None and first is not None:
            mapped = self._failure(first, self.log.last_round())
            if mapped is first:
                raise first
            raise mapped from None

    def _launch_hosts_early(self) -> None:
        """With runtime.num_hosts fixed, the pool starts while the server loads the data (about
        half of a small federation's start-up); otherwise its size waits for the client count."""
        rt = self.cfg.runtime
        # a pool the cluster could not hold waits for the client count, which caps it (num_hosts=64, 5 clients)
        if rt.num_hosts is not None and rt.clients_per_host is None and self.backend.fits(self.cfg, rt.num_hosts):
            self.hosts, self._unawaited, self.pg = self.backend.launch_pool(self.cfg, rt.num_hosts)

    def _start_hosts(self) -> None:
        total = self.n + self.info["num_targets"]
        if not (self._unawaited and len(self.hosts) == self.num_hosts):  # not launched early at this size
            self._stop_hosts()  # an early pool larger than the clients (or nothing, normally)
            self.hosts, self._unawaited, self.pg = self.backend.launch_pool(self.cfg, self.num_hosts)
        self._call(self._unawaited)  # the hosts load their data, under the watchdog
        starts, self._unawaited = self._unawaited, []
        self.backend.await_pool(self.hosts, starts, total, run_dir=self.run_dir)
        self.owner = owner_of(self.num_hosts)

    def _stop_hosts(self) -> None:
        self.backend.stop_pool(self.hosts, self.pg, self._unawaited)
        self.hosts, self.pg, self._unawaited = [], None, []

    def _stop(self) -> None:
        self._stop_hosts()
        if self.server is not None:
            self.backend.kill(self.server)
            self.server = None

    # ------------------------------------------------------------------ one round (or server step)
    def _round(self, rnd: int) -> tuple[RoundSummary, dict | None]:
        """Round ``rnd`` (a buffered schedule's server step ``rnd``): its training, the simulated
        clock's time, its evaluation when due, and its metrics rows."""
        summary = self._buffered_step(rnd) if self.buffered else self._synchronous_round(rnd)
        before = self.sim_time
        if "sim_time" in summary.clock:  # a buffered step's time on the timeline
            self.sim_time = summary.clock["sim_time"]
        elif "sim_round_s" in summary.clock:  # rounds one after another
            self.sim_time += summary.clock["sim_round_s"]
            summary.clock["sim_time"] = self.sim_time
        due = self._eval_due(rnd, before)
        if due and self._window:  # the server's state is past this step: the window should have ended here
            raise RuntimeError(f"step {rnd} is evaluated but the buffered window went on to step {self._window[-1].round}")
        results = self._evaluate(rnd) if due else None
        # metrics only once the whole round succeeded, so a replayed round never logs twice
        self.log.add_round(rnd, summary, self.domain_of)
        evaluation = self.log.add_eval(rnd, results, self.domain_of) if results is not None else None
        return summary, evaluation

    def _eval_due(self, rnd: int, before: float) -> bool:
        """Every ``eval.every`` rounds, the last, the one that reaches ``stop.sim_hours``, and each
        that passes another multiple of ``eval.every_s`` simulated seconds."""
        e = self.cfg.eval
        if rnd % e.every == 0 or rnd == self.cfg.rounds or self._time_is_up():
            return True
        return e.every_s is not None and self.sim_time // e.every_s > before // e.every_s

    def _time_is_up(self) -> bool:
        """The simulated clock reached ``stop.sim_hours``."""
        hours = self.cfg.stop.sim_hours
        return hours is not None and self.sim_time >= hours * 3600

    def _synchronous_round(self, rnd: int) -> RoundSummary:
        server = self.server
        self.doing = f"round {rnd}"
        opened = self._call(server.open_round.remote(rnd))
        while isinstance(opened, LossQuery):  # the selection asked for the candidates' local losses
            opened = self._call(server.open_round.remote(rnd, self._local_losses(opened)))
        sampled, payload_box, personal = opened

        def aggregate(host_results: list):
            return server.aggregate.remote(rnd, *host_results)

        if self.plan is None or len(self.hosts) == 1:
            summary_ref = aggregate([self.hosts[h].train_round.remote(rnd, payload_box, cids,
                                                                      {c: personal[c] for c in cids if c in personal})
                                     for h, cids in split_by_host(sampled, self.owner).items()])
            returned = []
        else:
            summary_ref, returned = self._train_balanced(rnd, sampled, payload_box, personal, aggregate)
        summary: RoundSummary = self._call(summary_ref)
        self._call(returned)  # moved clients' records are back on their owners before anyone reads them
        return summary

    def _buffered_step(self, rnd: int) -> RoundSummary:
        """Server step ``rnd`` of a buffered schedule (raysim.engine.timeline): the next summary of
        the window of steps the last call planned and aggregated, or a new window's first."""
        self._queued = bool(self._window)
        if self._window:
            return self._window.pop(0)
        summaries = self._buffered_window(rnd)
        if not summaries:  # its first step needed jobs left to train after the last window's: they have now
            summaries = self._buffered_window(rnd, again=True)
        if not summaries:  # every job in flight has trained: a step must be possible (asking again would spin)
            raise RuntimeError(f"server step {rnd}: every job in flight has trained, yet the plan takes no step "
                               "(a job the hosts were handed came back without its duration)")
        self._window = summaries[1:]
        return summaries[0]

    def _buffered_window(self, rnd: int, again: bool = False) -> list[RoundSummary]:
        """Server steps ``rnd``, ``rnd + 1``, ... in one pass: the jobs dispatched by the last
        window (the first window and the first after a restore ask the server) that its first step
        could need, trained; the server plans as many steps as need no job still untrained (each
        step's dispatch included) and never past a step the driver evaluates or checkpoints after;
        the hosts fold them and the server aggregates them, while the hosts train the jobs it did
        not need. The calls are chained (each takes the refs of the ones before), so the driver
        waits once per window; nothing here depends on which host answers first. ``again``: the
        last call planned no step (it needed the jobs it left to train): no new jobs to train."""
        server, hosts = self.server, self.hosts
        self.doing = f"server step {rnd}"
        jobs, self._next_jobs = self._next_jobs, None
        trained, self._next_trained = self._next_trained, None
        if again:
            jobs, trained = TrainJobs([], box(None)), []
        elif jobs is None:
            jobs = self._call(server.dispatch.remote())
        if trained is None:
            trained = self._train_needed(jobs)
        plans = server.plan.remote(rnd, self._window_steps(rnd), self.sim_time, *self._training_ahead, *trained)
        folds = [host.fold.remote(plans) for host in hosts]
        # the jobs the window did not need train while the server aggregates; the next window reads
        # them (none after the run's last step: its jobs in flight would train for nothing). The
        # driver reads the plan (a few numbers) to know; the hosts wait for it anyway.
        self._training_ahead = []
        if rnd + len(self._call(plans)) - 1 < self.cfg.rounds:
            self._training_ahead = [hosts[h].train_jobs.remote(jobs, True) for h in jobs.hosts(len(hosts), ahead=True)]
        summaries: list[RoundSummary] = self._call(server.aggregate_buffered.remote(rnd, plans, *folds))
        if summaries:
            self._next_jobs, summaries[-1].next_jobs = summaries[-1].next_jobs, None
        # records a job left away from its owner (raysim.engine.balance.job_trainers) go home, queued
        # on the owner before that client's next job (which trains there) and before any checkpoint
        # reads the owner's store; the driver reads their answers a window later, when they are done
        self._call(self._homecoming)
        going_home = {c: rec for s in summaries for c, rec in s.records_for_owner.items()}
        self._homecoming = [hosts[h].import_states.remote({c: going_home[c] for c in cids})
                            for h, cids in split_by_host(going_home, self.owner).items()]
        for s in summaries:
            s.records_for_owner = {}
        # the next window's first jobs start now, while the driver logs this window's steps (and
        # evaluates or checkpoints after its last: those calls queue behind them on the hosts)
        hours = self.cfg.stop.sim_hours
        if self._next_jobs is not None and (hours is None or summaries[-1].clock["sim_time"] < hours * 3600):
            self._next_trained = self._train_needed(self._next_jobs)
        return summaries

    def _train_needed(self, jobs: TrainJobs) -> list:
        """The hosts' calls that train the jobs a window's plan may need (``jobs.jobs``)."""
        return [self.hosts[h].train_jobs.remote(jobs) for h in jobs.hosts(len(self.hosts))]

    def _window_steps(self, rnd: int) -> int:
        """The most steps a window from ``rnd`` may take: up to the next step the driver evaluates
        after (every ``eval.every``, the last) or checkpoints after (every ``checkpoint.every``),
        and at most as many as keep a host's folded sums within WINDOW_BYTES."""
        last = min(self.cfg.rounds, _next_multiple(rnd, self.cfg.eval.every))
        if self.cfg.checkpoint.every:
            last = min(last, _next_multiple(rnd, self.cfg.checkpoint.every))
        return max(1, min(last - rnd + 1, WINDOW_BYTES // max(1, self.info.get("model_bytes", 0) * 2)))

    def _evaluate(self, rnd: int) -> dict:
        """Every requested (client, split)'s scores of the model after round ``rnd``."""
        cfg, server = self.cfg, self.server
        personalized = cfg.eval.protocol == "personalized"  # the global model needs no per-client payloads
        payload_box, personal = self._call(server.broadcast.remote(rnd, list(self.requests) if personalized else [],
                                                                   False))
        futures = [self.hosts[h].evaluate.remote(rnd, payload_box, {c: self.requests[c] for c in cids},
                                                 cfg.eval.protocol, {c: personal[c] for c in cids if c in personal})
                   for h, cids in split_by_host(self.requests, self.owner).items()]
        results = {}
        for host_scores in self._call(futures):
            results.update(host_scores)
        return results

    def _local_losses(self, query: LossQuery) -> LocalLosses:
        """The answers to ``query``, each client's from its owner host (every record is home
        between rounds), the hosts computing at once."""
        futures = [self.hosts[h].local_losses.remote(query.round, query.payload, cids,
                                                     {c: query.personal[c] for c in cids if c in query.personal})
                   for h, cids in split_by_host(query.clients, self.owner).items()]
        return LocalLosses.combined(self._call(futures))

    def _train_balanced(self, rnd: int, sampled: list[int], payload_box: list, personal: dict, then):
        """Train the round's clients in chunks handed to hosts as they free up (``self.plan``).
        Once the last chunk is handed out, ``then`` gets the hosts' end_round refs (their calls queue
        behind each host's last chunks, so the server's reduce waits on the hosts, not on the
        driver); returns what ``then`` returned and the refs of the moved records' return to their
        owners."""
        limit = self.cfg.runtime.steal_state_mb * 2**20
        # chunks sized by measured time, except where hosts train cohorts: a cohort forms within a
        # chunk, so timed chunks would make the cohorts, and their sums' rounding, vary between runs;
        # there a chunk holds a whole cohort at least (shrinking chunks cut 100 clients of one host
        # into 14 cohorts, most of a few clients, where K = 64 makes 2)
        # (the queues are evened out by the examples alone there: the hosts' measured paces would too)
        k = self.cfg.runtime.cohort_size
        if k in (0, 1):
            least = {h: least_chunk(s) for h, s in self.paces.per_client.items()}
            costs = Costs(self.client_examples, self.paces.per_example)
        else:
            least = dict.fromkeys(range(len(self.hosts)), AUTO_COHORT_MAX if k == "auto" else int(k))
            costs = Costs(self.client_examples)
        plan = self.plan(rnd, split_by_host(sampled, self.owner), len(self.hosts),
                         lambda c: self.state_bytes.get(c, 0) <= limit, least=least, costs=costs)
        # the records a thief may need, read from each owner before its first chunk (so a busy owner
        # never holds a thief up); clients without a record start from their initial state anywhere
        exports = {h: box(self.hosts[h].export_records.remote(cids)) for h in range(len(self.hosts))
                   if (cids := [c for c in plan.may_leave(h) if c in self.state_bytes])}
        running: dict = {}  # ref -> (host, owner, clients)
        returned = []

        def feed(h: int) -> None:
            while True:
                owner, cids = plan.next_chunk(h, sum(1 for host, *_ in running.values() if host == h))
                if not cids:
                    return
                moved = None if owner == h else exports.get(owner, box(None))
                ref = self.hosts[h].train_clients.remote(rnd, payload_box, cids,
                                                         {c: personal[c] for c in cids if c in personal}, moved)
                running[ref] = (h, owner, len(cids))

        after = None
        for h in range(len(self.hosts)):
            feed(h)
        while True:
            if after is None and plan.exhausted():
                after = then([host.end_round.remote(rnd) for host in self.hosts])
            if not running:
                return after, returned
            ready = self._first_done(list(running))
            for ref in ready:
                h, owner, n = running.pop(ref)
                done: TrainedClients = self._call(ref)
                if owner == h:  # what its own clients take there sizes its next chunks (moved ones travel)
                    self.paces.add(h, done.seconds, n, sum(done.examples.values()), done.first)
                self.state_bytes.update(done.state_bytes)
                self.client_examples.update(done.examples)
                if done.records_for_owner:
                    returned.append(self.hosts[owner].import_states.remote(done.records_for_owner))
                feed(h)

    def _actors(self) -> dict:
        """{name: handle} of every actor the federation has now (what the watchdog checks)."""
        out = {} if self.server is None else {"the Server": self.server}
        out.update({f"ClientHost {h}": actor for h, actor in enumerate(self.hosts)})
        return out

    def _first_done(self, refs: list) -> list:
        """The refs done, as soon as one is (under the watchdog's deadline)."""
        done = []

        def waiting(timeout: float) -> bool:
            done[:] = self.backend.wait(refs, timeout)[0]
            return not done

        self._watched(waiting)
        return done

    def _watched(self, waiting) -> None:
        """Wait while ``waiting(timeout)`` is true, under the watchdog: a stalled actor is
        killed and raised as lost."""
        try:
            self.watchdog.wait(waiting, self._actors(), self.doing, starting=self.starting)
        except Stalled as err:
            self._kill_stalled(err)

    def _kill_stalled(self, err: Stalled):
        hosts = sorted(int(n.rsplit(" ", 1)[1]) for n in err.names if n.startswith("ClientHost "))
        server = "the Server" in err.names
        _warn(f"raysim: {' and '.join(err.names)} missed the deadline: {err.reason}; killing "
              f"{'them' if len(err.names) > 1 else 'it'}")
        for name in err.names:
            self.backend.kill(self._actors()[name])
        raise ActorLost(hosts, err.reason, server=server) from None

    def _call(self, refs):
        """The results of ``refs``; a lost, stopped or wedged server or host raises
        :class:`ActorLost` (recoverable), an exception of the code they run MethodFailed (not)."""
        try:
            self._watched(lambda timeout: bool(self.backend.pending(refs, timeout)))
            return self.backend.get(refs)
        except self.backend.lost() as err:
            if self.backend.is_code_error(err):
                raise
            reason, oom = plain_reason(err), self.backend.out_of_memory(err)
            if not self._answers(self.server):
                raise ActorLost([], reason, server=True, out_of_memory=oom) from None
            dead = [h for h, actor in enumerate(self.hosts) if not self._answers(actor)]
            if not dead:
                raise
            raise ActorLost(dead, reason, out_of_memory=oom) from None

    # ------------------------------------------------------------------ recovery and checkpoints
    def _answers(self, actor, timeout: float = 30.0) -> bool:
        """Whether ``actor`` answers a health check; a stop asked for meanwhile ends the wait (a
        signal to the whole process group ends Ray's workers too: their loss is no fault)."""
        return self.backend.alive(actor, timeout, check=self.watchdog.check)

    def _recover(self, lost: "ActorLost", rnd: int) -> int:
        """Replace what was lost (the server, or the host pool), and the pool in any case (its
        clients' state is ahead of the checkpoint); roll back to the last checkpoint (or round 0)
        and return its round."""
        while True:
            self.watchdog.check()  # stopped (a signal, a sibling's error): nothing to replace
            if not lost.server and not self._answers(self.server, SERVER_CHECK_S):
                # one fault, one restart: a node lost with hosts and the Server on it is replaced at once
                lost = ActorLost(lost.hosts, lost.reason, server=True, out_of_memory=lost.out_of_memory)
            if not self.faults.failed(rnd):
                raise RunFailed(f"{lost.what} {lost.was} lost in round {rnd} ({lost.reason}), {self.faults.count} times "
                                f"without progress (runtime.max_restarts = {self.faults.limit}); "
                                f"{self._resume_hint()}")
            ckpt = checkpoint.latest(self.run_dir, self.cfg, warn=_warn)
            start = f"the checkpoint of round {ckpt['round']}" if ckpt else "round 1"
            self.doing, self.starting = f"the replacement after round {rnd}'s loss", True
            _warn(f"raysim: warning: {lost.what} {lost.was} lost in round {rnd} ({lost.reason}); replacing {lost.it} and "
                  f"replaying from {start} (restart {self.faults.count} of {self.faults.limit})")
            try:
                self._stop_hosts()
                if lost.server:
                    self.server_restarts += 1
                    self.backend.kill(self.server)
                    self.server = self.backend.server(self.cfg, avoid_node=self.server_node)
                    self._call(self.server.start.remote())
                    self.server_node = self._call(self.server.ready.remote()).get("node_id")
                else:
                    self.host_restarts += 1
                    if ckpt is None:
                        self._call(self.server.reset.remote())
                self._start_hosts()
                restored = self._restore(ckpt)
                self.starting = False
                return restored
            except ActorLost as again:  # lost again while replacing: the same fault window
                lost = again
            except self.backend.lost() as err:
                if self.backend.is_code_error(err):
                    raise
                lost = ActorLost([], plain_reason(err), server=not self._answers(self.server))

    def _checkpoint_due(self, rnd: int) -> bool:
        c = self.cfg.checkpoint
        if rnd >= self.cfg.rounds:  # the finished run needs none
            return False
        if self._window:  # inside a window of buffered steps the server's state is already past rnd
            return False
        if c.every and rnd % c.every == 0:
            return True
        if c.minutes is None:
            return False
        return time.monotonic() - self._ckpt_at >= max(c.minutes * 60, CHECKPOINT_COST_CAP * self._ckpt_seconds)

    def _restore(self, ckpt: dict | None) -> int:
        self.state_bytes, self._training_ahead, self._homecoming, self._next_jobs = {}, [], [], None
        self._window, self._next_trained = [], None
        if ckpt is None:
            self.log = MetricsLog()
            self.sim_time = 0.0
            return 0
        self._call(self.server.load_state.remote(ckpt["server"]))
        by_host: dict[int, dict] = {}
        for cid, record in ckpt["clients"].items():
            by_host.setdefault(self.owner(cid), {})[cid] = record
        for sizes in self._call([self.hosts[h].import_states.remote(records) for h, records in by_host.items()]):
            self.state_bytes.update(sizes)
        self.log = MetricsLog.from_table(ckpt["metrics"])
        self.sim_time = self.log.last_value("clock", "sim_time", ckpt["round"]) or 0.0
        return ckpt["round"]

    def _checkpoint(self, rnd: int) -> None:
        t0 = time.monotonic()
        self.doing = f"the checkpoint of round {rnd}"
        server_state = self._call(self.server.export_state.remote())
        clients = {}
        for host_records in self._call([h.export_states.remote() for h in self.hosts]):
            clients.update(host_records)
        try:
            checkpoint.write(self.run_dir, rnd, self.cfg, server_state, clients, self.log.table(),
                             keep=self.cfg.checkpoint.keep)
        except Exception as err:  # torch.save says "unexpected pos" where the disk is full
            # no partial checkpoint left behind: it would hold the space a resume needs
            shutil.rmtree(os.path.join(checkpoint.checkpoint_dir(self.run_dir), f"round-{rnd:06d}.tmp"),
                          ignore_errors=True)
            note = "" if isinstance(err, OSError) else free_space_note(checkpoint.checkpoint_dir(self.run_dir))
            raise WriteFailed(f"the checkpoint of round {rnd}", f"{describe(err)}{note}") from None
        self._ckpt_at = time.monotonic()
        self._ckpt_seconds = self._ckpt_at - t0

    def _resume_hint(self) -> str:
        if checkpoint.list_rounds(self.run_dir):
            return f"resume with: raysim run --resume {self.resume_dir}"
        return f"rerun with: raysim run --resume {self.resume_dir} (no checkpoint yet: it restarts from round 1)"


class FaultWindow:
    """The restart budget: ``limit`` losses in a row without progress. A loss in round r counts;
    the count starts again once a round at or past the furthest round that failed completes (the
    replay caught up and went on). So a long run survives any number of separate faults, and a
    round that fails every time ends the run after ``limit`` replacements."""

    def __init__(self, limit: int):
        self.limit, self.count, self.furthest = limit, 0, 0

    def failed(self, rnd: int) -> bool:
        """Count a loss in round ``rnd``; whether the budget allows replacing it."""
        self.count += 1
        self.furthest = max(self.furthest, rnd)
        return self.count <= self.limit

    def completed(self, rnd: int) -> None:
        if rnd >= self.furthest:
            self.count = 0


class ActorLost(Exception):
    """The Server (``server``) or ClientHosts (``hosts``) died; the round loop replaces them."""

    def __init__(self, hosts: list[int], reason: str, server: bool = False, out_of_memory: bool = False):
        self.hosts, self.reason, self.server, self.out_of_memory = hosts, reason, server, out_of_memory
        if server:
            self.what = "the Server" + (f" and ClientHost{'s' if len(hosts) > 1 else ''} "
                                        + ", ".join(map(str, hosts)) if hosts else "")
        elif hosts:
            self.what = ("ClientHost " if len(hosts) == 1 else "ClientHosts ") + ", ".join(map(str, hosts))
        else:
            self.what = "a ClientHost"
        several = server and hosts or len(hosts) > 1
        self.was, self.it = ("were", "them") if several else ("was", "it")
        super().__init__(f"{self.what} lost: {reason}")


def finished(run_dir: str, cfg) -> bool:
    """Whether the federation in ``run_dir`` ran all the rounds of ``cfg``: its status.json says so,
    and the folder's state is ``cfg``'s (another config's, or a config.yaml edited since, is a
    UserError: never taken as finished). A status.json written before it carried the config's
    fingerprint counts where nothing in the folder contradicts it (:func:`runstate.check`)."""
    runstate.check(run_dir, cfg)
    return runstate.read_status(run_dir).get("finished") is True


def _next_multiple(rnd: int, every: int) -> int:
    """The first multiple of ``every`` at or after ``rnd``."""
    return -(-rnd // every) * every


def eval_requests(cfg, clients: list[int], info: dict) -> dict[int, list[str]]:
    """Which splits each client is evaluated on. Leave-one-domain-out selects models by the
    source clients' validation accuracy and reports the unseen clients' test accuracy."""
    if cfg.eval.protocol == "lodo":
        n, t = info["num_clients"], info["num_targets"]
        return {**{c: ["val"] for c in clients}, **{c: ["test"] for c in range(n, n + t)}}
    return {c: list(cfg.eval.splits) for c in clients}


def eval_clients(cfg, n: int) -> list[int]:
    if cfg.eval.clients == "all" or cfg.eval.clients >= n:
        return list(range(n))
    rng = rng_for(cfg.seed, 0, SERVER, "eval-clients")
    return sorted(int(c) for c in rng.choice(n, size=cfg.eval.clients, replace=False))


def split_by_host(client_ids, owner) -> dict[int, list[int]]:
    by_host: dict[int, list[int]] = {}
    for c in client_ids:
        by_host.setdefault(owner(c), []).append(c)
    return dict(sorted(by_host.items()))


def _write_status(run_dir: str, cfg, **status) -> None:
    """status.json, with the fingerprint of the config it is the status of."""
    write_json(os.path.join(run_dir, "status.json"), {**status, "config": checkpoint.config_fingerprint(cfg)})


def _warn(text: str) -> None:
    print(text, file=sys.stderr)
