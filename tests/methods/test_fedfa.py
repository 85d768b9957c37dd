"""FedFA: its key equations against values worked out by hand (baselines spec 4)."""
import pytest
import torch

from raysim.core.aggregation import Mean
from raysim.config import ModelConfig
from raysim.methods.fedfa import FFALayer, FedFA
from raysim.models.blocks import block_ends
from raysim.models import build
from raysim import testing


def setup(name="small_cnn", n=3, size=16):
    return testing.setup(image_shape=(1, size, size), num_clients=n, model=ModelConfig(name=name, norm="bn"))


def _shared_variances(m):
    """The server's shared_var_mean for three clients' running means (0, 1), (2, 1), (4, 1) of one layer."""
    means = [torch.tensor([0.0, 1.0]), torch.tensor([2.0, 1.0]), torch.tensor([4.0, 1.0])]
    extras = {c: {"ffa": {"features.ffa_pool1": (means[c], torch.ones(2))}} for c in range(3)}
    glob = {"features.ffa_pool1.shared_var_mean": torch.zeros(2), "features.ffa_pool1.shared_var_std": torch.zeros(2)}
    return m.aggregate({"global": glob}, Mean(dict(glob), 3.0, [0, 1, 2], extras), 1)["global"][
        "features.ffa_pool1.shared_var_mean"]


def test_ffa_with_zero_noise_is_the_identity_and_the_shared_variance_scales_channels():
    layer = FFALayer(2)
    x = torch.randn(4, 2, 3, 3)
    mu, sigma = x.mean(dim=(2, 3)), (x.var(dim=(2, 3)) + 1e-6).sqrt()
    assert torch.allclose(layer.augment(x, mu, sigma, torch.zeros(2, 4, 2)), x, atol=1e-5)
    stat = torch.tensor([[0.0, 0.0], [2.0, 2.0]])  # batch variance 2 (+ eps) in both channels
    layer.shared_var_mean.copy_(torch.tensor([0.0, 1e6]))  # r ~ (0, 1): gamma = (0, 2): factors (1, 3)
    assert (layer.spread(stat, layer.shared_var_mean) ** 2).tolist() == pytest.approx([2.0, 6.0], rel=1e-4)
    layer.shared_var_mean.copy_(torch.tensor([0.3, 0.3]))  # equal: gamma = (1, 1): factor 2
    assert (layer.spread(stat, layer.shared_var_mean) ** 2).tolist() == pytest.approx([4.0, 4.0], rel=1e-4)
    layer.eval()
    assert layer(x) is x


def test_ffa_layers_follow_each_conv_block_and_the_server_shares_their_variance():
    assert block_ends(build("small_cnn", num_classes=3, in_channels=1, input_size=16).features) == ["pool1", "pool2"]
    assert block_ends(build("cnn6", num_classes=3, in_channels=1, input_size=16).features) == ["pool1", "pool2", "relu3"]
    assert len(block_ends(build("alexnet", num_classes=3, in_channels=3, input_size=64).features)) == 5  # FDSE A7.2
    model = FedFA(FedFA.Hparams(), setup()).build_model()
    assert [n for n, m in model.named_modules() if isinstance(m, FFALayer)] == ["features.ffa_pool1", "features.ffa_pool2"]
    assert model.features.ffa_pool1.running_mean.numel() == 16
    # three clients' running means of one 2-channel layer: per-channel variance vs the code's scalar
    means = [torch.tensor([0.0, 1.0]), torch.tensor([2.0, 1.0]), torch.tensor([4.0, 1.0])]
    extras = {c: {"ffa": {"features.ffa_pool1": (means[c], torch.ones(2))}} for c in range(3)}
    glob = {"features.ffa_pool1.shared_var_mean": torch.zeros(2), "features.ffa_pool1.shared_var_std": torch.zeros(2)}
    # var(0, 2, 4) = 4 and var(1, 1, 1) = 0 per channel; the code: var of all six (mean 1.5) = 9.5 / 5 = 1.9
    for mode, expected in (("per_channel", [4.0, 0.0]), ("scalar_code", [1.9, 1.9])):
        m = FedFA(FedFA.Hparams.from_dict({"shared_var": mode}), setup())
        out = m.aggregate({"global": glob}, Mean(dict(glob), 3.0, [0, 1, 2], extras), 1)["global"]
        assert out["features.ffa_pool1.shared_var_mean"].tolist() == pytest.approx(expected)


def test_fedfa_default_shared_variance_is_the_released_codes_scalar():
    """The default (the defaults rule): the released code's one scalar, 1.9, copied to both
    channels, not the paper's per-channel variance across clients (4, 0)."""
    assert FedFA.Hparams().shared_var == "scalar_code"
    assert _shared_variances(FedFA(FedFA.Hparams(), setup())).tolist() == pytest.approx([1.9, 1.9])


def test_fedfa_shared_variance_forms_differ_in_the_augmentation():
    """What a client does with the server's variance: per channel (4, 0): r = (4 / 5, ~1e-6), gamma ~ (2, 0),
    the batch variance scaled by (3, 1); the scalar form (1.9, 1.9): gamma = (1, 1), scaled by (2, 2)."""
    stat = torch.tensor([[0.0, 0.0], [2.0, 2.0]])  # batch variance 2 (+ eps) in both channels
    for mode, factors in (("per_channel", [3.0, 1.0]), ("scalar_code", [2.0, 2.0])):
        layer = FFALayer(2)
        layer.shared_var_mean.copy_(_shared_variances(FedFA(FedFA.Hparams.from_dict({"shared_var": mode}), setup())))
        spread2 = layer.spread(stat, layer.shared_var_mean) ** 2
        assert (spread2 / 2.0).tolist() == pytest.approx(factors, rel=1e-4), mode
