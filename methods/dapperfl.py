"""DapperFL — Jia et al., "DapperFL: Domain Adaptive Federated Learning with Model Fusion
Pruning for Edge Devices", NeurIPS 2024.

Every client i has a fixed pruning ratio rho_i, set by its capability tier C_1..C_5
(rho in {0, 0.2, 0.4, 0.6, 0.8}, two clients per tier by default).

Client i, round t (Algorithm 1 = local epoch 1, then Algorithm 2 lines 1-3):
    w_hat  <- W^{t-1} after one epoch of SGD on D_i, the full (dense) model       (Alg. 1 line 1)
    a_t     = max((1 - eps)^(t-1) * alpha0, alpha_min)                           (Eq. 2)
    w       = a_t * W^{t-1} + (1 - a_t) * w_hat        (t >= fuse_from_round = 1)    (Eq. 1)
    M       = structured L1 masks of w at ratio rho_i                             (Alg. 1 line 3)
    w       <- w * M                                                              (Alg. 1 line 4)
    for e = 2..E, every batch:  z = g_e(w_e * M_e; x),  logits = g_p(w_p * M_p; z)
        L = CE(logits, y) + gamma * mean_b ||z_b||_2^2                            (Eqs. 3-5)
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

Switches (defaults = the paper; ``official_compat`` = the published code's behaviour, spec
section 10): fusion off, pruned slots averaged as zeros, DAR = gamma * mean_b ||z_b|| (not squared),
plain batch-mean CE (no 1/|K_i|), the code's in + out channel masks. The fine-tune epoch uses Eq. 5
too (the paper does not say; the code does), and one SGD optimizer spans all E epochs, so momentum
crosses the prune (code).

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

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from raysim.errors import UserError
from raysim.methods.base import ClientContext, Hparams, Method, Space, Upload, Uploads, client_weight
from raysim.training import collect_bn_stats

PAPER_LEVELS = (0.0, 0.2, 0.4, 0.6, 0.8)  # rho of capability tiers C_1..C_5 (Sec. 4.2)


# ============================================================================= hyperparameters

@dataclass(frozen=True)
class DapperFLHparams(Hparams):
    alpha0: float = 0.9  # initial fusion factor (Table 4)
    alpha_min: float = 0.1  # floor of the fusion factor (Table 4)
    epsilon: float = 0.2  # decay ("sensitivity") of the fusion factor per round (Table 4)
    gamma: float = 0.01  # DAR weight (Table 4)
    # ---- system heterogeneity: who gets which pruning ratio ----
    rho_levels: tuple = PAPER_LEVELS  # rho of each capability tier C_1..C_L
    tier_shares: tuple | None = None  # share of the clients in each tier; None: equal shares
    tier_assignment: str = "seeded"  # "seeded": balanced slots shuffled by setup.seed |
    #                                  "modulo": client k -> tier k mod L (the official code)
    rho: float | None = None  # one ratio for every client (Fig. 3, Tables 5-6); overrides tiers
    # ---- variants (spec section 2.6) ----
    fusion: bool = True  # Eq. 1-2 ("w/o MFP" ablation: False)
    fuse_from_round: int = 1  # Eq. 2 holds from t = 1 (paper); 2 = the code's guard (W^0 is random)
    recovery: str = "global"  # Eq. 6: "global" (pruned slots <- W^{t-1}) | "zero" (code)
    dar_form: str = "squared"  # Eq. 3: "squared" ||z||^2 | "l2" ||z|| (code)
    ce_norm: str = "batch"  # Eq. 4: "batch" plain batch-mean CE (code, spec 9.4) | "labels" CE / |K_i| (literal)
    dar_in_finetune: bool = True  # CE + gamma * DAR in the fine-tune epoch too (code)
    finetune_epochs: int = 1  # dense epochs before pruning (Alg. 1 line 1: one)
    # "filters": output filters by L1, proportion of 0 in M = rho (paper) | "official": in + out channels (code)
    prune_scheme: str = "filters"
    # BN running statistics of the upload (the paper is silent on them):
    # "recovered": re-estimated on the client's Eq.-6-recovered dense model (one forward pass over D_i) |
    # "pruned": those the pruned epochs leave (the literal reading: the global model then evaluates at chance)
    bn_stats: str = "recovered"
    official_compat: bool = False  # forces fusion=False, recovery="zero", dar_form="l2", ce_norm="batch",
    #                                prune_scheme="official"

    def __post_init__(self):
        def bad(key, expected):
            raise UserError(f"hyperparameter 'hp.dapperfl.{key}' = {getattr(self, key)!r}: expected {expected}")

        levels = self.rho_levels
        if isinstance(levels, (int, float)) and not isinstance(levels, bool):
            levels = (levels,)
        if not isinstance(levels, (list, tuple)) or not levels or not all(
                isinstance(r, (int, float)) and not isinstance(r, bool) and 0 <= r < 1 for r in levels):
            bad("rho_levels", "a non-empty list of ratios in [0, 1)")
        object.__setattr__(self, "rho_levels", tuple(float(r) for r in levels))
        if self.tier_shares is not None:
            shares = self.tier_shares
            if not isinstance(shares, (list, tuple)) or len(shares) != len(self.rho_levels) or not all(
                    isinstance(s, (int, float)) and not isinstance(s, bool) and s >= 0 for s in shares) \
                    or sum(shares) <= 0:
                bad("tier_shares", f"{len(self.rho_levels)} non-negative numbers (one per tier), not all 0")
            object.__setattr__(self, "tier_shares", tuple(float(s) for s in shares))
        if self.rho is not None:
            if isinstance(self.rho, bool) or not isinstance(self.rho, (int, float)) or not 0 <= self.rho < 1:
                bad("rho", "null or a ratio in [0, 1)")
            object.__setattr__(self, "rho", float(self.rho))
        for key, allowed in {"tier_assignment": ("seeded", "modulo"), "recovery": ("global", "zero"),
                             "dar_form": ("squared", "l2"), "ce_norm": ("labels", "batch"),
                             "prune_scheme": ("official", "filters"),
                             "bn_stats": ("recovered", "pruned")}.items():
            if getattr(self, key) not in allowed:
                bad(key, "one of " + ", ".join(allowed))
        if not (0 <= self.alpha_min <= 1 and 0 <= self.alpha0 <= 1):
            bad("alpha0", "alpha0 and alpha_min in [0, 1]")
        if not 0 <= self.epsilon < 1:
            bad("epsilon", "a number in [0, 1)")
        if self.gamma < 0:
            bad("gamma", ">= 0")
        if self.finetune_epochs < 1:
            bad("finetune_epochs", "at least 1")
        if self.fuse_from_round < 1:
            bad("fuse_from_round", "at least 1")

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


# ============================================================================= Eq. 2, Eq. 1

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


# ============================================================================= masks (Alg. 1 line 3)

def num_pruned(size: int, rho: float) -> int:
    """round(rho * size), halves rounded up (with the paper's ratios and widths there are none)."""
    return min(size, int(math.floor(rho * size + 0.5 + 1e-9)))


def top_mask(scores: torch.Tensor, keep: int) -> torch.Tensor:
    """Boolean mask keeping the ``keep`` highest scores (ties: the lower index)."""
    mask = torch.zeros(scores.numel(), dtype=torch.bool, device=scores.device)
    if keep > 0:
        order = torch.argsort(scores.detach().double(), descending=True, stable=True)
        mask[order[:keep]] = True
    return mask


def layer_roles(model: nn.Module, scheme: str = "filters") -> dict[str, str]:
    """Which layers are pruned and how: {module name: role}.

    Roles: "stem" (never pruned), "out" (output filters), "in_out" (input channels, then output
    filters), "norm" (norm weight, unstructured), "linear" (input columns).
    """
    roles: dict[str, str] = {}
    convs = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Conv2d)]
    shortcuts = [n for n, _ in convs if "shortcut" in n.split(".") or "downsample" in n.split(".")]
    first_shortcut = shortcuts[0] if shortcuts else None
    for i, (name, _) in enumerate(convs):
        if i == 0:
            roles[name] = "stem"
        elif scheme == "filters" or i == 1 or name == first_shortcut:
            roles[name] = "out"
        else:
            roles[name] = "in_out"
    from raysim.models.norm import is_norm
    norms = [n for n, m in model.named_modules() if is_norm(m) and getattr(m, "weight", None) is not None]
    for i, name in enumerate(norms):
        roles[name] = "stem" if i == 0 else "norm"
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            roles[name] = "linear"
    return roles


