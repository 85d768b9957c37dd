"""Round progress. On a terminal: one live table for the whole run (rich), a row per federation
(method, held-out domain or seed, round/total, train loss, test AVG, elapsed, ETA) redrawn in
place, left on screen as the final table. Otherwise (logs, CI, pipes): one plain line per round.

    board = LiveBoard()                       # the driver's, when ``live_terminal()``
    with board:                               # federations in threads add and update rows
        ProgressCallback(rounds, label, board=board, method="fedbn", detail="seed 1")
"""
from __future__ import annotations

import sys
import threading
import time

from raysim.engine.loop import Callback
from raysim.engine.messages import RoundSummary


def live_terminal(stream=None) -> bool:
    """Whether progress goes to a terminal that can redraw in place (not a pipe, file, or TERM=dumb)."""
    from rich.console import Console

    stream = stream or sys.stderr
    if not (hasattr(stream, "isatty") and stream.isatty()):
        return False
    console = Console(file=stream)
    return console.is_terminal and not console.is_dumb_terminal


def _fmt(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m}:{s:02d}"


def _avg(last_eval: dict):
    return (last_eval or {}).get("test", (last_eval or {}).get("val", {})).get("AVG")


class _Timer:
    """Elapsed time and ETA from the mean time of the rounds run since the (re)start: a resumed
    federation's earlier rounds are not in it, nor is start-up."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.rounds = 0  # rounds completed since t0
        self.t_last = self.t0

    def restart(self) -> None:
        self.t0 = self.t_last = time.perf_counter()
        self.rounds = 0

    def tick(self) -> None:
        self.rounds += 1
        self.t_last = time.perf_counter()

    def elapsed(self, now: float | None = None) -> float:
        return (now or time.perf_counter()) - self.t0

    def eta(self, rnd: int, total: int, now: float | None = None) -> float | None:
        if not self.rounds:
            return None
        mean = (self.t_last - self.t0) / self.rounds
        since_last = (now or time.perf_counter()) - self.t_last
        return max(0.0, mean * (total - rnd) - since_last)


class Progress:
    """One plain line per round on ``stream`` (stderr by default)."""

    def __init__(self, total: int, label: str = "", enabled: bool = True, stream=None, lines: bool = True):
        self.total, self.label, self.enabled = total, label, enabled
        self.stream = stream or sys.stderr
        self.timer = _Timer()

    @property
    def t0(self) -> float:
        return self.timer.t0

    @t0.setter
    def t0(self, value: float) -> None:
        self.timer.restart()
        self.timer.t0 = self.timer.t_last = value

    def update(self, rnd: int, train_loss: float, last_eval: dict) -> None:
        self.timer.tick()
        if not self.enabled:
            return
        elapsed = self.timer.elapsed(self.timer.t_last)
        eta = self.timer.eta(rnd, self.total, self.timer.t_last)
        acc = _avg(last_eval)
        acc_text = f"  acc(AVG) {100 * acc:5.1f}%" if acc is not None else ""
        self.stream.write(f"{self.label} round {rnd}/{self.total}  loss {train_loss:.3f}{acc_text}"
                          f"  elapsed {_fmt(elapsed)}  eta {_fmt(eta or 0)}\n")
        self.stream.flush()

    def close(self) -> None:
        pass


class _Row:
    """One federation's line of a :class:`LiveBoard`; updated from the federation's thread."""

    def __init__(self, board: "LiveBoard", method: str, detail: str, total: int):
        self.board, self.method, self.detail, self.total = board, method, detail, total
        self.state = "starting"  # starting -> running -> done | stopped
        self.rnd, self.loss, self.acc = 0, None, None
        self.timer = _Timer()
        self.t_created = time.perf_counter()
        self.t_end = None

    def start(self) -> None:
        with self.board.lock:
            self.state = "running"
            self.timer.restart()
        self.board.refresh()

    def update(self, rnd: int, train_loss: float, last_eval: dict) -> None:
        with self.board.lock:
            self.timer.tick()
            self.rnd, self.loss = rnd, train_loss
            acc = _avg(last_eval)
            self.acc = acc if acc is not None else self.acc
        self.board.refresh()

    def end(self) -> None:
        with self.board.lock:
            self.state = "done" if self.rnd >= self.total else "stopped"
            self.t_end = time.perf_counter()
        self.board.refresh()

    def cells(self, now: float, final: bool) -> list[str]:
        loss = f"{self.loss:.3f}" if self.loss is not None else "-"
        acc = f"{100 * self.acc:.1f}%" if self.acc is not None else "-"
        rounds = f"{self.rnd}/{self.total}"
        if final:
            seconds = (self.t_end or now) - self.t_created
            state = self.state if self.state in ("done", "stopped") else "stopped"
            return [self.method, self.detail or "-", rounds, loss, acc, _fmt(seconds), state]
        if self.state == "starting":
            return [self.method, self.detail or "-", rounds, loss, acc, "-", "starting"]
        if self.state in ("done", "stopped"):
            return [self.method, self.detail or "-", rounds, loss, acc, _fmt(self.t_end - self.t_created), self.state]
        eta = self.timer.eta(self.rnd, self.total, now)
        return [self.method, self.detail or "-", rounds, loss, acc, _fmt(self.timer.elapsed(now)),
                f"eta {_fmt(eta)}" if eta is not None else "round 1…"]


class LiveBoard:
    """The run's live table (rich.live.Live on stderr), a row per federation that has started,
    redrawn in place 4 times a second and on every round; on ``stop`` the final table stays.
    Rows are added and updated from the federations' threads (under ``lock``)."""

    HEADERS = ["method", "held-out / seed", "round", "loss", "test AVG", "elapsed", "status"]
    FINAL_HEADERS = ["method", "held-out / seed", "rounds", "loss", "test AVG", "time", "status"]

    def __init__(self, title: str = "", console=None):
        from rich.console import Console
        from rich.live import Live

        self.title = title
        self.console = console or Console(stderr=True)
        self.lock = threading.RLock()
        self.rows: list[_Row] = []
        self.final = False
        self.live = Live(console=self.console, get_renderable=self._render, refresh_per_second=4,
                         transient=False)
        self.started = False

    def add(self, method: str, detail: str, total: int) -> _Row:
        row = _Row(self, method, detail, total)
        with self.lock:
            self.rows.append(row)
        self.refresh()
        return row

    def _render(self):
        from rich.table import Table

        now = time.perf_counter()
        with self.lock:
            final = self.final
            rows = [r.cells(now, final) for r in self.rows]
        if final:
            done = sum(r[-1] == "done" for r in rows)
            title = f"{self.title}{': ' if self.title else ''}{done}/{len(rows)} federations done"
        else:
            title = self.title or None
            if len(rows) + 3 > self.console.size.height:  # taller than the screen: running ones only
                running = [r for r in rows if r[-1] not in ("done", "stopped")]
                title = f"{self.title}{' ' if self.title else ''}({len(rows) - len(running)} done)"
                rows = running
        table = Table(title=title, title_justify="left", box=None, pad_edge=False, header_style="bold")
        detail = any(cells[1] != "-" for cells in rows)  # a held-out / seed column only if one differs
        for i, name in enumerate(self.FINAL_HEADERS if final else self.HEADERS):
            if i != 1 or detail:
                table.add_column(name, justify="right" if 2 <= i <= 5 else "left", no_wrap=True)
        for cells in rows:
            table.add_row(*(c for i, c in enumerate(cells) if i != 1 or detail))
        return table

    def refresh(self) -> None:
        if self.started:
            self.live.refresh()

    def start(self) -> "LiveBoard":
        if not self.started:
            self.live.start()
            self.started = True
        return self

    def stop(self) -> None:
        if self.started:
            with self.lock:
                self.final = True
            self.live.stop()  # draws the final table in full, in place of the live one
            self.started = False

    def __enter__(self) -> "LiveBoard":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class ProgressCallback(Callback):
    """Round-loop callback reporting one federation's progress: a row of the driver's
    :class:`LiveBoard` (``board``), else plain lines (``mode="lines"``, or not a terminal), else
    a board of its own (``mode=True`` on a terminal: a federation run by itself)."""

    def __init__(self, total: int, label: str, mode: bool | str = True, board: LiveBoard | None = None,
                 method: str | None = None, detail: str = ""):
        self.last_eval: dict = {}
        self.own_board = None
        self.row = self.bar = None
        if not mode:
            self.bar = Progress(total, label=label, enabled=False)
            return
        if board is None and mode is True and live_terminal():
            board = self.own_board = LiveBoard()
        if board is not None:
            self.row = board.add(method or label, detail, total)
        else:
            self.bar = Progress(total, label=label)

    def on_start(self, run) -> None:
        if self.own_board is not None:
            self.own_board.start()
        if self.row is not None:
            self.row.start()
        else:
            self.bar.timer.restart()  # rounds only: start-up is not in the ETA

    def on_round(self, rnd: int, summary: RoundSummary, evaluation, log) -> None:
        self.last_eval = evaluation or self.last_eval
        if self.row is not None:
            self.row.update(rnd, summary.train_loss, self.last_eval)
        else:
            self.bar.update(rnd, summary.train_loss, self.last_eval)

    def on_end(self, log) -> None:
        if self.row is not None:
            self.row.end()
        if self.own_board is not None:
            self.own_board.stop()
