"""Configs as the application loads them: the schema's checks (:mod:`raysim.config`), then the
method registry's (the methods' names and hyperparameters), which the config module, below the
methods, does not consult."""
from __future__ import annotations

import os

from raysim.config import ExperimentConfig, load_config


def check_methods(cfg: ExperimentConfig) -> None:
    """Every method the config names exists, and its ``hp.<method>`` settings type-check."""
    from raysim.methods import registry

    for name in cfg.method_names():
        registry.get(name)  # raises UserError listing the known methods
    for name, hp in cfg.hp.items():
        registry.get(name).hparams_from(hp, prefix=f"hp.{name}")


def load_checked(path: str | os.PathLike | None = None, overrides: list[str] | None = None,
                 raw: dict | None = None) -> ExperimentConfig:
    """:func:`raysim.config.load_config` and :func:`check_methods`."""
    cfg = load_config(path, overrides, raw=raw)
    check_methods(cfg)
    return cfg

