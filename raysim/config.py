"""Experiment configuration: YAML in, typed dataclasses out, every mistake a one-line UserError.

A config is plain YAML read with the safe loader. Sections map to the dataclasses below; unknown
keys, wrong types and impossible values are reported with the dotted key, the value, and what was
expected. ``key=value`` overrides from the command line use the same dotted keys.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from raysim.errors import UserError


SELECT_RULES = ("val", "val_weighted", "test", "final")  # eval.select: see EvalConfig


@dataclass
class DataConfig:
    dataset: str = "digits5"
    root: str | None = None  # folder of a real dataset on disk; None for generated benchmarks
    options: dict = field(default_factory=dict)  # passed to the dataset loader (image_size, ...)
    partition: dict = field(default_factory=lambda: {"kind": "per_domain"})
    # pre-written Parquet shards of this partition (a path or a pyarrow.fs URI: file://, s3://,
    # gs://), written by `raysim data shard CONFIG URI`; each host then reads only its clients' data
    shards: str | None = None


@dataclass
class ModelConfig:
    name: str = "cnn6"
    norm: str = "default"  # "default" = the paper's norm for that network; bn | gn | ln | in | none
    pretrained: str | None = None  # local weights file; nothing is downloaded
    options: dict = field(default_factory=dict)


@dataclass
class TrainConfig:
    epochs: int = 1
    batch_size: int = 32
    lr: float = 0.01
    momentum: float = 0.0
    weight_decay: float = 0.0
    lr_decay: float = 1.0  # multiplied into lr once per round: lr_t = lr * lr_decay ** (t - 1)
    max_steps: int | None = None  # cap on local steps per round (None: whole epochs)
    grad_clip: float | None = None  # max global grad norm
    weighting: str = "samples"  # aggregation weights: "samples" (n_k) or "uniform"


@dataclass
class EvalConfig:
    every: int = 1  # evaluate every k rounds (and always after the last)
    protocol: str = "personalized"  # personalized | global | lodo
    holdout: str = "all"  # lodo: "all" or a domain name
    splits: list = field(default_factory=lambda: ["val", "test"])
    clients: Any = "all"  # "all", or an int: a fixed seeded subset of clients is evaluated
    # personalized protocol: a client's model as it receives it for the next round ("received", after
    # aggregation), or as it left its last local training ("post_train": FLGo's and FDSE's code)
    point: str = "received"
    # which evaluated round summary.md headlines: "val" (best validation AVG, the default; under lodo
    # the source clients' validation), "val_weighted" (best train-size-weighted mean of the clients'
    # validation accuracies: FDSE's code), "test" (best test AVG: peeks at the test split, as DapperFL
    # reports), "final" (the last round)
    select: str = "val"
    # unseen clients (lodo targets): run the method's label-free adaptation on the client's unlabeled
    # test data before evaluating it (FedBN: BN statistics; FDSE: Alg. 3); false: the model as built
    adapt: bool = True


@dataclass
class RuntimeConfig:
    num_hosts: int | None = 2  # ClientHost actors; None: derived from clients_per_host
    clients_per_host: int | None = None  # None: ceil(num_clients / num_hosts)
    cpus_per_host: float = 1.0
    gpus_per_host: float = 0.0  # fractional GPUs per host, e.g. 0.25
    server_cpus: float = 0.0
    torch_threads: int | None = None  # None: cpus_per_host rounded down (at least 1)
    state_memory_mb: float = 4096.0  # per host; idle clients' state beyond this spills to disk
    spill_dir: str | None = None  # None: a temp folder per host
    address: str | None = None  # Ray address: None (local, or RAY_ADDRESS), "auto", "ray://..."
    pg_timeout_s: float = 60.0
    # federations of one run (methods x held-out domains) run at once; None: as many as the
    # cluster's free CPUs and GPUs fit, each with its own placement group
    parallel_federations: int | None = None


@dataclass
class CheckpointConfig:
    every: int = 0  # write a checkpoint every k rounds (0: never)
    keep: int = 2  # keep the newest k checkpoints


@dataclass
class ExperimentConfig:
    method: str | None = "fedavg"
    methods: list | None = None  # several methods on the same data and seed -> one comparison table
    rounds: int = 20
    seed: int = 0
    seeds: list | None = None  # several seeds: every method runs once per seed (takes the place of seed)
    clients_per_round: int | None = None  # None with fraction None: every client every round
    fraction: float | None = None
    name: str | None = None
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    hp: dict = field(default_factory=dict)  # per-method hyperparameters: {method_name: {field: value}}
    # settings that differ per method in a comparison, e.g. {fedbn: {train: {lr: 0.05}}}
    per_method: dict = field(default_factory=dict)

    def method_names(self) -> list[str]:
        return list(self.methods) if self.methods else [self.method]

    def for_method(self, name: str) -> "ExperimentConfig":
        """This config narrowed to one method of a comparison, with that method's ``per_method``
        settings merged in."""
        raw = self.to_dict()
        raw.update(method=name, methods=None, per_method={})
        _merge(raw, self.per_method.get(name) or {})
        return _build(ExperimentConfig, raw)

    def seed_list(self) -> list[int]:
        return list(self.seeds) if self.seeds else [self.seed]

    def for_seed(self, seed: int) -> "ExperimentConfig":
        """This config narrowed to one seed of a multi-seed run."""
        raw = self.to_dict()
        raw.update(seed=seed, seeds=None)
        return _build(ExperimentConfig, raw)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------- parsing

def _type_name(tp) -> str:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    return {type(None): "null"}.get(tp, getattr(tp, "__name__", str(tp)))


def _coerce(value, tp, key: str):
    """Check ``value`` against the annotated type; ints are accepted where floats are expected."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(tp):
            try:
                return _coerce(value, option, key)
            except UserError:
                continue
        raise UserError(f"config key '{key}' = {value!r}: expected {_type_name(tp)}")
    if tp is type(None):
        if value is None:
            return None
    elif tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(float(value)):
                raise UserError(f"config key '{key}' = {value!r}: expected a finite number")
            return float(value)
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp in (dict, list) or origin in (dict, list):
        base = origin or tp
        if isinstance(value, base):
            return copy.deepcopy(value)
    elif dataclasses.is_dataclass(tp):
        return _build(tp, value, key)
    raise UserError(f"config key '{key}' = {value!r}: expected {_type_name(tp)}")


