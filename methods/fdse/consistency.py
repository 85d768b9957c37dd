"""FDSE's consistency regularizer (Sec. 4.2, Eqs. 4-7): the statistics of each DSE block's output
pulled towards the global BN_DFE statistics, during local training and in the unseen-client
adaptation (Alg. 3)."""
from __future__ import annotations

import torch

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
