"""Chaos run: one federation killed over and over, recovered with no human, metrics compared.

    .venv/bin/python benchmarks/chaos.py                    # the quickstart's FedAvg, 20 rounds, 2 hosts
    .venv/bin/python benchmarks/chaos.py --out runs/chaos   # keep the run folders there
    .venv/bin/python benchmarks/chaos.py --supervisor       # cluster/supervise.sh reruns the driver

It runs ``raysim run CONFIG ... --out DIR`` twice: undisturbed, then under a kill schedule, by
``kill -9`` of the processes themselves, at the first time the run reports a round done:

* a ClientHost three times (the round loop replaces the pool and replays from the last checkpoint),
* the Server once (replaced the same way),
* the driver once (``raysim run`` itself): the script then runs the *same command* again, as a
  supervisor would (Slurm ``--requeue``, a Kubernetes Job's retries, systemd, a shell loop), and the
  run continues from its last checkpoint.

Checkpoints come from the time rule (``checkpoint.minutes``, here a few seconds). The ClientHost and
Server processes are found among the driver's descendants by their Ray process titles
(``ray::ClientHost...``, ``ray::Server...``), so nothing outside this run is touched. At the end
it prints the kill log and whether the two ``metrics.parquet`` are equal (``DataFrame.equals``);
exit 0 only if they are, with every kill done and no manual step.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from benchmarks.procmem import tree_pids  # noqa: E402

ROUND = re.compile(r"\bround (\d+)/(\d+)\b")
DRIVER = re.compile(r"(-m raysim|/raysim) run\b")

# (after round, what): at the first report of that round, kill it ~0.3 s later (mid next round)
SCHEDULE = ((3, "host"), (6, "server"), (9, "host"), (12, "driver"), (15, "host"))


@dataclass
class Kill:
    after_round: int
    what: str
    pid: int | None = None
    at_s: float = 0.0
    outcome: str = ""


@dataclass
class ChaosResult:
    kills: list[Kill]
    returncode: int
    drivers: int  # driver processes it took (1 + the restarts)
    seconds: float
    stderr: list[str] = field(default_factory=list)
    leftover: list[str] = field(default_factory=list)  # the last driver's descendants alive 10 s after it exited


def tree(root: int) -> list[tuple[int, str]]:
    """(pid, command line) of ``root``'s descendants (Linux /proc)."""
    out = []
    for pid in tree_pids(root)[1:]:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue  # ended meanwhile
        out.append((pid, cmd))
    return out


def actor_pids(driver: int, title: str) -> list[int]:
    return sorted(pid for pid, cmd in tree(driver) if cmd.startswith(f"ray::{title}"))


