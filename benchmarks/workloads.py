"""The benchmark workloads, as JSON-able specs shared by the three arms (plain, raysim, Flower).

A spec carries exactly what the computation depends on; ``raysim_config`` turns it into a
raysim config. The model is ``small_cnn`` (146k parameters on 3x32x32) everywhere: the
digits CNN of the papers (``cnn6``, 14M parameters) is too slow for a 2-core CPU benchmark.

* A  cross-silo: FedAvg, digits5, 5 clients (one per domain, each with 743 training images,
     FedBN's digits protocol), full participation, 1 local epoch, 20 rounds.
* B  cross-device: FedAvg, 1,000 clients of 64 training images each (drawn per client from
     their domain's training split, overlapping across clients), 50 per round, 10 rounds.
* C  personalized state at scale: FedBN (BN layers stay on the client), like B but with
     100,000 registered clients (and the same run with 1,000), 100 per round.
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
