"""FedAvg+GN, FedAvg+LN, SiloBN and FixBN on tiny tensors, checked by hand."""
import pytest
import torch
from torch import nn

from raysim.config import ModelConfig, TrainConfig
from raysim.core.errors import UserError
from raysim.core.tensors import load_tensors
from raysim import testing
from raysim.methods.normbaselines import FedAvgGN, FedAvgLN, FixBN, SiloBN, bn_stat_keys, frozen_bn


def setup_for(name="cnn6", norm="bn", size=28, rounds=10, **options):
    return testing.setup(num_classes=10, image_shape=(3, size, size), num_clients=2, client_domains=("a", "b"),
                         model=ModelConfig(name=name, norm=norm, options=options), rounds=rounds)


def tiny():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 2, 1), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(8, 2))


def context(model, rnd, x, y, lr=0.1, state=None):
    return testing.client_context(None, model, testing.fixed_batches((x, y)), round=rnd, state=state or {},
                                  train=TrainConfig(batch_size=len(y), lr=lr))


# ----------------------------------------------------------------------------- GN / LN

def test_fedavg_gn_uses_table5_groups_and_ln_one_group():
    gn = FedAvgGN(FedAvgGN.Hparams(), setup_for(norm="bn", size=8)).build_model()  # the config's bn is swapped
    norms = [m for m in gn.modules() if isinstance(m, (nn.BatchNorm2d, nn.GroupNorm))]
    assert [(m.num_groups, m.num_channels) for m in norms] == [(32, 64), (32, 64), (64, 128)]
    ln = FedAvgLN(FedAvgLN.Hparams(), setup_for(size=8)).build_model()
    norms = [m for m in ln.modules() if isinstance(m, (nn.BatchNorm2d, nn.GroupNorm))]
    assert [(m.num_groups, m.num_channels) for m in norms] == [(1, 64), (1, 64), (1, 128)]
    for model in (gn, ln):
        assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
        assert FedAvgGN(FedAvgGN.Hparams(), setup_for()).personal_keys(model) == set()


def test_fedavg_gn_alexnet_table6_groups():
    model = FedAvgGN(FedAvgGN.Hparams(), setup_for("alexnet", size=96, hidden=16)).build_model()
    groups = [(m.num_groups, m.num_channels) for m in model.modules() if isinstance(m, nn.GroupNorm)]
    assert groups == [(32, 64), (32, 192), (64, 384), (64, 256), (64, 256)]


def test_ln_normalises_each_sample_over_c_h_w():
    model = FedAvgLN(FedAvgLN.Hparams(), setup_for(size=8)).build_model()
    ln = model.features.bn1
    x = torch.arange(2 * 64 * 2 * 2, dtype=torch.float32).view(2, 64, 2, 2)
    y = ln(x)
    # affine is (1, 0) at init: each sample has mean 0 and (population) variance ~1 over (C, H, W)
    assert torch.allclose(y.mean(dim=(1, 2, 3)), torch.zeros(2), atol=1e-5)
    assert torch.allclose(y.var(dim=(1, 2, 3), unbiased=False), torch.ones(2), atol=1e-3)


# ----------------------------------------------------------------------------- SiloBN

def test_silobn_shares_bn_affine_and_keeps_statistics_local():
    model = tiny()
    m = SiloBN(SiloBN.Hparams(), setup_for())
    assert m.personal_keys(model) == bn_stat_keys(model) == {
        "1.running_mean", "1.running_var", "1.num_batches_tracked"}
    state = m.init_server(model)
    assert set(state["global"]) == {"0.weight", "0.bias", "1.weight", "1.bias", "3.weight", "3.bias"}

    # A client's own statistics survive loading the broadcast; its upload carries gamma, beta, not stats.
    client = {"personal": {"1.running_mean": torch.tensor([5.0, -5.0]), "1.running_var": torch.tensor([4.0, 9.0]),
                           "1.num_batches_tracked": torch.tensor(7)}}
    payload = {"global": {**state["global"], "1.weight": torch.tensor([2.0, 3.0])}}
    m.load_client_model(model, payload, client)
    assert torch.equal(model[1].running_mean, torch.tensor([5.0, -5.0]))
    assert torch.equal(model[1].weight.detach(), torch.tensor([2.0, 3.0]))
    x, y = torch.randn(4, 1, 2, 2), torch.tensor([0, 1, 0, 1])
    with torch.no_grad():
        mu = model[0](x).mean(dim=(0, 2, 3))  # the batch mean before BN, before the step
    up = m.local_update(context(model, 1, x, y, state=client))
    assert "1.weight" in up.tensors and "1.bias" in up.tensors
    assert not bn_stat_keys(model) & set(up.tensors)
    # the stored statistics moved by momentum 0.1 toward the batch's: mean_new = 0.9 * 5 + 0.1 * mu_batch
    assert torch.allclose(client["personal"]["1.running_mean"], 0.9 * torch.tensor([5.0, -5.0]) + 0.1 * mu,
                          atol=1e-5)
    # evaluation uses the client's own statistics
    other = {"personal": {k: v.clone() for k, v in client["personal"].items()}}
    other["personal"]["1.running_mean"] = torch.tensor([0.0, 0.0])
    m.eval_model(model, payload, other)
    assert torch.equal(model[1].running_mean, torch.tensor([0.0, 0.0]))


