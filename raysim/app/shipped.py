"""The configs and examples raysim ships, and how a config named on the command line is found.

The repository's ``configs/`` (the quickstart, each paper's configs, the baselines) travels in the
wheel as ``raysim/configs/``, and ``examples/`` (methods in files of their own, with their tests
and tune configs) as ``raysim/examples/`` (pyproject.toml); a source checkout (an editable
install, or the repository on PYTHONPATH) has both beside the ``raysim`` package.
:func:`shipped_configs` and :func:`shipped_examples` are the one place that knows both.

A relative CONFIG means the current directory first. Only where no such file exists there is it
looked up among the shipped configs, as given (``fdse/digits5.yaml``) or without its leading
``configs/`` (``configs/fdse/digits5.yaml``, as the docs spell it), so the docs' commands work
from any directory after a plain ``pip install``.
"""
from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

from raysim.core.errors import UserError

QUICKSTART = "quickstart.yaml"


def _shipped(name: str, marker: str) -> Path:
    """``raysim/NAME`` inside an installed package, else the repository's ``NAME/`` beside the
    package (a source checkout): the one holding ``marker``."""
    package = Path(str(resources.files("raysim")))
    for folder in (package / name, package.parent / name):
        if (folder / marker).is_file():
            return folder
    return package / name  # neither: where an installed package keeps it, for the error lines


def shipped_configs() -> Path:
    """The folder of shipped configs (the quickstart among them)."""
    return _shipped("configs", QUICKSTART)


def shipped_examples() -> Path:
    """The folder of shipped examples: ``NAME.py``, ``test_NAME.py`` and ``NAME_tune.yaml`` each."""
    return _shipped("examples", "fednova.py")


def quickstart() -> Path:
    """The config ``raysim run`` runs when given none."""
    return shipped_configs() / QUICKSTART


def find_config(path: str | os.PathLike) -> str:
    """The file a command-line CONFIG names: the path as given where a file is there (relative:
    to the current directory), else the shipped config of that name; one line naming both places
    where neither has it."""
    given = os.path.expanduser(os.fspath(path))
    if os.path.isabs(given) or os.path.exists(given):
        return given  # read as given: a missing absolute path, a folder get the reader's own error
    found = shipped_config(given)
    if found is not None:
        return str(found)
    raise UserError(f"config file not found: {given} (neither in the current directory {os.getcwd()} "
                    f"nor among raysim's shipped configs in {shipped_configs()})")


def shipped_config(path: str | os.PathLike) -> Path | None:
    """The shipped config a relative ``path`` names, as given (``fdse/digits5.yaml``) or with its
    leading ``configs/``; None where raysim ships no such file (or ``path`` is absolute)."""
    parts = Path(os.fspath(path)).parts
    if not parts or os.path.isabs(os.fspath(path)):
        return None
    shipped = shipped_configs()
    for rel in (parts, parts[1:] if parts[:1] == ("configs",) else ()):
        if rel and shipped.joinpath(*rel).is_file():
            return shipped.joinpath(*rel)
    return None
