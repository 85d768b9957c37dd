"""FedSR — A. T. Nguyen, P. Torr, S.-N. Lim, "FedSR: A Simple and Effective Domain Generalization
Method for Federated Learning", NeurIPS 2022 (Alg. 1; baselines spec 5.1).

A probabilistic representation: the encoder outputs 2d numbers per image, mu(x) and
sigma(x) = softplus(raw); training draws one z = mu + sigma * e, e ~ N(0, I), and the classifier h
acts on z. Client k, round t, from the global encoder and classifier:
    L = CE(h(z), y) + alpha_L2R * E||z||_2 + alpha_CMI * E KL( N(C mu, (C sigma)^2) || r(z|y) )
        r(z|y) = N(r_mu[y], r_sigma[y]^2),  r_sigma = softplus(raw),  C a learnable scalar
        KL per dimension: log r_sigma - log(C sigma) + (C^2 sigma^2 + (C mu - r_mu)^2) / (2 r_sigma^2) - 1/2,
        summed over the d dimensions, averaged over the batch
    upload the encoder and the classifier; keep r_mu, r_sigma, C on the client.
Server: the mean of the encoders and classifiers (train.weighting: n_k by default; the official code
averages uniformly, ``train.weighting: uniform``).
Prediction: log mean_{s=1..S} softmax(h(z_s)), S = 20 samples of z.

Where the defaults come from (``raysim methods fedsr`` lists each one's source):
* alpha_L2R = 0.01, alpha_CMI = 5e-4, z_dim 512 on ResNet-18, S = 20: the official code
  (atuannguyen/FedSR); DapperFL Table 4 runs (0.01, 0.001), set in its configs.
* L2R form (spec 5.1 pitfall 1): the paper writes E||z||_2^2, the official code computes the mean
  *unsquared* norm E||z||_2, and alpha_L2R = 0.01 was tuned on the code's form, so the code's form
  is the default (``l2r: norm``); ``l2r: squared`` gives the paper's equation.
* r(z|y) and C are local client state, as in the official code (``reference: local``);
  ``reference: global`` makes them part of the averaged model. They are optimised by the same
  optimizer as the network (the protocol's lr, momentum and weight decay; the official code uses
  momentum 0.9, which is its protocol's), initialised r_mu = 0, raw r_sigma = 1, C = 1 (the code).
* The encoder is the zoo backbone's ``features`` followed by Linear(feature_dim, 2 z_dim)
  (the official code replaces ResNet-18's fc by Linear(512, 2 * 512)); the classifier is
  Linear(z_dim, classes). ``z_dim`` 0 means the backbone's feature_dim.
* Prediction noise comes from a generator keyed by (seed, 0, server, "fedsr_eval"), re-seeded
  for every evaluation batch, so a client's score does not depend on which host
  evaluates it or in which order; ``eval_rule: mean`` predicts from h(mu) instead (ours).
* Local steps follow the protocol's epochs (the official code counts 5 *iterations* per round).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from raysim.core.contract import ClientContext, Method, Upload
from raysim.core.hparams import Hparams, Space
from raysim.models.base import Net
from raysim.core.seeding import SERVER, generator_for
from raysim.core.settings import setting

REFERENCE = ("ref_mu", "ref_sigma_raw", "ref_c")  # r_mu, raw r_sigma, C: parameters of FedSRNet


@dataclass(frozen=True)
class FedSRHparams(Hparams):
    alpha_l2r: float = setting(0.01, ge=0, source="official code (atuannguyen/FedSR); DapperFL Table 4 agrees", doc="tuned on l2r: norm")
    alpha_cmi: float = setting(0.0005, ge=0, source="official code (atuannguyen/FedSR)", doc="DapperFL Table 4: 0.001")
    z_dim: int = setting(0, ge=0, source="official code (512 = ResNet-18's feature_dim)", doc="0: the backbone's feature_dim")
    num_samples: int = setting(20, ge=1, source="official code (atuannguyen/FedSR)", doc="z samples of a test prediction")
    l2r: str = setting("norm", one_of=("norm", "squared"), source="official code (the paper writes E||z||^2; spec 5.1 pitfall 1)", doc="E||z|| (code) | E||z||^2 (paper)")
    reference: str = setting("local", one_of=("local", "global"), source="official code (spec 5.1 pitfall 2)", doc="where r(z|y) and C live")
    eval_rule: str = setting("sample", one_of=("sample", "mean"), source="official code (atuannguyen/FedSR)", doc="mean: h(mu) (ours)")

    @classmethod
    def search_space(cls):
        return {"alpha_l2r": Space.choice(0.01, 0.05, 0.1),  # FDSE repo's grid
                "alpha_cmi": Space.choice(0.0005, 0.001, 0.3)}


# ----------------------------------------------------------------------------- the equations

def l2r_term(z: torch.Tensor, squared: bool = False) -> torch.Tensor:
    """E_b ||z_b||_2 (official code) or E_b ||z_b||_2^2: z = [3, 4] gives 5 or 25."""
    norms = z.norm(dim=1)
    return (norms ** 2 if squared else norms).mean()


def cmi_term(mu: torch.Tensor, sigma: torch.Tensor, r_mu: torch.Tensor, r_sigma: torch.Tensor,
             c: torch.Tensor) -> torch.Tensor:
    """E_b sum_d KL(N(C mu, (C sigma)^2) || N(r_mu, r_sigma^2)); ``r_mu``/``r_sigma`` already
    indexed by each sample's label (B x d)."""
    cm, cs = c * mu, c * sigma
    kl = torch.log(r_sigma) - torch.log(cs) + (cs ** 2 + (cm - r_mu) ** 2) / (2 * r_sigma ** 2) - 0.5
    return kl.sum(dim=1).mean()