# ----------------------------------------------------------------------------- FixBN

def test_fixbn_switch_round():
    assert FixBN(FixBN.Hparams(), setup_for(rounds=100)).switch_round() == 50
    assert FixBN(FixBN.Hparams(), setup_for(rounds=15)).switch_round() == 8  # round(7.5) half up
    m = FixBN(FixBN.hparams_from({"switch_round": 3}), setup_for(rounds=100))
    assert m.switch_round() == 3 and not m.frozen(3) and m.frozen(4)
    with pytest.raises(UserError):
        FixBN.hparams_from({"switch_frac": 1.5})


def test_fixbn_stage1_is_fedavg_with_batch_statistics():
    model = tiny()
    m = FixBN(FixBN.Hparams(), setup_for(rounds=10))
    assert m.personal_keys(model) == set()  # statistics are averaged like every other tensor
    x, y = torch.randn(4, 1, 2, 2), torch.tensor([0, 1, 0, 1])
    mean0 = model[1].running_mean.clone()
    up = m.local_update(context(model, 5, x, y, lr=0.0))  # round 5 <= T* = 5: stage 1
    with torch.no_grad():
        mu = model[0](x).mean(dim=(0, 2, 3))
    assert torch.allclose(model[1].running_mean, 0.9 * mean0 + 0.1 * mu, atol=1e-6)
    assert "1.running_mean" in up.tensors and int(model[1].num_batches_tracked) == 1


def test_fixbn_stage2_trains_with_frozen_global_statistics():
    model = tiny()
    m = FixBN(FixBN.Hparams(), setup_for(rounds=10))
    glob = {"1.running_mean": torch.tensor([0.3, -0.2]), "1.running_var": torch.tensor([2.0, 0.5])}
    load_tensors(model, glob)
    x, y = torch.randn(4, 1, 2, 2), torch.tensor([0, 1, 0, 1])
    w_before = model[1].weight.detach().clone()
    # the training forward normalises with the frozen statistics: equal to the eval-mode output
    model.eval()
    expected = model(x)
    model.train()
    with frozen_bn(model):
        assert torch.allclose(model(x), expected)
    assert not torch.allclose(model(x), expected)  # hooks removed: batch statistics again
    load_tensors(model, glob)  # (that train-mode call moved the running statistics)
    model.eval()
    with torch.no_grad():
        z = model[0](x)  # by hand: (z - mu) / sqrt(var + eps) * gamma + beta
        by_hand = (z - glob["1.running_mean"].view(1, 2, 1, 1)) / torch.sqrt(
            glob["1.running_var"].view(1, 2, 1, 1) + 1e-5) * model[1].weight.view(1, 2, 1, 1) \
            + model[1].bias.view(1, 2, 1, 1)
        assert torch.allclose(model[1](z), by_hand, atol=1e-6)
    up = m.local_update(context(model, 6, x, y, lr=0.1))  # round 6 > T* = 5: stage 2
    assert torch.equal(model[1].running_mean, glob["1.running_mean"])
    assert torch.equal(model[1].running_var, glob["1.running_var"])
    assert not torch.equal(model[1].weight.detach(), w_before)  # gamma keeps training
    assert torch.equal(up.tensors["1.running_var"], glob["1.running_var"])
