"""raysim against the plain PyTorch loop and Flower's simulation runtime, in one invocation.

    .venv/bin/python benchmarks/run.py            # full: A 20 rounds, B 10, C 20
    .venv/bin/python benchmarks/run.py --quick    # fewer rounds (4), same table and ratios

(33 and 13 minutes on a 2-core machine shared with other work at load average ~10, plus 1-2
minutes the first time to install Flower's venv with pip.)

Workloads (``benchmarks/workloads.py``): A cross-silo FedAvg, 5 clients; B cross-device FedAvg,
1,000 clients, 50 per round; C FedBN with 100,000 registered clients vs 1,000, 100 per round.
Every arm runs in its own process, one after the other (never two Ray instances at once):

* plain  the FedAvg loop of ``plain.py`` in one process, torch.set_num_threads(2) (both cores)
         and, as the reference of the equivalence check, with 1 thread;
* raysim 2 ClientHost actors x 1 CPU (1 torch thread each) on the 2 cores;
* flower ``flwr[simulation]`` in ``benchmarks/.venv-flwr``, client resources num_cpus=1 (2 actors).

Before any ratio is read, the final global weights of raysim and of the 1-thread plain loop
must agree (max |difference| <= --tolerance, 0 expected): a benchmark of different computations
is void, and the harness exits with status 1 if they do not.

Round time = the median of the per-round wall times (sample, broadcast, local training,
aggregation; the final evaluation falls in the last round, which the median ignores, as it
ignores Flower's first round, where its actors load the data raysim's hosts load at start-up).
Start-up (Ray, actors, data) is reported separately. Output: the table, then one line per ratio
``RATIO <workload> <name> <value>``; everything is also written to OUT/results.json.
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

from benchmarks import flower_env  # noqa: E402
from benchmarks.workloads import raysim_config, workload_a, workload_b, workload_c  # noqa: E402

TARGETS = {"raysim/plain": 1.10, "flower/raysim": 3.0, "rounds_100k/1k": 1.25, "mem_over_budget": 1.0,
           "first_round_s/10s": 1.0}


# ----------------------------------------------------------------------------- helpers

def load_average() -> str:
    try:
        with open("/proc/loadavg", encoding="utf-8") as fh:
            return " ".join(fh.read().split()[:3])
    except OSError:
        return "n/a"


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')} load {load_average()}] {msg}", file=sys.stderr, flush=True)


def median_round(res: dict) -> float:
    return statistics.median(res["round_seconds"])


def median_cpu(res: dict) -> float | None:
    cpu = res.get("round_cpu") or []
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
    """Run one arm in its own process; its output goes to OUT/<name>.log."""
    os.makedirs(out, exist_ok=True)
    logfile = os.path.join(out, "log.txt")
    t0 = time.perf_counter()
    with open(logfile, "w", encoding="utf-8") as fh:
        try:
            r = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=_env(), cwd=REPO, timeout=timeout)
            rc = r.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.perf_counter() - t0
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

    def plain(self, spec, threads: int, tag: str):
        log(f"{spec['name']}: plain loop, {threads} thread(s)")
        out = os.path.join(self.out, f"{spec['name']}-{tag}")
        return run_arm(f"plain {spec['name']}", [sys.executable, os.path.join(HERE, "plain.py"),
                                                 write_spec(spec, self.out), out, "--threads", str(threads)],
                       out, self.timeout), out

    def raysim(self, spec, tag: str, memory: bool = False, hosts: int = 2):
        log(f"{spec['name']}: raysim, {hosts} hosts x 1 CPU ({spec['partition'].get('num_clients', 5)} clients)")
        out = os.path.join(self.out, f"{spec['name']}-{tag}")
        cmd = [sys.executable, os.path.join(HERE, "raysim_runner.py"), write_spec(spec, self.out), out,
               "--hosts", str(hosts)] + (["--memory"] if memory else [])
        return run_arm(f"raysim {spec['name']}", cmd, out, self.timeout), out

    def flower(self, spec, py: str):
        log(f"{spec['name']}: Flower simulation, 2 actors x 1 CPU")
        out = os.path.join(self.out, f"{spec['name']}-flower")
        return run_arm(f"flower {spec['name']}", [py, os.path.join(HERE, "flower_runner.py"),
                                                  write_spec(spec, self.out), out], out, self.timeout), out

    def row(self, workload: str, arm: str, res: dict, resources: str, diff: float | None = None, **extra):
        r = {"workload": workload, "arm": arm, "resources": resources,
             "ray_start": res.get("ray_start_seconds"), "startup": res.get("startup_seconds"),
             "round_median": median_round(res), "round_mean": statistics.fmean(res["round_seconds"]),
             "cpu_median": median_cpu(res),
             "rounds_total": sum(res["round_seconds"]), "rounds": len(res["round_seconds"]),
             "test_avg": (res.get("final_eval") or {}).get("AVG"), "diff": diff, **extra}
        self.rows.append(r)
        return r

    def ratio(self, workload: str, name: str, value: float):
        self.ratios.append((workload, name, value))


# ----------------------------------------------------------------------------- workloads

def fedavg_workload(b: Bench, spec: dict, flower_py: str | None, flower_why: str) -> None:
    w = spec["name"]
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
    b.row(w, "plain", ref, "1 process, 1 thread", 0.0)
    b.row(w, "plain", fast, "1 process, 2 threads", d2)
    b.row(w, "raysim", rs, "2 hosts x 1 CPU, 1 thread", diff)
    b.results[w] = {"plain_1t": ref, "plain_2t": fast, "raysim": rs, "equivalence_max_abs_diff": diff}
    b.ratio(w, "raysim/plain", median_round(rs) / median_round(fast))
    b.ratio(w, "raysim/plain_1thread", median_round(rs) / median_round(ref))
    b.ratio(w, "raysim/plain_cpu", median_cpu(rs) / median_cpu(ref))
    if flower_py is None:
        b.rows.append({"workload": w, "arm": "flower", "na": f"flower: not available: {flower_why}"})
        return
    try:
        fl, fl_dir = b.flower(spec, flower_py)
    except RuntimeError as err:
        b.rows.append({"workload": w, "arm": "flower", "na": f"flower: not available: {err}"})
        return
    fdiff = max_abs_diff(os.path.join(fl_dir, "weights.pt"), os.path.join(ref_dir, "weights.pt"))
    b.row(w, "flower", fl, "2 actors x 1 CPU, 1 thread", fdiff, ray_start=None)
    b.results[w]["flower"] = fl
    b.ratio(w, "flower/raysim", median_round(fl) / median_round(rs))
    b.ratio(w, "flower/raysim_cpu", median_cpu(fl) / median_cpu(rs))


def state_bytes_per_client(spec: dict) -> int:
    """What FedBN keeps per client, counted as raysim's store counts it (tensor bytes + dicts)."""
    from benchmarks.plain import PlainFederation
    from raysim.tensors import bn_keys
    from raysim.runtime.store import state_nbytes

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


