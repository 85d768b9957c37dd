"""The tune config: which method, on which experiment, optimising which validation metric, how.

    raysim tune CONFIG [key=value ...]

A tune config is YAML. Its *tune keys* (``TUNE_KEYS``) describe the search; every other key,
in the file or on the command line, belongs to the base experiment. So ``trials=4`` sets the
number of trials and ``rounds=3`` (or ``experiment.rounds=3``) the federation's rounds, and a
file may hold a whole experiment config next to its tune keys. See tuning/README.md.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raysim.app.configs import load_checked
from raysim.app.rundir import with_holdout
from raysim.app.shipped import shipped_config, shipped_configs
from raysim.config import ExperimentConfig, apply_overrides, get_path, merge, parse_override, read_yaml, set_path
from raysim.core.errors import UserError, first_line
from raysim.tuning import space as sp
from raysim.core.hparams import Space

TUNE_KEYS = ("experiment", "name", "method", "metric", "mode", "trials", "max_concurrent", "max_failures",
             "sampler", "scheduler", "space", "initial_points", "resources")

# A failed trial (its worker died, its node was lost, its federation raised) is retried this many
# times by Tune (FailureConfig), each retry resuming the federation from its last checkpoint.
# 2: a transient loss is survived twice over, while a failure that repeats (a bug, a trial that
# cannot fit) costs at most three partial runs of one trial before the search moves on.
MAX_FAILURES = 2

# Metrics every trial reports after each evaluated round (``round`` is Tune's time axis).
# Test metrics are never reported to Tune, so nothing can be selected on them.
METRICS = {
    "val_avg_best": "max",  # best mean per-client validation accuracy so far (default)
    "val_avg": "max",  # mean per-client validation accuracy of the latest evaluation
    "val_all_best": "max",  # best pooled validation accuracy so far
    "val_all": "max",  # pooled validation accuracy of the latest evaluation
    "train_loss": "min",  # mean training loss of the latest round
}
SAMPLERS = {"tpe": "TPESampler", "random": "RandomSampler", "cmaes": "CmaEsSampler", "qmc": "QMCSampler",
            "gp": "GPSampler"}
SCHEDULERS = ("asha", "median", "none")
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
PATH_KEYS = ("data.root", "model.pretrained", "runtime.spill_dir")


@dataclass
class TuneSpec:
    name: str
    method: str
    experiment: dict  # the base experiment (raw, validated), method set; paths as the user wrote them
    space: dict[str, Space]
    metric: str = "val_avg_best"
    mode: str = "max"
    trials: int = 8
    max_concurrent: int = 2
    max_failures: int = MAX_FAILURES  # retries of a failed trial, each from its last checkpoint
    sampler: dict = field(default_factory=lambda: {"kind": "tpe", "seed": 0})
    scheduler: dict = field(default_factory=lambda: {"kind": "asha", "grace_period": 2, "reduction_factor": 2})
    initial_points: list = field(default_factory=list)
    resources: dict = field(default_factory=lambda: {"trial_cpus": 0.0, "strategy": "PACK"})
    source: str | None = None

    # ---- experiments ------------------------------------------------------------------------
    def base_config(self) -> ExperimentConfig:
        return load_checked(raw=self.experiment)

    @property
    def rounds(self) -> int:
        return self.base_config().rounds

    def experiment_config(self, params: dict) -> ExperimentConfig:
        """The base experiment with a trial's hyperparameters set (what ``best.yaml`` holds)."""
        return load_checked(raw=sp.apply_params(self.experiment, params))

    def run_experiment(self) -> dict:
        """The base experiment as trials run it: relative paths made absolute (a trial's worker may
        start elsewhere) and, for leave-one-domain-out, the one held-out domain set."""
        raw = copy.deepcopy(self.experiment)
        for key in PATH_KEYS:
            value = get_path(raw, key)
            if isinstance(value, str) and value and not os.path.isabs(value):
                set_path(raw, key, os.path.abspath(os.path.expanduser(value)))
        cfg = load_checked(raw=raw)
        if cfg.eval.protocol == "lodo":
            set_path(raw, "data.partition", with_holdout(cfg, cfg.eval.holdout).data.partition)
        return raw

    def record(self) -> dict:
        """Everything that defines the search (written to search.yaml, compared on resume)."""
        return {"name": self.name, "method": self.method, "metric": self.metric, "mode": self.mode,
                "trials": self.trials, "max_concurrent": self.max_concurrent, "max_failures": self.max_failures,
                "sampler": dict(self.sampler),
                "scheduler": dict(self.scheduler), "space": sp.as_jsonable(self.space),
                "initial_points": [dict(p) for p in self.initial_points], "resources": dict(self.resources),
                "experiment": copy.deepcopy(self.experiment)}  # as given: engine defaults may change


