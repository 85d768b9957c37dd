"""DapperFL's equations on tiny tensors and tiny models, every expected value worked out by hand."""
import copy
import dataclasses
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from raysim.config import ModelConfig, TrainConfig
from raysim.core.aggregation import AllUploads, weighted_mean
from raysim.core.contract import Upload
from raysim.core.errors import UserError
from raysim.methods.dapperfl import (DapperFL, RepresentationTap, dar_term, footprint_table, fuse, fusion_factor,
                                     layer_roles, local_objective, prune_masks, recover)
from raysim.methods.lib.masks import apply_masks, num_pruned
from raysim.core.tiers import level_counts, level_tiers
from raysim.models.base import Net
from raysim import testing
from raysim.testing import client_context, client_data, random_client_data


# ----------------------------------------------------------------------------- helpers

def tiny_net(seed=0):
    """stem conv 3->4, conv 4->5 (first after the stem: output filters only), conv 5->5 (in + out),
    a BN after each, GAP, Linear 5->3."""
    torch.manual_seed(seed)
    feats = nn.Sequential(OrderedDict([
        ("conv1", nn.Conv2d(3, 4, 3, padding=1, bias=False)), ("bn1", nn.BatchNorm2d(4)), ("relu1", nn.ReLU()),
        ("conv2", nn.Conv2d(4, 5, 3, padding=1, bias=False)), ("bn2", nn.BatchNorm2d(5)), ("relu2", nn.ReLU()),
        ("conv3", nn.Conv2d(5, 5, 3, padding=1, bias=False)), ("bn3", nn.BatchNorm2d(5)), ("relu3", nn.ReLU()),
        ("pool", nn.AdaptiveAvgPool2d(1)), ("flat", nn.Flatten()),
    ]))
    return Net(feats, nn.Linear(5, 3), (3, 6, 6))


def hand_weights(net):
    """conv3.weight[o, i] = a[o] * b[i] / 9 on every tap, so sum|W[:, i]| = b[i] * sum(a) and
    sum|W[o]| = a[o] * sum(b): in-channels rank 0 > 2 > 4 > 3 > 1, out-filters 1 > 3 > 4 > 0 > 2."""
    a = torch.tensor([2.0, 5.0, 1.0, 4.0, 3.0])
    b = torch.tensor([5.0, 1.0, 4.0, 2.0, 3.0])
    with torch.no_grad():
        net.features.conv3.weight.copy_((a.view(5, 1, 1, 1) * b.view(1, 5, 1, 1) / 9).expand(5, 5, 3, 3))
        # conv2 filters' L1 = 9 * 4 * c[o]: rank 3 > 0 > 4 > 1 > 2
        c = torch.tensor([4.0, 2.0, 1.0, 5.0, 3.0])
        net.features.conv2.weight.copy_(-c.view(5, 1, 1, 1).expand(5, 4, 3, 3))
        net.features.bn3.weight.copy_(torch.tensor([0.5, -3.0, 1.0, 0.1, 2.0]))  # |g|: 1 > 4 > 2 > 0 > 3
        net.features.bn2.weight.copy_(torch.tensor([1.0, 0.2, -0.7, 0.3, 2.0]))  # |g|: 4 > 0 > 2 > 3 > 1
        # head columns: L2 = [3, 2.83, 1, 0.5, 4] (L1 = [3, 4, 1, 0.5, 4]): L2 rank 4 > 0 > 1 > 2 > 3
        net.head.weight.copy_(torch.tensor([[3.0, 2.0, 1.0, 0.0, 4.0],
                                            [0.0, 2.0, 0.0, 0.0, 0.0],
                                            [0.0, 0.0, 0.0, 0.5, 0.0]]))
    return net


def kept(mask_1d):
    return set(torch.nonzero(mask_1d).flatten().tolist())


def setup(num_clients=10, seed=0, **kw):
    return testing.setup(num_classes=3, image_shape=(3, 6, 6), num_clients=num_clients,
                         client_domains=tuple(f"d{c // 2}" for c in range(num_clients)), model=ModelConfig(),
                         rounds=5, seed=seed, **kw)


def fake_data(n=8, seed=0):
    return random_client_data(num_train=n, seed=seed, image_shape=(3, 6, 6))


def context(method, net, cid=0, rnd=1, epochs=3, lr=0.05, max_steps=None):
    train = TrainConfig(epochs=epochs, batch_size=4, lr=lr, momentum=0.9, weight_decay=1e-5, max_steps=max_steps)
    payload = {"global": {k: v.detach().clone() for k, v in net.state_dict().items()}}
    return client_context(method, net, fake_data(), client_id=cid, round=rnd, payload=payload, train=train,
                          seed=123, domain="d0")


# ----------------------------------------------------------------------------- Eq. 2 and Eq. 1