def driver_pids(root: int) -> list[int]:
    """The ``raysim run`` processes ``root`` (a supervisor) started: its children only (a child the
    driver forks carries the driver's command line until it execs), and not the shell itself."""
    return sorted(pid for pid, cmd in tree(root) if _parent(pid) == root and DRIVER.search(cmd)
                  and not cmd.startswith(("bash", "/bin/")))


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
        return int(stat[stat.rfind(b")") + 2:].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def run_under_chaos(command: list[str], schedule=SCHEDULE, delay_s: float = 0.3, env=None, echo=None,
                    timeout_s: float = 1800, supervised: bool = False) -> ChaosResult:
    """Run ``command`` (a ``raysim run ... --out DIR`` without --quiet: its progress lines say
    which round is done) and kill per ``schedule``; after the driver is killed, run the same
    command again. ``supervised``: ``command`` is a supervisor (``cluster/supervise.sh raysim run
    ...``) that reruns the driver itself; the driver killed is the ``raysim run`` below it.
    Returns the kill log, the last exit status and the stderr lines."""
    kills = [Kill(r, what) for r, what in schedule]
    pending = list(kills)
    t0 = time.monotonic()
    drivers, lines = 0, []
    drivers_seen: set[int] = set()
    env = {**(env or os.environ), "PYTHONUNBUFFERED": "1"}
    while True:
        drivers += 1
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                                cwd=ROOT, start_new_session=True)
        driver_killed, exited = threading.Event(), threading.Event()
        done_rounds: set[int] = set()
        seen: dict[int, str] = {}

        def watch(proc=proc, exited=exited, seen=seen):  # every process the driver started
            while not exited.wait(0.5):
                seen.update(tree(proc.pid))
                if supervised:
                    drivers_seen.update(driver_pids(proc.pid))

        threading.Thread(target=watch, daemon=True).start()

        def fire(kill: Kill, proc=proc, driver_killed=driver_killed, seen=seen):
            time.sleep(delay_s)
            if kill.what == "driver":
                victims = driver_pids(proc.pid) if supervised else [proc.pid]
            else:
                victims = actor_pids(proc.pid, "ClientHost" if kill.what == "host" else "Server")
                victims = victims[-1:]  # one process: the last host (or the server)
            if not victims:
                kill.outcome = "nothing to kill"
                return
            kill.pid, kill.at_s = victims[0], time.monotonic() - t0
            if kill.what == "driver":
                driver_killed.set()
                drivers_seen.add(victims[0])
            try:
                os.kill(victims[0], signal.SIGKILL)
            except ProcessLookupError:
                kill.outcome = "already gone"
            if kill.what == "driver" and supervised:
                # what outlives a killed driver is not the last driver's to clean up: watch anew
                # (its orphans leave the supervisor's tree once it is gone)
                while _running(victims[0]):
                    time.sleep(0.05)
                seen.clear()

        for line in proc.stderr:
            line = line.rstrip("\n")
            lines.append(line)
            if echo:
                echo(line)
            m = ROUND.search(line)
            if m and int(m.group(1)) not in done_rounds:
                rnd = int(m.group(1))
                done_rounds.add(rnd)
                for kill in [k for k in pending if k.after_round <= rnd]:
                    pending.remove(kill)
                    threading.Thread(target=fire, args=(kill,), daemon=True).start()
                    if kill.what == "driver" and not supervised:  # nothing after it in this driver's life
                        break
            if supervised and "running it again" in line:
                kill = next((k for k in kills if k.what == "driver" and k.pid and not k.outcome), None)
                if kill is not None:
                    kill.outcome = "the supervisor ran the same command again: " + line.split(": ", 1)[-1]
            if "lost in round" in line:
                for kill in kills:
                    if kill.pid and not kill.outcome:
                        kill.outcome = "recovered: " + line.split("warning: ", 1)[-1]
                        break
            if time.monotonic() - t0 > timeout_s:
                proc.kill()
        rc = proc.wait()
        exited.set()
        if supervised:
            drivers = len(drivers_seen)
        elif driver_killed.is_set() and rc == -signal.SIGKILL:
            kill = next(k for k in kills if k.what == "driver")
            kill.outcome = f"driver exited {rc}; the same command started again"
            continue
        seconds = time.monotonic() - t0
        deadline = time.monotonic() + 10
        while (left := [f"{pid} {cmd[:60]}" for pid, cmd in seen.items() if _running(pid)]) and \
                time.monotonic() < deadline:
            time.sleep(0.5)
        return ChaosResult(kills, rc, drivers, seconds, lines, left)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
        return stat[stat.rfind(b")") + 2:].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def same_metrics(a: str, b: str) -> bool:
    import pyarrow.parquet as pq
    return pq.read_table(os.path.join(a, "metrics.parquet")).to_pandas().equals(
        pq.read_table(os.path.join(b, "metrics.parquet")).to_pandas())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "quickstart.yaml"))
    p.add_argument("overrides", nargs="*", default=["methods=[fedavg]", "rounds=20", "runtime.num_hosts=2",
                                                     "checkpoint.minutes=0.05"],
                   help="key=value overrides (default: the quickstart's FedAvg, 20 rounds, 2 hosts, "
                        "checkpoints every 3 s by the time rule)")
    p.add_argument("--out", help="folder for the two runs (default: a temporary one, removed)")
    p.add_argument("--verbose", action="store_true", help="echo the runs' progress")
    p.add_argument("--supervisor", action="store_true",
                   help="run the driver under cluster/supervise.sh, which reruns it after the kill (else this script does)")
    ns = p.parse_args(argv)
    base = ns.out or tempfile.mkdtemp(prefix="raysim-chaos-")
    quiet, chaos = os.path.join(base, "undisturbed"), os.path.join(base, "chaos")
    for d in (quiet, chaos):
        shutil.rmtree(d, ignore_errors=True)
    cmd = [sys.executable, "-m", "raysim", "run", ns.config, *ns.overrides]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    echo = (lambda line: print("   |", line)) if ns.verbose else None
    print("command:", " ".join(cmd[1:]), "--out DIR")
    t0 = time.monotonic()
    undisturbed = subprocess.run([*cmd, "--out", quiet, "--quiet"], env=env, cwd=ROOT, capture_output=True, text=True)
    print(f"undisturbed run: exit {undisturbed.returncode} in {time.monotonic() - t0:.0f} s")
    if undisturbed.returncode != 0:
        print(undisturbed.stderr[-3000:])
        return 1
    if ns.supervisor:
        env["RAYSIM_RETRY_DELAY"] = env.get("RAYSIM_RETRY_DELAY", "1")
        result = run_under_chaos(["bash", str(ROOT / "cluster" / "supervise.sh"), *cmd, "--out", chaos], env=env,
                                 echo=echo, supervised=True)
    else:
        result = run_under_chaos([*cmd, "--out", chaos], env=env, echo=echo)
    print(f"chaos run: {result.drivers} driver processes, last exit {result.returncode}, {result.seconds:.0f} s")
    print("kill log:")
    for k in result.kills:
        print(f"  {k.at_s:6.1f} s  after round {k.after_round:2d}  kill -9 {k.what:6s} pid {k.pid}: {k.outcome}")
    warnings = [ln for ln in result.stderr if ln.startswith("raysim")]
    print("raysim's own lines:")
    for ln in warnings:
        print("  " + ln)
    print(f"processes of the last driver alive 10 s after it exited: {result.leftover or 'none'}")
    equal = result.returncode == 0 and same_metrics(quiet, chaos)
    print(f"metrics.parquet equal to the undisturbed run's (DataFrame.equals): {equal}")
    if not ns.out:
        shutil.rmtree(base, ignore_errors=True)
    ok = equal and all(k.pid for k in result.kills) and not result.leftover
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
