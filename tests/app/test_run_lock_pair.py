"""Two real ``raysim run`` processes on one ``--out`` whose lock a crashed run left behind (a dead
pid's lock): the rerun-after-a-crash case, twice at once. Exactly one takes the lock over and runs;
the other is refused in one line."""
import json
import os
import socket
import subprocess
import sys

import pytest

from raysim.app.rundir import LOCK

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# one federation, one host, one round of 16-pixel digits (the tuning tests' cache)
ARGS = ["configs/quickstart.yaml", "methods=[fedavg]", "rounds=1", "data.options.image_size=16",
        "data.options.n_render=1430", "data.partition.train_size=32", "eval.splits=[test]",
        "tracking.tensorboard=false"]


@pytest.mark.slow  # two real raysim runs (~24 s): make test-slow
def test_two_raysim_runs_on_a_stale_lock_one_runs_the_other_is_refused(tmp_path, tmp_path_factory):
    out = tmp_path / "run"
    out.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    (out / LOCK).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "since": "then"}))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # each its own Ray
    env.setdefault("RAYSIM_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
    runs = []
    for n in range(2):
        err = open(tmp_path / f"stderr-{n}", "w")  # a file: a lingering Ray daemon would hold a pipe open
        runs.append(subprocess.Popen([sys.executable, "-m", "raysim", "run", *ARGS, "--out", str(out), "--quiet"],
                                     cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err))
        err.close()
    codes = [run.wait(timeout=300) for run in runs]
    texts = [(tmp_path / f"stderr-{n}").read_text() for n in range(2)]
    assert sorted(codes) == [0, 2], texts
    ran, refused = (texts[0], texts[1]) if codes[0] == 0 else (texts[1], texts[0])
    winner = runs[codes.index(0)].pid
    assert f"raysim: warning: taking over {out / LOCK} (left by pid {dead.pid} on " in ran, ran
    assert refused.count("\n") == 1 and refused.startswith(
        f"raysim: error: {out} is being written by another raysim (pid {winner} on "), refused
    assert (out / "metrics.parquet").is_file() and not (out / LOCK).exists()
    assert sorted(p.name for p in out.glob(f"{LOCK}*")) == []  # no claim left
