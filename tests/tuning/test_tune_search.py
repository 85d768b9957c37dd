"""A real search on the session's Ray: two FedProx federations, the second one stopped by ASHA,
then best.yaml re-run the way `raysim run` runs it, to the same validation accuracy."""
import os

import pandas as pd
import pytest

from raysim.config import load_config
from raysim.engine.metrics import read
from raysim.tuning.search import run_search
from raysim.tuning.spec import load_spec


@pytest.fixture(scope="module")
def search(ray_session, tmp_path_factory, tiny_experiment):
    out = tmp_path_factory.mktemp("tune") / "search"
    experiment = tiny_experiment()
    # every trial is tracked as `raysim run` tracks a federation: a real (SQLite-backed) MLflow store
    uri = f"sqlite:///{out.parent / 'mlflow.db'}"
    experiment["tracking"] = {"mlflow_uri": uri, "mlflow_experiment": "asha-test"}  # best.yaml's re-run too
    from mlflow.tracking import MlflowClient  # artifacts in the test's folder, not the working directory
    MlflowClient(uri).create_experiment("asha-test", artifact_location=(out.parent / "artifacts").as_uri())
    # Trial 1 learns (lr 0.05); trial 2 cannot (lr 1e-5: the initial model's accuracy). They run
    # one after the other, so when trial 2 reaches ASHA's first rung (round 1) trial 1's value is
    # already recorded there and trial 2 falls below the cutoff: it must be stopped.
    spec = load_spec(raw={
        "name": "asha-test", "method": "fedprox", "experiment": experiment,
        "trials": 2, "max_concurrent": 1, "sampler": {"kind": "random", "seed": 0},
        "scheduler": {"kind": "asha", "grace_period": 1, "reduction_factor": 2},
        "space": {"train.lr": {"loguniform": [1e-5, 0.1]}},
        "initial_points": [{"train.lr": 0.05, "mu": 0.01}, {"train.lr": 1e-5, "mu": 0.01}]})
    lines = []
    result = run_search(spec, str(out), echo=lines.append)
    return spec, out, result, lines


@pytest.mark.slow
def test_search_writes_the_three_outputs(search):
    spec, out, result, lines = search
    assert result["exit_code"] == 0
    for name in ("trials.parquet", "best.yaml", "search.png"):
        assert (out / name).is_file(), name
    df = pd.read_parquet(out / "trials.parquet")
    assert list(df["trial"]) == [1, 2]
    assert {"hp.fedprox.mu", "train.lr", "objective", "val_avg_final", "val_avg_best", "rounds_run",
            "stop_reason"} <= set(df.columns)
    assert df["train.lr"].tolist() == pytest.approx([0.05, 1e-5])
    assert "asha-test" in (out / "search.yaml").read_text()
    assert any("trials: " in line for line in lines)


@pytest.mark.slow
def test_the_scheduler_stops_the_bad_trial_early(search):
    spec, out, result, lines = search
    df = pd.read_parquet(out / "trials.parquet").set_index("trial")
    assert df.loc[1, "stop_reason"] == "completed" and df.loc[1, "rounds_run"] == 2
    assert df.loc[2, "stop_reason"] == "early_stopped", df.to_string()
    assert df.loc[2, "rounds_run"] == 1
    assert df.loc[2, "objective"] < df.loc[1, "val_avg_final"]
    # the stopped trial's per-round record survives in its run directory
    assert os.path.isfile(os.path.join(df.loc[2, "run_dir"], "progress.json"))
    assert (out / "trials").is_dir() and len(list((out / "trials").iterdir())) == 2


@pytest.mark.slow
def test_each_trial_is_tracked_like_a_run(search):
    """TensorBoard events in each trial's run directory (read with TensorBoard's own reader) and one
    MLflow run per trial, named after it, with the sampled learning rate as a param."""
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    spec, out, result, lines = search
    df = pd.read_parquet(out / "trials.parquet")
    for run_dir, rounds in zip(df["run_dir"], df["rounds_run"]):
        acc = EventAccumulator(os.path.join(run_dir, "tb"), size_guidance={"scalars": 0})
        acc.Reload()
        assert [e.step for e in acc.Scalars("val/AVG")] == list(range(1, rounds + 1))
    client = MlflowClient(f"sqlite:///{out.parent / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name(spec.name).experiment_id])
    by_name = {r.info.run_name: r for r in runs}
    assert {os.path.basename(d) for d in df["run_dir"]} <= set(by_name)
    for run_dir, lr in zip(df["run_dir"], df["train.lr"]):
        params = by_name[os.path.basename(run_dir)].data.params
        assert float(params["train.lr"]) == pytest.approx(lr)


@pytest.mark.slow
def test_trials_run_inside_their_placement_group(search):
    import json
    spec, out, result, lines = search
    for run_dir in pd.read_parquet(out / "trials.parquet")["run_dir"]:
        info = json.loads(open(os.path.join(run_dir, "placement.json")).read())
        assert info["placement_group"] and info["bundles"][1] == {"CPU": 0.5}


@pytest.mark.slow
def test_best_yaml_reruns_to_the_same_metric(search, tmp_path):
    from raysim.app.experiment import run

    spec, out, result, lines = search
    df = pd.read_parquet(out / "trials.parquet").set_index("trial")
    cfg = load_config(out / "best.yaml")  # what `raysim run best.yaml` loads
    assert cfg.train.lr == pytest.approx(0.05) and cfg.method == "fedprox"
    run(cfg, out=str(tmp_path / "rerun"), progress=False)  # what `raysim run` calls
    m = read(str(tmp_path / "rerun" / "metrics.parquet"))
    val = m[(m.domain == "AVG") & (m.split == "val") & (m.metric == "accuracy")]
    assert val["value"].max() == pytest.approx(df.loc[1, "val_avg_best"], abs=1e-12)
    assert val["value"].iloc[-1] == pytest.approx(df.loc[1, "val_avg_final"], abs=1e-12)


@pytest.mark.slow
def test_every_trial_gives_its_resources_back(search, ray_session):
    """The stopped trial's federation (Server, hosts) and both placement groups are gone."""
    import time
    total = ray_session.cluster_resources()
    deadline = time.time() + 60
    while time.time() < deadline:
        free = ray_session.available_resources()
        if free.get("CPU", 0) == total["CPU"] and free.get("GPU", 0) == total.get("GPU", 0):
            break
        time.sleep(0.5)
    assert free.get("CPU", 0) == total["CPU"], free
    import json
    from ray.util.placement_group import placement_group_table
    spec, out, result, lines = search
    table = placement_group_table()
    for run_dir in pd.read_parquet(out / "trials.parquet")["run_dir"]:
        pg = json.loads(open(os.path.join(run_dir, "placement.json")).read())["placement_group"]
        assert table[pg]["state"] == "REMOVED", table[pg]


def test_a_data_error_is_one_user_error_before_any_trial(ray_session, tmp_path, tiny_experiment):
    from raysim.core.errors import UserError

    exp = tiny_experiment()
    exp["data"]["root"] = str(tmp_path)  # the generated benchmark takes no root
    spec = load_spec(raw={"method": "fedprox", "experiment": exp, "trials": 2})
    with pytest.raises(UserError, match="takes no root"):
        run_search(spec, str(tmp_path / "s"), echo=lambda *a: None)
    assert not (tmp_path / "s" / "tune").exists()  # no trial was started
