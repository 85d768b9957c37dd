"""Cross-check raysim's general FL baselines against FLGo's implementations of them.

FLGo (``flgo==0.3.29``, the platform FDSE's code runs on; installed in its own venv
``benchmarks/.venv-flgo`` by ``flgo_env.py``) ships FedAvg, FedProx, SCAFFOLD, FedDyn, MOON and
Ditto. This driver (project venv) runs FLGo's versions on exactly what raysim trains on:

* for each seed, raysim's own federation (``raysim.engine.federation.Federation`` of the config)
  builds the clients' train/val/test arrays (one client per domain, normalised float32, the same
  partition) and the seeded initial model of each method; they are written to ``<out>/data/``;
* ``flgo_runner.py`` (FLGo venv) trains FLGo's algorithm module on them with the config's
  protocol (SGD lr/momentum/weight decay, grad-norm clip, batch, epochs, every client every round,
  sample-weighted aggregation where FLGo's method lets the option through) and raysim's method
  hyperparameters (``hp.<method>`` of the config, else the method's defaults), and scores each
  client's model on its own test split: ``<out>/raw/<method>/seed-<s>.json``;
* the raysim side is read from a raysim run directory of the same config (``--raysim-run``):
  ``<run>/<method>/seed-<s>/metrics.parquet``, test accuracy at its final round.

Both sides are compared at the final round (round ``--rounds``): AVG = mean over the domains of
each domain's client test accuracy, mean ± std over the seeds, in ``<out>/crosscheck.md``.

    .venv/bin/python benchmarks/flgo_crosscheck.py --out /tmp/flgo_full --raysim-run /tmp/exp/runs/all
    .venv/bin/python benchmarks/flgo_crosscheck.py --rounds 2 --seeds 0 --out /tmp/flgo_2 --raysim-run RUN
    .venv/bin/python benchmarks/flgo_crosscheck.py --table-only --out /tmp/flgo_full --raysim-run RUN

FLGo results already in ``<out>/raw`` for the same rounds are reused (``--force`` reruns them), so
``--table-only`` (or a plain rerun) rebuilds the table once the raysim run exists.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if REPO not in sys.path:
    sys.path.insert(0, REPO)

DEFAULT_CONFIG = os.path.join(REPO, "configs", "baselines", "digits5_all.yaml")
METHODS = ["fedavg", "fedprox", "scaffold", "feddyn", "moon", "ditto"]
# diagnostic FLGo variants: FLGo's module with one named change, compared with raysim's method
VARIANTS = {"feddyn_bnmean": "feddyn"}
DEFAULT_METHODS = METHODS + list(VARIANTS)


def base_method(name: str) -> str:
    return VARIANTS.get(name, name)

# raysim hyperparameter -> FLGo's algo_para, in the order of FLGo's Server.init_algo_para
ALGO_PARA = {
    "fedavg": [],
    "fedprox": ["mu"],        # FLGo {'mu'}: 0.5 * mu * ||w - w^t||^2
    "scaffold": ["eta_g"],    # FLGo {'eta'}: global step size
    "feddyn": ["alpha"],      # FLGo {'alpha'}
    "moon": ["mu", "tau"],    # FLGo {'mu', 'tau'}
    "ditto": ["lam"],         # FLGo {'mu'}: 0.5 * mu * ||v - w^t||^2 on the personal model
}
ALGO_PARA["feddyn_bnmean"] = ALGO_PARA["feddyn"]

# where the two implementations cannot be identical (read from both sources; see the note)
NOTES = {
    "fedavg": "identical algorithm; FLGo's sample-weighted mean ('other') over every client.",
    "fedprox": "identical objective; FLGo fixes the uniform mean (equal to raysim's sample-weighted one here: "
               "every client holds 743 training images).",
    "scaffold": "identical (option II, uniform mean of y_i, c += (1/N) sum dc_i, correction before clipping); "
                "FLGo's c and dy also cover BN buffers, which eta_g = 1 makes the plain mean, as in raysim; FLGo "
                "fixes sample='uniform' (all 5 clients each round, in a random order: only the summation order "
                "differs).",
    "feddyn": "FLGo applies the server state h to the whole state dict, BN running statistics included "
              "(theta = mean - h/alpha on running_mean/var too); raysim keeps h on the parameters and averages "
              "the BN statistics plainly.",
    "moon": "same loss (first participation: l_con = 0, no projection head). FLGo's frozen copy of the global "
            "model is in whatever mode the received model is: train here (evaluation runs on copies), eval in "
            "FLGo's stock loggers, which evaluate the server's model in place every round.",
    "ditto": "same two solvers on the same batch (global step, then personal step with (lambda/2)||v - w^t||^2, "
             "both clipped); FLGo fixes the uniform mean (= sample-weighted here). Scored with the personal model.",
    "feddyn_bnmean": "diagnostic, not an FLGo algorithm: FLGo's FedDyn module with one change, the server's new "
                     "model takes the plain mean of the BN running statistics (raysim's rule); compared with "
                     "raysim's feddyn. If it agrees with raysim while stock FLGo does not, the BN-statistics rule "
                     "is the cause.",
}


def log(msg: str) -> None:
    print(f"[flgo-crosscheck {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- raysim's side of the inputs

def load_cfg(config: str, method: str, seed: int, rounds: int | None):
    from raysim.config import load_config
    cfg = load_config(config, [f"methods=[{method}]", f"seeds=[{seed}]"] + ([f"rounds={rounds}"] if rounds else []))
    return cfg.for_method(method).for_seed(seed)


def model_kwargs(fed) -> dict:
    """raysim.models.build arguments of Method.build_model (the base build: the six methods'
    models are the base model, MOON without its projection head)."""
    m = fed.setup.model
    return {"name": m.name, "kwargs": {"num_classes": fed.setup.num_classes, "in_channels": fed.setup.image_shape[0],
                                       "input_size": fed.setup.image_shape[-1], "norm": m.norm,
                                       "pretrained": m.pretrained, **dict(m.options or {})}}


def dump_inputs(config: str, seed: int, methods: list[str], out: str, rounds: int | None) -> dict:
    """Arrays of every client (train/val/test) and each method's initial state dict, for one seed,
    from raysim's own Federation; returns what the runner's spec needs."""
    import numpy as np
    import torch

    from raysim.engine.federation import Federation

    data_dir = os.path.join(out, "data")
    os.makedirs(data_dir, exist_ok=True)
    arrays_path = os.path.join(data_dir, f"seed-{seed}.npz")
    init_path = os.path.join(data_dir, f"seed-{seed}-init.pt")
    meta_path = os.path.join(data_dir, f"seed-{seed}.json")
    if all(os.path.isfile(p) for p in (arrays_path, init_path, meta_path)):
        with open(meta_path, encoding="utf-8") as fh:
            meta = json.load(fh)
        if {base_method(m) for m in methods} <= set(meta["methods"]):
            return meta
    feds = {m: Federation(load_cfg(config, m, seed, rounds)) for m in dict.fromkeys(map(base_method, methods))}
    base = next(iter(feds.values()))
    if base.target is not None:
        raise SystemExit("the cross-check expects a partition without held-out domains")
    arrays, counts = {}, {}
    for cid in range(base.num_clients):
        data = base.client_data(cid)
        for split in ("train", "val", "test"):
            view = getattr(data, split)
            x, y = view.split.tensors(view.indices, train=False, generator=None)
            arrays[f"x_{split}_{cid}"] = x.numpy().astype(np.float32)
            arrays[f"y_{split}_{cid}"] = y.numpy().astype(np.int64)
            counts.setdefault(split, []).append(int(len(y)))
    if any(getattr(base.client_data(c).train.split, "augment", None) is not None for c in range(base.num_clients)):
        log("warning: the dataset has train-time augmentation, which the FLGo arm does not apply")
    inits = {}
    for m, fed in feds.items():
        if fed.pooled:
            raise SystemExit(f"{m} pools the clients' data; not a method of this cross-check")
        inits[m] = {k: v.detach().clone() for k, v in fed.initial_model().state_dict().items()}
    np.savez(arrays_path, **arrays)
    torch.save(inits, init_path)
    meta = {"seed": seed, "methods": list(feds), "arrays": arrays_path, "init": init_path,
            "domains": [base.domain(c) for c in range(base.num_clients)], "counts": counts,
            "model": model_kwargs(base)}
    with open(meta_path, "w", encoding="utf-8") as fh:
        json.dump(meta, fh, indent=1)
    return meta


def method_spec(config: str, method: str, seed: int, rounds: int | None) -> dict:
    """The protocol and the method's hyperparameters as raysim runs them."""
    from raysim.engine.federation import Federation
    variant, method = method, base_method(method)
    cfg = load_cfg(config, method, seed, rounds)
    fed = Federation(cfg)
    hp = fed.method.hp
    t = cfg.train
    if float(getattr(t, "lr_decay", 1.0) or 1.0) != 1.0:
        raise SystemExit("lr_decay != 1 is not mapped onto FLGo's scheduler here")
    if method == "scaffold" and hp.option != "II":
        raise SystemExit("FLGo's SCAFFOLD is option II only")
    if method == "moon" and hp.head != "none":
        raise SystemExit("FLGo's MOON has no projection head: use hp.moon.head=none")
    train = {"lr": t.lr, "momentum": t.momentum, "weight_decay": t.weight_decay, "grad_clip": t.grad_clip,
             "batch_size": t.batch_size, "epochs": t.epochs, "weighting": t.weighting,
             "max_steps": getattr(t, "max_steps", None)}
    if train["max_steps"]:
        raise SystemExit("train.max_steps is not mapped onto FLGo (num_steps)")
    return {"rounds": int(cfg.rounds), "train": train,
            "hp": {k: getattr(hp, k) for k in hp.__dataclass_fields__},
            "algo_para": [float(getattr(hp, k)) for k in ALGO_PARA[variant]], "init_of": method,
            "eval_every": int(getattr(cfg.eval, "every", 0) or 0)}


