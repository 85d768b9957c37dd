"""Chaos run: one federation killed, stopped, cut off and starved of disk, recovered with no human
(or stopped in one line), its metrics compared with an undisturbed run's.

    .venv/bin/python benchmarks/chaos.py                    # the kill schedule: quickstart's FedAvg, 20 rounds, 2 hosts
    .venv/bin/python benchmarks/chaos.py --out runs/chaos   # keep the run folders there
    .venv/bin/python benchmarks/chaos.py --supervisor       # cluster/supervise.sh reruns the driver
    .venv/bin/python benchmarks/chaos.py --list             # the named scenarios, one a line
    .venv/bin/python benchmarks/chaos.py --scenario host-hang --scenario raylet-loss   # some of them
    .venv/bin/python benchmarks/chaos.py --scenario all --out runs/chaos39             # every one, in turn

**The kill schedule** (no ``--scenario``) runs ``raysim run CONFIG ... --out DIR`` twice:
undisturbed, then under a kill schedule, by ``kill -9`` of the processes themselves, at the first
time the run reports a round done:

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

**Named scenarios** (``--scenario NAME``, repeatable, or ``all``; ``--list`` names them): each is
one fault injected into a run of the same small config (default: the quickstart's FedAvg, 12
rounds, 2 hosts, a checkpoint every 3 s by the time rule), compared with one undisturbed run of
that config, one scenario at a time. A scenario runs the command, injects its fault (a signal to
the driver, a ClientHost, the Server, the local raylet or GCS; a full, unwritable or read-only run
folder; the loss of a node of a local three-node Ray cluster), and then does what a scheduler or
``cluster/supervise.sh`` would (run the same command again), or, for the disk, what a person would
(free the space, give the permission back, remount read-write) before running it again. For each it
reports what was done, raysim's own lines, the exit codes, the processes the runs started that
are alive 10 s after the last exit, and whether ``metrics.parquet`` equals the undisturbed run's;
then one table of all of them. The hang scenarios set ``runtime.stall_timeout_s`` (``--stall-timeout``,
10 s) so that a stopped actor is found in seconds, not the default minute. The disk scenarios mount
a small tmpfs for the run folder and the permission one runs the driver without CAP_DAC_OVERRIDE
(``setpriv``), so they need root; without it they are skipped, saying why. Exit 0 only if every
scenario run met its expectation (see ``--list``).
"""
from __future__ import annotations

import argparse
import contextlib
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


# ---------------------------------------------------------------------------------------------
# Named scenarios: one fault each, against one undisturbed run of the same config
# ---------------------------------------------------------------------------------------------

SCENARIO_OVERRIDES = ["methods=[fedavg]", "rounds=12", "runtime.num_hosts=2", "checkpoint.minutes=0.05"]
STALL_TIMEOUT_S = 10.0  # runtime.stall_timeout_s of the hang scenarios: a stopped actor found in seconds
DISK_MB = 16  # the tmpfs of the disk scenarios: a run folder of this config takes ~1 MB
PG_TIMEOUT_S = 20.0  # runtime.pg_timeout_s of node-loss-no-spare: how long a driver waits for room for the hosts
NEW_NODE_AFTER_S = 20.0  # ... and when the new node joins, after the first exit 75
ATTEMPT_TIMEOUT_S = 900.0  # one run of the command; past it the script kills it and calls it a hang
LEFTOVER_WAIT_S = 10.0
RAYSIM_LINE = re.compile(r"^raysim\b")
ROUTINE = ("holds a run of this config", "taking over")  # a rerun's usual lines, left out of the table
SUPERVISOR_STATUS = re.compile(r"^raysim supervise: .*status (\d+)")


@dataclass
class Attempt:
    """One run of the scenario's command: what was done during it, how it ended, what it printed."""
    label: str
    rc: int | None = None
    seconds: float = 0.0
    lines: list[str] = field(default_factory=list)
    injected: str = ""  # what the script did to it, if anything
    timed_out: bool = False
    notes: list[str] = field(default_factory=list)

    def raysim_lines(self) -> list[str]:
        return [ln for ln in self.lines if RAYSIM_LINE.match(ln)]

    def other_lines(self) -> list[str]:
        """Lines that are neither raysim's nor progress: a traceback, Ray's own notices."""
        return [ln for ln in self.lines if ln.strip() and not RAYSIM_LINE.match(ln) and not ROUND.search(ln)]


