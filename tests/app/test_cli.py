"""The command line as a user meets it: one-line errors, exit code 2, no traceback."""
import os
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
    (["run", "--check", "--frob"], "unrecognized arguments: --frob"),
])
def test_user_errors_are_one_line_with_exit_code_2(args, fragment, tmp_path):
    r = raysim(*args, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("raysim: error: "), r.stderr
    assert fragment in lines[0]
    assert "Traceback" not in r.stderr


# raysim's entry point in a fresh interpreter, timed from the moment main() starts: torch is
# imported first, as it is by every command before its work (5-12 s alone on a loaded 2-core machine)
TIMED_MAIN = ("import sys, time, torch, raysim.cli; t0 = time.perf_counter(); code = raysim.cli.main(sys.argv[1:]); "
              "print(f'{time.perf_counter() - t0:.2f}'); sys.exit(code)")


def test_overrides_after_the_options_are_taken_as_overrides(tmp_path):
    # argparse alone stops at "rounds=3" after an option: "unrecognized arguments"
    r = raysim("run", "method=fedavg", "--check", "rounds=3", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "\nrounds: 3\n" in r.stdout


def test_an_address_where_no_cluster_answers_is_one_line_within_10_s(tmp_path):
    """`raysim run --address 127.0.0.1:1` (nothing listens there): one line naming the address and
    what to check, exit 2, within 10 s, no run folder; Ray's own connect would retry ~14 minutes."""
    (tmp_path / "c.yaml").write_text("method: fedavg\nrounds: 1\ndata: {dataset: rotated_mnist}\n")
    for env in ({}, {"RAY_AUTH_TOKEN": "f" * 64}):  # without a token it used to claim a missing token first
        r = subprocess.run([sys.executable, "-c", TIMED_MAIN, "run", "c.yaml", "--address", "127.0.0.1:1"],
                           capture_output=True, text=True, cwd=tmp_path, timeout=120,
                           env={**{k: v for k, v in os.environ.items() if not k.startswith("RAY_")}, **env})
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        print(f"{r.stdout.strip()} s: {lines}")
        assert r.returncode == 2 and len(lines) == 1, r.stderr
        assert lines[0].startswith("raysim: error: cannot reach the Ray cluster at 127.0.0.1:1")
        assert "head node is running" in lines[0] and "firewall" in lines[0]
        assert float(r.stdout) <= 10.0
        assert os.listdir(tmp_path) == ["c.yaml"]


def test_a_config_is_read_and_its_mistakes_found_without_importing_torch(tmp_path):
    """A mistyped key is one line in a fraction of a second: reading a config imports no torch
    (~2 s of a core), and neither does the module that starts Ray (raysim.engine.cluster)."""
    path = tmp_path / "typo.yaml"
    path.write_text("method: fedavg\nrounds: 2\nmodle: {name: mlp}\n")
    code = ("import sys; from raysim.config import load_config; import raysim.engine.cluster\n"
            "cfg = load_config(sys.argv[1], ['rounds=3'])\n"
            "print(cfg.rounds, 'torch' in sys.modules)\n")
    good = tmp_path / "good.yaml"
    good.write_text("method: fedavg\nrounds: 2\nserver: {optimizer: adam}\n")
    r = subprocess.run([sys.executable, "-c", code, str(good)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["3", "False"], r.stderr
    r = subprocess.run([sys.executable, "-c", "import sys, raysim.cli\ntry:\n    raysim.cli.main(['run', sys.argv[1]])\n"
                        "finally:\n    print('torch' in sys.modules)\n", str(path)],
                       capture_output=True, text=True, timeout=120)
    assert "unknown config key 'modle'" in r.stderr and r.stdout.split() == ["False"], r.stderr


def _without_raysim_methods(monkeypatch):
    """raysim.methods unimportable, as in a checkout that was never installed (pyproject maps the
    checkout's methods/ folder to it only in an install)."""
    for name in [n for n in sys.modules if n == "raysim.methods" or n.startswith("raysim.methods.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "raysim.methods", None)


def test_a_checkout_never_installed_is_one_line_saying_so(monkeypatch, capsys):
    from importlib import metadata

    from raysim import cli

    assert cli.not_installed("anything") is None  # this Python has raysim installed (editable)

    def no_install_record(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", no_install_record)
    _without_raysim_methods(monkeypatch)
    assert cli.main(["methods"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("raysim: error: raysim is not installed in this Python")
    assert "module raysim.methods" in err and "pip install -e ." in err


def test_where_raysim_is_installed_a_missing_module_is_a_bugs_traceback(monkeypatch):
    from raysim import cli

    _without_raysim_methods(monkeypatch)
    with pytest.raises(ModuleNotFoundError):
        cli.main(["methods"])
