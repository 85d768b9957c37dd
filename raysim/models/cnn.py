"""Small CNNs for digit benchmarks.

* :class:`CNN6` - FedBN's six-layer digits CNN as FedWon's Table 5 gives it.
* :class:`MNISTCNN` - the "standard MNIST CNN with two conv layers and two FC layers" of
  CSAC's Rotated MNIST experiments.
* :class:`SmallCNN` - a ~0.1M-parameter CNN for cross-device runs with many clients.
"""
from __future__ import annotations

from collections import OrderedDict

from torch import nn

from raysim.core.errors import UserError
from raysim.models.base import ConvFactory, Net, default_conv, resolve_conv
from raysim.models.dropout import KeyedDropout
from raysim.models.norm import NormSpec, check_norm, make_norm
from raysim.models.registry import register


def _pooled(size: int, times: int) -> int:
    for _ in range(times):
        size //= 2
    return size


def _check_size(model: str, input_size: int, pools: int) -> int:
    out = _pooled(input_size, pools)
    if out < 1:
        raise UserError(f"{model}: input_size {input_size} is too small "
                        f"(it is halved {pools} times; need at least {2 ** pools})")
    return out


def _fc_block(i: int, in_f: int, out_f: int, norm: NormSpec, fc_norm: bool,
              dropout: float) -> list[tuple[str, nn.Module]]:
    # FedWon Tables 5/6: "Dropout, FC, ReLU". FedBN's originals: "FC, BN1d, ReLU".
    if fc_norm:
        return [(f"fc{i}", nn.Linear(in_f, out_f)), (f"bn{i + 3}", make_norm(norm, out_f, 1)),
                (f"relu{i + 3}", nn.ReLU(inplace=True))]
    return [(f"drop{i}", KeyedDropout(dropout)), (f"fc{i}", nn.Linear(in_f, out_f)),
            (f"relu{i + 3}", nn.ReLU(inplace=True))]


class CNN6(Net):
    """Three 5x5 conv blocks (64-64-128) and three FC layers (2048-512-C).

    Input-size aware: the flatten size is 128 * (s // 4)^2, 6272 at 28 px (FedWon,
    FedBN) and 8192 at 32 px. ``fc_norm=True`` restores FedBN's original BN1d between the
    FC layers; FedWon replaced it with Dropout for every method, which is the default.
    ``norm="gn"`` uses Table 5's GN(32, 64), GN(32, 64), GN(64, 128).
    """

    gn_table = (32, 32, 64)

    def __init__(self, num_classes: int = 10, in_channels: int = 3, input_size: int = 28,
                 norm: NormSpec = "bn", conv: ConvFactory = default_conv,
                 fc_norm: bool = False, dropout: float = 0.5):
        norm = check_norm(norm)
        conv = resolve_conv(conv)
        side = _check_size("cnn6", input_size, 2)
        gn = self.gn_table if norm == "gn" else (None,) * 3
        layers = OrderedDict([
            ("conv1", conv(in_channels, 64, 5, 1, 2, True)),
            ("bn1", make_norm(norm, 64, 2, groups=gn[0])),
            ("relu1", nn.ReLU(inplace=True)),
            ("pool1", nn.MaxPool2d(2, 2)),
            ("conv2", conv(64, 64, 5, 1, 2, True)),
            ("bn2", make_norm(norm, 64, 2, groups=gn[1])),
            ("relu2", nn.ReLU(inplace=True)),
            ("pool2", nn.MaxPool2d(2, 2)),
            ("conv3", conv(64, 128, 5, 1, 2, True)),
            ("bn3", make_norm(norm, 128, 2, groups=gn[2])),
            ("relu3", nn.ReLU(inplace=True)),
            ("flatten", nn.Flatten()),
        ])
        layers.update(_fc_block(1, 128 * side * side, 2048, norm, fc_norm, dropout))
        layers.update(_fc_block(2, 2048, 512, norm, fc_norm, dropout))
        super().__init__(nn.Sequential(layers), nn.Linear(512, num_classes),
                         (in_channels, input_size, input_size))