@dataclass
class Outcome:
    name: str
    attempts: list[Attempt] = field(default_factory=list)
    equal: bool | None = None
    leftover: list[str] = field(default_factory=list)
    seconds: float = 0.0
    load: tuple[float, float] = (0.0, 0.0)  # 1-minute load average at the start and the end
    problems: list[str] = field(default_factory=list)  # where it went against the expectation
    skipped: str = ""

    @property
    def ok(self) -> bool:
        return not self.skipped and not self.problems

    def exit_codes(self) -> list[int]:
        """Every exit status in order: the supervisor's reports of its command's, then each attempt's."""
        codes = []
        for a in self.attempts:
            codes += [int(m.group(1)) for ln in a.lines if (m := SUPERVISOR_STATUS.match(ln))]
            codes.append(_status(a.rc))
        return codes


def _status(rc: int | None) -> int:
    """A shell's exit status: a process killed by signal N is 128 + N."""
    if rc is None:
        return -1
    return 128 - rc if rc < 0 else rc


class Run:
    """The live state of one attempt, which triggers and actions read."""

    def __init__(self, proc: subprocess.Popen, run_dir: str, supervised: bool):
        self.proc, self.run_dir, self.supervised = proc, run_dir, supervised
        self.lines: list[str] = []
        self.rounds: set[int] = set()
        self.exited = threading.Event()
        self.seen: dict[int, str] = {}
        self.notes: list[str] = []  # what the script did later, in the background
        self.t0 = time.monotonic()
        self.setup: Setup | None = None  # the scenario's (a local cluster's add_node)

    def driver(self) -> int | None:
        """The ``raysim run`` process: the command itself, or the one below the supervisor."""
        if not self.supervised:
            return self.proc.pid
        drivers = driver_pids(self.proc.pid)
        return drivers[-1] if drivers else None

    def processes(self) -> list[tuple[int, str]]:
        return tree(self.proc.pid)


# triggers: when(run) -> bool, polled until it holds or the command exits

def after_round(n: int):
    def when(run: Run) -> bool:
        return bool(run.rounds) and max(run.rounds) >= n
    when.poll_s, when.what = 0.05, f"after round {n} is reported"
    return when


def checkpoint_being_written(run: Run) -> bool:
    """A ``checkpoints/round-*.tmp`` folder exists beside a finished checkpoint: a checkpoint write
    is under way, and the rerun has an older one to fall back to."""
    try:
        names = [e.name for e in os.scandir(os.path.join(run.run_dir, "checkpoints"))]
    except OSError:
        return False
    return any(n.endswith(".tmp") for n in names) and any(not n.endswith(".tmp") for n in names)


checkpoint_being_written.poll_s = 0.002
checkpoint_being_written.what = "when a checkpoints/round-*.tmp folder appears beside a finished checkpoint"


def hosts_started(run: Run) -> bool:
    """Both ClientHost processes are up (start-up: data loading, before round 1 ends)."""
    return len([1 for _, cmd in run.processes() if cmd.startswith("ray::ClientHost")]) >= 2


hosts_started.poll_s, hosts_started.what = 0.2, "once both ClientHost processes are up, before round 1 ends"


# actions: do(run) -> what was done, one line

def _checkpoints(run_dir: str) -> str:
    try:
        names = sorted(e.name for e in os.scandir(os.path.join(run_dir, "checkpoints")))
    except OSError:
        names = []
    return ", ".join(names) or "none"


def signal_driver(sig: int, delay_s: float = 0.0):
    def do(run: Run) -> str:
        time.sleep(delay_s)
        pid = run.driver()
        if pid is None:
            return "no driver to signal"
        state = _checkpoints(run.run_dir)
        os.kill(pid, sig)
        return f"{signal.Signals(sig).name} to the driver pid {pid} (checkpoints on disk: {state})"
    return do


def signal_actor(title: str, sig: int, delay_s: float = 0.3):
    def do(run: Run) -> str:
        time.sleep(delay_s)
        pids = sorted(pid for pid, cmd in run.processes() if cmd.startswith(f"ray::{title}"))
        if not pids:
            return f"no ray::{title} process found"
        os.kill(pids[-1], sig)
        return f"{signal.Signals(sig).name} to ray::{title} pid {pids[-1]}"
    return do


def signal_ray_process(program: str, sig: int = signal.SIGKILL, delay_s: float = 0.3):
    """``program``: the executable's name, ``raylet`` or ``gcs_server``, among the driver's descendants."""
    def do(run: Run) -> str:
        time.sleep(delay_s)
        pids = [pid for pid, cmd in run.processes() if os.path.basename(cmd.split(" ", 1)[0]) == program]
        if not pids:
            return f"no {program} process found"
        os.kill(pids[0], sig)
        return f"{signal.Signals(sig).name} to the driver's {program} pid {pids[0]}"
    return do


