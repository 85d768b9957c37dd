"""MOON: its key equations against values worked out by hand on tiny tensors (baselines spec 2.3)."""
import math

import pytest
import torch

from small_cnn_harness import context, setup, small
from raysim.methods.moon import MOON, model_contrastive_loss
from raysim.testing import random_client_data


def test_moon_contrastive_loss_by_hand():
    z = torch.tensor([[1.0, 0.0]])
    # z = z_glob, z orthogonal to z_prev: -log(e^2 / (e^2 + e^0)) = log(1 + e^-2)
    assert float(model_contrastive_loss(z, z.clone(), torch.tensor([[0.0, 3.0]]), 0.5)) == pytest.approx(
        math.log(1 + math.exp(-2)), abs=1e-5)
    assert float(model_contrastive_loss(z, z * 2, z * 5, 0.5)) == pytest.approx(math.log(2), abs=1e-6)
    # a batch is averaged: the second sample has z = -z_glob, z = z_prev: log(1 + e^{(1 - (-1)) / 0.5})
    zb = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    zg, zp = torch.tensor([[1.0, 0.0], [0.0, -1.0]]), torch.tensor([[0.0, 1.0], [0.0, 1.0]])
    expected = (math.log(1 + math.exp(-2)) + math.log(1 + math.exp(4))) / 2
    assert float(model_contrastive_loss(zb, zg, zp, 0.5)) == pytest.approx(expected, abs=1e-5)


def test_moon_keeps_its_previous_model_and_contrasts_from_its_second_round():
    m = MOON(MOON.Hparams.from_dict({"mu": 1.0}), setup(2))
    model = small()
    glob = {k: v.clone() for k, v in model.state_dict().items()}
    state = m.init_client_state(0, model)
    first = m.local_update(context(m, model, {"global": glob}, state, rnd=1))
    assert "con_loss" not in first.metrics  # no previous model: l_con = 0 (FLGo)
    prev = state["previous"]
    assert all(torch.equal(prev[k], first.tensors[k]) for k in prev)
    model.load_state_dict(glob)
    second = m.local_update(context(m, model, {"global": glob}, state, rnd=2))
    assert second.metrics["con_loss"] > 0
    # MOON with mu = 0 is FedAvg's step
    plain = MOON(MOON.Hparams.from_dict({"mu": 0.0}), setup(2))
    model.load_state_dict(glob)
    a = plain.local_update(context(plain, model, {"global": glob}, {"previous": prev}))
    from raysim.methods.fedavg import FedAvg
    model.load_state_dict(glob)
    b = FedAvg(FedAvg.Hparams(), setup(2)).local_update(context(plain, model, {"global": glob}, {}))
    assert all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)
    head = MOON(MOON.Hparams.from_dict({"head": "mlp", "proj_dim": 16}), setup(2)).build_model()
    assert head.head.in_features == 16 and head.feature_dim == 16


def test_moon_previous_model_is_its_own_last_local_model_every_round():
    """Spec 2.3: z_prev comes from the client's model at the end of its last participation, never
    the received global model, in every round (the contrastive ones included)."""
    m = MOON(MOON.Hparams.from_dict({"mu": 1.0}), setup(2))
    model = small()
    glob = {k: v.clone() for k, v in model.state_dict().items()}
    state = m.init_client_state(0, model)
    for rnd in (1, 2):
        model.load_state_dict(glob)
        up = m.local_update(context(m, model, {"global": glob}, state, rnd=rnd, data=random_client_data(num_train=4)))
        assert ("con_loss" in up.metrics) == (rnd > 1)
        assert all(torch.equal(state["previous"][k], up.tensors[k]) for k in up.tensors), rnd
        assert not torch.equal(state["previous"]["head.weight"], glob["head.weight"])
