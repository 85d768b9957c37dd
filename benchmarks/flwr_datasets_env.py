"""Flower Datasets' own virtual environment (``benchmarks/.venv-flwrds``), made on first use.

``flwr-datasets`` is the ecosystem's reference for federated partitioners (IID, Dirichlet,
shard, pathological). ``benchmarks/flwr_partition_crosscheck.py`` runs them in this venv and
writes the partitions they make to a fixture that ``tests/data/test_data_partition_flwr.py``
holds raysim's own partitioners to. It pulls Hugging Face ``datasets`` (and so pyarrow, pandas)
but neither torch nor raysim: the script needs only numpy and ``datasets.Dataset.from_dict``.
Built by ``benchmarks/venvs.py``, like Flower's and FLGo's venvs.
"""
from __future__ import annotations

import os

from benchmarks import venvs

VENV = os.path.join(venvs.HERE, ".venv-flwrds")
PIN = "flwr-datasets==0.6.1"  # the version the committed fixture was made with
PACKAGES = [PIN]
CHECK = ("import warnings; warnings.simplefilter('ignore'); from importlib.metadata import version; "
         "import flwr_datasets.partitioner, datasets, numpy; "
         "print(version('flwr-datasets'), datasets.__version__, numpy.__version__)")


def python(venv: str = VENV) -> str:
    return venvs.python(venv)


def side_venv(venv: str = VENV) -> venvs.SideVenv:
    return venvs.SideVenv(path=venv, installs=[PACKAGES], check=CHECK, with_raysim=False,
                          describe=venvs.versions_line("flwr-datasets", "datasets", "numpy"),
                          label="Flower Datasets", fallbacks=[["flwr-datasets"]])


def ensure(venv: str = VENV, log=print, timeout: float = 1800) -> tuple[str | None, str]:
    """(python of the venv, "flwr-datasets X, datasets Y, numpy Z") or (None, why it is not available)."""
    return side_venv(venv).ensure(log=log, timeout=timeout)


if __name__ == "__main__":
    py, line = ensure()
    print(py or "unavailable:", line)
