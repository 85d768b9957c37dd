"""densenet121_tv: torchvision's DenseNet-121 rebuilt with the zoo's norm/conv factories.

Checked against torchvision's own densenet121 (built locally, random init, nothing downloaded):
parameter count, key layout (a torchvision state_dict loads and gives the same logits), the
norm swaps, and gPerXAN's Camelyon17 XAN placement (denseblock1 + transition1).
"""
import re

import pytest
import torch
import torchvision
from torch import nn

from raysim.models import from_setup
from raysim.config import ModelConfig, TrainConfig
from raysim.core.errors import UserError
from raysim.core.contract import Setup
from raysim.methods.fedbn import FedBN
from raysim.methods.fedwon import FedWon, WSConv2d
from raysim.methods.gperxan import GPerXAN
from raysim.methods.gperxan_layers import XAN, place, select, stage_of
from raysim.models import build, count_params, is_norm

TORCHVISION_PARAMS = 7_978_856  # torchvision.models.densenet121(weights=None), 1000 classes


def norm_keys(model):
    return {f"{n}.{k}" for n, m in model.named_modules() if is_norm(m) for k in m.state_dict()}


@pytest.fixture(scope="module")
def tv_file(tmp_path_factory):
    """A torchvision densenet121 state_dict with non-trivial BN statistics and affines."""
    torch.manual_seed(0)
    tv = torchvision.models.densenet121(weights=None)
    with torch.no_grad():
        for m in tv.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 1.5)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.1, 0.1)
    path = tmp_path_factory.mktemp("weights") / "densenet121_imagenet.pth"
    torch.save(tv.state_dict(), path)
    return tv.eval(), str(path)


def setup_for(size=32, pretrained=None, norm="bn"):
    return Setup(model_builder=from_setup, num_classes=2, image_shape=(3, size, size), num_clients=4, client_domains=("a", "b", "c", "d"),
                 model=ModelConfig(name="densenet121_tv", norm=norm, pretrained=pretrained),
                 train=TrainConfig(), rounds=1, seed=0)


# ----------------------------------------------------------------------------- architecture

def test_param_count_equals_torchvision():
    tv = torchvision.models.densenet121(weights=None)
    model = build("densenet121_tv", num_classes=1000)
    assert count_params(model) == count_params(tv) == TORCHVISION_PARAMS
    assert model.feature_dim == 1024 and model.input_shape == (3, 224, 224)
    # 58 dense layers (6 + 12 + 24 + 16) x 2 norms + bn0 + 3 transitions + final = 121 norms;
    # 58 x 2 convs + conv0 + 3 transitions = 120 convs
    assert sum(isinstance(m, nn.BatchNorm2d) for m in model.modules()) == 121
    assert sum(isinstance(m, nn.Conv2d) for m in model.modules()) == 120
    assert [model.features.get_submodule(f"transition{i}").conv.out_channels for i in (1, 2, 3)] == [128, 256, 512]


@pytest.mark.parametrize("size", [96, 224])
def test_forward_shape(size):
    model = build("densenet121_tv", num_classes=2, input_size=size).eval()
    assert model.input_shape == (3, size, size)
    x = torch.randn(1, 3, size, size)
    with torch.no_grad():
        z = model.features(x)
        assert z.shape == (1, 1024)
        torch.testing.assert_close(model.head(z), model(x))
    assert model.head.out_features == 2


def test_too_small_input_and_channels():
    with pytest.raises(UserError, match="too small"):
        build("densenet121_tv", input_size=28)
    model = build("densenet121_tv", in_channels=1, input_size=32).eval()
    assert model.features.conv0.in_channels == 1
    with torch.no_grad():
        assert model(torch.randn(2, 1, 32, 32)).shape == (2, 10)


# ----------------------------------------------------------------------------- pretrained

def test_torchvision_file_gives_torchvision_logits(tv_file):
    tv, path = tv_file
    model = build("densenet121_tv", num_classes=1000, input_size=64, pretrained=path).eval()
    assert torch.equal(model.features.final.bn.running_var, tv.features.norm5.running_var)
    assert torch.equal(model.features.denseblock3.denselayer7.bn2.weight,
                       tv.features.denseblock3.denselayer7.norm2.weight)
    assert torch.equal(model.head.weight, tv.classifier.weight)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(model(x), tv(x))


def test_classifier_skipped_when_classes_differ(tv_file):
    tv, path = tv_file
    model = build("densenet121_tv", num_classes=2, input_size=64, pretrained=path).eval()
    assert model.head.weight.shape == (2, 1024)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        expected = torch.flatten(nn.functional.adaptive_avg_pool2d(torch.relu(tv.features(x)), 1), 1)
        torch.testing.assert_close(model.features(x), expected)


