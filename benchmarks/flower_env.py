"""Flower's own virtual environment (``benchmarks/.venv-flwr``), made on first use.

Flower's ``simulation`` extra pins an older Ray than raysim, so it cannot share the project's
venv. The harness installs ``flwr[simulation]``, the project's torch/torchvision versions and
raysim itself (``--no-deps``, so the Flower client can reuse ``raysim.data``/``raysim.models``)
with pip, and records success in a marker file (``benchmarks/venvs.py`` does the building).
Nothing else is downloaded at run time.
"""
from __future__ import annotations

import os

from benchmarks import venvs

HERE = venvs.HERE
REPO = venvs.REPO
VENV = os.path.join(HERE, ".venv-flwr")
MARKER = venvs.MARKER
PACKAGES = ["flwr[simulation]", *venvs.TORCH]
CHECK = "import flwr, ray, torch, raysim.models, raysim.data; print(flwr.__version__, ray.__version__, torch.__version__)"
_last_error = venvs.last_error


def python(venv: str = VENV) -> str:
    return venvs.python(venv)


def side_venv(venv: str = VENV) -> venvs.SideVenv:
    return venvs.SideVenv(path=venv, installs=[PACKAGES], check=CHECK, describe=venvs.versions_line("flwr", "ray", "torch"), label="Flower")


def ensure(venv: str = VENV, log=print, timeout: float = 1800) -> tuple[str | None, str]:
    """(python of the Flower venv, "flwr X ray Y torch Z") or (None, why it is not available)."""
    return side_venv(venv).ensure(log=log, timeout=timeout)
