"""CSAC — Yuan, Ma, Chen, Kuang, Wu, Lin, "Collaborative Semantic Aggregation and Calibration
for Federated Domain Generalization", IEEE TKDE 2023 (arXiv 2110.06736).

One client per source domain h = 1..H; the held-out target domain never trains (the engine's
``eval.protocol: lodo``). Three processes (Sec. 3.3-3.6):

Local semantic acquisition (engine round 1, once per client, no communication until its end):
    G^h  <- stage1_epochs of SGD on D^h with label-smoothed CE                     (Eq. 2)
            p_c = (1 - a_LS) 1[y = c] + a_LS / C,   a_LS = 0.1
    L^h  := frozen copy of G^h, kept in ``ctx.state["reference"]`` for the whole run
    upload G^h

Data-free semantic aggregation (server, every round; "layer" = every state-dict tensor):
    AVG_l = 1/H sum_h G_l^h                                                        (Eq. 3)
    d_l^h = || G_l^h - AVG_l ||_2,   w_l^h = d_l^h / sum_k d_l^k   (1/H if all d = 0)
    M_l   = sum_h w_l^h G_l^h                                                      (Eq. 4)
    (farther from the average -> larger weight; with H = 2 this is exactly the plain mean;
     data sizes are not used; integer buffers take the max)

Cross-layer semantic calibration (client h, engine rounds 2..T+1, starting from M):
    F_l = output of layer l in R of the trained copy M^h, E_m = of the frozen L^h (eval mode)
    a_l = ProjM_l(F_l),  b_m = ProjL_m(E_m)   (one conv each, to c x g x w; fresh every round) (Eq. 5)
    s^p_lm = avg_batch avg(A_l^T B_m)   s^c_lm = avg_batch avg(A_l B_m^T)   (A, B: c x d)
    a^p_lm = softmax_m(s^p_l.),  a^c_lm = softmax_m(s^c_l.),  alpha_lm = (a^p + a^c) / 2  (Eqs. 7-9)
    L_AL = sum_l sum_m stopgrad(alpha_lm) MKMMD(flat a_l, flat b_m)                (Eq. 6)
    L_AR = CE(M^h(x), y)                       (hard labels)                       (Eq. 10)
    L_CB = L_AR + lam L_AL,   lam = 0.6                                            (Eq. 11)
    M^h and the projections take SGD steps (two optimizers, same lr/momentum); upload M^h.

Engine mapping: ``rounds = T + 1``. Round 1 is the acquisition round (its aggregation is the
first fusion of the stage-1 models); rounds 2..T+1 are calibrate -> fuse, and every fused model
is evaluated. The paper's schedule (30 acquisition epochs, T = 40 rounds of 10 calibration
epochs; 5 on Rotated MNIST) is ``rounds: 41``, ``hp.csac.stage1_epochs: 30``, ``train.epochs: 10``.
An "epoch" is one pass over the client's data (the paper's word) unless ``iters_per_epoch`` /
``stage1_iters_per_epoch`` fix it to a number of iterations (the official code: 20 / 60).

``variant = "official_code"`` reproduces the released code's default run (spec section 9.1):
its alignment loss is always zero (``--mode alpha`` feeds the double sum an empty list), an
undocumented logit-level MK-MMD between L^h and M^h is added with weight lam, and stage 1 uses
plain CE. The ablations of Tables 4-5 are the ``fusion``, ``fusion_distance``, ``alignment``,
``attention``, ``discrepancy``, ``retrain_loss`` and ``label_smoothing`` switches.
"""
from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from raysim.errors import TrainingDiverged, UserError
from raysim.methods.base import ClientContext, Hparams, Method, Space, Upload, Uploads
from raysim.training import make_sgd

MMD_MULTIPLIERS = tuple(3.0 ** k for k in range(-3, 2))  # s_k = 3^-3 .. 3^1 (DAN / TLL, code)
MMD_EPS = 1e-8  # added to sigma^2 so collapsed features cannot divide by zero (spec 9.15)


# ============================================================================= hyperparameters

