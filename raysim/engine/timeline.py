"""The simulated timeline of a buffered (asynchronous) federation: which clients are in flight,
when each one's upload arrives, and when the server steps.

The server keeps up to ``concurrency`` (C) clients training. Each trains from the model version
it was dispatched with (the server steps taken by then) and arrives at its start plus its
simulated duration, which the clock measured while it trained (compute on its device, download
and upload). Arrivals are taken in simulated order, by (finish time, client id): ties break by
client id, so the order never depends on which host answered first in real time. Once
``buffer`` (K) uploads are in, the server steps (the version goes up by one) at the K-th one's
finish time, and new clients are dispatched at that time to fill the free slots.

An arrival staler than ``max_staleness`` server steps is dropped: it frees its slot but does
not count towards K. When nothing is left in flight the server steps with the uploads it has
(fewer than K). Only then may a step take fewer than K.

A step needs the duration of every job whose arrival could be among its K: each job in flight
has an earliest arrival known at dispatch (its start plus a lower bound of its duration: the
download of its model and the least its method uploads, at its bandwidths), and a job whose
earliest arrival comes after the K-th folded arrival of the jobs already trained cannot be among
them, so it may train later. The step is the one every duration would give; nothing depends on
real time. A job that takes less than its bound is refused (:meth:`Timeline.trained`).

Since a dispatch needs only the timeline, never the model, the server plans a window of steps in
one call: as many as come before any untrained job could arrive (raysim.engine.server.Server.plan);
the hosts fold them in one call and the server aggregates them in one, so the calls and transfers
of a step are paid once per window.
A client is never in flight twice, and a client dispatched at version v trains with the draws
keyed as round v + 1: with C = K = clients per round and every client fresh, the draws are the
synchronous round's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Job:
    """One client's local training, dispatched at simulated time ``start`` with model ``version``."""

    client: int
    version: int
    """Server steps taken when it was dispatched: the model version it trains from."""
    start: float
    """Simulated seconds at dispatch."""

    @property
    def round(self) -> int:
        """The round its keyed draws (data order, dropout, augmentation) are keyed by: version + 1."""
        return self.version + 1


@dataclass(frozen=True)
class Arrival:
    """A job's upload reaching the server."""

    job: Job
    finish: float
    """Simulated seconds at arrival: the job's start plus its duration."""
    staleness: int
    """Server steps taken between its dispatch and the step it is folded into (τ)."""


@dataclass(frozen=True)
class Step:
    """One server step: the arrivals folded into it (in arrival order) and those dropped as too stale."""

    version: int
    """The version the step produces (1, 2, ...; unchanged when every arrival was dropped)."""
    time: float
    """Simulated seconds at the step: the last folded (or dropped) arrival's finish."""
    folded: tuple[Arrival, ...]
    dropped: tuple[Arrival, ...] = ()


class DispatchedTwice(ValueError):
    """A client dispatched while it is still in flight."""


