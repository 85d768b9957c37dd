"""The command line as a user meets it: one-line errors, exit code 2, no traceback."""
import subprocess
import sys

import pytest


def raysim(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "raysim", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


@pytest.mark.parametrize("args, fragment", [
    (["run", "missing.yaml"], "config file not found: missing.yaml"),
    (["run", "method=nosuch"], "unknown method 'nosuch'"),
    (["run", "train.lr=-1"], "'train.lr' = -1.0: expected a positive number"),
    (["run", "tarin.lr=1"], "unknown config key 'tarin'"),
    (["report", "/nonexistent/run"], "no metrics.parquet found in /nonexistent/run"),
    (["frobnicate"], "invalid choice"),
])
def test_user_errors_are_one_line_with_exit_code_2(args, fragment, tmp_path):
    r = raysim(*args, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("raysim: error: "), r.stderr
    assert fragment in lines[0]
    assert "Traceback" not in r.stderr
