"""The buffered schedule through the real loop: metrics that do not depend on the host layout,
nor on losses (a host and the server killed mid-run replay to the same metrics); with C = K = m
and fresh arrivals it is FedAvg's synchronous rounds; time as an axis (sim_time, eval.every_s,
stop.sim_hours); what cannot run buffered is refused in one line."""
import os
import signal
import threading

import pyarrow.parquet as pq
import pytest

from raysim.app.configs import load_checked
from raysim.app.experiment import federation
from raysim.core.errors import UserError
from raysim.engine.backend import InProcess

LEVELS = [{"name": "fast", "flops": 2.0e+9, "up_mbps": 10, "down_mbps": 50},
          {"name": "mid", "flops": 1.0e+9, "up_mbps": 10, "down_mbps": 50},
          {"name": "slow", "flops": 0.3e+9, "up_mbps": 10, "down_mbps": 50}]
BASE = {
    "method": "fedbuff", "rounds": 6, "seed": 3, "clients_per_round": 4,
    "data": {"dataset": "digits5", "options": {"image_size": 16},
             "partition": {"kind": "per_domain", "clients_per_domain": 3, "train_size": 12,
                           "domains": ["mnist", "usps", "svhn"]}},
    "model": {"name": "small_cnn", "norm": "bn"},
    "train": {"epochs": 1, "batch_size": 8, "lr": 0.05, "momentum": 0.5, "grad_clip": 10.0},
    "eval": {"every": 2, "splits": ["test"]},
    "schedule": {"buffer": 2},
    "clients": {"profiles": {"levels": LEVELS, "assign": "round_robin"}},
    "runtime": {"num_hosts": 1, "cpus_per_host": 0.5},
    "checkpoint": {"every": 2, "keep": 2},
}


def cfg(*overrides, raw=None):
    return load_checked(raw=raw or BASE, overrides=list(overrides))


def metrics(run_dir):
    return pq.read_table(os.path.join(run_dir, "metrics.parquet")).to_pandas()


def run(out, *overrides, backend=None, **kw):
    federation(cfg(*overrides), str(out), progress=False, backend=backend, **kw).run()
    return metrics(str(out))


@pytest.fixture(scope="module")
def one_host(ray_session, tmp_path_factory):
    return run(tmp_path_factory.mktemp("one_host"))


@pytest.fixture(scope="module")
def in_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("in_process") / "run"
    return str(out), run(out, backend=InProcess())


def test_steps_fold_k_arrivals_with_their_staleness_on_the_simulated_clock(in_process):
    one_host = in_process[1]
    clock = one_host[one_host.split == "clock"].pivot_table(index="round", columns="metric", values="value")
    assert (clock["folded"] == 2).all() and clock["sim_time"].is_monotonic_increasing
    assert clock["staleness_max"].max() >= 1  # slow clients arrive after others' steps
    stale = one_host[(one_host.metric == "staleness") & (one_host.client >= 0)]
    assert len(stale) == 2 * 6 and not stale.duplicated(["round", "client"]).any()


@pytest.mark.slow  # three federations on Ray actors (~1 min): make test-slow
@pytest.mark.parametrize("hosts", [2, 4])
def test_same_metrics_whatever_the_host_layout(one_host, in_process, tmp_path, hosts):
    assert one_host.equals(in_process[1])  # Ray actors or in one process
    assert run(tmp_path, f"runtime.num_hosts={hosts}", "runtime.cpus_per_host=0.25").equals(one_host)


def test_a_longer_run_with_stale_arrivals_gives_the_same_metrics_on_1_2_and_4_hosts(tmp_path):
    """40 steps of 4 arrivals with 8 in flight: most arrivals are stale, their s(τ) a fraction.
    Folded as the weight w·s(τ), the hosts' float64 sums depended on the grouping and these runs
    parted (262 of 2,552 values on 2 hosts); scaled on the host first, they do not."""
    overrides = ("rounds=40", "clients_per_round=8", "schedule.buffer=4", "checkpoint.every=0", "eval.every=5")
    one = run(tmp_path / "1", *overrides, backend=InProcess())
    assert one[one.metric == "staleness_max"].value.max() >= 2
    for hosts in (2, 4):
        assert run(tmp_path / str(hosts), *overrides, f"runtime.num_hosts={hosts}", backend=InProcess()).equals(one), hosts


