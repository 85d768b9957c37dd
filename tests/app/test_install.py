"""raysim from a plain (non-editable) install: the wheel carries every package (each folder with an
``__init__.py`` under raysim/, methods/, tuning/), the quickstart, the shipped configs and the
examples; installed in a clean venv, every registered method imports, one that is built on
raysim.methods.lib trains a round, and ``raysim`` finds the shipped files from any directory.
Also how a command-line CONFIG is looked up (the current directory first, then the shipped
configs)."""
from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from raysim.app.shipped import find_config, quickstart, shipped_configs
from raysim.core.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "setup.py", "README.md", "raysim", "methods", "tuning", "configs", "examples")  # built
CODE = {"raysim": "raysim", "methods": "raysim/methods", "tuning": "raysim/tuning"}  # folder -> its place in the wheel


def yaml_files(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*.yaml")}


def source_files(suffix: str) -> set[str]:
    """Every ``*suffix`` file of the code folders, where the wheel must hold it."""
    return {f"{place}/{p.relative_to(ROOT / folder).as_posix()}" for folder, place in CODE.items()
            for p in (ROOT / folder).rglob(f"*{suffix}") if "__pycache__" not in p.parts}


# ----------------------------------------------------------------------------- the lookup

def test_in_a_source_checkout_the_shipped_configs_are_the_repositorys(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the cwd plays no part
    assert shipped_configs() == ROOT / "configs"
    assert quickstart() == ROOT / "configs" / "quickstart.yaml"


def test_a_relative_config_means_the_current_directory_first(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "fdse").mkdir()
    (tmp_path / "fdse" / "digits5.yaml").write_text("method: fedavg\n")
    assert find_config("fdse/digits5.yaml") == "fdse/digits5.yaml"  # the user's, not the shipped one


def test_a_config_not_in_the_current_directory_is_a_shipped_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shipped = str(ROOT / "configs" / "fdse" / "digits5.yaml")
    assert find_config("fdse/digits5.yaml") == shipped
    assert find_config("configs/fdse/digits5.yaml") == shipped  # as the docs spell it


def test_a_config_in_neither_place_is_one_line_naming_both(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as err:
        find_config("fdse/nosuch.yaml")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("config file not found: fdse/nosuch.yaml")
    assert str(tmp_path) in msg and str(ROOT / "configs") in msg


def test_the_public_load_config_finds_a_shipped_config_from_any_directory(tmp_path, monkeypatch):
    """The README's Python example, ``raysim.load_config("configs/quickstart.yaml")``, outside a
    checkout; raysim.config's own ``load_config`` (below the app) reads the path as given."""
    import raysim
    from raysim.config import load_config

    monkeypatch.chdir(tmp_path)
    cfg = raysim.load_config("configs/quickstart.yaml", ["methods=[fedavg,fedbn]", "rounds=5"])
    assert cfg.name == "quickstart" and cfg.rounds == 5 and cfg.method_names() == ["fedavg", "fedbn"]
    assert raysim.load_config("fdse/digits5.yaml").data.dataset == "digits5"
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "quickstart.yaml").write_text("name: mine\nmethod: fedavg\n")
    assert raysim.load_config("configs/quickstart.yaml").name == "mine"  # the user's file first
    with pytest.raises(UserError, match="config file not found: nosuch.yaml"):
        raysim.load_config("nosuch.yaml")
    with pytest.raises(UserError):
        load_config("fdse/digits5.yaml")


# ----------------------------------------------------------------------------- the wheel

def test_the_wheel_in_a_clean_venv_imports_every_method_and_trains_a_lib_method_from_elsewhere(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_")) and k != "RAY_ADDRESS"}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")  # its own Ray, not the session's

    def sh(*cmd, cwd=tmp_path, timeout=120):
        r = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        assert r.returncode == 0, f"{cmd}: {r.stdout}\n{r.stderr}"
        return r.stdout

    # build from a copy of the sources, so no build/ or egg-info lands in the repository (and no
    # stale build/lib file slips into the wheel); offline, with this venv's setuptools
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, src / name)
    sh(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
       "-w", tmp_path / "dist", ".", cwd=src)
    (wheel,) = (tmp_path / "dist").glob("raysim-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = {n.removesuffix("/__init__.py") for n in names if n.endswith("/__init__.py")}
    assert packages == {p.removesuffix("/__init__.py") for p in source_files("__init__.py")}  # every package
    assert source_files(".py") <= names  # and every module of each
    assert {"raysim/methods/lib/__init__.py", "raysim/tuning/__init__.py"} <= names
    assert {"raysim/methods/README.md", "raysim/data/README.md"} <= names  # the contracts errors point to
    shipped = {n.removeprefix("raysim/configs/") for n in names if n.startswith("raysim/configs/")}
    assert shipped == yaml_files(ROOT / "configs")  # every shipped config, the quickstart among them
    examples = {n.removeprefix("raysim/examples/") for n in names if n.startswith("raysim/examples/")}
    assert examples == {p.name for p in (ROOT / "examples").iterdir() if p.is_file()}

    # a fresh venv that sees this venv's packages (torch, ray, ...) after its own, through a plain
    # path line: this venv's editable raysim (a finder that its own .pth installs) stays out
    venv = tmp_path / "venv"
    sh(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    purelib = Path(sh(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").strip())
    (purelib / "reuse-test-venv.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    sh(python, "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed", "--no-compile", "-q", wheel)

    # from elsewhere, in one process (torch is imported once): which raysim this is, the README's
    # Python example's config, `raysim methods` (it imports every registered method), and
    # `raysim new method --from fednova` (the shipped example)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "checks.py").write_text(
        "import raysim, raysim.app.shipped as s\n"
        "from raysim.cli import main\n"
        "print(raysim.__file__, s.shipped_configs(), s.shipped_examples())\n"
        "print(raysim.load_config('configs/quickstart.yaml').name)\n"
        "assert main(['methods']) == 0\n"
        "assert main(['new', 'method', 'my_nova', '--from', 'fednova', '--dir', 'mine']) == 0\n")
    where, name, *rest = sh(python, tmp_path / "checks.py", cwd=elsewhere).splitlines()
    assert all(Path(p).is_relative_to(venv) for p in where.split()), where  # the installed copy
    assert name == "quickstart"
    catalog = "\n".join(rest)
    assert "cannot import" not in catalog, catalog
    assert all(f"| {m} " in catalog for m in ("feddrop", "fedmp", "nefl", "dapperfl", "fdse", "csac")), catalog
    assert "quickstart" in next(line for line in catalog.splitlines() if line.startswith("| fedavg "))
    assert "wrote mine/my_nova_tune.yaml" in catalog
    assert "class MyNova(Method)" in (elsewhere / "mine" / "my_nova.py").read_text()

    # one round of FedDrop (sub-models from raysim.methods.lib) on the quickstart (no CONFIG) made
    # tiny, on Ray: the installed entry point, its own Ray instance, workers in the clean venv
    out = sh(venv / "bin" / "raysim", "run", "methods=[feddrop]", "rounds=1", "eval.every=1",
             "data.options.image_size=16", "data.partition.train_size=48", "train.batch_size=16",
             "tracking.tensorboard=false", "--out", "run",
             cwd=elsewhere, timeout=240)
    assert "run directory:" in out and "name: quickstart" in (elsewhere / "run" / "config.yaml").read_text()
    metrics = pq.read_table(elsewhere / "run" / "metrics.parquet").to_pandas()
    test = metrics[(metrics.split == "test") & (metrics.metric == "accuracy") & (metrics.domain == "AVG")]
    assert list(test["round"].unique()) == [1] and test.value.notna().all()