# ----------------------------------------------------------------------------- FLGo runs

def raw_path(out: str, method: str, seed: int) -> str:
    return os.path.join(out, "raw", method, f"seed-{seed}.json")


def run_flgo(py: str, config: str, methods: list[str], seeds: list[int], rounds: int | None, out: str,
             force: bool, threads: int, batch_order: str = "flgo") -> None:
    metas: dict[int, dict] = {}
    for method in methods:  # method by method, every seed: a partial run still gives whole comparisons
        for seed in seeds:
            meta = metas.get(seed)
            path = raw_path(out, method, seed)
            spec = method_spec(config, method, seed, rounds)
            if not force and os.path.isfile(path):
                with open(path, encoding="utf-8") as fh:
                    done = json.load(fh)
                if (done.get("rounds") == spec["rounds"] and done.get("final")
                        and done.get("batch_order", "flgo") == batch_order):
                    log(f"{method} seed {seed}: reusing {path}")
                    continue
            if meta is None:
                log(f"seed {seed}: raysim's client arrays and initial models")
                meta = metas[seed] = dump_inputs(config, seed, methods, out, rounds)
            spec.update({"method": method, "seed": seed, "arrays": meta["arrays"], "init": meta["init"],
                         "domains": meta["domains"], "model": meta["model"], "threads": threads,
                         "batch_order": batch_order})
            os.makedirs(os.path.dirname(path), exist_ok=True)
            spec_path = path[:-len(".json")] + ".spec.json"
            with open(spec_path, "w", encoding="utf-8") as fh:
                json.dump(spec, fh, indent=1)
            log(f"{method} seed {seed}: FLGo, {spec['rounds']} rounds, algo_para {spec['algo_para']}")
            env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
                   "OMP_WAIT_POLICY": "PASSIVE", "CUDA_VISIBLE_DEVICES": "", "PYTHONWARNINGS": "ignore"}
            with open(path[:-len(".json")] + ".log", "w", encoding="utf-8") as lf:
                r = subprocess.run([py, os.path.join(HERE, "flgo_runner.py"), spec_path, path],
                                   stdout=lf, stderr=subprocess.STDOUT, env=env, cwd=REPO)
            if r.returncode != 0:
                log(f"{method} seed {seed}: FLGo runner failed (exit {r.returncode}); see {path[:-5]}.log")
            else:
                with open(path, encoding="utf-8") as fh:
                    res = json.load(fh)
                log(f"{method} seed {seed}: final test AVG {res['final']['AVG']:.4f} ({res['seconds']:.0f} s)")


