"""FDSE - Wang et al., "Federated Learning with Domain Shift Eraser", CVPR 2025.

Model (Sec. 4.1, Tables A6/A7; :mod:`raysim.methods.fdse.layers`): every conv and hidden FC
layer is decomposed into a shared DFE (conv ceil(T/G) channels, BN_DFE) and a personalized DSE
(BN_DSE + ReLU + depthwise cheap op), theta_k = [theta_u ; theta_v,k].

Client k, round t (Alg. 1 lines 5-10):
    mu_g, sigma2_g  <- BN_DFE running stats of the received model (one pair per DSE block l)
    for every batch b:                                   E epochs of SGD, grad clip, wd from train
        mu_b, sigma2_b = per-channel batch mean / biased variance of Z^(l) = BN_DFE input  (Eq. 4)
        mu_hat  = gamma mu_hat  + (1 - gamma) mu_b                                          (Eq. 5)
        sigma2_hat = gamma sigma2_hat + (1 - gamma) sigma2_b
        L_con^(l) = ||mu_hat - mu_g||^2 / d + ((||sigma2_hat||_1 - ||sigma2_g||_1) / d)^2      (Eq. 6)
        L = CE + lambda * sum_l softmax(beta l)_l L_con^(l)       (Eq. 7; skipped in round 1)
    upload theta_u (DFE, BN_DFE, head), theta_v,k (BN_DSE affine, cheap op), BN_DFE running stats;
    BN_DSE running stats never leave the client.

Server (Alg. 1 line 12), each state-dict tensor separately:
    theta_u: dbar = mean_k ||D_k||, dhat_k = D_k / ||D_k||,
             u = argmin_{u in simplex} ||sum_k u_k dhat_k||^2,  theta_u += dbar sum_k u_k dhat_k  (Eq. 8)
    theta_v: V = [theta_v,1 ; ... ; theta_v,N], Q = K = row-normalised V,
             [theta_v,k,next]_k = softmax(Q K^T / tau) V; client k receives row k           (Eq. 9)
    BN_DFE running stats: plain mean over clients.

Unseen client (Sec. 5.4, Alg. 3; spec 9.26): theta_u and the BN_DFE statistics as broadcast,
theta_v = the uniform mean of the clients' Eq. 9 mixes, BN_DSE statistics = the uniform mean of
the clients'; then, label-free on its unlabeled data, E' epochs of SGD (step size eta = the last
training round's lr, batch 50) on theta_v alone to minimise sum_l w_l L_Con^(l) against the frozen
BN_DFE statistics (BN_DFE in eval mode, BN_DSE in train mode, re-estimating its statistics).

Defaults: the paper's forms. The official code (WwZzz/FDSE_CVPR25) was published after the
paper in two versions that disagree with each other, and neither is the one behind the paper's
numbers: Table 4's FLOPs fit only Table A6's paddings, which neither commit has (spec 4, 10.5),
and the latest commit's configs (lambda 0.05 / 0.5, Office beta 0.05) came with its new loss and
break the paper's "beta fixed at 0.001". Where the paper and the first commit agree (ReLU after
BN_DSE, Eq. 6's form), the paper's form is the default; the latest code stays a switch:
``dse_act`` ("relu" | "none": latest code) and ``con_mode`` ("paper": Eq. 6 per channel |
"code_v2": the latest code's KL-like loss on channel-pooled scalars). What the paper does not
say comes from the code (``tau`` 0.5, ``skip_first_round``) or is ours (``lam`` in the middle
of its grid; the Alg. 3 adaptation's epochs, step size and batch). Ablations: ``shared_agg``
("consensus": Eq. 8 | "mean": w/o A) and ``dse_agg`` ("attention": Eq. 9 | "local": w/o B |
"mean").
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from raysim.core.aggregation import KeepAll, weighted_mean
from raysim.core.contract import ClientContext, Method, Upload
from raysim.core.errors import UserError
from raysim.core.hparams import Hparams, Space
from raysim.methods.fdse.aggregation import consensus_update, similarity_attention
from raysim.methods.fdse.consistency import ConsistencyRegularizer
from raysim.methods.fdse.layers import ACTIVATIONS, decompose, dse_blocks
from raysim.core.settings import setting
from raysim.core.tensors import load_tensors
from raysim.core.tensors import cpu_copy

ODD_KERNELS = (1, 3, 5, 7)


@dataclass(frozen=True)
class FDSEHparams(Hparams):
    lam: float = setting(0.1, ge=0, source="ours: middle of the paper's grid {0.01, 0.1, 1} (A7.4); its choice is unreported", doc="lambda, weight of L_Con (paper grid {0.01, 0.1, 1}; chosen value unreported)")
    tau: float = setting(0.5, gt=0, expected="> 0", source="official code (WwZzz/FDSE_CVPR25) default and configs; in the paper's grid", doc="Eq. 9 temperature (paper grid {0.001, 0.01, 0.1, 0.5}; official configs 0.5)")
    beta: float = setting(0.001, source="paper Sec. 4.2 (fixed); official PACS config agrees", doc="Eq. 7 depth exponent, fixed by the paper")
    gamma: float = setting(0.9, ge=0, lt=1, source="paper Eq. 5 (BN_DFE's momentum 0.1); code agrees", doc="Eq. 5 EMA momentum (weight on the old value) = 1 - BN momentum 0.1")
    G: int = setting(2, ge=2, source="paper Table A6; code agrees", doc="DSE expansion ratio (Table A6: 2 everywhere)")
    dw: int = setting(3, one_of=ODD_KERNELS, source="paper Table A6; code agrees", doc="cheap depthwise kernel of conv blocks (Table A6: 3)")
    dw_fc: int = setting(1, one_of=ODD_KERNELS, source="paper Table A6; code agrees", doc="cheap op kernel of FC blocks (Table A6: 1, a per-channel scale)")
    # ---- switches (defaults = the paper; alternatives = official code or ablations) ----
    dse_act: str = setting("relu", one_of=ACTIVATIONS, source="paper Eq. 3, Table A7; first code commit dd266a2 agrees", doc='after BN_DSE: "relu" (Eq. 3, Table A7) | "none" (latest code)')
    con_mode: str = setting("paper", one_of=("paper", "code_v2"), source="paper Eq. 6; first code commit dd266a2 has its form", doc="Eq. 6 per channel | the latest code's KL-like loss")
    skip_first_round: bool = setting(True, source="official code (the paper is silent)", doc="no L_Con in round 1 (global BN stats still at 0 / 1)")
    shared_agg: str = setting("consensus", one_of=("consensus", "mean"), source="paper Eq. 8; code agrees", doc='Eq. 8 | ablation "w/o A": FedAvg mean')
    dse_agg: str = setting("attention", one_of=("attention", "local", "mean"), source="paper Eq. 9; code agrees", doc='Eq. 9 | "w/o B" | uniform mean')
    # ---- unseen-client adaptation (Alg. 3; the paper gives no E or eta: spec 9.26) ----
    adapt_epochs: int = setting(5, ge=0, source="ours: Alg. 3 says 'several epochs' (spec 9.26)", doc='0: no adaptation (Table 2\'s "- align" row)')
    adapt_lr: float = setting(0.0, ge=0, source="ours: the paper gives no eta (spec 9.26)", doc="eta; 0: the learning rate of the last training round")
    adapt_batch: int = setting(50, ge=2, source="ours: the paper's training batch (A7.4); Alg. 3 gives none")

    @classmethod
    def search_space(cls):
        # Sec. A7.4: beta fixed, lambda in {0.01, 0.1, 1}, tau in {0.001, 0.01, 0.1, 0.5}.
        return {"lam": Space.log(0.01, 1.0), "tau": Space.log(0.001, 0.5)}


def key_role(key: str) -> str:
    """Role of a state-dict entry of an FDSE model.

    "local":  BN_DSE running statistics (and every BN's batch counter): never leave the client;
    "dse":    BN_DSE affine and the cheap op: theta_v, personalized by Eq. 9;
    "stat":   BN_DFE running mean/var: averaged;
    "shared": everything else (DFE convs/linears, BN_DFE affine, head): theta_u, Eq. 8.
    """
    parts = key.split(".")
    leaf, owners = parts[-1], parts[:-1]
    if leaf == "num_batches_tracked":
        return "local"
    if "bn_dse" in owners:
        return "local" if leaf in ("running_mean", "running_var") else "dse"
    if "cheap" in owners:
        return "dse"
    if leaf in ("running_mean", "running_var"):
        return "stat"
    return "shared"



class FDSE(Method):
    name = "fdse"
    Hparams = FDSEHparams
    aggregator = KeepAll()  # Eqs. 8-9 need every client's tensors
    paper = "Wang et al., CVPR 2025"
    shares = ('shares the DFE layers (Eq. 8 consensus) and BN_DFE statistics; DSE'
              ' layers personalized (Eq. 9 attention mix); keeps BN_DSE statistics')

    # ---- model (Sec. 4.1) -------------------------------------------------------------------
    def build_model(self):
        if self.setup.model.pretrained:
            raise UserError("FDSE re-creates every layer as a DSE block; 'model.pretrained' cannot be used")
        base = self.base_model(norm="bn")
        hp = self.hp
        return decompose(base, G=hp.G, dw=hp.dw, dw_fc=hp.dw_fc, dse_act=hp.dse_act)

    def personal_keys(self, model):
        return {k for k in model.state_dict() if key_role(k) == "local"}

    # ---- server -----------------------------------------------------------------------------
    def init_server(self, model):
        sd = model.state_dict()
        return {"global": cpu_copy({k: v for k, v in sd.items() if key_role(k) in ("shared", "stat")}),
                "dse_init": cpu_copy({k: v for k, v in sd.items() if key_role(k) == "dse"}),
                "dse": {}}  # client id -> its Eq. 9 mix (Alg. 1 line 2: the initial DSE until then)

    def client_payload(self, state, client_id, round):
        # Alg. 1 line 2: theta_v,k^0 = theta_v^0 until the client's first Eq. 9 mix
        return {"dse": state["dse"].get(client_id, state["dse_init"])}

    def aggregate(self, state: dict, uploads, round: int) -> dict:
        ids, ups = list(uploads.each), list(uploads.each.values())
        new_global = {}
        for key, cur in state["global"].items():
            vals = [u.tensors[key] for u in ups]
            if key_role(key) == "stat":  # BN_DFE running stats: "directly average them"
                new_global[key] = weighted_mean((({key: v}, 1.0) for v in vals))[key]
            elif not cur.is_floating_point():
                new_global[key] = cur
            elif self.hp.shared_agg == "consensus":  # Eq. 8
                delta, _ = consensus_update(cur, vals)
                new_global[key] = (cur.double() + delta).to(cur.dtype)
            else:  # ablation "w/o A": FedAvg's weighted mean
                new_global[key] = weighted_mean((({key: v}, u.weight) for v, u in zip(vals, ups)))[key]
        mixes = {k: dict(v) for k, v in state["dse"].items()}
        self_weights = []
        for key, init in state["dse_init"].items():
            V = torch.stack([u.tensors[key].double().reshape(-1) for u in ups])
            if self.hp.dse_agg == "attention":  # Eq. 9
                A = similarity_attention(V, self.hp.tau)
                self_weights.append(float(A.diagonal().mean()))
                rows = A @ V
            elif self.hp.dse_agg == "local":  # ablation "w/o B": DSE stays with its client
                rows = V
            else:
                rows = V.mean(0, keepdim=True).expand_as(V)
            for i, k in enumerate(ids):
                mixes.setdefault(k, {})[key] = rows[i].reshape(init.shape).to(init.dtype).clone()
        # diagnostics: the weight a client keeps on its own DSE in Eq. 9 (mean over tensors, clients)
        return {**state, "global": new_global, "dse": mixes,
                "dse_self_weight": float(np.mean(self_weights)) if self_weights else 1.0}

    def server_metrics(self, state):
        return {"dse_self_weight": state["dse_self_weight"]} if "dse_self_weight" in state else {}

    # ---- client -----------------------------------------------------------------------------
    def load_client_model(self, model, payload, state):
        load_tensors(model, payload["global"])  # theta_u and the averaged BN_DFE stats
        personal = payload.get("personal") or {}
        load_tensors(model, personal.get("dse", {}))  # this client's theta_v,k (Eq. 9 row)
        load_tensors(model, state.get("personal", {}))  # its own BN_DSE running stats

    def local_update(self, ctx: ClientContext) -> Upload:
        hp, model = self.hp, ctx.model
        reg = None  # Alg. 1: no L_Con in round 1, when the global statistics are still 0 / 1
        if hp.lam > 0 and not (hp.skip_first_round and ctx.round == 1):
            reg = ConsistencyRegularizer([b.bn_dfe for _, b in dse_blocks(model)], hp.gamma, hp.beta, hp.con_mode)
        handles = reg.attach() if reg is not None else []
        opt = ctx.optimizer()
        try:
            for x, y in ctx.batches():
                if len(y) < 2:  # BN needs two samples: a final batch of one is skipped (spec 9.25)
                    continue
                loss = F.cross_entropy(model(x), y)
                if reg is not None:
                    loss = loss + hp.lam * reg.loss()  # Eq. 7
                ctx.step(loss, opt)
        finally:
            for h in handles:
                h.remove()
        stats = ctx.stats()
        if reg is not None and reg.steps:
            stats["con_loss"] = reg.total / reg.steps
        return self.upload(ctx, stats)

    # ---- the global model and an unseen client (Sec. 5.4, Alg. 3) ---------------------------
    def eval_payload(self, state, round):
        """Adds the unseen client's theta_v: the uniform mean of the clients' Eq. 9 mixes."""
        mixes = list(state["dse"].values())
        dse = weighted_mean(((m, 1.0) for m in mixes), like=state["dse_init"]) if mixes else state["dse_init"]
        return {"global": state["global"], "dse_mean": dse}

    def global_eval_model(self, model, payload):
        load_tensors(model, payload["global"])  # theta_u and the averaged BN_DFE statistics
        load_tensors(model, payload["dse_mean"])  # mean theta_v
        load_tensors(model, payload.get("personal_mean", {}))  # mean BN_DSE statistics
        return model

    def adapt_to_unseen(self, model, client):
        """Alg. 3: minimise L_Con over the unseen client's unlabeled data, DSE parameters only."""
        hp = self.hp
        if hp.adapt_epochs == 0:
            return False
        blocks = [b for _, b in dse_blocks(model)]
        dse_params = [p for b in blocks for p in (*b.bn_dse.parameters(), *b.cheap.parameters())]
        model.eval()  # line 1: BN_DFE keeps (and normalises with) the global statistics
        for b in blocks:
            b.bn_dse.train()  # BN_DSE statistics re-estimated on the target (spec 9.26)
        model.requires_grad_(False)
        for p in dse_params:
            p.requires_grad_(True)  # line 1: every other trainable parameter frozen
        reg = ConsistencyRegularizer([b.bn_dfe for b in blocks], hp.gamma, hp.beta, hp.con_mode)
        handles = reg.attach(in_eval_mode=True)
        opt = client.optimizer(dse_params, lr=hp.adapt_lr or client.lr)  # plain SGD
        try:
            for _ in range(hp.adapt_epochs):  # lines 2-9
                for x in client.unlabeled_batches(hp.adapt_batch):
                    model(x)
                    client.step(reg.loss(), opt)
        finally:
            for h in handles:
                h.remove()
            model.requires_grad_(True)
            model.eval()
        return True
