"""cluster/slurm/raysim.sbatch, run outside Slurm with the environment Slurm would set.

No Slurm runs here (a single-node Slurm from Debian's slurm-wlm and munge is not started by the
suite): the test runs the batch script with bash, with the variables sbatch would export for a
two-node allocation (SLURM_JOB_ID, SLURM_JOB_NODELIST=node[1-2], SLURM_JOB_NUM_NODES,
SLURM_CPUS_PER_TASK, ...) and a fake `scontrol` (`show hostnames`) and `srun` (runs the step's
command on this machine, logging `-w NODE`) first on PATH. So the script's own logic runs for
real: a Ray head started through `srun -w node1`, a second Ray node joining it with
`ray start --address` through `srun -w node2`, token authentication with the per-job token the
script generates, `raysim run --address` on a tiny quickstart, and the trap that stops Ray on
every node. Both "nodes" are on this machine, so they are two Ray nodes with distinct node ids.

Like test_two_node: the cluster has its own ports and --temp-dir, nothing is written to
~/.ray, every process it starts carries a marker in its environment, and whatever the script
leaves behind is ended by pid (never `ray stop`, which would end the pytest session's Ray too).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import marked_procs  # tests/cluster/marked_procs.py
from marked_procs import alive as _alive, free_ports as _free_ports, token_file_state as _token_file_state

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "cluster" / "slurm" / "raysim.sbatch"
MARK = "RAYSIM_TEST_SLURM"


def _marked_pids(marker: str) -> list[int]:
    return marked_procs.marked_pids(MARK, marker)


def _teardown(marker: str, grace_s: float = 4.0) -> None:
    marked_procs.teardown(MARK, marker, grace_s)


FAKE_SRUN = r"""#!/bin/bash
# fake srun: run the step's command here, as if on the node named by -w
node=
while [ $# -gt 0 ]; do
    case "$1" in
        -w|--nodelist) node=$2; shift 2 ;;
        --nodelist=*) node=${1#*=}; shift ;;
        -N|-n|-c|--nodes|--ntasks|--cpus-per-task) shift 2 ;;
        --) shift; break ;;
        -*) shift ;;
        *) break ;;
    esac
done
echo "srun -w $node: $*" >> "$FAKE_SLURM_LOG"
SLURMD_NODENAME=$node SLURM_STEP_NODELIST=$node exec "$@"
"""

FAKE_SCONTROL = r"""#!/usr/bin/env python3
# fake scontrol: only `scontrol show hostnames LIST`, LIST like node[1-2],other
import re, sys
if sys.argv[1:3] != ["show", "hostnames"] or len(sys.argv) != 4:
    sys.exit(f"fake scontrol: unsupported {sys.argv[1:]}")
for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?", sys.argv[3]):
    m = re.fullmatch(r"(.*)\[(.*)\]", part)
    if not m:
        print(part)
        continue
    for r in m.group(2).split(","):
        lo, _, hi = r.partition("-")
        for i in range(int(lo), int(hi or lo) + 1):
            print(f"{m.group(1)}{i:0{len(lo)}d}")
