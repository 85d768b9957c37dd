"""Server optimizers: the server's step on the round's mean, as in Reddi et al., "Adaptive
Federated Optimization", ICLR 2021, Alg. 2 (FedJAX's ``server_optimizer``; the config's ``server:``
section).

The round's weighted mean of the clients' tensors gives the (negative) pseudo-gradient of the
global model ``x_t``::

    Δ_t = mean_t − x_t                                  (Alg. 2 line 10: the mean client update)

and the server takes one optimizer step along it::

    sgd       x_{t+1} = x_t + η Δ_t                      (η = 1: FedAvg, x_{t+1} = mean_t)
    momentum  v_t = β v_{t−1} + Δ_t;  x_{t+1} = x_t + η v_t              (FedAvgM, Hsu et al. 2019)
    adagrad   m_t = β1 m_{t−1} + (1 − β1) Δ_t;  v_t = v_{t−1} + Δ_t²                  (Alg. 2 l. 11, 12)
    yogi      m_t as above;  v_t = v_{t−1} − (1 − β2) Δ_t² sign(v_{t−1} − Δ_t²)        (l. 13)
    adam      m_t as above;  v_t = β2 v_{t−1} + (1 − β2) Δ_t²                          (l. 14)
              x_{t+1} = x_t + η c_t m_t / (√v_t + τ)                                  (l. 15)

in one of two forms (``server.form``):

- ``code`` (the default): the form the η of Reddi et al.'s grid was tuned with, their released
  code (google-research/federated) running Keras's optimizers with ε = τ. Adam and Yogi (Keras
  Adam; the Yogi of TF Addons) are bias-corrected, c_t = √(1 − β2^t) / (1 − β1^t) at step
  t = 1, 2, ..., and Adagrad (Keras Adagrad) has no first moment (β1 = 0: m_t = Δ_t) and c_t = 1;
  all three start from v_{−1} = 0 (their docs/hyperparameters.md: ``initial_accumulator_value=0.0``
  for Adagrad and Yogi, Keras Adam's v starts at 0).
- ``paper``: Alg. 2 as printed: c_t = 1 (no bias correction), β1 for all three, v_{−1} = τ² (line 1
  asks v_{−1} ≥ τ²; τ² is its least value).

m_{−1} = 0 in both. FedAvgM's form is Hsu et al.'s ``v ← βv + Δw; w ← w − v`` (their Δw is our −Δ)
with a server learning rate η in front of v, as Reddi et al.'s FedAvgM baseline (SGD with momentum
on the server): η = 1 is Hsu et al.'s exact form.

Only floating-point tensors take the step; a norm layer's running statistics (``running_mean``,
``running_var``) are estimates, not parameters, and take the plain mean, as do integer buffers
(``num_batches_tracked``: the optimizer never touches them). Everything here is a pure function of
its arguments; the state is a plain dict of dicts of tensors (and the step count), so it rides in
the server's state and its checkpoints (``torch.load(weights_only=True)``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from raysim.core.errors import UserError
from raysim.core.tensors import Tensors

# the names and defaults a config is checked against, in a module without torch (raysim.config reads them)
from raysim.core.server_optimizer_defaults import (ADAPTIVE, DEFAULT_BETAS, DEFAULT_FORM, DEFAULT_LR,  # noqa: E402,F401
                                                   DEFAULT_MOMENTUM, DEFAULT_TAU, FORMS, OPTIMIZERS)

STATE_KEY = "server_optimizer"  # where the optimizer's state lives in the server's state


def running_statistic(key: str) -> bool:
    """A norm layer's running mean or variance (torch's BatchNorm/InstanceNorm buffer names)."""
    return key.rsplit(".", 1)[-1] in ("running_mean", "running_var")


@dataclass(frozen=True)
class ServerOptimizer:
    """One server optimizer with its settings; ``init`` and ``step`` are pure (FedJAX style)."""
    name: str = "sgd"
    lr: float = DEFAULT_LR["sgd"]  # η
    momentum: float = DEFAULT_MOMENTUM  # β of "momentum"
    betas: tuple[float, float] | None = None  # β1, β2 of the adaptive optimizers; None: the form's
    tau: float = DEFAULT_TAU  # τ, the adaptivity (Adam's ε)
    form: str = DEFAULT_FORM  # "code" | "paper" (module docstring)

    def __post_init__(self):
        if self.betas is None:
            object.__setattr__(self, "betas", DEFAULT_BETAS[self.form])

    @property
    def plain_mean(self) -> bool:
        """SGD with η = 1: the new global model is the round's mean, FedAvg (the optimizer is skipped)."""
        return self.name == "sgd" and self.lr == 1.0

    @property
    def bias_corrected(self) -> bool:
        """Keras Adam's and TF Addons Yogi's step (``code`` form): c_t and v_{−1} = 0."""
        return self.form == "code" and self.name in ("adam", "yogi")

    @property
    def beta1(self) -> float:
        """β1 of m_t: Keras Adagrad has no first moment (``code`` form), Alg. 2's has."""
        return 0.0 if self.form == "code" and self.name == "adagrad" else self.betas[0]

    def correction(self, t: int) -> float:
        """c_t of step t (1, 2, ...): √(1 − β2^t) / (1 − β1^t) when bias-corrected, else 1."""
        if not self.bias_corrected:
            return 1.0
        b1, b2 = self.betas
        return (1 - b2 ** t) ** 0.5 / (1 - b1 ** t)

    def init(self, params: Tensors) -> dict:
        """The state before the first step: m_{−1} = 0, v_{−1} = 0 in the code form, τ² in the
        paper's (momentum: v_{−1} = 0); no step taken yet."""
        if self.name == "momentum":
            return {"velocity": {k: torch.zeros_like(p) for k, p in params.items()}}
        if self.name in ADAPTIVE:
            v0 = 0.0 if self.form == "code" else self.tau ** 2
            return {"m": {k: torch.zeros_like(p) for k, p in params.items()},
                    "v": {k: torch.full_like(p, v0) for k, p in params.items()}, "step": 0}
        return {}

    def step(self, params: Tensors, delta: Tensors, state: dict) -> tuple[Tensors, dict]:
        """x_{t+1} and the new state from x_t (``params``), Δ_t = mean − x_t (``delta``) and the state."""
        eta = self.lr
        if self.name == "sgd":
            return {k: p + eta * delta[k] for k, p in params.items()}, state
        if self.name == "momentum":
            velocity = {k: self.momentum * state["velocity"][k] + delta[k] for k in params}
            return {k: p + eta * velocity[k] for k, p in params.items()}, {"velocity": velocity}
        b1, b2 = self.beta1, self.betas[1]
        m = {k: b1 * state["m"][k] + (1 - b1) * delta[k] for k in params}
        v = {}
        for k in params:
            v_prev, d2 = state["v"][k], delta[k] * delta[k]
            if self.name == "adagrad":
                v[k] = v_prev + d2
            elif self.name == "adam":
                v[k] = b2 * v_prev + (1 - b2) * d2
            else:  # yogi
                v[k] = v_prev - (1 - b2) * d2 * torch.sign(v_prev - d2)
        t = state.get("step", 0) + 1  # a state saved before the step count existed: counted from there
        scale = eta * self.correction(t)
        return {k: p + scale * m[k] / (v[k].sqrt() + self.tau) for k, p in params.items()}, {"m": m, "v": v, "step": t}

    def update(self, global_: Tensors, mean: Tensors, state: dict | None) -> tuple[Tensors, dict]:
        """The server's new global tensors and optimizer state (``state`` None before the first
        round): the floating-point tensors but the running statistics take a step along
        Δ = mean − global; the others (and any key the global tensors lack) become the mean."""
        keys = [k for k, t in mean.items() if k in global_ and t.is_floating_point() and not running_statistic(k)]
        params = {k: global_[k] for k in keys}
        stepped, state = self.step(params, {k: mean[k] - global_[k] for k in keys},
                                   self.init(params) if state is None else state)
        return {**global_, **mean, **stepped}, state