@pytest.mark.slow
def test_a_host_and_the_server_killed_mid_run_replay_to_the_same_metrics(one_host, tmp_path):
    import ray

    killed = {}

    def kill(rnd, summary, evaluation):
        for at, who in ((2, "host"), (5, "server")):  # once each: the replays pass these steps again
            if rnd == at and who not in killed:
                actor = fed.hosts[0] if who == "host" else fed.server
                killed[who] = ray.get(actor.ready.remote())["pid"]
                threading.Timer(0.05, os.kill, (killed[who], signal.SIGKILL)).start()

    # 12 steps, so that the server's kill lands in a step; its first 6 are one_host's (evaluated every 2)
    fed = federation(cfg("rounds=12"), str(tmp_path / "run"), progress=False, on_round=kill)
    result = fed.run()
    assert (result.host_restarts, result.server_restarts) == (1, 1)
    first = metrics(fed.run_dir)
    assert first[first["round"] <= 6].reset_index(drop=True).equals(one_host)


def test_a_resumed_buffered_run_retrains_its_jobs_in_flight_to_the_same_metrics(in_process, tmp_path):
    import shutil
    out = shutil.copytree(in_process[0], str(tmp_path / "run"))
    whole = in_process[1]
    # back to step 2's checkpoint (its timeline has jobs in flight, trained before the checkpoint)
    for name in ("metrics.parquet", "status.json"):
        os.remove(os.path.join(out, name))
    shutil.rmtree(os.path.join(out, "checkpoints", "round-000004"))
    federation(cfg(), out, progress=False, backend=InProcess()).run(resume=True)
    assert metrics(out).equals(whole)


@pytest.mark.slow  # one more federation in process (~15 s): make test-slow
def test_steps_taken_before_every_job_trained_are_those_every_duration_gives(in_process, tmp_path, monkeypatch):
    """With no lower bound of a duration every job trains before the next step, and every window
    is one step; the metrics are the same as with the bounds (a bound above a real duration would
    let a step miss an arrival)."""
    from raysim.engine.server import Server
    monkeypatch.setattr(Server, "_floor_seconds", lambda self, profile: 0.0)
    assert run(tmp_path, backend=InProcess()).equals(in_process[1])


def test_c_equal_k_equal_m_with_fresh_arrivals_is_fedavgs_synchronous_rounds(tmp_path):
    import numpy as np
    every = ["eval.every=1", "train.weighting=uniform", "clients_per_round=9", "data.options.image_size=16"]
    rounds = run(tmp_path / "rounds", "method=fedavg", *every, backend=InProcess())
    buffered = run(tmp_path / "buffered", "method=fedavg", "schedule.kind=buffered", "schedule.buffer=9",
                   *every, backend=InProcess())
    pick = lambda df: df[(df.split == "test") & (df.metric == "accuracy")].sort_values(["round", "client", "domain"])
    a, b = pick(rounds), pick(buffered)
    assert len(a) == len(b) > 0
    assert np.allclose(a["value"].to_numpy(), b["value"].to_numpy(), atol=0.02)  # x + mean(y - x) vs mean(y)


