"""Configs as the application loads them: the schema's checks (:mod:`raysim.config`), then the
method registry's (the methods' names and hyperparameters), which the config module, below the
methods, does not consult."""
from __future__ import annotations

import os

from raysim.config import ExperimentConfig, load_config
from raysim.core.errors import UserError


def check_methods(cfg: ExperimentConfig) -> None:
    """Every method the config names exists, its ``hp.<method>`` settings type-check (a plugin
    ``module:Class`` is keyed by its class's name, :func:`raysim.methods.registry.name_of`), and its
    ``server`` section suits it (a server optimizer only where the default aggregate runs)."""
    from raysim.core.contract import Method
    from raysim.core.server_optimizers import resolve
    from raysim.methods import registry

    run = {}
    for name in cfg.method_names():
        cls = registry.get(name)  # raises UserError listing the known methods
        key = registry.name_of(name)
        run[key] = name
        server = (cfg.for_method(name, key=key) if key in cfg.per_method else cfg).server
        resolve(server, cls.server_optimizer, key, own_aggregate=cls.aggregate is not Method.aggregate)
    for key, hp in cfg.hp.items():
        if registry.is_plugin(key):
            raise UserError(f"config key 'hp.{key}': a method of your own is keyed by its class's name: "
                            f"hp.{registry.name_of(key)}")
        registry.get(run.get(key, key)).hparams_from(hp, prefix=f"hp.{key}")


def method_keys(cfg: ExperimentConfig) -> list[str]:
    """The config's methods by the names their folders and tables show (a plugin's class name)."""
    from raysim.methods import registry

    return [registry.name_of(n) for n in cfg.method_names()]


def method_config(cfg: ExperimentConfig, name: str) -> ExperimentConfig:
    """``cfg`` narrowed to its method ``name`` (``per_method.<key>`` merged in; see :func:`check_methods`)."""
    from raysim.methods import registry

    return cfg.for_method(name, key=registry.name_of(name))


def load_checked(path: str | os.PathLike | None = None, overrides: list[str] | None = None,
                 raw: dict | None = None) -> ExperimentConfig:
    """:func:`raysim.config.load_config` and :func:`check_methods`."""
    from raysim.methods import registry

    cfg = load_config(path, overrides, raw=raw, method_key=registry.name_of)
    check_methods(cfg)
    return cfg
