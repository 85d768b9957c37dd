"""One search per directory, and nothing unpickled from a directory another user could write:
``raysim tune`` holds ``raysim.lock`` in its ``--out`` as ``raysim run`` does (a second search on
it is refused in one line), refuses a search directory that is not this user's alone before Tune
restores (unpickles) its state from it, and reads a trial's error from Tune's text record."""
import json
import os
import socket
import subprocess

import pytest
import yaml

from tunehelp import kill_tree, raysim_cmd, wait_for

from raysim.app.rundir import LOCK, RunLock
from raysim.cli import main as cli_main
from raysim.tuning.search import check_owned, error_line, private_writes


def tune_config(tmp_path, tiny_experiment):
    path = tmp_path / "tune.yaml"
    path.write_text(yaml.safe_dump({
        "method": "fedprox", "trials": 2, "max_concurrent": 1, "scheduler": "none",
        "sampler": {"kind": "random", "seed": 0}, "space": {"train.lr": {"loguniform": [0.01, 0.1]}},
        "experiment": tiny_experiment()}))
    return str(path)


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("raysim: error: ") and "Traceback" not in err, err
    return lines[0]


@pytest.mark.slow  # two real `raysim tune` processes (~30 s): make test-slow
def test_a_second_raysim_tune_on_the_same_out_is_refused_in_one_line(tmp_path, cache_env, tiny_experiment):
    """Two real ``raysim tune`` processes: the second starts while the first holds the lock."""
    config, out = tune_config(tmp_path, tiny_experiment), tmp_path / "search"
    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.Popen(raysim_cmd("tune", config, "--out", str(out)), env=cache_env, cwd=tmp_path,
                                 stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: (out / LOCK).exists(), timeout=120, proc=first, what="the first search's lock")
        second = subprocess.run(raysim_cmd("tune", config, "--out", str(out)), env=cache_env, cwd=tmp_path,
                                capture_output=True, text=True, timeout=120)
        assert second.returncode == 2, second.stdout + second.stderr
        line = one_line(second.stderr)
        assert f"{out} is being written by another raysim (pid {first.pid} on {socket.gethostname()}" in line
        assert json.loads((out / LOCK).read_text())["pid"] == first.pid  # the first one's lock stands
    finally:
        kill_tree(first)


def test_a_live_holders_lock_refuses_a_search_before_anything_is_written(tmp_path, capsys, tiny_experiment):
    config, out = tune_config(tmp_path, tiny_experiment), tmp_path / "search"
    out.mkdir()
    holder = os.getppid()  # a live process on this host
    (out / LOCK).write_text(json.dumps({"pid": holder, "host": socket.gethostname(), "since": "now"}))
    assert cli_main(["tune", config, "--out", str(out)]) == 2
    assert f"is being written by another raysim (pid {holder} on " in one_line(capsys.readouterr().err)
    assert sorted(p.name for p in out.iterdir()) == [LOCK]


def test_a_search_directory_others_could_write_is_refused(tmp_path, capsys, tiny_experiment):
    """Tune's state (``tune/``: tuner.pkl, the searcher's pickle) is unpickled by a restore: a
    directory, or a file in it, writable by the group or by others, or owned by another user, is
    refused in one line before the lock is taken or anything is read."""
    config, out = tune_config(tmp_path, tiny_experiment), tmp_path / "search"
    (out / "tune").mkdir(parents=True)
    (out / "search.yaml").write_text("{}\n")
    pkl = out / "tune" / "tuner.pkl"
    pkl.write_bytes(b"\x80\x04N.")
    for path, mode, words in ((pkl, 0o664, "writable by its group"), (out / "tune", 0o757, "writable by others"),
                              (out, 0o775, "writable by its group")):
        os.chmod(path, mode)
        assert cli_main(["tune", config, "--out", str(out)]) == 2
        line = one_line(capsys.readouterr().err)
        assert line.startswith(f"raysim: error: {path} is {words}: raysim tune resumes a search by unpickling") \
            and line.endswith(f"run: chmod -R go-w {out}"), line
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
        assert not (out / LOCK).exists()
    if os.getuid() == 0:  # another user's file (only root can make one here)
        os.chown(pkl, 4242, -1)
        assert cli_main(["tune", config, "--out", str(out)]) == 2
        line = one_line(capsys.readouterr().err)
        assert f"{pkl} is owned by uid 4242" in line and line.endswith("choose another --out"), line


def test_what_a_search_writes_under_a_group_writable_umask_passes_its_own_check(tmp_path):
    """umask 002 (common where each user has a group of their own) would make Tune's files
    group-writable, and the next resume refused: a search writes as if the umask were 022."""
    out = tmp_path / "search"
    old = os.umask(0o002)
    try:
        with private_writes(), RunLock(str(out)):
            (out / "tune").mkdir()
            (out / "tune" / "tuner.pkl").write_bytes(b"\x80\x04N.")
        assert os.umask(0o002) == 0o002  # given back
    finally:
        os.umask(old)
    assert [oct(p.stat().st_mode & 0o777) for p in (out, out / "tune", out / "tune" / "tuner.pkl")] == \
        ["0o755", "0o755", "0o644"]
    check_owned(str(out))


def test_a_trials_error_is_read_from_tunes_text_record():
    """``error.txt`` as Tune writes it (a record per failure, the latest last) gives the line the
    exception itself gave: Ray's dead-actor text as its ActorDiedError with the worker's exit
    type; a traceback's last exception, without its module path or the run's resume hint."""
    from ray.exceptions import ActorDiedError

    died = str(ActorDiedError())
    record = (f"Failure # 1 (occurred at 2026-01-01_00-00-00)\n{died}\nThe actor is dead because its worker "
              "process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: connection error\n"
              "Failure # 2 (occurred at 2026-01-01_00-00-09)\nray::ImplicitFunc.train() (pid=7, ip=127.0.0.1)\n"
              "  File \"x.py\", line 3, in f\nraysim.core.errors.RunFailed: the server was lost; resume with: "
              "raysim run --resume /x\n")
    assert error_line(record) == "RunFailed: the server was lost"
    first = record.split("Failure # 2")[0]
    assert error_line(first) == ("ActorDiedError: The actor died unexpectedly before finishing this task. "
                                 "(worker exit type SYSTEM_ERROR)")
    assert error_line("Failure # 1 (occurred at x)\n") == "unknown error"
