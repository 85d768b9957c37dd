"""Round progress: a live bar on a terminal, one plain line per round otherwise (logs, CI)."""
from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, label: str = "", enabled: bool = True, stream=None, lines: bool = False):
        """``lines``: one line per round even on a terminal (federations running side by side)."""
        self.total, self.label, self.enabled = total, label, enabled
        self.stream = stream or sys.stderr
        self.tty = enabled and not lines and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.perf_counter()

    def update(self, rnd: int, train_loss: float, last_eval: dict) -> None:
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / rnd * (self.total - rnd)
        acc = last_eval.get("test", last_eval.get("val", {})).get("AVG")
        acc_text = f"  acc(AVG) {100 * acc:5.1f}%" if acc is not None else ""
        text = (f"{self.label} round {rnd}/{self.total}  loss {train_loss:.3f}{acc_text}"
                f"  elapsed {_fmt(elapsed)}  eta {_fmt(eta)}")
        if self.tty:
            width = 24
            done = int(width * rnd / self.total)
            self.stream.write(f"\r[{'#' * done}{'.' * (width - done)}] {text}\033[K")
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _fmt(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m}:{s:02d}"


class ProgressCallback:
    """Round-loop callback drawing a :class:`Progress` line for one federation."""

    def __init__(self, total: int, label: str, mode: bool | str = True):
        """``mode``: True (a live bar on a terminal), "lines" (one line per round: federations
        running side by side share the terminal) or False."""
        self.bar = Progress(total, label=label, enabled=bool(mode), lines=mode == "lines")
        self.last_eval: dict = {}

    def on_start(self, run) -> None:
        self.bar.t0 = time.perf_counter()  # rounds only: start-up is not in the ETA

    def on_round(self, rnd: int, summary: dict, evaluation, log) -> None:
        self.last_eval = evaluation or self.last_eval
        self.bar.update(rnd, summary["train_loss"], self.last_eval)

    def on_end(self, log) -> None:
        self.bar.close()
