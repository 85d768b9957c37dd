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
share; natural: false, each client its own group's), ``shuffle`` (default true; false takes
consecutive slices of the split's own order, e.g. FedBN's ``train_part0`` = the first 743
images; no effect on dirichlet, natural, shard or pathological).

* ``per_domain``: ``clients_per_domain`` (int, list or {domain: k}; default 1) splits each
  domain's train set disjointly; ``fraction: f`` gives each client int(f * n_train)
  (DapperFL: 1% or 20%), ``train_size: n`` exactly n (FedBN/FedWon: 743); ``num_clients: N,
  assign: random`` draws domains as DapperFL's code does (the last D clients cover every
  domain once, the others pick uniformly, redrawn if a domain runs out of data).
* ``dirichlet``: label skew within each domain: ``clients_per_domain``, ``alpha``,
  ``min_size`` (default 10, redraw until every client has it), ``balance`` (default true:
  a client already above the average size gets no more of a class, as EasyFL/FedLab do).
  Giving Flower Datasets' ``min_partition_size`` (default 10) or ``self_balancing`` (default
  false) instead selects its DirichletPartitioner's draw exactly (no per-class shuffle before
  the cut; a partition strictly above the average is the one held back). The two families of
  keys do not mix, so an existing config (EasyFL's keys or neither) keeps its numbers: that is
  why flwr's names select flwr's algorithm rather than rename raysim's.
* ``cross_device``: ``num_clients`` spread ``even`` (default; the counts round-robin dealing
  gives, ids still grouped by domain) or ``proportional`` (to the domains' train sizes); ``samples_per_client`` (default: an even share of the pool);
  ``overlap: true`` lets clients draw independently (without replacement within a client)
  when clients x samples exceed the pool.
* ``natural``: the data as it was produced: ``by: group`` (the only choice so far) makes one client
  per group id (``Split.groups``: a writer, a user) of each domain's train split, ascending; its
  val/test are that group's positions in the domain's val/test (so with a per-group carve a
  client is tested on its own held-out data, even a domain's only client), or with
  ``shared_test: true`` the domain's whole val/test. ``min_samples`` (default 1) drops groups
  with fewer training samples, said in ``Partition.notes`` (as are val/test samples of groups
  no client has). Built from one stable argsort per split and searchsorted group runs, so
  100,000 groups cost a few arrays.
* ``shard``: Flower Datasets' ShardPartitioner within each domain's train split:
  ``num_shards_per_partition`` and/or ``shard_size``, ``keep_incomplete_shard`` (default false).
* ``pathological``: Flower Datasets' PathologicalPartitioner within each domain's train split:
  ``num_classes_per_partition``, ``class_assignment_mode`` (``random`` (default),
  ``deterministic``, ``first-deterministic``); a class no client is given is said in ``notes``.

Flower Datasets' names map onto raysim's: ``num_partitions`` is ``clients_per_domain`` (each
kind applies within each domain; a single-domain dataset is flwr's case), ``partition_by`` may
only be ``label``, ``seed`` is the run's seed (each domain draws from its own generator keyed by
(seed, kind, domain)), and ``shuffle`` is raysim's common key: flwr's only reorders samples
inside a partition, so it changes no client's samples. Val/test of these kinds are dealt as
dirichlet's are. The algorithms are pure functions of (labels, parameters, a numpy Generator):
``flwr_dirichlet_partitions``, ``shard_partitions``, ``pathological_partitions`` and
``iid_partitions`` (IidPartitioner: consecutive blocks, no kind of its own since ``per_domain``
with ``shuffle: false`` is the same up to where the longer blocks fall); handed
``np.random.default_rng(seed)`` they reproduce flwr-datasets with ``seed=seed`` exactly
(tests/data/test_data_partition_flwr.py, against partitions flwr-datasets 0.6.1 wrote).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from raysim.data.splits import ALL, SPLITS
from raysim.core.errors import UserError
from raysim.core.partition_spec import CLASS_ASSIGNMENT_MODES, HOLDOUT_KEYS, KINDS, keys

# the keys a spec given to make_partition may hold: its kind's, less the held-out domain's (taken
# off the config's partition before the federation builds it; see leave_one_domain_out)
_KEYS = {kind: keys(kind) - HOLDOUT_KEYS for kind in KINDS}
# keys whose null means "not given" (their typed spec's default is null)
_NULL_IS_UNSET = ("shared_test", "num_clients", "min_size", "balance", "min_partition_size", "self_balancing",
                  "num_shards_per_partition", "shard_size", "num_classes_per_partition")


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


class _Ranges:
    """Client j gets ``order[lo[j]:hi[j]]``: one group's run of a group-sorted order (a stable
    argsort, so each run is already ascending); the runs of dropped or absent groups are skipped."""

    def __init__(self, order: np.ndarray, lo: np.ndarray, hi: np.ndarray):
        self.order, self.lo, self.hi = order, lo, hi

    def get(self, j: int) -> np.ndarray:
        return self.order[self.lo[j]:self.hi[j]]

    def count(self, j: int) -> int:
        return int(self.hi[j] - self.lo[j])

    def counts(self) -> np.ndarray:
        return self.hi - self.lo


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

    def __init__(self, dataset: str, plans: list[_DomainPlan], spec: dict, seed: int,
                 notes: list[str] | None = None):
        self.dataset = dataset
        # what building it left out or changed, one line each (e.g. the groups a natural partition
        # dropped), for the run to print at its start
        self.notes = list(notes or [])
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
        return "\n".join(rows + self.notes)

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


def _plan_per_domain(ds, spec, doms, seed, shared_default, notes) -> list[_DomainPlan]:
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


def _deal(pos: np.ndarray, p: np.ndarray, parts: list[list], sizes: np.ndarray) -> None:
    """Cut one class's positions ``pos`` at the cumulative shares ``p``: piece j to partition j."""
    cuts = (np.cumsum(p) * pos.size).astype(np.int64)[:-1]
    for j, chunk in enumerate(np.split(pos, cuts)):
        parts[j].append(chunk)
        sizes[j] += chunk.size


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
            _deal(pos, p, parts, sizes)
        if sizes.min() >= min_size:
            return [np.sort(np.concatenate(c)).astype(np.int64) for c in parts]
    raise UserError(f"partition: dirichlet alpha={alpha} could not give all {k} clients of {domain!r} "
                    f"min_size={min_size} samples in {max_tries} draws; lower min_size or raise alpha")


def _partition_by(spec: dict) -> str:
    v = spec.get("partition_by", "label")
    if v != "label":
        raise UserError(f"partition: partition_by={v!r}: raysim partitions by 'label' only (its splits "
                        "carry no other per-sample column)")
    return v


def _plan_lists(ds, doms, counts: dict[str, int], shared: bool, seed: int, lists_of) -> list[_DomainPlan]:
    """One domain plan per domain with clients: ``lists_of(labels, k, domain)`` gives the train
    positions of its k clients; val/test as ``_val_test_plans`` deals them."""
    plans, first = [], 0
    for d in doms:
        k = counts[d]
        if k == 0:
            continue
        labels = ds.split(d, "train").labels
        train = _Lists(lists_of(labels, k, d))
        plans.append(_DomainPlan(d, first, k, {"train": train,
                                               **_val_test_plans(ds, d, train.counts(), labels.size, shared, seed)}))
        first += k
    return plans


def _plan_dirichlet(ds, spec, doms, seed, shared_default, notes) -> list[_DomainPlan]:
    counts = _per_domain_counts(spec, doms)
    alpha = spec.get("alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise UserError(f"partition: dirichlet needs alpha > 0, got {alpha!r}")
    _partition_by(spec)
    easyfl = [k for k in ("min_size", "balance") if k in spec]
    flwr = [k for k in ("min_partition_size", "self_balancing") if k in spec]
    if easyfl and flwr:
        raise UserError(f"partition: {', '.join(easyfl)} (EasyFL/FedLab's draw) and {', '.join(flwr)} "
                        "(Flower Datasets' draw) do not mix; give one family")
    max_tries = _int(spec, "max_tries", 1, 1000)
    shared = spec.get("shared_test", shared_default(counts))
    if flwr:
        min_partition_size = _int(spec, "min_partition_size", 0, 10)
        self_balancing = _bool(spec, "self_balancing", False)
        return _plan_lists(ds, doms, counts, shared, seed, lambda labels, k, d: flwr_dirichlet_partitions(
            labels, k, alpha=float(alpha), min_partition_size=min_partition_size, self_balancing=self_balancing,
            rng=_rng(seed, "partition/flwr_dirichlet", d), max_tries=max_tries, where=f"domain {d!r}"))
    min_size = _int(spec, "min_size", 0, 10)
    balance = bool(spec.get("balance", True))
    return _plan_lists(ds, doms, counts, shared, seed, lambda labels, k, d: _dirichlet_lists(
        labels, k, float(alpha), min_size, balance, max_tries, _rng(seed, "partition/dirichlet", d), d))


def _bool(spec: dict, key: str, default: bool) -> bool:
    v = spec.get(key, default)
    if not isinstance(v, bool):
        raise UserError(f"partition: {key}={v!r}: expected true or false")
    return v


# ---------------------------------------------------------------- Flower Datasets' partitioners
#
# Each is a pure function of (labels, parameters, numpy Generator) returning one sorted array of
# positions per partition. Handed ``np.random.default_rng(seed)`` it makes the partitions
# flwr-datasets makes with ``seed=seed`` (tests/data/test_data_partition_flwr.py holds them to
# partitions flwr-datasets wrote); a config's partition hands it raysim's generator keyed by (run
# seed, kind, domain) instead. flwr's ``shuffle`` only reorders the samples inside a partition after
# they were chosen, so it changes no partition's samples and is no parameter here.


def _check_partitions(k: int, n: int, where: str) -> None:
    if not _is_int(k, 1):
        raise UserError(f"partition: {k!r} clients: expected an integer >= 1")
    if k > n:
        raise UserError(f"partition: {k} clients exceed {where}'s {n} train images")


def iid_partitions(n: int, num_partitions: int) -> list[np.ndarray]:
    """Flower Datasets' IidPartitioner: consecutive blocks of the split's own order, the first
    ``n % num_partitions`` one longer (Hugging Face's ``Dataset.shard(contiguous=True)``); no
    randomness. (``per_domain`` with ``shuffle: false`` deals the longer blocks spread out instead.)"""
    if not _is_int(num_partitions, 1):
        raise UserError(f"partition: {num_partitions!r} clients: expected an integer >= 1")
    j = np.arange(num_partitions + 1, dtype=np.int64)
    div, mod = divmod(int(n), int(num_partitions))
    starts = div * j + np.minimum(j, mod)
    return [np.arange(starts[i], starts[i + 1], dtype=np.int64) for i in range(num_partitions)]


def _class_runs(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(classes ascending, positions sorted by class — ascending within a class —, run bounds)."""
    order = np.argsort(labels, kind="stable")
    classes, starts = np.unique(labels[order], return_index=True)
    return classes, order, np.append(starts, labels.size)


def flwr_dirichlet_partitions(labels, num_partitions: int, *, alpha: float, min_partition_size: int = 10,
                              self_balancing: bool = False, rng: np.random.Generator, max_tries: int = 1000,
                              where: str = "the split") -> list[np.ndarray]:
    """Flower Datasets' DirichletPartitioner: for each class in ascending order, one Dirichlet(alpha)
    draw of the partitions' shares, its samples cut in their own order at the cumulative shares;
    ``self_balancing`` first zeroes the share of a partition already above the average size;
    redrawn whole until every partition has ``min_partition_size`` (flwr gives up after 11 draws,
    this after ``max_tries``: the same partitions whenever flwr finds one)."""
    labels = np.asarray(labels).reshape(-1)
    n, k = labels.size, num_partitions
    _check_partitions(k, n, where)
    if k * min_partition_size > n:
        raise UserError(f"partition: {k} clients x min_partition_size {min_partition_size} exceed {where}'s "
                        f"{n} train images")
    classes, order, bounds = _class_runs(labels)
    alphas = np.full(k, float(alpha))
    average = n / k
    for _ in range(max_tries):
        parts = [[] for _ in range(k)]
        sizes = np.zeros(k, np.int64)
        for c in range(classes.size):
            pos = order[bounds[c]:bounds[c + 1]]
            p = rng.dirichlet(alphas)
            if self_balancing:  # never all zero: not every partition can be above the average
                p = np.where(sizes > average, 0.0, p)
                p = p / np.cumsum(p)[-1]  # summed left to right, as flwr's sum() does (not pairwise)
            _deal(pos, p, parts, sizes)
        if sizes.min() >= min_partition_size:
            return [np.sort(np.concatenate(c)).astype(np.int64) for c in parts]
    raise UserError(f"partition: dirichlet alpha={alpha} could not give all {k} clients of {where} "
                    f"min_partition_size={min_partition_size} samples in {max_tries} draws; lower "
                    "min_partition_size or raise alpha")


def shard_partitions(labels, num_partitions: int, *, num_shards_per_partition: int | None = None,
                     shard_size: int | None = None, keep_incomplete_shard: bool = False,
                     rng: np.random.Generator, where: str = "the split") -> list[np.ndarray]:
    """Flower Datasets' ShardPartitioner: the split sorted by label (stably) and cut into shards of
    ``shard_size`` (default: as many samples as fill ``num_partitions x num_shards_per_partition``
    shards); a random permutation of the shards deals ``num_shards_per_partition`` to each partition
    (default: every shard, dealt evenly, the first partitions one more). ``keep_incomplete_shard``
    counts the short last shard as one that may be dealt."""
    labels = np.asarray(labels).reshape(-1)
    n, k = labels.size, num_partitions
    _check_partitions(k, n, where)
    per_client, size, keep = num_shards_per_partition, shard_size, bool(keep_incomplete_shard)
    if per_client is not None:
        used = k * per_client
        per = np.full(k, per_client, np.int64)
        if size is None:
            size = n // used
            if size == 0:
                raise UserError(f"partition: shard: {k} clients x {per_client} shards need at least {used} "
                                f"train images; {where} has {n}")
            usable = -(-n // size) if keep else n // size
        else:
            if size * used > n:
                raise UserError(f"partition: shard: {k} clients x {per_client} shards of {size} need {size * used} "
                                f"train images; {where} has {n}")
            usable = n // size
    elif size is None:
        raise UserError("partition: shard needs num_shards_per_partition, shard_size or both")
    else:
        used = usable = -(-n // size) if keep else n // size
        per = np.full(k, used // k, np.int64)
        per[:used - k * (used // k)] += 1
    if usable < k:
        raise UserError(f"partition: shard: {where}'s {n} train images make {usable} shards of {size}, "
                        f"fewer than the {k} clients; lower shard_size")
    dealt = np.split(rng.permutation(usable)[:used], np.cumsum(per)[:-1])
    _, by_label, _ = _class_runs(labels)
    out = []
    for shards in dealt:
        pieces = [by_label[s * size:min((s + 1) * size, n)] for s in shards.tolist()]
        out.append(np.sort(np.concatenate(pieces)).astype(np.int64) if pieces else _EMPTY)
    return out


def pathological_partitions(labels, num_partitions: int, *, num_classes_per_partition: int,
                            class_assignment_mode: str = "random", rng: np.random.Generator,
                            where: str = "the split") -> list[np.ndarray]:
    """Flower Datasets' PathologicalPartitioner: each partition is given ``num_classes_per_partition``
    of the classes present (``random``: drawn without replacement per partition; ``deterministic``:
    partition j the classes j, j+1, ... mod C; ``first-deterministic``: class j mod C, then draws
    with replacement until it has enough distinct ones); each class's samples, in their own order,
    are split evenly (``np.array_split``) between the partitions given it, in partition order. A
    class given to no partition is left out."""
    labels = np.asarray(labels).reshape(-1)
    n, k, m = labels.size, num_partitions, num_classes_per_partition
    _check_partitions(k, n, where)
    classes, order, bounds = _class_runs(labels)
    C = classes.size
    if not _is_int(m, 1) or m > C:
        raise UserError(f"partition: num_classes_per_partition={m!r}: expected 1..{C}, the classes in {where}")
    if class_assignment_mode == "random":
        chosen = [rng.choice(C, size=m, replace=False).tolist() for _ in range(k)]
    elif class_assignment_mode == "deterministic":
        chosen = [[(j + i) % C for i in range(m)] for j in range(k)]
    elif class_assignment_mode == "first-deterministic":
        chosen = []
        for j in range(k):
            mine = [j % C]
            while len(mine) < m:
                c = int(rng.choice(C, size=1)[0])
                if c not in mine:
                    mine.append(c)
            chosen.append(mine)
    else:
        raise UserError(f"partition: class_assignment_mode={class_assignment_mode!r}: expected one of "
                        f"{', '.join(CLASS_ASSIGNMENT_MODES)}")
    holders = [[] for _ in range(C)]
    for j, mine in enumerate(chosen):
        for c in mine:
            holders[c].append(j)
    parts = [[] for _ in range(k)]
    for c in range(C):
        if not holders[c]:
            continue
        pos = order[bounds[c]:bounds[c + 1]]
        if len(holders[c]) > pos.size:
            raise UserError(f"partition: pathological: class {classes[c]} of {where} goes to {len(holders[c])} "
                            f"clients but has {pos.size} train images; lower clients_per_domain or "
                            "num_classes_per_partition, or use class_assignment_mode: deterministic")
        for j, chunk in zip(holders[c], np.array_split(pos, len(holders[c]))):
            parts[j].append(chunk)
    return [np.sort(np.concatenate(p)).astype(np.int64) if p else _EMPTY for p in parts]


def _plan_shard(ds, spec, doms, seed, shared_default, notes) -> list[_DomainPlan]:
    counts = _per_domain_counts(spec, doms)
    _partition_by(spec)
    per_client = _int(spec, "num_shards_per_partition", 1) if spec.get("num_shards_per_partition") is not None else None
    size = _int(spec, "shard_size", 1) if spec.get("shard_size") is not None else None
    if per_client is None and size is None:
        raise UserError("partition: shard needs num_shards_per_partition, shard_size or both")
    keep = _bool(spec, "keep_incomplete_shard", False)
    shared = spec.get("shared_test", shared_default(counts))
    return _plan_lists(ds, doms, counts, shared, seed, lambda labels, k, d: shard_partitions(
        labels, k, num_shards_per_partition=per_client, shard_size=size, keep_incomplete_shard=keep,
        rng=_rng(seed, "partition/shard", d), where=f"domain {d!r}"))


def _plan_pathological(ds, spec, doms, seed, shared_default, notes) -> list[_DomainPlan]:
    counts = _per_domain_counts(spec, doms)
    _partition_by(spec)
    m = _int(spec, "num_classes_per_partition", 1)
    mode = spec.get("class_assignment_mode", "random")
    shared = spec.get("shared_test", shared_default(counts))

    def lists_of(labels, k, d):
        lists = pathological_partitions(labels, k, num_classes_per_partition=m, class_assignment_mode=mode,
                                        rng=_rng(seed, "partition/pathological", d), where=f"domain {d!r}")
        held = np.zeros(labels.size, bool)
        for x in lists:
            held[x] = True
        if not held.all():
            left = np.unique(labels[~held])
            notes.append(f"pathological partition: classes {left.tolist()} of domain {d!r} go to no client "
                         f"({int((~held).sum()):,} train samples unused)")
        return lists

    return _plan_lists(ds, doms, counts, shared, seed, lists_of)


def _plan_natural(ds, spec, doms, seed, shared_default, notes) -> list[_DomainPlan]:
    """One client per group id of each domain's train split, ascending; its val/test the same
    group's positions (or, with shared_test, the domain's whole val/test)."""
    by = spec.get("by", "group")
    if by != "group":
        raise UserError(f"partition: natural by={by!r}: only 'group' (the per-sample group ids: a writer, a user) "
                        "is supported for now")
    min_samples = _int(spec, "min_samples", 1, 1)
    kept = {}
    for d in doms:
        groups = ds.split(d, "train").groups
        if groups is None:
            raise UserError(f"partition: natural needs per-sample group ids (who produced each sample: a writer, "
                            f"a user), and dataset {ds.name!r} has none (domain {d!r}'s train split)")
        order = np.argsort(groups, kind="stable")
        ids, lo = np.unique(groups[order], return_index=True)
        hi = np.append(lo[1:], groups.size).astype(np.int64)
        keep = (hi - lo) >= min_samples
        if not keep.all():
            n_drop = int((~keep).sum())
            notes.append(f"natural partition: dropped {n_drop:,} of {ids.size:,} groups "
                         f"({int((hi - lo)[~keep].sum()):,} training samples) with fewer than {min_samples} "
                         f"training samples in domain {d!r}")
        if not keep.any():
            notes.append(f"natural partition: domain {d!r} has no group with {min_samples} training samples; "
                         "it has no clients")
        kept[d] = (order, ids[keep], lo[keep].astype(np.int64), hi[keep])
    counts = {d: int(v[1].size) for d, v in kept.items()}
    if not any(counts.values()):
        raise UserError(f"partition: natural with min_samples={min_samples} leaves no client: no group of "
                        f"{ds.name!r} has that many training samples")
    shared = spec.get("shared_test", False)  # even a domain's only client: its own group's val/test
    plans, first = [], 0
    for d, (order, ids, lo, hi) in kept.items():
        k = ids.size
        if k == 0:
            continue
        split_plans = {"train": _Ranges(order, lo, hi)}
        outside = []
        for s in ("val", "test"):
            split = ds.split(d, s)
            if shared:
                split_plans[s] = _Full(len(split), k)
                continue
            if split.groups is None:
                raise UserError(f"partition: natural gives each client its own group's {s} samples, but domain "
                                f"{d!r}'s {s} split of {ds.name!r} has no group ids; set shared_test: true")
            s_order = np.argsort(split.groups, kind="stable")
            sorted_ids = split.groups[s_order]
            plan = _Ranges(s_order, np.searchsorted(sorted_ids, ids, "left").astype(np.int64),
                           np.searchsorted(sorted_ids, ids, "right").astype(np.int64))
            split_plans[s] = plan
            outside.append(len(split) - int(plan.counts().sum()))
        if any(outside):
            notes.append(f"natural partition: {outside[0]:,} val and {outside[1]:,} test samples of domain {d!r} "
                         "belong to no client's group")
        plans.append(_DomainPlan(d, first, k, split_plans))
        first += k
    return plans


def _plan_cross_device(ds, spec, doms, seed, shared_default, notes) -> list[_DomainPlan]:
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
    for key in _NULL_IS_UNSET:  # null: not given, as in the typed spec (partition_spec)
        if key in spec and spec[key] is None:
            del spec[key]
    if "shared_test" in spec and not isinstance(spec["shared_test"], bool):
        raise UserError(f"partition: shared_test={spec['shared_test']!r}: expected true or false")
    doms = _domains(ds, spec)

    def shared_default(counts) -> bool:
        return all(int(k) <= 1 for k in dict(counts).values())

    builder = {"per_domain": _plan_per_domain, "dirichlet": _plan_dirichlet, "cross_device": _plan_cross_device,
               "natural": _plan_natural, "shard": _plan_shard, "pathological": _plan_pathological}[kind]
    notes: list[str] = []
    plans = builder(ds, spec, doms, int(seed), shared_default, notes)
    return Partition(ds.name, plans, spec, seed, notes)


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
