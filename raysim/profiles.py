"""Client system profiles: device levels (DapperFL's capability tiers C1..C5) and which client has
which. A method reads its client's profile from ``ctx.profile`` (and every client's from
``setup.client_profiles``); every method of a comparison sees the same devices.

    clients:
      profiles:
        levels: [C1, C2, C3, C4, C5]   # or 5, or [{name: C1, ...}, ...]
        assign: round_robin            # random | [0, 1, 4, ...] (one level index per client)
"""
from __future__ import annotations

import math

from raysim.errors import UserError

ASSIGN_RULES = ("round_robin", "random")


def _levels(profiles) -> list[dict]:
    levels = profiles.levels
    if isinstance(levels, int) and not isinstance(levels, bool):
        return [{"name": f"L{i + 1}"} for i in range(levels)]
    return [dict(lv) if isinstance(lv, dict) else {"name": lv} for lv in levels]


def check_profiles(profiles) -> None:
    """The profiles section without the federation (the number of clients is checked later)."""
    levels = profiles.levels
    ok = (isinstance(levels, int) and not isinstance(levels, bool) and levels >= 0) or (
        isinstance(levels, list) and all(isinstance(lv, str) or (isinstance(lv, dict) and isinstance(lv.get("name"), str))
                                         for lv in levels))
    if not ok:
        raise UserError(f"config key 'clients.profiles.levels' = {levels!r}: expected a number of levels or a "
                        "list of level names (or of mappings with a 'name')")
    n = len(_levels(profiles))
    assign = profiles.assign
    if not (assign in ASSIGN_RULES or (isinstance(assign, list) and all(
            isinstance(a, int) and not isinstance(a, bool) and 0 <= a < max(n, 1) for a in assign))):
        raise UserError(f"config key 'clients.profiles.assign' = {assign!r}: expected round_robin, random or a "
                        f"list of level indices in [0, {n})")
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


def assign_levels(num_clients: int, num_levels: int, shares: tuple | None = None, how: str = "round_robin",
                  seed: int = 0, purpose: str = "client-levels") -> list[int]:
    """Level of each client. "round_robin": cycle through the levels that still have room (client
    k -> k mod L with equal shares, DapperFL's code); "random": the same slots, shuffled by a
    generator keyed by (seed, ``purpose``)."""
    counts = level_counts(num_clients, shares, num_levels)
    left, slots, k = list(counts), [], 0
    while len(slots) < num_clients:
        if left[k % num_levels] > 0:
            slots.append(k % num_levels)
            left[k % num_levels] -= 1
        k += 1
    if how == "round_robin":
        return slots
    from raysim.runtime.seeding import SERVER, rng_for
    perm = rng_for(seed, 0, SERVER, purpose).permutation(num_clients)
    return [slots[int(i)] for i in perm]


def client_profiles(profiles, num_clients: int, seed: int) -> tuple[dict, ...]:
    """Every client's profile, ``{"tier": level index, "level": name, **the level's keys}``; ()
    without levels."""
    levels = _levels(profiles)
    if not levels:
        return ()
    if isinstance(profiles.assign, list):
        if len(profiles.assign) != num_clients:
            raise UserError(f"config key 'clients.profiles.assign' lists {len(profiles.assign)} levels but the "
                            f"federation has {num_clients} clients")
        tiers = list(profiles.assign)
    else:
        tiers = assign_levels(num_clients, len(levels), profiles.shares, profiles.assign, seed)
    return tuple({**{k: v for k, v in levels[t].items() if k != "name"}, "tier": t, "level": levels[t]["name"]}
                 for t in tiers)
