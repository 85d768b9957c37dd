"""Every mistake a run can be refused for without training, found before Ray starts and before the
run folder is made: what ``raysim run --check`` checks, and what ``raysim run`` checks first.

A run otherwise meets these mistakes 20-90 s in, inside its actors, after Ray has started and the
run folder has been written. Here each is one line (a UserError: exit 2):

* the cluster (``--address``, ``runtime.address`` or ``RAY_ADDRESS``) answers as a Ray cluster
  (:func:`raysim.engine.cluster.probe_cluster`): seconds, not Ray's minutes of retries;
* the model is a known one;
* the dataset exists: a known loader and its options, and a real dataset's ``data.root`` in the
  layout its loader expects; ``data.shards``: the shards' manifest matches the config;
* the partition fits the data, for every federation of the run (method x seed x held-out domain),
  built as the federation builds it (:class:`raysim.engine.federation.Federation`) from the
  splits' sizes and labels alone;
* ``clients_per_round`` is at most the federation's clients (``fraction`` always gives one);
* where raysim starts its own Ray (no ``--address``, no ``RAY_ADDRESS``, no Ray running in this
  process), the hosts fit this machine's CPUs: the hosts a federation uses (``runtime.num_hosts``
  capped at its clients, :func:`raysim.engine.layout.host_layout`) x ``cpus_per_host`` +
  ``server_cpus`` <= ``os.cpu_count()``, the CPUs raysim gives its own Ray.

The data is read the way every federation reads it, once per dataset and seed: a real dataset's
loader lists its files and labels (no image is decoded), a generated benchmark is read from its
cache, or generated once into the cache that the run's actors then read instead of each generating
it. What only training can show (a model that does not fit the images, a loss that diverges) is
still found where it is now, as one line.
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field

from raysim.core.errors import UserError, first_line


@dataclass
class Checked:
    """What a passed preflight saw: per federation, its clients and, where raysim starts its own
    Ray, the CPUs it needs of the machine's."""
    federations: int = 0
    clients: list[int] = field(default_factory=list)
    cpus_needed: list[float] = field(default_factory=list)  # empty when joining a cluster
    cpus_here: int | None = None
    cluster: str | None = None  # the address that answered, when joining one

    def summary(self) -> str:
        """One line for ``raysim run --check`` (a YAML comment after the resolved config)."""
        low, high = min(self.clients), max(self.clients)
        parts = [f"{self.federations} federation{'s' if self.federations != 1 else ''}",
                 f"{low if low == high else f'{low}..{high}'} clients each"]
        if self.cluster:
            parts.append(f"the Ray cluster at {self.cluster} answers")
        elif self.cpus_needed:
            parts.append(f"at most {max(self.cpus_needed):g} of this machine's {self.cpus_here} CPUs")
        return "# checked without training: " + ", ".join(parts)


def preflight(cfg, address: str | None = None, own_ray: bool = True) -> Checked:
    """Check ``cfg`` as described in the module docstring; raise a one-line UserError for the
    first mistake. ``address``: the command's ``--address``; ``own_ray``: False when this process
    is connected to Ray already (a caller's ``ray.init``: its cluster is used as it is, and the
    run's placement checks its resources)."""
    from raysim.app.rundir import plan
    from raysim.models import registry as model_registry

    joining = address or cfg.runtime.address or os.environ.get("RAY_ADDRESS")
    checked = Checked()
    if own_ray and joining:
        from raysim.engine.cluster import probe_cluster
        probe_cluster(joining)
        checked.cluster = joining
    if own_ray and not joining:
        checked.cpus_here = os.cpu_count() or 1
    jobs = plan(cfg, "")  # with leave-one-domain-out, this reads the dataset's domains
    counted: dict[tuple, int] = {}
    for data_key, group in _by_dataset(jobs):
        # the dataset, read once when a federation's clients are not counted yet
        dataset = functools.cache(functools.partial(_load, group[0].data, group[0].seed))
        for one in group:
            label = _label(cfg, one)
            model_registry.builder(one.model.name)  # a known model (building it is left to the run)
            try:
                n = _num_clients(one, data_key, dataset, counted)
            except UserError as err:
                raise UserError(f"{label}{err}") from None
            _check_participation(one, n, label)
            _check_schedule(one, n, label)
            if checked.cpus_here is not None:
                checked.cpus_needed.append(_check_local_cpus(one, n, checked.cpus_here, label))
            checked.clients.append(n)
        dataset.cache_clear()  # one dataset in memory at a time
    checked.federations = len(jobs)
    return checked


# the clients of a partition of a generated dataset (no data.root): a function of the dataset's
# name, seed and options and of the partition alone, so this process counts each once (repeated
# checks, e.g. a notebook's or a test's runs, read no data again); a dataset on disk may change,
# and so may a dataset plugin's code
_GENERATED_COUNTS: dict[tuple, int] = {}


def _data_key(one) -> tuple | None:
    """What the dataset a federation loads depends on (None: it reads pre-written shards)."""
    d = one.data
    if d.shards:
        return None
    return d.dataset, d.root, one.seed, json.dumps(d.options, sort_keys=True, default=str)


