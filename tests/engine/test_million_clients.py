"""A federation of 1,000,000 registered clients (100 per round) costs, at start-up and per round,
about what one of 1,000 does: the server's per-client tables (domains, profiles) are runs and a
tier array read lazily, and sampling never lists every client. The lazy tables equal the eager
tuples they replaced, item for item, for every way of assigning levels."""
import gc
import math
import os
import pickle
import sys
import time
import tracemalloc

import numpy as np
import pytest

from raysim.config import load_config
from raysim.engine.clock import client_profiles
from raysim.engine.federation import ClientDomains, Federation, PooledPartition
from raysim.core.seeding import SERVER, rng_for
from raysim.engine.server import Server

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks.workloads import raysim_config, workload_c  # noqa: E402

BIG, SMALL, PER_ROUND = 1_000_000, 1_000, 100
LEVELS = [{"name": "C1", "flops": 2.0e9, "availability": 1.0}, {"name": "C2", "flops": 1.0e9},
          {"name": "C3", "memory_mb": 8, "availability": 0.5}]


@pytest.fixture(scope="module", autouse=True)
def _cache(tmp_path_factory):
    os.environ.setdefault("RAYSIM_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


def workload_c_config(num_clients: int, **partition):
    """Workload C of the benchmarks (FedBN, digits5, cross-device, 64 samples each, 100 per round)."""
    spec = workload_c(rounds=3, num_clients=num_clients, per_round=PER_ROUND)
    spec["partition"].update(partition)
    return raysim_config(spec)


def started(cfg) -> tuple[Server, dict, float, int]:
    """A started server, what it describes, its start-up seconds and the memory it still holds."""
    gc.collect()
    tracemalloc.start()
    try:
        t0 = time.perf_counter()
        server = Server(cfg)
        info = server.start()
        seconds = time.perf_counter() - t0
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    return server, info, seconds, held


def test_a_million_registered_clients_cost_what_a_thousand_do():
    Server(workload_c_config(SMALL)).start()  # imports and the dataset cache, outside the measurement
    _, small_info, small_s, small_mem = started(workload_c_config(SMALL))
    server, info, big_s, big_mem = started(workload_c_config(BIG))
    print(f"\nstart-up {small_s:.2f} s vs {big_s:.2f} s, memory held {small_mem / 2**20:.1f} vs "
          f"{big_mem / 2**20:.1f} MiB, describe() {len(pickle.dumps(small_info))} vs {len(pickle.dumps(info))} B")
    # generous bounds (a loaded 2-core machine); the eager tables took ~1 s more at 1,000,000 clients
    assert big_s < 5 * small_s + 2.0
    # measured: 64.2 vs 64.2 MiB; eager tables (every client's domain, describe()'s list of them, the
    # val/test slice bounds) added 31 MB
    assert big_mem - small_mem < 4 * 2**20
    assert len(pickle.dumps(info)) < 2**20
    assert info["num_clients"] == BIG and info["clients_per_round"] == PER_ROUND
    domains = info["client_domains"]
    assert len(domains) == BIG
    fed = server.fed
    for cid in (0, 199_999, 200_000, 555_555, BIG - 1):
        assert domains[cid] == fed.partition.domain(cid)
    assert domains[-1] == domains[BIG - 1] == "svhn" and domains[0] == "mnist"
    for rnd in (1, 2, 3):
        ids = server.sample(rnd)
        draw = rng_for(fed.cfg.seed, rnd, SERVER, "sample").choice(BIG, size=PER_ROUND, replace=False)
        assert ids == sorted(int(c) for c in draw) and len(set(ids)) == PER_ROUND
        assert all(type(c) is int and 0 <= c < BIG for c in ids)
    t0 = time.perf_counter()
    profiles = client_profiles(load_config(raw={"clients": {"profiles": {"levels": LEVELS, "assign": "random"}}})
                               .clients.profiles, BIG, 0)
    assert time.perf_counter() - t0 < 5.0 and len(profiles) == BIG and profiles.tiers.nbytes == BIG  # a byte each


def test_unseen_clients_follow_the_training_clients_in_describe():
    server, info, _, _ = started(workload_c_config(BIG, holdout="svhn"))
    domains = info["client_domains"]
    assert info["num_targets"] == 1 and len(domains) == BIG + 1
    assert domains[0] == "mnist" and domains[BIG - 1] == "synth" and domains[BIG] == "svhn"
    assert domains[BIG] == server.fed.domain(BIG)
    assert len(pickle.dumps(info)) < 2**20


def test_client_domains_equal_the_eager_tuple():
    fed = Federation(workload_c_config(SMALL + 3))
    part = fed.partition
    eager = tuple(part.domain(c) for c in range(part.num_clients))
    lazy = fed.setup.client_domains
    assert isinstance(lazy, ClientDomains)
    assert lazy == eager and eager == lazy and tuple(lazy) == eager and list(lazy) == list(eager)
    assert len(lazy) == len(eager) and lazy[-1] == eager[-1] and lazy[-len(eager)] == eager[0]
    assert lazy[5:700:7] == eager[5:700:7] and hash(lazy) == hash(eager)
    assert pickle.loads(pickle.dumps(lazy)) == eager
    assert ("usps" in lazy) and ("nowhere" not in lazy)
    with pytest.raises(IndexError):
        lazy[len(eager)]
    with_target = lazy + ClientDomains([(0, 2, "t")])
    assert tuple(with_target) == eager + ("t", "t")
    # a partition without per-domain id ranges (the pooled client) is read client by client
    assert ClientDomains.of(PooledPartition(part)) == ("+".join(dict.fromkeys(eager)),)


def eager_profiles(levels: list[dict], shares, assign, num_clients: int, seed: int) -> tuple[dict, ...]:
    """The profiles as they were built before (one dict per client), as the reference."""
    shares = shares or (1.0,) * len(levels)
    quotas = [s / sum(shares) * num_clients for s in shares]
    counts = [int(math.floor(q + 1e-9)) for q in quotas]
    for i in sorted(range(len(levels)), key=lambda i: (-(quotas[i] - counts[i]), i))[:num_clients - sum(counts)]:
        counts[i] += 1
    if isinstance(assign, list):
        tiers = assign
    else:
        slots, k = [], 0
        while len(slots) < num_clients:
            if counts[k % len(levels)] > 0:
                slots.append(k % len(levels))
                counts[k % len(levels)] -= 1
            k += 1
        perm = rng_for(seed, 0, SERVER, "client-levels").permutation(num_clients)
        tiers = slots if assign == "round_robin" else [slots[int(i)] for i in perm]
    return tuple({**{k: v for k, v in levels[t].items() if k != "name"}, "tier": t, "level": levels[t]["name"]}
                 for t in tiers)


@pytest.mark.parametrize("assign,shares", [("round_robin", None), ("round_robin", [1, 2, 0.5]),
                                           ("random", None), ("random", [3, 0, 1]), ("explicit", None)])
def test_client_profiles_equal_the_eager_dicts(assign, shares):
    n, seed = SMALL + 7, 3
    if assign == "explicit":
        assign = [int(t) for t in np.random.default_rng(0).integers(0, len(LEVELS), n)]
    profiles = {"levels": LEVELS, "assign": assign, "shares": shares}
    cfg = load_config(raw={"seed": seed, "clients": {"profiles": profiles}})
    lazy = client_profiles(cfg.clients.profiles, n, seed)
    eager = eager_profiles(LEVELS, shares, assign, n, seed)
    assert len(lazy) == n and lazy == eager and list(lazy) == list(eager) and lazy[-1] == eager[-1]
    assert all(lazy[c] == eager[c] for c in range(0, n, 97))
    lazy[0]["flops"] = -1.0  # each read is the client's own dict
    assert lazy[0] == eager[0]
    assert pickle.loads(pickle.dumps(lazy)) == eager
    assert not client_profiles(load_config(raw={}).clients.profiles, n, seed)  # no levels: empty
    assert client_profiles(load_config(raw={}).clients.profiles, n, seed) == ()


def test_availability_draws_and_traces_select_the_same_clients(tmp_path):
    """Online clients through the tier array = the old per-client loop's, and so the same sample."""
    pairs = {(c, r) for r in (1, 2) for c in range(r, SMALL + 50, 3)}  # ids past the federation's too
    trace = tmp_path / "online.csv"
    trace.write_text("client,round\n" + "".join(f"{c},{r}\n" for c, r in sorted(pairs)))
    for extra in ({}, {"trace": str(trace)}):
        raw = {"method": "fedavg", "seed": 5, "clients_per_round": 50,
               "data": {"dataset": "digits5", "partition": {"kind": "cross_device", "num_clients": SMALL,
                                                            "samples_per_client": 64, "overlap": True}},
               "clients": {"profiles": {"levels": LEVELS, "assign": "random", **extra}}}
        server = Server(load_config(raw=raw))
        server.start()
        profiles = server.fed.setup.client_profiles
        for rnd in (1, 2, 3):
            if extra:
                online = [c for c in range(SMALL) if (c, rnd) in pairs]
            else:
                u = rng_for(5, rnd, SERVER, "available").random(SMALL)
                online = [c for c in range(SMALL) if u[c] < profiles[c].get("availability", 1.0)]
            assert [int(c) for c in server.online(rnd)] == online
            if len(online) <= 50:
                expected = online
            else:
                pick = rng_for(5, rnd, SERVER, "sample").choice(len(online), size=50, replace=False)
                expected = sorted(online[int(i)] for i in pick)
            assert server.sample(rnd) == expected


def test_equal_share_val_test_bounds_are_the_general_formulas():
    """Clients with equal train counts get their val/test slice bounds computed when asked; they
    are the integers the general cumulative-share formula gives (and hold no per-client array)."""
    from raysim.data.partition import _EqualShareBounds

    for n, k, pool, m in [(1, 64, 743, 100), (7, 64, 743, 1000), (1000, 64, 7430, 2000),
                          (200_000, 64, 25_000, 9000), (3, 5, 2, 7), (12, 1, 12, 12)]:
        counts = np.full(n, k, np.int64)
        cum = np.concatenate([[0], np.cumsum(counts, dtype=np.float64)])
        expected = np.floor(cum / max(cum[-1], pool, 1) * m + 1e-9).astype(np.int64)
        lazy = _EqualShareBounds(n, k, float(max(float(counts.sum()), pool, 1)), m)
        assert np.array_equal(np.asarray(lazy), expected)
        for j in (0, 1, n // 2, n - 1, n):
            assert lazy[j] == expected[j]
