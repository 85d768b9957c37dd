"""Channel sub-models of a dense network, shared by FedDrop, FedMP and NeFL.

A *channel group* is a set of channels that must be kept or dropped together for a sub-model to
be a real, smaller network: the output filters of a conv (or the units of a Linear), the norm
layer after it, and the input channels (input columns) of every layer that reads them. In a ResNet
the identity shortcuts tie the residual stream of a stage into one group (the stem's output and
every block's conv2/bn2 of layer1, ...), so a dropped channel is absent from the stream, not just
from one branch. The input image channels and the classes are never groups.

A *plan* is ``{group index: sorted LongTensor of kept channels}``; a group the plan omits is kept
whole. From a plan:

* ``extract(tensors, slices)``: the sub-model's tensors, physically smaller (what is sent);
* ``embed(compact, slices, base)``: back to full shape, ``base`` at the positions the sub-model
  lacks (the server's residual recovery, or zeros);
* ``train_masks``: boolean masks of the full-size parameters, for training the sub-model inside
  the host's one dense model (the dropped entries are held at exactly 0: a dropped channel's conv
  output, norm scale and shift are 0, so it outputs 0 and every reader sees nothing; this equals
  training the extracted sub-network with batch-statistics norms, whose dropped channels are then
  simply absent);
* ``footprint``: exact parameters and forward MACs of the sub-model (what its device trains).

Supported: sequential CNNs (small_cnn, cnn6, mnist_cnn: conv / norm / pool / flatten / Linear)
and ResNets of BasicBlocks (resnet10, resnet18); any other module holding parameters is refused.
With BatchNorm (every DapperFL config) the masked model is exactly the smaller network; with
GroupNorm / LayerNorm a held-at-0 channel still enters its group's statistics, so it is close to,
not equal to, the extracted sub-network.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from raysim.core.aggregation import KeepAll, weighted_mean
from raysim.core.contract import ClientContext, Method, Upload, client_weight
from raysim.core.errors import UserError
from raysim.models.flops import probe
from raysim.models.norm import is_norm


# ----------------------------------------------------------------------------- structure

@dataclass
class Group:
    size: int
    name: str  # the module that produces it (its first producer)
    members: list = field(default_factory=list)  # (module name, role, factor); role: out | in | norm


def is_block(m: nn.Module) -> bool:
    """A residual block (conv1/bn1, conv2/bn2 and a shortcut): its channels are kept or cut together."""
    return all(hasattr(m, a) for a in ("conv1", "bn1", "conv2", "bn2", "shortcut"))


def channel_groups(model: nn.Module) -> list[Group]:
    """The model's channel groups in forward order; group 0 is the stem's output."""
    groups: list[Group] = []
    state = {"current": None, "flat": False}

    def new(size, name):
        groups.append(Group(int(size), name))
        return len(groups) - 1

    def layer(name, m, head=False):
        g, cur = None, state["current"]
        if cur is not None:
            c_in = m.in_channels if isinstance(m, nn.Conv2d) else m.in_features
            factor = c_in // groups[cur].size
            if factor * groups[cur].size != c_in:
                raise UserError(f"sub-models: {name} reads {c_in} inputs from a group of {groups[cur].size} channels")
            groups[cur].members.append((name, "in", factor))
        if not head:
            g = new(m.out_channels if isinstance(m, nn.Conv2d) else m.out_features, name)
            groups[g].members.append((name, "out", 1))
            state["current"] = g

    def walk(mod, prefix):
        for child_name, m in mod.named_children():
            name = f"{prefix}{child_name}"
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                if isinstance(m, nn.Conv2d) and m.groups != 1:
                    raise UserError(f"sub-models: grouped conv {name} is not supported")
                layer(name, m)
            elif is_norm(m):
                if state["current"] is None:
                    raise UserError(f"sub-models: norm {name} before any layer")
                groups[state["current"]].members.append((name, "norm", 1))
            elif is_block(m):
                block(m, name)
            elif isinstance(m, nn.Sequential):
                walk(m, f"{name}.")
            elif any(True for _ in m.parameters(recurse=True)):
                raise UserError(f"sub-models (FedDrop/FedMP/NeFL) do not know the module {name} "
                                f"({type(m).__name__}); supported: sequential CNNs and BasicBlock ResNets")

    def block(m, name):
        x = state["current"]
        layer(f"{name}.conv1", m.conv1)
        groups[state["current"]].members.append((f"{name}.bn1", "norm", 1))
        inner = state["current"]
        convs = [n for n, c in m.shortcut.named_modules() if isinstance(c, nn.Conv2d)]
        if convs:  # projection shortcut: a new residual stream
            out = new(m.conv2.out_channels, f"{name}.conv2")
            for n, c in m.shortcut.named_children():
                full = f"{name}.shortcut.{n}"
                if isinstance(c, nn.Conv2d):
                    groups[x].members.append((full, "in", 1))
                    groups[out].members.append((full, "out", 1))
                elif is_norm(c):
                    groups[out].members.append((full, "norm", 1))
                elif any(True for _ in c.parameters()):
                    raise UserError(f"sub-models: unknown shortcut module {full}")
        else:  # identity: the block writes into its input's stream
            out = x
        groups[inner].members.append((f"{name}.conv2", "in", 1))
        groups[out].members.append((f"{name}.conv2", "out", 1))
        groups[out].members.append((f"{name}.bn2", "norm", 1))
        state["current"] = out

    features = getattr(model, "features", None)
    head = getattr(model, "head", None)
    if features is None or not isinstance(head, nn.Linear):
        raise UserError("sub-models need a raysim zoo model (features + a Linear head)")
    walk(features, "features.")
    layer("head", head, head=True)
    return groups


def key_dims(model: nn.Module, groups: list[Group]) -> dict[str, tuple]:
    """{state-dict key: (group on dim 0 or None, group on dim 1 or None, dim-1 factor)} for every
    key a plan can slice; other keys are never sliced."""
    sd = model.state_dict()
    dims: dict[str, list] = {}
    for g, group in enumerate(groups):
        for name, role, factor in group.members:
            for key, v in sd.items():
                if not key.startswith(name + ".") or "." in key[len(name) + 1:] or v.dim() == 0:
                    continue
                entry = dims.setdefault(key, [None, None, 1])
                if role in ("out", "norm"):
                    entry[0] = g
                elif role == "in" and v.dim() >= 2:
                    entry[1], entry[2] = g, factor
    return {k: tuple(v) for k, v in dims.items()}


# ----------------------------------------------------------------------------- plans

def num_kept(size: int, rho: float) -> int:
    """size - round(rho * size) (halves rounded up, DapperFL's rule), at least 1."""
    pruned = min(size, int(math.floor(rho * size + 0.5 + 1e-9)))
    return max(1, size - pruned)


def _expand(idx: torch.Tensor, factor: int) -> torch.Tensor:
    """Channel c of a flattened (C, H, W) map -> columns c * factor .. c * factor + factor - 1."""
    if factor == 1:
        return idx
    return (idx.view(-1, 1) * factor + torch.arange(factor, device=idx.device).view(1, -1)).flatten()


def slices(dims: dict, plan: dict) -> dict[str, tuple]:
    """{key: (dim-0 index or None, dim-1 index or None)} for every key the plan slices."""
    out = {}
    for key, (g0, g1, factor) in dims.items():
        i0 = plan.get(g0) if g0 is not None else None
        i1 = _expand(plan[g1], factor) if g1 is not None and g1 in plan else None
        if i0 is not None or i1 is not None:
            out[key] = (i0, i1)
    return out


def extract(tensors: dict, sl: dict) -> dict:
    """The sub-model's tensors: W[i0][:, i1] for every sliced key, the rest as they are."""
    out = {}
    for k, v in tensors.items():
        i0, i1 = sl.get(k, (None, None))
        if i0 is not None:
            v = v.index_select(0, i0.to(v.device))
        if i1 is not None:
            v = v.index_select(1, i1.to(v.device))
        out[k] = v
    return out


def embed(compact: torch.Tensor, i0, i1, base: torch.Tensor) -> torch.Tensor:
    """A copy of ``base`` (full shape) with ``compact`` written at rows i0 x columns i1."""
    out = base.clone()
    if i0 is None and i1 is None:
        out.copy_(compact)
    elif i1 is None:
        out[i0] = compact.to(out.dtype)
    elif i0 is None:
        out[:, i1] = compact.to(out.dtype)
    else:
        out[i0.view(-1, 1), i1.view(1, -1)] = compact.to(out.dtype)
    return out


def holds(shape, i0, i1) -> torch.Tensor:
    """Boolean full-shape mask of the entries a sub-model holds."""
    full = torch.zeros(shape, dtype=torch.bool)
    if i0 is None and i1 is None:
        return ~full
    ones = torch.ones((len(i0) if i0 is not None else shape[0],) + ((len(i1),) if i1 is not None else tuple(shape[1:2]))
                      + tuple(shape[2:]), dtype=torch.bool)
    return embed(ones, i0, i1, full)


def train_masks(model: nn.Module, sl: dict) -> dict[str, torch.Tensor]:
    """{parameter key: full-shape boolean mask} for every parameter the sub-model slices."""
    params = dict(model.named_parameters())
    return {k: holds(params[k].shape, *sl[k]).to(params[k].device) for k in sl if k in params}


@torch.no_grad()
def apply_masks(model: nn.Module, masks: dict) -> None:
    """w <- w * M: the entries outside the sub-model held at 0."""
    params = dict(model.named_parameters())
    for k, m in masks.items():
        params[k].mul_(m.to(params[k].dtype))


def _times(factor):
    def hook(module, inputs, output):
        return output * factor
    return hook


def rescale_inputs(model: nn.Module, groups: list[Group], plan: dict) -> list:
    """Training only (``rescale``, off by default): every layer reading a thinned group has its
    output multiplied by C_g / kept_g (HeteroFL's scaler, inverted dropout), so the sums a layer
    sees in training match those of the dense model that is evaluated. Returns the hook handles."""
    modules = dict(model.named_modules())
    handles = []
    for g, idx in plan.items():
        if len(idx) < groups[g].size:
            for name, role, _ in groups[g].members:
                if role == "in":
                    handles.append(modules[name].register_forward_hook(_times(groups[g].size / len(idx))))
    return handles


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


# ----------------------------------------------------------------------------- who gets what

def client_tier(setup, client_id: int, num_levels: int, method: str) -> int:
    """The client's capability tier: its profile's (clients.profiles), else k mod L (DapperFL's
    official rule, raysim.core.tiers.assign_levels round robin with equal shares)."""
    profiles = setup.client_profiles
    # round robin with equal shares deals client k level k mod L (no per-client table to build)
    tier = int(profiles[client_id]["tier"]) if client_id < len(profiles) else client_id % num_levels
    if not 0 <= tier < num_levels:
        raise UserError(f"{method}: client {client_id} has tier {tier} but hp.{method}.rho_levels lists "
                        f"{num_levels} levels (one ratio per clients.profiles level is needed)")
    return tier


# ----------------------------------------------------------------------------- footprint

class Footprints:
    """Exact parameters and forward MACs per sample (conv + Linear, raysim.models.count_flops's
    convention) of a method's sub-models, from one model built once per process."""

    def __init__(self, method):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.model = method.build_model()
        self.groups = channel_groups(self.model)
        self.dims = key_dims(self.model, self.groups)
        self.positions = _positions(self.model, method.setup.image_shape)
        self.shapes = {k: tuple(p.shape) for k, p in self.model.named_parameters()}
        del self.model  # only the structure is kept
        self._cache: dict = {}

    def of(self, kept: dict[int, int]) -> dict:
        """{"params", "macs"} of the sub-model keeping ``kept[g]`` channels of group g (others whole);
        the counts depend only on how many channels each group keeps."""
        key = tuple(sorted(kept.items()))
        if key not in self._cache:
            plan = {g: torch.arange(n) for g, n in kept.items()}
            sl = slices(self.dims, plan)
            sizes = {}
            for k, shape in self.shapes.items():
                i0, i1 = sl.get(k, (None, None))
                s = list(shape)
                if i0 is not None:
                    s[0] = len(i0)
                if i1 is not None:
                    s[1] = len(i1)
                sizes[k] = math.prod(s)
            macs = sum(pos * sizes[f"{name}.weight"] for name, pos in self.positions.items())
            self._cache[key] = {"params": float(sum(sizes.values())), "macs": float(macs)}
        return self._cache[key]


@torch.no_grad()
def _positions(model: nn.Module, image_shape) -> dict[str, int]:
    """Output positions per sample of every conv / Linear (MACs = positions x weight entries)."""
    out, handles = {}, []
    for name, m in model.named_modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            def hook(mod, inp, o, name=name):
                out[name] = o.shape[2:].numel() if isinstance(mod, nn.Conv2d) else o.numel() // o.shape[-1] // o.shape[0]
            handles.append(m.register_forward_hook(hook))
    was = model.training
    model.eval()
    try:
        with probe():
            model(torch.zeros((1,) + tuple(image_shape)))
    finally:
        for h in handles:
            h.remove()
        model.train(was)
    return out


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
    @property
    def ref(self) -> Footprints:
        if getattr(self, "_ref", None) is None:
            self._ref = Footprints(self)
        return self._ref

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
