"""Client-level differential privacy: DP-FedAvg's clip and noise, adaptive clipping, and the
privacy accountant (Google's ``dp-accounting``).

DP-FedAvg with fixed clipping (McMahan, Ramage, Talwar, Zhang, ICLR 2018), each round:

    Δ̃_k = Δ_k · min(1, C / ||Δ_k||)                 every client's update clipped to L2 norm C
    Δ̄  = (Σ_k Δ̃_k + N(0, (z C)² I)) / m             uniform weights, noise on the sum, m the
                                                       expected clients per round (fixed: m)

so one client moves Δ̄ by at most C/m and the noise's standard deviation on Δ̄ is zC/m. The norm is
the flat norm over every floating-point tensor of the upload (McMahan et al.'s flat clipping).

Adaptive clipping (Andrew, Thakkar, McMahan, Ramaswamy, NeurIPS 2021, Alg. 1 with the geometric
update): each client also sends b_k = 1[||Δ_k|| <= C]; the server draws
b̄ = (Σ_k b_k + N(0, σ_b²)) / m and sets C <- C · exp(−η_C (b̄ − γ)), so C tracks the γ-quantile of
the update norms. The count's noise costs privacy too: for a total noise multiplier z the sum's is
z_Δ = (z^-2 − (2σ_b)^-2)^(-1/2) (their Thm. 1), and the accountant is given z.

Local DP (``privacy.local``) adds N(0, (zC)²) to each client's clipped update before it leaves the
client; the server adds none.

The accountant composes one sampled Gaussian event per round over the planned rounds:

* Poisson sampling (``clients.selection.kind: poisson``, each client with probability q = m/N):
  ``PoissonSampledDpEvent(q, GaussianDpEvent(z))`` under add-or-remove-one, the classic analysis;
* fixed-size sampling without replacement (the uniform draw of m of N):
  ``SampledWithoutReplacementDpEvent(N, m, GaussianDpEvent(z / 2))`` under replace-one (replacing
  one client's clipped update moves the sum by up to 2C, the event's sensitivity); only the RDP
  accountant supports it, and the PLD one is refused rather than approximated;
* local DP: each client's report is a Gaussian mechanism of sensitivity 2C (any two clipped updates),
  ``GaussianDpEvent(z / 2)`` composed over every planned round (a client is assumed to take part in
  all of them: the server sees who reports).
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from raysim.core.errors import UserError
from raysim.core.tensors import Tensors

ACCOUNTANTS = ("rdp", "pld")
SAMPLINGS = ("fixed", "poisson")


# ----------------------------------------------------------------------------- clip and noise

def flat_norm(tensors: Tensors) -> float:
    """The L2 norm of every floating-point tensor of ``tensors`` as one flat vector (float64)."""
    total = 0.0
    for v in tensors.values():
        if v.is_floating_point():
            total += float(v.detach().double().pow(2).sum())
    return math.sqrt(total)


def clip(tensors: Tensors, bound: float) -> tuple[Tensors, float]:
    """(``tensors`` scaled by min(1, C / norm), the norm before): an update of norm at most C is
    returned unchanged; integer tensors are left as they are."""
    norm = flat_norm(tensors)
    if norm <= bound:
        return dict(tensors), norm
    scale = bound / norm
    return {k: v * scale if v.is_floating_point() else v for k, v in tensors.items()}, norm


def add_gaussian(tensors: Tensors, std: float, generator: torch.Generator) -> Tensors:
    """``tensors`` plus independent N(0, std²) noise on every floating-point entry, drawn from
    ``generator`` in the tensors' key order (in float64 on the generator's device, then cast)."""
    out = {}
    for k in sorted(tensors):
        v = tensors[k]
        if not v.is_floating_point() or std == 0:
            out[k] = v
            continue
        noise = torch.randn(v.shape, generator=generator, dtype=torch.float64, device=generator.device)
        out[k] = (v.double() + std * noise.to(v.device)).to(v.dtype)
    return {k: out[k] for k in tensors}


# ----------------------------------------------------------------------------- adaptive clipping

@dataclass(frozen=True)
class AdaptiveClip:
    """Andrew et al.'s geometric quantile update of the clip norm (module docstring)."""

    quantile: float  # γ, the target fraction of unclipped updates
    lr: float  # η_C
    count_noise: float  # σ_b, the standard deviation of the noise on the count of unclipped updates

    def next_clip(self, bound: float, noisy_fraction: float) -> float:
        """C · exp(−η_C (b̄ − γ))."""
        return bound * math.exp(-self.lr * (noisy_fraction - self.quantile))

    def sum_noise_multiplier(self, total: float) -> float:
        """z_Δ = (z^-2 − (2σ_b)^-2)^(-1/2): the sum's noise multiplier that, with the count's noise,
        spends the privacy of noise multiplier ``total`` (Andrew et al., Thm. 1)."""
        rest = total ** -2 - (2 * self.count_noise) ** -2
        if rest <= 0:
            raise UserError(f"privacy.adaptive: the count's noise σ_b = {self.count_noise:g} spends more than the noise "
                            f"multiplier {total:g} allows (needs 2σ_b > z); raise count_noise or the noise multiplier")
        return rest ** -0.5


# ----------------------------------------------------------------------------- the accountant