def test_alpha_schedule_by_hand():
    # 0.9 * 0.8^(t-1): 0.9, 0.72, 0.576, 0.4608, 0.36864, ..., 0.1207959552 (t=10), then the 0.1 floor
    expected = [0.9, 0.72, 0.576, 0.4608, 0.36864, 0.294912, 0.2359296, 0.18874368, 0.150994944,
                0.1207959552, 0.1, 0.1]
    got = [fusion_factor(t) for t in range(1, 13)]
    assert got == pytest.approx(expected, abs=1e-12)
    assert fusion_factor(11) == 0.1  # 0.9 * 0.8^10 = 0.0966 < alpha_min
    assert fusion_factor(3, alpha0=0.5, epsilon=0.5, alpha_min=0.2) == 0.2  # 0.125 -> floor
    m = DapperFL(DapperFL.hparams_from({"alpha0": 0.8, "epsilon": 0.5, "alpha_min": 0.05}), setup())
    assert [m.alpha(t) for t in (1, 2, 3, 5, 6)] == pytest.approx([0.8, 0.4, 0.2, 0.05, 0.05])


def test_fusion_blends_every_float_entry_and_keeps_local_counters():
    g = {"w": torch.tensor([0.0, 10.0]), "n": torch.tensor(7)}
    loc = {"w": torch.tensor([10.0, 0.0]), "n": torch.tensor(9)}
    out = fuse(g, loc, 0.72)  # 0.72 * W + 0.28 * w_hat
    assert torch.allclose(out["w"], torch.tensor([2.8, 7.2]))
    assert int(out["n"]) == 9


# ----------------------------------------------------------------------------- masks

def test_layer_roles_stem_untouched_first_conv_and_first_shortcut_out_only():
    roles = layer_roles(tiny_net(), "official")
    assert roles == {"features.conv1": "stem", "features.conv2": "out", "features.conv3": "in_out",
                     "features.bn1": "stem", "features.bn2": "norm", "features.bn3": "norm", "head": "linear"}
    from raysim.models import build
    r = layer_roles(build("resnet10", num_classes=10), "official")
    assert r["features.conv1"] == "stem" and r["features.bn1"] == "stem"
    assert r["features.layer1.0.conv1"] == "out" and r["features.layer2.0.shortcut.conv"] == "out"
    assert r["features.layer3.0.shortcut.conv"] == "in_out" and r["features.layer1.0.conv2"] == "in_out"
    assert r["head"] == "linear" and r["features.layer4.0.bn2"] == "norm"


@pytest.mark.parametrize("rho, n_pruned", [(0.0, 0), (0.2, 1), (0.4, 2), (0.6, 3), (0.8, 4)])
def test_masks_keep_exactly_the_highest_norm_channels(rho, n_pruned):
    net = hand_weights(tiny_net())
    masks = prune_masks(net, rho, "official")
    keep = 5 - n_pruned
    assert num_pruned(5, rho) == n_pruned
    assert set(masks) == {"features.conv2.weight", "features.conv3.weight", "features.bn2.weight",
                          "features.bn3.weight", "head.weight"}  # stem conv and stem BN: never
    in_rank, out_rank = [0, 2, 4, 3, 1], [1, 3, 4, 0, 2]
    m3 = masks["features.conv3.weight"]
    assert m3.shape == (5, 5, 3, 3)
    m_out, m_in = m3[:, :, 0, 0].any(1), m3[:, :, 0, 0].any(0)
    assert kept(m_in) == set(in_rank[:keep]) and kept(m_out) == set(out_rank[:keep])
    assert torch.equal(m3, (m_out.view(5, 1, 1, 1) & m_in.view(1, 5, 1, 1)).expand(5, 5, 3, 3))
    assert int(m3.sum()) == keep * keep * 9
    m2 = masks["features.conv2.weight"]  # output filters only: every input channel stays
    assert kept(m2[:, :, 0, 0].any(1)) == set([3, 0, 4, 1, 2][:keep]) and bool(m2[:, :, 0, 0].any(0).all())
    assert kept(masks["features.bn3.weight"]) == set([1, 4, 2, 0, 3][:keep])
    assert kept(masks["features.bn2.weight"]) == set([4, 0, 2, 3, 1][:keep])
    assert kept(masks["head.weight"].all(0)) == set([4, 0, 1, 2, 3][:keep])  # L2, not L1 (at 0.6: {4, 0})
    assert masks["head.weight"].any(0).sum() == keep


