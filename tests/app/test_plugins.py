"""Method plugins: a method in the user's own file, named ``module:Class`` (raysim.methods.registry).

* resolving one, and each mistake as one line (exit 2): missing module, missing class, not a
  method, a built-in's name, no name, a module that fails to import;
* its settings keyed by its class's name (``hp.<name>``, ``per_method.<name>``), its run folder;
* the module shipped to every Ray worker through the job's runtime_env (``py_modules``);
* raysim's own methods found through their entry points, each module imported only when asked for;
* the example FedNova (examples/fednova.py) from a folder outside the repository: ``raysim run`` on
  Ray actors with 2 hosts, and a 2-trial ``raysim tune`` whose workers can import the module only
  from what the driver shipped them. Its own hand-value tests (examples/test_fednova.py) run here too.
"""
import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from raysim.app import rundir
from raysim.app.configs import load_checked
from raysim.cli import main
from raysim.core.contract import Method
from raysim.core.errors import UserError
from raysim.engine import cluster
from raysim.methods import registry
from raysim.testing import TINY

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"

sys.path.insert(0, str(EXAMPLES))  # the example's own tests (a user's tests beside their method) run here too
from test_fednova import (test_a_norm_is_the_weight_momentum_sgd_gives_the_gradients,  # noqa: E402,F401
                          test_client_uploads_its_update_divided_by_its_local_steps,
                          test_equal_local_steps_give_fedavgs_mean,
                          test_server_step_rescales_the_average_of_the_normalised_updates)

PLUGINS = {
    "plug_ok.py": '''
from dataclasses import dataclass

from raysim.core.contract import Method
from raysim.core.hparams import Hparams
from raysim.core.settings import setting


@dataclass(frozen=True)
class MineHparams(Hparams):
    beta: float = setting(0.5, ge=0)


class Mine(Method):
    name = "mine"
    Hparams = MineHparams


class Clash(Method):
    name = "fedavg"


class Unnamed(Method):
    pass


class NotAMethod:
    pass


helper = 3
''',
    "plug_twin.py": "from raysim.core.contract import Method\n\n\nclass Twin(Method):\n    name = 'mine'\n",
    "plug_broken.py": "import no_such_dependency_xyz\n",
    "plug_raises.py": "x = 1\nraise RuntimeError('boom')\n",
    "plugpkg/__init__.py": "",
    "plugpkg/sub/__init__.py": "",
    "plugpkg/sub/mod.py": "from raysim.core.contract import Method\n\n\nclass Pkg(Method):\n    name = 'pkgmine'\n",
}


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    """A folder of plugin modules as the current directory (not on sys.path: the registry looks
    there itself); the modules and the path entry it adds are gone afterwards."""
    d = tmp_path / "plugins"
    for rel, text in PLUGINS.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text(text)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(d)
    yield d
    for name in [m for m in sys.modules if m.startswith(("plug_", "plugpkg"))]:
        del sys.modules[name]


# ----------------------------------------------------------------------------- resolving, and its errors

def test_a_plugin_resolves_from_the_current_directory(plugin_dir):
    cls = registry.get("plug_ok:Mine")
    assert issubclass(cls, Method) and cls.name == "mine" and registry.name_of("plug_ok:Mine") == "mine"
    assert registry.get("plugpkg.sub.mod:Pkg").name == "pkgmine"
    assert registry.name_of("fedavg") == "fedavg" and "plug_ok:Mine" not in registry.names()


@pytest.mark.parametrize("spec, message", [
    ("no_such_module_xyz:Thing", r"method 'no_such_module_xyz:Thing': no module named 'no_such_module_xyz' "
                                 r"\(looked on sys.path and in the current directory .*plugins\)"),
    ("plug_ok:Missing", r"module plug_ok \(.*plug_ok.py\) has no class Missing"),
    ("plug_ok:NotAMethod", r"plug_ok.NotAMethod is not a raysim method \(a subclass of raysim.core.contract.Method\)"),
    ("plug_ok:helper", r"plug_ok.helper is not a raysim method"),
    ("plug_ok:Clash", r"its name 'fedavg' is a built-in method's; give Clash a name of its own"),
    ("plug_ok:Unnamed", r"Unnamed.name = 'base'; give the class a name of its own"),
    ("plug_broken:Thing", r"importing plug_broken failed: ModuleNotFoundError: No module named 'no_such_dependency_xyz' "
                          r"\(.*plug_broken.py:1\)"),
    ("plug_raises:Thing", r"importing plug_raises failed: RuntimeError: boom \(.*plug_raises.py:2\)"),
    ("plug_ok:", r"expected a name or module:Class"),
    ("plug ok:Mine", r"expected a name or module:Class"),
])
def test_each_plugin_mistake_is_one_line_and_exit_2(plugin_dir, capsys, spec, message):
    with pytest.raises(UserError, match=message) as err:
        registry.get(spec)
    assert "\n" not in str(err.value)
    (plugin_dir / "c.yaml").write_text("rounds: 1\n")
    assert main(["run", "--check", "c.yaml", f"method={spec}"]) == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("raysim: error: ") and "Traceback" not in lines[0]


