"""Experiment tracking (raysim.app.tracking) against the real things: a tiny federation in this process
(the real round loop, Server and ClientHost on raysim.engine.backend.InProcess) writes TensorBoard
event files that TensorBoard's own reader reads back, and logs to a real MLflow tracking server
started here on 127.0.0.1 (installed by the test extra), queried with MLflow's own client."""
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pyarrow.parquet as pq
import pytest

from raysim.config import load_config
from raysim.core.errors import UserError
from raysim.app.experiment import federation
from raysim.engine.backend import InProcess
from raysim.app.tracking import flat_config, log_report, run_name, tag_of

TINY = {
    "method": "fedavg", "rounds": 2, "seed": 11,
    "data": {"dataset": "digits5", "options": {"image_size": 16},
             "partition": {"kind": "per_domain", "train_size": 12, "domains": ["mnist", "usps", "svhn"]}},
    "model": {"name": "small_cnn", "norm": "bn"},
    "train": {"epochs": 1, "batch_size": 8, "lr": 0.05, "momentum": 0.5},
    "eval": {"every": 1, "splits": ["val", "test"]},
    "runtime": {"num_hosts": 1},
}


@pytest.fixture(scope="module", autouse=True)
def _cache(tmp_path_factory):
    os.environ.setdefault("RAYSIM_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


def run_tiny(out, *overrides):
    cfg = load_config(raw=TINY, overrides=list(overrides))
    federation(cfg, str(out), progress=False, backend=InProcess()).run()
    return cfg, pq.read_table(os.path.join(out, "metrics.parquet")).to_pandas()


# ----------------------------------------------------------------------------- the MLflow server

class Server:
    """``mlflow server`` on a free 127.0.0.1 port, booting while the TensorBoard tests run."""

    def __init__(self, root):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.uri = f"http://127.0.0.1:{self.port}"
        self.log_path = root / "server.log"
        exe = shutil.which("mlflow", path=os.path.dirname(sys.executable)) or "mlflow"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [exe, "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
                 "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
                 "--artifacts-destination", str(root / "artifacts")],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait(self, timeout=90.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"mlflow server exited ({self.proc.returncode}): "
                            f"{self.log_path.read_text(errors='replace')[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                    if r.status == 200:
                        return self.uri
            except OSError:
                time.sleep(0.3)
        pytest.fail(f"mlflow server not answering after {timeout:.0f} s: "
                    f"{self.log_path.read_text(errors='replace')[-2000:]}")

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the server and its uvicorn worker, started here
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@pytest.fixture(scope="module", autouse=True)
def mlflow_server(tmp_path_factory):
    try:
        import mlflow  # noqa: F401
    except ImportError:
        yield None
        return
    server = Server(tmp_path_factory.mktemp("mlflow"))
    yield server
    server.stop()


# ----------------------------------------------------------------------------- TensorBoard

def read_events(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_tensorboard_events_match_metrics(tmp_path):
    cfg, df = run_tiny(tmp_path)
    files = os.listdir(tmp_path / "tb")
    assert any(f.startswith("events.out.tfevents") for f in files)
    acc = read_events(tmp_path / "tb")
    tags = set(acc.Tags()["scalars"])
    assert {"test/AVG", "test/ALL", "test/mnist", "test/usps", "test/svhn", "val/AVG", "test/loss/ALL",
            "train/loss", "train/loss/client_0", "train/loss/client_2", "comm/bytes_up",
            "comm/bytes_down"} <= tags

    fed = df[df.client == -1]
    for split in ("test", "val"):
        for dom in ("AVG", "ALL", "mnist", "usps", "svhn"):
            rows = fed[(fed.split == split) & (fed.domain == dom) & (fed.metric == "accuracy")].sort_values("round")
            got = [(e.step, e.value) for e in acc.Scalars(f"{split}/{dom}")]
            assert [s for s, _ in got] == rows["round"].tolist() == [1, 2]
            assert [v for _, v in got] == pytest.approx(rows["value"].tolist(), rel=1e-6)  # float32 in events
    loss = fed[(fed.split == "train") & (fed.metric == "loss")].sort_values("round")["value"].tolist()
    assert [e.value for e in acc.Scalars("train/loss")] == pytest.approx(loss, rel=1e-6)
    up = fed[(fed.split == "comm") & (fed.metric == "bytes_up")].sort_values("round")["value"].tolist()
    assert [e.value for e in acc.Scalars("comm/bytes_up")] == pytest.approx(up, rel=1e-6)
    c1 = df[(df.client == 1) & (df.split == "train") & (df.metric == "loss")].sort_values("round")["value"]
    assert [e.value for e in acc.Scalars("train/loss/client_1")] == pytest.approx(c1.tolist(), rel=1e-6)

    # every tracked row has its scalar, and nothing else is written
    expected = {tag_of(r.client, r.domain, r.split, r.metric) for r in df.itertuples()} - {None}
    assert tags == expected

    # the resolved config as hparams (TensorBoard's HParams plugin data)
    from tensorboard.plugins.hparams import metadata
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    content = acc.PluginTagToContent(metadata.PLUGIN_NAME)
    start = HParamsPluginData.FromString(content[metadata.SESSION_START_INFO_TAG]).session_start_info
    assert start.hparams["train.lr"].number_value == pytest.approx(0.05)
    assert start.hparams["method"].string_value == "fedavg"
    assert start.hparams["data.partition.domains"].string_value == '["mnist", "usps", "svhn"]'
    exp = HParamsPluginData.FromString(content[metadata.EXPERIMENT_TAG]).experiment
    assert {m.name.tag for m in exp.metric_infos} >= {"test/AVG", "val/AVG"}
    assert len(exp.hparam_infos) == len(flat_config(cfg))


def test_tensorboard_off_and_tracking_keys(tmp_path):
    run_tiny(tmp_path, "tracking.tensorboard=false", "rounds=1")
    assert not (tmp_path / "tb").exists()
    assert (tmp_path / "metrics.parquet").is_file()
    for bad, words in (("tracking.mlflow_uri=''", "tracking.mlflow_uri"),
                       ("tracking.tensorboard=maybe", "tracking.tensorboard"),
                       ("tracking.wandb=1", "unknown config key 'tracking.wandb'"),
                       ("tracking.client_scalars=-1", "tracking.client_scalars"),
                       ("tracking.client_scalars=many", "tracking.client_scalars")):
        with pytest.raises(UserError, match=words):
            load_config(raw=TINY, overrides=[bad])
    cfg = load_config(raw=TINY)
    assert (cfg.tracking.tensorboard, cfg.tracking.mlflow_uri, cfg.tracking.mlflow_experiment) == (True, None, None)
    assert cfg.tracking.client_scalars == 100


def test_a_federation_larger_than_client_scalars_gets_only_the_federations_scalars(tmp_path):
    """Three clients with tracking.client_scalars 2 (as a cross-device federation beyond the default
    100): no train/*/client_k tag, every federation tag, and metrics.parquet keeps each client's rows."""
    _, df = run_tiny(tmp_path, "tracking.client_scalars=2", "rounds=1")
    tags = set(read_events(tmp_path / "tb").Tags()["scalars"])
    expected = {tag_of(r.client, r.domain, r.split, r.metric) for r in df.itertuples() if r.client < 0} - {None}
    assert tags == expected and "train/loss" in tags
    assert not any("/client_" in t for t in tags)
    assert set(df[(df.split == "train") & (df.client >= 0)].client) == {0, 1, 2}


def test_mlflow_missing_is_a_user_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)  # as if the extra were not installed
    cfg = load_config(raw=TINY, overrides=["tracking.mlflow_uri=http://127.0.0.1:9"])
    with pytest.raises(UserError, match=r"pip install raysim\[mlflow\]"):
        federation(cfg, str(tmp_path), progress=False, backend=InProcess())


# ----------------------------------------------------------------------------- MLflow

@pytest.mark.slow
def test_mlflow_logs_metrics_params_and_artifacts(tmp_path, mlflow_server):
    if mlflow_server is None:
        pytest.skip("mlflow is not installed (pip install -e '.[test]' installs it)")
    from mlflow.tracking import MlflowClient

    from raysim.app import report

    uri = mlflow_server.wait()
    cfg, df = run_tiny(tmp_path, f"tracking.mlflow_uri={uri}", "tracking.mlflow_experiment=raysim-test")
    report.render(str(tmp_path))  # what `raysim run` does once every federation ended
    log_report(cfg, str(tmp_path))

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("raysim-test")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.run_name == run_name(cfg) == "fedavg/seed-11"
    assert run.info.status == "FINISHED"
    assert run.data.tags["raysim.method"] == "fedavg"

    params = run.data.params
    assert params["train.lr"] == "0.05" and params["method"] == "fedavg" and params["rounds"] == "2"
    assert params["tracking.mlflow_uri"] == uri
    assert set(params) == set(flat_config(cfg))

    fed = df[df.client == -1]
    for split, dom in (("test", "AVG"), ("test", "mnist"), ("val", "AVG"), ("test", "ALL")):
        rows = fed[(fed.split == split) & (fed.domain == dom) & (fed.metric == "accuracy")].sort_values("round")
        hist = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, f"{split}/{dom}"))
        assert hist == list(zip(rows["round"].tolist(), rows["value"].tolist()))
    loss = client.get_metric_history(run.info.run_id, "train/loss/client_0")
    assert [m.step for m in sorted(loss, key=lambda m: m.step)] == [1, 2]
    assert {"comm/bytes_up", "train/loss", "test/loss/ALL"} <= set(run.data.metrics)

    names = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"summary.md", "curves.png", "config.yaml", "metrics.parquet"} <= names
    local = client.download_artifacts(run.info.run_id, "summary.md", str(tmp_path / "dl"))
    with open(local, encoding="utf-8") as fh, open(tmp_path / "summary.md", encoding="utf-8") as mine:
        assert fh.read() == mine.read()
