"""A real two-node Ray cluster on this machine: `raysim run --address` places the hosts on both
nodes, each host reads its clients' data from Parquet shards through pyarrow.fs, and the metrics
equal a single-node run that loads the dataset itself.

The cluster is this test's own: `ray start --head` and a second `ray start --address ...` (1 CPU
each, the second labelled with a `node2` resource) under a private --temp-dir, so no other Ray
instance on the machine sees it (a plain `ray.init()` looks for /tmp/ray/ray_current_cluster),
with token authentication from a token passed in the environment (RAY_AUTH_TOKEN), so nothing is
written to ~/.ray. Every process the cluster starts carries a marker in its environment;
teardown ends exactly those, by pid, whatever happened in the test. `ray stop` is never used: it
would end every Ray process on the machine, the pytest session's included.

Ray resolves `--node-ip-address=127.0.0.1` to the machine's own address (its
`resolve_ip_for_localhost`), so both nodes advertise that address; the driver joins through
127.0.0.1.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import marked_procs  # tests/cluster/marked_procs.py
from marked_procs import alive as _alive, free_ports as _free_ports, token_file_state as _token_file_state
import yaml

from raysim.config import load_config

MARK = "RAYSIM_TEST_CLUSTER"


def _marked_pids(marker: str) -> list[int]:
    return marked_procs.marked_pids(MARK, marker)


def _teardown(marker: str, grace_s: float = 4.0) -> None:
    marked_procs.teardown(MARK, marker, grace_s)
RAY = str(Path(sys.executable).with_name("ray"))

CONFIG = {
    "method": "fedbn", "rounds": 2, "seed": 1,
    "data": {"dataset": "rotated_mnist",
             "partition": {"kind": "per_domain", "domains": ["0", "45"], "clients_per_domain": 2}},
    "model": {"name": "small_cnn", "norm": "bn"},
    "train": {"epochs": 1, "batch_size": 32, "lr": 0.05, "max_steps": 3},
    "eval": {"splits": ["val", "test"]},
    "runtime": {"num_hosts": 2, "cpus_per_host": 1, "server_cpus": 0},
}


def _cpu_seconds(pids: list[int]) -> float:
    """CPU time used by these processes and the children they have reaped (ended Ray workers)."""
    total, tick = 0, os.sysconf("SC_CLK_TCK")
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            total += sum(int(v) for v in fields[11:15])  # utime stime cutime cstime
        except (OSError, IndexError, ValueError):
            continue
    return total / tick


def _run(cmd: list[str], env: dict, timeout: float, what: str) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                              start_new_session=True)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"{what} took more than {timeout:g}s: {(err.stderr or b'')[-2000:]!r}")
    if proc.returncode != 0:
        pytest.fail(f"{what} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return proc


@pytest.fixture(scope="module")
def two_node_cluster(ray_session):
    """(address, env for drivers) of a head plus one worker node, 1 CPU each."""
    temp = tempfile.mkdtemp(prefix="rs2n-", dir="/tmp")  # short: Ray's socket paths live under it
    marker = os.path.basename(temp)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update({MARK: marker, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
                "RAY_DEDUP_LOGS": "0", "RAY_USAGE_STATS_ENABLED": "0"})
    port, dash, agent1, agent2 = _free_ports(4)
    token_before = _token_file_state()
    t0 = time.perf_counter()
    common = ["--node-ip-address=127.0.0.1", "--num-cpus=1", "--num-gpus=0", "--disable-usage-stats",
              f"--temp-dir={temp}", "--include-log-monitor=false", "--object-store-memory=200000000"]
    try:
        _run([RAY, "start", "--head", f"--port={port}", "--include-dashboard=false", f"--dashboard-port={dash}",
              f"--dashboard-agent-listen-port={agent1}", *common], env, 90, "ray start --head")
        _run([RAY, "start", f"--address=127.0.0.1:{port}", f"--dashboard-agent-listen-port={agent2}",
              '--resources={"node2": 1}', *common], env, 90, "ray start --address (second node)")
        print(f"two-node cluster up in {time.perf_counter() - t0:.1f}s")
        yield f"127.0.0.1:{port}", env
    finally:
        t0 = time.perf_counter()
        cpu = _cpu_seconds(_marked_pids(marker))
        _teardown(marker)
        print(f"two-node cluster down in {time.perf_counter() - t0:.1f}s (its processes used {cpu:.1f} CPU s)")
        shutil.rmtree(temp, ignore_errors=True)
    assert not _marked_pids(marker), "processes of the test cluster are still running"
    assert _token_file_state() == token_before, "the test cluster changed ~/.ray/auth_token"


def _metrics(run_dir) -> "pd.DataFrame":  # noqa: F821
    return pq.read_table(os.path.join(run_dir, "metrics.parquet")).to_pandas()


@pytest.mark.slow
def test_two_node_run_places_hosts_on_both_nodes_and_matches_single_node(two_node_cluster, tmp_path):
    from raysim.app.experiment import run
    from raysim.app.sharding import write_federation_shards

    address, env = two_node_cluster
    t0 = time.perf_counter()
    config = tmp_path / "two_node.yaml"
    config.write_text(yaml.safe_dump(CONFIG))
    shards = f"file://{tmp_path}/shards"
    write_federation_shards(load_config(config), shards)
    t_shards = time.perf_counter()

    # the reference: one node (the pytest session's Ray), data loaded from the dataset
    single = tmp_path / "single"
    run(load_config(config), out=str(single), progress=False)
    t_single = time.perf_counter()

    # the same config on the two-node cluster, in its own driver process, data from the shards
    two = tmp_path / "two"
    _run([sys.executable, "-m", "raysim", "run", str(config), f"data.shards={shards}", "--address", address,
          "--out", str(two), "--quiet"], env, 240, "raysim run --address on the two-node cluster")

    hosts = json.loads((two / "hosts.json").read_text())
    assert hosts["num_hosts"] == 2 and hosts["num_nodes"] == 2
    node_ids = {h["node_id"] for h in hosts["hosts"]}
    assert len(node_ids) == 2, f"both hosts landed on one node: {hosts}"
    assert sorted(h["client_range"] for h in hosts["hosts"]) == [[0, 4, 2], [1, 4, 2]]
    assert json.loads((single / "hosts.json").read_text())["num_nodes"] == 1

    a, b = _metrics(single), _metrics(two)
    assert len(a) and set(a.split) >= {"val", "test"}
    assert a.equals(b), "the two-node run's metrics differ from the single-node run's"
    t_two = time.perf_counter()
    print(f"two-node test: shards {t_shards - t0:.1f}s, single-node run {t_single - t_shards:.1f}s, "
          f"two-node run {t_two - t_single:.1f}s")
