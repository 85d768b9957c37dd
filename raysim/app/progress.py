"""Round progress. On a terminal: one live table for the whole run (rich), a row per federation
(method, held-out domain or seed, round/total, train loss, test AVG, elapsed, ETA) redrawn in
place, left on screen as the final table, as wide as the terminal allows (80 columns is enough).
Otherwise (logs, CI, pipes): one plain line per round, with the test accuracy on evaluated rounds.

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


def for_terminal(markdown: str, stream=None) -> str:
    """A summary as a terminal shows it: its prose and list items wrapped to the terminal's width
    (tables, headings and code as they are); unchanged where ``stream`` (stdout) is no terminal."""
    import shutil
    import textwrap

    stream = stream or sys.stdout
    if not (hasattr(stream, "isatty") and stream.isatty()):
        return markdown
    width = max(40, shutil.get_terminal_size().columns - 1)
    out = []
    for line in markdown.splitlines():
        if len(line) <= width or line.lstrip().startswith(("|", "#", "```")):
            out.append(line)
            continue
        bullet = line[:len(line) - len(line.lstrip())] + ("- " if line.lstrip().startswith("- ") else "")
        out.append(textwrap.fill(line, width, subsequent_indent=" " * len(bullet), break_on_hyphens=False))
    return "\n".join(out) + ("\n" if markdown.endswith("\n") else "")


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
    """One plain line per round on ``stream`` (stderr by default); the test accuracy only on a
    round that was evaluated (``last_eval`` empty: none)."""

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

    def update(self, rnd: int, train_loss: float, last_eval: dict, epsilon: float | None = None) -> None:
        self.timer.tick()
        if not self.enabled:
            return
        elapsed = self.timer.elapsed(self.timer.t_last)
        eta = self.timer.eta(rnd, self.total, self.timer.t_last)
        acc = _avg(last_eval)
        acc_text = f"  acc(AVG) {100 * acc:5.1f}%" if acc is not None else ""
        acc_text += f"  ε {epsilon:.3g}" if epsilon is not None else ""  # privacy spent (raysim.core.stages)
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
        self.rnd, self.loss, self.acc, self.epsilon = 0, None, None, None
        self.timer = _Timer()
        self.t_created = time.perf_counter()
        self.t_end = None

    def start(self) -> None:
        with self.board.lock:
            self.state = "running"
            self.timer.restart()
        self.board.refresh()

    def update(self, rnd: int, train_loss: float, last_eval: dict, epsilon: float | None = None) -> None:
        with self.board.lock:
            self.timer.tick()
            self.rnd, self.loss, self.epsilon = rnd, train_loss, epsilon
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
        rounds = f"{self.rnd}/{self.total}" + (f" ε{self.epsilon:.2g}" if self.epsilon is not None else "")
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
    Rows are added and updated from the federations' threads (under ``lock``).

    The table fits the terminal's width (80 columns with a seed and a held-out domain per row):
    short headers; the held-out / seed column only where a row has one, its header saying which
    and its cells without the repeated words; on a narrower terminal the time column goes first,
    then the loss, and last the method and held-out texts are cut with an ellipsis, so that
    neither the round, the test accuracy nor the status is ever cut."""

    HEADERS = ["method", "held out / seed", "round", "loss", "test AVG", "time", "status"]
    FINAL_HEADERS = ["method", "held out / seed", "rounds", "loss", "test AVG", "time", "status"]
    DETAIL, RIGHT = 1, (2, 3, 4, 5)  # the held-out / seed column; the right-aligned ones
    DROPPABLE = (5, 3)  # time, then loss: the columns left out, in this order, when too wide
    GAP = 2  # spaces between two columns (rich's padding of 1 on either side)

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
        headers, rows = fit_columns(list(self.FINAL_HEADERS if final else self.HEADERS), rows,
                                    self.console.size.width, self.DETAIL, self.DROPPABLE, self.GAP)
        table = Table(title=title, title_justify="left", box=None, pad_edge=False, header_style="bold")
        for i, name in headers:
            table.add_column(name, justify="right" if i in self.RIGHT else "left", no_wrap=True)
        for cells in rows:
            table.add_row(*cells)
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


def detail_column(details: list[str]) -> tuple[str | None, list[str]]:
    """The held-out / seed column's header and cells from the rows' details (``holdout mnistm,
    seed 1``): ``held out``, ``seed`` or both as the header, the cells without those words; no
    column (None) where no row has a detail."""
    if all(d in ("", "-") for d in details):
        return None, details
    parts = [dict(p.partition(" ")[::2] for p in d.split(", ")) if d not in ("", "-") else {} for d in details]
    keys = [k for k in ("holdout", "seed") if any(k in p for p in parts)]
    if not keys or any(set(p) - set(keys) for p in parts):  # something else: shown as it is
        return "held out / seed", details
    header = ", ".join("held out" if k == "holdout" else k for k in keys)
    return header, [", ".join(p.get(k, "-") for k in keys) if p else "-" for p in parts]


def fit_columns(headers: list[str], rows: list[list[str]], width: int, detail: int, droppable, gap: int):
    """The columns (index, header) and rows' cells to draw in ``width`` characters: the detail
    column named by :func:`detail_column` (left out where no row has one), then the ``droppable``
    columns left out in turn while the table is wider, then the first two columns' texts cut
    (with an ellipsis) to what is left."""
    name, cells = detail_column([r[detail] for r in rows])
    rows = [r[:detail] + [c] + r[detail + 1:] for r, c in zip(rows, cells)]
    keep = [i for i in range(len(headers)) if i != detail or name is not None]
    if name is not None:
        headers[detail] = name

    def widths(cols):
        return {i: max([len(headers[i]), *(len(r[i]) for r in rows)]) for i in cols}

    def total(cols):
        return sum(widths(cols).values()) + gap * (len(cols) - 1)

    for i in droppable:
        if total(keep) <= width:
            break
        keep.remove(i)
    excess = total(keep) - width
    if excess > 0:  # cut the widest of the method and detail texts, one character at a time
        w = widths(keep)
        texts = [i for i in (0, detail) if i in keep]
        while excess > 0 and any(w[i] > 4 for i in texts):
            widest = max(texts, key=lambda i: w[i])
            w[widest] -= 1
            excess -= 1
        rows = [[_cut(c, w[i]) if i in texts else c for i, c in enumerate(r)] for r in rows]
        headers = [_cut(h, w[i]) if i in texts else h for i, h in enumerate(headers)]
    return [(i, headers[i]) for i in keep], [[r[i] for i in keep] for r in rows]


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 1] + "…"


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
        epsilon = (summary.server_metrics or {}).get("epsilon")  # privacy spent so far (privacy: runs)
        if self.row is not None:  # the table's cell keeps the latest test accuracy
            self.row.update(rnd, summary.train_loss, self.last_eval, epsilon)
        else:  # a line per round: the accuracy only on the rounds that were evaluated
            self.bar.update(rnd, summary.train_loss, evaluation or {}, epsilon)

    def on_end(self, log) -> None:
        if self.row is not None:
            self.row.end()
        if self.own_board is not None:
            self.own_board.stop()
