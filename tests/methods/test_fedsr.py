"""FedSR: its key equations against values worked out by hand on tiny tensors, and its client step on
a tiny model (baselines spec 5.1)."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dg_client_harness import context, global_rng, one_batch_context, same_rng, setup
from raysim.core.errors import UserError
from raysim.methods.fedsr import REFERENCE, FedSR, cmi_term, l2r_term, mc_log_predict
from raysim.testing import fixed_batches


pytestmark = pytest.mark.usefixtures("one_thread")


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
