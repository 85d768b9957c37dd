"""FedSR, FedDG-GA, COPA and FedADG: each key equation against values worked out by hand on
tiny tensors, and each client step / server step on a tiny model (baselines spec 5.1, 5.2, 5.5, 5.6)."""
import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from raysim.core.aggregation import AllUploads, KeepAll, Mean
from raysim.config import TrainConfig
from raysim.core.contract import Upload
from raysim.core.errors import UserError
from raysim.methods.copa import COPA, IBN, copa_loss, ensemble_log_probs, make_ibn
from raysim.methods.fedadg import (DISC, FedADG, FedADGNet, discriminator_loss, feature_loss, generator_loss,
                                   smoothed_ce, soft_labels)
from raysim.methods.feddg_ga import FedDGGA, adjust_weights, step_size
from raysim.methods.fedsr import REFERENCE, FedSR, cmi_term, l2r_term, mc_log_predict
from raysim.models import build
from raysim.models.base import Net
from raysim import testing
from raysim.testing import client_context, fixed_batches, random_client_data


pytestmark = pytest.mark.usefixtures("one_thread")


def setup(n=3, rounds=10):
    return testing.setup(num_clients=n, rounds=rounds)  # 3 classes of 1 x 8 x 8 images, small_cnn with BN


def context(model, payload, state, cid=0, rnd=1, lr=0.1, epochs=1):
    """8 training and 6 validation images of client ``cid`` (seeded with it)."""
    return client_context(None, model, random_client_data(seed=cid, num_val=6), client_id=cid, round=rnd,
                          payload=payload, state=state, train=TrainConfig(epochs=epochs, batch_size=4, lr=lr), seed=7)


def global_rng():
    return torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()


def same_rng(a, b):
    return torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]


def init_weights(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.1 * torch.randn(p.shape, generator=g))


def one_batch_context(model, data, state=None, epochs=1, lr=0.1):
    """``data``: one fixed batch per epoch (no shuffling), the data of the hand-computed client steps."""
    return client_context(None, model, data, state=state or {},
                          train=TrainConfig(epochs=epochs, batch_size=data.num_train, lr=lr), seed=7)


# ----------------------------------------------------------------------------- FedSR (5.1)

def test_fedsr_cmi_kl_by_hand():
    one, zero = torch.ones(1, 2), torch.zeros(1, 2)
    c1 = torch.tensor(1.0)
    assert float(cmi_term(zero, one, zero, one, c1)) == pytest.approx(0.0)  # the same Gaussian
    assert float(cmi_term(zero, one, one, one, c1)) == pytest.approx(2 * 0.5)  # r_mu = 1: 1/2 per dimension
    # C = 2: log 1 - log 2 + (4 + 0) / 2 - 1/2 = 1.5 - ln 2 per dimension
    assert float(cmi_term(zero, one, zero, one, torch.tensor(2.0))) == pytest.approx(2 * (1.5 - math.log(2)))
    # C = 2, mu = 1, r_mu = 1: (C mu - r_mu)^2 = 1: log 1 - log 2 + (4 + 1) / 2 - 1/2 = 2 - ln 2
    assert float(cmi_term(one, one, one, one, torch.tensor(2.0))) == pytest.approx(2 * (2 - math.log(2)))
    # r_sigma = 2: log 2 - log 1 + 1 / 8 - 1/2
    assert float(cmi_term(zero, one, zero, 2 * one, c1)) == pytest.approx(2 * (math.log(2) + 0.125 - 0.5))
    # a batch of two: the mean over the batch of the per-sample sums (0 and 1)
    assert float(cmi_term(torch.zeros(2, 2), torch.ones(2, 2), torch.tensor([[0.0, 0.0], [1.0, 1.0]]),
                          torch.ones(2, 2), c1)) == pytest.approx(0.5)


def test_fedsr_l2r_by_hand():
    z = torch.tensor([[3.0, 4.0]])
    assert float(l2r_term(z)) == pytest.approx(5.0) and float(l2r_term(z, squared=True)) == pytest.approx(25.0)
    assert float(l2r_term(torch.tensor([[3.0, 4.0], [0.0, 0.0]]))) == pytest.approx(2.5)  # batch mean