# ----------------------------------------------------------------------------- same computation

def raysim_weights(config: str, method: str, seed: int, rounds: int, run_dir: str, threads: int = 1) -> dict:
    """raysim's global model after ``rounds`` rounds, run in this process (InProcess backend)."""
    import torch

    from raysim.app.experiment import federation
    from raysim.engine.backend import InProcess
    from raysim.engine.loop import Callback

    torch.set_num_threads(threads)
    fed = federation(load_cfg(config, method, seed, rounds), run_dir, progress=False, backend=InProcess())
    got = {}

    class Grab(Callback):
        def on_round(self, rnd, summary, evaluation, log):
            if rnd == rounds:
                got["w"] = fed.backend.get(fed.server.export_state.remote())["global"]

    fed.callbacks.append(Grab())
    fed.run()
    return {k: v.detach().clone() for k, v in got["w"].items()}


def weights_check(py: str, config: str, methods: list[str], seed: int, rounds: int, out: str, threads: int) -> str:
    """FLGo with raysim's batch order against raysim itself: max |difference| of the global
    models after ``rounds`` rounds (floating-point entries; BN's num_batches_tracked, which FLGo
    scales with the aggregation weights and nobody reads, is left out)."""
    import torch

    wdir = os.path.join(out, "weights-check")
    os.makedirs(wdir, exist_ok=True)
    meta = dump_inputs(config, seed, methods, out, rounds)
    rows = ["| FLGo method | raysim method | rounds | max abs diff (global model, float entries) | "
            "largest entry there |", "|---|---|---:|---:|---:|"]
    cache: dict = {}
    for method in methods:
        spec = method_spec(config, method, seed, rounds)
        flgo_w = os.path.join(wdir, f"{method}-flgo.pt")
        spec.update({"method": method, "seed": seed, "arrays": meta["arrays"], "init": meta["init"],
                     "domains": meta["domains"], "model": meta["model"], "threads": threads,
                     "batch_order": "raysim", "save_weights": flgo_w, "eval_every": 0})
        spec_path = os.path.join(wdir, f"{method}.spec.json")
        with open(spec_path, "w", encoding="utf-8") as fh:
            json.dump(spec, fh, indent=1)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "CUDA_VISIBLE_DEVICES": "", "PYTHONWARNINGS": "ignore"}
        with open(os.path.join(wdir, f"{method}.log"), "w", encoding="utf-8") as lf:
            r = subprocess.run([py, os.path.join(HERE, "flgo_runner.py"), spec_path,
                                os.path.join(wdir, f"{method}-flgo.json")], stdout=lf, stderr=subprocess.STDOUT,
                               env=env, cwd=REPO)
        if r.returncode != 0:
            rows.append(f"| {method} | {base_method(method)} | {rounds} | FLGo runner failed | |")
            continue
        base = base_method(method)  # a diagnostic variant is compared with raysim's method
        if base not in cache:
            cache[base] = raysim_weights(config, base, seed, rounds, os.path.join(wdir, f"raysim-{base}"), threads)
        a = cache[base]
        b = torch.load(flgo_w, weights_only=True)["server"]
        diffs = {k: float((a[k].double() - b[k].double()).abs().max()) for k in a
                 if a[k].is_floating_point() and a[k].numel()}
        worst = max(diffs, key=diffs.get)
        rows.append(f"| {method} | {base} | {rounds} | {diffs[worst]:.3g} ({worst}) | "
                    f"{float(a[worst].abs().max()):.3g} |")
        log(f"{method}: max |raysim - FLGo| = {diffs[worst]:.3g} at {worst}")
    text = "\n".join([f"# Same batches, same computation? (seed {seed}, {rounds} round(s))", "",
                      "FLGo's algorithm modules with `--batch-order raysim` (each client visits its examples in "
                      "raysim's seeded order) against raysim's own run (InProcess backend), from the same "
                      "initial weights:", ""] + rows + [
                      "", "Round 1 is the exact check: both start from the same weights and see the same batches, so "
                      "anything above float32 rounding of the aggregate (~1e-7) is a difference in the algorithm. "
                      "From round 2 on, SGD amplifies that rounding (on this setup a relative 1e-7 perturbation of "
                      "the starting weights grows to ~1e-2 after one round of 24 steps), so compare a method's "
                      "round-2+ figure with FedAvg's rather than with 0."]) + "\n"
    with open(os.path.join(out, "weights-check.md"), "w", encoding="utf-8") as fh:
        fh.write(text)
    return text


