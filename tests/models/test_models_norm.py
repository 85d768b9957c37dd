"""The norm and conv factories reach every layer, and "bn" names norm layers only."""
import pytest
import torch
from torch import nn

from raysim.core.errors import UserError
from raysim.models import available, build, gn_groups, is_norm, make_norm
from raysim.models.dropout import dropout_generator

# Small inputs (and narrow AlexNet FC layers) keep the sweep fast; the paper sizes and widths
# are covered in test_models_zoo.
SMALL = {"alexnet": dict(input_size=96, hidden=128), "alexnet_fdse": dict(input_size=96, hidden=128),
         "resnet10": dict(input_size=16), "resnet18": dict(input_size=16),
         "resnet18_tv": dict(input_size=64), "resnet50_tv": dict(input_size=64),
         "densenet121_tv": dict(input_size=64)}  # "in" needs > 1x1 at the last norm
FC_NORM_MODELS = {"alexnet_fdse", "mlp"}  # BN1d between FC layers: instance norm is undefined there


@pytest.fixture(autouse=True)
def client_step_dropout():
    """Train-mode passes here stand in for a client step: dropout draws from a keyed generator."""
    with dropout_generator(torch.Generator().manual_seed(0)):
        yield


def small(name, **kw):
    return build(name, **{**SMALL.get(name, {}), **kw})


def norm_keys(model):
    keys = set()
    for mod_name, mod in model.named_modules():
        if is_norm(mod):
            keys |= {f"{mod_name}.{k}" for k in mod.state_dict()}
    return keys


# resnet50_tv shares resnet18_tv's code path; one norm covers its Bottleneck downsample naming
# (its BN build is checked in test_models_zoo).
CASES = [(n, norm) for n in sorted(available()) for norm in ("bn", "gn", "ln", "in", "none")
         if not (norm == "in" and n in FC_NORM_MODELS) and not (n == "resnet50_tv" and norm != "gn")]
ALL_BUT_R50 = [n for n in sorted(available()) if n != "resnet50_tv"]


@pytest.mark.parametrize("name,norm", CASES)
def test_norm_option_builds_runs_and_names(name, norm):
    model = small(name, norm=norm)
    model.train()
    x = torch.randn(2, *model.input_shape)
    assert model(x).shape == (2, 10)
    norms = [m for m in model.modules() if is_norm(m)]
    if norm == "none":
        assert norms == []
    else:
        expected = {"bn": nn.modules.batchnorm._BatchNorm, "gn": nn.GroupNorm, "in": nn.InstanceNorm2d,
                    "ln": (nn.GroupNorm, nn.LayerNorm)}[norm]
        assert norms and all(isinstance(m, expected) for m in norms)
        if norm == "ln":
            assert all(m.num_groups == 1 for m in norms if isinstance(m, nn.GroupNorm))
    # FedBN keeps the keys containing "bn" local: those must be exactly the norm layers' keys.
    assert {k for k in model.state_dict() if "bn" in k} == norm_keys(model)


def test_instance_norm_refused_after_linear():
    with pytest.raises(UserError, match="undefined after a linear layer"):
        small("alexnet_fdse", norm="in")


@pytest.mark.parametrize("name", ALL_BUT_R50)
def test_custom_norm_callable_used_everywhere(name):
    calls = []

    class Marked(nn.Module):
        def __init__(self, c, dim):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(c))
            self.dim = dim

        def forward(self, x):
            return x * (self.scale.view(1, -1, 1, 1) if self.dim == 2 else self.scale)

    def factory(c, dim):
        calls.append((c, dim))
        return Marked(c, dim)

    model = small(name, norm=factory)
    assert not any(is_norm(m) for m in model.modules())  # no built-in norm slipped through
    marked = [n for n, m in model.named_modules() if isinstance(m, Marked)]
    assert len(marked) == len(calls) > 0
    assert all("bn" in n.split(".")[-1] for n in marked)
    assert model(torch.randn(2, *model.input_shape)).shape == (2, 10)


def test_norm_none_removes_norm_and_keeps_the_rest():
    model = small("resnet18", norm="none")
    assert not any(is_norm(m) for m in model.modules())
    assert isinstance(model.features.layer1[0].bn1, nn.Identity)
    assert not any("bn" in k for k in model.state_dict())


def test_gn_groups_rule_and_tables():
    # FedWon App. A.2: 32 by default, 8 below 32 channels, 24 for 144.
    assert [gn_groups(c) for c in (16, 24, 32, 64, 144, 512)] == [8, 8, 32, 32, 24, 32]
    cnn = build("cnn6", norm="gn")  # Table 5
    assert [getattr(cnn.features, f"bn{i}").num_groups for i in (1, 2, 3)] == [32, 32, 64]
    alex = small("alexnet", norm="gn")  # Table 6
    assert [getattr(alex.features, f"bn{i}").num_groups for i in range(1, 6)] == [32, 32, 64, 64, 64]
    res = build("resnet18_tv", norm="gn", input_size=64)  # rule
    assert res.features.bn1.num_groups == 32


def test_make_norm_dims():
    assert isinstance(make_norm("bn", 8, 1), nn.BatchNorm1d)
    assert isinstance(make_norm("ln", 8, 1), nn.LayerNorm)
    assert isinstance(make_norm("none", 8, 2), nn.Identity)
    assert make_norm("gn", 64, 2, groups=4).num_groups == 4


def test_unknown_norm_lists_valid_names():
    with pytest.raises(UserError, match="valid norms: bn, gn, ln, in, none"):
        build("cnn6", norm="batchnorm")


class Marker(nn.Conv2d):
    pass


@pytest.mark.parametrize("name", [n for n in ALL_BUT_R50 if n != "mlp"])  # the MLP has no conv
def test_conv_factory_replaces_every_conv(name):
    seen = []

    def factory(in_ch, out_ch, k, stride, padding, bias):
        seen.append((in_ch, out_ch, k, stride, padding, bias))
        return Marker(in_ch, out_ch, k, stride=stride, padding=padding, bias=bias)

    model = small(name, conv=factory)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert convs and all(type(m) is Marker for m in convs)
    assert len(seen) == len(convs)
    assert model(torch.randn(2, *model.input_shape)).shape == (2, 10)


def test_conv_class_accepted():
    # A conv subclass itself is accepted too (FedWon can pass its WSConv class).
    for name in ("cnn6", "resnet18_tv"):
        model = small(name, conv=Marker)
        assert all(type(m) is Marker for m in model.modules() if isinstance(m, nn.Conv2d))


def test_conv_factory_gets_the_table_hyperparameters():
    seen = []

    def factory(*args):
        seen.append(args)
        return nn.Conv2d(*args[:3], stride=args[3], padding=args[4], bias=args[5])

    small("alexnet", conv=factory)
    assert seen == [(3, 64, 11, 4, 2, True), (64, 192, 5, 1, 2, True), (192, 384, 3, 1, 1, True),
                    (384, 256, 3, 1, 1, True), (256, 256, 3, 1, 1, True)]
