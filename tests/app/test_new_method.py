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


def test_from_the_fednova_example_under_a_name_of_ones_own(tmp_path, capsys, monkeypatch):
    """``--from fednova``: the shipped example's method, tests and tune config, renamed (module,
    class, method name, test and tune file) so they pass and run as the example does."""
    from raysim.tuning.spec import load_spec

    folder = tmp_path / "mine"
    assert main(["new", "method", "my_nova", "--from", "fednova", "--dir", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "method=my_nova:MyNova" in out and "raysim tune my_nova_tune.yaml" in out
    assert sorted(p.name for p in folder.iterdir()) == ["my_nova.py", "my_nova_tune.yaml", "test_my_nova.py"]
    texts = {p.name: p.read_text() for p in folder.iterdir()}
    header, method = texts["my_nova.py"].split("\n", 1)
    assert header == ("# my_nova.py: raysim's FedNova example (raysim new method my_nova --from fednova), "
                      "now yours to change.")
    assert not any("fednova" in t for t in (method, texts["test_my_nova.py"], texts["my_nova_tune.yaml"]))
    assert "class MyNova(Method):" in texts["my_nova.py"] and 'name = "my_nova"' in texts["my_nova.py"]
    assert "FedNova averages" in texts["my_nova.py"]  # the prose still names the algorithm

    # its own tests, as written, in this process (the module and its test by the folder on sys.path)
    monkeypatch.syspath_prepend(str(folder))
    for module in ("my_nova", "test_my_nova"):
        monkeypatch.delitem(sys.modules, module, raising=False)
    tests = load(folder / "test_my_nova.py", "test_my_nova", monkeypatch)
    ran = []
    for name in sorted(n for n in vars(tests) if n.startswith("test_")):
        fn = getattr(tests, name)
        fn(**({"tmp_path": tmp_path / name} if "tmp_path" in fn.__code__.co_varnames else {}))
        ran.append(name)
    assert len(ran) == 5 and "test_my_nova_runs_rounds_and_scores_every_domain" in ran
    monkeypatch.delitem(sys.modules, "my_nova", raising=False)
    spec = load_spec(folder / "my_nova_tune.yaml")  # the tune config names the renamed method
    assert spec.name == "my_nova" and spec.method == "my_nova:MyNova" and list(spec.space) == ["train.lr"]

    # nothing is overwritten; an unknown example is one line naming the shipped ones
    (folder / "my_nova.py").write_text("# mine\n")
    assert main(["new", "method", "my_nova", "--from", "fednova", "--dir", str(folder)]) == 2
    assert main(["new", "method", "other", "--from", "nosuch", "--dir", str(tmp_path / "x")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 2 and err[1] == "raysim: error: --from nosuch: no such example; raysim ships fednova", err
    assert (folder / "my_nova.py").read_text() == "# mine\n" and not (tmp_path / "x").exists()
