"""Method name -> class: raysim's methods, methods registered in this process, and method plugins.

raysim's methods are the entry points of the ``raysim.methods`` group (pyproject.toml,
``[project.entry-points."raysim.methods"]``, ``name = "module:Class"``). The table is read at
first use and a method's module is imported only when that method is asked for, so start-up
imports none of them and a method that fails to import never blocks the others. Another installed
distribution may add methods to the group the same way (raysim's own names win a clash).

A method plugin is a :class:`raysim.core.contract.Method` subclass in the user's own module, named
``module:Class`` (``method: my_pkg.my_module:MyMethod``; ``method=fednova:FedNova`` on the command
line). The module is imported from ``sys.path``, then from the current directory; the class's
``name`` keys its settings (``hp.<name>``, ``per_method.<name>``) and names its run folder
(:func:`name_of`). Ray actors import it from the copy the driver ships them
(:func:`plugin_sources`, Ray's ``runtime_env`` py_modules, :func:`raysim.engine.cluster.ray_session`).
"""
from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

from raysim.core import plugins
from raysim.core.errors import UserError

GROUP = "raysim.methods"  # the entry-point group of methods
DISTRIBUTION = "raysim"

# Methods registered in this process (:func:`register`): tests and in-process use. Empty otherwise:
# the methods raysim ships are entry points, not a list here.
_METHODS: dict[str, str | type] = {}
_own: dict[str, str] | None = None  # raysim's entry points, read once
_others: dict[str, str] | None = None  # other distributions' entry points in the group, read once



def register(name: str, target: str | type) -> None:
    """Add a method: ``"module:Class"`` (importable wherever the run's actors start), or the class
    itself (this process only: in-process use and tests). A method of your own file needs no
    registration: name it ``module:Class`` in the config."""
    _METHODS[name] = target


# ----------------------------------------------------------------------------- the table

def _own_table() -> dict[str, str]:
    """raysim's entry points: the table of the pyproject.toml beside the package when raysim runs
    from its source tree (what that code declares, even before ``pip install -e .`` refreshed the
    installed metadata), else the installed distribution's."""
    global _own
    if _own is None:
        table = _source_tree_table()
        _own = table if table is not None else _installed_table()
    return _own


def _source_tree_table() -> dict[str, str] | None:
    # methods/registry.py in a checkout (raysim.methods is its methods/ folder), beside pyproject.toml
    path = Path(__file__).resolve().parents[1] / "pyproject.toml"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return None  # an installed raysim: its metadata
    if f'name = "{DISTRIBUTION}"' not in text.splitlines():
        return None
    return entry_point_table(text)


def entry_point_table(pyproject: str) -> dict[str, str]:
    """The ``[project.entry-points."raysim.methods"]`` table of raysim's pyproject.toml: its
    ``name = "module:Class"`` lines up to the next table. Read by hand rather than with tomllib,
    whose import costs every process (driver and actors) more than reading the file;
    tests/app/test_plugins.py checks it reads what tomllib reads."""
    out, inside = {}, False
    for line in pyproject.splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("["):
            inside = line == f'[project.entry-points."{GROUP}"]'
        elif inside and "=" in line:
            name, _, value = line.partition("=")
            out[name.strip()] = value.strip().strip('"')
    return out


def _installed_table() -> dict[str, str]:
    import importlib.metadata  # here, not at start-up: a source checkout reads pyproject.toml
    try:
        eps = importlib.metadata.distribution(DISTRIBUTION).entry_points
    except importlib.metadata.PackageNotFoundError:
        return {}
    return {ep.name: ep.value for ep in eps if ep.group == GROUP}


def _other_table() -> dict[str, str]:
    """Methods other installed distributions add to the group (read only when a name is not
    raysim's: scanning every distribution costs more than reading raysim's own)."""
    global _others
    if _others is None:
        import importlib.metadata
        _others = {}
        for ep in importlib.metadata.entry_points(group=GROUP):
            dist = getattr(ep, "dist", None)
            if dist is not None and (dist.metadata["Name"] or "").lower() == DISTRIBUTION:
                continue  # raysim's own: _own_table (the installed copy may be stale)
            _others.setdefault(ep.name, ep.value)
    return _others


