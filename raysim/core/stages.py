"""Privacy and compression as stages any method's uploads run through (``privacy:`` and
``compression:`` in the config); the method never sees them.

On the client (:meth:`Stages.client`, in the host's fold, before the aggregator's ``add``), in
this order:

1. the update: Δ = y − x, the uploaded floating-point tensors minus the broadcast's the client
   trained from (integer tensors, BN's ``num_batches_tracked``, take the broadcast's value: they
   are not part of what is released);
2. compression (raysim.core.compression): top-k with error feedback (the residual is kept in the
   client's record, stored and checkpointed like its state) or stochastic quantization;
3. the clip to C (raysim.core.privacy), the weight set to 1 (uniform: the sum's sensitivity is C),
   and with adaptive clipping the centred indicator b − 1/2 of ``||Δ|| <= C`` as a statistic;
4. local DP only: Gaussian noise of standard deviation z C on the clipped update.

The compressed size is what ``bytes_up`` and the simulated clock charge.

On the server (:meth:`Stages.server_round`, between the aggregator's ``reduce`` and the method's
server step): the reduced sum gets N(0, (z C)²) noise (central DP) and is divided by m, the expected
clients per round (DP-FedAvg's fixed denominator); the method's server step then receives
x + Δ̄ as the round's mean, as if the clients had uploaded models, so its own step (FedAvg's mean,
a server optimizer, FedDyn's correction) is unchanged. The adaptive clip's next C is drawn here
too. Buffered steps get the noisy sum over their folded arrivals (:meth:`Stages.server_buffered`).

Every draw is keyed (seed, round, client or server, purpose): the noise and the quantizer's
coins do not depend on the host layout.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from raysim.core import compression as comp
from raysim.core.errors import UserError
from raysim.core.privacy import Accounting, AdaptiveClip, RunningEpsilon, add_gaussian, clip
from raysim.core.seeding import SERVER, generator_for
from raysim.core.tensors import Tensors, to_device

PAYLOAD_KEY = "stages"  # the broadcast's entry with the adaptive clip's C (only with adaptive clipping)
COUNT_KEY = "stages.unclipped"  # the upload statistic b_k − 1/2 of adaptive clipping
RESIDUAL_KEY = "residual"  # a client record's error-feedback residual (top-k)


def refusal(method) -> str:
    """Why ``method`` (a Method or its class) cannot run through the stages, in a few words; ""
    where it can: its uploads are its shared model, folded by the weighted mean, trained from one
    broadcast."""
    from raysim.core.aggregation import WeightedMean
    from raysim.core.contract import Method
    cls = method if isinstance(method, type) else type(method)
    if not isinstance(cls.aggregator, WeightedMean):
        return "it keeps every client's upload (KeepAll), which a clip and noise on the sum do not cover"
    if cls.client_payload is not Method.client_payload:
        return "it sends each client a payload of its own, so the uploads have no common base to clip against"
    if cls.pools_clients:
        return "it trains one model on every client's data at once"
    if cls.exchanges:
        return "it sends data-derived statistics beside the model, which the clip does not bound"
    if cls.uploads_beside_model:
        return f"its uploads carry {cls.uploads_beside_model} beside the model, which the stages do not bound"
    return ""


@dataclass(frozen=True)
class PrivacyPlan:
    """The privacy section resolved for a run: the clip, the noise multipliers, the accountant."""

    clip: float  # C (adaptive: its initial value C_0)
    noise_multiplier: float  # z, what the accountant is given (0: no noise, ε = inf)
    delta: float
    accounting: Accounting
    adaptive: AdaptiveClip | None = None
    local: bool = False
    approximate: str = ""  # why the accountant's sampling is only close to the run's ("" : it is the run's)

    def describe(self, target_epsilon: float | None, rounds: int) -> str:
        """One line for the run's start: the noise and how it was chosen, the accountant's event."""
        a = self.accounting
        how = (f"chosen for ε = {target_epsilon:g} after {rounds} rounds" if target_epsilon is not None
               else f"ε = {self.epsilon(rounds):.3g} after {rounds} rounds")
        sampling = ("local DP, every round" if self.local else
                    f"Poisson sampling, q = {a.rate:g}" if a.sampling == "poisson" else
                    f"fixed-size sampling, {a.per_round} of {a.population}")
        line = (f"privacy: noise multiplier z = {self.noise_multiplier:.4g} ({how} at δ = {self.delta:g}; "
                f"{a.accountant} accountant, {sampling}), clip C = {self.clip:g}"
                + (" (adaptive)" if self.adaptive is not None else ""))
        return line + (f"; approximate: {self.approximate}" if self.approximate else "")

    @property
    def sum_noise(self) -> float:
        """The noise multiplier on the sum of clipped updates (z_Δ with adaptive clipping, else z)."""
        if self.adaptive is None or self.noise_multiplier == 0:
            return self.noise_multiplier
        return self.adaptive.sum_noise_multiplier(self.noise_multiplier)

    def epsilon(self, rounds: int) -> float:
        """ε after ``rounds`` rounds (server steps) at δ."""
        return self.accounting.epsilon(self.noise_multiplier, rounds, self.delta)


@dataclass
class ClientUpload:
    """A client's upload after the client stages."""

    tensors: Tensors
    weight: float
    statistics: Tensors
    bytes: int  # what it sends (the compressed size)
    residual: Tensors | None = None  # its next error-feedback residual (top-k), to store in its record
    metrics: dict = field(default_factory=dict)