def fedsr_fixed_encoder(hp: dict, mu, sigma_raw):
    """A FedSR client whose encoder outputs mu and raw sigma whatever the image (its last Linear's
    weight 0, its bias (mu, raw sigma)) and whose classifier starts at 0."""
    m = FedSR(FedSR.Hparams.from_dict({"z_dim": 2, **hp}), setup())
    model = m.build_model()
    with torch.no_grad():
        model.features[-1].weight.zero_()
        model.features[-1].bias.copy_(torch.tensor([*mu, sigma_raw, sigma_raw]))
        model.head.weight.zero_(), model.head.bias.zero_()
    return m, model


def test_fedsr_default_l2r_is_the_codes_unsquared_norm():
    """alpha_L2R = 0.01 was tuned on the official code's E||z||_2 (spec 5.1 pitfall 1). mu = (3, 4)
    and no noise: z = (3, 4), L2R = 5; with alpha_CMI = 0 and a zero classifier (no CE gradient
    reaches z) one step moves mu's bias by -lr alpha z / ||z|| = -0.001 (0.6, 0.8); the paper's
    squared form would report 25 and move it by -lr alpha 2 z = -0.002 (3, 4)."""
    assert FedSR.Hparams().l2r == "norm"
    y = torch.tensor([0, 0, 1, 2])
    for form, l2r, moved in ((None, 5.0, [2.9994, 3.9992]), ("squared", 25.0, [2.994, 3.992])):
        m, model = fedsr_fixed_encoder({"alpha_cmi": 0.0, **({"l2r": form} if form else {})}, (3.0, 4.0), 0.0)
        model.noise = lambda shape, like, generator: torch.zeros(shape)
        up = m.local_update(one_batch_context(model, fixed_batches((torch.zeros(4, 1, 8, 8), y))))
        assert up.metrics["l2r"] == pytest.approx(l2r)
        assert model.features[-1].bias[:2].tolist() == pytest.approx(moved, abs=1e-6)


def test_fedsr_trains_the_classifier_on_a_sampled_z():
    """z = mu + sigma e, not mu. mu = 0, sigma = softplus(raw) = s, e = 1: z = (s, s) for every
    image; a zero classifier predicts 1/3 each, so one step gives W[c] = -lr s (1/3 - the share of
    class c in the batch) on both coordinates: labels (0, 0, 1, 2) -> lr s (1/6, -1/12, -1/12).
    Trained on z = mu = 0, W would not move."""
    m, model = fedsr_fixed_encoder({"alpha_l2r": 0.0, "alpha_cmi": 0.0}, (0.0, 0.0), 0.5)
    s = float(F.softplus(torch.tensor(0.5)))
    model.noise = lambda shape, like, generator: torch.ones(shape)
    m.local_update(one_batch_context(model, fixed_batches((torch.zeros(4, 1, 8, 8), torch.tensor([0, 0, 1, 2])))))
    expected = [[0.1 * s / 6] * 2, [-0.1 * s / 12] * 2, [-0.1 * s / 12] * 2]
    assert model.head.weight.tolist() == [pytest.approx(row, abs=1e-7) for row in expected]


def test_fedsr_prediction_is_the_log_of_the_mean_softmax():
    """h(z) = (z, -z), mu = 0, sigma = 1, noise (a, 0) with a = ln(3) / 2: p_0 = 1 / (1 + e^{-2z}) =
    3/4 and 1/2, mean 5/8 (the softmax of the mean logit would give 1 / (1 + 3^{-1/2}) = 0.634)."""
    head = nn.Linear(1, 2, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[1.0], [-1.0]]))
    a = math.log(3) / 2
    out = mc_log_predict(head, torch.zeros(1, 1), torch.ones(1, 1), torch.tensor([[[a]], [[0.0]]]))
    assert out.exp()[0].tolist() == pytest.approx([5 / 8, 3 / 8])


def test_fedsr_model_client_step_and_reference_kept_local():
    m = FedSR(FedSR.Hparams.from_dict({"z_dim": 4}), setup())
    model = m.build_model()
    assert m.personal_keys(model) == set(REFERENCE) and model.ref_mu.shape == (3, 4)
    assert model.features[-1].out_features == 8 and model.head.in_features == 4
    model.eval()
    x = torch.randn(5, 1, 8, 8)
    first, again = model(x), model(x)
    assert torch.equal(first, again) and torch.allclose(first.exp().sum(1), torch.ones(5))  # reproducible log-probs
    state = m.init_client_state(0, model)
    payload = m.broadcast(m.init_server(model), 1)
    assert not set(REFERENCE) & set(payload["global"])
    rng = global_rng()
    ctx = context(model, payload, state)
    up = m.local_update(ctx)
    assert same_rng(rng, global_rng())
    assert not set(REFERENCE) & set(up.tensors) and set(ctx.state["personal"]) == set(REFERENCE)
    assert up.metrics["l2r"] > 0 and up.metrics["cmi"] > 0
    assert not torch.equal(ctx.state["personal"]["ref_mu"], torch.zeros(3, 4))  # r(z|y) is trained
    glob = FedSR(FedSR.Hparams.from_dict({"z_dim": 4, "reference": "global"}), setup())
    assert glob.personal_keys(model) == set()
    with pytest.raises(UserError):
        FedSR.Hparams.from_dict({"l2r": "cubed"})
    assert FedSR.Hparams.search_space()["alpha_cmi"].choices == (0.0005, 0.001, 0.3)


