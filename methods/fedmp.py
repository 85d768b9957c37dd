"""FedMP — Jiang, Xu, Xu, Wang, Qiao, Zhao, "FedMP: Federated Learning through Adaptive Model
Pruning in Heterogeneous Edge Computing", ICDE 2022, pp. 767-779.

Each worker k trains a structurally pruned sub-model of the global model whose pruning ratio
rho_k suits its computation and communication capability; the server recovers every pruned
sub-model to full size with the global model's "residual" (the part the worker never received)
and averages them synchronously (R2SP, Residual Recovery Synchronous Parallel). In the paper a
multi-armed bandit picks rho_k online from observed round times; DapperFL (NeurIPS 2024, Tables
1-2) runs FedMP with the ratios fixed per capability tier, rho in {0, 0.2, 0.4, 0.6, 0.8}.

Round t:
    server, for worker k at ratio rho_k = rho_levels[tier_k]:
        for every prunable channel group g (filters of a conv / units of an FC layer, with the
        layers reading them), score_c = sum over g's producing layers of ||W^{t-1}[c]||_1
        K_g^k = the C_g - round(rho_k * C_g) channels of highest score              (l1_plan)
        send the sub-model W^{t-1}[K^k]
    worker k: E epochs of SGD on D_k on its sub-model; upload w_k (and K^k)
    server (R2SP):
        w_k := w_k on K^k, W^{t-1} elsewhere (the residual)                          (recover)
        W^t  = sum_k n_k w_k / sum_k n_k                                             (r2sp)

Choices the paper leaves open (no code was published), and which this file takes (baselines
spec section 6.1 [R]):
  * Importance: l1 magnitude of the filters / units on the *global* model, every round (the worker
    computes it on the model it received, which is exactly the server's ranking); ties: lower index.
  * Which layers: every hidden channel group except the stem's (DapperFL's rule; ``prune_stem``
    prunes it too). Residual-consistent groups: a ResNet stage's residual stream is one group,
    scored over the stem / block conv2 / shortcut filters writing into it, so the stem group
    also holds layer1's stream. The norm layer of a pruned filter goes with it.
  * Ratio per tier fixed (``rho_levels``, DapperFL's comparison): the tier is the client's profile
    tier (clients.profiles), else k mod L. ``rho`` sets one ratio for every client (Fig. 3).
  * The bandit (the paper's adaptive ratio) is not implemented: its exact update rule (reward,
    exploration term, arm set) could not be recovered from the material available here, and
    DapperFL's comparison fixes the ratios anyway.
  * R2SP average: every worker weighs n_k on every entry, so an entry it did not hold receives a
    zero update from it (no renormalisation over holders). BN running statistics of pruned
    channels come back from W^{t-1} unchanged.
  * No output rescaling of thinned layers (``rescale`` turns HeteroFL's C / kept scaler on) and no
    BN re-estimation (DapperFL's own ``bn_stats = recovered`` is not part of FedMP).
  * The engine broadcasts the dense global model (bytes_down counts it); the sub-model is cut on
    the client from it. bytes_up and the footprint (client_footprint) are the sub-model's; the
    structured footprint of a conv is ~(1 - rho)^2 of its parameters, not the nominal (1 - rho).

Where the defaults come from (``raysim methods fedmp``): FedMP's own ratios come from its bandit at
run time (not implemented, above), so the ratios are DapperFL's, the only seed that compares FedMP:
its tiers {0, 0.2, 0.4, 0.6, 0.8} (the code's best_args pr_ratios), the stem left unpruned (its
rule, spec 6.1 [R]). No rescaling: the paper describes none.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from raysim.core.aggregation import weighted_mean
from raysim.core.errors import UserError
from raysim.core.hparams import Hparams, Space
from raysim.methods.lib.masks import num_kept, top_mask
from raysim.methods.lib.submodels import SubModelMethod, recover
from raysim.core.settings import setting

PAPER_LEVELS = (0.0, 0.2, 0.4, 0.6, 0.8)  # DapperFL's tiers C1..C5


@dataclass(frozen=True)
class FedMPHparams(Hparams):
    rho_levels: tuple[float, ...] = setting(PAPER_LEVELS, ge=0, lt=1, source="DapperFL Sec. 4.2 / code pr_ratios (FedMP's bandit not implemented)", doc="pruning ratio of each capability tier")
    rho: float | None = setting(None, ge=0, lt=1, source="DapperFL Tables 1-2: ratios by tier, none uniform", doc="one ratio for every client (DapperFL Fig. 3); overrides tiers")
    prune_stem: bool = setting(False, source="DapperFL's pruning rule: stem skipped (spec 6.1 [R])", doc="also prune the stem's filters (and, in a ResNet, layer1's stream)")
    rescale: bool = setting(False, source="paper: describes no rescaling", doc="train with each layer's output x C / kept of its input (HeteroFL's scaler)")

    def __post_init__(self):
        if not self.rho_levels:
            raise UserError("hyperparameter 'hp.fedmp.rho_levels' = (): expected a non-empty list of ratios in [0, 1)")

    @classmethod
    def search_space(cls):
        # the ratio is a device constraint in the heterogeneous setting; Fig. 3 sweeps a uniform one
        return {"rho": Space.choice(0.2, 0.4, 0.6, 0.8)}


def filter_scores(weights: list[torch.Tensor]) -> torch.Tensor:
    """score_c = sum over the group's producing layers of sum |W[c]| (conv filter or FC row)."""
    return sum(w.detach().abs().flatten(1).sum(dim=1).double() for w in weights)


def l1_plan(scores: dict[int, torch.Tensor], rho: float) -> dict[int, torch.Tensor]:
    """Keep, in each group, the size - round(rho * size) channels of highest l1 score, ascending."""
    return {g: torch.nonzero(top_mask(s, num_kept(s.numel(), rho))).flatten() for g, s in scores.items()}


def r2sp(subs, prev: dict) -> dict:
    """R2SP: each (sub-model tensors, slices, n_k) recovered to full size with ``prev`` where the
    sub-model lacks an entry, then the n_k-weighted mean of the recovered models."""
    return weighted_mean(((recover(t, sl, prev), w) for t, sl, w in subs), like=prev)


class FedMP(SubModelMethod):
    name = "fedmp"
    Hparams = FedMPHparams
    paper = "Jiang et al., ICDE 2022"
    shares = 'shares pruned sub-models (tier ratios); server recovers them with the residual'

    def client_tier(self, client_id: int) -> int:
        return self.tiers(client_id)

    def client_rho(self, client_id: int) -> float:
        return self.hp.rho if self.hp.rho is not None else self.hp.rho_levels[self.client_tier(client_id)]

    def client_metrics(self, client_id: int) -> dict:
        return {"rho": self.client_rho(client_id), "tier": self.client_tier(client_id)}

    def prunable(self) -> list[int]:
        return [g for g in range(len(self.ref.groups)) if g > 0 or self.hp.prune_stem]

    def kept_counts(self, client_id: int) -> dict[int, int]:
        rho = self.client_rho(client_id)
        return {g: num_kept(self.ref.groups[g].size, rho) for g in self.prunable()}

    def plan(self, ctx, groups):
        params = dict(ctx.model.named_parameters())
        scores = {g: filter_scores([params[f"{name}.weight"] for name, role, _ in groups[g].members if role == "out"])
                  for g in self.prunable()}
        return l1_plan(scores, self.client_rho(ctx.client_id))

    def aggregate(self, state, uploads, round):
        subs = ((up.tensors, self.upload_slices(up), up.weight) for up in uploads.each.values())
        return {**state, "global": r2sp(subs, state["global"])}
