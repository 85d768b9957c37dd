"""torchvision's ImageNet ResNet-18/50 (gPerXAN, CSAC; FedWon's "ResNet-18 ... in PyTorch").

The network is torchvision's own class, built with ``norm_layer`` from the norm factory, so
ImageNet weight files load unchanged. Two changes make it fit the zoo's contract:

* each ``downsample`` becomes ``Sequential(conv=..., bn=...)`` so that its norm's keys
  contain "bn" like every other norm (torchvision's ``downsample.1`` would escape
  FedBN-style "bn" key filters); the loader maps ``downsample.0/1`` accordingly;
* ``fc`` becomes ``head``; ``features`` is the trunk up to the pooled, flattened vector.

``bottleneck=256`` appends CSAC's code-level Linear(512, 256)-norm-ReLU to ``features``
(the paper itself describes a plain pretrained ResNet-18, which is the default).
"""
from __future__ import annotations

from collections import OrderedDict

from torch import nn

from raysim.models.base import ConvFactory, Net, default_conv, resolve_conv
from raysim.models.norm import NormSpec, check_norm, make_norm
from raysim.models.pretrained import load_pretrained
from raysim.models.registry import register


def _swap_convs(module: nn.Module, conv: ConvFactory) -> None:
    for name, child in module.named_children():
        if type(child) is nn.Conv2d:
            if child.groups != 1 or child.dilation != (1, 1) or child.kernel_size[0] != child.kernel_size[1]:
                raise ValueError(f"cannot swap {name}: the conv factory takes square, ungrouped convs")
            setattr(module, name, conv(child.in_channels, child.out_channels, child.kernel_size[0],
                                       child.stride[0], child.padding[0], child.bias is not None))
        else:
            _swap_convs(child, conv)


class TorchvisionResNet(Net):
    def __init__(self, arch: str, num_classes: int = 10, in_channels: int = 3, input_size: int = 224,
                 norm: NormSpec = "bn", conv: ConvFactory = default_conv,
                 bottleneck: int | None = None):
        norm = check_norm(norm)
        conv = resolve_conv(conv)
        # here, not at the top: importing torchvision costs ~1 s (torchvision.ops pulls in
        # torch._dynamo), paid by every Ray worker that builds any model otherwise
        from torchvision.models import resnet as tv_resnet

        trunk = getattr(tv_resnet, arch)(weights=None, norm_layer=lambda c: make_norm(norm, c, 2))
        for block in trunk.modules():
            if isinstance(block, (tv_resnet.BasicBlock, tv_resnet.Bottleneck)) and block.downsample is not None:
                block.downsample = nn.Sequential(OrderedDict(
                    [("conv", block.downsample[0]), ("bn", block.downsample[1])]))
        if in_channels != 3:
            trunk.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
        if conv is not default_conv:
            _swap_convs(trunk, conv)
        dim = trunk.fc.in_features
        if bottleneck:
            trunk.fc = nn.Sequential(OrderedDict([
                ("bottleneck", nn.Linear(dim, bottleneck)),
                ("bn", make_norm(norm, bottleneck, 1)),
                ("relu", nn.ReLU(inplace=True)),
            ]))
            dim = bottleneck
        else:
            trunk.fc = nn.Identity()  # torchvision's forward ends in avgpool -> flatten -> fc
        super().__init__(trunk, nn.Linear(dim, num_classes), (in_channels, input_size, input_size))


@register("resnet18_tv")
def resnet18_tv(*, num_classes: int = 10, in_channels: int = 3, input_size: int = 224,
                norm: NormSpec = "bn", conv: ConvFactory = default_conv,
                pretrained: str | None = None, bottleneck: int | None = None) -> TorchvisionResNet:
    """torchvision ResNet-18; ``pretrained`` is a local state_dict file (e.g. ImageNet)."""
    model = TorchvisionResNet("resnet18", num_classes, in_channels, input_size, norm, conv, bottleneck)
    if pretrained is not None:
        load_pretrained(model, pretrained)
    return model


@register("resnet50_tv")
def resnet50_tv(*, num_classes: int = 10, in_channels: int = 3, input_size: int = 224,
                norm: NormSpec = "bn", conv: ConvFactory = default_conv,
                pretrained: str | None = None, bottleneck: int | None = None) -> TorchvisionResNet:
    """torchvision ResNet-50; ``pretrained`` is a local state_dict file (e.g. ImageNet)."""
    model = TorchvisionResNet("resnet50", num_classes, in_channels, input_size, norm, conv, bottleneck)
    if pretrained is not None:
        load_pretrained(model, pretrained)
    return model
