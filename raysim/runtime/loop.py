"""One federation's life: a Server actor, a host pool, the round loop, checkpoints and recovery.

Everything said to the outside world goes through callbacks (:class:`Callback`): metrics files,
progress lines, Tune reports. A lost ClientHost is replaced and the federation rolls back to its
last checkpoint (or to round 0, which is always reproducible) and replays: every draw is keyed by
(seed, round, client), so the metrics come out identical to an undisturbed run's.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass

from raysim import checkpoint
from raysim.config import dump_yaml, host_layout
from raysim.errors import RunFailed
from raysim.metrics import MetricsLog
from raysim.runtime.backend import RayActors
from raysim.runtime.balance import plan_for
from raysim.runtime.cluster import first_line, owner_of
from raysim.runtime.seeding import SERVER, rng_for

MAX_HOST_RESTARTS = 3


@dataclass
class MethodRun:
    method: str
    run_dir: str
    rounds_done: int
    seconds: float
    startup_seconds: float
    round_seconds: list[float]
    last_eval: dict
    host_restarts: int = 0


class Callback:
    """What the round loop reports; override what you need."""

    def on_start(self, run: "FederationRun") -> None:
        """The pool is up and the loop starts (``run.server``, ``run.hosts`` exist)."""

    def on_round(self, rnd: int, summary: dict, evaluation: dict | None, log: MetricsLog) -> None:
        """After every round that completed (``evaluation`` None on rounds without one)."""

    def on_end(self, log: MetricsLog) -> None:
        """When the loop stops, finished or not."""


class FederationRun:
    """One federation of ``cfg`` (a single method, seed and held-out domain) in ``run_dir``."""

    def __init__(self, cfg, run_dir: str, callbacks=(), backend=None):
        """``backend``: where the server and hosts live (Ray actors by default; see runtime.backend)."""
        self.cfg, self.run_dir = cfg, run_dir
        self.callbacks = list(callbacks)
        self.backend = backend or RayActors()
        self.server = None
        self.hosts, self.pg = [], None
        self._unawaited = []  # start() refs of hosts launched before the server was ready
        self.log = MetricsLog()
        self.host_restarts = 0
        # runtime.balance: how a round's clients are spread over the hosts (raysim.runtime.balance)
        self.plan = plan_for(cfg)
        self.state_bytes: dict[int, int] = {}  # stored-state size of each client that has a record

    # ------------------------------------------------------------------ lifecycle
    def run(self, resume: bool = False) -> MethodRun:
        cfg = self.cfg
        os.makedirs(self.run_dir, exist_ok=True)
        if not resume or not os.path.isfile(os.path.join(self.run_dir, "config.yaml")):
            dump_yaml(cfg, os.path.join(self.run_dir, "config.yaml"))
        t_start = time.perf_counter()
        self.server = self.backend.server(cfg)
        server_started = self.server.start.remote()
        round_seconds, last_eval, rnd = [], {}, 0
        try:
            self._launch_hosts_early()
            self.info = self.backend.get(server_started)
            self.n = self.info["num_clients"]
            self.num_hosts, _ = host_layout(cfg.runtime, self.n)
            self._start_hosts()
            self.domain_of = self.info["client_domains"].__getitem__
            self.requests = eval_requests(cfg, eval_clients(cfg, self.n), self.info)
            rnd = self._restore(checkpoint.latest(self.run_dir, cfg, warn=_warn) if resume else None) + 1
            startup = time.perf_counter() - t_start
            for cb in self.callbacks:
                cb.on_start(self)
            while rnd <= cfg.rounds:
                t0 = time.perf_counter()
                try:
                    summary, evaluation = self._round(rnd)
                except HostLost as lost:
                    rnd = self._recover(lost, rnd) + 1
                    continue
                last_eval = evaluation or last_eval
                round_seconds.append(time.perf_counter() - t0)
                if cfg.checkpoint.every and (rnd % cfg.checkpoint.every == 0) and rnd < cfg.rounds:
                    self._checkpoint(rnd)
                for cb in self.callbacks:
                    cb.on_round(rnd, summary, evaluation, self.log)
                rnd += 1
            rnd = cfg.rounds
            _write_status(self.run_dir, finished=True, rounds=rnd, startup_seconds=startup,
                          round_seconds=round_seconds, host_restarts=self.host_restarts)
        except KeyboardInterrupt:
            raise RunFailed(f"interrupted in round {rnd}; {self._resume_hint()}") from None
        finally:
            for cb in self.callbacks:
                cb.on_end(self.log)
            self._stop()
        return MethodRun(cfg.method, self.run_dir, rnd, time.perf_counter() - t_start, startup, round_seconds,
                         last_eval, self.host_restarts)

    def _launch_hosts_early(self) -> None:
        """With runtime.num_hosts fixed, the pool starts while the server loads the data (about
        half of a small federation's start-up); otherwise its size waits for the client count."""
        rt = self.cfg.runtime
        if rt.num_hosts is not None and rt.clients_per_host is None:
            self.hosts, self._unawaited, self.pg = self.backend.launch_pool(self.cfg, rt.num_hosts)

    def _start_hosts(self) -> None:
        total = self.n + self.info["num_targets"]
        if self._unawaited and len(self.hosts) == self.num_hosts:  # launched early, at the right size
            starts, self._unawaited = self._unawaited, []
            self.backend.await_pool(self.hosts, starts, total, run_dir=self.run_dir)
            self.owner = owner_of(self.num_hosts)
            return
        self._stop_hosts()  # an early pool larger than the clients (or nothing, normally)
        self.hosts, self.owner, self.pg = self.backend.create_pool(self.cfg, self.num_hosts, total,
                                                                   run_dir=self.run_dir)

    def _stop_hosts(self) -> None:
        self.backend.stop_pool(self.hosts, self.pg, self._unawaited)
        self.hosts, self.pg, self._unawaited = [], None, []

    def _stop(self) -> None:
        self._stop_hosts()
        if self.server is not None:
            self.backend.kill(self.server)

    # ------------------------------------------------------------------ one round
    def _round(self, rnd: int):
        cfg, server = self.cfg, self.server
        sampled = self._call(server.sample.remote(rnd))
        payload_box, personal = self._call(server.broadcast.remote(rnd, sampled))
        if self.plan is None or len(self.hosts) == 1:
            futures = [self.hosts[h].train_round.remote(rnd, payload_box, cids,
                                                        {c: personal[c] for c in cids if c in personal})
                       for h, cids in split_by_host(sampled, self.owner).items()]
            returned = []
        else:
            futures, returned = self._train_balanced(rnd, sampled, payload_box, personal)
        summary = self._call(server.aggregate.remote(rnd, *futures))
        self._call(returned)  # moved clients' records are back on their owners before anyone reads them
        results = None
        if rnd % cfg.eval.every == 0 or rnd == cfg.rounds:
            personalized = cfg.eval.protocol == "personalized"  # the global model needs no per-client payloads
            payload_box, personal = self._call(server.broadcast.remote(rnd, list(self.requests) if personalized else [],
                                                                       False))
            futures = [self.hosts[h].evaluate.remote(rnd, payload_box, {c: self.requests[c] for c in cids},
                                                     cfg.eval.protocol, {c: personal[c] for c in cids if c in personal})
                       for h, cids in split_by_host(self.requests, self.owner).items()]
            results = {}
            for part in self._call(futures):
                results.update(part)
        # metrics only once the whole round succeeded, so a replayed round never logs twice
        self.log.add_round(rnd, summary, self.domain_of)
        evaluation = self.log.add_eval(rnd, results, self.domain_of) if results is not None else None
        return summary, evaluation

    def _train_balanced(self, rnd: int, sampled: list[int], payload_box: list, personal: dict):
        """Train the round's clients in chunks handed to hosts as they free up (``self.plan``);
        returns the hosts' end_round refs and the refs of the moved records' return to their owners."""
        limit = self.cfg.runtime.steal_state_mb * 2**20
        plan = self.plan(rnd, split_by_host(sampled, self.owner), len(self.hosts),
                         lambda c: self.state_bytes.get(c, 0) <= limit)
        # the records a thief may need, read from each owner before its first chunk (so a busy owner
        # never holds a thief up); clients without a record start from their initial state anywhere
        exports = {h: [self.hosts[h].export_records.remote(cids)]
                   for h, q in plan.queues.items()
                   if (cids := [c for c in q if c in self.state_bytes and plan.movable(c)])}
        running: dict = {}  # ref -> (host, owner)
        returned = []

        def feed(h: int) -> None:
            while True:
                owner, cids = plan.next_chunk(h, sum(1 for host, _ in running.values() if host == h))
                if not cids:
                    return
                moved = None if owner == h else exports.get(owner, [None])
                ref = self.hosts[h].train_clients.remote(rnd, payload_box, cids,
                                                         {c: personal[c] for c in cids if c in personal}, moved)
                running[ref] = (h, owner)

        for h in range(len(self.hosts)):
            feed(h)
        while running:
            ready, _ = self.backend.wait(list(running))
            for ref in ready:
                h, owner = running.pop(ref)
                done = self._call(ref)
                self.state_bytes.update(done["state_bytes"])
                if done["records"]:
                    returned.append(self.hosts[owner].import_states.remote(done["records"]))
                feed(h)
        return [host.end_round.remote(rnd) for host in self.hosts], returned

    def _call(self, refs):
        """The results of ``refs``, telling a lost host (recoverable) from a lost server (resume later)."""
        try:
            return self.backend.get(refs)
        except self.backend.lost() as err:
            if not self.backend.alive(self.server):
                raise RunFailed(f"the server actor was lost ({first_line(err)}); {self._resume_hint()}") from None
            dead = [h for h, actor in enumerate(self.hosts) if not self.backend.alive(actor)]
            if not dead:
                raise
            raise HostLost(dead, first_line(err)) from None

    # ------------------------------------------------------------------ recovery and checkpoints
    def _recover(self, lost: "HostLost", rnd: int) -> int:
        """Replace the pool and roll back to the last checkpoint (or round 0); return its round."""
        self.host_restarts += 1
        if self.host_restarts > MAX_HOST_RESTARTS:
            raise RunFailed(f"hosts {lost.hosts} lost in round {rnd} after {MAX_HOST_RESTARTS} restarts "
                            f"({lost.reason}); {self._resume_hint()}")
        _warn(f"raysim: warning: host(s) {lost.hosts} lost in round {rnd} ({lost.reason}); "
              "restarting the pool and replaying from the last checkpoint")
        self._stop_hosts()
        self._start_hosts()
        ckpt = checkpoint.latest(self.run_dir, self.cfg, warn=_warn)
        if ckpt is None:
            self.backend.get(self.server.reset.remote())
        return self._restore(ckpt)

    def _restore(self, ckpt: dict | None) -> int:
        self.state_bytes = {}
        if ckpt is None:
            self.log = MetricsLog()
            return 0
        self.backend.get(self.server.load_state.remote(ckpt["server"]))
        by_host: dict[int, dict] = {}
        for cid, record in ckpt["clients"].items():
            by_host.setdefault(self.owner(cid), {})[cid] = record
        for sizes in self.backend.get([self.hosts[h].import_states.remote(records) for h, records in by_host.items()]):
            self.state_bytes.update(sizes)
        self.log = MetricsLog.from_table(ckpt["metrics"])
        return ckpt["round"]

    def _checkpoint(self, rnd: int) -> None:
        server_state = self._call(self.server.export_state.remote())
        clients = {}
        for part in self._call([h.export_states.remote() for h in self.hosts]):
            clients.update(part)
        checkpoint.write(self.run_dir, rnd, self.cfg, server_state, clients, self.log.table(),
                         keep=self.cfg.checkpoint.keep)

    def _resume_hint(self) -> str:
        if self.cfg.checkpoint.every and checkpoint.list_rounds(self.run_dir):
            return f"resume with: raysim run --resume {self.run_dir}"
        return f"rerun with: raysim run --resume {self.run_dir} (no checkpoint yet: it restarts from round 1)"


class HostLost(Exception):
    def __init__(self, hosts: list[int], reason: str):
        super().__init__(f"hosts {hosts} lost: {reason}")
        self.hosts, self.reason = hosts, reason


def finished(run_dir: str) -> bool:
    """Whether the federation in ``run_dir`` ran all its rounds (its status.json says so)."""
    try:
        with open(os.path.join(run_dir, "status.json"), encoding="utf-8") as fh:
            return json.load(fh).get("finished", False)
    except (OSError, ValueError):
        return False


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


def _write_status(run_dir: str, **status) -> None:
    tmp = os.path.join(run_dir, "status.json.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(status, fh)
    os.replace(tmp, os.path.join(run_dir, "status.json"))


def _warn(text: str) -> None:
    print(text, file=sys.stderr)
