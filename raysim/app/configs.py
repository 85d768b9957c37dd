"""Configs as the application loads them: the schema's checks (:mod:`raysim.config`), then the
method registry's (the methods' names and hyperparameters), which the config module, below the
methods, does not consult."""
from __future__ import annotations

import os

from raysim.config import ExperimentConfig, load_config
from raysim.core.errors import UserError


def check_methods(cfg: ExperimentConfig) -> None:
    """Every method the config names exists, its ``hp.<method>`` settings type-check (a plugin
    ``module:Class`` is keyed by its class's name, :func:`raysim.methods.registry.name_of`), each
    entry's ``server`` section suits its method (a server optimizer only where the default
    aggregate runs), and a named variant's ``hp`` are its method's and its name no other method's."""
    from raysim.core.contract import Method
    from raysim.core.server_optimizers import resolve
    from raysim.methods import registry

    run = {}
    entries = cfg.method_entries()
    for entry in entries:
        cls = registry.get(entry.method)  # raises UserError listing the known methods
        run[registry.name_of(entry.method)] = entry.method
    for key, hp in cfg.hp.items():
        if registry.is_plugin(key):
            raise UserError(f"config key 'hp.{key}': a method of your own is keyed by its class's name: "
                            f"hp.{registry.name_of(key)}")
        registry.get(run.get(key, key)).hparams_from(hp, prefix=f"hp.{key}")
    for i, entry in enumerate(entries):
        cls, key, name = registry.get(entry.method), registry.name_of(entry.method), entry.name(registry.name_of)
        one = cfg.for_method(name, registry.name_of) if (name in cfg.per_method or entry.settings) else cfg
        where = f"methods[{i}] ({name})"
        if entry.variant is not None and name != key and name in registry.names():
            raise UserError(f"{where}: {name!r} is another method's name; give the variant of {key} a name "
                            "of its own (it labels its row)")
        if entry.variant is not None and entry.settings.get("hp"):
            cls.hparams_from(one.hp.get(key), prefix=f"{where}.hp")
        try:
            resolve(one.server, cls.server_optimizer, key, own_aggregate=cls.aggregate is not Method.aggregate)
        except UserError as err:
            raise UserError(f"{where}: {err}" if entry.variant is not None else str(err)) from None


def method_keys(cfg: ExperimentConfig) -> list[str]:
    """The config's entries by the names their folders and tables show (a variant's name, a
    plugin's class name)."""
    from raysim.methods import registry

    return cfg.entry_names(registry.name_of)


def method_config(cfg: ExperimentConfig, name: str) -> ExperimentConfig:
    """``cfg`` narrowed to its entry ``name`` (a variant's name, a method's key or its spec:
    ``per_method.<name>`` and a variant's settings merged in; see :func:`check_methods`)."""
    from raysim.methods import registry

    return cfg.for_method(name, registry.name_of)


def load_checked(path: str | os.PathLike | None = None, overrides: list[str] | None = None,
                 raw: dict | None = None) -> ExperimentConfig:
    """:func:`raysim.config.load_config` and :func:`check_methods`."""
    from raysim.methods import registry

    cfg = load_config(path, overrides, raw=raw, method_key=registry.name_of)
    check_methods(cfg)
    return cfg
