"""Server: holds the global state, selects the round's clients (the method's ``select``), reduces
the hosts' partial results with the method's aggregator (in host order: see
raysim.core.aggregation) and runs the method's server step.
"""
from __future__ import annotations

import math
import os

import numpy as np
import torch

from raysim.core.aggregation import WeightedMean
from raysim.core.contract import Method
from raysim.core.selection import STATE_KEY as SELECTION_KEY, SelectionContext, from_config as selection_from_config
from raysim.core.errors import UserError
from raysim.engine.balance import job_trainers
from raysim.engine.clock import device_time, read_trace
from raysim.engine.layout import host_layout
from raysim.engine.federation import ClientDomains, Federation
from raysim.engine.messages import HostRoundResult, LocalLosses, LossQuery, RoundSummary, StepPlan, TrainJobs, box
from raysim.engine import heap, wire
from raysim.engine.timeline import Timeline, buffered_schedule, schedule_kind
from raysim.core.buffered import BufferedUploads
from raysim.core.seeding import SERVER, rng_for
from raysim.core.stages import from_config as stages_from_config
from raysim.core.tensors import tensors_nbytes


BUFFERED_KEY = "buffered_schedule"  # where a checkpoint's server state keeps the timeline
# a window's plan that found its first step needing a job left to train after the last folds (the
# driver asks again once it trained) leaves no job to train then for this many windows
AHEAD_PAUSE = 8
STAGES_KEY = "stages"  # where a checkpoint's server state keeps the stages' state (the adaptive clip)