@dataclass(frozen=True)
class CSACHparams(Hparams):
    lam: float = 0.6  # lambda of Eq. 11 (all experiments)
    label_smoothing: float = 0.1  # alpha of Eq. 2 (stage 1 only)
    stage1_epochs: int = 30  # local semantic acquisition epochs (Sec. 4.1)
    stage1_iters_per_epoch: int = 0  # 0: an epoch is a pass over D^h; the code: 60 iterations
    iters_per_epoch: int = 0  # calibration (train.epochs per round); 0: a pass; the code: 20
    # ---- aggregation (Table 4) ----
    fusion: str = "divergence"  # divergence (Eq. 4) | similarity (closer -> larger) | average (1/H)
    fusion_distance: str = "l2"  # l2 (paper) | l1 | cosine
    # ---- calibration (Table 5) ----
    alignment: str = "cross"  # cross (Eq. 6, all pairs, attention) | same_layer | uniform | none
    attention: str = "both"  # both (Eq. 9) | position (Eq. 7 only) | channel (Eq. 8 only)
    discrepancy: str = "mmd"  # mmd (MK-MMD) | mse
    retrain_loss: bool = True  # L_AR of Eq. 10 ("without cross-entropy" ablation: False)
    layers: tuple = ()  # the layer set R (module names); () = the architecture's default
    proj_channels: int = 32  # c of the projected features (code)
    proj_size: int = 0  # g = w of the projected features; 0 = the last layer of R (paper)
    alpha_temperature: float = 1.0  # softmax temperature of Eqs. 7-8 (the paper has none: 1)
    logit_mmd_weight: float = 0.0  # the code's extra MK-MMD(logits_L, logits_M) weight
    independent_head_init: bool = False  # code: every client draws its own random head
    variant: str = "paper"  # paper | official_code (no L_AL, logit MMD weight lam, plain CE)

    def __post_init__(self):
        def bad(key, expected):
            raise UserError(f"hyperparameter 'hp.csac.{key}' = {getattr(self, key)!r}: expected {expected}")

        for key, allowed in {"fusion": ("divergence", "similarity", "average"),
                             "fusion_distance": ("l2", "l1", "cosine"),
                             "alignment": ("cross", "same_layer", "uniform", "none"),
                             "attention": ("both", "position", "channel"),
                             "discrepancy": ("mmd", "mse"),
                             "variant": ("paper", "official_code")}.items():
            if getattr(self, key) not in allowed:
                bad(key, "one of " + ", ".join(allowed))
        layers = self.layers
        if isinstance(layers, str):
            layers = tuple(s.strip() for s in layers.split(",") if s.strip())
        if not isinstance(layers, (list, tuple)) or not all(isinstance(s, str) and s for s in layers):
            bad("layers", "a list of module names (e.g. [features.layer2, features.layer3])")
        object.__setattr__(self, "layers", tuple(layers))
        if self.lam < 0:
            bad("lam", ">= 0")
        if not 0 <= self.label_smoothing < 1:
            bad("label_smoothing", "a number in [0, 1)")
        if self.stage1_epochs < 0:
            bad("stage1_epochs", ">= 0")
        for key in ("stage1_iters_per_epoch", "iters_per_epoch", "proj_size"):
            if getattr(self, key) < 0:
                bad(key, ">= 0")
        if self.proj_channels < 1:
            bad("proj_channels", ">= 1")
        if self.alpha_temperature <= 0:
            bad("alpha_temperature", "> 0")
        if self.logit_mmd_weight < 0:
            bad("logit_mmd_weight", ">= 0")

    @classmethod
    def search_space(cls):
        return {"lam": Space.uniform(0.1, 1.0)}  # Fig. 6: sensitivity of lambda

    # ---- the settings actually used, after the variant preset ----
    @property
    def use_alignment(self) -> str:
        return "none" if self.variant == "official_code" else self.alignment

    @property
    def use_label_smoothing(self) -> float:
        return 0.0 if self.variant == "official_code" else self.label_smoothing

    @property
    def use_logit_mmd_weight(self) -> float:
        if self.variant == "official_code" and self.logit_mmd_weight == 0:
            return self.lam
        return self.logit_mmd_weight


# ============================================================================= aggregation

def tensor_distances(stack: torch.Tensor, metric: str = "l2") -> torch.Tensor:
    """dist(G_l^h, AVG_l) for each h; ``stack`` is (H, ...) in float64."""
    flat = stack.reshape(stack.shape[0], -1)
    avg = flat.mean(0, keepdim=True)  # Eq. 3
    if metric == "l2":
        return (flat - avg).norm(dim=1)
    if metric == "l1":
        return (flat - avg).abs().sum(1)
    if metric == "cosine":
        cos = F.cosine_similarity(flat, avg.expand_as(flat), dim=1, eps=1e-12)
        return (1.0 - cos).clamp_min(0.0)
    raise ValueError(metric)


