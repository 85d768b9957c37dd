"""ClientHost: one Ray actor that hosts a fixed shard of virtual clients.

It loads its clients' data partitions once, keeps one model instance that every client's step
reuses, keeps each client's persistent state between rounds (spilling idle ones to disk), and
folds its clients' uploads with the method's aggregator into one partial result per round. Its
clients' evaluation is :mod:`raysim.engine.evaluation`'s; their simulated clock (client profiles)
:class:`raysim.engine.clock.ClientClock`'s; what it returns, :mod:`raysim.engine.messages`'.

A client's stored record is ``{"state": what the method keeps, "trained": the model as it left
training}`` ("trained" only with ``eval.point: post_train``): the engine never writes into the
method's state.
"""
from __future__ import annotations

import copy
import math
import os
import time
from collections import OrderedDict
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from raysim.core.aggregation import WeightedMean
from raysim.models.dropout import dropout_generator
from raysim.engine.clock import ClientClock
from raysim.core.contract import ClientContext, Method, Upload
from raysim.engine.clientdata import ClientViews, device_budget, keep_on_device
from raysim.engine.cohort import CohortClient, auto_cohort_size, cohort_ready, run_cohort
from raysim.engine.compute import ComputeMeter
from raysim.engine.determinism import configure as configure_determinism
from raysim.engine.evaluation import Evaluator
from raysim.engine.federation import Federation
from raysim.core.training import evaluate
from raysim.engine.messages import (HostRoundResult, LocalLosses, SplitScores, StepPlan, TrainedClients, TrainJobs,
                                    client_payload, unbox)
from raysim.core.buffered import delta_upload, staleness_scaled
from raysim.core.seeding import generator_for
from raysim.core.stages import RESIDUAL_KEY, from_config as stages_from_config, residual_on
from raysim.engine import heap, wire
from raysim.engine.store import ClientStateStore, same_record, state_nbytes
from raysim.core.tensors import keep_state_on, load_tensors, tensors_nbytes, to_device


def pick_device(gpu_ids) -> torch.device:
    """The GPU Ray assigned to this actor when torch can see one, the CPU otherwise."""
    if gpu_ids and torch.cuda.is_available():
        return torch.device("cuda", 0)  # Ray sets CUDA_VISIBLE_DEVICES to the assigned GPU(s)
    return torch.device("cpu")


# A host keeps at most this many clients' data views (index arrays into the dataset, or shard
# arrays). Hosts with fewer clients load them all at start; a host of 50,000 registered
# cross-device clients builds a client's view when it is first sampled, so start-up time and
# memory grow with the clients that train, not with the clients that are registered.
DATA_CACHE_CLIENTS = 4096


class ClientDataCache:
    """Client id -> ClientViews, built on first use; the least recently used beyond ``limit`` are
    dropped (a view is a pure function of the partition, so rebuilding it gives the same data)."""

    def __init__(self, build, limit: int):
        self._build, self._limit = build, max(1, int(limit))
        self._items: OrderedDict[int, ClientViews] = OrderedDict()

    def __getitem__(self, cid: int) -> ClientViews:
        data = self._items.get(cid)
        if data is None:
            data = self._items[cid] = self._build(cid)
            if len(self._items) > self._limit:
                self._items.popitem(last=False)
        else:
            self._items.move_to_end(cid)
        return data

    def __contains__(self, cid: int) -> bool:
        return cid in self._items

    def __len__(self) -> int:
        return len(self._items)


@dataclass
class PartialRound:
    """A host's running result of a round, from its first :meth:`ClientHost.train_clients` of the
    round to :meth:`ClientHost.end_round` (which turns it into a HostRoundResult)."""

    round: int
    payload: dict | None
    """The round's payload, on the host's device (loaded into every client's model from there)."""
    uploads: object
    """The method's aggregator's partial result, on the device (``Aggregator.start``)."""
    personal_sums: object
    """Weighted sums of the clients' personal tensors, for the global model (None: not gathered)."""
    client_metrics: dict[int, dict] = field(default_factory=dict)
    bytes_up: int = 0
    clients: int = 0
    """Clients handed to this host this round (dropped ones included)."""
    seconds: float = 0.0


