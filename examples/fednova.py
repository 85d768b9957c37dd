"""FedNova — Wang, Liu, Liang, Joshi, Poor, "Tackling the Objective Inconsistency Problem in
Heterogeneous Federated Optimization", NeurIPS 2020: a method in a file of its own, run by raysim
without being part of it:

    raysim run configs/quickstart.yaml method=fednova:FedNova     # from the folder holding this file
    raysim tune fednova_tune.yaml

Clients that take different numbers of local steps tau_i (more data, more epochs, a step cap)
pull FedAvg's average towards the clients that moved most: it converges to a stationary point of
a surrogate objective weighted by p_i tau_i instead of p_i. FedNova averages each client's update
*normalised* by how much its local steps added up, then rescales the average:

    client i, round t:  y_i = tau_i steps of local SGD from x^t (momentum rho, buffer starting at 0)
                        ||a_i||_1 = tau_i                                        rho = 0
                                  = (tau_i - rho (1 - rho^tau_i) / (1 - rho)) / (1 - rho)   rho > 0
                        (the total weight the tau_i gradients carry in x^t - y_i)
                        d_i = (x^t - y_i) / ||a_i||_1                       normalised update
    server:             x^{t+1} = x^t - tau_eff * sum_i p_i d_i,   tau_eff = sum_i p_i ||a_i||_1

p_i = n_i / sum_j n_j over the round's clients (train.weighting: uniform gives 1/m). With plain
SGD (train.momentum 0) that is x^{t+1} = x^t - (sum_i p_i tau_i) * sum_i p_i (x^t - y_i) / tau_i;
with equal tau_i it is FedAvg's mean. The normalisation covers the trainable parameters; buffers
(BN running statistics, batch counters) take FedAvg's weighted mean, as no gradient moves them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from raysim.core.contract import ClientContext, Method, Upload, client_weight
from raysim.core.hparams import Hparams

STEP = "fednova.d/"  # prefix of the normalised update d_i among the uploaded tensors
A_NORM = "fednova.a_norm"  # ||a_i||_1, uploaded as a tensor so the weighted mean gives tau_eff


@dataclass(frozen=True)
class FedNovaHparams(Hparams):
    pass  # none of its own: lr, epochs, momentum are the experiment's (train.*)


class FedNova(Method):
    name = "fednova"  # keys hp.fednova / per_method.fednova and names the run folder
    Hparams = FedNovaHparams
    paper = "Wang et al., NeurIPS 2020"
    shares = "shares the model's normalised update (x - y_i) / ||a_i||_1 and ||a_i||_1; keeps nothing"

    def local_update(self, ctx: ClientContext) -> Upload:
        model = ctx.model
        x = {k: p.detach().clone() for k, p in model.named_parameters()}  # x^t, as received
        opt = ctx.optimizer()  # SGD at the round's lr and train.momentum, a fresh buffer
        for xb, yb in ctx.batches():
            ctx.step(F.cross_entropy(model(xb), yb), opt)
        stats = ctx.stats()
        a_norm = local_steps_norm(stats["steps"], ctx.train.momentum)
        y = {k: v.detach() for k, v in model.state_dict().items()}
        tensors = {k: v for k, v in y.items() if k not in x}  # buffers: the plain weighted mean
        tensors.update({STEP + k: normalised_update(x[k], y[k], a_norm) for k in x})
        tensors[A_NORM] = torch.tensor(a_norm, dtype=torch.float64, device=ctx.device)
        return Upload(tensors=tensors, weight=client_weight(ctx), metrics=stats)

    def aggregate(self, state: dict, uploads, round: int) -> dict:
        mean = uploads.mean  # sum_i p_i t_i for every uploaded tensor t
        tau_eff = float(mean[A_NORM])  # sum_i p_i ||a_i||_1
        new = {}
        for k, v in state["global"].items():
            if STEP + k in mean:  # x^{t+1} = x^t - tau_eff * sum_i p_i d_i
                new[k] = (v.double() - tau_eff * mean[STEP + k].double()).to(v.dtype)
            else:
                new[k] = mean[k]
        return {**state, "global": new}


def local_steps_norm(steps: int, momentum: float) -> float:
    """||a_i||_1 of ``steps`` local SGD steps with heavy-ball ``momentum`` rho (dampening 0, the
    buffer starting at 0): gradient j weighs (1 - rho^(tau - j)) / (1 - rho) in x^t - y_i; summed,
    (tau - rho (1 - rho^tau) / (1 - rho)) / (1 - rho); tau for plain SGD."""
    tau, rho = float(steps), float(momentum)
    if rho == 0.0:
        return tau
    return (tau - rho * (1.0 - rho ** tau) / (1.0 - rho)) / (1.0 - rho)


def normalised_update(x: torch.Tensor, y: torch.Tensor, a_norm: float) -> torch.Tensor:
    """d_i = (x^t - y_i) / ||a_i||_1; zero for a client that took no step."""
    return (x - y) / a_norm if a_norm > 0 else torch.zeros_like(x)
