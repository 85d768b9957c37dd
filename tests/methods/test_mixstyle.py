"""FedAvg+MixStyle: its key equations against values worked out by hand on tiny tensors (baselines
spec 7)."""
import pytest
import torch

from raysim.config import ModelConfig
from raysim.methods.mixstyle import FedAvgMixStyle, MixStyle, mix_styles
from raysim import testing


def setup(name="small_cnn", channels=1, size=16, n=3):
    return testing.setup(image_shape=(channels, size, size), num_clients=n, model=ModelConfig(name=name, norm="bn"))


def test_mixstyle_mix_by_hand():
    """Instance 0 = [0, 2] (mu 1, sigma 1), instance 1 = [10, 14] (mu 12, sigma 2); perm swaps them.
    lambda_0 = 1/4: mu_mix = 1/4 + 3/4 * 12 = 9.25, sigma_mix = 1/4 + 3/4 * 2 = 1.75:
    out_0 = 1.75 * [-1, 1] + 9.25 = [7.5, 11]; lambda_1 = 1: instance 1 unchanged."""
    x = torch.tensor([[[[0.0, 2.0]]], [[[10.0, 14.0]]]])
    out = mix_styles(x, torch.tensor([0.25, 1.0]), torch.tensor([1, 0]), eps=1e-6)
    assert out.flatten().tolist() == pytest.approx([7.5, 11.0, 10.0, 14.0], abs=1e-4)


def test_mixstyle_layer_placement_and_when_it_is_the_identity():
    names = lambda model: [n for n, mod in model.named_modules() if isinstance(mod, MixStyle)]  # noqa: E731
    assert names(FedAvgMixStyle(FedAvgMixStyle.Hparams(), setup()).build_model()) == ["features.mixstyle_pool1"]
    assert names(FedAvgMixStyle(FedAvgMixStyle.Hparams(), setup("cnn6")).build_model()) == \
        ["features.mixstyle_pool1", "features.mixstyle_pool2"]
    resnet = FedAvgMixStyle(FedAvgMixStyle.Hparams(), setup("resnet18", 3, 32)).build_model()
    assert names(resnet) == ["features.mixstyle_layer1", "features.mixstyle_layer2", "features.mixstyle_layer3"]
    layer, x = MixStyle(p=1.0), torch.randn(4, 2, 3, 3)
    assert layer(x) is x  # no generator: never the global RNG
    layer.generator = torch.Generator().manual_seed(0)
    assert not torch.equal(layer(x), x)
    layer.eval()
    assert layer(x) is x
    assert (FedAvgMixStyle.Hparams().p, FedAvgMixStyle.Hparams().alpha) == (0.5, 0.1)


def test_mixstyle_statistics_carry_no_gradient():
    """mu and sigma detached (the authors' release): d out / d x = sigma_mix / sigma elementwise. The
    example above, loss = sum(w * out) with w = (1, 3) on each instance's two pixels: instance 0 gets
    1.75 / 1 * w, instance 1 (lambda 1) 1 * w."""
    x = torch.tensor([[[[0.0, 2.0]]], [[[10.0, 14.0]]]], requires_grad=True)
    w = torch.tensor([1.0, 3.0]).view(1, 1, 1, 2)
    (w * mix_styles(x, torch.tensor([0.25, 1.0]), torch.tensor([1, 0]), eps=1e-6)).sum().backward()
    assert x.grad.flatten().tolist() == pytest.approx([1.75, 5.25, 1.0, 3.0], abs=1e-4)
