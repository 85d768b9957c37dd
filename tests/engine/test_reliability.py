"""Checkpoints, resume, a host or the server lost mid-round, the driver killed, a full disk: the
metrics must equal an undisturbed run's, and nobody has to step in."""
import errno
import os
import re
import signal
import subprocess
import sys
import threading

import pyarrow.parquet as pq
import pytest
import torch

from raysim.engine import checkpoint
from raysim.cli import main
from raysim.config import load_config
from raysim.core.errors import Interrupted, RunFailed, UserError
from raysim.app.experiment import federation, resume_config
from raysim.engine.backend import InProcess

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # the colour of the "(pid=N)" prefix Ray gives forwarded worker lines
if REPO not in sys.path:
    sys.path.insert(0, REPO)
from benchmarks.chaos import ROUND, run_under_chaos  # noqa: E402

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
def undisturbed_dir(ray_session, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("undisturbed"))
    federation(cfg(), out, progress=False).run()
    return out


@pytest.fixture(scope="module")
def undisturbed(undisturbed_dir):
    return metrics(undisturbed_dir)


@pytest.mark.slow
def test_interrupted_driver_resumes_to_identical_metrics(undisturbed, tmp_path):
    out = str(tmp_path / "run")

    def stop_after_round_3(rnd, summary, evaluation):
        if rnd == 3:
            raise KeyboardInterrupt

    with pytest.raises(Interrupted, match=r"^interrupted in round 3; resume with: raysim run --resume \S+$"):
        federation(cfg(), out, progress=False, on_round=stop_after_round_3).run()
    assert checkpoint.list_rounds(out) == [2]
    federation(resume_config(out, []), out, progress=False).run(resume=True)
    assert metrics(out).equals(undisturbed)


@pytest.mark.slow
def test_chaos_under_the_cluster_supervisor_hosts_server_and_driver_killed_recover_identical_metrics(
        undisturbed, tmp_path):
    """benchmarks/chaos.py, short, with cluster/supervise.sh (what raysim.sbatch runs the driver
    under) as the supervisor: ``supervise.sh raysim run CONFIG --out DIR``; kill -9 a ClientHost
    (after round 1), the Server (after round 3), the driver itself (after round 4): the supervisor
    runs the same command again, which takes over the dead driver's lock and continues from its
    checkpoint. Real processes, no mocks, no --resume, nobody steps in; the metrics equal the
    undisturbed run's, and nothing of the last driver's Ray is left running."""
    import yaml

    config, out = tmp_path / "run.yaml", tmp_path / "run"
    config.write_text(yaml.safe_dump({**BASE, "checkpoint": {"every": 1, "keep": 2}}))
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "RAYSIM_RETRY_DELAY": "0"}
    command = ["bash", os.path.join(REPO, "cluster", "supervise.sh"), sys.executable, "-m", "raysim", "run",
               str(config), "--out", str(out)]
    result = run_under_chaos(command, schedule=((1, "host"), (3, "server"), (4, "driver")), env=env,
                             timeout_s=400, supervised=True)
    log = "\n".join(result.stderr[-30:])
    assert result.returncode == 0, log
    assert [k.pid is not None for k in result.kills] == [True] * 3, result.kills
    assert result.drivers == 2, log
    lost = [ln for ln in result.stderr if " was lost in round " in ln]
    # the host killed is the newest ClientHost process, which need not be host 1
    assert len(lost) == 2 and re.search(r"ClientHost \d was lost in round 2", lost[0]) \
        and "the Server was lost" in lost[1], log
    assert all("\x1b" not in ln and "object at 0x" not in ln for ln in lost)  # plain words
    assert any("the command exited with status 137 (try 1 of 10); running it again" in ln
               for ln in result.stderr), log
    assert any("taking over" in ln and "which is gone" in ln for ln in result.stderr), log  # the dead driver's lock
    assert any("holds a run of this config: continuing it" in ln for ln in result.stderr), log
    restart = next(i for i, ln in enumerate(result.stderr) if "running it again" in ln)
    rounds_after = [int(m.group(1)) for ln in result.stderr[restart:] if (m := ROUND.search(ln))]
    assert rounds_after and min(rounds_after) >= 4, log  # it went on from its checkpoint, not from scratch
    assert not result.leftover, result.leftover
    assert metrics(str(out)).equals(undisturbed)


