"""FedWon's equations on tiny tensors, computed by hand: WSConv (Eq. 3 / Listing 1), AGC (Eq. 4),
the normalization-free networks, and the local step (AGC between backward and step)."""
import copy
import math

import pytest
import torch
from torch import nn

from raysim.config import ModelConfig, TrainConfig
from raysim.core.errors import UserError
from raysim.methods.fedwon import (FedWon, WSConv2d, adaptive_clip_, agc_parameters, unitwise_norm,
                                   ws_conv_factory)
from raysim.models import is_norm
from raysim.models.dropout import dropout_generator
from raysim import testing


def setup_for(name="small_cnn", norm="bn", size=32, **options):
    return testing.setup(num_classes=10, image_shape=(3, size, size), num_clients=2, client_domains=("a", "b"),
                         model=ModelConfig(name=name, norm=norm, options=options), rounds=10)


def fedwon(name="small_cnn", size=32, hp=None, **options):
    return FedWon(FedWon.hparams_from(hp or {}), setup_for(name, size=size, **options))


# ----------------------------------------------------------------------------- WSConv

def tiny_ws(unbiased=True):
    conv = WSConv2d(1, 2, 2, bias=True, unbiased=unbiased)
    with torch.no_grad():
        conv.weight.copy_(torch.tensor([[1.0, 2.0], [3.0, 4.0]]).view(1, 1, 2, 2).repeat(2, 1, 1, 1))
        conv.weight[1] = torch.tensor([[0.0, 0.0], [0.0, 0.001]])  # N * var far below eps
        conv.gain.copy_(torch.tensor([2.0, 1.0]).view(2, 1, 1, 1))
        conv.bias.copy_(torch.tensor([0.5, 0.0]))
    return conv


def test_wsconv_output_equals_the_formula_unbiased():
    conv = tiny_ws(unbiased=True)
    assert conv.fan_in == 4 and conv.eps == 1e-4
    # row 0: W = [1,2,3,4], mu = 2.5, W - mu = [-1.5,-.5,.5,1.5], sum sq = 5,
    #        unbiased var = 5/3, N var = 20/3 > eps  ->  W_hat = 2 * (W - mu) * sqrt(3/20)
    # row 1: W = [0,0,0,.001], mu = .00025, W - mu = [-.00025,-.00025,-.00025,.00075],
    #        unbiased var = 7.5e-7/3, N var = 1e-6 < eps = 1e-4  ->  W_hat = 1 * (W - mu) / sqrt(1e-4)
    w_hat = conv.standardized_weight().view(2, 4)
    r0 = torch.tensor([-1.5, -0.5, 0.5, 1.5]) * 2 * math.sqrt(3 / 20)
    r1 = torch.tensor([-0.00025, -0.00025, -0.00025, 0.00075]) * 100
    assert torch.allclose(w_hat[0], r0, atol=1e-6)
    assert torch.allclose(w_hat[1], r1, atol=1e-6)
    # x = [[1, 2], [0, 0]]: y_i = sum_j W_hat_ij x_j + b_i
    x = torch.tensor([[1.0, 2.0], [0.0, 0.0]]).view(1, 1, 2, 2)
    y = conv(x).flatten()
    y0 = (-1.5 * 1 - 0.5 * 2) * 2 * math.sqrt(3 / 20) + 0.5  # = -1.43649
    y1 = (-0.00025 * 1 - 0.00025 * 2) * 100 + 0.0  # = -0.075
    assert torch.allclose(y, torch.tensor([y0, y1]), atol=1e-6)


def test_wsconv_population_variance_is_eq3():
    conv = tiny_ws(unbiased=False)
    # row 0: population var = 5/4, N var = 5  ->  W_hat = 2 (W - mu) / sqrt(5)
    r0 = torch.tensor([-1.5, -0.5, 0.5, 1.5]) * 2 / math.sqrt(5)
    assert torch.allclose(conv.standardized_weight().view(2, 4)[0], r0, atol=1e-6)
    # row 1: N var = 4 * 7.5e-7 / 4 = 7.5e-7 < eps: still the eps floor
    r1 = torch.tensor([-0.00025, -0.00025, -0.00025, 0.00075]) * 100
    assert torch.allclose(conv.standardized_weight().view(2, 4)[1], r1, atol=1e-6)


