"""DapperFL — Jia et al., "DapperFL: Domain Adaptive Federated Learning with Model Fusion
Pruning for Edge Devices", NeurIPS 2024.

Every client i has a fixed pruning ratio rho_i, set by its capability tier C_1..C_5
(rho in {0, 0.2, 0.4, 0.6, 0.8}, two clients per tier by default).

Client i, round t (Algorithm 1 = local epoch 1, then Algorithm 2 lines 1-3):
    w_hat  <- W^{t-1} after one epoch of SGD on D_i, the full (dense) model       (Alg. 1 line 1)
    a_t     = max((1 - eps)^(t-1) * alpha0, alpha_min)                           (Eq. 2)
    w       = a_t * W^{t-1} + (1 - a_t) * w_hat        (t >= fuse_from_round = 2)    (Eq. 1)
    M       = structured L1 masks of w at ratio rho_i                             (Alg. 1 line 3)
    w       <- w * M                                                              (Alg. 1 line 4)
    for e = 2..E, every batch:  z = g_e(w_e * M_e; x),  logits = g_p(w_p * M_p; z)
        L = CE(logits, y) + gamma * mean_b ||z_b||_2                              (Eqs. 3-5, code's form)
        (ce_norm="labels": CE / |K_i|, Eq. 4 read literally; see below)
        SGD step, then pruned entries back to 0
    BN running statistics <- those of w * M + W^{t-1} * (1 - M) on D_i     (bn_stats, see below)
    upload w * M, M (in Upload.extras["masks"]), n_i, the real footprint, and z_norm = mean ||z_b||
    over the round's batches (a representation the DAR term has collapsed shows as z_norm -> 0)

Server (Algorithm 2 lines 5-10):
    w_i := w_i * M_i + W^{t-1} * (1 - M_i)             (pruned slots get the old global) (Eq. 6)
    W^t  = sum_i n_i / n * w_i                         (every state entry)               (Eq. 7)

The masks (Alg. 1 line 3: "channel-wise l1 norm", "rho_i determines the proportion of 0 in M_i^t"),
per layer, the same ratio rho in every prunable layer, round(rho * C) channels pruned.
Default ``prune_scheme = "filters"`` (L1 filter pruning, so the proportion of 0 in M is rho, as the paper
states, and the footprint is the paper's (1 - rho) x dense of Tables 5-6):
  * the stem conv (first conv) and its norm: never pruned;
  * every other conv: the output filters with the smallest L1 norm sum|W[c]|;
  * norm weights (BN gamma) except the stem's: unstructured, smallest |gamma| zeroed;
    the shift (beta) and running statistics are never masked;
  * every nn.Linear: input columns by their L2 norm (the bias and the classes are kept).
``prune_scheme = "official"`` is the published code's scheme (spec section 2.2): the first conv after
the stem and the first shortcut conv by output filters; every other conv by input channels (L1 of
W[:, c]), then output filters (L1 of (W * m_in)[c]), M = m_out x m_in. It keeps ~(1 - rho)^2 of each
such conv, so the proportion of 0 in M is ~1 - (1 - rho)^2, not rho (96% of the convs at rho = 0.8).

Where the defaults come from (``raysim methods dapperfl`` lists each one's source). The rule: the
form the paper's hyperparameters were tuned with is the default, the other a switch.
  * gamma = 0.01 was tuned (Fig. 4d) with the released code's DAR, gamma * mean_b ||z_b||, so that
    unsquared norm is the default; Eq. 3's squared norm is ``dar_form: squared`` (at gamma 0.01 it
    weighs the regulariser ||z|| times more: spec 9.3).
  * Fusion starts in round 2 (``fuse_from_round: 2``), as the code's guard does: Eq. 2 read from t = 1
    would blend 90% of the random W^0 back into round 1's model (spec 9.5); ``fuse_from_round: 1``
    is the literal reading. The exponent stays t - 1, so round 2 uses alpha = 0.72.
  * Fusion itself, Eq. 6's recovery and the rho share of zeros in M are the paper's: in the
    released code the fusion never runs and the recovery is lost (spec 10.1-10.2), so the code
    cannot have produced the paper's Table 3, and alpha0 / alpha_min / epsilon (Fig. 4a-c) only
    mean anything with fusion on.
``official_compat`` = the published code's behaviour (spec section 10): fusion off, pruned slots
averaged as zeros, DAR = gamma * mean_b ||z_b||, plain batch-mean CE (no 1/|K_i|), the code's in +
out channel masks. The fine-tune epoch uses Eq. 5 too (the paper does not say; the code does), and
one SGD optimizer spans all E epochs, so momentum crosses the prune (code).

Two choices the paper leaves open, and why (measured on digits5, 10 clients, rho tiers C1..C5):
  * BN running statistics (``bn_stats``). The paper never mentions them; read literally, the upload
    carries the statistics the pruned epochs leave in the BN buffers, i.e. those of a sub-network with
    up to 96% of its conv weights at zero, and Eq. 7 averages them into the dense global model. They
    do not describe that model: in eval mode its activations exploded (||z||^2 ~ 1e4 after 8 rounds,
    Eq. 6 from W^{t-1}) or vanished (~0.2, the code's zero-fill), and the global model scored chance
    (10-12%) although its weights, with re-estimated statistics, gave 20%. Default "recovered": after
    training, the client applies Eq. 6 to its own upload (it holds W^{t-1} and M) and re-estimates the
    BN statistics of that dense model on D_i with one forward pass (no gradient, the weights it sends
    are still w * M). The server then averages statistics of the models it averages. The weights
    trajectory is unchanged (training uses batch statistics). "pruned" keeps the literal reading.
  * Eq. 4's 1/|K_i| (``ce_norm``). Read literally it divides the CE by |K_i| (10 here), so at the
    paper's gamma = 0.01 the squared-norm DAR dominates the objective and the representation collapses:
    the global model stayed at chance even with re-estimated BN statistics. The paper's gamma was tuned
    with the published code, whose CE is the plain batch mean; spec section 9.4 recommends that too.
    Default "batch"; "labels" is the literal Eq. 4.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F
from torch import nn

from raysim.core.aggregation import KeepAll, weighted_mean
from raysim.core.contract import ClientContext, Method, Upload, client_weight
from raysim.core.errors import UserError
from raysim.core.hparams import Hparams, Space
from raysim.methods.dapperfl.footprint import PAPER_LEVELS, measure_footprint, summary_section
from raysim.methods.dapperfl.masks import prune_masks
from raysim.methods.lib.masks import apply_masks
from raysim.core.tiers import ClientTiers
from raysim.core.settings import setting
from raysim.core.training import collect_bn_stats


# ============================================================================= hyperparameters

@dataclass(frozen=True)
class DapperFLHparams(Hparams):
    alpha0: float = setting(0.9, ge=0, le=1, source="paper Table 4 (best of Fig. 4a); code agrees", doc="initial fusion factor")
    alpha_min: float = setting(0.1, ge=0, le=1, source="paper Table 4 (best of Fig. 4b); code agrees", doc="floor of the fusion factor")
    epsilon: float = setting(0.2, ge=0, lt=1, source="paper Table 4 (best of Fig. 4c); code agrees", doc='decay ("sensitivity") of the fusion factor per round')
    gamma: float = setting(0.01, ge=0, source="paper Table 4 (Fig. 4d), tuned with the code's unsquared DAR", doc="DAR weight")
    # ---- system heterogeneity: who gets which pruning ratio ----
    rho_levels: tuple[float, ...] = setting(PAPER_LEVELS, ge=0, lt=1, source="paper Sec. 4.2; code's pr_ratios", doc="rho of each capability tier C_1..C_L")
    tier_shares: tuple[float, ...] | None = setting(None, ge=0, source="code: two clients per tier (equal shares)", doc="without clients.profiles, the tiers are DapperFL's own: shares (None: equal)")
    tier_assignment: str = setting("seeded", one_of=("seeded", "modulo"),
                                   source="ours: the code's k mod 5 made seedable (spec 9.14)", doc='without clients.profiles: "seeded" (balanced slots shuffled by setup.seed) or "modulo" (client k -> tier k mod L, the official code)')
    rho: float | None = setting(None, ge=0, lt=1, source="paper Table 1 setting: ratios by tier, none uniform", doc="one ratio for every client (Fig. 3, Tables 5-6); overrides tiers")
    # ---- variants (spec section 2.6) ----
    fusion: bool = setting(True, source="paper Eqs. 1-2 and Table 3 (the code's fusion never runs: spec 10.1)", doc='"w/o MFP" ablation: False')
    fuse_from_round: int = setting(2, ge=1, source="code: fusion skipped in round 1 (spec 9.5, 10.6)", doc="1 = Eq. 2 literally from t = 1 (blends 90% of the random W^0 back in)")
    recovery: str = setting("global", one_of=("global", "zero"), source="paper Eq. 6 (the code loses it: spec 10.2)", doc="Eq. 6: pruned slots <- W^{t-1} | 0 (code)")
    dar_form: str = setting("l2", one_of=("squared", "l2"), source="code, which gamma was tuned with (spec 9.3, 10.3)", doc="||z|| (code) | ||z||^2 (paper Eq. 3)")
    ce_norm: str = setting("batch", one_of=("batch", "labels"), source="code's batch-mean CE (spec 9.4)", doc="Eq. 4: batch-mean CE | CE / |K_i| (Eq. 4 literally)")
    dar_in_finetune: bool = setting(True, source="code (the paper is silent: spec 9.9)", doc="CE + gamma * DAR in the fine-tune epoch too")
    finetune_epochs: int = setting(1, ge=1, source="paper Alg. 1 line 1; code agrees", doc="dense epochs before pruning")
    prune_scheme: str = setting("filters", one_of=("filters", "official"),
                                source="paper: rho is the proportion of 0 in M (the code's scheme zeroes ~1-(1-rho)^2)", doc='"filters": output filters by L1, proportion of 0 in M = rho (paper) | "official": in + out channels (code)')
    bn_stats: str = setting("recovered", one_of=("recovered", "pruned"), source="ours: the paper is silent; the code keeps the pruned ones (module docstring)", doc='BN running statistics of the upload (the paper is silent on them): "recovered": re-estimated on the client\'s Eq.-6-recovered dense model (one forward pass over D_i) | "pruned": those the pruned epochs leave (the literal reading: the global model then evaluates at chance)')
    official_compat: bool = setting(False, source="paper (True: the published code's behaviour, spec 10)", doc='forces fusion=False, recovery="zero", dar_form="l2", ce_norm="batch", prune_scheme="official"')

    def __post_init__(self):
        if not self.rho_levels:
            raise UserError("hyperparameter 'hp.dapperfl.rho_levels' = (): expected a non-empty list of ratios in [0, 1)")
        if self.tier_shares is not None and (len(self.tier_shares) != len(self.rho_levels) or sum(self.tier_shares) <= 0):
            raise UserError(f"hyperparameter 'hp.dapperfl.tier_shares' = {self.tier_shares!r}: expected "
                            f"{len(self.rho_levels)} non-negative numbers (one per tier), not all 0")

    @classmethod
    def search_space(cls):
        # Fig. 4a: alpha0 in {0.1..0.9}; Fig. 4d: gamma in {0.001 .. 0.1}; Fig. 3 / Tables 5-6:
        # one ratio for every client in {0.2, 0.4, 0.6, 0.8} (searching rho explores that setting;
        # in the heterogeneous setting rho is a device constraint, not a knob).
        return {"alpha0": Space.uniform(0.1, 0.9), "gamma": Space.log(1e-3, 0.1),
                "rho": Space.choice(0.2, 0.4, 0.6, 0.8)}

    # the settings actually used, after the official_compat preset
    @property
    def use_fusion(self) -> bool:
        return self.fusion and not self.official_compat

    @property
    def use_recovery(self) -> str:
        return "zero" if self.official_compat else self.recovery

    @property
    def use_dar_form(self) -> str:
        return "l2" if self.official_compat else self.dar_form

    @property
    def use_ce_norm(self) -> str:
        return "batch" if self.official_compat else self.ce_norm

    @property
    def use_prune_scheme(self) -> str:
        return "official" if self.official_compat else self.prune_scheme


# ============================================================================= Eqs. 1-2

def fusion_factor(t: int, alpha0: float = 0.9, epsilon: float = 0.2, alpha_min: float = 0.1) -> float:
    """Eq. 2: alpha^t = max((1 - epsilon)^(t - 1) * alpha0, alpha_min), t = 1, 2, ..."""
    return max((1.0 - epsilon) ** (t - 1) * alpha0, alpha_min)


def fuse(global_sd: dict, local_sd: dict, alpha: float) -> dict:
    """Eq. 1: w = alpha * W^{t-1} + (1 - alpha) * w_hat on every floating-point entry (weights,
    biases, BN affine and running statistics); integer entries (num_batches_tracked) stay local."""
    out = {}
    for k, v in local_sd.items():
        if v.is_floating_point():
            g = global_sd[k].to(v.device, v.dtype)
            out[k] = alpha * g + (1.0 - alpha) * v
        else:
            out[k] = v.clone()
    return out


# ============================================================================= Eqs. 3-5

def dar_term(z: torch.Tensor, form: str = "l2") -> torch.Tensor:
    """Eq. 3 averaged over the batch: mean_b ||z_b||_2^2 ("squared", paper) or mean_b ||z_b||_2
    ("l2", official code)."""
    z = z.flatten(1)
    if form == "squared":
        return z.pow(2).sum(dim=1).mean()
    return z.norm(p=2, dim=1).mean()


def local_objective(logits: torch.Tensor, y: torch.Tensor, z: torch.Tensor | None, gamma: float,
                    dar_form: str = "l2", num_labels: int = 1) -> torch.Tensor:
    """Eq. 5: L = L_CE + gamma * L_DAR, with Eq. 4's L_CE = batch mean of -(1/|K_i|) sum_k y_k log y_hat_k,
    i.e. the usual cross-entropy divided by |K_i| (``num_labels`` = 1: the code's plain CE)."""
    loss = F.cross_entropy(logits, y) / num_labels
    if gamma > 0 and z is not None:
        loss = loss + gamma * dar_term(z, dar_form)
    return loss


class RepresentationTap:
    """Captures z, the input of the predictor g_p (the last Linear), on every forward pass, and keeps
    the running mean of ||z_b||_2 so a run shows whether the DAR term is collapsing the representation."""

    def __init__(self, model: nn.Module):
        head = getattr(model, "head", None)
        if not isinstance(head, nn.Linear):
            linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
            if not linears:
                raise UserError("DapperFL needs a model whose last layer is an nn.Linear (the predictor)")
            head = linears[-1]
        self.z = None
        self.norm_sum, self.batches = None, 0  # on the device, float64: no sync per step
        self._handle = head.register_forward_pre_hook(self._hook)

    def _hook(self, module, inputs):
        self.z = inputs[0]
        norm = self.z.detach().flatten(1).norm(p=2, dim=1).mean().to(torch.float64)
        self.norm_sum = norm if self.norm_sum is None else self.norm_sum + norm
        self.batches += 1

    @property
    def mean_norm(self) -> float:
        """mean over the forward passes so far of mean_b ||z_b||_2."""
        return (0.0 if self.norm_sum is None else float(self.norm_sum)) / max(self.batches, 1)

    def remove(self):
        self._handle.remove()
        self.z = None


# ============================================================================= Eq. 6

def recover(tensors: dict, masks: dict, prev_global: dict, mode: str = "global") -> dict:
    """Eq. 6: w := w * M + W^{t-1} * (1 - M) on every masked entry; other entries as uploaded.
    ``mode="zero"`` (official code) leaves pruned slots at 0."""
    out = dict(tensors)
    for k, m in masks.items():
        w = tensors[k]
        m = m.to(w.device)
        fill = prev_global[k].to(w.device, w.dtype) if mode == "global" else torch.zeros_like(w)
        out[k] = torch.where(m, w, fill)
    return out


# ============================================================================= the method

class DapperFL(Method):
    name = "dapperfl"
    Hparams = DapperFLHparams
    aggregator = KeepAll()  # Eq. 6 needs each client's masks
    paper = "Jia et al., NeurIPS 2024"
    shares = 'shares pruned sub-models (fusion pruning, tier ratio rho); server recovers and aggregates'

    # ---- system heterogeneity ------------------------------------------------------------
    @cached_property
    def tiers(self) -> ClientTiers:
        """Each client's capability tier: its profile's (clients.profiles), else DapperFL's own
        assignment (hp.dapperfl.tier_assignment, tier_shares)."""
        how = "round_robin" if self.hp.tier_assignment == "modulo" else "random"
        return ClientTiers(self.setup, len(self.hp.rho_levels), method=self.name, shares=self.hp.tier_shares,
                           how=how, purpose="dapperfl-tiers", checked=False)  # a profile may carry its rho

    def client_tier(self, client_id: int) -> int:
        return self.tiers(client_id)

    def client_rho(self, client_id: int) -> float:
        """rho_i: hp.rho if set, else a profile's "rho", else the ratio of the client's tier."""
        if self.hp.rho is not None:
            return self.hp.rho
        profiles = self.setup.client_profiles
        if client_id < len(profiles) and "rho" in profiles[client_id]:
            return float(profiles[client_id]["rho"])
        return self.hp.rho_levels[self.client_tier(client_id)]

    def client_footprint(self, client_id: int, dense: dict) -> dict:
        """What the device must hold: the paper's premise that a C_i device affords a (1 - rho_i) share
        of the model (its memory budget). The clock measures the passes themselves: the dense
        fine-tune epoch, the pruned epochs and the dense BN pass of ``bn_stats: recovered``."""
        keep = 1.0 - self.client_rho(client_id)
        return {"params": dense["params"] * keep, "macs": dense["macs"] * keep}

    def num_labels(self, ctx: ClientContext) -> int:
        """|K_i|: the labels present in the client's training data."""
        return max(1, len(ctx.data.train.classes))

    def alpha(self, t: int) -> float:
        return fusion_factor(t, self.hp.alpha0, self.hp.epsilon, self.hp.alpha_min)

    def init_client_state(self, client_id: int, model: nn.Module) -> dict:
        # Nothing is carried between rounds but the device's fixed capability.
        return {"personal": {}, "tier": self.client_tier(client_id), "rho": self.client_rho(client_id)}

    # ---- client: Algorithm 1, then epochs 2..E -------------------------------------------
    def local_update(self, ctx: ClientContext) -> Upload:
        hp, model, t = self.hp, ctx.model, ctx.train
        rho = self.client_rho(ctx.client_id)
        received = {k: v.detach().clone() for k, v in model.state_dict().items()}  # W^{t-1}
        opt = ctx.optimizer()  # one optimizer for all E epochs: momentum crosses the prune (code)
        tap = RepresentationTap(model)
        k = self.num_labels(ctx) if hp.use_ce_norm == "labels" else 1
        ft_epochs = min(hp.finetune_epochs, t.epochs)
        pruned_epochs = t.epochs - ft_epochs
        ft_steps, pruned_steps = _split_steps(t.max_steps, ft_epochs, t.epochs)
        try:
            # line 1: fine-tune the full model W^{t-1} -> w_hat (Eq. 5; the DAR term as the code has it)
            gamma = hp.gamma if hp.dar_in_finetune else 0.0
            for x, y in ctx.batches(ft_epochs, max_steps=ft_steps):
                ctx.step(local_objective(model(x), y, tap.z, gamma, hp.use_dar_form, k), opt)
            steps_ft = ctx.steps
            # line 2: fuse (Eqs. 1-2)
            alpha = 0.0
            if hp.use_fusion and ctx.round >= hp.fuse_from_round:
                alpha = self.alpha(ctx.round)
                model.load_state_dict(fuse(received, model.state_dict(), alpha))
            # lines 3-4: masks on the fused weights, w <- w * M
            masks = prune_masks(model, rho, hp.use_prune_scheme)
            params = dict(model.named_parameters())
            active = {k: m.to(params[k].device, params[k].dtype) for k, m in masks.items() if not bool(m.all())}
            apply_masks(model, active)
            # Alg. 2 lines 2-3: train the pruned model with Eq. 5, pruned entries held at 0
            if pruned_epochs > 0 and pruned_steps != 0:
                for x, y in ctx.batches(pruned_epochs, max_steps=pruned_steps):
                    ctx.step(local_objective(model(x), y, tap.z, hp.gamma, hp.use_dar_form, k), opt)
                    apply_masks(model, active)
        finally:
            z_norm = tap.mean_norm
            tap.remove()
        stats = ctx.stats()
        sent = {k: masks[k].detach().cpu() for k in active}
        if hp.bn_stats == "recovered" and sent:
            # the statistics of the model the server will average for this client (Eq. 6 applied
            # here, to the client's own upload), not of the pruned sub-network (module docstring)
            self.recovered_bn_stats(ctx, sent, received)
        foot = self.footprint(model, rho, masks)
        # forward FLOPs of the round: the dense fine-tune epoch, the pruned epochs, and the extra dense
        # pass over D_i that re-estimates the recovered model's BN statistics (bn_stats: recovered)
        n, bs = ctx.data.num_train, t.batch_size
        seen = {phase: n * e if steps == e * math.ceil(n / bs) else steps * bs
                for phase, steps, e in (("ft", steps_ft, ft_epochs), ("pruned", stats["steps"] - steps_ft, pruned_epochs))}
        compute = {"fwd_flops_train": foot["flops_dense"] * seen["ft"] + foot["flops"] * seen["pruned"],
                   "fwd_flops_bn_pass": foot["flops_dense"] * n if hp.bn_stats == "recovered" and sent else 0.0}
        metrics = {**stats, "rho": rho, "tier": self.client_tier(ctx.client_id),
                   "alpha": alpha, "z_norm": z_norm, **foot, **compute}
        tensors = {k: v.detach() for k, v in model.state_dict().items()}
        return Upload(tensors=tensors, weight=client_weight(ctx), extras={"masks": sent}, metrics=metrics)

    def recovered_bn_stats(self, ctx: ClientContext, masks: dict, received: dict) -> None:
        """Replace the model's BN running statistics by those of its Eq.-6-recovered dense version
        w * M + W^{t-1} * (1 - M) on D_i (one forward pass, no gradient); the weights stay w * M."""
        model = ctx.model
        trained = {k: v.detach().clone() for k, v in model.state_dict().items()}
        model.load_state_dict(recover(trained, masks, received, self.hp.use_recovery))
        stats = collect_bn_stats(model, ctx.batches(1, max_steps=None))  # one pass, no step
        trained.update(stats)
        model.load_state_dict(trained)

    def footprint(self, model: nn.Module, rho: float, masks: dict) -> dict:
        """The pruned local model's real footprint beside the paper's nominal (1 - rho) x dense."""
        return measure_footprint(model, rho, tuple(model.input_shape), masks)

    @classmethod
    def report_markdown(cls, config, metrics) -> str:
        """summary.md: the footprint each tier's clients measured (Tables 5-6); see footprint.py."""
        hp = cls.hparams_from(config.hp.get(cls.name) if config is not None else None)
        return summary_section(config, metrics, hp)

    # ---- server: Eqs. 6-7 ----------------------------------------------------------------
    def aggregate(self, state: dict, uploads, round: int) -> dict:
        prev = state["global"]
        recovered = ((recover(up.tensors, up.extras.get("masks", {}), prev, self.hp.use_recovery), up.weight)
                     for up in uploads.each.values())  # Eq. 6, client by client
        return {**state, "global": weighted_mean(recovered, like=prev)}  # Eq. 7


def _split_steps(max_steps: int | None, ft_epochs: int, epochs: int) -> tuple[int | None, int | None]:
    """train.max_steps caps the whole round: the fine-tune share is max_steps * ft_epochs / E."""
    if not max_steps:
        return None, None
    ft = min(max_steps, max(1, int(round(max_steps * ft_epochs / epochs))))
    return ft, max_steps - ft