class ClientHost:
    def __init__(self, host_id: int, cfg, num_hosts: int, gpu_ids=None):
        self.host_id, self.cfg, self.num_hosts, self._gpu_ids = host_id, cfg, num_hosts, gpu_ids
        self._trained = False  # whether a train_clients call ran yet (the first one holds the warm-up)

    def start(self) -> dict:
        """Load the clients' data and build the model (outside __init__ so errors keep their cause).

        The host derives its clients (k with k mod H = host id) from the federation it builds, so
        it needs nothing from the server and starts while the server loads the data too."""
        host_id, cfg, gpu_ids = self.host_id, self.cfg, self._gpu_ids
        wire.install()  # its partial sums and records leave as raw bytes (a no-op without Ray)
        heap.keep_freed_memory()  # a window reuses the pages the last one freed (a Ray actor on glibc)
        rt = cfg.runtime
        threads = rt.torch_threads or max(1, int(rt.cpus_per_host))
        torch.set_num_threads(threads)
        configure_determinism(rt.deterministic)  # before the model and data reach the device
        self.device = pick_device(gpu_ids if gpu_ids is not None else _ray_gpu_ids())
        self.fed = Federation(cfg)
        self.client_ids = range(host_id, self.fed.num_clients + self.fed.num_targets, self.num_hosts)
        self.method = self.fed.method
        # privacy and compression (raysim.core.stages): the client side, run in the fold
        self.stages = stages_from_config(cfg, self.method, population=self.fed.num_clients, per_round=1,
                                         account=False)
        self.model = self.fed.initial_model().to(self.device)
        self._init_sd = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        # a new client's start (_training_record): the contract's own two steps read the initial
        # model's personal tensors only, and the payload's shared ones must cover the rest
        personal = set(self.method.personal_keys(self.model))
        self._init_personal = {k: v for k, v in self._init_sd.items() if k in personal}
        self._shared_keys = set(self._init_sd) - personal
        # global / lodo protocols: the server builds the global model with the mean of the clients'
        # personal tensors (what the broadcast lacks), so the hosts gather them after training
        self._gather_personal = cfg.eval.protocol != "personalized"
        self._personal_keys = sorted(self.method.personal_keys(self.model)) if self._gather_personal else []
        # client system profiles drive a simulated clock (raysim.core.tiers); none: no clock rows
        self.clock = ClientClock(self.model, self.fed.image_shape, self.fed.profile, self.method.client_footprint,
                                 cfg.clients.deadline_s) if self.fed.setup.client_profiles else None
        self._clocked = self.clock is not None
        # runtime.device_data_mb: clients' data kept on the GPU once loaded (None on CPU or at 0)
        self.device_budget = device_budget(self.device, rt.device_data_mb)
        self.data = ClientDataCache(self._client_data, DATA_CACHE_CLIENTS)
        if len(self.client_ids) <= DATA_CACHE_CLIENTS:  # cross-silo: load every client now (errors at start)
            for cid in self.client_ids:
                self.data[cid]
        spill = os.path.join(rt.spill_dir, f"host-{host_id}") if rt.spill_dir else None
        # runtime.device_state_mb: clients' stored state kept on the GPU between rounds (0, or on CPU: none)
        self._state_device = self.device if self.device.type != "cpu" and rt.device_state_mb > 0 else None
        self.store = ClientStateStore(rt.state_memory_mb * 2**20, spill,
                                      device_budget_bytes=rt.device_state_mb * 2**20 if self._state_device else 0)
        self._partial: PartialRound | None = None  # the round's running result (train_clients .. end_round)
        # buffered schedule: each trained job in flight, (its delta upload, its client's new record,
        # metrics, bytes sent), until the server step that folds (or drops) it; the record is stored
        # only then, so a checkpoint between holds the record the job trained from
        self._jobs: dict[int, tuple] = {}
        self._payloads = None  # (key, the last window's payloads by version, those moved to the device)
        self.evaluator = Evaluator(cfg, self.fed, self.model, self._init_sd, self.data, self.device, self._record)
        return self.ready()

    def _client_data(self, cid: int) -> ClientViews:
        # from the dataset, or from the client's own shard (data.shards)
        return keep_on_device(self.fed.client_data(cid), self.device_budget)

    def ready(self) -> dict:
        return {"host": self.host_id, "clients": len(self.client_ids), "device": str(self.device),
                "threads": torch.get_num_threads(), "pid": os.getpid(), "niceness": os.nice(0), **_node()}

    # ------------------------------------------------------------------ state
    def _record(self, cid: int) -> dict:
        """The client's stored record; a client's first one holds its initial state."""
        return self._initial_record(cid, self.store.get(cid))

    def _training_record(self, cid: int, moved, payload: dict) -> dict:
        """The record a client trains from this round: its owner's stored one (``moved``: the
        records its owner exported), or its initial one. For the initial one the whole initial
        model is loaded only where something could read more of it than the personal tensors:
        with the contract's own ``init_client_state`` (it reads those) and ``load_client_model``
        (it then overwrites the payload's shared tensors and the personal ones), and a payload whose
        shared tensors cover the rest of the model, nothing does (D: 0.1 ms a new client)."""
        return self._start_record(cid, self.store.get(cid) if moved is None else moved.get(cid), payload)

    def _start_record(self, cid: int, record: dict | None, payload: dict) -> dict:
        """``record``, or (None) the client's initial one, built as :meth:`_training_record` says."""
        if record is None and self._contract_start and self._shared_keys <= payload.get("global", {}).keys():
            load_tensors(self.model, self._init_personal)
            return {"state": self.method.init_client_state(cid, self.model)}
        return self._initial_record(cid, record)

    @property
    def _contract_start(self) -> bool:
        """Whether the method starts a client with the contract's own ``init_client_state`` and
        ``load_client_model``."""
        cls = type(self.method)
        return cls.init_client_state is Method.init_client_state and cls.load_client_model is Method.load_client_model

    def _initial_record(self, cid: int, record: dict | None) -> dict:
        """``record``, or (None: the client has no state yet) its initial one."""
        if record is None:
            load_tensors(self.model, self._init_sd)  # load_state_dict's values, without its per-module walk
            record = {"state": self.method.init_client_state(cid, self.model)}
        return record

    def _context(self, cid: int, rnd: int, payload: dict, state: dict) -> ClientContext:
        train = self.cfg.train
        return ClientContext(
            client_id=cid, domain=self.fed.domain(cid), round=rnd, model=self.model,
            payload=payload, state=state, data=self.data[cid].for_method(), train=train,
            lr=train.lr * train.lr_decay ** (rnd - 1),
            generator=generator_for(self.cfg.seed, rnd, cid, "train"), device=self.device,
            profile=self.fed.profile(cid))

    # ------------------------------------------------------------------ a round
    def train_round(self, rnd: int, payload_box: list, client_ids: list[int], personal_boxes: dict | None = None):
        """Run the local step of each listed client (ascending id) and return the host's partial
        result: :meth:`train_clients` then :meth:`end_round`, for a round without balancing."""
        self.train_clients(rnd, payload_box, client_ids, personal_boxes)
        return self.end_round(rnd)

    def train_clients(self, rnd: int, payload_box: list, client_ids: list[int], personal_boxes: dict | None = None,
                      moved_records: list | None = None) -> TrainedClients:
        """Train some of the round's clients (ascending id), folding their uploads into the host's
        partial result of the round (returned by :meth:`end_round`).

        ``payload_box``: the round's payload in a box (:func:`raysim.engine.messages.box`).
        ``moved_records``: the listed clients are owned by another host (work stealing): each
        trains from its record in the box ``moved_records`` (a ref to ``{client id: record}`` from the
        owner's :meth:`export_records`; a client missing there has no state yet) and its new record
        comes back in the result's ``records_for_owner``, instead of staying here."""
        t0 = time.perf_counter()
        partial = self._round_partial(rnd, payload_box)
        personal_boxes = personal_boxes or {}
        moved = None
        if moved_records is not None:
            moved = unbox(moved_records) or {}
        out = TrainedClients(host=self.host_id, first=not self._trained)
        self._trained = True
        cohort = self._cohort_size(len(client_ids))
        if cohort > 1:  # runtime.cohort_size: the clients in cohorts, each as it would train alone
            self._train_cohorts(rnd, partial, sorted(client_ids), personal_boxes, moved, out, cohort)
        else:
            for cid in sorted(client_ids):
                mine = client_payload(partial.payload, personal_boxes.get(cid), self.device)
                if self._clocked and not self._fits(cid, partial):
                    continue
                # what the step keeps (cpu_copy) stays on the device within runtime.device_state_mb,
                # unless the record goes back to its owner host (work stealing)
                with keep_state_on(self._state_device if moved is None else None):
                    record = self._training_record(cid, moved, mine)
                    self.method.load_client_model(self.model, mine, record["state"])
                    ctx = self._context(cid, rnd, mine, record["state"])
                    with ComputeMeter() if self._clocked else nullcontext() as meter, \
                            dropout_generator(generator_for(self.cfg.seed, rnd, cid, "dropout", self.device)):
                        up = self.method.local_update(ctx)
                    record = self._next_record(record, ctx)
                self._fold(partial, out, cid, record, up, meter.macs if self._clocked else None, mine, moved)
        partial.clients += len(client_ids)
        out.seconds = time.perf_counter() - t0
        partial.seconds += out.seconds
        return out

    def _next_record(self, previous: dict, ctx: ClientContext) -> dict:
        """A trained client's new record: the state its step left, the stages' residual it trained
        with (replaced when its upload goes through them), and with ``eval.point: post_train`` the
        model as it left training (evaluated before aggregation)."""
        record = {"state": ctx.state}
        if RESIDUAL_KEY in previous:
            record[RESIDUAL_KEY] = previous[RESIDUAL_KEY]
        if self.cfg.eval.point == "post_train":
            record["trained"] = self.method.post_train_state(ctx)
        return record

    def _staged(self, rnd: int, cid: int, record: dict, up: Upload, mine: dict, moved) -> tuple[Upload, int]:
        """(the upload after the client stages, the bytes it sends); the client's new error-feedback
        residual into its record (on the host's state device unless the record travels)."""
        if self.stages is None:
            return up, upload_nbytes(up)
        staged = self.stages.client(rnd, cid, up, mine["global"], mine, record.get(RESIDUAL_KEY))
        if staged.residual is not None:
            record[RESIDUAL_KEY] = residual_on(staged.residual, self._state_device if moved is None else None)
        return Upload(staged.tensors, staged.weight, metrics={**up.metrics, **staged.metrics},
                      statistics=staged.statistics), staged.bytes

    def _fits(self, cid: int, partial: PartialRound) -> bool:
        """Whether the client's memory holds the model it would train (clocked runs); if not, its
        metrics say it was dropped."""
        if self.clock.fits(cid):
            return True
        partial.client_metrics[cid] = ClientClock.dropped_metrics()  # it cannot train this model
        return False

    def _fold(self, partial: PartialRound, out: TrainedClients, cid: int, record: dict, up: Upload, macs,
              mine: dict, moved) -> None:
        """A trained client's record stored (or sent back to its owner), its metrics and clock, and
        its upload folded into the host's partial result (the model still holds what it trained)."""
        up, sent = self._staged(partial.round, cid, record, up, mine, moved)
        if moved is None:
            self.store.put(cid, record)
        else:
            out.records_for_owner[cid] = record
        out.state_bytes[cid] = state_nbytes(record)
        out.examples[cid] = self.data[cid].num_train
        metrics = partial.client_metrics[cid] = dict(up.metrics)
        partial.bytes_up += sent
        if self._clocked:
            metrics.update(self.clock.round_metrics(cid, macs, tensors_nbytes(mine), sent))
            if metrics["dropped_deadline"]:
                return  # dropped from the aggregate: the server stopped waiting at the deadline
        self.method.aggregator.add(partial.uploads, cid, up)
        if partial.personal_sums is not None:  # for the global model only (Method.global_eval_model)
            sd = self.model.state_dict()
            WeightedMean().add(partial.personal_sums, cid, Upload({k: sd[k] for k in self._personal_keys}, 1.0))

    def _cohort_size(self, n: int) -> int:
        """How many clients train at once (runtime.cohort_size): 0 where the method keeps the
        per-client path (no ``local_loss``) or cohorts are off."""
        k = self.cfg.runtime.cohort_size
        if not k or not cohort_ready(self.method):
            return 0
        if k == "auto":
            k = auto_cohort_size(self.model, self.device, self.cfg.train.batch_size, self.fed.image_shape)
        return min(int(k), n)

    def _train_cohorts(self, rnd: int, partial: PartialRound, ids: list[int], personal_boxes: dict, moved,
                       out: TrainedClients, size: int) -> None:
        """The listed clients in cohorts of ``size`` (consecutive in ascending id), each trained,
        stored, clocked and folded exactly as on the per-client path (raysim.engine.cohort)."""
        todo = []
        for cid in ids:
            mine = client_payload(partial.payload, personal_boxes.get(cid), self.device)
            if self._clocked and not self._fits(cid, partial):
                continue
            partial.client_metrics[cid] = {}  # its place in the metrics' order, as on the per-client path
            todo.append((cid, mine))
        for first in range(0, len(todo), size):
            chunk = todo[first:first + size]
            mines = {cid: mine for cid, mine in chunk}
            previous = {}  # each client's record as it started
            clients = []
            for cid, mine in chunk:
                def start(cid=cid, mine=mine):
                    record = self._training_record(cid, moved, mine)
                    previous[cid] = record
                    self.method.load_client_model(self.model, mine, record["state"])
                    return self._context(cid, rnd, mine, record["state"])
                clients.append(CohortClient(start, generator_for(self.cfg.seed, rnd, cid, "dropout", self.device)))

            def after(ctx, up, macs):
                record = self._next_record(previous.pop(ctx.client_id), ctx)
                self._fold(partial, out, ctx.client_id, record, up, macs, mines[ctx.client_id], moved)

            with keep_state_on(self._state_device if moved is None else None):
                run_cohort(self.method, self.model, clients, after, meter=self._clocked)

    def _round_partial(self, rnd: int, payload_box: list) -> PartialRound:
        """The host's running result of round ``rnd`` (begun by its first :meth:`train_clients`).
        The round's payload goes to the host's device here, once per round: every client's model
        is loaded from that copy, device to device."""
        partial = self._partial
        if partial is None or partial.round != rnd:
            payload = to_device(unbox(payload_box), self.device, what="payload")
            partial = self._partial = self._new_partial(rnd, payload, gather_personal=bool(self._personal_keys))
        return partial

    def _new_partial(self, rnd: int, payload, gather_personal: bool) -> PartialRound:
        return PartialRound(round=rnd, payload=payload, uploads=self.method.aggregator.start(),
                            personal_sums=WeightedMean().start() if gather_personal else None)

    def end_round(self, rnd: int) -> HostRoundResult:
        """The host's partial result of round ``rnd`` (the method's aggregator), its clients' metrics
        and the bytes they sent; an empty partial when it trained nobody this round."""
        partial = self._partial
        self._partial = None
        if partial is None or partial.round != rnd:  # nobody trained here this round
            partial = self._new_partial(rnd, None, gather_personal=False)
        eval_bytes = partial.clients * sum(self._init_sd[k].numel() * self._init_sd[k].element_size()
                                           for k in self._personal_keys)
        # one device-to-CPU transfer of the host's result (the server reduces on the CPU)
        uploads = self.method.aggregator.leave_device(partial.uploads)
        personal_sums = None if partial.personal_sums is None else WeightedMean().leave_device(partial.personal_sums)
        return HostRoundResult(host=self.host_id, uploads=uploads, personal_sums=personal_sums,
                               client_metrics=partial.client_metrics, bytes_up=partial.bytes_up,
                               bytes_up_eval=eval_bytes, seconds=partial.seconds)

    # ------------------------------------------------------------------ buffered schedule
    def train_jobs(self, work: TrainJobs, ahead: bool = False) -> tuple[dict[int, float], list[int]]:
        """Train each of this host's (client, version) jobs of ``work`` (``ahead``: those to train
        after the window's folds) in ascending client order from its version's payload, its draws
        keyed as round version + 1, and keep its delta upload (raysim.core.buffered) until
        :meth:`fold`; returns each job's simulated duration (the clock's compute and transfer) and
        the clients whose record the job changed (they train on their owner from now on)."""
        t0 = time.perf_counter()
        durations, changed = {}, []
        for cid, version in sorted(work.ahead if ahead else work.jobs):
            if work.trainers.get(cid, cid % self.num_hosts) != self.host_id:  # another host trains it
                continue
            mine, rnd = self._job_payload(work.payloads, version), version + 1
            if not self.clock.fits(cid):  # it cannot train this model: arrives with nothing to fold
                self._jobs[cid] = (None, None, ClientClock.dropped_metrics(), 0)
                durations[cid] = 0.0
                continue
            with keep_state_on(self._state_device):
                stored = self.store.get(cid)
                record = self._start_record(cid, stored, mine)
                initial = copy.deepcopy(record) if stored is None else None  # to see whether the job changes it
                self.method.load_client_model(self.model, mine, record["state"])
                ctx = self._context(cid, rnd, mine, record["state"])
                with ComputeMeter() as meter, dropout_generator(generator_for(self.cfg.seed, rnd, cid, "dropout",
                                                                              self.device)):
                    up = self.method.local_update(ctx)
                record = self._next_record(record, ctx)
                if self.stages is None:
                    delta, sent = Upload(delta_upload(up.tensors, mine["global"]), up.weight, metrics=up.metrics), \
                        upload_nbytes(up)
                else:  # the stages' update is already the delta y − x_v
                    delta, sent = self._staged(rnd, cid, record, up, mine, None)
                if initial is not None and same_record(record, initial):
                    record = None  # still its initial record: nothing to keep, and any host may train it next
            metrics = dict(delta.metrics)
            metrics.update(self.clock.round_metrics(cid, meter.macs, tensors_nbytes(mine), sent))
            self._jobs[cid] = (delta, record, metrics, sent)
            durations[cid] = metrics["sim_seconds"]
            if record is not None:
                changed.append(cid)
        self._job_seconds = getattr(self, "_job_seconds", 0.0) + time.perf_counter() - t0
        return durations, changed

    def _job_payload(self, payloads_box: list, version: int) -> dict:
        """Version ``version``'s payload on this host's device: a window's payloads (one object)
        are fetched and moved once, however many calls train its jobs (those before the plan and
        those after the folds)."""
        key = payloads_box[0].hex() if hasattr(payloads_box[0], "hex") else id(payloads_box[0])
        if self._payloads is None or self._payloads[0] != key:
            self._payloads = (key, unbox(payloads_box), {})
        _, fetched, on_device = self._payloads
        if version not in on_device:
            on_device[version] = to_device(fetched[version], self.device, what="payload")
        return on_device[version]

    def fold(self, plans: list[StepPlan]) -> list[HostRoundResult]:
        """This host's share of a window's server steps (one result each, one object for the driver
        to hand the server); the wall time it trained since the last window is spread evenly over
        them."""
        if not plans:
            return []
        seconds, self._job_seconds = getattr(self, "_job_seconds", 0.0), 0.0
        return [self._fold_step(plan, seconds / len(plans)) for plan in plans]

    def _fold_step(self, plan: StepPlan, seconds: float) -> HostRoundResult:
        """A server step's share of this host (the jobs it trained): their delta uploads scaled by
        s(τ_i) and folded with weight w_i (raysim.core.buffered), and those of its dropped jobs
        (arrivals too stale to fold) not;
        either way a job's new record is kept when it differs from the client's initial one, here
        for this host's own clients, else handed back to the owner through the driver."""
        def trained_here(c: int) -> bool:
            return plan.trainers.get(c, c % self.num_hosts) == self.host_id

        folded = [(c, s, tau) for c, s, tau, _ in plan.folded if trained_here(c)]
        dropped = [(c, tau) for c, tau in plan.dropped if trained_here(c)]
        partial = self.method.aggregator.start()
        metrics, bytes_up = {}, 0
        kept, for_owner = [], {}

        def keep(cid: int, record: dict | None) -> None:
            if record is None:
                return
            kept.append(cid)
            if cid % self.num_hosts == self.host_id:
                self.store.put(cid, record)
            else:
                for_owner[cid] = to_device(record, "cpu", what="state")

        for cid, scale, tau in sorted(folded):
            up, record, m, sent = self._jobs.pop(cid)
            keep(cid, record)
            metrics[cid] = {**m, "staleness": float(tau), "dropped_stale": 0.0}
            bytes_up += sent
            if up is not None:
                tensors = (staleness_scaled(up.tensors, scale, in_place=self.stages is None)  # delta_upload's own
                           if self.method.fold_staleness else up.tensors)
                self.method.aggregator.add(partial, cid, Upload(tensors, up.weight, statistics=up.statistics))
        for cid, tau in sorted(dropped):
            up, record, m, sent = self._jobs.pop(cid)
            keep(cid, record)
            metrics[cid] = {**m, "staleness": float(tau), "dropped_stale": 1.0, "completed": 0.0}
            bytes_up += sent
        return HostRoundResult(host=self.host_id, uploads=self.method.aggregator.leave_device(partial),
                               personal_sums=None, client_metrics=metrics, bytes_up=bytes_up,
                               seconds=seconds, kept=kept, records_for_owner=for_owner)

    def export_records(self, client_ids: list[int]) -> dict[int, dict]:
        """The stored records of those listed clients that have one, for another host to train them."""
        out = {}
        for cid in client_ids:
            record = self.store.get(cid)
            if record is not None:
                out[cid] = to_device(record, "cpu", what="state")  # as it travels: on the CPU
        return out

    # ------------------------------------------------------------------ selection
    def local_losses(self, rnd: int, payload_box: list, client_ids: list[int],
                     personal_boxes: dict | None = None) -> LocalLosses:
        """Each listed client's mean cross-entropy over its training data of the model it would
        train from this round (the payload and its state, as ``Method.load_client_model`` builds
        it): the Power-of-Choice estimate F_k(w^t). Eval mode (BN's running statistics, no
        dropout, no augmentation), forward passes only: a function of the model and the data,
        drawing nothing and changing no state. With client profiles, each client's passes and
        download are charged to its simulated clock; a client whose device cannot hold the model
        answers nan at no cost."""
        payload = to_device(unbox(payload_box), self.device, what="payload")  # once per query, as in a round
        personal_boxes = personal_boxes or {}
        out = LocalLosses()
        for cid in sorted(client_ids):
            if self._clocked and not self.clock.fits(cid):
                out.losses[cid], out.sim_seconds[cid] = math.nan, 0.0
                continue
            mine = client_payload(payload, personal_boxes.get(cid), self.device)
            self.method.load_client_model(self.model, mine, self._record(cid)["state"])
            with ComputeMeter() if self._clocked else nullcontext() as meter, \
                    dropout_generator(generator_for(self.cfg.seed, rnd, cid, "local_loss", self.device)):
                r = evaluate(self.model, self.data[cid].train, max(self.cfg.train.batch_size, 256), self.device)
            out.losses[cid] = r["loss_sum"] / r["n"] if r["n"] else math.nan
            if self._clocked:  # the model down, one float64 up
                out.sim_seconds[cid] = self.clock.answer_seconds(cid, meter.macs, tensors_nbytes(mine), 8)
        return out

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, rnd: int, payload_box: list, requests: dict[int, list[str]], protocol: str,
                 personal_boxes: dict | None = None) -> dict[int, dict[str, SplitScores]]:
        """Accuracy and loss sums for each requested (client, split): with the client's own model
        (personalized) or with the global model (global; lodo), see :mod:`raysim.engine.evaluation`."""
        payload = to_device(unbox(payload_box), self.device, what="payload")  # once per evaluation, as in a round
        return self.evaluator.run(rnd, payload, requests, protocol, personal_boxes or {})

    # ------------------------------------------------------------------ checkpoints
    def ping(self) -> bool:
        return True

    def export_states(self) -> dict[int, dict]:
        """Every client's stored record (spilled ones included), for a checkpoint."""
        return dict(self.store.items())

    def import_states(self, states: dict[int, dict]) -> dict[int, int]:
        """Store these clients' records (a checkpoint's, or those trained on another host);
        returns their sizes in bytes (the driver keeps clients with large state on their host)."""
        for cid, state in states.items():
            self.store.put(int(cid), state)
        return {int(cid): state_nbytes(state) for cid, state in states.items()}

    def memory(self) -> dict:
        import resource
        return {"rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "state_mb": self.store.bytes_in_memory / 2**20, "spills": self.store.spills,
                "device_state_mb": self.store.bytes_on_device / 2**20,
                "device_data_mb": self.device_budget.used / 2**20 if self.device_budget else 0.0,
                "clients_with_state": len(self.store)}


def upload_nbytes(up: Upload) -> int:
    """What an upload sends as it is (no compression stage): its tensors, statistics and extras."""
    return tensors_nbytes(up.tensors) + tensors_nbytes(up.statistics) + tensors_nbytes(up.extras)


def _node() -> dict:
    """The Ray node this process runs on (empty outside a Ray worker)."""
    import ray
    return {"node_id": ray.get_runtime_context().get_node_id()} if ray.is_initialized() else {}


def _ray_gpu_ids():
    import ray
    try:
        return ray.get_gpu_ids()
    except Exception:  # not inside a Ray worker (direct use in tests/benchmarks)
        return []
