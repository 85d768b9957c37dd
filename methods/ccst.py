"""CCST — Chen, Jiang, Dou, Chen, "Federated Domain Generalization for Image Recognition via
Cross-Client Style Transfer", WACV 2023 (baselines spec 5.4).

1. Style statistics, once (the first round a client trains), overall (domain) mode: the
   per-channel mean and std of client k's representations pooled over all pixels of all its
   training images,  S_k = (mu_k, sigma_k),  sigma = sqrt(E[f^2] - E[f]^2 + 1e-5).
2. The server collects the style bank {S_j} of the clients that trained (source clients only: a
   held-out domain never uploads) and broadcasts it.
3. Augmentation: for each training image x, K styles chosen among the bank's clients (its own
   included) without replacement; its own style keeps x, another style j gives
       x_j = Dec(AdaIN(Enc(x); S_j)),   AdaIN(f; mu, sigma) = sigma * (f - mu_f) / sigma_f + mu
   (full stylisation, alpha = 1). The local dataset becomes K images per original.
4. Plain FedAvg on the augmented data. Scored: the global model.
Data exchange: one style vector (2 x channels floats) per client, sent to every client.

Variants (``variant``, written to the run's config; summary.md names the one that ran):
* ``image`` (default, offline): no pretrained network can be downloaded here, so Enc = Dec = the
  identity: AdaIN on the images' own per-channel pixel statistics ([0, 1] pixels, before
  normalisation), the style bank holds 2 x C floats per client. A colour/contrast transfer, much
  weaker than the paper's VGG stylisation: a deviation, stated in every report.
* ``feature``: the paper's network, the normalised VGG-19 up to relu4_1 and the AdaIN decoder
  (Huang & Belongie, ICCV 2017), from local files (``encoder_path``, ``decoder_path``, state dicts
  of those two torch Sequentials, as the AdaIN release ships them). The style is 2 x 512 floats.
  Grey images are repeated to three channels and the output averaged back.

Choices:
* sigma_f of the content: the population std, + 1e-5 inside the root (the AdaIN paper's
  definition, the same as the style's); the reference code's unbiased std is not used.
* K = 3 (README, PACS/Office-Home), capped at the bank's size: in round 1 a client knows only its
  own style and trains on its own images (FedAvg).
* On the fly instead of offline: each shuffled batch of B originals becomes K x B images (every
  image with its K styles), shuffled and cut into K steps of B, so an epoch has K times the steps,
  as on the paper's K-fold dataset. The styles are redrawn each epoch (the paper draws once); the
  K copies of an image fall into the same K consecutive steps.
* Statistics at the data's resolution (the code resizes to 512 px for the feature variant).
* Only the overall (domain) style mode; the single-image mode is not implemented.

Where the defaults come from (``raysim methods ccst``): K = 3, the official README's overall-style
runs on PACS and Office-Home (K = 4 on Camelyon17, the number of source hospitals; gPerXAN: "K = N";
configs/gperxan/camelyon17_lodo.yaml sets it). ``variant: image`` is not the paper's form (that is
``feature``, the paper's VGG-19 AdaIN): the pretrained encoder and decoder cannot be fetched here, so
a default that needs them would fail on every config; it is a stated deviation, not a choice
between the paper's and the code's forms.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from raysim.core.aggregation import update_bank
from raysim.core.contract import ClientContext, Method, Upload
from raysim.core.errors import UserError
from raysim.core.hparams import Hparams, Space
from raysim.core.settings import setting

EPS = 1e-5  # inside the root of every std (spec 5.4)


@dataclass(frozen=True)
class CCSTHparams(Hparams):
    variant: str = setting("image", one_of=("image", "feature"), source="ours: no pretrained AdaIN weights offline (the paper: feature)", doc="image: pixel-statistics AdaIN | feature: the paper's VGG-19 AdaIN")
    k: int = setting(3, ge=1, source="official README (overall style, K=3 for PACS and Office-Home)", doc="styles per image (Camelyon17: 4)")
    encoder_path: str = setting("", source="ours: no file by default (the user supplies the AdaIN release's)", doc="feature variant: the normalised VGG-19 state dict (vgg_normalised.pth)")
    decoder_path: str = setting("", source="ours: no file by default (the user supplies the AdaIN release's)", doc="feature variant: the AdaIN decoder state dict (decoder.pth)")

    def __post_init__(self):
        if self.variant != "feature":
            return
        for key in ("encoder_path", "decoder_path"):
            path = getattr(self, key)
            if not path:
                raise UserError(f"hyperparameter 'hp.ccst.{key}' is missing: variant 'feature' needs the AdaIN "
                                f"{'VGG-19 encoder' if key == 'encoder_path' else 'decoder'} weights as a local file")
            if not os.path.isfile(os.path.expanduser(path)):
                raise UserError(f"hyperparameter 'hp.ccst.{key}' = {path!r}: no such file")

    @classmethod
    def search_space(cls):
        return {"k": Space.integer(1, 4)}


# ----------------------------------------------------------------------------- AdaIN

def channel_stats(f: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-instance, per-channel (mu, sigma) of N x C x H x W: population std, EPS inside the root."""
    mu = f.mean(dim=(2, 3), keepdim=True)
    return mu, (f.var(dim=(2, 3), keepdim=True, unbiased=False) + EPS).sqrt()


