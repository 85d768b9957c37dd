"""A two-layer perceptron: the overhead-bound model of the speed benchmarks (workload D).

Its client steps cost about a millisecond, so a run with it measures what a simulator itself
spends per client and per round rather than the training. Usable in any config
(``model: {name: mlp}``); ``hidden: 0`` makes it multinomial logistic regression.
"""
from __future__ import annotations

from collections import OrderedDict

from torch import nn

from raysim.core.errors import UserError
from raysim.models.base import ConvFactory, Net, default_conv
from raysim.models.norm import NormSpec, make_norm
from raysim.models.registry import register


class MLP(Net):
    """flatten - FC(hidden) - [norm] - ReLU - FC(C); with ``hidden = 0``: flatten - FC(C)."""

    def __init__(self, num_classes: int = 10, in_channels: int = 1, input_size: int = 28,
                 norm: NormSpec = "none", hidden: int = 200):
        inputs = in_channels * input_size * input_size
        layers = [("flatten", nn.Flatten())]
        if hidden:
            layers += [("fc1", nn.Linear(inputs, hidden)), ("bn1", make_norm(norm, hidden, 1)),
                       ("relu1", nn.ReLU(inplace=True))]
        super().__init__(nn.Sequential(OrderedDict(layers)), nn.Linear(hidden or inputs, num_classes),
                         (in_channels, input_size, input_size))


@register("mlp")
def mlp(*, num_classes: int = 10, in_channels: int = 1, input_size: int = 28,
        norm: NormSpec = "none", conv: ConvFactory = default_conv, hidden: int = 200) -> MLP:
    """Two-layer MLP: one hidden layer of 200 units (the FedAvg paper's 2NN width); no convs."""
    if not isinstance(hidden, int) or isinstance(hidden, bool) or hidden < 0:
        raise UserError(f"mlp: model.options.hidden = {hidden!r}: expected an integer >= 0 (0: logistic regression)")
    return MLP(num_classes, in_channels, input_size, norm, hidden)