@pytest.mark.parametrize("rho, n_pruned", [(0.0, 0), (0.2, 1), (0.4, 2), (0.6, 3), (0.8, 4)])
def test_default_masks_prune_the_lowest_l1_filters_and_a_rho_share_of_every_layer(rho, n_pruned):
    """The paper's reading: "rho_i determines the proportion of 0 in M_i^t", channel-wise L1."""
    net = hand_weights(tiny_net())
    assert DapperFL.Hparams().prune_scheme == "filters"
    assert layer_roles(net) == {"features.conv1": "stem", "features.conv2": "out", "features.conv3": "out",
                                "features.bn1": "stem", "features.bn2": "norm", "features.bn3": "norm",
                                "head": "linear"}
    masks = prune_masks(net, rho)
    keep = 5 - n_pruned
    # conv3 filter L1 = a[o] * sum(b) = 15 * [2, 5, 1, 4, 3]: rank 1 > 3 > 4 > 0 > 2; every input kept
    m3 = masks["features.conv3.weight"][:, :, 0, 0]
    assert kept(m3.any(1)) == set([1, 3, 4, 0, 2][:keep]) and torch.equal(m3, m3.any(1, keepdim=True).expand(5, 5))
    assert kept(masks["features.conv2.weight"][:, :, 0, 0].any(1)) == set([3, 0, 4, 1, 2][:keep])
    assert kept(masks["features.bn3.weight"]) == set([1, 4, 2, 0, 3][:keep])
    assert kept(masks["head.weight"].all(0)) == set([4, 0, 1, 2, 3][:keep])
    for key, m in masks.items():  # exactly rho of every pruned tensor is 0 (5 channels: rho * 5 is whole)
        assert int((~m).sum()) == pytest.approx(rho * m.numel()), key


