"""pfl-research's own virtual environment (``benchmarks/.venv-pfl``), made on first use.

pfl (Apple's pfl-research, package ``pfl`` on the package index) is installed at a pinned version
with the project's torch/torchvision versions and raysim itself (``--no-deps -e``: the runner
builds the workload's model and data from ``raysim.models``/``raysim.data``, as the Flower arm
does). Built by ``benchmarks/venvs.py``, like Flower's and FLGo's venvs; success is recorded in a
marker file. pfl is kept out of the project's venv because it pulls its own dependencies
(``multiprocess``, ``dp-accounting``, ``prv-accountant``, scipy) and sets torch's multiprocessing
start method at import.
"""
from __future__ import annotations

import os

from benchmarks import venvs

VENV = os.path.join(venvs.HERE, ".venv-pfl")
PFL_PIN = "pfl==0.6.0"
PACKAGES = [PFL_PIN, *venvs.TORCH]
CHECK = ("import warnings; warnings.simplefilter('ignore'); "
         "from importlib.metadata import version; import torch, raysim.models, raysim.data; "
         "import pfl.algorithm, pfl.aggregate.simulate, pfl.data.federated_dataset, pfl.hyperparam; "
         "print(version('pfl'), torch.__version__)")


def python(venv: str = VENV) -> str:
    return venvs.python(venv)


def side_venv(venv: str = VENV) -> venvs.SideVenv:
    return venvs.SideVenv(path=venv, installs=[PACKAGES], check=CHECK, describe=venvs.versions_line('pfl', 'torch'), label="pfl-research",
                          fallbacks=[["pfl", *venvs.TORCH]])


def ensure(venv: str = VENV, log=print, timeout: float = 1800) -> tuple[str | None, str]:
    """(python of the pfl venv, "pfl X, torch Y") or (None, why it is not available)."""
    return side_venv(venv).ensure(log=log, timeout=timeout)