def fill_disk(run: Run) -> str:
    filler = os.path.join(os.path.dirname(run.run_dir), "filler")
    written = 0
    with open(filler, "wb") as fh:
        try:
            while True:
                fh.write(b"\0" * 2**20)
                fh.flush()
                written += 1
        except OSError:
            pass
    return f"filled the {DISK_MB} MiB tmpfs of the run folder ({written} MiB of filler)"


def take_write_permission(run: Run) -> str:
    os.chmod(run.run_dir, 0o555)
    return "chmod 555 on the run folder (the driver runs without CAP_DAC_OVERRIDE)"


def remount_read_only(run: Run) -> str:
    mnt = os.path.dirname(run.run_dir)
    done = subprocess.run(["mount", "-o", "remount,ro", mnt], capture_output=True, text=True)
    return "mount -o remount,ro on the run folder's tmpfs" + (
        "" if done.returncode == 0 else f": FAILED ({done.stderr.strip()})")


def kill_node_of_hosts(run: Run) -> str:
    """kill -9 the raylet of the node the ClientHosts run on (found as the hosts' parent process:
    a Ray worker is its node's raylet's child)."""
    import json
    try:
        with open(os.path.join(run.run_dir, "hosts.json")) as fh:
            hosts = json.load(fh)["hosts"]
    except (OSError, ValueError, KeyError):
        return "no hosts.json to find the hosts' node by"
    raylets = {_parent(h["pid"]) for h in hosts if h.get("pid")}
    raylets.discard(None)
    if not raylets:
        return "the hosts' raylet was not found"
    victim = sorted(raylets)[0]
    try:
        with open(f"/proc/{victim}/cmdline", "rb") as fh:
            program = os.path.basename(fh.read().split(b"\0")[0].decode())
    except OSError:
        program = "?"
    os.kill(victim, signal.SIGKILL)
    return (f"kill -9 the raylet (pid {victim}, {program}) of the node holding {len(hosts)} host(s) "
            f"({len(raylets)} node(s) held them)")


def lose_node_then_add_one(run: Run) -> str:
    """kill -9 the node holding the hosts (the only one with CPUs); once the supervisor reports the
    first exit 75, wait ``NEW_NODE_AFTER_S`` and start a new node."""
    what = kill_node_of_hosts(run)
    run.setup.lost += 1

    def later():
        while not run.exited.is_set() and not any("(status 75" in ln for ln in run.lines):
            time.sleep(0.2)
        if run.exited.wait(NEW_NODE_AFTER_S):
            return
        run.setup.add_node()
        run.setup.added += 1
        run.notes.append(f"a new 2-CPU node joined the cluster at {time.monotonic() - run.t0:.0f} s, "
                         f"{NEW_NODE_AFTER_S:.0f} s after the first exit 75")

    threading.Thread(target=later, daemon=True).start()
    return what + f"; a new node joins {NEW_NODE_AFTER_S:.0f} s after the first exit 75"


def attempt(command: list[str], env: dict, run_dir: str, label: str, when=None, do=None, supervised=False,
            seen: dict | None = None, echo=None, timeout_s: float = ATTEMPT_TIMEOUT_S, setup=None) -> Attempt:
    """Run ``command`` once (its stderr read line by line), ``do(run)`` once ``when(run)`` holds."""
    out = Attempt(label)
    t0 = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                            start_new_session=True)
    run = Run(proc, run_dir, supervised)
    run.setup = setup
    if seen is not None:
        run.seen = seen

    def read():
        for line in proc.stderr:
            line = line.rstrip("\n")
            run.lines.append(line)
            if echo:
                echo(line)
            if (m := ROUND.search(line)) and not RAYSIM_LINE.match(line):
                run.rounds.add(int(m.group(1)))

    def watch():
        while not run.exited.wait(0.3):
            run.seen.update(run.processes())

    def trigger():
        while not run.exited.is_set():
            if when(run):
                out.injected = do(run)
                return
            time.sleep(when.poll_s)
        out.injected = f"nothing: the command ended before {when.what}"

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    threading.Thread(target=watch, daemon=True).start()
    if when is not None:
        threading.Thread(target=trigger, daemon=True).start()
    try:
        out.rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        out.timed_out = True
        run.seen.update(run.processes())
        _end(list(run.seen) + [proc.pid])
        out.rc = proc.wait()
    run.exited.set()
    reader.join(timeout=5)  # a Ray process that outlives the driver may hold the pipe: do not wait on it
    out.seconds = time.monotonic() - t0
    out.lines = list(run.lines)
    out.notes = list(run.notes)
    return out