class Stages:
    """The configured stages of one run (``from_config``): client side on the hosts, server side
    on the server; the same object on both."""

    def __init__(self, seed: int, privacy: PrivacyPlan | None, compression):
        self.seed, self.privacy, self.compression = seed, privacy, compression
        self.spent = None if privacy is None else RunningEpsilon(privacy.accounting, privacy.noise_multiplier,
                                                                 privacy.delta)

    # ---- client ---------------------------------------------------------------------------
    def client(self, rnd: int, cid: int, upload, base: Tensors, payload: dict, residual: Tensors | None) -> ClientUpload:
        """The client stages over ``upload`` (its tensors the trained model) trained from ``base`` (the
        broadcast's global tensors); ``residual``: its stored error feedback."""
        if upload.statistics or upload.extras:
            what = "statistics" if upload.statistics else "extras"
            raise UserError(f"privacy/compression: the method's uploads carry {what} "
                            f"({', '.join(sorted(getattr(upload, what)))}) beside the model, which the stages do not "
                            "clip, noise or compress; run it without privacy: and compression:")
        update = {}
        for k, y in upload.tensors.items():
            x = base.get(k)
            if x is None:
                raise UserError(f"privacy/compression: the method uploads {k!r}, which its broadcast does not hold: "
                                "the stages need uploads that are the broadcast model")
            update[k] = y - x if y.is_floating_point() else x.clone()
        out = ClientUpload(update, float(upload.weight), {}, 0)
        c = self.compression
        if c is None:
            out.bytes = sum(v.numel() * v.element_size() for v in update.values())
        elif c.kind == "topk":
            out.tensors, out.residual, out.bytes = comp.topk(update, c.fraction, residual)
        else:
            out.tensors, out.bytes = comp.quantize(update, c.bits, generator_for(self.seed, rnd, cid, "quantize",
                                                                                 _device(update)))
        p = self.privacy
        if p is not None:
            sent = payload[PAYLOAD_KEY]  # this round's C and the local noise multiplier (the server's plan)
            bound = float(sent["clip"])
            out.tensors, norm = clip(out.tensors, bound)
            out.weight = 1.0
            out.metrics["update_norm"] = norm
            if p.adaptive is not None:
                out.statistics = {COUNT_KEY: torch.tensor([float(norm <= bound) - 0.5], dtype=torch.float64)}
            if p.local and sent["local_noise"] > 0:
                out.tensors = add_gaussian(out.tensors, sent["local_noise"] * bound,
                                           generator_for(self.seed, rnd, cid, "dp_local", _device(update)))
        return out

    # ---- server ---------------------------------------------------------------------------
    def init_state(self) -> dict:
        """The stages' server state (checkpointed with the server's): the adaptive clip's C."""
        p = self.privacy
        return {"clip": p.clip} if p is not None and p.adaptive is not None else {}

    def payload(self, state: dict) -> dict:
        """What the broadcast carries for the client stages (privacy only): this round's C and the
        local noise multiplier (plain floats: they weigh nothing in ``bytes_down``)."""
        p = self.privacy
        if p is None:
            return {}
        return {PAYLOAD_KEY: {"clip": float(state.get("clip", p.clip)),
                              "local_noise": float(p.noise_multiplier if p.local else 0.0)}}

    def _noisy_sum(self, rnd: int, mean: Tensors, count: float, state: dict) -> Tensors:
        """Σ of the folded updates (``mean`` × ``count``) plus the central noise, keyed by the round."""
        total = {k: (v.double() * count if v.is_floating_point() else v) for k, v in mean.items()}
        p = self.privacy
        if p is None or p.local or p.noise_multiplier == 0:
            return total
        bound = state.get("clip", p.clip)
        return add_gaussian(total, p.sum_noise * bound, generator_for(self.seed, rnd, SERVER, "dp_noise"))

    def server_round(self, rnd: int, reduced, global_: Tensors, per_round: int, state: dict):
        """(the round's ``Mean`` as the method's step takes it, the stages' new state, metrics):
        x + (Σ Δ̃ + noise) / m for a privacy run (m the expected clients per round), x + the weighted
        mean of the updates for compression alone. ``reduced`` is the aggregator's Mean of the
        updates (None: nobody uploaded; under DP the noise is released all the same)."""
        from raysim.core.aggregation import Mean
        p = self.privacy
        if reduced is not None and not reduced.clients:
            reduced = None
        mean = reduced.mean if reduced is not None else {k: torch.zeros_like(v) for k, v in global_.items()}
        count = reduced.total_weight if reduced is not None else 0.0
        if p is None:
            update = {k: v.double() for k, v in mean.items()}
        else:
            noisy = self._noisy_sum(rnd, mean, count, state)
            update = {k: v / per_round if v.is_floating_point() else v for k, v in noisy.items()}
        model = {k: (global_[k].double() + update[k]).to(global_[k].dtype) if global_[k].is_floating_point()
                 else global_[k].clone() for k in mean}
        state, metrics = self._next_clip(rnd, reduced, per_round, state)
        clients = reduced.clients if reduced is not None else []
        out = Mean(model, reduced.total_weight if reduced is not None else 0.0, clients,
                   reduced.extras if reduced is not None else {}, {})
        return out, state, metrics

    def server_buffered(self, rnd: int, reduced, state: dict, buffer: int):
        """A buffered step's ``(mean, state, metrics)``: the folded deltas' Σ w_i s_i Δ̃_i plus the
        noise, divided by Σ w_i (the step's Δ̄; raysim.core.buffered). The adaptive clip counts each
        arrival's unclipped bit once, whatever its staleness."""
        p = self.privacy
        if p is None:
            return reduced.mean, state, {}
        noisy = self._noisy_sum(rnd, reduced.mean, reduced.total_weight, state)
        total = reduced.total_weight if reduced.total_weight > 0 else 1.0
        mean = {k: (v / total).to(reduced.mean[k].dtype) if v.is_floating_point() else v for k, v in noisy.items()}
        state, metrics = self._next_clip(rnd, reduced, buffer, state)
        return mean, state, metrics

    def _next_clip(self, rnd: int, reduced, per_round: int, state: dict) -> tuple[dict, dict]:
        """The adaptive clip's update from the noisy count of unclipped updates."""
        p = self.privacy
        if p is None or p.adaptive is None:
            return state, {"clip": p.clip} if p is not None else {}
        count = 0.0
        if reduced is not None and COUNT_KEY in reduced.statistics:
            count = float(reduced.statistics[COUNT_KEY].double().sum()) * reduced.total_weight
        if p.noise_multiplier > 0 and not p.local:
            g = generator_for(self.seed, rnd, SERVER, "dp_count")
            count += p.adaptive.count_noise * float(torch.randn(1, generator=g, dtype=torch.float64))
        fraction = count / per_round + 0.5
        bound = state["clip"]
        return {**state, "clip": p.adaptive.next_clip(bound, fraction)}, {"clip": bound, "unclipped": fraction}