class MNISTCNN(Net):
    """conv(32, 5x5) - pool - conv(64, 5x5) - pool - FC(1024) - FC(C), no norm by default.

    CSAC gives only "two conv and two FC layers" (after Ghifary et al. and DGER); these are
    the widths of the classic TensorFlow MNIST tutorial network, recommended by the spec.
    Norm slots after each conv exist so BN/GN variants can be asked for explicitly.
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 1, input_size: int = 28,
                 norm: NormSpec = "none", conv: ConvFactory = default_conv, hidden: int = 1024):
        side = _check_size("mnist_cnn", input_size, 2)
        conv = resolve_conv(conv)
        features = nn.Sequential(OrderedDict([
            ("conv1", conv(in_channels, 32, 5, 1, 2, True)),
            ("bn1", make_norm(norm, 32, 2)),
            ("relu1", nn.ReLU(inplace=True)),
            ("pool1", nn.MaxPool2d(2, 2)),
            ("conv2", conv(32, 64, 5, 1, 2, True)),
            ("bn2", make_norm(norm, 64, 2)),
            ("relu2", nn.ReLU(inplace=True)),
            ("pool2", nn.MaxPool2d(2, 2)),
            ("flatten", nn.Flatten()),
            ("fc1", nn.Linear(64 * side * side, hidden)),
            ("relu3", nn.ReLU(inplace=True)),
        ]))
        super().__init__(features, nn.Linear(hidden, num_classes), (in_channels, input_size, input_size))


class SmallCNN(Net):
    """conv(16, 5x5) - pool - conv(32, 5x5) - pool - FC(64) - FC(C).

    Sized for cross-device simulations with hundreds of clients, where model size dominates
    memory and communication: 114k parameters on 1x28x28, 146k on 3x32x32. ``width`` multiplies
    the conv channels (``width: 2`` gives FDSE's halved shared path the plain network's widths).
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 3, input_size: int = 32,
                 norm: NormSpec = "bn", conv: ConvFactory = default_conv, hidden: int = 64, width: int = 1):
        side = _check_size("small_cnn", input_size, 2)
        conv = resolve_conv(conv)
        c1, c2 = 16 * width, 32 * width
        features = nn.Sequential(OrderedDict([
            ("conv1", conv(in_channels, c1, 5, 1, 2, True)),
            ("bn1", make_norm(norm, c1, 2)),
            ("relu1", nn.ReLU(inplace=True)),
            ("pool1", nn.MaxPool2d(2, 2)),
            ("conv2", conv(c1, c2, 5, 1, 2, True)),
            ("bn2", make_norm(norm, c2, 2)),
            ("relu2", nn.ReLU(inplace=True)),
            ("pool2", nn.MaxPool2d(2, 2)),
            ("flatten", nn.Flatten()),
            ("fc1", nn.Linear(c2 * side * side, hidden)),
            ("relu3", nn.ReLU(inplace=True)),
        ]))
        super().__init__(features, nn.Linear(hidden, num_classes), (in_channels, input_size, input_size))


@register("cnn6")
def cnn6(*, num_classes: int = 10, in_channels: int = 3, input_size: int = 28,
         norm: NormSpec = "bn", conv: ConvFactory = default_conv,
         fc_norm: bool = False, dropout: float = 0.5) -> CNN6:
    """FedBN/FedWon six-layer digits CNN (FedWon Table 5)."""
    return CNN6(num_classes, in_channels, input_size, norm, conv, fc_norm, dropout)


@register("mnist_cnn")
def mnist_cnn(*, num_classes: int = 10, in_channels: int = 1, input_size: int = 28,
              norm: NormSpec = "none", conv: ConvFactory = default_conv,
              hidden: int = 1024) -> MNISTCNN:
    """CSAC's Rotated MNIST network (two conv + two FC)."""
    return MNISTCNN(num_classes, in_channels, input_size, norm, conv, hidden)


@register("small_cnn")
def small_cnn(*, num_classes: int = 10, in_channels: int = 3, input_size: int = 32,
              norm: NormSpec = "bn", conv: ConvFactory = default_conv,
              hidden: int = 64, width: int = 1) -> SmallCNN:
    """Cross-device CNN, ~0.1M parameters."""
    if not isinstance(width, int) or isinstance(width, bool) or width < 1:
        raise UserError(f"small_cnn: model.options.width = {width!r}: expected a positive integer")
    return SmallCNN(num_classes, in_channels, input_size, norm, conv, hidden, width)