def mc_log_predict(head: nn.Module, mu: torch.Tensor, sigma: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """log mean_s softmax(h(mu + sigma * e_s)) for ``noise`` e of shape S x B x d."""
    z = mu[None] + sigma[None] * noise
    probs = F.softmax(head(z), dim=-1).mean(dim=0)
    return torch.log(probs.clamp_min(torch.finfo(probs.dtype).tiny))


# ----------------------------------------------------------------------------- the model

class FedSRNet(Net):
    """``features`` outputs (mu, raw sigma) as 2 z_dim numbers; ``head`` classifies z. Holds the
    reference distribution r(z|y) and C as parameters (kept local unless ``reference: global``).
    Forward: one sampled z in train mode, the Monte-Carlo prediction (or h(mu)) in eval mode."""

    def __init__(self, backbone: Net, z_dim: int, num_classes: int, num_samples: int = 20,
                 eval_rule: str = "sample"):
        encoder = nn.Sequential(backbone.features, nn.Linear(backbone.feature_dim, 2 * z_dim))
        super().__init__(encoder, nn.Linear(z_dim, num_classes), backbone.input_shape)
        self.z_dim, self.num_samples, self.eval_rule = z_dim, num_samples, eval_rule
        self.ref_mu = nn.Parameter(torch.zeros(num_classes, z_dim))
        self.ref_sigma_raw = nn.Parameter(torch.ones(num_classes, z_dim))
        self.ref_c = nn.Parameter(torch.ones(()))
        self.generator: torch.Generator | None = None  # train-mode forward only (local_update samples itself)
        self.eval_seed: int | None = None  # evaluation: the seed every batch's noise is drawn with

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.features(x)
        return out[:, :self.z_dim], F.softplus(out[:, self.z_dim:])

    def noise(self, shape, like: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        if generator is None:  # never the global RNG
            raise RuntimeError("FedSRNet needs a generator to sample z")
        return torch.randn(shape, generator=generator).to(like.device, like.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mu, sigma = self.encode(x)
        if self.training:  # (a train-mode pass without a generator, e.g. re-estimating BN statistics: z = mu)
            return self.head(mu if self.generator is None else mu + sigma * self.noise(mu.shape, mu, self.generator))
        if self.eval_rule == "mean":
            return self.head(mu)
        gen = torch.Generator().manual_seed(self.eval_seed if self.eval_seed is not None else 0)
        return mc_log_predict(self.head, mu, sigma, self.noise((self.num_samples, *mu.shape), mu, gen))


class FedSR(Method):
    name = "fedsr"
    Hparams = FedSRHparams
    paper = "Nguyen, Torr, Lim, NeurIPS 2022"
    shares = 'shares encoder and classifier; keeps its reference distribution (reference: local)'

    def build_model(self) -> nn.Module:
        backbone = super().build_model()
        hp = self.hp
        model = FedSRNet(backbone, hp.z_dim or backbone.feature_dim, backbone.num_classes, hp.num_samples, hp.eval_rule)
        model.eval_seed = generator_for(self.setup.seed, 0, SERVER, "fedsr_eval").initial_seed()
        return model

    def personal_keys(self, model):
        return set(REFERENCE) if self.hp.reference == "local" else set()

    def local_update(self, ctx: ClientContext) -> Upload:
        model, hp = ctx.model, self.hp
        opt = ctx.optimizer()  # the network, r_mu, r_sigma and C
        l2r_sum = cmi_sum = 0.0
        for x, y in ctx.batches():
            mu, sigma = model.encode(x)
            z = mu + sigma * model.noise(mu.shape, mu, ctx.generator)
            loss = F.cross_entropy(model.head(z), y)
            l2r = l2r_term(z, hp.l2r == "squared")
            cmi = cmi_term(mu, sigma, model.ref_mu[y], F.softplus(model.ref_sigma_raw)[y], model.ref_c)
            ctx.step(loss + hp.alpha_l2r * l2r + hp.alpha_cmi * cmi, opt)
            l2r_sum, cmi_sum = l2r_sum + l2r.detach().double(), cmi_sum + cmi.detach().double()
        stats = ctx.stats()
        n = max(stats["steps"], 1)
        stats.update(l2r=float(l2r_sum) / n, cmi=float(cmi_sum) / n)
        return self.upload(ctx, stats)
