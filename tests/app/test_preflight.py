"""Mistakes found without training (raysim.app.preflight): `raysim run --check` refuses each in one
line, exit 2; `raysim run` refuses it the same way before Ray starts and before any run folder
exists; a run that a user error still stops before its first round leaves no folder behind."""
import json
import os
import subprocess
import sys

import pytest
import yaml

from raysim.app.configs import load_checked
from raysim.app.experiment import run
from raysim.app.preflight import preflight
from raysim.core.errors import UserError

# rotated_mnist: generated in a fraction of a second, no cache; 6 domains of ~660 training images
TINY = {"method": "fedavg", "rounds": 1, "seed": 0,
        "data": {"dataset": "rotated_mnist", "options": {"image_size": 8}, "partition": {"kind": "per_domain"}},
        "model": {"name": "small_cnn"}, "train": {"max_steps": 1, "batch_size": 8},
        "runtime": {"num_hosts": 1, "cpus_per_host": 1}}
CPUS = os.cpu_count()

MISTAKES = {  # the four of issue 38: (overrides, what the one line says)
    "unknown dataset": (["data.dataset=nosuch"], "unknown dataset 'nosuch'; available: digits5, "),
    "partition larger than the data": (["data.partition.train_size=100000"],
                                       "partition: 1 clients x 100000 train images exceed domain '0''s "),
    "more hosts than CPUs": ([f"data.partition={{kind: cross_device, num_clients: {max(CPUS + 1, 6)}}}",
                              f"runtime.num_hosts={CPUS + 1}"],
                             f"the federation needs {CPUS + 1} CPUs, {CPUS + 1} hosts x 1 (runtime.cpus_per_host), "
                             f"but this machine has {CPUS}; lower runtime.num_hosts"),
    "clients_per_round above the clients": (["clients_per_round=7"],
                                            "clients_per_round = 7 but the federation has 6 clients"),
}

# Each command runs through raysim's own entry point in one fresh process (no Ray in it, as in a
# shell), its stderr and seconds recorded; ray.init is wrapped only to record that it was called.
DRIVER = r"""
import contextlib, io, json, sys, time
import ray
from raysim.cli import main
started, init = [], ray.init
ray.init = lambda *a, **k: started.append(1) or init(*a, **k)
out = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()) as text:
        code = main(argv)
    out.append({"argv": argv, "code": code, "stderr": err.getvalue(), "stdout": text.getvalue(),
                "seconds": round(time.perf_counter() - t0, 2), "ray_started": bool(started)})
print(json.dumps(out))
"""


def tiny_config(folder) -> str:
    path = os.path.join(folder, "tiny.yaml")
    with open(path, "w") as fh:
        yaml.safe_dump(TINY, fh)
    return path


def in_fresh_process(commands: list[list[str]], cwd) -> list[dict]:
    proc = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(commands)], capture_output=True, text=True,
                          cwd=cwd, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for r in results:
        print(f"{r['code']}  {r['seconds']:5.2f} s  {' '.join(r['argv'][2:])}: {r['stderr'].strip()[:100]}")
    return results


def test_each_mistake_is_one_line_before_ray_and_before_a_folder(tmp_path):
    """--check and run refuse each of the four mistakes in one line, exit 2, without starting Ray
    or leaving a folder (run without --out would write runs/<name>-<time>/ in the cwd); the
    quickstart still passes --check, as does runtime.num_hosts=64 on a 1-client federation (the
    hosts it would use: one)."""
    config = tiny_config(tmp_path)
    commands = [["run", "--check", config, *over] for over, _ in MISTAKES.values()]
    commands += [["run", config, *over, "--quiet"] for over, _ in MISTAKES.values()]
    commands += [["run", "--check"], ["run", "--check", config, "runtime.num_hosts=64", "data.partition.domains=['0']"]]
    results = in_fresh_process(commands, cwd=tmp_path)
    for r, (name, (_, line)) in zip(results, [*MISTAKES.items(), *MISTAKES.items()]):
        lines = [ln for ln in r["stderr"].splitlines() if ln.strip()]
        assert r["code"] == 2 and len(lines) == 1, (name, r)
        assert lines[0].startswith("raysim: error: " + line), (name, lines[0])
    quickstart, capped = results[-2:]
    assert quickstart["code"] == 0 and quickstart["stderr"] == "", quickstart
    assert "name: quickstart" in quickstart["stdout"]
    assert "# checked without training: 4 federations, 5 clients each" in quickstart["stdout"]
    assert capped["code"] == 0 and "1 clients each, at most 1 of this machine's" in capped["stdout"], capped
    assert not any(r["ray_started"] for r in results)
    assert sorted(os.listdir(tmp_path)) == ["tiny.yaml"]  # no runs/ folder


