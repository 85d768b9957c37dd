"""The driver: start (or join) Ray, place the server and the host pool, run the rounds, write the
run directory. It holds no per-client state; it only orchestrates and reports progress.

    run(cfg) -> for each method (and each held-out domain under LODO): FederationRun
                -> Server actor + ClientHost pool -> rounds -> metrics.parquet;
             -> summary.md and curves.png (one comparison table on top).

A lost ClientHost is replaced and the federation rolls back to its last checkpoint (or to round
0, which is always reproducible) and replays: every draw is keyed by (seed, round, client), so the
metrics come out identical to an undisturbed run's.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass

from raysim import checkpoint
from raysim.config import ExperimentConfig, dump_yaml, host_layout, load_config
from raysim.errors import RunFailed, TrainingDiverged, UserError
from raysim.metrics import MetricsLog
from raysim.progress import Progress
from raysim.runtime.seeding import SERVER, rng_for

MAX_HOST_RESTARTS = 3
SLOT_SETTLE_TRIES, SLOT_SETTLE_S = 4, 0.25  # parallel_slots: up to 1 s for freed actors to show


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


def default_run_dir(cfg: ExperimentConfig) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = cfg.name or "-".join(cfg.method_names())
    return os.path.join("runs", f"{name}-{stamp}")


def run(cfg: ExperimentConfig, out: str | None = None, address: str | None = None,
        progress: bool = True, resume: bool = False) -> list[MethodRun]:
    """Run every method of ``cfg`` on the same data and seed; return one MethodRun each.

    With ``resume``, federations already finished are skipped and the others continue from their
    last checkpoint.
    """
    from raysim import report
    from raysim.runtime.cluster import ray_session

    run_dir = out or default_run_dir(cfg)
    os.makedirs(run_dir, exist_ok=True)
    if not resume:
        dump_yaml(cfg, os.path.join(run_dir, "config.yaml"))
    names, seeds = cfg.method_names(), cfg.seed_list()
    holdouts = lodo_holdouts(cfg) if cfg.eval.protocol == "lodo" else [None]
    jobs = []  # (config, run directory) of every federation: method x seed x held-out domain
    for name in names:
        for seed in seeds:
            for holdout in holdouts:
                sub = run_dir if len(names) == 1 else os.path.join(run_dir, name)
                one = cfg.for_method(name)
                if cfg.seeds:  # one folder per seed: <method>/seed-<s>/
                    one = one.for_seed(seed)
                    sub = os.path.join(sub, f"seed-{seed}")
                if holdout is not None:  # leave-one-domain-out: one federation per held-out domain
                    one.data.partition = {**one.data.partition, "holdout": holdout}
                    sub = os.path.join(sub, f"holdout-{holdout}")
                if not (resume and _finished(sub)):
                    jobs.append((one, sub))
    with ray_session(address or cfg.runtime.address, cfg.runtime):
        results = _run_federations(jobs, progress, resume, show_seed=bool(cfg.seeds))
    text = report.render(run_dir)
    if progress:
        print(text)
        print(f"run directory: {run_dir}")
    return results


def _run_federations(jobs: list, progress: bool, resume: bool, show_seed: bool = False) -> list[MethodRun]:
    """Run the federations one after another, or as many at once as the cluster fits: they are
    independent (every draw is keyed by seed, round and client), so the results are the same."""
    from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

    slots = parallel_slots(jobs[0][0], len(jobs)) if jobs else 1
    if slots <= 1:
        return [FederationRun(one, sub, progress=progress, show_seed=show_seed).run(resume=resume) for one, sub in jobs]
    if progress:
        print(f"raysim: running {len(jobs)} federations, {slots} at a time", file=sys.stderr)

    def one_federation(one, sub):
        result = FederationRun(one, sub, progress="lines" if progress else False, show_seed=show_seed).run(resume=resume)
        if progress:
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
    except KeyboardInterrupt:
        raise RunFailed("interrupted; finished federations are kept: rerun with raysim run --resume RUN_DIR") from None
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def parallel_slots(cfg: ExperimentConfig, num_jobs: int) -> int:
    """How many federations run at once: ``runtime.parallel_federations``, or as many as the
    cluster's free CPUs and GPUs fit (one inside a Tune trial, whose placement group holds one)."""
    import ray
    from ray.util.placement_group import get_current_placement_group

    rt = cfg.runtime
    if rt.parallel_federations is not None:
        return max(1, min(rt.parallel_federations, num_jobs))
    if get_current_placement_group() is not None or rt.num_hosts is None:
        return 1

    def fits_now() -> int:
        free = ray.available_resources()
        fits = int((free.get("CPU", 0) + 1e-9) // max(rt.cpus_per_host * rt.num_hosts + rt.server_cpus, 1e-9))
        if rt.gpus_per_host:
            fits = min(fits, int((free.get("GPU", 0) + 1e-9) // (rt.gpus_per_host * rt.num_hosts)))
        return fits

    # Ray frees a killed actor's resources asynchronously, so right after a previous run the free
    # count can lag by a few hundred ms; look a few times before settling for fewer slots.
    fits = fits_now()
    for _ in range(SLOT_SETTLE_TRIES):
        if fits >= num_jobs:
            break
        time.sleep(SLOT_SETTLE_S)
        fits = max(fits, fits_now())
    return max(1, min(fits, num_jobs))


def resume_config(run_dir: str, overrides: list[str]) -> ExperimentConfig:
    """The run's own config; only runtime.* may be changed on resume."""
    bad = [o for o in overrides if not o.split("=", 1)[0].startswith("runtime.")]
    if bad:
        raise UserError(f"--resume continues the run as configured; only runtime.* overrides are allowed, "
                        f"got {bad[0]!r}")
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(path):
        raise UserError(f"--resume {run_dir}: no config.yaml there (is it a raysim run directory?)")
    return load_config(path, overrides)


def run_method(cfg: ExperimentConfig, run_dir: str, progress: bool = True, on_round=None) -> MethodRun:
    """One federation of one method (see FederationRun)."""
    return FederationRun(cfg, run_dir, progress=progress, on_round=on_round).run()


def _finished(run_dir: str) -> bool:
    try:
        with open(os.path.join(run_dir, "status.json"), encoding="utf-8") as fh:
            return json.load(fh).get("finished", False)
    except (OSError, ValueError):
        return False


class FederationRun:
    """One federation: a Server actor, a host pool, the round loop, metrics and checkpoints.

    ``on_round(round, summary, evaluation or None)`` is called after every round (Tune reports
    per-round metrics through it). ``progress``: True (a live bar on a terminal), "lines" (one
    line per round: federations running side by side share the terminal) or False.
    """

    def __init__(self, cfg: ExperimentConfig, run_dir: str, progress: bool | str = True, on_round=None,
                 show_seed: bool = False):
        self.cfg, self.run_dir, self.on_round, self.show_seed = cfg, run_dir, on_round, show_seed
        self.progress = progress
        self.server = None
        self.hosts, self.pg = [], None
        self._unawaited = []  # start() refs of hosts launched before the server was ready
        self.log = MetricsLog()
        self.host_restarts = 0

    # ------------------------------------------------------------------ lifecycle
    def run(self, resume: bool = False) -> MethodRun:
        import ray
        from raysim.runtime.server import Server

        cfg = self.cfg
        os.makedirs(self.run_dir, exist_ok=True)
        if not resume or not os.path.isfile(os.path.join(self.run_dir, "config.yaml")):
            dump_yaml(cfg, os.path.join(self.run_dir, "config.yaml"))
        t_start = time.perf_counter()
        holdout = (cfg.data.partition or {}).get("holdout")
        label = cfg.method + (f"[{holdout}]" if holdout else "") + (f"[seed {cfg.seed}]" if self.show_seed else "")
        bar = Progress(cfg.rounds, label=label,
                       enabled=bool(self.progress), lines=self.progress == "lines")
        self.server = ray.remote(Server).options(num_cpus=cfg.runtime.server_cpus,
                                                 scheduling_strategy=_server_placement()).remote(cfg)
        server_started = self.server.start.remote()
        round_seconds, last_eval, rnd = [], {}, 0
        try:
            self._launch_hosts_early()
            self.info = _get(server_started)
            self.n = self.info["num_clients"]
            self.num_hosts, _ = host_layout(cfg.runtime, self.n)
            self._start_hosts()
            self.domain_of = self.info["client_domains"].__getitem__
            self.requests = _eval_requests(cfg, _eval_clients(cfg, self.n), self.info)
            rnd = self._restore(checkpoint.latest(self.run_dir, cfg, warn=_warn) if resume else None) + 1
            startup = time.perf_counter() - t_start
            bar.t0 = time.perf_counter()
            while rnd <= cfg.rounds:
                t0 = time.perf_counter()
                try:
                    summary, evaluation = self._round(rnd)
                except HostLost as lost:
                    rnd = self._recover(lost, rnd) + 1
                    continue
                last_eval = evaluation or last_eval
                round_seconds.append(time.perf_counter() - t0)
                if evaluation is not None:  # an early-stopped or killed run keeps its rows so far
                    self.log.write(os.path.join(self.run_dir, "metrics.parquet"))
                if cfg.checkpoint.every and (rnd % cfg.checkpoint.every == 0) and rnd < cfg.rounds:
                    self._checkpoint(rnd)
                bar.update(rnd, summary["train_loss"], last_eval)
                if self.on_round is not None:
                    self.on_round(rnd, summary, evaluation)
                rnd += 1
            rnd = cfg.rounds
            _write_status(self.run_dir, finished=True, rounds=rnd, startup_seconds=startup,
                          round_seconds=round_seconds, host_restarts=self.host_restarts)
        except KeyboardInterrupt:
            raise RunFailed(f"interrupted in round {rnd}; {self._resume_hint()}") from None
        finally:
            bar.close()
            if len(self.log):
                self.log.write(os.path.join(self.run_dir, "metrics.parquet"))
            self._stop()
        return MethodRun(cfg.method, self.run_dir, rnd, time.perf_counter() - t_start, startup, round_seconds,
                         last_eval, self.host_restarts)

    def _launch_hosts_early(self) -> None:
        """With runtime.num_hosts fixed, the pool starts while the server loads the data (about
        half of a small federation's start-up); otherwise its size waits for the client count."""
        from raysim.runtime.cluster import launch_pool
        rt = self.cfg.runtime
        if rt.num_hosts is not None and rt.clients_per_host is None:
            self.hosts, self._unawaited, self.pg = launch_pool(self.cfg, rt.num_hosts)

    def _start_hosts(self) -> None:
        from raysim.runtime.cluster import await_pool, create_pool, owner_of
        total = self.n + self.info["num_targets"]
        if self._unawaited and len(self.hosts) == self.num_hosts:  # launched early, at the right size
            starts, self._unawaited = self._unawaited, []
            await_pool(self.hosts, starts, total, run_dir=self.run_dir)
            self.owner = owner_of(self.num_hosts)
            return
        self._stop_hosts()  # an early pool larger than the clients (or nothing, normally)
        self.hosts, self.owner, self.pg = create_pool(self.cfg, self.num_hosts, total, run_dir=self.run_dir)

    def _stop_hosts(self) -> None:
        from raysim.runtime.cluster import stop_pool
        stop_pool(self.hosts, self.pg, self._unawaited)
        self.hosts, self.pg, self._unawaited = [], None, []

    def _stop(self) -> None:
        import ray
        self._stop_hosts()
        if self.server is not None:
            ray.kill(self.server)

    # ------------------------------------------------------------------ one round
    def _round(self, rnd: int):
        cfg, server = self.cfg, self.server
        sampled = self._call(server.sample.remote(rnd))
        payload_box, personal = self._call(server.broadcast.remote(rnd, sampled))
        futures = [self.hosts[h].train_round.remote(rnd, payload_box, cids,
                                                    {c: personal[c] for c in cids if c in personal})
                   for h, cids in _split_by_host(sampled, self.owner).items()]
        summary = self._call(server.aggregate.remote(rnd, *futures))
        results = None
        if rnd % cfg.eval.every == 0 or rnd == cfg.rounds:
            personalized = cfg.eval.protocol == "personalized"  # the global model needs no per-client payloads
            payload_box, personal = self._call(server.broadcast.remote(rnd, list(self.requests) if personalized else [],
                                                                       False))
            futures = [self.hosts[h].evaluate.remote(rnd, payload_box, {c: self.requests[c] for c in cids},
                                                     cfg.eval.protocol, {c: personal[c] for c in cids if c in personal})
                       for h, cids in _split_by_host(self.requests, self.owner).items()]
            results = {}
            for part in self._call(futures):
                results.update(part)
        # metrics only once the whole round succeeded, so a replayed round never logs twice
        self.log.add_round(rnd, summary, self.domain_of)
        evaluation = self.log.add_eval(rnd, results, self.domain_of) if results is not None else None
        return summary, evaluation

    def _call(self, refs):
        """ray.get that tells a lost host (recoverable) from a lost server (resume later)."""
        import ray
        try:
            return _get(refs)
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError, ray.exceptions.ObjectLostError) as err:
            if not _alive(self.server):
                raise RunFailed(f"the server actor was lost ({_first_line(err)}); {self._resume_hint()}") from None
            dead = [h for h, actor in enumerate(self.hosts) if not _alive(actor)]
            if not dead:
                raise
            raise HostLost(dead, _first_line(err)) from None

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
            _get(self.server.reset.remote())
        return self._restore(ckpt)

    def _restore(self, ckpt: dict | None) -> int:
        if ckpt is None:
            self.log = MetricsLog()
            return 0
        _get(self.server.load_state.remote(ckpt["server"]))
        by_host: dict[int, dict] = {}
        for cid, state in ckpt["clients"].items():
            by_host.setdefault(self.owner(cid), {})[cid] = state
        _get([self.hosts[h].import_states.remote(states) for h, states in by_host.items()])
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


def lodo_holdouts(cfg) -> list[str]:
    from raysim.runtime.datashards import dataset_domains
    domains = dataset_domains(cfg)  # from the shards' index under data.shards: no data load
    if cfg.eval.holdout == "all":
        return domains
    if cfg.eval.holdout not in domains:
        raise UserError(f"eval.holdout = {cfg.eval.holdout!r} is not a domain of {cfg.data.dataset}; "
                        f"expected 'all' or one of: {', '.join(domains)}")
    return [cfg.eval.holdout]


def _eval_requests(cfg, eval_clients: list[int], info: dict) -> dict[int, list[str]]:
    """Which splits each client is evaluated on. Leave-one-domain-out selects models by the
    source clients' validation accuracy and reports the unseen clients' test accuracy."""
    if cfg.eval.protocol == "lodo":
        n, t = info["num_clients"], info["num_targets"]
        return {**{c: ["val"] for c in eval_clients}, **{c: ["test"] for c in range(n, n + t)}}
    return {c: list(cfg.eval.splits) for c in eval_clients}


def _eval_clients(cfg, n: int) -> list[int]:
    if cfg.eval.clients == "all" or cfg.eval.clients >= n:
        return list(range(n))
    rng = rng_for(cfg.seed, 0, SERVER, "eval-clients")
    return sorted(int(c) for c in rng.choice(n, size=cfg.eval.clients, replace=False))


def _split_by_host(client_ids, owner) -> dict[int, list[int]]:
    by_host: dict[int, list[int]] = {}
    for c in client_ids:
        by_host.setdefault(owner(c), []).append(c)
    return dict(sorted(by_host.items()))


def _server_placement():
    """Inside a Tune trial the server takes bundle 0 of the trial's placement group (the hosts take
    1..H); otherwise Ray places it."""
    from ray.util.placement_group import get_current_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    pg = get_current_placement_group()
    return None if pg is None else PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)


def _write_status(run_dir: str, **status) -> None:
    tmp = os.path.join(run_dir, "status.json.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(status, fh)
    os.replace(tmp, os.path.join(run_dir, "status.json"))


def _alive(actor, timeout: float = 30.0) -> bool:
    import ray
    try:
        ray.get(actor.ping.remote(), timeout=timeout)
        return True
    except Exception:
        return False


def _warn(text: str) -> None:
    print(text, file=sys.stderr)


def _first_line(err: Exception) -> str:
    lines = [line for line in str(err).splitlines() if line.strip()]
    return lines[0][:300] if lines else type(err).__name__


def _get(refs):
    """ray.get that turns a user error raised inside an actor back into a plain UserError."""
    import ray
    try:
        return ray.get(refs)
    except ray.exceptions.RayTaskError as err:
        cause = getattr(err, "cause", None)
        if isinstance(cause, TrainingDiverged):
            raise cause from None
        if isinstance(cause, UserError):
            raise UserError(str(cause).splitlines()[0]) from None
        raise
