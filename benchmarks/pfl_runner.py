"""The pfl-research arm: a workload on pfl's simulated backend with PyTorch (``pfl`` from the package index).

Runs inside its own virtual environment (``benchmarks/.venv-pfl``, made by ``pfl_env.py``):

    benchmarks/.venv-pfl/bin/python benchmarks/pfl_runner.py SPEC.json OUT_DIR [--workers 2] [--native]

pfl runs its simulation in one process per worker; with ``--workers N`` (default 2, one torch
thread each, as raysim's 2 hosts x 1 CPU) this script starts N worker processes of itself, which
pfl connects through ``torch.distributed`` (gloo) from ``PFL_WORKER_ADDRESSES``/``PFL_WORKER_RANK``,
pfl's own multi-worker mode: each worker trains its share of the cohort, and pfl all-reduces the
workers' sums. What pfl runs, and what this file gives it:

* the model: raysim's model of the spec (``PlainFederation.build_model``: the same seeded initial
  weights as the plain loop) in pfl's ``PyTorchModel``, with the ``loss``/``metrics`` methods pfl
  asks for (cross-entropy, the plain loop's ``F.cross_entropy``); local optimizer
  ``torch.optim.SGD`` with the spec's lr/momentum/weight decay; central optimizer SGD, lr 1.0;
* the data: a ``FederatedDatasetBase`` (pfl's interface for "how a user's dataset is built") whose
  ``get_cohort`` yields round t's clients, sampled with raysim's seeded sampler, as pfl
  ``Dataset``s; a client's examples are laid out in the order of its batches in the plain loop
  (``torch.randperm`` from the (seed, round, client, "train") generator, the tensors made batch by
  batch as the plain loop makes them), so pfl's own batching (``Dataset.iter``: consecutive slices
  of ``local_batch_size``) yields the plain loop's batches;
* local training: pfl's SGD bridge (``do_multiple_epochs_of`` with pfl's train step:
  zero_grad, loss, backward, step), one epoch at the spec's batch size;
* the algorithm: pfl's ``FederatedAveraging`` driven by ``algorithm.run`` on a
  ``SimulatedBackend``.

Same computation (the default): two of pfl's extension points are used so that the final weights
equal the plain loop's bit for bit. (1) The algorithm is a subclass of ``FederatedAveraging``
whose user statistics are n_k x (the client's full state dict, BN running statistics included)
in float64 instead of pfl's float32 parameter difference, and whose server step assigns the
float64 weighted mean rounded to each tensor's dtype (the plain loop's ``weighted_mean``) instead
of applying the averaged difference with the central SGD (lr 1.0); every client starts from the
central BN statistics (pfl federates parameters only and lets the buffers drift from user to
user on its single model object). (2) The backend's aggregator all-reduces the workers' float64
sums in float64 (pfl's ``SumAggregator`` casts them to float32 for the all-reduce).
``--native`` runs pfl's stock FedAvg instead (float32 differences, central SGD lr 1.0, uniform
weights, BN statistics not federated): the same computation up to float32 rounding of the
aggregate (and BN buffers), not bit for bit; the harness then reports cost per client step.

pfl evaluates every user before and after local training in iterations where
``iteration % evaluation_frequency == 0``: always in the first one, as pfl does; the evaluation
reads the model in eval mode and does not change it. After the last round the final model is
scored on the evaluation clients' test data by rank 0, as the plain loop does.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.dirname(_HERE) not in sys.path:
    sys.path.insert(0, os.path.dirname(_HERE))

RANK_ENV, ADDR_ENV, T0_ENV = "PFL_WORKER_RANK", "PFL_WORKER_ADDRESSES", "RAYSIM_BENCH_T0"


# ----------------------------------------------------------------------------- the data

def make_federated_dataset(fed, spec: dict):
    """pfl's ``FederatedDatasetBase``: round t's cohort is raysim's sample for round t, in
    ascending client order, split over the workers as pfl splits a cohort (position i to worker
    i % world_size); each user's examples are in the plain loop's batch order for that round."""
    import numpy as np
    import torch
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDatasetBase
    from pfl.internal.ops.selector import get_default_framework_module as get_ops

    from raysim.core.seeding import generator_for

    train = spec["train"]
    bs = int(train["batch_size"])

    def user_dataset(rnd: int, cid: int):
        split, positions = fed.view(cid)["train"]
        positions = np.asarray(positions, dtype=np.int64)
        g = generator_for(fed.seed, rnd, cid, "train")
        order = torch.randperm(len(positions), generator=g).numpy()
        xs, ys = [], []
        for start in range(0, len(positions), bs):  # batch by batch, as the plain loop draws them
            x, y = split.tensors(positions[order[start:start + bs]], train=True, generator=g)
            xs.append(x)
            ys.append(y)
        return Dataset((torch.cat(xs), torch.cat(ys)), user_id=f"{cid}")

    class RoundSchedule(FederatedDatasetBase):
        def __init__(self):
            super().__init__()
            self.round = 0

        def __next__(self):
            raise TypeError("the benchmark's federated dataset is only read by cohorts")

        def get_cohort(self, cohort_size: int):
            self.round += 1
            clients = fed.sample(self.round)
            if cohort_size != len(clients):
                raise RuntimeError(f"pfl asked for {cohort_size} users; round {self.round} samples {len(clients)}")
            dist = get_ops().distributed
            for i, cid in enumerate(clients):
                if i % dist.world_size == dist.global_rank:
                    yield user_dataset(self.round, cid), self._get_seed()

    return RoundSchedule()


# ----------------------------------------------------------------------------- the algorithm

def make_algorithm(native: bool, torch_model):
    import torch
    from pfl.algorithm import FederatedAveraging
    from pfl.internal.bridge import FrameworkBridgeFactory as bridges
    from pfl.metrics import Metrics
    from pfl.stats import MappedVectorStatistics

    from benchmarks.plain import load_weights, weighted_mean

    if native:
        return FederatedAveraging()

    state = torch_model.state_dict()
    dtypes = {k: v.dtype for k, v in state.items()}
    param_names = {n for n, _ in torch_model.named_parameters()}
    buffer_names = [k for k in state if k not in param_names]

    class SameComputationFedAvg(FederatedAveraging):
        """pfl's FedAvg with the plain loop's update arithmetic (see the module docstring)."""

        def __init__(self):
            super().__init__()
            self.central_buffers = {k: state[k].detach().clone() for k in buffer_names}

        def train_one_user(self, initial_model_state, model, user_dataset, central_context):
            pm = model.pytorch_model
            if self.central_buffers:
                load_weights(pm, self.central_buffers)
            bridges.sgd_bridge().do_sgd(model, user_dataset, central_context.model_train_params)
            n = float(len(user_dataset))
            stats = MappedVectorStatistics({k: v.detach().to(torch.float64) * n for k, v in pm.state_dict().items()},
                                           weight=n)
            return stats, Metrics()

        def process_aggregated_statistics(self, central_context, aggregate_metrics, model, statistics):
            mean = weighted_mean({k: statistics[k] for k in statistics.keys()}, float(statistics.weight), dtypes)
            load_weights(model.pytorch_model, mean)
            self.central_buffers = {k: mean[k] for k in buffer_names}
            return model, Metrics()

    return SameComputationFedAvg()


def make_aggregator(native: bool):
    if native:
        return None  # pfl's SumAggregator

    import torch
    from pfl.aggregate.base import SumAggregator
    from pfl.internal import ops

    class Float64SumAggregator(SumAggregator):
        """pfl's SumAggregator, with the workers' sums all-reduced in float64."""

        def worker_reduce(self, *, aggregated_worker_stats, central_context, aggregated_worker_metrics):
            import torch.distributed as dist

            stats = aggregated_worker_stats
            keys = list(stats.keys())
            flat = torch.cat([stats[k].reshape(-1).to(torch.float64) for k in keys]
                             + [torch.tensor([float(stats.weight)], dtype=torch.float64)])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            data, off = {}, 0
            for k in keys:
                n = stats[k].numel()
                data[k] = flat[off:off + n].reshape(stats[k].shape)
                off += n
            return stats.__class__(data, weight=float(flat[-1])), ops.all_reduce_metrics(aggregated_worker_metrics)

    return Float64SumAggregator()


# ----------------------------------------------------------------------------- one worker

def run_worker(spec: dict, threads: int, native: bool) -> dict | None:
    """Runs in every worker process; rank 0 returns the figures, the others None."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(int(threads))
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.algorithm import NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.internal.ops.selector import get_default_framework_module as get_ops
    from pfl.metrics import Metrics, Weighted
    from pfl.model.pytorch import PyTorchModel

    from benchmarks.plain import PlainFederation, evaluate_clients, headline, load_weights
    from benchmarks.procmem import TreeCPU

    dist = get_ops().distributed
    rank, world = dist.global_rank, dist.world_size
    if spec["method"] != "fedavg":
        raise SystemExit("the pfl arm runs FedAvg only")
    train = spec["train"]
    identical = not native and int(train.get("epochs", 1)) == 1 and not train.get("lr_decay")
    fed = PlainFederation(spec)
    torch_model = fed.build_model()

    def loss(self, x, y, eval=False):  # noqa: A002 - pfl's keyword
        self.eval() if eval else self.train()
        return F.cross_entropy(self(x), y)

    @torch.no_grad()
    def metrics(self, x, y, eval=True):  # noqa: A002
        self.eval() if eval else self.train()
        logits = self(x)
        n = len(y)
        return {"loss": Weighted(float(F.cross_entropy(logits, y, reduction="sum")), n),
                "accuracy": Weighted(float((logits.argmax(1) == y).sum()), n)}

    import types
    torch_model.loss = types.MethodType(loss, torch_model)
    torch_model.metrics = types.MethodType(metrics, torch_model)
    sgd_kw = {"momentum": float(train.get("momentum", 0.0)), "weight_decay": float(train.get("weight_decay", 0.0))}

    def local_optimizer_create(params, lr, **kw):
        return torch.optim.SGD(params, lr=lr, **{**sgd_kw, **kw})

    model = PyTorchModel(model=torch_model, local_optimizer_create=local_optimizer_create,
                         central_optimizer=torch.optim.SGD(torch_model.parameters(), lr=1.0))
    rounds = int(spec["rounds"])
    k = fed.per_round()
    dataset = make_federated_dataset(fed, spec)
    backend = SimulatedBackend(training_data=dataset, val_data=dataset, aggregator=make_aggregator(native))
    algorithm = make_algorithm(native, torch_model)
    algo_params = NNAlgorithmParams(central_num_iterations=rounds, evaluation_frequency=max(rounds, 1),
                                    train_cohort_size=k, val_cohort_size=0)
    train_params = NNTrainHyperParams(local_num_epochs=int(train.get("epochs", 1)),
                                      local_learning_rate=float(train["lr"]),
                                      local_batch_size=int(train["batch_size"]))
    eval_params = NNEvalHyperParams(local_batch_size=max(int(train["batch_size"]), 256))
    eval_clients = fed.eval_clients()
    tree = TreeCPU(os.getppid() if world > 1 else None)
    marks: dict = {"cpu": []}
    final: dict = {}

    class Timer(TrainingProcessCallback):
        def on_train_begin(self, *, model):
            marks["t"] = [time.perf_counter()]
            return Metrics()

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            if central_iteration == rounds - 1 and rank == 0:  # the plain loop evaluates in its last round
                pm = model.pytorch_model
                final["eval"] = headline(evaluate_clients(fed, pm, eval_clients), fed.partition.domain)
                final["weights"] = {k: v.detach().clone() for k, v in pm.state_dict().items()}
            marks["t"].append(time.perf_counter())
            if central_iteration == 0:
                tree.rescan()
            marks["cpu"].append(tree())
            return False, Metrics()

    t0 = float(os.environ.get(T0_ENV, time.time()))
    startup_wall = time.time() - t0
    algorithm.run(algorithm_params=algo_params, backend=backend, model=model, model_train_params=train_params,
                  model_eval_params=eval_params, callbacks=[Timer()])
    if rank != 0:
        return None
    t = marks["t"]
    cpu = marks["cpu"]
    steps = sum(-(-len(fed.view(c)["train"][1]) // int(train["batch_size"])) * int(train.get("epochs", 1))
                for r in range(1, rounds + 1) for c in fed.sample(r)) / rounds
    return {"pfl_version": _dist_version("pfl"), "torch_version": torch.__version__, "workers": world,
            "threads": torch.get_num_threads(), "mode": "native" if native else "same-computation",
            "identical": identical, "startup_seconds": startup_wall,
            "round_seconds": [b - a for a, b in zip(t, t[1:])],
            "round_cpu": [b - a for a, b in zip(cpu, cpu[1:])],
            "steps_per_round": steps, "final_eval": final.get("eval", {}), "weights": final.get("weights"),
            "num_clients": fed.n}


def _dist_version(name: str) -> str | None:
    try:
        from importlib.metadata import version
        return version(name)
    except Exception:  # noqa: BLE001
        return None


# ----------------------------------------------------------------------------- launcher

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(ns, argv: list[str]) -> int:
    """Start ``ns.workers`` worker processes of this script (pfl's multi-worker mode) and wait."""
    port = _free_port()
    addresses = ",".join(f"127.0.0.1:{port + i}" for i in range(ns.workers))
    env = dict(os.environ, **{ADDR_ENV: addresses, T0_ENV: repr(time.time()), "OMP_NUM_THREADS": str(ns.threads),
                              "PFL_PYTORCH_DEVICE": "cpu"})
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv], env={**env, RANK_ENV: str(r)})
             for r in range(ns.workers)]
    codes = [p.wait() for p in procs]
    if any(codes[1:]) and codes[0] == 0 and os.path.isfile(os.path.join(ns.out, "result.json")):
        # seen once in ten runs: a worker aborts in torch.distributed's teardown ("terminate called
        # without an active exception") after every iteration ran and rank 0 wrote the results
        print(f"pfl workers exited with {codes} after rank 0 wrote its results (a crash at teardown): kept",
              file=sys.stderr)
        return 0
    if any(codes):
        print(f"pfl workers exited with {codes}", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("spec")
    p.add_argument("out")
    p.add_argument("--workers", type=int, default=2, help="pfl worker processes (torch.distributed, gloo)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--native", action="store_true",
                   help="pfl's stock FedAvg (float32 differences, central SGD lr 1.0): not bit-identical")
    p.add_argument("--device", default="cpu",
                   help="pfl's torch device (PFL_PYTORCH_DEVICE) with one worker: cpu (default) or cuda")
    ns = p.parse_args(argv)
    if ns.workers > 1 and RANK_ENV not in os.environ:
        return launch(ns, argv)
    os.environ.setdefault("PFL_PYTORCH_DEVICE", ns.device)
    os.environ.setdefault(T0_ENV, repr(time.time()))
    with open(ns.spec, encoding="utf-8") as fh:
        spec = json.load(fh)
    res = run_worker(spec, ns.threads, ns.native)
    if res is not None:
        from benchmarks.plain import save_result
        save_result(ns.out, res)
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        # leaving with the process group up kept both workers busy for ~20 s at exit
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
