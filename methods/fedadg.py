"""FedADG — L. Zhang, X. Lei, Y. Shi, H. Huang, C. Chen, "Federated Learning with Domain
Generalization", arXiv:2111.10487, 2021 (federated adversarial domain generalization; spec 5.6).

Each client aligns its feature distribution to a shared, class-conditional *reference
distribution* produced by a generator, through a local discriminator.
    F: the feature extractor, C: the classifier, G(y, u): the conditional generator of reference
    features (u ~ U(0, 1)^{d_u}), D(y, f): a conditional discriminator on a fixed random projection
    of f; y_s = the soft label (``soft_label`` on the true class, 0 elsewhere).
Client k, round t, from the global F, C, G and its own D:
    i_epochs epochs of label-smoothed CE on F and C, then E epochs where every batch takes three steps
    (a) D:    L_D = mean[(1 - D(y_s, G(y_s, u)))^2 + D(y_s, F(x))^2]       G and F detached, F in eval mode
    (b) F, C: L_F = alpha CE_ls(C(F(x)), y) + (1 - alpha) mean[(1 - D(y_s, F(x)))^2]
    (c) G:    L_G = mean[D(y_s, G(y_s, u))^2]
    CE_ls: the CE against 1 - eps on the true class and eps / (classes - 1) on each other class
    (least-squares GAN: D calls the reference "real" and the features "fake"; F learns to make its
    features look like the reference, G to make the reference look like the features)
    upload F, C and G as they are after the last adversarial epoch; D stays on the client.
Server: FedAvg of F, C and G. The scored model is the global F + C.

Where the defaults come from: the code read is an unofficial mirror of the release
(Haoxiang-Wang/FedADG, pacs-ours/{train,localTrain,Nets}.py and utils/utilss.py; spec 5.6); the
paper's own text was not at hand, and its hyperparameters were tuned with that code, so its forms
are the defaults (``raysim methods fedadg`` lists each one's source):
* alpha = 0.85 and y_s = 0.7 on the true class (hard-coded in localTrain.py); rp_size 1024; the
  README's PACS command: label smoothing 0.01, i_epochs 3, lr1 / lr0 = 0.007 / 0.01;
* y_s is 0 on the other classes (``soft_label_rest: zero``; ``spread`` puts (1 - 0.7) / (classes - 1)
  on each, an earlier reading of ours);
* the smoothed CE puts eps / (classes - 1) on each wrong class (``smoothing: others``, the code's
  LabelSmoothingLoss; ``uniform`` is PyTorch's label_smoothing, eps / classes on every class);
* step (a) scores F(x) with F in eval mode (dropout off, BN on its running statistics; no update
  of them), step (b) with a fresh train-mode pass (``disc_features: eval``; ``train`` reuses
  step (b)'s train-mode features, detached, for D: one pass of F instead of two);
* the upload is the last adversarial epoch's F, C and G (``upload: last``). The mirror means to
  upload the epoch with the best local validation accuracy, but it keeps that epoch as
  ``state_dict()`` references to the live modules, which the later epochs overwrite in place: what
  it sends, and what its hyperparameters were tuned with, is the last epoch. ``upload: best_val``
  is the intended best-epoch upload (it needs a validation split).

Choices of ours (the paper leaves them open or the mirror's architecture does not carry over):
* F is the zoo backbone's ``features`` and C its ``head`` (the mirror's C is Linear-Linear on
  AlexNet's fc7; the zoo's head is one Linear);
* G: Linear(d_u + classes, d) - LeakyReLU(0.2) - Linear(d, d) - ReLU with d_u = d / 2 (the mirror:
  2048 for 4096-d features); the hidden width d is ours;
* D: a fixed bias-free Gaussian projection d -> ``rp_size`` with unit-norm rows, drawn from a
  generator keyed by the run's seed (the same on every client, never stored or sent), concatenated
  with y_s, then Linear(rp + classes, rp) - LeakyReLU(0.2) - Linear(rp, 1) - sigmoid (widths ours);
* G and D step at ``gd_lr_ratio`` (0.7 = 0.007 / 0.01, PACS) times the round's lr; the optimizers
  are rebuilt every round (the code); D's weights persist on the client;
* the adversarial epochs are train.epochs (E); the CE warm-up epochs ``ce_epochs`` run first in
  every round; train.max_steps caps the adversarial phase;
* ``upload: best_val`` without a validation split uploads the last epoch. The scheduler (warm-up +
  ReduceLROnPlateau) is replaced by the protocol's lr schedule.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from raysim.core.contract import ClientContext, Method, Upload
from raysim.core.hparams import Hparams, Space
from raysim.models.base import Net
from raysim.core.seeding import SERVER, generator_for
from raysim.core.settings import setting
from raysim.core.training import evaluate

DISC = "disc."  # the discriminator's state-dict prefix: kept on the client


@dataclass(frozen=True)
class FedADGHparams(Hparams):
    alpha: float = setting(0.85, ge=0, le=1, source="code (mirror, localTrain.py)", doc="weight of the CE in L_F")
    label_smoothing: float = setting(0.01, ge=0, lt=1, source="code README, PACS (VLCS: 0.2)", doc="eps of CE_ls")
    smoothing: str = setting("others", one_of=("others", "uniform"), source="code (mirror, utils/utilss.py)", doc="eps/(C-1) on each wrong class | eps/C on every class")
    soft_label: float = setting(0.7, gt=0, le=1, source="code (mirror, localTrain.py)", doc="y_s's value on the true class")
    soft_label_rest: str = setting("zero", one_of=("zero", "spread"), source="code (mirror, localTrain.py)", doc="y_s elsewhere: 0 | (1 - soft_label)/(C-1)")
    disc_features: str = setting("eval", one_of=("eval", "train"), source="code (mirror, localTrain.py)", doc="F's mode when D scores it in step (a)")
    ce_epochs: int = setting(3, ge=0, source="code README, PACS (--i-epochs 3)", doc="i_epochs of label-smoothed CE before the adversarial epochs")
    gd_lr_ratio: float = setting(0.7, gt=0, source="code README, PACS (lr1 / lr0 = 0.007 / 0.01)", doc="G's and D's lr / F's and C's")
    rp_size: int = setting(1024, ge=1, source="code (mirror, README and train.py)", doc="the random projection's width")
    upload: str = setting("last", one_of=("best_val", "last"), source="code (mirror, localTrain.py: its best-epoch copy aliases the live weights)", doc="the epoch whose F, C, G are uploaded")

    @classmethod
    def search_space(cls):
        # the README's two settings (PACS 0.01, VLCS 0.2) and a middle value; alpha around the code's 0.85 (ours)
        return {"alpha": Space.choice(0.7, 0.85, 0.95), "label_smoothing": Space.choice(0.01, 0.1, 0.2)}


# ----------------------------------------------------------------------------- the equations

def soft_labels(y: torch.Tensor, num_classes: int, on: float = 0.7, rest: str = "zero") -> torch.Tensor:
    """``on`` at the true class and 0 elsewhere (``rest: zero``, the code's), or (1 - on) / (classes - 1)
    on each other class (``spread``): y = 1 of 3 -> (0, 0.7, 0) or (0.15, 0.7, 0.15)."""
    off = 0.0 if rest == "zero" else (1.0 - on) / max(num_classes - 1, 1)
    return torch.full((len(y), num_classes), off, device=y.device).scatter_(1, y[:, None], on)


def smoothed_ce(logits: torch.Tensor, y: torch.Tensor, eps: float, form: str = "others") -> torch.Tensor:
    """CE_ls: the CE against 1 - eps on the true class and eps / (classes - 1) on each other class
    (``others``, the code's), or PyTorch's label_smoothing (``uniform``: eps / classes added to
    every class). p = (1/2, 1/4, 1/4), y = 0, eps = 0.2:
    0.8 ln 2 + 2 * 0.1 * 2 ln 2 = 1.2 ln 2 (others), (0.8 + 0.2/3) ln 2 + 2 * (0.2/3) * 2 ln 2 = 17/15 ln 2 (uniform)."""
    if form == "uniform":
        return F.cross_entropy(logits, y, label_smoothing=eps)
    logp = F.log_softmax(logits, dim=1)
    target = torch.full_like(logp, eps / max(logits.shape[1] - 1, 1)).scatter_(1, y[:, None], 1.0 - eps)
    return -(target * logp).sum(dim=1).mean()


def discriminator_loss(d_ref: torch.Tensor, d_feat: torch.Tensor) -> torch.Tensor:
    """(a) mean[(1 - D(G))^2 + D(F)^2]: D == 0.5 gives 0.25 + 0.25 = 0.5."""
    return ((1 - d_ref) ** 2 + d_feat ** 2).mean()


def feature_loss(ce: torch.Tensor, d_feat: torch.Tensor, alpha: float) -> torch.Tensor:
    """(b) alpha CE + (1 - alpha) mean[(1 - D(F))^2]: D == 0.5 gives 0.85 CE + 0.15 * 0.25 = 0.85 CE + 0.0375."""
    return alpha * ce + (1 - alpha) * ((1 - d_feat) ** 2).mean()


def generator_loss(d_ref: torch.Tensor) -> torch.Tensor:
    """(c) mean[D(G)^2]: D == 0.5 gives 0.25."""
    return (d_ref ** 2).mean()


def eval_features(features: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """F(x) with F in eval mode (dropout off, BN on its running statistics, which stay as they
    are), no gradient; F back in train mode after."""
    features.eval()
    with torch.no_grad():
        f = features(x)
    features.train()
    return f


# ----------------------------------------------------------------------------- the modules

class Generator(nn.Module):
    """G(y_s, u): the class-conditional reference features."""

    def __init__(self, noise_dim: int, num_classes: int, feature_dim: int):
        super().__init__()
        self.noise_dim = noise_dim
        self.net = nn.Sequential(nn.Linear(noise_dim + num_classes, feature_dim), nn.LeakyReLU(0.2),
                                 nn.Linear(feature_dim, feature_dim), nn.ReLU())

    def forward(self, y_soft: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([u, y_soft], dim=1))


class Discriminator(nn.Module):
    """D(y_s, f) in (0, 1) on a fixed random projection of f (a non-persistent buffer)."""

    def __init__(self, feature_dim: int, num_classes: int, rp_size: int, generator: torch.Generator):
        super().__init__()
        proj = torch.randn(rp_size, feature_dim, generator=generator)
        self.register_buffer("projection", proj / proj.norm(dim=1, keepdim=True), persistent=False)
        self.net = nn.Sequential(nn.Linear(rp_size + num_classes, rp_size), nn.LeakyReLU(0.2),
                                 nn.Linear(rp_size, 1), nn.Sigmoid())

    def forward(self, y_soft: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([f @ self.projection.T, y_soft], dim=1)).squeeze(1)


class FedADGNet(Net):
    """F (``features``) + C (``head``), with the generator ``gen`` and the discriminator ``disc``
    riding along; forward is C(F(x))."""

    def __init__(self, backbone: Net, rp_size: int, seed: int):
        super().__init__(backbone.features, backbone.head, backbone.input_shape)
        d, c = backbone.feature_dim, backbone.num_classes
        self.gen = Generator(max(d // 2, 1), c, d)
        self.disc = Discriminator(d, c, rp_size, generator_for(seed, 0, SERVER, "fedadg_projection"))


class FedADG(Method):
    name = "fedadg"
    Hparams = FedADGHparams
    paper = "Zhang, Lei, Shi, Huang, Chen, arXiv:2111.10487, 2021"
    shares = 'shares feature extractor, classifier and reference generator; keeps its discriminator'
    exchanges = ("the generator of class-conditional reference features, trained to imitate the "
                 "clients' feature distributions, is averaged and broadcast")

    def build_model(self) -> nn.Module:
        return FedADGNet(super().build_model(), self.hp.rp_size, self.setup.seed)

    def personal_keys(self, model):
        return {k for k in model.state_dict() if k.startswith(DISC)}

    def local_update(self, ctx: ClientContext) -> Upload:
        model, hp = ctx.model, self.hp
        classes = model.num_classes
        fc = list(model.features.parameters()) + list(model.head.parameters())
        gen, disc = list(model.gen.parameters()), list(model.disc.parameters())
        opt_fc = ctx.optimizer(fc)
        # warm-up: label-smoothed CE on F and C
        for x, y in ctx.batches(hp.ce_epochs, max_steps=None):
            ctx.step(smoothed_ce(model(x), y, hp.label_smoothing, hp.smoothing), opt_fc, clip=fc)
        opt_fc = ctx.optimizer(fc)  # (the code rebuilds its optimizers per phase)
        opt_g = ctx.optimizer(gen, lr=ctx.lr * hp.gd_lr_ratio)
        opt_d = ctx.optimizer(disc, lr=ctx.lr * hp.gd_lr_ratio)
        best, best_acc = None, -1.0
        use_best = hp.upload == "best_val" and ctx.data.val is not None
        d_sum = g_sum = 0.0
        start = ctx.steps
        cap = ctx.train.max_steps
        for _ in range(ctx.train.epochs):
            if cap and ctx.steps - start >= cap:
                break
            for x, y in ctx.batches(1, max_steps=cap - (ctx.steps - start) if cap else None):
                ys = soft_labels(y, classes, hp.soft_label, hp.soft_label_rest)
                u = torch.rand(len(y), model.gen.noise_dim, generator=ctx.generator).to(x.device)
                # (a) the discriminator, on F's eval-mode features (taken before (b)'s pass moves
                # the BN statistics) or on (b)'s train-mode ones
                if hp.disc_features == "eval":
                    f_d, f = eval_features(model.features, x), model.features(x)
                else:
                    f = model.features(x)
                    f_d = f.detach()
                loss_d = discriminator_loss(model.disc(ys, model.gen(ys, u).detach()), model.disc(ys, f_d))
                ctx.step(loss_d, opt_d, clip=disc, record=False)
                # (b) the feature extractor and the classifier
                ce = smoothed_ce(model.head(f), y, hp.label_smoothing, hp.smoothing)
                ctx.step(feature_loss(ce, model.disc(ys, f), hp.alpha), opt_fc, clip=fc)
                # (c) the generator
                loss_g = generator_loss(model.disc(ys, model.gen(ys, u)))
                ctx.step(loss_g, opt_g, clip=gen, record=False)
                d_sum, g_sum = d_sum + loss_d.detach().double(), g_sum + loss_g.detach().double()
            if use_best:
                r = evaluate(model, ctx.data.val, max(ctx.train.batch_size, 256), ctx.device)
                acc = r["correct"] / r["n"] if r["n"] else None
                if acc is None:
                    use_best = False
                elif acc > best_acc:
                    best_acc = acc
                    best = {k: v.detach().clone() for k, v in model.state_dict().items() if not k.startswith(DISC)}
        stats = ctx.stats()
        adv = max(ctx.steps - start, 1)
        stats.update(d_loss=float(d_sum) / adv, g_loss=float(g_sum) / adv)
        disc_state = {k: v.detach().clone() for k, v in model.state_dict().items() if k.startswith(DISC)}
        if use_best and best is not None:
            model.load_state_dict({**best, **disc_state})  # F, C, G of the best epoch; D as trained
            stats["best_val_acc"] = best_acc
        return self.upload(ctx, stats)
