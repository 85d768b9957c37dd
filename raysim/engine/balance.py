"""Which host trains which of a round's clients (``runtime.balance``).

Client k belongs to host k mod H: its stored state lives there between rounds. With pinned
clients a round lasts as long as the slowest host, so one busy core (a noisy neighbour, a slower
GPU, a spot node) stretches every round although the other hosts sit idle. With
``runtime.balance: steal`` the round's clients are handed out in chunks: a host first works
through its own queue, and once it has nothing left and nothing running it takes the tail of
another host's queue, but only clients whose stored state is small (``runtime.steal_state_mb``):
their record travels through the object store to the host that trains them and back to the owner,
and their data view is rebuilt there. Clients with large state stay on their owner.

Stealing alone evens out too late: k mod H splits 50 clients over 2 hosts 28-22 or worse about
half the time, and when the short queue runs dry the long one's last two chunks are already in
flight, where no thief can take them (P's hosts ended 35-40 ms apart a round). So before the round
the plan evens the queues out by what each client is expected to cost (its training examples, at
its host's measured pace) and stealing is left with the timing's noise.

Handing a queue out in chunks has a price: each chunk is a call from the driver (~1.5 ms of CPU in
the driver, the raylet and the host), and a host keeps two chunks in flight so that it never
waits for the driver, so a host's queue leaves in five or six chunks a round. On two cores that
cost more than the stealing it allows gained once the queues are evened out before the round
(stop 67, docs/results.md §11: rounds 1-6% shorter on B, D and P in alternated runs). So
``runtime.balance: even``, the default, evens the queues out and hands each host its queue as one
chunk; a host that is slower for good trains less from the next round on, since its measured pace
evens the queues.
``steal`` adds the chunks and the stealing, for hosts whose speed changes within a round.

Which host ran a client never changes the results: every draw is keyed by (seed, round, client),
the model a client trains is loaded from the payload and its own record, and the uploads are
summed in float64 whatever the grouping (raysim.core.aggregation).
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from functools import cached_property

OWN_CHUNK_DIVISOR = 2  # a host's next chunk: half of what is left in its own queue (at least 1)
PIPELINE = 2  # chunks of its own queue a host has in flight, so it never waits for the driver
# the least training time worth a chunk of its own: a chunk costs ~1.5 ms of CPU in the driver, the
# raylet and the host whatever its size, so a chunk of one 4 ms client (workload D) spends a quarter
# of its time on the call; 25 ms keeps that under 6% and the round's tail within 25 ms
LEAST_CHUNK_SECONDS = 0.025
PACE_WEIGHT = 0.5  # a new measurement's weight in a host's pace (the rest: what it measured before)


def least_chunk(seconds_per_client: float | None) -> int:
    """The fewest clients worth a chunk on a host that trains one in ``seconds_per_client``
    (None: not measured yet, 1)."""
    if not seconds_per_client or seconds_per_client <= 0:
        return 1
    return math.ceil(LEAST_CHUNK_SECONDS / seconds_per_client)  # >= 1: both are positive


class Paces:
    """Each host's measured wall seconds per training example and per client, from the chunks of its
    own clients. A host's first call is left out: it holds the host's warm-up, which differs from
    host to host (evening round 2 out by round 1 made it the slowest round of P's). Later
    measurements are averaged exponentially (:data:`PACE_WEIGHT`), so one noisy chunk does not move
    clients while a host that is slower for good is seen within a few rounds."""

    def __init__(self):
        self.per_example: dict[int, float] = {}
        self.per_client: dict[int, float] = {}

    def add(self, host: int, seconds: float, clients: int, examples: int, first: bool = False) -> None:
        if first or clients <= 0:
            return
        self._mix(self.per_client, host, seconds / clients)
        if examples > 0:
            self._mix(self.per_example, host, seconds / examples)

    @staticmethod
    def _mix(table: dict[int, float], host: int, value: float) -> None:
        old = table.get(host)
        table[host] = value if old is None else PACE_WEIGHT * value + (1 - PACE_WEIGHT) * old


@dataclass(frozen=True)
class Costs:
    """What the plan expects each client's training to take: ``examples`` (client -> its training
    examples; a client not trained yet counts the mean of those known, or 1) at ``pace`` (host ->
    its seconds per example; a host not measured yet, or every host with an empty ``pace``, the
    mean pace)."""

    examples: dict[int, int] = field(default_factory=dict)
    pace: dict[int, float] = field(default_factory=dict)

    def seconds(self, host: int, client: int) -> float:
        return self.examples.get(client, self._mean_examples) * self.pace.get(host, self._mean_pace)

    @cached_property
    def _mean_examples(self) -> float:
        return sum(self.examples.values()) / len(self.examples) if self.examples else 1.0

    @cached_property
    def _mean_pace(self) -> float:
        return sum(self.pace.values()) / len(self.pace) if self.pace else 1.0


class StealingPlan:
    """The round's clients queued on their owners, evened out; chunks out to hosts as they ask."""

    def __init__(self, rnd: int, queues: dict[int, list[int]], num_hosts: int, movable,
                 least: dict[int, int] | None = None, costs: Costs | None = None):
        """``queues``: owner -> its sampled clients; ``movable(client)``: whether its state may travel;
        ``least``: host -> the fewest clients of its own queue worth a chunk (:func:`least_chunk`; 1
        where absent); ``costs``: what evens the queues out before the round (None: left as the
        owners split them)."""
        self.rnd, self.num_hosts, self.movable = rnd, num_hosts, movable
        self.least = least or {}
        self.queues = {h: deque(sorted(queues.get(h, ()))) for h in range(num_hosts)}
        self.adopted: dict[int, deque[tuple[int, int]]] = {h: deque() for h in range(num_hosts)}
        """host -> (owner, client) moved to it before the round, trained before its own queue."""
        if costs is not None:
            self._even_out(costs)

    def _even_out(self, costs: Costs) -> None:
        """While it brings the last host's expected end earlier, move the movable client nearest
        the tail of that host's queue to the host expected to end first."""
        end = {h: sum(costs.seconds(h, c) for c in q) for h, q in self.queues.items()}
        while True:
            late = max(end, key=lambda h: (end[h], -h))
            early = min(end, key=lambda h: (end[h], h))
            if late == early:
                return
            moving = next((c for c in reversed(self.queues[late]) if self.movable(c) and
                           max(end[late] - costs.seconds(late, c), end[early] + costs.seconds(early, c)) < end[late]),
                          None)
            if moving is None:
                return
            self.queues[late].remove(moving)
            self.adopted[early].append((late, moving))
            end[late] -= costs.seconds(late, moving)
            end[early] += costs.seconds(early, moving)

    def exhausted(self) -> bool:
        """Every client of the round handed out."""
        return not any(self.queues.values()) and not any(self.adopted.values())

    def may_leave(self, owner: int) -> list[int]:
        """The owner's clients of the round that may train on another host: those moved before the
        round and its movable queued ones (whose records a thief may need)."""
        return sorted(self._moved_from(owner) + [c for c in self.queues[owner] if self.movable(c)])

    def _moved_from(self, owner: int) -> list[int]:
        """The owner's clients moved to other hosts before the round."""
        return [c for adopted in self.adopted.values() for o, c in adopted if o == owner]

    def next_chunk(self, host: int, in_flight: int) -> tuple[int | None, list[int]]:
        """(owner, clients) for ``host`` to train next, given the chunks it has ``in_flight``:
        from its own queue (owner == host; half of it, at least ``least[host]``), else stolen
        from the host with the most movable clients queued (half of them, from the tail); (None, [])
        when there is nothing for it. Clients moved to it before the round come first, a chunk per
        owner (their owners' records are exported before any chunk starts)."""
        if self.adopted[host]:
            return (None, []) if in_flight >= PIPELINE else self._adopted_chunk(host)
        own = self.queues[host]
        if own:
            if in_flight >= PIPELINE:
                return None, []
            n = max(math.ceil(len(own) / OWN_CHUNK_DIVISOR), self.least.get(host, 1))
            return host, [own.popleft() for _ in range(min(n, len(own)))]
        if in_flight:  # steal only when about to idle: a busy thief would take work from a faster owner
            return None, []
        counts = {h: sum(1 for c in q if self.movable(c)) for h, q in self.queues.items() if h != host}
        victim = max(counts, key=lambda h: (counts[h], -h), default=None)
        if victim is None or counts[victim] == 0:
            return None, []
        want, taken = math.ceil(counts[victim] / 2), []
        for c in reversed(self.queues[victim]):
            if self.movable(c):
                taken.append(c)
                if len(taken) == want:
                    break
        for c in taken:
            self.queues[victim].remove(c)
        return victim, sorted(taken)

    def _adopted_chunk(self, host: int) -> tuple[int, list[int]]:
        """(owner, clients): the clients of one owner moved to ``host`` before the round."""
        adopted = self.adopted[host]
        owner = adopted[0][0]
        self.adopted[host] = deque((o, c) for o, c in adopted if o != owner)
        return owner, sorted(c for o, c in adopted if o == owner)