"""


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace")[:150]
    except OSError:
        return "?"


@pytest.mark.slow
def test_sbatch_script_starts_two_nodes_runs_and_stops_ray(tmp_path):
    temp = tempfile.mkdtemp(prefix="rssl-", dir="/tmp")  # short: Ray's socket paths live under it
    marker = os.path.basename(temp)
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (fake_bin / name).write_text(text)
        (fake_bin / name).chmod(0o755)
    srun_log = tmp_path / "srun.log"
    port, dash, agent1, agent2, client = _free_ports(5)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "SLURM_", "RAYSIM_"))}
    env.update({
        MARK: marker,
        "PATH": f"{fake_bin}:{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}",
        "RAYSIM_CACHE": os.environ.get("RAYSIM_CACHE") or str(tmp_path / "cache"),
        "FAKE_SLURM_LOG": str(srun_log),
        "RAY_DEDUP_LOGS": "0",
        # what sbatch --nodes=2 --ntasks-per-node=1 --cpus-per-task=1 would export
        "SLURM_JOB_ID": "4242", "SLURM_JOBID": "4242", "SLURM_JOB_NAME": "raysim",
        "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_NODELIST": "node[1-2]",
        "SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2", "SLURM_NTASKS": "2",
        "SLURM_NTASKS_PER_NODE": "1", "SLURM_CPUS_PER_TASK": "1", "SLURM_CPUS_ON_NODE": "1",
        "SLURM_SUBMIT_DIR": str(ROOT), "SLURMD_NODENAME": "node1",
        # this machine's own ports and temp dir, so the pytest session's Ray is untouched
        "RAYSIM_RAY_PORT": str(port),
        "RAYSIM_RAY_ARGS": f"--temp-dir={temp} --include-log-monitor=false "
                           "--object-store-memory=200000000 --disable-usage-stats",
        "RAYSIM_RAY_HEAD_ARGS": f"--include-dashboard=false --dashboard-port={dash} "
                                f"--dashboard-agent-listen-port={agent1} --ray-client-server-port={client}",
        "RAYSIM_RAY_WORKER_ARGS": f"--dashboard-agent-listen-port={agent2}",
        "RAYSIM_START_TIMEOUT": "90",
    })
    run_dir = tmp_path / "run"
    cmd = ["bash", str(SCRIPT), str(ROOT / "configs" / "quickstart.yaml"), "methods=[fedbn]", "rounds=1",
           "data.partition.train_size=32", "eval.every=1", "runtime.num_hosts=2", "runtime.cpus_per_host=1",
           "runtime.server_cpus=0", "--out", str(run_dir), "--quiet"]
    token_before = _token_file_state()
    t0 = time.perf_counter()
    try:
        try:
            # files, not pipes: a Ray daemon that outlived the script would hold a pipe open
            with open(tmp_path / "stdout", "w") as so, open(tmp_path / "stderr", "w") as se:
                proc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=so, stderr=se, timeout=240,
                                      start_new_session=True)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the sbatch script took more than 240s: {(tmp_path / 'stderr').read_text()[-3000:]}")
        elapsed = time.perf_counter() - t0
        # the script's trap stops Ray on both nodes: nothing of this cluster may be left running
        deadline = time.monotonic() + 10
        while (left := _marked_pids(marker)) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = [f"{pid} {_cmdline(pid)}" for pid in left]
    finally:
        _teardown(marker)
        shutil.rmtree(temp, ignore_errors=True)
    print(f"sbatch script outside Slurm: {elapsed:.1f}s")
    stdout, stderr = (tmp_path / "stdout").read_text(), (tmp_path / "stderr").read_text()
    out = stdout[-3000:] + "\n" + stderr[-5000:]
    assert proc.returncode == 0, f"the sbatch script failed (exit {proc.returncode}):\n{out}"
    assert not left, f"the script left {len(left)} Ray processes running:\n" + "\n".join(left) + "\n" + out
    assert not _marked_pids(marker)
    assert _token_file_state() == token_before, "the script changed ~/.ray/auth_token"

    # one step per node, through srun -w: the head on node1, the worker joining it on node2
    steps = srun_log.read_text().splitlines()
    head = [s for s in steps if s.startswith("srun -w node1: ray start --head")]
    worker = [s for s in steps if s.startswith("srun -w node2: ray start --address=")]
    assert len(head) == 1 and len(worker) == 1, steps
    assert "--num-cpus=1" in head[0] and "--block" in worker[0] and f":{port} " in worker[0]

    # the cluster's two Ray nodes, as the script reported them, and the hosts placed on both
    cluster_nodes = set(re.findall(r"raysim\.sbatch: Ray node ([0-9a-f]+) at", stderr))
    assert len(cluster_nodes) == 2, out
    assert (run_dir / "metrics.parquet").is_file(), out
    hosts = json.loads((run_dir / "hosts.json").read_text())
    assert hosts["num_hosts"] == 2 and hosts["num_nodes"] == 2, hosts
    assert {h["node_id"] for h in hosts["hosts"]} == cluster_nodes, (hosts, cluster_nodes)
    assert "raysim run exited with 0" in stderr
