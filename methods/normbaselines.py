"""The normalization baselines of FedWon (Zhuang & Lyu, ICLR 2024, Sec. 4.2, App. A.2-A.3).

Each is FedAvg (or FedBN's key split) with one change to where normalization lives or what
its statistics are:

* FedAvg+GN  every BN becomes GroupNorm (FedWon Tables 5-6 groups; 32/8/24 rule elsewhere).
* FedAvg+LN  every BN becomes GroupNorm(1, C) (LayerNorm over C, H, W with per-channel affine).
* SiloBN     Andreux et al. 2020: BN statistics stay on the client, BN affine is shared.
* FixBN      Zhong et al. 2023: FedAvg with BN, then BN statistics frozen at the global ones.

Only FixBN has hyperparameters: its switch round T* = R/2 (FedWon, which ran these baselines in
Table 1, gives none; no FixBN code is public, so the default follows the FixBN paper's two
halves as the FedWon spec reads it, unverified). GN's group counts are the model's (FedWon
Tables 5-6), not method settings.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

from torch import nn

from raysim.core.contract import ClientContext, LocalLoss, Method, Upload, cross_entropy
from raysim.core.hparams import Hparams, Space
from raysim.core.settings import setting
from raysim.core.training import collect_bn_stats, train_epochs


def bn_layers(model: nn.Module) -> list[tuple[str, nn.modules.batchnorm._BatchNorm]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def bn_stat_keys(model: nn.Module) -> set[str]:
    """State-dict keys of the BN statistics only: running mean, running var, batch counter."""
    keys = set()
    for name, mod in bn_layers(model):
        for k in ("running_mean", "running_var", "num_batches_tracked"):
            if getattr(mod, k, None) is not None:
                keys.add(f"{name}.{k}" if name else k)
    return keys


# ----------------------------------------------------------------------------- FedAvg + GN / LN

@dataclass(frozen=True)
class FedAvgGNHparams(Hparams):
    pass


class FedAvgGN(Method):
    """FedAvg+GN — FedAvg with every BatchNorm replaced by GroupNorm (Wu & He 2018).

    FedWon App. A.2: the six-layer CNN uses GN(32, 64), GN(32, 64), GN(64, 128) (Table 5), the
    AlexNet GN(32, 64), GN(32, 192), GN(64, 384), GN(64, 256) x2 (Table 6); ResNet/MobileNetV2
    32 groups, 8 below 32 channels, 24 at 144 channels. Statistics are per sample, so nothing
    depends on the batch; all tensors are averaged (n_k-weighted) and one global model is tested.
    """
    name = "fedavg_gn"
    Hparams = FedAvgGNHparams
    paper = "FedWon (Zhuang & Lyu, ICLR 2024) baseline; GroupNorm: Wu & He, ECCV 2018"
    shares = 'shares the whole model (GroupNorm instead of BN); keeps nothing'
    norm = "gn"

    def build_model(self) -> nn.Module:
        return self.base_model(norm=self.norm)

    def local_loss(self, ctx):
        return LocalLoss(cross_entropy)  # client cohorts: the step is SGD on the cross-entropy


@dataclass(frozen=True)
class FedAvgLNHparams(Hparams):
    pass


class FedAvgLN(FedAvgGN):
    """FedAvg+LN — FedAvg+GN with one group: GroupNorm(1, C) after every conv.

    FedWon App. A.2: "FedAvg+LN ... sets the number of groups in GN to 1", i.e. LayerNorm over
    (C, H, W) of each sample with a per-channel affine (the zoo's norm "ln"; after a linear
    layer, nn.LayerNorm(C)). All tensors averaged; global model.
    """
    name = "fedavg_ln"
    Hparams = FedAvgLNHparams
    paper = "FedWon (Zhuang & Lyu, ICLR 2024) baseline; LayerNorm: Ba et al. 2016"
    shares = 'shares the whole model (LayerNorm instead of BN); keeps nothing'
    norm = "ln"


# ----------------------------------------------------------------------------- SiloBN

@dataclass(frozen=True)
class SiloBNHparams(Hparams):
    pass


class SiloBN(Method):
    """SiloBN — Andreux et al., "Siloed Federated Learning for Multi-centric Histopathology
    Datasets", DART/DCL 2020.

    BN layers are split: the learned affine (gamma, beta) is federated with every other weight,
    the statistics (running mean, running variance) never leave their client:

        shared   = all parameters, BN gamma and beta included      (n_k-weighted FedAvg)
        personal = BN running_mean, running_var, num_batches_tracked

    FedWon App. A.3: "we modify the FedBN implementation to aggregate only the BN parameters
    while keeping the BN statistics local". Each client is tested with the shared weights and
    its own statistics (eval.protocol: personalized). The global model (global and lodo
    protocols) takes the mean of the clients' statistics; an unseen client replaces them with
    its own, collected in one train-mode pass over its unlabeled data (as FedBN's adaptation,
    FDSE Alg. 2: statistics are what SiloBN keeps per site).
    """
    name = "silobn"
    Hparams = SiloBNHparams
    paper = "Andreux et al., DART/DCL 2020"
    shares = 'shares all but the BN running statistics; keeps BN statistics'

    def personal_keys(self, model: nn.Module) -> set[str]:
        return bn_stat_keys(model)

    def local_loss(self, ctx):
        return LocalLoss(cross_entropy)  # client cohorts: the step is SGD on the cross-entropy

    def adapt_to_unseen(self, model, client):
        collect_bn_stats(model, client.unlabeled_batches(client.train.batch_size))
        return True


# ----------------------------------------------------------------------------- FixBN

@dataclass(frozen=True)
class FixBNHparams(Hparams):
    switch_frac: float = setting(0.5, ge=0, le=1, source="FedWon spec 9.18: T* = R/2 after the FixBN paper (not checked against its text)", doc="stage 1 = the first round(switch_frac * rounds) rounds")
    switch_round: int = setting(0, ge=0, source="ours: 0 = use switch_frac", doc="> 0 overrides switch_frac: stage 1 = rounds 1..switch_round")

    @classmethod
    def search_space(cls):
        return {"switch_frac": Space.uniform(0.1, 0.9)}


@contextmanager
def frozen_bn(model: nn.Module):
    """Inside: every BN layer normalises with its running statistics, also in train mode, and
    leaves them unchanged. Each BN call runs in eval mode (a forward pre-hook switches it, a
    forward hook switches it back), so ``model.train()``/``eval()`` keep their meaning."""
    was: dict[int, bool] = {}

    def enter(module, args):
        was[id(module)] = module.training
        module.training = False

    def leave(module, args, output):
        module.training = was.pop(id(module), module.training)

    handles = []
    for _, m in bn_layers(model):
        handles += [m.register_forward_pre_hook(enter), m.register_forward_hook(leave)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


class FixBN(Method):
    """FixBN — Zhong et al., "Making Batch Normalization Great in Federated Deep Learning", 2023.

    Two stages over R rounds, switch round T* = round(switch_frac * R) (0.5 by default):

      rounds 1..T*      (explore)  FedAvg with BN: local training normalises with batch
                                   statistics, and every tensor, BN running statistics
                                   included, is n_k-averaged;
      rounds T*+1..R    (calibrate) the BN statistics are frozen at the aggregated global
                                   running mean and variance: local training normalises with
                                   them (no batch statistics) and no longer updates them;
                                   gamma, beta and every other weight keep training and being
                                   averaged.

    FedWon Sec. 2.1: "FixBN only trains BN statistics in the first stage of training and
    freezes them thereafter." No code is public; this follows the description. One global model
    is tested.
    """
    name = "fixbn"
    Hparams = FixBNHparams
    paper = "Zhong et al., arXiv 2303.06530 (2023)"
    shares = 'shares the whole model; BN statistics frozen after the switch round'

    def switch_round(self) -> int:
        if self.hp.switch_round > 0:
            return self.hp.switch_round
        return int(math.floor(self.hp.switch_frac * self.setup.rounds + 0.5))

    def frozen(self, round: int) -> bool:
        return round > self.switch_round()

    def local_update(self, ctx: ClientContext) -> Upload:
        if self.frozen(ctx.round):
            with frozen_bn(ctx.model):
                stats = train_epochs(ctx)
        else:
            stats = train_epochs(ctx)
        return self.upload(ctx, stats)
