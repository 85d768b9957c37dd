"""Configs as the application loads them: the schema's checks (:mod:`raysim.config`), then the
method registry's (the methods' names and hyperparameters), which the config module, below the
methods, does not consult."""
from __future__ import annotations

import os

from raysim.config import ExperimentConfig, load_config


def check_methods(cfg: ExperimentConfig) -> None:
    """Every method the config names exists, its ``hp.<method>`` settings type-check, and its
    ``server`` section suits it (a server optimizer only where the default aggregate runs)."""
    from raysim.core.contract import Method
    from raysim.core.server_optimizers import resolve
    from raysim.methods import registry

    for name in cfg.method_names():
        cls = registry.get(name)  # raises UserError listing the known methods
        server = (cfg.for_method(name) if name in cfg.per_method else cfg).server
        resolve(server, cls.server_optimizer, name, own_aggregate=cls.aggregate is not Method.aggregate)
    for name, hp in cfg.hp.items():
        registry.get(name).hparams_from(hp, prefix=f"hp.{name}")


def load_checked(path: str | os.PathLike | None = None, overrides: list[str] | None = None,
                 raw: dict | None = None) -> ExperimentConfig:
    """:func:`raysim.config.load_config` and :func:`check_methods`."""
    cfg = load_config(path, overrides, raw=raw)
    check_methods(cfg)
    return cfg

