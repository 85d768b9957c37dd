"""count_flops / count_params against hand-computed figures and the papers' footprint tables."""
from collections import OrderedDict

import torch
from torch import nn

from raysim.models import Net, build, count_flops, count_params


def tiny(bn=False):
    """conv(3->4, 3x3, s1, p1) [BN] ReLU conv(4->6, 3x3, s2, p1) ReLU flatten linear(96->5), on 3x8x8."""
    layers = [("conv1", nn.Conv2d(3, 4, 3, stride=1, padding=1))]
    if bn:
        layers.append(("bn1", nn.BatchNorm2d(4)))
    layers += [("relu1", nn.ReLU()), ("conv2", nn.Conv2d(4, 6, 3, stride=2, padding=1)),
               ("relu2", nn.ReLU()), ("flatten", nn.Flatten())]
    return Net(nn.Sequential(OrderedDict(layers)), nn.Linear(96, 5), (3, 8, 8))


# Hand counts, one sample: conv1 8*8 positions x 4 filters x 3*3*3 = 6912;
# conv2 4*4 positions x 6 filters x 4*3*3 = 3456; linear 96*5 = 480.
DENSE = 6912 + 3456 + 480


def test_dense_macs_by_hand():
    assert count_flops(tiny()) == DENSE == 10848
    assert count_flops(tiny(), (3, 8, 8)) == DENSE


def test_grouped_conv_by_hand():
    net = Net(nn.Sequential(nn.Conv2d(4, 8, 3, padding=1, groups=4), nn.Flatten()),
              nn.Linear(8 * 4 * 4, 2), (4, 4, 4))
    # 16 positions x 8 filters x (4/4)*3*3 = 1152; linear 128*2 = 256.
    assert count_flops(net) == 1152 + 256


def test_nonzero_only_half_channels_zeroed():
    net = tiny()
    with torch.no_grad():
        net.features.conv1.weight[2:] = 0      # half of conv1's output channels (filters)
        net.features.conv2.weight[:, 2:] = 0   # the matching input channels of conv2
    # conv1 64 x 2 x 27 = 3456; conv2 16 x 6 x 2*9 = 1728; linear unchanged 480.
    assert count_flops(net, nonzero_only=True) == 3456 + 1728 + 480
    assert count_flops(net) == DENSE  # nominal count ignores the zeros
    # params: conv1 108+4, conv2 216+6, linear 480+5 = 819; zeroed 2*27 + 6*2*9.
    assert count_params(net) == 819
    assert count_params(net, nonzero_only=True) == 819 - 54 - 108


def test_count_norm_thop_convention_and_state_untouched():
    net = tiny(bn=True).train()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    assert count_flops(net) == DENSE
    assert count_flops(net, count_norm=True) == DENSE + 2 * 4 * 8 * 8
    assert net.training
    net.features.bn1.eval()  # a mixed-mode model (FixBN freezes BN statistics) stays mixed
    count_flops(net)
    assert net.training and not net.features.bn1.training
    for k, v in net.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_dapperfl_table5_resnet10():
    """Table 5 is nominal: (1 - rho) x the dense ResNet-10 at 3x32x32, FLOPs thop-style (BN counted)."""
    model = build("resnet10")
    dense = count_flops(model, (3, 32, 32), count_norm=True)
    assert dense == 254_170_112  # 254.17M
    assert count_flops(model) == 253_432_832  # conv/linear MACs only
    for rho, params, flops in [(0.2, 3.92, 203.34), (0.4, 2.94, 152.50), (0.6, 1.96, 101.67), (0.8, 0.98, 50.83)]:
        assert round((1 - rho) * count_params(model) / 1e6, 2) == params
        assert round((1 - rho) * dense / 1e6, 2) == flops


def test_dapperfl_table6_resnet18():
    """Table 6's ResNet-18 FLOPs were measured at 28x28 (training runs at 32x32)."""
    model = build("resnet18")
    at28 = count_flops(model, (3, 28, 28), count_norm=True)
    print(f"resnet18: {at28:,} thop-MACs at 28 px, {count_flops(model, (3, 32, 32), count_norm=True):,} at 32 px")
    assert round(at28 / 1e6, 2) == 457.66
    for rho, params, flops in [(0.2, 8.94, 366.13), (0.4, 6.70, 274.60), (0.6, 4.47, 183.06), (0.8, 2.23, 91.53)]:
        assert round((1 - rho) * count_params(model) / 1e6, 2) == params
        assert abs((1 - rho) * at28 / 1e6 - flops) <= 0.011  # the paper scaled the rounded 457.66


def test_fdse_table4_flops_need_256px():
    """FDSE Table 4: 4.41e10 FLOPs for a batch of 50; only 256 px (the code's resize) fits."""
    model = build("alexnet_fdse", num_classes=10)
    at256, at224 = 50 * count_flops(model, (3, 256, 256)), 50 * count_flops(model, (3, 224, 224))
    print(f"alexnet_fdse batch 50: {at256:.4e} MACs at 256 px, {at224:.4e} at 224 px (Table 4: 4.41e10)")
    assert abs(at256 / 4.41e10 - 1) < 0.005
    assert abs(at224 / 4.41e10 - 1) > 0.2