def resolve(server, method_optimizer: str = "sgd", method: str = "", own_aggregate: bool = False) -> ServerOptimizer:
    """The server optimizer a method runs with: the config's ``server`` section (a
    ``raysim.config.ServerConfig``, or None: every default), its ``optimizer`` defaulting to the
    method's own (``Method.server_optimizer``: sgd, FedAdam's adam, ...) and its ``lr`` to that
    optimizer's :data:`DEFAULT_LR`. A UserError where the config contradicts the method: another
    optimizer than the one a FedOpt variant is, or any step but the plain mean for a method with
    its own server step (``own_aggregate``: it overrides ``Method.aggregate``)."""
    chosen = getattr(server, "optimizer", None)
    if chosen is not None and method_optimizer != "sgd" and chosen != method_optimizer:
        raise UserError(f"method {method} is FedAvg with server.optimizer={method_optimizer}, not {chosen}: "
                        f"run method fedavg with server.optimizer={chosen}")
    name = chosen or method_optimizer
    lr = getattr(server, "lr", None)
    opt = ServerOptimizer(name=name, lr=DEFAULT_LR[name] if lr is None else float(lr),
                          momentum=getattr(server, "momentum", DEFAULT_MOMENTUM),
                          betas=None if getattr(server, "betas", None) is None else tuple(server.betas),
                          tau=getattr(server, "tau", DEFAULT_TAU), form=getattr(server, "form", DEFAULT_FORM))
    if own_aggregate and not opt.plain_mean:
        raise UserError(f"method {method} has its own server step (aggregate): server.optimizer={name} "
                        f"with server.lr={opt.lr} applies only to methods that aggregate by the default mean")
    return opt
