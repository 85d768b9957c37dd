"""Progress as a person sees it: ``raysim run`` of two federations side by side in a real
80-column terminal (a detached tmux pane, captured while it runs) shows one line per federation
redrawn in place and ends with a final table, headers whole; piped, it writes plain lines without
escape codes, the accuracy on evaluated rounds only."""
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid

import pytest

from raysim.engine.messages import RoundSummary

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROUNDS = 3
# the quickstart made small: two federations (one host each, 2 at a time on 2 cores), 3 rounds
ARGS = ["configs/quickstart.yaml", "methods=[fedavg,fedbn]", f"rounds={ROUNDS}", "data.options.image_size=16",
        "data.partition.train_size=48", "train.batch_size=16", "eval.every=1", "runtime.cpus_per_host=1"]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def env():
    """Its own Ray (not the test session's), same data cache."""
    return {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}


def rows(screen: str, method: str) -> list[str]:
    """The lines of the progress table for ``method`` (the summary's markdown rows start with '|')."""
    return [line for line in screen.splitlines() if line.split()[:1] == [method]]


@pytest.mark.slow
def test_live_table_in_a_terminal_one_line_per_federation_updated_in_place(tmp_path):
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (make test installs it with apt-get)")
    socket, session = f"raysim-test-{uuid.uuid4().hex[:8]}", "progress"
    tmux = ["tmux", "-L", socket]  # a server of its own: our environment, no user config
    run = " ".join([sys.executable, "-m", "raysim", "run", *(f"'{a}'" for a in ARGS), "--out", str(tmp_path / "run")])
    log = tmp_path / "exit"
    command = f"{run}; echo $? > {log}; sleep 600"  # the pane stays for the final capture
    subprocess.run([*tmux, "-f", "/dev/null", "new-session", "-d", "-s", session, "-x", "80", "-y", "40",
                    "-c", REPO, command], env=env(), check=True)
    try:
        captures, deadline = [], time.monotonic() + 150
        while not log.exists() and time.monotonic() < deadline:
            screen = subprocess.run([*tmux, "capture-pane", "-p", "-t", session], capture_output=True,
                                    text=True).stdout
            if "federations done" not in screen:
                captures.append(screen)
            time.sleep(0.2)
        history = subprocess.run([*tmux, "capture-pane", "-p", "-S", "-", "-t", session], capture_output=True,
                                 text=True).stdout
        assert log.exists(), f"raysim run did not finish in time:\n{history}"
        assert log.read_text().strip() == "0", history

        # while it runs: one line per federation in every capture from its start on (a federation's
        # row appears when its thread starts it, the other's maybe a capture later), the round advancing
        live = [c for c in captures if rows(c, "fedavg") or rows(c, "fedbn")]
        assert len(live) >= 3, f"the live table was never seen:\n{history}"
        rounds = {m: [] for m in ("fedavg", "fedbn")}
        for screen in live:
            for method in rounds:
                lines = rows(screen, method)
                assert len(lines) <= 1 and (lines or not rounds[method]), \
                    f"{method}: {len(lines)} lines on one screen:\n{screen}"
                if lines:
                    rounds[method].append(int(re.search(rf"(\d+)/{ROUNDS}\b", lines[0]).group(1)))
        for method, seen in rounds.items():
            assert seen == sorted(seen) and len(set(seen)) >= 2, (method, seen)
        assert any(re.search(r"eta \d+:\d\d", c) for c in live), "no ETA shown"
        assert any(re.search(r"\d+\.\d%", c) for c in live), "no test AVG shown"
        # on an 80-column terminal every header whole, live and final
        headers = {line.strip() for c in [*live, history] for line in c.splitlines() if line.startswith("method ")}
        assert {re.sub(r"\s+", " ", h) for h in headers} == {"method round loss test AVG time status",
                                                              "method rounds loss test AVG time status"}, headers

        # at the end: the final table, and nowhere in the scroll-back a second line per federation
        assert "raysim quickstart: 2/2 federations done" in history, history
        for method in rounds:
            (line,) = rows(history, method)
            assert re.search(rf"\b{ROUNDS}/{ROUNDS}\b.*\d+\.\d%.*\bdone$", line.rstrip()), line
        assert "run directory:" in history
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)


