"""Code of the user's own, named ``module:attribute``: method plugins (:mod:`raysim.methods.registry`,
``method: my_module:MyMethod``) and dataset plugins (:mod:`raysim.data`, ``data.dataset:
my_module:load_mine``) are found, reported and shipped to Ray's workers the same way, here.

* :func:`parse`: the spec's module and attribute, or None when it is not ``module:attribute``;
* :func:`import_module`: the module from ``sys.path``, then from the current directory (a console
  script's ``sys.path`` does not hold it), each failure one line naming the plugin;
* :func:`ship_path`: what Ray's ``runtime_env`` ``py_modules`` must carry for the module to import
  on every worker (:func:`raysim.engine.cluster.job_runtime_env`).
"""
from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

from raysim.core.errors import UserError, first_line

OWN = "raysim"  # raysim's own modules travel with raysim itself


def parse(spec) -> tuple[str, str] | None:
    """``"pkg.mod:Name"`` -> ``("pkg.mod", "Name")``; None for anything else (a plain name, a
    spec with a part that is not an identifier)."""
    if not isinstance(spec, str) or spec.count(":") != 1:
        return None
    module_name, _, attr = spec.partition(":")
    if all(part.isidentifier() for part in module_name.split(".")) and attr.isidentifier():
        return module_name, attr
    return None


def import_module(module_name: str, label: str):
    """``module_name`` from sys.path, then from the current directory (the directory stays on the
    path for the module's own later imports); ``label`` (``method 'x:Y'``) starts each one-line
    error."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and (module_name == err.name or module_name.startswith(err.name + ".")):
            raise UserError(f"{label}: no module named {module_name!r} (looked on sys.path and in "
                            f"the current directory {cwd})") from None
        raise UserError(f"{label}: importing {module_name} failed: {why(err)}") from None
    except Exception as err:  # the user's module raised while importing: where, in one line
        raise UserError(f"{label}: importing {module_name} failed: {why(err)}") from None


def why(err: BaseException) -> str:
    """An import's failure in one line: its type, message and the file and line that raised."""
    import traceback
    if isinstance(err, SyntaxError):
        return f"SyntaxError: {err.msg} ({err.filename}:{err.lineno})"
    frames = traceback.extract_tb(err.__traceback__)
    at = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return first_line(err, with_type=True) + at


def ship_path(module_name: str, label: str) -> str | None:
    """The module file, or the folder of the top-level package (all of it, so the package's own
    imports work), that holds the imported module ``module_name``; None for raysim's own modules
    and for one installed in site-packages (the cluster's environment holds it)."""
    top = module_name.split(".")[0]
    if top == OWN:
        return None
    module = sys.modules.get(top) or importlib.import_module(top)
    paths = list(getattr(module, "__path__", None) or [])
    if len(paths) > 1:
        raise UserError(f"{label}: package {top} spans several folders ({', '.join(paths)}); "
                        "raysim ships one folder to the Ray workers")
    path = os.path.abspath(paths[0] if paths else module.__file__)
    if any(part in ("site-packages", "dist-packages") for part in Path(path).parts):
        return None
    return path
