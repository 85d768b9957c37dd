"""What the driver, the server and the hosts send each other in a round, as typed records.

A method's selection may first ask the candidates for their local losses (``Method.select``): the
server's :class:`LossQuery`, answered by each host as :class:`LocalLosses`. A host's clients'
training comes back as :class:`TrainedClients` (one call's share) and
:class:`HostRoundResult` (the host's whole round); the server reduces those to a
:class:`RoundSummary` (what the round-loop callbacks receive); an evaluation comes back from each
host as :class:`SplitScores` per (client, split). Ray pickles these between actors; none of them
goes into a checkpoint (a checkpoint holds the server state, the clients' records and the metrics
table, so it keeps loading with ``torch.load(weights_only=True)``).

Object-store references travel in a box (:func:`box`), so that a host fetches them itself.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


# ----------------------------------------------------------------------------- boxes

def box(ref) -> list:
    """``[ref]``: how the driver hands a host an object-store reference (the round's payload, an
    owner's exported records) that the host fetches when it needs it.

    Ray fetches a reference that is an argument of an actor call itself before the call runs, on
    every call. One inside a list reaches the host as a reference: a host fetches the round's
    payload when its first share of the round's clients starts, and moves it to its device once,
    however many shares it trains (runtime.balance); a host that trains another host's clients
    fetches their records only when their share comes up. Without Ray the box holds the object."""
    return [ref]


def unbox(box: list):
    """The object in a box (fetched from the object store when it holds a reference)."""
    return fetched(box[0])


def fetched(obj):
    """``obj``, or the object it references (a reference inside a container reaches an actor as is)."""
    import ray
    return ray.get(obj) if isinstance(obj, ray.ObjectRef) else obj


def client_payload(payload: dict, personal, device) -> dict:
    """The round's payload (on the device already) plus this client's own part (``personal``: a
    reference, the part itself, or None), moved there."""
    if personal is None:
        return payload
    from raysim.core.tensors import to_device  # not at the top: the driver reads these records without torch
    return {**payload, "personal": to_device(fetched(personal), device, what="personal")}


# ----------------------------------------------------------------------------- selection

@dataclass
class LossQuery:
    """The server's answer to ``sample`` when the method's ``select`` asked for local losses the
    engine has not fetched yet: the hosts holding ``clients`` compute them
    (:meth:`ClientHost.local_losses`) and the driver calls ``sample`` again with them."""

    round: int
    clients: list[int]
    """The clients asked (ascending), each answered by its owner host."""
    payload: list
    """The round's payload in a box (:func:`box`): the model each client would train from."""
    personal: dict
    """Client id -> its own part of the payload (a reference), for methods that have one."""


@dataclass
class LocalLosses:
    """Clients' answers to a :class:`LossQuery`."""

    losses: dict[int, float] = field(default_factory=dict)
    """Each client's mean cross-entropy of the round's model over its training data (eval mode)."""
    sim_seconds: dict[int, float] = field(default_factory=dict)
    """With client profiles: each client's simulated time to answer (forward passes, download)."""

    @staticmethod
    def combined(parts) -> "LocalLosses":
        """One record of several hosts' (or queries') answers."""
        out = LocalLosses()
        for part in parts:
            out.losses.update(part.losses)
            out.sim_seconds.update(part.sim_seconds)
        return out


# ----------------------------------------------------------------------------- training

@dataclass
class TrainedClients:
    """What one :meth:`ClientHost.train_clients` call returns to the driver (the uploads stay on the
    host until :meth:`ClientHost.end_round`)."""

    host: int
    state_bytes: dict[int, int] = field(default_factory=dict)
    """Each trained client's stored-state size (the driver keeps clients with large state on their host)."""
    records_for_owner: dict[int, dict] = field(default_factory=dict)
    """The new records of clients another host owns (work stealing), to be stored back there."""
    examples: dict[int, int] = field(default_factory=dict)
    """Each trained client's training examples (what the driver expects its next rounds to cost)."""
    seconds: float = 0.0
    """Wall seconds the call spent."""
    first: bool = False
    """The host's first call since it started: its seconds hold the warm-up (lazy imports, the first
    touches of memory), not the host's pace."""


@dataclass
class HostRoundResult:
    """A host's share of a round, for the server to reduce (on the CPU)."""

    host: int
    uploads: object
    """The method's aggregator's partial result over the host's clients (``Aggregator.start`` .. ``leave_device``)."""
    personal_sums: object
    """The weighted sums of the clients' personal tensors (global and lodo protocols; None otherwise)."""
    client_metrics: dict[int, dict]
    """Each trained client's metrics (the method's, and the simulated clock's with client profiles)."""
    bytes_up: int
    """Bytes the clients uploaded for training."""
    bytes_up_eval: int = 0
    """Bytes of personal tensors gathered only to build the global evaluation model."""
    seconds: float = 0.0
    """Wall seconds the host spent training this round."""
    kept: list[int] = field(default_factory=list)
    """Buffered schedule: the folded or dropped clients whose new record differs from their initial
    one (stored on their owner; their later jobs train there)."""
    records_for_owner: dict[int, dict] = field(default_factory=dict)
    """Buffered schedule: such records of jobs this host trained for another host's client, on
    the CPU, for the driver to hand to the owner."""


# ----------------------------------------------------------------------------- buffered schedule

@dataclass
class TrainJobs:
    """The server's jobs for the hosts to train: those the next buffered step needs, before it;
    those it does not (they arrive after its K-th arrival whatever they take), after it, while the
    server aggregates (raysim.engine.timeline)."""

    jobs: list[tuple[int, int]]
    """(client, model version) pairs to train before the step, ascending by client."""
    payloads: list
    """Version -> its broadcast payload, one dict in a box (:func:`box`): one object-store object
    however many versions a window's jobs train from."""
    ahead: list[tuple[int, int]] = field(default_factory=list)
    """(client, model version) pairs to train after the step, ascending by client."""
    trainers: dict[int, int] = field(default_factory=dict)
    """Client -> the host that trains its job (raysim.engine.balance.job_trainers); absent: its
    owner, k mod H."""

    def hosts(self, num_hosts: int, ahead: bool = False) -> list[int]:
        """The hosts with a job to train before the step (``ahead``: after it), ascending."""
        return sorted({self.trainers.get(c, c % num_hosts) for c, _ in (self.ahead if ahead else self.jobs)})


@dataclass
class StepPlan:
    """A buffered server step as the timeline took it: which uploads fold, with which weight."""

    version: int
    """The model version the step produces."""
    time: float
    """Simulated seconds at the step."""
    folded: list[tuple[int, float, int, int]]
    """(client, staleness weight s(τ), τ, the version it trained from), in arrival order."""
    dropped: list[tuple[int, int]] = field(default_factory=list)
    """(client, τ) of arrivals staler than schedule.max_staleness, dropped."""
    trainers: dict[int, int] = field(default_factory=dict)
    """Client -> the host that trained its job and holds its upload (absent: its owner)."""
    in_flight: int = 0
    """Jobs still in flight after the step's arrivals left, before its dispatch."""
    dispatched: int = 0
    """Jobs dispatched at the step's time (from the version it produces)."""


@dataclass
class RoundSummary:
    """The server's account of a round: what the metrics log records and the callbacks receive."""

    round: int
    train_loss: float = math.nan
    """Mean training loss over the clients that reported one (nan if none did)."""
    clients: list[int] = field(default_factory=list)
    """The clients that reported metrics (ascending)."""
    client_metrics: dict[int, dict] = field(default_factory=dict)
    """Each client's metrics by client id."""
    bytes_up: int = 0
    """Bytes the round's clients uploaded."""
    bytes_down: int = 0
    """Bytes broadcast to the round's clients."""
    bytes_up_eval: int = 0
    """Bytes of personal tensors gathered only to build the global evaluation model."""
    server_metrics: dict[str, float] = field(default_factory=dict)
    """The method's own server-side numbers (``Method.server_metrics``)."""
    clock: dict[str, float] = field(default_factory=dict)
    """The simulated clock (client profiles): sim_round_s, completed, sampled; empty without profiles."""
    host_seconds: dict[int, float] = field(default_factory=dict)
    """Wall seconds each host spent training (by host id)."""
    records_for_owner: dict[int, dict] = field(default_factory=dict)
    """Buffered schedule: records of clients trained away from their owner, for the driver to
    hand to the owner before the next step (HostRoundResult.records_for_owner)."""
    next_jobs: "TrainJobs | None" = None
    """Buffered schedule: the jobs dispatched at this step's time, for the driver to hand to the
    hosts in the next step (None after the last step)."""


# ----------------------------------------------------------------------------- evaluation

@dataclass
class SplitScores:
    """One client's evaluation on one split: sums, so that clients pool by adding."""

    correct: int
    """Samples classified correctly."""
    loss_sum: float
    """Cross-entropy summed over the samples."""
    num_samples: int
    """Samples evaluated."""
    num_train: int
    """The client's training-set size (weights AVG_weighted)."""