def adain(f: torch.Tensor, mu: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """sigma * (f - mu_f) / sigma_f + mu, with (mu, sigma) per instance and channel (N x C)."""
    mu_f, sigma_f = channel_stats(f)
    return sigma[..., None, None] * (f - mu_f) / sigma_f + mu[..., None, None]


class StyleSums:
    """Running float64 sums of f and f^2 per channel: S = (mu, sqrt(E[f^2] - E[f]^2 + EPS))."""

    def __init__(self):
        self.s1 = self.s2 = None
        self.n = 0

    def add(self, f: torch.Tensor) -> None:
        f = f.detach().double()
        s1, s2 = f.sum(dim=(0, 2, 3)), (f * f).sum(dim=(0, 2, 3))
        self.s1 = s1 if self.s1 is None else self.s1 + s1
        self.s2 = s2 if self.s2 is None else self.s2 + s2
        self.n += f.shape[0] * f.shape[2] * f.shape[3]

    def style(self) -> torch.Tensor:
        mu = self.s1 / self.n
        sigma = (self.s2 / self.n - mu * mu + EPS).clamp_min(EPS).sqrt()
        return torch.stack([mu, sigma]).float().cpu()  # 2 x C


# ----------------------------------------------------------------------------- the AdaIN network (feature variant)

def vgg_to_relu4_1() -> nn.Sequential:
    """The normalised VGG-19 of AdaIN up to relu4_1 (its first 31 modules, same indices)."""
    cfg = [(3, 64), (64, 64), "M", (64, 128), (128, 128), "M", (128, 256), (256, 256), (256, 256), (256, 256), "M",
           (256, 512)]
    layers: list[nn.Module] = [nn.Conv2d(3, 3, 1)]
    for c in cfg:
        if c == "M":
            layers.append(nn.MaxPool2d(2, 2, ceil_mode=True))
        else:
            layers += [nn.ReflectionPad2d(1), nn.Conv2d(c[0], c[1], 3), nn.ReLU()]
    return nn.Sequential(*layers)


def adain_decoder() -> nn.Sequential:
    """The AdaIN decoder: relu4_1 (512 channels) back to RGB, mirroring the encoder."""
    cfg = [(512, 256), "U", (256, 256), (256, 256), (256, 256), (256, 128), "U", (128, 128), (128, 64), "U",
           (64, 64), (64, 3)]
    layers: list[nn.Module] = []
    for i, c in enumerate(cfg):
        if c == "U":
            layers.append(nn.Upsample(scale_factor=2, mode="nearest"))
        else:
            layers += [nn.ReflectionPad2d(1), nn.Conv2d(c[0], c[1], 3)] + ([nn.ReLU()] if i < len(cfg) - 1 else [])
    return nn.Sequential(*layers)


def load_adain(encoder_path: str, decoder_path: str) -> tuple[nn.Module, nn.Module]:
    nets = []
    for path, net in ((encoder_path, vgg_to_relu4_1()), (decoder_path, adain_decoder())):
        try:
            sd = torch.load(os.path.expanduser(path), map_location="cpu", weights_only=True)
            keep = set(net.state_dict())
            net.load_state_dict({k: v for k, v in sd.items() if k in keep})
        except (OSError, RuntimeError, AttributeError) as e:
            raise UserError(f"ccst: cannot load AdaIN weights from {path!r} ({str(e).splitlines()[0]})") from None
        nets.append(net.eval().requires_grad_(False))
    return nets[0], nets[1]


# ----------------------------------------------------------------------------- the method

class CCST(Method):
    name = "ccst"
    Hparams = CCSTHparams
    paper = "Chen et al., WACV 2023 (cross-client style transfer)"
    shares = 'shares the model and per-client style vectors; keeps nothing'
    exchanges = ("one style vector per client (per-channel mean and std of its images, pooled; "
                 "variant 'image': 2 x C pixel statistics, 'feature': 2 x 512 VGG relu4_1 statistics), "
                 "every client's sent to every client")

    def __init__(self, hp, setup):
        super().__init__(hp, setup)
        self._nets = None  # (encoder, decoder) of the feature variant, loaded once per host

    def init_server(self, model):
        return {**super().init_server(model), "styles": {}}

    def broadcast(self, state, round):
        return {**super().broadcast(state, round), "styles": state["styles"]}

    def aggregate(self, state, uploads, round):
        new = super().aggregate(state, uploads, round)
        return {**new, "styles": update_bank(state["styles"], uploads, "style")}

    def server_metrics(self, state):
        return {"style_bank_clients": float(len(state["styles"]))} if state["styles"] else {}

    @classmethod
    def report_markdown(cls, config, metrics) -> str:
        # the value as configured, unchecked: summary.md names the variant that ran even where
        # the feature variant's weight files are not on this machine
        hp = (config.hp.get(cls.name) if config is not None else None) or {}
        variant = hp.get("variant", "image")
        what = ("image-level AdaIN on per-channel pixel statistics (offline variant, no VGG encoder/decoder)"
                if variant == "image" else
                "feature-level AdaIN with the user's VGG-19 encoder and decoder (the paper's)")
        return f"## CCST\n\nStyle transfer variant: `{variant}`: {what}."

    # ---- the stylisation network ---------------------------------------------------------------
    def encode(self, x01: torch.Tensor) -> torch.Tensor:
        if self.hp.variant == "image":
            return x01
        enc, _ = self.nets(x01.device)
        return enc(x01.expand(-1, 3, -1, -1) if x01.shape[1] == 1 else x01)

    def decode(self, f: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        if self.hp.variant == "image":
            return f
        _, dec = self.nets(f.device)
        out = dec(f)
        if out.shape[-2:] != like.shape[-2:]:
            out = F.interpolate(out, size=like.shape[-2:], mode="bilinear", align_corners=False)
        return out.mean(dim=1, keepdim=True) if like.shape[1] == 1 else out

    def nets(self, device):
        if self._nets is None:
            self._nets = load_adain(self.hp.encoder_path, self.hp.decoder_path)
        enc, dec = self._nets
        return enc.to(device), dec.to(device)

    @torch.no_grad()
    def stylise(self, x01: torch.Tensor, styles: torch.Tensor) -> torch.Tensor:
        """Dec(AdaIN(Enc(x); S)) per image (``styles``: N x 2 x C), clipped to [0, 1]."""
        return self.decode(adain(self.encode(x01), styles[:, 0], styles[:, 1]), x01).clamp(0, 1)

    # ---- the client ----------------------------------------------------------------------------
    def local_update(self, ctx: ClientContext) -> Upload:
        mean, std = ctx.data.train.normalisation.tensors(ctx.device)
        extras = {}
        if not ctx.state.get("uploaded"):
            sums = StyleSums()
            with torch.no_grad():
                for x, _ in ctx.batches(1, max_steps=None):  # one pass, no step
                    sums.add(self.encode((x * std + mean).clamp(0, 1)))
            extras["style"] = sums.style()
            ctx.state["uploaded"] = True
        bank = dict(ctx.payload["styles"])
        ids = sorted(set(bank) | {ctx.client_id})
        k = min(self.hp.k, len(ids))
        cap = ctx.train.max_steps
        model, opt = ctx.model, ctx.optimizer()
        for x, y in ctx.batches():
            if k == 1 and len(ids) == 1:  # only its own style: the original images
                ctx.step(F.cross_entropy(model(x), y), opt)
                continue
            xs, ys = self.augment(x, y, ids, bank, ctx.client_id, k, mean, std, ctx.generator)
            for xb, yb in zip(xs.split(len(x)), ys.split(len(x))):
                if cap and ctx.steps >= cap:
                    break
                ctx.step(F.cross_entropy(model(xb), yb), opt)
        up = self.upload(ctx, ctx.stats())
        up.extras = extras
        return up

    def augment(self, x, y, ids, bank, own, k, mean, std, g):
        """The K x B images of a batch (each with K distinct styles; its own style: x itself), shuffled."""
        n = len(x)
        picks = torch.rand(n, len(ids), generator=g).argsort(dim=1)[:, :k]  # K distinct clients per image
        style_of = torch.stack([bank[i] if i in bank else torch.zeros_like(next(iter(bank.values())))
                                for i in ids]).to(x.device)
        x01 = (x * std + mean).clamp(0, 1)
        out = []
        for col in range(k):
            who = picks[:, col].to(x.device)
            mine = torch.tensor([ids[i] == own for i in picks[:, col].tolist()], device=x.device)
            styled = self.stylise(x01, style_of[who])
            out.append(torch.where(mine.view(-1, 1, 1, 1), x, (styled - mean) / std))
        xs, ys = torch.cat(out), y.repeat(k)
        order = torch.randperm(len(xs), generator=g).to(x.device)
        return xs[order], ys[order]