def test_the_dataset_root_and_layout_are_checked(tmp_path):
    """A real dataset: its data.root exists and holds the layout its loader reads (only listed)."""
    def check(*overrides):
        return preflight(load_checked(raw=TINY, overrides=list(overrides)))

    with pytest.raises(UserError, match=rf"imagefolder: folder {tmp_path}/none does not exist"):
        check("data.dataset=imagefolder", f"data.root={tmp_path}/none", "data.options={}")
    with pytest.raises(UserError, match=r"pacs: .* does not look like the dataset; expected folders"):
        check("data.dataset=pacs", f"data.root={tmp_path}", "data.options={}")
    with pytest.raises(UserError, match=r"dataset 'rotated_mnist' cannot be loaded with data.options = "
                                        r"\{'image_size': 'big'\}: ValueError: "):
        check("data.options.image_size=big")
    # the folder layout with 2 domains x 2 classes x 5 files: 2 clients, no image is opened
    for domain in ("a", "b"):
        for cls in ("x", "y"):
            os.makedirs(tmp_path / "imgs" / domain / cls)
            for i in range(5):
                (tmp_path / "imgs" / domain / cls / f"{i}.png").write_bytes(b"not an image")
    checked = check("data.dataset=imagefolder", f"data.root={tmp_path / 'imgs'}", "data.options={}")
    assert checked.federations == 1 and checked.clients == [2]
    with pytest.raises(UserError, match=r"partition: 20 clients exceed domain 'a''s \d+ train images"):
        check("data.dataset=imagefolder", f"data.root={tmp_path / 'imgs'}", "data.options={}",
              "data.partition.clients_per_domain=20")


def test_every_federation_of_a_comparison_is_checked():
    """A method's own settings (per_method) and each held-out domain are checked too; the line
    names the federation where federations differ."""
    raw = {**TINY, "method": None, "methods": ["fedavg", "fedbn"],
           "per_method": {"fedbn": {"data": {"partition": {"kind": "per_domain", "train_size": 5000}}}}}
    with pytest.raises(UserError, match=r"^method fedbn: partition: 1 clients x 5000 train images exceed"):
        preflight(load_checked(raw=raw))
    lodo = load_checked(raw={**TINY, "eval": {"protocol": "lodo", "holdout": "all"}, "clients_per_round": 5})
    checked = preflight(lodo)
    assert checked.federations == 6 and checked.clients == [5] * 6  # 5 source domains each
    with pytest.raises(UserError, match=r"^holdout 0: clients_per_round = 6 but the federation has 5 clients"):
        preflight(load_checked(raw={**TINY, "eval": {"protocol": "lodo", "holdout": "all"}, "clients_per_round": 6}))


def test_a_user_error_before_the_first_round_leaves_no_folder(ray_session, tmp_path):
    """A mistake only training shows (a loss that diverges in round 1) still stops the run in one
    line; the folder this command made, which holds nothing but its config, is removed, runs/ with
    it. (A folder that was there before is kept: test_experiment's NaN test.)"""
    cfg = load_checked(raw=TINY, overrides=["train.lr=1e30", "train.momentum=0.0", "train.max_steps=5",
                                            "data.partition.domains=['0']"])
    with pytest.raises(UserError, match=r"loss became nan for client 0 \(domain 0\) in round 1"):
        run(cfg, out=str(tmp_path / "runs" / "diverged"), progress=False)
    assert os.listdir(tmp_path) == []
