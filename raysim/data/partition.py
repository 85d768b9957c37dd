"""Partitions: which positions of which domain's splits each client holds.

A partition is a pure function of (dataset, spec, seed): every random draw comes from a
numpy Generator keyed by (seed, purpose, domain[, client]), so any host can rebuild any
client's shard without talking to anyone. Client ids run 0..N-1, grouped by domain (in the
order of ``spec['domains']``, else the dataset's), then by index within the domain.

Shards are computed on demand from per-domain plans (a permutation plus slice
boundaries, or per-client draws), so a 100,000-client cross-device partition costs a few
arrays per domain, not 100,000 shards.

The keys are declared, typed and checked by kind in ``raysim.core.partition_spec`` (a config's
``data.partition`` is checked there when it is loaded); here they are read, and checked against
the dataset. Spec keys (all kinds): ``kind``, ``domains`` (subset/order), ``shared_test`` (every client
of a domain evaluates on the domain's full val/test; default: true iff each domain has one
client, else each client gets a disjoint slice of val/test proportional to its train
share), ``shuffle`` (default true; false takes consecutive slices of the split's own order,
e.g. FedBN's ``train_part0`` = the first 743 images).

* ``per_domain``: ``clients_per_domain`` (int, list or {domain: k}; default 1) splits each
  domain's train set disjointly; ``fraction: f`` gives each client int(f * n_train)
  (DapperFL: 1% or 20%), ``train_size: n`` exactly n (FedBN/FedWon: 743); ``num_clients: N,
  assign: random`` draws domains as DapperFL's code does (the last D clients cover every
  domain once, the others pick uniformly, redrawn if a domain runs out of data).
* ``dirichlet``: label skew within each domain: ``clients_per_domain``, ``alpha``,
  ``min_size`` (default 10, redraw until every client has it), ``balance`` (default true:
  a client already above the average size gets no more of a class, as EasyFL/FedLab do).
* ``cross_device``: ``num_clients`` spread ``even`` (default; the counts round-robin dealing
  gives, ids still grouped by domain) or ``proportional`` (to the domains' train sizes); ``samples_per_client`` (default: an even share of the pool);
  ``overlap: true`` lets clients draw independently (without replacement within a client)
  when clients x samples exceed the pool.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from raysim.data.splits import ALL, SPLITS
from raysim.core.errors import UserError
from raysim.core.partition_spec import HOLDOUT_KEYS, KINDS, keys

# the keys a spec given to make_partition may hold: its kind's, less the held-out domain's (taken
# off the config's partition before the federation builds it; see leave_one_domain_out)
_KEYS = {kind: keys(kind) - HOLDOUT_KEYS for kind in KINDS}


@dataclass(frozen=True, eq=False)
class ClientShard:
    """Positions into ``ds.split(domain, s)`` for s in train/val/test.

    ``test`` indexes the split named ``test_split``: "test", except for a leave-one-domain-out
    target, whose test set is the whole domain (``ds.split(domain, "all")``).
    """

    client_id: int
    domain: str
    train: np.ndarray
    val: np.ndarray
    test: np.ndarray
    test_split: str = "test"

    def split_name(self, which: str) -> str:
        return self.test_split if which == "test" else which


def client_data(ds, shard: ClientShard, which: str):
    """(Split, positions) of a client's ``which`` in {'train','val','test'}."""
    return ds.split(shard.domain, shard.split_name(which)), getattr(shard, which)


def _rng(seed: int, purpose: str, *keys) -> np.random.Generator:
    words = [int(seed) % 2**64, zlib.crc32(purpose.encode())]
    words += [zlib.crc32(k.encode()) if isinstance(k, str) else int(k) for k in keys]
    return np.random.default_rng(np.random.SeedSequence(words))


_EMPTY = np.zeros(0, np.int64)
_EMPTY.setflags(write=False)


