"""FDSE - Wang et al., "Federated Learning with Domain Shift Eraser", CVPR 2025.

Model (Sec. 4.1, Tables A6/A7; :mod:`raysim.methods.fdse_layers`): every conv and hidden FC
layer is decomposed into a shared DFE (conv ceil(T/G) channels, BN_DFE) and a personalized DSE
(BN_DSE + ReLU + depthwise cheap op), theta_k = [theta_u ; theta_v,k].

Client k, round t (Alg. 1 lines 5-10):
    mu_g, sigma2_g  <- BN_DFE running stats of the received model (one pair per DSE block l)
    for every batch b:                                   E epochs of SGD, grad clip, wd from train
        mu_b, sigma2_b = per-channel batch mean / biased variance of Z^(l) = BN_DFE input  (Eq. 4)
        mu_hat  = gamma mu_hat  + (1 - gamma) mu_b                                          (Eq. 5)
        sigma2_hat = gamma sigma2_hat + (1 - gamma) sigma2_b
        L_con^(l) = ||mu_hat - mu_g||^2 / d + ((||sigma2_hat||_1 - ||sigma2_g||_1) / d)^2      (Eq. 6)
        L = CE + lambda * sum_l softmax(beta l)_l L_con^(l)       (Eq. 7; skipped in round 1)
    upload theta_u (DFE, BN_DFE, head), theta_v,k (BN_DSE affine, cheap op), BN_DFE running stats;
    BN_DSE running stats never leave the client.

Server (Alg. 1 line 12), each state-dict tensor separately:
    theta_u: dbar = mean_k ||D_k||, dhat_k = D_k / ||D_k||,
             u = argmin_{u in simplex} ||sum_k u_k dhat_k||^2,  theta_u += dbar sum_k u_k dhat_k  (Eq. 8)
    theta_v: V = [theta_v,1 ; ... ; theta_v,N], Q = K = row-normalised V,
             [theta_v,k,next]_k = softmax(Q K^T / tau) V; client k receives row k           (Eq. 9)
    BN_DFE running stats: plain mean over clients.

Unseen client (Sec. 5.4, Alg. 3; spec 9.26): theta_u and the BN_DFE statistics as broadcast,
theta_v = the uniform mean of the clients' Eq. 9 mixes, BN_DSE statistics = the uniform mean of
the clients'; then, label-free on its unlabeled data, E' epochs of SGD (step size eta = the last
training round's lr, batch 50) on theta_v alone to minimise sum_l w_l L_Con^(l) against the frozen
BN_DFE statistics (BN_DFE in eval mode, BN_DSE in train mode, re-estimating its statistics).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from raysim.errors import UserError
from raysim.methods.base import ClientContext, Hparams, Method, Space, Upload, Uploads, load_tensors
from raysim.methods.fdse_layers import ACTIVATIONS, dse_blocks, decompose
from raysim.training import train_epochs

EPS = 1e-8  # added to norms in Eqs. 8 and 9 (the spec's zero-norm guard)


# ============================================================================= hyperparameters

@dataclass(frozen=True)
class FDSEHparams(Hparams):
    lam: float = 0.1  # lambda, weight of L_Con (paper grid {0.01, 0.1, 1}; chosen value unreported)
    tau: float = 0.5  # Eq. 9 temperature (paper grid {0.001, 0.01, 0.1, 0.5}; official configs 0.5)
    beta: float = 0.001  # Eq. 7 depth exponent, fixed by the paper
    gamma: float = 0.9  # Eq. 5 EMA momentum (weight on the old value) = 1 - BN momentum 0.1
    G: int = 2  # DSE expansion ratio (Table A6: 2 everywhere)
    dw: int = 3  # cheap depthwise kernel of conv blocks (Table A6: 3)
    dw_fc: int = 1  # cheap op kernel of FC blocks (Table A6: 1, a per-channel scale)
    # ---- switches (defaults = the paper; alternatives = official code or ablations) ----
    dse_act: str = "relu"  # activation after BN_DSE: "relu" (Eq. 3, Table A7) | "none" (latest code)
    con_mode: str = "paper"  # "paper" (Eq. 6, per-channel) | "code_v2" (latest code's KL-like loss)
    skip_first_round: bool = True  # no L_Con in round 1 (global BN stats still at 0 / 1)
    shared_agg: str = "consensus"  # "consensus" (Eq. 8) | "mean" (ablation "w/o A": FedAvg mean)
    dse_agg: str = "attention"  # "attention" (Eq. 9) | "local" (ablation "w/o B") | "mean"
    # ---- unseen-client adaptation (Alg. 3; the paper gives no E or eta: spec 9.26) ----
    adapt_epochs: int = 5  # 0: no adaptation (Table 2's "- align" row)
    adapt_lr: float = 0.0  # eta; 0: the learning rate of the last training round
    adapt_batch: int = 50

    def __post_init__(self):
        choices = {"dse_act": ACTIVATIONS, "con_mode": ("paper", "code_v2"),
                   "shared_agg": ("consensus", "mean"), "dse_agg": ("attention", "local", "mean")}
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise UserError(f"hyperparameter 'hp.fdse.{key}' = {getattr(self, key)!r}: "
                                f"expected one of {', '.join(allowed)}")
        if self.tau <= 0:
            raise UserError(f"hyperparameter 'hp.fdse.tau' = {self.tau}: expected > 0")
        if self.lam < 0:
            raise UserError(f"hyperparameter 'hp.fdse.lam' = {self.lam}: expected >= 0")
        if not 0 <= self.gamma < 1:
            raise UserError(f"hyperparameter 'hp.fdse.gamma' = {self.gamma}: expected 0 <= gamma < 1")
        if self.adapt_epochs < 0 or self.adapt_lr < 0 or self.adapt_batch < 2:
            raise UserError("hyperparameters 'hp.fdse.adapt_epochs' >= 0, 'adapt_lr' >= 0 and 'adapt_batch' >= 2 "
                            f"expected; got {self.adapt_epochs}, {self.adapt_lr}, {self.adapt_batch}")
        if self.G < 2 or self.dw < 1 or self.dw_fc < 1 or self.dw % 2 == 0 or self.dw_fc % 2 == 0:
            raise UserError("hyperparameters 'hp.fdse.G' >= 2 and odd 'hp.fdse.dw'/'dw_fc' >= 1 expected")

    @classmethod
    def search_space(cls):
        # Sec. A7.4: beta fixed, lambda in {0.01, 0.1, 1}, tau in {0.001, 0.01, 0.1, 0.5}.
        return {"lam": Space.log(0.01, 1.0), "tau": Space.log(0.001, 0.5)}


# ============================================================================= key roles

def key_role(key: str) -> str:
    """Role of a state-dict entry of an FDSE model.

    "local":  BN_DSE running statistics (and every BN's batch counter): never leave the client;
    "dse":    BN_DSE affine and the cheap op: theta_v, personalized by Eq. 9;
    "stat":   BN_DFE running mean/var: averaged;
    "shared": everything else (DFE convs/linears, BN_DFE affine, head): theta_u, Eq. 8.
    """
    parts = key.split(".")
    leaf, owners = parts[-1], parts[:-1]
    if leaf == "num_batches_tracked":
        return "local"
    if "bn_dse" in owners:
        return "local" if leaf in ("running_mean", "running_var") else "dse"
    if "cheap" in owners:
        return "dse"
    if leaf in ("running_mean", "running_var"):
        return "stat"
    return "shared"


# ============================================================================= Eqs. 4-7

def batch_stats(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 4 per channel: mean and biased variance over (batch[, H, W]), as BN computes them."""
    dims = (0,) if z.dim() == 2 else (0, *range(2, z.dim()))
    return z.mean(dim=dims), z.var(dim=dims, unbiased=False)


def layer_weights(num_layers: int, beta: float) -> torch.Tensor:
    """Eq. 7: w_l = exp(beta l) / sum_l' exp(beta l'), l = 1..L."""
    return torch.softmax(beta * torch.arange(1, num_layers + 1, dtype=torch.float64), 0).float()


def consistency_term(mu_hat: torch.Tensor, var_hat: torch.Tensor, mu_g: torch.Tensor,
                     var_g: torch.Tensor) -> torch.Tensor:
    """Eq. 6: ||mu_hat - mu_g||^2 / d + ((||var_hat||_1 - ||var_g||_1) / d)^2."""
    d = mu_hat.numel()
    return ((mu_hat - mu_g) ** 2).sum() / d + ((var_hat.abs().sum() - var_g.abs().sum()) / d) ** 2


class ConsistencyRegularizer:
    """L_Con over the DSE blocks of a model, with one EMA pair per block (Eq. 5).

    The global statistics are snapshotted from the BN_DFE layers when it is built (i.e. from the
    received model, before any local step). Each block's BN_DFE input is captured by a forward
    pre-hook; :meth:`loss` is then called once per training step, after the forward pass. The EMA
    starts from the first batch's statistics, and its history is detached every step so that the
    gradient flows only through the current batch's statistics.
    """

    def __init__(self, bn_dfe_layers: list, gamma: float, beta: float, mode: str = "paper"):
        self.layers = list(bn_dfe_layers)
        self.mu_g = [bn.running_mean.detach().clone() for bn in self.layers]
        self.var_g = [bn.running_var.detach().clone() for bn in self.layers]
        self.w = layer_weights(len(self.layers), beta)
        self.gamma, self.mode = gamma, mode
        self.z: list[torch.Tensor | None] = [None] * len(self.layers)
        self.ema_mu: list[torch.Tensor | None] = [None] * len(self.layers)
        self.ema_var: list[torch.Tensor | None] = [None] * len(self.layers)
        self.chain: tuple | None = None  # code_v2: one (mean, var) pair chained over layers and steps
        self.total, self.steps = 0.0, 0

    def attach(self, in_eval_mode: bool = False) -> list:
        """Capture each BN_DFE input in training forward passes (or in every forward pass: Alg. 3
        adapts with BN_DFE in eval mode)."""
        def capture(index):
            def hook(module, inputs):
                if module.training or in_eval_mode:
                    self.z[index] = inputs[0]
            return hook
        return [bn.register_forward_pre_hook(capture(i)) for i, bn in enumerate(self.layers)]

    def _ema(self, old, new):
        return new if old is None else self.gamma * old.detach() + (1 - self.gamma) * new

    def loss(self) -> torch.Tensor:
        if any(z is None for z in self.z):
            raise RuntimeError("FDSE: a DSE block's output was not captured in this forward pass")
        terms = self._paper() if self.mode == "paper" else self._code_v2()
        value = sum(self.w[i].to(t.device) * t for i, t in enumerate(terms))
        self.z = [None] * len(self.layers)
        self.total += float(value.detach())
        self.steps += 1
        return value

    def _paper(self) -> list[torch.Tensor]:
        terms = []
        for i, z in enumerate(self.z):
            mu, var = batch_stats(z)
            self.ema_mu[i] = self._ema(self.ema_mu[i], mu)
            self.ema_var[i] = self._ema(self.ema_var[i], var)
            terms.append(consistency_term(self.ema_mu[i], self.ema_var[i],
                                          self.mu_g[i].to(z.device), self.var_g[i].to(z.device)))
        return terms

    def _code_v2(self) -> list[torch.Tensor]:
        """The latest official code's term (spec Sec. 10, items 1-3), kept as an option.

        Per block: c = per-channel means of Z; scalars m = mean(c), v = unbiased var(c); one
        (m, v) EMA chained over all blocks and steps; term = mean_c[(mu_g^2 - m^2) / (2 v)]
        + 0.5 mean_c[log(v / var_g) + var_g / v].
        """
        terms = []
        m_old, v_old = self.chain if self.chain is not None else (None, None)
        for i, z in enumerate(self.z):
            c = batch_stats(z)[0]
            m_new, v_new = c.mean(), c.var(unbiased=True)
            m = m_new if m_old is None else self.gamma * m_old + (1 - self.gamma) * m_new
            v = v_new if v_old is None else self.gamma * v_old + (1 - self.gamma) * v_new
            mu_g, var_g = self.mu_g[i].to(z.device), self.var_g[i].to(z.device)
            terms.append(((mu_g ** 2 - m ** 2) / (2 * v)).mean()
                         + 0.5 * (torch.log(v / var_g) + var_g / v).mean())
            m_old, v_old = m, v
        self.chain = (m_old.detach(), v_old.detach())
        return terms


# ============================================================================= Eq. 8

def min_norm_simplex(gram: np.ndarray, tol: float = 1e-12, max_iter: int = 1000) -> np.ndarray:
    """argmin_{u >= 0, sum u = 1} u^T M u for a Gram matrix M = [<d_i, d_j>] (exact).

    Wolfe's minimum-norm-point algorithm on the convex hull of the d_k, written on the Gram
    matrix only: a finite active-set method whose corral (support) stays affinely independent,
    so each affine sub-problem is a small regular linear system. Returns the weights u.
    """
    M = np.asarray(gram, dtype=np.float64)
    n = M.shape[0]
    if n == 1:
        return np.ones(1)
    scale = max(float(np.max(np.abs(np.diag(M)))), 1e-300)
    lam = np.zeros(n)
    first = int(np.argmin(np.diag(M)))
    lam[first] = 1.0
    S = [first]
    for _ in range(max_iter):
        g = M @ lam  # <x, d_k>
        xx = float(lam @ g)  # ||x||^2
        k = int(np.argmin(g))
        if g[k] >= xx - tol * scale or k in S:  # Wolfe's criterion: x is the min-norm point
            break
        S.append(k)
        for _ in range(max_iter):  # minor cycle
            alpha = _affine_minimizer(M, S)
            if np.all(alpha > tol):
                lam[:] = 0.0
                lam[S] = alpha
                break
            # move from lam towards alpha until the first weight hits zero, drop it, repeat
            cur = lam[S]
            neg = alpha <= tol
            denom = cur[neg] - alpha[neg]  # >= cur >= 0
            theta = float(np.min(np.where(denom > 0, cur[neg] / np.where(denom > 0, denom, 1.0), 0.0)))
            new = cur + theta * (alpha - cur)
            lam[:] = 0.0
            keep = [(s, v) for s, v in zip(S, new) if v > tol]
            S = [s for s, _ in keep]
            lam[S] = [v for _, v in keep]
        if k not in S:  # the new point did not enter the corral: no further progress possible
            break
    lam = np.clip(lam, 0.0, None)
    return lam / lam.sum()


def _affine_minimizer(M: np.ndarray, S: list[int]) -> np.ndarray:
    """argmin ||sum_{i in S} a_i d_i||^2 s.t. sum a = 1: the KKT system [[M_SS, 1], [1^T, 0]]."""
    m = len(S)
    K = np.zeros((m + 1, m + 1))
    K[:m, :m] = M[np.ix_(S, S)]
    K[:m, m] = 1.0
    K[m, :m] = 1.0
    rhs = np.zeros(m + 1)
    rhs[m] = 1.0
    sol = np.linalg.lstsq(K, rhs, rcond=None)[0]
    return sol[:m]


def consensus_update(current: torch.Tensor, uploads: list[torch.Tensor]) -> tuple[torch.Tensor, np.ndarray]:
    """Eq. 8 for one tensor: (dbar * sum_k u_k dhat_k, u). Zero updates: see :data:`EPS`.

    A client whose update is exactly zero contributes dhat_k = 0, which puts the origin in the
    hull, so the min-norm point is 0 and the tensor does not move (as with the code's eps);
    when every update is zero the tensor is left unchanged as well.
    """
    base = current.detach().to("cpu", torch.float64).reshape(-1)
    D = torch.stack([u.detach().to("cpu", torch.float64).reshape(-1) - base for u in uploads]).numpy()
    norms = np.linalg.norm(D, axis=1)
    if not np.any(norms > 0):
        return torch.zeros_like(current, dtype=torch.float64, device="cpu"), np.full(len(uploads), 1 / len(uploads))
    scale = 1.0 / (norms + EPS)  # dhat_k = D_k * scale_k, never materialised
    u = min_norm_simplex((D @ D.T) * np.outer(scale, scale))
    delta = norms.mean() * ((u * scale) @ D)
    return torch.from_numpy(delta).reshape(current.shape), u


# ============================================================================= Eq. 9

def similarity_attention(V: torch.Tensor, tau: float) -> torch.Tensor:
    """Eq. 9's weights softmax(Q K^T / tau), Q = K = the row-normalised V (rows: clients);
    row k is how client k's next DSE mixes the clients' current ones."""
    V = V.to(torch.float64).reshape(V.shape[0], -1)
    Q = V / (V.norm(dim=1, keepdim=True) + EPS)
    return torch.softmax(Q @ Q.T / tau, dim=1)


def similarity_mix(V: torch.Tensor, tau: float) -> torch.Tensor:
    """Eq. 9: softmax(Q K^T / tau) V."""
    return similarity_attention(V, tau) @ V.to(torch.float64).reshape(V.shape[0], -1)


# ============================================================================= the method

class _NoSingletonBatches:
    """A client's data whose training batches skip a final batch of one sample (BN needs two)."""

    def __init__(self, data):
        self._data = data

    def __getattr__(self, name):
        return getattr(self._data, name)

    def batches(self, batch_size, generator, device, drop_last=False):
        for x, y in self._data.batches(batch_size, generator, device, drop_last=drop_last):
            if len(y) > 1:
                yield x, y


class FDSE(Method):
    name = "fdse"
    Hparams = FDSEHparams
    aggregation = "per_client"
    paper = "Wang et al., CVPR 2025"

    # ---- model (Sec. 4.1) -------------------------------------------------------------------
    def build_model(self):
        from raysim.models import build
        m = self.setup.model
        if m.pretrained:
            raise UserError("FDSE re-creates every layer as a DSE block; 'model.pretrained' cannot be used")
        base = build(m.name, num_classes=self.setup.num_classes, in_channels=self.setup.image_shape[0],
                     input_size=self.setup.image_shape[-1], norm="bn", **m.options)
        hp = self.hp
        return decompose(base, G=hp.G, dw=hp.dw, dw_fc=hp.dw_fc, dse_act=hp.dse_act)

    def personal_keys(self, model):
        return {k for k in model.state_dict() if key_role(k) == "local"}

    # ---- server -----------------------------------------------------------------------------
    def init_server(self, model):
        sd = model.state_dict()
        return {"global": {k: v.detach().clone() for k, v in sd.items() if key_role(k) in ("shared", "stat")},
                "dse_init": {k: v.detach().clone() for k, v in sd.items() if key_role(k) == "dse"},
                "dse": {}}  # client id -> its Eq. 9 mix (Alg. 1 line 2: the initial DSE until then)

    def client_payload(self, state, client_id, round):
        # Alg. 1 line 2: theta_v,k^0 = theta_v^0 until the client's first Eq. 9 mix
        return {"dse": state["dse"].get(client_id, state["dse_init"])}

    def aggregate(self, state: dict, uploads: Uploads, round: int) -> dict:
        each = uploads.each or {}
        if not each:
            return state
        ids = sorted(each)
        ups = [each[k] for k in ids]
        new_global = {}
        for key, cur in state["global"].items():
            vals = [u.tensors[key] for u in ups]
            if key_role(key) == "stat":  # BN_DFE running stats: "directly average them"
                new_global[key] = torch.stack([v.double() for v in vals]).mean(0).to(cur.dtype)
            elif not cur.is_floating_point():
                new_global[key] = cur
            elif self.hp.shared_agg == "consensus":  # Eq. 8
                delta, _ = consensus_update(cur, vals)
                new_global[key] = (cur.double() + delta).to(cur.dtype)
            else:  # ablation "w/o A": FedAvg's weighted mean
                w = torch.tensor([u.weight for u in ups], dtype=torch.float64)
                stacked = torch.stack([v.double() for v in vals])
                new_global[key] = (torch.tensordot(w / w.sum(), stacked, dims=1)).to(cur.dtype)
        mixes = {k: dict(v) for k, v in state["dse"].items()}
        self_weights = []
        for key, init in state["dse_init"].items():
            V = torch.stack([u.tensors[key].double().reshape(-1) for u in ups])
            if self.hp.dse_agg == "attention":  # Eq. 9
                A = similarity_attention(V, self.hp.tau)
                self_weights.append(float(A.diagonal().mean()))
                rows = A @ V
            elif self.hp.dse_agg == "local":  # ablation "w/o B": DSE stays with its client
                rows = V
            else:
                rows = V.mean(0, keepdim=True).expand_as(V)
            for i, k in enumerate(ids):
                mixes.setdefault(k, {})[key] = rows[i].reshape(init.shape).to(init.dtype).clone()
        # diagnostics: the weight a client keeps on its own DSE in Eq. 9 (mean over tensors, clients)
        return {**state, "global": new_global, "dse": mixes,
                "dse_self_weight": float(np.mean(self_weights)) if self_weights else 1.0}

    def server_metrics(self, state):
        return {"dse_self_weight": state["dse_self_weight"]} if "dse_self_weight" in state else {}

    # ---- client -----------------------------------------------------------------------------
    def load_client_model(self, model, payload, state):
        load_tensors(model, payload["global"])  # theta_u and the averaged BN_DFE stats
        personal = payload.get("personal") or {}
        load_tensors(model, personal.get("dse", {}))  # this client's theta_v,k (Eq. 9 row)
        load_tensors(model, state.get("personal", {}))  # its own BN_DSE running stats

    def local_update(self, ctx: ClientContext) -> Upload:
        hp = self.hp
        reg = None
        handles = []
        if hp.lam > 0 and not (hp.skip_first_round and ctx.round == 1):
            reg = ConsistencyRegularizer([b.bn_dfe for _, b in dse_blocks(ctx.model)], hp.gamma, hp.beta,
                                         hp.con_mode)
            handles = reg.attach()
        try:
            stats = train_epochs(dataclasses.replace(ctx, data=_NoSingletonBatches(ctx.data)),
                                 extra_loss=(lambda model, x, y, logits: hp.lam * reg.loss()) if reg else None)
        finally:
            for h in handles:
                h.remove()
        if reg is not None and reg.steps:
            stats["con_loss"] = reg.total / reg.steps
        return self.upload(ctx, stats)

    # ---- the global model and an unseen client (Sec. 5.4, Alg. 3) ---------------------------
    def eval_payload(self, state, round):
        """Adds the unseen client's theta_v: the uniform mean of the clients' Eq. 9 mixes."""
        mixes = list(state["dse"].values())
        dse = {k: torch.stack([m[k].double() for m in mixes]).mean(0).to(init.dtype) if mixes else init
               for k, init in state["dse_init"].items()}
        return {"global": state["global"], "dse_mean": dse}

    def global_eval_model(self, model, payload):
        load_tensors(model, payload["global"])  # theta_u and the averaged BN_DFE statistics
        load_tensors(model, payload["dse_mean"])  # mean theta_v
        load_tensors(model, payload.get("personal_mean", {}))  # mean BN_DSE statistics
        return model

    def adapt_to_unseen(self, model, client):
        """Alg. 3: minimise L_Con over the unseen client's unlabeled data, DSE parameters only."""
        hp = self.hp
        if hp.adapt_epochs == 0:
            return False
        blocks = [b for _, b in dse_blocks(model)]
        dse_params = [p for b in blocks for p in (*b.bn_dse.parameters(), *b.cheap.parameters())]
        model.eval()  # line 1: BN_DFE keeps (and normalises with) the global statistics
        for b in blocks:
            b.bn_dse.train()  # BN_DSE statistics re-estimated on the target (spec 9.26)
        model.requires_grad_(False)
        for p in dse_params:
            p.requires_grad_(True)  # line 1: every other trainable parameter frozen
        reg = ConsistencyRegularizer([b.bn_dfe for b in blocks], hp.gamma, hp.beta, hp.con_mode)
        handles = reg.attach(in_eval_mode=True)
        opt = torch.optim.SGD(dse_params, lr=hp.adapt_lr or client.lr)
        try:
            for _ in range(hp.adapt_epochs):  # lines 2-9
                for x in client.unlabeled_batches(hp.adapt_batch):
                    model(x)
                    loss = reg.loss()
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
        finally:
            for h in handles:
                h.remove()
            model.requires_grad_(True)
            model.eval()
        return True