# ----------------------------------------------------------------------------- loading

def load_spec(path: str | os.PathLike | None = None, overrides: list[str] | None = None,
              raw: dict | None = None) -> TuneSpec:
    """Read a tune config, apply ``key=value`` overrides (tune keys to the search, the rest to
    the experiment), resolve the experiment and the space, and validate everything up front."""
    base_dir = Path(path).resolve().parent if path is not None else Path.cwd()
    data = read_yaml(path) if path is not None else copy.deepcopy(raw or {})
    tune_over, exp_over = route_overrides(overrides or [])
    for keys, value in tune_over:
        _apply_tune_override(data, keys, value)

    tune = {k: data[k] for k in TUNE_KEYS if k in data}
    patch = {k: v for k, v in data.items() if k not in TUNE_KEYS}
    experiment = _resolve_experiment(tune.get("experiment"), base_dir,
                                     from_cli=any(k[0] == "experiment" and len(k) == 1 for k, _ in tune_over))
    merge(experiment, patch)  # a fresh dict: _resolve_experiment copies what it is given
    experiment = apply_overrides(experiment, exp_over)

    method = tune.get("method")
    if method is None:
        method = experiment.get("method")
        if experiment.get("methods"):
            raise UserError("a search tunes one method; the experiment lists several under 'methods', "
                            "so set 'method: NAME' in the tune config (or method=NAME)")
    if not isinstance(method, str) or not method:
        raise UserError("the tune config needs 'method: NAME' (the method whose hyperparameters are searched)")
    experiment["method"] = method
    experiment.pop("methods", None)
    cfg = _load_experiment(experiment)
    from raysim.methods import registry
    method_cls = registry.get(method)
    key = registry.name_of(method)  # hp.<key>: a plugin module:Class's class name

    metric = tune.get("metric", "val_avg_best")
    mode = _metric_mode(metric, tune.get("mode"))
    if cfg.eval.protocol == "lodo":
        if cfg.eval.holdout == "all":
            raise UserError("tuning under eval.protocol=lodo needs one held-out domain: set eval.holdout "
                            "to a domain name (each trial is one federation)")
    elif "val" not in cfg.eval.splits:
        raise UserError(f"tuning selects on validation accuracy, but eval.splits = {cfg.eval.splits}; "
                        "add 'val' (e.g. eval.splits=[val,test])")

    space = sp.resolve_space(method_cls, key, tune.get("space"))
    _check_space_against(space, experiment)

    name = tune.get("name") or (Path(path).stem if path is not None else key)
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        raise UserError(f"tune config key 'name' = {name!r}: expected letters, digits, '.', '_' or '-'")

    spec = TuneSpec(
        name=name, method=method, experiment=experiment, space=space, metric=metric, mode=mode,
        trials=_positive_int(tune, "trials", 8), max_concurrent=_positive_int(tune, "max_concurrent", 2),
        max_failures=_count(tune, "max_failures", MAX_FAILURES),
        sampler=_sampler(tune.get("sampler", "tpe")),
        scheduler=_scheduler(tune.get("scheduler", "asha"), cfg.rounds),
        resources=_resources(tune.get("resources")),
        source=str(path) if path is not None else None)
    spec.initial_points = _initial_points(tune.get("initial_points"), spec, cfg, method_cls)
    return spec


def route_overrides(overrides: list[str]) -> tuple[list[tuple[list[str], Any]], list[str]]:
    """Split ``key=value`` overrides: tune keys to the search, ``experiment.KEY=...`` and every
    other key to the experiment (``rounds=3`` is the experiment's)."""
    tune, exp = [], []
    for text in overrides:
        keys, value = parse_override(text)
        if keys[0] == "experiment" and len(keys) > 1:
            exp.append(".".join(keys[1:]) + "=" + text.split("=", 1)[1])
        elif keys[0] in TUNE_KEYS:
            tune.append((keys, value))
        else:
            exp.append(text)
    return tune, exp


