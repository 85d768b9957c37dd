"""Deterministic kernels (``runtime.deterministic``): a GPU run that repeats bit for bit.

On the CPU torch's kernels give the same result every time; on a GPU some do not (atomic adds in
scatter and pooling backward passes, cuDNN's autotuned algorithm choice, cuBLAS's split-K
reductions over a workspace shared between streams). With ``runtime.deterministic: true``:

* every host, the server and (in one process) the in-process backend call :func:`configure` when
  they start: ``torch.use_deterministic_algorithms(True)``, ``cudnn.deterministic = True``,
  ``cudnn.benchmark = False``;
* ``CUBLAS_WORKSPACE_CONFIG`` (cuBLAS's deterministic workspace) must be in the environment before
  the process's first cuBLAS call: Ray actors get it in their ``runtime_env`` (:func:`actor_options`),
  so it is there when the worker process starts; in one process :func:`configure` sets it if unset;
* an operation torch has no deterministic kernel for raises torch's RuntimeError; the backends turn
  it into a one-line :class:`~raysim.core.errors.UserError` naming the operation and the model
  (:func:`nondeterministic_error`).
"""
from __future__ import annotations

import os
import re

import torch

from raysim.core.errors import UserError

# ":4096:8": eight 4 MiB cuBLAS workspaces (torch's documented setting; ":16:8" also works, smaller, slower)
ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def actor_options(runtime) -> dict:
    """Extra Ray actor options: the deterministic environment, set when the worker process starts
    (before CUDA can initialise); none when ``runtime.deterministic`` is off."""
    return {"runtime_env": {"env_vars": dict(ENV)}} if runtime.deterministic else {}


def configure(deterministic: bool) -> None:
    """Make this process use deterministic kernels (nothing when ``deterministic`` is false: the
    process keeps torch's defaults). A value of CUBLAS_WORKSPACE_CONFIG already set is kept."""
    if not deterministic:
        return
    for key, value in ENV.items():
        os.environ.setdefault(key, value)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


_NO_KERNEL = re.compile(r"(\S+) does not have a deterministic implementation")


def nondeterministic_error(err: BaseException | None, model: str) -> UserError | None:
    """The one-line user error for torch's "no deterministic kernel" RuntimeError (the operation
    as torch names it, and ``model``); None for any other exception."""
    if not isinstance(err, RuntimeError):
        return None
    text = str(err)
    found = _NO_KERNEL.search(text)
    if found:
        op = found.group(1)
    elif "CUBLAS_WORKSPACE_CONFIG" in text:
        op = "a cuBLAS matmul (CUBLAS_WORKSPACE_CONFIG was not set before CUDA started)"
    else:
        return None
    return UserError(f"runtime.deterministic: operation {op} in model {model!r} has no deterministic "
                     f"kernel in torch {torch.__version__}; set runtime.deterministic=false to run it")
