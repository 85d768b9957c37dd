"""FedSR, FedDG-GA, COPA and FedADG: each key equation against values worked out by hand on
tiny tensors, and each client step / server step on a tiny model (baselines spec 5.1, 5.2, 5.5, 5.6)."""
import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from raysim.aggregation import AllUploads, KeepAll, Mean
from raysim.config import ModelConfig, TrainConfig
from raysim.contract import ClientContext, Setup, Upload
from raysim.errors import UserError
from raysim.methods.copa import COPA, IBN, copa_loss, ensemble_log_probs, make_ibn
from raysim.methods.fedadg import (DISC, FedADG, discriminator_loss, feature_loss, generator_loss,
                                   soft_labels)
from raysim.methods.feddg_ga import FedDGGA, adjust_weights, step_size
from raysim.methods.fedsr import REFERENCE, FedSR, cmi_term, l2r_term, mc_log_predict
from raysim.models import build


pytestmark = pytest.mark.usefixtures("one_thread")


def setup(n=3, rounds=10):
    return Setup(num_classes=3, image_shape=(1, 8, 8), num_clients=n, client_domains=("a",) * n,
                 model=ModelConfig(name="small_cnn", norm="bn"), train=TrainConfig(), rounds=rounds, seed=0)


class Split:
    def __init__(self, n=8, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.x, self.y = torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 3, (n,), generator=g)

    def batches(self, batch_size, generator, device, drop_last=False):
        order = torch.randperm(len(self.y), generator=generator)
        for i in range(0, len(order), batch_size):
            yield self.x[order[i:i + batch_size]], self.y[order[i:i + batch_size]]

    def eval_batches(self, batch_size, device):
        for i in range(0, len(self.y), batch_size):
            yield self.x[i:i + batch_size], self.y[i:i + batch_size]


class Data:
    def __init__(self, n=8, seed=0):
        self.train, self.val = Split(n, seed), Split(6, seed + 100)
        self.num_train = n

    def batches(self, batch_size, generator, device, drop_last=False):
        return self.train.batches(batch_size, generator, device, drop_last)


def context(model, payload, state, cid=0, rnd=1, lr=0.1, epochs=1):
    return ClientContext(client_id=cid, domain="a", round=rnd, model=model, payload=payload, state=state,
                         data=Data(seed=cid), train=TrainConfig(epochs=epochs, batch_size=4, lr=lr),
                         lr=lr, generator=torch.Generator().manual_seed(7), device=torch.device("cpu"))


def global_rng():
    return torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()


def same_rng(a, b):
    return torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]


def init_weights(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.1 * torch.randn(p.shape, generator=g))


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


def test_feddg_ga_step_size_decays_linearly_over_n():
    assert step_size(0.2, 1, 10, 3) == pytest.approx(0.2 / 3)
    assert step_size(0.2, 6, 10, 4) == pytest.approx((0.2 - 5 * 0.02) / 4)  # 0.025
    assert step_size(0.2, 10, 10, 2) == pytest.approx(0.02 / 2)


def test_feddg_ga_server_aggregates_with_the_adjusted_weights_not_n_k():
    """theta_k = (0, 3, 6) with n_k = (1, 1, 10). Round 1 (no gaps): a = 1/3 each, theta = 3.
    Round 2 with accuracy gaps (-0.1, -0.2, 0) and d_1 = 0.2 / 3: a = (1/3, 4/11, 10/33),
    theta = 3 * 4/11 + 6 * 10/33 = 96/33."""
    m = FedDGGA(FedDGGA.hparams_from({"metric": "acc"}), setup(3, rounds=10))
    assert isinstance(m.aggregator, KeepAll)
    state = {"global": {"w": torch.zeros(1)}, "weights": {}}
    ups = {k: Upload({"w": torch.tensor([3.0 * k])}, weight=w) for k, w in enumerate((1.0, 1.0, 10.0))}
    state = m.aggregate(state, AllUploads(ups), 1)
    assert float(state["global"]["w"]) == pytest.approx(3.0)
    gaps = (-0.1, -0.2, 0.0)
    ups = {k: Upload({"w": torch.tensor([3.0 * k])}, weight=1.0, extras={"gap": g}) for k, g in enumerate(gaps)}
    state = m.aggregate(state, AllUploads(ups), 2)
    assert float(state["global"]["w"]) == pytest.approx(96 / 33, rel=1e-6)
    assert m.server_metrics(state)["weight_1"] == pytest.approx(4 / 11)


def test_feddg_ga_client_uploads_the_gap_of_the_received_model():
    m = FedDGGA(FedDGGA.hparams_from({"metric": "acc"}), setup())
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
    acc0 = float((Data(seed=0).val.y == 0).float().mean())
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
    assert soft_labels(torch.tensor([1]), 3).tolist() == [pytest.approx([0.15, 0.7, 0.15])]


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
    assert {"d_loss", "g_loss", "best_val_acc"} <= set(up.metrics)


def state_weight(m):
    return m.build_model().state_dict()["disc.net.0.weight"]


def test_fedadg_uploads_the_best_validation_epoch(monkeypatch):
    """Two adversarial epochs scored (0.9, 0.5) on the validation split: the upload is the first
    epoch's F, C and G (replayed by a one-epoch run with upload: last and the same generator);
    scored (0.5, 0.9): the second's, which is the last."""
    import raysim.methods.fedadg as fedadg
    hp = {"ce_epochs": 0, "rp_size": 8}
    m_best = FedADG(FedADG.Hparams.from_dict(hp), setup())
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
