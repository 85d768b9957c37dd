"""The buffered schedule's simulated timeline on a toy clock with known durations: arrival
order, versions, staleness and server steps, computed by hand."""
import pytest

from raysim.engine.timeline import DispatchedTwice, Job, Timeline


def run(t: Timeline, durations: dict[int, float], refill) -> list:
    """Train every waiting job with its toy duration, step, refill; the steps' (time, version, folded
    (client, staleness), dropped clients)."""
    out = []
    for _ in range(4):
        for c in t.waiting_on:
            t.trained(c, durations[c])
        s = t.step()
        out.append((s.time, s.version, [(a.job.client, a.staleness) for a in s.folded], [a.job.client for a in s.dropped]))
        t.dispatch(refill(s))
    return out


def test_a_toy_clock_gives_the_arrival_order_versions_staleness_and_steps_by_hand():
    # C = 3 in flight, K = 2 per step; durations: client 0 1 s, 1 4 s, 2 2 s, 3 1 s, 4 3 s
    t = Timeline(concurrency=3, buffer=2)
    t.dispatch([0, 1, 2])  # at 0 s, version 0
    queue = iter([[3, 4], [0, 2], [3, 4], []])
    steps = run(t, {0: 1.0, 1: 4.0, 2: 2.0, 3: 1.0, 4: 3.0}, lambda s: next(queue))
    # step 1: 0 arrives at 1 s, 2 at 2 s -> version 1 at 2 s; 3 and 4 start at 2 s (v1), 1 still out (v0)
    # step 2: 3 at 3 s (τ 0), 1 at 4 s (τ 1) -> version 2 at 4 s; 0 and 2 start at 4 s (v2)
    # step 3: 4 at 5 s (τ 1), 0 at 5 s (τ 0): a tie at 5 s broken by client id -> 0 then 4; version 3 at 5 s
    # step 4: 2 at 6 s (τ 1), 3 at 6 s (τ 0; started at 5 s, v3): tie -> 2 then 3; version 4 at 6 s
    assert steps == [(2.0, 1, [(0, 0), (2, 0)], []),
                     (4.0, 2, [(3, 0), (1, 1)], []),
                     (5.0, 3, [(0, 0), (4, 1)], []),
                     (6.0, 4, [(2, 1), (3, 0)], [])]


def test_an_arrival_staler_than_max_staleness_frees_its_slot_without_counting():
    t = Timeline(concurrency=2, buffer=1, max_staleness=0)
    t.dispatch([0, 1])
    t.trained(0, 1.0), t.trained(1, 5.0)
    s = t.step()
    assert (s.version, [a.job.client for a in s.folded]) == (1, [0])
    t.dispatch([2])  # at 1 s, v1
    t.trained(2, 10.0)
    s = t.step()  # 1 arrives at 5 s with τ 1 > 0: dropped; 2 at 11 s folded
    assert [a.job.client for a in s.dropped] == [1] and [(a.job.client, a.staleness) for a in s.folded] == [(2, 0)]
    assert (s.time, s.version, t.in_flight) == (11.0, 2, {})


def test_with_nothing_left_in_flight_a_step_takes_fewer_than_k():
    t = Timeline(concurrency=3, buffer=3)
    t.dispatch([4, 7])
    t.trained(4, 2.0), t.trained(7, 1.0)
    s = t.step()
    assert [a.job.client for a in s.folded] == [7, 4] and s.time == 2.0 and t.free_slots == 3


def test_a_client_is_never_in_flight_twice():
    t = Timeline(concurrency=4, buffer=1)
    t.dispatch([1, 2])
    with pytest.raises(DispatchedTwice, match="client 2 is already in flight"):
        t.dispatch([3, 2])
    with pytest.raises(DispatchedTwice, match="client 5"):
        t.dispatch([5, 5])
    assert set(t.in_flight) == {1, 2}
    with pytest.raises(ValueError, match="3 clients dispatched with 2 free slots"):
        t.dispatch([5, 6, 8])


def test_a_step_waits_for_every_duration_and_the_order_is_simulated_not_real():
    """Durations recorded in any real-time order give the same steps."""
    def steps(order):
        t = Timeline(concurrency=4, buffer=2)
        t.dispatch([0, 1, 2, 3])
        for c in order[:-1]:
            t.trained(c, {0: 3.0, 1: 1.0, 2: 2.0, 3: 1.0}[c])
        with pytest.raises(RuntimeError, match="have not trained yet"):
            t.step()
        t.trained(order[-1], {0: 3.0, 1: 1.0, 2: 2.0, 3: 1.0}[order[-1]])
        s = t.step()
        return [(a.job.client, a.finish) for a in s.folded]
    assert steps([0, 1, 2, 3]) == steps([3, 2, 1, 0]) == steps([2, 0, 3, 1]) == [(1, 1.0), (3, 1.0)]


def test_a_job_whose_earliest_arrival_comes_after_the_kth_may_train_after_the_step():
    """Lower bounds of the durations (the download) let a step go before every job trained: only
    jobs whose earliest arrival is not after the K-th folded known arrival are needed, and the
    step is the one all durations give."""
    durations = {0: 1.0, 1: 2.0, 2: 2.5, 3: 4.0}

    def timeline():
        t = Timeline(concurrency=4, buffer=2)
        t.dispatch([0, 1, 2, 3], least_seconds=[0.5, 0.5, 1.5, 2.0])  # earliest arrivals 0.5, 0.5, 1.5, 2
        return t

    full = timeline()
    for c, s in durations.items():
        full.trained(c, s)
    expected = full.step()
    lazy = timeline()
    assert lazy.needed() == [0, 1, 2, 3]  # nothing trained yet: the K-th arrival is unknown
    assert lazy.needed(training=[0, 1]) == [2, 3]  # jobs being trained are not asked twice
    lazy.trained(0, 1.0), lazy.trained(1, 2.0)  # K-th known arrival: client 1 at 2 s
    assert lazy.needed() == [2]  # 2 may arrive at 1.5 s; 3 not before 2 s, and a tie there puts client 1 first
    with pytest.raises(RuntimeError, match=r"clients \[2\] have not trained yet"):
        lazy.step()
    lazy.trained(2, 2.5)
    assert lazy.needed() == []
    got = lazy.step()
    assert (got.time, got.version, [a.job.client for a in got.folded]) == (expected.time, expected.version, [0, 1])
    assert lazy.waiting_on == [3] and set(lazy.in_flight) == {2, 3}  # 3 trains after the step


def test_a_job_is_keyed_as_the_synchronous_round_of_its_version():
    assert Job(client=3, version=0, start=0.0).round == 1 and Job(3, 6, 9.5).round == 7


def test_the_timeline_round_trips_through_plain_data():
    t = Timeline(concurrency=3, buffer=2, max_staleness=4)
    t.dispatch([0, 1, 2])
    t.trained(0, 1.0), t.trained(2, 2.5)
    back = Timeline.restore(t.export())
    assert back == t
    for x in (t, back):
        x.trained(1, 0.5)
    assert t.step() == back.step()


def test_k_must_fit_in_c():
    with pytest.raises(ValueError, match="buffer K = 5 must be between 1 and the concurrency C = 4"):
        Timeline(concurrency=4, buffer=5)