def _end(pids) -> None:
    """SIGCONT (a stopped process cannot die otherwise) and SIGKILL: what a scenario left behind."""
    for sig in (signal.SIGCONT, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


@dataclass
class Setup:
    """Where and how a scenario runs its command."""
    run_dir: str
    prefix: list[str] = field(default_factory=list)  # before the command (setpriv ...)
    args: list[str] = field(default_factory=list)  # after it (--address ...)
    env: dict = field(default_factory=dict)
    fix: object = None  # what a person does before running the command again (the disk)
    fix_what: str = ""
    add_node: object = None  # a local cluster's: start one more worker node


@dataclass
class Scenario:
    name: str
    fault: str
    expect: str  # in words, for --list and the table
    when: object
    do: object
    supervised: bool = False  # under cluster/supervise.sh (else this script reruns the command, as a scheduler would)
    first_rc: int = 0  # the first attempt's exit status (the supervisor's, when supervised) as expected
    driver_rc: int | None = None  # the driver's own status at the fault, which it ends with one raysim line
    line_has: str = ""  # ... which contains this
    recovered_has: str = ""  # a line any attempt prints when the fault is recovered as the scenario expects
    extra: tuple = ()  # overrides the scenario adds to the config
    setup: object = None  # contextmanager(base_dir, ctx) -> Setup; default: a plain folder
    needs: str = ""  # "root": mounts and capabilities


@contextlib.contextmanager
def plain_folder(folder: str, ctx):
    yield Setup(folder)


@contextlib.contextmanager
def small_tmpfs(folder: str, ctx, how: str = "full"):
    """The run folder on a ``DISK_MB`` tmpfs; ``how``: the fault's fix once the run stopped."""
    mnt = folder + "-disk"
    os.makedirs(mnt, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_MB}m", "tmpfs", mnt], capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise Skip(f"cannot mount a tmpfs ({done.stderr.strip() or 'mount failed'}): needs root")
    run_dir = os.path.join(mnt, "run")
    fixes = {
        "full": (lambda: os.unlink(os.path.join(mnt, "filler")), "deleted the filler"),
        "permission": (lambda: os.chmod(run_dir, 0o755), "chmod 755 on the run folder"),
        "readonly": (lambda: subprocess.run(["mount", "-o", "remount,rw", mnt], check=True),
                     "mount -o remount,rw"),
    }
    fix, what = fixes[how]
    prefix = []
    if how == "permission":  # root writes anywhere: take the capability that lets it
        if shutil.which("setpriv") is None:
            raise Skip("setpriv (util-linux) is missing: root would write through the permission bits")
        prefix = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--"]
    try:
        yield Setup(run_dir, prefix=prefix, fix=fix, fix_what=what)
    finally:
        if ctx.keep:  # the folder is asked for: copy it out before the tmpfs goes
            shutil.copytree(run_dir, folder, dirs_exist_ok=True, ignore_dangling_symlinks=True)
        subprocess.run(["mount", "-o", "remount,rw", mnt], capture_output=True)
        subprocess.run(["umount", "-l", mnt], capture_output=True)


def disk(how: str):
    return lambda folder, ctx: small_tmpfs(folder, ctx, how)


CLUSTER_MARK = "RAYSIM_CHAOS_CLUSTER"


@contextlib.contextmanager
def local_cluster(folder: str, ctx, workers: int):
    """A local Ray cluster on this machine: a head with no CPUs (GCS; only 0-CPU actors land there)
    and ``workers`` nodes of 2 CPUs each; the hosts (2 x 1 CPU) fit on any one of them. Private
    --temp-dir, token authentication from the environment; its processes carry a marker in their
    environment and are ended by pid at the end (never ``ray stop``, which would end every Ray
    instance on the machine). ``Setup.add_node()`` starts one more worker node (an autoscaler's part)."""
    import secrets
    import socket

    temp = tempfile.mkdtemp(prefix="rschaos-", dir="/tmp")  # short: Ray's socket paths live under it
    marker = os.path.basename(temp)
    env = {k: v for k, v in ctx.env.items() if not k.startswith("RAY_")}
    env.update({CLUSTER_MARK: marker, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
                "RAY_DEDUP_LOGS": "0", "RAY_USAGE_STATS_ENABLED": "0"})

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    ray = str(Path(sys.executable).with_name("ray"))
    common = ["--node-ip-address=127.0.0.1", "--num-gpus=0", "--disable-usage-stats", f"--temp-dir={temp}",
              "--include-log-monitor=false", "--object-store-memory=200000000"]
    port = free_port()

    def start(cmd: list[str]) -> None:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180, start_new_session=True)
        if done.returncode != 0:
            raise Skip(f"`ray start` failed: {(done.stderr or done.stdout).strip()[-300:]}")

    def add_node() -> None:
        start([ray, "start", f"--address=127.0.0.1:{port}", "--num-cpus=2",
               f"--dashboard-agent-listen-port={free_port()}", *common])

    try:
        start([ray, "start", "--head", f"--port={port}", "--num-cpus=0", "--include-dashboard=false",
               f"--dashboard-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}", *common])
        for _ in range(workers):
            add_node()
        setup = Setup(folder, args=["--address", f"127.0.0.1:{port}"], env=env)
        setup.add_node = add_node
        setup.lost = setup.added = 0  # nodes lost by the scenario, added back by it

        def replace_lost_node() -> None:  # a person's part, where nothing added one back
            if setup.lost > setup.added:
                add_node()
                setup.added += 1

        setup.fix, setup.fix_what = replace_lost_node, "a new node started by hand where none had joined"
        yield setup
    finally:
        for _ in range(2):
            _end(_marked(marker))
            time.sleep(1)
        shutil.rmtree(temp, ignore_errors=True)


