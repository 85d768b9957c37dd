"""``raysim new method NAME``: the two files it writes pass their own tests as written, the class
imports and is a method with a declared hyperparameter, and nothing is ever overwritten."""
from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from raysim.cli import main
from raysim.core.contract import Method
from raysim.core.errors import UserError
from raysim.methods.fedavg import FedAvg


def load(path, name, monkeypatch):
    """The module at ``path``, imported by path (no sys.path entry), for this test only."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # dataclasses look their module up while it runs
    spec.loader.exec_module(module)
    return module


def test_the_generated_method_passes_its_generated_test_and_imports(tmp_path, capsys, monkeypatch):
    assert main(["new", "method", "my_method", "--dir", str(tmp_path / "mine")]) == 0
    out = capsys.readouterr().out
    assert "method=my_method:MyMethod" in out and "raysim run configs/quickstart.yaml" in out
    folder = tmp_path / "mine"
    assert sorted(p.name for p in folder.iterdir()) == ["my_method.py", "test_my_method.py"]

    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_my_method.py"],
                       cwd=folder, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "2 passed" in r.stdout, r.stdout + r.stderr

    cls = load(folder / "my_method.py", "my_method", monkeypatch).MyMethod
    assert issubclass(cls, FedAvg) and issubclass(cls, Method) and cls.name == "my_method"
    assert cls.Hparams().smoothing == 0.1 and "source" in cls.Hparams.__dataclass_fields__["smoothing"].metadata
    with pytest.raises(UserError, match="hp.my_method.smoothing"):
        cls.hparams_from({"smoothing": 1.0}, prefix="hp.my_method")  # eps < 1, as declared


def test_it_never_overwrites_and_names_must_be_identifiers(tmp_path, capsys):
    (tmp_path / "test_taken.py").write_text("# mine\n")
    for args in (["taken"], ["my-method"], ["2nd"], ["class"], ["fedavg"], ["json"]):
        assert main(["new", "method", *args, "--dir", str(tmp_path)]) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(err) == 1 and err[0].startswith("raysim: error: "), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["test_taken.py"]  # neither file written
    assert (tmp_path / "test_taken.py").read_text() == "# mine\n"