def _device(tensors: Tensors):
    return next(iter(tensors.values())).device if tensors else torch.device("cpu")


def residual_on(residual: Tensors | None, device) -> Tensors | None:
    """The residual as a client's record keeps it: on the host's state device, else the CPU."""
    return None if residual is None else to_device(residual, device or "cpu", what="state", copy=True)



def from_config(cfg, method, *, population: int, per_round: int, buffered: bool = False,
                always_available: bool = True, account: bool = True) -> Stages | None:
    """The run's stages (None: no ``privacy:`` and no ``compression:``), checked against the method
    and the sampling. ``account``: resolve the noise (a ``target_epsilon``'s search) and check the
    sampling: the server's build; a host's needs only what its clients do (the clip and the local
    noise come with the broadcast)."""
    p, c = cfg.privacy, cfg.compression
    if p is None and c is None:
        return None
    why = refusal(method)
    if why:
        raise UserError(f"privacy/compression: method {method.name} cannot run through the stages: {why}")
    plan = None
    if p is not None:
        selection = cfg.clients.selection.kind
        from raysim.core.contract import Method
        own_select = type(method).select is not Method.select
        sampling = "poisson" if selection == "poisson" else "fixed"
        approximate = ""
        if account:
            if own_select or selection == "power_of_choice":
                raise UserError("privacy: the accountant knows uniform (fixed-size) and Poisson sampling; this run's "
                                "clients are chosen by " + ("the method's own select" if own_select else
                                                            "power_of_choice") + ": use clients.selection.kind uniform or poisson")
            if not always_available or cfg.clients.deadline_s is not None:
                raise UserError("privacy: availability profiles or clients.deadline_s change who is sampled and who is "
                                "aggregated, which the accountant's sampling event does not model: run DP with every "
                                "client available and no deadline")
            if buffered:
                approximate = (f"buffered: each server step is accounted as a draw of its K = {per_round} folded "
                               f"arrivals out of N = {population} without replacement, which the asynchronous "
                               "arrivals only approximate")
                sampling = "fixed"
        accounting = Accounting(sampling=sampling, population=population, per_round=per_round,
                                accountant=p.accountant, local=p.local)
        delta = p.delta if p.delta is not None else 1.0 / population
        adaptive = None
        if p.adaptive is not None:
            a = p.adaptive
            adaptive = AdaptiveClip(a.quantile, a.lr, a.count_noise if a.count_noise is not None else per_round / 20)
        z = p.noise_multiplier or 0.0
        if account:
            if p.target_epsilon is not None:
                z = accounting.noise_for(p.target_epsilon, cfg.rounds, delta)
            else:
                accounting.fresh()  # the accountant supports the event (PLD: not fixed-size sampling)
        plan = PrivacyPlan(clip=p.clip, noise_multiplier=z, delta=delta, accounting=accounting, adaptive=adaptive,
                           local=p.local, approximate=approximate)
        if account:
            _ = plan.sum_noise  # adaptive: the count's noise leaves room for the sum's
    return Stages(cfg.seed, plan, c)
