"""The run folder's guards, without Ray: one writer per folder, a rerun on a folder of another
config refused, the restart budget per fault window, checkpoints by rounds or by minutes, a lost
actor's reason in plain words, interrupts' exit codes, and a metrics.parquet of the wrong shape in
`raysim report`."""
import json
import os
import socket
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from raysim.app import experiment
from raysim.cli import main
from raysim.config import dump_yaml, load_config
from raysim.core.errors import Interrupted, RunFailed, Terminated, TryLater, UserError
from raysim.app.rundir import LOCK, LOCK_STALE_S, RunLock, holds_run_of
from raysim.engine import loop
from raysim.engine.backend import InProcess
from raysim.engine.cluster import plain_reason

BASE = {
    "method": "fedbn", "rounds": 6, "seed": 7,
    "data": {"dataset": "digits5", "partition": {"kind": "per_domain", "train_size": 48}},
    "model": {"name": "small_cnn"},
    "train": {"batch_size": 16, "lr": 0.05, "momentum": 0.9},
    "runtime": {"num_hosts": 2, "cpus_per_host": 1},
}


def config_file(tmp_path, name="run.yaml", **top):
    path = tmp_path / name
    path.write_text(yaml.safe_dump({**BASE, **top}))
    return str(path)


def one_line(err: str) -> str:
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


# ----------------------------------------------------------------------------- one writer

def test_a_second_writer_is_refused_in_one_line(tmp_path, capsys):
    out = tmp_path / "run"
    config = config_file(tmp_path)
    with RunLock(str(out)):
        dump_yaml(load_config(config), out / "config.yaml")
        holder = json.loads((out / LOCK).read_text())
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
        for argv in (["run", config, "--out", str(out)], ["run", "--resume", str(out)]):
            assert main(argv) == 2
            err = one_line(capsys.readouterr().err)
            assert f"{out} is being written by another raysim (pid {os.getpid()} on {socket.gethostname()}" in err
    assert not (out / LOCK).exists()  # released on leaving


def test_a_lock_whose_holder_is_gone_is_taken_over_with_a_warning(tmp_path, monkeypatch):
    out = tmp_path / "run"
    out.mkdir()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    here = socket.gethostname()

    def take(holder, age_s=0.0):
        (out / LOCK).write_text(json.dumps(holder))
        os.utime(out / LOCK, (os.path.getmtime(out / LOCK) - age_s,) * 2)
        warnings = []
        with RunLock(str(out), warn=warnings.append):
            assert json.loads((out / LOCK).read_text())["pid"] == os.getpid()
        return warnings

    # same host, its pid gone
    assert "which is gone" in take({"pid": gone.pid, "host": here, "since": "then"})[0]
    # same host, the pid alive but another process (reused): its start time differs
    assert "belongs to another process" in take({"pid": os.getppid(), "host": here, "started": -1})[0]
    # another host: try later (exit 75) while it refreshes the lock, taken over once it stopped
    (out / LOCK).write_text(json.dumps({"pid": 1, "host": "node-elsewhere", "since": "then"}))
    os.utime(out / LOCK, (os.path.getmtime(out / LOCK) - 20,) * 2)
    with pytest.raises(TryLater, match=r"being written by another raysim \(pid 1 on node-elsewhere, since then\), "
                                       r"whose lock was refreshed 20 s ago: it is taken over if not refreshed for "
                                       r"120 s, at \d\d:\d\d:\d\d at the earliest; try again then") as later:
        RunLock(str(out)).__enter__()
    assert "\n" not in str(later.value)
    assert "not refreshed for" in take({"pid": 1, "host": "node-elsewhere"}, age_s=LOCK_STALE_S + 5)[0]
    # the same Slurm job, requeued onto another node
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    warned = take({"pid": 1, "host": "node7", "slurm_job": "4242", "slurm_restart": 0})
    assert "Slurm job 4242 before it was requeued" in warned[0]
    # a taker that died holding its claim on a stale lock: the claim is stale too
    (out / f"{LOCK}.takeover-t1").write_text(json.dumps({"pid": gone.pid, "host": here}))
    assert "which is gone" in take({"pid": gone.pid, "host": here, "token": "t1"})[0]
    assert sorted(p.name for p in out.iterdir()) == []
    # a live holder on this host is never taken over
    (out / LOCK).write_text(json.dumps({"pid": os.getppid(), "host": here}))
    with pytest.raises(UserError, match=f"pid {os.getppid()}"):
        RunLock(str(out)).__enter__()