# ----------------------------------------------------------------------------- the table

def flgo_results(out: str, methods: list[str], seeds: list[int]) -> dict:
    res = {}
    for m in methods:
        for s in seeds:
            p = raw_path(out, m, s)
            if os.path.isfile(p):
                with open(p, encoding="utf-8") as fh:
                    r = json.load(fh)
                if r.get("final"):
                    res.setdefault(m, {})[s] = r
    return res


def raysim_results(run_dir: str | None, methods: list[str], seeds: list[int]) -> tuple[dict, list[str]]:
    """{method: {seed: {"final_round": r, "final": {domain: acc, "AVG": acc}}}} and notes on what is missing."""
    from raysim.app import rundir
    from raysim.app.tables import summarize
    notes, res = [], {}
    if not run_dir:
        return res, ["no --raysim-run given: raysim columns left empty"]
    if not os.path.isdir(run_dir):
        return res, [f"raysim run directory {run_dir} does not exist (yet): raysim columns left empty"]
    try:
        mdirs = rundir.method_dirs(run_dir)
    except Exception as err:  # noqa: BLE001
        return res, [f"cannot read {run_dir}: {err}"]
    for m in methods:
        d = mdirs.get(base_method(m))
        if d is None:
            notes.append(f"{run_dir}: no {base_method(m)}")
            continue
        sdirs = rundir.seed_dirs(d)
        for s in seeds:
            sd = sdirs.get(s)
            path = os.path.join(sd, "metrics.parquet") if sd else os.path.join(d, f"seed-{s}", "metrics.parquet")
            if not os.path.isfile(path):
                notes.append(f"{path}: absent")
                continue
            try:
                summary = summarize(rundir.read_metrics(sd), base_method(m), rule="final")
            except Exception as err:  # noqa: BLE001
                notes.append(f"{path}: unreadable ({str(err).splitlines()[0]})")
                continue
            res.setdefault(m, {})[s] = {"final_round": summary.final_round, "final": summary.final}
    return res, notes


