"""Zoo models against the papers' tables: parameter counts, input sizes, the features/head split."""
import pytest
import torch
from torch import nn

from raysim.core.errors import UserError
from raysim.models import available, build, count_flops, count_params, is_norm, options

# name -> (paper count, where it comes from). "[computed]" counts come from the spec's
# arithmetic on the paper's layer table, not from a number printed in the paper.
EXACT_PARAMS = {
    "cnn6": (14_214_090, "FedWon Table 5 [computed]: 14,213,578 + 512 BN affine"),
    "alexnet": (57_047_114, "FedWon Table 6 [computed]: 57,044,810 + 2,304 BN affine"),
    "alexnet_fdse": (12_974_154, "FDSE Table A5; Table 4 prints 1.30e7"),
    "resnet10": (4_903_242, "DapperFL Table 5: #Para = (1-rho) x 4.90M"),
    "resnet18": (11_173_962, "DapperFL Table 6: #Para = (1-rho) x 11.17M"),
    "resnet18_tv": (11_181_642, "torchvision resnet18 (11,689,512) with a 10-class fc"),
    "resnet50_tv": (23_528_522, "torchvision resnet50 (25,557,032) with a 10-class fc"),
    "densenet121_tv": (6_964_106, "torchvision densenet121 (7,978,856) with a 10-class head"),
    "mnist_cnn": (3_274_634, "CSAC spec [rec] widths (paper gives none)"),
    "small_cnn": (145_930, "raysim's own cross-device CNN at 3x32x32"),
    "mlp": (159_010, "784 x 200 + 200 + 200 x 10 + 10 [computed]"),
}

PAPER_INPUT = {
    "cnn6": (3, 28, 28), "alexnet": (3, 256, 256), "alexnet_fdse": (3, 256, 256),
    "resnet10": (3, 32, 32), "resnet18": (3, 32, 32), "resnet18_tv": (3, 224, 224),
    "resnet50_tv": (3, 224, 224), "densenet121_tv": (3, 224, 224), "mnist_cnn": (1, 28, 28),
    "small_cnn": (3, 32, 32), "mlp": (1, 28, 28),
}


@pytest.fixture(scope="module")
def zoo():
    torch.manual_seed(0)
    return {name: build(name) for name in available()}


def test_registry_lists_every_model():
    assert set(available()) == set(EXACT_PARAMS)


@pytest.mark.parametrize("name", sorted(EXACT_PARAMS))
def test_param_count_matches_paper(zoo, name):
    model = zoo[name]
    expected, source = EXACT_PARAMS[name]
    n = count_params(model)
    print(f"{name}: {n:,} params (paper {expected:,}: {source})")
    assert n == expected


def test_fedwon_counts_without_norm(zoo):
    # FedWon spec section 4: the networks "without norms" (norm slots empty), + BN affine.
    for name, bare, bn in (("cnn6", 14_213_578, 512), ("alexnet", 57_044_810, 2_304)):
        norm_params = sum(count_params(m) for m in zoo[name].modules() if is_norm(m))
        assert (count_params(zoo[name]) - norm_params, norm_params) == (bare, bn)


def test_fdse_table4_alexnet_size():
    """FDSE Table 4: 1.30e7 parameters and 49.52 MB of communication for FedAvg/FedBN-AlexNet.

    The count does not depend on the input size (adaptive pooling); the 49.52 (MiB of the
    fp32 state_dict with BN buffers) singles out 10 classes (Office-Caltech10, DomainNet):
    PACS's 7 classes give 49.51.
    """
    for classes, mib in ((10, 49.52), (7, 49.51)):
        model = build("alexnet_fdse", num_classes=classes, input_size=224)
        assert round(count_params(model) / 1e7, 2) == 1.30
        state = model.state_dict()
        floats = sum(v.numel() for v in state.values() if v.is_floating_point())
        print(f"alexnet_fdse C={classes}: {count_params(model):,} params, state {floats * 4 / 2**20:.3f} MiB")
        assert round(floats * 4 / 2 ** 20, 2) == mib