def test_eval_every_s_and_stop_sim_hours_on_the_simulated_clock(tmp_path):
    m = run(tmp_path, "rounds=40", "eval.every=100", "eval.every_s=1", "stop.sim_hours=0.001", backend=InProcess())
    clock = m[(m.split == "clock") & (m.metric == "sim_time")].set_index("round")["value"]
    assert clock.iloc[-1] >= 3.6 and clock.iloc[-2] < 3.6 and len(clock) < 40
    evaluated = sorted(m[m.split == "test"]["round"].unique())
    crossed = [r for r in clock.index if r == clock.index[-1] or (clock[r] // 1 > clock.get(r - 1, 0) // 1)]
    assert evaluated == crossed


@pytest.mark.parametrize("overrides, said", [
    (["clients.profiles.levels=[]"], "needs clients.profiles"),
    (["method=scaffold"], "cannot run a buffered schedule: it has its own server step"),
    (["method=fedasync", "schedule.buffer=3"], "steps on every 1 arrival"),
    (["schedule.buffer=5"], "exceeds the clients in flight"),
    (["clients.deadline_s=3.0"], "clients.deadline_s"),
])
def test_what_cannot_run_buffered_is_one_line(tmp_path, overrides, said):
    with pytest.raises(UserError, match=said):
        run(tmp_path, "schedule.kind=buffered", *overrides, backend=InProcess())


def test_the_servers_timeline_on_a_toy_clock_by_hand():
    """Four clients in flight, K = 2, durations chosen by hand: arrivals in (finish, client) order,
    versions, staleness and s(τ) = 1/√(1+τ) as computed here; new clients dispatched at step times."""
    from raysim.engine.server import Server
    server = Server(cfg("clients_per_round=4", "rounds=100"))
    server.start()
    tl = server.timeline
    work = server.dispatch()  # version 0 at t = 0: four clients drawn
    first = [c for c, _ in work.jobs]
    assert len(first) == 4 and {v for _, v in work.jobs} == {0}
    a, b, c, d = first
    durations = {a: 5.0, b: 1.0, c: 3.0, d: 1.0}  # b and d tie at 1 s: the lower id first
    plan, = server.plan(1, 1, 0.0, (durations, []))
    assert [(cl, s, tau, v) for cl, s, tau, v in plan.folded] == [(min(b, d), 1.0, 0, 0), (max(b, d), 1.0, 0, 0)]
    assert (plan.version, plan.time, plan.in_flight, plan.dispatched) == (1, 1.0, 2, 2)
    # two free slots refilled at t = 1 s from version 1, never a client in flight
    new = tl.waiting_on
    assert len(new) == 2 and not set(new) & {a, c} and {tl.in_flight[cl].version for cl in new} == {1}
    plan, = server.plan(2, 1, 1.0, ({new[0]: 0.5, new[1]: 4.0}, []))  # arrivals: new[0] at 1.5, c at 3, new[1] at 5, a at 5
    assert [(cl, tau) for cl, _, tau, _ in plan.folded] == [(new[0], 0), (c, 1)]
    assert [s for _, s, _, _ in plan.folded] == pytest.approx([1.0, 2 ** -0.5])
    assert (plan.version, plan.time) == (2, 3.0)
    for rnd in range(3, 33):  # thirty more steps: a dispatch never draws a client in flight
        flying = set(tl.in_flight)
        waiting = tl.waiting_on
        plan, = server.plan(rnd, 1, tl.now, ({cl: 1.0 + cl % 3 for cl in waiting}, []))
        still = flying - {cl for cl, *_ in plan.folded} - {cl for cl, _ in plan.dropped}
        assert plan.dispatched and not set(tl.waiting_on) & still


def _planned(server, max_steps: int, steps: int, seconds) -> list:
    """``steps`` server steps planned in windows of at most ``max_steps``, every job trained (its
    duration ``seconds(client, version)``) before each window."""
    tl, plans = server.timeline, []
    server.dispatch()
    while len(plans) < steps:
        trained = {c: seconds(c, tl.in_flight[c].version) for c in tl.waiting_on}
        plans += server.plan(len(plans) + 1, min(max_steps, steps - len(plans)), tl.now, (trained, []))
    return plans


def test_a_window_of_steps_is_the_steps_one_call_each_would_take():
    """The server plans steps ahead as long as no untrained job could arrive among a step's K
    (each job takes at least its transfers): the same steps, dispatches and times as one step per
    call, in fewer calls."""
    from raysim.engine.server import Server

    def server():
        s = Server(cfg("clients_per_round=6", "schedule.buffer=2", "rounds=60"))
        s.start()
        return s

    one = server()
    floor = {c: one._least_seconds(c) for c in range(one.n)}  # download + the whole model's upload
    assert min(floor.values()) > 0
    seconds = lambda c, v: floor[c] * (1.05 + 0.3 * ((c * 7 + v) % 5))  # near the bound: steps come fast
    by_one = _planned(one, 1, 60, seconds)
    windowed = server()
    by_window = _planned(windowed, 16, 60, seconds)
    assert by_window == by_one
    timeline = lambda s: {k: v for k, v in s.timeline.export().items() if k != "durations"}  # trained ahead or not
    assert timeline(windowed) == timeline(one)
    calls = 0
    again = server()
    tl = again.timeline
    again.dispatch()
    done = 0
    while done < 60:
        trained = {c: seconds(c, tl.in_flight[c].version) for c in tl.waiting_on}
        done += len(again.plan(done + 1, min(16, 60 - done), tl.now, (trained, [])))
        calls += 1
    assert calls < 40  # windows of several steps


def test_the_runs_last_window_trains_only_the_jobs_its_steps_can_fold():
    """Before a run's last steps the server hands out for training the jobs likely among their
    arrivals, not every job that could arrive before a new dispatch: the same steps, fewer jobs
    trained for nothing (each ran ~7% of a 1,000-update run's training)."""
    from raysim.engine.server import Server

    def server():
        s = Server(cfg("data.partition.clients_per_domain=10", "clients_per_round=24", "schedule.buffer=2", "rounds=10"))
        s.start()
        return s

    full, last = server(), server()
    floor = {c: full._least_seconds(c) for c in range(full.n)}
    seconds = lambda c, v: floor[c] * (1.05 + 0.3 * ((c * 7 + v) % 5))
    for s in (full, last):  # six steps in windows; then four steps are left
        _planned(s, 16, 6, seconds)
        s.versions.update({j.version: {} for j in s.timeline.in_flight.values()})  # (aggregates make them)
    everything = full._jobs_to_train()
    likely = last._jobs_to_train(steps_left=4)
    assert 0 < len(likely.jobs) < len(everything.jobs)
    plans = {}
    for s, work in ((full, everything), (last, likely)):
        tl = s.timeline
        trained = {c: seconds(c, tl.in_flight[c].version) for c, _ in work.jobs}
        plans[s] = s.plan(7, 4, tl.now, (trained, []))
    assert len(plans[last]) == 4 and plans[last] == plans[full]


def test_the_runs_last_step_trains_only_the_jobs_likely_among_its_k_arrivals():
    """By hand: K = 2, one step left, one trained job in flight (arriving at 1.0 s), five untrained
    ones whose earliest arrivals are 2, 3, 4, 5 and 6 s (the trained job took no more than its
    bound). The step folds 2 arrivals: the trained one and, likely, the one due at 2 s; only that
    one trains (the others would train for nothing). If the guess is short, the plan finds a job it
    needs untrained and trains it before stepping."""
    from raysim.engine.server import Server
    from raysim.engine.timeline import Timeline

    s = Server(cfg("schedule.buffer=2", "rounds=10"))
    s.start()
    tl = s.timeline = Timeline(concurrency=6, buffer=2)
    tl.dispatch([10, 11, 12, 13, 14, 15], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    tl.trained(10, 1.0)
    s.least_any, s.training, s.trainers, s.versions = 10.0, set(), {}, {0: {}}
    assert [c for c, _ in s._jobs_to_train(steps_left=1).jobs] == [11]
    s.training = set()
    assert [c for c, _ in s._jobs_to_train(steps_left=2).jobs] == [11, 12, 13]  # 4 arrivals: 1 trained + 3


def test_a_job_quicker_than_its_dispatchs_lower_bound_is_refused():
    from raysim.engine.timeline import Timeline
    tl = Timeline(concurrency=2, buffer=1)
    tl.dispatch([3, 5], [2.0, 0.0])
    tl.trained(5, 0.0)
    with pytest.raises(RuntimeError, match="under the lower bound"):
        tl.trained(3, 1.5)


def test_report_and_compare_draw_accuracy_against_simulated_time(in_process, tmp_path):
    import shutil
    from raysim.app.compare import compare
    from raysim.app.report import render
    out = shutil.copytree(in_process[0], str(tmp_path / "run"))
    text = render(out)
    assert "## Simulated time" in text and "fedbuff" in text.split("## Simulated time")[1]
    assert os.path.isfile(os.path.join(out, "curves_time.png"))
    assert "compare_time.png" in compare([out], out=str(tmp_path / "cmp"))
    assert os.path.isfile(tmp_path / "cmp" / "compare_time.png")


def test_jobs_train_on_any_host_and_records_that_changed_go_home(tmp_path):
    """FedBuff with top-k's error feedback (each client's residual is its record) on 2 hosts:
    the jobs split evenly over the hosts whoever owns them (raysim.engine.balance.job_trainers),
    a record a job changed away from its owner reaches the owner before that client's next job,
    and the metrics are those of 1 host, where nothing moves."""
    overrides = ("rounds=8", "schedule.concurrency=6", "schedule.buffer=3", "compression.kind=topk",
                 "compression.fraction=0.1")
    seen = {}

    def look(rnd, summary, evaluation):
        if fed.num_hosts == 2:
            server = fed.server.obj
            seen.setdefault("moved", set()).update(c for c, h in server.trainers.items() if h != c % 2)
            seen["pinned"] = set(server.pinned)
            seen["stored"] = [sorted(cid for cid in range(12) if cid in h.obj.store) for h in fed.hosts]

    runs = []
    for hosts in (1, 2):
        fed = federation(cfg(*overrides, f"runtime.num_hosts={hosts}"), str(tmp_path / str(hosts)), progress=False,
                         backend=InProcess(), on_round=look)
        fed.run()
        runs.append(metrics(fed.run_dir))
    assert runs[0].equals(runs[1])
    assert seen["moved"]  # some jobs trained away from their owner
    assert seen["stored"][0] and all(c % 2 == 0 for c in seen["stored"][0])  # records live on their owner
    assert seen["stored"][1] and all(c % 2 == 1 for c in seen["stored"][1])
    assert seen["pinned"] == set(seen["stored"][0]) | set(seen["stored"][1])


def test_a_plan_that_can_never_step_fails_the_run_instead_of_asking_forever(tmp_path, monkeypatch):
    """A job handed to a host that comes back without its duration (an engine bug) leaves the
    step's plan empty even after every job in flight trained: the run fails saying so, with its
    traceback, rather than asking for a plan again and again."""
    from raysim.core.errors import MethodFailed
    from raysim.engine.host import ClientHost
    train_jobs = ClientHost.train_jobs

    def forgetful(host, work, ahead=False):
        durations, changed = train_jobs(host, work, ahead)
        durations.pop(min(durations, default=None), None)
        return durations, changed

    monkeypatch.setattr(ClientHost, "train_jobs", forgetful)
    with pytest.raises(MethodFailed, match="the plan takes no step"):
        run(tmp_path, backend=InProcess())


def test_the_hosts_fold_gives_each_step_the_staleness_weighted_mean_of_its_deltas(tmp_path, monkeypatch):
    """Through the real loop, each server step of FedBuff receives Δ̄ = Σ w_i s(τ_i) Δ_i / Σ w_i
    of the deltas its arrivals' jobs trained (raysim.core.buffered), on 2 hosts: the hosts apply
    s(τ) to the deltas, the server divides by the clients' weights."""
    import torch
    from raysim.engine.host import ClientHost
    from raysim.methods import registry
    deltas, steps = {}, {}
    fold_step, buffered_step = ClientHost._fold_step, registry.get("fedbuff").buffered_step

    def look_at_fold(host, plan, seconds):
        for c, s, tau, _ in plan.folded:
            if c in host._jobs and host._jobs[c][0] is not None:
                deltas[plan.version, c] = (host._jobs[c][0].tensors["head.weight"].clone(), s, tau)
        return fold_step(host, plan, seconds)

    def look_at_step(method, state, uploads, step):
        steps[step] = uploads
        return buffered_step(method, state, uploads, step)

    monkeypatch.setattr(ClientHost, "_fold_step", look_at_fold)
    monkeypatch.setattr(registry.get("fedbuff"), "buffered_step", look_at_step)
    run(tmp_path, "runtime.num_hosts=2", "rounds=5", backend=InProcess())
    assert len(steps) == 5 and any(tau > 0 for _, _, tau in deltas.values())
    for step, uploads in steps.items():
        mine = {c: d for (v, c), d in deltas.items() if v == step}
        assert sorted(mine) == uploads.clients
        assert uploads.staleness_weights == {c: s for c, (_, s, _) in mine.items()}
        by_hand = sum(s * d for d, s, _ in mine.values()) / len(mine)  # FedBuff's w_i = 1
        assert uploads.weight == len(mine)
        assert torch.allclose(uploads.delta()["head.weight"], by_hand, rtol=1e-5, atol=1e-7)


@pytest.mark.slow  # two federations on Ray actors (~30 s): make test-slow
def test_records_go_home_through_ray_as_in_one_process(ray_session, tmp_path):
    """The same run as above on Ray actors (records cross the object store and the driver)."""
    overrides = ("rounds=8", "schedule.concurrency=6", "schedule.buffer=3", "compression.kind=topk",
                 "compression.fraction=0.1", "runtime.num_hosts=2", "runtime.cpus_per_host=0.5")
    in_process = run(tmp_path / "in_process", *overrides, backend=InProcess())
    assert run(tmp_path / "ray", *overrides).equals(in_process)