def test_another_hosts_live_lock_is_try_later_exit_75_in_one_line(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / LOCK).write_text(json.dumps({"pid": 1, "host": "node-elsewhere", "since": "then"}))
    assert main(["run", config_file(tmp_path), "--out", str(out)]) == 75
    err = one_line(capsys.readouterr().err)
    assert err.startswith(f"raysim: {out} is being written by another raysim (pid 1 on node-elsewhere, since then)")
    assert f"try again then, or delete {out / LOCK} if that run is gone" in err
    assert json.loads((out / LOCK).read_text())["host"] == "node-elsewhere"  # left as it was


def _racer(base, rounds, start, results, decided):
    """One of two processes that take ``base/run-N``'s lock at the same moment, round after round,
    and hold it (if they got it) until the test has seen both outcomes."""
    for n in range(rounds):
        start.wait(30)
        try:
            with RunLock(os.path.join(base, f"run-{n}"), warn=lambda line: None):
                results.put((n, os.getpid(), "won"))
                decided.wait(30)
        except (UserError, RunFailed) as err:
            results.put((n, os.getpid(), f"refused: {err}"))
            decided.wait(30)


def test_two_processes_racing_for_a_stale_lock_one_wins(tmp_path):
    """The rerun-after-a-crash case: a dead pid's lock in the folder and two processes taking it
    at the same moment (released together by a barrier). Exactly one gets it, 50 times out of
    50; the other is refused in one line naming the winner; no claim or temporary file is left."""
    import multiprocessing

    rounds = 50
    dead = subprocess.Popen(["true"])
    dead.wait()
    for n in range(rounds):  # as this raysim writes a lock (with a token) and as an older one did
        dead_lock = {"pid": dead.pid, "host": socket.gethostname(), **({"token": f"dead{n}"} if n % 2 else {})}
        (tmp_path / f"run-{n}").mkdir()
        (tmp_path / f"run-{n}" / LOCK).write_text(json.dumps(dead_lock))
    ctx = multiprocessing.get_context("fork")  # two long-lived racers: a fork per round would cost seconds
    start, decided, results = ctx.Barrier(3), ctx.Barrier(3), ctx.Queue()
    racers = [ctx.Process(target=_racer, args=(str(tmp_path), rounds, start, results, decided)) for _ in range(2)]
    for racer in racers:
        racer.start()
    try:
        for n in range(rounds):
            start.wait(30)
            got = sorted((results.get(timeout=30) for _ in racers), key=lambda r: r[2] != "won")
            holder = json.loads((tmp_path / f"run-{n}" / LOCK).read_text())
            decided.wait(30)
            assert got[0][2] == "won" and got[1][2].startswith("refused"), (n, got)
            winner = got[0][1]
            assert holder["pid"] == winner
            assert f"being written by another raysim (pid {winner} on " in got[1][2] and "\n" not in got[1][2]
    except BaseException:
        start.abort()  # a failed round: the racers stop waiting
        decided.abort()
        raise
    finally:
        for racer in racers:
            racer.join(30)
            if racer.is_alive():
                racer.kill()
    assert [racer.exitcode for racer in racers] == [0, 0]
    assert [p.name for p in tmp_path.glob("run-*/*")] == []  # the winners' locks released, no claims behind


def test_a_late_taker_leaves_the_lock_a_first_taker_put_in_the_stale_ones_place(tmp_path):
    """The two steps of a takeover the 50-trial race rarely hits between, set up one at a time:
    a taker that judged a lock stale must not remove it while another taker holds its claim, nor
    remove the fresh lock that replaced it (the remove-then-create race: two winners)."""
    from raysim.app.rundir import _LockFile

    run = tmp_path / "run"
    run.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    path = run / LOCK
    path.write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "token": "dead0"}))
    stale = _LockFile.read(str(path))
    late = RunLock(str(run), warn=lambda line: None)
    claim = run / f"{LOCK}.takeover-dead0"  # a live taker's claim on the same stale lock
    claim.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "token": "first"}))
    assert late._remove_stale(stale) is False and json.loads(path.read_text())["token"] == "dead0"
    claim.unlink()
    with RunLock(str(run), warn=lambda line: None) as first:  # the first taker has put its own lock there
        assert late._remove_stale(stale) is False
        assert json.loads(path.read_text())["token"] == first.me["token"]


