"""Flower's own virtual environment (``benchmarks/.venv-flwr``), made on first use.

Flower's ``simulation`` extra pins an older Ray than raysim, so it cannot share the project's
venv. The harness installs ``flwr[simulation]``, the project's torch/torchvision versions and
raysim itself (``--no-deps``, so the Flower client can reuse ``raysim.data``/``raysim.models``)
with pip, and records success in a marker file. Nothing else is downloaded at run time.
"""
from __future__ import annotations

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
VENV = os.path.join(HERE, ".venv-flwr")
MARKER = ".raysim-bench-ready"
PACKAGES = ["flwr[simulation]", "torch==2.14.1", "torchvision==0.29.1"]
CHECK = "import flwr, ray, torch, raysim.models, raysim.data; print(flwr.__version__, ray.__version__, torch.__version__)"


def python(venv: str = VENV) -> str:
    return os.path.join(venv, "bin", "python")


def _last_error(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines()
             if ln.strip() and not ln.startswith("WARNING: Location") and "DEPRECATION" not in ln]
    errors = [ln for ln in lines if ln.startswith("ERROR")]
    return (errors or lines or ["no output"])[-1][:300]


def ensure(venv: str = VENV, log=print, timeout: float = 1800) -> tuple[str | None, str]:
    """(python of the Flower venv, "flwr X ray Y torch Z") or (None, why it is not available)."""
    py = python(venv)
    marker = os.path.join(venv, MARKER)
    if os.path.isfile(marker) and os.path.exists(py):
        ok = subprocess.run([py, "-c", CHECK], capture_output=True, text=True, timeout=300)
        if ok.returncode == 0:
            return py, _versions(ok.stdout)
    log(f"installing Flower into {venv} (pip; a few minutes the first time)")
    try:
        if not os.path.exists(py):
            base = getattr(sys, "_base_executable", None) or sys.executable
            subprocess.run([base, "-m", "venv", venv], check=True, capture_output=True, text=True, timeout=300)
        pip = [py, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        for args in (PACKAGES, ["--no-deps", "-e", REPO]):
            r = subprocess.run(pip + args, capture_output=True, text=True, timeout=timeout)
            if r.returncode != 0:
                return None, f"pip install {' '.join(args)} failed: {_last_error(r.stderr + r.stdout)}"
        ok = subprocess.run([py, "-c", CHECK], capture_output=True, text=True, timeout=300)
        if ok.returncode != 0:
            return None, f"installed but does not import: {_last_error(ok.stderr)}"
    except subprocess.TimeoutExpired as err:
        return None, f"installation timed out ({err.cmd[:3]}...)"
    except (OSError, subprocess.CalledProcessError) as err:
        return None, f"cannot create the venv: {str(err).splitlines()[0] if str(err) else type(err).__name__}"
    with open(marker, "w", encoding="utf-8") as fh:
        fh.write(ok.stdout)
    return py, _versions(ok.stdout)


def _versions(stdout: str) -> str:
    parts = stdout.split()
    if len(parts) >= 3:
        return f"flwr {parts[0]}, ray {parts[1]}, torch {parts[2]}"
    return stdout.strip()