@torch.no_grad()
def prune_masks(model: nn.Module, rho: float, scheme: str = "filters") -> dict[str, torch.Tensor]:
    """{state-dict key of a weight: boolean mask of its shape} at pruning ratio ``rho``.

    Every prunable weight gets a mask (all True at rho = 0); a key that is absent is never pruned.
    """
    masks: dict[str, torch.Tensor] = {}
    modules = dict(model.named_modules())
    for name, role in layer_roles(model, scheme).items():
        if role == "stem":
            continue
        w = modules[name].weight.detach()
        key = f"{name}.weight" if name else "weight"
        if role in ("out", "in_out"):  # conv weight (C_out, C_in, kh, kw)
            c_out, c_in = w.shape[0], w.shape[1]
            m_in = torch.ones(c_in, dtype=torch.bool, device=w.device)
            if role == "in_out":
                m_in = top_mask(w.abs().sum(dim=(0, 2, 3)), c_in - num_pruned(c_in, rho))
            scored = w.abs() * m_in.view(1, -1, 1, 1)
            m_out = top_mask(scored.sum(dim=(1, 2, 3)), c_out - num_pruned(c_out, rho))
            masks[key] = (m_out.view(-1, 1, 1, 1) & m_in.view(1, -1, 1, 1)).expand_as(w).clone()
        elif role == "norm":  # gamma: smallest |gamma_c| zeroed
            masks[key] = top_mask(w.abs(), w.numel() - num_pruned(w.numel(), rho)).view_as(w)
        elif role == "linear":  # (out, in): input columns by L2 norm
            cols = top_mask(w.norm(p=2, dim=0), w.shape[1] - num_pruned(w.shape[1], rho))
            masks[key] = cols.view(1, -1).expand_as(w).clone()
    return masks


