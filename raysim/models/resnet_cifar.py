"""CIFAR-style ResNets of DapperFL (ResNet-10 on Digits, ResNet-18 on Office-Caltech, both 3x32x32).

The ImageNet stem (7x7/2 conv + max-pool) would shrink a 32-px image to 8 px before the
first stage, so the stem is one 3x3/1 conv and there is no pooling; stages of BasicBlocks
(64-128-256-512, strides 1-2-2-2) then give 32 -> 32 -> 16 -> 8 -> 4. Counts at 10
classes: ResNet-10 4,903,242 and ResNet-18 11,173,962 parameters (DapperFL Tables 5/6).
DapperFL's backbone class also carries an MLP its forward pass never uses; it is left out.
"""
from __future__ import annotations

from collections import OrderedDict

from torch import Tensor, nn

from raysim.models.base import ConvFactory, Net, default_conv, resolve_conv
from raysim.models.norm import NormSpec, check_norm, make_norm
from raysim.models.registry import register


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int, norm: NormSpec, conv: ConvFactory):
        super().__init__()
        self.conv1 = conv(in_planes, planes, 3, stride, 1, False)
        self.bn1 = make_norm(norm, planes, 2)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv(planes, planes, 3, 1, 1, False)
        self.bn2 = make_norm(norm, planes, 2)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(OrderedDict([
                ("conv", conv(in_planes, planes, 1, stride, 0, False)),
                ("bn", make_norm(norm, planes, 2)),
            ]))

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class ResNetCIFAR(Net):
    def __init__(self, blocks: tuple[int, int, int, int], num_classes: int = 10,
                 in_channels: int = 3, input_size: int = 32, norm: NormSpec = "bn",
                 conv: ConvFactory = default_conv, widths: tuple[int, ...] = (64, 128, 256, 512)):
        norm = check_norm(norm)
        conv = resolve_conv(conv)
        layers = OrderedDict([
            ("conv1", conv(in_channels, widths[0], 3, 1, 1, False)),
            ("bn1", make_norm(norm, widths[0], 2)),
            ("relu", nn.ReLU(inplace=True)),
        ])
        in_planes = widths[0]
        for i, (n, width) in enumerate(zip(blocks, widths), start=1):
            stage = []
            for j in range(n):
                stride = 1 if (i == 1 or j > 0) else 2
                stage.append(BasicBlock(in_planes, width, stride, norm, conv))
                in_planes = width
            layers[f"layer{i}"] = nn.Sequential(*stage)
        layers["avgpool"] = nn.AdaptiveAvgPool2d(1)
        layers["flatten"] = nn.Flatten()
        super().__init__(nn.Sequential(layers), nn.Linear(in_planes, num_classes),
                         (in_channels, input_size, input_size))


@register("resnet10")
def resnet10(*, num_classes: int = 10, in_channels: int = 3, input_size: int = 32,
             norm: NormSpec = "bn", conv: ConvFactory = default_conv) -> ResNetCIFAR:
    """DapperFL's Digits backbone: one BasicBlock per stage."""
    return ResNetCIFAR((1, 1, 1, 1), num_classes, in_channels, input_size, norm, conv)


@register("resnet18")
def resnet18(*, num_classes: int = 10, in_channels: int = 3, input_size: int = 32,
             norm: NormSpec = "bn", conv: ConvFactory = default_conv) -> ResNetCIFAR:
    """DapperFL's Office-Caltech backbone: two BasicBlocks per stage."""
    return ResNetCIFAR((2, 2, 2, 2), num_classes, in_channels, input_size, norm, conv)
