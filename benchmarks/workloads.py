"""The benchmark workloads, as JSON-able specs shared by every arm (plain, raysim, Flower, pfl, FLGo).

A spec carries exactly what the computation depends on; ``raysim_config`` turns it into a
raysim config. The model is ``small_cnn`` (146k parameters on 3x32x32) in A, B and C: the
digits CNN of the papers (``cnn6``, 14M parameters) is too slow for a 2-core CPU benchmark.

* A  cross-silo: FedAvg, digits5, 5 clients (one per domain, each with 743 training images,
     FedBN's digits protocol), full participation, 1 local epoch, 20 rounds.
* B  cross-device: FedAvg, 1,000 clients of 64 training images each (drawn per client from
     their domain's training split, overlapping across clients), 50 per round, 10 rounds.
* C  personalized state at scale: FedBN (BN layers stay on the client), like B but with
     1,000,000 registered clients (and the same run with 1,000), 100 per round: what it costs
     must grow with the clients that train, not with those registered (``run.py``'s
     ``scale_workload`` passes the count; ``workload_c``'s default stays 100,000).
* D  overhead-bound: FedAvg, 1,000 clients of 50 training images each, 100 per round, one epoch
     at batch 10 (5 SGD steps per client), on digits5 rendered at 28 px, with raysim's two-layer
     MLP (``mlp``: 200 hidden units, no norm; 472k parameters on 3x28x28 but only ~0.47M
     multiply-adds per image), SGD lr 0.1 (P's): per client the training is about a millisecond,
     so the per-client cost of the simulator dominates a round.
* P  pfl-research's published image-classification setting (its ``benchmarks/image_classification``
     baseline: CIFAR10 IID, 50 images per user, 1,000 users, cohort 50, local batch 10, 1 local
     epoch, local SGD lr 0.1, central lr 1.0, uniform weighting, pfl's 2-conv ``simple_cnn``)
     scaled to this machine: digits5 at 3x32x32 for CIFAR10, raysim's ``small_cnn`` without
     normalisation layers for pfl's ``simple_cnn`` (1.6M parameters; no norm layers either),
     FedAvg (n_k-weighted: every client holds 50 images, so it equals pfl's uniform weighting
     and central lr 1.0), and a few rounds instead of 1,500 central iterations.

Two more for the device benchmark (``run.py --device``; too slow for a 2-core CPU):

* B6 B with the digits CNN of the papers, ``cnn6`` (BN and dropout; 18.1M parameters at 32 px).
* R  FedAvg in DapperFL's ResNet-10 digits5 setting (``configs/dapperfl/digits5.yaml`` at the
     paper's 32 px): 10 clients (2 per domain, 10% of the domain's training split each), all
     every round, 5 local epochs at batch 64, SGD lr 0.01, momentum 0.9, weight decay 1e-5,
     n_k-weighted FedAvg, each domain's full test split shared by its clients.
"""
from __future__ import annotations

import copy

MODEL = {"name": "small_cnn", "norm": "bn"}
TRAIN = {"epochs": 1, "batch_size": 32, "lr": 0.01, "momentum": 0.0, "weight_decay": 0.0}


def cross_device_partition(num_clients: int, samples: int = 64) -> dict:
    return {"kind": "cross_device", "num_clients": int(num_clients), "samples_per_client": int(samples),
            "overlap": True}


def workload_a(rounds: int = 20) -> dict:
    return {"name": "A", "method": "fedavg", "rounds": rounds, "seed": 0, "clients_per_round": None,
            "dataset": "digits5", "data_options": {}, "partition": {"kind": "per_domain", "train_size": 743},
            "model": dict(MODEL), "train": dict(TRAIN), "eval_clients": "all"}


def workload_b(rounds: int = 10, num_clients: int = 1000, per_round: int = 50) -> dict:
    return {"name": "B", "method": "fedavg", "rounds": rounds, "seed": 0, "clients_per_round": per_round,
            "dataset": "digits5", "data_options": {}, "partition": cross_device_partition(num_clients),
            "model": dict(MODEL), "train": dict(TRAIN), "eval_clients": 100}


