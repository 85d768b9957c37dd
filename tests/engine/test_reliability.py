"""Checkpoints, resume, and a host lost mid-round: the metrics must equal an undisturbed run's."""
import os
import signal
import subprocess
import sys
import threading
import time

import pyarrow.parquet as pq
import pytest
import torch

from raysim import checkpoint
from raysim.config import load_config
from raysim.errors import RunFailed, UserError
from raysim.experiment import federation, resume_config
from raysim.metrics import MetricsLog

BASE = {
    "method": "fedbn", "rounds": 6, "seed": 7,
    "data": {"dataset": "digits5", "partition": {"kind": "per_domain", "train_size": 48}},
    "model": {"name": "small_cnn"},
    "train": {"batch_size": 16, "lr": 0.05, "momentum": 0.9},
    "runtime": {"num_hosts": 2, "cpus_per_host": 1},
    "checkpoint": {"every": 2, "keep": 2},
}


def cfg(*overrides):
    return load_config(raw=BASE, overrides=list(overrides))


def metrics(run_dir):
    return pq.read_table(os.path.join(run_dir, "metrics.parquet")).to_pandas()


@pytest.fixture(scope="module")
def undisturbed(ray_session, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("undisturbed"))
    federation(cfg(), out, progress=False).run()
    return metrics(out)


def test_interrupted_driver_resumes_to_identical_metrics(undisturbed, tmp_path):
    out = str(tmp_path / "run")

    def stop_after_round_3(rnd, summary, evaluation):
        if rnd == 3:
            raise KeyboardInterrupt

    with pytest.raises(RunFailed, match=r"interrupted in round 3; resume with: raysim run --resume"):
        federation(cfg(), out, progress=False, on_round=stop_after_round_3).run()
    assert checkpoint.list_rounds(out) == [2]
    federation(resume_config(out, []), out, progress=False).run(resume=True)
    assert metrics(out).equals(undisturbed)


def test_driver_process_killed_after_round_3_resumes_to_identical_metrics(undisturbed, tmp_path):
    """The real thing: ``raysim run`` in its own process, SIGKILLed once round 3's checkpoint is on
    disk (no handler runs), then ``raysim run --resume`` in a fresh process."""
    import yaml

    config, out = tmp_path / "run.yaml", tmp_path / "run"
    config.write_text(yaml.safe_dump({**BASE, "checkpoint": {"every": 1, "keep": 2}}))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cmd = [sys.executable, "-m", "raysim", "run", "--quiet"]
    driver = subprocess.Popen([*cmd, str(config), "--out", str(out)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    marker = out / "checkpoints" / "round-000003"
    deadline = time.monotonic() + 240
    while not marker.exists() and driver.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), driver.stderr.read() if driver.poll() is not None else "no round-3 checkpoint"
    driver.send_signal(signal.SIGKILL)
    driver.wait(timeout=30)
    assert driver.returncode == -signal.SIGKILL  # it was still running: killed, not finished
    assert not (out / "metrics.parquet").exists() or len(metrics(out)) < len(undisturbed)

    resumed = subprocess.run([*cmd, "--resume", str(out)], env=env, capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert max(checkpoint.list_rounds(str(out))) > 3  # it went on from round 3, not from scratch
    assert metrics(out).equals(undisturbed)


def test_host_killed_mid_round_is_replaced_and_metrics_are_identical(undisturbed, tmp_path):
    import ray

    killed = []

    def kill_a_host_during_round_4(rnd, summary, evaluation):
        if rnd == 3 and not killed:  # once: the replay passes round 3 again
            pid = ray.get(fed.hosts[1].ready.remote())["pid"]
            threading.Timer(0.3, os.kill, (pid, signal.SIGKILL)).start()
            killed.append(pid)

    fed = federation(cfg(), str(tmp_path / "run"), progress=False, on_round=kill_a_host_during_round_4)
    result = fed.run()
    assert result.host_restarts == 1
    assert metrics(fed.run_dir).equals(undisturbed)


def test_resume_refuses_a_changed_config(tmp_path):
    with pytest.raises(UserError, match="only runtime.\\* overrides are allowed"):
        resume_config(str(tmp_path), ["train.lr=0.1"])


def _write_two(tmp_path):
    c = cfg()
    log = MetricsLog()
    log.add(1, -1, "ALL", "test", "accuracy", 0.5)
    for rnd in (2, 4):
        checkpoint.write(str(tmp_path), rnd, c, {"global": {"w": torch.full((64,), float(rnd))}},
                         {0: {"personal": {"b": torch.ones(3) * rnd}}}, log.table(), keep=2)
    return c


@pytest.mark.parametrize("fraction", [0.0, 0.01, 0.5, 0.99])
@pytest.mark.parametrize("victim", ["server.pt", "clients.pt", "metrics.parquet", "meta.json"])
def test_truncated_checkpoint_is_a_clear_error_and_the_previous_one_loads(tmp_path, victim, fraction):
    c = _write_two(tmp_path)
    path = tmp_path / "checkpoints" / "round-000004" / victim
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(UserError, match=f"checkpoint file .*round-000004/{victim} is unreadable"):
        checkpoint.read(str(tmp_path), 4, c)
    warnings = []
    got = checkpoint.latest(str(tmp_path), c, warn=warnings.append)
    assert got["round"] == 2 and torch.equal(got["server"]["global"]["w"], torch.full((64,), 2.0))
    assert len(warnings) == 1 and victim in warnings[0]


def test_checkpoint_of_another_config_is_refused(tmp_path):
    _write_two(tmp_path)
    with pytest.raises(UserError, match="written by a different config"):
        checkpoint.read(str(tmp_path), 4, cfg("train.lr=0.2"))


def test_keep_only_the_newest(tmp_path):
    _write_two(tmp_path)
    c = cfg()
    checkpoint.write(str(tmp_path), 6, c, {}, {}, MetricsLog().table(), keep=2)
    assert checkpoint.list_rounds(str(tmp_path)) == [4, 6]
