"""The driver: start (or join) Ray, place the server and the host pool, run the rounds, write the
run directory. It holds no per-client state; it only orchestrates and reports progress.

    run(cfg) -> for each method: Server actor + ClientHost pool -> rounds -> metrics.parquet,
                summary.md, curves.png; with several methods, one comparison table on top.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

from raysim.config import ExperimentConfig, dump_yaml, host_layout
from raysim.errors import UserError
from raysim.metrics import MetricsLog
from raysim.progress import Progress
from raysim.runtime.seeding import SERVER, rng_for


@dataclass
class MethodRun:
    method: str
    run_dir: str
    rounds_done: int
    seconds: float
    startup_seconds: float
    round_seconds: list[float]
    last_eval: dict


def default_run_dir(cfg: ExperimentConfig) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = cfg.name or "-".join(cfg.method_names())
    return os.path.join("runs", f"{name}-{stamp}")


def run(cfg: ExperimentConfig, out: str | None = None, address: str | None = None,
        progress: bool = True) -> list[MethodRun]:
    """Run every method of ``cfg`` on the same data and seed; return one MethodRun each."""
    from raysim import report
    from raysim.runtime.cluster import ray_session

    run_dir = out or default_run_dir(cfg)
    os.makedirs(run_dir, exist_ok=True)
    dump_yaml(cfg, os.path.join(run_dir, "config.yaml"))
    names = cfg.method_names()
    holdouts = lodo_holdouts(cfg) if cfg.eval.protocol == "lodo" else [None]
    results = []
    with ray_session(address or cfg.runtime.address, cfg.runtime):
        for name in names:
            for holdout in holdouts:
                sub = run_dir if len(names) == 1 else os.path.join(run_dir, name)
                one = cfg.for_method(name)
                if holdout is not None:  # leave-one-domain-out: one federation per held-out domain
                    one.data.partition = {**one.data.partition, "holdout": holdout}
                    sub = os.path.join(sub, f"holdout-{holdout}")
                results.append(run_method(one, sub, progress=progress))
    text = report.render(run_dir)
    if progress:
        print(text)
        print(f"run directory: {run_dir}")
    return results


def run_method(cfg: ExperimentConfig, run_dir: str, progress: bool = True, on_round=None) -> MethodRun:
    """One federation of one method. ``on_round(round, summary, evaluation or None)`` is called
    after every round (Tune reports per-round metrics through it)."""
    import ray
    from raysim.runtime.cluster import create_pool
    from raysim.runtime.server import Server

    os.makedirs(run_dir, exist_ok=True)
    dump_yaml(cfg, os.path.join(run_dir, "config.yaml"))
    t_start = time.perf_counter()
    log = MetricsLog()
    bar = Progress(cfg.rounds, label=cfg.method, enabled=progress)
    server = ray.remote(Server).options(num_cpus=cfg.runtime.server_cpus).remote(cfg)
    hosts, pg = [], None
    round_seconds, last_eval, rnd = [], {}, 0
    try:
        info = _get(server.start.remote())
        n = info["num_clients"]
        num_hosts, _ = host_layout(cfg.runtime, n)
        hosts, owner, pg = create_pool(cfg, num_hosts, n + info["num_targets"])
        domain_of = info["client_domains"].__getitem__
        requests = _eval_requests(cfg, _eval_clients(cfg, n), info)
        startup = time.perf_counter() - t_start
        bar.t0 = time.perf_counter()
        for rnd in range(1, cfg.rounds + 1):
            t0 = time.perf_counter()
            sampled = _get(server.sample.remote(rnd))
            payload_box, personal = _get(server.broadcast.remote(rnd, sampled))
            futures = [hosts[h].train_round.remote(rnd, payload_box, cids, {c: personal[c] for c in cids if c in personal})
                       for h, cids in _split_by_host(sampled, owner).items()]
            summary = _get(server.aggregate.remote(rnd, *futures))
            log.add_round(rnd, summary)
            evaluation = None
            if rnd % cfg.eval.every == 0 or rnd == cfg.rounds:
                evaluation = last_eval = _evaluate(cfg, server, hosts, owner, rnd, requests, log, domain_of)
            round_seconds.append(time.perf_counter() - t0)
            if on_round is not None:
                on_round(rnd, summary, evaluation)
            bar.update(rnd, summary["train_loss"], last_eval)
    finally:
        bar.close()
        if len(log):
            log.write(os.path.join(run_dir, "metrics.parquet"))
        for actor in [*hosts, server]:
            ray.kill(actor)
        if pg is not None:
            ray.util.remove_placement_group(pg)
    return MethodRun(cfg.method, run_dir, rnd, time.perf_counter() - t_start, startup, round_seconds, last_eval)


def lodo_holdouts(cfg) -> list[str]:
    from raysim.data import load
    domains = list(load(cfg.data.dataset, root=cfg.data.root, seed=cfg.seed, **cfg.data.options).domains)
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


def _evaluate(cfg, server, hosts, owner, rnd, requests, log, domain_of) -> dict:
    payload_box, personal = _get(server.broadcast.remote(rnd, list(requests), False))
    futures = [hosts[h].evaluate.remote(rnd, payload_box, {c: requests[c] for c in cids}, cfg.eval.protocol,
                                        {c: personal[c] for c in cids if c in personal})
               for h, cids in _split_by_host(requests, owner).items()]
    results = {}
    for part in _get(futures):
        results.update(part)
    return log.add_eval(rnd, results, domain_of)


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


def _get(refs):
    """ray.get that turns a user error raised inside an actor back into a plain UserError."""
    import ray
    try:
        return ray.get(refs)
    except ray.exceptions.RayTaskError as err:
        cause = getattr(err, "cause", None)
        if isinstance(cause, UserError):
            raise UserError(str(cause).splitlines()[0]) from None
        raise
    except ray.exceptions.ActorDiedError as err:
        raise UserError(f"a raysim actor died: {str(err).splitlines()[0]}") from None