def test_a_broken_method_never_blocks_the_others(plugin_dir, monkeypatch):
    monkeypatch.syspath_prepend(str(plugin_dir))
    monkeypatch.setitem(registry._METHODS, "broken", "plug_raises:Thing")  # installed, but raises on import
    monkeypatch.setitem(registry._METHODS, "absent", "no_such_module_xyz:Thing")  # not installed: not listed
    assert "broken" in registry.names() and "absent" not in registry.names()
    with pytest.raises(RuntimeError, match="boom"):
        registry.get("broken")
    assert registry.get("fedavg").name == "fedavg"


# ----------------------------------------------------------------------------- keys and folders

def test_a_plugins_settings_and_folder_are_keyed_by_its_class_name(plugin_dir, monkeypatch):
    raw = {**TINY, "methods": ["fedavg", "plug_ok:Mine"], "hp": {"mine": {"beta": 0.25}},
           "per_method": {"mine": {"train": {"lr": 0.01}}}}
    cfg = load_checked(raw=raw, overrides=["hp.mine.beta=0.125"])
    assert cfg.method_names() == ["fedavg", "plug_ok:Mine"]
    plan = rundir.plan(cfg, "out")
    assert [sub for _, sub in plan] == [os.path.join("out", "fedavg"), os.path.join("out", "mine")]
    mine = plan[1][0]
    assert mine.method == "plug_ok:Mine" and mine.train.lr == 0.01 and plan[0][0].train.lr == TINY["train"]["lr"]

    from raysim import testing
    from raysim.engine.federation import Federation
    fed = Federation(mine)
    fed.__dict__["setup"] = testing.setup()  # what the method is built with, without loading the data
    assert type(fed.method).__name__ == "Mine" and fed.method.hp.beta == 0.125  # hp.mine reached the method

    with pytest.raises(UserError, match=r"hyperparameter 'hp.mine.beta' = -1.0: expected >= 0"):
        load_checked(raw={**raw, "hp": {"mine": {"beta": -1}}})
    with pytest.raises(UserError, match=r"'per_method.plug_ok:Mine': 'plug_ok:Mine' is not one of the run's "
                                        r"methods \['fedavg', 'mine'\]"):
        load_checked(raw={**raw, "per_method": {"plug_ok:Mine": {}}})
    with pytest.raises(UserError, match=r"hp.plug_ok:Mine': a method of your own is keyed by its class's name: hp.mine"):
        load_checked(raw={**raw, "hp": {"plug_ok:Mine": {"beta": 1.0}}})
    with pytest.raises(UserError, match=r"two of the methods .* have the same name"):
        load_checked(raw={**raw, "methods": ["plug_ok:Mine", "plug_twin:Twin"]})
    # a spec naming raysim's own class is that method
    assert registry.name_of("raysim.methods.fedavg:FedAvg") == "fedavg"


# ----------------------------------------------------------------------------- shipping to the workers

def test_a_plugin_is_shipped_in_the_jobs_runtime_env(plugin_dir):
    assert cluster.job_runtime_env(["fedavg", "fedbn"]) is None  # raysim's own: ray.init as ever
    assert cluster.job_runtime_env(["fedavg", "plug_ok:Mine"]) == {"py_modules": [str(plugin_dir / "plug_ok.py")]}
    # a module inside a package: the whole top-level package, so its own imports work on the workers
    assert cluster.job_runtime_env(["plugpkg.sub.mod:Pkg", "plug_ok:Mine"]) == {
        "py_modules": [str(plugin_dir / "plugpkg"), str(plugin_dir / "plug_ok.py")]}


def test_joining_a_cluster_or_starting_ray_hands_ray_init_the_runtime_env(plugin_dir, monkeypatch):
    """What raysim gives ray.init (faked): the plugin's module for a cluster it joins (every node
    gets it from there), nothing new for raysim's own methods on a local start."""
    import ray

    seen = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: seen.append(kw))
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(cluster, "_token_auth", lambda: None)
    monkeypatch.setattr(cluster, "probe_cluster", lambda address: None)  # as if a cluster answered there
    monkeypatch.setenv("RAY_AUTH_TOKEN", "f" * 64)
    with cluster.ray_session("10.0.0.1:6379", methods=["fedavg", "plug_ok:Mine"]):
        pass
    with cluster.ray_session(None, methods=["fedavg"]):
        pass
    assert seen[0]["address"] == "10.0.0.1:6379"
    assert seen[0]["runtime_env"] == {"py_modules": [str(plugin_dir / "plug_ok.py")]}
    assert "runtime_env" not in seen[1] and seen[1]["_node_ip_address"] == "127.0.0.1"


# ----------------------------------------------------------------------------- raysim's own methods

