"""Ditto: its key equations against values worked out by hand on scalars or tiny tensors (baselines
spec 3.1)."""
import pytest
import torch
import torch.nn.functional as F

from small_cnn_harness import Scalar, context, setup, small
from raysim.core.contract import sgd_step
from raysim.methods.ditto import Ditto, personal_objective
from raysim.testing import random_client_data


def test_ditto_personal_solver_converges_geometrically_to_its_fixed_point():
    """L(v) = (v - 3)^2 / 2, w = 1, lambda = 1: v* = (3 + 1) / 2 = 2, and gradient steps of 0.1
    from v = 0 give |v_t - 2| = 2 * 0.8^t exactly (spec 3.1)."""
    v = Scalar(0.0)
    opt = torch.optim.SGD(v.parameters(), lr=0.1)
    anchor = {"theta": torch.tensor([1.0])}
    for t in range(1, 6):
        loss = personal_objective(0.5 * ((v.theta - 3) ** 2).sum(), dict(v.named_parameters()), anchor, 1.0)
        sgd_step(loss, opt)
        assert abs(float(v.theta.detach()) - 2) == pytest.approx(2 * 0.8 ** t, rel=1e-5)


def test_ditto_anchors_the_personal_model_to_the_received_global_model():
    m = Ditto(Ditto.Hparams.from_dict({"lam": 0.5}), setup(2))
    model = small()
    received = {k: v.clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(5)
    v0 = {k: v + 0.05 * torch.randn(v.shape, generator=gen) if v.is_floating_point() else v.clone()
          for k, v in received.items()}
    ctx = context(m, model, {"global": received}, {"v": {k: t.clone() for k, t in v0.items()}})
    up = m.local_update(ctx)
    # by hand: the personal solver alone, anchored at w^t = received, on the same batches
    ref = small()
    ref.load_state_dict(v0)
    ref.train()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    anchor = {k: received[k] for k, _ in ref.named_parameters()}
    for xb, yb in random_client_data(seed=0).batches(4, torch.Generator().manual_seed(7), "cpu"):
        sgd_step(personal_objective(F.cross_entropy(ref(xb), yb), dict(ref.named_parameters()), anchor, 0.5), opt)
    for k, t in ref.state_dict().items():
        assert torch.allclose(ctx.state["v"][k].float(), t.float(), atol=1e-6), k
    assert not torch.equal(up.tensors["head.weight"], received["head.weight"])  # the global copy trained too
    # scored with the personal model
    probe = small(9)
    m.eval_model(probe, {"global": received}, ctx.state)
    assert torch.equal(probe.state_dict()["head.weight"], ctx.state["v"]["head.weight"])


def test_ditto_post_train_state_is_the_personal_model():
    """eval.point post_train scores v_k (FLGo, FDSE), not the global copy the client trained."""
    m = Ditto(Ditto.Hparams.from_dict({"lam": 0.5}), setup(2))
    model = small()
    received = {k: v.clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(6)
    v0 = {k: v + 0.05 * torch.randn(v.shape, generator=gen) if v.is_floating_point() else v.clone()
          for k, v in received.items()}
    ctx = context(m, model, {"global": received}, {"v": v0}, data=random_client_data(num_train=4))
    m.local_update(ctx)
    post = m.post_train_state(ctx)
    assert set(post) == set(ctx.state["v"]) and all(torch.equal(post[k], ctx.state["v"][k]) for k in post)
    assert not torch.equal(post["head.weight"], model.state_dict()["head.weight"])
