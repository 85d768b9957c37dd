"""FedWon — Zhuang & Lyu, "FedWon: Triumphing Multi-domain Federated Learning Without
Normalization", ICLR 2024 (arXiv 2306.05879).

FedWon is FedAvg on a different network, plus one change to the local SGD step:

1. Network (Sec. 3.2, App. A.2): every normalization layer (BN, GN, LN) is removed and every
   convolution becomes a WSConv, a convolution with Scaled Weight Standardization (Eq. 3,
   Listing 1). For output channel i of the raw weight W (fan-in N = C_in/groups * kh * kw):

       mu_i      = mean_j W_ij
       s2_i      = var_j  W_ij                      (Listing 1: torch.var, divisor N - 1)
       W_hat_ij  = g_i * (W_ij - mu_i) / sqrt(max(N * s2_i, eps))          eps = 1e-4
       y         = conv2d(x, W_hat) + b

   W ~ xavier_normal_, the gain g (one per output channel) starts at 1 and is learned, the
   bias b is an ordinary trainable conv bias. The FC layers stay plain nn.Linear.

2. Client (App. A.3): E epochs of plain SGD (momentum 0, weight decay 0, optimizer rebuilt
   every round). At B = 32 each step clips the gradient with Adaptive Gradient Clipping
   (Brock et al. 2021b, Eq. 4), unit-wise, i.e. for every row i (output unit) of a layer:

       w_i* = max(||W_i||_F, eps)                                         eps = 1e-3
       G_i <- lambda * w_i* / ||G_i||_F * G_i      if ||G_i||_F / w_i* > lambda
       G_i <- G_i                                   otherwise

   lambda = 0.64 (Digits-Five), 1.28 (Office-Caltech-10, DomainNet); the final classifier is
   not clipped; AGC is off for small batches (B in {1, 2, 4}), where it hurts (Table 18).

3. Server: FedAvg over *every* tensor (raw W, gains, biases, FC layers), weighted by n_k.
   Nothing stays on the client, so one method serves cross-silo and cross-device FL (a
   fraction C of clients per round, B down to 1): the network has no batch statistics.
   One global model is evaluated on every domain.

Defaults: no FedWon code is public (spec 10.1), so every default is the paper's own (its text,
Listing 1 and App. A.3: the Table 1 runs); where it is silent (which layers AGC skips, whether
biases and gains are clipped) the NF-Nets / timm practice. lambda is the Digits-Five value; the
Office-Caltech-10 and DomainNet configs set 1.28, and each config sets its Table 8-10 lr.
Switches between the paper's two forms: ``ws_unbiased`` (True: Listing 1's torch.var, divisor
N - 1 | False: Eq. 3's population variance) and ``ws_plain_convs`` (() = every conv a WSConv,
as Sec. 3.2 says | [3] = Table 6 literally, layer 3 a plain Conv2D). Ablations: ``ws=False``,
``agc`` true / false / "auto".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from raysim.core.contract import ClientContext, LocalLoss, Method, Upload, cross_entropy
from raysim.core.errors import UserError
from raysim.core.hparams import Hparams, Space
from raysim.core.settings import setting
from raysim.core.training import train_epochs


# ----------------------------------------------------------------------------- WSConv

class WSConv2d(nn.Conv2d):
    """Conv2d whose weight is used through Scaled Weight Standardization (FedWon Listing 1).

    ``W_hat = gain * (W - mean(W)) / sqrt(max(fan_in * var(W), eps))`` per output channel,
    with ``var`` unbiased (divisor fan_in - 1) as Listing 1's ``torch.var`` or, with
    ``unbiased=False``, the population variance of Eq. (3). The state_dict holds ``weight``,
    ``gain`` and ``bias`` only: ``eps`` and ``fan_in`` are constants, not tensors.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0,
                 dilation=1, groups: int = 1, bias: bool = True, padding_mode: str = "zeros", *,
                 eps: float = 1e-4, unbiased: bool = True, gain_init: float = 1.0):
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, groups,
                         bias, padding_mode)
        nn.init.xavier_normal_(self.weight)
        self.gain = nn.Parameter(torch.full((out_channels, 1, 1, 1), float(gain_init)))
        self.eps = float(eps)
        self.unbiased = bool(unbiased)
        self.fan_in = self.weight[0].numel()  # (C_in / groups) * kh * kw

    def standardized_weight(self) -> torch.Tensor:
        w = self.weight
        dims = tuple(range(1, w.ndim))
        mean = w.mean(dim=dims, keepdim=True)
        var = w.var(dim=dims, keepdim=True, unbiased=self.unbiased)
        scale = torch.rsqrt(torch.clamp(var * self.fan_in, min=self.eps))
        return (w - mean) * scale * self.gain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(x, self.standardized_weight(), self.bias)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", ws_eps={self.eps}, unbiased={self.unbiased}"


