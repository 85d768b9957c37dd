"""User-facing errors: one clear line, exit code 2, no traceback."""


class UserError(Exception):
    """Something the user supplied is wrong (config, path, dataset, name).

    The CLI prints ``raysim: error: <message>`` and exits with code 2.
    The message should say what was wrong and what was expected.
    """


class RunFailed(Exception):
    """A run stopped for a reason outside the user's input (a lost server, an interrupt).

    The CLI prints the one-line message, which says how to resume, and exits with code 1.
    """


class Interrupted(RunFailed):
    """Ctrl-C (SIGINT) or SIGTERM stopped the run; the message says how to resume, if anything can be.

    The CLI exits with code 130 (128 + SIGINT), or 143 after SIGTERM (``signal`` says which).
    """

    def __init__(self, message: str, signal: int = 2):
        super().__init__(message)
        self.signal = signal


class TryLater(RunFailed):
    """A fault that another try may not meet: a lost node with no spare capacity yet, a lock held
    by another host that is not yet stale, Ray's control processes (GCS, raylet) gone. The CLI
    exits with 75 (EX_TEMPFAIL), which ``cluster/supervise.sh`` retries with backoff."""

    exit_code = 75


class MethodFailed(RunFailed):
    """An exception raised by a method's own code (on a host or on the server): a bug to fix, not a
    fault to replay. ``traceback`` is the method's traceback as text (its file and line); the CLI
    prints it after the one-line message and exits with 1."""

    def __init__(self, message: str, traceback: str = "", short: str = ""):
        super().__init__(message)
        self.traceback = traceback
        self.short = short or message
        """``Type: message, where``: what a list of several failures shows of it."""

    def __reduce__(self):  # survives the trip through Ray and a thread pool
        return (MethodFailed, (str(self), self.traceback, self.short))


class Terminated(KeyboardInterrupt):
    """SIGTERM (scancel, a pod's termination, preemption), raised where Ctrl-C raises
    KeyboardInterrupt, so every phase stops the same way; exit code 143."""
    signal = 15

    def __init__(self, *args):
        super().__init__(*args)
        _received["signal"] = self.signal


_received = {"signal": None}  # the signal a Terminated was last raised for


def forget_signal() -> None:
    """A new command or run starts: no signal received yet."""
    _received["signal"] = None


def signal_of(interrupt: BaseException) -> int:
    """The signal that stopped the run: the interrupt's own, else the one the last Terminated was
    raised for (Ray turns an exception raised while it waits into a plain KeyboardInterrupt, which
    would read as Ctrl-C), else SIGINT."""
    return getattr(interrupt, "signal", None) or _received["signal"] or 2


class TrainingDiverged(UserError):
    """A client's loss became NaN or infinite: usually the learning rate is too high."""

    def __init__(self, client_id: int, domain: str, round: int, value: float):
        self.client_id, self.domain, self.round = client_id, domain, round
        super().__init__(f"training diverged: loss became {value} for client {client_id} "
                         f"(domain {domain}) in round {round}; try a lower train.lr")

    def __reduce__(self):  # survives the trip through Ray
        return (TrainingDiverged, (self.client_id, self.domain, self.round, float("nan")))



def first_line(err: BaseException, *, limit: int | None = None, default: str | None = None,
               with_type: bool = False) -> str:
    """The error's first non-blank line, stripped: what a one-line message shows of it.

    ``limit`` cuts it to that many characters; ``default`` stands in for a blank message (the
    error's type name unless given); ``with_type`` gives ``Type: line`` (cut as a whole)."""
    line = next((ln.strip() for ln in str(err).splitlines() if ln.strip()), None)
    if with_type:
        line = f"{type(err).__name__}: {line or ''}"
    elif line is None:
        line = type(err).__name__ if default is None else default
    return line if limit is None else line[:limit]
