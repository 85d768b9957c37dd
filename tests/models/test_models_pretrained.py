"""Local weight files: raysim and torchvision layouts, classifier skip, clear errors."""
import pytest
import torch
import torchvision
from torch import nn

from raysim.core.errors import UserError
from raysim.models import build, load_pretrained


def test_round_trip_raysim_layout(tmp_path):
    torch.manual_seed(0)
    src = build("resnet18_tv", input_size=64)
    path = tmp_path / "r18.pt"
    torch.save(src.state_dict(), path)
    torch.manual_seed(1)
    dst = build("resnet18_tv", input_size=64, pretrained=str(path))
    for k, v in src.state_dict().items():
        assert torch.equal(v, dst.state_dict()[k]), k


def test_torchvision_layout_imagenet_style(tmp_path):
    torch.manual_seed(0)
    tv = torchvision.models.resnet18(weights=None)  # stands in for the ImageNet file
    with torch.no_grad():
        for m in tv.modules():
            if isinstance(m, nn.BatchNorm2d):  # non-trivial statistics, so the check means something
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    path = tmp_path / "resnet18_imagenet.pth"
    torch.save(tv.state_dict(), path)

    model = build("resnet18_tv", num_classes=7, input_size=64, pretrained=str(path)).eval()
    assert model.head.weight.shape == (7, 512)  # 1000-class fc skipped
    assert torch.equal(model.features.layer2[0].downsample.bn.running_var, tv.layer2[0].downsample[1].running_var)
    tv.fc = nn.Identity()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(model.features(x), tv.eval()(x))

    same = build("resnet18_tv", num_classes=1000, input_size=64, pretrained=str(path))
    assert torch.equal(same.head.weight, torch.load(path, weights_only=True)["fc.weight"])


def test_swapped_norm_keeps_convs(tmp_path):
    path = tmp_path / "r18.pt"
    src = build("resnet18_tv", input_size=64)
    torch.save(src.state_dict(), path)
    with pytest.warns(UserWarning, match="norm-layer"):
        gn = build("resnet18_tv", input_size=64, norm="gn", pretrained=str(path))
    assert torch.equal(gn.features.layer3[1].conv2.weight, src.features.layer3[1].conv2.weight)


def test_missing_file():
    with pytest.raises(UserError) as err:
        build("resnet50_tv", pretrained="/nonexistent/resnet50.pth")
    assert str(err.value) == ("pretrained weights file not found: /nonexistent/resnet50.pth "
                              "(expected a torch state_dict saved with torch.save)")


def test_wrong_architecture(tmp_path):
    path = tmp_path / "small.pt"
    torch.save(build("small_cnn").state_dict(), path)
    with pytest.raises(UserError, match="does not fit"):
        build("resnet18_tv", input_size=64, pretrained=str(path))


def test_not_a_state_dict(tmp_path):
    path = tmp_path / "junk.pt"
    torch.save([1, 2, 3], path)
    with pytest.raises(UserError, match="state_dict"):
        load_pretrained(build("small_cnn"), str(path))


def test_any_zoo_model_accepts_a_raysim_file(tmp_path):
    src = build("small_cnn", num_classes=4)
    path = tmp_path / "s.pt"
    torch.save({"state_dict": src.state_dict()}, path)  # a wrapped checkpoint also works
    dst = build("small_cnn", num_classes=4, pretrained=str(path))
    for k, v in src.state_dict().items():
        assert torch.equal(v, dst.state_dict()[k]), k


def test_bn_entries_reach_a_bn_inside_a_custom_norm(tmp_path):
    """gPerXAN: XAN's BN branch starts from the pretrained BN, its IN branch fresh."""
    class XANLike(nn.Module):
        def __init__(self, c, dim):
            super().__init__()
            self.bn_branch = nn.BatchNorm2d(c)
            self.in_branch = nn.InstanceNorm2d(c, affine=True)

        def forward(self, x):
            return self.bn_branch(x) + self.in_branch(x)

    src = build("resnet18_tv", input_size=64)
    with torch.no_grad():
        src.features.layer1[0].bn2.weight.uniform_()
    path = tmp_path / "r18.pt"
    torch.save(src.state_dict(), path)
    with pytest.warns(UserWarning):  # the IN branches keep their fresh init
        dst = build("resnet18_tv", input_size=64, norm=XANLike, pretrained=str(path))
    assert torch.equal(dst.features.layer1[0].bn2.bn_branch.weight, src.features.layer1[0].bn2.weight)
    assert torch.equal(dst.features.layer2[0].downsample.bn.bn_branch.running_var,
                       src.features.layer2[0].downsample.bn.running_var)