class _Slices:
    """Client j gets ``order[bounds[j]:bounds[j+1]]`` (sorted)."""

    def __init__(self, order: np.ndarray, bounds: np.ndarray):
        self.order, self.bounds = order, bounds

    def get(self, j: int) -> np.ndarray:
        return np.sort(self.order[self.bounds[j]:self.bounds[j + 1]])

    def count(self, j: int) -> int:
        return int(self.bounds[j + 1] - self.bounds[j])

    def counts(self) -> np.ndarray:
        return np.diff(np.asarray(self.bounds))


class _EqualShareBounds:
    """``floor(j * k / total * m + 1e-9)`` for j = 0..n: the val/test slice bounds of n clients that
    each hold k training images, computed when asked rather than held (a million registered clients
    would otherwise keep 8 MB per split and domain in every process). Same float64 operations as
    the general case, so the same integers."""

    def __init__(self, n: int, k: int, total: float, m: int):
        self.n, self.k, self.total, self.m = n, k, total, m

    def __getitem__(self, j: int) -> int:
        return int(np.floor(float(j * self.k) / self.total * self.m + 1e-9))

    def __array__(self, dtype=None, copy=None):
        cum = (np.arange(self.n + 1, dtype=np.int64) * self.k).astype(np.float64) / self.total
        return np.floor(cum * self.m + 1e-9).astype(dtype or np.int64)


class _Lists:
    def __init__(self, lists: list[np.ndarray]):
        self.lists = lists

    def get(self, j: int) -> np.ndarray:
        return self.lists[j]

    def count(self, j: int) -> int:
        return int(self.lists[j].size)

    def counts(self) -> np.ndarray:
        return np.array([x.size for x in self.lists], np.int64)


class _Draws:
    """Client j draws ``k`` distinct positions of ``pool`` from its own generator."""

    def __init__(self, pool: int, k: int, n: int, seed: int, domain: str):
        self.pool, self.k, self.n, self.seed, self.domain = pool, k, n, seed, domain

    def get(self, j: int) -> np.ndarray:
        rng = _rng(self.seed, "cross_device/draw", self.domain, j)
        return np.sort(rng.choice(self.pool, self.k, replace=False).astype(np.int64))

    def count(self, j: int) -> int:
        return self.k

    def counts(self) -> np.ndarray:
        return np.full(self.n, self.k, np.int64)


class _Full:
    def __init__(self, n_items: int, n_clients: int):
        self.n_items, self.n = n_items, n_clients

    def get(self, j: int) -> np.ndarray:
        return np.arange(self.n_items, dtype=np.int64)

    def count(self, j: int) -> int:
        return self.n_items

    def counts(self) -> np.ndarray:
        return np.full(self.n, self.n_items, np.int64)


@dataclass
class _DomainPlan:
    domain: str
    first: int
    n: int
    plans: dict  # split -> _Slices | _Lists | _Draws | _Full
    test_split: str = "test"