@torch.no_grad()
def apply_masks(model: nn.Module, masks: dict[str, torch.Tensor]) -> None:
    """w <- w * M in place (Alg. 1 line 4; also after every step of the pruned epochs)."""
    params = dict(model.named_parameters())
    for key, m in masks.items():
        p = params[key]
        p.mul_(m.to(p.device, p.dtype))


# ============================================================================= Eq. 3

def dar_term(z: torch.Tensor, form: str = "squared") -> torch.Tensor:
    """Eq. 3 averaged over the batch: mean_b ||z_b||_2^2 ("squared", paper) or mean_b ||z_b||_2
    ("l2", official code)."""
    z = z.flatten(1)
    if form == "squared":
        return z.pow(2).sum(dim=1).mean()
    return z.norm(p=2, dim=1).mean()


def local_objective(logits: torch.Tensor, y: torch.Tensor, z: torch.Tensor | None, gamma: float,
                    dar_form: str = "squared", num_labels: int = 1) -> torch.Tensor:
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
        self.norm_sum, self.batches = 0.0, 0
        self._handle = head.register_forward_pre_hook(self._hook)

    def _hook(self, module, inputs):
        self.z = inputs[0]
        self.norm_sum += float(self.z.detach().flatten(1).norm(p=2, dim=1).mean())
        self.batches += 1

    @property
    def mean_norm(self) -> float:
        """mean over the forward passes so far of mean_b ||z_b||_2."""
        return self.norm_sum / max(self.batches, 1)

    def remove(self):
        self._handle.remove()
        self.z = None


# ============================================================================= Eq. 6-7

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