def test_default_masks_on_resnet10_keep_the_nominal_share():
    from raysim.models import build
    net = build("resnet10", num_classes=10)
    for rho in (0.2, 0.4, 0.6, 0.8):
        masks = prune_masks(net, rho)
        for key, m in masks.items():  # round(rho * C) of C channels pruned in every layer
            c = m.shape[1] if key == "head.weight" else m.shape[0]
            assert int((~m).sum()) == num_pruned(c, rho) * (m.numel() // c), key
            assert abs(int((~m).sum()) / m.numel() - rho) <= 0.5 / c
    # the code's scheme, for contrast, zeroes 1 - (1 - rho)^2 of an in+out conv: 96% at rho = 0.8
    official = prune_masks(net, 0.8, "official")["features.layer3.0.conv2.weight"]
    assert int(official.sum()) == 51 * 51 * 9 and float((~official).float().mean()) > 0.95


def test_out_mask_is_scored_on_the_in_masked_weights():
    # W[0] = [1, 0], W[1] = [0.4, 0.9]: in-norms 1.4 > 0.9 keep input 0; on that input filter 0 (1.0)
    # beats filter 1 (0.4), although filter 1 has the larger L1 overall (1.3 > 1.0).
    net = tiny_net()
    conv = nn.Conv2d(2, 2, 1, bias=False)
    with torch.no_grad():
        conv.weight.copy_(torch.tensor([[1.0, 0.0], [0.4, 0.9]]).view(2, 2, 1, 1))
    net.features.conv3 = conv
    m = prune_masks(net, 0.5, "official")["features.conv3.weight"].view(2, 2)
    assert torch.equal(m, torch.tensor([[True, False], [False, False]]))


def test_resnet_mask_sizes_match_the_spec_count():
    from raysim.models import build
    net = build("resnet10", num_classes=10)
    total = sum(p.numel() for p in net.parameters())
    assert total == 4_903_242
    masks = prune_masks(net, 0.2, "official")
    assert total - sum(int((~m).sum()) for m in masks.values()) == 3_151_527  # spec section 7.4
    assert all(bool(m.all()) for m in prune_masks(net, 0.0).values())
    # layer2.0.conv2 (128 -> 128): 102 of 128 inputs and outputs kept, 102 * 102 * 9 entries
    assert int(masks["features.layer2.0.conv2.weight"].sum()) == 102 * 102 * 9


# ----------------------------------------------------------------------------- pruned forward

def test_masked_conv_equals_the_physically_compact_conv():
    net = tiny_net(seed=3)
    masks = prune_masks(net, 0.4, "official")
    apply_masks(net, masks)
    m = masks["features.conv3.weight"][:, :, 0, 0]
    outs, ins = torch.nonzero(m.any(1)).flatten(), torch.nonzero(m.any(0)).flatten()
    compact = nn.Conv2d(len(ins), len(outs), 3, padding=1, bias=False)
    with torch.no_grad():
        compact.weight.copy_(net.features.conv3.weight[outs][:, ins])
    x = torch.randn(2, 5, 6, 6)
    full = net.features.conv3(x)
    assert torch.allclose(full[:, outs], compact(x[:, ins]), atol=1e-6)
    assert torch.count_nonzero(full[:, [c for c in range(5) if c not in outs.tolist()]]) == 0


def test_pruned_forward_matches_dense_model_with_those_channels_zeroed():
    net = hand_weights(tiny_net(seed=1))
    dense = copy.deepcopy(net)
    apply_masks(net, prune_masks(net, 0.4, "official"))
    with torch.no_grad():  # zero by hand the channels the rankings above prune at rho = 0.4
        dense.features.conv3.weight[[0, 2]] = 0  # output filters 0, 2
        dense.features.conv3.weight[:, [3, 1]] = 0  # input channels 3, 1
        dense.features.conv2.weight[[1, 2]] = 0  # filters 1, 2 of the out-only conv
        dense.features.bn3.weight[[0, 3]] = 0
        dense.features.bn2.weight[[3, 1]] = 0
        dense.head.weight[:, [2, 3]] = 0
    x = torch.randn(4, 3, 6, 6)
    net.eval(), dense.eval()
    assert torch.allclose(net(x), dense(x), atol=1e-6)
    # the predictor on the kept columns only is the same function
    z = net.features(x)
    cols = [0, 1, 4]
    assert torch.allclose(net.head(z), z[:, cols] @ net.head.weight[:, cols].T + net.head.bias, atol=1e-6)


# ----------------------------------------------------------------------------- Eq. 3

def test_local_objective_eq5_by_hand():
    # softmax([0, ln 3]) = [1/4, 3/4]; y = 1: CE = -ln(3/4) = 0.287682; |K| = 2 -> 0.143841
    # z = [3, 4]: ||z||^2 = 25, gamma = 0.01 -> 0.25;  ||z|| = 5 -> 0.05
    logits, y, z = torch.tensor([[0.0, float(torch.log(torch.tensor(3.0)))]]), torch.tensor([1]), torch.tensor([[3.0, 4.0]])
    assert float(local_objective(logits, y, z, 0.01, "squared", 2)) == pytest.approx(0.143841 + 0.25, abs=1e-5)
    assert float(local_objective(logits, y, z, 0.01, "l2", 1)) == pytest.approx(0.287682 + 0.05, abs=1e-5)
    assert float(local_objective(logits, y, z, 0.0, "squared", 1)) == pytest.approx(0.287682, abs=1e-5)


def test_dar_by_hand_and_the_tap_sees_the_predictor_input():
    z = torch.tensor([[3.0, 4.0], [0.0, 1.0]])
    assert float(dar_term(z, "squared")) == pytest.approx((25 + 1) / 2)  # mean ||z||^2 = 13
    assert float(dar_term(z, "l2")) == pytest.approx((5 + 1) / 2)  # mean ||z|| = 3
    net = tiny_net()
    tap = RepresentationTap(net)
    x = torch.randn(2, 3, 6, 6)
    net.eval()
    net(x)
    assert torch.equal(tap.z, net.features(x))
    tap.remove()
    net(x)
    assert tap.z is None


def test_the_tap_reports_the_mean_representation_norm_over_its_forward_passes():
    """z_norm, the collapse check in each client's metrics: mean over batches of mean_b ||z_b||."""
    net = tiny_net().eval()
    tap = RepresentationTap(net)
    x1, x2 = torch.randn(2, 3, 6, 6), torch.randn(3, 3, 6, 6)
    with torch.no_grad():
        net(x1)
        net(x2)
        by_hand = [net.features(x).flatten(1).norm(dim=1).mean().item() for x in (x1, x2)]
    assert tap.batches == 2
    assert tap.mean_norm == pytest.approx(sum(by_hand) / 2, rel=1e-6)
    tap.remove()


# ----------------------------------------------------------------------------- Eqs. 6-7

def test_aggregation_fills_pruned_slots_from_the_previous_global_model():
    prev = {"w": torch.tensor([10.0, 20.0, 30.0, 40.0]), "b": torch.tensor([0.0]), "n": torch.tensor(0)}
    # client A (n=1) kept slots 0, 2; client B (n=3) kept 0, 1; uploads are w * M (zeros where pruned)
    a = Upload({"w": torch.tensor([1.0, 0.0, 3.0, 0.0]), "b": torch.tensor([2.0]), "n": torch.tensor(4)}, 1.0,
               {"masks": {"w": torch.tensor([True, False, True, False])}})
    b = Upload({"w": torch.tensor([5.0, 6.0, 0.0, 0.0]), "b": torch.tensor([6.0]), "n": torch.tensor(8)}, 3.0,
               {"masks": {"w": torch.tensor([True, True, False, False])}})
    # Eq. 6: A -> [1, 20, 3, 40], B -> [5, 6, 30, 40]; Eq. 7: (1 * A + 3 * B) / 4
    assert torch.equal(recover(a.tensors, a.extras["masks"], prev)["w"], torch.tensor([1.0, 20.0, 3.0, 40.0]))
    m = DapperFL(DapperFL.Hparams(), setup(2))
    new = m.aggregate({"global": prev}, AllUploads({0: a, 1: b}), 1)
    assert torch.allclose(new["global"]["w"], torch.tensor([4.0, 9.5, 23.25, 40.0]))
    assert torch.allclose(new["global"]["b"], torch.tensor([5.0]))  # (2 + 18) / 4: unmasked, as uploaded
    assert new["global"]["n"].dtype == torch.int64 and int(new["global"]["n"]) == 7  # (4 + 24) / 4
    assert torch.equal(prev["w"], torch.tensor([10.0, 20.0, 30.0, 40.0]))  # the old state is untouched
    # the official code's zero-fill: (1 * [1, 0, 3, 0] + 3 * [5, 6, 0, 0]) / 4
    z = DapperFL(DapperFL.hparams_from({"official_compat": True}), setup(2))
    new = z.aggregate({"global": prev}, AllUploads({0: a, 1: b}), 1)
    assert torch.allclose(new["global"]["w"], torch.tensor([4.0, 4.5, 0.75, 0.0]))


def test_weighted_mean_by_hand():
    out = weighted_mean([({"w": torch.tensor([1.0])}, 2.0), ({"w": torch.tensor([4.0])}, 1.0)], like={"w": torch.zeros(1)})
    assert torch.allclose(out["w"], torch.tensor([2.0]))  # (2 * 1 + 1 * 4) / 3


# ----------------------------------------------------------------------------- tiers

def test_tiers_five_levels_two_clients_each():
    assert level_tiers(10, 5, how="round_robin").tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4]  # the code's k mod 5
    seeded = level_tiers(10, 5, how="random", seed=0).tolist()
    assert sorted(seeded) == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert seeded == level_tiers(10, 5, how="random", seed=0).tolist()
    assert any(level_tiers(10, 5, how="random", seed=s).tolist() != seeded for s in (1, 2, 3))
    assert level_counts(12, None, 5) == [3, 3, 2, 2, 2]  # 2.4 each, largest remainder to the first
    assert level_counts(10, (1, 0, 0, 0, 3), 5) == [3, 0, 0, 0, 7]  # 2.5 / 7.5: tie to the lower tier
    m = DapperFL(DapperFL.hparams_from({"tier_assignment": "modulo"}), setup())
    assert [m.client_rho(c) for c in range(10)] == [0.0, 0.2, 0.4, 0.6, 0.8] * 2
    m = DapperFL(DapperFL.hparams_from({"rho": 0.6}), setup())
    assert {m.client_rho(c) for c in range(10)} == {0.6}
    m = DapperFL(DapperFL.Hparams(), setup(2, client_profiles=({"tier": 0, "rho": 0.3}, {"tier": 4})))
    assert (m.client_rho(0), m.client_rho(1)) == (0.3, 0.8)