class Partition:
    """Clients of a federation and, per client, its domain and data positions."""

    def __init__(self, dataset: str, plans: list[_DomainPlan], spec: dict, seed: int):
        self.dataset = dataset
        self._plans = plans
        self._starts = np.array([p.first for p in plans], np.int64)
        self.num_clients = int(sum(p.n for p in plans))
        self.domains = tuple(p.domain for p in plans)
        self.spec = dict(spec)
        self.seed = int(seed)

    def __len__(self) -> int:
        return self.num_clients

    def _locate(self, cid) -> tuple[_DomainPlan, int]:
        cid = int(cid)
        if not 0 <= cid < self.num_clients:
            raise IndexError(f"client id {cid} outside 0..{self.num_clients - 1}")
        k = int(np.searchsorted(self._starts, cid, side="right") - 1)
        plan = self._plans[k]
        return plan, cid - plan.first

    def domain(self, cid: int) -> str:
        return self._locate(cid)[0].domain

    def shard(self, cid: int) -> ClientShard:
        plan, j = self._locate(cid)
        arrays = {s: plan.plans[s].get(j) for s in SPLITS}
        return ClientShard(int(cid), plan.domain, arrays["train"], arrays["val"], arrays["test"], plan.test_split)

    def num_samples(self, cid: int, split: str = "train") -> int:
        if split not in SPLITS:
            raise UserError(f"split {split!r} is not one of {', '.join(SPLITS)}")
        plan, j = self._locate(cid)
        return plan.plans[split].count(j)

    def all_num_samples(self, split: str = "train") -> np.ndarray:
        """Sample counts of every client, vectorised (e.g. FedAvg weights for 100k clients)."""
        if split not in SPLITS:
            raise UserError(f"split {split!r} is not one of {', '.join(SPLITS)}")
        return np.concatenate([p.plans[split].counts() for p in self._plans]) if self._plans else _EMPTY

    def clients(self, domain: str) -> range:
        for p in self._plans:
            if p.domain == domain:
                return range(p.first, p.first + p.n)
        raise UserError(f"no clients of domain {domain!r}; this partition has {', '.join(self.domains)}")

    def __iter__(self) -> Iterator[ClientShard]:
        return (self.shard(c) for c in range(self.num_clients))

    def describe(self) -> str:
        rows = [f"{'domain':<14}{'clients':>9}{'train/client (min..max)':>26}{'val':>8}{'test':>8}"]
        for p in self._plans:
            c = p.plans["train"].counts()
            rows.append(f"{p.domain:<14}{p.n:>9}{f'{c.min()}..{c.max()}' if c.size else '-':>26}"
                        f"{int(p.plans['val'].counts().sum()):>8}{int(p.plans['test'].counts().sum()):>8}")
        return "\n".join(rows)

    def __repr__(self) -> str:
        return (f"Partition({self.dataset!r}, kind={self.spec.get('kind')!r}, clients={self.num_clients}, "
                f"domains={self.domains}, seed={self.seed})")


# ---------------------------------------------------------------- spec handling


def _domains(ds, spec: dict) -> list[str]:
    doms = spec.get("domains")
    if doms is None:
        return list(ds.domains)
    if isinstance(doms, str):
        doms = [doms]
    doms = list(doms)
    for d in doms:
        if d not in ds.domains:
            raise UserError(f"partition: unknown domain {d!r}; {ds.name} has {', '.join(ds.domains)}")
    if len(set(doms)) != len(doms):
        raise UserError(f"partition: domains {doms} lists a domain twice")
    if not doms:
        raise UserError("partition: domains is empty")
    return doms


def _is_int(v, lo: int) -> bool:
    try:
        return not isinstance(v, bool) and float(v).is_integer() and int(v) >= lo
    except (TypeError, ValueError):
        return False


def _int(spec: dict, key: str, lo: int, default=None) -> int:
    v = spec.get(key, default)
    if v is None:
        raise UserError(f"partition: {spec.get('kind')} needs {key}")
    if not _is_int(v, lo):
        raise UserError(f"partition: {key}={v!r}: expected an integer >= {lo}")
    return int(v)


def _per_domain_counts(spec: dict, doms: list[str], key: str = "clients_per_domain") -> dict[str, int]:
    v = spec.get(key, 1)
    if isinstance(v, dict):
        extra = set(v) - set(doms)
        if extra:
            raise UserError(f"partition: {key} names domains not in the partition: {sorted(extra)}")
        counts = {d: v.get(d, 0) for d in doms}
    elif isinstance(v, (list, tuple)):
        if len(v) != len(doms):
            raise UserError(f"partition: {key} has {len(v)} entries for {len(doms)} domains")
        counts = dict(zip(doms, v))
    else:
        counts = {d: v for d in doms}
    for d, k in counts.items():
        if not _is_int(k, 0):
            raise UserError(f"partition: {key} for {d!r} = {k!r}: expected an integer >= 0")
    counts = {d: int(k) for d, k in counts.items()}
    if not any(counts.values()):
        raise UserError(f"partition: {key} gives no clients")
    return counts