# ----------------------------------------------------------------------------- FedDG-GA (5.2)

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
    acc0 = float((random_client_data(seed=0, num_val=6).val.y == 0).float().mean())
    up2 = m.local_update(context(model, {"global": theta1}, ctx.state, rnd=2))
    assert up2.extras["gap"] == pytest.approx(acc0 - before)
    # a client that skipped round 2 measures no gap in round 3 (theta^2 does not hold its model)
    up3 = m.local_update(context(model, {"global": theta1}, {"before": 0.5, "round": 1}, rnd=3))
    assert "gap" not in up3.extras


# ----------------------------------------------------------------------------- COPA (5.5)

def test_copa_ensemble_and_loss_by_hand():
    heads = [torch.log(torch.tensor([[0.9, 0.1]])), torch.log(torch.tensor([[0.3, 0.7]]))]
    assert ensemble_log_probs(heads).exp()[0].tolist() == pytest.approx([0.6, 0.4])
    y = torch.tensor([0])
    own = torch.log(torch.tensor([[0.5, 0.5]]))
    # CE(own) = ln 2; frozen CEs -ln 0.9 and -ln 0.3, their mean (0.10536 + 1.20397) / 2
    frozen_mean = (-math.log(0.9) - math.log(0.3)) / 2
    assert float(copa_loss(own, heads, y)) == pytest.approx(math.log(2) + frozen_mean)
    assert float(copa_loss(own, heads, y, frozen_weight=2.0)) == pytest.approx(math.log(2) + 2 * frozen_mean)
    assert float(copa_loss(own, [], y)) == pytest.approx(math.log(2))


def test_ibn_splits_channels_and_inherits_the_bn():
    bn = nn.BatchNorm2d(4)
    with torch.no_grad():
        bn.weight.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0])), bn.running_mean.copy_(torch.tensor([0.0, 0.0, 5.0, 6.0]))
    ibn = IBN.replacing(bn)
    assert ibn.IN.weight.tolist() == [1.0, 2.0] and ibn.BN.weight.tolist() == [3.0, 4.0]
    assert ibn.BN.running_mean.tolist() == [5.0, 6.0]
    x = torch.randn(3, 4, 5, 5)
    ibn.eval()
    out = ibn(x)
    assert torch.allclose(out[:, :2], ibn.IN(x[:, :2]), atol=1e-6)
    assert torch.allclose(out[:, 2:], ibn.BN(x[:, 2:]), atol=1e-6)
    model = build("small_cnn", num_classes=3, in_channels=1, input_size=8, norm="bn")
    assert make_ibn(model.features, 0.5) == ["bn1"] and isinstance(model.features.bn1, IBN)


