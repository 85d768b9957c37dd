"""Named variants end to end on real Ray actors (the session's Ray instance): a comparison of
FedAvg and a variant of it with Adam on the server, run by `raysim run` with the variant on the
command line, then resumed after its variant lost its last round."""
import os

import pandas as pd
import pytest
import yaml

from raysim.app import rundir
from raysim.cli import main

TINY = {
    "method": "fedavg", "rounds": 2, "seed": 3, "clients_per_round": 3,
    "data": {"dataset": "digits5", "options": {"image_size": 16}, "partition": {"kind": "per_domain", "train_size": 32}},
    "model": {"name": "small_cnn", "norm": "bn"},
    "train": {"epochs": 1, "batch_size": 16, "lr": 0.05},
    "runtime": {"num_hosts": 1, "cpus_per_host": 1},
    "checkpoint": {"every": 1},
    "tracking": {"tensorboard": False},
}
VARIANT = "methods=[fedavg,{name: adam, method: fedavg, server: {optimizer: adam}}]"


@pytest.fixture(scope="module")
def compared(ray_session, tmp_path_factory):
    """`raysim run CONFIG methods=[fedavg,{name: adam, ...}] --out DIR`, once for the module."""
    root = tmp_path_factory.mktemp("variants")
    config = root / "tiny.yaml"
    config.write_text(yaml.safe_dump(TINY))
    out = str(root / "run")
    assert main(["run", str(config), VARIANT, "--out", out, "--quiet"]) == 0
    return str(config), out


def metrics(folder):
    return pd.read_parquet(os.path.join(folder, "metrics.parquet"))


def test_a_variant_has_its_folder_and_row_and_its_summary_names_both_server_optimizers(compared):
    _, compared = compared
    assert rundir.method_dirs(compared) == {"fedavg": os.path.join(compared, "fedavg"),
                                            "adam": os.path.join(compared, "adam")}
    recorded = yaml.safe_load(open(os.path.join(compared, "adam", "config.yaml")))
    assert (recorded["method"], recorded["variant"], recorded["server"]["optimizer"]) == ("fedavg", "adam", "adam")
    assert "variant" not in yaml.safe_load(open(os.path.join(compared, "fedavg", "config.yaml")))
    summary = open(os.path.join(compared, "summary.md")).read()
    what = summary.split("## What ran")[1].split("Test accuracy")[0]
    assert "- data: digits5 (image_size 16), partition per_domain (train_size 32)" in what
    assert "- participation: 3 of 5 clients per round" in what
    assert "**fedavg**: method fedavg; hyperparameters: none; server: sgd (lr 1): the plain mean (the method's own)" in what
    assert "**adam**: method fedavg (variant adam); hyperparameters: none; server: adam (lr 0.01" in what
    assert "| adam (round 2) |" in " ".join(summary.split())
    # the variant's numbers are its own
    assert not metrics(os.path.join(compared, "adam")).equals(metrics(os.path.join(compared, "fedavg")))


@pytest.mark.slow
def test_a_run_with_a_variant_resumes(compared, tmp_path, capsys):
    """The variant lost its last round (its metrics and status gone, its round-1 checkpoint kept):
    `raysim run --resume` runs round 2 of the variant alone, from that checkpoint (its config's
    fingerprint matches), to the same numbers; the same command again finds nothing left to do."""
    import shutil
    config, compared = compared
    copy = str(tmp_path / "run")
    shutil.copytree(compared, copy)
    adam = os.path.join(copy, "adam")
    before = metrics(adam)
    for name in ("metrics.parquet", "status.json"):
        os.remove(os.path.join(adam, name))
    assert os.listdir(os.path.join(adam, "checkpoints")) == ["round-000001"]
    fedavg_mtime = os.path.getmtime(os.path.join(copy, "fedavg", "metrics.parquet"))
    assert main(["run", "--resume", copy, "--quiet"]) == 0
    pd.testing.assert_frame_equal(metrics(adam), before)
    assert os.path.getmtime(os.path.join(copy, "fedavg", "metrics.parquet")) == fedavg_mtime  # finished: skipped
    capsys.readouterr()
    assert main(["run", config, VARIANT, "--out", copy]) == 0  # the same command: this config's run, finished
    assert "every federation in" in capsys.readouterr().err


def test_a_lone_variant_is_the_run_folder_and_its_config_yaml_resumes_it(tmp_path):
    """``methods: [one variant]``: the run folder is its federation's; the config.yaml it writes
    there reads back as the same federation (name, method, fingerprint), and MLflow names it."""
    from raysim.app.configs import load_checked
    from raysim.app.tracking import run_name
    from raysim.config import dump_yaml
    from raysim.engine.checkpoint import config_fingerprint
    cfg = load_checked(raw={**TINY, "method": None, "methods": [{"name": "prox1", "method": "fedprox",
                                                                  "hp": {"mu": 1.0}}]})
    [(one, sub)] = rundir.plan(cfg, str(tmp_path))
    assert sub == str(tmp_path) and (one.method, one.variant, one.hp) == ("fedprox", "prox1", {"fedprox": {"mu": 1.0}})
    dump_yaml(one, tmp_path / "config.yaml")  # what its federation writes
    [(again, _)] = rundir.plan(load_checked(tmp_path / "config.yaml"), str(tmp_path))
    assert config_fingerprint(again) == config_fingerprint(one)
    pd.DataFrame({"round": [1]}).to_parquet(tmp_path / "metrics.parquet")
    assert rundir.method_dirs(str(tmp_path)) == {"prox1": str(tmp_path)}
    assert rundir.holds_run_of(cfg, str(tmp_path))  # the same command resumes it
    assert run_name(one) == "prox1/seed-3"