def test_client_footprint_is_the_papers_premise_for_the_memory_budget():
    """rho = 0.6 (tier C4): the device holds 0.4 of the dense model (params and MACs). The clock
    does not read it: it meters the dense fine-tune epoch, the pruned epochs and the BN pass
    themselves (tests/engine/test_clock.py)."""
    dense = {"params": 1000.0, "macs": 300.0}
    s = setup(2, client_profiles=({"tier": 3}, {"tier": 0}))
    s = dataclasses.replace(s, train=TrainConfig(epochs=5))
    m = DapperFL(DapperFL.Hparams(), s)
    assert m.client_footprint(0, dense) == pytest.approx({"params": 400.0, "macs": 120.0})
    assert m.client_footprint(1, dense) == pytest.approx(dense)


def test_hparams_types_and_errors():
    hp = DapperFL.hparams_from({"rho_levels": [0, 0.5], "tier_shares": [1, 3], "gamma": 0})
    assert hp.rho_levels == (0.0, 0.5) and hp.tier_shares == (1.0, 3.0) and hp.gamma == 0.0
    d = DapperFL.Hparams()
    assert (d.alpha0, d.alpha_min, d.epsilon, d.gamma, d.rho_levels) == (0.9, 0.1, 0.2, 0.01, (0, .2, .4, .6, .8))
    # the defaults rule: gamma was tuned with the code's unsquared DAR; the code's guard skips round 1's fusion
    assert (d.use_fusion, d.use_recovery, d.use_dar_form, d.use_ce_norm, d.use_prune_scheme) == (
        True, "global", "l2", "batch", "filters")
    assert d.bn_stats == "recovered"
    assert d.fuse_from_round == 2
    o = DapperFL.hparams_from({"official_compat": True})
    assert (o.use_fusion, o.use_recovery, o.use_dar_form, o.use_ce_norm, o.use_prune_scheme) == (
        False, "zero", "l2", "batch", "official")
    for bad in ({"rho_levels": [1.0]}, {"tier_shares": [1, 2]}, {"recovery": "mean"}, {"rho": 1.5},
                {"dar_form": "l1"}, {"bn_stats": "dense"}, {"nope": 1}):
        with pytest.raises(UserError):
            DapperFL.hparams_from(bad)
    assert set(DapperFL.Hparams.search_space()) == {"alpha0", "gamma", "rho"}


# ----------------------------------------------------------------------------- the client step

