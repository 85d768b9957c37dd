"""The FLGo arm of the cross-check: one method, one seed, on FLGo's own algorithm modules.

Runs inside FLGo's virtual environment (``benchmarks/.venv-flgo``, made by ``flgo_env.py``):

    benchmarks/.venv-flgo/bin/python benchmarks/flgo_runner.py SPEC.json OUT.json

SPEC.json (written by ``flgo_crosscheck.py``) names the arrays raysim built for the seed (one
client per domain: train/val/test, normalised float32), the seeded initial state dict raysim's
federation starts from, the model's ``raysim.models.build`` arguments, the training protocol and
FLGo's ``algo_para`` for the method. What this file adds to FLGo is only the plumbing FLGo asks a
user to write:

* a benchmark (``<name>.core`` with ``TaskPipe`` and ``TaskCalculator``): the pipe hands each
  client its arrays as ``TensorDataset``s; the calculator is FLGo's own
  ``flgo.benchmark.toolkits.cv.classification.GeneralCalculator`` (cross-entropy, SGD);
* a model module (``init_global_module``): an ``FModule`` holding raysim's ``small_cnn`` (the
  same ``features``/``head`` layers and state-dict keys) loaded with raysim's initial weights;
* a logger that scores each client's model on its own test split (Ditto: the client's personal
  model ``client.model``, as FLGo's PFLLogger does; every other method: the global model) after
  the evaluated rounds, on copies, so that evaluating never changes a model's train/eval mode.

The training itself is FLGo's: ``flgo.init(task, flgo.algorithm.<method>, option).run()``.
"""
from __future__ import annotations

import copy
import json
import os
import sys
import tempfile
import time
import types

_HERE = os.path.dirname(os.path.abspath(__file__))
BENCHMARK = "raysim_digits5_flgo"  # the benchmark's module name as FLGo imports it
METHODS = ("fedavg", "fedprox", "scaffold", "feddyn", "moon", "ditto")
# diagnostic variants (not FLGo's own algorithms): FLGo's module with one named change
VARIANTS = {"feddyn_bnmean": "feddyn"}
PERSONAL = ("ditto",)  # scored with the client's own model (client.model)

_SPEC: dict = {}  # set by main() before flgo.init builds anything
_ARRAYS: dict = {}
_INIT: dict = {}


# ----------------------------------------------------------------------------- the benchmark

def _benchmark_module():
    """``raysim_digits5_flgo.core``: TaskPipe (raysim's arrays as TensorDatasets) and FLGo's
    GeneralCalculator, registered in sys.modules so that flgo.init can import it by name."""
    import numpy as np
    import torch
    from flgo.benchmark.base import BasicTaskPipe
    from flgo.benchmark.toolkits.cv.classification import GeneralCalculator

    class TaskPipe(BasicTaskPipe):
        def load_data(self, running_time_option) -> dict:
            data = {"server": {"test": None, "val": None}}
            for cid, name in enumerate(self.feddata["client_names"]):
                data[name] = {}
                for split in ("train", "val", "test"):
                    x = torch.from_numpy(np.ascontiguousarray(_ARRAYS[f"x_{split}_{cid}"]))
                    y = torch.from_numpy(np.ascontiguousarray(_ARRAYS[f"y_{split}_{cid}"]).astype(np.int64))
                    data[name][split] = torch.utils.data.TensorDataset(x, y)
            return data

    pkg = types.ModuleType(BENCHMARK)
    pkg.__path__ = []
    core = types.ModuleType(BENCHMARK + ".core")
    core.TaskPipe = TaskPipe
    core.TaskCalculator = GeneralCalculator
    pkg.core = core
    sys.modules[BENCHMARK] = pkg
    sys.modules[BENCHMARK + ".core"] = core


def _make_task(root: str, client_names: list[str]) -> str:
    task = os.path.join(root, "task")
    for d in (task, os.path.join(task, "record"), os.path.join(task, "log")):
        os.makedirs(d, exist_ok=True)
    with open(os.path.join(task, "info"), "w", encoding="utf-8") as fh:
        json.dump({"benchmark": BENCHMARK, "scene": "horizontal", "num_clients": len(client_names)}, fh)
    with open(os.path.join(task, "data.json"), "w", encoding="utf-8") as fh:
        json.dump({"client_names": client_names}, fh)
    return task


# ----------------------------------------------------------------------------- the model

def _model_class():
    """An FModule with raysim's small_cnn inside: FLGo builds it with no arguments (its model
    arithmetic calls ``model.__class__()``), so the build arguments come from the spec."""
    from flgo.utils.fmodule import FModule

    from raysim.models import build

    class RaysimNet(FModule):
        def __init__(self):
            super().__init__()
            m = _SPEC["model"]
            net = build(m["name"], **m["kwargs"])
            self.features = net.features  # the representation MOON contrasts (the head's input)
            self.head = net.head

        def forward(self, x):
            return self.head(self.features(x))

    return RaysimNet


