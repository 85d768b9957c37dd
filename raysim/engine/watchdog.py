"""Deadlines on every remote wait: a run never waits silently on a process that stopped.

A plain ``ray.get`` waits forever on an actor whose process was stopped (SIGSTOP; what a wedged
GPU kernel, an NFS stall or a deadlock look like from outside) and on a driver whose own Ray node
is gone. The round loop waits through :meth:`Watchdog.wait` instead:

* every ``POLL_S`` it looks at the driver's side: a stop asked for (another federation of the
  comparison failed, Ctrl-C, SIGTERM: :class:`Stopped`) and a local Ray node that lost its raylet
  or GCS (:class:`NodeGone`, which the CLI ends with exit 75 for a supervisor to rerun);
* after the deadline (``runtime.stall_timeout_s``, else ``STALL_ROUNDS`` x the median of the last
  rounds' wall time, at least ``STALL_FLOOR_S``) it health-checks every actor of the federation
  through the actors' own health thread, which answers while the training thread is busy. An actor
  that does not answer within the deadline is :class:`Stalled` (the loop kills, replaces and
  replays it, as a lost one). If all answer, the wait goes on with one line saying so (never
  silent, ``--quiet`` or not); after ``PATIENCE`` deadlines without the call finishing, the
  federation is stalled as a whole (a deadlock or a kernel that never returns, while the process
  itself lives).
"""
from __future__ import annotations

import statistics
import time

STALL_FLOOR_S = 60.0  # the least deadline, also before any round's time is known
STARTING_FLOOR_S = 60.0  # the least deadline while actors start (a process, torch, the data), whatever the setting
STALL_ROUNDS = 10  # the deadline is this many times the median round ...
RECENT_ROUNDS = 5  # ... of the last few rounds
PATIENCE = 10  # deadlines a call may run, every actor answering, before the federation counts as stalled
POLL_S = 0.5


class Stopped(BaseException):
    """The driver ends this federation (another one of the comparison failed, Ctrl-C, SIGTERM):
    not a fault of its own. A BaseException, so no method's ``except Exception`` swallows it."""


class Stalled(Exception):
    """Actors of the federation missed the deadline; ``names`` are those that did not answer a
    health check (every actor: the federation made no progress although all answer)."""

    def __init__(self, names: list, reason: str):
        super().__init__(reason)
        self.names, self.reason = names, reason


class NodeGone(Exception):
    """This driver's own Ray node lost its raylet or GCS: nothing can run until the command runs again."""


class Watchdog:
    """The wait of one federation's driver on its actors (see the module's docstring)."""

    def __init__(self, stall_timeout_s: float | None = None, stop=None, warn=print, node_failure=None):
        """``stop``: a ``threading.Event`` the driver sets to end the federation; ``warn``: where the
        one-line notes go; ``node_failure()``: why the driver's Ray node is gone, or None."""
        self.fixed = stall_timeout_s
        self.stop, self.warn = stop, warn
        self.node_failure = node_failure or (lambda: None)
        self.rounds: list[float] = []

    def observe(self, seconds: float) -> None:
        """A completed round's wall time: the deadline follows the run's own pace."""
        self.rounds = (self.rounds + [seconds])[-RECENT_ROUNDS:]

    def deadline_s(self) -> float:
        if self.fixed is not None:
            return self.fixed
        if not self.rounds:
            return STALL_FLOOR_S
        return max(STALL_FLOOR_S, STALL_ROUNDS * statistics.median(self.rounds))

    def check(self) -> None:
        """The driver's side, between waits: a stop asked for, the local Ray node gone."""
        if self.stop is not None and self.stop.is_set():
            raise Stopped()
        gone = self.node_failure()
        if gone:
            raise NodeGone(gone)

    def wait(self, pending, actors: dict, what: str, starting: bool = False) -> None:
        """Return once ``pending(timeout)`` (the refs still running after waiting up to ``timeout``
        seconds) is empty. ``actors``: {name: handle} of the federation, health-checked at each
        deadline; ``what``: the wait, for the lines (``round 4``); ``starting``: actors are being
        started, and one that has not started yet cannot answer (``STARTING_FLOOR_S``)."""
        from raysim.engine.cluster import silent

        start = time.monotonic()
        deadline = max(self.deadline_s(), STARTING_FLOOR_S) if starting else self.deadline_s()
        next_check, checks = start + deadline, 0
        while True:
            self.check()
            if not pending(POLL_S):
                return
            if time.monotonic() < next_check:
                continue
            waited = time.monotonic() - start
            quiet = silent(actors, timeout=deadline)
            if quiet:
                raise Stalled(quiet, f"no answer to a health check for {deadline:.0f} s after {waited:.0f} s on "
                                     f"{what}: stopped, wedged or cut off")
            checks += 1
            if checks >= PATIENCE:
                raise Stalled(list(actors), f"{what} made no progress for {waited:.0f} s ({PATIENCE} x the "
                                            f"{deadline:.0f} s deadline) although every actor answers")
            self.warn(f"raysim: {what} has run {waited:.0f} s (deadline {deadline:.0f} s); every actor answers a "
                      f"health check, so it goes on (set runtime.stall_timeout_s to change the deadline)")
            next_check = time.monotonic() + deadline