def test_local_update_trains_the_masked_model_and_reports_its_footprint():
    m = DapperFL(DapperFL.hparams_from({"rho": 0.4}), setup())
    net = tiny_net()
    ctx = context(m, net, rnd=2, epochs=3)
    up = m.local_update(ctx)
    masks = up.extras["masks"]
    assert set(masks) == {"features.conv2.weight", "features.conv3.weight", "features.bn2.weight",
                          "features.bn3.weight", "head.weight"}
    for k, mask in masks.items():  # pruned entries are exactly 0 after the pruned epochs
        assert torch.count_nonzero(up.tensors[k][~mask]) == 0 and mask.dtype == torch.bool
    assert not torch.equal(up.tensors["features.conv1.weight"], ctx.payload["global"]["features.conv1.weight"])
    mt = up.metrics
    assert mt["steps"] == 3 * 2 and mt["rho"] == 0.4 and mt["alpha"] == pytest.approx(0.72)
    assert mt["z_norm"] > 0  # a fresh tiny net's representation is not collapsed
    assert mt["kept_params"] == mt["params"] - sum(int((~k).sum()) for k in masks.values())
    assert mt["nominal_params"] == pytest.approx(0.6 * mt["params"]) and mt["flops"] < mt["flops_dense"]
    assert up.weight == 8.0
    # round 1: the code's guard skips the fusion (default); Eq. 2 literally: alpha^1 = alpha0; official_compat: never
    assert m.local_update(context(m, tiny_net(), rnd=1)).metrics["alpha"] == 0.0
    g = DapperFL(DapperFL.hparams_from({"rho": 0.4, "fuse_from_round": 1}), setup())
    assert g.local_update(context(g, tiny_net(), rnd=1)).metrics["alpha"] == pytest.approx(0.9)
    o = DapperFL(DapperFL.hparams_from({"rho": 0.4, "official_compat": True}), setup())
    up_o = o.local_update(context(o, tiny_net(), rnd=3))
    assert up_o.metrics["alpha"] == 0.0
    # the default prunes conv3's output filters only; official_compat also its input channels
    m3, o3 = masks["features.conv3.weight"][:, :, 0, 0], up_o.extras["masks"]["features.conv3.weight"][:, :, 0, 0]
    assert int(m3.sum()) == 3 * 5 and int(o3.sum()) == 3 * 3


def test_local_update_rho_zero_one_epoch_and_step_cap():
    m = DapperFL(DapperFL.hparams_from({"tier_assignment": "modulo"}), setup())
    up = m.local_update(context(m, tiny_net(), cid=5, epochs=1))  # client 5: tier C1, rho = 0
    assert up.extras["masks"] == {} and up.metrics["steps"] == 2 and up.metrics["kept_params"] == up.metrics["params"]
    # max_steps caps the round: 3 of 5 epochs' worth -> 1 fine-tune step + 2 pruned steps
    up = m.local_update(context(m, tiny_net(), cid=4, epochs=5, max_steps=3))
    assert up.metrics["steps"] == 3 and up.metrics["rho"] == 0.8


def test_client_loss_is_ce_over_the_client_labels():
    # lr = 0: the weights never move, so each run sees the same logits; |K| = 3 (label space)
    losses = {}
    for norm in ("labels", "batch"):
        m = DapperFL(DapperFL.hparams_from({"rho": 0.4, "gamma": 0.0, "ce_norm": norm}), setup())
        losses[norm] = m.local_update(context(m, tiny_net(), epochs=2, lr=0.0)).metrics["loss"]
    assert losses["labels"] == pytest.approx(losses["batch"] / 3, rel=1e-5)

    data = client_data(torch.zeros(4, 3, 6, 6), torch.tensor([0, 2, 2, 0]))
    assert m.num_labels(type("Ctx", (), {"data": data})()) == 2


def test_footprint_table_resnet10_matches_nominal_and_measured_counts():
    rows = footprint_table("resnet10", (0.0, 0.2), scheme="official", show=False)
    assert rows[0]["kept_params"] == rows[0]["params"] == 4_903_242
    assert rows[0]["flops"] == rows[0]["flops_dense"] == pytest.approx(254.17e6, rel=1e-4)  # Table 5 basis
    assert rows[1]["nominal_params"] == pytest.approx(3.92e6, rel=1e-3)  # Table 5: 3.92M
    assert rows[1]["nominal_flops"] == pytest.approx(203.34e6, rel=1e-4)  # Table 5: 203.34M
    assert rows[1]["kept_params"] == 3_151_527 and rows[1]["flops"] < rows[1]["nominal_flops"]
    # the default (paper) masks: measured within 0.5% of Table 5's nominal 3.92M / 203.34M at rho = 0.2
    paper = footprint_table("resnet10", (0.2, 0.8), show=False)
    assert paper[0]["kept_params"] == pytest.approx(3.92e6, rel=2e-3)
    assert paper[0]["flops"] == pytest.approx(203.34e6, rel=2e-3)
    assert paper[1]["kept_params"] == pytest.approx(0.98e6, rel=2e-3)  # Table 5: 0.98M at rho = 0.8