def test_wsconv_rows_zero_mean_norm_and_scale_invariance():
    torch.manual_seed(0)
    conv = WSConv2d(3, 8, 3, padding=1)
    n = 27
    w_hat = conv.standardized_weight().view(8, -1)
    assert torch.allclose(w_hat.mean(1), torch.zeros(8), atol=1e-6)
    assert torch.allclose(w_hat.norm(dim=1), torch.full((8,), math.sqrt((n - 1) / n)), atol=1e-5)
    x = torch.randn(2, 3, 5, 5)
    y = conv(x)
    with torch.no_grad():
        conv.weight.mul_(7.0)
    assert torch.allclose(conv(x), y, atol=1e-5)  # W -> 7W leaves W_hat unchanged
    pop = WSConv2d(3, 8, 3, unbiased=False)
    assert torch.allclose(pop.standardized_weight().view(8, -1).norm(dim=1), torch.ones(8), atol=1e-5)


def test_wsconv_init_and_state_dict():
    torch.manual_seed(0)
    conv = WSConv2d(64, 128, 5)
    assert set(conv.state_dict()) == {"weight", "bias", "gain"}  # eps, fan_in are not sent
    assert conv.gain.shape == (128, 1, 1, 1) and torch.all(conv.gain == 1)
    # xavier_normal_: std = sqrt(2 / (fan_in + fan_out)) = sqrt(2 / (64*25 + 128*25))
    assert abs(conv.weight.std().item() - math.sqrt(2 / (64 * 25 + 128 * 25))) < 2e-4
    assert conv.gain.requires_grad and conv.bias.requires_grad


def test_conv_factory_forces_bias_and_keeps_requested_plain_convs():
    f = ws_conv_factory(force_bias=True, plain=(2,))
    a, b, c = f(3, 4, 3, 1, 1, False), f(4, 4, 3, 1, 1, False), f(4, 4, 3, 1, 1, False)
    assert isinstance(a, WSConv2d) and a.bias is not None
    assert type(b) is nn.Conv2d and b.bias is None
    assert isinstance(c, WSConv2d)
    assert ws_conv_factory(force_bias=False)(3, 4, 3, 1, 1, False).bias is None


# ----------------------------------------------------------------------------- AGC

def test_agc_clips_exactly_the_units_above_the_threshold():
    lam = 0.1
    w = torch.nn.Parameter(torch.tensor([[3.0, 4.0], [0.0, 0.0], [1.0, 0.0], [0.0, 2.0]]))
    # row norms ||W_i|| = 5, 0 (-> eps 1e-3), 1, 2; limits lam * max(||W_i||, eps) = .5, 1e-4, .1, .2
    w.grad = torch.tensor([[30.0, 40.0],   # ||G|| = 50 = 100 * limit  -> rescaled to norm .5
                           [0.0, 1.0],     # ||G|| = 1 > 1e-4          -> rescaled to norm 1e-4
                           [0.05, 0.0],    # ||G|| = .05 < .1          -> unchanged
                           [0.0, 0.2]])    # ||G|| = .2 == limit (not >) -> unchanged
    b = torch.nn.Parameter(torch.tensor([3.0, 4.0]))  # a vector is one unit: ||b|| = 5, limit .5
    b.grad = torch.tensor([6.0, 8.0])  # ||G|| = 10 -> [.3, .4]
    clipped, seen = adaptive_clip_([(w, False), (b, True)], lam, eps=1e-3)
    expected = torch.tensor([[0.3, 0.4], [0.0, 1e-4], [0.05, 0.0], [0.0, 0.2]])
    assert torch.allclose(w.grad, expected, rtol=1e-6, atol=1e-9)
    assert torch.allclose(b.grad, torch.tensor([0.3, 0.4]))
    assert (clipped, seen) == (3, 5)


