"""Channel sub-models of a dense network (FedDrop, FedMP, NeFL): which channels go together, and
a sub-model's tensors.

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
  simply absent).

Supported: sequential CNNs (small_cnn, cnn6, mnist_cnn: conv / norm / pool / flatten / Linear)
and ResNets of BasicBlocks (resnet10, resnet18); any other module holding parameters is refused.
With BatchNorm (every DapperFL config) the masked model is exactly the smaller network; with
GroupNorm / LayerNorm a held-at-0 channel still enters its group's statistics, so it is close to,
not equal to, the extracted sub-network.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from raysim.core.errors import UserError
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