@dataclass(frozen=True)
class Accounting:
    """What the accountant needs to know about a federation's releases."""

    sampling: str  # "fixed" | "poisson"
    population: int  # N, the clients that can be sampled
    per_round: int  # m (fixed), or the expected clients per round q N (poisson)
    accountant: str = "rdp"  # "rdp" | "pld"
    local: bool = False

    @property
    def rate(self) -> float:
        return self.per_round / self.population

    def round_event(self, noise_multiplier: float):
        """One round's release as a ``dp_accounting`` event (module docstring)."""
        import dp_accounting as dpa
        if self.local:
            return dpa.GaussianDpEvent(noise_multiplier / 2)
        if self.sampling == "poisson":
            return dpa.PoissonSampledDpEvent(self.rate, dpa.GaussianDpEvent(noise_multiplier))
        return dpa.SampledWithoutReplacementDpEvent(self.population, self.per_round,
                                                    dpa.GaussianDpEvent(noise_multiplier / 2))

    def relation(self):
        import dp_accounting as dpa
        if self.local or self.sampling == "poisson":
            return dpa.NeighboringRelation.ADD_OR_REMOVE_ONE
        return dpa.NeighboringRelation.REPLACE_ONE

    def fresh(self):
        """A new accountant of the configured kind, under this sampling's neighbouring relation."""
        from dp_accounting import pld, rdp
        if self.accountant == "pld":
            if not self.local and self.sampling == "fixed":
                raise UserError("privacy.accountant 'pld' does not support fixed-size sampling without replacement "
                                "(dp-accounting's PLD accountant has no such event); use accountant: rdp, or "
                                "clients.selection.kind: poisson")
            return pld.PLDAccountant(neighboring_relation=self.relation())
        return rdp.RdpAccountant(neighboring_relation=self.relation())

    def epsilon(self, noise_multiplier: float, rounds: int, delta: float) -> float:
        """ε after ``rounds`` rounds at ``delta`` (inf with no noise; 0 before the first round)."""
        if rounds <= 0:
            return 0.0
        if noise_multiplier <= 0:
            return math.inf
        import dp_accounting as dpa
        acc = self.fresh()
        acc.compose(dpa.SelfComposedDpEvent(self.round_event(noise_multiplier), int(rounds)))
        with quiet_absl():
            return float(acc.get_epsilon(delta))

    def noise_for(self, target_epsilon: float, rounds: int, delta: float) -> float:
        """The smallest noise multiplier whose ε after ``rounds`` rounds is at most the target
        (``dp_accounting.calibrate_dp_mechanism``'s search)."""
        import dp_accounting as dpa
        from dp_accounting import rdp

        def event(z):
            return dpa.SelfComposedDpEvent(self.round_event(z), int(rounds))

        # the RDP bound first (closed forms, any z); a PLD search then stays in [z_rdp / 2, z_rdp]: the PLD
        # accountant's discretised support grows without bound as z goes to 0
        with quiet_absl():
            z = float(dpa.calibrate_dp_mechanism(lambda: rdp.RdpAccountant(neighboring_relation=self.relation()),
                                                 event,
                                                 target_epsilon, delta, dpa.LowerEndpointAndGuess(1e-3, 1.0),
                                                 tol=1e-4))
            if self.accountant == "pld":
                z = float(dpa.calibrate_dp_mechanism(self.fresh, event, target_epsilon, delta,
                                                     dpa.ExplicitBracketInterval(z / 2, z), tol=1e-4))
        return z


class RunningEpsilon:
    """ε after each round of one run. RDP: one round's RDP curve is computed once and ε after r
    rounds read from r times it (RDP composes by addition: what ``SelfComposedDpEvent(e, r)`` does;
    the sampled-without-replacement curve costs ~0.5 s, too much for every round). PLD: the rounds
    since the last call, as one privacy loss distribution built once per count of rounds (building a
    sampled Gaussian's costs 0.5-1 s, its convolution with the kept one 30-150 ms), composed into the
    kept distribution; a resumed run's first call composes the rounds before it at once. (Each
    increment is composed with PLD's identity once more than an accountant would: ε within 1e-9.)"""

    def __init__(self, accounting: Accounting, noise_multiplier: float, delta: float):
        self.accounting, self.noise_multiplier, self.delta = accounting, noise_multiplier, delta
        self._pld, self._rounds, self._one_round, self._increments = None, 0, None, {}

    def after(self, rounds: int) -> float:
        if rounds <= 0:
            return 0.0
        if self.noise_multiplier <= 0:
            return math.inf
        if self.accounting.accountant == "rdp":
            from dp_accounting.rdp import rdp_privacy_accountant as rdp
            if self._one_round is None:
                acc = self.accounting.fresh()
                with quiet_absl():  # the curve's orders that do not converge are dropped, said per order
                    acc.compose(self.accounting.round_event(self.noise_multiplier))
                self._one_round = (acc._orders, acc._rdp.copy())  # dp-accounting keeps the curve here
            orders, curve = self._one_round
            with quiet_absl():
                return float(rdp.compute_epsilon(orders, rounds * curve, self.delta)[0])
        if self._pld is None or rounds < self._rounds:
            self._pld, self._rounds = self.accounting.fresh()._pld, 0  # PLD's identity
        if rounds > self._rounds:
            self._pld = self._pld.compose(self._increment(rounds - self._rounds))
            self._rounds = rounds
        with quiet_absl():
            return float(self._pld.get_epsilon_for_delta(self.delta))

    def _increment(self, rounds: int):
        """The privacy loss distribution of ``rounds`` rounds, as dp-accounting's PLD accountant
        builds it (kept in its ``_pld``)."""
        if rounds not in self._increments:
            import dp_accounting as dpa
            acc = self.accounting.fresh()
            with quiet_absl():
                acc.compose(dpa.SelfComposedDpEvent(self.accounting.round_event(self.noise_multiplier), rounds))
            self._increments[rounds] = acc._pld
        return self._increments[rounds]


@contextmanager
def quiet_absl():
    """dp-accounting logs through absl a warning per RDP order it drops (at large sampling rates);
    the ε it returns already accounts for them."""
    import logging
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
