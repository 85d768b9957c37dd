"""The pure description of one federation: data, partition, method, initial model.

The server and every host build it from the same config, so all of them agree on the partition,
the clients' domains and the initial weights without shipping any of it around.
"""
from __future__ import annotations

from functools import cached_property

import torch

from raysim.methods import registry
from raysim.methods.base import Setup


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
    def _partitions(self):
        """(training clients, unseen-domain clients or None). With ``partition.holdout: DOMAIN``
        (leave-one-domain-out) the held-out domain's clients never train; they get ids after the
        training clients and are only evaluated."""
        from raysim.data.partition import leave_one_domain_out, make_partition
        spec = dict(self.cfg.data.partition)
        holdout = spec.pop("holdout", None)
        target_test = spec.pop("target_test", "all")  # "test": the target's test split only (CSAC-VLCS)
        if holdout is None:
            return make_partition(self.dataset, spec, self.cfg.seed), None
        return leave_one_domain_out(self.dataset, holdout, spec, self.cfg.seed, target_test=target_test)

    @property
    def partition(self):
        return self._partitions[0]

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
        """A training client's shard, or (cid >= num_clients) an unseen-domain client's."""
        n = self.num_clients
        return self.partition.shard(cid) if cid < n else self.target.shard(cid - n)

    def domain(self, cid: int) -> str:
        n = self.num_clients
        return self.partition.domain(cid) if cid < n else self.target.domain(cid - n)

    def profile(self, client_id: int) -> dict:
        profiles = self.setup.client_profiles
        return profiles[client_id] if profiles else {}

    @cached_property
    def setup(self) -> Setup:
        part = self.partition
        return Setup(num_classes=self.dataset.num_classes, image_shape=tuple(self.dataset.image_shape),
                     num_clients=part.num_clients,
                     client_domains=tuple(part.domain(c) for c in range(part.num_clients)),
                     model=self.cfg.model, train=self.cfg.train, rounds=self.cfg.rounds, seed=self.cfg.seed)

    @cached_property
    def method(self):
        cls = registry.get(self.cfg.method)
        return cls(cls.hparams_from(self.cfg.hp.get(self.cfg.method), prefix=f"hp.{self.cfg.method}"), self.setup)

    def initial_model(self) -> torch.nn.Module:
        """The same weights on every process: built under a generator keyed by the seed alone."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.cfg.seed)
            return self.method.build_model()