def ws_conv_factory(eps: float = 1e-4, unbiased: bool = True, gain_init: float = 1.0,
                    force_bias: bool = True, plain: Iterable[int] = ()):
    """A zoo ``conv(in_ch, out_ch, kernel_size, stride, padding, bias)`` factory making WSConvs.

    ``force_bias`` gives every WSConv a bias, as Listing 1's default (``bias=True``), also where
    the host network asked for none (torchvision ResNet's convs precede a BN that FedWon removes).
    ``plain`` lists 1-based conv indices (in construction order) left as plain nn.Conv2d, e.g.
    ``(3,)`` reproduces FedWon Table 6 literally (its AlexNet layer 3 reads Conv2D).
    """
    plain = set(plain)
    count = [0]

    def conv(in_ch, out_ch, kernel_size, stride=1, padding=0, bias=True):
        count[0] += 1
        if count[0] in plain:
            return nn.Conv2d(in_ch, out_ch, kernel_size, stride=stride, padding=padding, bias=bias)
        return WSConv2d(in_ch, out_ch, kernel_size, stride=stride, padding=padding,
                        bias=True if force_bias else bias, eps=eps, unbiased=unbiased, gain_init=gain_init)
    return conv


# ----------------------------------------------------------------------------- AGC

def unitwise_norm(x: torch.Tensor, whole: bool = False) -> torch.Tensor:
    """Frobenius norm of each output unit (row along dim 0), broadcastable to ``x``.

    A tensor with at most one dimension, or ``whole=True`` (a WSConv gain), is one unit.
    """
    if whole or x.ndim <= 1:
        return torch.linalg.vector_norm(x)
    return torch.linalg.vector_norm(x, dim=tuple(range(1, x.ndim)), keepdim=True)


@torch.no_grad()
def adaptive_clip_(params: Iterable[tuple[torch.Tensor, bool]], clip: float, eps: float = 1e-3,
                   grad_eps: float = 1e-6) -> tuple[int, int]:
    """AGC in place (Brock et al. 2021b, FedWon Eq. 4) on ``(parameter, is_one_unit)`` pairs.

    Each unit's gradient G_i is rescaled to norm ``clip * max(||W_i||, eps)`` where
    ``||G_i|| / max(||W_i||, eps) > clip``, and left untouched otherwise; ``||G_i||`` is
    floored at ``grad_eps`` in the division only. Returns (units clipped, units seen).
    """
    clipped = seen = 0
    for p, whole in params:
        if p.grad is None:
            continue
        g = p.grad
        max_norm = unitwise_norm(p.detach(), whole).clamp(min=eps) * clip
        g_norm = unitwise_norm(g, whole)
        over = g_norm > max_norm
        scale = torch.where(over, max_norm / g_norm.clamp(min=grad_eps), torch.ones_like(g_norm))
        g.mul_(scale)
        clipped += int(over.sum())
        seen += over.numel()
    return clipped, seen


def agc_parameters(model: nn.Module, exclude: Iterable[str] = ("head",),
                   clip_vectors: bool = True) -> list[tuple[str, torch.Tensor, bool]]:
    """The ``(name, parameter, is_one_unit)`` triples AGC clips.

    Every trainable parameter except those of the modules named by ``exclude`` (the final
    classifier ``head`` by default, as NF-Nets and timm do) and, with ``clip_vectors=False``,
    except 1-D tensors and WSConv gains. A WSConv gain ([C_out, 1, 1, 1]) counts as one vector
    unit, like a bias, as in the NF-Nets reference where the gain is a vector.
    """
    prefixes = tuple(e.strip() for e in exclude if e.strip())
    gains = {f"{mn}.gain" if mn else "gain" for mn, m in model.named_modules() if isinstance(m, WSConv2d)}
    out = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if any(name == pre or name.startswith(pre + ".") for pre in prefixes):
            continue
        whole = name in gains or p.ndim <= 1
        if whole and not clip_vectors:
            continue
        out.append((name, p, whole))
    return out


# ----------------------------------------------------------------------------- the method