def test_without_pruning_fusion_and_dar_it_is_fedavg():
    """rho = 0, no fusion, gamma = 0, plain CE: the client step and the server step are FedAvg's."""
    from raysim.methods.fedavg import FedAvg
    d = DapperFL(DapperFL.hparams_from({"rho": 0.0, "fusion": False, "gamma": 0.0, "ce_norm": "batch"}), setup())
    f = FedAvg(FedAvg.Hparams(), setup())
    ups = {}
    for name, m in (("dapperfl", d), ("fedavg", f)):
        ups[name] = [m.local_update(context(m, tiny_net(), cid=c, rnd=2, epochs=3)) for c in range(2)]
    for a, b in zip(ups["dapperfl"], ups["fedavg"]):
        assert a.extras["masks"] == {} and a.tensors.keys() == b.tensors.keys()
        assert all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)
    prev = {k: v.clone() for k, v in tiny_net().state_dict().items()}
    new = d.aggregate({"global": prev}, AllUploads(dict(enumerate(ups["dapperfl"]))), 2)["global"]
    mean = {k: (ups["fedavg"][0].tensors[k].double() * 8 + ups["fedavg"][1].tensors[k].double() * 8) / 16 for k in prev}
    for k in prev:
        if prev[k].is_floating_point():
            assert torch.allclose(new[k], mean[k].float(), atol=1e-6)


# ----------------------------------------------------------------------------- BN statistics of the global model

def bn_input_stats(net, x):
    """(mean, unbiased var) per channel of every BN layer's input on one train-mode pass over x:
    what a BN layer that saw exactly this batch would store as running statistics."""
    seen, hooks = {}, []
    for name, mod in net.named_modules():
        if isinstance(mod, nn.BatchNorm2d):
            hooks.append(mod.register_forward_pre_hook(
                lambda m, inp, name=name: seen.__setitem__(name, (inp[0].mean((0, 2, 3)),
                                                                  inp[0].var((0, 2, 3), unbiased=True)))))
    net.train()
    with torch.no_grad():
        net(x)
    for h in hooks:
        h.remove()
    return seen


@pytest.mark.parametrize("rho", [0.4, 0.8])
def test_global_model_bn_statistics_are_those_of_the_dense_global_model(rho):
    """One pruned client (all its 8 samples in one batch): the aggregate is its Eq.-6-recovered
    model, and the BN running statistics the server ends up with must be that dense model's own
    statistics on the client's data. The pruned sub-network's statistics (what the pruned epochs
    leave in the BN buffers) do not describe it: averaged into the global model they made its
    eval-mode activations explode (recovery from W^{t-1}) or vanish (zero-fill), and the global
    model scored chance on digits5 while its training loss fell."""
    data = fake_data(n=8)
    results = {}
    for mode, extra in (("default", {}), ("pruned", {"bn_stats": "pruned"})):
        m = DapperFL(DapperFL.hparams_from({"rho": rho, **extra}), setup(1))
        net = tiny_net()
        prev = {k: v.detach().clone() for k, v in net.state_dict().items()}
        ctx = context(m, net, rnd=2, epochs=3)
        ctx = dataclasses.replace(ctx, data=data, train=dataclasses.replace(ctx.train, batch_size=8))
        up = m.local_update(ctx)
        for k, mask in up.extras["masks"].items():  # the upload is still the pruned model w * M
            assert torch.count_nonzero(up.tensors[k][~mask]) == 0
        new = m.aggregate({"global": prev}, AllUploads({0: up}), 2)["global"]
        glob = tiny_net()
        glob.load_state_dict(new)
        x = torch.cat([xb for xb, _ in data.train.eval_batches(8, None)])  # the client's 8 images
        expected = bn_input_stats(copy.deepcopy(glob), x)
        results[mode] = max(max(float((new[f"{n}.running_mean"] - mu).abs().max()),
                                float((new[f"{n}.running_var"] - var).abs().max()))
                            for n, (mu, var) in expected.items())
    assert results["default"] < 1e-4
    assert results["pruned"] > 1e-2  # the literal reading: statistics of a different network