def _apply_tune_override(data: dict, keys: list[str], value) -> None:
    head = keys[0]
    if len(keys) == 1:
        data[head] = value
    elif head == "space":  # space.train.lr={loguniform: [...]}: the rest of the key is one entry
        section = data.get("space")
        if section is None:
            section = data["space"] = {}
        if not isinstance(section, dict):
            raise UserError("tune config key 'space' must be a mapping to set space.KEY")
        section[".".join(keys[1:])] = value
    elif head in ("sampler", "scheduler", "resources"):
        section = data.get(head)
        if isinstance(section, str):
            section = {"kind": section}
        section = dict(section or {})
        node = section
        for part in keys[1:-1]:
            node = node.setdefault(part, {})
        node[keys[-1]] = value
        data[head] = section
    else:
        raise UserError(f"override '{'.'.join(keys)}=...': tune key '{head}' has no sub-keys")


def _resolve_experiment(value, base_dir: Path, from_cli: bool) -> dict:
    if value is None:
        return {}
    if isinstance(value, dict):
        return copy.deepcopy(value)
    if not isinstance(value, str):
        raise UserError(f"tune config key 'experiment' = {value!r}: expected a path to an experiment "
                        "config or an inline mapping")
    candidates = [Path(value)] if os.path.isabs(value) else (
        [Path.cwd() / value, base_dir / value] if from_cli else [base_dir / value, Path.cwd() / value])
    for c in candidates:
        if c.is_file():
            return read_yaml(c)
    shipped = shipped_config(value)  # then the configs raysim ships, as `raysim run` looks
    if shipped is not None:
        return read_yaml(shipped)
    raise UserError(f"experiment config not found: {value} (looked in "
                    f"{', '.join(str(c.parent) for c in candidates)} and among raysim's shipped configs "
                    f"in {shipped_configs()})")


def _load_experiment(raw: dict) -> ExperimentConfig:
    try:
        return load_checked(raw=raw)
    except UserError as err:
        msg = str(err)
        m = re.match(r"unknown config key '([^'.]+)'", msg)
        if m:
            raise UserError(f"unknown config key '{m.group(1)}': neither a tune key ({', '.join(TUNE_KEYS)}) "
                            f"nor an experiment key ({', '.join(f.name for f in dataclasses.fields(ExperimentConfig))})"
                            ) from None
        raise


def _metric_mode(metric, mode) -> str:
    if not isinstance(metric, str):
        raise UserError(f"tune config key 'metric' = {metric!r}: expected one of {', '.join(METRICS)}")
    if metric.startswith("test"):
        raise UserError(f"tune config key 'metric' = {metric!r}: a search never selects on a test metric; "
                        f"use a validation metric ({', '.join(METRICS)})")
    if metric not in METRICS:
        raise UserError(f"tune config key 'metric' = {metric!r}: expected one of {', '.join(METRICS)}")
    if mode is not None and mode != METRICS[metric]:
        raise UserError(f"tune config key 'mode' = {mode!r}: {metric} is always {METRICS[metric]}imised")
    return METRICS[metric]


def _positive_int(tune: dict, key: str, default: int) -> int:
    value = tune.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"tune config key '{key}' = {value!r}: expected a positive integer")
    return value


def _count(tune: dict, key: str, default: int) -> int:
    value = tune.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise UserError(f"tune config key '{key}' = {value!r}: expected an integer >= 0")
    return value


def _sampler(value) -> dict:
    if value is None:
        value = "tpe"
    if isinstance(value, str):
        value = {"kind": value}
    if not isinstance(value, dict):
        raise UserError(f"tune config key 'sampler' = {value!r}: expected a name ({', '.join(SAMPLERS)}) "
                        "or {kind: NAME, seed: N, ...}")
    out = {"kind": "tpe", "seed": 0, **value}
    if out["kind"] not in SAMPLERS:
        raise UserError(f"tune config key 'sampler.kind' = {out['kind']!r}: expected one of {', '.join(SAMPLERS)}")
    if out["seed"] is not None and (isinstance(out["seed"], bool) or not isinstance(out["seed"], int)):
        raise UserError(f"tune config key 'sampler.seed' = {out['seed']!r}: expected an integer or null")
    if out["kind"] == "cmaes":
        import importlib.util
        if importlib.util.find_spec("cmaes") is None:
            raise UserError("sampler 'cmaes' needs the 'cmaes' package (pip install cmaes); "
                            "or use sampler=tpe")
    return out


