"""Resident memory of a process and all its descendants (driver + raylet + GCS + Ray workers).

Uses psutil when it is installed, ``/proc`` otherwise (Linux). RSS counts shared pages (torch's
libraries, the object store's shared memory) once per process that maps them, so the sum is an
upper bound of the physical memory the tree uses; it is the same measure in every arm.
"""
from __future__ import annotations

import os
import threading
import time


def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        # the command name is in parentheses and may contain spaces: split after the last ')'
        fields = stat[stat.rfind(b")") + 2:].split()
        kids.setdefault(int(fields[1]), []).append(int(name))
    return kids


def tree_pids(root: int | None = None) -> list[int]:
    root = os.getpid() if root is None else root
    try:
        import psutil
        p = psutil.Process(root)
        return [root] + [c.pid for c in p.children(recursive=True)]
    except ImportError:
        pass
    except Exception:
        return []
    kids = _children_map()
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(kids.get(pid, []))
    return out


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm", "rb") as fh:
            return int(fh.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int) -> float:
    """user + system CPU time of one process so far."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return 0.0
    fields = stat[stat.rfind(b")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


class TreeCPU:
    """CPU seconds used by a process tree (the set of processes is rescanned on request only:
    walking /proc costs CPU in the measuring process, which belongs to the tree)."""

    def __init__(self, root: int | None = None):
        self.root = root
        self.pids = tree_pids(root)

    def rescan(self) -> None:
        self.pids = tree_pids(self.root)

    def __call__(self) -> float:
        return sum(cpu_seconds(p) for p in self.pids)


def tree_rss(root: int | None = None) -> int:
    """Sum of the RSS of ``root`` (default: this process) and every descendant, in bytes."""
    return sum(rss_bytes(p) for p in tree_pids(root))


class PeakSampler:
    """Samples ``tree_rss`` every ``interval`` seconds in a thread; ``peak`` is the largest sum."""

    def __init__(self, interval: float = 0.1, root: int | None = None, rescan: float = 1.0):
        self.interval, self.root, self.rescan = interval, root, rescan
        self._pids: list[int] = []
        self._scanned = -1e9
        self.peak = 0
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def sample(self, rescan: bool = False) -> int:
        now = time.perf_counter()
        if rescan or now - self._scanned > self.rescan:  # walking /proc is the costly part
            self._pids, self._scanned = tree_pids(self.root), now
        v = sum(rss_bytes(p) for p in self._pids)
        self.samples.append((now, v))
        self.peak = max(self.peak, v)
        return v

    def _loop(self):
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        return False
