"""FedDrop (Federated Dropout) — Caldas, Konečný, McMahan, Talwalkar, "Expanding the Reach of
Federated Learning by Reducing Client Resource Requirements", arXiv:1812.07210, 2018.

Federated Dropout shrinks what a client receives, trains and sends: the server drops a fixed
fraction of the activations of every layer (whole filters of a conv layer, units of a fully
connected layer), sends the smaller sub-model, the client trains it, and the server maps the
update back into the global model. DapperFL (NeurIPS 2024, Tables 1-2) runs it as a system-
heterogeneity baseline with **one uniform ratio for every client** (its code: rho = 0.6).

Round t (every client k of the round):
    for every channel group g of size C_g (a layer's filters / units, with every layer reading them):
        K_g^k = a uniformly random subset of C_g - round(rho * C_g) channels     (dropout_plan)
    w_k = the sub-model W^{t-1}[K^k], trained E epochs of SGD on D_k (dropped entries held at 0)
    upload w_k and K^k
Server ("maps the updates back"):
    aggregation = "all" (default): w_k recovered to full shape with W^{t-1} where K^k drops
        (a zero update there), then W^t = sum_k n_k w_k / sum_k n_k                (recover)
    aggregation = "holders": every entry averaged over the clients that held it     (holder_mean)

Choices the paper leaves open, and which this file takes:
  * Who draws the masks. ``mask_scope = "client"`` (default): a new random sub-model per client and
    round, from the client's generator (keyed by seed, round, client), as "clients train randomly
    selected subsets" is usually read (Cheng et al. 2022). ``"round"``: one sub-model per round for
    every client (keyed by seed and round; the reading of Verardo et al. 2022, who extend FD to
    per-client sub-models). Both draw from keyed generators only (never the global RNG); the
    server never needs the draw because the client uploads K^k.
  * How updates are mapped back: the paper maps each update into the global model and averages as
    FedAvg does, so a dropped entry contributes a zero update ("all"); "holders" averages each
    entry over its holders only (HeteroFL-style). With ``mask_scope = "round"`` both coincide.
  * Which layers: every hidden channel group, the stem's filters included (the paper drops from
    "each layer"); never the input channels or the classes. Residual streams are one group.
  * Conv output filters dropped with their norm layer (scale, shift, running statistics): the
    sub-model really lacks those channels; a dropped norm entry comes back like any other.
  * No rescaling of the thinned layers' outputs (the paper describes none); ``rescale = True``
    multiplies each layer reading a thinned group by C / kept in training (inverted dropout,
    HeteroFL's scaler). On configs/quickstart.yaml (small_cnn, rho 0.6, 4 rounds) it did not help:
    final AVG 14.6 ("all") / 24.8 ("holders") without, 10.2 / 10.2 with (FedAvg: 38.9 at round 3;
    FedDrop at rho = 0: 40.6).
  * Every client gets the same ratio (DapperFL's comparison); ``rho_levels`` instead gives the
    ratio of the client's capability tier (clients.profiles tier, else k mod L).
  * The paper's lossy compression of the down- and uplink (Kashin / Hadamard, quantisation) is a
    separate technique and is not applied. The engine broadcasts the dense global model, so
    bytes_down counts it; bytes_up and the footprint (client_footprint) are the sub-model's.

Where the defaults come from (``raysim methods feddrop``): Caldas et al. sweep the kept fraction
({0.5, ..., 0.875, 1}), so no value of theirs is "the" default; rho = 0.6 for every client is how
DapperFL ran FedDrop (its code's best_args), the only seed that compares it. The other defaults are
the paper's description where it gives one (updates mapped back and averaged as in FedAvg, no
rescaling) and ours where it is silent (who draws the masks), as listed above.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from raysim.core.errors import UserError
from raysim.core.hparams import Hparams, Space
from raysim.methods.lib.masks import num_kept
from raysim.methods.lib.submodels import SubModelMethod, holder_mean
from raysim.core.seeding import SERVER, generator_for
from raysim.core.settings import setting


@dataclass(frozen=True)
class FedDropHparams(Hparams):
    rho: float = setting(0.6, ge=0, lt=1, source="DapperFL's code best_args (uniform 0.6); the paper sweeps it", doc="fraction of every layer's filters / units dropped")
    rho_levels: tuple[float, ...] | None = setting(None, ge=0, lt=1, source="paper and DapperFL: one ratio for every client", doc="one ratio per capability tier instead of rho (None: rho for everyone, DapperFL's comparison)")
    mask_scope: str = setting("client", one_of=("client", "round"), source="ours: the paper is silent (the usual per-client reading)", doc="a sub-model per client and round | per round")
    aggregation: str = setting("all", one_of=("all", "holders"), source="paper: updates mapped back, averaged as in FedAvg", doc="zero update where dropped | holders' mean")
    rescale: bool = setting(False, source="paper: describes no rescaling", doc="train with each layer's output x C / kept of its input (inverted dropout)")

    def __post_init__(self):
        if self.rho_levels is not None and not self.rho_levels:
            raise UserError("hyperparameter 'hp.feddrop.rho_levels' = (): expected null or a non-empty list of ratios")

    @classmethod
    def search_space(cls):
        # Caldas et al. sweep the fraction kept in {0.5, 0.625, 0.75, 0.875, 1}; DapperFL fixes 0.6 dropped
        return {"rho": Space.choice(0.125, 0.25, 0.375, 0.5, 0.6)}


def dropout_plan(sizes: list[int], rho: float, generator: torch.Generator, skip=()) -> dict[int, torch.Tensor]:
    """Federated Dropout's masks: for every group g (not in ``skip``), a uniformly random set of
    size - round(rho * size) kept channels, ascending; drawn group by group from ``generator``."""
    plan = {}
    for g, size in enumerate(sizes):
        perm = torch.randperm(size, generator=generator)  # always drawn: the stream does not depend on skip
        if g in skip:
            continue
        plan[g] = perm[:num_kept(size, rho)].sort().values
    return plan


class FedDrop(SubModelMethod):
    name = "feddrop"
    Hparams = FedDropHparams
    paper = "Caldas et al., arXiv:1812.07210, 2018"
    shares = 'shares dropped-out sub-models (one uniform ratio); server maps them back'

    def client_rho(self, client_id: int) -> float:
        levels = self.hp.rho_levels
        if levels is None:
            return self.hp.rho
        return levels[self.tiers(client_id)]

    def client_metrics(self, client_id: int) -> dict:
        return {"rho": self.client_rho(client_id)}

    def kept_counts(self, client_id: int) -> dict[int, int]:
        rho = self.client_rho(client_id)
        return {g: num_kept(grp.size, rho) for g, grp in enumerate(self.ref.groups)}

    def plan(self, ctx, groups):
        gen = ctx.generator if self.hp.mask_scope == "client" else \
            generator_for(self.setup.seed, ctx.round, SERVER, "feddrop-mask")
        return dropout_plan([g.size for g in groups], self.client_rho(ctx.client_id), gen)

    def aggregate(self, state, uploads, round):
        if self.hp.aggregation == "all":
            return super().aggregate(state, uploads, round)
        prev = state["global"]
        items = ((up.tensors, self.upload_slices(up), up.weight) for up in uploads.each.values())
        return {**state, "global": holder_mean(items, prev)}
