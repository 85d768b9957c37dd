"""A comparison that ends abnormally ends cleanly: a bug in one method stops that federation alone
(its traceback shown and kept in error.txt, the others finish); an error, Ctrl-C or SIGTERM ends
every federation within seconds with exit 2, 130 or 143, one Ray instance in all, and no Ray
process left behind. Real ``raysim run`` processes, real signals."""
from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from benchmarks.chaos import _running, tree  # noqa: E402

TINY = {
    "rounds": 4, "seed": 1,
    "data": {"dataset": "digits5", "options": {"image_size": 16},
             "partition": {"kind": "per_domain", "train_size": 32}},
    "model": {"name": "small_cnn"},
    "train": {"batch_size": 16, "lr": 0.05},
    "eval": {"splits": ["test"]},
    "runtime": {"num_hosts": 1, "cpus_per_host": 1, "parallel_federations": 2},
    "checkpoint": {"every": 1},
    "tracking": {"tensorboard": False},
}

PLUGIN = '''
from raysim.core.errors import UserError
from raysim.methods.fedavg import FedAvg


class BuggyClient(FedAvg):
    """FedAvg whose client step raises a KeyError from round 2 on."""
    name = "buggyclient"

    def local_update(self, ctx):
        if ctx.round >= 2:
            return lookup({}, "missing")
        return super().local_update(ctx)


class BuggyServer(FedAvg):
    """FedAvg whose server step raises in round 2."""
    name = "buggyserver"

    def aggregate(self, state, uploads, round):
        if round >= 2:
            raise ValueError(f"aggregate broke in round {round}")
        return super().aggregate(state, uploads, round)


class WrongSetting(FedAvg):
    """FedAvg that finds a setting wrong in round 2 (a user's error: it ends the whole comparison)."""
    name = "wrongsetting"

    def local_update(self, ctx):
        if ctx.round >= 2:
            raise UserError("wrongsetting: this setting cannot work")
        return super().local_update(ctx)


def lookup(table, key):
    return table[key]
'''


def line_of(code: str) -> int:
    return next(i for i, ln in enumerate(PLUGIN.splitlines(), 1) if code in ln)


def start(tmp_path: Path, *args: str) -> subprocess.Popen:
    """``raysim run`` as a shell starts it (SIGINT at its default, its own process group), the
    plugin file beside the config, stderr into a file (a lingering Ray daemon would hold a pipe)."""
    (tmp_path / "plugin.py").write_text(PLUGIN)
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    err = open(tmp_path / "stderr", "w")
    return subprocess.Popen([sys.executable, "-m", "raysim", "run", "tiny.yaml", *args, "--out", "run"],
                            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def watch(driver: subprocess.Popen, until, seen: dict, timeout: float = 240) -> None:
    """Poll the driver's process tree into ``seen`` ({pid: command}) until ``until()`` or it exits
    (a command as last read: a forked process carries its parent's until it execs, and an ending
    one's reads back empty)."""
    deadline = time.monotonic() + timeout
    while True:
        for pid, cmd in tree(driver.pid):
            if cmd:
                seen[pid] = cmd
        if until() or driver.poll() is not None:
            return
        assert time.monotonic() < deadline, "the run did not get there in time"
        time.sleep(0.05)


def ended(driver: subprocess.Popen, timeout: float, seen: dict | None = None) -> int:
    """The driver's exit code (its process group killed if it outlives ``timeout`` seconds);
    ``seen``: its process tree, polled into it meanwhile (:func:`watch`)."""
    try:
        if seen is not None:
            watch(driver, lambda: False, seen)
        return driver.wait(timeout=timeout)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)


