"""The simulated clock: every client's profile (a lazy per-client table), whether a model fits a
device, a round's device time, a host's clock of its clients' rounds (:class:`ClientClock`), and
availability traces. Levels and the tier of each client come from :mod:`raysim.core.tiers`; the
clock itself is described there."""
from __future__ import annotations

import csv
import operator
from collections.abc import Sequence

from raysim.core.errors import UserError
from raysim.core.tiers import level_tiers, profile_levels


class ClientTable(Sequence):
    """A read-only per-client sequence whose items are computed when read (a federation's table of
    1,000,000 clients costs what one of 1,000 does): indexes (negative ids too), slices to a tuple,
    and equals the tuple of its items, as the tuple it stands in for did."""

    def _item(self, i: int):
        raise NotImplementedError

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self._item(j) for j in range(*i.indices(len(self))))
        i, n = operator.index(i), len(self)
        if not -n <= i < n:
            raise IndexError(f"client id {i} outside 0..{n - 1}")
        return self._item(i + n if i < 0 else i)

    def __eq__(self, other):
        if not isinstance(other, (tuple, ClientTable)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    def __hash__(self):
        return hash(tuple(self))


class ClientProfiles(ClientTable):
    """Every client's profile, ``{**its level's keys but "name", "tier": level index, "level":
    name}``, from the levels and one tier per client (a numpy byte: 1 MB for 1,000,000 clients,
    not a million dicts). Each read returns a fresh dict, as each client had its own before."""

    def __init__(self, levels: list[dict], tiers):
        self.level_profiles = tuple({**{k: v for k, v in level.items() if k != "name"}, "tier": t,
                                     "level": level["name"]} for t, level in enumerate(levels))
        self.tiers = tiers

    def __len__(self) -> int:
        return len(self.tiers)

    def _item(self, i: int) -> dict:
        return dict(self.level_profiles[self.tiers[i]])

    def __iter__(self):
        return (dict(self.level_profiles[t]) for t in self.tiers.tolist())

    def __repr__(self) -> str:
        return f"ClientProfiles({len(self)} clients over levels {[p['level'] for p in self.level_profiles]})"


def client_profiles(profiles, num_clients: int, seed: int) -> ClientProfiles:
    """Every client's profile (see :class:`ClientProfiles`); empty without levels."""
    import numpy as np

    levels = profile_levels(profiles)
    if not levels:
        return ClientProfiles([], np.zeros(0, np.uint8))
    if isinstance(profiles.assign, list):
        if len(profiles.assign) != num_clients:
            raise UserError(f"config key 'clients.profiles.assign' lists {len(profiles.assign)} levels but the "
                            f"federation has {num_clients} clients")
        tiers = np.asarray(profiles.assign, dtype=np.min_scalar_type(len(levels) - 1))
    else:
        tiers = level_tiers(num_clients, len(levels), profiles.shares, profiles.assign, seed)
    return ClientProfiles(levels, tiers)


def fits_memory(profile: dict, params: float) -> bool:
    """Whether the client's device holds the model it would train (float32 parameters)."""
    budget = profile.get("memory_mb")
    return budget is None or params * 4 / 2 ** 20 <= budget


def device_time(profile: dict, train_flops: float, bytes_down: float, bytes_up: float) -> tuple[float, float]:
    """(compute seconds, transfer seconds) of one client's round on its device."""
    compute = train_flops / profile["flops"] if profile.get("flops") else 0.0
    comm = 0.0
    if profile.get("down_mbps"):
        comm += 8 * bytes_down / (profile["down_mbps"] * 1e6)
    if profile.get("up_mbps"):
        comm += 8 * bytes_up / (profile["up_mbps"] * 1e6)
    return compute, comm


def read_trace(path: str) -> set[tuple[int, int]]:
    """The (client, round) pairs of an availability trace: a CSV of client,round rows (a header
    row is skipped)."""
    online = set()
    with open(path, newline="", encoding="utf-8") as fh:
        for i, row in enumerate(csv.reader(fh)):
            if not row or (i == 0 and not row[0].strip().lstrip("-").isdigit()):
                continue
            try:
                online.add((int(row[0]), int(row[1])))
            except (ValueError, IndexError):
                raise UserError(f"availability trace {path}, line {i + 1}: expected client,round integers, got {row}") from None
    return online


class ClientClock:
    """A host's simulated clock (runs with client profiles): whether a client's device holds the
    model it would train, and how long its round takes there. The compute comes from the
    multiply-accumulates of every pass its step ran (measured: :class:`raysim.engine.compute.ComputeMeter`)
    at its device's speed; the transfer from the bytes at its bandwidth."""

    def __init__(self, model, image_shape, profile_of, footprint_of, deadline_s: float | None):
        """``profile_of(client id)``: the client's profile; ``footprint_of(client id, dense)``: what
        its device must hold (``Method.client_footprint``), given the full ``model``'s."""
        from raysim.models import count_flops, count_params
        self.dense = {"params": float(count_params(model)), "macs": float(count_flops(model, image_shape))}
        self.profile_of, self.footprint_of, self.deadline_s = profile_of, footprint_of, deadline_s

    def fits(self, cid: int) -> bool:
        """Whether the client's memory holds the model it would train."""
        foot = self.footprint_of(cid, self.dense)
        return fits_memory(self.profile_of(cid), foot["params"])

    def round_metrics(self, cid: int, macs: float, bytes_down: int, bytes_up: int) -> dict:
        """The client's simulated round as metrics (``dropped_deadline`` 1.0: it missed the
        deadline, and the server stopped waiting for its upload)."""
        compute, comm = device_time(self.profile_of(cid), 2 * macs, bytes_down, bytes_up)  # FLOPs = 2 x MACs
        late = self.deadline_s is not None and compute + comm > self.deadline_s
        return dict(sim_compute_s=compute, sim_comm_s=comm, sim_seconds=compute + comm,
                    completed=0.0 if late else 1.0, dropped_deadline=1.0 if late else 0.0, dropped_memory=0.0)

    def answer_seconds(self, cid: int, macs: float, bytes_down: int, bytes_up: int) -> float:
        """The client's simulated time to answer a loss query (``Method.select``): the forward
        passes it ran at its device's speed, the model's download and the answer's upload."""
        compute, comm = device_time(self.profile_of(cid), 2 * macs, bytes_down, bytes_up)  # FLOPs = 2 x MACs
        return compute + comm

    @staticmethod
    def dropped_metrics() -> dict:
        """The metrics of a client that does not :meth:`fit <fits>` (it does not train)."""
        return {"completed": 0.0, "dropped_memory": 1.0}
