"""Device tiers: client system profiles' levels (DapperFL's capability tiers C1..C5) and which client has
which, and the simulated clock they drive. A method reads its client's profile from
``ctx.profile`` (and every client's from ``setup.client_profiles``); every method of a comparison
sees the same devices.

    clients:
      profiles:
        levels:                        # or [C1, C2, ...], or a number of levels
          - {name: C1, flops: 2.0e9, memory_mb: 64, up_mbps: 20, down_mbps: 100, availability: 1.0}
          - {name: C5, flops: 2.5e8, memory_mb: 8, up_mbps: 2, down_mbps: 10, availability: 0.8}
        assign: round_robin            # random | [0, 1, 4, ...] (one level index per client)
        trace: null                    # or a CSV of "client,round" rows: when each client is online
      deadline_s: null                 # drop clients slower than this many simulated seconds

The clock is simulated, never measured: a client's round takes
    compute_s = 3 x (2 x forward MACs per sample) x samples processed / flops    (forward + backward)
    comm_s    = 8 x bytes down / (down_mbps 1e6) + 8 x bytes up / (up_mbps 1e6)
so results are deterministic and the same on any machine. A level without ``flops`` (or a
bandwidth) adds no time for it; without ``memory_mb`` any model fits; availability 1 by default.
"""
from __future__ import annotations

import math
import os

from raysim.core.errors import UserError

ASSIGN_RULES = ("round_robin", "random")
CLOCK_KEYS = ("flops", "memory_mb", "up_mbps", "down_mbps")  # positive numbers


def profile_levels(profiles) -> list[dict]:
    """The levels of a ``clients.profiles`` section as dicts (a number of levels: named L1..Ln)."""
    levels = profiles.levels
    if isinstance(levels, int) and not isinstance(levels, bool):
        return [{"name": f"L{i + 1}"} for i in range(levels)]
    out = [dict(lv) if isinstance(lv, dict) else {"name": lv} for lv in levels]
    for level in out:  # YAML 1.1 reads 1e9 as a string
        for key in CLOCK_KEYS + ("availability",):
            if isinstance(level.get(key), str):
                try:
                    level[key] = float(level[key])
                except ValueError:
                    pass
    return out


def check_profiles(profiles) -> None:
    """The profiles section without the federation (the number of clients is checked later)."""
    levels = profiles.levels
    ok = (isinstance(levels, int) and not isinstance(levels, bool) and levels >= 0) or (
        isinstance(levels, list) and all(isinstance(lv, str) or (isinstance(lv, dict) and isinstance(lv.get("name"), str))
                                         for lv in levels))
    if not ok:
        raise UserError(f"config key 'clients.profiles.levels' = {levels!r}: expected a number of levels or a "
                        "list of level names (or of mappings with a 'name')")
    n = len(profile_levels(profiles))
    assign = profiles.assign
    if not (assign in ASSIGN_RULES or (isinstance(assign, list) and all(
            isinstance(a, int) and not isinstance(a, bool) and 0 <= a < max(n, 1) for a in assign))):
        raise UserError(f"config key 'clients.profiles.assign' = {assign!r}: expected round_robin, random or a "
                        f"list of level indices in [0, {n})")
    for level in profile_levels(profiles):
        for key in CLOCK_KEYS + ("availability",):
            v = level.get(key)
            if v is None:
                continue
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (0 <= v <= 1 if key == "availability"
                                                                              else v > 0)
            if not ok:
                raise UserError(f"config key 'clients.profiles.levels' level {level['name']!r}: {key} = {v!r}: expected "
                                + ("a probability in [0, 1]" if key == "availability" else "a positive number"))
    if profiles.trace is not None and not os.path.isfile(profiles.trace):
        raise UserError(f"config key 'clients.profiles.trace' = {profiles.trace!r}: no such file (a CSV of client,round rows)")
    if profiles.shares is not None and (len(profiles.shares) != n or sum(profiles.shares) <= 0):
        raise UserError(f"config key 'clients.profiles.shares' = {list(profiles.shares)!r}: expected {n} "
                        "non-negative numbers (one per level), not all 0")


def level_counts(num_clients: int, shares: tuple | None, num_levels: int) -> list[int]:
    """Clients per level: shares * N, rounded by largest remainder (ties: the lower level)."""
    shares = shares or (1.0,) * num_levels
    quotas = [s / sum(shares) * num_clients for s in shares]
    counts = [int(math.floor(q + 1e-9)) for q in quotas]
    order = sorted(range(num_levels), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in order[:num_clients - sum(counts)]:
        counts[i] += 1
    return counts


def level_tiers(num_clients: int, num_levels: int, shares: tuple | None = None, how: str = "round_robin",
                seed: int = 0, purpose: str = "client-levels"):
    """Level of each client as a numpy array (a byte per client below 256 levels), vectorised so
    that a million clients take milliseconds. "round_robin": cycle through the levels that still
    have room (client k -> k mod L with equal shares, DapperFL's code); "random": the same slots,
    shuffled by a generator keyed by (seed, ``purpose``)."""
    import numpy as np

    counts = level_counts(num_clients, shares, num_levels)
    # the cycle skips full levels, so pass t of it deals one slot to each level with more than t
    passes = np.concatenate([np.arange(c, dtype=np.int64) for c in counts])
    levels = np.repeat(np.arange(num_levels, dtype=np.min_scalar_type(max(num_levels - 1, 0))), counts)
    slots = levels[np.argsort(passes, kind="stable")][:num_clients]
    if how == "round_robin":
        return slots
    from raysim.core.seeding import SERVER, rng_for
    return slots[rng_for(seed, 0, SERVER, purpose).permutation(num_clients)]


class ClientTiers:
    """Which capability tier each client has, for a method that gives the clients of different
    devices different models (DapperFL, FedDrop, FedMP, NeFL): ``tiers(client_id)``.

    A client with a profile (``clients.profiles``) has its profile's tier; without one, the
    method's own assignment of the training clients to ``num_levels`` tiers (:func:`level_tiers`:
    ``shares``, ``how``; by default equal shares dealt round robin, i.e. client k -> k mod L,
    DapperFL's code), and k mod L beyond them. The array is built on first use, and not at all
    for round robin with equal shares. A profile's tier beyond ``num_levels`` is a one-line error
    unless ``checked`` is False (DapperFL: a profile may carry its own ratio)."""

    def __init__(self, setup, num_levels: int, *, method: str, shares: tuple | None = None,
                 how: str = "round_robin", purpose: str = "client-levels", checked: bool = True):
        self.profiles = setup.client_profiles
        self.num_clients, self.seed = setup.num_clients, setup.seed
        self.num_levels, self.method, self.checked = num_levels, method, checked
        self.shares, self.how, self.purpose = shares, how, purpose
        self._assigned = None

    def __call__(self, client_id: int) -> int:
        if client_id < len(self.profiles):
            tier = int(self.profiles[client_id]["tier"])
            if self.checked and not 0 <= tier < self.num_levels:
                raise UserError(f"{self.method}: client {client_id} has tier {tier} but hp.{self.method}.rho_levels "
                                f"lists {self.num_levels} levels (one ratio per clients.profiles level is needed)")
            return tier
        if client_id >= self.num_clients or (self.how == "round_robin" and self.shares is None):
            return client_id % self.num_levels  # what level_tiers deals client k with equal shares
        if self._assigned is None:
            self._assigned = level_tiers(self.num_clients, self.num_levels, self.shares, self.how, self.seed,
                                         self.purpose)
        return int(self._assigned[client_id])
