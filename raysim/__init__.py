"""raysim: a Ray-based simulator for federated learning under domain shift."""
__version__ = "0.1.0"


def load_config(path=None, overrides: list[str] | None = None, raw: dict | None = None):
    """An experiment config, read, overridden (``["rounds=5", ...]``) and schema-checked, with
    ``path`` found as ``raysim run`` finds a CONFIG: the current directory first, then the configs
    raysim ships (``load_config("configs/quickstart.yaml")`` works from any directory after a plain
    ``pip install``). :func:`raysim.config.load_config` reads ``path`` as given."""
    from raysim.app.shipped import find_config
    from raysim.config import load_config as read
    from raysim.methods import registry

    return read(find_config(path) if path is not None else None, overrides, raw=raw, method_key=registry.name_of)
