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
An "epoch" is the official code's fixed number of iterations, ``stage1_iters_per_epoch`` = 60 and
``iters_per_epoch`` = 20 (batch 64 there); 0 makes it one pass over the client's data.

Defaults. The released code (junkunyuan/CSAC) cannot have produced the paper's tables: its
default run has no cross-layer alignment at all, so the rows of Table 5 that change the
alignment would equal the full method, and it never applies the label smoothing that Table 5
ablates. So the paper's forms are the defaults where the paper states them (Eqs. 2-11, lambda,
the schedule), and the code's where the paper is silent and nothing suggests the unreleased
version differed: an epoch of 60 / 20 iterations, c = 32 projected channels, and a bottleneck
and classifier drawn at random by every client (``independent_head_init``; spec 9.8 would share
one initial model). ``variant = "official_code"`` reproduces the released code's default run
(spec section 9.1): its alignment loss is always zero (``--mode alpha`` feeds the double sum an
empty list), an undocumented logit-level MK-MMD between L^h and M^h is added with weight lam,
and stage 1 uses plain CE. The ablations of Tables 4-5 are the ``fusion``, ``fusion_distance``,
``alignment``, ``attention``, ``discrepancy``, ``retrain_loss`` and ``label_smoothing`` switches.
"""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from raysim.core.aggregation import KeepAll, weighted_mean
from raysim.core.contract import ClientContext, Method, Upload
from raysim.core.hparams import Hparams, Space
from raysim.methods.csac.calibration import (FeatureTaps, Projections, attention_weights, default_layers, mk_mmd,
                                             mk_mmd_pairs, mse_discrepancy)
from raysim.core.settings import setting


# ============================================================================= hyperparameters

@dataclass(frozen=True)
class CSACHparams(Hparams):
    lam: float = setting(0.6, ge=0, source="paper Sec. 4.1; code agrees", doc="lambda of Eq. 11 (all experiments)")
    label_smoothing: float = setting(0.1, ge=0, lt=1, source="paper Eq. 2 and Table 5's ablation; the code's flag is unused (spec 9.2)", doc="alpha of Eq. 2 (stage 1 only)")
    stage1_epochs: int = setting(30, ge=0, source="paper Sec. 4.1; code agrees", doc="local semantic acquisition epochs (Sec. 4.1)")
    stage1_iters_per_epoch: int = setting(60, ge=0, source="official code (junkunyuan/CSAC --length 60); the paper does not define its epoch", doc="60 iterations an epoch (code); 0: an epoch is a pass over D^h")
    iters_per_epoch: int = setting(20, ge=0, source="official code (junkunyuan/CSAC client.length 20); the paper does not define its epoch", doc="calibration (train.epochs per round): 20 iterations an epoch (code); 0: a pass")
    # ---- aggregation (Table 4) ----
    fusion: str = setting("divergence", one_of=("divergence", "similarity", "average"), source="paper Eq. 4; code agrees", doc="Eq. 4 | closer -> larger | 1/H")
    fusion_distance: str = setting("l2", one_of=("l2", "l1", "cosine"), source="paper Eq. 4; code agrees", doc="l2 (paper)")
    # ---- calibration (Table 5) ----
    alignment: str = setting("cross", one_of=("cross", "same_layer", "uniform", "none"), source="paper Eq. 6 (the code's default run has none: spec 9.1)", doc="cross (Eq. 6, all pairs, attention) | same_layer | uniform | none")
    attention: str = setting("both", one_of=("both", "position", "channel"), source="paper Eq. 9", doc="Eq. 9 | Eq. 7 only | Eq. 8 only")
    discrepancy: str = setting("mmd", one_of=("mmd", "mse"), source="paper Eq. 6 (MMD); code's multi-kernel form", doc="MK-MMD | MSE")
    retrain_loss: bool = setting(True, source="paper Eq. 10", doc='L_AR of Eq. 10 ("without cross-entropy" ablation: False)')
    layers: tuple[str, ...] = setting((), source="paper Sec. 4.1 (last three blocks / convs); code agrees", doc="the layer set R (module names); () = the architecture's default")
    proj_channels: int = setting(32, ge=1, source="official code; the paper's 'size of the last adopted layer' (Eq. 5) may mean its channels too", doc="c of the projected features (code)")
    proj_size: int = setting(0, ge=0, source="paper Eq. 5 text (the last adopted layer's size); the code agrees on ResNet-18, uses 4 on AlexNet", doc="g = w of the projected features; 0 = the last layer of R (paper)")
    alpha_temperature: float = setting(1.0, gt=0, expected="> 0", source="paper Eqs. 7-8 (no temperature); code agrees", doc="softmax temperature of Eqs. 7-8 (the paper has none: 1)")
    logit_mmd_weight: float = setting(0.0, ge=0, source="paper (no such term); variant official_code uses lam", doc="the code's extra MK-MMD(logits_L, logits_M) weight")
    independent_head_init: bool = setting(True, source="official code (one net built per client); the paper is silent (spec 9.8)", doc="code: every client draws its own random head")
    variant: str = setting("paper", one_of=("paper", "official_code"), source="paper (the code's default run cannot give Tables 4-5: spec 9.1)", doc="official_code: no L_AL, logit MMD weight lam, plain CE")

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
        # M_l = sum_h w_l^h G_l^h (the weights already sum to 1)
        fused[key] = weighted_mean((({key: s[key]}, float(w[h])) for h, s in enumerate(states)), total=1.0)[key]
    return fused, weights


# ============================================================================= the method

class CSAC(Method):
    name = "csac"
    Hparams = CSACHparams
    aggregator = KeepAll()  # Eq. 4 weighs each client's tensors by its distance to the mean
    paper = "Yuan et al., IEEE TKDE 2023 (arXiv 2110.06736)"
    shares = 'shares the model (semantic fusion at the server); clients calibrate/align locally'

    def __init__(self, hp: CSACHparams, setup):
        super().__init__(hp, setup)
        self._ref_net = None  # a second instance for L^h, built once per host
        self._ref_src = None

    # ---- server ---------------------------------------------------------------------------
    def aggregate(self, state: dict, uploads, round: int) -> dict:
        """Eqs. 3-4 over every client's full state dict (buffers included), ascending ids."""
        cids = uploads.clients
        fused, weights = fuse([uploads.each[c].tensors for c in cids], self.hp.fusion, self.hp.fusion_distance)
        return {**state, "global": {**state["global"], **fused},
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
        opt = ctx.optimizer()
        for x, y in ctx.batches(hp.stage1_epochs, iters_per_epoch=hp.stage1_iters_per_epoch, max_steps=None):
            ctx.step(F.cross_entropy(model(x), y, label_smoothing=hp.use_label_smoothing), opt)
        return {**ctx.stats(), "stage": 1}

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
        opt_m, opt_p, proj = ctx.optimizer(), None, None
        sums = dict.fromkeys(("ce", "align", "logit_mmd", "alpha_entropy", "alpha_diag"), 0.0)  # on the device
        n_alpha = 0
        drop_last = ctx.data.num_train >= ctx.train.batch_size
        try:
            for x, y in ctx.batches(iters_per_epoch=hp.iters_per_epoch, drop_last=drop_last):
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
                        opt_p = ctx.optimizer(proj.parameters())
                    if x.shape[0] >= 2:
                        a = [p(f) for p, f in zip(proj.fused, fm)]  # Eq. 5
                        b = [p(f) for p, f in zip(proj.local, fl)]
                        l_al, alpha = self.alignment_loss(a, b, align)
                        loss = loss + hp.lam * l_al  # Eq. 11
                        sums["align"] = sums["align"] + l_al.detach().double()
                        if alpha is not None:
                            ent = -(alpha * alpha.clamp_min(1e-12).log()).sum(1).mean()
                            sums["alpha_entropy"] = sums["alpha_entropy"] + ent.double()
                            sums["alpha_diag"] = sums["alpha_diag"] + alpha.diagonal().mean().double()
                            n_alpha += 1
                if logit_w > 0 and x.shape[0] >= 2:  # the official code's extra term
                    l_lg = mk_mmd(ref_logits, logits)
                    loss = loss + logit_w * l_lg
                    sums["logit_mmd"] = sums["logit_mmd"] + l_lg.detach().double()
                ctx.step(loss, *(o for o in (opt_m, opt_p) if o is not None))  # grad clip: the model's only
                sums["ce"] = sums["ce"] + ce.detach().double()
        finally:
            for taps in (taps_m, taps_l):
                if taps is not None:
                    taps.remove()
        stats = ctx.stats()
        out = {k: float(v) / max(stats["steps"], 1) for k, v in sums.items() if not k.startswith("alpha")}
        if n_alpha:
            out["alpha_entropy"] = float(sums["alpha_entropy"]) / n_alpha
            out["alpha_diag"] = float(sums["alpha_diag"]) / n_alpha
        return {"loss": stats["loss"], **out, "steps": stats["steps"], "stage": 2}

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