def weighted_mean(pairs, like: dict) -> dict:
    """Eq. 7: sum_i (n_i / n) w_i over ``pairs`` = iterable of (state dict, n_i), streamed (one model
    at a time) and summed in float64, then cast back to each entry's dtype (integers rounded)."""
    acc: dict[str, torch.Tensor] = {}
    total = 0.0
    for sd, n in pairs:
        total += float(n)
        for k in like:
            v = sd[k].detach().to("cpu", torch.float64) * float(n)
            acc[k] = acc[k] + v if k in acc else v
    out = {}
    for k, ref in like.items():
        mean = acc[k] / total
        out[k] = mean.to(ref.dtype) if ref.is_floating_point() else mean.round().to(ref.dtype)
    return out


# ============================================================================= tiers

def tier_counts(num_clients: int, shares: tuple | None, num_tiers: int) -> list[int]:
    """Clients per tier: shares * N, rounded by largest remainder (ties: the lower tier)."""
    shares = shares or (1.0,) * num_tiers
    quotas = [s / sum(shares) * num_clients for s in shares]
    counts = [int(math.floor(q + 1e-9)) for q in quotas]
    order = sorted(range(num_tiers), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in order[:num_clients - sum(counts)]:
        counts[i] += 1
    return counts


def assign_tiers(num_clients: int, num_tiers: int, shares: tuple | None = None,
                 how: str = "seeded", seed: int = 0) -> list[int]:
    """Tier of each client. "modulo": cycle through the tiers that still have room (client k ->
    k mod L with equal shares, the official code's rule); "seeded": the same slots, shuffled by a
    generator keyed by the seed (the paper's random pairing of clients, domains and levels)."""
    counts = tier_counts(num_clients, shares, num_tiers)
    left, slots, k = list(counts), [], 0
    while len(slots) < num_clients:
        if left[k % num_tiers] > 0:
            slots.append(k % num_tiers)
            left[k % num_tiers] -= 1
        k += 1
    if how == "modulo":
        return slots
    from raysim.runtime.seeding import SERVER, rng_for
    perm = rng_for(seed, 0, SERVER, "dapperfl-tiers").permutation(num_clients)
    return [slots[int(i)] for i in perm]


# ============================================================================= the method

class DapperFL(Method):
    name = "dapperfl"
    Hparams = DapperFLHparams
    aggregation = "per_client"
    paper = "Jia et al., NeurIPS 2024"

    # ---- system heterogeneity ------------------------------------------------------------
    def client_tier(self, client_id: int) -> int:
        profiles = getattr(self.setup, "client_profiles", ()) or ()
        if client_id < len(profiles) and "tier" in profiles[client_id]:
            return int(profiles[client_id]["tier"])
        if not hasattr(self, "_tiers"):
            self._tiers = assign_tiers(self.setup.num_clients, len(self.hp.rho_levels), self.hp.tier_shares,
                                       self.hp.tier_assignment, self.setup.seed)
        return self._tiers[client_id] if client_id < len(self._tiers) else client_id % len(self.hp.rho_levels)

    def client_rho(self, client_id: int) -> float:
        """rho_i: hp.rho if set, else a profile's "rho", else the ratio of the client's tier."""
        if self.hp.rho is not None:
            return self.hp.rho
        profiles = getattr(self.setup, "client_profiles", ()) or ()
        if client_id < len(profiles) and "rho" in profiles[client_id]:
            return float(profiles[client_id]["rho"])
        return self.hp.rho_levels[self.client_tier(client_id)]

    def num_labels(self, ctx: ClientContext) -> int:
        """|K_i|: the labels present in the client's training data (the label space if unknown)."""
        labels = getattr(getattr(ctx.data, "train", None), "labels", None)
        if labels is None:
            return int(self.setup.num_classes)
        return max(1, int(np.unique(np.asarray(labels)).size))

    def alpha(self, t: int) -> float:
        return fusion_factor(t, self.hp.alpha0, self.hp.epsilon, self.hp.alpha_min)

    def init_client_state(self, client_id: int, model: nn.Module) -> dict:
        # Nothing is carried between rounds but the device's fixed capability.
        return {"personal": {}, "tier": self.client_tier(client_id), "rho": self.client_rho(client_id)}

    # ---- client: Algorithm 1, then epochs 2..E -------------------------------------------
    def local_update(self, ctx: ClientContext) -> Upload:
        from raysim.training import make_sgd, train_epochs
        hp, model, t = self.hp, ctx.model, ctx.train
        rho = self.client_rho(ctx.client_id)
        received = {k: v.detach().clone() for k, v in model.state_dict().items()}  # W^{t-1}
        opt = make_sgd(ctx)  # one optimizer for all E epochs: momentum crosses the prune (code)
        tap = RepresentationTap(model)
        k = self.num_labels(ctx) if hp.use_ce_norm == "labels" else 1

        def objective(with_dar: bool):
            """Eq. 5 as train_epochs' extra term: it adds this to the plain CE it computes itself."""
            gamma = hp.gamma if with_dar else 0.0
            if k == 1 and gamma == 0:
                return None

            def extra(model_, x, y, logits):
                return local_objective(logits, y, tap.z, gamma, hp.use_dar_form, k) - F.cross_entropy(logits, y)
            return extra
        ft_epochs = min(hp.finetune_epochs, t.epochs)
        pruned_epochs = t.epochs - ft_epochs
        ft_steps, pruned_steps = _split_steps(t.max_steps, ft_epochs, t.epochs)
        try:
            # line 1: fine-tune the full model W^{t-1} -> w_hat
            s1 = train_epochs(_capped(ctx, ft_steps), extra_loss=objective(hp.dar_in_finetune),
                              optimizer=opt, epochs=ft_epochs)
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
            s2 = {"loss": 0.0, "steps": 0}
            if pruned_epochs > 0 and pruned_steps != 0:
                s2 = train_epochs(_capped(ctx, pruned_steps), extra_loss=objective(True),
                                  optimizer=opt, epochs=pruned_epochs,
                                  after_step=lambda m: apply_masks(m, active))
        finally:
            z_norm = tap.mean_norm
            tap.remove()
        steps = s1["steps"] + s2["steps"]
        loss = (s1["loss"] * s1["steps"] + s2["loss"] * s2["steps"]) / max(steps, 1)
        sent = {k: masks[k].detach().cpu() for k in active}
        if hp.bn_stats == "recovered" and sent:
            # the statistics of the model the server will average for this client (Eq. 6 applied
            # here, to the client's own upload), not of the pruned sub-network (module docstring)
            self.recovered_bn_stats(ctx, sent, received)
        foot = self.footprint(model, rho, masks)
        # forward FLOPs of the round: the dense fine-tune epoch, the pruned epochs, and the extra dense
        # pass over D_i that re-estimates the recovered model's BN statistics (bn_stats: recovered)
        n, bs = ctx.data.num_train, t.batch_size
        seen = {k: n * e if s["steps"] == e * math.ceil(n / bs) else s["steps"] * bs
                for k, s, e in (("ft", s1, ft_epochs), ("pruned", s2, pruned_epochs))}
        compute = {"fwd_flops_train": foot["flops_dense"] * seen["ft"] + foot["flops"] * seen["pruned"],
                   "fwd_flops_bn_pass": foot["flops_dense"] * n if hp.bn_stats == "recovered" and sent else 0.0}
        metrics = {"loss": loss, "steps": steps, "rho": rho, "tier": self.client_tier(ctx.client_id),
                   "alpha": alpha, "z_norm": z_norm, **foot, **compute}
        tensors = {k: v.detach() for k, v in model.state_dict().items()}
        return Upload(tensors=tensors, weight=client_weight(ctx), extras={"masks": sent}, metrics=metrics)

    def recovered_bn_stats(self, ctx: ClientContext, masks: dict, received: dict) -> None:
        """Replace the model's BN running statistics by those of its Eq.-6-recovered dense version
        w * M + W^{t-1} * (1 - M) on D_i (one forward pass, no gradient); the weights stay w * M."""
        model = ctx.model
        trained = {k: v.detach().clone() for k, v in model.state_dict().items()}
        model.load_state_dict(recover(trained, masks, received, self.hp.use_recovery))
        stats = collect_bn_stats(model, ctx.data.batches(ctx.train.batch_size, ctx.generator, ctx.device))
        trained.update(stats)
        model.load_state_dict(trained)

    def footprint(self, model: nn.Module, rho: float, masks: dict) -> dict:
        """The pruned local model's real footprint beside the paper's nominal (1 - rho) x dense."""
        shape = tuple(getattr(model, "input_shape", None) or self.setup.image_shape)
        return measure_footprint(model, rho, shape, masks)

    @classmethod
    def report_markdown(cls, run_dir: str) -> str:
        """summary.md gets the footprint each tier's clients measured (Tables 5-6)."""
        try:
            rows = footprint_from_run(run_dir, show=False)
        except UserError:  # nothing trained yet
            return ""
        hp = cls.hparams_from(_run_hp(run_dir))
        note = (f"BN statistics of the upload: `bn_stats: {hp.bn_stats}`"
                + (" (re-estimated on the client's Eq.-6-recovered dense model: one extra dense forward pass over "
                   "D_i per round, counted in the table)" if hp.bn_stats == "recovered" else
                   " (those the pruned epochs leave: the paper's literal reading)"))
        return footprint_markdown(rows, _run_label(run_dir, rows[0]["round"])) + "\n" + note + "\n"

    # ---- server: Eqs. 6-7 ----------------------------------------------------------------
    def aggregate(self, state: dict, uploads: Uploads, round: int) -> dict:
        if not uploads.each:
            return state
        prev = state["global"]
        recovered = ((recover(up.tensors, up.extras.get("masks", {}), prev, self.hp.use_recovery), up.weight)
                     for _, up in sorted(uploads.each.items()))  # Eq. 6, client by client
        return {**state, "global": weighted_mean(recovered, prev)}  # Eq. 7


def _split_steps(max_steps: int | None, ft_epochs: int, epochs: int) -> tuple[int | None, int | None]:
    """train.max_steps caps the whole round: the fine-tune share is max_steps * ft_epochs / E."""
    if not max_steps:
        return None, None
    ft = min(max_steps, max(1, int(round(max_steps * ft_epochs / epochs))))
    return ft, max_steps - ft


def _capped(ctx: ClientContext, max_steps: int | None) -> ClientContext:
    if max_steps is None:
        return ctx
    return dataclasses.replace(ctx, train=dataclasses.replace(ctx.train, max_steps=max_steps))


# ============================================================================= footprint (Tables 5-6)

def measure_footprint(model: nn.Module, rho: float, input_shape: tuple, masks: dict | None = None) -> dict:
    """Non-zero parameters and FLOPs of a masked model, and the paper's nominal figures.

    ``kept_params``: parameters the masks keep (exact whatever the weight values);
    ``nonzero_params``: parameters that are not exactly zero (also misses, e.g., a BN shift still
    at its initial 0). FLOPs follow the paper's (thop) convention: conv/linear multiply-accumulates
    plus 2 per norm output element; ``flops`` counts only MACs whose weight is not zero.
    """
    from raysim.models import count_flops, count_params
    params = count_params(model)
    flops_dense = count_flops(model, input_shape, count_norm=True)
    pruned = sum(int((~m).sum()) for m in masks.values()) if masks is not None else 0
    return {"params": float(params), "kept_params": float(params - pruned),
            "nonzero_params": float(count_params(model, nonzero_only=True)),
            "flops_dense": float(flops_dense),
            "flops": float(count_flops(model, input_shape, nonzero_only=True, count_norm=True)),
            "nominal_params": (1.0 - rho) * params, "nominal_flops": (1.0 - rho) * flops_dense}


def footprint_table(model: str | nn.Module = "resnet10", levels=PAPER_LEVELS, *, num_classes: int = 10,
                    in_channels: int = 3, input_size: int = 32, scheme: str = "filters",
                    seed: int = 0, show: bool = True) -> list[dict]:
    """Per-tier footprint of the pruned local model: measured non-zero parameters and FLOPs next to
    the paper's nominal (1 - rho) x dense (Tables 5-6). The mask sizes do not depend on the weight
    values, so a freshly initialised model gives the exact counts of any round."""
    if isinstance(model, str):
        from raysim.models import build
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            net = build(model, num_classes=num_classes, in_channels=in_channels, input_size=input_size)
        label = f"{model} ({in_channels}x{input_size}x{input_size}, {num_classes} classes, {scheme} masks)"
    else:
        net, label = model, type(model).__name__
    dense = {k: v.detach().clone() for k, v in net.state_dict().items()}
    shape = (in_channels, input_size, input_size)
    rows = []
    for tier, rho in enumerate(levels, start=1):
        net.load_state_dict(dense)
        masks = prune_masks(net, rho, scheme)
        apply_masks(net, masks)
        f = measure_footprint(net, rho, shape, masks)
        rows.append({"tier": f"C{tier}", "rho": rho, **f,
                     "params_frac": f["kept_params"] / f["params"], "flops_frac": f["flops"] / f["flops_dense"]})
    net.load_state_dict(dense)
    if show:
        print(format_footprint(rows, label))
    return rows


def format_footprint(rows: list[dict], label: str = "") -> str:
    head = (f"{'tier':<5}{'rho':>5} | {'nominal #Para':>14}{'measured #Para':>16}{'frac':>7} | "
            f"{'nominal FLOPs':>14}{'measured FLOPs':>16}{'frac':>7}")
    lines = [f"DapperFL footprint per tier: {label}" if label else "DapperFL footprint per tier", head,
             "-" * len(head)]
    for r in rows:
        lines.append(f"{r['tier']:<5}{r['rho']:>5.1f} | {r['nominal_params'] / 1e6:>13.3f}M"
                     f"{r['kept_params'] / 1e6:>15.3f}M{r['params_frac']:>7.3f} | "
                     f"{r['nominal_flops'] / 1e6:>13.2f}M{r['flops'] / 1e6:>15.2f}M{r['flops_frac']:>7.3f}")
    lines.append("nominal = (1 - rho) x dense (the paper's Tables 5-6); measured #Para = parameters the masks "
                 "keep; measured FLOPs = MACs with a non-zero weight + 2 per norm output (thop convention)")
    return "\n".join(lines)


def footprint_from_run(run_dir: str, show: bool = True) -> list[dict]:
    """The footprint table of a finished run, from the per-client metrics its clients reported
    (``run_dir`` is a DapperFL run or a comparison holding a ``dapperfl/`` folder): one row per tier,
    at the run's own input size, with the clients of the tier and their domains."""
    import os
    from raysim.metrics import read
    for d in (run_dir, os.path.join(run_dir, "dapperfl")):
        if os.path.isfile(os.path.join(d, "metrics.parquet")):
            break
    else:
        raise UserError(f"no DapperFL metrics.parquet in {run_dir} or {os.path.join(run_dir, 'dapperfl')}")
    df = read(os.path.join(d, "metrics.parquet"))
    df = df[(df.split == "train") & (df.client >= 0)]
    if "kept_params" not in set(df.metric):
        raise UserError(f"{d} holds no footprint metrics (not a DapperFL run?)")
    round_ = int(df["round"].max())
    last = df[df["round"] == round_]
    wide = last.pivot_table(index="client", columns="metric", values="value", aggfunc="first")
    domains = dict(zip(last.client, last.domain))
    rows = []
    for tier, g in wide.groupby("tier", sort=True):
        f = g.iloc[0]
        clients = ", ".join(f"{int(c)} ({domains[c]})" for c in g.index)
        compute = {k: float(g[k].mean()) for k in ("fwd_flops_train", "fwd_flops_bn_pass") if k in g}
        rows.append({"tier": f"C{int(tier) + 1}", "rho": float(f["rho"]), "clients": clients, "round": round_, **compute,
                     **{k: float(f[k]) for k in ("params", "kept_params", "nonzero_params", "flops_dense", "flops",
                                                 "nominal_params", "nominal_flops")},
                     "params_frac": float(f["kept_params"] / f["params"]),
                     "flops_frac": float(f["flops"] / f["flops_dense"])})
    if show:
        print(format_footprint(rows, _run_label(d, round_)))
        for r in rows:
            print(f"  {r['tier']}: clients {r['clients']}")
    return rows


def _run_hp(run_dir: str) -> dict:
    import os
    import yaml
    for d in (run_dir, os.path.join(run_dir, "dapperfl")):
        if os.path.isfile(os.path.join(d, "config.yaml")):
            with open(os.path.join(d, "config.yaml"), encoding="utf-8") as fh:
                return ((yaml.safe_load(fh) or {}).get("hp") or {}).get("dapperfl") or {}
    return {}


def _run_label(run_dir: str, round: int) -> str:
    import os
    import yaml
    cfg_path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(cfg_path):
        return run_dir
    with open(cfg_path, encoding="utf-8") as fh:
        cfg = yaml.safe_load(fh) or {}
    model = (cfg.get("model") or {}).get("name", "?")
    size = ((cfg.get("data") or {}).get("options") or {}).get("image_size")
    scheme = DapperFL.hparams_from((cfg.get("hp") or {}).get("dapperfl")).use_prune_scheme  # official_compat too
    return f"{model}{f' at {size} px' if size else ''}, {scheme} masks, measured by the clients (round {round})"


def footprint_markdown(rows: list[dict], label: str) -> str:
    """The per-tier footprint as a markdown section (appended to a run's summary.md)."""
    compute = all("fwd_flops_train" in r for r in rows)
    out = [f"## DapperFL footprint per capability tier: {label}", "",
           "| tier | rho | clients | nominal #Para | measured #Para | fraction | nominal FLOPs | measured FLOPs "
           "| fraction |" + (" round fwd FLOPs (training) | + BN pass (share of the round) |" if compute else ""),
           "|---|---|---|---|---|---|---|---|---|" + ("---|---|" if compute else "")]
    for r in rows:
        line = (f"| {r['tier']} | {r['rho']:.1f} | {r.get('clients', '')} | {r['nominal_params'] / 1e6:.3f}M "
                f"| {r['kept_params'] / 1e6:.3f}M | {r['params_frac']:.3f} | {r['nominal_flops'] / 1e6:.2f}M "
                f"| {r['flops'] / 1e6:.2f}M | {r['flops_frac']:.3f} |")
        if compute:
            train, bn = r["fwd_flops_train"], r["fwd_flops_bn_pass"]
            line += f" {train / 1e9:.2f}G | {bn / 1e9:.2f}G ({100 * bn / (3 * train + bn):.1f}%) |"
        out.append(line)
    out += ["", "nominal = (1 - rho) x dense, the paper's Tables 5-6; measured #Para = parameters the masks keep; "
            "measured FLOPs = multiply-accumulates with a non-zero weight + 2 per norm output (thop convention)."]
    if compute:
        out += ["Round fwd FLOPs: forward FLOPs of one client's round (dense fine-tune epoch + pruned epochs, mean "
                "over the tier's clients); + BN pass: the extra dense forward pass over D_i of bn_stats: recovered; "
                "its share counts a training step as 3 forward passes (forward + backward)."]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    # python -m raysim.methods.dapperfl [resnet10|resnet18] [input_size]   the per-tier table of a model
    # python -m raysim.methods.dapperfl RUN_DIR                            the table a run's clients measured
    import os
    import sys
    if len(sys.argv) > 1 and os.path.isdir(sys.argv[1]):
        footprint_from_run(sys.argv[1])
        sys.exit(0)
    name = sys.argv[1] if len(sys.argv) > 1 else "resnet10"
    size = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    footprint_table(name, input_size=size)
    footprint_table(name, input_size=size, scheme="official")
