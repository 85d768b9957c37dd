"""FedAvg+RSC: its key equations against values worked out by hand on tiny tensors (baselines spec 7)."""
import pytest
import torch
from torch import nn

from raysim.config import ModelConfig
from raysim.methods.rsc import FedAvgRSC, batch_select, challenge_mask, conv_split, rsc_mask
from raysim import testing


def setup(name="small_cnn", channels=1, size=16, n=3):
    return testing.setup(image_shape=(channels, size, size), num_clients=n, model=ModelConfig(name=name, norm="bn"))


def test_rsc_masks_by_hand():
    """grad channel 0 = [3, 0, 6], channel 1 = [1, 2, 0] (one row of three locations).
    Spatial: channel means [2, 1, 3]; the 2/3 quantile of [1, 2, 3] is 2 + 1/3 = 2.33: location 2 muted.
    Channel: location means [3, 1]; the 2/3 quantile of [1, 3] is 1 + 2/3 * 2 = 2.33: channel 0 muted."""
    g = torch.tensor([[[[3.0, 0.0, 6.0]], [[1.0, 2.0, 0.0]]]])
    assert rsc_mask(g, 1 / 3, spatial=True).flatten().tolist() == [1.0, 1.0, 0.0]
    assert rsc_mask(g, 1 / 3, spatial=False).flatten().tolist() == [0.0, 1.0]
    # confidence drops 0.4, 0.7, 0.1: with b = 1/3 only sample 1 is challenged
    assert batch_select(torch.tensor([0.9, 0.8, 0.7]), torch.tensor([0.5, 0.1, 0.6]), 1 / 3).tolist() == \
        [False, True, False]


def test_rsc_mutes_the_feature_with_the_largest_true_class_gradient():
    """z = [1, 1, 1] (1 channel, 3 locations), logits = W z with W = [[5, -1, 2], [-3, 4, 0]], y = 0:
    d logit_0 / dz = [5, -1, 2]; the 2/3 quantile of [-1, 2, 5] is 2 + 1/3 * 3 = 3: location 0 muted
    (the sum of both logits, [2, 3, 2], would mute location 1)."""
    head = nn.Linear(3, 2, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[5.0, -1.0, 2.0], [-3.0, 4.0, 0.0]]))
    mask = challenge_mask(torch.ones(1, 1, 1, 3), torch.tensor([0]), lambda z: head(z.flatten(1)), 1 / 3, 1.0, True)
    assert mask.flatten().tolist() == [0.0, 1.0, 1.0]


def test_rsc_challenges_the_last_conv_map():
    model = FedAvgRSC(FedAvgRSC.Hparams(), setup()).build_model()
    cut = conv_split(model.features)
    assert list(dict(model.features.named_children()))[cut] == "flatten"
    assert FedAvgRSC.Hparams().drop_f == pytest.approx(1 / 3)
