"""DenseNet-121 in torchvision's layout (gPerXAN's Camelyon17 backbone; CCST's too).

DenseNet-BC (Huang et al., CVPR 2017): growth rate 32, dense blocks of (6, 12, 24, 16)
layers, bottleneck width 4 x growth, compression 0.5 in the transitions, 64 stem channels,
no dropout. Written here rather than wrapped: torchvision's DenseNet hardcodes BatchNorm2d
and nn.Conv2d, and the zoo builds every norm with ``make_norm`` and every conv with the
``conv`` factory.

    features:  conv0 bn0 relu0 pool0                               "stem"
               denseblock1 transition1 ... transition3 denseblock4  one stage each
               final (bn, relu)                                     "final": torchvision's norm5 + ReLU
               pool flatten                                         -> z, 1024 channels
    head:      Linear(1024, num_classes)                            torchvision's classifier

A dense layer is  bn1 relu1 conv1(1x1, 128) bn2 relu2 conv2(3x3, 32)  on the concatenation of
every earlier output of its block; a transition is  bn relu conv(1x1, C/2) pool(avg 2x2).
Norm slots are named ``bn*`` (torchvision: ``norm*``); :mod:`raysim.models.pretrained` maps a
torchvision state_dict (current or legacy ``norm.1`` keys) onto these names.

Spatial size: the stem divides by 4 and each transition by 2, so 224 px ends at 7x7 and
Camelyon17's 96 px patches at 3x3; the adaptive average pool makes z 1024-d at any size.
"""
from __future__ import annotations

from collections import OrderedDict

import torch
from torch import Tensor, nn

from raysim.core.errors import UserError
from raysim.models.base import ConvFactory, Net, default_conv, resolve_conv
from raysim.models.norm import NormSpec, check_norm, make_norm
from raysim.models.pretrained import load_pretrained
from raysim.models.registry import register

DENSENET121 = dict(growth=32, blocks=(6, 12, 24, 16), bn_size=4, init_features=64)


class DenseLayer(nn.Module):
    """BN-ReLU-Conv1x1 (bn_size * growth) - BN-ReLU-Conv3x3 (growth) on the concatenated inputs."""

    def __init__(self, in_ch: int, growth: int, bn_size: int, norm: NormSpec, conv: ConvFactory):
        super().__init__()
        width = bn_size * growth
        self.bn1 = make_norm(norm, in_ch, 2)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv1 = conv(in_ch, width, 1, 1, 0, False)
        self.bn2 = make_norm(norm, width, 2)
        self.relu2 = nn.ReLU(inplace=True)
        self.conv2 = conv(width, growth, 3, 1, 1, False)

    def forward(self, inputs: list[Tensor]) -> Tensor:
        x = torch.cat(inputs, 1)  # a new tensor: the in-place ReLU cannot touch earlier outputs
        x = self.conv1(self.relu1(self.bn1(x)))
        return self.conv2(self.relu2(self.bn2(x)))


class DenseBlock(nn.Module):
    """``num_layers`` dense layers; layer i sees the block input and the outputs of layers < i."""

    def __init__(self, num_layers: int, in_ch: int, growth: int, bn_size: int,
                 norm: NormSpec, conv: ConvFactory):
        super().__init__()
        for i in range(num_layers):
            self.add_module(f"denselayer{i + 1}", DenseLayer(in_ch + i * growth, growth, bn_size, norm, conv))
        self.out_channels = in_ch + num_layers * growth

    def forward(self, x: Tensor) -> Tensor:
        outputs = [x]
        for layer in self.children():
            outputs.append(layer(outputs))
        return torch.cat(outputs, 1)


def _transition(in_ch: int, out_ch: int, norm: NormSpec, conv: ConvFactory) -> nn.Sequential:
    return nn.Sequential(OrderedDict([
        ("bn", make_norm(norm, in_ch, 2)),
        ("relu", nn.ReLU(inplace=True)),
        ("conv", conv(in_ch, out_ch, 1, 1, 0, False)),
        ("pool", nn.AvgPool2d(kernel_size=2, stride=2)),
    ]))


def _final_side(size: int, num_transitions: int) -> int:
    """Side length after the stem (conv 7x7/2 pad 3, max-pool 3x3/2 pad 1) and the transitions."""
    size = (size - 1) // 2 + 1
    size = (size - 1) // 2 + 1
    for _ in range(num_transitions):
        size //= 2
    return size


class DenseNet(Net):
    def __init__(self, num_classes: int = 10, in_channels: int = 3, input_size: int = 224,
                 norm: NormSpec = "bn", conv: ConvFactory = default_conv, *, growth: int = 32,
                 blocks: tuple[int, ...] = (6, 12, 24, 16), bn_size: int = 4, init_features: int = 64,
                 compression: float = 0.5, name: str = "densenet"):
        norm = check_norm(norm)
        conv = resolve_conv(conv)
        if _final_side(input_size, len(blocks) - 1) < 1:
            smallest = next(s for s in range(1, 4096) if _final_side(s, len(blocks) - 1) >= 1)
            raise UserError(f"{name}: input_size {input_size} is too small (need at least {smallest}: "
                            f"the stem and {len(blocks) - 1} transitions halve it {len(blocks) + 1} times)")
        layers: list[tuple[str, nn.Module]] = [
            ("conv0", conv(in_channels, init_features, 7, 2, 3, False)),
            ("bn0", make_norm(norm, init_features, 2)),
            ("relu0", nn.ReLU(inplace=True)),
            ("pool0", nn.MaxPool2d(kernel_size=3, stride=2, padding=1)),
        ]
        ch = init_features
        for i, num_layers in enumerate(blocks, start=1):
            block = DenseBlock(num_layers, ch, growth, bn_size, norm, conv)
            layers.append((f"denseblock{i}", block))
            ch = block.out_channels
            if i < len(blocks):
                out = int(ch * compression)
                layers.append((f"transition{i}", _transition(ch, out, norm, conv)))
                ch = out
        layers += [
            ("final", nn.Sequential(OrderedDict([("bn", make_norm(norm, ch, 2)),
                                                 ("relu", nn.ReLU(inplace=True))]))),
            ("pool", nn.AdaptiveAvgPool2d(1)),
            ("flatten", nn.Flatten()),
        ]
        features = nn.Sequential(OrderedDict(layers))
        head = nn.Linear(ch, num_classes)
        # The DenseNet paper's / torchvision's init: He-normal convs, zero linear bias
        # (norm layers keep their own init: BN weight 1, bias 0).
        for m in features.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight)
        nn.init.zeros_(head.bias)
        super().__init__(features, head, (in_channels, input_size, input_size))


@register("densenet121_tv")
def densenet121_tv(*, num_classes: int = 10, in_channels: int = 3, input_size: int = 224,
                   norm: NormSpec = "bn", conv: ConvFactory = default_conv,
                   pretrained: str | None = None) -> DenseNet:
    """DenseNet-121 (torchvision's layout); ``pretrained`` is a local state_dict file (e.g. ImageNet)."""
    model = DenseNet(num_classes, in_channels, input_size, norm, conv, name="densenet121_tv", **DENSENET121)
    if pretrained is not None:
        load_pretrained(model, pretrained)
    return model
