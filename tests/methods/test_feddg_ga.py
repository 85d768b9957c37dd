"""FedDG-GA: its key equations against values worked out by hand, and its client and server steps on
a tiny model (baselines spec 5.2)."""
import pytest
import torch

from dg_client_harness import context, setup
from raysim.core.aggregation import AllUploads, KeepAll
from raysim.core.contract import Upload
from raysim.methods.feddg_ga import FedDGGA, adjust_weights, step_size
from raysim.models import build
from raysim.testing import random_client_data


pytestmark = pytest.mark.usefixtures("one_thread")


def test_feddg_ga_weight_update_spec_example():
    a = {0: 1 / 3, 1: 1 / 3, 2: 1 / 3}
    new = adjust_weights(a, {0: -0.1, 1: -0.2, 2: 0.0}, 0.2 / 3, "acc")
    assert [new[k] for k in range(3)] == pytest.approx([1 / 3, 4 / 11, 10 / 33], abs=1e-9)  # 0.3333, 0.3636, 0.3030


def test_feddg_ga_loss_sign_clipping_centring_and_zero_gaps():
    a = {0: 1 / 3, 1: 1 / 3, 2: 1 / 3}
    # loss gaps (0.2, -0.1, 0), step 0.1: G^ = (1, -0.5, 0), a + (0.1, -0.05, 0) = (13/30, 8.5/30, 10/30), / 1.05
    new = adjust_weights(a, {0: 0.2, 1: -0.1, 2: 0.0}, 0.1, "loss")
    assert [new[k] for k in range(3)] == pytest.approx([13 / 31.5, 8.5 / 31.5, 10 / 31.5])
    # clip: (0.05, 0.95) + 0.2 * (-1, +1) (accuracy gaps (0.1, -0.1)) = (-0.15, 1.15) -> (0, 1)
    new = adjust_weights({0: 0.05, 1: 0.95}, {0: 0.1, 1: -0.1}, 0.2, "acc")
    assert new == pytest.approx({0: 0.0, 1: 1.0})
    # centred gaps (0.1, 0.2, 0.3) -> (-0.1, 0, 0.1) -> G^ = (-1, 0, 1); accuracy: a + 0.1 * (1, 0, -1)
    new = adjust_weights(a, {0: 0.1, 1: 0.2, 2: 0.3}, 0.1, "acc", centre=True)
    assert [new[k] for k in range(3)] == pytest.approx([1 / 3 + 0.1, 1 / 3, 1 / 3 - 0.1])
    assert adjust_weights(a, {0: 0.0, 1: 0.0}, 0.1) == a and adjust_weights(a, {}, 0.1) == a
    # a client without a gap keeps its a_k before the renormalisation: (1/3 + 0.1, 1/3, 1/3) / (1 + 0.1)
    new = adjust_weights(a, {0: -0.5}, 0.1, "acc")
    assert new[0] == pytest.approx((1 / 3 + 0.1) / 1.1) and new[2] == pytest.approx((1 / 3) / 1.1)


def test_feddg_ga_step_size_follows_the_official_round_index():
    """The official loop counts rounds i from 0 and, after round i, steps by (d - (i - 1) d / R) / 3;
    the gaps measured on theta^r (r = i + 1) step by (d - (r - 2) d / R) / N. d = 0.2, R = 15, N = 4
    (digits5 LODO): 0.05 - (r - 2) / 300, from 0.0533 at r = 1 to 0.01 at r = 14 (the gaps on
    theta^15 would serve a 16th round)."""
    assert step_size(0.2, 1, 15, 4) == pytest.approx((0.2 + 0.2 / 15) / 4)  # 0.05333: (1 + 1/R) d at first
    assert step_size(0.2, 2, 15, 4) == pytest.approx(0.05)
    assert step_size(0.2, 3, 15, 4) == pytest.approx((0.2 - 0.2 / 15) / 4)  # 0.04667
    assert step_size(0.2, 14, 15, 4) == pytest.approx(0.01)
    assert [round(step_size(0.2, r, 15, 4), 6) for r in range(1, 15)] == pytest.approx(
        [round(0.05 - (r - 2) / 300, 6) for r in range(1, 15)])
    assert step_size(0.2, 1, 10, 3) == pytest.approx(0.22 / 3)  # the code's 1/3 for N = 3