@pytest.mark.slow
def test_plain_lines_when_not_a_terminal(tmp_path):
    r = subprocess.run([sys.executable, "-m", "raysim", "run", *ARGS, "--out", str(tmp_path / "run")], cwd=REPO,
                       env=env(), capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr
    assert not ANSI.search(r.stdout + r.stderr), "escape codes in piped output"
    assert "raysim: running 2 federations, 2 at a time" in r.stderr
    for method in ("fedavg", "fedbn"):
        lines = [line for line in r.stderr.splitlines() if line.startswith(f"{method} round ")]
        assert [int(re.match(rf"{method} round (\d+)/{ROUNDS}", line).group(1)) for line in lines] == \
            list(range(1, ROUNDS + 1)), r.stderr
        assert re.search(r"loss \d\.\d{3}  acc\(AVG\)\s+\d+\.\d%  elapsed \d+:\d\d  eta \d+:\d\d$", lines[-1])
        assert re.search(rf"raysim: \S*{method} done: {ROUNDS} rounds in \d+ s", r.stderr)
    assert "run directory:" in r.stdout
    # raysim started Ray itself: its hosts run at the priority of the program that started them
    # (runtime.worker_niceness 0 on top), not 15 lower as Ray's default would put them
    for method in ("fedavg", "fedbn"):
        with open(tmp_path / "run" / method / "hosts.json", encoding="utf-8") as fh:
            assert {h["niceness"] for h in json.load(fh)["hosts"]} == {os.nice(0)}


def test_board_rows_from_threads_and_final_table():
    """The live table without Ray: four federations' callbacks in threads, one row each."""
    import io
    import threading

    from rich.console import Console

    from raysim.app.progress import LiveBoard, ProgressCallback

    console = Console(file=io.StringIO(), force_terminal=True, width=120, height=40)
    board = LiveBoard("demo", console=console)
    callbacks = [ProgressCallback(4, f"m{i}", "lines", board=board, method=f"m{i}", detail=f"seed {i}")
                 for i in range(4)]

    def federation(cb, stop_at):
        cb.on_start(None)
        for rnd in range(1, stop_at + 1):
            cb.on_round(rnd, RoundSummary(round=rnd, train_loss=1 / rnd), {"test": {"AVG": rnd / 10}} if rnd % 2 == 0 else None,
                        None)
        cb.on_end(None)

    with board:
        threads = [threading.Thread(target=federation, args=(cb, 4 if i else 2)) for i, cb in enumerate(callbacks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    final = Console(file=io.StringIO(), width=120)
    final.print(board._render())
    lines = final.file.getvalue().splitlines()
    assert lines[0].strip() == "demo: 3/4 federations done"
    assert lines[1].split() == ["method", "seed", "rounds", "loss", "test", "AVG", "time", "status"]
    assert re.search(r"^m0\s+0\s+2/4\s+0\.500\s+20\.0%\s+0:00\s+stopped", lines[2]), lines
    for i in range(1, 4):
        assert re.search(rf"^m{i}\s+{i}\s+4/4\s+0\.250\s+40\.0%\s+0:00\s+done", lines[2 + i]), lines


def board_lines(width: int, final: bool) -> list[str]:
    """The live table (or the final one) of four long-labelled federations on a ``width``-column
    terminal: held-out domains and seeds, the longest built-in method name, a plugin's."""
    import io

    from rich.console import Console

    from raysim.app.progress import LiveBoard, ProgressCallback

    board = LiveBoard("raysim digits5_lodo_all", console=Console(file=io.StringIO(), force_terminal=True,
                                                                 width=width, height=40))
    rows = [("fedavg_mixstyle", "holdout mnistm, seed 1"), ("my_method", "holdout usps, seed 12"),
            ("fedbn", "holdout synth, seed 1"), ("fedavg", "holdout svhn, seed 1")]
    for i, (method, detail) in enumerate(rows):
        cb = ProgressCallback(120, method, "lines", board=board, method=method, detail=detail)
        cb.on_start(None)
        if i:  # the first one is still in round 1: "round 1…" where the ETA goes
            cb.on_round(100, RoundSummary(round=100, train_loss=0.1234), {"test": {"AVG": 0.456}}, None)
    board.final = final
    out = Console(file=io.StringIO(), width=width, force_terminal=False)
    out.print(board._render())
    return out.file.getvalue().splitlines()


@pytest.mark.parametrize("final", [False, True])
def test_the_table_fits_80_columns_and_narrower_ones_drop_time_then_loss(final):
    rounds = "rounds" if final else "round"
    lines = board_lines(80, final)
    assert max(len(line.rstrip()) for line in lines) <= 80 and "fedavg_mixstyle  mnistm, 1" in lines[2], lines
    assert lines[1].split() == ["method", "held", "out,", "seed", rounds, "loss", "test", "AVG", "time", "status"]
    assert re.search(r"^fedavg_mixstyle\s+mnistm, 1\s+0/120\s+-\s+-\s+\S+\s+(stopped|round 1…)$", lines[2].rstrip())
    assert re.search(r"^my_method\s+usps, 12\s+100/120\s+0\.123\s+45\.6%\s+0:00\s+(stopped|eta 0:00)$",
                     lines[3].rstrip()), lines
    for width, columns in ((70, [rounds, "loss", "test", "AVG", "status"]),  # the time column goes first
                           (60, [rounds, "test", "AVG", "status"])):  # then the loss
        narrow = board_lines(width, final)
        assert max(len(line.rstrip()) for line in narrow) <= width and "fedavg_mixstyle  mnistm, 1" in narrow[2]
        assert narrow[1].split()[-len(columns):] == columns and "time" not in narrow[1], narrow
    narrowest = board_lines(45, final)  # then the labels are cut, never a number or the status
    assert max(len(line.rstrip()) for line in narrowest) <= 45, narrowest
    assert re.search(r"^fed\w*…\s.*\s0/120\s+-\s+(stopped|round 1…)$", narrowest[-4].rstrip()), narrowest
    for line in narrowest[-3:]:
        assert re.search(r"\s100/120\s+45\.6%\s+(stopped|eta 0:00)$", line.rstrip()), narrowest


def test_plain_line_format(capsys):
    from raysim.app.progress import ProgressCallback

    cb = ProgressCallback(10, "fedbn[seed 1]", "lines")
    cb.on_start(None)
    cb.on_round(1, RoundSummary(round=1, train_loss=2.5), None, None)
    cb.on_round(2, RoundSummary(round=2, train_loss=1.25), {"test": {"AVG": 0.4321}}, None)
    cb.on_round(3, RoundSummary(round=3, train_loss=1.0), None, None)  # not evaluated: no accuracy
    cb.on_end(None)
    assert capsys.readouterr().err.splitlines() == [
        "fedbn[seed 1] round 1/10  loss 2.500  elapsed 0:00  eta 0:00",
        "fedbn[seed 1] round 2/10  loss 1.250  acc(AVG)  43.2%  elapsed 0:00  eta 0:00",
        "fedbn[seed 1] round 3/10  loss 1.000  elapsed 0:00  eta 0:00"]


def test_the_summary_printed_on_an_80_column_terminal_wraps_its_prose_not_its_tables(monkeypatch):
    import io

    from raysim.app.progress import for_terminal

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setenv("COLUMNS", "80")
    prose = "Test accuracy (%) per domain; AVG = mean over domains (the papers' AVG), ALL = accuracy over all " \
            "clients' pooled test samples."
    item = "- fedprox: hp mu = 0.01 (default 0.01); server sgd lr 1 (the method's own); selection uniform, 5 of 20"
    table = "| " + " | ".join(f"column {i}" for i in range(12)) + " |"
    text = "\n".join(["## What ran", prose, item, table]) + "\n"
    shown = for_terminal(text, Terminal())
    lines = shown.splitlines()
    assert table in lines  # a table is never broken
    assert all(len(ln) < 80 for ln in lines if ln != table), lines
    assert " ".join(ln.strip() for ln in lines[1:-1]) == f"{prose} {item}"  # nothing lost
    first = next(i for i, ln in enumerate(lines) if ln.startswith("- "))
    assert lines[first + 1].startswith("  ")  # the list item's continuation hangs under its text
    assert for_terminal(text, io.StringIO()) == text  # a file or pipe gets summary.md as it is