def test_agc_ten_times_over_comes_out_at_the_threshold():
    torch.manual_seed(0)
    lam = 0.64
    w = torch.nn.Parameter(torch.randn(4, 3, 3, 3))
    row = w.detach().view(4, -1).norm(dim=1)
    g = torch.randn(4, 3, 3, 3)
    g = g / g.view(4, -1).norm(dim=1).view(4, 1, 1, 1) * (10 * lam * row).view(4, 1, 1, 1)
    w.grad = g.clone()
    adaptive_clip_([(w, False)], lam)
    assert torch.allclose(w.grad.view(4, -1).norm(dim=1), lam * row, rtol=1e-5)
    assert torch.allclose(w.grad, g / 10, rtol=1e-5, atol=1e-7)  # direction kept
    assert unitwise_norm(w.detach()).shape == (4, 1, 1, 1) and unitwise_norm(w.detach(), True).ndim == 0


def test_agc_leaves_the_classifier_alone_and_treats_gains_as_one_unit():
    torch.manual_seed(0)
    model = fedwon().build_model()
    names = {n for n, _, _ in agc_parameters(model)}
    all_names = {n for n, _ in model.named_parameters()}
    assert all_names - names == {"head.weight", "head.bias"}
    units = agc_parameters(model)
    assert all(whole for n, _, whole in units if n.endswith((".gain", ".bias")))
    assert not any(whole for n, _, whole in units if n.endswith(".weight"))
    no_vec = {n for n, _, _ in agc_parameters(model, clip_vectors=False)}
    assert no_vec == {n for n in names if n.endswith(".weight")}
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e3)
    adaptive_clip_([(p, whole) for _, p, whole in units], 0.01)
    assert torch.all(model.head.weight.grad == 1e3) and torch.all(model.head.bias.grad == 1e3)
    conv1 = model.features.conv1
    limit = 0.01 * conv1.weight.detach().view(16, -1).norm(dim=1)
    assert torch.allclose(conv1.weight.grad.view(16, -1).norm(dim=1), limit, rtol=1e-5)
    # the gain (16 ones) is one unit: ||g|| = 4, limit .04 over the whole vector
    assert abs(conv1.gain.grad.norm().item() - 0.04) < 1e-6


def test_agc_switch():
    m = fedwon()
    assert m.use_agc(32) and not m.use_agc(4) and not m.use_agc(2) and not m.use_agc(1)
    assert fedwon(hp={"agc": False}).use_agc(32) is False
    assert fedwon(hp={"agc": True}).use_agc(2) is True
    assert fedwon(hp={"agc_small_batch": 32}).use_agc(32) is False
    with pytest.raises(UserError):
        FedWon.hparams_from({"agc": "sometimes"})
    with pytest.raises(UserError):
        FedWon.hparams_from({"agc_lambda": 0})
    with pytest.raises(UserError):
        FedWon.hparams_from({"ws_plain_convs": "x"})
    assert FedWon.Hparams().agc_lambda == 0.64 and FedWon.Hparams().agc_eps == 1e-3


# ----------------------------------------------------------------------------- networks

@pytest.mark.parametrize("name,size,params,gains,convs", [
    ("cnn6", 28, 14_213_578 + 256, 256, 3),        # Table 5: 14,213,578 without norms + 256 gains
    ("alexnet", 256, 57_044_810 + 1_152, 1_152, 5),  # Table 6: 57,044,810 without norms + 1,152 gains
    ("resnet18_tv", 64, 11_181_642, 4_800, 20),    # torchvision ResNet-18, BN removed, biased WSConvs
])
def test_no_normalization_remains_and_every_conv_is_wsconv(name, size, params, gains, convs):
    model = fedwon(name, size=size).build_model()
    assert not any(is_norm(m) for m in model.modules())
    assert sum(isinstance(m, WSConv2d) for m in model.modules()) == convs
    assert not any(type(m) is nn.Conv2d for m in model.modules())
    assert sum(p.numel() for p in model.parameters()) == params
    assert sum(p.numel() for n, p in model.named_parameters() if n.endswith(".gain")) == gains
    assert list(model.buffers()) == []  # no running statistics anywhere
    if name == "cnn6":
        model.train()
        with dropout_generator(torch.Generator().manual_seed(0)):  # as inside a client step
            assert model(torch.randn(1, 3, 28, 28)).shape == (1, 10)  # B = 1 trains: no batch statistics