def _by_dataset(jobs) -> list[tuple[tuple | None, list]]:
    """The federations' configs grouped by the dataset they load, in the order first met."""
    groups: dict = {}
    for one, _ in jobs:
        groups.setdefault(_data_key(one), []).append(one)
    return list(groups.items())


def _load(data, seed: int):
    """The dataset as a federation loads it. A loader that cannot take the options given (a
    ValueError or TypeError from them, e.g. ``image_size: big``) is the config's mistake."""
    from raysim.data import load

    try:
        return load(data.dataset, root=data.root, seed=seed, **data.options)
    except (TypeError, ValueError) as err:
        raise UserError(f"dataset {data.dataset!r} cannot be loaded with data.options = {data.options!r}"
                        f"{f' and data.root = {data.root!r}' if data.root else ''}: {first_line(err, with_type=True)}") \
            from None


def _num_clients(one, data_key, dataset, counted: dict) -> int:
    """The federation's training clients: its partition built from the sizes of ``dataset()``'s
    splits, or read from the shards' manifest; each distinct (dataset, partition, pooling) once."""
    from raysim.data import is_builtin
    from raysim.engine.federation import Federation

    pooled = Federation(one).pooled  # the method trains on every client's data as one (DeepAll)
    key = (data_key, json.dumps(one.data.partition, sort_keys=True, default=str), pooled, one.data.shards)
    generated = data_key is not None and data_key[1] is None and is_builtin(data_key[0])
    memo = _GENERATED_COUNTS if generated else counted
    if key not in memo:
        memo[key] = Federation(one, dataset=None if data_key is None else dataset()).num_clients
    return memo[key]


def _label(cfg, one) -> str:
    """Which federation a line is about, where they differ: a method with ``per_method`` settings,
    a seed, a held-out domain ('' where every federation would fail alike)."""
    from raysim.methods import registry

    parts = []
    if registry.name_of(one.method) in cfg.per_method:  # its own settings: the others' may pass
        parts.append(f"method {registry.name_of(one.method)}")
    if cfg.seeds:
        parts.append(f"seed {one.seed}")
    holdout = (one.data.partition or {}).get("holdout")
    if holdout is not None:
        parts.append(f"holdout {holdout}")
    return f"{', '.join(parts)}: " if parts else ""


def _check_participation(one, n: int, label: str) -> None:
    """``clients_per_round`` at most the clients (the server's own rule; ``fraction`` in (0, 1]
    gives max(1, round(fraction x n)), never none)."""
    k = one.clients_per_round
    if k is not None and k > n:
        raise UserError(f"{label}clients_per_round = {k} but the federation has {n} clients "
                        f"({_partition_text(one)}); expected at most {n}")


def _check_schedule(one, n: int, label: str) -> None:
    """A buffered schedule the server would refuse (raysim.engine.timeline.buffered_schedule), said
    before Ray starts (a method's personal tensors are checked where its model is built)."""
    from raysim.engine.timeline import buffered_schedule, schedule_kind
    from raysim.methods import registry
    cls = registry.get(one.method)
    if schedule_kind(one, cls) != "buffered":
        return
    per_round = one.clients_per_round or (max(1, int(round(one.fraction * n))) if one.fraction else n)
    try:
        plan = buffered_schedule(one, cls, per_round, clocked=bool(one.clients.profiles.levels))
    except UserError as err:
        raise UserError(f"{label}{err}") from None
    if plan.concurrency > n:
        raise UserError(f"{label}schedule.concurrency = {plan.concurrency} but the federation has {n} clients")


def _check_local_cpus(one, n: int, cpus_here: int, label: str) -> float:
    """The CPUs the federation's pool and server need of raysim's own Ray (all of this machine's
    CPUs); a UserError when they exceed it, as the pool's placement would refuse it after Ray started."""
    from raysim.engine.layout import host_layout

    rt = one.runtime
    hosts, _ = host_layout(rt, n)  # at most one host per client
    need = hosts * rt.cpus_per_host + rt.server_cpus
    if need > cpus_here + 1e-9:
        used = f"{hosts} hosts" if rt.num_hosts is None or hosts == rt.num_hosts else \
            f"{hosts} hosts (runtime.num_hosts = {rt.num_hosts}, at most one per client)"
        server = f" + {rt.server_cpus:g} (runtime.server_cpus)" if rt.server_cpus else ""
        raise UserError(f"{label}the federation needs {need:g} CPUs, {used} x {rt.cpus_per_host:g} "
                        f"(runtime.cpus_per_host){server}, but this machine has {cpus_here}; lower "
                        "runtime.num_hosts or runtime.cpus_per_host, or join a cluster with --address")
    return need


def _partition_text(one) -> str:
    spec = {k: v for k, v in (one.data.partition or {}).items() if k != "holdout"}
    return f"{one.data.dataset}, partition {json.dumps(spec, default=str)}"
