"""AlexNet with a norm layer after every conv, for 224/256-px multi-domain benchmarks.

Two published classifiers sit on the same conv trunk (torchvision's 64-192-384-256-256 with
AdaptiveAvgPool2d(6, 6), so the parameter count does not depend on the input size):

* ``alexnet`` - FedWon Table 6: Dropout-FC(9216, 4096)-ReLU-Dropout-FC(4096, 4096)-ReLU-FC.
  57,044,810 parameters without norms (+2,304 BN affine) at 10 classes.
* ``alexnet_fdse`` - FDSE Table A5 ("vanilla AlexNet" of its baselines):
  FC(9216, 1024)-BN1d-ReLU-FC(1024, 1024)-BN1d-ReLU-FC. 12,974,154 parameters at
  10 classes with BN, FDSE Table 4's 1.30e7; the fp32 state with BN buffers is 49.52 MiB,
  Table 4's "49.52M".

FedBN's own AlexNet is ``alexnet`` with ``fc_norm=True`` (BN1d instead of Dropout).
"""
from __future__ import annotations

from collections import OrderedDict

from torch import nn

from raysim.core.errors import UserError
from raysim.models.base import ConvFactory, Net, default_conv, resolve_conv
from raysim.models.dropout import KeyedDropout
from raysim.models.norm import NormSpec, check_norm, make_norm
from raysim.models.registry import register


def _trunk_side(input_size: int) -> int:
    s = (input_size + 2 * 2 - 11) // 4 + 1  # conv1
    for _ in range(3):  # three MaxPool2d(3, 2)
        s = (s - 3) // 2 + 1
    return s


class AlexNet(Net):
    """``norm="gn"`` uses FedWon Table 6's groups GN(32,64), GN(32,192), GN(64,384), GN(64,256) x2."""

    gn_table = (32, 32, 64, 64, 64)

    def __init__(self, num_classes: int = 10, in_channels: int = 3, input_size: int = 256,
                 norm: NormSpec = "bn", conv: ConvFactory = default_conv,
                 hidden: int = 4096, fc_norm: bool = False, dropout: float = 0.5):
        norm = check_norm(norm)
        conv = resolve_conv(conv)
        if input_size < 63 or _trunk_side(input_size) < 1:
            raise UserError(f"alexnet: input_size {input_size} is too small (need at least 63; "
                            f"the papers use 224 or 256)")
        gn = self.gn_table if norm == "gn" else (None,) * 5
        layers = OrderedDict()
        widths = ((in_channels, 64, 11, 4, 2), (64, 192, 5, 1, 2), (192, 384, 3, 1, 1),
                  (384, 256, 3, 1, 1), (256, 256, 3, 1, 1))
        for i, (cin, cout, k, s, p) in enumerate(widths, start=1):
            layers[f"conv{i}"] = conv(cin, cout, k, s, p, True)
            layers[f"bn{i}"] = make_norm(norm, cout, 2, groups=gn[i - 1])
            layers[f"relu{i}"] = nn.ReLU(inplace=True)
            if i in (1, 2, 5):
                layers[f"pool{i}"] = nn.MaxPool2d(3, 2)
        layers["avgpool"] = nn.AdaptiveAvgPool2d((6, 6))
        layers["flatten"] = nn.Flatten()
        in_f = 256 * 6 * 6
        for i in (6, 7):
            if fc_norm:
                layers[f"fc{i - 5}"] = nn.Linear(in_f, hidden)
                layers[f"bn{i}"] = make_norm(norm, hidden, 1)
            else:
                layers[f"drop{i - 5}"] = KeyedDropout(dropout)
                layers[f"fc{i - 5}"] = nn.Linear(in_f, hidden)
            layers[f"relu{i}"] = nn.ReLU(inplace=True)
            in_f = hidden
        super().__init__(nn.Sequential(layers), nn.Linear(hidden, num_classes),
                         (in_channels, input_size, input_size))


@register("alexnet")
def alexnet(*, num_classes: int = 10, in_channels: int = 3, input_size: int = 256,
            norm: NormSpec = "bn", conv: ConvFactory = default_conv,
            hidden: int = 4096, fc_norm: bool = False, dropout: float = 0.5) -> AlexNet:
    """FedWon Table 6 (FedBN's AlexNet with Dropout between the FC layers)."""
    return AlexNet(num_classes, in_channels, input_size, norm, conv, hidden, fc_norm, dropout)


@register("alexnet_fdse")
def alexnet_fdse(*, num_classes: int = 10, in_channels: int = 3, input_size: int = 256,
                 norm: NormSpec = "bn", conv: ConvFactory = default_conv,
                 hidden: int = 1024, fc_norm: bool = True, dropout: float = 0.0) -> AlexNet:
    """FDSE Table A5: 1024-wide FC layers with BN1d; the backbone of every FDSE baseline."""
    return AlexNet(num_classes, in_channels, input_size, norm, conv, hidden, fc_norm, dropout)
