"""Train-time augmentation on batches, drawing randomness only from a torch.Generator.

torchvision's transforms draw from torch's global RNG one image at a time, which makes a
client step depend on everything that ran before it in the process. These ops work on a
whole (N, C, H, W) float batch in [0, 1] after resizing, draw every random number for the
batch up front in a fixed order from the generator they are given, and never touch global
state. Same generator state + same batch => same output, on any host.

Differences from torchvision, on purpose:
* ``ResizedCrop`` works on the already-resized image (one decode size for everything) and
  clamps an out-of-range box instead of re-drawing up to 10 times.
* ``ColorJitter`` applies brightness, contrast, saturation, hue in this fixed order; hue
  is a rotation of the chroma plane in YIQ space (close to an HSV hue shift, no branches).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from raysim.core.errors import UserError


def _rand(n: int, g: torch.Generator | None) -> torch.Tensor:
    return torch.rand(n, generator=g)


def _uniform(n: int, lo: float, hi: float, g) -> torch.Tensor:
    return lo + (hi - lo) * _rand(n, g)


_LUMA = torch.tensor([0.299, 0.587, 0.114]).view(1, 3, 1, 1)


def _gray(x: torch.Tensor) -> torch.Tensor:
    if x.shape[1] != 3:
        return x
    return (x * _LUMA).sum(1, keepdim=True).expand_as(x)


@dataclass(frozen=True)
class HFlip:
    p: float = 0.5

    def __call__(self, x, g):
        m = _rand(x.shape[0], g) < self.p
        if m.any():
            x = x.clone()
            x[m] = x[m].flip(-1)
        return x


@dataclass(frozen=True)
class PadCrop:
    """RandomCrop(size, padding=pad) with zero fill (DapperFL's digits/Office transform)."""

    pad: int = 4

    def __call__(self, x, g):
        n, c, h, w = x.shape
        p = self.pad
        di = torch.randint(0, 2 * p + 1, (n,), generator=g)
        dj = torch.randint(0, 2 * p + 1, (n,), generator=g)
        xp = F.pad(x, (p, p, p, p))
        rows = (di[:, None] + torch.arange(h)[None, :])  # n,h
        cols = (dj[:, None] + torch.arange(w)[None, :])  # n,w
        b = torch.arange(n)[:, None, None]
        out = xp.permute(0, 2, 3, 1)[b, rows[:, :, None], cols[:, None, :]]  # n,h,w,c
        return out.permute(0, 3, 1, 2).contiguous()


def _affine(x, theta, mode):
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode=mode, padding_mode="zeros", align_corners=False)


@dataclass(frozen=True)
class Rotate:
    """RandomRotation((-degrees, degrees)), nearest, zero fill (torchvision's defaults)."""

    degrees: float = 30.0

    def __call__(self, x, g):
        n = x.shape[0]
        a = _uniform(n, -self.degrees, self.degrees, g) * (math.pi / 180)
        cos, sin = torch.cos(a), torch.sin(a)
        theta = torch.zeros(n, 2, 3)
        theta[:, 0, 0], theta[:, 0, 1], theta[:, 1, 0], theta[:, 1, 1] = cos, -sin, sin, cos
        return _affine(x, theta, "nearest")


@dataclass(frozen=True)
class ResizedCrop:
    """RandomResizedCrop(scale, ratio) back to the same size, bilinear."""

    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)

    def __call__(self, x, g):
        n = x.shape[0]
        area = _uniform(n, *self.scale, g)
        logr = _uniform(n, math.log(self.ratio[0]), math.log(self.ratio[1]), g)
        r = torch.exp(logr)
        sw = torch.sqrt(area * r).clamp(max=1.0)  # box width as a fraction of the image
        sh = torch.sqrt(area / r).clamp(max=1.0)
        cx = (_rand(n, g) * 2 - 1) * (1 - sw)  # box centre in [-1, 1] coordinates
        cy = (_rand(n, g) * 2 - 1) * (1 - sh)
        theta = torch.zeros(n, 2, 3)
        theta[:, 0, 0], theta[:, 1, 1], theta[:, 0, 2], theta[:, 1, 2] = sw, sh, cx, cy
        return _affine(x, theta, "bilinear").clamp_(0, 1)