def scale_workload(b: Bench, rounds: int, big: int = 100_000, small: int = 1_000) -> None:
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
    b.ratio("C", "rounds_100k/1k", median_round(g) / median_round(s))
    b.ratio("C", "rounds_100k/1k_cpu", median_cpu(g) / median_cpu(s))
    b.ratio("C", "mem_over_budget", g["peak_rss"] / budget)
    b.ratio("C", "startup_100k/1k", g["startup_seconds"] / s["startup_seconds"])
    log(f"C: raysim's client-state store with {big:,} FedBN states (RSS growth vs state bytes)")
    out = os.path.join(b.out, "C-store")
    st = run_arm("store", [sys.executable, os.path.join(HERE, "store_mem.py"), str(big), out], out, b.timeout)
    b.results["C"]["store"] = st
    b.notes.append(f"C store: {st['clients']:,} FedBN client states ({st['tensors_per_client']} tensors each) "
                   f"hold {st['state_bytes'] / 2**20:.1f} MiB of state and grow the host's RSS by "
                   f"{st['rss_growth'] / 2**20:.1f} MiB ({st['ratio']:.2f}x); put {st['put_us']:.0f} us, "
                   f"get {st['get_us']:.0f} us per client.")
    b.ratio("C", "store_rss/state_bytes", st["ratio"])


def cli_first_round(b: Bench, spec: dict) -> None:
    """Seconds from launching ``raysim run CONFIG`` to the end of round 1 (its metrics file)."""
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
    with open(os.path.join(out, "log.txt"), "w", encoding="utf-8") as fh:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=_env(), cwd=REPO)
        first = None
        while p.poll() is None:
            if first is None and os.path.exists(metrics):
                first = time.perf_counter() - t0
            time.sleep(0.02)
        total = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"raysim run failed (exit {p.returncode}); see {out}/log.txt")
    if first is None:
        first = total
    b.results["cli"] = {"first_round_seconds": first, "process_seconds": total}
    b.notes.append(f"`raysim run` (workload A config, 1 round) to the end of round 1: {first:.1f} s; "
                   f"process exit (incl. report and Ray shutdown): {total:.1f} s.")
    b.ratio("S", "first_round_s/10s", first / 10.0)


# ----------------------------------------------------------------------------- output

def fmt(v, spec=".2f"):
    return "-" if v is None else format(v, spec)