@dataclass(frozen=True)
class FedWonHparams(Hparams):
    agc: bool | str = setting("auto", one_of=(True, False, "auto"), expected="true, false or 'auto'", source="paper App. A.3 (AGC at B = 32 only)", doc='AGC (App. A.3, Eq. 4). agc: True, False, or "auto" = on iff batch_size > agc_small_batch (the paper: AGC at B = 32, bypassed for B in {1, 2, 4}).')
    agc_lambda: float = setting(0.64, gt=0, expected="> 0", source="paper App. A.3 (Digits-Five)", doc="Digits-Five 0.64; Office-Caltech-10 and DomainNet 1.28")
    agc_eps: float = setting(1e-3, gt=0, expected="> 0", source="paper App. A.3 (eps = 1e-3)")
    agc_small_batch: int = setting(4, source="paper App. A.3 / Table 18 (no AGC for B in {1, 2, 4})")
    agc_exclude: str = setting("head", source="ours: the paper is silent; NF-Nets and timm (spec 9.3)", doc="comma-separated module names left unclipped (the classifier)")
    agc_clip_vectors: bool = setting(True, source="ours: the paper is silent; NF-Nets and timm (spec 9.3)", doc="clip biases and WS gains too (each tensor one unit)")
    # WSConv (Eq. 3, Listing 1)
    ws: bool = setting(True, source="paper Sec. 3.2", doc='False: plain convs, no norm ("FedAvg w/o BN" of the ablations, Table 18)')
    ws_eps: float = setting(1e-4, gt=0, expected="> 0", source="paper Listing 1")
    ws_unbiased: bool = setting(True, source="paper Listing 1 (torch.var); Eq. 3 differs (spec 9.5)", doc="Listing 1's torch.var; False: Eq. (3)'s population variance")
    ws_gain_init: float = setting(1.0, source="paper Listing 1")
    ws_bias: bool = setting(True, source="paper Listing 1 (bias=True)", doc="every WSConv has a bias (Listing 1 default), even where the net had none")
    ws_plain_convs: tuple[int, ...] = setting((), ge=1, source="paper Sec. 3.2, Fig. 2c (Table 6 layer 3 is a typo: spec 9.7)", doc="1-based conv indices kept plain; [3] = Table 6 literally")
    lr: float = setting(0.0, ge=0, expected="> 0 (or 0: use train.lr)", source="ours: train.lr (Tables 8-10 values are set per config)", doc="Local learning rate for FedWon alone (0: train.lr). The paper tunes lr per method (Tables 8-9: Digits FedWon 0.05 vs 0.1 for the BN baselines), and a comparison config shares train.lr. train.lr_decay still applies: lr_t = lr * lr_decay ** (t - 1).")

    @classmethod
    def search_space(cls):
        return {"agc_lambda": Space.choice(0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)}


class FedWon(Method):
    name = "fedwon"
    Hparams = FedWonHparams
    paper = "Zhuang & Lyu, ICLR 2024"
    shares = 'shares the whole model (no normalization layers, WSConv); keeps nothing'

    # ---- model: no normalization, every conv a WSConv -----------------------------------
    def conv_factory(self):
        hp = self.hp
        if not hp.ws:
            return None  # the zoo's plain Conv2d
        return ws_conv_factory(hp.ws_eps, hp.ws_unbiased, hp.ws_gain_init, hp.ws_bias, hp.ws_plain_convs)

    def build_model(self) -> nn.Module:
        from raysim.models import is_norm
        m = self.setup.model
        conv = self.conv_factory()
        model = self.base_model(norm="none") if conv is None else self.base_model(norm="none", conv=conv)
        left = [n for n, mod in model.named_modules() if is_norm(mod)]
        if left:
            raise UserError(f"fedwon: model {m.name!r} still has normalization layers {left[:3]}")
        if self.hp.ws:
            plain = [n for n, mod in model.named_modules()
                     if isinstance(mod, nn.Conv2d) and not isinstance(mod, WSConv2d)]
            if len(plain) != len(self.hp.ws_plain_convs):
                raise UserError(f"fedwon: model {m.name!r} does not build its convs from the conv "
                                f"factory ({plain[:3]} stayed nn.Conv2d)")
        return model

    # ---- client: SGD with AGC between backward() and step() -----------------------------
    def use_agc(self, batch_size: int) -> bool:
        if self.hp.agc == "auto":
            return batch_size > self.hp.agc_small_batch
        return bool(self.hp.agc)

    def step_lr(self, ctx: ClientContext) -> float | None:
        return ctx.lr * self.hp.lr / ctx.train.lr if self.hp.lr > 0 else None

    def local_loss(self, ctx: ClientContext) -> LocalLoss | None:
        """Client cohorts: plain SGD on the cross-entropy where AGC is off; with AGC (clipping
        each unit's gradient between backward and step) the client trains alone."""
        if self.use_agc(ctx.train.batch_size):
            return None
        return LocalLoss(cross_entropy, lr=self.step_lr(ctx))

    def local_update(self, ctx: ClientContext) -> Upload:
        lr = self.step_lr(ctx)
        opt = ctx.optimizer(lr=lr)  # plain SGD, rebuilt every round
        counts = [0, 0]
        if self.use_agc(ctx.train.batch_size):
            hp = self.hp
            units = [(p, whole) for _, p, whole in
                     agc_parameters(ctx.model, hp.agc_exclude.split(","), hp.agc_clip_vectors)]

            def agc_hook(optimizer, args, kwargs):  # runs after backward(), before the update
                c, s = adaptive_clip_(units, hp.agc_lambda, hp.agc_eps)
                counts[0] += c
                counts[1] += s
            opt.register_step_pre_hook(agc_hook)
        stats = train_epochs(ctx, optimizer=opt)
        if counts[1]:
            stats["agc_clipped"] = counts[0] / counts[1]  # fraction of units clipped this round
        return self.upload(ctx, stats)
