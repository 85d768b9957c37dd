"""raysim against the plain PyTorch loop, Flower, pfl-research and FLGo, in one invocation.

    .venv/bin/python benchmarks/run.py            # full: A 20 rounds, B 10, C 20, D 10, P 10
    .venv/bin/python benchmarks/run.py --quick    # fewer rounds (4), same table and ratios
    .venv/bin/python benchmarks/run.py --only D,P --rounds 2 --no-flower   # a smoke run
    .venv/bin/python benchmarks/run.py --only B --noisy    # a busy process pinned to one core throughout
    .venv/bin/python benchmarks/run.py --device cuda --quick   # the device benchmark on a GPU (below)
    .venv/bin/python benchmarks/run.py --device cpu --rounds 2 --only B   # its smoke test (make test)

(A, B and C alone: 33 and 13 minutes on a 2-core machine shared with other work at load average
~10, plus 1-3 minutes the first time to install each side venv with pip.)

Workloads (``benchmarks/workloads.py``): A cross-silo FedAvg, 5 clients; B cross-device FedAvg,
1,000 clients, 50 per round; C FedBN with 1,000,000 registered clients vs 1,000, 100 per round;
D overhead-bound FedAvg, a tiny model, 1,000 clients, 100 per round, batch 10; P pfl-research's
published image-classification setting scaled to this machine (1,000 clients, 50 per round,
batch 10). Every arm runs in its own process, one after the other (never two Ray instances at once):

* plain  the FedAvg loop of ``plain.py`` in one process, torch.set_num_threads(2) (both cores)
         and, as the reference of the equivalence check, with 1 thread;
* raysim 2 ClientHost actors x 1 CPU (1 torch thread each) on the 2 cores;
* flower ``flwr[simulation]`` in ``benchmarks/.venv-flwr``, client resources num_cpus=1 (2 actors);
* pfl    pfl-research's simulated backend with PyTorch in ``benchmarks/.venv-pfl``, 2 worker
         processes x 1 thread (pfl's torch.distributed multi-worker mode);
* flgo   FLGo 0.3.29's simulator in ``benchmarks/.venv-flgo``, 1 process, 1 thread.

Before any ratio is read, the final global weights of raysim and of the 1-thread plain loop
must agree (max |difference| <= --tolerance, 0 expected): a benchmark of different computations
is void, and the harness exits with status 1 if they do not. The external arms are checked the
same way; one that does not compute the same weights gets no ``<arm>/raysim`` ratio: the harness
reports its cost per client step (``<arm>_ms_per_step`` and ``raysim_ms_per_step``: median round
time / local SGD steps per round, overhead included) instead.

Round time = the median of the per-round wall times (sample, broadcast, local training,
aggregation) of the rounds between the first and the last, in every arm: the last holds the final
evaluation, the first the warm-up (Flower's actors load the data raysim's hosts load at start-up;
every process that trains imports torch._dynamo at its first optimizer step).
Start-up (Ray, actors, data) is reported separately. Output: the table, then one line per ratio
``RATIO <workload> <name> <value>``, then one line per target ``TARGET <workload> <name> ...``;
everything is also written to OUT/results.json.

The device benchmark (``--device cuda``, or ``--device cpu`` for its smoke test) is a separate flow:
for each workload of A, B, D, P, B6 (B with ``cnn6``) and R (FedAvg in DapperFL's ResNet-10 digits5
setting) -- 4 rounds each with ``--quick``, R 2 -- the arms are

* plain     the plain loop on the device (``plain.py --device``: model on the device, each batch
            copied there, no per-step host sync), 1 thread: the reference of every check and ratio;
* raysim    per-client, H hosts sharing the device: H in {1, 4} with ``--quick`` ({1, 2, 4, 8} in
            full) on cuda, each host ``gpus_per_host = 1/H``, ``cpus_per_host = 1``,
            ``device_data_mb = 2000``; H in {1, 2} on the CPU;
* cohort    raysim with client cohorts (``runtime.cohort_size``, 1 host), reported as not
            available while raysim has no such setting;
* pfl       pfl-research on the GPU (A, B, D, P; one worker), only where ``benchmarks/.venv-pfl``
            already imports pfl (nothing is installed in this mode); otherwise not available.

Each arm's result is printed (an ``ARM`` line) and appended to OUT/arms.jsonl as soon as it
finishes; every arm's final weights are checked against the plain loop's: max |difference| <=
the tolerance (``--tolerance``; default 1e-6 on the CPU and with ``--deterministic``, 5e-2 on
cuda without it: non-deterministic GPU kernels drift, ~1e-2 after 6 rounds of A). ``--deterministic``
runs every arm with deterministic kernels (``runtime.deterministic``). The exit status is 1 if an
arm failed or its weights differ. Ratios: ``raysim_h<H>/plain``, ``raysim_best/plain``,
``cohort/plain``, ``pfl/plain`` (median round time over the plain loop's); on cuda the issue's
targets follow as TARGET lines.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks import flgo_env, flower_env, pfl_env, venvs  # noqa: E402
from benchmarks.procmem import cpu_seconds  # noqa: E402
from benchmarks.workloads import (DEVICE_WORKLOADS, WORKLOADS, raysim_config, workload_a,  # noqa: E402
                                  workload_c)

# (workload, ratio name, only with --noisy?) -> (comparison, bound)
TARGETS = {
    ("A", "raysim/plain", False): ("<=", 1.10), ("B", "raysim/plain", False): ("<=", 1.10),
    ("D", "raysim/plain", False): ("<=", 1.20),
    ("A", "flower/raysim", False): (">=", 3.0), ("B", "flower/raysim", False): (">=", 3.0),
    ("D", "flower/raysim", False): (">=", 10.0),
    ("A", "pfl/raysim", False): (">=", 1.0), ("B", "pfl/raysim", False): (">=", 1.0),
    ("D", "pfl/raysim", False): (">=", 1.0),
    ("A", "flgo/raysim", False): (">=", 1.0), ("B", "flgo/raysim", False): (">=", 1.0),
    ("D", "flgo/raysim", False): (">=", 1.0),
    ("B", "raysim/plain_1thread", True): ("<=", 0.85),
    ("C", "rounds_1m/1k", False): ("<=", 1.25), ("C", "startup_1m/1k", False): ("<=", 1.5),
    ("C", "mem_over_budget", False): ("<=", 1.0),
    ("S", "first_round_s/8s", False): ("<=", 1.0),
}
FEDAVG = ("A", "B", "D", "P")  # the workloads every FedAvg arm runs
EXTERNAL = ("flower", "pfl", "flgo")
ROUNDS = {"A": 20, "B": 10, "C": 20, "D": 10, "P": 10}


def target_lines(ratios: list[tuple[str, str, float]], noisy: bool) -> list[str]:
    """``TARGET <workload> <name> <op> <bound> <measured> met|missed`` for every target measured."""
    out = []
    for (w, name, needs_noise), (op, bound) in TARGETS.items():
        if needs_noise and not noisy:
            continue
        for rw, rn, v in ratios:
            if (rw, rn) == (w, name):
                ok = v <= bound if op == "<=" else v >= bound
                out.append(f"TARGET {w} {name}{' (noisy)' if needs_noise else ''} {op} {bound:g}: "
                           f"{v:.3g} {'met' if ok else 'missed'}")
    return out


class Noise:
    """``--noisy``: a pure-Python busy loop pinned to one CPU, started before each arm and stopped
    after it (the plain-loop references included), so that every arm runs with one core busy."""

    def __init__(self, cpu: int):
        self.cpu = int(cpu)
        self.proc: subprocess.Popen | None = None
        self.log: list[dict] = []
        self._t0 = 0.0

    def describe(self) -> str:
        return f"--noisy: a pure-Python busy loop pinned to CPU {self.cpu} ran during every arm"

    def start(self) -> None:
        cpu = self.cpu
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                     preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
        self._t0 = time.perf_counter()

    def stop(self, arm: str) -> None:
        if self.proc is None:
            return
        used = cpu_seconds(self.proc.pid)
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.append({"arm": arm, "wall_s": time.perf_counter() - self._t0, "noise_cpu_s": used})
        self.proc = None


NOISE: Noise | None = None  # set by main() for --noisy


# ----------------------------------------------------------------------------- helpers

def load_average() -> str:
    try:
        with open("/proc/loadavg", encoding="utf-8") as fh:
            return " ".join(fh.read().split()[:3])
    except OSError:
        return "n/a"


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')} load {load_average()}] {msg}", file=sys.stderr, flush=True)


def steady_rounds(values: list) -> list:
    """The rounds between the first (warm-up: Ray workers importing torch._dynamo at their first
    optimizer, Flower's actors loading data) and the last (the final evaluation, in every arm):
    with 4 rounds a plain median would average a training round with the evaluation round."""
    return values[1:-1] if len(values) >= 3 else values


def median_round(res: dict) -> float:
    return statistics.median(steady_rounds(res["round_seconds"]))


def median_cpu(res: dict) -> float | None:
    cpu = res.get("round_cpu") or []
    if len(cpu) == len(res["round_seconds"]):  # rounds 1..R (the plain loop); the others: 2..R
        cpu = steady_rounds(cpu)
    elif len(cpu) >= 2:
        cpu = cpu[:-1]
    return statistics.median(cpu) if cpu else None


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("RAY_DEDUP_LOGS", "0")
    # OpenMP threads sleep rather than spin while waiting: on a loaded machine a spinning
    # 2-thread plain loop slows down many times over (it only helps the plain baseline)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


def run_arm(name: str, cmd: list[str], out: str, timeout: float) -> dict:
    """Run one arm in its own process (with the --noisy busy loop around it); its output goes to
    OUT/log.txt."""
    os.makedirs(out, exist_ok=True)
    logfile = os.path.join(out, "log.txt")
    if NOISE is not None:
        NOISE.start()
    t0 = time.perf_counter()
    try:
        with open(logfile, "w", encoding="utf-8") as fh:
            try:
                r = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=_env(), cwd=REPO, timeout=timeout)
                rc = r.returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
    finally:
        wall = time.perf_counter() - t0
        if NOISE is not None:
            NOISE.stop(name)
    path = os.path.join(out, "result.json")
    if rc != 0 or not os.path.isfile(path):
        with open(logfile, encoding="utf-8", errors="replace") as fh:
            tail = [ln.rstrip() for ln in fh.readlines() if ln.strip()][-3:]
        raise RuntimeError(f"{name} failed (exit {rc}; log {logfile}): {' | '.join(tail)[-400:]}")
    with open(path, encoding="utf-8") as fh:
        res = json.load(fh)
    res["process_seconds"] = wall
    return res


def max_abs_diff(a_path: str, b_path: str) -> float:
    import torch

    from benchmarks.plain import weights_diff
    return weights_diff(torch.load(a_path, weights_only=True), torch.load(b_path, weights_only=True))


def write_spec(spec: dict, out: str) -> str:
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"spec-{spec['name']}-{spec['partition'].get('num_clients', 'silo')}.json")
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(spec, fh, indent=1)
    return path


class Bench:
    def __init__(self, out: str, timeout: float, tolerance: float):
        self.out, self.timeout, self.tolerance = out, timeout, tolerance
        self.rows: list[dict] = []
        self.ratios: list[tuple[str, str, float]] = []
        self.notes: list[str] = []
        self.results: dict = {"load_before": load_average()}
        self.void = False
        self.pfl_native = False

    def plain(self, spec, threads: int, tag: str):
        log(f"{spec['name']}: plain loop, {threads} thread(s)")
        out = os.path.join(self.out, f"{spec['name']}-{tag}")
        return run_arm(f"plain {spec['name']}", [sys.executable, os.path.join(HERE, "plain.py"),
                                                 write_spec(spec, self.out), out, "--threads", str(threads)],
                       out, self.timeout), out

    def raysim(self, spec, tag: str, memory: bool = False, hosts: int = 2, runtime: dict | None = None):
        log(f"{spec['name']}: raysim, {hosts} hosts x 1 CPU ({spec['partition'].get('num_clients', 5)} clients)"
            f"{f' {runtime}' if runtime else ''}")
        out = os.path.join(self.out, f"{spec['name']}-{tag}")
        cmd = [sys.executable, os.path.join(HERE, "raysim_runner.py"), write_spec(spec, self.out), out,
               "--hosts", str(hosts)] + (["--memory"] if memory else []) + \
              (["--runtime", json.dumps(runtime)] if runtime else [])
        return run_arm(f"raysim {spec['name']}", cmd, out, self.timeout), out

    def flower(self, spec, py: str):
        log(f"{spec['name']}: Flower simulation, 2 actors x 1 CPU")
        out = os.path.join(self.out, f"{spec['name']}-flower")
        return run_arm(f"flower {spec['name']}", [py, os.path.join(HERE, "flower_runner.py"),
                                                  write_spec(spec, self.out), out], out, self.timeout), out

    def pfl(self, spec, py: str, native: bool = False, workers: int = 2):
        log(f"{spec['name']}: pfl-research simulated backend, {workers} workers x 1 thread"
            f"{' (pfl native FedAvg)' if native else ''}")
        out = os.path.join(self.out, f"{spec['name']}-pfl")
        cmd = [py, os.path.join(HERE, "pfl_runner.py"), write_spec(spec, self.out), out, "--workers", str(workers),
               "--threads", "1"] + (["--native"] if native else [])
        return run_arm(f"pfl {spec['name']}", cmd, out, self.timeout), out

    def flgo(self, spec, py: str):
        log(f"{spec['name']}: FLGo simulator, 1 process x 1 thread")
        out = os.path.join(self.out, f"{spec['name']}-flgo")
        return run_arm(f"flgo {spec['name']}", [py, os.path.join(HERE, "flgo_bench_runner.py"),
                                                write_spec(spec, self.out), out], out, self.timeout), out

    def row(self, workload: str, arm: str, res: dict, resources: str, diff: float | None = None, **extra):
        r = {"workload": workload, "arm": arm, "resources": resources,
             "ray_start": res.get("ray_start_seconds"), "startup": res.get("startup_seconds"),
             "round_median": median_round(res), "round_mean": statistics.fmean(res["round_seconds"]),
             "cpu_median": median_cpu(res),
             "rounds_total": sum(res["round_seconds"]), "rounds": len(res["round_seconds"]),
             "test_avg": (res.get("final_eval") or {}).get("AVG"), "diff": diff, **extra}
        if r.get("steps"):
            r["ms_step"] = 1000 * r["round_median"] / r["steps"]
        self.rows.append(r)
        return r

    def ratio(self, workload: str, name: str, value: float | None):
        if value is not None:
            self.ratios.append((workload, name, value))


# ----------------------------------------------------------------------------- workloads

def _div(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def steps_per_round(spec: dict) -> float:
    """Local SGD steps per round, averaged over the rounds: sum over the sampled clients of
    epochs x ceil(n_k / batch size), as every arm trains them."""
    from benchmarks.plain import PlainFederation
    fed = PlainFederation(spec)
    bs, ep = int(spec["train"]["batch_size"]), int(spec["train"].get("epochs", 1))
    rounds = int(spec["rounds"])
    total = sum(ep * -(-len(fed.partition.shard(c).train) // bs) for r in range(1, rounds + 1) for c in fed.sample(r))
    return total / rounds


RESOURCES = {"flower": "2 actors x 1 CPU, 1 thread", "pfl": "2 workers x 1 thread (torch.distributed)",
             "flgo": "1 process, 1 thread"}


def fedavg_workload(b: Bench, spec: dict, externals: dict[str, tuple[str | None, str]]) -> None:
    """plain (1 and 2 threads), raysim, then each external arm of ``externals`` ({arm: (python of
    its venv or None, versions or why not)})."""
    w = spec["name"]
    steps = steps_per_round(spec)
    ref, ref_dir = b.plain(spec, 1, "plain-1t")
    fast, fast_dir = b.plain(spec, 2, "plain-2t")
    rs, rs_dir = b.raysim(spec, "raysim")
    diff = max_abs_diff(os.path.join(rs_dir, "weights.pt"), os.path.join(ref_dir, "weights.pt"))
    ok = diff <= b.tolerance
    print(f"equivalence {w}: max |w_raysim - w_plain(1 thread)| = {diff:.3g} after {spec['rounds']} rounds "
          f"({'OK' if ok else 'MISMATCH: the timings below compare different computations'})", flush=True)
    if not ok:
        b.void = True
    d2 = max_abs_diff(os.path.join(fast_dir, "weights.pt"), os.path.join(ref_dir, "weights.pt"))
    b.row(w, "plain", ref, "1 process, 1 thread", 0.0, steps=steps)
    b.row(w, "plain", fast, "1 process, 2 threads", d2, steps=steps)
    b.row(w, "raysim", rs, "2 hosts x 1 CPU, 1 thread", diff, steps=steps)
    b.results[w] = {"plain_1t": ref, "plain_2t": fast, "raysim": rs, "equivalence_max_abs_diff": diff,
                    "steps_per_round": steps}
    b.ratio(w, "raysim/plain", median_round(rs) / median_round(fast))
    b.ratio(w, "raysim/plain_1thread", median_round(rs) / median_round(ref))
    b.ratio(w, "raysim/plain_cpu", _div(median_cpu(rs), median_cpu(ref)))
    if NOISE is not None:  # what work stealing buys: the same run with every client on its own host
        pinned, pinned_dir = b.raysim(spec, "raysim-pinned", runtime={"balance": "owner"})
        pdiff = max_abs_diff(os.path.join(pinned_dir, "weights.pt"), os.path.join(ref_dir, "weights.pt"))
        b.row(w, "raysim", pinned, "2 hosts x 1 CPU, clients pinned (runtime.balance=owner)", pdiff, steps=steps)
        b.ratio(w, "raysim_pinned/plain_1thread", median_round(pinned) / median_round(ref))
    per_step_reported = False
    for arm in EXTERNAL:
        if arm not in externals:
            continue
        py, why = externals[arm]
        if py is None:
            b.rows.append({"workload": w, "arm": arm, "na": f"{arm}: not available: {why}"})
            continue
        try:
            if arm == "flower":
                res, arm_dir = b.flower(spec, py)
            elif arm == "pfl":
                res, arm_dir = b.pfl(spec, py, native=b.pfl_native)
            else:
                res, arm_dir = b.flgo(spec, py)
        except RuntimeError as err:
            b.rows.append({"workload": w, "arm": arm, "na": f"{arm}: not available: {err}"})
            continue
        wpath = os.path.join(arm_dir, "weights.pt")
        adiff = max_abs_diff(wpath, os.path.join(ref_dir, "weights.pt")) if os.path.isfile(wpath) else float("inf")
        same = adiff <= b.tolerance and res.get("identical", True)
        b.row(w, arm, res, RESOURCES[arm] + ("" if res.get("mode", "same-computation") == "same-computation"
                                             else f", {res['mode']}"), adiff, ray_start=None, steps=steps)
        b.results[w][arm] = res
        print(f"equivalence {w}: max |w_{arm} - w_plain(1 thread)| = {adiff:.3g} "
              f"({'OK' if same else 'NOT the same computation: cost per client step reported instead'})", flush=True)
        if same:
            b.ratio(w, f"{arm}/raysim", median_round(res) / median_round(rs))
            b.ratio(w, f"{arm}/raysim_cpu", _div(median_cpu(res), median_cpu(rs)))
        else:
            b.notes.append(f"{w} {arm}: final weights differ from the plain loop's by {adiff:.3g} (mode "
                           f"{res.get('mode', '-')}): no {arm}/raysim ratio; cost per client step "
                           f"(median round / {steps:g} local SGD steps per round) instead.")
            b.ratio(w, f"{arm}_ms_per_step", 1000 * median_round(res) / steps)
            if not per_step_reported:
                b.ratio(w, "raysim_ms_per_step", 1000 * median_round(rs) / steps)
                per_step_reported = True


def state_bytes_per_client(spec: dict) -> int:
    """What FedBN keeps per client, counted as raysim's store counts it (tensor bytes + dicts)."""
    from benchmarks.plain import PlainFederation
    from raysim.core.tensors import bn_keys
    from raysim.engine.store import state_nbytes

    model = PlainFederation(spec).build_model()
    keys = bn_keys(model)
    return state_nbytes({"personal": {k: v for k, v in model.state_dict().items() if k in keys}})


def clients_with_state(spec: dict) -> int:
    from benchmarks.plain import sample_clients
    n, k = int(spec["partition"]["num_clients"]), int(spec["clients_per_round"])
    seen = set()
    for rnd in range(1, int(spec["rounds"]) + 1):
        seen.update(sample_clients(int(spec["seed"]), rnd, n, k))
    return len(seen)


def scale_workload(b: Bench, rounds: int, big: int = 1_000_000, small: int = 1_000,
                   store_clients: int = 100_000) -> None:
    """C: the same FedBN federation with ``big`` and ``small`` registered clients (100 train per
    round): round time, start-up and memory must not grow with the registrations; then the
    client-state store's memory with ``store_clients`` clients' states."""
    res = {}
    for n in (small, big):
        spec = workload_c(rounds=rounds, num_clients=n)
        r, _ = b.raysim(spec, f"raysim-{n}", memory=True)
        per_client = state_bytes_per_client(spec)
        holders = clients_with_state(spec)
        r["state_bytes"] = per_client * holders
        r["state_bytes_per_client"], r["clients_with_state"] = per_client, holders
        res[n] = r
        b.row("C", f"raysim {n:,} reg.", r, "2 hosts x 1 CPU, 1 thread",
              peak_mib=r["peak_rss"] / 2**20, state_mib=r["state_bytes"] / 2**20)
    s, g = res[small], res[big]
    base = s["peak_rss"] - s["state_bytes"]
    budget = base + 1.5 * g["state_bytes"]
    b.results["C"] = {"small": s, "big": g, "base_bytes": base, "budget_bytes": budget}
    b.notes.append(
        f"C memory: peak RSS sum (driver + Ray processes + workers) {g['peak_rss'] / 2**20:.0f} MiB with {big:,} "
        f"registered clients vs {s['peak_rss'] / 2**20:.0f} MiB with {small:,}; base = the {small:,} run's peak "
        f"less its state = {base / 2**20:.0f} MiB; persistent state = {g['clients_with_state']:,} clients with state x "
        f"{g['state_bytes_per_client']} B (FedBN's BN tensors) = {g['state_bytes'] / 2**20:.2f} MiB; "
        f"budget = base + 1.5 x state = {budget / 2**20:.0f} MiB. Before round 1: "
        f"{s['rss_before_rounds'] / 2**20:.0f} MiB ({small:,}) vs {g['rss_before_rounds'] / 2**20:.0f} MiB ({big:,}).")
    b.ratio("C", "rounds_1m/1k", median_round(g) / median_round(s))
    b.ratio("C", "rounds_1m/1k_cpu", median_cpu(g) / median_cpu(s))
    b.ratio("C", "mem_over_budget", g["peak_rss"] / budget)
    b.ratio("C", "startup_1m/1k", g["startup_seconds"] / s["startup_seconds"])
    # the store holds states, not registrations: its cost per state is measured on store_clients
    # states (a federation of 1,000,000 registered clients holds only those that trained)
    log(f"C: raysim's client-state store with {store_clients:,} FedBN states (RSS growth vs state bytes)")
    out = os.path.join(b.out, "C-store")
    st = run_arm("store", [sys.executable, os.path.join(HERE, "store_mem.py"), str(store_clients), out], out,
                 b.timeout)
    b.results["C"]["store"] = st
    b.notes.append(f"C store: {st['clients']:,} FedBN client states ({st['tensors_per_client']} tensors each) "
                   f"hold {st['state_bytes'] / 2**20:.1f} MiB of state and grow the host's RSS by "
                   f"{st['rss_growth'] / 2**20:.1f} MiB ({st['ratio']:.2f}x); put {st['put_us']:.0f} us, "
                   f"get {st['get_us']:.0f} us per client. It measures bytes per stored state, not "
                   f"registrations: the {big:,}-client run stores only the clients that trained.")
    b.ratio("C", "store_rss/state_bytes", st["ratio"])


def cli_first_round(b: Bench, spec: dict, runs: int = 1) -> None:
    """Seconds from launching ``raysim run CONFIG`` to the end of round 1 (its metrics file); with
    ``runs`` > 1 the median of that many launches (one launch varies by ~1.5 s on a 2-core VM)."""
    firsts, totals = [], []
    for _ in range(runs):
        first, total = _cli_first_round_once(b, spec)
        firsts.append(first)
        totals.append(total)
    first, total = statistics.median(firsts), statistics.median(totals)
    b.results["cli"] = {"first_round_seconds": first, "process_seconds": total, "first_round_runs": firsts}
    over = f" (median of {len(firsts)} launches, {min(firsts):.1f}-{max(firsts):.1f} s)" if len(firsts) > 1 else ""
    b.notes.append(f"`raysim run` (workload A config, 1 round) to the end of round 1: {first:.1f} s{over}; "
                   f"process exit (incl. report and Ray shutdown): {total:.1f} s.")
    b.ratio("S", "first_round_s/8s", first / 8.0)


def _cli_first_round_once(b: Bench, spec: dict) -> tuple[float, float]:
    """One launch of ``raysim run``: (seconds to round 1's metrics file, seconds to its exit)."""
    from raysim.config import dump_yaml
    one = dict(spec, rounds=1)
    cfg = raysim_config(one, hosts=2, eval_every=1)
    out = os.path.join(b.out, "cli")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "config.yaml")
    dump_yaml(cfg, path)
    run_dir = os.path.join(out, "run")
    shutil.rmtree(run_dir, ignore_errors=True)
    raysim_bin = os.path.join(os.path.dirname(sys.executable), "raysim")
    cmd = [raysim_bin] if os.path.exists(raysim_bin) else [sys.executable, "-m", "raysim"]
    cmd += ["run", path, "--quiet", "--out", run_dir]
    log(f"CLI: {' '.join(cmd[-5:])} (time to the end of round 1)")
    metrics = os.path.join(run_dir, "metrics.parquet")
    if NOISE is not None:
        NOISE.start()
    try:
        with open(os.path.join(out, "log.txt"), "w", encoding="utf-8") as fh:
            t0 = time.perf_counter()
            p = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=_env(), cwd=REPO)
            first = None
            while p.poll() is None:
                if first is None and os.path.exists(metrics):
                    first = time.perf_counter() - t0
                time.sleep(0.02)
            total = time.perf_counter() - t0
    finally:
        if NOISE is not None:
            NOISE.stop("raysim run (CLI)")
    if p.returncode != 0:
        raise RuntimeError(f"raysim run failed (exit {p.returncode}); see {out}/log.txt")
    if first is None:
        first = total
    return first, total


