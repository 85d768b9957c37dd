"""Dataset plugins: a loader in the user's own file, named ``module:Loader`` (raysim.data).

* resolving one (a function, a class, a module in a package, a loader taking ``**options``), and
  each mistake as one line (exit 2): missing module, missing attribute, not callable, no ``seed``,
  a module that fails to import, an unknown or missing option, a result that is no dataset;
* an exception inside the loader's own code: its traceback and one line, exit 1 (a method's bug
  is reported the same way);
* ``raysim data show module:Loader key=value`` and ``raysim run --check``;
* datasets installed distributions register in the ``raysim.datasets`` entry-point group;
* the module shipped to every Ray worker: the job's runtime_env (``py_modules``) where raysim
  starts or joins Ray, the actors' own where the process was connected before (this session);
* done when: a plugin from a folder outside the repository, on the driver's ``sys.path`` alone,
  runs a federation on Ray actors with 2 hosts (the metrics of the same run in this process) and
  a one-trial ``raysim tune``, on the session's Ray instance (~25 s on 2 cores, nearly all of it
  Ray starting actors and Tune starting up; a built-in dataset's run costs the same).
"""
import sys
import textwrap

import numpy as np
import pandas as pd
import pytest

from raysim import data
from raysim.app.configs import load_checked
from raysim.cli import main
from raysim.core.errors import UserError
from raysim.engine import cluster

LOADERS = '''
import numpy as np

from raysim.data import ArraySplit, MultiDomainDataset
from raysim.data.splits import group_carve

CLASSES = ("dark", "light")


def load_small(root=None, seed: int = 0, image_size: int = 8, per_writer: int = 8):
    """Two domains of 3 writers each; a class is an image's brightness, a domain its contrast."""
    rng = np.random.default_rng(seed)
    splits = {}
    for d, domain in enumerate(("low", "high")):
        groups = np.repeat(np.arange(3) + 3 * d, per_writer)
        labels = rng.integers(0, 2, groups.size)
        level = 60 + 120 * labels + rng.integers(0, 20 + 40 * d, groups.size)
        images = np.broadcast_to(level[:, None, None, None], (groups.size, 3, image_size, image_size))
        images = (images + rng.integers(0, 30, images.shape)).astype(np.uint8)
        train, val, test = group_carve(groups, 0.25, 0.25, rng)
        splits[domain] = {name: ArraySplit(images[pos], labels[pos], (0.5,) * 3, (0.5,) * 3, groups=groups[pos])
                          for name, pos in (("train", train), ("val", val), ("test", test))}
    return MultiDomainDataset("small", splits, CLASSES)


class SmallData(MultiDomainDataset):
    def __init__(self, root, seed, image_size=6):
        made = load_small(root, seed, image_size)
        super().__init__("small-class", {d: {s: made.split(d, s) for s in ("train", "val", "test")}
                                         for d in made.domains}, made.classes)


def anything(root, seed, **options):
    return load_small(root, seed, image_size=options.get("image_size", 8))


def needs_writers(root, seed, writers):
    return load_small(root, seed)


def returns_arrays(root, seed):
    return np.zeros(3), np.zeros(3)


def no_seed(root):
    return load_small(root)


def buggy(root, seed, image_size=8):
    sizes = {"small": image_size}
    return load_small(root, seed, sizes["big"])


def says_no(root, seed):
    from raysim.core.errors import UserError
    raise UserError("no files under root")


helper = 3
'''

PLUGINS = {
    "dplug_ok.py": LOADERS,
    "dplug_broken.py": "import no_such_dependency_xyz\n",
    "dplug_raises.py": "x = 1\nraise RuntimeError('boom')\n",
    "dplugpkg/__init__.py": "",
    "dplugpkg/sub/__init__.py": "",
    "dplugpkg/sub/mod.py": "from dplugpkg.sub.helpers import load\n",
    "dplugpkg/sub/helpers.py": "from dplug_ok import load_small as load\n",
}


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    """A folder of loader modules outside the repository, as the current directory (not on
    sys.path: the loader looks there itself); the modules and the path entry it adds are gone
    afterwards."""
    folder = tmp_path / "plugins"
    for rel, text in PLUGINS.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(text)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(folder)
    yield folder
    for name in [m for m in sys.modules if m.startswith(("dplug_", "dplugpkg"))]:
        del sys.modules[name]


# ----------------------------------------------------------------------------- resolving, and its mistakes