@dataclass
class Timeline:
    """The driver's simulated clock of a buffered federation (module docstring)."""

    concurrency: int
    buffer: int
    max_staleness: int | None = None
    now: float = 0.0
    version: int = 0
    in_flight: dict[int, Job] = field(default_factory=dict)
    durations: dict[int, float] = field(default_factory=dict)
    """Client -> its in-flight job's simulated duration, once it trained."""
    earliest: dict[int, float] = field(default_factory=dict)
    """Client -> its in-flight job's earliest arrival (start + a lower bound of its duration); a job
    not listed may arrive at its start."""

    def __post_init__(self):
        if not 1 <= self.buffer <= self.concurrency:
            raise ValueError(f"buffer K = {self.buffer} must be between 1 and the concurrency C = {self.concurrency}")

    @property
    def free_slots(self) -> int:
        return self.concurrency - len(self.in_flight)

    def dispatch(self, clients, least_seconds=None) -> list[Job]:
        """Start ``clients`` (in the order given) now, from the current version; ``least_seconds``:
        a lower bound of each one's duration (none: 0)."""
        clients = [int(c) for c in clients]
        twice = next((c for i, c in enumerate(clients) if c in self.in_flight or c in clients[:i]), None)
        if twice is not None:
            raise DispatchedTwice(f"client {twice} is already in flight")
        if len(clients) > self.free_slots:
            raise ValueError(f"{len(clients)} clients dispatched with {self.free_slots} free slots")
        jobs = [Job(c, self.version, self.now) for c in clients]
        self.in_flight.update((j.client, j) for j in jobs)
        if least_seconds is not None:
            self.earliest.update((j.client, j.start + float(s)) for j, s in zip(jobs, least_seconds))
        return jobs

    def trained(self, client: int, seconds: float) -> None:
        """Record how long ``client``'s job takes in simulated seconds (its clock's figure)."""
        if client not in self.in_flight:
            raise KeyError(f"client {client} is not in flight")
        if not seconds >= 0 or math.isinf(seconds):
            raise ValueError(f"client {client}: a duration of {seconds} simulated seconds")
        job = self.in_flight[client]
        if job.start + seconds < self.earliest.get(client, job.start):
            raise RuntimeError(f"client {client}'s job took {seconds} simulated seconds, under the lower bound "
                               f"{self.earliest[client] - job.start} its dispatch promised (its transfers): steps "
                               "planned with that bound could have missed its arrival; is the method's upload "
                               "smaller than its Method.upload_floor?")
        self.durations[client] = float(seconds)

    @property
    def waiting_on(self) -> list[int]:
        """Clients in flight whose duration is not known yet (a step waits for them)."""
        return sorted(c for c in self.in_flight if c not in self.durations)

    def arrivals(self) -> list[Arrival]:
        """The arrivals of the jobs in flight that trained, in simulated order (finish, client)."""
        out = [Arrival(j, j.start + self.durations[c], self.version - j.version)
               for c, j in self.in_flight.items() if c in self.durations]
        return sorted(out, key=lambda a: (a.finish, a.job.client))

    def _take(self, arrivals: list[Arrival]) -> tuple[list[Arrival], list[Arrival]]:
        """(folded, dropped): arrivals in order until ``buffer`` are folded."""
        folded, dropped = [], []
        for a in arrivals:
            if len(folded) == self.buffer:
                break
            (dropped if self.max_staleness is not None and a.staleness > self.max_staleness else folded).append(a)
        return folded, dropped

    def needed(self, training=()) -> list[int]:
        """The untrained clients in flight (other than those in ``training``) whose duration the
        next step needs: each whose earliest arrival is not after the K-th folded arrival of the
        trained ones (all of them while the trained ones do not fill the buffer). The others may
        train after it. Trained jobs only move the K-th arrival earlier, so this holds whatever
        ``training``'s jobs turn out to take."""
        training = set(training)
        untrained = [c for c in self.waiting_on if c not in training]
        folded, _ = self._take(self.arrivals())
        if len(folded) < self.buffer:
            return untrained
        last = (folded[-1].finish, folded[-1].job.client)
        return [c for c in untrained if self._earliest(c) <= last]

    def likely(self, arrivals: int) -> list[int]:
        """The untrained clients in flight likely among the next ``arrivals`` arrivals and a step's
        more: each whose earliest arrival is not after the (arrivals + K)-th of the trained jobs'
        arrivals and the untrained ones' earliest plus the most any trained job took beyond its
        own. A guess (a job's compute is known once it trained), unlike :meth:`needed`: where it is
        short, a step finds a job it needs untrained and waits for it."""
        known = [a.finish for a in self.arrivals()]
        excess = max((self.in_flight[c].start + d - self.earliest_arrival(c) for c, d in self.durations.items()),
                     default=0.0)
        untrained = self.waiting_on
        keys = sorted(known + [self.earliest_arrival(c) + excess for c in untrained])
        if len(keys) <= arrivals + self.buffer:
            return untrained
        return [c for c in untrained if self.earliest_arrival(c) <= keys[arrivals + self.buffer - 1]]

    def earliest_arrival(self, client: int) -> float:
        """Its in-flight job's earliest arrival (its start where no bound was given)."""
        return self.earliest.get(client, self.in_flight[client].start)

    def _earliest(self, client: int) -> tuple[float, int]:
        return self.earliest_arrival(client), client

    def step(self) -> Step:
        """Take arrivals in simulated order until ``buffer`` are folded (or nothing is left in
        flight); the server steps at the last one's time. Their clients leave the flight. Every
        job that could arrive among them must have trained (:meth:`needed`)."""
        folded, dropped = self._take(self.arrivals())
        waiting = self.waiting_on
        if waiting and (len(folded) < self.buffer
                        or any(self._earliest(c) <= (folded[-1].finish, folded[-1].job.client) for c in waiting)):
            raise RuntimeError(f"clients {self.needed()} have not trained yet: the step's arrivals are unknown")
        taken = folded + dropped
        if not taken:
            raise RuntimeError("no client is in flight: dispatch before stepping")
        self.now = max(self.now, max(a.finish for a in taken))
        for a in taken:
            del self.in_flight[a.job.client]
            del self.durations[a.job.client]
            self.earliest.pop(a.job.client, None)
        if folded:  # every arrival too stale: no update, no new version
            self.version += 1
        return Step(self.version, self.now, tuple(folded), tuple(sorted(dropped, key=lambda a: (a.finish, a.job.client))))

    # ------------------------------------------------------------------ checkpoints
    def export(self) -> dict:
        """Plain data a checkpoint holds (the in-flight jobs re-dispatch from it deterministically)."""
        return {"concurrency": self.concurrency, "buffer": self.buffer, "max_staleness": self.max_staleness,
                "now": self.now, "version": self.version,
                "in_flight": [[j.client, j.version, j.start] for j in self.in_flight.values()],
                "durations": [[c, s] for c, s in self.durations.items()]}

    @classmethod
    def restore(cls, data: dict) -> "Timeline":
        t = cls(data["concurrency"], data["buffer"], data["max_staleness"], data["now"], data["version"])
        t.in_flight = {int(c): Job(int(c), int(v), float(s)) for c, v, s in data["in_flight"]}
        t.durations = {int(c): float(s) for c, s in data["durations"]}
        return t


