"""CSAC's cross-layer semantic calibration pieces (Sec. 3.5, Eqs. 5-9): multi-kernel MMD, the
layer-pair attention, the projections and the feature taps on the layer set R."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from raysim.core.errors import UserError

MMD_MULTIPLIERS = tuple(3.0 ** k for k in range(-3, 2))  # s_k = 3^-3 .. 3^1 (DAN / TLL, code)
MMD_EPS = 1e-8  # added to sigma^2 so collapsed features cannot divide by zero (spec 9.15)


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