# ----------------------------------------------------------------------------- the device benchmark

DEVICE_ORDER = ("A", "B", "D", "P", "B6", "R")
DEVICE_ROUNDS = {"quick": {"A": 4, "B": 4, "D": 4, "P": 4, "B6": 4, "R": 2},
                 "full": {"A": 20, "B": 10, "D": 10, "P": 10, "B6": 10, "R": 6}}
DEVICE_HOSTS = {"cuda": {"quick": (1, 4), "full": (1, 2, 4, 8)}, "cpu": {"quick": (1, 2), "full": (1, 2)}}
DEVICE_DATA_MB = 2000  # per host on cuda: the clients' data kept on the GPU, batches cut there
# (workload, ratio) -> (comparison, bound): issue 31's targets on one H100/H200 (cohort goals on B, B6)
DEVICE_TARGETS = {
    **{(w, "raysim_best/plain"): ("<=", 1.0) for w in ("A", "B", "D", "B6")},
    **{(w, "raysim_h1/plain"): ("<=", 1.3) for w in ("A", "B", "D", "B6")},
    ("D", "cohort/plain"): ("<=", 0.2), ("P", "cohort/plain"): ("<=", 0.2),
    ("B", "cohort/plain"): ("<=", 0.3), ("B6", "cohort/plain"): ("<=", 0.5),
}


