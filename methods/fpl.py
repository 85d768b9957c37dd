"""FPL — Huang, Ye, Shi, Li, Du, "Rethinking Federated Learning with Domain Shift: A Prototype View",
CVPR 2023 (Federated Prototype Learning).

Server state: for each class c, a set P_c of cluster prototypes (none before the first round).
Client k, round t, from the global model; z = the representation (the classifier's input):
    L = CE(h(z), y) + L_CPCL + L_UPCR                                        (Eqs. 4-8, weights 1)
    L_CPCL = -log( sum_{p in P_y} e^{cos(z, p) / tau} / sum_{p in all P} e^{cos(z, p) / tau} )
    L_UPCR = || z - mean(P_y) ||^2 / d                        (the "unbiased" prototype of class y)
    both summed over the samples whose class has prototypes, divided by the batch size; CE only
    while there are none
    local prototypes: p_{k,c} = the mean of the detached z of class c seen in the last local epoch
    upload the model and {c: p_{k,c}}
Server: FedAvg of the models; per class, FINCH (cosine) over the clients' p_{k,c}, its last
(coarsest) partition, a cluster prototype = the mean of its members; broadcast every P_c.
Data exchange: per-client, per-class mean embeddings up; cluster means of all clients' embeddings down.

Where the default comes from (``raysim methods fpl``): tau = 0.02, the paper's value and the official
code's (WenkeHuang/RethinkFL ``--infoNCET 0.02`` since commit edac25f, "fix bug"; the first commit had
0.1, which spec 4.3 read); DapperFL Table 4 uses 0.02 too. The loss weights (1 and 1) and the
last-epoch prototypes are the paper's and the code's alike.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from raysim.core.contract import ClientContext, Method, Upload
from raysim.core.hparams import Hparams, Space
from raysim.core.settings import setting


@dataclass(frozen=True)
class FPLHparams(Hparams):
    tau: float = setting(0.02, gt=0, expected="> 0", source="paper; official code agrees (RethinkFL --infoNCET 0.02)", doc="temperature of L_CPCL; DapperFL Table 4 too")

    @classmethod
    def search_space(cls):
        return {"tau": Space.log(0.01, 0.5)}


# ----------------------------------------------------------------------------- FINCH (Sarfraz et al., CVPR 2019)

def first_neighbour_partition(x: np.ndarray) -> np.ndarray:
    """One FINCH step: link every point to its first (cosine) neighbour; the clusters are the
    connected components of those links (i ~ j if one is the other's first neighbour or they share one)."""
    n = len(x)
    if n == 1:
        return np.zeros(1, dtype=np.int64)
    unit = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
    sim = unit @ unit.T
    np.fill_diagonal(sim, -np.inf)
    first = sim.argmax(axis=1)
    parent = list(range(n))

    def root(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i
    for i, j in enumerate(first):
        parent[root(i)] = root(int(j))
    roots = [root(i) for i in range(n)]
    return np.unique(roots, return_inverse=True)[1].astype(np.int64)


def finch(x: np.ndarray) -> list[np.ndarray]:
    """FINCH's partitions of the rows of ``x``, finest first: each level clusters the previous
    level's cluster means; it stops at a level with one cluster or no merge (that level is dropped,
    except the first)."""
    partitions = [first_neighbour_partition(x)]
    while True:
        labels = partitions[-1]
        k = labels.max() + 1
        if k == 1:
            return partitions
        means = np.stack([x[labels == c].mean(0) for c in range(k)])
        merged = first_neighbour_partition(means)
        if merged.max() + 1 == 1 or merged.max() + 1 == k:
            return partitions
        partitions.append(merged[labels])


def cluster_prototypes(protos: list[torch.Tensor]) -> torch.Tensor:
    """The cluster prototypes of one class: the means of FINCH's last partition of the clients'
    prototypes (a class held by one client keeps its prototype)."""
    x = torch.stack(protos).double()
    if len(protos) == 1:
        return x.float()
    labels = finch(x.numpy())[-1]
    return torch.stack([x[torch.from_numpy(labels == c)].mean(0) for c in range(labels.max() + 1)]).float()


# ----------------------------------------------------------------------------- the losses

def prototype_losses(z: torch.Tensor, y: torch.Tensor, protos: torch.Tensor, labels: torch.Tensor,
                     tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(L_CPCL, L_UPCR) of a batch: each summed over the samples whose class has prototypes and
    divided by the batch size. ``protos`` M x d, ``labels`` M (the class of each prototype)."""
    logits = F.cosine_similarity(z[:, None, :], protos[None, :, :], dim=2) / tau  # B x M
    positive = labels[None, :] == y[:, None]
    has = positive.any(dim=1)  # only samples whose class has prototypes (no -inf rows: no NaN gradient)
    logits, positive, z, n = logits[has], positive[has], z[has], len(y)
    cpcl = (torch.logsumexp(logits, dim=1) - torch.logsumexp(logits.masked_fill(~positive, float("-inf")), dim=1))
    unbiased = (positive.to(protos.dtype) @ protos) / positive.sum(dim=1, keepdim=True)  # mean(P_y)
    return cpcl.sum() / n, ((z - unbiased) ** 2).mean(dim=1).sum() / n


class FPL(Method):
    name = "fpl"
    Hparams = FPLHparams
    paper = "Huang et al., CVPR 2023"
    shares = 'shares the model and class prototypes; keeps nothing'
    exchanges = "per-client class-mean embeddings (prototypes) up; cluster means of all clients' embeddings down"

    def init_server(self, model):
        return {**super().init_server(model), "protos": torch.zeros(0, model.feature_dim), "proto_labels":
                torch.zeros(0, dtype=torch.long)}

    def broadcast(self, state, round):
        return {**super().broadcast(state, round), "protos": state["protos"], "proto_labels": state["proto_labels"]}

    def local_update(self, ctx: ClientContext) -> Upload:
        model = ctx.model
        protos = ctx.payload["protos"].to(ctx.device)
        labels = ctx.payload["proto_labels"].to(ctx.device)
        opt = ctx.optimizer()
        epochs = ctx.train.epochs
        sums = torch.zeros(self.setup.num_classes, model.feature_dim, dtype=torch.float64, device=ctx.device)
        counts = torch.zeros(self.setup.num_classes, dtype=torch.float64, device=ctx.device)
        cap = ctx.train.max_steps  # per round, across the epochs
        for epoch in range(epochs):
            if cap and ctx.steps >= cap:
                break
            for x, y in ctx.batches(epochs=1, max_steps=cap - ctx.steps if cap else None):
                z = model.features(x)
                loss = F.cross_entropy(model.head(z), y)
                if len(protos):
                    cpcl, upcr = prototype_losses(z, y, protos, labels, self.hp.tau)
                    loss = loss + cpcl + upcr
                ctx.step(loss, opt)
                if epoch == epochs - 1:  # the last local epoch's representations
                    sums.index_add_(0, y, z.detach().double())
                    counts.index_add_(0, y, torch.ones_like(y, dtype=torch.float64))
        up = self.upload(ctx, ctx.stats())
        present = counts > 0
        up.extras = {"protos": (sums[present] / counts[present, None]).float().cpu(),
                     "classes": present.nonzero().flatten().cpu()}
        return up

    def aggregate(self, state, uploads, round):
        state = super().aggregate(state, uploads, round)
        by_class: dict[int, list[torch.Tensor]] = {}
        for e in uploads.extras.values():
            for c, p in zip(e["classes"].tolist(), e["protos"]):
                by_class.setdefault(c, []).append(p)
        protos, labels = [], []
        for c in sorted(by_class):
            clusters = cluster_prototypes(by_class[c])
            protos.append(clusters)
            labels += [c] * len(clusters)
        if not protos:
            return state
        return {**state, "protos": torch.cat(protos), "proto_labels": torch.tensor(labels, dtype=torch.long)}

    def server_metrics(self, state):
        n = len(state["proto_labels"])
        return {"prototypes": float(n)} if n else {}