class EvenPlan(StealingPlan):
    """The round's clients queued on their owners and evened out as :class:`StealingPlan` does, each
    host's queue then handed out whole: a chunk per owner of the clients moved to it, then its own
    queue. Nothing is stolen."""

    def next_chunk(self, host: int, in_flight: int) -> tuple[int | None, list[int]]:
        if self.adopted[host]:
            return self._adopted_chunk(host)
        own = self.queues[host]
        clients = list(own)
        own.clear()
        return (host if clients else None), clients

    def may_leave(self, owner: int) -> list[int]:
        """Only the clients moved before the round leave their owner."""
        return sorted(self._moved_from(owner))


PLANS = {"even": EvenPlan, "steal": StealingPlan}


def plan_for(cfg):
    """The plan class ``runtime.balance`` asks for, or None (``owner``): every client on its owner."""
    return PLANS.get(cfg.runtime.balance)


def job_trainers(clients, pinned, num_hosts: int) -> dict[int, int]:
    """Buffered schedule: the host that trains each of a dispatch's new jobs. A client whose
    record is kept (``pinned``: its owner stores state for it) trains on its owner, k mod H; the
    others start from their initial record wherever they train and leave it as it was, so they go
    to the least loaded host in ascending client order: a step's ~K new jobs split evenly over the
    hosts however their owners fall (an owner split of 10 jobs over 2 hosts is 6-4 or worse three
    times in four, and the step waits for the busier host)."""
    load = [0] * num_hosts
    out: dict[int, int] = {}
    for c in clients:
        if c in pinned:
            out[c] = c % num_hosts
            load[out[c]] += 1
    for c in sorted(clients):
        if c not in pinned:
            out[c] = min(range(num_hosts), key=lambda h: (load[h], h))
            load[out[c]] += 1
    return out