def test_every_method_module_is_reachable_by_its_entry_point():
    """Every Method subclass under methods/ that sets its own ``name`` is an entry point of that
    name (pyproject.toml), and every entry point resolves to a class of that name."""
    import raysim.methods as package

    root = Path(package.__file__).parent
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        module = importlib.import_module(".".join(("raysim.methods",) + parts[:-1 if parts[-1] == "__init__" else None]))
        for obj in vars(module).values():
            if (isinstance(obj, type) and issubclass(obj, Method) and obj.__module__ == module.__name__
                    and "name" in obj.__dict__):
                found[obj.name] = obj
    assert sorted(found) == registry.builtin_names()
    for name, cls in found.items():
        assert registry.get(name) is cls


def test_the_entry_point_table_reads_as_tomllib_reads_it():
    import tomllib

    text = (ROOT / "pyproject.toml").read_text()
    table = tomllib.loads(text)["project"]["entry-points"][registry.GROUP]
    assert registry.entry_point_table(text) == table and len(table) >= 30


def test_asking_for_a_method_imports_that_method_alone():
    code = ("import sys; from raysim.app.configs import load_checked; "
            "load_checked(raw={'method': 'fedprox', 'runtime': {'num_hosts': 1}}); "
            "print(sorted(m for m in sys.modules if m.startswith('raysim.methods.')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "['raysim.methods.fedprox', 'raysim.methods.registry']"


# ----------------------------------------------------------------------------- the example, end to end

# the example sized for a test: 16-pixel digits (the tuning tests' cache), 32 training images per
# domain, no TensorBoard files
SMALL = ["data.options.image_size=16", "data.options.n_render=1430", "data.partition.train_size=32",
         "tracking.tensorboard=false"]
RAY_START_TIMEOUT = "timed out during startup"  # Ray's fixed 30 s wait for its raylet, on a loaded machine


@pytest.fixture
def plugin_env(tmp_path_factory):
    os.environ.setdefault("RAYSIM_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in [str(ROOT), os.environ.get("PYTHONPATH", "")] if p)}
    env.pop("RAY_ADDRESS", None)
    return env


def run_cli(cmd, **kwargs) -> subprocess.CompletedProcess:
    for attempt in range(3):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kwargs)
        if r.returncode == 0 or RAY_START_TIMEOUT not in r.stderr:
            break
    return r


@pytest.mark.slow
def test_fednova_from_a_folder_outside_the_repository_runs_on_ray_actors(tmp_path, plugin_env):
    work = tmp_path / "work"
    (work / "configs").mkdir(parents=True)
    shutil.copy(EXAMPLES / "fednova.py", work)
    shutil.copy(ROOT / "configs" / "quickstart.yaml", work / "configs")
    # `python -P -m raysim` is the `raysim` console script: the current directory is not on sys.path
    r = run_cli([sys.executable, "-P", "-m", "raysim", "run", "configs/quickstart.yaml", "method=fednova:FedNova",
                 "rounds=2", "runtime.num_hosts=2", *SMALL, "eval.splits=[test]", "--out", "run", "--quiet"],
                cwd=work, env=plugin_env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    m = pd.read_parquet(work / "run" / "metrics.parquet")
    acc = m[(m.split == "test") & (m.metric == "accuracy") & (m["round"] == 2)]
    assert {"mnist", "mnistm", "usps", "synth", "svhn", "AVG"} <= set(acc.domain)
    assert acc.value.between(0, 1).all()
    assert '"num_hosts": 2' in (work / "run" / "hosts.json").read_text()
    assert "fednova (round 2)" in (work / "run" / "summary.md").read_text()


@pytest.mark.slow
def test_a_two_trial_tune_of_fednova_imports_it_only_from_what_the_driver_ships(tmp_path, plugin_env):
    """The driver alone has the module's folder on its sys.path (not its current directory, not
    PYTHONPATH, which Ray's local workers would inherit): the trials and the federations' actors
    in them import fednova from the job's runtime_env, as on the nodes of a cluster."""
    plugins, work = tmp_path / "plugins", tmp_path / "work"
    plugins.mkdir(), work.mkdir()
    shutil.copy(EXAMPLES / "fednova.py", plugins)
    shutil.copy(EXAMPLES / "fednova_tune.yaml", plugins)
    driver = ("import sys; sys.path.insert(0, sys.argv[1]); from raysim.cli import main; "
              "sys.exit(main(sys.argv[2:]))")
    r = run_cli([sys.executable, "-P", "-c", driver, str(plugins), "tune", str(plugins / "fednova_tune.yaml"),
                 "rounds=1", *SMALL, "eval.splits=[val]", "runtime.num_hosts=1", "max_concurrent=2",
                 "--out", str(work / "search")], cwd=work, env=plugin_env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    trials = pd.read_parquet(work / "search" / "trials.parquet")
    assert len(trials) == 2 and set(trials.stop_reason) == {"completed"}, trials.to_string()
    assert trials["train.lr"].nunique() == 2 and trials["val_avg_best"].notna().all()