# ----------------------------------------------------------------------------- the same command resumes

def test_a_rerun_on_a_folder_of_another_config_is_refused_naming_what_differs(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    ran = load_config(raw=BASE)
    dump_yaml(ran.for_method("fedbn"), out / "config.yaml")  # what a one-method federation records
    assert not holds_run_of(load_config(raw=BASE, overrides=["train.lr=0.1"]), str(out))  # nothing ran: no run
    pq.write_table(pa.table({"round": [1]}), out / "metrics.parquet")
    assert holds_run_of(load_config(raw={**BASE, "method": None, "methods": ["fedbn"]}), str(out))
    assert holds_run_of(load_config(raw=BASE, overrides=["runtime.num_hosts=1"]), str(out))  # where it runs may change
    assert main(["run", config_file(tmp_path), "train.lr=0.1", "seed=8", "--out", str(out)]) == 2
    err = one_line(capsys.readouterr().err)
    assert f"--out {out} holds a run of another config (seed: 7 there, 8 here; train.lr: 0.05 there, 0.1 here)" in err
    assert f"raysim run --resume {out}" in err
    assert not (out / LOCK).exists()


# ----------------------------------------------------------------------------- restarts and checkpoints

def test_the_restart_budget_is_per_fault_window():
    faults = loop.FaultWindow(3)
    for rnd in (4, 9, 14, 18, 19):  # five losses far apart (the old budget ended the run at the 4th)
        assert faults.failed(rnd)
        for replayed in range(rnd - 2, rnd + 1):  # the replay from a checkpoint two rounds back
            faults.completed(replayed)
    assert faults.count == 0
    assert [faults.failed(7) for _ in range(4)] == [True, True, True, False]  # round 7 fails every time
    faults = loop.FaultWindow(2)
    assert faults.failed(7)
    faults.completed(5)  # replayed rounds before the failure are no progress
    faults.completed(6)
    assert faults.failed(6)  # lost again while replaying: the same window
    assert not faults.failed(7)


def test_a_checkpoint_is_due_every_k_rounds_or_after_minutes(tmp_path, monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(loop.time, "monotonic", lambda: now[0])

    def fed(*overrides):
        run = loop.FederationRun(load_config(raw=BASE, overrides=["rounds=50", *overrides]), str(tmp_path),
                                 backend=InProcess())
        run._ckpt_at = now[0]
        return run

    run = fed()  # the default: by time, every 10 minutes
    assert run.cfg.checkpoint.every == 0 and run.cfg.checkpoint.minutes == 10
    now[0] += 599
    assert not run._checkpoint_due(3)
    now[0] += 1
    assert run._checkpoint_due(4)
    run._ckpt_at, run._ckpt_seconds = now[0], 60.0  # a slow checkpoint: the next waits 20 x 60 s
    now[0] += 900
    assert not run._checkpoint_due(5)
    now[0] += 300
    assert run._checkpoint_due(6)
    assert not run._checkpoint_due(50)  # never after the last round
    run = fed("checkpoint.every=5", "checkpoint.minutes=null")
    assert [r for r in range(1, 51) if run._checkpoint_due(r)] == [5, 10, 15, 20, 25, 30, 35, 40, 45]
    with pytest.raises(UserError, match="checkpoint.minutes"):
        load_config(raw=BASE, overrides=["checkpoint.minutes=0"])
    with pytest.raises(UserError, match="runtime.max_restarts"):
        load_config(raw=BASE, overrides=["runtime.max_restarts=-1"])


def test_a_lost_actors_reason_is_plain_words():
    class Died(Exception):
        cause = None

    class TaskError(Exception):  # what ray.get raises when the server's input came from a dead host
        def __init__(self, text, cause):
            super().__init__(text)
            self.cause = cause

    died = Died("The actor died unexpectedly before finishing this task.\n\tclass_name: ClientHost\n\t"
                "actor_id: 8a6f\n\tpid: 2219\n\tnamespace: x\nThe actor is dead because its worker process has "
                "died. Worker exit type: SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits ...")
    wrapped = TaskError("\x1b[36mray::Server.aggregate()\x1b[39m (pid=2220, ip=127.0.0.1, actor_id=59d0, "
                        "repr=<raysim.engine.server.Server object at 0x7fb9>)\n  At least one of the input "
                        "arguments for this task could not be computed:\n" + str(died), died)
    assert plain_reason(wrapped) == plain_reason(died) == "its worker process has died, pid 2219"


# ----------------------------------------------------------------------------- interrupts, report

@pytest.mark.parametrize("signal_raised, code", [(KeyboardInterrupt, 130), (Terminated, 143)])
def test_an_interrupt_exits_130_or_143_with_the_resume_hint_when_there_is_something_to_resume(
        tmp_path, monkeypatch, capsys, signal_raised, code):
    def interrupted(*args, **kwargs):
        raise signal_raised()

    monkeypatch.setattr(experiment, "_run", interrupted)
    config, out = config_file(tmp_path), tmp_path / "run"
    assert main(["run", config, "--out", str(out), "--quiet"]) == code  # during start-up: nothing to resume
    assert one_line(capsys.readouterr().err) == "raysim: interrupted\n"
    (out / "checkpoints" / "round-000002").mkdir(parents=True)
    dump_yaml(load_config(config), out / "config.yaml")
    assert main(["run", config, "--out", str(out), "--quiet"]) == code
    assert one_line(capsys.readouterr().err) == f"raysim: interrupted; resume with: raysim run --resume {out}\n"
    assert not (out / LOCK).exists()

    def in_a_round(*args, **kwargs):
        raise Interrupted(f"interrupted in round 3; resume with: raysim run --resume {out}")

    monkeypatch.setattr(experiment, "_run", in_a_round)
    assert main(["run", config, "--out", str(out), "--quiet"]) == 130
    assert one_line(capsys.readouterr().err).startswith("raysim: interrupted in round 3; resume with")


def test_a_failed_write_exits_1_in_one_line(tmp_path, monkeypatch, capsys):
    from raysim.core.files import WriteFailed

    def disk_full(*args, **kwargs):
        raise RunFailed(f"{WriteFailed('x/metrics.parquet', OSError(28, 'No space left on device'))}; "
                        "resume with: raysim run --resume x")

    monkeypatch.setattr(experiment, "_run", disk_full)
    assert main(["run", config_file(tmp_path), "--out", str(tmp_path / "run"), "--quiet"]) == 1
    err = one_line(capsys.readouterr().err)
    assert err.startswith("raysim: cannot write x/metrics.parquet: [Errno 28] No space left on device")
    assert not (tmp_path / "run" / LOCK).exists()


def test_report_on_a_metrics_file_missing_a_column_is_one_line(tmp_path, capsys):
    table = pa.table({"round": pa.array([1], pa.int32()), "client": [-1], "domain": ["AVG"], "split": ["test"],
                      "metric": ["accuracy"]})  # no "value"
    pq.write_table(table, tmp_path / "metrics.parquet")
    assert main(["report", str(tmp_path)]) == 2
    err = one_line(capsys.readouterr().err)
    assert "metrics.parquet is not a raysim metrics file: it lacks the column(s) value" in err
    pq.write_table(table.append_column("value", pa.array(["high"])), tmp_path / "metrics.parquet")
    assert main(["report", str(tmp_path)]) == 2
    assert "its columns do not convert" in one_line(capsys.readouterr().err)


# ----------------------------------------------------------------------------- the folder knows its config
# Every piece of a federation's state records its config's fingerprint (raysim.engine.runstate);
# a folder whose state is not the config being run is refused in one line, before Ray starts.

def _fingerprint(c):
    from raysim.engine.checkpoint import config_fingerprint
    return config_fingerprint(c)


def _state(out, c, status=True, rounds=(4,), fingerprints=True, config=True):
    """A federation's state written as ``c``'s run leaves it (by hand; ``fingerprints=False``: as
    raysim wrote status.json and metrics.parquet before they carried the fingerprint)."""
    import torch

    from raysim.engine import checkpoint
    from raysim.engine.metrics import MetricsLog
    os.makedirs(out, exist_ok=True)
    if config:
        dump_yaml(c, os.path.join(out, "config.yaml"))
    log = MetricsLog()
    log.add(1, -1, "AVG", "test", "accuracy", 0.5)
    log.write(os.path.join(out, "metrics.parquet"), _fingerprint(c) if fingerprints else None)
    if status:
        record = {"finished": True, "rounds": c.rounds, **({"config": _fingerprint(c)} if fingerprints else {})}
        (out / "status.json").write_text(json.dumps(record))
    for rnd in rounds:
        checkpoint.write(str(out), rnd, c, {"w": torch.ones(2)}, {0: {"state": {}, "trained": True}}, log.table(),
                         keep=len(rounds))


def test_state_without_a_config_yaml_is_refused_in_one_line(tmp_path, capsys):
    """The chaos run's folder: an old run's status.json, checkpoints and metrics, no config.yaml, and
    another config run into it (before: its checkpoints pruned away, then "finished", exit 0)."""
    out = tmp_path / "run"
    _state(out, load_config(raw=BASE, overrides=["seed=0", "rounds=8"]), rounds=(6, 7, 8), config=False)
    before = sorted(os.listdir(out))
    assert main(["run", config_file(tmp_path), "--out", str(out), "--quiet"]) == 2
    err = one_line(capsys.readouterr().err)
    assert f"--out {out} holds a run's state (" in err and "status.json" in err and "checkpoints" in err
    assert "but no config.yaml" in err and "choose another --out" in err
    assert sorted(os.listdir(out)) == before  # nothing written, nothing pruned
    assert main(["run", "--resume", str(out)]) == 2
    assert "no config.yaml there" in one_line(capsys.readouterr().err)
    with pytest.raises(UserError, match="holds a run's status.json, metrics.parquet and the checkpoints of rounds "
                                        "6, 7, 8 but no config.yaml"):
        loop.FederationRun(load_config(raw=BASE), str(out), backend=InProcess()).run()


def test_a_config_yaml_edited_after_its_run_is_refused_on_resume_and_on_the_same_command(tmp_path, capsys):
    """A finished seed-7 run whose config.yaml now says seed 8 (before: --resume exited 0, the
    folder labelling seed-7 results as seed 8)."""
    out = tmp_path / "run"
    _state(out, load_config(raw=BASE).for_method("fedbn"))
    assert loop.finished(str(out), load_config(raw=BASE))
    text = (out / "config.yaml").read_text()
    (out / "config.yaml").write_text(text.replace("seed: 7", "seed: 8"))
    commands = (["run", "--resume", str(out)],
                ["run", config_file(tmp_path, seed=8), "--out", str(out)],  # the edited config
                ["run", config_file(tmp_path), "--out", str(out)])  # the run's own
    for argv in commands:
        assert main([*argv, "--quiet"]) == 2
        err = one_line(capsys.readouterr().err)
        assert f"{out}/config.yaml does not match its run's state: status.json, metrics.parquet and the " \
               "checkpoint of round 4 record config " in err, err
        assert "edited after the run" in err and "put back the config.yaml the run was written with" in err
    with pytest.raises(UserError, match="does not match its run's state"):
        loop.finished(str(out), load_config(raw=BASE, overrides=["seed=8"]))


def test_finished_means_finished_for_this_config(tmp_path):
    out = tmp_path / "run"
    ran, other = load_config(raw=BASE), load_config(raw=BASE, overrides=["train.lr=0.1"])
    _state(out, ran, rounds=())
    assert loop.finished(str(out), ran)
    with pytest.raises(UserError, match=r"holds status.json and metrics.parquet of another config \(config "
                                        f"{_fingerprint(ran)}; this run's is config {_fingerprint(other)}\\); "
                                        "choose another --out"):
        loop.finished(str(out), other)
    (out / "status.json").write_text(json.dumps({"finished": True, "config": _fingerprint(other)}))
    with pytest.raises(UserError, match="holds status.json of another config"):  # its own metrics: still refused
        loop.finished(str(out), ran)
    (out / "status.json").write_text(json.dumps({"finished": False, "config": _fingerprint(ran)}))
    assert not loop.finished(str(out), ran)


def test_a_folder_from_before_the_fingerprints_is_finished_where_nothing_contradicts_it(tmp_path, capsys):
    """status.json and metrics.parquet without a fingerprint (raysim before them): finished for its
    config.yaml's config where its checkpoints (which always carried one) agree, or none is left."""
    from raysim.engine.metrics import recorded_config
    ran = load_config(raw=BASE)
    old = tmp_path / "old"
    _state(old, ran, fingerprints=False)
    assert recorded_config(str(old / "metrics.parquet")) is None
    assert loop.finished(str(old), ran)
    assert experiment.resume_config(str(old), ["runtime.num_hosts=1"]).seed == 7
    assert holds_run_of(ran, str(old))
    bare = tmp_path / "bare"
    _state(bare, ran, fingerprints=False, rounds=())
    assert loop.finished(str(bare), ran)  # nothing to contradict it: its config.yaml is taken as it says
    (old / "config.yaml").write_text((old / "config.yaml").read_text().replace("seed: 7", "seed: 8"))
    assert main(["run", "--resume", str(old), "--quiet"]) == 2  # the checkpoint contradicts the edit
    assert "the checkpoint of round 4 records config" in one_line(capsys.readouterr().err)


def test_checkpoints_of_another_config_are_refused_before_the_run_starts(tmp_path):
    """This config's run and status beside another config's higher-numbered checkpoints."""
    from raysim.engine import checkpoint
    out = tmp_path / "run"
    ran, other = load_config(raw=BASE), load_config(raw=BASE, overrides=["seed=0"])
    _state(out, other, status=False, rounds=(6, 7, 8))
    _state(out, ran, rounds=(1, 2))
    assert checkpoint.list_rounds(str(out)) == [1, 2, 6, 7, 8]
    for attempt in (lambda: loop.finished(str(out), ran), lambda: experiment.resume_config(str(out), []),
                    lambda: holds_run_of(ran, str(out)),
                    lambda: loop.FederationRun(ran, str(out), backend=InProcess()).run(resume=True)):
        with pytest.raises(UserError, match=f"{out} holds the checkpoints of rounds 6, 7, 8 of another config "
                                            f"\\(config {_fingerprint(other)}; this run's is config "
                                            f"{_fingerprint(ran)}\\); choose another --out"):
            attempt()


def test_every_federation_of_a_comparison_passes_the_check_for_its_own_config(tmp_path):
    """Methods x seeds x a held-out domain, per-method settings and a server optimizer: each
    federation's config.yaml loads back to the fingerprint its state records, so the check never
    refuses a folder raysim wrote itself."""
    out = tmp_path / "cmp"
    raw = {**BASE, "method": None, "methods": ["fedavg", "fedbn"], "seeds": [1, 2],
           "per_method": {"fedbn": {"train": {"lr": 0.1}}}, "eval": {"protocol": "lodo", "holdout": "mnist"},
           "server": {"optimizer": "adam", "lr": 0.01}, "name": "cmp", "paper": {"source": "x"}}
    ran = experiment.load_checked(raw=raw)
    os.makedirs(out)
    dump_yaml(ran, out / "config.yaml")
    jobs = experiment.plan(ran, str(out))
    assert [os.path.relpath(sub, out) for _, sub in jobs] == [
        f"{m}/seed-{s}/holdout-mnist" for m in ("fedavg", "fedbn") for s in (1, 2)]
    for one, sub in jobs:
        _state(tmp_path / sub, one, rounds=(2,))
    assert holds_run_of(ran, str(out))
    resumed = experiment.resume_config(str(out), [])
    assert all(loop.finished(sub, one) for one, sub in experiment.plan(resumed, str(out)))


def test_eval_holdout_takes_a_list_of_domains_held_out_in_turn(tmp_path):
    """A leave-one-domain-out run over some domains: one folder each, in the order asked; YAML's
    numbers name rotated_mnist's angle domains; a repeat or an unknown domain is one line."""
    from raysim.app.rundir import plan
    from raysim.app.tables import held_out_text
    base = {"method": "fedavg", "data": {"dataset": "rotated_mnist"}, "eval": {"protocol": "lodo"}}
    cfg = load_config(raw={**base, "eval": {"protocol": "lodo", "holdout": [75, "0"]}})
    folders = [os.path.relpath(f, tmp_path) for _, f in plan(cfg, str(tmp_path))]
    assert folders == ["holdout-75", "holdout-0"]
    assert held_out_text(cfg.eval.holdout) == "75, 0 held out in turn"
    assert held_out_text("all") == "each domain held out in turn"
    with pytest.raises(UserError, match=r"eval.holdout' = \[0, '0'\]: expected 'all', a domain's name, or a list"):
        load_config(raw={**base, "eval": {"protocol": "lodo", "holdout": [0, "0"]}})
    with pytest.raises(UserError, match="eval.holdout = '90' is not a domain of rotated_mnist"):
        plan(load_config(raw={**base, "eval": {"protocol": "lodo", "holdout": [0, 90]}}), str(tmp_path))