def _mean_std(values: list[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else float("nan")
    return mean, std


def _cell(values: list[float]) -> str:
    if not values:
        return "-"
    mean, std = _mean_std(values)
    return f"{100 * mean:.2f}" + (f" ± {100 * std:.2f}" if len(values) > 1 else "") + f" (n={len(values)})"


def render(out: str, methods: list[str], seeds: list[int], rounds: int, raysim_run: str | None) -> str:
    fl = flgo_results(out, methods, seeds)
    rs, notes = raysim_results(raysim_run, methods, seeds)
    any_flgo = next((r for per in fl.values() for r in per.values()), None)
    version = any_flgo.get("flgo_version") if any_flgo else "?"
    lines = [f"# raysim vs FLGo {version}: general FL baselines on digits5", "",
             f"Test accuracy (%) at the final round (FLGo: round {rounds}; raysim: the run's last evaluated round), "
             f"each client's model on its own test split (Ditto: the personal model; the others: the global model); "
             f"AVG = mean over the {len(any_flgo['domains']) if any_flgo else 5} domains; mean ± sample std over seeds "
             f"{', '.join(map(str, seeds))}. raysim run: `{raysim_run or '-'}`. "
             f"'within 2 std': |FLGo mean - raysim mean| <= 2 x raysim's std. FLGo batch order: "
             f"{', '.join(sorted({r.get('batch_order', 'flgo') for per in fl.values() for r in per.values()})) or '-'} "
             f"(flgo: its own shuffling; raysim: raysim's seeded order, a diagnostic).", ""]
    lines += ["| method | FLGo AVG | raysim AVG | difference (FLGo - raysim) | within 2 std? |",
              "|---|---:|---:|---:|---|"]
    verdicts = {}
    for m in methods:
        f_vals = [fl[m][s]["final"]["AVG"] for s in seeds if s in fl.get(m, {})]
        r_vals = [rs[m][s]["final"]["AVG"] for s in seeds if s in rs.get(m, {})]
        rounds_r = sorted({rs[m][s]["final_round"] for s in seeds if s in rs.get(m, {})})
        if rounds_r and rounds_r != [rounds]:
            notes.append(f"{m}: raysim's final round is {rounds_r}, FLGo's {rounds}")
        diff, verdict = "-", "-"
        if f_vals and r_vals:
            fm, _ = _mean_std(f_vals)
            rm, rsd = _mean_std(r_vals)
            diff = f"{100 * (fm - rm):+.2f}"
            if len(r_vals) > 1 and rsd == rsd:
                verdict = "yes" if abs(fm - rm) <= 2 * rsd else "**no**"
            else:
                verdict = "n/a (one seed)"
        verdicts[m] = verdict
        lines.append(f"| {m} | {_cell(f_vals)} | {_cell(r_vals)} | {diff} | {verdict} |")
    domains = any_flgo["domains"] if any_flgo else []
    if domains:
        lines += ["", "## Per domain (final round, mean over seeds)", "",
                  "| method | framework | " + " | ".join(domains) + " | AVG |",
                  "|---|---|" + "---:|" * (len(domains) + 1)]
        for m in methods:
            rname = "raysim" if base_method(m) == m else f"raysim ({base_method(m)})"
            for name, src in (("FLGo", fl), (rname, rs)):
                per = src.get(m, {})
                if not per:
                    continue
                cells = []
                for d in domains + ["AVG"]:
                    vals = [per[s]["final"][d] for s in seeds if s in per and d in per[s]["final"]]
                    cells.append(f"{100 * sum(vals) / len(vals):.2f}" if vals else "-")
                lines.append(f"| {m} | {name} | " + " | ".join(cells) + " |")
        lines += ["", "## Per seed (AVG, final round)", "", "| method | seed | FLGo | raysim |", "|---|---:|---:|---:|"]
        for m in methods:
            for s in seeds:
                f = fl.get(m, {}).get(s)
                r = rs.get(m, {}).get(s)
                lines.append(f"| {m} | {s} | {100 * f['final']['AVG']:.2f} |" if f else f"| {m} | {s} | - |")
                lines[-1] += f" {100 * r['final']['AVG']:.2f} |" if r else " - |"
    lines += ["", "## Where FLGo's implementation differs from raysim's", ""]
    for m in methods:
        para = fl.get(m) and next(iter(fl[m].values())).get("applied", {}).get("algo_para")
        lines.append(f"* **{m}** (FLGo algo_para {para if para else '{}'}): {NOTES[m]}")
    for m in methods:
        neg = sorted((s, r["final"]["min_running_var"]) for s, r in fl.get(m, {}).items()
                     if r["final"].get("min_running_var", 0.0) < 0)
        if neg:
            lines.append(f"* **{m}**: FLGo's final global model has negative BN running variances ("
                         + ", ".join(f"seed {s}: min {v:.3g}" for s, v in neg)
                         + "): batch normalisation at test time divides by the square root of a negative number, "
                           "the outputs are NaN and every image gets the same class (chance accuracy).")
    bn = {m: [r["final"]["min_running_var"] for r in fl.get(m, {}).values() if "min_running_var" in r["final"]]
          for m in methods}
    if any(bn.values()):
        lines.append("* **BN running variances** of FLGo's final global model (smallest entry, per seed): "
                     + "; ".join(f"{m} " + "/".join(f"{v:.3g}" for v in vals) for m, vals in bn.items() if vals)
                     + ". Below 0 the model outputs NaN (FLGo's FedDyn after round 2 here); a FedDyn variance "
                       "far above the other methods' in both feddyn and feddyn_bnmean comes from FedDyn's parameters "
                       "(larger activations), not from the BN-statistics rule.")
    lines += ["* **all**: the same arrays, partition, initial weights (max |diff| recorded per run), model "
              "(raysim's small_cnn in an FModule), SGD settings, clipping (clip_grad_norm_ over the model's "
              "parameters before the step; weight decay inside SGD, after the clip), 24 steps of batch 32 per "
              "round (last batch of 7), every client every round. The batch order differs: FLGo shuffles with "
              "torch's global generator (flgo seed), raysim with its (seed, round, client) generators, so the "
              "runs agree in distribution, not bit for bit (`--batch-order raysim` makes FLGo's clients visit "
              "their examples in raysim's order: a diagnostic of the same computation)."]
    if notes:
        lines += ["", "## Missing", ""] + [f"* {n}" for n in notes]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "crosscheck.md"), "w", encoding="utf-8") as fh:
        fh.write(text)
    with open(os.path.join(out, "crosscheck.json"), "w", encoding="utf-8") as fh:
        json.dump({"flgo": fl, "raysim": rs, "verdicts": verdicts, "notes": notes}, fh, indent=1, default=str)
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=DEFAULT_CONFIG, help="raysim config (default: configs/baselines/digits5_all.yaml)")
    p.add_argument("--rounds", type=int, default=None, help="rounds (default: the config's)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--methods", nargs="+", default=DEFAULT_METHODS, choices=DEFAULT_METHODS,
                   help="FLGo methods (default: the six and the diagnostic feddyn_bnmean)")
    p.add_argument("--raysim-run", default=None, help="raysim run directory of the same config")
    p.add_argument("--out", required=True, help="folder for data/, raw/ (FLGo per method and seed) and the table")
    p.add_argument("--table-only", action="store_true", help="do not run FLGo; rebuild the table from <out>/raw")
    p.add_argument("--force", action="store_true", help="rerun FLGo even where <out>/raw has the result")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the FLGo runner")
    p.add_argument("--batch-order", choices=("flgo", "raysim"), default="flgo",
                   help="flgo: FLGo shuffles as it does (the cross-check); raysim: diagnostic, FLGo's clients "
                        "visit their examples in raysim's seeded order, so both train on the same batches")
    p.add_argument("--weights-check", action="store_true",
                   help="instead of the table: FLGo with raysim's batch order vs raysim, max |difference| of the "
                        "global models after --rounds (default 1) rounds, first seed")
    ns = p.parse_args(argv)
    os.makedirs(ns.out, exist_ok=True)
    from raysim.config import load_config
    rounds = ns.rounds or int(load_config(ns.config, []).rounds)
    if ns.weights_check:
        from benchmarks import flgo_env
        py, what = flgo_env.ensure(log=log)
        if py is None:
            log(f"FLGo is not available: {what}")
            return 1
        print(weights_check(py, ns.config, ns.methods, ns.seeds[0], ns.rounds or 1, ns.out, ns.threads))
        return 0
    if not ns.table_only:
        from benchmarks import flgo_env
        py, what = flgo_env.ensure(log=log)
        if py is None:
            log(f"FLGo is not available: {what}")
            return 1
        log(f"FLGo venv: {what}")
        run_flgo(py, ns.config, ns.methods, ns.seeds, ns.rounds, ns.out, ns.force, ns.threads, ns.batch_order)
    print(render(ns.out, ns.methods, ns.seeds, rounds, ns.raysim_run))
    return 0


if __name__ == "__main__":
    sys.exit(main())