def test_copa_client_trains_its_head_against_frozen_foreign_heads_and_the_server_banks_heads():
    m = COPA(COPA.Hparams(), setup(3))
    model = m.build_model()
    assert len(model.heads) == 3 and isinstance(model.features.bn1, IBN)
    state = m.init_server(model)
    state["global"]["trained"] = torch.tensor([1.0, 1.0, 0.0])  # heads 0 and 1 trained, head 2 not yet
    payload = m.broadcast(state, 2)
    init = {k: v.clone() for k, v in payload["global"].items()}

    def run(glob, cid=1):
        m.load_client_model(model, {"global": glob}, {})
        up = m.local_update(context(model, {"global": glob}, {}, cid=cid, rnd=2))
        up.tensors = {k: v.clone() for k, v in up.tensors.items()}  # (they share the model's storage)
        return up
    up = run(init)
    after = model.state_dict()
    assert torch.equal(after["heads.0.weight"], init["heads.0.weight"])  # frozen
    assert not torch.equal(after["heads.1.weight"], init["heads.1.weight"])  # its own, though trained before
    assert torch.equal(up.extras["head_tensors"]["weight"], after["heads.1.weight"])
    assert all(p.requires_grad for p in model.parameters())
    assert all(k.startswith("features.") for k in up.tensors) and up.extras["head"] == 1
    # an untrained head takes no part: F is the same whatever head 2 holds
    other = {**init, "heads.2.weight": init["heads.2.weight"] + 1.0}
    assert all(torch.equal(v, run(other).tensors[k]) for k, v in up.tensors.items())
    # the frozen head's CE reaches F: F differs from one trained with its own CE alone
    up2 = run({**init, "trained": torch.tensor([0.0, 1.0, 0.0])})
    assert not torch.equal(up.tensors["features.fc1.weight"], up2.tensors["features.fc1.weight"])
    # server: F the weighted mean, head k = client k's own, the bank marks it trained
    glob = {"features.w": torch.zeros(1), "heads.0.weight": torch.zeros(1), "heads.1.weight": torch.zeros(1),
            "trained": torch.zeros(2)}
    extras = {0: {"head": 0, "head_tensors": {"weight": torch.tensor([5.0])}},
              1: {"head": 1, "head_tensors": {"weight": torch.tensor([7.0])}}}
    new = m.aggregate({"global": glob}, Mean({"features.w": torch.tensor([2.0])}, 2.0, [0, 1], extras), 1)["global"]
    assert new["heads.0.weight"].tolist() == [5.0] and new["heads.1.weight"].tolist() == [7.0]
    assert new["features.w"].tolist() == [2.0] and new["trained"].tolist() == [1.0, 1.0]


def test_copa_predicts_with_the_ensemble_of_trained_heads():
    m = COPA(COPA.Hparams.from_dict({"ibn_fraction": 0.0}), setup(3))
    model = m.build_model().eval()
    x = torch.randn(2, 1, 8, 8)
    z = model.features(x)
    model.trained.copy_(torch.tensor([1.0, 0.0, 1.0]))
    expected = (F.softmax(model.heads[0](z), 1) + F.softmax(model.heads[2](z), 1)) / 2
    assert torch.allclose(model(x).exp(), expected, atol=1e-6)
    model.trained.zero_()  # none trained yet: every head
    expected = sum(F.softmax(h(z), 1) for h in model.heads) / 3
    assert torch.allclose(model(x).exp(), expected, atol=1e-6)


# ----------------------------------------------------------------------------- FedADG (5.6)

def test_fedadg_losses_by_hand():
    half = torch.full((4,), 0.5)
    assert float(discriminator_loss(half, half)) == pytest.approx(0.5)
    assert float(generator_loss(half)) == pytest.approx(0.25)
    assert float(feature_loss(torch.tensor(2.0), half, 0.85)) == pytest.approx(0.85 * 2 + 0.0375)
    # D(G) = 0.8, D(F) = 0.3: L_D = 0.2^2 + 0.3^2 = 0.13, L_G = 0.64, L_F = 0.85 + 0.15 * 0.7^2
    ref, feat = torch.tensor([0.8]), torch.tensor([0.3])
    assert float(discriminator_loss(ref, feat)) == pytest.approx(0.13)
    assert float(generator_loss(ref)) == pytest.approx(0.64)
    assert float(feature_loss(torch.tensor(1.0), feat, 0.85)) == pytest.approx(0.85 + 0.15 * 0.49)
    # y_s: 0.7 on the true class and 0 elsewhere (the code's), or the rest spread over the others
    assert soft_labels(torch.tensor([1]), 3).tolist() == [pytest.approx([0.0, 0.7, 0.0])]
    assert soft_labels(torch.tensor([1]), 3, 0.7, "spread").tolist() == [pytest.approx([0.15, 0.7, 0.15])]


def test_fedadg_smoothed_ce_by_hand():
    """p = (1/2, 1/4, 1/4), y = 0, eps = 0.2. The code's target (0.8, 0.1, 0.1): 0.8 ln 2 + 0.2 * 2 ln 2
    = 1.2 ln 2; PyTorch's (0.8 + 0.2/3, 0.2/3, 0.2/3): (0.8 + 0.2/3) ln 2 + (0.4/3) 2 ln 2 = 17/15 ln 2."""
    logits, y = torch.tensor([[math.log(2), 0.0, 0.0]]), torch.tensor([0])
    assert float(smoothed_ce(logits, y, 0.2)) == pytest.approx(1.2 * math.log(2))
    assert float(smoothed_ce(logits, y, 0.2, "uniform")) == pytest.approx(17 / 15 * math.log(2))
    assert float(smoothed_ce(logits, y, 0.0)) == pytest.approx(math.log(2))  # eps 0: the plain CE