def _build(cls, raw, prefix: str = ""):
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        where = f"config section '{prefix}'" if prefix else "config"
        raise UserError(f"{where} must be a mapping of keys to values, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if key not in hints:
            raise UserError(f"unknown config key '{dotted}'; valid keys here: {', '.join(names)}")
        kwargs[key] = _coerce(value, hints[key], dotted)
    return cls(**kwargs)


def _merge(into: dict, extra: dict) -> None:
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = copy.deepcopy(v)


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text or text.startswith("="):
        raise UserError(f"override '{text}' is not of the form key=value (e.g. train.lr=0.05)")
    key, value = text.split("=", 1)
    try:
        parsed = yaml.safe_load(value) if value != "" else None
    except yaml.YAMLError:
        parsed = value
    return key.strip().split("."), parsed


def set_path(raw: dict, path: list[str], value, where: str) -> None:
    """Set ``raw[path[0]][path[1]]... = value``, creating missing sections; ``where`` names the
    source (an override, a tuned key) in the error when a step is not a section."""
    node = raw
    for part in path[:-1]:
        nxt = node.get(part)
        if nxt is None:
            nxt = node[part] = {}
        if not isinstance(nxt, dict):
            raise UserError(f"{where}: '{part}' is not a section")
        node = nxt
    node[path[-1]] = value


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    raw = copy.deepcopy(raw)
    for text in overrides:
        path, value = parse_override(text)
        set_path(raw, path, value, where=f"override '{text}'")
        if path == ["method"]:  # method=NAME on the command line replaces a methods list
            raw.pop("methods", None)
        if path == ["methods"]:
            raw.pop("method", None)
        if path == ["seed"]:  # seed=N on the command line replaces a seeds list
            raw.pop("seeds", None)
    return raw


def read_yaml(path: str | os.PathLike) -> dict:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"config file not found: {path}")
    try:
        with open(path, encoding="utf-8") as fh:
            raw = yaml.safe_load(fh)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark else ""
        raise UserError(f"config file {path} is not valid YAML{where}") from None
    except UnicodeDecodeError:
        raise UserError(f"config file {path} is not UTF-8 text") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise UserError(f"config file {path} must hold a mapping of keys to values")
    return raw


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None,
                raw: dict | None = None) -> ExperimentConfig:
    """Read, override, type-check and validate an experiment config."""
    base = read_yaml(path) if path is not None else dict(raw or {})
    base = apply_overrides(base, overrides or [])
    if "methods" in base and "method" not in base:
        base["method"] = None
    cfg = _build(ExperimentConfig, base)
    validate(cfg)
    if cfg.data.shards and "://" not in cfg.data.shards:  # a local path means the driver's cwd
        cfg.data.shards = os.path.abspath(os.path.expanduser(cfg.data.shards))
    return cfg