def _scheduler(value, rounds: int) -> dict:
    if value is None or value is False:
        value = "none"
    if isinstance(value, str):
        value = {"kind": value.lower()}
    if not isinstance(value, dict):
        raise UserError(f"tune config key 'scheduler' = {value!r}: expected none, asha, median or "
                        "{kind: asha, grace_period: N, reduction_factor: N}")
    kind = value.get("kind", "asha")
    if kind == "fifo":
        kind = "none"
    if kind not in SCHEDULERS:
        raise UserError(f"tune config key 'scheduler.kind' = {kind!r}: expected one of {', '.join(SCHEDULERS)}")
    if kind == "none":
        return {"kind": "none"}
    defaults = {"asha": {"grace_period": 2, "reduction_factor": 2},
                "median": {"grace_period": 2, "min_samples_required": 3}}[kind]
    out = {**defaults, **value, "kind": kind}
    g = out["grace_period"]
    if isinstance(g, bool) or not isinstance(g, int) or g < 1:
        raise UserError(f"tune config key 'scheduler.grace_period' = {g!r}: expected a number of rounds >= 1")
    out["grace_period"] = min(g, rounds)  # a grace period past the last round would stop nothing
    if kind == "asha":
        rf = out["reduction_factor"]
        if isinstance(rf, bool) or not isinstance(rf, (int, float)) or rf <= 1:
            raise UserError(f"tune config key 'scheduler.reduction_factor' = {rf!r}: expected a number > 1")
    return out


def _resources(value) -> dict:
    if not isinstance(value or {}, dict):
        raise UserError("tune config key 'resources' must be a mapping {trial_cpus: N, strategy: PACK}")
    out = {"trial_cpus": 0.0, "strategy": "PACK", **(value or {})}
    unknown = set(out) - {"trial_cpus", "strategy"}
    if unknown:
        raise UserError(f"unknown tune config key 'resources.{sorted(unknown)[0]}'; valid: trial_cpus, strategy")
    c = out["trial_cpus"]
    if isinstance(c, bool) or not isinstance(c, (int, float)) or c < 0:
        raise UserError(f"tune config key 'resources.trial_cpus' = {c!r}: expected a number >= 0")
    out["trial_cpus"] = float(c)
    s = str(out["strategy"]).upper()
    if s not in STRATEGIES:
        raise UserError(f"tune config key 'resources.strategy' = {out['strategy']!r}: expected one of "
                        f"{', '.join(STRATEGIES)}")
    out["strategy"] = s
    return out


def _check_space_against(space: dict[str, Space], experiment: dict) -> None:
    """Every corner of the space must make a valid experiment (typos and impossible ranges fail now,
    not in trial 7)."""
    for key, s in space.items():
        for value in sp.endpoints(s):
            try:
                load_checked(raw=sp.apply_params(experiment, {key: value}))
            except UserError as err:
                raise UserError(f"search space entry '{key}' value {value!r} is not a valid experiment: "
                                f"{first_line(err)}") from None


def current_value(cfg: ExperimentConfig, key: str, method_cls):
    """The experiment's value for a searched key (hyperparameters: the config's or the default)."""
    if key.startswith("hp."):
        _, method, name = key.split(".")
        hp = method_cls.hparams_from(cfg.hp.get(method), prefix=f"hp.{method}")
        return getattr(hp, name)
    return get_path(cfg.to_dict(), key)


def _initial_points(value, spec: TuneSpec, cfg: ExperimentConfig, method_cls) -> list[dict]:
    """Trials to evaluate first, in order. ``defaults`` is the experiment's own values; a mapping
    may name some keys and takes the experiment's values for the rest."""
    if value is None:
        return []
    from raysim.methods import registry
    method_key = registry.name_of(spec.method)  # hp.<method_key>: a plugin's class name
    if not isinstance(value, list):
        value = [value]
    points = []
    for i, p in enumerate(value):
        where = f"tune config key 'initial_points[{i}]'"
        if p == "defaults":
            p = {}
        if not isinstance(p, dict):
            raise UserError(f"{where} = {p!r}: expected 'defaults' or a mapping of searched keys to values")
        given = {sp.full_key(str(k), method_key): sp.plain(v) for k, v in p.items()}
        extra = sorted(set(given) - set(spec.space))
        if extra:
            raise UserError(f"{where}: '{extra[0]}' is not searched; searched keys: {', '.join(spec.space)}")
        point = {}
        for key, s in spec.space.items():
            v = given[key] if key in given else current_value(cfg, key, method_cls)
            if not sp.contains(s, v):
                origin = "" if key in given else " (the experiment's value)"
                raise UserError(f"{where}: {key} = {v!r}{origin} lies outside its search range "
                                f"{sp.describe({key: s}).split(' ', 1)[1]}")
            point[key] = float(v) if s.kind in ("loguniform", "uniform") else v
        points.append(point)
    return points
