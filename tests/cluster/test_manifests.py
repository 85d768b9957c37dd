"""cluster/: the launcher YAML and the KubeRay RayJob manifests parse, carry the fields their tools
require, ask for GPUs on the workers, pin the Ray version raysim pins, and their `raysim`
entrypoints are valid commands for this checkout (no cloud is reachable here, so this is what
can be checked)."""
import re
import shlex
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "cluster"


def load(name):
    with open(CLUSTER / name, encoding="utf-8") as fh:
        return yaml.safe_load(fh)


def pinned_ray() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    return re.search(r'"ray\[tune\]==([0-9.]+)"', text).group(1)


def entrypoint(cmd: str, sub: str) -> tuple[str, list[str], dict]:
    """(config path, key=value overrides, --options) of `raysim SUB [--opt value] CONFIG [k=v ...]`."""
    words = shlex.split(cmd)
    assert words[:2] == ["raysim", sub], cmd
    opts, rest, i = {}, [], 2
    while i < len(words):
        if words[i].startswith("--"):
            opts[words[i]] = words[i + 1]
            i += 2
        else:
            rest.append(words[i])
            i += 1
    assert rest and "=" not in rest[0], f"no CONFIG in {cmd!r}"
    assert all("=" in w for w in rest[1:]), f"argparse takes the options before CONFIG: {cmd!r}"
    return rest[0], rest[1:], opts


def test_cluster_launcher_yaml():
    cfg = load("aws-gpu.yaml")
    for key in ("cluster_name", "provider", "available_node_types", "head_node_type", "setup_commands"):
        assert cfg.get(key), f"aws-gpu.yaml lacks {key}"
    assert cfg["provider"]["type"] == "aws" and cfg["provider"]["region"]
    types = cfg["available_node_types"]
    assert cfg["head_node_type"] in types
    gpu_families = ("g4dn.", "g5.", "g6.", "g6e.", "p3.", "p4d.", "p4de.", "p5.")
    gpu_types = [name for name, t in types.items()
                 if t["node_config"]["InstanceType"].startswith(gpu_families) or t.get("resources", {}).get("GPU")]
    assert gpu_types and cfg["head_node_type"] not in gpu_types
    for name in gpu_types:
        t = types[name]
        assert 0 <= t.get("min_workers", 0) <= t["max_workers"] <= cfg["max_workers"]
        assert t["node_config"]["ImageId"]
    # this checkout is copied to the nodes and installed there
    mounts = cfg["file_mounts"]
    target = next(remote for remote, local in mounts.items() if local == ".")
    assert any("pip install" in c and target in c for c in cfg["setup_commands"])
    assert f"ray:{pinned_ray()}-py311" in cfg["docker"]["image"]
    assert any("RAY_AUTH_MODE=token" in c for c in cfg["head_start_ray_commands"])
    assert any("RAY_AUTH_MODE=token" in c for c in cfg["worker_start_ray_commands"])


def _containers(group):
    spec = group["template"]["spec"]
    assert spec["containers"], "a pod template without containers"
    return spec["containers"]


@pytest.mark.parametrize("name, sub", [("rayjob-run.yaml", "run"), ("rayjob-tune.yaml", "tune")])
def test_rayjob_manifest(name, sub):
    job = load(name)
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    assert job["metadata"]["name"]
    spec = job["spec"]
    assert f"raysim {sub}" in spec["entrypoint"]
    assert spec.get("shutdownAfterJobFinishes") is True
    rc = spec["rayClusterSpec"]
    assert rc["rayVersion"] == pinned_ray()
    head = rc["headGroupSpec"]
    assert isinstance(head["rayStartParams"], dict)
    assert all(isinstance(v, str) for v in head["rayStartParams"].values()), "rayStartParams values are strings"
    head_images = {c["image"] for c in _containers(head)}
    workers = rc["workerGroupSpecs"]
    assert workers
    for g in workers:
        assert g["groupName"] and isinstance(g["rayStartParams"], dict)
        assert 0 <= g.get("minReplicas", 0) <= g["replicas"] <= g["maxReplicas"]
        gpus = [float(c["resources"]["limits"].get("nvidia.com/gpu", 0)) for c in _containers(g)]
        assert max(gpus) > 0, f"worker group {g['groupName']} asks for no GPU"
        assert {c["image"] for c in _containers(g)} == head_images, "head and workers run different images"
    assert any(c["image"].endswith(":0.1.0") for c in _containers(head))


def test_rayjob_entrypoints_are_valid_commands():
    """The manifests' configs exist in this checkout and their overrides type-check."""
    from raysim.config import load_config
    from raysim.tuning.spec import load_spec

    path, overrides, opts = entrypoint(load("rayjob-run.yaml")["spec"]["entrypoint"], "run")
    cfg = load_config(ROOT / path, overrides)
    assert cfg.data.shards.startswith("s3://") and cfg.runtime.gpus_per_host > 0
    assert opts["--out"].startswith("/results")

    path, overrides, opts = entrypoint(load("rayjob-tune.yaml")["spec"]["entrypoint"], "tune")
    spec = load_spec(ROOT / path, overrides)
    assert spec.trials >= 1 and spec.base_config().runtime.gpus_per_host > 0
    assert opts["--out"].startswith("/results")
    # the search directory is shared by every pod (trials write from the nodes that run them)
    job = load("rayjob-tune.yaml")["spec"]["rayClusterSpec"]
    for group in [job["headGroupSpec"], *job["workerGroupSpecs"]]:
        mounts = {m["mountPath"] for c in _containers(group) for m in c.get("volumeMounts", [])}
        assert "/results" in mounts


def test_dockerfile_and_readme():
    docker = (CLUSTER / "Dockerfile").read_text()
    assert f"FROM rayproject/ray:{pinned_ray()}-py311-gpu" in docker and "pip install" in docker
    readme = (CLUSTER / "README.md").read_text()
    for ref in ("aws-gpu.yaml", "rayjob-run.yaml", "rayjob-tune.yaml", "ray job submit", "data.shards",
                "runtime.gpus_per_host", "1M clients"):
        assert ref in readme, f"cluster/README.md does not mention {ref}"


def test_the_dockerfile_copies_everything_the_wheel_is_built_from():
    """The image builds the wheel from its COPY lines: a source the build reads but the image lacks
    (setup.py's package list, the shipped examples) fails the build."""
    import ast
    import re

    install_test = CLUSTER.parent / "tests" / "app" / "test_install.py"
    SOURCES = next(ast.literal_eval(node.value) for node in ast.parse(install_test.read_text()).body
                   if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "SOURCES")
    copied = set()
    for line in (CLUSTER / "Dockerfile").read_text().splitlines():
        if re.match(r"COPY\b", line):
            copied.update(p.rstrip("/") for p in line.split()[1:-1] if not p.startswith("--"))
    assert set(SOURCES) <= copied, f"cluster/Dockerfile does not COPY {sorted(set(SOURCES) - copied)}"