def validate(cfg: ExperimentConfig) -> None:
    """Values that are well-typed but impossible. Checks needing the data or cluster live there."""
    from raysim.methods import registry  # late import: methods import config types

    def need(ok: bool, msg: str):
        if not ok:
            raise UserError(msg)

    names = cfg.method_names()
    need(bool(names) and all(isinstance(n, str) for n in names),
         "config needs 'method: NAME' or 'methods: [NAME, ...]'")
    for n in names:
        registry.get(n)  # raises UserError listing the known methods
    need(len(set(names)) == len(names), f"'methods' lists a method twice: {names}")
    need(cfg.name is None or (re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", cfg.name) is not None),
         f"config key 'name' = {cfg.name!r}: expected letters, digits, '.', '_' or '-' (it names the run folder)")
    for n, extra in cfg.per_method.items():
        need(n in names, f"config key 'per_method.{n}': {n!r} is not one of the run's methods {names}")
        need(isinstance(extra, dict), f"config key 'per_method.{n}' must be a mapping of settings")
        need(not {"method", "methods", "per_method"} & set(extra),
             f"config key 'per_method.{n}' cannot set method, methods or per_method")
        try:
            cfg.for_method(n)  # type-checks the merged settings
        except UserError as err:
            raise UserError(f"in per_method.{n}: {err}") from None
    for n, hp in cfg.hp.items():
        need(isinstance(hp, dict), f"config key 'hp.{n}' must map hyperparameter names to values")
        registry.get(n).hparams_from(hp, prefix=f"hp.{n}")
    need(cfg.seeds is None or (bool(cfg.seeds) and all(isinstance(x, int) and not isinstance(x, bool)
                                                       and x >= 0 for x in cfg.seeds)),
         f"config key 'seeds' = {cfg.seeds!r}: expected a non-empty list of non-negative integers")
    need(cfg.seeds is None or len(set(cfg.seeds)) == len(cfg.seeds), f"'seeds' lists a seed twice: {cfg.seeds}")
    need(cfg.rounds >= 1, f"config key 'rounds' = {cfg.rounds}: expected at least 1")
    need(cfg.clients_per_round is None or cfg.clients_per_round >= 1,
         f"config key 'clients_per_round' = {cfg.clients_per_round}: expected at least 1")
    need(cfg.fraction is None or 0 < cfg.fraction <= 1,
         f"config key 'fraction' = {cfg.fraction}: expected a number in (0, 1]")
    need(cfg.clients_per_round is None or cfg.fraction is None,
         "set either 'clients_per_round' or 'fraction', not both")
    t = cfg.train
    need(t.epochs >= 1, f"config key 'train.epochs' = {t.epochs}: expected at least 1")
    need(t.batch_size >= 1, f"config key 'train.batch_size' = {t.batch_size}: expected at least 1")
    need(t.lr > 0, f"config key 'train.lr' = {t.lr}: expected a positive number")
    need(0 <= t.momentum < 1, f"config key 'train.momentum' = {t.momentum}: expected 0 <= momentum < 1")
    need(t.weight_decay >= 0, f"config key 'train.weight_decay' = {t.weight_decay}: expected >= 0")
    need(0 < t.lr_decay <= 1, f"config key 'train.lr_decay' = {t.lr_decay}: expected a number in (0, 1]")
    need(t.max_steps is None or t.max_steps >= 1, "config key 'train.max_steps' must be at least 1")
    need(t.grad_clip is None or t.grad_clip > 0, "config key 'train.grad_clip' must be positive")
    need(t.weighting in ("samples", "uniform"),
         f"config key 'train.weighting' = {t.weighting!r}: expected 'samples' or 'uniform'")
    e = cfg.eval
    need(e.every >= 1, f"config key 'eval.every' = {e.every}: expected at least 1")
    need(e.protocol in ("personalized", "global", "lodo"),
         f"config key 'eval.protocol' = {e.protocol!r}: expected personalized, global or lodo")
    need(e.point in ("received", "post_train"),
         f"config key 'eval.point' = {e.point!r}: expected 'received' or 'post_train'")
    need(e.select in SELECT_RULES,
         f"config key 'eval.select' = {e.select!r}: expected one of {', '.join(SELECT_RULES)}")
    need(all(s in ("val", "test") for s in e.splits) and e.splits,
         f"config key 'eval.splits' = {e.splits!r}: expected a list of 'val' and/or 'test'")
    need(e.clients == "all" or (isinstance(e.clients, int) and not isinstance(e.clients, bool)
                                and e.clients >= 1),
         f"config key 'eval.clients' = {e.clients!r}: expected 'all' or a positive integer")
    r = cfg.runtime
    need(r.num_hosts is None or r.num_hosts >= 1,
         f"config key 'runtime.num_hosts' = {r.num_hosts}: expected at least 1")
    need(r.clients_per_host is None or r.clients_per_host >= 1,
         f"config key 'runtime.clients_per_host' = {r.clients_per_host}: expected at least 1")
    need(r.num_hosts is not None or r.clients_per_host is not None,
         "set 'runtime.num_hosts' or 'runtime.clients_per_host'")
    need(r.cpus_per_host > 0, f"config key 'runtime.cpus_per_host' = {r.cpus_per_host}: expected > 0")
    need(r.gpus_per_host >= 0, f"config key 'runtime.gpus_per_host' = {r.gpus_per_host}: expected >= 0")
    need(r.gpus_per_host <= 1 or float(r.gpus_per_host).is_integer(),
         f"config key 'runtime.gpus_per_host' = {r.gpus_per_host}: fractions must be at most 1")
    need(r.server_cpus >= 0, "config key 'runtime.server_cpus' must be >= 0")
    need(r.torch_threads is None or r.torch_threads >= 1, "config key 'runtime.torch_threads' must be >= 1")
    need(r.state_memory_mb >= 0, "config key 'runtime.state_memory_mb' must be >= 0")
    need(r.parallel_federations is None or r.parallel_federations >= 1,
         "config key 'runtime.parallel_federations' must be >= 1 (or null: as many as fit)")
    need(r.spill_dir is None or ".." not in Path(r.spill_dir).parts,
         f"config key 'runtime.spill_dir' = {r.spill_dir!r}: '..' is not allowed in a scratch path")
    need(cfg.checkpoint.every >= 0, f"config key 'checkpoint.every' = {cfg.checkpoint.every}: expected >= 0")
    need(cfg.checkpoint.keep >= 1, f"config key 'checkpoint.keep' = {cfg.checkpoint.keep}: expected >= 1")
    need(cfg.data.shards is None or cfg.data.shards.strip() != "",
         "config key 'data.shards' is empty; expected a path or URI (file://, s3://, gs://) or null")
    need(isinstance(cfg.data.partition, dict) and "kind" in cfg.data.partition,
         "config key 'data.partition' must be a mapping with a 'kind' (e.g. per_domain)")


def host_layout(runtime: RuntimeConfig, num_clients: int) -> tuple[int, int]:
    """(num_hosts, clients_per_host) for a federation of ``num_clients``; client k lives on host k % H."""
    if runtime.clients_per_host is not None:
        hosts = math.ceil(num_clients / runtime.clients_per_host)
        if runtime.num_hosts is not None and runtime.num_hosts < hosts:
            raise UserError(
                f"runtime.num_hosts = {runtime.num_hosts} hosts cannot hold {num_clients} clients at "
                f"runtime.clients_per_host = {runtime.clients_per_host}; need {hosts} hosts")
        hosts = min(hosts, runtime.num_hosts or hosts)
    else:
        hosts = min(runtime.num_hosts, num_clients)
    return hosts, math.ceil(num_clients / hosts)


def dump_yaml(cfg: ExperimentConfig, path: str | os.PathLike) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        yaml.safe_dump(cfg.to_dict(), fh, sort_keys=False)