def test_feddg_ga_server_aggregates_with_the_adjusted_weights_not_n_k():
    """theta_k = (0, 3, 6) with n_k = (1, 1, 10). Round 1 (no gaps): a = 1/3 each, theta = 3.
    Round 2 with accuracy gaps (-0.1, -0.2, 0), measured on theta^1: d_1 = (0.2 + 0.2/10) / 3 = 0.22/3,
    G^ = (-0.5, -1, 0), a = (1/3 + 0.11/3, 1/3 + 0.22/3, 1/3) / 1.11 = (1/3, 122/333, 100/333),
    theta = 3 * 122/333 + 6 * 100/333 = 966/333."""
    m = FedDGGA(FedDGGA.hparams_from({"metric": "acc"}), setup(3, rounds=10))
    assert isinstance(m.aggregator, KeepAll)
    state = {"global": {"w": torch.zeros(1)}, "weights": {}}
    ups = {k: Upload({"w": torch.tensor([3.0 * k])}, weight=w) for k, w in enumerate((1.0, 1.0, 10.0))}
    state = m.aggregate(state, AllUploads(ups), 1)
    assert float(state["global"]["w"]) == pytest.approx(3.0)
    gaps = (-0.1, -0.2, 0.0)
    ups = {k: Upload({"w": torch.tensor([3.0 * k])}, weight=1.0, extras={"gap": g}) for k, g in enumerate(gaps)}
    state = m.aggregate(state, AllUploads(ups), 2)
    assert float(state["global"]["w"]) == pytest.approx(966 / 333, rel=1e-6)
    assert m.server_metrics(state)["weight_1"] == pytest.approx(122 / 333)


def test_feddg_ga_default_is_the_codes_accuracy_gap_and_favours_the_client_that_lost_accuracy():
    """The released code's default (--fair acc). N = 2, R = 10, theta_k = (0, 1); accuracy gaps
    (-0.2, +0.2): client 0 lost accuracy to the average, so it gains weight. Round 2 (gaps on
    theta^1): d = (0.2 + 0.02) / 2 = 0.11, a = (0.61, 0.39), theta = 0.39; round 3 (theta^2):
    d = 0.2 / 2 = 0.1, a = (0.71, 0.29), theta = 0.29. (A loss gap of the same sign would move the
    weights the other way: theta = 0.61.)"""
    assert FedDGGA.Hparams().metric == "acc"
    m = FedDGGA(FedDGGA.Hparams(), setup(2, rounds=10))
    state = {"global": {"w": torch.zeros(1)}, "weights": {}}
    ups = {k: Upload({"w": torch.tensor([float(k)])}, weight=1.0) for k in range(2)}
    state = m.aggregate(state, AllUploads(ups), 1)
    assert float(state["global"]["w"]) == pytest.approx(0.5)
    for rnd, a0 in ((2, 0.61), (3, 0.71)):
        ups = {k: Upload({"w": torch.tensor([float(k)])}, weight=1.0, extras={"gap": g})
               for k, g in enumerate((-0.2, 0.2))}
        state = m.aggregate(state, AllUploads(ups), rnd)
        assert m.server_metrics(state) == pytest.approx({"weight_0": a0, "weight_1": 1 - a0})
        assert float(state["global"]["w"]) == pytest.approx(1 - a0)


def test_feddg_ga_client_uploads_the_gap_of_the_received_model():
    m = FedDGGA(FedDGGA.Hparams(), setup())  # the default: the accuracy gap
    model = build("small_cnn", num_classes=3, in_channels=1, input_size=8, norm="bn")
    payload = m.broadcast(m.init_server(model), 1)
    ctx = context(model, payload, m.init_client_state(0, model), rnd=1)
    up = m.local_update(ctx)
    assert up.extras == {} and ctx.state["round"] == 1 and 0 <= ctx.state["before"] <= 1
    before = ctx.state["before"]
    # round 2 receives some theta^1: gap = its validation accuracy - the client's own model's
    theta1 = {k: v.clone() for k, v in up.tensors.items()}
    theta1["head.bias"] = torch.tensor([10.0, 0.0, 0.0])  # theta^1 predicts class 0 everywhere
    model.load_state_dict(theta1)
    acc0 = float((random_client_data(seed=0, num_val=6).val.labels == 0).mean())
    up2 = m.local_update(context(model, {"global": theta1}, ctx.state, rnd=2))
    assert up2.extras["gap"] == pytest.approx(acc0 - before)
    # a client that skipped round 2 measures no gap in round 3 (theta^2 does not hold its model)
    up3 = m.local_update(context(model, {"global": theta1}, {"before": 0.5, "round": 1}, rnd=3))
    assert "gap" not in up3.extras