def tiny_fedadg(hp: dict):
    """F = BatchNorm1d(2) on 2 numbers, C = Linear(2, 3) with weight 0 and bias (ln 2, 0, 0)
    (p = (1/2, 1/4, 1/4) for every image, and no CE gradient reaches F); one batch x = ((1, 3), (3, 5)),
    y = (0, 1): train-mode BN gives F(x) = (-1, -1), (1, 1) (times 1 / sqrt(1 + 1e-5)), eval mode
    with the initial running statistics F(x) = x / sqrt(1 + 1e-5)."""
    m = FedADG(FedADG.Hparams.from_dict({"rp_size": 4, "ce_epochs": 0, "label_smoothing": 0.2, **hp}), setup())
    head = nn.Linear(2, 3)
    with torch.no_grad():
        head.weight.zero_(), head.bias.copy_(torch.tensor([math.log(2), 0.0, 0.0]))
    model = FedADGNet(Net(nn.Sequential(nn.Flatten(), nn.BatchNorm1d(2)), head, (1, 1, 2)), 4, seed=0)
    data = fixed_batches((torch.tensor([[1.0, 3.0], [3.0, 5.0]]).view(2, 1, 1, 2), torch.tensor([0, 1])))
    return m, model, data


def test_fedadg_warm_up_and_feature_step_smooth_over_the_other_classes():
    """The CE on the tiny batch: (1.2 ln 2 + 1.9 ln 2) / 2 = 1.55 ln 2 with the code's eps / (C - 1)
    (y = 1: 0.8 * 2 ln 2 + 0.1 ln 2 + 0.1 * 2 ln 2 = 1.9 ln 2); PyTorch's eps / C gives
    (17/15 + 29/15) / 2 ln 2 = 23/15 ln 2. The warm-up's first loss is that CE; without a warm-up,
    step (b)'s loss is 0.85 CE + 0.15 mean[(1 - D(F))^2]."""
    assert FedADG.Hparams().smoothing == "others"
    for hp, ce in (({}, 1.55 * math.log(2)), ({"smoothing": "uniform"}, 23 / 15 * math.log(2))):
        for warm_up in (1, 0):
            m, model, data = tiny_fedadg({"ce_epochs": warm_up, **hp})
            ctx = one_batch_context(model, data)
            losses, step, d_out = [], ctx.step, []
            ctx.step = lambda loss, *opts, **kw: (losses.append(float(loss.detach())), step(loss, *opts, **kw))
            model.disc.register_forward_hook(lambda mod, args, out: d_out.append(out.detach().clone()))
            m.local_update(ctx)
            adversarial = 0.15 * float(((1 - d_out[2]) ** 2).mean())  # D's calls: (a) D(G), D(F); (b) D(F)
            assert losses[0] == pytest.approx(ce if warm_up else 0.85 * ce + adversarial, rel=1e-6)


def test_fedadg_discriminator_sees_eval_mode_features_and_the_codes_soft_labels():
    """Step (a) scores F(x) with F in eval mode (the code), step (b) the train-mode F(x); y_s is 0.7
    on the true class and 0 elsewhere. The eval pass leaves BN's running statistics alone: after
    the one train-mode pass running_mean = 0.1 * (2, 4)."""
    defaults = FedADG.Hparams()
    assert (defaults.disc_features, defaults.soft_label_rest) == ("eval", "zero")
    x = torch.tensor([[1.0, 3.0], [3.0, 5.0]])
    train_f = torch.tensor([[-1.0, -1.0], [1.0, 1.0]])
    for hp, step_a, ys in (({}, x, [[0.7, 0, 0], [0, 0.7, 0]]),
                           ({"disc_features": "train", "soft_label_rest": "spread"}, train_f,
                            [[0.7, 0.15, 0.15], [0.15, 0.7, 0.15]])):
        m, model, data = tiny_fedadg(hp)
        calls = []
        model.disc.register_forward_hook(lambda mod, args, out: calls.append([a.detach().clone() for a in args]))
        m.local_update(one_batch_context(model, data))
        # D's calls: (a) D(G), D(F); (b) D(F); (c) D(G)
        scale = 1 / math.sqrt(1 + 1e-5)
        assert torch.allclose(calls[1][1], step_a * scale, atol=1e-5)
        assert torch.allclose(calls[2][1], train_f * scale, atol=1e-5)
        assert calls[1][0].tolist() == [pytest.approx(row) for row in ys]
        assert model.features[1].running_mean.tolist() == pytest.approx([0.2, 0.4])