class RaysimModel:
    """FLGo's model module: the server's model is raysim's seeded initial model."""
    Net = None

    @classmethod
    def init_global_module(cls, obj):
        from flgo.algorithm.fedbase import BasicServer
        if isinstance(obj, BasicServer):
            net = cls.Net()
            net.load_state_dict(_INIT, strict=True)
            obj.model = net.to(obj.device)

    @classmethod
    def init_local_module(cls, obj):
        pass


# ----------------------------------------------------------------------------- the logger

def _logger_class():
    import numpy as np
    import torch
    from flgo.experiment.logger import BasicLogger

    class CrossCheckLogger(BasicLogger):
        """Test accuracy of every client on its own test split, after the rounds in
        ``_SPEC['eval_rounds']`` (the last one always): the model each client would be scored
        with, evaluated as a copy."""

        def initialize(self, *args, **kwargs):
            self.results = {}
            self._trained = False

        def log_once(self, *args, **kwargs):
            if not self._trained:  # BasicServer.run evaluates the initial model first: skipped
                self._trained = True
                return
            rnd = int(self.coordinator.current_round)  # the round just trained (incremented after)
            if rnd not in _SPEC["eval_rounds_set"]:
                return
            server = self.coordinator
            per_client = {}
            with torch.no_grad():
                for c in self.participants:
                    personal = _SPEC["method"] in PERSONAL and getattr(c, "model", None) is not None
                    model = copy.deepcopy(c.model if personal else server.model)
                    res = c.calculator.test(model, c.test_data, batch_size=512)
                    per_client[int(c.id)] = float(res["accuracy"])
            domains = _SPEC["domains"]
            row = {domains[cid]: acc for cid, acc in sorted(per_client.items())}
            row["AVG"] = float(np.mean(list(per_client.values())))
            # BN running variances of the server's model (FedDyn's h can drive them below 0)
            row["min_running_var"] = min((float(b.min()) for n, b in server.model.named_buffers()
                                          if n.endswith("running_var")), default=float("nan"))
            self.results[rnd] = row
            if rnd == int(_SPEC["rounds"]) and _SPEC.get("save_weights"):
                torch.save({"server": {k: v.detach().cpu().clone() for k, v in server.model.state_dict().items()},
                            "clients": {int(c.id): {k: v.detach().cpu().clone() for k, v in c.model.state_dict().items()}
                                        for c in self.participants if getattr(c, "model", None) is not None}},
                           _SPEC["save_weights"])
            self.info(f"round {rnd}: test AVG {row['AVG']:.4f}")

        def save_output_as_json(self, filepath=None):
            return  # results go to OUT.json

    return CrossCheckLogger


# ----------------------------------------------------------------------------- the run

def run(spec: dict) -> dict:
    import numpy as np
    import torch

    sys.argv = sys.argv[:1]  # flgo.init also parses the command line (parse_known_args)
    import flgo

    _SPEC.clear()
    _SPEC.update(spec)
    rounds = int(spec["rounds"])
    every = int(spec.get("eval_every", 0) or 0)
    _SPEC["eval_rounds_set"] = {r for r in range(1, rounds + 1) if (every and r % every == 0)} | {rounds}
    with np.load(spec["arrays"]) as z:
        _ARRAYS.clear()
        _ARRAYS.update({k: z[k] for k in z.files})
    _INIT.clear()
    _INIT.update(torch.load(spec["init"], map_location="cpu", weights_only=True)[spec.get("init_of", spec["method"])])
    torch.set_num_threads(int(spec.get("threads", 1)))

    _benchmark_module()
    RaysimModel.Net = _model_class()
    method = spec["method"]
    if method not in METHODS and method not in VARIANTS:
        raise SystemExit(f"unknown method {method!r}; one of {METHODS + tuple(VARIANTS)}")
    algorithm = _variant(method) if method in VARIANTS else getattr(
        __import__("flgo.algorithm", fromlist=[method]), method)
    tr = spec["train"]
    option = {
        "seed": int(spec["seed"]), "dataseed": int(spec["seed"]),
        "num_rounds": rounds, "proportion": 1.0,
        # every client every round; train.weighting samples: sum_k (n_k / n) w_k ('other'), uniform: 'uniform'
        # (FedProx, SCAFFOLD, FedDyn and Ditto fix their own aggregation in FLGo)
        "sample": "full", "aggregate": "uniform" if tr.get("weighting") == "uniform" else "other",
        "learning_rate": float(tr["lr"]), "learning_rate_decay": 1.0, "lr_scheduler": "-1",
        "momentum": float(tr["momentum"]), "weight_decay": float(tr["weight_decay"]),
        "clip_grad": float(tr["grad_clip"] or 0.0), "batch_size": int(tr["batch_size"]),
        "num_epochs": int(tr["epochs"]), "num_steps": -1, "optimizer": "SGD",
        "train_holdout": 0.0, "test_batch_size": 512, "num_workers": 0, "drop_last": False,
        "gpu": [], "server_with_cpu": False, "num_parallels": 1, "torch_num_threads": int(spec.get("threads", 1)),
        "eval_interval": 1, "early_stop": -1, "log_level": "WARNING", "no_log_console": True, "no_tqdm": True,
        "log_file": False, "save_checkpoint": "", "load_checkpoint": "",
    }
    if spec.get("algo_para"):
        option["algo_para"] = [float(v) for v in spec["algo_para"]]
    root = tempfile.mkdtemp(prefix="flgo-task-")
    task = _make_task(root, [f"Client{i}" for i in range(len(spec["domains"]))])
    t0 = time.perf_counter()
    runner = flgo.init(task, algorithm, option=option, model=RaysimModel, Logger=_logger_class())
    # what FLGo actually runs with, for the record
    applied = {k: getattr(runner, k, None) for k in ("sample_option", "aggregation_option", "proportion",
                                                     "learning_rate", "decay_rate", "lr_scheduler_type")}
    applied["algo_para"] = dict(runner.algo_para)
    c0 = runner.clients[0]
    applied.update({"client_" + k: getattr(c0, k, None) for k in ("learning_rate", "momentum", "weight_decay",
                                                                   "batch_size", "num_steps", "num_epochs",
                                                                   "clip_grad")})
    if spec.get("batch_order") == "raysim":
        _raysim_batch_order(runner, int(spec["seed"]))
    init_diff = max(float((runner.model.state_dict()[k].double() - v.double()).abs().max()) if v.numel() else 0.0
                    for k, v in _INIT.items())
    runner.run()
    seconds = time.perf_counter() - t0
    results = runner.gv.logger.results
    return {"framework": "flgo", "flgo_version": _dist_version("flgo") or getattr(flgo, "__version__", None),
            "torch_version": torch.__version__, "method": method, "seed": int(spec["seed"]), "rounds": rounds,
            "domains": spec["domains"], "algo_para": spec.get("algo_para"), "applied": applied,
            "batch_order": spec.get("batch_order", "flgo"),
            "initial_weights_max_abs_diff": init_diff, "seconds": seconds,
            "per_round": {str(r): v for r, v in sorted(results.items())},
            "final_round": rounds, "final": results.get(rounds)}


