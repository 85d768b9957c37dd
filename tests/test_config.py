from pathlib import Path

import pytest

from raysim.app.configs import load_checked
from raysim.config import apply_overrides, load_config, RuntimeConfig
from raysim.engine.layout import host_layout
from raysim.core.errors import UserError


def test_defaults_and_overrides():
    cfg = load_config(raw={"method": "fedavg"}, overrides=["train.lr=0.05", "rounds=3", "hp.fedprox.mu=0.1"])
    assert cfg.train.lr == 0.05 and cfg.rounds == 3
    assert cfg.hp == {"fedprox": {"mu": 0.1}}
    assert cfg.method_names() == ["fedavg"]


def test_exponent_notation_is_a_number():
    cfg = load_config(raw={"method": "fedprox", "train": {"lr": "1e-3"}}, overrides=["hp.fedprox.mu=1e-2"])
    assert cfg.train.lr == 1e-3 and cfg.for_method("fedprox").hp["fedprox"]["mu"] == "1e-2"
    from raysim.methods.fedprox import FedProx
    assert FedProx.hparams_from(cfg.hp["fedprox"]).mu == 0.01


def test_method_override_replaces_methods_list():
    cfg = load_config(raw={"methods": ["fedavg", "fedbn"]}, overrides=["method=local"])
    assert cfg.method_names() == ["local"]
    cfg = load_config(raw={"methods": ["fedavg", "fedbn"]})
    assert cfg.method_names() == ["fedavg", "fedbn"]


@pytest.mark.parametrize("raw, fragment", [
    ({"method": "fedavg", "trian": {}}, "unknown config key 'trian'"),
    ({"method": "fedavg", "train": {"lrr": 1}}, "unknown config key 'train.lrr'; valid keys here: epochs"),
    ({"method": "fedavg", "train": {"lr": "fast"}}, "'train.lr' = 'fast': expected float"),
    ({"method": "fedavg", "train": {"lr": -1}}, "'train.lr' = -1.0: expected a positive number"),
    ({"method": "fedavg", "rounds": 0}, "'rounds' = 0"),
    ({"method": "nosuch"}, "unknown method 'nosuch'; available: "),
    ({"method": "fedavg", "runtime": {"num_hosts": 0}}, "'runtime.num_hosts' = 0"),
    ({"method": "fedavg", "fraction": 1.5}, "'fraction' = 1.5"),
    ({"method": "fedavg", "hp": {"fedprox": {"nu": 1}}}, "unknown hyperparameter 'hp.fedprox.nu'"),
    ({"method": "fedavg", "hp": {"fedprox": {"mu": "x"}}}, "'hp.fedprox.mu' = 'x': expected float"),
    ({"method": "fedavg", "runtime": {"gpus_per_host": 1.5}}, "fractions must be at most 1"),
    ({"method": "fedavg", "name": "../../etc"}, "config key 'name' = '../../etc': expected letters"),
    ({"method": "fedavg", "runtime": {"spill_dir": "/tmp/../etc"}}, "'..' is not allowed"),
    ({"method": "fedavg", "checkpoint": {"keep": 0}}, "'checkpoint.keep' = 0"),
])
def test_bad_configs_give_one_line_errors(raw, fragment):
    with pytest.raises(UserError) as err:
        load_checked(raw=raw)
    assert fragment in str(err.value)
    assert "\n" not in str(err.value)


def test_bad_yaml_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("method: [fedavg\n")
    with pytest.raises(UserError, match="not valid YAML"):
        load_config(p)
    with pytest.raises(UserError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")


def test_override_syntax():
    with pytest.raises(UserError, match="key=value"):
        apply_overrides({}, ["rounds"])


def test_host_layout():
    assert host_layout(RuntimeConfig(num_hosts=2), 5) == (2, 3)
    assert host_layout(RuntimeConfig(num_hosts=None, clients_per_host=1), 5) == (5, 1)
    assert host_layout(RuntimeConfig(num_hosts=8), 5) == (5, 1)
    with pytest.raises(UserError, match="cannot hold"):
        host_layout(RuntimeConfig(num_hosts=2, clients_per_host=1), 5)


SHIPPED = sorted(p for p in (Path(__file__).parents[1] / "configs").rglob("*.yaml") if "tune" not in p.parts)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_shipped_config_validates(path):
    cfg = load_config(path)
    assert cfg.method_names() and cfg.rounds >= 1
