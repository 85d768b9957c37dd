"""FedOpt — FedAvg with an optimizer on the server: Reddi et al., "Adaptive Federated
Optimization", ICLR 2021 (FedAdagrad, FedYogi, FedAdam: Alg. 2), and Hsu et al., "Measuring the
Effects of Non-Identical Data Distribution for Federated Visual Classification", 2019 (FedAvgM).

    client: w_k = E epochs of SGD on D_k from x_t                     (FedAvg's, unchanged)
    server: Δ_t = sum_k (n_k / n) w_k − x_t;  x_{t+1} = ServerOpt(x_t, Δ_t)

Each variant is FedAvg with ``server.optimizer`` set (``fedadam`` runs exactly as ``fedavg`` with
``server.optimizer=adam``); the step's equations and the defaults of ``server.lr``, ``betas``,
``momentum``, ``tau`` and ``form`` are in :mod:`raysim.core.server_optimizers` (defined once) and
``raysim.config.ServerConfig``. By the defaults rule the step is the form Reddi et al.'s η was tuned
with (``server.form: code``: Keras Adam, TF Addons Yogi, Keras Adagrad); ``server.form: paper`` is
Alg. 2 as printed.
"""
from __future__ import annotations

from raysim.methods.fedavg import FedAvg


class FedAvgM(FedAvg):
    """FedAvg with server momentum (Hsu et al. 2019): v = β v + Δ, x = x + η v (β = server.momentum,
    η = server.lr, 1 by default: Hsu et al.'s form).

    Its settings are the config's ``server`` section: server.lr, server.momentum."""
    name = "fedavgm"
    paper = "Hsu et al., arXiv:1909.06335, 2019: FedAvg with server.optimizer=momentum"
    shares = "shares the whole model; keeps nothing (server: SGD with momentum on the mean update)"
    server_optimizer = "momentum"


class FedAdagrad(FedAvg):
    """FedAvg with Adagrad on the server (Reddi et al. 2021, Alg. 2): v = v + Δ²,
    x = x + η m / (√v + τ); m = Δ (Keras Adagrad: no first moment) unless server.form=paper.

    Its settings are the config's ``server`` section: server.lr, server.betas, server.tau, server.form."""
    name = "fedadagrad"
    paper = "Reddi et al., ICLR 2021: FedAvg with server.optimizer=adagrad"
    shares = "shares the whole model; keeps nothing (server: Adagrad on the mean update)"
    server_optimizer = "adagrad"


class FedAdam(FedAvg):
    """FedAvg with Adam on the server (Reddi et al. 2021, Alg. 2): v = β2 v + (1 − β2) Δ²,
    x = x + η c_t m / (√v + τ), bias-corrected from v = 0 (Keras Adam) unless server.form=paper.

    Its settings are the config's ``server`` section: server.lr, server.betas, server.tau, server.form."""
    name = "fedadam"
    paper = "Reddi et al., ICLR 2021: FedAvg with server.optimizer=adam"
    shares = "shares the whole model; keeps nothing (server: Adam on the mean update)"
    server_optimizer = "adam"


class FedYogi(FedAvg):
    """FedAvg with Yogi on the server (Reddi et al. 2021, Alg. 2): v = v − (1 − β2) Δ² sign(v − Δ²),
    x = x + η c_t m / (√v + τ), bias-corrected from v = 0 (TF Addons Yogi) unless server.form=paper.

    Its settings are the config's ``server`` section: server.lr, server.betas, server.tau, server.form."""
    name = "fedyogi"
    paper = "Reddi et al., ICLR 2021: FedAvg with server.optimizer=yogi"
    shares = "shares the whole model; keeps nothing (server: Yogi on the mean update)"
    server_optimizer = "yogi"
