"""The server optimizers' names and defaults (the equations: :mod:`raysim.core.server_optimizers`).

Kept apart from the equations so that reading a config needs no torch: ``raysim run`` reads its
config before it starts Ray, and importing torch first (~2 s of one core) held Ray's start back.
"""
from __future__ import annotations

OPTIMIZERS = ("sgd", "momentum", "adam", "yogi", "adagrad")
ADAPTIVE = ("adam", "yogi", "adagrad")
FORMS = ("code", "paper")  # the form η was tuned with (bias-corrected, v from 0) | Alg. 2 as printed

# Every server default, defined once (raysim.config.ServerConfig and ServerOptimizer take theirs
# from here; tests/methods/test_defaults.py pins them).
# η when ``server.lr`` is not given: Reddi et al.'s grid of server learning rates (10^-3 .. 10^1 in
# half decades) and the best values its released code lists per task (google-research/federated,
# optimization/docs/hyperparameters.md): FedAvg and FedAvgM 10^0 (FedAvgM's best on 4 of 6 tasks),
# FedAdagrad 10^-1 (median of its 6 tasks; EMNIST-CR's best), FedAdam and FedYogi 10^-2 (best on
# Shakespeare and Stack Overflow NWP; the median of the 6 is 10^-1.75, EMNIST-CR's 10^-2.5)
DEFAULT_LR = {"sgd": 1.0, "momentum": 1.0, "adagrad": 1e-1, "adam": 1e-2, "yogi": 1e-2}
DEFAULT_MOMENTUM = 0.9  # β of FedAvgM: Hsu et al. 2019; Reddi et al.'s FedAvgM (server_sgd_momentum=0.9)
# β1, β2 by form: the code form's are Keras's defaults, which Reddi et al.'s code ran ("beta1 and beta2
# set by default to 0.9 and 0.999 ... we did not [change them]", docs/hyperparameters.md); the paper
# form's are the paper's text, β2 = 0.99 (Flower's FedAdam/FedYogi take those)
DEFAULT_BETAS = {"code": (0.9, 0.999), "paper": (0.9, 0.99)}
DEFAULT_TAU = 1e-3  # τ: Reddi et al. 2021, their code's recommended ε (docs/hyperparameters.md)
DEFAULT_FORM = "code"  # by the defaults rule: the form the grid's η was tuned with
