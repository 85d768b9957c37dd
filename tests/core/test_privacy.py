"""Client-level DP (raysim.core.privacy, raysim.core.stages) against values computed by hand and
against dp-accounting's own computation."""
import math

import dp_accounting as dpa
import pytest
import torch
from dp_accounting import pld, rdp

from raysim.core.aggregation import WeightedMean
from raysim.core.contract import Upload
from raysim.core.errors import UserError
from raysim.core.privacy import Accounting, AdaptiveClip, RunningEpsilon, clip, flat_norm
from raysim.core.stages import COUNT_KEY, PAYLOAD_KEY, PrivacyPlan, Stages


def test_clip_scales_an_update_over_the_bound_to_norm_c_and_leaves_one_under_it_alone():
    over = {"w": torch.tensor([3.0, 0.0]), "b": torch.tensor([4.0]), "n": torch.tensor(7)}
    clipped, norm = clip(over, 1.0)
    assert norm == 5.0  # sqrt(9 + 16): the flat norm over both floating-point tensors
    assert torch.equal(clipped["w"], torch.tensor([0.6, 0.0])) and torch.equal(clipped["b"], torch.tensor([0.8]))
    assert clipped["n"] is over["n"]  # integers are not part of the norm, nor scaled
    assert flat_norm(clipped) == pytest.approx(1.0)
    under = {"w": torch.tensor([0.3, -0.4])}
    same, norm = clip(under, 1.0)
    assert norm == pytest.approx(0.5) and torch.equal(same["w"], under["w"])


def plan(clip_=1.0, z=0.0, adaptive=None, local=False, n=10, m=4):
    return PrivacyPlan(clip=clip_, noise_multiplier=z, delta=1e-3, accounting=Accounting("fixed", n, m),
                       adaptive=adaptive, local=local)


def round_of(stages: Stages, updates: dict[int, dict], base: dict, m: int, state=None, rnd=1):
    """The client stages on each update (x + Δ uploaded), the weighted-mean fold, the server stage."""
    state = stages.init_state() if state is None else state
    payload = {"global": base, **stages.payload(state)}
    agg = WeightedMean()
    partial = agg.start()
    for cid, delta in sorted(updates.items()):
        up = Upload({k: base[k] + delta[k] for k in base}, weight=float(10 + cid))  # n_k weights: DP ignores them
        staged = stages.client(rnd, cid, up, base, payload, None)
        agg.add(partial, cid, Upload(staged.tensors, staged.weight, statistics=staged.statistics))
    return stages.server_round(rnd, agg.reduce([partial]), base, m, state)


def test_one_huge_client_moves_the_mean_by_at_most_c_over_m():
    base = {"w": torch.zeros(3)}
    updates = {0: {"w": torch.tensor([1e6, 0.0, 0.0])}, 1: {"w": torch.zeros(3)}, 2: {"w": torch.zeros(3)}}
    mean, _, _ = round_of(Stages(0, plan(clip_=2.0), None), updates, base, m=4)
    assert torch.allclose(mean.mean["w"], torch.tensor([0.5, 0.0, 0.0]))  # C / m = 2 / 4, not divided by 3 clients


def test_the_noise_on_the_mean_has_standard_deviation_z_c_over_m():
    stages = Stages(7, plan(clip_=2.0, z=1.5), None)
    base = {"w": torch.zeros(200)}
    draws = torch.cat([round_of(stages, {}, base, m=4, rnd=r)[0].mean["w"] for r in range(1, 101)]).double()
    expected = 1.5 * 2.0 / 4  # z C / m = 0.75
    # 20,000 draws: the sample std's standard error is ~0.5%; 3% is six of them
    assert draws.std().item() == pytest.approx(expected, rel=0.03)
    assert abs(draws.mean().item()) < 4 * expected / math.sqrt(draws.numel())
    again = round_of(stages, {}, base, m=4, rnd=5)[0].mean["w"]
    assert torch.equal(again, round_of(stages, {}, base, m=4, rnd=5)[0].mean["w"])  # keyed by the round


def test_local_noise_is_drawn_on_each_client_and_the_server_adds_none():
    stages = Stages(1, plan(clip_=1.0, z=2.0, local=True), None)
    base = {"w": torch.zeros(5000)}
    payload = {"global": base, **stages.payload(stages.init_state())}
    assert payload[PAYLOAD_KEY] == {"clip": 1.0, "local_noise": 2.0}
    staged = stages.client(1, 3, Upload({"w": base["w"].clone()}, 1.0), base, payload, None)
    assert staged.tensors["w"].std().item() == pytest.approx(2.0, rel=0.05)  # z C on the client's own update
    mean, _, _ = round_of(Stages(1, plan(clip_=1.0, z=2.0, local=True), None), {}, base, m=4)
    assert torch.count_nonzero(mean.mean["w"]) == 0


