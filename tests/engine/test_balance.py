"""Work stealing between hosts (raysim.engine.balance): the plan hands out chunks as the
description says, and which host trains a client never changes the results (real Ray actors,
records through the object store)."""
import os

import pyarrow.parquet as pq
import pytest

from raysim.config import AUTO_COHORT_MAX, load_config
from raysim.app.experiment import federation
from raysim.engine.balance import LEAST_CHUNK_SECONDS, StealingPlan, job_trainers, least_chunk
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
    sticky = {10, 12}
    plan = StealingPlan(1, {0: [0, 2, 4, 6, 8, 10, 12, 14], 1: [1]}, 2, lambda c: c not in sticky)
    assert plan.next_chunk(0, 0) == (0, [0, 2])  # a quarter of 8
    assert plan.next_chunk(0, 1) == (0, [4, 6])  # a quarter of 6, rounded up
    assert plan.next_chunk(0, 2) == (None, [])  # two chunks in flight: it waits
    assert plan.next_chunk(1, 0) == (1, [1])
    assert plan.next_chunk(1, 1) == (None, [])  # own queue empty but still busy: no stealing yet
    # idle: half of host 0's movable queued clients (8, 14), from the tail; 10 and 12 stay
    assert plan.next_chunk(1, 0) == (0, [14])
    assert plan.next_chunk(1, 0) == (0, [8])
    assert plan.next_chunk(1, 0) == (None, [])  # only sticky clients left on host 0
    assert list(plan.queues[0]) == [10, 12]
    assert plan.next_chunk(0, 0) == (0, [10])


def test_a_chunk_of_cheap_clients_holds_at_least_the_least_chunks_worth():
    # a client of 4 ms: 25 ms is 7 of them; one of 30 ms is worth a chunk alone; unmeasured: 1
    assert LEAST_CHUNK_SECONDS == 0.025
    assert (least_chunk(0.004), least_chunk(0.0125), least_chunk(0.03), least_chunk(None)) == (7, 2, 1, 1)
    plan = StealingPlan(1, {0: list(range(0, 40, 2)), 1: [1, 3]}, 2, lambda c: True, least={0: 7})
    assert plan.next_chunk(0, 0) == (0, [0, 2, 4, 6, 8, 10, 12])  # a quarter of 20 is 5: 7 instead
    assert plan.next_chunk(0, 1) == (0, [14, 16, 18, 20, 22, 24, 26])
    assert plan.next_chunk(0, 2) == (None, [])  # two in flight
    assert plan.next_chunk(0, 1) == (0, [28, 30, 32, 34, 36, 38])  # the last 6
    assert plan.next_chunk(1, 0) == (1, [1])  # no floor on host 1: a quarter, rounded up
    assert plan.next_chunk(1, 1) == (1, [3])


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
    """The default plan, remembering the chunk floors the driver gave each round's plan."""
    floors: dict = {}

    def __init__(self, rnd, queues, num_hosts, movable, least=None):
        super().__init__(rnd, queues, num_hosts, movable, least)
        RecordingPlan.floors[rnd] = dict(least or {})


def test_the_driver_sizes_a_hosts_chunks_from_its_measured_clients(ray_session, tmp_path):
    RecordingPlan.floors = {}
    _run(tmp_path, "floors", "rounds=2", plan=RecordingPlan)
    assert RecordingPlan.floors[1] == {}  # nothing measured before the first round
    assert set(RecordingPlan.floors[2]) == {0, 1} and all(k >= 1 for k in RecordingPlan.floors[2].values())
    # with cohorts a chunk holds a whole cohort at least, in every round: a cohort forms within a
    # chunk, and timed chunks would make the cohorts (and their rounding) vary from run to run
    RecordingPlan.floors = {}
    _run(tmp_path, "cohorts", "rounds=2", "runtime.cohort_size=3", plan=RecordingPlan)
    assert RecordingPlan.floors[1] == RecordingPlan.floors[2] == {0: 3, 1: 3}
    RecordingPlan.floors = {}  # 'auto' (K from the GPU memory free, on each host): the most it picks
    _run(tmp_path, "cohorts_auto", "rounds=1", "runtime.cohort_size=auto", plan=RecordingPlan)
    assert RecordingPlan.floors[1] == {0: AUTO_COHORT_MAX, 1: AUTO_COHORT_MAX} and AUTO_COHORT_MAX == 64


@pytest.mark.slow
def test_the_same_results_whichever_host_trains_a_client(ray_session, tmp_path):
    pinned = _run(tmp_path, "owner", "runtime.balance=owner")
    # every client on the host after its owner: FedBN's BN state read from the owner and returned
    moved = _run(tmp_path, "elsewhere", plan=ElsewherePlan)
    stealing = _run(tmp_path, "steal")  # the default: whatever the timing gives
    post_train = _run(tmp_path, "elsewhere-post", "eval.point=post_train", plan=ElsewherePlan)
    pinned_post = _run(tmp_path, "owner-post", "eval.point=post_train", "runtime.balance=owner")
    assert len(pinned) and pinned.equals(moved) and pinned.equals(stealing)
    assert pinned_post.equals(post_train)
