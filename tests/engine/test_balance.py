"""Balancing a round's clients over the hosts (raysim.engine.balance): the plans hand out chunks
as the description says, and which host trains a client never changes the results (real Ray actors,
records through the object store)."""
import copy
import os

import pyarrow.parquet as pq
import pytest

from raysim.config import AUTO_COHORT_MAX, load_config
from raysim.app.experiment import federation
from raysim.engine.balance import (LEAST_CHUNK_SECONDS, PACE_WEIGHT, Costs, EvenPlan, Paces, StealingPlan, job_trainers,
                                   least_chunk, plan_for)
from raysim.testing import ElsewherePlan

TINY = {
    "method": "fedbn", "rounds": 3, "seed": 5, "clients_per_round": 4,
    "data": {"dataset": "digits5", "options": {"image_size": 16},
             "partition": {"kind": "per_domain", "train_size": 16, "clients_per_domain": 2,
                           "domains": ["mnist", "usps", "svhn"]}},
    "model": {"name": "small_cnn", "norm": "bn"},
    "train": {"epochs": 1, "batch_size": 8, "lr": 0.05, "momentum": 0.5},
    "eval": {"every": 1, "splits": ["test"]},
    "runtime": {"num_hosts": 2},
}


def test_a_host_drains_its_own_queue_in_shrinking_chunks_then_steals_movable_clients():
    sticky = {18, 20}
    plan = StealingPlan(1, {0: list(range(0, 24, 2)), 1: [1]}, 2, lambda c: c not in sticky)
    assert plan.next_chunk(0, 0) == (0, [0, 2, 4, 6, 8, 10])  # half of 12
    assert plan.next_chunk(0, 1) == (0, [12, 14, 16])  # half of 6
    assert plan.next_chunk(0, 2) == (None, [])  # two chunks in flight: it waits
    assert plan.next_chunk(1, 0) == (1, [1])
    assert plan.next_chunk(1, 1) == (None, [])  # own queue empty but still busy: no stealing yet
    # idle: half of host 0's movable queued clients (22), from the tail; 18 and 20 stay
    assert plan.next_chunk(1, 0) == (0, [22])
    assert plan.next_chunk(1, 0) == (None, [])  # only sticky clients left on host 0
    assert list(plan.queues[0]) == [18, 20]
    assert plan.next_chunk(0, 0) == (0, [18])
    assert not plan.exhausted() and plan.next_chunk(0, 0) == (0, [20]) and plan.exhausted()


def test_a_chunk_of_cheap_clients_holds_at_least_the_least_chunks_worth():
    # a client of 4 ms: 25 ms is 7 of them; one of 30 ms is worth a chunk alone; unmeasured: 1
    assert LEAST_CHUNK_SECONDS == 0.025
    assert (least_chunk(0.004), least_chunk(0.0125), least_chunk(0.03), least_chunk(None)) == (7, 2, 1, 1)
    plan = StealingPlan(1, {0: list(range(0, 40, 2)), 1: [1, 3]}, 2, lambda c: True, least={0: 7})
    assert plan.next_chunk(0, 0) == (0, [0, 2, 4, 6, 8, 10, 12, 14, 16, 18])  # half of 20
    assert plan.next_chunk(0, 1) == (0, [20, 22, 24, 26, 28, 30, 32])  # half of 10 is 5: 7 instead
    assert plan.next_chunk(0, 2) == (None, [])  # two in flight
    assert plan.next_chunk(0, 1) == (0, [34, 36, 38])  # the last 3
    assert plan.next_chunk(1, 0) == (1, [1])  # no floor on host 1: half, rounded up
    assert plan.next_chunk(1, 1) == (1, [3])


def test_the_owners_uneven_split_is_evened_out_before_the_round_by_count_when_clients_cost_alike():
    # k mod 2 gave host 0 fourteen clients and host 1 eight: three move, from host 0's tail; they
    # train first on host 1, as one chunk from their owner
    plan = StealingPlan(1, {0: list(range(0, 28, 2)), 1: list(range(1, 16, 2))}, 2, lambda c: True, costs=Costs())
    assert len(plan.queues[0]) == len(plan.queues[1]) + len(plan.adopted[1]) == 11
    assert list(plan.adopted[1]) == [(0, 26), (0, 24), (0, 22)] and not plan.adopted[0]
    assert plan.may_leave(0) == list(range(0, 28, 2)) and plan.may_leave(1) == list(range(1, 16, 2))
    assert plan.next_chunk(1, 0) == (0, [22, 24, 26])
    assert plan.next_chunk(1, 1) == (1, [1, 3, 5, 7])  # then its own queue, half of 8
    # an odd total stays one apart; clients whose state may not travel stay home
    plan = StealingPlan(1, {0: [0, 2, 4, 6, 8], 1: []}, 2, lambda c: c not in {6, 8}, costs=Costs())
    assert list(plan.queues[0]) == [0, 6, 8] and list(plan.adopted[1]) == [(0, 4), (0, 2)]
    # without costs the queues stay as the owners split them
    assert not StealingPlan(1, {0: [0, 2, 4, 6, 8], 1: []}, 2, lambda c: True).adopted[1]


