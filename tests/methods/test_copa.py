"""COPA: its key equations against values worked out by hand on tiny tensors, and its client and
server steps on a tiny model (baselines spec 5.5)."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dg_client_harness import context, setup
from raysim.core.aggregation import Mean
from raysim.methods.copa import COPA, IBN, copa_loss, ensemble_log_probs, make_ibn
from raysim.models import build


pytestmark = pytest.mark.usefixtures("one_thread")


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