def fusion_weights(stack: torch.Tensor, strategy: str = "divergence", metric: str = "l2") -> torch.Tensor:
    """w_l^h of Eq. 4 for one tensor (float64, sums to 1 over h)."""
    h = stack.shape[0]
    uniform = torch.full((h,), 1.0 / h, dtype=torch.float64)
    if strategy == "average":
        return uniform
    d = tensor_distances(stack.to(torch.float64), metric)
    if strategy == "similarity":  # not defined by the paper; spec 2.2 [rec]: w ~ 1 / d
        inv = 1.0 / (d + 1e-12)
        return inv / inv.sum()
    total = d.sum()
    if not torch.isfinite(total) or total <= 0:  # all tensors identical (or H = 1)
        return uniform
    return d / total


def fuse(states: list[dict[str, torch.Tensor]], strategy: str = "divergence",
         metric: str = "l2") -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Layer-wise (tensor-wise) fusion of full state dicts: (fused state, weights per key)."""
    fused, weights = {}, {}
    for key in states[0]:
        ref = states[0][key]
        stack = torch.stack([s[key].detach().to("cpu") for s in states])
        if not ref.is_floating_point():  # num_batches_tracked: no effect at eval time
            fused[key] = stack.max(0).values.to(ref.dtype)
            continue
        w = fusion_weights(stack, strategy, metric)
        weights[key] = w
        mixed = (w.view(-1, *([1] * (stack.dim() - 1))) * stack.to(torch.float64)).sum(0)
        fused[key] = mixed.to(ref.dtype)
    return fused, weights


# ============================================================================= calibration pieces

def mk_mmd(zs: torch.Tensor, zt: torch.Tensor, multipliers=MMD_MULTIPLIERS, eps: float = MMD_EPS) -> torch.Tensor:
    """Multi-kernel MMD (DAN's quadratic-time estimator, equal kernel weights).

    Z = [zs; zt], D_ij = ||Z_i - Z_j||^2, sigma_k^2 = s_k * mean(D) (no gradient, diagonal
    included), K = sum_k exp(-D / (2 sigma_k^2));
    MMD = sum_{i!=j}(K_ss + K_tt) / (B(B-1)) - 2 sum K_st / B^2 + 2 / (B - 1).
    """
    zs, zt = zs.flatten(1), zt.flatten(1)
    b = zs.shape[0]
    if b < 2 or zt.shape[0] != b:
        raise ValueError("mk_mmd needs two batches of the same size >= 2")
    z = torch.cat([zs, zt], 0)
    sq = (z * z).sum(1)
    dist = (sq[:, None] + sq[None, :] - 2.0 * z @ z.t()).clamp_min(0.0)
    mean = dist.detach().mean()
    kernel = sum(torch.exp(-dist / (2.0 * (s * mean + eps))) for s in multipliers)
    k_ss, k_tt, k_st = kernel[:b, :b], kernel[b:, b:], kernel[:b, b:]
    off = (k_ss.sum() - k_ss.diagonal().sum()) + (k_tt.sum() - k_tt.diagonal().sum())
    return off / (b * (b - 1)) - 2.0 * k_st.sum() / (b * b) + 2.0 / (b - 1)


def mk_mmd_pairs(a: torch.Tensor, b: torch.Tensor, multipliers=MMD_MULTIPLIERS,
                 eps: float = MMD_EPS) -> torch.Tensor:
    """``mk_mmd(a[l], b[m])`` for every pair at once: a (R, B, D), b (R', B, D) -> (R, R').

    The same estimator, vectorised over the |R|^2 layer pairs (each pair keeps its own
    bandwidth: the mean of its own (2B)^2 distance matrix)."""
    r, bsz = a.shape[0], a.shape[1]
    if bsz < 2 or b.shape[1] != bsz:
        raise ValueError("mk_mmd needs two batches of the same size >= 2")
    a, b = a.flatten(2), b.flatten(2)
    sq_a, sq_b = (a * a).sum(2), (b * b).sum(2)  # R x B
    d_aa = (sq_a[:, :, None] + sq_a[:, None, :] - 2 * a @ a.transpose(1, 2)).clamp_min(0)  # R x B x B
    d_bb = (sq_b[:, :, None] + sq_b[:, None, :] - 2 * b @ b.transpose(1, 2)).clamp_min(0)  # R' x B x B
    d_ab = (sq_a[:, None, :, None] + sq_b[None, :, None, :]
            - 2 * torch.einsum("lid,mjd->lmij", a, b)).clamp_min(0)  # R x R' x B x B
    with torch.no_grad():  # mean over the pair's (2B)^2 matrix: two diagonal blocks + two cross blocks
        mean = (d_aa.sum((1, 2))[:, None] + d_bb.sum((1, 2))[None, :] + 2 * d_ab.sum((2, 3))) / (4 * bsz * bsz)
        inv = [1.0 / (2.0 * (s * mean + eps)) for s in multipliers]  # R x R' each
    k_aa = sum(torch.exp(-d_aa[:, None] * w[:, :, None, None]) for w in inv)  # R x R' x B x B
    k_bb = sum(torch.exp(-d_bb[None, :] * w[:, :, None, None]) for w in inv)
    k_ab = sum(torch.exp(-d_ab * w[:, :, None, None]) for w in inv)
    diag = len(multipliers) * bsz  # exp(0) on each diagonal entry
    off = (k_aa.sum((2, 3)) - diag) + (k_bb.sum((2, 3)) - diag)
    return off / (bsz * (bsz - 1)) - 2.0 * k_ab.sum((2, 3)) / (bsz * bsz) + 2.0 / (bsz - 1)


def mse_discrepancy(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Table 5's "MSE" alternative to MMD: mean squared difference of paired features."""
    return F.mse_loss(a.flatten(1), b.flatten(1))


def attention_scores(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(s^p, s^c): |R| x |R| matrices of avg(A_l^T B_m) and avg(A_l B_m^T), batch-averaged.

    With A, B of shape c x d: mean over the d x d entries of A^T B equals the dot product of
    the spatial means (GAP, c-vectors); mean over the c x c entries of A B^T equals the dot
    product of the channel means (d-vectors). Exact identities, O(B c d) instead of O(B d^2).
    """
    gap_a = torch.stack([t.flatten(2).mean(2) for t in a])  # R x B x c
    gap_b = torch.stack([t.flatten(2).mean(2) for t in b])
    cm_a = torch.stack([t.flatten(2).mean(1) for t in a])  # R x B x d
    cm_b = torch.stack([t.flatten(2).mean(1) for t in b])
    s_p = torch.einsum("lnc,mnc->lm", gap_a, gap_b) / gap_a.shape[1]
    s_c = torch.einsum("lnd,mnd->lm", cm_a, cm_b) / cm_a.shape[1]
    return s_p, s_c


def attention_weights(a: list[torch.Tensor], b: list[torch.Tensor], mode: str = "both",
                      temperature: float = 1.0) -> torch.Tensor:
    """alpha (|R| x |R|, rows l = fused-model layer sum to 1 over m = local-model layer), Eqs. 7-9.
    A constant: computed without gradient (the code turns it into Python floats)."""
    with torch.no_grad():
        s_p, s_c = attention_scores([t.detach() for t in a], [t.detach() for t in b])
        a_p = torch.softmax(s_p / temperature, dim=1)  # Eq. 7
        a_c = torch.softmax(s_c / temperature, dim=1)  # Eq. 8
        if mode == "position":
            return a_p
        if mode == "channel":
            return a_c
        return 0.5 * (a_p + a_c)  # Eq. 9


def projection_conv(c_in: int, size_in: tuple[int, int], c_out: int, size_out: tuple[int, int]) -> nn.Module:
    """One conv from c_in x h x w to c_out x g x w' (the code's rules, spec section 2.3)."""
    (hi, wi), (ho, wo) = size_in, size_out
    if (hi, wi) == (2 * ho, 2 * wo):
        return nn.Conv2d(c_in, c_out, 3, stride=2, padding=1)
    if (hi, wi) == (ho, wo):
        return nn.Conv2d(c_in, c_out, 1)
    if (2 * hi, 2 * wi) == (ho, wo):
        return nn.ConvTranspose2d(c_in, c_out, 4, stride=2, padding=1)
    if hi >= ho and wi >= wo:
        return nn.Conv2d(c_in, c_out, (1 + hi - ho, 1 + wi - wo))
    if hi <= ho and wi <= wo:  # not in the code (it never enlarges otherwise)
        return nn.ConvTranspose2d(c_in, c_out, (1 + ho - hi, 1 + wo - wi))
    raise UserError(f"csac: cannot project a {hi}x{wi} feature map to {ho}x{wo}")


class Projections(nn.Module):
    """Proj of Eq. 5: one conv per layer of R on the fused-model side and one on the local side."""

    def __init__(self, shapes: list[tuple[int, int, int]], channels: int, size: int = 0):
        super().__init__()
        side = (size, size) if size else tuple(shapes[-1][1:])
        self.out_shape = (channels, *side)
        self.fused = nn.ModuleList(projection_conv(c, (h, w), channels, side) for c, h, w in shapes)
        self.local = nn.ModuleList(projection_conv(c, (h, w), channels, side) for c, h, w in shapes)


class FeatureTaps:
    """Forward hooks that keep the outputs of the named modules (the layer set R)."""

    def __init__(self, model: nn.Module, names: tuple[str, ...]):
        modules = dict(model.named_modules())
        missing = [n for n in names if n not in modules]
        if missing:
            raise UserError(f"csac: the model has no module(s) {', '.join(missing)} for the layer set R "
                            f"(hp.csac.layers)")
        self.names, self.out = names, {}
        self.handles = [modules[n].register_forward_hook(self._keep(n)) for n in names]

    def _keep(self, name):
        def hook(module, inputs, output):
            self.out[name] = output
        return hook

    def take(self) -> list[torch.Tensor]:
        feats = [self.out.pop(n) for n in self.names]
        for f in feats:
            if f.dim() != 4:
                raise UserError(f"csac: layer set R must be conv feature maps (B x C x H x W); "
                                f"got shape {tuple(f.shape)} (hp.csac.layers)")
        return feats

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.out.clear()


def default_layers(model: nn.Module) -> tuple[str, ...]:
    """R per architecture (Sec. 4.1): ResNet -> the last three stages; AlexNet -> conv3, conv4,
    conv5 (+ReLU, conv5 +pool); MNIST CNN (and small_cnn) -> both conv blocks; cnn6 -> its
    three conv blocks."""
    names = {n for n, _ in model.named_modules()}
    candidates = (
        ("features.layer2", "features.layer3", "features.layer4"),  # resnet18_tv, resnet*_cifar
        ("features.relu3", "features.relu4", "features.pool5"),  # alexnet
        ("features.pool1", "features.pool2", "features.relu3"),  # cnn6 (conv3 has no pool)
        ("features.pool1", "features.pool2"),  # mnist_cnn, small_cnn
    )
    for cand in candidates:
        if all(c in names for c in cand):
            if cand[-1] == "features.relu3" and "features.conv3" not in names:
                continue  # mnist_cnn's relu3 follows fc1, not a conv
            return cand
    raise UserError("csac: no default layer set R for this model; set hp.csac.layers to the names "
                    "of two or more conv modules (model.named_modules())")


# ============================================================================= the method

class CSAC(Method):
    name = "csac"
    Hparams = CSACHparams
    aggregation = "per_client"
    paper = "Yuan et al., IEEE TKDE 2023 (arXiv 2110.06736)"

    def __init__(self, hp: CSACHparams, setup):
        super().__init__(hp, setup)
        self._ref_net = None  # a second instance for L^h, built once per host
        self._ref_src = None

    # ---- server ---------------------------------------------------------------------------
    def aggregate(self, state: dict, uploads: Uploads, round: int) -> dict:
        """Eqs. 3-4 over every client's full state dict (buffers included), ascending ids."""
        if not uploads.each:
            return state
        cids = sorted(uploads.each)
        fused, weights = fuse([uploads.each[c].tensors for c in cids], self.hp.fusion, self.hp.fusion_distance)
        new_global = dict(state["global"])
        new_global.update(fused)
        return {**state, "global": new_global,
                "fusion_weights": {"clients": cids, "round": round,
                                   "weights": {k: w.to(torch.float32) for k, w in weights.items()}}}

    # ---- client ---------------------------------------------------------------------------
    def init_client_state(self, client_id: int, model: nn.Module) -> dict:
        return {}  # L^h appears after stage 1

    def local_update(self, ctx: ClientContext) -> Upload:
        if "reference" not in ctx.state:  # round 1 (or a client's first round)
            stats = self.acquire(ctx)
            ctx.state["reference"] = {k: v.detach().to("cpu").clone() for k, v in ctx.model.state_dict().items()}
            ctx.state["acquired_round"] = int(ctx.round)
        else:
            stats = self.calibrate(ctx)
        return self.upload(ctx, stats)

    # ---- stage 1: local semantic acquisition ------------------------------------------------
    def acquire(self, ctx: ClientContext) -> dict:
        """G^h: stage1_epochs of SGD on label-smoothed CE (Eq. 2), from the received model."""
        hp, model = self.hp, ctx.model
        if hp.independent_head_init:
            _reinit_head(model, ctx.generator, ctx.device)
        model.train()
        opt = make_sgd(ctx)
        total, steps = 0.0, 0
        for x, y in _stream(ctx, hp.stage1_epochs, hp.stage1_iters_per_epoch, None, drop_last=False):
            loss = F.cross_entropy(model(x), y, label_smoothing=hp.use_label_smoothing)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if ctx.train.grad_clip:
                nn.utils.clip_grad_norm_(model.parameters(), ctx.train.grad_clip)
            opt.step()
            total += _finite(loss, ctx)
            steps += 1
        return {"loss": total / max(steps, 1), "steps": steps, "stage": 1}

    # ---- collaboration rounds: cross-layer semantic calibration ------------------------------
    def reference_model(self, ctx: ClientContext) -> nn.Module:
        """L^h: the host's second model instance holding this client's frozen stage-1 weights."""
        if self._ref_net is None or self._ref_src is not ctx.model:
            self._ref_net = copy.deepcopy(ctx.model)
            self._ref_src = ctx.model
        ref = self._ref_net
        ref.load_state_dict(ctx.state["reference"])
        ref.eval()
        ref.requires_grad_(False)
        return ref

    def calibrate(self, ctx: ClientContext) -> dict:
        """M^h <- SGD on L_CB = L_AR + lam * L_AL (Eq. 11) for train.epochs epochs."""
        hp, model = self.hp, ctx.model
        align = hp.use_alignment if hp.lam > 0 else "none"
        logit_w = hp.use_logit_mmd_weight
        need_ref = align != "none" or logit_w > 0
        layers = (hp.layers or default_layers(model)) if align != "none" else ()
        ref = self.reference_model(ctx) if need_ref else None
        model.train()
        taps_m = FeatureTaps(model, layers) if layers else None
        taps_l = FeatureTaps(ref, layers) if layers else None
        opt_m, opt_p, proj = make_sgd(ctx), None, None
        sums = {"loss": 0.0, "ce": 0.0, "align": 0.0, "logit_mmd": 0.0, "alpha_entropy": 0.0, "alpha_diag": 0.0}
        steps = n_alpha = 0
        drop_last = ctx.data.num_train >= ctx.train.batch_size
        try:
            for x, y in _stream(ctx, ctx.train.epochs, hp.iters_per_epoch, ctx.train.max_steps, drop_last):
                logits = model(x)
                ce = F.cross_entropy(logits, y)  # Eq. 10
                loss = ce if hp.retrain_loss else 0.0 * ce
                if need_ref:
                    with torch.no_grad():
                        ref_logits = ref(x)
                if layers:
                    fm, fl = taps_m.take(), taps_l.take()
                    if proj is None:  # fresh every round, initialised from ctx.generator
                        proj = _build_projections(fm, hp, ctx)
                        opt_p = make_sgd(ctx, proj.parameters())
                    if x.shape[0] >= 2:
                        a = [p(f) for p, f in zip(proj.fused, fm)]  # Eq. 5
                        b = [p(f) for p, f in zip(proj.local, fl)]
                        l_al, alpha = self.alignment_loss(a, b, align)
                        loss = loss + hp.lam * l_al
                        sums["align"] += float(l_al.detach())
                        if alpha is not None:
                            ent = -(alpha * alpha.clamp_min(1e-12).log()).sum(1).mean()
                            sums["alpha_entropy"] += float(ent)
                            sums["alpha_diag"] += float(alpha.diagonal().mean())
                            n_alpha += 1
                if logit_w > 0 and x.shape[0] >= 2:  # the official code's extra term
                    l_lg = mk_mmd(ref_logits, logits)
                    loss = loss + logit_w * l_lg
                    sums["logit_mmd"] += float(l_lg.detach())
                opt_m.zero_grad(set_to_none=True)
                if opt_p is not None:
                    opt_p.zero_grad(set_to_none=True)
                loss.backward()
                if ctx.train.grad_clip:
                    nn.utils.clip_grad_norm_(model.parameters(), ctx.train.grad_clip)
                opt_m.step()
                if opt_p is not None:
                    opt_p.step()
                sums["loss"] += _finite(loss, ctx)
                sums["ce"] += float(ce.detach())
                steps += 1
        finally:
            for taps in (taps_m, taps_l):
                if taps is not None:
                    taps.remove()
        out = {k: v / max(steps, 1) for k, v in sums.items() if not k.startswith("alpha")}
        if n_alpha:
            out["alpha_entropy"] = sums["alpha_entropy"] / n_alpha
            out["alpha_diag"] = sums["alpha_diag"] / n_alpha
        return {**out, "steps": steps, "stage": 2}

    def alignment_loss(self, a: list[torch.Tensor], b: list[torch.Tensor], mode: str):
        """L_AL of Eq. 6 (``cross``) and its Table 5 ablations; returns (loss, alpha or None)."""
        r = len(a)
        if mode == "same_layer":  # l = m only, weight 1
            dist = mk_mmd if self.hp.discrepancy == "mmd" else mse_discrepancy
            return sum(dist(a[i], b[i]) for i in range(r)), None
        if self.hp.discrepancy == "mmd":  # every pair (l, m) at once: an |R| x |R| matrix
            pair = mk_mmd_pairs(torch.stack(a), torch.stack(b))
        else:
            pair = torch.stack([torch.stack([mse_discrepancy(a[l], b[m]) for m in range(r)]) for l in range(r)])
        if mode == "uniform":  # all |R|^2 pairs, weight 1 ("without attention")
            return pair.sum(), None
        alpha = attention_weights(a, b, self.hp.attention, self.hp.alpha_temperature)
        return (alpha * pair).sum(), alpha


# ============================================================================= helpers

def _stream(ctx: ClientContext, epochs: int, iters_per_epoch: int, max_steps: int | None, drop_last: bool):
    """Training batches: ``epochs`` passes over the data, or ``epochs * iters_per_epoch``
    iterations cycling through freshly shuffled passes; at most ``max_steps``."""
    total = epochs * iters_per_epoch if iters_per_epoch else None
    if max_steps:
        total = max_steps if total is None else min(total, max_steps)
    bs, n = ctx.train.batch_size, 0
    passes = 0
    while True:
        if total is None and passes >= epochs:
            return
        got = False
        for batch in ctx.data.batches(bs, ctx.generator, ctx.device, drop_last=drop_last):
            got = True
            if total is not None and n >= total:
                return
            yield batch
            n += 1
        passes += 1
        if not got or (total is not None and n >= total):
            return


def _seeded(generator: torch.Generator) -> int:
    return int(torch.randint(0, 2 ** 62, (1,), generator=generator))


@contextlib.contextmanager
def _seeded_scope(generator: torch.Generator, device: torch.device):
    """Module initialisers draw from the global RNG: run them in a private copy of it, seeded
    from ``ctx.generator`` (the only source of randomness), and restore it afterwards."""
    seed = _seeded(generator)
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.random.default_generator.manual_seed(seed)
        if cuda:
            torch.cuda.manual_seed(seed)
        yield


def _build_projections(features: list[torch.Tensor], hp: CSACHparams, ctx: ClientContext) -> Projections:
    shapes = [tuple(int(s) for s in f.shape[1:]) for f in features]
    with _seeded_scope(ctx.generator, torch.device("cpu")):  # built on the CPU, then moved
        proj = Projections(shapes, hp.proj_channels, hp.proj_size)
    return proj.to(ctx.device).train()


def _reinit_head(model: nn.Module, generator: torch.Generator, device: torch.device) -> None:
    """The official code's independently random bottleneck + classifier per client."""
    parts = [model.head]
    fc = getattr(getattr(model, "features", None), "fc", None)
    if isinstance(fc, nn.Module):
        parts.append(fc)
    with _seeded_scope(generator, device):
        for part in parts:
            for m in part.modules():
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()


def _finite(loss: torch.Tensor, ctx: ClientContext) -> float:
    value = float(loss.detach())
    if not math.isfinite(value):
        raise TrainingDiverged(ctx.client_id, ctx.domain, ctx.round, value)
    return value
