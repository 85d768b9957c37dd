"""Side virtual environments for the benchmark arms, made with pip on first use.

An arm that runs another framework (Flower, FLGo) cannot always share the project's venv (Flower
pins an older Ray; FLGo pulls its own dependencies). :class:`SideVenv` describes one such venv:
where it lives, the packages pip installs into it, whether raysim itself goes in (``--no-deps
-e``, so the arm can reuse ``raysim.data``/``raysim.models``), and a check command whose output
names the versions. ``ensure()`` builds it the first time, records success in a marker file, and
afterwards only re-runs the check. Nothing else is downloaded at run time.
"""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Callable, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MARKER = ".raysim-bench-ready"
TORCH = ["torch==2.14.1", "torchvision==0.29.1"]  # the project's versions, in every side venv


def versions_line(*names: str) -> Callable[[str], str]:
    """A ``describe`` for a check that prints one version per name, last: "flgo X, torch Y"."""
    def describe(stdout: str) -> str:
        parts = stdout.split()
        if len(parts) < len(names):
            return stdout.strip()
        return ", ".join(f"{n} {v}" for n, v in zip(names, parts[-len(names):]))
    return describe


def python(venv: str) -> str:
    return os.path.join(venv, "bin", "python")


def last_error(text: str) -> str:
    """The most telling line of pip's output (its last ERROR line, else its last line)."""
    lines = [ln.strip() for ln in text.splitlines()
             if ln.strip() and not ln.startswith("WARNING: Location") and "DEPRECATION" not in ln]
    errors = [ln for ln in lines if ln.startswith("ERROR")]
    return (errors or lines or ["no output"])[-1][:300]


@dataclass
class SideVenv:
    """One side venv. ``installs`` are pip argument lists run in order (the first that fails stops
    the build, unless a later alternative in ``fallbacks`` installs); ``check`` is Python code run
    in the venv that must exit 0 and print the versions; ``describe`` turns its stdout into the
    line ``ensure`` returns."""
    path: str
    installs: Sequence[Sequence[str]]
    check: str
    describe: Callable[[str], str] = field(default=lambda out: out.strip())
    with_raysim: bool = True  # pip install --no-deps -e REPO after the packages
    fallbacks: Sequence[Sequence[str]] = ()  # alternatives to installs[0], tried in order
    label: str = ""

    def python(self) -> str:
        return python(self.path)

    def _check(self) -> subprocess.CompletedProcess:
        return subprocess.run([self.python(), "-c", self.check], capture_output=True, text=True, timeout=300)

    def ensure(self, log=print, timeout: float = 1800) -> tuple[str | None, str]:
        """(python of the venv, its versions line) or (None, why it is not available)."""
        py = self.python()
        marker = os.path.join(self.path, MARKER)
        if os.path.isfile(marker) and os.path.exists(py):
            ok = self._check()
            if ok.returncode == 0:
                return py, self.describe(ok.stdout)
        log(f"installing {self.label or os.path.basename(self.path)} into {self.path} (pip; a few minutes the first time)")
        try:
            if not os.path.exists(py):
                base = getattr(sys, "_base_executable", None) or sys.executable
                subprocess.run([base, "-m", "venv", self.path], check=True, capture_output=True, text=True,
                               timeout=300)
            pip = [py, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
            steps = [list(a) for a in self.installs] + ([["--no-deps", "-e", REPO]] if self.with_raysim else [])
            for i, args in enumerate(steps):
                r = subprocess.run(pip + args, capture_output=True, text=True, timeout=timeout)
                if r.returncode != 0 and i == 0:
                    for alt in self.fallbacks:  # e.g. an older pin of the framework
                        log(f"pip install {' '.join(args)} failed ({last_error(r.stderr + r.stdout)}); "
                            f"trying {' '.join(alt)}")
                        args = list(alt)
                        r = subprocess.run(pip + args, capture_output=True, text=True, timeout=timeout)
                        if r.returncode == 0:
                            break
                if r.returncode != 0:
                    return None, f"pip install {' '.join(args)} failed: {last_error(r.stderr + r.stdout)}"
            ok = self._check()
            if ok.returncode != 0:
                return None, f"installed but does not import: {last_error(ok.stderr)}"
        except subprocess.TimeoutExpired as err:
            return None, f"installation timed out ({err.cmd[:3]}...)"
        except (OSError, subprocess.CalledProcessError) as err:
            return None, f"cannot create the venv: {str(err).splitlines()[0] if str(err) else type(err).__name__}"
        with open(marker, "w", encoding="utf-8") as fh:
            fh.write(ok.stdout)
        return py, self.describe(ok.stdout)
