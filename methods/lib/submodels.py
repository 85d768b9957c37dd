"""What the channel sub-model methods (FedDrop, FedMP, NeFL) share beyond the channels
(:mod:`.channels`): the server's residual recovery and holders' mean, a sub-model's footprint,
and the client step (:class:`SubModelMethod`).
"""
from __future__ import annotations

from functools import cached_property

import torch
import torch.nn.functional as F

from raysim.core.aggregation import KeepAll, weighted_mean
from raysim.core.contract import ClientContext, Method, Upload, client_weight
from raysim.core.tiers import ClientTiers
from raysim.methods.lib.channels import (Group, channel_groups, embed, extract, holds, key_dims, rescale_inputs,
                                         slices, train_masks)
from raysim.methods.lib.masks import apply_masks
from raysim.models.flops import count_flops, count_params


# ----------------------------------------------------------------------------- aggregation

def recover(compact: dict, sl: dict, prev: dict) -> dict:
    """Residual recovery: the full-shape model whose entries the sub-model lacks are the previous
    global model's (a zero update there). Keys missing from ``compact`` come from ``prev``."""
    out = {}
    for k, base in prev.items():
        if k not in compact:
            out[k] = base.clone()
            continue
        i0, i1 = sl.get(k, (None, None))
        out[k] = embed(compact[k].to(base.device), i0, i1, base)
    return out


def holder_mean(items, prev: dict, keys=None) -> dict:
    """Element-wise weighted mean over the clients whose sub-model holds each entry:
    W[e] = sum_{k holds e} w_k x_k[e] / sum_{k holds e} w_k; an entry no client holds keeps
    ``prev``. ``items``: (compact tensors, slices, weight); ``keys``: the keys to average
    (default all of ``prev``); a client lacking a key does not hold it. Float64, then the
    tensor's own dtype (integers rounded)."""
    keys = list(prev) if keys is None else list(keys)
    sums = {k: torch.zeros(prev[k].shape, dtype=torch.float64) for k in keys}
    den = {k: torch.zeros(prev[k].shape, dtype=torch.float64) for k in keys}
    for compact, sl, w in items:
        for k in keys:
            if k not in compact:
                continue
            i0, i1 = sl.get(k, (None, None))
            zero = torch.zeros(prev[k].shape, dtype=torch.float64)
            sums[k] += embed(compact[k].detach().cpu().double() * float(w), i0, i1, zero)
            den[k] += embed(torch.full(compact[k].shape, float(w), dtype=torch.float64), i0, i1, zero)
    out = {}
    for k in keys:
        p = prev[k]
        mean = torch.where(den[k] > 0, sums[k] / den[k].clamp_min(1e-300), p.detach().cpu().double())
        out[k] = mean.to(p.dtype) if p.dtype.is_floating_point else mean.round().to(p.dtype)
    return out


# ----------------------------------------------------------------------------- footprint

class Footprints:
    """Exact parameters and forward MACs per sample of a method's sub-models, in
    :func:`raysim.models.count_flops`'s convention (conv + Linear), measured on one reference
    model built once per process: the sub-model's entries set to 1, the others to 0, counted with
    ``nonzero_only`` (so a MAC or parameter counts iff the sub-model holds its weight)."""

    def __init__(self, method):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.model = method.build_model().requires_grad_(False)  # its weights become 0/1 masks
        self.groups = channel_groups(self.model)
        self.dims = key_dims(self.model, self.groups)
        self.input_shape = tuple(method.setup.image_shape)
        self._cache: dict = {}

    def of(self, kept: dict[int, int]) -> dict:
        """{"params", "macs"} of the sub-model keeping ``kept[g]`` channels of group g (others whole);
        the counts depend only on how many channels each group keeps."""
        key = tuple(sorted(kept.items()))
        if key not in self._cache:
            sl = slices(self.dims, {g: torch.arange(n) for g, n in kept.items()})
            with torch.no_grad():
                for k, p in self.model.named_parameters():
                    p.copy_(holds(p.shape, *sl.get(k, (None, None))))
            self._cache[key] = {"params": float(count_params(self.model, nonzero_only=True)),
                                "macs": float(count_flops(self.model, self.input_shape, nonzero_only=True))}
        return self._cache[key]


# ----------------------------------------------------------------------------- the shared client step

class SubModelMethod(Method):
    """A method whose client trains a channel sub-model of the global model and uploads it.

    Client: plan <- ``self.plan(ctx, groups)`` (the method's rule); train the sub-model (E epochs of
    SGD on the cross-entropy, dropped entries held at 0); upload the sub-model's tensors, physically
    sliced, and its plan (kept channel indices per group) in ``extras["plan"]``. Server: the
    method's ``aggregate`` over every upload (KeepAll); by default residual recovery then the
    n_k-weighted mean (:func:`recover`)."""
    aggregator = KeepAll()

    # ---- structure (one reference model per process: the same on the server and every host) ----
    @cached_property
    def ref(self) -> Footprints:
        return Footprints(self)

    @cached_property
    def tiers(self) -> ClientTiers:
        """Each client's capability tier: its profile's, else k mod L over ``hp.rho_levels``."""
        return ClientTiers(self.setup, len(self.hp.rho_levels), method=self.name)

    def plan(self, ctx: ClientContext, groups: list[Group]) -> dict:
        raise NotImplementedError

    def kept_counts(self, client_id: int) -> dict[int, int]:
        """Channels the client's sub-model keeps per group (for its footprint)."""
        raise NotImplementedError

    def client_footprint(self, client_id: int, dense: dict) -> dict:
        return self.ref.of(self.kept_counts(client_id))

    # ---- client ------------------------------------------------------------------------------
    def local_update(self, ctx: ClientContext) -> Upload:
        model, ref = ctx.model, self.ref
        plan = self.plan(ctx, ref.groups)
        sl = slices(ref.dims, plan)
        masks = train_masks(model, sl)
        apply_masks(model, masks)
        hooks = rescale_inputs(model, ref.groups, plan) if getattr(self.hp, "rescale", False) else []
        try:
            opt = ctx.optimizer()
            for x, y in ctx.batches():
                ctx.step(F.cross_entropy(model(x), y), opt)
                apply_masks(model, masks)
        finally:
            for h in hooks:
                h.remove()
        stats = ctx.stats()
        sent = extract({k: v.detach() for k, v in model.state_dict().items()}, sl)
        foot = ref.of({g: len(i) for g, i in plan.items()})
        metrics = {**stats, **self.client_metrics(ctx.client_id), "sub_params": foot["params"],
                   "sub_macs": foot["macs"]}
        return Upload(tensors=sent, weight=client_weight(ctx),
                      extras={"plan": {str(g): i.cpu() for g, i in plan.items()}}, metrics=metrics)

    def client_metrics(self, client_id: int) -> dict:
        return {}

    def upload_slices(self, upload) -> dict:
        """The slices of an upload's plan (server side)."""
        plan = {int(g): i for g, i in upload.extras.get("plan", {}).items()}
        return slices(self.ref.dims, plan)

    # ---- server ------------------------------------------------------------------------------
    def aggregate(self, state: dict, uploads, round: int) -> dict:
        prev = state["global"]
        recovered = ((recover(up.tensors, self.upload_slices(up), prev), up.weight) for up in uploads.each.values())
        return {**state, "global": weighted_mean(recovered, like=prev)}
