"""FDSE's server step (Sec. 4.3): consensus-maximising aggregation of the shared parameters
(Eq. 8) and similarity-aware personalisation of the DSE parameters (Eq. 9)."""
from __future__ import annotations

import numpy as np
import torch

EPS = 1e-8  # added to norms in Eqs. 8 and 9 (the spec's zero-norm guard)


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


def similarity_attention(V: torch.Tensor, tau: float) -> torch.Tensor:
    """Eq. 9's weights softmax(Q K^T / tau), Q = K = the row-normalised V (rows: clients);
    row k is how client k's next DSE mixes the clients' current ones."""
    V = V.to(torch.float64).reshape(V.shape[0], -1)
    Q = V / (V.norm(dim=1, keepdim=True) + EPS)
    return torch.softmax(Q @ Q.T / tau, dim=1)


def similarity_mix(V: torch.Tensor, tau: float) -> torch.Tensor:
    """Eq. 9: softmax(Q K^T / tau) V."""
    return similarity_attention(V, tau) @ V.to(torch.float64).reshape(V.shape[0], -1)