def test_fedadg_client_keeps_d_uploads_f_c_g_and_draws_only_from_its_generator():
    m = FedADG(FedADG.Hparams.from_dict({"ce_epochs": 1, "rp_size": 8}), setup())
    model = m.build_model()
    keys = set(model.state_dict())
    assert m.personal_keys(model) == {k for k in keys if k.startswith(DISC)} and m.personal_keys(model)
    assert not any("projection" in k for k in keys)  # the fixed projection is neither stored nor sent
    assert model.disc.projection.norm(dim=1).tolist() == pytest.approx([1.0] * 8)
    assert torch.equal(m.build_model().disc.projection, model.disc.projection)  # the same on every host
    state = m.init_client_state(0, model)
    payload = m.broadcast(m.init_server(model), 1)
    m.load_client_model(model, payload, state)
    rng = global_rng()
    ctx = context(model, payload, state, epochs=2)
    up = m.local_update(ctx)
    assert same_rng(rng, global_rng())
    assert not any(k.startswith(DISC) for k in up.tensors) and any(k.startswith("gen.") for k in up.tensors)
    assert set(ctx.state["personal"]) == m.personal_keys(model)
    assert not torch.equal(ctx.state["personal"]["disc.net.0.weight"], state_weight(m))
    assert ctx.steps == 3 * 2  # 1 CE epoch + 2 adversarial epochs of 2 batches
    assert {"d_loss", "g_loss"} <= set(up.metrics) and "best_val_acc" not in up.metrics  # upload: last


def state_weight(m):
    return m.build_model().state_dict()["disc.net.0.weight"]


def test_fedadg_uploads_the_last_epoch_by_default_and_the_best_validation_epoch_on_request(monkeypatch):
    """The default is the code's effective upload, the last epoch. Two adversarial epochs scored (0.9, 0.5) on the validation split: the upload is the first
    epoch's F, C and G (replayed by a one-epoch run with upload: last and the same generator);
    scored (0.5, 0.9): the second's, which is the last."""
    import raysim.methods.fedadg as fedadg
    hp = {"ce_epochs": 0, "rp_size": 8}
    m_best = FedADG(FedADG.Hparams.from_dict({**hp, "upload": "best_val"}), setup())
    m_last = FedADG(FedADG.Hparams.from_dict({**hp, "upload": "last"}), setup())
    model = m_best.build_model()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    snapshots = []
    for epochs in (1, 2):  # the same generator: epoch 1 of the 2-epoch run is the 1-epoch run
        model.load_state_dict(init)
        ctx = context(model, {"global": init}, {"personal": {}}, epochs=epochs)
        up = m_last.local_update(ctx)
        snapshots.append({k: v.clone() for k, v in up.tensors.items()})
        disc_last = ctx.state["personal"]["disc.net.0.weight"].clone()
    assert not torch.equal(snapshots[0]["head.weight"], snapshots[1]["head.weight"])
    for scores, best in (((0.9, 0.5), 0), ((0.5, 0.9), 1)):
        calls = iter(scores)
        monkeypatch.setattr(fedadg, "evaluate", lambda *a, **k: {"correct": next(calls) * 10, "n": 10, "loss_sum": 0.0})
        model.load_state_dict(init)
        ctx = context(model, {"global": init}, {"personal": {}}, epochs=2)
        up = m_best.local_update(ctx)
        assert up.metrics["best_val_acc"] == pytest.approx(scores[best])
        assert all(torch.equal(up.tensors[k], snapshots[best][k]) for k in up.tensors)
        # D is not rolled back: it stays as the last epoch left it
        assert torch.equal(ctx.state["personal"]["disc.net.0.weight"], disc_last)
    # the default uploads the last epoch whatever the validation scores (no evaluation at all)
    assert FedADG.Hparams().upload == "last"
    m_default = FedADG(FedADG.Hparams.from_dict(hp), setup())
    monkeypatch.setattr(fedadg, "evaluate", lambda *a, **k: pytest.fail("the default upload scores no epoch"))
    model.load_state_dict(init)
    up = m_default.local_update(context(model, {"global": init}, {"personal": {}}, epochs=2))
    assert all(torch.equal(up.tensors[k], snapshots[1][k]) for k in up.tensors)
