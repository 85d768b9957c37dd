"""trials.parquet, best.yaml and search.png from a made-up results table (no Ray)."""
import math

import pandas as pd
import pytest

from raysim.config import load_config
from raysim.tuning import outputs
from raysim.tuning.search import error_line, stop_reason, trial_number
from raysim.tuning.spec import load_spec
from raysim.core.errors import UserError

TINY = {"rounds": 4, "model": {"name": "small_cnn"},
        "data": {"dataset": "digits5", "partition": {"kind": "per_domain", "train_size": 64}},
        "runtime": {"num_hosts": 1, "cpus_per_host": 0.5}}


@pytest.fixture
def spec():
    return load_spec(raw={"method": "fedprox", "name": "demo", "experiment": TINY,
                          "space": {"train.lr": {"loguniform": [0.001, 0.1]},
                                    "train.momentum": {"choice": [0.0, 0.9]}}})


def row(n, mu, lr, mom, obj, rounds_run, reason, error=None):
    return {"trial": n, "trial_id": f"abc{n}", "hp.fedprox.mu": mu, "train.lr": lr,
            "train.momentum": mom, "objective": obj, "val_avg_final": obj, "val_avg_best": obj,
            "val_all_final": obj, "val_all_best": obj, "train_loss_final": 1.0, "rounds_run": rounds_run,
            "rounds": 4, "stop_reason": reason, "attempts": 1, "seconds": 3.0, "error": error,
            "run_dir": f"/x/trials/{n:03d}_abc{n}"}


@pytest.fixture
def rows():
    return [row(3, 0.5, 0.05, 0.9, 0.91, 1, "early_stopped"),  # best value, but from 1 round only
            row(1, 0.01, 0.01, 0.0, 0.62, 4, "completed"),
            row(2, 0.1, 0.02, 0.9, 0.75, 4, "completed"),
            row(4, 0.3, 0.08, 0.0, None, 0, "error", error="data root not found"),
            row(5, 0.9, 0.09, 0.0, 0.99, 2, "diverged")]


def test_trials_parquet_has_one_row_per_trial(spec, rows, tmp_path):
    df = outputs.trials_frame(rows, list(spec.space))
    path = tmp_path / "trials.parquet"
    outputs.write_trials(df, str(path))
    back = pd.read_parquet(path)
    assert list(back["trial"]) == [1, 2, 3, 4, 5]
    for col in ["hp.fedprox.mu", "train.lr", "train.momentum", "objective", "val_avg_final", "val_avg_best",
                "rounds_run", "stop_reason", "attempts", "error"]:
        assert col in back.columns
    assert back.loc[3, "stop_reason"] == "error" and math.isnan(back.loc[3, "objective"])
    assert back.loc[2, "stop_reason"] == "early_stopped" and back.loc[2, "rounds_run"] == 1


def test_best_is_the_best_completed_trial(spec, rows):
    df = outputs.trials_frame(rows, list(spec.space))
    best = outputs.pick_best(df, "max")
    assert best["trial"] == 2  # not the early-stopped 0.91 nor the diverged 0.99
    assert outputs.pick_best(df, "min")["trial"] == 1
    only_stopped = outputs.trials_frame([rows[0], rows[3]], list(spec.space))
    assert outputs.pick_best(only_stopped, "max")["trial"] == 3  # fallback when nothing completed
    assert outputs.pick_best(outputs.trials_frame([rows[3]], list(spec.space)), "max") is None


def test_best_yaml_is_a_complete_config_raysim_run_accepts(spec, rows, tmp_path):
    df = outputs.trials_frame(rows, list(spec.space))
    path = tmp_path / "best.yaml"
    outputs.write_best(spec, outputs.pick_best(df, "max"), str(path), str(tmp_path))
    text = path.read_text()
    assert text.startswith("# Best trial") and "val_avg_best = 75.00% after 4/4 rounds" in text  # in percent
    cfg = load_config(path)
    assert cfg.method == "fedprox" and cfg.rounds == 4 and cfg.name == "demo-best"
    assert cfg.hp["fedprox"]["mu"] == 0.1 and cfg.train.lr == 0.02 and cfg.train.momentum == 0.9
    assert cfg.model.name == "small_cnn" and cfg.runtime.cpus_per_host == 0.5