def _val_test_plans(ds, domain: str, train_counts: np.ndarray, pool: int, shared: bool, seed: int) -> dict:
    """Full val/test per client, or disjoint slices proportional to each client's train share."""
    n = train_counts.size
    out = {}
    for s in ("val", "test"):
        m = len(ds.split(domain, s))
        if shared:
            out[s] = _Full(m, n)
            continue
        order = _rng(seed, f"partition/{s}", domain).permutation(m)
        total = float(max(float(train_counts.sum()), pool, 1))  # shares of the domain; never more than all of it
        if n and train_counts.min() == train_counts.max():
            out[s] = _Slices(order, _EqualShareBounds(n, int(train_counts[0]), total, m))
            continue
        cum = np.concatenate([[0], np.cumsum(train_counts, dtype=np.float64)]) / total
        out[s] = _Slices(order, np.floor(cum * m + 1e-9).astype(np.int64))
    return out


def _order(n: int, shuffle: bool, seed: int, domain: str) -> np.ndarray:
    return _rng(seed, "partition/train", domain).permutation(n) if shuffle else np.arange(n, dtype=np.int64)


def _assign_random(ds, spec, doms, seed) -> dict[str, int]:
    """DapperFL's client -> domain draw (see module docstring)."""
    n = _int(spec, "num_clients", len(doms))
    frac, size = spec.get("fraction"), spec.get("train_size")
    rng = _rng(seed, "partition/assign")
    for _ in range(1000):
        extra = rng.integers(0, len(doms), n - len(doms))
        counts = {d: 1 + int((extra == i).sum()) for i, d in enumerate(doms)}
        ok = True
        for d, k in counts.items():
            pool = len(ds.split(d, "train"))
            need = k * (int(frac * pool) if frac is not None else size if size is not None else 1)
            ok &= need <= pool
        if ok:
            return counts
    raise UserError(f"partition: cannot place {n} clients over {len(doms)} domains without a domain running out of data")


def _plan_per_domain(ds, spec, doms, seed, shared_default) -> list[_DomainPlan]:
    if spec.get("assign") not in (None, "random"):
        raise UserError(f"partition: assign={spec['assign']!r}: expected 'random'")
    if spec.get("assign") == "random":
        counts = _assign_random(ds, spec, doms, seed)
    elif "num_clients" in spec:
        raise UserError("partition: per_domain takes num_clients only with assign: random")
    else:
        counts = _per_domain_counts(spec, doms)
    frac, size = spec.get("fraction"), spec.get("train_size")
    if frac is not None and size is not None:
        raise UserError("partition: give fraction or train_size, not both")
    if frac is not None and not (isinstance(frac, (int, float)) and 0 < frac <= 1):
        raise UserError(f"partition: fraction={frac!r}: expected 0 < f <= 1")
    if size is not None:
        size = _int(spec, "train_size", 1)
    shuffle = bool(spec.get("shuffle", True))
    shared = spec.get("shared_test", shared_default(counts))
    plans, first = [], 0
    for d in doms:
        k = counts[d]
        if k == 0:
            continue
        pool = len(ds.split(d, "train"))
        if frac is not None or size is not None:
            per = int(frac * pool) if frac is not None else size
            if per < 1:
                raise UserError(f"partition: fraction={frac} of {d!r}'s {pool} train images is < 1 image")
            if k * per > pool:
                raise UserError(f"partition: {k} clients x {per} train images exceed domain {d!r}'s "
                                f"{pool} train images")
            bounds = np.arange(k + 1, dtype=np.int64) * per
        else:
            if k > pool:
                raise UserError(f"partition: {k} clients exceed domain {d!r}'s {pool} train images")
            bounds = (np.arange(k + 1, dtype=np.int64) * pool) // k
        train = _Slices(_order(pool, shuffle, seed, d), bounds)
        plans.append(_DomainPlan(d, first, k, {"train": train,
                                               **_val_test_plans(ds, d, train.counts(), pool, shared, seed)}))
        first += k
    return plans


