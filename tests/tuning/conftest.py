"""Shared pieces of the tuning tests: a tiny federation (small CNN, 64 training images per domain,
16-pixel digits rendered 1,430 per domain) and the environment for searches run in a subprocess."""
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

TINY_EXPERIMENT = {
    "rounds": 2,
    "seed": 0,
    "model": {"name": "small_cnn", "norm": "bn"},
    "data": {"dataset": "digits5", "options": {"image_size": 16, "n_render": 1430},
             "partition": {"kind": "per_domain", "train_size": 64}},
    "train": {"epochs": 5, "batch_size": 16, "lr": 0.05, "momentum": 0.9},
    "eval": {"every": 1, "protocol": "personalized", "splits": ["val", "test"]},
    "runtime": {"num_hosts": 1, "cpus_per_host": 0.5},
}


@pytest.fixture(scope="session")
def tiny_experiment():
    """A fresh copy for each caller."""
    import copy
    return lambda: copy.deepcopy(TINY_EXPERIMENT)


@pytest.fixture(scope="session")
def cache_env(tmp_path_factory):
    """The environment for subprocesses: the session's dataset cache (generated once)."""
    env = dict(os.environ)
    env.setdefault("RAYSIM_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
    os.environ.setdefault("RAYSIM_CACHE", env["RAYSIM_CACHE"])
    env.pop("RAY_ADDRESS", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), env.get("PYTHONPATH", "")] if p)
    return env
