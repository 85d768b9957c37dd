"""NeFL — Kang, Cha, Shin, Lee, Kang, "NeFL: Nested Federated Learning for Heterogeneous Clients"
(later "Nested Model Scaling for Federated Learning with System Heterogeneous Clients"),
arXiv:2308.07761, 2023.

NeFL splits one global model into L nested sub-models, sub-model 1 inside sub-model 2 inside ...
inside the full model, and gives each client the one its device can train. Scaling is by width
(the first channels of every layer), by depth (residual blocks skipped), or both; a ResNet is read
as an ODE solver, x_{l+1} = x_l + s_l F_l(x_l), with learnable step sizes s_l. Parameters are
decoupled into *consistent* ones (the conv and FC weights and biases, shared by every sub-model
that contains them) and *inconsistent* ones (the norm layers and the step sizes: one copy per
sub-model). DapperFL (NeurIPS 2024, Tables 1-2) runs width scaling ("W") with 5 sub-models of
parameter ratios [0.04, 0.16, 0.36, 0.64, 1], i.e. widths gamma = 1 - rho for rho in
{0.8, 0.6, 0.4, 0.2, 0}, and learnable steps.

Round t:
    client k with sub-model i = tier_k (width gamma_i = 1 - rho_levels[i]):
        receives the consistent parameters cut to width gamma_i (first ceil(gamma_i C) channels of
        every channel group, nested_plan) and sub-model i's inconsistent set (norm layers, steps)
        E epochs of SGD on D_k; upload its consistent and inconsistent parameters
    server:
        consistent  (NeFedAvg): every entry = the n_k-weighted mean over the clients whose
                    sub-model contains it; an entry no client held keeps its value (nefedavg)
        inconsistent: for each sub-model i, the n_k-weighted mean over the clients of sub-model i
                    only (FedAvg within the group); a sub-model no client trained keeps its set
Scored: the widest sub-model (the full model with its own norm layers and steps).

Choices the paper leaves open or this file fixes (baselines spec section 6.2 [R]):
  * Widths from DapperFL's tiers, gamma_i = 1 - rho_levels[i] (its ps = gamma^2); the tier is the
    client's profile tier (clients.profiles), else k mod L. Kept channels: ceil(gamma C), the first
    ones; every channel group is scaled (the stem's too), never the input channels or classes.
  * Steps s_l: a scalar per residual block and per sub-model, initialised at 1, multiplying the
    residual branch (after its last norm layer); ``learnable_step = False`` trains plain blocks.
    A model without residual blocks (small_cnn, cnn6) has no steps.
  * No HeteroFL-style 1/gamma output rescaling of narrow sub-models (the spec's default).
  * Depth scaling is not implemented: DapperFL's comparison ran width only, and resnet10 has a
    single block per stage, so no block can be skipped.
  * Only the widest sub-model is evaluated (other sub-models are not logged).
  * The engine broadcasts the dense consistent model and every sub-model's inconsistent set
    (bytes_down counts them); bytes_up and the footprint (client_footprint) are the sub-model's.

Where the defaults come from (``raysim methods nefl``): NeFL's code was not available, so the
defaults are its configuration in DapperFL's code, the only seed that compares it (best_args: ps =
[0.04, 0.16, 0.36, 0.64, 1], i.e. widths 1 - rho for rho in {0.8, ..., 0}; ``learnable_step=1``);
learnable step sizes are also the paper's design (spec 6.2).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from raysim.core.aggregation import weighted_mean
from raysim.core.errors import UserError
from raysim.core.hparams import Hparams
from raysim.methods.lib.channels import extract, is_block, slices, train_masks
from raysim.methods.lib.masks import apply_masks
from raysim.methods.lib.submodels import SubModelMethod, holder_mean, recover
from raysim.models.norm import is_norm
from raysim.core.settings import setting
from raysim.core.tensors import load_tensors
from raysim.core.tensors import cpu_copy

PAPER_LEVELS = (0.0, 0.2, 0.4, 0.6, 0.8)  # DapperFL's tiers: widths 1, 0.8, 0.6, 0.4, 0.2


@dataclass(frozen=True)
class NeFLHparams(Hparams):
    rho_levels: tuple[float, ...] = setting(PAPER_LEVELS, ge=0, lt=1, source="DapperFL's code best_args (ps = (1 - rho)^2)", doc="sub-model i has width 1 - rho_levels[i]")
    learnable_step: bool = setting(True, source="paper (learnable step sizes); DapperFL's code learnable_step=1", doc="x + s_l F_l(x) with s_l learned per sub-model")

    def __post_init__(self):
        if not self.rho_levels:
            raise UserError("hyperparameter 'hp.nefl.rho_levels' = (): expected a non-empty list of ratios in [0, 1)")

    @classmethod
    def search_space(cls):
        return {}  # the widths are device constraints; NeFL adds no tuned knob


# ----------------------------------------------------------------------------- the equations

def nested_plan(sizes: list[int], width: float) -> dict[int, torch.Tensor]:
    """Width scaling: the first ceil(width * C_g) channels of every group (nested by construction)."""
    return {g: torch.arange(max(1, math.ceil(width * c - 1e-9))) for g, c in enumerate(sizes)}


def nefedavg(items, prev: dict, consistent) -> dict:
    """Consistent parameters: each entry averaged (weights n_k) over the clients holding it."""
    return holder_mean(items, prev, keys=consistent)


def group_mean(items, prev_set: dict) -> dict:
    """Inconsistent parameters of one sub-model: FedAvg over that sub-model's clients only
    (``items``: (tensors, n_k)); no client: the set is kept."""
    items = list(items)
    if not items:
        return prev_set
    return weighted_mean(((t, w) for t, w in items), like=prev_set)


def inconsistent_keys(model: nn.Module) -> list[str]:
    """Every state entry of a norm layer (affine, running statistics, the step s_l it carries)."""
    keys = []
    for name, m in model.named_modules():
        if is_norm(m):
            keys += [f"{name}.{k}" for k, _ in m.named_parameters(recurse=False)]
            keys += [f"{name}.{k}" for k, _ in m.named_buffers(recurse=False)]
    return keys


def _scale_by_step(module, inputs, output):
    return output * module.step


def add_steps(model: nn.Module) -> nn.Module:
    """x_{l+1} = relu(x_l' + s_l F_l(x_l)): a learnable scalar s_l (init 1) on every residual block's
    last norm layer, multiplying the branch before the shortcut is added."""
    for m in model.modules():
        if is_block(m):
            m.bn2.register_parameter("step", nn.Parameter(torch.ones(())))
            m.bn2.register_forward_hook(_scale_by_step)
    return model


class NeFL(SubModelMethod):
    name = "nefl"
    Hparams = NeFLHparams
    paper = "Kang et al., arXiv:2308.07761, 2023"
    shares = 'shares nested sub-models (width scaling); per-sub-model norm layers and step sizes'

    def build_model(self) -> nn.Module:
        model = super().build_model()
        return add_steps(model) if self.hp.learnable_step else model

    # ---- who trains which sub-model ------------------------------------------------------------
    def level(self, client_id: int) -> int:
        return self.tiers(client_id)

    def width(self, level: int) -> float:
        return 1.0 - self.hp.rho_levels[level]

    def widest(self) -> int:
        return min(range(len(self.hp.rho_levels)), key=lambda i: (self.hp.rho_levels[i], i))

    def level_plan(self, level: int) -> dict:
        return nested_plan([g.size for g in self.ref.groups], self.width(level))

    def kept_counts(self, client_id: int) -> dict[int, int]:
        return {g: len(i) for g, i in self.level_plan(self.level(client_id)).items()}

    def client_metrics(self, client_id: int) -> dict:
        lv = self.level(client_id)
        return {"tier": lv, "width": self.width(lv)}

    def plan(self, ctx, groups):
        return self.level_plan(self.level(ctx.client_id))

    # ---- server state: the consistent model and one inconsistent set per sub-model ------------
    def init_server(self, model):
        full = cpu_copy(model.state_dict())
        incons = inconsistent_keys(model)
        sets = {}
        for lv in range(len(self.hp.rho_levels)):
            sl = slices(self.ref.dims, self.level_plan(lv))
            sets[str(lv)] = extract({k: full[k] for k in incons}, sl)
        return {"global": full, "inconsistent": sets}

    def broadcast(self, state, round):
        return {"global": state["global"], "inconsistent": state["inconsistent"]}

    def eval_payload(self, state, round):
        return {"global": state["global"]}

    def load_client_model(self, model, payload, state):
        load_tensors(model, payload["global"])
        if "inconsistent" in payload and "level" in state:
            own = payload["inconsistent"][str(state["level"])]
            sl = slices(self.ref.dims, self.level_plan(state["level"]))
            sd = model.state_dict()
            load_tensors(model, recover(own, sl, {k: sd[k] for k in own}))
        else:
            self._mask_widest(model)

    def init_client_state(self, client_id, model):
        return {"personal": {}, "level": self.level(client_id)}

    def eval_model(self, model, payload, state):
        return self.global_eval_model(model, payload)

    def global_eval_model(self, model, payload):
        load_tensors(model, payload["global"])
        self._mask_widest(model)
        return model

    def _mask_widest(self, model):
        """The widest sub-model inside the dense model (nothing to do at width 1)."""
        plan = self.level_plan(self.widest())
        if any(len(i) < g.size for i, g in zip(plan.values(), self.ref.groups)):
            apply_masks(model, train_masks(model, slices(self.ref.dims, plan)))

    def aggregate(self, state, uploads, round):
        prev = state["global"]
        incons = set(next(iter(state["inconsistent"].values())))
        consistent = [k for k in prev if k not in incons]
        items = [(up.tensors, self.upload_slices(up), up.weight) for up in uploads.each.values()]
        new = nefedavg(items, prev, consistent)
        sets = dict(state["inconsistent"])
        for lv, prev_set in state["inconsistent"].items():
            members = [(({k: up.tensors[k] for k in prev_set}), up.weight)
                       for cid, up in uploads.each.items() if str(self.level(cid)) == lv]
            sets[lv] = group_mean(members, prev_set)
        widest = str(self.widest())
        full = recover(sets[widest], slices(self.ref.dims, self.level_plan(self.widest())),
                       {k: prev[k] for k in incons})
        return {**state, "global": {**prev, **new, **full}, "inconsistent": sets}