def _dirichlet_lists(labels: np.ndarray, k: int, alpha: float, min_size: int, balance: bool,
                     max_tries: int, rng: np.random.Generator, domain: str) -> list[np.ndarray]:
    n = labels.size
    if k * min_size > n:
        raise UserError(f"partition: {k} clients x min_size {min_size} exceed domain {domain!r}'s {n} train images")
    classes = np.unique(labels)
    by_class = [np.flatnonzero(labels == c) for c in classes]
    for _ in range(max_tries):
        parts = [[] for _ in range(k)]
        sizes = np.zeros(k, np.int64)
        for pos in by_class:
            pos = pos[rng.permutation(pos.size)]
            p = rng.dirichlet(np.full(k, alpha))
            if balance:
                q = p * (sizes < n / k)
                p = q if q.sum() > 0 else p
            p = p / p.sum()
            cuts = (np.cumsum(p) * pos.size).astype(np.int64)[:-1]
            for j, chunk in enumerate(np.split(pos, cuts)):
                parts[j].append(chunk)
                sizes[j] += chunk.size
        if sizes.min() >= min_size:
            return [np.sort(np.concatenate(c)).astype(np.int64) for c in parts]
    raise UserError(f"partition: dirichlet alpha={alpha} could not give all {k} clients of {domain!r} "
                    f"min_size={min_size} samples in {max_tries} draws; lower min_size or raise alpha")