def test_search_png_and_table(spec, rows, tmp_path):
    df = outputs.trials_frame(rows, list(spec.space))
    path = tmp_path / "search.png"
    outputs.plot_search(df, spec, str(path), outputs.pick_best(df, "max"))
    assert path.stat().st_size > 5000 and path.read_bytes()[:4] == b"\x89PNG"
    table = outputs.format_table(df, spec)
    assert "early_stopped" in table and "75.00%" in table and "mu" in table
    assert "val_avg_best (%)" in table.splitlines()[0] and "0.75" not in table  # percent, labelled


def test_a_person_reads_accuracies_in_percent_and_the_loss_as_is():
    """Tune and Optuna keep fractions (trials.parquet too); the printed lines, the table,
    best.yaml's header and search.png's axis show percent, as `raysim run` does."""
    assert outputs.shown("val_avg_best", 0.4321) == "43.21%" and outputs.shown("val_all", 1) == "100.00%"
    assert outputs.shown("train_loss", 0.4321) == "0.4321" and outputs.shown("val_avg", None) == "-"
    assert outputs.shown("val_avg", float("nan")) == "-"
    assert outputs.axis_label("val_avg_best") == "val_avg_best (%)" and outputs.axis_label("train_loss") == "train_loss"


def test_mixed_choice_values_become_text(tmp_path):
    spec = load_spec(raw={"method": "fedprox", "experiment": TINY,
                          "space": {"train.weighting": {"choice": ["samples", "uniform"]}}})
    df = outputs.trials_frame([{"trial": 1, "hp.fedprox.mu": 0.1, "train.weighting": "uniform"},
                               {"trial": 2, "hp.fedprox.mu": 1, "train.weighting": 3}], list(spec.space))
    outputs.write_trials(df, str(tmp_path / "t.parquet"))
    assert list(pd.read_parquet(tmp_path / "t.parquet")["train.weighting"]) == ["uniform", "3"]


def test_stop_reasons_and_trial_numbers():
    assert stop_reason({"round": 4, "rounds_total": 4}, error=False) == "completed"
    assert stop_reason({"round": 2, "rounds_total": 4}, error=False) == "early_stopped"
    assert stop_reason({"round": 2, "rounds_total": 4}, error=False, finished=False) == "unfinished"
    assert stop_reason({"round": 2, "rounds_total": 4, "diverged": 1}, error=False) == "diverged"
    assert stop_reason({}, error=True) == "error" and stop_reason({}, error=False) == "unfinished"
    assert trial_number("1_lr=0.1") == 1 and trial_number("012_1f46143d") == 12


def test_error_line_finds_the_user_error():
    try:
        try:
            raise UserError("data root not found: /nope\nmore")
        except UserError as inner:
            raise RuntimeError("wrapped") from inner
    except RuntimeError as err:
        assert error_line(err) == "data root not found: /nope"
    # anything else: the real exception's type and the first line of its message
    assert error_line(ValueError("first line\nb\nlast line")) == "ValueError: first line"


def test_error_line_unwraps_ray_errors():
    """A trial's exception reaches the driver wrapped in a RayTaskError (the real one is its cause;
    its own text is Ray's traceback); Tune's text copy ends with the real one; a RunFailed's
    advice to resume is the round loop's, not the trial's."""
    from ray.exceptions import RayTaskError

    from raysim.core.errors import RunFailed

    try:
        raise KeyError("boom")
    except KeyError as cause:
        wrapped = RayTaskError("ImplicitFunc.train", "Traceback ...\nKeyError: 'boom'", cause)
    assert error_line(wrapped) == "KeyError: 'boom'"
    assert error_line(wrapped.as_instanceof_cause()) == "KeyError: 'boom'"
    assert error_line(RayTaskError("f", "Traceback (most recent call last):\n  x\nOSError: disk gone", None)) \
        == "OSError: disk gone"
    assert error_line("Traceback (most recent call last):\n  File x\nRuntimeError: bad state\n") \
        == "RuntimeError: bad state"
    assert error_line(RunFailed("the server actor was lost (died); resume with: raysim run --resume /x")) \
        == "RunFailed: the server actor was lost (died)"
    assert error_line(None) == "unknown error"