def device_tolerance(device: str, deterministic: bool, given: float | None) -> float:
    """max |w_arm - w_plain| an arm may show: exact on the CPU and with deterministic kernels (1e-6,
    0 expected); 5e-2 on cuda without them (atomics and autotuned kernels drift: ~1e-2 after 6
    rounds of A on an H200)."""
    if given is not None:
        return given
    return 5e-2 if device == "cuda" and not deterministic else 1e-6


# max |w_cohort - w_plain|: cohorts equal the per-client path within rounding, not bit for bit
# (vmap's batched kernels sum in another order): 2.9e-6 after 2 rounds of B on a CPU
COHORT_TOLERANCE = 1e-4


def cohort_unavailable() -> str | None:
    """Why the cohort arm cannot run (None when raysim has ``runtime.cohort_size``)."""
    import dataclasses

    from raysim.config import RuntimeConfig
    if "cohort_size" in {f.name for f in dataclasses.fields(RuntimeConfig)}:
        return None
    return "raysim has no runtime.cohort_size yet (client cohorts: coming)"


def pfl_on_device() -> tuple[str | None, str]:
    """(python of benchmarks/.venv-pfl, versions) when pfl already imports there; nothing is
    installed here (a GPU machine may have no network): (None, why) otherwise."""
    sv = pfl_env.side_venv()
    py = sv.python()
    if not (os.path.isfile(os.path.join(sv.path, venvs.MARKER)) and os.path.exists(py)):
        return None, f"pfl-research is not installed ({os.path.relpath(sv.path, REPO)} missing)"
    ok = sv._check()
    if ok.returncode != 0:
        return None, f"pfl does not import: {venvs.last_error(ok.stderr)}"
    return py, sv.describe(ok.stdout)