class Server:
    def __init__(self, cfg):
        self.cfg = cfg

    def start(self) -> dict:
        """Build data, partition and initial state. Not in __init__: an error raised there reaches
        the driver without its cause, and a user error must arrive as one clear line."""
        wire.install()  # its payloads leave as raw bytes (a no-op without Ray)
        heap.keep_freed_memory()  # a step reuses the pages the last one freed (a Ray actor on glibc)
        self.fed = Federation(self.cfg)
        self.method = self.fed.method
        # which clients train: the method's own select, or the selection it runs with (clients.selection)
        self.own_select = type(self.method).select is not Method.select
        self.selection = self.method.selection(selection_from_config(self.cfg.clients.selection))
        self.state = self._initial_state()
        self.n = self.fed.num_clients
        self.per_round = self._clients_per_round()
        # global / lodo protocols: the uniform mean of the last round's clients' personal tensors,
        # for the global model only (Method.global_eval_model); never broadcast for training
        self.personal_mean: dict[str, torch.Tensor] = {}
        trace = self.cfg.clients.profiles.trace
        self.online_by_round = trace_by_round(read_trace(trace), self.n) if trace else None
        self.availability = level_availability(self.fed.setup.client_profiles)
        self._answers, self._bytes_query = LocalLosses(), 0  # the round's loss query (the selection's)
        self._asked: tuple | None = None  # (context, candidates) between a selection's two phases
        # schedule.kind buffered: the simulated timeline (raysim.engine.timeline) and the global
        # tensors of every model version a client in flight trained from (its delta's base)
        buffered = schedule_kind(self.cfg, self.method) == "buffered"
        self.buffered = buffered_schedule(self.cfg, self.method, self.per_round,
                                          clocked=len(self.fed.setup.client_profiles) > 0,
                                          model=self.fed.initial_model() if buffered else None)
        if self.buffered is not None and self.buffered.concurrency > self.n:
            raise UserError(f"schedule.concurrency = {self.buffered.concurrency} but the federation has {self.n} clients")
        # buffered jobs of clients whose record is their initial one train on whichever host is least
        # loaded (raysim.engine.balance.job_trainers); runtime.balance: owner keeps every job home
        self.num_hosts = host_layout(self.cfg.runtime, self.n)[0]
        self.move_jobs = self.cfg.runtime.balance != "owner" and self.num_hosts > 1
        # privacy and compression (raysim.core.stages): the noise, the accountant, the adaptive clip
        self.stages = stages_from_config(
            self.cfg, self.method, population=self.n, buffered=self.buffered is not None,
            per_round=self.buffered.buffer if self.buffered is not None else self.per_round,
            always_available=self.availability is None and self.online_by_round is None)
        self.stage_state = self.stages.init_state() if self.stages is not None else {}
        if self.buffered is not None:
            # what every job transfers at least (its duration's lower bound, raysim.engine.timeline):
            # the broadcast's global tensors, whose shapes never change, and the method's upload floor
            # (none under compression, which sends less than the model)
            self.down_floor = tensors_nbytes(self.method.broadcast(self.state, 1)["global"])
            floor = self.method.upload_floor(self.fed.initial_model())
            self.up_floor = floor if self.stages is None or self.stages.compression is None else 0
            levels = self.fed.setup.client_profiles.level_profiles
            unprofiled = len(self.fed.setup.client_profiles) < self.n
            self.least_any = 0.0 if unprofiled else min((self._floor_seconds(p) for p in levels), default=0.0)
        self._reset_timeline()
        return self.describe()

    def _reset_timeline(self) -> None:
        self.timeline = self.buffered.timeline() if self.buffered is not None else None
        self.versions: dict[int, dict] = {}  # version -> its broadcast payload (CPU), while a job of it is in flight
        self.dispatches = 0
        self.unreported_down = 0  # bytes the jobs dispatched since the last step's summary downloaded
        self.training: set[int] = set()  # clients handed to the hosts to train after a step, durations not in yet
        self.pinned: set[int] = set()  # clients whose owner keeps a record other than their initial one
        self.trainers: dict[int, int] = {}  # client in flight -> the host that trains its job (absent: its owner)
        self.ahead_paused = 0  # windows left whose jobs all train before the next plan (scheduling only)

    def _initial_state(self) -> dict:
        """The method's initial server state, and the selection's where it keeps one."""
        state = self.method.init_server(self.fed.initial_model())
        kept = self.selection.init_state()
        return state if kept is None else {**state, SELECTION_KEY: kept}

    def _clients_per_round(self) -> int:
        cfg = self.cfg
        if cfg.clients_per_round is not None:
            if cfg.clients_per_round > self.n:
                raise UserError(f"clients_per_round = {cfg.clients_per_round} but the federation has "
                                f"{self.n} clients")
            return cfg.clients_per_round
        if cfg.fraction is not None:
            return max(1, int(round(cfg.fraction * self.n)))
        return self.n

    def describe(self) -> dict:
        """What the driver needs to know; ``client_domains`` (training clients, then the unseen
        ones) is a ClientDomains of a few runs, not a list of every client's domain."""
        partition = self.fed.partition
        domains = self.fed.setup.client_domains
        if self.fed.target is not None:
            domains = domains + ClientDomains.of(self.fed.target)
        return {"num_clients": self.n, "num_targets": self.fed.num_targets, "clients_per_round": self.per_round,
                "domains": list(self.fed.domains), "client_domains": domains,
                "buffered": self.buffered is not None, "model_bytes": getattr(self, "down_floor", 0),
                "privacy": (self.stages.privacy.describe(self.cfg.privacy.target_epsilon, self.cfg.rounds)
                            if self.stages is not None and self.stages.privacy is not None else None),
                "partition_notes": list(getattr(partition, "notes", ())),  # what the partition dropped
                "num_train": [partition.num_samples(c, "train") for c in range(min(self.n, 1000))]}

    # ------------------------------------------------------------------ round
    def sample(self, rnd: int, answers: LocalLosses | None = None) -> list[int] | LossQuery:
        """The round's clients (ascending) from those online (client profiles' availability): the
        method's own ``select``, or its selection (:mod:`raysim.core.selection`) in two phases.

        Where the selection needs the candidates' local losses, a :class:`LossQuery` first: the
        driver has the hosts answer it and calls again with their ``answers``; the selection then
        chooses, from the same generator."""
        if answers is None:  # the round's first call
            online = self.online(rnd)
            ctx = SelectionContext(round=rnd, online=online, m=self.per_round,
                                   rng=rng_for(self.cfg.seed, rnd, SERVER, "sample"), num_train=self._num_train)
            self._answers, self._bytes_query, self._asked = LocalLosses(), 0, None
            if self.own_select:
                return self._online_subset(rnd, online, self.method.select(self.state, ctx), "chose")
            candidates = self.selection.candidates(self.state.get(SELECTION_KEY), ctx)
            if candidates:
                candidates = [int(c) for c in candidates]
                self._online_subset(rnd, online, candidates, "asked for the local loss of")
                self._asked = (ctx, candidates)
                payload, personal, down = self._payloads(rnd, sorted(candidates), for_training=True)
                self._bytes_query = down
                return LossQuery(rnd, sorted(candidates), box(payload), personal)
            losses = {}
        else:
            if self._asked is None or self._asked[0].round != rnd:
                raise RuntimeError(f"answers for round {rnd} without its loss query")
            ctx, candidates = self._asked
            self._answers = answers
            losses = {c: answers.losses[c] for c in candidates}  # in the candidates' order
        chosen = self.selection.choose(self.state.get(SELECTION_KEY), ctx, losses)
        return self._online_subset(rnd, ctx.online, chosen, "chose")

    def _num_train(self, cid: int) -> int:
        return self.fed.partition.num_samples(int(cid), "train")

    def _online_subset(self, rnd: int, online, ids, what: str) -> list[int]:
        """``ids`` ascending, checked to be distinct clients online in round ``rnd`` (what a plugin's
        ``select`` returns or asks about); costs the ids, not the federation."""
        ids = sorted(int(c) for c in ids)
        twice = next((a for a, b in zip(ids, ids[1:]) if a == b), None)
        if isinstance(online, range):
            offline = next((c for c in ids if c not in online), None)
        else:
            arr = np.asarray(online, dtype=np.int64)
            pos = np.minimum(np.searchsorted(arr, ids), max(len(arr) - 1, 0))
            offline = next((c for c, p in zip(ids, pos.tolist()) if not len(arr) or arr[p] != c), None)
        if twice is not None or offline is not None:
            why = f"client {twice} twice" if twice is not None else f"client {offline}, not online"
            who = f"method {self.method.name}: select" if self.own_select else f"selection {self.selection.kind}:"
            raise UserError(f"{who} {what} {why} in round {rnd}")
        return ids

    def online(self, rnd: int):
        """Client ids online in round ``rnd`` (ascending): every client (a range) without profiles;
        else the availability trace's, or a draw keyed by (seed, round) against each client's
        level's availability (vectorised through the tier array: no per-client Python loop)."""
        if self.online_by_round is not None:
            return self.online_by_round.get(rnd, [])
        if self.availability is None:
            return range(self.n)
        u = rng_for(self.cfg.seed, rnd, SERVER, "available").random(self.n)
        return np.flatnonzero(u < self.availability[self.fed.setup.client_profiles.tiers])

    def open_round(self, rnd: int, answers: LocalLosses | None = None):
        """:meth:`sample`, then :meth:`broadcast` to the sampled clients: a round's first two steps
        in one call. Returns ``(client ids, payload box, personal refs)``, or sample's
        :class:`LossQuery` (the driver calls again with the answers)."""
        sampled = self.sample(rnd, answers)
        if isinstance(sampled, LossQuery):
            return sampled
        return (sampled, *self.broadcast(rnd, sampled))

    def broadcast(self, rnd: int, client_ids: list[int], for_training: bool = True):
        """ray.put the round's payload once; per-client payloads only when the method has them.

        Returns ``(payload box, {client_id: personal_ref})``: the payload's ref in a box
        (:func:`raysim.engine.messages.box`), the clients' own parts as refs inside a dict (which
        Ray passes on unresolved as well).
        """
        payload, personal, down = self._payloads(rnd, client_ids, for_training)
        if for_training:
            self._bytes_down = down
        return box(payload), personal

    def _payloads(self, rnd: int, client_ids: list[int], for_training: bool):
        """(the payload's ref, {client id: its own part's ref}, bytes sent to ``client_ids``)."""
        if for_training:
            payload = self._training_payload(rnd)
        else:
            payload = self.method.eval_payload(self.state, rnd)
            if self.personal_mean:
                payload = {**payload, "personal_mean": self.personal_mean}
        personal = {}
        down = tensors_nbytes(payload) * len(client_ids)
        for cid in client_ids:
            p = self.method.client_payload(self.state, cid, rnd)
            if p is not None:
                personal[cid] = _put(p)
                down += tensors_nbytes(p)
        return _put(payload), personal, down

    def _training_payload(self, rnd: int) -> dict:
        """The method's broadcast, plus what the client stages read (this round's clip)."""
        payload = self.method.broadcast(self.state, rnd)
        return {**payload, **self.stages.payload(self.stage_state)} if self.stages is not None else payload

    def aggregate(self, rnd: int, *host_results: HostRoundResult) -> RoundSummary:
        """Reduce the hosts' results of round ``rnd`` (in host order), run the method's server step,
        and sum the round up."""
        results = sorted(host_results, key=lambda r: r.host)
        uploads = self.method.aggregator.reduce([r.uploads for r in results])
        metrics = {c: m for r in results for c, m in r.client_metrics.items()}
        stage_metrics, released = {}, False
        if self.stages is not None:  # the round's updates -> the mean the method's step takes (noised under DP)
            uploads, self.stage_state, stage_metrics = self.stages.server_round(
                rnd, uploads if uploads.clients else None, self.state["global"], self.per_round, self.stage_state)
            released = self.stages.privacy is not None  # DP releases the noisy sum even with no client
        if uploads.clients or released:  # the contract: aggregate only with uploads (all dropped: the state stays)
            self.state = self.method.aggregate(self.state, uploads, rnd)
            if SELECTION_KEY in self.state:  # the selection learns the aggregated clients' training losses
                losses = {int(c): metrics[c]["loss"] for c in uploads.clients if "loss" in metrics.get(c, {})}
                self.state = {**self.state, SELECTION_KEY: self.selection.observe(self.state[SELECTION_KEY], losses)}
        gathered = [r.personal_sums for r in results if r.personal_sums is not None]
        if gathered:
            self.personal_mean = WeightedMean().reduce(gathered).mean
        clients = sorted(metrics)
        losses = [metrics[c]["loss"] for c in clients if "loss" in metrics[c]]
        clock = {}
        if any("completed" in m for m in metrics.values()):  # the round lasts as long as its slowest finisher
            done = [m["sim_seconds"] for m in metrics.values() if m.get("completed")]
            late = any(m.get("dropped_deadline") for m in metrics.values())
            clock = {"sim_round_s": self.cfg.clients.deadline_s if late else max(done, default=0.0),
                     "completed": float(len(done)), "sampled": float(len(metrics))}
            asked = getattr(self, "_answers", None)
            if asked is not None and asked.sim_seconds:  # losses asked first: the slowest answer, then training
                select_s = max(asked.sim_seconds.values())
                clock.update(sim_round_s=select_s + clock["sim_round_s"], sim_select_s=select_s,
                             queried=float(len(asked.sim_seconds)))
        return RoundSummary(round=rnd, clients=clients, train_loss=float(np.mean(losses)) if losses else math.nan,
                            client_metrics=metrics, bytes_up=sum(r.bytes_up for r in results),
                            bytes_up_eval=sum(r.bytes_up_eval for r in results),
                            server_metrics={**self.method.server_metrics(self.state),
                                            **stage_metrics_of(self.stages, rnd, stage_metrics)}, clock=clock,
                            bytes_down=getattr(self, "_bytes_down", 0) + getattr(self, "_bytes_query", 0),
                            host_seconds={r.host: r.seconds for r in results})

    # ------------------------------------------------------------------ buffered schedule
    def dispatch(self) -> TrainJobs:
        """Fill the free slots at the timeline's time (:meth:`_fill_slots`) and return every job in
        flight whose duration is unknown (the new ones; after a restore, all), with their versions'
        payloads: the first step's, and the first after a restore (later ones come with the
        aggregate of the window before)."""
        tl = self.timeline
        dispatched = self._fill_slots()
        if dispatched:
            self._payload_for(tl.version, dispatched)
        return self._jobs_to_train()

    def _fill_slots(self) -> int:
        """Dispatch the free slots at the timeline's time from the clients online then and not in
        flight (a uniform draw keyed by the dispatch's count), from the current version; returns how
        many. Only durations and availability decide it, never the model, so a window plans it
        before the steps it follows are aggregated."""
        tl, slot_s = self.timeline, self.buffered.slot_s
        if not tl.free_slots:
            return 0
        self.dispatches += 1
        rng = rng_for(self.cfg.seed, self.dispatches, SERVER, "sample")
        while True:
            online = np.asarray(self.online(int(tl.now // slot_s) + 1), dtype=np.int64)
            if tl.in_flight:
                online = online[~np.isin(online, np.fromiter(tl.in_flight, np.int64))]
            if len(online) or tl.in_flight:
                break
            if self.online_by_round is not None and tl.now // slot_s + 1 > max(self.online_by_round, default=0):
                raise UserError(f"no client is online after slot {int(tl.now // slot_s)} of the availability "
                                f"trace ({slot_s} s each) and none is in flight: the buffered federation cannot go on")
            tl.now = (tl.now // slot_s + 1) * slot_s  # nobody online, nothing in flight: the next slot
        take = min(tl.free_slots, len(online))
        ctx = SelectionContext(round=self.dispatches, online=online, m=take, rng=rng, num_train=self._num_train)
        chosen = online.tolist() if take == len(online) else self.selection.choose(None, ctx, {})
        tl.dispatch(chosen, [self._least_seconds(c) for c in chosen])
        if self.move_jobs:
            self.trainers.update(job_trainers(chosen, self.pinned, self.num_hosts))
        return len(chosen)

    def _payload_for(self, version: int, dispatched: int) -> None:
        """Version ``version``'s payload, built from the state now (right after its step), and the
        downloads of the ``dispatched`` jobs of it, reported with the next step (jobs trained again
        after a restore downloaded before it)."""
        if version not in self.versions:
            self.versions[version] = self._training_payload(version + 1)
        self.unreported_down += dispatched * tensors_nbytes(self.versions[version])

    def _jobs_to_train(self, steps_left: int | None = None) -> TrainJobs:
        """Every untrained job in flight not already handed to a host, with its version's payload
        (one object for all of them): to train before the next window's plan, those that could
        arrive before any job dispatched from now on could and, with ``steps_left`` server steps
        to go, among the arrivals those steps fold; the others (in steady state the last step's
        dispatch) after its folds, while the server aggregates, unless the next window ends the run
        (then they would train for nothing). They cannot shorten the next window, which stops
        before any untrained job could arrive (:meth:`plan`); where its first step needs one of
        them after all, the plan is empty and they train before the next."""
        tl = self.timeline
        horizon = tl.now + self.least_any  # no job dispatched from now on arrives before it
        jobs = [(c, tl.in_flight[c].version) for c in tl.waiting_on if c not in self.training]
        needed = {c for c, _ in jobs if tl.earliest_arrival(c) < horizon}
        if steps_left is not None:  # the run's last steps fold steps_left x K arrivals, no more
            needed &= set(tl.likely((steps_left - 1) * tl.buffer))  # likely() adds one step's K itself
        if self.ahead_paused or len(tl.in_flight) - (len(jobs) - len(needed)) < tl.buffer:
            needed = {c for c, _ in jobs}  # the others cannot make a step, or lately could not
        self.ahead_paused = max(0, self.ahead_paused - 1)
        self.training.update(c for c, _ in jobs if c not in needed)
        payloads = box(_put({v: self.versions[v] for v in sorted({v for _, v in jobs})}))
        return TrainJobs([j for j in jobs if j[0] in needed], payloads, [j for j in jobs if j[0] not in needed],
                         trainers={c: self.trainers[c] for c, _ in jobs if c in self.trainers})

    def _least_seconds(self, client: int) -> float:
        """A lower bound of a job's simulated duration: the transfer of its model's download and of
        the least its method's upload sends (``Method.upload_floor``; the clock adds compute), at
        its bandwidths, a hair under (the timeline refuses a job that takes less); nothing where the
        client's device may not hold the model: it arrives at once."""
        return self._floor_seconds(self.fed.profile(client))

    def _floor_seconds(self, profile: dict) -> float:
        if "memory_mb" in profile:
            return 0.0
        return device_time(profile, 0.0, self.down_floor, self.up_floor)[1] * (1 - 1e-9)

    def plan(self, rnd: int, max_steps: int, since: float, *trained: tuple[dict[int, float], list[int]]) -> list[StepPlan]:
        """Record the trained jobs' simulated durations (and the clients whose record they changed:
        from now on they train on their owner), then take server steps ``rnd``, ``rnd + 1``, ... (at
        most ``max_steps``) while every arrival a step needs is known: which clients fold with which
        staleness weight, which are dropped, and after each step but the run's last the free slots
        dispatched at its time. It stops after a step that crosses an ``eval.every_s`` boundary
        (``since``: the simulated time at the last step) or reaches ``stop.sim_hours``, where the
        driver evaluates or stops. The steps are those one call per step would take."""
        tl = self.timeline
        for durations, changed in trained:
            for c, seconds in sorted(durations.items()):
                tl.trained(int(c), seconds)
                self.training.discard(int(c))
            self.pinned.update(int(c) for c in changed)
        plans, s = [], self.buffered.staleness
        for r in range(rnd, rnd + max_steps):
            if tl.needed():  # the next step needs a job that has not trained (one this window dispatched)
                if not plans:  # one left to train after the last window's folds: none for a while
                    self.ahead_paused = AHEAD_PAUSE
                break
            step = tl.step()
            arrived = [a.job.client for a in step.folded + step.dropped]
            plan = StepPlan(version=step.version, time=step.time,
                            folded=[(a.job.client, s.weight(a.staleness), a.staleness, a.job.version)
                                    for a in step.folded],
                            dropped=[(a.job.client, a.staleness) for a in step.dropped],
                            trainers={c: self.trainers.pop(c) for c in arrived if c in self.trainers},
                            in_flight=len(tl.in_flight))
            plan.dispatched = self._fill_slots() if r < self.cfg.rounds else 0
            plans.append(plan)
            if self._evaluated_after(since, step.time):
                break
            since = step.time
        return plans

    def _evaluated_after(self, before: float, now: float) -> bool:
        """Whether the driver evaluates (or stops) after a step at ``now`` by the simulated clock."""
        every_s, hours = self.cfg.eval.every_s, self.cfg.stop.sim_hours
        return (every_s is not None and now // every_s > before // every_s) or (hours is not None and now >= hours * 3600)

    def aggregate_buffered(self, rnd: int, plans: list[StepPlan], *host_results: list[HostRoundResult]) -> list[RoundSummary]:
        """Server steps ``rnd``, ``rnd + 1``, ... of a window (:meth:`plan`), each the method's
        ``buffered_step`` over the hosts' folded deltas (raysim.core.buffered) and the payload of the
        version its dispatch trains from; then the versions no job in flight needs are dropped. Unless
        the window ended the run, the last summary carries the jobs to train next, so the next
        window needs no call of its own to learn them."""
        summaries = [self._aggregate_step(rnd + i, plan, [r[i] for r in host_results]) for i, plan in enumerate(plans)]
        live = {j.version for j in self.timeline.in_flight.values()}
        self.versions = {v: p for v, p in self.versions.items() if v in live}
        if summaries and rnd + len(plans) - 1 < self.cfg.rounds:
            summaries[-1].next_jobs = self._jobs_to_train(steps_left=self.cfg.rounds - (rnd + len(plans) - 1))
        return summaries

    def _aggregate_step(self, rnd: int, plan: StepPlan, host_results: list[HostRoundResult]) -> RoundSummary:
        results = sorted(host_results, key=lambda r: r.host)
        reduced = self.method.aggregator.reduce([r.uploads for r in results])
        metrics = {c: m for r in results for c, m in r.client_metrics.items()}
        moved_records = {c: rec for r in results for c, rec in r.records_for_owner.items()}
        self.pinned.update(c for r in results for c in r.kept)
        stage_metrics = {}
        if reduced.clients:
            mean = reduced.mean
            if self.stages is not None:  # the folded deltas' sum noised under DP
                mean, self.stage_state, stage_metrics = self.stages.server_buffered(rnd, reduced, self.stage_state,
                                                                                    self.buffered.buffer)
            uploads = BufferedUploads(mean=mean, weight=reduced.total_weight, clients=reduced.clients,
                                      staleness={c: tau for c, _, tau, _ in plan.folded},
                                      staleness_weights={c: s for c, s, _, _ in plan.folded},
                                      bases={c: self.versions[v]["global"] for c, _, _, v in plan.folded})
            self.state = self.method.buffered_step(self.state, uploads, rnd)
        clients = sorted(metrics)
        losses = [metrics[c]["loss"] for c in clients if "loss" in metrics[c]]
        taus = [tau for _, _, tau, _ in plan.folded]
        clock = {"sim_time": plan.time, "folded": float(len(plan.folded)), "dropped_stale": float(len(plan.dropped)),
                 "staleness_mean": float(np.mean(taus)) if taus else math.nan,
                 "staleness_max": float(max(taus, default=0)), "in_flight": float(plan.in_flight)}
        bytes_down, self.unreported_down = self.unreported_down, 0  # this step's; its dispatch's are the next's
        if plan.dispatched:
            self._payload_for(plan.version, plan.dispatched)
        return RoundSummary(round=rnd, clients=clients, train_loss=float(np.mean(losses)) if losses else math.nan,
                            client_metrics=metrics, bytes_up=sum(r.bytes_up for r in results),
                            server_metrics={**self.method.server_metrics(self.state),
                                            **stage_metrics_of(self.stages, rnd, stage_metrics)}, clock=clock,
                            bytes_down=bytes_down, host_seconds={r.host: r.seconds for r in results},
                            records_for_owner=moved_records)

    # ------------------------------------------------------------------ checkpoints and recovery
    def ping(self) -> bool:
        return True

    def ready(self) -> dict:
        """Where the server runs: its process id (what a chaos test kills) and Ray node (which a
        replacement avoids)."""
        import ray
        node = {"node_id": ray.get_runtime_context().get_node_id()} if ray.is_initialized() else {}
        return {"pid": os.getpid(), **node}

    def export_state(self) -> dict:
        """The server's state; a buffered schedule's adds its timeline and in-flight versions, the
        stages' their state (the adaptive clip's C)."""
        state = self.state
        if self.stage_state:
            state = {**state, STAGES_KEY: self.stage_state}
        if self.timeline is None:
            return state
        return {**state, BUFFERED_KEY: {"timeline": self.timeline.export(), "versions": self.versions,
                                        "dispatches": self.dispatches, "unreported_down": self.unreported_down,
                                        "pinned": sorted(self.pinned),
                                        "trainers": self.trainers}}

    def load_state(self, state: dict) -> None:
        """A checkpoint's state. A buffered schedule's jobs in flight lost their uploads with the
        hosts that held them: their durations are forgotten, so they train again (their draws are
        keyed: the same uploads) before the next step."""
        state = dict(state)
        kept = state.pop(BUFFERED_KEY, None)
        self.stage_state = state.pop(STAGES_KEY, self.stages.init_state() if self.stages is not None else {})
        self.state = state
        if kept is not None:
            data = dict(kept["timeline"], durations=[])
            self.timeline = Timeline.restore(data)
            self.versions = {int(v): p for v, p in kept["versions"].items()}
            self.dispatches = int(kept["dispatches"])
            self.unreported_down = int(kept.get("unreported_down", 0))
            self.training = set()
            self.pinned = {int(c) for c in kept.get("pinned", ())}
            self.trainers = {int(c): int(h) % self.num_hosts for c, h in kept.get("trainers", {}).items()}
            if "pinned" not in kept:  # a checkpoint from before job_trainers: its owners may hold any record
                self.move_jobs = False

    def reset(self) -> None:
        """Back to round 0: the initial global state (reproducible from the config alone)."""
        self.state = self._initial_state()
        self.stage_state = self.stages.init_state() if self.stages is not None else {}
        self._reset_timeline()


def stage_metrics_of(stages, rnd: int, metrics: dict) -> dict:
    """The privacy spent after ``rnd`` server steps (ε at δ) and the stages' own numbers (none
    without a ``privacy:`` section)."""
    p = stages.privacy if stages is not None else None
    if p is None:
        return {}
    return {**metrics, "epsilon": stages.spent.after(rnd), "noise_multiplier": p.noise_multiplier}


def level_availability(profiles):
    """Each level's availability (a numpy array indexed by tier), or None when every level that
    has clients is always online (then nobody is drawn)."""
    availability = np.array([p.get("availability", 1.0) for p in profiles.level_profiles], dtype=np.float64)
    in_use = np.bincount(profiles.tiers, minlength=availability.size) > 0
    return availability if (availability[in_use] < 1).any() else None


def trace_by_round(trace: set[tuple[int, int]], num_clients: int) -> dict[int, list[int]]:
    """Round -> the training clients an availability trace has online then (ascending)."""
    by_round: dict[int, list[int]] = {}
    for client, rnd in trace:
        if 0 <= client < num_clients:
            by_round.setdefault(rnd, []).append(client)
    return {rnd: sorted(clients) for rnd, clients in by_round.items()}


def _put(obj):
    """Into the object store (hosts fetch it from there), or as is without Ray (InProcess)."""
    import ray
    return ray.put(obj) if ray.is_initialized() else obj