# ----------------------------------------------------------------------------- the configured schedule

@dataclass(frozen=True)
class BufferedSchedule:
    """A buffered federation's settings, resolved from the config (``schedule:``) and the method's
    defaults (``Method.buffer``, ``Method.staleness``)."""

    concurrency: int
    buffer: int
    staleness: object
    """A :class:`raysim.core.staleness.Staleness`."""
    max_staleness: int | None
    slot_s: float

    def timeline(self) -> Timeline:
        return Timeline(self.concurrency, self.buffer, self.max_staleness)


FEDBUFF_BUFFER = 10  # K of a buffered method that names none: FedBuff's (Nguyen et al. 2022, their experiments' K)


def schedule_kind(cfg, method) -> str:
    """``rounds`` or ``buffered``: the config's ``schedule.kind``, else the method's."""
    return cfg.schedule.kind or _cls(method).schedule


def _cls(method) -> type:
    """A method's class, given the method or its class."""
    return method if isinstance(method, type) else type(method)


def buffered_schedule(cfg, method, per_round: int, clocked: bool, model=None) -> BufferedSchedule | None:
    """The buffered schedule ``cfg`` asks for (None: synchronous rounds), or a UserError in one line
    where it cannot run: without client profiles (nothing gives a client's duration), with a round
    deadline, a loss-asking selection, or a method whose upload is not a model update."""
    from dataclasses import replace

    from raysim.core.contract import buffered_refusal as refusal
    from raysim.core.errors import UserError
    if schedule_kind(cfg, method) != "buffered":
        return None
    s = cfg.schedule
    where = f"schedule.kind buffered (method {method.name})"
    why = refusal(method, model)
    if why:
        raise UserError(f"method {method.name} cannot run a buffered schedule: {why}; run it with schedule.kind rounds")
    if not clocked:
        raise UserError(f"{where} needs clients.profiles: the simulated clock gives each client's duration, "
                        "which orders the arrivals")
    if cfg.clients.deadline_s is not None:
        raise UserError(f"{where} has no rounds to cut at clients.deadline_s; set it to null "
                        "(schedule.max_staleness drops late arrivals instead)")
    if cfg.clients.selection.kind != "uniform":
        raise UserError(f"{where} dispatches clients one step at a time; clients.selection.kind "
                        f"{cfg.clients.selection.kind} runs with schedule.kind rounds only")
    concurrency = s.concurrency or per_round
    buffer = s.buffer or min(_cls(method).buffer or FEDBUFF_BUFFER, concurrency)
    if _cls(method).buffer_fixed and buffer != _cls(method).buffer:
        raise UserError(f"method {method.name} steps on every {_cls(method).buffer} arrival(s); schedule.buffer = "
                        f"{buffer} would change the method: leave it null")
    if buffer > concurrency:
        raise UserError(f"schedule.buffer = {buffer} exceeds the clients in flight (schedule.concurrency = "
                        f"{concurrency}): a step would wait for more arrivals than can come")
    staleness = _cls(method).staleness
    if s.staleness is not None:
        staleness = replace(staleness, kind=s.staleness)
    if s.staleness_a is not None:
        staleness = replace(staleness, a=s.staleness_a)
    if s.staleness_b is not None:
        staleness = replace(staleness, b=s.staleness_b)
    return BufferedSchedule(concurrency, buffer, staleness, s.max_staleness, s.slot_s)