class DeviceBench(Bench):
    """The device benchmark's arms; each one's result is appended to OUT/arms.jsonl and printed as
    soon as it finishes."""

    def __init__(self, out: str, timeout: float, tolerance: float, device: str, deterministic: bool):
        super().__init__(out, timeout, tolerance)
        self.device, self.deterministic = device, deterministic
        self.arms_file = os.path.join(out, "arms.jsonl")
        self.failed: list[str] = []

    def record(self, workload: str, arm: str, resources: str, res: dict | None = None, diff: float | None = None,
               steps: float | None = None, na: str | None = None, tolerance: float | None = None) -> None:
        tolerance = self.tolerance if tolerance is None else tolerance
        entry = {"workload": workload, "arm": arm, "resources": resources, "device": self.device,
                 "deterministic": self.deterministic, "time": time.strftime("%Y-%m-%d %H:%M:%S")}
        if na is not None:
            entry["not_available"] = na
            self.rows.append({"workload": workload, "arm": arm, "na": f"{resources}: {na}"})
            line = f"ARM {workload} {arm}: not available: {na}"
        else:
            ok = diff is not None and diff <= tolerance
            if not ok:
                self.void = True
            r = self.row(workload, arm, res, resources, diff, steps=steps)
            entry.update(round_median=r["round_median"], round_seconds=res["round_seconds"],
                         startup=res.get("startup_seconds"), ray_start=res.get("ray_start_seconds"),
                         test_avg=r["test_avg"], max_abs_diff=diff, tolerance=tolerance,
                         same=ok, steps_per_round=steps)
            line = (f"ARM {workload} {arm} [{resources}]: round {r['round_median']:.3f} s (median), start-up "
                    f"{fmt(res.get('startup_seconds'))} s, max |w - w_plain| = {diff:.3g} "
                    f"({'OK' if ok else 'MISMATCH'}: tolerance {tolerance:g})")
        with open(self.arms_file, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(entry, default=str) + "\n")
        print(line, flush=True)

    def fail(self, workload: str, arm: str, resources: str, err: Exception) -> None:
        self.failed.append(f"{workload} {arm}")
        self.record(workload, arm, resources, na=f"FAILED: {err}")

    def plain_arm(self, spec: dict):
        log(f"{spec['name']}: plain loop on {self.device}, 1 thread")
        out = os.path.join(self.out, f"{spec['name']}-plain-{self.device}")
        cmd = [sys.executable, os.path.join(HERE, "plain.py"), write_spec(spec, self.out), out, "--threads", "1",
               "--device", self.device] + (["--deterministic"] if self.deterministic else [])
        return run_arm(f"plain {spec['name']}", cmd, out, self.timeout), out

    def host_runtime(self, hosts: int, extra: dict | None = None) -> dict:
        rt = {"deterministic": True} if self.deterministic else {}
        if self.device == "cuda":
            rt.update(gpus_per_host=1.0 / hosts, cpus_per_host=1, device_data_mb=DEVICE_DATA_MB)
        return {**rt, **(extra or {})}

    def host_resources(self, hosts: int) -> str:
        if self.device == "cuda":
            return f"{hosts} host(s) x {1 / hosts:g} GPU, 1 CPU"
        return f"{hosts} host(s) x 1 CPU, 1 thread"


