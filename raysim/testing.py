"""Helpers for testing methods, raysim's own and users': a public harness.

* :class:`ElsewherePlan`: a host plan that trains every client on another host than its owner,
  every round, so a method that keeps some client state outside the client's record shows it
  (its results change).
"""
from __future__ import annotations

from raysim.engine.balance import StealingPlan


class ElsewherePlan(StealingPlan):
    """Every client trains on the host after its owner's, whatever its state's size: each
    client's record leaves its owner and comes back every round. A check, not a policy: a method
    whose results change under it keeps something of a client outside the client's record."""

    def __init__(self, rnd: int, queues: dict[int, list[int]], num_hosts: int, movable=None):
        super().__init__(rnd, queues, num_hosts, lambda c: True)

    def next_chunk(self, host: int, in_flight: int) -> tuple[int | None, list[int]]:
        owner = (host - 1) % self.num_hosts
        queue = self.queues[owner]
        if not queue or in_flight:
            return None, []
        chunk = list(queue)
        queue.clear()
        return owner, chunk