def test_the_adaptive_clip_follows_its_geometric_update_on_a_toy_sequence():
    """Andrew et al.: C <- C exp(-η (b - γ)), b the fraction of unclipped updates (here no noise:
    z = 0 draws no count noise)."""
    rule = AdaptiveClip(quantile=0.5, lr=0.2, count_noise=1.0)
    stages = Stages(0, plan(clip_=1.0, adaptive=rule), None)
    base = {"w": torch.zeros(1)}
    state = stages.init_state()
    expected = 1.0
    for rnd, norms in enumerate([(0.5, 0.5, 3.0, 3.0), (0.1, 0.2, 0.3, 5.0), (9.0, 9.0, 9.0, 9.0)], start=1):
        unclipped = sum(n <= expected for n in norms) / 4
        updates = {c: {"w": torch.tensor([n])} for c, n in enumerate(norms)}
        mean, state, metrics = round_of(stages, updates, base, m=4, state=state, rnd=rnd)
        assert metrics["clip"] == pytest.approx(expected) and metrics["unclipped"] == pytest.approx(unclipped)
        expected = expected * math.exp(-0.2 * (unclipped - 0.5))
        assert state["clip"] == pytest.approx(expected, rel=1e-12)
    assert rule.sum_noise_multiplier(1.0) == pytest.approx((1 - 0.25) ** -0.5)  # z_Δ = (z^-2 - (2σ_b)^-2)^-1/2
    with pytest.raises(UserError, match="count's noise"):
        AdaptiveClip(0.5, 0.2, count_noise=0.4).sum_noise_multiplier(1.0)


def test_the_count_statistic_is_centred():
    rule = AdaptiveClip(0.5, 0.2, 1.0)
    stages = Stages(0, plan(clip_=1.0, adaptive=rule), None)
    base = {"w": torch.zeros(1)}
    payload = {"global": base, **stages.payload(stages.init_state())}
    inside = stages.client(1, 0, Upload({"w": torch.tensor([0.5])}, 3.0), base, payload, None)
    outside = stages.client(1, 1, Upload({"w": torch.tensor([2.0])}, 3.0), base, payload, None)
    assert inside.statistics[COUNT_KEY].item() == 0.5 and outside.statistics[COUNT_KEY].item() == -0.5
    assert inside.weight == outside.weight == 1.0  # uniform weights: the sum's sensitivity is C


# ----------------------------------------------------------------------------- the accountant

@pytest.mark.parametrize("rounds", [1, 30])
def test_fixed_size_epsilon_is_dp_accountings_sampled_without_replacement_at_half_the_noise(rounds):
    ours = Accounting("fixed", population=100, per_round=10).epsilon(1.2, rounds, 1e-2)
    acc = rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
    acc.compose(dpa.SampledWithoutReplacementDpEvent(100, 10, dpa.GaussianDpEvent(0.6)), rounds)
    assert ours == acc.get_epsilon(1e-2)


@pytest.mark.parametrize("kind, make", [("rdp", rdp.RdpAccountant), ("pld", pld.PLDAccountant)])
def test_poisson_epsilon_is_dp_accountings_poisson_sampled_gaussian(kind, make):
    ours = Accounting("poisson", population=1000, per_round=20, accountant=kind).epsilon(0.9, 50, 1e-3)
    acc = make(neighboring_relation=dpa.NeighboringRelation.ADD_OR_REMOVE_ONE)
    acc.compose(dpa.PoissonSampledDpEvent(0.02, dpa.GaussianDpEvent(0.9)), 50)
    assert ours == acc.get_epsilon(1e-3)


@pytest.mark.parametrize("sampling, kind", [("fixed", "rdp"), ("poisson", "rdp"), ("poisson", "pld")])
def test_the_running_epsilon_of_each_round_is_the_fresh_accountants(sampling, kind):
    a = Accounting(sampling, population=200, per_round=10, accountant=kind)
    z = 2.0 if kind == "pld" else 1.1  # (PLD's discretised support, and its time, shrink as z grows)
    running = RunningEpsilon(a, z, 1e-3)
    got = [running.after(r) for r in (1, 2, 5, 3)]  # 3 after 5: a resumed run's accountant starts again
    want = [a.epsilon(z, r, 1e-3) for r in (1, 2, 5, 3)]
    assert got == pytest.approx(want, rel=1e-9)
    assert running.after(0) == 0.0 and RunningEpsilon(a, 0.0, 1e-3).after(4) == math.inf


def test_local_dp_composes_every_round_at_sensitivity_two_c():
    ours = Accounting("fixed", 100, 10, local=True).epsilon(4.0, 20, 1e-5)
    acc = rdp.RdpAccountant()
    acc.compose(dpa.GaussianDpEvent(2.0), 20)
    assert ours == acc.get_epsilon(1e-5)


def test_target_epsilon_picks_the_noise_whose_epsilon_meets_it():
    a = Accounting("poisson", population=1000, per_round=10)
    z = a.noise_for(4.0, 100, 1e-3)
    assert a.epsilon(z, 100, 1e-3) <= 4.0 < a.epsilon(z * 0.98, 100, 1e-3)


def test_pld_is_refused_for_fixed_size_sampling():
    with pytest.raises(UserError, match="pld"):
        Accounting("fixed", 100, 10, accountant="pld").fresh()