def _lookup(name: str) -> str | type | None:
    if name in _METHODS:
        return _METHODS[name]
    own = _own_table()
    if name in own:
        return own[name]
    return _other_table().get(name)


def _installed(target: str | type) -> bool:
    if not isinstance(target, str):
        return True
    try:
        return importlib.util.find_spec(target.split(":")[0]) is not None
    except (ImportError, ValueError):
        return False


def names() -> list[str]:
    """The methods available by name in this build (plugins aside)."""
    table = {**_other_table(), **_own_table(), **_METHODS}
    return sorted(n for n, target in table.items() if _installed(target))


def builtin_names() -> list[str]:
    """The methods raysim ships (its entry points), installed or not."""
    return sorted(_own_table())


# ----------------------------------------------------------------------------- resolving

def is_plugin(spec) -> bool:
    """``module:Class``: a method of the user's own."""
    return isinstance(spec, str) and ":" in spec


def get(name: str):
    """The method class of a name (``fedavg``) or a plugin spec (``my_module:MyMethod``); a
    UserError (one line) if there is none."""
    if is_plugin(name):
        return _plugin(name)
    target = _lookup(name) if isinstance(name, str) else None
    if target is None or not _installed(target):
        raise UserError(f"unknown method {name!r}; available: {', '.join(names())}; "
                        "or a method of your own file: module:Class")
    if not isinstance(target, str):
        return target
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)


def name_of(spec: str) -> str:
    """The key of a method in a config (``hp.<key>``, ``per_method.<key>``) and its run folder's
    name: the name itself, or a plugin class's ``name``."""
    return get(spec).name if is_plugin(spec) else spec


def _plugin(spec: str):
    from raysim.core.contract import Method

    parsed = plugins.parse(spec)
    if parsed is None:
        raise UserError(f"method {spec!r}: expected a name or module:Class (e.g. fednova:FedNova, "
                        "my_pkg.my_module:MyMethod)")
    module_name, cls_name = parsed
    module = plugins.import_module(module_name, f"method {spec!r}")  # sys.path, then the current directory
    where = f"module {module_name} ({getattr(module, '__file__', None) or 'no file'})"
    if not hasattr(module, cls_name):
        raise UserError(f"method {spec!r}: {where} has no class {cls_name}")
    cls = getattr(module, cls_name)
    if not (isinstance(cls, type) and issubclass(cls, Method)) or cls is Method:
        raise UserError(f"method {spec!r}: {module_name}.{cls_name} is not a raysim method "
                        "(a subclass of raysim.core.contract.Method)")
    name = cls.name
    if name == Method.name or not _good_name(name):
        raise UserError(f"method {spec!r}: {cls_name}.name = {name!r}; give the class a name of its own "
                        "(letters, digits, '_' or '-'), e.g. name = \"mymethod\": it keys hp.<name> and "
                        "names its run folder")
    target = _lookup(name)
    if target is not None and target is not cls and target != f"{cls.__module__}:{cls.__qualname__}":
        whose = "a built-in method's" if name in _own_table() else "another method's"
        raise UserError(f"method {spec!r}: its name {name!r} is {whose}; give {cls_name} a "
                        f"name of its own (name = \"...\")")
    return cls


def _good_name(name) -> bool:
    """A plugin's name keys config sections (``hp.<name>``) and names a folder: a letter, then
    letters, digits, '_' or '-'."""
    return (isinstance(name, str) and name[:1].isalpha() and name.isascii()
            and all(c.isalnum() or c in "_-" for c in name))


# ----------------------------------------------------------------------------- shipping

def plugin_sources(specs) -> list[str]:
    """What Ray's ``runtime_env`` ``py_modules`` must ship for these methods to import on every
    worker: each plugin's module file, or the folder of its top-level package (all of it, so the
    package's own imports work). Nothing for raysim's methods, nor for a module installed in
    site-packages (the cluster's environment holds it)."""
    out = []
    for spec in specs:
        if not is_plugin(spec):
            continue
        path = plugins.ship_path(get(spec).__module__, f"method {spec!r}")
        if path is not None and path not in out:
            out.append(path)
    return out
