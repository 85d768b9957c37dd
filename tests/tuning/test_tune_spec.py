"""Tune configs: key routing, the base experiment, validation up front (no Ray)."""
from pathlib import Path

import pytest
import yaml

from raysim.config import load_config
from raysim.core.errors import UserError
from raysim.methods import registry
from raysim.tuning.spec import load_spec, route_overrides
from raysim.tuning.trial import trial_bundles

ROOT = Path(__file__).resolve().parents[2]

TINY = {"rounds": 3, "model": {"name": "small_cnn"},
        "data": {"dataset": "digits5", "partition": {"kind": "per_domain", "train_size": 64}},
        "runtime": {"num_hosts": 1, "cpus_per_host": 0.5}}


def spec_of(overrides=(), **tune):
    raw = {"method": "fedprox", "experiment": dict(TINY), **tune}
    return load_spec(raw=raw, overrides=list(overrides))


def test_routing_tune_keys_to_the_search_and_the_rest_to_the_experiment():
    tune, exp = route_overrides(["trials=4", "rounds=3", "experiment.seed=7", "train.lr=0.05",
                                 "space.train.lr={loguniform: [0.001, 0.1]}", "scheduler=none"])
    assert [k for k, _ in tune] == [["trials"], ["space", "train", "lr"], ["scheduler"]]
    assert exp == ["rounds=3", "seed=7", "train.lr=0.05"]


def test_overrides_apply():
    spec = spec_of(["trials=4", "rounds=2", "max_concurrent=1", "train.lr=0.05",
                    "space.train.lr={loguniform: [0.001, 0.1]}", "sampler.seed=3", "scheduler.grace_period=1",
                    "hp.fedprox.mu=0.2"])
    assert spec.trials == 4 and spec.max_concurrent == 1
    assert spec.rounds == 2 and spec.base_config().train.lr == 0.05
    assert spec.base_config().hp == {"fedprox": {"mu": 0.2}}
    assert set(spec.space) == {"hp.fedprox.mu", "train.lr"}
    assert spec.sampler == {"kind": "tpe", "seed": 3}
    assert spec.scheduler == {"kind": "asha", "grace_period": 1, "reduction_factor": 2}


def test_top_level_experiment_keys_in_the_file_merge_into_the_experiment(tmp_path):
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump({**TINY, "method": "fedavg", "seed": 3}))
    (tmp_path / "tune.yaml").write_text(yaml.safe_dump({
        "experiment": "exp.yaml", "method": "fedprox", "rounds": 5,
        "data": {"partition": {"train_size": 32}}}))
    spec = load_spec(tmp_path / "tune.yaml")
    cfg = spec.base_config()
    assert cfg.method == "fedprox" and cfg.rounds == 5 and cfg.seed == 3
    assert cfg.data.partition == {"kind": "per_domain", "train_size": 32}  # merged, not replaced
    assert spec.name == "tune"  # the file's stem


def test_an_experiment_config_with_tune_keys_is_a_tune_config():
    spec = load_spec(raw={**TINY, "method": "fedprox", "trials": 3})
    assert spec.trials == 3 and spec.rounds == 3


def test_method_comes_from_the_experiment_when_not_given():
    spec = load_spec(raw={"experiment": {**TINY, "method": "fedprox"}})
    assert spec.method == "fedprox"


def test_a_methods_list_needs_one_method():
    with pytest.raises(UserError, match="tunes one method"):
        load_spec(raw={"experiment": {**TINY, "methods": ["fedavg", "fedprox"]}})
    spec = load_spec(raw={"method": "fedprox", "experiment": {**TINY, "methods": ["fedavg", "fedprox"]}})
    assert spec.base_config().method_names() == ["fedprox"]


@pytest.mark.parametrize("overrides, fragment", [
    (["metric=test_avg_best"], "never selects on a test metric"),
    (["metric=accuracy"], "expected one of val_avg_best"),
    (["mode=min"], "val_avg_best is always maximised"),
    (["trials=0"], "'trials' = 0: expected a positive integer"),
    (["max_failures=-1"], "'max_failures' = -1: expected an integer >= 0"),
    (["max_failures=1.5"], "'max_failures' = 1.5: expected an integer >= 0"),
    (["sampler=annealing"], "'sampler.kind' = 'annealing'"),
    (["scheduler=pbt"], "'scheduler.kind' = 'pbt'"),
    (["scheduler.reduction_factor=1"], "expected a number > 1"),
    (["max_concurency=2"], "unknown config key 'max_concurency': neither a tune key"),
    (["train.lr=-1"], "'train.lr' = -1.0: expected a positive number"),
    (["eval.splits=[test]"], "add 'val'"),
    (["eval.protocol=lodo"], "needs one held-out domain"),
    (["space.train.momentum={uniform: [0.5, 1.0]}"], "value 1.0 is not a valid experiment"),
    (["initial_points=[{mu: 5.0}]"], "lies outside its search range"),
    (["initial_points=[{lr: 0.01}]"], "'hp.fedprox.lr' is not searched"),
    (["resources.strategy=everywhere"], "'resources.strategy'"),
    (["resources=lots"], "'resources' must be a mapping"),
    (["name=a/b"], "'name' = 'a/b'"),
    (["method=nosuch"], "unknown method 'nosuch'"),
])
def test_mistakes_are_one_line_user_errors(overrides, fragment):
    with pytest.raises(UserError) as err:
        spec_of(overrides)
    msg = str(err.value)
    assert fragment in msg and "\n" not in msg


