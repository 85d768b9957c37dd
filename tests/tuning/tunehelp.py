"""Helpers of the tuning tests: run a command in its own process group, kill it the hard way, and
clean up every process it started (each by its id)."""
import os
import signal
import subprocess
import sys
import time


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (from /proc), children first found first."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a command started with start_new_session=True, its group, and every process it
    started (Ray's workers leave the group), each by its id."""
    pids = descendants(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)


def raysim_cmd(*args) -> list[str]:
    return [sys.executable, "-m", "raysim", *args]


def wait_for(predicate, timeout: float, proc=None, what="condition"):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process ended (code {proc.returncode}) before {what}")
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


RAY_START_TIMEOUT = "timed out during startup"  # Ray's fixed 30 s wait for its raylet


def run_retrying_ray_start(cmd, attempts: int = 3, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run, again when Ray itself failed to start (an overloaded machine: Ray waits a
    fixed 30 s for its raylet); any other failure is returned as is."""
    for i in range(attempts):
        r = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
        if r.returncode == 0 or RAY_START_TIMEOUT not in r.stderr or i == attempts - 1:
            return r
    return r
