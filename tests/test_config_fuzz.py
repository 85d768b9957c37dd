"""Random and corrupted configs: each either validates or fails with one user-error line (exit 2)."""
import string

import yaml
from hypothesis import HealthCheck, given, settings, strategies as st

from raysim.cli import main

KEYS = {
    "": ["method", "methods", "rounds", "seed", "clients_per_round", "fraction", "name", "data", "model",
         "train", "eval", "runtime", "checkpoint", "hp", "bogus"],
    "data": ["dataset", "root", "options", "partition", "nope"],
    "model": ["name", "norm", "pretrained", "options", "depth"],
    "train": ["epochs", "batch_size", "lr", "momentum", "weight_decay", "lr_decay", "max_steps", "grad_clip",
              "weighting", "lr_schedule"],
    "eval": ["every", "protocol", "holdout", "splits", "clients"],
    "runtime": ["num_hosts", "clients_per_host", "cpus_per_host", "gpus_per_host", "server_cpus",
                "torch_threads", "state_memory_mb", "spill_dir", "address", "pg_timeout_s", "max_restarts", "gpus"],
    "checkpoint": ["every", "minutes", "keep"],
    "hp": ["fedprox", "fedavg", "fedbn", "nosuch"],
}

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 1000), st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["fedavg", "fedprox", "fedbn", "local", "lodo", "all", "bn", "1e-3", "samples", "val"]),
    st.text(string.printable, max_size=12),
)
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                      st.dictionaries(st.text(max_size=5), inner, max_size=3)),
                      max_leaves=6)


@st.composite
def configs(draw):
    raw = {}
    for key in draw(st.lists(st.sampled_from(KEYS[""]), max_size=8, unique=True)):
        if key in KEYS and draw(st.booleans()):
            raw[key] = {k: draw(values) for k in draw(st.lists(st.sampled_from(KEYS[key]), max_size=4, unique=True))}
        else:
            raw[key] = draw(values)
    return raw


def _check(tmp_path, capsys, text: str):
    path = tmp_path / "fuzz.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogateescape")
    code = main(["run", str(path), "--check"])
    err = capsys.readouterr().err
    assert code in (0, 2)
    if code == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("raysim: error: "), err
    else:
        assert err.strip() == ""


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(raw=configs())
def test_random_configs(tmp_path_factory, capsys, raw):
    try:
        text = yaml.safe_dump(raw, allow_unicode=True)
    except yaml.YAMLError:
        return
    _check(tmp_path_factory.mktemp("fz"), capsys, text)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(raw=configs(), cut=st.integers(0, 400), junk=st.text(max_size=20))
def test_corrupted_config_text(tmp_path_factory, capsys, raw, cut, junk):
    try:
        text = yaml.safe_dump(raw, allow_unicode=True)
    except yaml.YAMLError:
        return
    _check(tmp_path_factory.mktemp("fz"), capsys, text[:cut] + junk + text[cut:])
