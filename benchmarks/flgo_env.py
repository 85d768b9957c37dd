"""FLGo's own virtual environment (``benchmarks/.venv-flgo``), made on first use.

FLGo (https://github.com/WwZzz/easyFL, the platform FDSE's code runs on) is installed from the
package index at the version FDSE used, ``flgo==0.3.29`` (the newest release is tried if that pin
ever stops installing), with the project's torch/torchvision versions and raysim itself
(``--no-deps -e``: the runner builds raysim's ``small_cnn`` from ``raysim.models``). Built by
``benchmarks/venvs.py``, like Flower's venv; success is recorded in a marker file.
"""
from __future__ import annotations

import os

from benchmarks import venvs

VENV = os.path.join(venvs.HERE, ".venv-flgo")
FLGO_PIN = "flgo==0.3.29"
PACKAGES = [FLGO_PIN, *venvs.TORCH]
CHECK = ("import warnings; warnings.simplefilter('ignore'); "
         "from importlib.metadata import version; import flgo, torch, raysim.models; "
         "import flgo.algorithm.fedavg, flgo.algorithm.fedprox, flgo.algorithm.scaffold, "
         "flgo.algorithm.feddyn, flgo.algorithm.moon, flgo.algorithm.ditto; "
         "print(version('flgo'), torch.__version__)")


def python(venv: str = VENV) -> str:
    return venvs.python(venv)


def side_venv(venv: str = VENV) -> venvs.SideVenv:
    return venvs.SideVenv(path=venv, installs=[PACKAGES], check=CHECK, describe=venvs.versions_line('flgo', 'torch'), label="FLGo",
                          fallbacks=[["flgo", *venvs.TORCH]])


def ensure(venv: str = VENV, log=print, timeout: float = 1800) -> tuple[str | None, str]:
    """(python of the FLGo venv, "flgo X, torch Y") or (None, why it is not available)."""
    return side_venv(venv).ensure(log=log, timeout=timeout)