def test_a_function_a_class_and_a_packaged_loader_resolve(plugin_dir):
    ds = data.load("dplug_ok:load_small", seed=3, image_size=5)
    assert ds.domains == ("low", "high") and ds.image_shape == (3, 5, 5) and ds.classes == ("dark", "light")
    train = ds.split("low", "train")
    assert train.groups is not None and set(ds.split("low", "test").groups) <= set(train.groups)
    again = data.load("dplug_ok:load_small", seed=3, image_size=5)
    assert np.array_equal(train.uint8, again.split("low", "train").uint8)  # the seed decides the data
    assert data.load("dplug_ok:SmallData", seed=0).image_shape == (3, 6, 6)
    assert data.load("dplugpkg.sub.mod:load", seed=0).name == "small"
    assert data.load("dplug_ok:anything", seed=0, image_size=4, whatever=1).image_shape == (3, 4, 4)
    assert data.options("dplug_ok:load_small") == {"image_size": 8, "per_writer": 8}
    assert data.is_plugin("dplug_ok:load_small") and not data.is_plugin("digits5")
    assert "dplug_ok:load_small" not in data.available()


@pytest.mark.parametrize("spec, options, message", [
    ("no_such_module_xyz:load", {}, r"dataset 'no_such_module_xyz:load': no module named 'no_such_module_xyz' "
                                    r"\(looked on sys.path and in the current directory .*plugins\)"),
    ("dplug_broken:load", {}, r"importing dplug_broken failed: ModuleNotFoundError: No module named "
                              r"'no_such_dependency_xyz' \(.*dplug_broken.py:1\)"),
    ("dplug_raises:load", {}, r"importing dplug_raises failed: RuntimeError: boom \(.*dplug_raises.py:2\)"),
    ("dplug_ok:missing", {}, r"module dplug_ok \(.*dplug_ok.py\) has no attribute missing"),
    ("dplug_ok:helper", {}, r"dplug_ok.helper is an int, not a loader: expected a function or class called as "
                            r"helper\(root, seed, \*\*options\)"),
    ("dplug_ok:no_seed", {}, r"dplug_ok.no_seed\(root\) does not take seed: a loader is called as "
                             r"no_seed\(root=data.root, seed="),
    ("dplug_ok:returns_arrays", {}, r"dataset 'dplug_ok:returns_arrays': its loader returned a tuple, not a "
                                    r"raysim.data.MultiDomainDataset"),
    ("dplug_ok:load_small", {"size": 3}, r"dataset 'dplug_ok:load_small' has no option\(s\) size; valid: "
                                         r"image_size, per_writer"),
    ("dplug_ok:needs_writers", {}, r"dataset 'dplug_ok:needs_writers' needs option\(s\) writers .*: set "
                                   r"data.options.writers"),
    ("dplug_ok:says_no", {}, r"^no files under root$"),  # the contract's own one-line error
    ("dplug ok:load", {}, r"expected a dataset's name or module:Loader"),
    ("nosuch", {}, r"unknown dataset 'nosuch'; available: digits5, .*; or a loader of your own file: module:function"),
])
def test_each_mistake_is_one_line_and_exit_2(plugin_dir, capsys, spec, options, message):
    with pytest.raises(UserError, match=message) as err:
        data.load(spec, **options)
    assert "\n" not in str(err.value)
    (plugin_dir / "c.yaml").write_text("rounds: 1\n")
    given = [f"data.options.{k}={v}" for k, v in options.items()]
    assert main(["run", "--check", "c.yaml", f"data.dataset={spec}", "data.options={}", *given]) == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("raysim: error: ") and "Traceback" not in lines[0], lines


def test_an_exception_inside_the_loader_is_its_bug_with_its_traceback(plugin_dir, capsys):
    """Not the config's mistake: the traceback from the loader's own frame, then one line, exit 1
    (as a method's bug), from ``raysim data show`` and ``raysim run --check`` alike."""
    with pytest.raises(data.LoaderFailed, match=r"its loader raised KeyError: 'big' \(.*dplug_ok.py:\d+\)") as err:
        data.load("dplug_ok:buggy")
    assert isinstance(err.value.__cause__, KeyError)
    (plugin_dir / "c.yaml").write_text("rounds: 1\ndata: {dataset: 'dplug_ok:buggy', options: {}}\n")
    for argv in (["data", "show", "dplug_ok:buggy"], ["run", "--check", "c.yaml"]):
        assert main(argv) == 1
        text = capsys.readouterr().err
        assert text.startswith("Traceback (most recent call last):\n") and 'dplug_ok.py", line' in text
        assert 'sizes["big"]' in text and "raysim/data/__init__.py" not in text  # the loader's frames only
        last = text.rstrip().splitlines()[-1]
        assert last.startswith("raysim: dataset 'dplug_ok:buggy': its loader raised KeyError"), text