def _raysim_batch_order(server, seed: int) -> None:
    """Diagnostic (``batch_order: raysim``): each client's training DataLoader visits its
    examples in raysim's order for (seed, round, client), ``torch.randperm(n, generator_for(seed,
    round, client, "train"))``, instead of shuffling with torch's global generator. FLGo's
    training code is untouched; with the same batches the two frameworks should compute the same
    models up to float rounding (raysim sums the aggregate in float64)."""
    import torch

    from raysim.core.seeding import generator_for

    for c in server.clients:
        calc = c.calculator
        plain = calc.get_dataloader

        def get_dataloader(dataset, batch_size=64, shuffle=True, *args, _c=c, _plain=plain, **kwargs):
            if dataset is not _c.train_data:
                return _plain(dataset, batch_size, shuffle, *args, **kwargs)
            rnd = int(_c.server.current_round)
            order = torch.randperm(len(dataset), generator=generator_for(seed, rnd, int(_c.id), "train")).tolist()
            return torch.utils.data.DataLoader(dataset, batch_size=batch_size, sampler=order,
                                               drop_last=bool(kwargs.get("drop_last", False)))

        calc.get_dataloader = get_dataloader


def _variant(name: str):
    """``feddyn_bnmean``: FLGo's FedDyn, except that the server's new model takes the plain mean
    of the clients' BN running statistics (raysim's rule) instead of FLGo's
    ``mean - h / alpha`` over the whole state dict. Everything else is FLGo's module."""
    from flgo.algorithm import feddyn
    from flgo.utils import fmodule

    class Server(feddyn.Server):
        def aggregate(self, models):
            new = super().aggregate(models)
            plain = fmodule._model_average(models)
            params = {n for n, _ in new.named_parameters()}
            sd, psd = new.state_dict(), plain.state_dict()
            for k in sd:
                if k not in params:
                    sd[k].copy_(psd[k])
            return new

    mod = types.ModuleType(name)
    mod.Server, mod.Client = Server, feddyn.Client
    return mod


def _dist_version(name: str) -> str | None:
    try:
        from importlib.metadata import version
        return version(name)
    except Exception:
        return None


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(__doc__.splitlines()[0] + "\nusage: flgo_runner.py SPEC.json OUT.json", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as fh:
        spec = json.load(fh)
    res = run(spec)
    os.makedirs(os.path.dirname(os.path.abspath(argv[1])), exist_ok=True)
    tmp = argv[1] + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(res, fh, indent=1)
    os.replace(tmp, argv[1])
    print(json.dumps({"method": res["method"], "seed": res["seed"], "final": res["final"],
                      "seconds": round(res["seconds"], 1)}))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(_HERE))  # raysim (installed --no-deps -e, or from the checkout)
    sys.exit(main())
