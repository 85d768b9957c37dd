"""Loading local weight files (ImageNet weights cannot be downloaded inside a simulation).

A file is a state_dict saved with ``torch.save``, in either key layout:

* torchvision's ResNet (``conv1.weight``, ``layer1.0.downsample.1.weight``, ``fc.weight``), as
  ``torchvision.models.resnet18(weights=...).state_dict()`` produces;
* torchvision's DenseNet (``features.norm0``, ``features.denseblock1.denselayer1.norm1``,
  ``features.transition1.norm``, ``features.norm5``, ``classifier``), as
  ``torchvision.models.densenet121(weights=...).state_dict()`` produces, or with the legacy
  ``denselayer1.norm.1`` names of the file torchvision downloads (``densenet121-a639ec97.pth``);
* raysim's (``features.*``, ``head.*``, ``downsample.conv``/``downsample.bn``), as
  ``build(...).state_dict()`` produces.

What may legitimately not fit is skipped, everything else must fit exactly:
the classifier when ``num_classes`` differs; norm-layer entries when the norm was swapped
(GN has no running statistics; a custom norm holding exactly one BatchNorm, such as
gPerXAN's XAN, receives the file's BN entries in that BatchNorm); parameters a swapped conv adds
(WSConv's gain); layers the paper adds on top (CSAC's bottleneck). A missing conv or
linear weight, an unexpected non-norm tensor or a shape mismatch is a UserError: it means
the file belongs to another architecture.
"""
from __future__ import annotations

import os
import re
import warnings

import torch
from torch import nn

from raysim.core.errors import UserError


def _is_norm_key(key: str) -> bool:
    return any("bn" in part for part in key.split(".")[:-1])


# A torchvision DenseNet file: its norm slots are named norm* (raysim's are bn*).
_TV_DENSENET = re.compile(r"^features\.(norm0|norm5|transition\d+\.norm|denseblock\d+\.denselayer\d+\.norm)")


def _densenet_key(key: str) -> str:
    """torchvision DenseNet key -> raysim's :mod:`raysim.models.densenet_tv` key."""
    if key.startswith("classifier."):
        return "head." + key[len("classifier."):]
    # legacy names (the downloadable file): denselayerM.norm.1 -> denselayerM.norm1, conv.2 -> conv2
    key = re.sub(r"(\.denselayer\d+\.(?:norm|conv))\.([12])\.", r"\1\2.", key)
    key = re.sub(r"^features\.norm0\.", "features.bn0.", key)
    key = re.sub(r"^features\.norm5\.", "features.final.bn.", key)
    key = re.sub(r"(\.denselayer\d+)\.norm([12])\.", r"\1.bn\2.", key)
    return re.sub(r"(\.transition\d+)\.norm\.", r"\1.bn.", key)


def to_raysim_layout(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map torchvision keys to raysim keys; raysim-layout dicts pass through unchanged."""
    if any(_TV_DENSENET.match(k) for k in state):  # before the prefix test: its keys are features.*
        return {_densenet_key(k): v for k, v in state.items()}
    if all(k.startswith(("features.", "head.")) for k in state):
        return dict(state)
    out = {}
    for key, value in state.items():
        key = "head." + key[3:] if key.startswith("fc.") else "features." + key
        key = re.sub(r"\.downsample\.0\.", ".downsample.conv.", key)
        key = re.sub(r"\.downsample\.1\.", ".downsample.bn.", key)
        out[key] = value
    return out


def check_file(path: str) -> None:
    if not os.path.isfile(path):
        raise UserError(f"pretrained weights file not found: {path} "
                        f"(expected a torch state_dict saved with torch.save)")


def read_state_dict(path: str) -> dict[str, torch.Tensor]:
    check_file(path)
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle errors, truncated files, non-tensor payloads
        raise UserError(f"cannot read pretrained weights file {path}: {exc} "
                        f"(expected a torch state_dict saved with torch.save)") from None
    for wrapper in ("state_dict", "model"):  # common checkpoint wrappers
        if isinstance(obj, dict) and isinstance(obj.get(wrapper), dict):
            obj = obj[wrapper]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise UserError(f"pretrained weights file {path} does not hold a state_dict of tensors "
                        f"(expected a torch state_dict saved with torch.save)")
    return {k[7:] if k.startswith("module.") else k: v for k, v in obj.items()}


def _into_wrapped_bn(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Route a BN entry into the single BatchNorm inside a custom norm module in that slot.

    gPerXAN's XAN keeps a BN branch next to an IN branch and initialises it from ImageNet;
    with this, ``bn1.weight`` of the file lands in ``bn1.<bn branch>.weight``.
    """
    modules = dict(model.named_modules())
    own = model.state_dict()
    out = {}
    for key, value in state.items():
        slot, _, leaf = key.rpartition(".")
        module = modules.get(slot)
        if key not in own and module is not None and not isinstance(module, nn.modules.batchnorm._BatchNorm):
            inner = [n for n, m in module.named_modules()
                     if isinstance(m, nn.modules.batchnorm._BatchNorm) and n]
            if len(inner) == 1 and f"{slot}.{inner[0]}.{leaf}" in own:
                key = f"{slot}.{inner[0]}.{leaf}"
        out[key] = value
    return out


def load_pretrained(model: nn.Module, path: str) -> dict[str, list[str]]:
    """Load ``path`` into ``model`` in place; returns the skipped keys by reason."""
    state = _into_wrapped_bn(model, to_raysim_layout(read_state_dict(path)))
    own = model.state_dict()
    weights_of = {f"{name}.weight" for name, m in model.named_modules()
                  if isinstance(m, (nn.modules.conv._ConvNd, nn.Linear))}

    skipped: dict[str, list[str]] = {"head": [], "norm": [], "extra": []}
    mismatched, unexpected = [], []
    load = {}
    for key, value in state.items():
        if key not in own:
            (skipped["norm"] if _is_norm_key(key) else unexpected).append(key)
        elif own[key].shape != value.shape:
            if key.startswith("head."):
                skipped["head"].append(key)
            else:
                mismatched.append(f"{key} {tuple(value.shape)} vs {tuple(own[key].shape)}")
        else:
            load[key] = value
    missing = [k for k in own if k not in load and k not in skipped["head"]]
    required = [k for k in missing if k in weights_of and not k.startswith("head.")
                and not _is_added_layer(k)]
    if mismatched or unexpected or required or not load:
        details = "; ".join(filter(None, [
            f"shape mismatch: {', '.join(mismatched[:5])}" if mismatched else "",
            f"not in the model: {', '.join(unexpected[:5])}" if unexpected else "",
            f"missing: {', '.join(required[:5])}" if required else "",
            "no tensor matched" if not load else "",
        ]))
        raise UserError(f"pretrained weights file {path} does not fit {type(model).__name__}: {details}")
    skipped["norm"] += [k for k in missing if _is_norm_key(k)]
    skipped["extra"] += [k for k in missing if not _is_norm_key(k)]
    model.load_state_dict(load, strict=False)
    if skipped["norm"] or skipped["extra"]:
        warnings.warn(f"{path}: {len(load)} tensors loaded; kept the fresh init of "
                      f"{len(skipped['norm'])} norm-layer and {len(skipped['extra'])} other entries "
                      f"(swapped norm/conv or added layers)", stacklevel=2)
    return skipped


def _is_added_layer(key: str) -> bool:
    # Layers raysim adds on top of a published trunk, which no ImageNet file has.
    return ".bottleneck." in key
