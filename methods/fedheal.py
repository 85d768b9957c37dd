"""FedHEAL — Chen, Huang, Ye, "Fair Federated Learning under Domain Skew with Local Consistency and
Domain Diversity", CVPR 2024 (Federated Parameter-Harmonized and Aggregation-Equalized Learning).

Clients train with plain CE; FedHEAL is the server step. Per client k the server keeps a sign
history H_k (model-shaped, in [0, 1]) with its observation count n_k, a weight P_k and its momentum
dP_k. For each client k of the round, on every floating-point entry (BN statistics included):
    u_k = theta_k - theta^{t-1}
    first participation:  m_k = 1,  H_k = 1[u_k >= 0]
    otherwise:            cons = H_k where u_k >= 0, else 1 - H_k;   m_k = 1[cons > tau]
                          H_k <- (n_k H_k + 1[u_k >= 0]) / (n_k + 1)           (harmonization)
    u~_k = m_k * u_k;     d_k = sum over parameter tensors of ||u~_k||_2
    dP_k <- (1 - beta) dP_k + beta d_k / sum_j d_j;   P_k <- P_k + dP_k   (P_k = 1/|S|, dP_k = 0 at first)
    w_k = P_k / sum_j P_j                                                        (equalization)
    theta^t = theta^{t-1} + sum_k omega_k * u~_k,   omega_k = w_k m_k / sum_j w_j m_j  (element-wise)
An element no client keeps does not move. Integer buffers take the plain mean. The history is
model-sized per client on the server: a cross-silo method.

Where the defaults come from (``raysim methods fedheal``): tau = 0.3 and beta = 0.4 are the official
code's defaults (yuhangchen0/FedHEAL ``--threshold 0.3 --beta 0.4``). FDSE's configs set its own
tau (Office 0.2, PACS 0.1, from the FDSE repo). The history's denominator is the client's own
participation count; the official code uses the round index, which is the same under full
participation (its setting), so there is no switch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from raysim.core.aggregation import KeepAll, weighted_mean
from raysim.core.contract import Method
from raysim.core.hparams import Hparams, Space
from raysim.core.settings import setting


@dataclass(frozen=True)
class FedHEALHparams(Hparams):
    tau: float = setting(0.3, ge=0, le=1, source="official code default (yuhangchen0/FedHEAL --threshold 0.3)", doc="consistency threshold; the middle of FDSE's grid")
    beta: float = setting(0.4, ge=0, le=1, source="official code default (yuhangchen0/FedHEAL --beta 0.4)", doc="momentum of the weight updates")

    @classmethod
    def search_space(cls):
        return {"tau": Space.choice(0.1, 0.2, 0.3, 0.4, 0.5)}  # FDSE A7.4


def harmonize(u: torch.Tensor, history: dict | None, tau: float) -> tuple[torch.Tensor, dict]:
    """(m_k, the updated history {"H", "n"}) for one tensor's update u."""
    up = (u >= 0).to(torch.float64)
    if history is None:
        return torch.ones_like(up), {"H": up, "n": 1}
    H, n = history["H"], history["n"]
    cons = torch.where(u >= 0, H, 1.0 - H)
    return (cons > tau).to(torch.float64), {"H": (H * n + up) / (n + 1), "n": n + 1}


def equalize(P: dict, dP: dict, d: dict, beta: float) -> tuple[dict, dict, dict]:
    """(w_k normalised, P, dP) from this round's distances d_k."""
    total = sum(d.values())
    dP = {k: (1 - beta) * dP[k] + beta * (d[k] / total if total > 0 else 0.0) for k in d}
    P = {k: P[k] + dP[k] for k in d}
    norm = sum(P.values())
    return {k: P[k] / norm for k in d}, P, dP


class FedHEAL(Method):
    name = "fedheal"
    Hparams = FedHEALHparams
    aggregator = KeepAll()  # element-wise masks: every upload
    paper = "Chen, Huang, Ye, CVPR 2024"
    shares = 'shares the whole model; server masks and reweights updates (fairness)'

    def init_server(self, model):
        params = sorted(k for k, p in model.named_parameters() if p.requires_grad)
        return {**super().init_server(model), "params": params, "clients": {}}

    def aggregate(self, state, uploads, round):
        prev, hp = state["global"], self.hp
        params = set(state["params"])
        floats = [k for k, v in prev.items() if v.is_floating_point()]
        memory = {k: dict(v) for k, v in state["clients"].items()}
        masked, masks, dist = {}, {}, {}
        for c, up in uploads.each.items():
            mem = memory.get(c, {"H": {}, "P": 1.0 / len(uploads.each), "dP": 0.0})
            masked[c], masks[c], hist = {}, {}, {}
            for k in floats:
                u = up.tensors[k].double() - prev[k].double()
                m, hist[k] = harmonize(u, {"H": mem["H"][k], "n": mem["n"]} if k in mem["H"] else None, hp.tau)
                masks[c][k], masked[c][k] = m, m * u
            dist[c] = sum(float(masked[c][k].norm()) for k in floats if k in params)
            memory[c] = {"H": {k: h["H"] for k, h in hist.items()}, "n": hist[floats[0]]["n"] if floats else 1,
                         "P": mem["P"], "dP": mem["dP"]}
        w, P, dP = equalize({c: memory[c]["P"] for c in dist}, {c: memory[c]["dP"] for c in dist}, dist, hp.beta)
        new_global = weighted_mean(((up.tensors, up.weight) for up in uploads.each.values()), like=prev)
        for k in floats:  # element-wise: omega_k = w_k m_k / sum_j w_j m_j
            weight_sum = sum(w[c] * masks[c][k] for c in dist)
            step = sum(w[c] * masked[c][k] for c in dist) / weight_sum.clamp_min(1e-300)
            new_global[k] = (prev[k].double() + torch.where(weight_sum > 0, step, torch.zeros_like(step))).to(prev[k].dtype)
        for c in dist:
            memory[c]["P"], memory[c]["dP"] = P[c], dP[c]
        return {**state, "global": new_global, "clients": memory}