def nodes(workers: int):
    return lambda folder, ctx: local_cluster(folder, ctx, workers)


def _marked(marker: str) -> list[int]:
    needle = f"{CLUSTER_MARK}={marker}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/environ", "rb") as fh:
                    if needle in fh.read().split(b"\0") and _running(int(entry)):
                        pids.append(int(entry))
            except OSError:
                continue
    return pids


class Skip(Exception):
    """The scenario cannot run on this machine (why)."""


KILL, STOP, TERM = signal.SIGKILL, signal.SIGSTOP, signal.SIGTERM
EQUAL = "metrics equal"
SCENARIOS = [
    Scenario("driver-before-checkpoint", "the driver killed before any checkpoint exists",
             EQUAL + " (the script runs the same command again: the run starts over)",
             hosts_started, signal_driver(KILL, delay_s=1.0), first_rc=-KILL,
             recovered_has="which is gone"),  # the dead driver's lock taken over; nothing to continue from
    Scenario("driver-during-checkpoint", "the driver killed while it writes a checkpoint",
             EQUAL + " (the script runs the same command again: the half-written checkpoint is ignored)",
             checkpoint_being_written, signal_driver(KILL), first_rc=-KILL, recovered_has="continuing it"),
    Scenario("driver-mid-round", "the driver killed mid-round",
             EQUAL + " (the script runs the same command again, from the last checkpoint)",
             after_round(5), signal_driver(KILL, delay_s=0.3), first_rc=-KILL, recovered_has="continuing it"),
    Scenario("driver-supervised", "the driver killed mid-round, under cluster/supervise.sh",
             EQUAL + " (the supervisor sees 137 and runs the same command again)",
             after_round(5), signal_driver(KILL, delay_s=0.3), supervised=True,
             recovered_has="exited with status 137"),
    Scenario("host-kill", "a ClientHost killed", EQUAL + " (replaced, replayed; one warning line)",
             after_round(3), signal_actor("ClientHost", KILL), recovered_has=" lost in round"),
    Scenario("server-kill", "the Server killed", EQUAL + " (replaced, replayed; one warning line)",
             after_round(3), signal_actor("Server", KILL), recovered_has=" lost in round"),
    Scenario("host-hang", "a ClientHost stopped (SIGSTOP: a wedged kernel, an NFS stall)",
             EQUAL + " (found past runtime.stall_timeout_s, killed, replaced, replayed)",
             after_round(3), signal_actor("ClientHost", STOP), recovered_has=" lost in round",
             extra=("runtime.stall_timeout_s={stall}",)),
    Scenario("server-hang", "the Server stopped (SIGSTOP)",
             EQUAL + " (found past runtime.stall_timeout_s, killed, replaced, replayed)",
             after_round(3), signal_actor("Server", STOP), recovered_has=" lost in round",
             extra=("runtime.stall_timeout_s={stall}",)),
    Scenario("raylet-loss", "the local raylet killed, under cluster/supervise.sh",
             "one line, exit 75; the supervisor runs the same command again: " + EQUAL,
             after_round(4), signal_ray_process("raylet"), supervised=True, driver_rc=75,
             recovered_has="asked to be run again later (status 75"),
    Scenario("gcs-loss", "the local GCS (gcs_server) killed, under cluster/supervise.sh",
             "one line, exit 75; the supervisor runs the same command again: " + EQUAL,
             after_round(4), signal_ray_process("gcs_server"), supervised=True, driver_rc=75,
             recovered_has="asked to be run again later (status 75"),
    Scenario("sigterm", "SIGTERM to the driver, under cluster/supervise.sh",
             "one line with the resume command, exit 143, the supervisor stops; the same command again: " + EQUAL,
             after_round(4), signal_driver(TERM, delay_s=0.3), supervised=True, first_rc=143, driver_rc=143,
             line_has="resume with"),
    Scenario("disk-full", "the run folder's file system full",
             "one line, exit 1; after the space is freed the same command: " + EQUAL,
             after_round(4), fill_disk, first_rc=1, driver_rc=1, line_has="resume with",
             setup=disk("full"), needs="root"),
    Scenario("disk-permission", "the run folder made unwritable",
             "one line, exit 1; after the permission is given back the same command: " + EQUAL,
             after_round(4), take_write_permission, first_rc=1, driver_rc=1, line_has="resume with",
             setup=disk("permission"), needs="root"),
    Scenario("disk-readonly", "the run folder's file system remounted read-only",
             "one line, exit 1; after a read-write remount the same command: " + EQUAL,
             after_round(4), remount_read_only, first_rc=1, driver_rc=1, line_has="resume with",
             setup=disk("readonly"), needs="root"),
    Scenario("node-loss", "the node holding the hosts lost (a local 3-node Ray cluster, spare capacity)",
             EQUAL + " (the hosts replaced on the other node)",
             after_round(3), kill_node_of_hosts, recovered_has=" lost in round", setup=nodes(2)),
    Scenario("node-loss-no-spare", "the only node with CPUs lost, under cluster/supervise.sh; a new node joins "
             f"{NEW_NODE_AFTER_S:.0f} s after the first exit 75 (what an autoscaler or a person does)",
             "exit 75 (one line) while no node can hold the hosts, retried by the supervisor; once the new node "
             "is up the same command continues: " + EQUAL,
             after_round(3), lose_node_then_add_one, supervised=True, driver_rc=75,
             recovered_has="asked to be run again later (status 75", setup=nodes(1),
             extra=("runtime.pg_timeout_s={pg}",)),
]
BY_NAME = {s.name: s for s in SCENARIOS}


