"""The pure description of one federation: data, partition, method, initial model.

The server and every host build it from the same config, so all of them agree on the partition,
the clients' domains and the initial weights without shipping any of it around. With
``data.shards: URI`` nobody loads the dataset: the partition's description comes from the shards'
manifest and each host reads only its own clients' data (see ``raysim.engine.datashards``).
"""
from __future__ import annotations

import bisect
from functools import cached_property
from itertools import repeat

import numpy as np
import torch

from raysim.core.contract import Setup
from raysim.core.errors import UserError
from raysim.methods import registry
from raysim.engine.clock import ClientTable, client_profiles
from raysim.models import from_setup


class Federation:
    def __init__(self, cfg, dataset=None):
        self.cfg = cfg
        self._dataset = dataset

    @cached_property
    def dataset(self):
        if self._dataset is not None:
            return self._dataset
        from raysim.data import load
        return load(self.cfg.data.dataset, root=self.cfg.data.root, seed=self.cfg.seed, **self.cfg.data.options)

    @cached_property
    def shards(self):
        """The federation's pre-written shards (``data.shards``), or None: load the dataset."""
        if not self.cfg.data.shards or self._dataset is not None:
            return None
        from raysim.engine.datashards import FederationShards
        return FederationShards(self.cfg)

    @property
    def num_classes(self) -> int:
        return (self.shards or self.dataset).num_classes

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return tuple((self.shards or self.dataset).image_shape)

    @property
    def domains(self) -> tuple[str, ...]:
        """The dataset's domains (all of them, held-out ones included)."""
        return tuple((self.shards or self.dataset).domains)

    @cached_property
    def _partitions(self):
        """(training clients, unseen-domain clients or None). With ``partition.holdout: DOMAIN``
        (leave-one-domain-out) the held-out domain's clients never train; they get ids after the
        training clients and are only evaluated."""
        if self.pooled and self.cfg.data.shards:
            raise UserError(f"method {self.cfg.method} trains on the pooled data of every client; data.shards "
                            "cannot be used with it")
        if self.shards is not None:
            return self.shards.partition, self.shards.target
        from raysim.data.partition import leave_one_domain_out, make_partition
        spec = dict(self.cfg.data.partition)
        holdout = spec.pop("holdout", None)
        target_test = spec.pop("target_test", "all")  # "test": the target's test split only (CSAC-VLCS)
        if holdout is None:
            return make_partition(self.dataset, spec, self.cfg.seed), None
        return leave_one_domain_out(self.dataset, holdout, spec, self.cfg.seed, target_test=target_test)

    @cached_property
    def pooled(self) -> bool:
        """The method trains one model on every client's data at once (DeepAll): one pooled client."""
        return registry.get(self.cfg.method).pools_clients

    @property
    def partition(self):
        return PooledPartition(self._partitions[0]) if self.pooled else self._partitions[0]

    @property
    def target(self):
        return self._partitions[1]

    @property
    def num_clients(self) -> int:
        return self.partition.num_clients

    @property
    def num_targets(self) -> int:
        return 0 if self.target is None else self.target.num_clients

    def shard(self, cid: int):
        """A training client's shard, or (cid >= the partition's clients) an unseen-domain client's."""
        n = self._partitions[0].num_clients
        return self._partitions[0].shard(cid) if cid < n else self.target.shard(cid - n)

    def client_data(self, cid: int):
        """A client's data as its host keeps it: views on the dataset's splits, or the arrays read
        from the client's own shard (same images, same order, same normalisation); a pooled
        client's views run over every member client's, one after another."""
        if self.pooled and cid == 0:
            return pooled_data([self._member_data(c) for c in range(self._partitions[0].num_clients)])
        return self._member_data(cid if not self.pooled else cid - 1 + self._partitions[0].num_clients)

    def _member_data(self, cid: int):
        from raysim.engine.clientdata import ClientViews, SplitView

        if self.shards is not None:
            n = self.num_clients
            data = self.partition.read(cid) if cid < n else self.target.read(cid - n)
            views = {s: SplitView(data.split(s), np.arange(len(data.split(s)))) for s in ("train", "val", "test")}
            return ClientViews(train=views["train"], val=views["val"], test=views["test"],
                              num_train=len(views["train"]))
        shard = self.shard(cid)
        ds = self.dataset
        views = {s: SplitView(ds.split(shard.domain, shard.split_name(s)), getattr(shard, s))
                 for s in ("train", "val", "test")}
        return ClientViews(train=views["train"], val=views["val"], test=views["test"], num_train=len(shard.train))

    def domain(self, cid: int) -> str:
        n = self.num_clients
        return self.partition.domain(cid) if cid < n else self.target.domain(cid - n)

    def profile(self, client_id: int) -> dict:
        """A training client's system profile ({} without profiles, and for unseen clients)."""
        profiles = self.setup.client_profiles
        return profiles[client_id] if client_id < len(profiles) else {}

    @cached_property
    def setup(self) -> Setup:
        part = self.partition
        return Setup(num_classes=self.num_classes, image_shape=self.image_shape,
                     num_clients=part.num_clients,
                     client_domains=ClientDomains.of(part),
                     model=self.cfg.model, train=self.cfg.train, rounds=self.cfg.rounds, seed=self.cfg.seed,
                     client_profiles=client_profiles(self.cfg.clients.profiles, part.num_clients, self.cfg.seed),
                     model_builder=from_setup, server=self.cfg.server)

    @cached_property
    def method(self):
        cls = registry.get(self.cfg.method)  # a plugin module:Class is imported here, on every process
        key = registry.name_of(self.cfg.method)  # hp.<key>: a plugin's class name
        return cls(cls.hparams_from(self.cfg.hp.get(key), prefix=f"hp.{key}"), self.setup)

    def is_unseen(self, cid: int) -> bool:
        """A held-out domain's client: it never trains, it is only evaluated."""
        return cid >= self.num_clients

    def initial_model(self) -> torch.nn.Module:
        """The same weights on every process: built under a generator keyed by the seed alone."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.cfg.seed)
            return self.method.build_model()


class PooledPartition:
    """Every client of a partition as one client (what a centralised reference trains on)."""

    def __init__(self, part):
        self.part = part
        self.num_clients = 1

    def domain(self, cid: int) -> str:
        return "+".join(dict.fromkeys(ClientDomains.of(self.part).names))

    def num_samples(self, cid: int, split: str = "train") -> int:
        return int(self.part.all_num_samples(split).sum())


class ClientDomains(ClientTable):
    """The domain of each client id, held as runs of consecutive ids (one per domain, as a partition
    numbers its clients): a few tuples for 1,000 or 1,000,000 clients, cheap to build in every
    process and to send to the driver."""

    def __init__(self, runs=()):
        """``runs``: (first id, count, domain), consecutive from id 0."""
        names, ends = [], []
        for first, count, domain in runs:
            end = ends[-1] if ends else 0
            if first != end:
                raise ValueError(f"client domain runs must be consecutive from 0: a run starts at {first}, not {end}")
            if count:
                names.append(str(domain))
                ends.append(end + int(count))
        self.names, self.ends = tuple(names), tuple(ends)  # ends: one past each run's last id

    @classmethod
    def of(cls, part) -> "ClientDomains":
        """A partition's (or shard partition's) domains, from its id range per domain; an object
        without them (a pooled partition: one client) is read client by client."""
        if hasattr(part, "clients") and hasattr(part, "domains"):
            ranges = {d: part.clients(d) for d in part.domains}
            return cls(sorted((r.start, len(r), d) for d, r in ranges.items()))
        runs = []
        for cid in range(part.num_clients):
            domain = part.domain(cid)
            if runs and runs[-1][2] == domain:
                runs[-1][1] += 1
            else:
                runs.append([cid, 1, domain])
        return cls(runs)

    def __add__(self, other: "ClientDomains") -> "ClientDomains":
        """These clients, then ``other``'s with ids after them (a federation's unseen clients)."""
        return ClientDomains([*self.runs(), *((first + len(self), n, d) for first, n, d in other.runs())])

    def runs(self) -> list[tuple[int, int, str]]:
        starts = (0,) + self.ends[:-1]
        return [(first, end - first, d) for first, end, d in zip(starts, self.ends, self.names)]

    def __len__(self) -> int:
        return self.ends[-1] if self.ends else 0

    def _item(self, i: int) -> str:
        return self.names[bisect.bisect_right(self.ends, i)]

    def __iter__(self):
        for _, n, domain in self.runs():
            yield from repeat(domain, n)

    def __contains__(self, domain) -> bool:
        return domain in self.names

    def __repr__(self) -> str:
        return "ClientDomains(" + ", ".join(f"{d} x{n}" for _, n, d in self.runs()) + ")"


def pooled_data(members: list):
    """One ClientViews whose train/val/test run over the members' views, part after part."""
    from raysim.data.splits import ConcatSplit
    from raysim.engine.clientdata import ClientViews, SplitView

    def concat(views):
        offsets = np.cumsum([0] + [len(v.split) for v in views])
        return SplitView(ConcatSplit([v.split for v in views]),
                         np.concatenate([v.indices + off for v, off in zip(views, offsets)]))
    views = {s: concat([getattr(m, s) for m in members]) for s in ("train", "val", "test")}
    return ClientViews(train=views["train"], val=views["val"], test=views["test"], num_train=len(views["train"]))
