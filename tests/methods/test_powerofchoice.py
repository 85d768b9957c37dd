"""Power-of-Choice's selection by hand (fixed losses, a generator whose draw is fixed) in its two
phases, the engine's loss query (the hosts' answer is the eval-mode training loss of the global
model, charged to the clock, and nothing is asked by a selection that does not ask), the selection
with other methods and server steps, and the uniform selection: today's draw, bit for bit."""
import math

import numpy as np
import pytest
import torch

from raysim import testing
from raysim.app.configs import load_checked
from raysim.core.contract import Method
from raysim.core.errors import UserError
from raysim.core.seeding import SERVER, rng_for
from raysim.core.selection import PowerOfChoice, SelectionContext
from raysim.core.training import evaluate
from raysim.engine.federation import Federation
from raysim.engine.host import ClientHost
from raysim.engine.messages import LossQuery
from raysim.engine.server import Server
from tiny_models import Logits

pytestmark = pytest.mark.usefixtures("one_thread")


class FixedDraw:
    """A generator whose ``choice`` returns the given indices and records how it was called."""

    def __init__(self, indices):
        self.indices, self.calls = list(indices), []

    def choice(self, a, size=None, replace=True, p=None):
        self.calls.append({"a": a, "size": size, "replace": replace, "p": None if p is None else list(p)})
        return np.array(self.indices[:size])


def select(selection, online, m, rng, sizes, losses=None, state=None):
    """Both phases, as the server runs them: (the clients chosen, the clients asked)."""
    ctx = SelectionContext(round=1, online=online, m=m, rng=rng, num_train=sizes.__getitem__)
    asked = selection.candidates(state, ctx)
    if asked and losses is None:
        raise AssertionError("asked for losses")
    return selection.choose(state, ctx, {c: losses[c] for c in asked}), asked


def test_pow_d_draws_d_candidates_by_data_size_and_keeps_the_m_highest_losses():
    # online 1, 3, 4, 6, 7 with n_k 10, 20, 30, 40, 100 (sum 200): p = .05, .1, .15, .2, .5
    sizes = {1: 10, 3: 20, 4: 30, 6: 40, 7: 100}
    rng = FixedDraw([4, 1, 2, 0])  # A = {7, 3, 4, 1}, in that order
    chosen, asked = select(PowerOfChoice(d=4), np.array([1, 3, 4, 6, 7]), 2, rng, sizes,
                           losses={7: 0.5, 3: 2.0, 4: 1.5, 1: 0.1})
    assert chosen == [3, 4]  # losses 2.0 and 1.5
    assert rng.calls == [{"a": 5, "size": 4, "replace": False, "p": pytest.approx([0.05, 0.1, 0.15, 0.2, 0.5])}]
    assert asked == [7, 3, 4, 1]  # one query, of the candidates only, in their drawn order


def test_equal_losses_keep_the_draw_order_and_a_client_that_cannot_answer_ranks_last():
    sizes = dict.fromkeys(range(5), 1)
    sel = PowerOfChoice(d=4)
    losses = {3: 1.0, 0: 1.0, 4: 1.0, 2: 1.0}
    assert select(sel, range(5), 2, FixedDraw([3, 0, 4, 2]), sizes, losses)[0] == [0, 3]  # the draw breaks the tie
    losses = {3: math.nan, 0: 0.2, 4: 0.1, 2: 0.3}
    assert select(sel, range(5), 2, FixedDraw([3, 0, 4, 2]), sizes, losses)[0] == [0, 2]


def test_rpow_d_ranks_by_the_last_reported_loss_and_never_asks():
    sel = PowerOfChoice(d=4, variant="rpow-d")
    state = {"last_loss": {0: 0.3, 1: 0.9, 2: 0.5, 4: 5.0}}
    chosen, asked = select(sel, range(5), 2, FixedDraw([0, 1, 2, 3]), dict.fromkeys(range(5), 1), state=state)
    assert (chosen, asked) == ([1, 3], [])  # client 3 never trained: it comes first; then 1 (0.9)
    # its losses: the aggregated clients' mean training loss, kept per client across rounds
    assert sel.init_state() == {"last_loss": {}} and PowerOfChoice().init_state() is None
    assert sel.observe(state, {3: 0.7, 1: 0.2})["last_loss"] == {0: 0.3, 1: 0.2, 2: 0.5, 4: 5.0, 3: 0.7}