@dataclass
class Context:
    command: list[str]  # python -m raysim run CONFIG overrides
    env: dict
    base: str
    reference: str  # the undisturbed run's folder
    keep: bool = False
    stall_s: float = STALL_TIMEOUT_S
    echo: object = None


def run_scenario(sc: Scenario, ctx: Context) -> Outcome:
    """Inject ``sc``'s fault into a run, run the same command again as long as the expectation says
    (the scheduler's or the supervisor's part, and after a person's fix for the disk), and compare."""
    out = Outcome(sc.name, load=(os.getloadavg()[0], 0.0))
    folder = os.path.join(ctx.base, sc.name)
    shutil.rmtree(folder, ignore_errors=True)
    t0 = time.monotonic()
    seen: dict[int, str] = {}
    try:
        with (sc.setup or plain_folder)(folder, ctx) as setup:
            extra = [x.format(stall=f"{ctx.stall_s:g}", pg=f"{PG_TIMEOUT_S:g}") for x in sc.extra]
            command = [*setup.prefix, *ctx.command, *extra, *setup.args, "--out", setup.run_dir]
            if sc.supervised:
                command = ["bash", str(ROOT / "cluster" / "supervise.sh"), *command]
            env = {**ctx.env, **setup.env}
            first = attempt(command, env, setup.run_dir, "with the fault", sc.when, sc.do, sc.supervised, seen,
                            ctx.echo, setup=setup)
            out.attempts.append(first)
            _judge_first(sc, first, out)
            if first.rc != 0 and not first.timed_out:
                if setup.fix is not None:
                    setup.fix()
                again = attempt(command, env, setup.run_dir, "the same command again" +
                                (f", after: {setup.fix_what}" if setup.fix_what else ""),
                                supervised=sc.supervised, seen=seen, echo=ctx.echo)
                out.attempts.append(again)
                if again.rc != 0:
                    out.problems.append(f"the same command again exited {_status(again.rc)}")
            out.seconds = time.monotonic() - t0
            deadline = time.monotonic() + LEFTOVER_WAIT_S
            while (left := [pid for pid in seen if _running(pid)]) and time.monotonic() < deadline:
                time.sleep(0.5)
            out.leftover = [f"{pid} {seen[pid][:70]}" for pid in left]
            if left:
                out.problems.append(f"{len(left)} process(es) alive {LEFTOVER_WAIT_S:.0f} s after the last exit")
                _end(left)  # the next scenario starts clean
            if out.attempts[-1].rc == 0:
                out.equal = same_metrics(ctx.reference, setup.run_dir)
                if not out.equal:
                    out.problems.append("metrics.parquet differs from the undisturbed run's")
        check_recovered(sc, out)
    except Skip as why:
        out.skipped = str(why)
    out.load = (out.load[0], os.getloadavg()[0])
    if not out.seconds:
        out.seconds = time.monotonic() - t0
    return out


