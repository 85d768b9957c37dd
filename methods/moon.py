"""MOON — Li, He, Song, "Model-Contrastive Federated Learning", CVPR 2021 (Algorithm 1, Eqs. 1-3).

Client i, round t, from the global model w^t (its state: its model from the end of its previous
participation, w_i^{t-1}):
    for every batch (x, y):
        z      = R_w(x)          the representation: the projection head's output (head: mlp),
                                 or the input of the classifier (head: none)
        z_glob = R_{w^t}(x)      frozen received global model, no gradient
        z_prev = R_{w_i^{t-1}}(x)  frozen previous local model, no gradient
        l_con  = -log( exp(cos(z, z_glob)/tau) / (exp(cos(z, z_glob)/tau) + exp(cos(z, z_prev)/tau)) )   (Eq. 2)
        L      = CE(w; x, y) + mu * mean_b l_con                                                          (Eq. 3)
    keep w_i^t; upload w_i^t.     Server: FedAvg.
A client's first participation has no previous model: l_con = 0 (FLGo; the official code's
copy of the initial model gives l_con ~ log 2 and no gradient). The frozen models run with
batch statistics (train mode), as the implementations do, and their statistics are discarded.

Where the defaults come from (``raysim methods moon`` lists each one's source): the paper and its
official code (QinbinLi/MOON) agree, so their values are the defaults.
  * ``head: mlp``: the paper's projection head, Linear(d, d) - ReLU - Linear(d, ``proj_dim`` = 256)
    with the classifier on its output (code: use_project_head = 1, out_dim = 256). ``head: none``
    contrasts the classifier's input instead, as the seeds' code bases do (FLGo's MOON for FDSE,
    RethinkFL's for DapperFL); the seed configs set it.
  * mu = 1: the code's default (the paper tunes mu per dataset in {0.1, 1, 5, 10}); tau = 0.5:
    paper and code.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from raysim.core.contract import ClientContext, Method, SpareModels, Upload
from raysim.core.hparams import Hparams, Space
from raysim.models.base import Net
from raysim.core.settings import setting


@dataclass(frozen=True)
class MOONHparams(Hparams):
    mu: float = setting(1.0, ge=0, source="official code default (QinbinLi/MOON --mu 1)", doc="weight of l_con; DapperFL Table 4 too, inside FDSE's grid {0.1, 1, 5, 10}")
    tau: float = setting(0.5, gt=0, expected="> 0", source="paper; code agrees (--temperature 0.5)", doc="temperature (fixed in FDSE and DapperFL)")
    head: str = setting("mlp", one_of=("none", "mlp"), source="paper (encoder, projection head, output layer); code agrees (use_project_head 1)", doc="mlp: the paper's projection head; none: FLGo / RethinkFL (the seeds' configs)")
    proj_dim: int = setting(256, ge=1, source="paper; code agrees (--out_dim 256)", doc="the mlp head's output")

    @classmethod
    def search_space(cls):
        return {"mu": Space.choice(0.1, 1.0, 5.0, 10.0)}  # FDSE A7.4


def model_contrastive_loss(z: torch.Tensor, z_glob: torch.Tensor, z_prev: torch.Tensor, tau: float) -> torch.Tensor:
    """Eq. 2 averaged over the batch: a 2-way cross-entropy with the global representation as the
    positive (index 0) and the previous local one as the negative."""
    sims = torch.stack([F.cosine_similarity(z, z_glob, dim=1), F.cosine_similarity(z, z_prev, dim=1)], dim=1)
    return F.cross_entropy(sims / tau, torch.zeros(len(z), dtype=torch.long, device=z.device))


class MOON(Method):
    name = "moon"
    Hparams = MOONHparams
    paper = "Li, He, Song, CVPR 2021"
    shares = 'shares the whole model; keeps its previous local model (contrastive term)'

    def __init__(self, hp, setup):
        super().__init__(hp, setup)
        self.spares = SpareModels()  # the frozen global and previous models, one instance each per host

    def build_model(self) -> nn.Module:
        model = super().build_model()
        if self.hp.head == "none":
            return model
        d, k = model.feature_dim, self.hp.proj_dim  # Linear(d, d) - ReLU - Linear(d, 256), classifier on it
        features = nn.Sequential(model.features, nn.Linear(d, d), nn.ReLU(inplace=True), nn.Linear(d, k))
        return Net(features, nn.Linear(k, model.num_classes), model.input_shape)

    def init_client_state(self, client_id, model):
        return {}  # w_i^{t-1} appears after the client's first round

    def local_update(self, ctx: ClientContext) -> Upload:
        model, hp = ctx.model, self.hp
        previous = ctx.state.get("previous")
        contrast = hp.mu > 0 and previous is not None
        if contrast:
            glob = self.spares.get("global", model, model.state_dict())  # w^t as received
            prev = self.spares.get("previous", model, previous)
        opt = ctx.optimizer()
        con_sum = 0.0
        for x, y in ctx.batches():
            z = model.features(x)
            loss = F.cross_entropy(model.head(z), y)
            if contrast:
                with torch.no_grad():
                    z_glob, z_prev = glob.features(x), prev.features(x)
                con = model_contrastive_loss(z, z_glob, z_prev, hp.tau)
                loss = loss + hp.mu * con  # Eq. 3
                con_sum = con_sum + con.detach().double()
            ctx.step(loss, opt)
        stats = ctx.stats()
        if contrast:
            stats["con_loss"] = float(con_sum) / max(stats["steps"], 1)
        ctx.state["previous"] = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        return self.upload(ctx, stats)
