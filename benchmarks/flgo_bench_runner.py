"""The FLGo arm of the benchmark harness: a workload spec on FLGo's simulator (``flgo.init(...).run()``).

Runs inside FLGo's virtual environment (``benchmarks/.venv-flgo``, made by ``flgo_env.py``, the
one the cross-check uses):

    benchmarks/.venv-flgo/bin/python benchmarks/flgo_bench_runner.py SPEC.json OUT_DIR

FLGo runs a round in one process: the server deep-copies its model into a package for each
sampled client, the client trains the copy with FLGo's ``BasicClient.train`` (its DataLoader, the
calculator's cross-entropy and SGD), and the server aggregates the returned models; FLGo's
system simulator (ideal availability, connectivity and responsiveness) and virtual clock run
around each round. One torch thread (FLGo's default ``num_parallels=1`` runs the clients one
after another). What this file gives FLGo is the plumbing FLGo asks a user to write, and the
pieces that make the computation the plain loop's:

* a benchmark (``<name>.core``: ``TaskPipe`` + FLGo's ``GeneralCalculator``): client k's training
  set is a ``torch.utils.data.Subset`` of its domain's normalised training images (the tensors the
  plain loop indexes), at the positions raysim's partition gives client k;
* a model module: an ``FModule`` holding the spec's raysim model (``features``/``head``, the same
  state-dict keys), loaded with the plain loop's seeded initial weights;
* the algorithm: a module whose ``Server`` subclasses FLGo's ``BasicServer`` with two methods
  replaced: ``sample`` returns raysim's sample of the round (FLGo's own draws with numpy's global
  generator), and ``aggregate`` takes the n_k-weighted mean of the clients' state dicts in float64,
  rounded to each tensor's dtype (the plain loop's ``weighted_mean``; FLGo's ``aggregate='other'``
  computes the same weighted mean in float32 FModule arithmetic and scales BN's
  num_batches_tracked by the weights); the ``Client`` is FLGo's ``BasicClient``;
* each client's DataLoader visits its examples in the plain loop's order,
  ``torch.randperm(n, generator_for(seed, round, client, "train"))`` (FLGo shuffles with torch's
  global generator), as ``flgo_runner.py``'s ``batch_order: raysim`` diagnostic does.

With those, the final weights equal the plain loop's bit for bit. Round times: the server's
``iterate`` (sample, communicate = pack/train/unpack for every sampled client, aggregate) timed
from outside; after the last round the final model is scored on the evaluation clients' test
data with the plain loop's ``evaluate_clients`` (inside the last round's time, as the plain loop
does).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import types

_HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.dirname(_HERE) not in sys.path:
    sys.path.insert(0, os.path.dirname(_HERE))

BENCHMARK = "raysim_bench_flgo"  # the benchmark's module name as FLGo imports it


def _benchmark_module(client_data: dict):
    from flgo.benchmark.base import BasicTaskPipe
    from flgo.benchmark.toolkits.cv.classification import GeneralCalculator

    class TaskPipe(BasicTaskPipe):
        def load_data(self, running_time_option) -> dict:
            data = {"server": {"test": None, "val": None}}
            for cid, name in enumerate(self.feddata["client_names"]):
                data[name] = {"train": client_data[cid], "val": None, "test": None}
            return data

    pkg = types.ModuleType(BENCHMARK)
    pkg.__path__ = []
    core = types.ModuleType(BENCHMARK + ".core")
    core.TaskPipe = TaskPipe
    core.TaskCalculator = GeneralCalculator
    pkg.core = core
    sys.modules[BENCHMARK] = pkg
    sys.modules[BENCHMARK + ".core"] = core


def _client_datasets(fed) -> tuple[dict, bool]:
    """{cid: Subset of its domain's normalised training tensors}; identical (no augmentation)?"""
    import numpy as np
    import torch

    shared: dict = {}
    out, identical = {}, True
    for cid in range(fed.n):
        split, positions = fed.view(cid)["train"]
        key = id(split)
        if key not in shared:
            x, y = split.tensors(np.arange(len(split)), train=False)
            shared[key] = torch.utils.data.TensorDataset(x, y)
            identical &= getattr(split, "augment", None) is None
        out[cid] = torch.utils.data.Subset(shared[key], [int(p) for p in positions])
    return out, identical


def run(spec: dict) -> dict:
    t_start = time.perf_counter()
    import numpy as np
    import torch

    sys.argv = sys.argv[:1]  # flgo.init also parses the command line (parse_known_args)
    import flgo
    from flgo.algorithm.fedbase import BasicClient, BasicServer
    from flgo.experiment.logger import BasicLogger
    from flgo.utils.fmodule import FModule

    from benchmarks.plain import PlainFederation, evaluate_clients, headline, weighted_mean
    from benchmarks.procmem import TreeCPU
    from raysim.core.seeding import generator_for

    if spec["method"] != "fedavg":
        raise SystemExit("the FLGo arm runs FedAvg only")
    torch.set_num_threads(1)
    fed = PlainFederation(spec)
    init_model = fed.build_model()
    init_state = {k: v.detach().clone() for k, v in init_model.state_dict().items()}
    dtypes = {k: v.dtype for k, v in init_state.items()}
    client_data, identical = _client_datasets(fed)
    train = spec["train"]
    identical &= int(train.get("epochs", 1)) == 1 and not train.get("lr_decay")
    rounds = int(spec["rounds"])
    eval_clients = fed.eval_clients()
    seed = fed.seed
    _benchmark_module(client_data)

    class Net(FModule):
        """FLGo builds its model with no arguments (``model.__class__()`` in its arithmetic)."""

        def __init__(self):
            super().__init__()
            net = fed.build_model()
            self.features = net.features
            self.head = net.head

        def forward(self, x):
            return self.head(self.features(x))

    class ModelModule:
        @staticmethod
        def init_global_module(obj):
            if isinstance(obj, BasicServer):
                net = Net()
                net.load_state_dict(init_state, strict=True)
                obj.model = net.to(obj.device)

        @staticmethod
        def init_local_module(obj):
            pass

    class QuietLogger(BasicLogger):
        def initialize(self, *args, **kwargs):
            pass

        def log_once(self, *args, **kwargs):
            pass

        def save_output_as_json(self, filepath=None):
            pass

    timing = {"round_seconds": [], "cpu": [], "final": {}}
    tree = TreeCPU()

    class Server(BasicServer):
        def sample(self):
            return fed.sample(int(self.current_round))

        def aggregate(self, models, *args, **kwargs):
            sums, total = {}, 0.0
            for cid, m in zip(self.received_clients, models):  # ascending client order, as the plain loop
                w = float(self.clients[cid].datavol)
                for k, v in m.state_dict().items():
                    c = v.detach().to(torch.float64) * w
                    sums[k] = sums[k] + c if k in sums else c
                total += w
            new = Net()
            new.load_state_dict(weighted_mean(sums, total, dtypes), strict=True)
            return new.to(self.device)

        def iterate(self):
            t0 = time.perf_counter()
            out = super().iterate()
            if int(self.current_round) == rounds:
                timing["final"]["eval"] = headline(evaluate_clients(fed, self.model, eval_clients),
                                                   fed.partition.domain)
                timing["final"]["weights"] = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            timing["round_seconds"].append(time.perf_counter() - t0)
            if int(self.current_round) == 1:
                tree.rescan()
            timing["cpu"].append(tree())
            return out

    algorithm = types.ModuleType("raysim_bench_fedavg")
    algorithm.Server, algorithm.Client = Server, BasicClient
    option = {
        "seed": seed, "dataseed": seed, "num_rounds": rounds, "proportion": fed.per_round() / fed.n,
        "sample": "uniform", "aggregate": "other",
        "learning_rate": float(train["lr"]), "learning_rate_decay": 1.0, "lr_scheduler": "-1",
        "momentum": float(train.get("momentum", 0.0)), "weight_decay": float(train.get("weight_decay", 0.0)),
        "clip_grad": float(train.get("grad_clip") or 0.0), "batch_size": int(train["batch_size"]),
        "num_epochs": int(train.get("epochs", 1)), "num_steps": -1, "optimizer": "SGD",
        "train_holdout": 0.0, "test_batch_size": 512, "num_workers": 0, "drop_last": False,
        "gpu": [], "server_with_cpu": False, "num_parallels": 1, "torch_num_threads": 1,
        "eval_interval": 0, "early_stop": -1, "log_level": "WARNING", "no_log_console": True, "no_tqdm": True,
        "log_file": False, "save_checkpoint": "", "load_checkpoint": "",
    }
    root = tempfile.mkdtemp(prefix="flgo-bench-")
    task = os.path.join(root, "task")
    for d in (task, os.path.join(task, "record"), os.path.join(task, "log")):
        os.makedirs(d, exist_ok=True)
    with open(os.path.join(task, "info"), "w", encoding="utf-8") as fh:
        json.dump({"benchmark": BENCHMARK, "scene": "horizontal", "num_clients": fed.n}, fh)
    with open(os.path.join(task, "data.json"), "w", encoding="utf-8") as fh:
        json.dump({"client_names": [f"Client{i}" for i in range(fed.n)]}, fh)
    runner = flgo.init(task, algorithm, option=option, model=ModelModule, Logger=QuietLogger)
    for c in runner.clients:  # the plain loop's batch order (see the module docstring)
        plain = c.calculator.get_dataloader

        def get_dataloader(dataset, batch_size=64, shuffle=True, *args, _c=c, _plain=plain, **kwargs):
            if dataset is not _c.train_data:
                return _plain(dataset, batch_size, shuffle, *args, **kwargs)
            rnd = int(_c.server.current_round)
            order = torch.randperm(len(dataset), generator=generator_for(seed, rnd, int(_c.id), "train")).tolist()
            return torch.utils.data.DataLoader(dataset, batch_size=batch_size, sampler=order,
                                               drop_last=bool(kwargs.get("drop_last", False)))

        c.calculator.get_dataloader = get_dataloader
    steps = [int(c.num_steps) for c in runner.clients]
    startup = time.perf_counter() - t_start
    try:
        runner.run()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    cpu = timing["cpu"]
    per_round = sum(steps[c] for r in range(1, rounds + 1) for c in fed.sample(r)) / rounds
    return {"flgo_version": _dist_version("flgo"), "torch_version": torch.__version__, "threads": 1,
            "identical": bool(identical), "startup_seconds": startup, "round_seconds": timing["round_seconds"],
            "round_cpu": [b - a for a, b in zip(cpu, cpu[1:])], "steps_per_round": per_round,
            "final_eval": timing["final"].get("eval", {}), "weights": timing["final"].get("weights"),
            "num_clients": fed.n, "mean_steps_per_client": float(np.mean(steps))}


def _dist_version(name: str) -> str | None:
    try:
        from importlib.metadata import version
        return version(name)
    except Exception:  # noqa: BLE001
        return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("spec")
    p.add_argument("out")
    ns = p.parse_args(argv)
    with open(ns.spec, encoding="utf-8") as fh:
        spec = json.load(fh)
    res = run(spec)
    from benchmarks.plain import save_result
    save_result(ns.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