def test_data_show_and_run_check_take_a_plugin(plugin_dir, capsys, monkeypatch):
    assert main(["data", "show", "dplug_ok:load_small", "image_size=4", "per_writer=4"]) == 0
    out = capsys.readouterr().out
    assert "dataset small: 2 domains, 2 classes, image 3x4x4" in out and "high" in out
    assert main(["data", "show", "dplug_ok:load_small", "nope.x=1"]) == 2
    (plugin_dir / "c.yaml").write_text(textwrap.dedent("""\
        rounds: 1
        data: {dataset: 'dplug_ok:load_small', options: {image_size: 4}, partition: {kind: per_domain}}
        runtime: {num_hosts: 2}
    """))
    assert main(["run", "--check", "c.yaml"]) == 0
    out = capsys.readouterr().out
    assert "dataset: dplug_ok:load_small" in out and "# checked without training: 1 federation, 2 clients each" in out
    # each check calls the loader again: unlike a built-in generated dataset's, a plugin's clients
    # are not remembered for the process (its code or the files it reads may change in between)
    import dplug_ok

    original, calls = dplug_ok.load_small, []
    monkeypatch.setattr(dplug_ok, "load_small", lambda **kw: calls.append(1) or original(**kw))
    assert main(["run", "--check", "c.yaml"]) == main(["run", "--check", "c.yaml"]) == 0 and len(calls) == 2


# ----------------------------------------------------------------------------- installed distributions

def test_an_installed_distribution_adds_datasets_by_entry_point(plugin_dir, monkeypatch):
    """A distribution's ``[project.entry-points."raysim.datasets"]`` (its dist-info's
    entry_points.txt): a name of its own works like raysim's; raysim's own names win a clash."""
    site = plugin_dir.parent / "site"
    info = site / "dplug_dist-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dplug-dist\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[raysim.datasets]\nwriters_small = dplug_ok:load_small\n"
                                          "digits5 = dplug_ok:returns_arrays\nbroken = dplug_ok:no_seed\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.syspath_prepend(str(plugin_dir))
    assert data.available()[:len(data._REGISTRY)] == list(data._REGISTRY)
    assert {"writers_small", "broken"} <= set(data.available()) and data.available().count("digits5") == 1
    assert data.describe()["writers_small"] == "dplug_ok:load_small (installed with dplug-dist)"
    assert data.load("writers_small", seed=0, image_size=4).image_shape == (3, 4, 4)
    assert data.options("writers_small") == {"image_size": 8, "per_writer": 8}
    assert data.loader("digits5").__module__ == "raysim.data.digits5"
    with pytest.raises(UserError, match=r"dataset 'broken' \(raysim.datasets entry point dplug_ok:no_seed of "
                                        r"dplug-dist\): dplug_ok.no_seed\(root\) does not take seed"):
        data.load("broken")
    assert cluster.job_runtime_env(datasets=["writers_small"]) is None  # installed: the cluster's environment has it


# ----------------------------------------------------------------------------- shipping

def test_a_plugin_is_shipped_in_the_jobs_runtime_env(plugin_dir):
    assert cluster.job_runtime_env(["fedavg"], ["digits5", "rotated_mnist"]) is None  # raysim's own: as ever
    assert cluster.job_runtime_env(["fedavg"], ["dplug_ok:load_small"]) == {
        "py_modules": [str(plugin_dir / "dplug_ok.py")]}
    # a module in a package: the whole top-level package; the loader it re-exports, its own module too
    assert cluster.job_runtime_env(datasets=["dplugpkg.sub.mod:load"]) == {
        "py_modules": [str(plugin_dir / "dplugpkg"), str(plugin_dir / "dplug_ok.py")]}


def test_joining_a_cluster_hands_ray_init_the_datasets_runtime_env(plugin_dir, monkeypatch):
    """What raysim gives ray.init (faked) when it joins a cluster: the plugin's module, which
    every node then gets from there."""
    import ray

    seen = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: seen.append(kw))
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(cluster, "_token_auth", lambda: None)
    monkeypatch.setattr(cluster, "probe_cluster", lambda address: None)
    monkeypatch.setenv("RAY_AUTH_TOKEN", "f" * 64)
    with cluster.ray_session("10.0.0.1:6379", methods=["fedavg"], datasets=["dplug_ok:load_small"]):
        assert cluster.shipped_plugins() is None  # the job carries it: the actors need nothing of their own
    assert seen[0]["runtime_env"] == {"py_modules": [str(plugin_dir / "dplug_ok.py")]}


# ----------------------------------------------------------------------------- done when: on Ray actors, and in tune

RUN = {
    "method": "fedavg", "rounds": 1, "seed": 0,
    "data": {"dataset": "dplug_ok:load_small", "options": {"image_size": 8}, "partition": {"kind": "per_domain"}},
    "model": {"name": "small_cnn", "norm": "bn"},
    "train": {"epochs": 1, "batch_size": 8, "lr": 0.05},
    "eval": {"every": 1, "splits": ["val", "test"]},
    "runtime": {"num_hosts": 2, "cpus_per_host": 0.5},
    "tracking": {"tensorboard": False},
}