def test_table6_literal_and_ablation_variants():
    literal = fedwon("alexnet", size=96, hp={"ws_plain_convs": [3]}, hidden=16).build_model()
    assert type(literal.features.conv3) is nn.Conv2d and isinstance(literal.features.conv4, WSConv2d)
    plain = fedwon(hp={"ws": False}).build_model()  # "FedAvg w/o BN"
    assert not any(isinstance(m, WSConv2d) or is_norm(m) for m in plain.modules())


def test_everything_is_shared_and_averaged():
    m = fedwon()
    model = m.build_model()
    assert m.personal_keys(model) == set()
    assert set(m.init_server(model)["global"]) == set(model.state_dict())


# ----------------------------------------------------------------------------- local step

def context(model, x, y, lr, batch_size):
    return testing.client_context(None, model, testing.fixed_batches((x, y)), state={},
                                  train=TrainConfig(batch_size=batch_size, lr=lr))


def test_local_step_is_sgd_on_agc_clipped_gradients():
    torch.manual_seed(0)
    m = fedwon(hp={"agc_lambda": 0.01})
    model = m.build_model()
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    ref = copy.deepcopy(model)
    ref.train()
    torch.nn.functional.cross_entropy(ref(x), y).backward()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    up = m.local_update(context(model, x, y, lr=1.0, batch_size=32))
    after = dict(model.named_parameters())
    grads = dict(ref.named_parameters())
    for n, _, whole in agc_parameters(model):  # w1 = w0 - lr * clip(g)
        g = grads[n].grad.clone()
        p = torch.nn.Parameter(before[n].clone())
        p.grad = g
        adaptive_clip_([(p, whole)], 0.01)
        assert torch.allclose(before[n] - after[n].detach(), p.grad, atol=1e-6), n
    for n in ("head.weight", "head.bias"):  # the classifier's step is the raw gradient
        assert torch.allclose(before[n] - after[n].detach(), grads[n].grad, atol=1e-6)
    assert 0 < up.metrics["agc_clipped"] <= 1 and up.weight == 8.0
    assert set(up.tensors) == set(model.state_dict())


def test_small_batch_step_is_plain_sgd():
    torch.manual_seed(0)
    m = fedwon(hp={"agc_lambda": 0.01})
    model = m.build_model()
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    ref = copy.deepcopy(model)
    torch.nn.functional.cross_entropy(ref(x), y).backward()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    up = m.local_update(context(model, x, y, lr=0.5, batch_size=2))
    for n, p in model.named_parameters():
        assert torch.allclose(before[n] - p.detach(), 0.5 * dict(ref.named_parameters())[n].grad, atol=1e-6)
    assert "agc_clipped" not in up.metrics
    # hp.lr replaces train.lr for FedWon alone (with lr_decay applied: ctx.lr = 0.25 = 0.5 * 0.5^1)
    m2 = fedwon(hp={"lr": 0.2})
    model2 = m2.build_model()
    ref2 = copy.deepcopy(model2)
    torch.nn.functional.cross_entropy(ref2(x), y).backward()
    before = {n: p.detach().clone() for n, p in model2.named_parameters()}
    ctx = context(model2, x, y, lr=0.25, batch_size=2)
    ctx.train.lr = 0.5
    m2.local_update(ctx)
    for n, p in model2.named_parameters():  # 0.2 * 0.5 (the decay factor) = 0.1
        assert torch.allclose(before[n] - p.detach(), 0.1 * dict(ref2.named_parameters())[n].grad, atol=1e-6)
