"""Search spaces: the methods' declared ranges, user entries, and their Optuna form (no Ray)."""
import math

import optuna
import pytest

from raysim.core.errors import UserError
from raysim.methods import registry
from raysim.core.hparams import Space
from raysim.tuning import space as sp


def test_declared_space_is_prefixed_with_the_method():
    space = sp.resolve_space(registry.get("fedprox"), "fedprox", None)
    assert space == {"hp.fedprox.mu": Space("loguniform", 1e-3, 1.0)}


def test_user_entries_merge_over_the_declared_space():
    cls = registry.get("fedprox")
    space = sp.resolve_space(cls, "fedprox", {"mu": {"uniform": [0, 0.5]},
                                              "train.lr": {"loguniform": [1e-3, 0.1]},
                                              "train.epochs": {"int": [1, 3]},
                                              "train.momentum": {"choice": [0.0, 0.9]}})
    assert space["hp.fedprox.mu"] == Space("uniform", 0.0, 0.5)  # a bare name is hp.<method>.NAME
    assert space["train.lr"] == Space("loguniform", 1e-3, 0.1)
    assert space["train.epochs"] == Space("int", 1, 3)
    assert space["train.momentum"].choices == (0.0, 0.9)
    assert list(space) == sorted(space)


@pytest.mark.parametrize("fixed", [None, "fixed", "none", False])
def test_fixed_removes_a_declared_key(fixed):
    space = sp.resolve_space(registry.get("fedprox"), "fedprox",
                             {"hp.fedprox.mu": fixed, "train.lr": {"uniform": [0.01, 0.1]}})
    assert list(space) == ["train.lr"]


def test_default_takes_the_declared_range():
    space = sp.resolve_space(registry.get("fedprox"), "fedprox", {"mu": "default"})
    assert space["hp.fedprox.mu"] == Space("loguniform", 1e-3, 1.0)


@pytest.mark.parametrize("entries, fragment", [
    ({"train.lr": {"loguniform": [0, 0.1]}}, "loguniform needs low > 0"),
    ({"train.lr": {"uniform": [0.1, 0.01]}}, "needs low < high"),
    ({"train.lr": {"normal": [0, 1]}}, "expected one of"),
    ({"train.lr": [0.01, 0.1]}, "expected one of"),
    ({"train.epochs": {"int": [1.5, 3]}}, "int bounds must be integers"),
    ({"train.lr": {"choice": []}}, "choice needs a non-empty list"),
    ({"train.lr": {"choice": [0.1, 0.1]}}, "lists an option twice"),
    ({"train.lr": {"choice": [[1], 2]}}, "choice options must be"),
    ({"nosuch": {"uniform": [0, 1]}}, "method fedprox has no hyperparameter 'nosuch'; valid: mu"),
    ({"hp.fdse.lam": {"uniform": [0, 1]}}, "the search tunes method fedprox"),
    ({"runtime.num_hosts": {"int": [1, 2]}}, "cannot be searched"),
    ({"data.partition": {"choice": ["a"]}}, "cannot be searched"),
    ({"train.lr": "default"}, "declares no range for it"),
])
def test_bad_entries_are_user_errors_naming_the_key(entries, fragment):
    with pytest.raises(UserError) as err:
        sp.resolve_space(registry.get("fedprox"), "fedprox", entries)
    assert fragment in str(err.value)


def test_an_empty_space_is_an_error():
    with pytest.raises(UserError, match="search space is empty"):
        sp.resolve_space(registry.get("fedavg"), "fedavg", None)


def test_to_optuna_distributions():
    d = sp.to_optuna({"a": Space.log(1e-3, 1.0), "b": Space.uniform(0, 1), "c": Space.integer(1, 4),
                      "d": Space.choice("x", "y")})
    assert d["a"] == optuna.distributions.FloatDistribution(1e-3, 1.0, log=True)
    assert d["b"] == optuna.distributions.FloatDistribution(0.0, 1.0)
    assert d["c"] == optuna.distributions.IntDistribution(1, 4)  # inclusive high, as declared
    assert d["d"] == optuna.distributions.CategoricalDistribution(["x", "y"])


def test_every_declared_space_converts():
    """Each installed method's default space is valid and converts (FDSE, DapperFL, ... as they land)."""
    for name in registry.names():
        cls = registry.get(name)
        declared = sp.declared_space(cls, name)
        sp.to_optuna(declared)
        for key in declared:
            assert key.startswith(f"hp.{name}.")


def test_optuna_samples_stay_inside_the_space():
    space = {"hp.fedprox.mu": Space.log(1e-3, 1.0), "train.epochs": Space.integer(1, 3),
             "model.norm": Space.choice("bn", "gn")}
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(20):
        params = study.ask(sp.to_optuna(space)).params
        assert all(sp.contains(space[k], v) for k, v in params.items())


def test_apply_params_sets_dotted_keys_on_a_copy():
    raw = {"train": {"lr": 0.1}, "hp": {}}
    out = sp.apply_params(raw, {"train.lr": 0.01, "hp.fedprox.mu": 0.5})
    assert out == {"train": {"lr": 0.01}, "hp": {"fedprox": {"mu": 0.5}}}
    assert raw == {"train": {"lr": 0.1}, "hp": {}}


def test_contains():
    assert sp.contains(Space.log(0.01, 1), 0.01) and not sp.contains(Space.log(0.01, 1), 2)
    assert sp.contains(Space.integer(1, 3), 3) and not sp.contains(Space.integer(1, 3), 2.5)
    assert sp.contains(Space.choice(0.2, 0.4), 0.4) and not sp.contains(Space.choice(1, 2), True)
    assert not sp.contains(Space.uniform(0, 1), math.nan)
