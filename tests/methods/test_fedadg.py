"""FedADG: its key equations against values worked out by hand on tiny tensors, and its client step
on a tiny model (baselines spec 5.6)."""
import math

import pytest
import torch
from torch import nn

from dg_client_harness import context, global_rng, one_batch_context, same_rng, setup
from raysim.methods.fedadg import (DISC, FedADG, FedADGNet, discriminator_loss, feature_loss, generator_loss,
                                   smoothed_ce, soft_labels)
from raysim.models.base import Net
from raysim.testing import fixed_batches


pytestmark = pytest.mark.usefixtures("one_thread")


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


def state_weight(m):
    return m.build_model().state_dict()["disc.net.0.weight"]


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
            def recorded(loss, *opts, **kw):  # the steps of F and C (D's and G's are not recorded)
                if kw.get("record", True):
                    losses.append(float(loss.detach()))
                step(loss, *opts, **kw)
            ctx.step = recorded
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