def test_d_below_m_is_a_one_line_error_and_d_above_the_online_clients_is_clamped():
    with pytest.raises(UserError, match=r"^clients.selection.d = 2 is below the 3 clients per round") as err:
        select(PowerOfChoice(d=2), range(5), 3, FixedDraw([0, 1, 2]), dict.fromkeys(range(5), 1), losses={})
    assert "\n" not in str(err.value)
    rng = FixedDraw([3, 1, 0, 2])
    chosen, asked = select(PowerOfChoice(d=10), [2, 5, 6, 9], 2, rng, dict.fromkeys([2, 5, 6, 9], 1),
                           losses={9: 3, 5: 2, 2: 1, 6: 0})
    assert chosen == [5, 9] and rng.calls[0]["size"] == 4 and asked == [9, 5, 2, 6]
    # the default d is 2m; with m or fewer online every one trains: nothing drawn, nothing asked
    rng = FixedDraw([0, 1, 2, 3, 4])
    select(PowerOfChoice(), range(5), 2, rng, dict.fromkeys(range(5), 1), losses=dict.fromkeys(range(5), 0.0))
    assert rng.calls[0]["size"] == 4
    rng = FixedDraw([])
    assert select(PowerOfChoice(), [1, 4], 2, rng, {}) == ([1, 4], []) and rng.calls == []


# ----------------------------------------------------------------------------- through the engine

LEVEL = {"name": "a", "flops": 1.0e9, "down_mbps": 50, "up_mbps": 10}


def test_the_hosts_answer_the_global_models_training_loss_on_any_layout(tmp_path, ray_session):
    """Round 1 with m = 1 of 3 clients and d = 3: each candidate's answer is the initial model's
    mean cross-entropy over its training data in eval mode (worked out here), and the client that
    trains is the one it fits worst, whatever the host layout."""
    args = ("clients_per_round=1", "hp.powerofchoice.d=3", "rounds=1")
    cfg = load_checked(raw={**testing.TINY, "method": "powerofchoice"}, overrides=list(args))
    server, host = Server(cfg), ClientHost(0, cfg, num_hosts=1, gpu_ids=[])
    server.start()
    host.start()
    query = server.sample(1)
    assert isinstance(query, LossQuery) and query.clients == [0, 1, 2]
    answers = host.local_losses(1, query.payload, query.clients, query.personal)
    model, expected = server.fed.initial_model(), {}
    for cid in range(3):
        r = evaluate(model, server.fed.client_data(cid).train, 256, torch.device("cpu"))
        expected[cid] = r["loss_sum"] / r["n"]
    assert answers.losses == expected and answers.sim_seconds == {}  # no client profiles: no clock
    worst = max(expected, key=expected.get)
    assert server.sample(1, answers) == [worst] and len(set(expected.values())) == 3
    one = testing.run_rounds("powerofchoice", tmp_path / "one", *args, "runtime.num_hosts=1")
    two = testing.run_rounds("powerofchoice", tmp_path / "two", *args, "runtime.num_hosts=2")
    assert one.equals(two) and set(one[(one.split == "train") & (one.client >= 0)].client) == {worst}


@pytest.mark.parametrize("method", ["fedprox", "fedadam"])
def test_power_of_choice_selects_for_any_method_and_server_step(method, tmp_path, ray_session):
    """clients.selection: the worst-fitting of 3 candidates trains, with FedProx's step or FedAdam's
    server step, as with the powerofchoice method (the same answers: the same initial model)."""
    args = ("clients_per_round=1", "rounds=1")
    poc = testing.run_rounds("powerofchoice", tmp_path / "poc", *args, "hp.powerofchoice.d=3")
    other = testing.run_rounds(method, tmp_path / method, *args, "clients.selection.kind=power_of_choice",
                               "clients.selection.d=3")
    trained = [set(df[(df.split == "train") & (df.client >= 0)].client) for df in (poc, other)]
    assert trained[0] == trained[1] and len(trained[0]) == 1
    with pytest.raises(UserError, match="method powerofchoice is FedAvg with Power-of-Choice's selection"):
        testing.run_rounds("powerofchoice", tmp_path / "both", *args, "clients.selection.kind=power_of_choice")