@dataclass(frozen=True)
class ColorJitter:
    brightness: float = 0.0
    contrast: float = 0.0
    saturation: float = 0.0
    hue: float = 0.0
    p: float = 1.0

    def __call__(self, x, g):
        n = x.shape[0]
        apply = (_rand(n, g) < self.p).float().view(n, 1, 1, 1)
        fb = _uniform(n, max(0, 1 - self.brightness), 1 + self.brightness, g).view(n, 1, 1, 1)
        fc = _uniform(n, max(0, 1 - self.contrast), 1 + self.contrast, g).view(n, 1, 1, 1)
        fs = _uniform(n, max(0, 1 - self.saturation), 1 + self.saturation, g).view(n, 1, 1, 1)
        fh = _uniform(n, -self.hue, self.hue, g)
        y = x
        if self.brightness:
            y = (y * fb).clamp(0, 1)
        if self.contrast:
            m = _gray(y).mean(dim=(1, 2, 3), keepdim=True)
            y = ((y - m) * fc + m).clamp(0, 1)
        if self.saturation and y.shape[1] == 3:
            gy = _gray(y)
            y = ((y - gy) * fs + gy).clamp(0, 1)
        if self.hue and y.shape[1] == 3:
            y = _hue_rotate(y, fh * 2 * math.pi)
        return apply * y + (1 - apply) * x


_RGB2YIQ = torch.tensor([[0.299, 0.587, 0.114], [0.596, -0.274, -0.322], [0.211, -0.523, 0.312]])
_YIQ2RGB = torch.linalg.inv(_RGB2YIQ)


def _hue_rotate(x, angle):
    yiq = torch.einsum("ij,njhw->nihw", _RGB2YIQ, x)
    c, s = torch.cos(angle).view(-1, 1, 1), torch.sin(angle).view(-1, 1, 1)
    i, q = yiq[:, 1], yiq[:, 2]
    yiq = torch.stack([yiq[:, 0], c * i - s * q, s * i + c * q], 1)
    return torch.einsum("ij,njhw->nihw", _YIQ2RGB, yiq).clamp(0, 1)


@dataclass(frozen=True)
class RandomGray:
    p: float = 0.1

    def __call__(self, x, g):
        m = (_rand(x.shape[0], g) < self.p).float().view(-1, 1, 1, 1)
        return m * _gray(x) + (1 - m) * x


@dataclass(frozen=True)
class Compose:
    ops: tuple

    def __call__(self, x, g=None):
        for op in self.ops:
            x = op(x, g)
        return x

    def __bool__(self):
        return bool(self.ops)


#: named pipelines from the specs (the recipe each paper's code uses)
PRESETS = {
    "none": (),
    "flip": (HFlip(0.5),),
    # FedBN / FedWon Office-Caltech-10 and DomainNet
    "flip_rotate30": (HFlip(0.5), Rotate(30.0)),
    # DapperFL digits / Office: RandomCrop(32, padding=4) + RandomHorizontalFlip
    "crop_flip": (PadCrop(4), HFlip(0.5)),
    # gPerXAN: HorizontalFlip(0.5) + ColorJitter(0.2,0.2,0.2,0.2) with p=0.5
    "flip_jitter": (HFlip(0.5), ColorJitter(0.2, 0.2, 0.2, 0.2, p=0.5)),
    # CSAC PACS/VLCS: RandomResizedCrop(scale 0.8-1) + flip + ColorJitter(0.4 x4) + RandomGrayscale(0.1)
    "csac": (ResizedCrop((0.8, 1.0)), HFlip(0.5), ColorJitter(0.4, 0.4, 0.4, 0.4), RandomGray(0.1)),
}


def make_augment(spec) -> Compose | None:
    """A preset name, a tuple of ops, or None -> a pipeline (None when it does nothing)."""
    if spec is None:
        return None
    if isinstance(spec, Compose):
        return spec if spec.ops else None
    if isinstance(spec, str):
        if spec not in PRESETS:
            raise UserError(f"augment={spec!r} is not known; expected one of {sorted(PRESETS)}")
        ops = PRESETS[spec]
    else:
        ops = tuple(spec)
        if not all(callable(o) for o in ops):
            raise UserError(f"augment={spec!r}: expected a preset name or a sequence of ops")
    return Compose(tuple(ops)) if ops else None


def preset_name(pipeline) -> str | None:
    """The PRESETS name of a pipeline ('none' for None), or None for a custom one."""
    ops = tuple(pipeline.ops) if isinstance(pipeline, Compose) else () if pipeline is None else None
    return next((k for k, v in PRESETS.items() if v == ops), None)
