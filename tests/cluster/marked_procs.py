"""Processes of a test's own Ray cluster, found by a marker in their environment (so a test stops
exactly what it started, never the suite's shared Ray instance), and the ports and token file the
cluster tests check."""
from __future__ import annotations

import hashlib
import os
import signal
import socket
import time
from pathlib import Path


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"  # a zombie has already ended
    except OSError:
        return False


def marked_pids(mark: str, marker: str) -> list[int]:
    """Pids of the live processes whose environment has ``mark=marker``."""
    needle = f"{mark}={marker}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                if needle in fh.read().split(b"\0") and alive(int(entry)):
                    pids.append(int(entry))
        except OSError:  # gone, or not ours
            continue
    return pids


def teardown(mark: str, marker: str, grace_s: float = 4.0) -> None:
    """SIGTERM every marked process, SIGKILL what is left after ``grace_s``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = marked_pids(mark, marker)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 5.0)
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if alive(p)]
            time.sleep(0.2)
        if not pids:
            return


def token_file_state():
    """A hash of ~/.ray/auth_token (None without one): the tests check they leave it as it was."""
    path = Path.home() / ".ray" / "auth_token"
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
