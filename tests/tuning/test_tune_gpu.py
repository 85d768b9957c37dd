"""Fractional GPUs inside each trial's placement group, on a Ray instance with logical GPUs.

The search runs in a subprocess with its own Ray (2 CPUs, 2 logical GPUs); a worker setup hook
records, in every ClientHost, the placement group it runs in and the resources Ray assigned it.
Two trials run at once, each a federation of 2 hosts x (0.25 CPU, 0.5 GPU).
"""
import json
import sys
import textwrap

import pytest

from tunehelp import run_retrying_ray_start

SCRIPT = textwrap.dedent('''
    import json, os, sys
    import ray

    PROBE = sys.argv[2]

    def probe():
        import raysim.engine.host as host
        original = host.ClientHost.start

        def start(self):
            out = original(self)
            ctx = ray.get_runtime_context()
            record = {"host": self.host_id, "pg": ctx.get_placement_group_id(),
                      "assigned": ctx.get_assigned_resources(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                      "device": str(self.device), "pid": os.getpid()}
            with open(os.path.join(PROBE, f"host-{os.getpid()}-{self.host_id}.json"), "w") as fh:
                json.dump(record, fh)
            return out

        host.ClientHost.start = start

    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             logging_level="ERROR", runtime_env={"worker_process_setup_hook": probe})
    from raysim.tuning.search import run_search
    from raysim.tuning.spec import load_spec

    experiment = json.loads(sys.argv[3])
    experiment["rounds"] = 1
    experiment["runtime"] = {"num_hosts": 2, "cpus_per_host": 0.25, "gpus_per_host": 0.5}
    spec = load_spec(raw={"method": "fedprox", "trials": 2, "max_concurrent": 2, "scheduler": "none",
                          "sampler": {"kind": "random", "seed": 1}, "experiment": experiment,
                          "space": {"train.lr": {"loguniform": [0.01, 0.1]}}})
    result = run_search(spec, sys.argv[1])
    print("EXIT", result["exit_code"])
''')


@pytest.mark.slow
def test_each_trials_hosts_get_their_gpu_share_inside_the_trials_group(tmp_path, cache_env, tiny_experiment):
    out, probe = tmp_path / "search", tmp_path / "probe"
    probe.mkdir()
    script = tmp_path / "gpu_search.py"
    script.write_text(SCRIPT)
    r = run_retrying_ray_start([sys.executable, str(script), str(out), str(probe), json.dumps(tiny_experiment())],
                               env=cache_env, cwd=tmp_path, timeout=900)
    assert "EXIT 0" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]

    trials = {}
    for run_dir in (out / "trials").iterdir():
        info = json.loads((run_dir / "placement.json").read_text())
        assert info["bundles"][1:] == [{"CPU": 0.25, "GPU": 0.5}] * 2  # one bundle per host
        assert info["bundles"][0].get("GPU", 0) == 0  # the trial itself holds no GPU
        trials[info["placement_group"]] = run_dir.name
    assert len(trials) == 2  # two trials, two placement groups

    hosts = [json.loads(p.read_text()) for p in probe.glob("host-*.json")]
    assert len(hosts) == 4, hosts  # 2 trials x 2 hosts
    by_group = {}
    for h in hosts:
        assert h["pg"] in trials, (h, trials)  # inside its own trial's group
        assert h["assigned"].get("GPU") == pytest.approx(0.5) and h["assigned"].get("CPU") == pytest.approx(0.25)
        assert len(h["gpu_ids"]) == 1 and h["device"] == "cpu"  # logical GPUs: torch stays on the CPU
        by_group.setdefault(h["pg"], []).append(h["host"])
    assert all(sorted(v) == [0, 1] for v in by_group.values()), by_group
