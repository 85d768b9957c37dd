"""The Flower arm: the same workload on Flower's simulation runtime (``flwr[simulation]``).

Runs inside its own virtual environment (``benchmarks/.venv-flwr``, made by ``flower_env.py``)
because Flower pins an older Ray than raysim. The ClientApp trains with the plain loop's
``local_train`` on raysim's data and model (raysim is installed there with ``--no-deps``), so
every arm computes the same thing:

* one SuperNode per client (``num_supernodes`` = number of clients); client k is node k in the
  order of the node ids, and the train message names the client id;
* the ServerApp drives the Grid itself: each round it samples the clients with the same seeded
  generator as raysim, sends the global weights to their nodes (``send_and_receive``), and
  takes the n_k-weighted mean in float64, like raysim and the plain loop;
* client resources ``num_cpus=1`` so that Ray runs two ClientApp actors on the two cores (the
  default, 2 CPUs per client, would run one at a time), and one torch thread per actor;
* after the last round the server evaluates the final model on the evaluation clients'
  test data, in its own process, as the plain loop does.

The worker processes keep the dataset, partition and model in a module-level cache, the most
favourable way to write a Flower client (the ClientApp object itself is rebuilt per message).

    benchmarks/.venv-flwr/bin/python benchmarks/flower_runner.py SPEC.json OUT_DIR
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))

_WORKER: dict = {}


def _worker_state(spec_path: str):
    """Per worker process: the federation (data + partition) and one model, built once."""
    st = _WORKER.get(spec_path)
    if st is None:
        import torch

        from benchmarks.plain import PlainFederation
        torch.set_num_threads(1)
        with open(spec_path, encoding="utf-8") as fh:
            spec = json.load(fh)
        fed = PlainFederation(spec)
        st = _WORKER[spec_path] = {"spec": spec, "fed": fed, "model": fed.build_model()}
    return st


def _train(msg, context):
    """The ClientApp's train function: one client's local epochs from the received weights."""
    from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

    from benchmarks.plain import load_weights, local_train, round_lr
    from raysim.core.seeding import generator_for

    cfg = msg.content["config"]
    st = _worker_state(str(cfg["spec"]))
    fed, model, tr = st["fed"], st["model"], st["spec"]["train"]
    cid, rnd = int(cfg["cid"]), int(cfg["round"])
    load_weights(model, msg.content["arrays"].to_torch_state_dict())
    split, positions = fed.view(cid)["train"]
    stats = local_train(model, split, positions, tr, round_lr(tr, rnd), generator_for(fed.seed, rnd, cid, "train"))
    reply = RecordDict({"arrays": ArrayRecord(model.state_dict()),
                        "metrics": MetricRecord({"num-examples": len(positions), "cid": cid,
                                                 "loss": float(stats["loss"])})})
    return Message(reply, reply_to=msg)


def make_apps(spec: dict, spec_path: str, timings: dict, result: dict):
    import torch
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp

    from benchmarks.plain import PlainFederation, evaluate_clients, headline, load_weights, weighted_mean

    client = ClientApp()
    client.train()(_train)

    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        timings["main_entered"] = time.perf_counter()
        torch.set_num_threads(1)
        fed = PlainFederation(spec)
        model = fed.build_model()
        global_w = {k: v.detach().clone() for k, v in model.state_dict().items()}
        dtypes = {k: v.dtype for k, v in global_w.items()}
        nodes = sorted(grid.get_node_ids())
        if len(nodes) != fed.n:
            raise RuntimeError(f"{len(nodes)} SuperNodes for {fed.n} clients")
        eval_clients = fed.eval_clients()
        rounds = int(spec["rounds"])
        from benchmarks.procmem import TreeCPU
        timings["rounds_start"] = time.perf_counter()
        round_seconds, cpu_at, tree_cpu = [], {}, TreeCPU()
        for rnd in range(1, rounds + 1):
            t0 = time.perf_counter()
            arrays = ArrayRecord(global_w)
            msgs = [Message(RecordDict({"arrays": arrays,
                                        "config": ConfigRecord({"cid": cid, "round": rnd, "spec": spec_path})}),
                            dst_node_id=nodes[cid], message_type="train")
                    for cid in fed.sample(rnd)]
            replies = list(grid.send_and_receive(msgs))
            got = {}
            for r in replies:
                if r.has_error():
                    raise RuntimeError(f"a Flower client failed: {r.error}")
                m = r.content["metrics"]
                got[int(m["cid"])] = (float(m["num-examples"]), r.content["arrays"].to_torch_state_dict())
            if len(got) != len(msgs):
                raise RuntimeError(f"round {rnd}: {len(got)} replies for {len(msgs)} clients")
            sums, total = {}, 0.0
            for cid in sorted(got):
                w, sd = got[cid]
                for k, v in sd.items():
                    c = v.to(torch.float64) * w
                    sums[k] = sums[k] + c if k in sums else c
                total += w
            global_w = weighted_mean(sums, total, dtypes)
            if rnd == rounds:
                load_weights(model, global_w)
                result["final_eval"] = headline(evaluate_clients(fed, model, eval_clients), fed.partition.domain)
            round_seconds.append(time.perf_counter() - t0)
            if rnd == 1:  # Flower starts its actors on the first messages
                tree_cpu.rescan()
            cpu_at[rnd] = tree_cpu()
        result["round_seconds"] = round_seconds
        result["round_cpu"] = [cpu_at[r] - cpu_at[r - 1] for r in sorted(cpu_at) if r - 1 in cpu_at]
        result["weights"] = global_w

    return server, client


def run_flower(spec: dict, spec_path: str) -> dict:
    import flwr
    from flwr.simulation import run_simulation

    from benchmarks.plain import PlainFederation

    n = PlainFederation(spec).n
    timings, result = {}, {}
    server, client = make_apps(spec, os.path.abspath(spec_path), timings, result)
    backend = {"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
               "init_args": {"num_cpus": os.cpu_count(), "include_dashboard": False}}
    t0 = time.perf_counter()
    run_simulation(server_app=server, client_app=client, num_supernodes=n, backend_config=backend)
    total = time.perf_counter() - t0
    if "round_seconds" not in result:
        raise RuntimeError("the Flower simulation ended without finishing its rounds (see its log above)")
    import ray
    return {"flwr_version": flwr.__version__, "ray_version": ray.__version__,
            "startup_seconds": timings["rounds_start"] - t0, "round_seconds": result["round_seconds"],
            "round_cpu": result["round_cpu"],
            "total_seconds": total, "final_eval": result["final_eval"], "weights": result["weights"],
            "num_clients": n}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("spec")
    p.add_argument("out")
    ns = p.parse_args(argv)
    with open(ns.spec, encoding="utf-8") as fh:
        spec = json.load(fh)
    from benchmarks.flower_runner import run_flower as run  # importable by Ray's workers (PYTHONPATH)
    from benchmarks.plain import save_result
    save_result(ns.out, run(spec, ns.spec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