def test_footprint_table_of_a_run_from_its_client_metrics(tmp_path, capsys):
    from raysim.methods.dapperfl import footprint_from_run
    from raysim.engine.messages import RoundSummary
    from raysim.engine.metrics import MetricsLog
    m = DapperFL(DapperFL.hparams_from({"tier_assignment": "modulo"}), setup(10))
    log = MetricsLog()
    metrics = {c: m.local_update(context(m, tiny_net(), cid=c, rnd=1, epochs=2)).metrics for c in (0, 4, 5)}
    log.add_round(1, RoundSummary(round=1, client_metrics=metrics, train_loss=0.0, bytes_up=0, bytes_down=0),
                  domain_of=lambda c: f"d{c // 2}")
    (tmp_path / "dapperfl").mkdir()
    log.write(str(tmp_path / "dapperfl" / "metrics.parquet"))
    from raysim.app import rundir
    fed = rundir.method_dirs(str(tmp_path))["dapperfl"]  # a comparison's folder: finds dapperfl/
    rows = footprint_from_run(rundir.read_metrics(fed))
    assert [(r["tier"], r["rho"], r["clients"]) for r in rows] == [("C1", 0.0, "0 (d0), 5 (d2)"),
                                                                   ("C5", 0.8, "4 (d2)")]
    assert rows[0]["kept_params"] == rows[0]["params"] == metrics[0]["params"]
    assert rows[1]["kept_params"] == metrics[4]["kept_params"] < rows[1]["params"]
    assert rows[1]["flops"] == metrics[4]["flops"]
    out = capsys.readouterr().out
    assert "C5     0.8 |" in out and "C1: clients 0 (d0), 5 (d2)" in out
    with pytest.raises(UserError):
        footprint_from_run(rundir.read_metrics(fed).iloc[:0])
    # the same rows go into summary.md through the method's report hook
    from raysim.app.report import method_section
    md = method_section(fed, rundir.read_metrics(fed))
    c5 = f"| C5 | 0.8 | 4 (d2) | {0.2 * metrics[4]['params'] / 1e6:.3f}M | {metrics[4]['kept_params'] / 1e6:.3f}M |"
    assert "## DapperFL footprint per capability tier" in md and c5 in md
    # the round's forward FLOPs by hand (8 samples, batch 4, E = 2: one dense epoch, one pruned), and
    # bn_stats: recovered's extra dense pass over the 8 samples (none at rho = 0: nothing to recover)
    f4 = metrics[4]
    assert f4["fwd_flops_train"] == f4["flops_dense"] * 8 + f4["flops"] * 8
    assert f4["fwd_flops_bn_pass"] == f4["flops_dense"] * 8 and metrics[0]["fwd_flops_bn_pass"] == 0.0
    share = 100 * f4["fwd_flops_bn_pass"] / (3 * f4["fwd_flops_train"] + f4["fwd_flops_bn_pass"])
    assert f"{f4['fwd_flops_bn_pass'] / 1e9:.2f}G ({share:.1f}%)" in md and "`bn_stats: recovered`" in md
    assert DapperFL.report_markdown(None, rundir.read_metrics(fed).iloc[:0]) == ""


# ----------------------------------------------------------------------------- the order of Alg. 1 lines 1-3

def _one_epoch(hp: dict, net_seed=0, rnd=1, lr=0.5):
    """DapperFL's client step with E = 1 (the fine-tune epoch, fusion and masking; no pruned
    epoch), plain SGD, no DAR: the upload is the fused (and masked) w_hat."""
    m = DapperFL(DapperFL.hparams_from({"gamma": 0.0, "bn_stats": "pruned", "fuse_from_round": 1, **hp}), setup())
    net = tiny_net(net_seed)
    received = {k: v.detach().clone() for k, v in net.state_dict().items()}
    ctx = context(m, net, rnd=rnd, epochs=1, lr=lr)
    ctx = dataclasses.replace(ctx, train=dataclasses.replace(ctx.train, momentum=0.0, weight_decay=0.0))
    return m.local_update(ctx), received


def test_fusion_weights_the_previous_global_model_by_alpha():
    """Eq. 1 in the client step: w = alpha W^{t-1} + (1 - alpha) w_hat, alpha^1 = 0.9. w_hat comes
    from the same step with fusion off; with the operands swapped (alpha on w_hat) this fails."""
    w_hat, received = _one_epoch({"rho": 0.0, "fusion": False})
    fused, _ = _one_epoch({"rho": 0.0})
    assert fused.metrics["alpha"] == pytest.approx(0.9)
    moved = 0
    for k, v in fused.tensors.items():
        if not v.is_floating_point():
            continue
        expected = 0.9 * received[k] + 0.1 * w_hat.tensors[k]
        assert torch.allclose(v, expected, atol=1e-6), k
        moved += int(not torch.allclose(w_hat.tensors[k], received[k]))
    assert moved >= 5  # the fine-tune epoch really moved the weights, so the order is visible


def test_masks_are_computed_on_the_fused_weights():
    """Alg. 1 line 3 prunes the fused model (line 2), not the fine-tuned one: the masks the client
    sends are the L1 masks of alpha W^{t-1} + (1 - alpha) w_hat. The case is chosen so that they
    differ from the masks of w_hat in at least one layer (checked), so computing the masks before
    the fusion fails this test."""
    rho = 0.6
    w_hat, received = _one_epoch({"rho": 0.0, "fusion": False}, net_seed=3, lr=2.0)
    up, _ = _one_epoch({"rho": rho}, net_seed=3, lr=2.0)
    probe = tiny_net(3)
    fused = {k: (0.9 * received[k] + 0.1 * w_hat.tensors[k]) if received[k].is_floating_point() else received[k]
             for k in received}
    probe.load_state_dict(fused)
    expected = {k: m for k, m in prune_masks(probe, rho).items() if not bool(m.all())}
    probe.load_state_dict(w_hat.tensors)
    before_fusion = {k: m for k, m in prune_masks(probe, rho).items() if not bool(m.all())}
    assert any(not torch.equal(expected[k], before_fusion[k]) for k in expected)  # the case discriminates
    assert set(up.extras["masks"]) == set(expected)
    for k, mask in expected.items():
        assert torch.equal(up.extras["masks"][k], mask), k
        # and the upload is the fused model times those masks
        assert torch.allclose(up.tensors[k], fused[k] * mask, atol=1e-6), k