def targeted(workload: str, ratio_names: tuple[str, ...]) -> bool:
    """Whether a ``DEVICE_TARGETS`` line reads one of these ratios of this workload."""
    return any((workload, name) in DEVICE_TARGETS for name in ratio_names)


def device_workload(b: DeviceBench, spec: dict, hosts: tuple[int, ...], cohort_size, pfl: tuple | None,
                    targets_only: bool = False) -> None:
    """The plain loop on the device, then raysim per-client at each H, cohorts, pfl (cuda); with
    ``targets_only``, only the arms a target reads (the GPU check's time is short)."""
    w = spec["name"]
    steps = steps_per_round(spec)
    try:
        ref, ref_dir = b.plain_arm(spec)
    except RuntimeError as err:
        b.fail(w, "plain", f"1 process, 1 thread, {b.device}", err)
        return
    ref_w = os.path.join(ref_dir, "weights.pt")
    b.record(w, "plain", f"1 process, 1 thread, {b.device}", ref, 0.0, steps)
    b.results[w] = {"plain": ref, "steps_per_round": steps}
    base = median_round(ref)

    def arm(name: str, tag: str, n_hosts: int, runtime: dict, resources: str, tol: float | None = None) -> float | None:
        tol = b.tolerance if tol is None else tol
        try:
            res, d = b.raysim(spec, tag, hosts=n_hosts, runtime=runtime)
        except RuntimeError as err:
            b.fail(w, name, resources, err)
            return None
        diff = max_abs_diff(os.path.join(d, "weights.pt"), ref_w)
        b.record(w, name, resources, res, diff, steps, tolerance=tol)
        b.results[w][tag] = {**res, "max_abs_diff": diff}
        return median_round(res) if diff <= tol else None

    best = None
    per_client = not targets_only or targeted(w, ("raysim_best/plain",) + tuple(f"raysim_h{h}/plain" for h in hosts))
    for h in hosts if per_client else ():
        t = arm(f"raysim H={h}", f"raysim-h{h}", h, b.host_runtime(h), b.host_resources(h))
        if t is not None:
            b.ratio(w, f"raysim_h{h}/plain", t / base)
            best = t if best is None else min(best, t)
    if best is not None:
        b.ratio(w, "raysim_best/plain", best / base)
    why = cohort_unavailable()
    cohorts = not targets_only or targeted(w, ("cohort/plain",))
    if cohorts and why is not None:
        b.record(w, "raysim cohorts", "1 host", na=why)
    elif cohorts:
        t = arm(f"raysim cohorts K={cohort_size}", "raysim-cohort", 1,
                b.host_runtime(1, {"cohort_size": cohort_size}), b.host_resources(1) + f", cohort_size {cohort_size}",
                tol=max(b.tolerance, COHORT_TOLERANCE))
        if t is not None:
            b.ratio(w, "cohort/plain", t / base)
    if pfl is None or w not in FEDAVG:
        return
    py, why = pfl
    if py is None:
        b.record(w, "pfl", "1 worker, GPU", na=why)
        return
    log(f"{w}: pfl-research simulated backend on {b.device}, 1 worker")
    out = os.path.join(b.out, f"{w}-pfl-{b.device}")
    cmd = [py, os.path.join(HERE, "pfl_runner.py"), write_spec(spec, b.out), out, "--workers", "1", "--threads", "1",
           "--device", b.device]
    try:
        res = run_arm(f"pfl {w}", cmd, out, b.timeout)
    except RuntimeError as err:
        b.record(w, "pfl", "1 worker, GPU", na=str(err))  # pfl's own failure: not raysim's
        return
    wpath = os.path.join(out, "weights.pt")
    diff = max_abs_diff(wpath, ref_w) if os.path.isfile(wpath) else float("inf")
    b.record(w, "pfl", f"1 worker, 1 thread, {b.device} ({why})", res, diff, steps)
    if diff <= b.tolerance:
        b.ratio(w, "pfl/plain", median_round(res) / base)


