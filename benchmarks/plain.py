"""The plain loop: one Python process, FedAvg written directly in PyTorch.

This is the limit the simulator is measured against: the same local training and the same
n_k-weighted averaging that raysim runs, with no actors, no object store and no method
abstraction. It reuses only raysim's *data* (``raysim.data.load``, the partitioners), its model
zoo (``raysim.models.build``) and its seed-derivation helpers (``raysim.core.seeding``), so
the computation is bit-for-bit the one raysim performs:

* the initial weights are built under ``torch.manual_seed(seed)``;
* round ``t`` samples ``clients_per_round`` clients with the generator keyed by
  (seed, t, server, "sample"), or takes every client under full participation;
* client ``k`` in round ``t`` shuffles its training positions with ``torch.randperm`` from the
  generator keyed by (seed, t, k, "train") and runs ``epochs`` epochs of SGD over batches cut
  from that permutation, starting from the global weights;
* the server takes the n_k-weighted mean of every state-dict entry in float64 and rounds it
  back to the entry's dtype once.

The functions here take a *spec*, a JSON-able dict (see ``benchmarks/workloads.py``), so the
Flower client (which runs in another virtual environment, without raysim's config layer) can
reuse them. Run as a script it trains one spec and writes its timings and final weights:

    python benchmarks/plain.py SPEC.json OUT_DIR --threads 2 [--device cuda] [--deterministic]

On a GPU (``--device cuda``) the model, the global weights and the float64 sums live on the
device, each batch is made on the CPU as above and copied there (``non_blocking``), and nothing
in the round waits for the device but the end of the round (``torch.cuda.synchronize`` before its
time is taken): the losses are summed on the device and read once per client. Models with
dropout draw its masks from the generator keyed by (seed, round, client, "dropout") on the
device, as a raysim client step does.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

SERVER = -1  # the server's "client id" in raysim's seed keys


# ----------------------------------------------------------------------------- the federation

class PlainFederation:
    """Data, partition and model of one spec, built the way raysim builds them."""

    def __init__(self, spec: dict):
        from raysim.data import load
        from raysim.data.partition import make_partition

        self.spec = spec
        self.seed = int(spec["seed"])
        self.dataset = load(spec["dataset"], root=None, seed=self.seed, **spec.get("data_options", {}))
        self.partition = make_partition(self.dataset, dict(spec["partition"]), self.seed)
        self.n = self.partition.num_clients
        self._views: dict[int, dict] = {}

    def build_model(self) -> torch.nn.Module:
        from raysim.models import build

        m = self.spec["model"]
        shape = self.dataset.image_shape
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            return build(m["name"], num_classes=self.dataset.num_classes, in_channels=shape[0],
                         input_size=shape[-1], norm=m.get("norm", "default"), pretrained=None,
                         **m.get("options", {}))

    def view(self, cid: int) -> dict:
        """{'train'|'val'|'test': (split, positions)} of client ``cid`` (computed once)."""
        v = self._views.get(cid)
        if v is None:
            shard = self.partition.shard(cid)
            v = {s: (self.dataset.split(shard.domain, shard.split_name(s)), getattr(shard, s))
                 for s in ("train", "val", "test")}
            self._views[cid] = v
        return v

    def per_round(self) -> int:
        k = self.spec.get("clients_per_round")
        return self.n if k is None else min(int(k), self.n)

    def sample(self, rnd: int) -> list[int]:
        return sample_clients(self.seed, rnd, self.n, self.per_round())

    def eval_clients(self) -> list[int]:
        from raysim.core.seeding import rng_for

        e = self.spec.get("eval_clients", "all")
        if e == "all" or int(e) >= self.n:
            return list(range(self.n))
        rng = rng_for(self.seed, 0, SERVER, "eval-clients")
        return sorted(int(c) for c in rng.choice(self.n, size=int(e), replace=False))


def sample_clients(seed: int, rnd: int, n: int, k: int) -> list[int]:
    """Round ``rnd``'s clients: all of them, or ``k`` drawn by the generator keyed by
    (seed, rnd, server, "sample"), in ascending order."""
    from raysim.core.seeding import rng_for

    if k >= n:
        return list(range(n))
    rng = rng_for(seed, rnd, SERVER, "sample")
    return sorted(int(c) for c in rng.choice(n, size=k, replace=False))


# ----------------------------------------------------------------------------- client and server

def local_train(model: torch.nn.Module, split, positions: np.ndarray, train: dict, lr: float,
                generator: torch.Generator, device: torch.device | str = "cpu") -> dict:
    """``epochs`` epochs of plain SGD over the client's shuffled data; returns mean loss and steps.
    The batches are made on the CPU and copied to ``device``; the loss is summed there in float64
    (a Python float's sum, without a host sync per step) and read once."""
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=train.get("momentum", 0.0),
                          weight_decay=train.get("weight_decay", 0.0))
    bs = int(train["batch_size"])
    positions = np.asarray(positions, dtype=np.int64)
    total, steps = torch.zeros((), dtype=torch.float64, device=device), 0
    for _ in range(int(train.get("epochs", 1))):
        order = torch.randperm(len(positions), generator=generator).numpy()
        for start in range(0, len(positions), bs):
            x, y = split.tensors(positions[order[start:start + bs]], train=True, generator=generator)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.detach().to(torch.float64)
            steps += 1
    return {"loss": total.item() / max(steps, 1), "steps": steps}