def test_evening_out_weighs_each_clients_examples_at_each_hosts_pace():
    # host 1 takes 2 s an example, host 0 1 s: 6 + 6 clients of one example end at 6 s and 12 s;
    # moving two to host 0 ends both at 8 s, a third would end host 0 at 9 s
    plan = StealingPlan(1, {0: [0, 2, 4, 6, 8, 10], 1: [1, 3, 5, 7, 9, 11]}, 2, lambda c: True,
                        costs=Costs({c: 1 for c in range(12)}, {0: 1.0, 1: 2.0}))
    assert list(plan.adopted[0]) == [(1, 11), (1, 9)] and not plan.adopted[1]
    # one large client (100 examples) and two small ones on host 0: the small ones move, the
    # large one would only make host 1 the late one
    plan = StealingPlan(1, {0: [0, 2, 4], 1: [1]}, 2, lambda c: True, costs=Costs({0: 100, 2: 10, 4: 10, 1: 10}))
    assert list(plan.queues[0]) == [0] and list(plan.adopted[1]) == [(0, 4), (0, 2)]
    # a client not trained yet counts the mean of the known (here 40 examples), an unmeasured host the mean pace
    costs = Costs({0: 70, 1: 10}, {0: 1.0})
    assert costs.seconds(0, 5) == 40.0 and costs.seconds(1, 0) == 70.0 and Costs().seconds(3, 3) == 1.0


def test_the_default_plan_evens_the_queues_out_then_hands_each_host_its_queue_whole():
    assert plan_for(load_config(raw=TINY)) is EvenPlan
    assert plan_for(load_config(raw=TINY, overrides=["runtime.balance=steal"])) is StealingPlan
    assert plan_for(load_config(raw=TINY, overrides=["runtime.balance=owner"])) is None
    # evened out as the stealing plan does (three of host 0's fourteen move to host 1), then host 1
    # gets the moved clients as one chunk from their owner and its own queue as another, at once
    plan = EvenPlan(1, {0: list(range(0, 28, 2)), 1: list(range(1, 16, 2))}, 2, lambda c: True, costs=Costs())
    assert plan.next_chunk(1, 0) == (0, [22, 24, 26])
    assert plan.next_chunk(1, 1) == (1, list(range(1, 16, 2)))
    assert plan.next_chunk(1, 2) == (None, [])
    assert not plan.exhausted()
    assert plan.next_chunk(0, 0) == (0, list(range(0, 22, 2)))
    assert plan.exhausted()
    # only the moved clients leave their owner (their records are exported), nothing is stolen
    plan = EvenPlan(1, {0: [0, 2, 4, 6, 8], 1: []}, 2, lambda c: c not in {6, 8}, costs=Costs())
    assert plan.may_leave(0) == [2, 4] and plan.may_leave(1) == []
    assert plan.next_chunk(1, 0) == (0, [2, 4]) and plan.next_chunk(1, 0) == (None, [])
    assert plan.next_chunk(0, 0) == (0, [0, 6, 8])


def test_a_hosts_pace_leaves_its_warm_up_out_and_weighs_each_new_chunk_half():
    assert PACE_WEIGHT == 0.5
    paces = Paces()
    paces.add(0, 9.0, clients=3, examples=30, first=True)  # the warm-up: not the host's pace
    assert paces.per_example == {} and paces.per_client == {}
    paces.add(0, 2.0, clients=2, examples=20)
    assert paces.per_example == {0: 0.1} and paces.per_client == {0: 1.0}
    paces.add(0, 4.0, clients=2, examples=20)  # half the new 0.2, half the old 0.1
    assert paces.per_example[0] == 0.5 * 0.2 + 0.5 * 0.1 and paces.per_client[0] == 1.5
    paces.add(1, 1.0, clients=1, examples=0)  # no examples known: the per-client pace only
    assert 1 not in paces.per_example and paces.per_client[1] == 1.0
    paces.add(1, 1.0, clients=0, examples=0)  # an empty chunk measures nothing
    assert paces.per_client[1] == 1.0