def _judge_first(sc: Scenario, first: Attempt, out: Outcome) -> None:
    if first.timed_out:
        out.problems.append(f"the run hung: killed by the script after {ATTEMPT_TIMEOUT_S:.0f} s")
        return
    if first.injected.startswith(("nothing", "no ")) or "FAILED" in first.injected:
        out.problems.append(f"fault not injected: {first.injected}")
    if first.rc != sc.first_rc:
        out.problems.append(f"the run with the fault exited {_status(first.rc)}, expected {_status(sc.first_rc)}")
    if sc.driver_rc is not None:
        said = driver_status(first)
        if said != _status(sc.driver_rc):
            out.problems.append(f"the driver exited {said} at the fault, expected {_status(sc.driver_rc)}")
        lines = driver_lines(first)
        last = lines[-1] if lines else ""
        if not RAYSIM_LINE.match(last):
            out.problems.append("the driver did not end with a raysim line")
        elif sc.line_has and sc.line_has not in last:
            out.problems.append(f"its last line lacks {sc.line_has!r}")
        others = [ln for ln in lines if ln.strip() and not RAYSIM_LINE.match(ln) and not ROUND.search(ln)]
        if others:
            out.problems.append(f"{len(others)} line(s) besides raysim's: {others[0][:100]}")


def driver_lines(first: Attempt) -> list[str]:
    """The first driver's lines: up to the supervisor's first note (it notes each exit it reruns)."""
    cut = next((i for i, ln in enumerate(first.lines) if ln.startswith("raysim supervise:")), len(first.lines))
    return first.lines[:cut]


def driver_status(first: Attempt) -> int:
    """The first driver's exit status: as the supervisor reports it, else the command's own."""
    codes = [int(m.group(1)) for ln in first.lines if (m := SUPERVISOR_STATUS.match(ln))]
    return codes[0] if codes else _status(first.rc)


def check_recovered(sc: Scenario, out: Outcome) -> None:
    if sc.recovered_has and not out.skipped and not any(
            sc.recovered_has in ln for a in out.attempts for ln in a.lines):
        out.problems.append(f"no line says {sc.recovered_has!r}")


def describe(out: Outcome) -> str:
    sc = BY_NAME[out.name]
    text = [f"== {out.name}: {sc.fault}", f"   expected: {sc.expect}"]
    if out.skipped:
        return "\n".join(text + [f"   SKIPPED: {out.skipped}"])
    for a in out.attempts:
        text.append(f"   {a.label}: exit {_status(a.rc)} after {a.seconds:.0f} s" +
                    (" (killed by the script: it hung)" if a.timed_out else ""))
        if a.injected:
            text.append(f"     injected {sc.when.what}: {a.injected}")
        for note in a.notes:
            text.append(f"     then: {note}")
        for ln in a.raysim_lines():
            text.append(f"     | {ln}")
        others = a.other_lines()
        if others:
            text.append(f"     {len(others)} other line(s), the first: {others[0][:160]}")
    text.append(f"   exit codes: {' -> '.join(map(str, out.exit_codes()))}; {out.seconds:.0f} s; load "
                f"{out.load[0]:.1f} -> {out.load[1]:.1f}")
    text.append(f"   processes alive {LEFTOVER_WAIT_S:.0f} s after the last exit: {out.leftover or 'none'}")
    text.append(f"   metrics.parquet equal to the undisturbed run's: {out.equal}")
    text.append("   " + ("OK" if out.ok else "FAILED: " + "; ".join(out.problems)))
    return "\n".join(text)


def table(outcomes: list[Outcome]) -> str:
    rows = ["| scenario | fault | injected | raysim printed | exit codes | result | s | left |",
            "|---|---|---|---|---|---|---|---|"]
    for out in outcomes:
        sc = BY_NAME[out.name]
        if out.skipped:
            rows.append(f"| {out.name} | {sc.fault} | | | | skipped: {out.skipped} | | |")
            continue
        said = [ln for ln in out.attempts[0].raysim_lines() if not any(w in ln for w in ROUTINE)]
        said = said or [ln for a in out.attempts[1:] for ln in a.raysim_lines()]
        codes = " → ".join(map(str, out.exit_codes()))
        result = (EQUAL if out.equal else "metrics differ") if out.equal is not None else "no metrics"
        if sc.driver_rc is not None:
            result = f"one line, exit {driver_status(out.attempts[0])}; then {result}"
        if not out.ok:
            result += " — **FAILED**: " + "; ".join(out.problems)
        rows.append(f"| {out.name} | {sc.fault} | {out.attempts[0].injected[:100]} | "
                    f"{' / '.join(s[:110] for s in said[:3])} | {codes} | {result} | {out.seconds:.0f} | "
                    f"{len(out.leftover)} |")
    return "\n".join(rows)


