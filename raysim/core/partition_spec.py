"""The keys of a data partition (a config's ``data.partition``), one dataclass per ``kind``.

Declared here, below both readers: ``raysim.config`` checks a partition when the config is loaded
(so ``raysim run --check`` reports a wrong key or value in one line, like every other setting), and
``raysim.data.partition`` builds the partition from the same keys, checking what needs the dataset
(domain names, sizes). A config keeps the partition as the mapping the user wrote (its run folder's
config.yaml and its shards' fingerprint hold exactly those keys); ``partition_spec`` gives the
typed view of it. What each key means: ``raysim.data.partition``'s docstring.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from raysim.core.errors import UserError
from raysim.core.settings import build, setting

KINDS = ("per_domain", "dirichlet", "cross_device", "natural", "shard", "pathological")
# what the label-skew kinds may group samples by (Flower Datasets' ``partition_by``); raysim's
# splits carry one column, the label
PARTITION_BY = ("label",)
# keys of the config's partition that are not the partition's own: the held-out domain of a
# leave-one-domain-out federation and its test set; the engine takes them off before building it
HOLDOUT_KEYS = frozenset({"holdout", "target_test"})


@dataclass
class PartitionSpec:
    """The keys every kind takes."""
    kind: str = setting("per_domain", one_of=KINDS)
    domains: str | tuple[str, ...] | None = None  # a subset and order of the dataset's domains; null: all
    # every client of a domain evaluates on the domain's full val/test; null: true iff each domain
    # has one client
    shared_test: bool | None = None
    shuffle: bool = True  # false: consecutive slices in the split's own order (FedBN's train_part0)
    holdout: str | None = None  # leave-one-domain-out: this domain's clients never train
    target_test: str = setting("all", one_of=("all", "test"))  # the held-out client's test set

    def check(self, prefix: str) -> None:
        """What relates two keys, or a key to itself (the dataset's domains are not known here)."""
        doms = (self.domains,) if isinstance(self.domains, str) else self.domains
        if doms is not None and (not doms or len(set(doms)) != len(doms)):
            raise UserError(f"config key '{prefix}.domains' = {list(doms)!r}: expected a non-empty list of "
                            "distinct domain names")


def _check_counts(value, prefix: str) -> None:
    """``clients_per_domain``: an int, a list, or {domain: int}, each >= 0 and not all 0 (its type
    and the bounds of an int or list were checked when the spec was built)."""
    key = f"{prefix}.clients_per_domain"
    if isinstance(value, dict):
        for d, k in value.items():
            if not isinstance(d, str) or isinstance(k, bool) or not isinstance(k, int) or k < 0:
                raise UserError(f"config key '{key}' = {value!r}: expected {{domain name: an integer >= 0}}")
        counts = list(value.values())
    else:
        counts = list(value) if isinstance(value, tuple) else [value]
    if not any(counts):
        raise UserError(f"config key '{key}' = {value!r}: gives no clients")


@dataclass
class PerDomainSpec(PartitionSpec):
    """``per_domain``: each domain's train set split disjointly between its clients."""
    clients_per_domain: int | tuple[int, ...] | dict = setting(1, ge=0)  # an int, a list, or {domain: k}
    fraction: float | None = setting(None, gt=0, le=1)  # each client holds int(f * n_train) images
    train_size: int | None = setting(None, ge=1)  # each client holds exactly this many
    num_clients: int | None = setting(None, ge=1)  # with assign: random
    assign: str | None = setting(None, one_of=("random",), expected="'random' or null")  # DapperFL's draw

    def check(self, prefix: str) -> None:
        super().check(prefix)
        if self.assign is None:  # (assign: random draws the counts)
            _check_counts(self.clients_per_domain, prefix)
        if self.fraction is not None and self.train_size is not None:
            raise UserError(f"config section '{prefix}': give fraction or train_size, not both")
        if self.assign == "random" and self.num_clients is None:
            raise UserError(f"config section '{prefix}': assign: random needs num_clients")
        if self.assign is None and self.num_clients is not None:
            raise UserError(f"config section '{prefix}': per_domain takes num_clients only with assign: random")


def _partition_by_setting():
    return setting("label", one_of=PARTITION_BY, expected="'label' (the only column raysim partitions by)")


@dataclass
class DirichletSpec(PartitionSpec):
    """``dirichlet``: label skew within each domain, by EasyFL/FedLab's draw (``min_size``,
    ``balance``) or, when ``min_partition_size`` or ``self_balancing`` is given, by Flower
    Datasets' DirichletPartitioner (the two families of keys do not mix)."""
    clients_per_domain: int | tuple[int, ...] | dict = setting(1, ge=0)
    alpha: float | None = setting(None, gt=0)  # required
    min_size: int | None = setting(None, ge=0)  # null: 10; redraw until every client has this many images
    # null: true; a client above the average size gets no more of a class (EasyFL, FedLab)
    balance: bool | None = None
    max_tries: int = setting(1000, ge=1)
    # Flower Datasets' names: either one selects its draw (defaults there: 10 and false)
    min_partition_size: int | None = setting(None, ge=0)
    self_balancing: bool | None = None
    partition_by: str = _partition_by_setting()

    def check(self, prefix: str) -> None:
        super().check(prefix)
        _check_counts(self.clients_per_domain, prefix)
        if self.alpha is None:
            raise UserError(f"config section '{prefix}': kind dirichlet needs alpha (> 0)")
        easyfl = [k for k in ("min_size", "balance") if getattr(self, k) is not None]
        flwr = [k for k in ("min_partition_size", "self_balancing") if getattr(self, k) is not None]
        if easyfl and flwr:
            raise UserError(f"config section '{prefix}': {', '.join(easyfl)} (EasyFL/FedLab's draw) and "
                            f"{', '.join(flwr)} (Flower Datasets' draw) do not mix; give one family")


@dataclass
class CrossDeviceSpec(PartitionSpec):
    """``cross_device``: many small clients over the domains' pooled train sets."""
    num_clients: int | None = setting(None, ge=1)  # required
    spread: str = setting("even", one_of=("even", "round_robin", "proportional"))
    samples_per_client: int | None = setting(None, ge=1)  # null: an even share of the pool
    overlap: bool = False  # clients draw independently when clients x samples exceed the pool

    def check(self, prefix: str) -> None:
        super().check(prefix)
        if self.num_clients is None:
            raise UserError(f"config section '{prefix}': kind cross_device needs num_clients")


@dataclass
class NaturalSpec(PartitionSpec):
    """``natural``: one client per group id (writer, user) in each domain's train split."""
    by: str = setting("group", one_of=("group",), expected="'group' (the per-sample group ids; the only "
                                                            "natural grouping so far)")
    min_samples: int = setting(1, ge=1)  # groups with fewer training samples are dropped (and said so)


@dataclass
class ShardSpec(PartitionSpec):
    """``shard``: Flower Datasets' ShardPartitioner (McMahan et al.'s shards of label-sorted data),
    within each domain's train split."""
    clients_per_domain: int | tuple[int, ...] | dict = setting(1, ge=0)  # flwr's num_partitions
    partition_by: str = _partition_by_setting()
    num_shards_per_partition: int | None = setting(None, ge=1)
    shard_size: int | None = setting(None, ge=1)
    keep_incomplete_shard: bool = False

    def check(self, prefix: str) -> None:
        super().check(prefix)
        _check_counts(self.clients_per_domain, prefix)
        if self.num_shards_per_partition is None and self.shard_size is None:
            raise UserError(f"config section '{prefix}': kind shard needs num_shards_per_partition, "
                            "shard_size or both")


CLASS_ASSIGNMENT_MODES = ("random", "deterministic", "first-deterministic")


@dataclass
class PathologicalSpec(PartitionSpec):
    """``pathological``: Flower Datasets' PathologicalPartitioner (each client holds a few
    classes), within each domain's train split."""
    clients_per_domain: int | tuple[int, ...] | dict = setting(1, ge=0)  # flwr's num_partitions
    partition_by: str = _partition_by_setting()
    num_classes_per_partition: int | None = setting(None, ge=1)  # required
    class_assignment_mode: str = setting("random", one_of=CLASS_ASSIGNMENT_MODES)

    def check(self, prefix: str) -> None:
        super().check(prefix)
        _check_counts(self.clients_per_domain, prefix)
        if self.num_classes_per_partition is None:
            raise UserError(f"config section '{prefix}': kind pathological needs num_classes_per_partition")


SPECS: dict[str, type[PartitionSpec]] = {
    "per_domain": PerDomainSpec, "dirichlet": DirichletSpec, "cross_device": CrossDeviceSpec,
    "natural": NaturalSpec, "shard": ShardSpec, "pathological": PathologicalSpec}


def keys(kind: str) -> frozenset[str]:
    """Every key a partition of ``kind`` takes in a config (``HOLDOUT_KEYS`` included)."""
    return frozenset(f.name for f in fields(SPECS[kind]))


def partition_spec(raw, prefix: str = "data.partition") -> PartitionSpec:
    """The typed partition ``raw`` describes (its ``kind``'s dataclass), or a one-line UserError
    naming the key, its value and what was expected."""
    if not isinstance(raw, dict) or "kind" not in raw:
        raise UserError(f"config key '{prefix}' must be a mapping with a 'kind' (e.g. per_domain)")
    kind = raw["kind"]
    if kind not in KINDS:
        raise UserError(f"config key '{prefix}.kind' = {kind!r}: expected one of {', '.join(KINDS)}")
    spec = build(SPECS[kind], raw, prefix)
    spec.check(prefix)
    return spec
