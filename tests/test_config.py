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


# ----------------------------------------------------------------------------- named variants

VARIANTS = {"methods": ["fedprox", {"name": "fedprox-mu1", "method": "fedprox", "hp": {"mu": 1.0},
                                    "train": {"lr": 0.1}}],
            "hp": {"fedprox": {"mu": 0.1}}, "train": {"lr": 0.05, "momentum": 0.5},
            "per_method": {"fedprox-mu1": {"rounds": 3}}}


def test_a_config_without_variants_keeps_its_config_and_fingerprint():
    """Checkpoints written before variants existed still resume: the same fingerprints (pinned),
    and no ``variant`` key in a federation's config.yaml. A server optimizer's section is in the
    fingerprint with its ``form`` and ``betas``: a FedAdam run written before the default form became
    the bias-corrected one with Keras's β2 (issue 40) is refused, not resumed in another form (pinned too)."""
    from raysim.engine.checkpoint import config_fingerprint
    raw = {"methods": ["fedavg", "fedprox"], "rounds": 3, "seed": 1, "hp": {"fedprox": {"mu": 0.1}},
           "per_method": {"fedprox": {"train": {"lr": 0.05}}}}
    cfg = load_config(raw=raw)
    assert [config_fingerprint(cfg.for_method(m)) for m in ("fedavg", "fedprox")] == ["542130e80b37a31f",
                                                                                       "c5c3b3b149bcbcb9"]
    # before issue 40: 4a6facc0a0f59a21, 9bd3dde9e4b028cc; before betas by form: 57a437be1af3657e, 5520169ade89035a
    cfg = load_config(raw={**raw, "server": {"optimizer": "adam"}})
    assert [config_fingerprint(cfg.for_method(m)) for m in ("fedavg", "fedprox")] == ["8ccb502cb0e0c32b",
                                                                                       "1ad577e82c0949db"]
    assert config_fingerprint(load_config(raw={"method": "fedbn"})) == "ea92a7ba7f3dcbca"
    # a config.yaml written in full before the betas followed the form (betas [0.9, 0.99]) keeps its fingerprint
    written = {"optimizer": None, "lr": None, "momentum": 0.9, "betas": [0.9, 0.99], "tau": 0.001, "form": "code"}
    cfg = load_config(raw={**raw, "server": written})
    assert config_fingerprint(cfg.for_method("fedavg")) == "542130e80b37a31f"
    assert "variant" not in cfg.to_dict() and "variant" not in cfg.for_method("fedprox").to_dict()


def test_a_variant_is_its_method_with_its_settings():
    cfg = load_checked(raw=VARIANTS)
    assert cfg.method_names() == ["fedprox", "fedprox"] and cfg.entry_names() == ["fedprox", "fedprox-mu1"]
    plain, mu1 = cfg.for_method("fedprox"), cfg.for_method("fedprox-mu1")
    assert (plain.variant, plain.hp, plain.train.lr, plain.rounds) == (None, {"fedprox": {"mu": 0.1}}, 0.05, 20)
    # its hp go to hp.<its method>, its sections over the config's, per_method.<its name> too
    assert (mu1.method, mu1.variant, mu1.hp, mu1.train.lr, mu1.train.momentum, mu1.rounds) == (
        "fedprox", "fedprox-mu1", {"fedprox": {"mu": 1.0}}, 0.1, 0.5, 3)
    assert mu1.methods is None and mu1.to_dict()["variant"] == "fedprox-mu1"
    # its federation's config.yaml reads back as that one federation
    again = load_checked(raw=mu1.to_dict())
    assert again.entry_names() == ["fedprox-mu1"] and again.for_method("fedprox-mu1").to_dict() == mu1.to_dict()
    # on the command line
    cli = load_checked(raw={"method": "fedavg"},
                       overrides=["methods=[fedavg,{name: adam, method: fedavg, server: {optimizer: adam}}]"])
    assert cli.entry_names() == ["fedavg", "adam"] and cli.for_method("adam").server.optimizer == "adam"
    assert cli.for_method("fedavg").server.optimizer is None


@pytest.mark.parametrize("entry, fragment", [
    ({"name": "v"}, "methods[1] (v): a variant needs 'method: NAME'"),
    ({"method": "fedprox"}, "methods[1]: a variant needs 'name: NAME'"),
    ({"name": "a/b", "method": "fedprox"}, "methods[1]: name = 'a/b': expected letters, digits"),
    ({"name": "seed-1", "method": "fedprox"}, "not starting with seed- or holdout-"),
    ({"name": "fedprox", "method": "fedprox", "hp": {"mu": 1}}, "'methods' has two entries named 'fedprox'"),
    ({"name": "fedavg", "method": "fedprox"}, "methods[1] (fedavg): 'fedavg' is another method's name"),
    ({"name": "v", "method": "fedprox", "lr": 0.1}, "methods[1] (v): unknown key 'lr'; expected name, method, hp"),
    ({"name": "v", "method": "fedprox", "seeds": [1, 2]}, "methods[1] (v): a variant cannot set 'seeds'"),
    ({"name": "v", "method": "fedprox", "hp": 1}, "methods[1] (v): 'hp' must map the method's hyperparameters"),
    ({"name": "v", "method": "fedprox", "hp": {"nu": 1}}, "unknown hyperparameter 'methods[1] (v).hp.nu'"),
    ({"name": "v", "method": "fedprox", "train": {"lr": -1}}, "in methods[1] (v): config key 'train.lr' = -1.0"),
    ({"name": "v", "method": "fedadam", "server": {"optimizer": "yogi"}}, "methods[1] (v): method fedadam is FedAvg"),
    ({"name": "v", "method": "nosuch"}, "unknown method 'nosuch'"),
])
def test_a_bad_variant_is_one_line(entry, fragment):
    with pytest.raises(UserError) as err:
        load_checked(raw={"methods": ["fedprox", entry]})
    assert fragment in str(err.value) and "\n" not in str(err.value)