def _plan_dirichlet(ds, spec, doms, seed, shared_default) -> list[_DomainPlan]:
    counts = _per_domain_counts(spec, doms)
    alpha = spec.get("alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise UserError(f"partition: dirichlet needs alpha > 0, got {alpha!r}")
    min_size = _int(spec, "min_size", 0, 10)
    max_tries = _int(spec, "max_tries", 1, 1000)
    balance = bool(spec.get("balance", True))
    shared = spec.get("shared_test", shared_default(counts))
    plans, first = [], 0
    for d in doms:
        k = counts[d]
        if k == 0:
            continue
        labels = ds.split(d, "train").labels
        lists = _dirichlet_lists(labels, k, float(alpha), min_size, balance, max_tries,
                                 _rng(seed, "partition/dirichlet", d), d)
        train = _Lists(lists)
        plans.append(_DomainPlan(d, first, k, {"train": train,
                                               **_val_test_plans(ds, d, train.counts(), labels.size, shared, seed)}))
        first += k
    return plans


def _plan_cross_device(ds, spec, doms, seed, shared_default) -> list[_DomainPlan]:
    n = _int(spec, "num_clients", len(doms))
    pools = np.array([len(ds.split(d, "train")) for d in doms], np.int64)
    spread = spec.get("spread", "even")
    if spread in ("even", "round_robin"):  # round-robin dealing gives the same counts
        per = np.full(len(doms), n // len(doms), np.int64)
        per[: n % len(doms)] += 1
    elif spread == "proportional":
        raw = n * pools / pools.sum()
        per = np.maximum(np.floor(raw).astype(np.int64), 1)
        while per.sum() > n:
            per[np.argmax(per)] -= 1
        rem = raw - np.floor(raw)
        for i in np.argsort(-rem, kind="stable")[: n - per.sum()]:
            per[i] += 1
    else:
        raise UserError(f"partition: spread={spread!r}: expected 'even' (= 'round_robin') or 'proportional'")
    s = spec.get("samples_per_client")
    if s is not None:
        s = _int(spec, "samples_per_client", 1)
    overlap = bool(spec.get("overlap", False))
    shuffle = bool(spec.get("shuffle", True))
    shared = spec.get("shared_test", shared_default(dict(zip(doms, per))))
    plans, first = [], 0
    for d, k, pool in zip(doms, per, pools):
        k, pool = int(k), int(pool)
        if k == 0:
            continue
        if s is None and k > pool:
            raise UserError(f"partition: {k} clients on domain {d!r} leave < 1 of its {pool} train images "
                            "each; set samples_per_client and overlap: true")
        if s is not None and s > pool:
            raise UserError(f"partition: samples_per_client={s} exceeds domain {d!r}'s {pool} train images")
        if s is not None and k * s > pool:
            if not overlap:
                raise UserError(f"partition: {k} clients x {s} samples exceed domain {d!r}'s {pool} train "
                                "images; set overlap: true to let clients' draws overlap")
            train = _Draws(pool, s, k, seed, d)
        else:
            bounds = (np.arange(k + 1, dtype=np.int64) * s if s is not None
                      else (np.arange(k + 1, dtype=np.int64) * pool) // k)
            train = _Slices(_order(pool, shuffle, seed, d), bounds)
        counts = train.counts()
        plans.append(_DomainPlan(d, first, k, {"train": train, **_val_test_plans(ds, d, counts, pool, shared, seed)}))
        first += k
    return plans


def make_partition(ds, spec: dict | None, seed: int) -> Partition:
    """The partition ``spec`` describes (see the module docstring), for ``seed``."""
    spec = dict(spec or {"kind": "per_domain"})
    kind = spec.setdefault("kind", "per_domain")
    if kind not in KINDS:
        raise UserError(f"partition: kind={kind!r} is not known; valid: {', '.join(KINDS)}")
    unknown = set(spec) - _KEYS[kind]
    if unknown:
        raise UserError(f"partition: unknown key(s) {sorted(unknown)} for kind {kind}; valid: {sorted(_KEYS[kind])}")
    for key in ("shared_test", "num_clients"):  # null: not given, as in the typed spec (partition_spec)
        if key in spec and spec[key] is None:
            del spec[key]
    if "shared_test" in spec and not isinstance(spec["shared_test"], bool):
        raise UserError(f"partition: shared_test={spec['shared_test']!r}: expected true or false")
    doms = _domains(ds, spec)

    def shared_default(counts) -> bool:
        return all(int(k) <= 1 for k in dict(counts).values())

    builder = {"per_domain": _plan_per_domain, "dirichlet": _plan_dirichlet, "cross_device": _plan_cross_device}[kind]
    plans = builder(ds, spec, doms, int(seed), shared_default)
    return Partition(ds.name, plans, spec, seed)


def leave_one_domain_out(ds, holdout: str, spec: dict | None = None, seed: int = 0,
                         target_test: str = ALL) -> tuple[Partition, Partition]:
    """(source, target): ``spec`` over every domain but ``holdout``; one target client.

    The target client holds 100% of the held-out domain: all of its train and val
    positions, and as test set the whole domain (``target_test='all'``, the DG protocol of
    gPerXAN/CSAC) or only its test split (``target_test='test'``: CSAC's VLCS, FDSE).
    """
    if holdout not in ds.domains:
        raise UserError(f"leave_one_domain_out: unknown domain {holdout!r}; {ds.name} has {', '.join(ds.domains)}")
    if target_test not in (ALL, "test"):
        raise UserError(f"leave_one_domain_out: target_test={target_test!r}: expected 'all' or 'test'")
    spec = dict(spec or {"kind": "per_domain"})
    doms = [d for d in _domains(ds, spec) if d != holdout]
    if not doms:
        raise UserError(f"leave_one_domain_out: no source domains left after holding out {holdout!r}")
    source = make_partition(ds, {**spec, "domains": doms}, seed)
    plans = {s: _Full(len(ds.split(holdout, s)), 1) for s in ("train", "val")}
    plans["test"] = _Full(len(ds.split(holdout, target_test)), 1)
    target = Partition(ds.name, [_DomainPlan(holdout, 0, 1, plans, target_test)],
                       {"kind": "target", "holdout": holdout, "target_test": target_test}, seed)
    return source, target