@pytest.mark.slow
def test_ctrl_c_in_a_round_exits_130_with_the_resume_hint_and_leaves_no_ray_behind(tmp_path):
    """The real thing: SIGINT (what Ctrl-C sends to the foreground process group) to ``raysim run``
    once a round's checkpoint is on disk: one line with the resume command, exit 130, and no
    process the driver started (Ray's agents included) outlives it."""
    import time

    import yaml

    from benchmarks.chaos import _running, tree

    config, out = tmp_path / "run.yaml", tmp_path / "run"
    config.write_text(yaml.safe_dump({**BASE, "rounds": 4, "checkpoint": {"every": 1},
                                      "runtime": {"num_hosts": 1, "cpus_per_host": 1}}))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    with open(tmp_path / "stderr", "w") as err:  # a file: a lingering Ray daemon would hold a pipe open
        # started as a shell starts it: SIGINT at its default (an ignored SIGINT, which a child inherits
        # through exec, is what a test process may have been left with by a library before this test)
        driver = subprocess.Popen([sys.executable, "-m", "raysim", "run", "--quiet", str(config), "--out", str(out)],
                                  env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True,
                                  preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = {}
    try:
        deadline = time.monotonic() + 240
        while not any(p.suffix != ".tmp" for p in (out / "checkpoints").glob("round-*")) and driver.poll() is None:
            assert time.monotonic() < deadline, (tmp_path / "stderr").read_text()
            seen.update(tree(driver.pid))
            time.sleep(0.05)
        seen.update(tree(driver.pid))
        os.killpg(driver.pid, signal.SIGINT)  # the whole group, as a terminal's Ctrl-C does
        rc = driver.wait(timeout=120)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    text = (tmp_path / "stderr").read_text()
    assert rc == 130, text
    assert re.fullmatch(rf"raysim: interrupted( in round \d)?; resume with: raysim run --resume {out}",
                        text.splitlines()[-1]), text
    assert "Traceback" not in text, text
    deadline = time.monotonic() + 10
    while (left := [c[:80] for pid, c in seen.items() if _running(pid)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, left


@pytest.mark.slow
def test_host_and_server_killed_mid_round_are_replaced_and_metrics_are_identical(undisturbed, tmp_path):
    import ray

    killed = {}

    def kill(rnd, summary, evaluation):
        # once each (the replays pass these rounds again): a host during round 4, the server during 5
        for at, who in ((3, "host"), (4, "server")):
            if rnd == at and who not in killed:
                actor = fed.hosts[1] if who == "host" else fed.server
                killed[who] = ray.get(actor.ready.remote())["pid"]
                threading.Timer(0.3, os.kill, (killed[who], signal.SIGKILL)).start()

    fed = federation(cfg(), str(tmp_path / "run"), progress=False, on_round=kill)
    result = fed.run()
    assert (result.host_restarts, result.server_restarts) == (1, 1)
    assert metrics(fed.run_dir).equals(undisturbed)


@pytest.mark.slow  # two stall deadlines waited out (~100 s): make test-slow
def test_a_stopped_host_and_a_stopped_server_are_detected_within_the_deadline_and_replayed(undisturbed, tmp_path,
                                                                                          capsys):
    """SIGSTOP (what a wedged GPU kernel, an NFS stall or a deadlock look like from outside): the
    actor's health thread stops answering, the wait misses its deadline, the actor is killed,
    replaced and the federation replayed to the undisturbed metrics."""
    import time

    import ray

    stopped = {}

    def stop(rnd, summary, evaluation):
        for at, who in ((2, "host"), (4, "server")):  # once each (the replays pass these rounds again)
            if rnd == at and who not in stopped:
                actor = fed.hosts[1] if who == "host" else fed.server
                pid = ray.get(actor.ready.remote())["pid"]
                os.kill(pid, signal.SIGSTOP)
                stopped[who] = time.monotonic()

    deadline_s = 4.0
    fed = federation(cfg(f"runtime.stall_timeout_s={deadline_s}"), str(tmp_path / "run"), progress=False,
                     on_round=stop)
    result = fed.run()
    assert (result.host_restarts, result.server_restarts) == (1, 1)
    assert metrics(fed.run_dir).equals(undisturbed)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "missed the deadline" in ln]
    assert len(lines) == 2 and "ClientHost 1" in lines[0] and "the Server" in lines[1], lines
    assert all(f"no answer to a health check for {deadline_s:.0f} s" in ln for ln in lines), lines


def test_the_same_command_on_a_finished_run_renders_it_again(undisturbed_dir, tmp_path, capsys):
    """Rerunning a finished run (or --resume on it) starts no federation and no Ray."""
    import yaml

    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(BASE))
    before = metrics(undisturbed_dir)
    assert main(["run", str(config), "--out", undisturbed_dir]) == 0
    assert "has finished; its summary is rendered again" in capsys.readouterr().err
    assert main(["run", "--resume", undisturbed_dir, "--quiet"]) == 0
    assert os.path.isfile(os.path.join(undisturbed_dir, "summary.md"))
    assert metrics(undisturbed_dir).equals(before)


@pytest.fixture
def small_disk(tmp_path, monkeypatch):
    """(folder, fill, free): a 16 MiB tmpfs where this machine lets the suite mount one (root), else
    a folder whose writes raise OSError(ENOSPC) while "full" (torch.save and Parquet writes)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)],
                             capture_output=True).returncode == 0
    filler = mnt / "filler"
    full = []
    if mounted:
        def fill():
            with open(filler, "wb") as fh:
                try:
                    while True:
                        fh.write(b"\0" * 2**20)
                        fh.flush()
                except OSError:
                    pass

        def free():
            filler.unlink()
    else:
        import pyarrow.parquet

        def enospc(original):
            def write(*args, **kwargs):
                if full:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                return original(*args, **kwargs)
            return write

        monkeypatch.setattr(pyarrow.parquet, "write_table", enospc(pyarrow.parquet.write_table))
        monkeypatch.setattr(torch, "save", enospc(torch.save))
        fill, free = (lambda: full.append(1)), full.clear
    yield mnt, fill, free
    if mounted:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def leftovers(run_dir):
    return [os.path.join(d, n) for d, dirs, files in os.walk(run_dir) for n in dirs + files if n.endswith(".tmp")]


def test_a_full_disk_is_one_line_with_what_is_intact_and_the_folder_resumes(small_disk):
    """The disk fills after round 2 (its checkpoint is written): round 3's metrics write fails; after
    a resume it fills again after round 3: round 4's checkpoint fails. Each time one line with the
    original error, what is intact and the resume command, and the first error is the one said
    (the metrics write at the end fails too). Then a resume finishes the run."""
    mnt, fill, free = small_disk
    out = str(mnt / "run")
    c = cfg("rounds=5", "data.partition.train_size=16", "runtime.num_hosts=1")

    def filling_after(at):
        return lambda rnd, summary, evaluation: fill() if rnd == at else None

    def run(resume, at):
        return federation(c, out, progress=False, on_round=filling_after(at), backend=InProcess()).run(resume=resume)

    with pytest.raises(RunFailed) as failed:
        run(False, 2)
    text = str(failed.value)
    assert leftovers(out) == []
    assert "\n" not in text and text == (
        f"cannot write {out}/metrics.parquet: [Errno 28] No space left on device; the checkpoint of round 2 is "
        f"intact, metrics.parquet holds rounds up to 2; resume with: raysim run --resume {out}")
    free()
    with pytest.raises(RunFailed) as failed:
        run(True, 3)
    text = str(failed.value)
    assert "\n" not in text and text.startswith("cannot write the checkpoint of round 4: ") and \
        "o space left on device" in text and text.endswith(
        f"; the checkpoint of round 2 is intact, metrics.parquet holds rounds up to 3; resume with: raysim run "
        f"--resume {out}")
    assert leftovers(out) == []  # the partial round-000004.tmp is gone
    free()
    run(True, None)
    assert sorted(set(metrics(out)["round"])) == [1, 2, 3, 4, 5]


def test_resume_refuses_a_changed_config(tmp_path):
    with pytest.raises(UserError, match="only runtime.\\* overrides are allowed"):
        resume_config(str(tmp_path), ["train.lr=0.1"])


@pytest.mark.slow
def test_out_of_memory_at_start_up_is_one_line_naming_what_to_lower(tmp_path):
    """Ray's memory monitor killing the server while it loads the data (here: a kill threshold of 1%
    of the machine's memory, so the first task's worker goes) is one line, not Ray's traceback."""
    import yaml

    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({**BASE, "rounds": 1, "runtime": {"num_hosts": 1, "cpus_per_host": 1}}))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_memory_usage_threshold="0.01", RAY_memory_monitor_refresh_ms="50")
    r = subprocess.run([sys.executable, "-m", "raysim", "run", "--quiet", str(config), "--out", str(tmp_path / "run")],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr
    # raysim's own output; a line a Ray worker logs while its lost actor is torn down ("(pid=N) ...
    # core_worker.cc: Mismatched ActorID: ignoring KillActor", now and then) is Ray's, forwarded
    ours = "".join(line for line in r.stderr.splitlines(keepends=True) if not ANSI.sub("", line).startswith("(pid="))
    assert ours.count("\n") == 1 and ours.startswith(
        "raysim: out of memory during start-up: Ray's memory monitor killed "), r.stderr
    assert "lower runtime.num_hosts" in ours and "Traceback" not in r.stderr