def round_lr(train: dict, rnd: int) -> float:
    return float(train["lr"]) * float(train.get("lr_decay", 1.0)) ** (rnd - 1)


def load_weights(model: torch.nn.Module, weights: dict) -> None:
    own = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for k, v in weights.items():
            own[k].copy_(v)


def weighted_mean(sums: dict, total: float, dtypes: dict) -> dict:
    """float64 sums of n_k * w_k -> the mean in each tensor's own dtype (integers rounded)."""
    out = {}
    for k, s in sums.items():
        m = s / total
        out[k] = m.to(dtypes[k]) if dtypes[k].is_floating_point else m.round().to(dtypes[k])
    return out


def weights_diff(a: dict, b: dict) -> float:
    """max |a - b| over every entry of two state dicts (inf when their keys differ)."""
    if set(a) != set(b):
        return float("inf")
    return max(((a[k].double() - b[k].double()).abs().max().item() if a[k].numel() else 0.0) for k in a)


@torch.no_grad()
def evaluate(model, split, positions, batch_size: int = 256, device: torch.device | str = "cpu") -> dict:
    model.eval()
    correct, n = torch.zeros((), dtype=torch.int64, device=device), 0
    positions = np.asarray(positions, dtype=np.int64)
    for start in range(0, len(positions), batch_size):
        x, y = split.tensors(positions[start:start + batch_size], train=False, generator=None)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        correct += (model(x).argmax(1) == y).sum()
        n += len(y)
    return {"correct": int(correct), "n": n}


def headline(results: dict[int, dict], domain_of) -> dict:
    """AVG (mean over domains of their pooled accuracy) and ALL (pooled accuracy), as raysim reports them."""
    pooled: dict[str, list[int]] = {}
    for cid, r in results.items():
        p = pooled.setdefault(domain_of(cid), [0, 0])
        p[0] += r["correct"]
        p[1] += r["n"]
    accs = [c / n for c, n in pooled.values() if n]
    c = sum(r["correct"] for r in results.values())
    n = sum(r["n"] for r in results.values())
    return {"AVG": float(np.mean(accs)) if accs else float("nan"), "ALL": c / n if n else float("nan")}


def evaluate_clients(fed: PlainFederation, model, clients: list[int], split_name: str = "test",
                     device: torch.device | str = "cpu") -> dict:
    bs = max(int(fed.spec["train"]["batch_size"]), 256)
    return {c: evaluate(model, *fed.view(c)[split_name], batch_size=bs, device=device) for c in clients}


def resolve_device(name: str | None) -> torch.device:
    """``cpu`` or ``cuda`` (the current CUDA device); a UserError in one line when CUDA is asked
    for and this torch sees none."""
    from raysim.core.errors import UserError

    name = (name or "cpu").lower()
    if name == "cpu":
        return torch.device("cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UserError(f"--device {name}: torch {torch.__version__} sees no CUDA device on this machine "
                            f"(torch.cuda.is_available() is False); use --device cpu")
        return torch.device(name if ":" in name else "cuda")
    raise UserError(f"--device {name!r}: expected cpu or cuda")


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a round's time must include it); nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------- the loop