def no_ray_left(seen: dict) -> list[str]:
    deadline = time.monotonic() + 10
    while (left := [c[:80] for pid, c in seen.items() if _running(pid)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def ray_instances(seen: dict) -> int:
    return sum(1 for cmd in seen.values() if "gcs_server" in cmd.split(" ", 1)[0])


@pytest.mark.slow  # three federations to their end (~30 s): make test-slow
def test_a_bug_in_one_method_stops_it_alone_with_its_traceback_and_the_others_finish(tmp_path):
    driver = start(tmp_path, "methods=[fedavg,plugin:BuggyClient,plugin:BuggyServer]")
    seen = {}
    rc = ended(driver, 60, seen)
    text = (tmp_path / "stderr").read_text()
    assert rc == 1, text
    plugin = str(tmp_path / "plugin.py")
    client = f'File "{plugin}", line {line_of("return table[key]")}, in lookup'
    server = f'File "{plugin}", line {line_of("raise ValueError")}, in aggregate'
    # the method's own file and line, on screen and in the federation's error.txt
    assert client in text and "KeyError: 'missing'" in text, text
    assert server in text and "ValueError: aggregate broke in round 2" in text, text
    run = tmp_path / "run"
    assert client in (run / "buggyclient" / "error.txt").read_text()  # a plugin's folder: its name
    assert server in (run / "buggyserver" / "error.txt").read_text()
    # not replayed: no replacement, no second try of round 2
    assert "replacing" not in text and " lost in round" not in text, text
    assert re.fullmatch(r"raysim: 2 of 3 federations failed \(buggyclient: KeyError: 'missing', in round 2; "
                        r"buggyserver: ValueError: aggregate broke in round 2, in round 2\); the other 1 finished "
                        r"and summary\.md shows them; fix, then rerun the same command \(finished federations are kept\)", text.splitlines()[-1]), text
    # the healthy federation ran to its end, and the summary shows it
    status = (run / "fedavg" / "status.json").read_text()
    assert '"finished": true' in status, status
    assert "fedavg" in (run / "summary.md").read_text()
    assert not no_ray_left(seen)


@pytest.mark.slow  # one buffered federation to round 2 (~15 s): make test-slow
def test_a_bug_in_a_buffered_client_step_shows_its_traceback_not_a_lost_host(tmp_path):
    """The buffered step chains its calls (a host's result is the server's argument): a method's
    exception still arrives as itself, with its file and line, and nothing is replayed."""
    levels = '[{name: fast, flops: 2.0e+9, up_mbps: 10, down_mbps: 50}]'
    driver = start(tmp_path, "method=plugin:BuggyClient", "schedule.kind=buffered", "schedule.buffer=2",
                   "clients_per_round=4", f"clients.profiles.levels={levels}")
    rc = ended(driver, 120)
    text = (tmp_path / "stderr").read_text()
    assert rc == 1, text
    assert f'File "{tmp_path / "plugin.py"}", line {line_of("return table[key]")}, in lookup' in text, text
    assert "KeyError: 'missing'" in text and "replacing" not in text and " lost in round" not in text, text


CASES = {  # how the comparison is ended -> its exit code and last line
    "ctrl-c": (signal.SIGINT, 130, r"raysim: interrupted.*resume with: raysim run --resume run"),
    "sigterm": (signal.SIGTERM, 143, r"raysim: interrupted.*resume with: raysim run --resume run"),
    "error": (None, 2, r"raysim: error: wrongsetting: this setting cannot work"),
}


# the error in make test; the two signals, which end the same way, in make test-slow (~25 s each)
@pytest.mark.parametrize("case", [c if c == "error" else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_a_three_federation_comparison_ended_at_a_random_point_ends_cleanly(tmp_path, case):
    """Exit 130, 143 or 2 within 10 s of the signal (or of the error), one line, a single Ray
    instance in all (none started after the first one ended), no Ray process left."""
    sig, code, last = CASES[case]
    first = "plugin:WrongSetting" if sig is None else "fedbn"  # the error: while another federation runs
    driver = start(tmp_path, f"methods=[{first},fedavg,fedprox]")
    seen = {}
    stderr = tmp_path / "stderr"
    try:
        watch(driver, lambda: "round 1/" in stderr.read_text(), seen)
        if sig is not None:
            pause = random.Random(os.getpid()).uniform(0.0, 3.0)  # a random point of the rounds that follow
            watch(driver, lambda t=time.monotonic() + pause: time.monotonic() > t, seen)
            os.killpg(driver.pid, sig)  # the whole group, as a terminal's Ctrl-C does
        sent = time.monotonic()
        watch(driver, lambda: False, seen, timeout=120)
        took = time.monotonic() - sent
        rc = driver.wait(timeout=10)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    text = stderr.read_text()
    assert rc == code, text
    assert re.search(last, text.splitlines()[-1]), text
    assert "Traceback" not in text and "Failed to connect to GCS" not in text, text
    if sig is not None:
        assert took < 10, (took, text)
    assert ray_instances(seen) == 1, [c[:80] for c in seen.values() if "gcs_server" in c]
    assert not no_ray_left(seen)