def run_scenarios(names: list[str], ns) -> int:
    base = ns.out or tempfile.mkdtemp(prefix="raysim-chaos-")
    overrides = ns.overrides or SCENARIO_OVERRIDES
    cmd = [sys.executable, "-m", "raysim", "run", ns.config, *overrides]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("RAYSIM_RETRY_DELAY", "1")
    print("command:", " ".join(cmd[1:]), "--out DIR")
    print(f"machine: {os.cpu_count()} CPUs; load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    if ns.reference:
        reference = os.path.abspath(ns.reference)
        print(f"undisturbed run: {reference}")
    else:
        reference = os.path.join(base, "undisturbed")
        shutil.rmtree(reference, ignore_errors=True)
        t0 = time.monotonic()
        undisturbed = subprocess.run([*cmd, "--out", reference, "--quiet"], env=env, cwd=ROOT, capture_output=True,
                                     text=True)
        print(f"undisturbed run: exit {undisturbed.returncode} in {time.monotonic() - t0:.0f} s", flush=True)
        if undisturbed.returncode != 0:
            print(undisturbed.stderr[-3000:])
            return 1
    ctx = Context(cmd, env, base, reference, keep=bool(ns.out), stall_s=ns.stall_timeout,
                  echo=(lambda line: print("   |", line, flush=True)) if ns.verbose else None)
    outcomes = []
    for name in names:
        out = run_scenario(BY_NAME[name], ctx)
        outcomes.append(out)
        print(describe(out), flush=True)
    print()
    print(table(outcomes))
    if not ns.out:
        shutil.rmtree(base, ignore_errors=True)
    return 0 if all(o.ok or o.skipped for o in outcomes) else 1


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "quickstart.yaml"))
    p.add_argument("overrides", nargs="*",
                   help="key=value overrides (default: the quickstart's FedAvg, 2 hosts, checkpoints every 3 s by "
                        "the time rule; 20 rounds for the kill schedule, 12 for the scenarios)")
    p.add_argument("--out", help="folder for the runs (default: a temporary one, removed)")
    p.add_argument("--verbose", action="store_true", help="echo the runs' progress")
    p.add_argument("--supervisor", action="store_true",
                   help="kill schedule: run the driver under cluster/supervise.sh, which reruns it after the kill "
                        "(else this script does)")
    p.add_argument("--scenario", action="append", metavar="NAME",
                   help="run this named scenario instead of the kill schedule (repeatable; 'all': every one, in "
                        "the order of --list)")
    p.add_argument("--list", action="store_true", help="list the named scenarios and exit")
    p.add_argument("--reference", metavar="DIR",
                   help="scenarios: a finished undisturbed run of the same config to compare with (else one is run)")
    p.add_argument("--stall-timeout", type=float, default=STALL_TIMEOUT_S, metavar="S",
                   help=f"runtime.stall_timeout_s of the hang scenarios (default {STALL_TIMEOUT_S:g})")
    ns = p.parse_args(argv)
    if ns.scenario:
        names = [n for arg in ns.scenario for n in arg.split(",") if n]
        names = list(BY_NAME) if "all" in names else names
        unknown = [n for n in names if n not in BY_NAME]
        if unknown:
            p.error(f"unknown scenario {unknown[0]!r}; --list names them")
        ns.scenario = list(dict.fromkeys(names))
    return ns


def list_scenarios() -> str:
    width = max(len(s.name) for s in SCENARIOS)
    return "\n".join(f"{s.name:{width}s}  {s.fault}; injected {s.when.what}; expected: {s.expect}"
                     + (" [needs root]" if s.needs else "") for s in SCENARIOS)


def main(argv=None) -> int:
    ns = parse_args(argv)
    if ns.list:
        print(list_scenarios())
        return 0
    if ns.scenario:
        return run_scenarios(ns.scenario, ns)
    return kill_schedule(ns)


def kill_schedule(ns) -> int:
    """The kill schedule of issue 32 (no --scenario): ``SCHEDULE`` in one run, against an undisturbed one."""
    ns.overrides = ns.overrides or ["methods=[fedavg]", "rounds=20", "runtime.num_hosts=2", "checkpoint.minutes=0.05"]
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