def device_targets(ratios: list[tuple[str, str, float]]) -> list[str]:
    out = []
    for (w, name), (op, bound) in DEVICE_TARGETS.items():
        for rw, rn, v in ratios:
            if (rw, rn) == (w, name):
                ok = v <= bound if op == "<=" else v >= bound
                out.append(f"TARGET {w} {name} {op} {bound:g}: {v:.3g} {'met' if ok else 'missed'}")
    return out


def device_main(ns, out: str) -> int:
    """``--device cpu|cuda``: the device benchmark (see the module docstring)."""
    from benchmarks.plain import resolve_device
    from raysim.core.errors import UserError

    device = resolve_device(ns.device).type  # one line and exit 2 when cuda is asked for and absent
    only = [w.strip().upper() for w in (ns.only or ",".join(DEVICE_ORDER)).split(",") if w.strip()]
    if not set(only) <= set(DEVICE_ORDER):
        raise UserError(f"--only {ns.only!r}: with --device, a comma-separated subset of {','.join(DEVICE_ORDER)}")
    mode = "quick" if ns.quick else "full"
    rounds = {w: ns.rounds or DEVICE_ROUNDS[mode][w] for w in DEVICE_ORDER}
    hosts = DEVICE_HOSTS[device][mode]
    cohort_size = int(ns.cohort_size) if str(ns.cohort_size).isdigit() else ns.cohort_size
    tol = device_tolerance(device, ns.deterministic, ns.tolerance)
    b = DeviceBench(out, ns.timeout, tol, device, ns.deterministic)
    t0 = time.perf_counter()
    print(f"machine: {versions()}{gpu_name(device)}; load average before: {load_average()}", flush=True)
    print(f"device benchmark on {device} ({mode}{', deterministic kernels' if ns.deterministic else ''}): "
          f"workloads {', '.join(f'{w} {rounds[w]} rounds' for w in DEVICE_ORDER if w in only)}; raysim at H in "
          f"{set(hosts)}; weights checked against the plain loop's, tolerance {tol:g}; results appended to "
          f"{b.arms_file}", flush=True)
    pfl = pfl_on_device() if device == "cuda" and not ns.no_pfl else None
    if pfl is not None and pfl[0] is None:
        print(f"pfl: not available: {pfl[1]}", flush=True)
    from raysim.data import load  # the data is generated once and cached before any arm is timed
    for w in [w for w in DEVICE_ORDER if w in only]:
        spec = DEVICE_WORKLOADS[w](1)
        load(spec["dataset"], seed=int(spec["seed"]), **spec.get("data_options", {}))
    for w in [w for w in DEVICE_ORDER if w in only]:
        device_workload(b, DEVICE_WORKLOADS[w](rounds[w]), hosts, cohort_size, pfl, ns.targets_only)
    targets = device_targets(b.ratios) if device == "cuda" else []
    b.results.update(load_after=load_average(), seconds=time.perf_counter() - t0, rows=b.rows,
                     ratios=[list(r) for r in b.ratios], machine=versions() + gpu_name(device), device=device,
                     deterministic=ns.deterministic, tolerance=tol, quick=ns.quick, hosts=list(hosts),
                     rounds={w: rounds[w] for w in only}, failed=b.failed, targets=targets)
    text = table(b.rows, [f"device {device}{gpu_name(device)}" + (", deterministic kernels" if ns.deterministic else "")])
    print()
    print(text)
    print(f"harness wall time {b.results['seconds']:.0f} s; results in {out}")
    if b.void:
        print(f"VOID: an arm failed ({', '.join(b.failed) or 'none'}) or its weights differ from the plain loop's "
              f"by more than {tol:g}; its ratios are left out")
    ratio_lines = [f"RATIO {w} {name} {v:.3g}" for w, name, v in b.ratios]
    for line in ratio_lines + targets:
        print(line)
    with open(os.path.join(out, "results.json"), "w", encoding="utf-8") as fh:
        json.dump(b.results, fh, indent=1, default=str)
    with open(os.path.join(out, "table.md"), "w", encoding="utf-8") as fh:
        fh.write(text + "\n\n" + "\n".join(ratio_lines + targets) + "\n")
    return 1 if b.void else 0