def old_pow_d(server, rnd, answers):
    """Power-of-Choice's pow-d select before the two phases (raysim e0c19f0 .. 27b68c0): run once to
    draw the candidates, again with their answers from a fresh generator keyed the same."""
    online, m, d = server.online(rnd), server.per_round, 2 * server.per_round
    if m >= len(online):
        return [int(c) for c in online]
    n_k = np.array([server.fed.partition.num_samples(c, "train") for c in online], dtype=np.float64)
    rng = rng_for(server.cfg.seed, rnd, SERVER, "sample")
    drawn = [int(online[int(i)]) for i in rng.choice(len(online), size=min(d, len(online)), replace=False,
                                                     p=n_k / n_k.sum())]
    order = sorted(range(len(drawn)), key=lambda i: -answers[drawn[i]])
    return sorted(drawn[i] for i in order[:m])


def test_two_phases_give_the_old_pow_d_draws_bit_for_bit(ray_session):
    raw = {**testing.TINY, "method": "powerofchoice", "clients_per_round": 2, "seed": 5,
           "data": {**testing.TINY["data"], "partition": {"kind": "per_domain", "train_size": 4,
                                                          "clients_per_domain": 3, "domains": ["mnist", "usps"]}}}
    cfg = load_checked(raw=raw)
    server, host = Server(cfg), ClientHost(0, cfg, num_hosts=1, gpu_ids=[])
    server.start()
    host.start()
    chosen = []
    for rnd in range(1, 9):
        query = server.sample(rnd)
        answers = host.local_losses(rnd, query.payload, query.clients, query.personal)
        new = server.sample(rnd, answers)
        assert new == old_pow_d(server, rnd, answers.losses)
        chosen.append(tuple(new))
    assert len(set(chosen)) > 2  # drawn, not fixed


def test_the_query_is_charged_to_the_clock_and_a_method_that_does_not_ask_pays_nothing(tmp_path, ray_session,
                                                                                       monkeypatch):
    from raysim.models import count_flops
    config = {**testing.TINY, "clients": {"profiles": {"levels": [LEVEL]}}}
    args = ("clients_per_round=1", "hp.powerofchoice.d=3", "rounds=1")
    df = testing.run_rounds("powerofchoice", tmp_path / "poc", *args, config=config)
    fed = Federation(load_checked(raw={**config, "method": "powerofchoice"}, overrides=list(args)))
    model = fed.initial_model()
    size = sum(v.numel() * v.element_size() for v in model.state_dict().values())
    # each candidate: 12 training images, one forward pass each (2 FLOPs per MAC) at 1 GFLOP/s;
    # the model down at 50 Mbit/s, the loss (8 bytes) up at 10 Mbit/s; the slowest of the three
    answer = 2 * count_flops(model, fed.image_shape) * 12 / 1e9 + 8 * size / 50e6 + 8 * 8 / 10e6
    clock = dict(zip(df[df.split == "clock"].metric, df[df.split == "clock"].value))
    trained = df[(df.split == "train") & (df.client >= 0) & (df.metric == "sim_seconds")].value.tolist()
    assert clock["sim_select_s"] == pytest.approx(answer) and clock["queried"] == 3
    assert clock["sim_round_s"] == pytest.approx(answer + trained[0]) and len(trained) == 1
    comm = dict(zip(df[df.split == "comm"].metric, df[df.split == "comm"].value))
    assert comm["bytes_down"] == 4 * size  # 3 candidates, then the one that trains

    def never(*args, **kwargs):
        raise AssertionError("a loss query for a method whose select does not ask")
    monkeypatch.setattr(ClientHost, "local_losses", never)
    avg = testing.run_rounds("fedavg", tmp_path / "fedavg", "clients_per_round=1", "rounds=1", config=config)
    assert set(avg[avg.split == "clock"].metric) == {"sim_round_s", "sim_time", "completed", "sampled"}
    assert avg[(avg.split == "comm") & (avg.metric == "bytes_down")].value.tolist() == [size]


# ----------------------------------------------------------------------------- the default select

def old_sample(server, rnd):
    """Server.sample before the select hook (raysim 8046079 .. ec87749), verbatim."""
    online = server.online(rnd)
    if server.per_round >= len(online):
        return [int(c) for c in online]
    rng = rng_for(server.cfg.seed, rnd, SERVER, "sample")
    if len(online) == server.n:
        return sorted(int(c) for c in rng.choice(server.n, size=server.per_round, replace=False))
    return sorted(int(online[int(i)]) for i in rng.choice(len(online), size=server.per_round, replace=False))


@pytest.mark.parametrize("extra", [{}, {"clients": {"profiles": {"levels": [
    {"name": "on", "flops": 1e9}, {"name": "flaky", "flops": 1e9, "availability": 0.5}], "assign": "round_robin"}}}])