def workload_c(rounds: int = 10, num_clients: int = 100_000, per_round: int = 100) -> dict:
    return {"name": "C", "method": "fedbn", "rounds": rounds, "seed": 0, "clients_per_round": per_round,
            "dataset": "digits5", "data_options": {}, "partition": cross_device_partition(num_clients),
            "model": dict(MODEL), "train": dict(TRAIN), "eval_clients": 100}


def workload_d(rounds: int = 10, num_clients: int = 1000, per_round: int = 100) -> dict:
    return {"name": "D", "method": "fedavg", "rounds": rounds, "seed": 0, "clients_per_round": per_round,
            "dataset": "digits5", "data_options": {"image_size": 28},
            "partition": cross_device_partition(num_clients, samples=50),
            "model": {"name": "mlp", "norm": "none"},
            "train": {"epochs": 1, "batch_size": 10, "lr": 0.1, "momentum": 0.0, "weight_decay": 0.0},
            "eval_clients": 100}


def workload_p(rounds: int = 10, num_clients: int = 1000, per_round: int = 50) -> dict:
    return {"name": "P", "method": "fedavg", "rounds": rounds, "seed": 0, "clients_per_round": per_round,
            "dataset": "digits5", "data_options": {}, "partition": cross_device_partition(num_clients, samples=50),
            "model": {"name": "small_cnn", "norm": "none"},
            "train": {"epochs": 1, "batch_size": 10, "lr": 0.1, "momentum": 0.0, "weight_decay": 0.0},
            "eval_clients": 100}


def workload_b6(rounds: int = 10, num_clients: int = 1000, per_round: int = 50) -> dict:
    spec = workload_b(rounds, num_clients, per_round)
    spec.update(name="B6", model={"name": "cnn6", "norm": "bn"})
    return spec


def workload_r(rounds: int = 6) -> dict:
    return {"name": "R", "method": "fedavg", "rounds": rounds, "seed": 0, "clients_per_round": None,
            "dataset": "digits5", "data_options": {},
            "partition": {"kind": "per_domain", "clients_per_domain": 2, "fraction": 0.1, "shared_test": True},
            "model": {"name": "resnet10", "norm": "bn"},
            "train": {"epochs": 5, "batch_size": 64, "lr": 0.01, "momentum": 0.9, "weight_decay": 1e-5},
            "eval_clients": "all"}


WORKLOADS = {"A": workload_a, "B": workload_b, "D": workload_d, "P": workload_p}
DEVICE_WORKLOADS = {**WORKLOADS, "B6": workload_b6, "R": workload_r}  # run.py --device


def raysim_config(spec: dict, hosts: int = 2, cpus_per_host: float = 1.0, eval_every: int | None = None,
                  runtime: dict | None = None):
    """The raysim config of ``spec``: evaluation after the last round only (test split), as the
    plain loop does, unless ``eval_every`` says otherwise."""
    from raysim.config import load_config

    raw = {
        "name": f"bench-{spec['name']}", "method": spec["method"], "rounds": spec["rounds"],
        "seed": spec["seed"], "clients_per_round": spec.get("clients_per_round"),
        "data": {"dataset": spec["dataset"], "options": copy.deepcopy(spec.get("data_options", {})),
                 "partition": copy.deepcopy(spec["partition"])},
        "model": {"name": spec["model"]["name"], "norm": spec["model"].get("norm", "default"),
                  "options": copy.deepcopy(spec["model"].get("options", {}))},
        "train": dict(spec["train"]),
        "eval": {"every": eval_every or spec["rounds"], "protocol": "personalized", "splits": ["test"],
                 "clients": spec.get("eval_clients", "all")},
        "runtime": {"num_hosts": hosts, "cpus_per_host": cpus_per_host, **(runtime or {})},
    }
    return load_config(raw=raw)