def gpu_name(device: str) -> str:
    """", <GPU model>" on cuda, from nvidia-smi (the driver process never opens a CUDA context)."""
    if device != "cuda":
        return ""
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
        names = [line.strip() for line in r.stdout.splitlines() if line.strip()]
    except (OSError, subprocess.TimeoutExpired):
        names = []
    return f", {'; '.join(names)}" if names else ", GPU (nvidia-smi not found)"


# ----------------------------------------------------------------------------- output

def fmt(v, spec=".2f"):
    return "-" if v is None else format(v, spec)


def table(rows: list[dict], conditions: list[str] | None = None) -> str:
    """The results table; ``conditions`` (e.g. --noisy) are printed as lines above its header."""
    head = ("| workload | arm | resources | Ray start s | start-up s | round s (median) | round s (mean) "
            "| ms per client step | CPU s/round (median) | rounds | test AVG | max abs diff vs plain 1t |")
    out = [f"conditions: {c}" for c in conditions or []]
    out += [head, "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "na" in r:
            out.append(f"| {r['workload']} | {r['arm']} | {r['na']} | | | | | | | | | |")
            continue
        extra = ""
        if "peak_mib" in r:
            extra = f" (peak {r['peak_mib']:.0f} MiB, state {r['state_mib']:.2f} MiB)"
        out.append(f"| {r['workload']} | {r['arm']} | {r['resources']}{extra} | {fmt(r['ray_start'])} "
                   f"| {fmt(r['startup'])} | {fmt(r['round_median'], '.3f')} | {fmt(r['round_mean'], '.3f')} "
                   f"| {fmt(r.get('ms_step'), '.2f')} | {fmt(r.get('cpu_median'), '.3f')} | {r['rounds']} | {fmt(r['test_avg'], '.4f')} | {fmt(r['diff'], '.2g')} |")
    return "\n".join(out)


def versions() -> str:
    import platform

    import ray
    import torch
    return (f"Python {platform.python_version()}, torch {torch.__version__}, ray {ray.__version__}, "
            f"{os.cpu_count()} CPUs, {platform.machine()}")


def main(argv=None) -> int:
    global NOISE
    p = argparse.ArgumentParser(description="raysim vs the plain loop, Flower, pfl-research and FLGo "
                                            "(prints a table, RATIO and TARGET lines)")
    p.add_argument("--quick", action="store_true", help="a few minutes per workload: 4 rounds each")
    p.add_argument("--rounds", type=int, default=None, help="rounds of every workload (overrides --quick)")
    p.add_argument("--only", default=None,
                   help="comma-separated subset of A,B,C,D,P,S (S: CLI start-up); with --device, of "
                        "A,B,D,P,B6,R; default: all")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="the device benchmark: the plain loop on the device against raysim per-client at "
                        "several host counts, cohorts and pfl (cuda); cpu: its smoke test")
    p.add_argument("--deterministic", action="store_true",
                   help="with --device: deterministic kernels in every arm (runtime.deterministic)")
    p.add_argument("--targets-only", action="store_true",
                   help="with --device: run only the arms a device target reads (no per-client P, no cohort A)")
    p.add_argument("--cohort-size", default="16", help="with --device: the cohort arm's runtime.cohort_size")
    p.add_argument("--no-flower", action="store_true", help="skip the Flower arm")
    p.add_argument("--no-pfl", action="store_true", help="skip the pfl-research arm")
    p.add_argument("--no-flgo", action="store_true", help="skip the FLGo arm")
    p.add_argument("--pfl-native", action="store_true",
                   help="pfl arm: pfl's stock FedAvg (float32 differences, central SGD) instead of the same "
                        "computation as the plain loop; reported as cost per client step")
    p.add_argument("--noisy", action="store_true",
                   help="run a pure-Python busy loop pinned to one CPU during every arm (plain loops included)")
    p.add_argument("--noisy-cpu", type=int, default=None, help="the CPU --noisy pins to (default 1, or 0 on 1 CPU)")
    p.add_argument("--out", default=None, help="results folder (default runs/bench-<time>)")
    p.add_argument("--tolerance", type=float, default=None,
                   help="equivalence check: max |w_arm - w_plain| (default 1e-6; with --device cuda 5e-2, "
                        "1e-6 with --deterministic)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per arm")
    p.add_argument("--first-round-runs", type=int, default=1,
                   help="S: launches of `raysim run` whose median is reported (default 1)")
    ns = p.parse_args(argv)
    from raysim.core.errors import UserError
    if ns.rounds is not None and ns.rounds < 1:
        raise UserError(f"--rounds {ns.rounds}: expected at least 1")
    if ns.first_round_runs < 1:
        raise UserError(f"--first-round-runs {ns.first_round_runs}: expected at least 1")
    if ns.device is not None:
        out = os.path.abspath(ns.out or os.path.join(REPO, "runs", f"bench-{ns.device}-{time.strftime('%Y%m%d-%H%M%S')}"))
        os.makedirs(out, exist_ok=True)
        return device_main(ns, out)
    if ns.tolerance is None:
        ns.tolerance = 1e-6
    only = {w.strip().upper() for w in (ns.only or "A,B,C,S,D,P").split(",") if w.strip()}
    if not only <= {"A", "B", "C", "D", "P", "S"}:
        raise UserError(f"--only {ns.only!r}: expected a comma-separated subset of A,B,C,D,P,S")
    out = os.path.abspath(ns.out or os.path.join(REPO, "runs", f"bench-{time.strftime('%Y%m%d-%H%M%S')}"))
    os.makedirs(out, exist_ok=True)
    rounds = {w: (ns.rounds or (4 if ns.quick else r)) for w, r in ROUNDS.items()}
    b = Bench(out, ns.timeout, ns.tolerance)
    b.pfl_native = ns.pfl_native
    t0 = time.perf_counter()
    print(f"machine: {versions()}; load average before: {load_average()}", flush=True)
    if ns.quick or ns.rounds:
        print("rounds: " + ", ".join(f"{w} {rounds[w]}" for w in sorted(only - {"S"})) +
              f" (full: {', '.join(f'{w} {r}' for w, r in ROUNDS.items())})", flush=True)

    externals: dict[str, tuple[str | None, str]] = {}
    for arm, skip, env in (("flower", ns.no_flower, flower_env), ("pfl", ns.no_pfl, pfl_env),
                           ("flgo", ns.no_flgo, flgo_env)):
        if skip or not only & set(FEDAVG):
            continue
        py, why = env.ensure(log=log)
        externals[arm] = (py, why)
        print(f"{arm}: {why}" if py else f"{arm}: not available: {why}", flush=True)
        b.results[f"{arm}_versions"] = why if py else None

    # the data is generated once and cached before any arm is timed
    from raysim.data import load
    for w in sorted(only & set(FEDAVG)) or ["A"]:
        spec = WORKLOADS[w](1)
        load(spec["dataset"], seed=int(spec["seed"]), **spec.get("data_options", {}))

    conditions = []
    if ns.noisy:
        ncpu = os.cpu_count() or 1
        cpu = ns.noisy_cpu if ns.noisy_cpu is not None else (1 if ncpu > 1 else 0)
        if not 0 <= cpu < ncpu:
            raise UserError(f"--noisy-cpu {cpu}: this machine has CPUs 0..{ncpu - 1}")
        NOISE = Noise(cpu)
        conditions.append(NOISE.describe() + " (started before and stopped after each arm)")
        print(f"conditions: {conditions[-1]}", flush=True)
    try:
        for w in ("A", "B"):
            if w in only:
                fedavg_workload(b, WORKLOADS[w](rounds[w]), externals)
        if "C" in only:
            scale_workload(b, rounds["C"])
        for w in ("D", "P"):
            if w in only:
                fedavg_workload(b, WORKLOADS[w](rounds[w]), externals)
        if "S" in only:
            cli_first_round(b, workload_a(1), runs=ns.first_round_runs)
    finally:
        if NOISE is not None:
            NOISE.stop("interrupted")
            b.results["noise"] = {"cpu": NOISE.cpu, "per_arm": NOISE.log}

    b.results.update(load_after=load_average(), seconds=time.perf_counter() - t0, rows=b.rows,
                     ratios=[list(r) for r in b.ratios], notes=b.notes, machine=versions(), quick=ns.quick,
                     rounds={w: rounds[w] for w in only - {"S"}}, noisy=ns.noisy, pfl_native=ns.pfl_native)
    if NOISE is not None and NOISE.log:
        busy = sum(x["noise_cpu_s"] for x in NOISE.log) / max(sum(x["wall_s"] for x in NOISE.log), 1e-9)
        b.notes.append(f"noise: the busy loop on CPU {NOISE.cpu} ran for {len(NOISE.log)} arms and got "
                       f"{busy:.2f} CPU s per wall s on average")
    text = table(b.rows, conditions)
    print()
    print(text)
    for note in b.notes:
        print(f"note: {note}")
    print(f"load average before/after: {b.results['load_before']} / {b.results['load_after']}; "
          f"harness wall time {b.results['seconds']:.0f} s; results in {out}")
    if b.void:
        print("VOID: raysim and the plain loop did not compute the same model; the ratios below are not valid")
    ratio_lines = [f"RATIO {w} {name} {v:.3g}" for w, name, v in b.ratios]
    targets = target_lines(b.ratios, ns.noisy)
    for line in ratio_lines + targets:
        print(line)
    b.results["targets"] = targets
    with open(os.path.join(out, "results.json"), "w", encoding="utf-8") as fh:
        json.dump(b.results, fh, indent=1, default=str)
    with open(os.path.join(out, "table.md"), "w", encoding="utf-8") as fh:
        fh.write(text + "\n\n" + "\n".join(ratio_lines + targets) + "\n")
    return 1 if b.void else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("benchmark interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as err:  # noqa: BLE001 - one clear line for user errors, a traceback otherwise
        from raysim.core.errors import UserError
        if isinstance(err, UserError):
            print(f"benchmarks: error: {err}", file=sys.stderr)
            sys.exit(2)
        raise