def test_a_dispatchs_jobs_split_evenly_and_pinned_clients_stay_home():
    # owners of 0, 2, 4, 6 are all host 0: unpinned, they alternate over the hosts
    assert job_trainers([6, 0, 4, 2], set(), 2) == {0: 0, 2: 1, 4: 0, 6: 1}
    # 2 and 4 keep records on host 0: they train there, so 0 and 6 go to host 1
    assert job_trainers([0, 2, 4, 6], {2, 4}, 2) == {2: 0, 4: 0, 0: 1, 6: 1}
    assert job_trainers([1, 3, 5], {1, 3, 5}, 4) == {1: 1, 3: 3, 5: 1}
    assert job_trainers([7], set(), 1) == {7: 0}


def test_elsewhere_plan_trains_every_client_on_the_next_host():
    plan = ElsewherePlan(2, {0: [0, 2], 1: [1]}, 2, lambda c: False)  # moves even sticky clients
    assert plan.next_chunk(0, 0) == (1, [1])
    assert plan.next_chunk(1, 0) == (0, [0, 2])
    assert plan.next_chunk(1, 0) == (None, [])


def _run(tmp_path, name, *overrides, plan=None):
    cfg = load_config(raw=TINY, overrides=list(overrides))
    fed = federation(cfg, str(tmp_path / name), progress=False)
    if plan is not None:
        fed.plan = plan
    fed.run()
    return pq.read_table(os.path.join(tmp_path, name, "metrics.parquet")).to_pandas()


class RecordingPlan(StealingPlan):
    """The default plan, remembering the chunk floors and costs the driver gave each round's plan."""
    floors: dict = {}
    costs: dict = {}

    def __init__(self, rnd, queues, num_hosts, movable, least=None, costs=None):
        super().__init__(rnd, queues, num_hosts, movable, least, costs)
        RecordingPlan.floors[rnd] = dict(least or {})
        RecordingPlan.costs[rnd] = copy.deepcopy(costs)  # the driver's live tables, as this round saw them


def test_the_driver_sizes_a_hosts_chunks_from_its_measured_clients(ray_session, tmp_path):
    RecordingPlan.floors = {}
    _run(tmp_path, "floors", "rounds=2", plan=RecordingPlan)
    assert RecordingPlan.floors[1] == {}  # nothing measured before the first round
    assert set(RecordingPlan.floors[2]) == {0, 1} and all(k >= 1 for k in RecordingPlan.floors[2].values())
    # the queues are evened out by what round 1 measured: each trained client's examples (16 in
    # TINY), each host's seconds per example
    assert RecordingPlan.costs[1] == Costs()
    assert set(RecordingPlan.costs[2].examples.values()) == {16} and len(RecordingPlan.costs[2].examples) == 4
    assert set(RecordingPlan.costs[2].pace) == {0, 1} and all(p > 0 for p in RecordingPlan.costs[2].pace.values())
    # with cohorts a chunk holds a whole cohort at least, in every round: a cohort forms within a
    # chunk, and timed chunks would make the cohorts (and their rounding) vary from run to run
    RecordingPlan.floors = {}
    _run(tmp_path, "cohorts", "rounds=2", "runtime.cohort_size=3", plan=RecordingPlan)
    assert RecordingPlan.floors[1] == RecordingPlan.floors[2] == {0: 3, 1: 3}
    assert not RecordingPlan.costs[2].pace  # by examples alone: timed queues would make the cohorts vary too
    RecordingPlan.floors = {}  # 'auto' (K from the GPU memory free, on each host): the most it picks
    _run(tmp_path, "cohorts_auto", "rounds=1", "runtime.cohort_size=auto", plan=RecordingPlan)
    assert RecordingPlan.floors[1] == {0: AUTO_COHORT_MAX, 1: AUTO_COHORT_MAX} and AUTO_COHORT_MAX == 64


@pytest.mark.slow
def test_the_same_results_whichever_host_trains_a_client(ray_session, tmp_path):
    pinned = _run(tmp_path, "owner", "runtime.balance=owner")
    # every client on the host after its owner: FedBN's BN state read from the owner and returned
    moved = _run(tmp_path, "elsewhere", plan=ElsewherePlan)
    stealing = _run(tmp_path, "steal", "runtime.balance=steal")  # whatever the timing gives
    evened = _run(tmp_path, "even")  # the default: queues evened out by measured paces
    post_train = _run(tmp_path, "elsewhere-post", "eval.point=post_train", plan=ElsewherePlan)
    pinned_post = _run(tmp_path, "owner-post", "eval.point=post_train", "runtime.balance=owner")
    assert len(pinned) and pinned.equals(moved) and pinned.equals(stealing) and pinned.equals(evened)
    assert pinned_post.equals(post_train)