def test_legacy_key_names_load(tv_file, tmp_path):
    # The file torchvision downloads (densenet121-a639ec97.pth) spells denselayer norms/convs
    # "norm.1", "conv.2"; torchvision renames them while loading, so must we.
    tv, _ = tv_file
    legacy = {re.sub(r"(denselayer\d+\.(?:norm|conv))([12])\.", r"\1.\2.", k): v for k, v in tv.state_dict().items()}
    assert "features.denseblock1.denselayer1.norm.1.weight" in legacy
    path = tmp_path / "densenet121-legacy.pth"
    torch.save(legacy, path)
    model = build("densenet121_tv", num_classes=1000, input_size=64, pretrained=str(path))
    assert torch.equal(model.features.denseblock4.denselayer16.conv2.weight,
                       tv.features.denseblock4.denselayer16.conv2.weight)
    assert torch.equal(model.features.denseblock2.denselayer5.bn1.running_var,
                       tv.features.denseblock2.denselayer5.norm1.running_var)


def test_wrong_file_is_a_user_error(tmp_path):
    path = tmp_path / "r18.pth"
    torch.save(torchvision.models.resnet18(weights=None).state_dict(), path)
    with pytest.raises(UserError, match="does not fit"):
        build("densenet121_tv", input_size=64, pretrained=str(path))


# ----------------------------------------------------------------------------- norm swaps

@pytest.mark.parametrize("norm", ["gn", "none"])
def test_norm_swap(norm):
    model = build("densenet121_tv", input_size=32, norm=norm).train()
    norms = [m for m in model.modules() if is_norm(m)]
    if norm == "gn":
        assert len(norms) == 121 and all(isinstance(m, nn.GroupNorm) and m.num_groups == 32 for m in norms)
    else:
        assert norms == [] and isinstance(model.features.denseblock1.denselayer1.bn1, nn.Identity)
    assert {k for k in model.state_dict() if "bn" in k} == norm_keys(model)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_fedwon_and_fedbn_build():
    won = FedWon(FedWon.hparams_from({}), setup_for()).build_model()
    convs = [m for m in won.modules() if isinstance(m, nn.Conv2d)]
    assert len(convs) == 120 and all(isinstance(m, WSConv2d) for m in convs)
    assert not any(is_norm(m) for m in won.modules())
    assert won(torch.randn(2, 3, 32, 32)).shape == (2, 2)
    fedbn = FedBN(FedBN.hparams_from({}), setup_for())
    model = fedbn.build_model()
    local = fedbn.personal_keys(model)  # every BN layer's keys stay on the client
    assert len(local) == 121 * 5 and local == {k for k in model.state_dict() if "bn" in k}


# ----------------------------------------------------------------------------- gPerXAN

def test_stage_names():
    model = build("densenet121_tv", input_size=32)
    stages = {stage_of(n) for n, m in model.features.named_modules() if isinstance(m, nn.BatchNorm2d)}
    assert stages == {"stem", "final"} | {f"denseblock{i}" for i in range(1, 5)} | {f"transition{i}" for i in range(1, 4)}
    assert stage_of("bn0") == "stem" and stage_of("final.bn") == "final"
    assert stage_of("denseblock2.denselayer3.bn1") == "denseblock2" and stage_of("transition1.bn") == "transition1"


def test_xan_placement_camelyon17_rule():
    model = build("densenet121_tv", num_classes=2, input_size=32)
    auto = select(model, "auto", "xan")  # Sec. 4.2: first dense block + the following transition
    expected = [f"features.denseblock1.denselayer{i}.bn{j}" for i in range(1, 7) for j in (1, 2)]
    assert auto == expected + ["features.transition1.bn"] == select(model, "denseblock1,transition1", "xan")
    with_stem = select(model, "stem,denseblock1,transition1", "xan")
    assert with_stem == ["features.bn0"] + auto  # the flag to include norm0 (stem only, not norm5)
    assert select(model, "final", "xan") == ["features.final.bn"]
    assert len(select(model, "all", "xan")) == 121
    with pytest.raises(UserError, match="denseblock1.*transition1"):
        select(model, "layer1", "xan")
    with pytest.raises(UserError, match="DenseNet"):
        select(model, "auto", "ibn")
    place(model, auto, "xan")
    assert sum(isinstance(m, XAN) for m in model.modules()) == 13
    model.train()
    out = model(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 2) and torch.isfinite(out).all()
    out.sum().backward()
    assert model.features.denseblock1.denselayer1.bn1.inst.weight.grad is not None


def test_gperxan_builds_on_pretrained_densenet(tv_file):
    tv, path = tv_file
    method = GPerXAN(GPerXAN.hparams_from({"stages": "auto"}), setup_for(pretrained=path))
    model = method.build_model()
    xans = [n for n, m in model.named_modules() if isinstance(m, XAN)]
    assert len(xans) == 13
    layer = model.features.denseblock1.denselayer4.bn2  # BN side <- the file's BN (Sec. 4.2)
    assert torch.equal(layer.bn.running_mean, tv.features.denseblock1.denselayer4.norm2.running_mean)
    assert torch.equal(layer.bn.weight, tv.features.denseblock1.denselayer4.norm2.weight)
    assert type(model.features.bn0) is nn.BatchNorm2d  # norm0 stays plain BN
    assert len(method.personal_keys(model)) == 13 * 6  # BN affine + 3 buffers + s_bn
    model.eval()
    with torch.no_grad():
        assert model(torch.randn(2, 3, 32, 32)).shape == (2, 2)