def table(rows: list[dict]) -> str:
    head = ("| workload | arm | resources | Ray start s | start-up s | round s (median) | round s (mean) "
            "| CPU s/round (median) | rounds | test AVG | max abs diff vs plain 1t |")
    out = [head, "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "na" in r:
            out.append(f"| {r['workload']} | {r['arm']} | {r['na']} | | | | | | | | |")
            continue
        extra = ""
        if "peak_mib" in r:
            extra = f" (peak {r['peak_mib']:.0f} MiB, state {r['state_mib']:.2f} MiB)"
        out.append(f"| {r['workload']} | {r['arm']} | {r['resources']}{extra} | {fmt(r['ray_start'])} "
                   f"| {fmt(r['startup'])} | {fmt(r['round_median'], '.3f')} | {fmt(r['round_mean'], '.3f')} "
                   f"| {fmt(r.get('cpu_median'), '.3f')} | {r['rounds']} | {fmt(r['test_avg'], '.4f')} | {fmt(r['diff'], '.2g')} |")
    return "\n".join(out)


def versions() -> str:
    import platform

    import ray
    import torch
    return (f"Python {platform.python_version()}, torch {torch.__version__}, ray {ray.__version__}, "
            f"{os.cpu_count()} CPUs, {platform.machine()}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="raysim vs the plain loop vs Flower (prints a table and RATIO lines)")
    p.add_argument("--quick", action="store_true", help="a few minutes: fewer rounds")
    p.add_argument("--only", default="A,B,C,S", help="comma-separated subset of A,B,C,S (S: CLI start-up)")
    p.add_argument("--no-flower", action="store_true", help="skip the Flower arm")
    p.add_argument("--out", default=None, help="results folder (default runs/bench-<time>)")
    p.add_argument("--tolerance", type=float, default=1e-6, help="equivalence check: max |w_raysim - w_plain|")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per arm")
    ns = p.parse_args(argv)
    from raysim.errors import UserError
    only = {w.strip().upper() for w in ns.only.split(",") if w.strip()}
    if not only <= {"A", "B", "C", "S"}:
        raise UserError(f"--only {ns.only!r}: expected a comma-separated subset of A,B,C,S")
    out = os.path.abspath(ns.out or os.path.join(REPO, "runs", f"bench-{time.strftime('%Y%m%d-%H%M%S')}"))
    os.makedirs(out, exist_ok=True)
    rounds = {"A": 4, "B": 4, "C": 4} if ns.quick else {"A": 20, "B": 10, "C": 20}
    b = Bench(out, ns.timeout, ns.tolerance)
    t0 = time.perf_counter()
    print(f"machine: {versions()}; load average before: {load_average()}", flush=True)
    if ns.quick:
        print("quick mode: A 4 rounds, B 4 rounds, C 4 rounds (full: 20, 10, 20)", flush=True)

    flower_py, why = None, "skipped (--no-flower)"
    if not ns.no_flower and only & {"A", "B"}:
        flower_py, why = flower_env.ensure(log=log)
        print(f"flower: {why}" if flower_py else f"flower: not available: {why}", flush=True)
        b.results["flower_versions"] = why if flower_py else None

    # the data is generated once and cached before any arm is timed
    from raysim.data import load
    load("digits5", seed=0)

    if "A" in only:
        fedavg_workload(b, workload_a(rounds["A"]), flower_py, why)
    if "B" in only:
        fedavg_workload(b, workload_b(rounds["B"]), flower_py, why)
    if "C" in only:
        scale_workload(b, rounds["C"])
    if "S" in only:
        cli_first_round(b, workload_a(1))

    b.results.update(load_after=load_average(), seconds=time.perf_counter() - t0, rows=b.rows,
                     ratios=[list(r) for r in b.ratios], notes=b.notes, machine=versions(), quick=ns.quick)
    text = table(b.rows)
    print()
    print(text)
    for note in b.notes:
        print(f"note: {note}")
    print(f"load average before/after: {b.results['load_before']} / {b.results['load_after']}; "
          f"harness wall time {b.results['seconds']:.0f} s; results in {out}")
    if b.void:
        print("VOID: raysim and the plain loop did not compute the same model; the ratios below are not valid")
    for w, name, v in b.ratios:
        print(f"RATIO {w} {name} {v:.3g}")
    with open(os.path.join(out, "results.json"), "w", encoding="utf-8") as fh:
        json.dump(b.results, fh, indent=1, default=str)
    with open(os.path.join(out, "table.md"), "w", encoding="utf-8") as fh:
        fh.write(text + "\n\n" + "\n".join(f"RATIO {w} {n} {v:.3g}" for w, n, v in b.ratios) + "\n")
    return 1 if b.void else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("benchmark interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as err:  # noqa: BLE001 - one clear line for user errors, a traceback otherwise
        from raysim.errors import UserError
        if isinstance(err, UserError):
            print(f"benchmarks: error: {err}", file=sys.stderr)
            sys.exit(2)
        raise
