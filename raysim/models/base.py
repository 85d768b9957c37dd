"""What every zoo model looks like to the engine and the methods.

A model is ``features`` (x -> flat representation z of size ``feature_dim``) followed by
``head`` (one nn.Linear). Methods that work on the representation (DapperFL's ||z||
penalty, gPerXAN's frozen global head, CSAC's taps, FDSE's heads) need both halves, and a
single split point keeps state-dict keys predictable: ``features.*`` and ``head.*``.
"""
from __future__ import annotations

from typing import Callable

from torch import Tensor, nn

# Called positionally: conv(in_ch, out_ch, kernel_size, stride, padding, bias).
ConvFactory = Callable[[int, int, int, int, int, bool], nn.Module]


def default_conv(in_ch: int, out_ch: int, kernel_size: int, stride: int = 1,
                 padding: int = 0, bias: bool = True) -> nn.Module:
    # A named wrapper rather than nn.Conv2d itself: nn.Conv2d's 6th positional is dilation.
    return nn.Conv2d(in_ch, out_ch, kernel_size, stride=stride, padding=padding, bias=bias)


def resolve_conv(conv: ConvFactory | type | None) -> ConvFactory:
    """Accept an nn.Conv2d subclass itself (e.g. a WSConv class) as well as a factory."""
    if conv is None:
        return default_conv
    if isinstance(conv, type) and issubclass(conv, nn.Conv2d):
        cls = conv

        def factory(in_ch, out_ch, kernel_size, stride=1, padding=0, bias=True):
            return cls(in_ch, out_ch, kernel_size, stride=stride, padding=padding, bias=bias)
        return factory
    if not callable(conv):
        raise TypeError(f"conv must be callable, got {type(conv).__name__}")
    return conv


class Net(nn.Module):
    """``forward(x) == head(features(x))``; ``input_shape`` is the published (C, H, W)."""

    def __init__(self, features: nn.Module, head: nn.Linear, input_shape: tuple[int, int, int]):
        super().__init__()
        self.features = features
        self.head = head
        self.feature_dim = head.in_features
        self.input_shape = tuple(input_shape)

    @property
    def num_classes(self) -> int:
        return self.head.out_features

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))
