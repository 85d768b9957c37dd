"""DapperFL's masks (Alg. 1 line 3): which channels of which layer a client at pruning ratio rho
zeroes. ``filters`` (the paper: rho of each layer's output filters, by L1 norm) or ``official``
(the published code: input channels, then output filters)."""
from __future__ import annotations

import torch
from torch import nn

from raysim.methods.lib.masks import num_pruned, top_mask


def layer_roles(model: nn.Module, scheme: str = "filters") -> dict[str, str]:
    """Which layers are pruned and how: {module name: role}.

    Roles: "stem" (never pruned), "out" (output filters), "in_out" (input channels, then output
    filters), "norm" (norm weight, unstructured), "linear" (input columns).
    """
    roles: dict[str, str] = {}
    convs = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Conv2d)]
    shortcuts = [n for n, _ in convs if "shortcut" in n.split(".") or "downsample" in n.split(".")]
    first_shortcut = shortcuts[0] if shortcuts else None
    for i, (name, _) in enumerate(convs):
        if i == 0:
            roles[name] = "stem"
        elif scheme == "filters" or i == 1 or name == first_shortcut:
            roles[name] = "out"
        else:
            roles[name] = "in_out"
    from raysim.models.norm import is_norm
    norms = [n for n, m in model.named_modules() if is_norm(m) and getattr(m, "weight", None) is not None]
    for i, name in enumerate(norms):
        roles[name] = "stem" if i == 0 else "norm"
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            roles[name] = "linear"
    return roles


@torch.no_grad()
def prune_masks(model: nn.Module, rho: float, scheme: str = "filters") -> dict[str, torch.Tensor]:
    """{state-dict key of a weight: boolean mask of its shape} at pruning ratio ``rho``.

    Every prunable weight gets a mask (all True at rho = 0); a key that is absent is never pruned.
    """
    masks: dict[str, torch.Tensor] = {}
    modules = dict(model.named_modules())
    for name, role in layer_roles(model, scheme).items():
        if role == "stem":
            continue
        w = modules[name].weight.detach()
        key = f"{name}.weight" if name else "weight"
        if role in ("out", "in_out"):  # conv weight (C_out, C_in, kh, kw)
            c_out, c_in = w.shape[0], w.shape[1]
            m_in = torch.ones(c_in, dtype=torch.bool, device=w.device)
            if role == "in_out":
                m_in = top_mask(w.abs().sum(dim=(0, 2, 3)), c_in - num_pruned(c_in, rho))
            scored = w.abs() * m_in.view(1, -1, 1, 1)
            m_out = top_mask(scored.sum(dim=(1, 2, 3)), c_out - num_pruned(c_out, rho))
            masks[key] = (m_out.view(-1, 1, 1, 1) & m_in.view(1, -1, 1, 1)).expand_as(w).clone()
        elif role == "norm":  # gamma: smallest |gamma_c| zeroed
            masks[key] = top_mask(w.abs(), w.numel() - num_pruned(w.numel(), rho)).view_as(w)
        elif role == "linear":  # (out, in): input columns by L2 norm
            cols = top_mask(w.norm(p=2, dim=0), w.shape[1] - num_pruned(w.shape[1], rho))
            masks[key] = cols.view(1, -1).expand_as(w).clone()
    return masks