def test_a_plugin_from_outside_the_repository_runs_on_two_hosts_and_in_tune(ray_session, tmp_path, plugin_dir,
                                                                           monkeypatch):
    """The module is on this driver's sys.path alone: the session's Ray workers started before it
    existed (and with another current directory), so they import it only from what raysim ships."""
    from raysim.app.experiment import run
    from raysim.tuning.search import run_search
    from raysim.tuning.spec import load_spec

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(plugin_dir))

    @ray_session.remote(num_cpus=0)
    def importable() -> bool:
        import importlib.util
        return importlib.util.find_spec("dplug_ok") is not None

    assert ray_session.get(importable.remote()) is False

    run(load_checked(raw=RUN), out=str(tmp_path / "on_ray"), progress=False)
    run(load_checked(raw=RUN), out=str(tmp_path / "here"), progress=False, debug=True)  # in this process
    on_ray, here = (pd.read_parquet(tmp_path / d / "metrics.parquet") for d in ("on_ray", "here"))
    assert '"num_hosts": 2' in (tmp_path / "on_ray" / "hosts.json").read_text()
    acc = on_ray[(on_ray.split == "test") & (on_ray.metric == "accuracy") & (on_ray["round"] == 1)]
    assert {"low", "high", "AVG"} <= set(acc.domain) and acc.value.between(0, 1).all()
    columns = ["round", "split", "domain", "client", "metric", "value"]
    key = ["round", "split", "domain", "client", "metric"]
    assert on_ray[columns].sort_values(key).reset_index(drop=True).equals(
        here[columns].sort_values(key).reset_index(drop=True))

    one_host = {**RUN, "runtime": {"num_hosts": 1, "cpus_per_host": 0.5}}  # the trial's own actors, as lean as can be
    spec = load_spec(raw={"name": "dplug-tune", "method": "fedavg", "experiment": one_host, "trials": 1,
                          "max_concurrent": 1, "scheduler": "none", "sampler": {"kind": "random", "seed": 0},
                          "space": {"train.lr": {"loguniform": [0.01, 0.1]}}})
    result = run_search(spec, str(tmp_path / "search"), echo=lambda line: None)
    assert result["exit_code"] == 0
    trials = pd.read_parquet(tmp_path / "search" / "trials.parquet")
    assert len(trials) == 1 and set(trials.stop_reason) == {"completed"} and trials["val_avg_best"].notna().all()
    assert ray_session.get(importable.remote()) is False  # the workers' own sys.path never held it
    assert cluster.shipped_plugins() is None  # nothing left behind for the session's next runs


@pytest.mark.slow
def test_raysim_run_and_tune_ship_a_plugin_in_the_jobs_runtime_env(tmp_path, plugin_dir):
    """The same, through the commands with a Ray instance of their own (``ray.init`` given the job's
    runtime_env): the driver alone has the plugin's folder on its sys.path (not its current
    directory, not PYTHONPATH, which Ray's local workers would inherit)."""
    import json
    import os
    import subprocess

    import yaml

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in [root, os.environ.get("PYTHONPATH", "")] if p)}
    env.pop("RAY_ADDRESS", None)
    work = tmp_path / "work"
    work.mkdir()
    (work / "run.yaml").write_text(yaml.safe_dump(RUN))
    tune = {"name": "dplug-tune", "method": "fedavg", "experiment": {**RUN, "runtime": {"num_hosts": 1}},
            "trials": 2, "max_concurrent": 2, "scheduler": "none", "sampler": {"kind": "random", "seed": 0},
            "space": {"train.lr": {"loguniform": [0.01, 0.1]}}}
    (work / "tune.yaml").write_text(yaml.safe_dump(tune))
    driver = "import sys; sys.path.insert(0, sys.argv[1]); from raysim.cli import main; sys.exit(main(sys.argv[2:]))"
    for argv in (["run", "run.yaml", "--out", "run", "--quiet"], ["tune", "tune.yaml", "--out", "search"]):
        r = subprocess.run([sys.executable, "-P", "-c", driver, str(plugin_dir), *argv], cwd=work, env=env,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert json.loads((work / "run" / "hosts.json").read_text())["num_hosts"] == 2
    metrics = pd.read_parquet(work / "run" / "metrics.parquet")
    assert {"low", "high", "AVG"} <= set(metrics.domain)
    trials = pd.read_parquet(work / "search" / "trials.parquet")
    assert len(trials) == 2 and set(trials.stop_reason) == {"completed"}, trials.to_string()
