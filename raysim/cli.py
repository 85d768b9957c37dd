"""raysim command line: run, report, compare, methods, data show, data shard, new method, new dataset
(tune lives in raysim.tuning).

User errors print one line, ``raysim: error: ...``, and exit with code 2; no traceback. A run that
stops for another reason (a failed write, a lost actor beyond runtime.max_restarts) prints one
line with what is intact and how to resume, exit 1; a bug in a method's code prints its traceback
and that line, exit 1; a fault another try may not meet (no spare capacity, a lock another host
still holds, Ray's control processes gone) exits 75 (EX_TEMPFAIL, which cluster/supervise.sh
retries); Ctrl-C exits 130 and SIGTERM 143, with the resume hint when there is something to resume.
"""
from __future__ import annotations

import argparse
import os
import sys

from raysim.core.errors import (Interrupted, MethodFailed, RunFailed, Terminated, TryLater, UserError, first_line,
                                 signal_of)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own usage errors: one line, exit 2
        raise UserError(f"{message} (see '{self.prog} --help')" if " " in self.prog else message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="raysim", description="Federated learning under domain shift, simulated on Ray.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = sub.add_parser("run", help="run an experiment (default: configs/quickstart.yaml); rerun on the "
                                     "same --out to continue it")
    run.add_argument("args", nargs="*", metavar="[CONFIG] [key=value ...]")
    run.add_argument("--out", help="run directory (default: runs/<name>-<time>); if it holds a run of the "
                                   "same config, that run continues")
    run.add_argument("--address", help="Ray cluster address: auto, ray://host:port (default: local Ray)")
    run.add_argument("--quiet", action="store_true", help="no progress output")
    run.add_argument("--resume", metavar="RUN_DIR", help="continue a stopped run from its last checkpoint")
    run.add_argument("--check", action="store_true",
                     help="check everything that needs no training (the config; the dataset and its root; that "
                          "the partition fits the data; clients_per_round; the hosts against this machine's CPUs, "
                          "or that --address answers), print the config resolved, and exit; no Ray, no run folder")
    run.add_argument("--debug", action="store_true",
                     help="run every federation in this process, one after another, without Ray: breakpoint() "
                          "and pdb work inside a method (slower; no parallel hosts)")

    rep = sub.add_parser("report", help="re-render summary.md and curves.png from metrics.parquet")
    rep.add_argument("run_dir")

    cmp_ = sub.add_parser("compare", help="one table (and curves) across run directories")
    cmp_.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    cmp_.add_argument("--by", choices=("method", "seed", "holdout"), default="method",
                      help="rows: one per method (default; mean ± std over seeds), per (method, seed); "
                           "holdout: leave-one-domain-out runs, one column per held-out domain")
    cmp_.add_argument("--out", help="folder for compare.md, compare.csv and compare.png")

    meth = sub.add_parser("methods", help="the method catalog; with NAME: its hyperparameters and search space")
    meth.add_argument("name", nargs="?", metavar="NAME")

    data = sub.add_parser("data", help="inspect datasets")
    dsub = data.add_subparsers(dest="data_command", required=True, parser_class=_Parser)
    show = dsub.add_parser("show", help="table of domains and splits; --grid saves sample images")
    show.add_argument("name", help="a dataset's name, or a loader of your own: module:function (raysim/data/README.md)")
    show.add_argument("options", nargs="*", metavar="key=value", help="the loader's options (data.options), "
                                                                     "e.g. image_size=16, right after NAME")
    show.add_argument("--root", help="folder of a real dataset")
    show.add_argument("--grid", help="PNG file for a grid of sample images per domain")
    shard = dsub.add_parser("shard", help="write a config's client partition as Parquet shards "
                                          "(then run it with data.shards=URI)")
    shard.add_argument("config", metavar="CONFIG")
    shard.add_argument("uri", metavar="URI", help="folder or pyarrow.fs URI: file://, s3://bucket/path, gs://...")
    shard.add_argument("overrides", nargs="*", metavar="key=value")
    shard.add_argument("--image-format", choices=("raw", "png"), default="raw",
                       help="raw uint8 (fastest to read, default) or png (smaller)")
    shard.add_argument("--clients-per-file", type=int, default=1,
                       help="clients per Parquet file, one row group each (default 1; raise it for 100k clients)")

    new = sub.add_parser("new", help="start something of your own from a template")
    nsub = new.add_subparsers(dest="new_command", required=True, parser_class=_Parser)
    nmeth = nsub.add_parser("method", help="write NAME.py (a method: FedAvg with a hyperparameter and its own "
                                           "client step) and test_NAME.py beside it; never overwrites")
    nmeth.add_argument("name", metavar="NAME", help="the method's name and module name (a Python identifier)")
    nmeth.add_argument("--dir", default=".", help="folder for the files (default: the current one)")
    nmeth.add_argument("--from", dest="example", metavar="EXAMPLE",
                       help="start from a shipped example instead, under NAME: fednova (FedNova, NeurIPS 2020: "
                            "NAME.py, test_NAME.py, NAME_tune.yaml)")
    ndata = nsub.add_parser("dataset", help="write NAME.py (a dataset loader: two domains of generated images "
                                            "with per-sample writer ids, where your reading code goes) and "
                                            "test_NAME.py beside it; never overwrites")
    ndata.add_argument("name", metavar="NAME", help="the module's name (a Python identifier); the loader is load_NAME")
    ndata.add_argument("--dir", default=".", help="folder for the files (default: the current one)")

    tune = sub.add_parser("tune", help="hyperparameter search with Ray Tune + Optuna")
    tune.add_argument("args", nargs="*", metavar="CONFIG [key=value ...]")
    tune.add_argument("--out", help="search directory")
    tune.add_argument("--address", help="Ray cluster address")
    return p


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line; a run's or a search's key=value overrides may also follow its options
    (``raysim run cfg.yaml --out runs/x train.lr=0.1``), where argparse alone stops at them."""
    parser = _parser()
    ns, extra = parser.parse_known_args(argv)
    if extra and isinstance(getattr(ns, "args", None), list) and all("=" in e and not e.startswith("-") for e in extra):
        ns.args += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return ns


def split_config_and_overrides(args: list[str]) -> tuple[str | None, list[str]]:
    if args and "=" not in args[0]:
        return args[0], args[1:]
    return None, args


def cmd_run(ns) -> int:
    from raysim.app.configs import load_checked

    if ns.resume:
        from raysim.app.experiment import resume_config, run
        if ns.args and "=" not in ns.args[0]:
            raise UserError("--resume takes the run directory's own config; give no CONFIG file")
        cfg = resume_config(ns.resume, ns.args)
        if ns.check:
            return _check(cfg, ns.address)
        run(cfg, out=ns.resume, address=ns.address, progress=not ns.quiet, resume=True, debug=ns.debug)
        return 0
    from raysim.app.shipped import find_config, quickstart

    path, overrides = split_config_and_overrides(ns.args)
    if path is None:
        path = quickstart()
        if not path.is_file():
            raise UserError(not_installed("the quickstart config")
                            or f"no CONFIG given and the quickstart config is missing: {path}")
    cfg = load_checked(find_config(path), overrides)
    if ns.check:
        return _check(cfg, ns.address)
    from raysim.app.experiment import run
    run(cfg, out=ns.out, address=ns.address, progress=not ns.quiet, debug=ns.debug)
    return 0


def _check(cfg, address: str | None) -> int:
    """``raysim run --check``: everything :mod:`raysim.app.preflight` finds without training, then
    the config resolved (YAML) and a comment line saying what was checked."""
    import yaml

    from raysim.app.preflight import preflight
    checked = preflight(cfg, address=address)
    print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
    print(checked.summary())
    return 0


def cmd_report(ns) -> int:
    from raysim.app.report import render
    print(render(ns.run_dir))
    return 0


def cmd_compare(ns) -> int:
    from raysim.app.compare import compare
    print(compare(ns.run_dirs, by=ns.by, out=ns.out), end="")
    return 0


def cmd_methods(ns) -> int:
    from raysim.app.catalog import methods
    print(methods(ns.name), end="")
    return 0


def cmd_data(ns) -> int:
    if ns.data_command == "shard":
        return cmd_data_shard(ns)
    from raysim.config import parse_override
    from raysim.data.show import show

    opts = {}
    for text in ns.options:
        path, value = parse_override(text)
        if len(path) != 1:
            raise UserError(f"raysim data show NAME [key=value ...]: {text!r}: an option's name has no '.'")
        opts[path[0]] = value
    print(show(ns.name, root=ns.root, grid=ns.grid, **opts))
    if ns.grid:
        print(f"sample grid written to {ns.grid}")
    return 0


def cmd_data_shard(ns) -> int:
    from raysim.app.configs import load_checked
    from raysim.app.sharding import write_federation_shards

    bad = [o for o in ns.overrides if "=" not in o]
    if bad:
        raise UserError(f"raysim data shard CONFIG URI [key=value ...]: {bad[0]!r} is not key=value")
    from raysim.app.shipped import find_config
    cfg = load_checked(find_config(ns.config), ns.overrides)
    write_federation_shards(cfg, ns.uri, image_format=ns.image_format, clients_per_file=ns.clients_per_file,
                            echo=print)
    print("run it with: raysim run " + " ".join([ns.config, *ns.overrides, f"data.shards={ns.uri}"]))
    return 0


def cmd_tune(ns) -> int:
    try:
        from raysim.tuning.search import main as tune_main
    except ImportError:
        raise UserError("raysim tune is not available in this build") from None
    path, overrides = split_config_and_overrides(ns.args)
    if path is None:
        raise UserError("raysim tune needs a CONFIG file (e.g. configs/tune/fdse.yaml)")
    from raysim.app.shipped import find_config
    return tune_main(find_config(path), overrides, out=ns.out, address=ns.address)


def cmd_new(ns) -> int:
    from raysim.app import scaffold
    if ns.new_command == "dataset":
        written = scaffold.new_dataset(ns.name, ns.dir)
        steps = scaffold.dataset_next_steps(ns.name, ns.dir)
    else:
        written = scaffold.new_method(ns.name, ns.dir, example=ns.example)
        steps = scaffold.next_steps(ns.name, ns.dir, tune=any(p.endswith("_tune.yaml") for p in written))
    for path in written:
        print(f"wrote {path}")
    print(steps, end="")
    return 0


# exits after which the process ends at once: every file is written and Ray's processes are ended,
# but the interpreter's own exit would still wait seconds on Ray's connections to processes that
# are gone (its atexit shutdown), after a signal or a lost Ray node
_END_AT_ONCE = (TryLater.exit_code, 128 + 2, 128 + 15)


def console_main() -> None:
    """The ``raysim`` command (and ``python -m raysim``): :func:`main`, then the process's exit."""
    code = main()
    if code in _END_AT_ONCE:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