def run_plain(spec: dict, threads: int | None = None, rounds: int | None = None, device: str = "cpu",
              deterministic: bool = False) -> dict:
    """Train ``spec`` with FedAvg in this process, on ``device`` (``cpu`` or ``cuda``). Returns
    timings, the final global weights (on the CPU) and the final evaluation (AVG/ALL test accuracy
    over the spec's evaluation clients). ``deterministic``: torch's deterministic kernels, as raysim's
    ``runtime.deterministic`` sets them (:mod:`raysim.engine.determinism`)."""
    from raysim.models.dropout import dropout_generator
    from raysim.engine.determinism import configure
    from raysim.core.seeding import generator_for

    if spec.get("method", "fedavg") != "fedavg":
        raise ValueError("the plain loop implements FedAvg only")
    dev = resolve_device(device)
    configure(deterministic)
    if threads:
        torch.set_num_threads(int(threads))
    t0 = time.perf_counter()
    fed = PlainFederation(spec)
    model = fed.build_model().to(dev)
    global_w = {k: v.detach().clone() for k, v in model.state_dict().items()}
    dtypes = {k: v.dtype for k, v in global_w.items()}
    train = spec["train"]
    eval_clients = fed.eval_clients()
    rounds = int(rounds or spec["rounds"])
    synchronize(dev)
    startup = time.perf_counter() - t0
    round_seconds, round_cpu, losses, final_eval = [], [], [], {}
    for rnd in range(1, rounds + 1):
        t_round, c_round = time.perf_counter(), time.process_time()
        sums, total, round_loss = {}, 0.0, []
        for cid in fed.sample(rnd):
            split, positions = fed.view(cid)["train"]
            load_weights(model, global_w)
            with dropout_generator(generator_for(fed.seed, rnd, cid, "dropout", dev)):
                stats = local_train(model, split, positions, train, round_lr(train, rnd),
                                    generator_for(fed.seed, rnd, cid, "train"), device=dev)
            round_loss.append(stats["loss"])
            weight = float(len(positions))
            for k, v in model.state_dict().items():
                contrib = v.detach().to(torch.float64) * weight
                if k in sums:
                    sums[k] += contrib
                else:
                    sums[k] = contrib
            total += weight
        global_w = weighted_mean(sums, total, dtypes)
        losses.append(float(np.mean(round_loss)))
        if rnd == rounds:  # raysim evaluates after the last round; so does the plain loop
            load_weights(model, global_w)
            final_eval = headline(evaluate_clients(fed, model, eval_clients, device=dev), fed.partition.domain)
        synchronize(dev)
        round_seconds.append(time.perf_counter() - t_round)
        round_cpu.append(time.process_time() - c_round)
    return {"startup_seconds": startup, "round_seconds": round_seconds, "round_cpu": round_cpu, "train_loss": losses,
            "final_eval": final_eval, "weights": {k: v.cpu() for k, v in global_w.items()},
            "threads": torch.get_num_threads(), "num_clients": fed.n, "device": str(dev),
            "deterministic": bool(deterministic)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("spec", help="workload spec (JSON file)")
    p.add_argument("out", help="folder for result.json and weights.pt")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--deterministic", action="store_true", help="torch's deterministic kernels")
    ns = p.parse_args(argv)
    with open(ns.spec, encoding="utf-8") as fh:
        spec = json.load(fh)
    save_result(ns.out, run_plain(spec, threads=ns.threads, device=ns.device, deterministic=ns.deterministic))
    return 0


def save_result(out: str, res: dict) -> None:
    """One arm's final weights (``weights.pt``, when it has them) and figures (``result.json``),
    which run.py reads back to compare the arms."""
    os.makedirs(out, exist_ok=True)
    weights = res.pop("weights", None)
    if weights is not None:
        torch.save(weights, os.path.join(out, "weights.pt"))
    with open(os.path.join(out, "result.json"), "w", encoding="utf-8") as fh:
        json.dump(res, fh)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from raysim.core.errors import UserError
    try:
        sys.exit(main())
    except UserError as err:  # one line (no CUDA for --device cuda, ...)
        print(f"plain: error: {err}", file=sys.stderr)
        sys.exit(2)
