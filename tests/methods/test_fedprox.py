"""FedProx's proximal term on tiny tensors, computed by hand."""
import math

import pytest
import torch

from raysim.methods.fedprox import proximal_term
from tiny_models import Logits


def test_fedprox_proximal_term_by_hand():
    w = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([[3.0]])}
    anchor = {"a": torch.tensor([0.0, 0.0]), "b": torch.tensor([[1.0]])}
    # (mu/2) * (1 + 4 + 4) = 0.05 * 9 = 0.45 with mu = 0.1
    assert abs(proximal_term(w, anchor, 0.1).item() - 0.45) < 1e-7


def test_fedprox_gradient_pulls_toward_anchor():
    p = torch.tensor([2.0], requires_grad=True)
    proximal_term({"p": p}, {"p": torch.tensor([0.5])}, 0.2).backward()
    assert torch.allclose(p.grad, torch.tensor([0.2 * 1.5]))


def test_fedprox_solo_step_adds_mu_times_the_move_from_the_anchor():
    """Two plain SGD steps (lr 1) of ``local_update`` on one example of class 0, mu = 0.5:
    step 1 from b0 = (0, 0) (w = w^t, no pull): gradient softmax - onehot = (-1/2, 1/2), b1 = (1/2, -1/2);
    step 2: cross-entropy gradient (-s, s) with s = 1 / (1 + e), plus mu (b1 - b0) = (1/4, -1/4):
    b2 = (1/4 + s, -1/4 - s). The loss it reports is the mean of ln 2 and ln(1 + 1/e) + (mu/2)|b1|^2."""
    from raysim import testing
    from raysim.methods.fedprox import FedProx

    method = FedProx(FedProx.Hparams(mu=0.5), testing.setup())
    model = Logits()
    one = (torch.zeros(1, 1), torch.tensor([0]))
    ctx = testing.client_context(method, model, testing.fixed_batches(one, one),
                                 train={"epochs": 1, "batch_size": 1, "lr": 1.0})
    upload = method.local_update(ctx)
    s = 1 / (1 + math.e)
    assert torch.allclose(model.b.detach(), torch.tensor([0.25 + s, -0.25 - s]), rtol=0, atol=1e-6)
    assert upload.metrics["steps"] == 2
    assert upload.metrics["loss"] == pytest.approx((math.log(2) + math.log(1 + 1 / math.e) + 0.125) / 2, rel=1e-6)