# raysim's packages that are the checkout's top-level folders, mapped by pyproject's package-dir:
# only an install (editable or not) makes them importable, and registers the methods' entry points
MAPPED_PACKAGES = ("raysim.methods", "raysim.tuning", "raysim.configs", "raysim.examples")


def not_installed(missing: str) -> str | None:
    """The one line for raysim run from a checkout it was never installed from (``missing``: what
    it lacks; no raysim distribution in this Python), else None."""
    from importlib import metadata

    try:
        metadata.distribution("raysim")
        return None
    except metadata.PackageNotFoundError:
        return (f"raysim is not installed in this Python ({sys.executable}): {missing} comes with the "
                "install; run `pip install -e .` (or `make run`) in the checkout")


def _on_sigterm(signum, frame):
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    import signal
    import threading

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    previous = None
    if threading.current_thread() is threading.main_thread():  # SIGTERM stops a run like Ctrl-C does
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        ns = _parse(argv)
        return {"run": cmd_run, "report": cmd_report, "compare": cmd_compare, "methods": cmd_methods,
                "data": cmd_data, "tune": cmd_tune, "new": cmd_new}[ns.command](ns)
    except UserError as err:
        print(f"raysim: error: {first_line(err)}", file=sys.stderr)
        return 2
    except Interrupted as err:
        print(f"raysim: {first_line(err)}", file=sys.stderr)
        return 128 + err.signal
    except TryLater as err:
        print(f"raysim: {first_line(err)}", file=sys.stderr)
        return TryLater.exit_code
    except MethodFailed as err:
        if err.traceback:
            print(err.traceback.rstrip(), file=sys.stderr)
        print(f"raysim: {first_line(err)}", file=sys.stderr)
        return 1
    except RunFailed as err:
        print(f"raysim: {first_line(err)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as err:
        print("raysim: interrupted", file=sys.stderr)
        return 128 + signal_of(err)
    except ModuleNotFoundError as err:  # any other missing module is a bug's, with its traceback
        why = not_installed(f"module {err.name}") if err.name in MAPPED_PACKAGES else None
        if why is None:
            raise
        print(f"raysim: error: {why}", file=sys.stderr)
        return 2
    except OSError as err:  # a write no part of raysim named (the run's own are WriteFailed)
        from raysim.core.files import describe
        where = f" ({err.filename})" if getattr(err, "filename", None) else ""
        print(f"raysim: {describe(err)}{where}", file=sys.stderr)
        return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    console_main()