@pytest.mark.parametrize("name", sorted(PAPER_INPUT))
def test_forward_at_paper_input(zoo, name):
    model = zoo[name].eval()
    assert model.input_shape == PAPER_INPUT[name]
    x = torch.randn(2, *PAPER_INPUT[name])
    captured = []
    handle = model.head.register_forward_hook(lambda m, inp, out: captured.append(inp[0]))
    with torch.no_grad():
        out = model(x)  # one pass at 224/256 px is the expensive part: capture z from it
    handle.remove()
    assert isinstance(model.head, nn.Linear)
    assert out.shape == (2, 10)
    norm_keys = {f"{n}.{k}" for n, m in model.named_modules() if is_norm(m) for k in m.state_dict()}
    assert {k for k in model.state_dict() if "bn" in k} == norm_keys
    z = captured[0]
    assert z.shape == (2, model.feature_dim)
    if name not in ("alexnet", "alexnet_fdse", "resnet18_tv", "resnet50_tv", "densenet121_tv"):
        with torch.no_grad():
            torch.testing.assert_close(model.features(x), z)
    torch.testing.assert_close(model.head(z), out)
    if not name.endswith("_tv"):  # a second 224-px pass is not worth its time here
        print(f"{name}: {count_flops(model):,} MACs at {model.input_shape}")


@pytest.mark.parametrize("name,size,flat", [("cnn6", 28, 6272), ("cnn6", 32, 8192),
                                             ("small_cnn", 28, 1568), ("mnist_cnn", 28, 3136)])
def test_digit_cnns_are_input_size_aware(name, size, flat):
    model = build(name, input_size=size, in_channels=3).eval()
    assert model.features.fc1.in_features == flat
    assert model(torch.randn(2, 3, size, size)).shape == (2, 10)


def test_mlp_is_logistic_regression_without_hidden_units():
    lr = build("mlp", in_channels=3, input_size=28, hidden=0)
    assert count_params(lr) == 3 * 28 * 28 * 10 + 10 and lr.feature_dim == 3 * 28 * 28
    assert isinstance(build("mlp", norm="bn").features.bn1, nn.BatchNorm1d)
    with pytest.raises(UserError, match="hidden"):
        build("mlp", hidden=-1)


def test_cifar_resnet_runs_at_28():
    # DapperFL trains at 32 px but measured ResNet-18's FLOPs at 28 px.
    model = build("resnet10", input_size=28).eval()
    with torch.no_grad():
        assert model(torch.randn(2, 3, 28, 28)).shape == (2, 10)


def test_feature_dims(zoo):
    dims = {"cnn6": 512, "alexnet": 4096, "alexnet_fdse": 1024, "resnet10": 512, "resnet18": 512,
            "resnet18_tv": 512, "resnet50_tv": 2048, "densenet121_tv": 1024, "mnist_cnn": 1024,
            "small_cnn": 64, "mlp": 200}
    assert {name: model.feature_dim for name, model in zoo.items()} == dims


def test_published_defaults():
    # Left unset, in_channels/input_size/norm are the paper's: CSAC's MNIST CNN has no norm.
    assert options("mnist_cnn")["norm"] == "none" and options("mnist_cnn")["in_channels"] == 1
    assert build("mnist_cnn", norm=None).input_shape == (1, 28, 28)
    assert isinstance(build("mnist_cnn", norm="bn").features.bn1, nn.BatchNorm2d)


def test_num_classes_and_channels():
    model = build("resnet18_tv", num_classes=7, in_channels=1, input_size=32).eval()
    with torch.no_grad():
        assert model(torch.randn(2, 1, 32, 32)).shape == (2, 7)
    assert model.num_classes == 7


def test_fedbn_original_fc_norm_variant():
    # FedBN's DigitModel: BN1d after fc1/fc2 instead of Dropout (named bn4, bn5 as in FedBN).
    model = build("cnn6", fc_norm=True)
    assert isinstance(model.features.bn4, nn.BatchNorm1d) and isinstance(model.features.bn5, nn.BatchNorm1d)
    assert not any(isinstance(m, nn.Dropout) for m in model.modules())
    assert count_params(model) == 14_213_578 + 512 + 2 * (2048 + 512)
    assert any(isinstance(m, nn.Dropout) for m in build("cnn6").modules())


def test_csac_bottleneck():
    model = build("resnet18_tv", num_classes=5, input_size=64, bottleneck=256).eval()
    assert model.feature_dim == 256
    assert isinstance(model.features.fc.bn, nn.BatchNorm1d)
    assert model(torch.randn(2, 3, 64, 64)).shape == (2, 5)


def test_unknown_model_and_option():
    with pytest.raises(UserError, match="valid models: .*cnn6"):
        build("lenet")
    with pytest.raises(UserError, match="does not accept option"):
        build("cnn6", depth=3)
    with pytest.raises(UserError, match="too small"):
        build("alexnet", input_size=32)