def test_the_default_select_is_the_old_draw_bit_for_bit(extra, tmp_path, ray_session):
    raw = {**testing.TINY, "method": "fedavg", "clients_per_round": 4, "seed": 3, **extra,
           "data": {**testing.TINY["data"], "partition": {"kind": "per_domain", "train_size": 4,
                                                          "clients_per_domain": 3, "domains": ["mnist", "usps"]}}}
    server = Server(load_checked(raw=raw))
    server.start()
    draws = [(server.sample(rnd), old_sample(server, rnd)) for rnd in range(1, 13)]
    assert all(new == old for new, old in draws)
    assert len({tuple(old) for _, old in draws}) > 3  # drawn, not fixed
    if extra:  # every branch of the old draw: m or fewer online, some of the 6, all 6
        assert {len(server.online(r)) for r in range(1, 13)} == {3, 4, 5, 6}
    # and through the round loop: the clients that trained are the old draw's
    config = {k: v for k, v in raw.items() if k != "method"}
    df = testing.run_rounds("fedavg", tmp_path / "run", "rounds=3", config=config)
    rows = df[(df.split == "train") & (df.client >= 0) & (df.metric == "loss")]
    assert [sorted(rows[rows["round"] == r].client) for r in (1, 2, 3)] == [old for _, old in draws[:3]]


def test_a_select_that_returns_an_offline_or_repeated_client_is_a_one_line_error(tmp_path, ray_session, monkeypatch):
    from raysim.methods import registry

    class Twice(Method):
        name = "select_twice"

        def select(self, state, ctx):
            return [0, 0]

    class Offline(Method):
        name = "select_offline"

        def select(self, state, ctx):
            return [5]
    monkeypatch.setitem(registry._METHODS, Twice.name, Twice)
    monkeypatch.setitem(registry._METHODS, Offline.name, Offline)
    with pytest.raises(UserError, match=r"^method select_twice: select chose client 0 twice in round 1$"):
        testing.run_rounds("select_twice", tmp_path / "twice", "rounds=1")
    with pytest.raises(UserError, match=r"^method select_offline: select chose client 5, not online in round 1$"):
        testing.run_rounds("select_offline", tmp_path / "offline", "rounds=1")


# ----------------------------------------------------------------------------- rpow-d's loss

def test_rpow_d_learns_the_mean_of_its_batch_losses_over_several_steps():
    """Plain SGD at lr 1 on batches of one class-0 example, the logits b starting at (0, 0):
    losses ln 2, then ln(1 + 1/e) at b = (1/2, -1/2), then ln(1 + e^-(1 + 2s)) at
    b = (1/2 + s, -1/2 - s), s = 1 / (1 + e). A client of 3 batches uploads their mean, one of 1
    batch ln 2, alone and in a client cohort (two clients, one stopping after its first step): the
    loss it reports, which rpow-d's selection learns."""
    from raysim.engine.cohort import CohortClient, run_cohort

    s = 1 / (1 + math.e)
    three = [math.log(2), math.log(1 + 1 / math.e), math.log(1 + math.exp(-(1 + 2 * s)))]
    expected = {0: sum(three) / 3, 1: math.log(2)}  # the sums would be 1.38 and 0.69
    from raysim.methods.powerofchoice import PowerOfChoice as PowerOfChoiceMethod
    method = PowerOfChoiceMethod(PowerOfChoiceMethod.Hparams(variant="rpow-d"), testing.setup(num_clients=8))
    model = Logits()
    one = (torch.zeros(1, 1), torch.tensor([0]))
    data = {0: testing.fixed_batches(one, one, one), 1: testing.fixed_batches(one)}

    def start(k):
        with torch.no_grad():
            model.b.zero_()
        return testing.client_context(method, model, data[k], client_id=k,
                                      train={"epochs": 1, "batch_size": 1, "lr": 1.0})
    ups = {k: method.local_update(start(k)) for k in (0, 1)}
    alone = {k: up.metrics["loss"] for k, up in ups.items()}
    assert {up.weight for up in ups.values()} == {1.0}  # step 4: the equal mean
    assert alone == {k: pytest.approx(v, rel=1e-6) for k, v in expected.items()}
    together = {}
    run_cohort(method, model, [CohortClient(lambda k=k: start(k)) for k in (0, 1)],
               lambda ctx, up, macs: together.update({ctx.client_id: up.metrics["loss"]}))
    assert together == {k: pytest.approx(v, rel=1e-6) for k, v in expected.items()}