def test_max_failures_is_a_tune_key_recorded_with_the_search():
    assert spec_of().max_failures == 2  # the default: see raysim.tuning.spec.MAX_FAILURES
    spec = spec_of(["max_failures=0"])
    assert spec.max_failures == 0 and spec.record()["max_failures"] == 0
    assert spec.base_config().to_dict().get("max_failures") is None  # not an experiment key


def test_initial_points_fill_in_the_experiment_values():
    spec = spec_of(["space.train.lr={loguniform: [0.001, 0.1]}", "train.lr=0.02", "hp.fedprox.mu=0.05"],
                   initial_points=["defaults", {"mu": 0.5}])
    assert spec.initial_points == [{"hp.fedprox.mu": 0.05, "train.lr": 0.02},
                                   {"hp.fedprox.mu": 0.5, "train.lr": 0.02}]


def test_scheduler_grace_period_is_clamped_to_the_rounds():
    spec = spec_of(["rounds=2", "scheduler.grace_period=5"])
    assert spec.scheduler["grace_period"] == 2
    assert spec_of(["scheduler=none"]).scheduler == {"kind": "none"}


def test_trial_configs_and_relative_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = spec_of(["runtime.spill_dir=spill"])
    cfg = spec.experiment_config({"hp.fedprox.mu": 0.3})
    assert cfg.hp["fedprox"]["mu"] == 0.3 and cfg.runtime.spill_dir == "spill"  # best.yaml keeps it
    run = load_config(raw=spec.run_experiment())
    assert run.runtime.spill_dir == str(tmp_path / "spill")  # trials get it absolute


def test_record_is_plain_yaml():
    rec = spec_of().record()
    assert yaml.safe_load(yaml.safe_dump(rec)) == rec
    assert rec["experiment"]["method"] == "fedprox"


def test_trial_bundles_head_then_one_per_host():
    cfg = load_config(raw={**TINY, "runtime": {"num_hosts": 2, "cpus_per_host": 0.5, "gpus_per_host": 0.25,
                                                "server_cpus": 1}})
    bundles = trial_bundles(cfg.runtime, 2, trial_cpus=0.1)
    assert bundles[0]["CPU"] == pytest.approx(1.1) and bundles[0]["memory"] > 0
    assert bundles[1:] == [{"CPU": 0.5, "GPU": 0.25}] * 2
    cpu_only = trial_bundles(load_config(raw=TINY).runtime, 1)
    assert cpu_only == [{"CPU": 0.0, "memory": cpu_only[0]["memory"]}, {"CPU": 0.5}]


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "tune").glob("*.yaml")), ids=lambda p: p.name)
def test_ready_configs_load(path):
    method = yaml.safe_load(path.read_text())["method"]
    if method not in registry.names():
        pytest.skip(f"method {method} is not in this build")
    spec = load_spec(path, ["trials=4", "rounds=3"])
    assert spec.trials == 4 and spec.rounds == 3 and spec.metric.startswith("val_")
    assert any(k.startswith(f"hp.{method}.") for k in spec.space) and "train.lr" in spec.space


def test_ready_configs_exist():
    names = {p.stem for p in (ROOT / "configs" / "tune").glob("*.yaml")}
    assert {"fdse", "dapperfl", "fedprox"} <= names


def test_experiment_names_a_shipped_config_as_raysim_run_finds_one(tmp_path, monkeypatch):
    """``experiment:`` relative to the tune file, then the current directory, then among the
    configs raysim ships (with or without the leading ``configs/``): a wheel user has no configs/."""
    monkeypatch.chdir(tmp_path)
    for value in ("configs/fdse/digits5.yaml", "fdse/digits5.yaml"):
        (tmp_path / "tune.yaml").write_text(yaml.safe_dump({"experiment": value, "method": "fedprox"}))
        assert load_spec(tmp_path / "tune.yaml").base_config().data.dataset == "digits5"
    (tmp_path / "fdse").mkdir()  # the user's own file of that name wins
    (tmp_path / "fdse" / "digits5.yaml").write_text(yaml.safe_dump({**TINY, "method": "fedprox", "seed": 42}))
    assert load_spec(tmp_path / "tune.yaml").base_config().seed == 42
    (tmp_path / "tune.yaml").write_text(yaml.safe_dump({"experiment": "fdse/nosuch.yaml", "method": "fedavg"}))
    with pytest.raises(UserError) as err:
        load_spec(tmp_path / "tune.yaml")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("experiment config not found: fdse/nosuch.yaml")
    assert "shipped configs in " + str(ROOT / "configs") in msg
