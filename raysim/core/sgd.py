"""The clients' SGD: ``torch.optim.SGD``'s own update, without its ``torch._dynamo`` guards.

``torch.optim.Optimizer`` imports ``torch._dynamo`` the first time an optimizer is built, zeroes
its gradients or steps (the guards that keep ``torch.compile`` graphs apart), although nothing
here compiles. The import costs ~1.3 s of CPU in every process that trains (measured on the 2-core
VM, as long as importing torch itself), paid by each host in its first round: the first round of
every run, and every host a test starts. This class runs the undecorated functions behind those
guards (the same update, same state, hooks and param groups); under ``torch.compile`` use
``torch.optim.SGD``.
"""
from __future__ import annotations

import inspect

import torch

_ADD_PARAM_GROUP = inspect.unwrap(torch.optim.Optimizer.add_param_group)
_ZERO_GRAD = inspect.unwrap(torch.optim.Optimizer.zero_grad)
_STEP = inspect.unwrap(torch.optim.SGD.step)


class SGD(torch.optim.SGD):
    """``torch.optim.SGD`` (momentum, dampening, Nesterov, weight decay, maximize as there)."""

    def add_param_group(self, param_group: dict) -> None:
        _ADD_PARAM_GROUP(self, param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        _ZERO_GRAD(self, set_to_none)

    def step(self, closure=None):
        with torch.set_grad_enabled(self.defaults["differentiable"]):  # what torch's guard sets
            return _STEP(self, closure)
