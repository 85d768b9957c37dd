"""FedDrop, FedMP and NeFL: their equations on tiny tensors (every expected value worked out by
hand), the sub-model machinery they share, their footprints and one client step each."""
from collections import OrderedDict
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from raysim.core.aggregation import AllUploads
from raysim.config import ModelConfig, TrainConfig
from raysim.core.contract import Upload
from raysim.core.errors import UserError
from raysim.methods.feddrop import FedDrop, dropout_plan
from raysim.methods.fedmp import FedMP, filter_scores, l1_plan, r2sp
from raysim.methods.nefl import NeFL, add_steps, group_mean, inconsistent_keys, nefedavg, nested_plan
from raysim.methods.lib.channels import channel_groups, embed, extract, key_dims, rescale_inputs, slices, train_masks
from raysim.methods.lib.masks import apply_masks, num_kept
from raysim.methods.lib.submodels import holder_mean, recover
from raysim.models import build, count_flops, count_params
from raysim.models.base import Net, default_conv
from raysim.models.resnet_cifar import BasicBlock, ResNetCIFAR
from raysim import testing

T = torch.tensor


# ----------------------------------------------------------------------------- helpers

def tiny_net():
    """conv 1->4 (1x1, bias), BN(4), ReLU, GAP, Linear 4->2: one channel group of 4."""
    feats = nn.Sequential(OrderedDict([
        ("conv1", nn.Conv2d(1, 4, 1)), ("bn1", nn.BatchNorm2d(4)), ("relu1", nn.ReLU()),
        ("pool", nn.AdaptiveAvgPool2d(1)), ("flat", nn.Flatten()),
    ]))
    return Net(feats, nn.Linear(4, 2), (1, 3, 3))


def tiny_net2():
    """conv 1->4, BN, ReLU, conv 4->4, BN, ReLU, GAP, Linear 4->2: groups 0 (stem) and 1."""
    feats = nn.Sequential(OrderedDict([
        ("conv1", nn.Conv2d(1, 4, 1)), ("bn1", nn.BatchNorm2d(4)), ("relu1", nn.ReLU()),
        ("conv2", nn.Conv2d(4, 4, 1)), ("bn2", nn.BatchNorm2d(4)), ("relu2", nn.ReLU()),
        ("pool", nn.AdaptiveAvgPool2d(1)), ("flat", nn.Flatten()),
    ]))
    return Net(feats, nn.Linear(4, 2), (1, 3, 3))


def setup(num_clients=2, model="small_cnn", shape=(1, 3, 3)):
    return testing.setup(num_classes=2, image_shape=shape, num_clients=num_clients,
                         client_domains=tuple("d" for _ in range(num_clients)), model=ModelConfig(name=model), rounds=2)


def method(cls, net_fn=tiny_net, num_clients=2, **hp):
    class Tiny(cls):
        def build_model(self):
            torch.manual_seed(0)
            net = net_fn()
            return add_steps(net) if cls is NeFL and self.hp.learnable_step else net
    return Tiny(cls.Hparams.from_dict(hp), setup(num_clients))


def context(m, net, cid=0, rnd=1, seed=123):
    train = TrainConfig(epochs=2, batch_size=4, lr=0.1, momentum=0.9)
    data = testing.random_client_data(image_shape=(1, 3, 3), num_classes=2)  # 8 images, seed 0
    return testing.client_context(m, net, data, client_id=cid, round=rnd, train=train, seed=seed, domain="d")


# ----------------------------------------------------------------------------- shared: how many, where

def test_num_kept_by_hand():
    # size - round(rho * size), halves up: 64 - 38 = 26; 5 - 3 = 2 (2.5 -> 3); 4 - 3 = 1; never 0
    assert [num_kept(64, 0.6), num_kept(5, 0.5), num_kept(4, 0.8), num_kept(10, 0.0), num_kept(1, 0.8)] == [26, 2, 1, 10, 1]


def test_extract_and_embed_by_hand():
    w = torch.arange(12.0).view(3, 4)  # rows 0..2, columns 0..3
    sl = {"w": (T([0, 2]), T([1, 3])), "b": (T([2]), None)}
    sub = extract({"w": w, "b": T([5.0, 6.0, 7.0]), "c": T(1.0)}, sl)
    assert sub["w"].tolist() == [[1.0, 3.0], [9.0, 11.0]] and sub["b"].tolist() == [7.0] and sub["c"].item() == 1.0
    back = embed(T([[-1.0, -2.0], [-3.0, -4.0]]), T([0, 2]), T([1, 3]), torch.zeros(3, 4))
    assert back.tolist() == [[0, -1, 0, -2], [0, 0, 0, 0], [0, -3, 0, -4]]


def test_flattened_columns_follow_their_channel():
    # small_cnn at 8 px: conv2 (32 ch) -> 2x2 map -> fc1 reads 128 columns, channel c = columns 4c..4c+3
    net = build("small_cnn", num_classes=2, in_channels=1, input_size=8)
    groups = channel_groups(net)
    dims = key_dims(net, groups)
    assert dims["features.fc1.weight"] == (2, 1, 4)
    sl = slices(dims, {1: T([0, 2])})
    assert sl["features.fc1.weight"][1].tolist() == [0, 1, 2, 3, 8, 9, 10, 11]


def test_resnet_residual_stream_is_one_group():
    net = build("resnet18", num_classes=2, in_channels=3, input_size=8)
    groups = channel_groups(net)
    stem = {n for n, r, _ in groups[0].members}
    # the stem's filters and every layer1 block's conv2/bn2 write the same stream; layer2's shortcut reads it
    assert {"features.conv1", "features.bn1", "features.layer1.0.conv2", "features.layer1.1.bn2",
            "features.layer2.0.shortcut.conv"} <= stem
    assert len(groups) == 12


@pytest.mark.parametrize("name, plan_fn", [
    ("resnet10", lambda sizes: nested_plan(sizes, 0.5)),
    ("resnet10", lambda sizes: dropout_plan(sizes, 0.5, torch.Generator().manual_seed(3))),
    ("small_cnn", lambda sizes: dropout_plan(sizes, 0.5, torch.Generator().manual_seed(4))),
])
def test_masked_dense_model_is_the_extracted_sub_network(name, plan_fn):
    """Training the masked dense model = training the physically smaller network: same outputs."""
    torch.manual_seed(0)
    net = build(name, num_classes=3, in_channels=3, input_size=8)
    groups = channel_groups(net)
    plan = plan_fn([g.size for g in groups])
    sl = slices(key_dims(net, groups), plan)
    apply_masks(net, train_masks(net, sl))
    if name == "resnet10":
        small = ResNetCIFAR((1, 1, 1, 1), 3, 3, 8, widths=(32, 64, 128, 256))
    else:
        small = build(name, num_classes=3, in_channels=3, input_size=8)
        small.features.conv1 = nn.Conv2d(3, 8, 5, 1, 2)
        small.features.bn1 = nn.BatchNorm2d(8)
        small.features.conv2 = nn.Conv2d(8, 16, 5, 1, 2)
        small.features.bn2 = nn.BatchNorm2d(16)
        small.features.fc1 = nn.Linear(16 * 4, 32)
        small.head = nn.Linear(32, 3)
    small.load_state_dict(extract(net.state_dict(), sl))
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    net.train(), small.train()
    assert torch.allclose(net(x), small(x), atol=1e-5)
    net.eval(), small.eval()
    assert torch.allclose(net(x), small(x), atol=1e-5)


# ----------------------------------------------------------------------------- FedDrop

def test_feddrop_masks_by_hand():
    sizes = [4, 10, 5]
    plan = dropout_plan(sizes, 0.6, torch.Generator().manual_seed(7))
    # kept = size - round(0.6 size): 4 - 2 = 2, 10 - 6 = 4, 5 - 3 = 2; the first kept of each group's permutation
    g = torch.Generator().manual_seed(7)
    expected = [torch.randperm(s, generator=g)[:k].sort().values for s, k in zip(sizes, (2, 4, 2))]
    assert [len(plan[i]) for i in range(3)] == [2, 4, 2]
    assert all(plan[i].tolist() == expected[i].tolist() for i in range(3))
    assert dropout_plan(sizes, 0.0, torch.Generator().manual_seed(7))[1].tolist() == list(range(10))


def test_feddrop_masks_are_keyed_per_client_and_round():
    m = method(FedDrop, tiny_net2, num_clients=4, rho=0.5)
    groups = m.ref.groups
    def plan(cid, rnd, seed):
        return m.plan(SimpleNamespace(client_id=cid, round=rnd, generator=torch.Generator().manual_seed(seed)), groups)
    before = torch.random.get_rng_state()
    a, a_again, b = plan(0, 1, 5), plan(0, 1, 5), plan(1, 1, 6)
    assert torch.equal(torch.random.get_rng_state(), before)  # never the global RNG
    assert all(torch.equal(a[g], a_again[g]) for g in a)
    m_round = method(FedDrop, tiny_net2, num_clients=4, rho=0.5, mask_scope="round")
    r0 = m_round.plan(SimpleNamespace(client_id=0, round=3, generator=torch.Generator().manual_seed(5)), groups)
    r1 = m_round.plan(SimpleNamespace(client_id=1, round=3, generator=torch.Generator().manual_seed(6)), groups)
    assert all(torch.equal(r0[g], r1[g]) for g in r0)  # one sub-model per round


def test_feddrop_differs_across_generators():
    sizes = [64, 64]
    a = dropout_plan(sizes, 0.5, torch.Generator().manual_seed(1))
    b = dropout_plan(sizes, 0.5, torch.Generator().manual_seed(2))
    assert not torch.equal(a[0], b[0])


def test_feddrop_mapped_back_and_holders_means_by_hand():
    prev = {"w": T([1.0, 2.0, 3.0, 4.0])}
    a = ({"w": T([10.0, 30.0])}, {"w": (T([0, 2]), None)}, 1.0)  # held 0 and 2
    b = ({"w": T([20.0, 40.0])}, {"w": (T([1, 2]), None)}, 3.0)  # held 1 and 2
    # "all": recovered a = (10, 2, 30, 4), b = (1, 20, 40, 4); (1 a + 3 b) / 4
    all_ = r2sp([a, b], prev)["w"]
    assert all_.tolist() == pytest.approx([(10 + 3) / 4, (2 + 60) / 4, (30 + 120) / 4, 4.0])
    # "holders": entry 0 only a -> 10, entry 1 only b -> 20, entry 2 (30 + 3 * 40) / 4 = 37.5, entry 3 nobody -> 4
    assert holder_mean([a, b], prev)["w"].tolist() == pytest.approx([10.0, 20.0, 37.5, 4.0])


def test_feddrop_client_step_trains_only_its_sub_model():
    m = method(FedDrop, tiny_net2, rho=0.5)
    net = m.build_model()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    up = m.local_update(context(m, net))
    plan = {int(g): i for g, i in up.extras["plan"].items()}
    assert [len(plan[0]), len(plan[1])] == [2, 2]
    assert up.tensors["features.conv2.weight"].shape == (2, 2, 1, 1)  # physically the sub-model
    assert up.tensors["head.weight"].shape == (2, 2)
    dropped = sorted(set(range(4)) - set(plan[1].tolist()))
    sd = net.state_dict()
    assert torch.all(sd["features.conv2.weight"][dropped] == 0) and torch.all(sd["features.bn2.weight"][dropped] == 0)
    kept = plan[1].tolist()
    assert not torch.equal(sd["features.conv2.weight"][kept], before["features.conv2.weight"][kept][:, :])
    # the server puts it back: the dropped rows of conv2 are W^{t-1}'s again
    state = {"global": before}
    new = m.aggregate(state, AllUploads({0: up}), 1)["global"]
    assert torch.equal(new["features.conv2.weight"][dropped], before["features.conv2.weight"][dropped])


def two_uploads(m):
    """A full model (all 1) and a sub-model holding conv2's filters {0, 2} (all 3), weight 1 each, on a
    zero global model (tiny_net2: group 1 is conv2's four filters)."""
    prev = {k: torch.zeros_like(v) for k, v in m.build_model().state_dict().items()}
    def up(value, plan):
        full = {k: torch.full_like(v, value) for k, v in prev.items()}
        extras = {"plan": {str(g): i for g, i in plan.items()}}
        return Upload(extract(full, slices(m.ref.dims, plan)), 1.0, extras=extras)
    return {"global": prev}, AllUploads({0: up(1.0, {}), 1: up(3.0, {1: T([0, 2])})})


def test_feddrop_default_maps_back_with_a_zero_update():
    """The default as it stands on this branch: "all" (the paper maps each update back and averages as
    FedAvg does): filters 0 and 2 (1 + 3) / 2 = 2, filters 1 and 3 (1 + 0) / 2 = 0.5."""
    assert FedDrop.Hparams().aggregation == "all"
    m = method(FedDrop, tiny_net2)
    out = m.aggregate(*two_uploads(m), 1)["global"]
    assert out["features.conv2.weight"].flatten(1)[:, 0].tolist() == [2.0, 0.5, 2.0, 0.5]


def test_feddrop_all_and_holders_differ_where_a_client_dropped():
    """"all": a dropped filter gets a zero update from that client, (1 + 0) / 2; "holders": only the
    full client holds filters 1 and 3, so they take its 1."""
    for mode, expected in (("all", [2.0, 0.5, 2.0, 0.5]), ("holders", [2.0, 1.0, 2.0, 1.0])):
        m = method(FedDrop, tiny_net2, aggregation=mode)
        out = m.aggregate(*two_uploads(m), 1)["global"]
        assert out["features.conv2.weight"].flatten(1)[:, 0].tolist() == expected, mode
        assert out["features.bn2.weight"].tolist() == expected, mode


# ----------------------------------------------------------------------------- FedMP

def test_fedmp_l1_masks_by_hand():
    # 4 filters with l1 norms (4, 1, 3, 2), rho 0.5: keep {0, 2}
    w = torch.stack([torch.full((2, 1, 1), v / 2) for v in (4.0, -1.0, 3.0, 2.0)])  # |.| sums 4, 1, 3, 2
    s = filter_scores([w])
    assert s.tolist() == [4.0, 1.0, 3.0, 2.0]
    assert l1_plan({0: s}, 0.5)[0].tolist() == [0, 2]
    # a residual stream with two producers: scores add, (4+0, 1+5, 3+0, 2+0) -> keep {1, 0} at rho 0.5
    w2 = torch.zeros(4, 3)
    w2[1] = T([5.0, 0.0, 0.0])
    assert l1_plan({0: filter_scores([w, w2])}, 0.5)[0].tolist() == [0, 1]
    assert l1_plan({0: s}, 0.75)[0].tolist() == [0]  # 4 - round(3) = 1 kept
    assert l1_plan({0: s}, 0.0)[0].tolist() == [0, 1, 2, 3]


def test_fedmp_residual_recovery_by_hand():
    prev = {"w": T([1.0, 2.0, 3.0, 4.0]), "n": T(2)}
    sub = {"w": T([10.0, 30.0]), "n": T(4)}
    sl = {"w": (T([0, 2]), None)}
    assert recover(sub, sl, prev)["w"].tolist() == [10.0, 2.0, 30.0, 4.0]  # (a', b, c', d)
    full = ({"w": T([5.0, 6.0, 7.0, 8.0]), "n": T(6)}, {}, 1.0)
    out = r2sp([(sub, sl, 1.0), full], prev)
    assert out["w"].tolist() == [7.5, 4.0, 18.5, 6.0]  # ((a'+a'')/2, (b+b'')/2, (c'+c'')/2, (d+d'')/2)
    assert out["n"].item() == 5


def test_fedmp_weighted_recovery_by_hand():
    prev = {"w": torch.zeros(2, 2)}
    sl = {"w": (T([1]), T([0]))}  # the sub-model holds W[1, 0] only
    a = ({"w": T([[8.0]])}, sl, 3.0)
    b = ({"w": T([[1.0, 1.0], [1.0, 1.0]])}, {}, 1.0)
    # W[1,0] = (3 * 8 + 1) / 4 = 6.25; elsewhere (3 * 0 + 1) / 4 = 0.25
    assert r2sp([a, b], prev)["w"].tolist() == [[0.25, 0.25], [6.25, 0.25]]


def test_fedmp_plan_skips_the_stem_and_ranks_the_global_model():
    m = method(FedMP, tiny_net2, rho=0.5)
    net = m.build_model()
    with torch.no_grad():
        net.features.conv2.weight.copy_(T([1.0, 4.0, 2.0, 3.0]).view(4, 1, 1, 1).expand(4, 4, 1, 1))
    plan = m.plan(SimpleNamespace(client_id=1, model=net), m.ref.groups)
    assert list(plan) == [1] and plan[1].tolist() == [1, 3]
    m2 = method(FedMP, tiny_net2, prune_stem=True)  # client 1: tier 1, rho 0.2: 4 - round(0.8) = 3 kept
    assert [len(v) for v in m2.plan(SimpleNamespace(client_id=1, model=net), m2.ref.groups).values()] == [3, 3]
    assert m2.client_rho(0) == 0.0 and m2.client_rho(1) == 0.2 and m2.client_rho(6) == 0.2


def test_fedmp_aggregate_is_r2sp_not_the_holders_mean():
    """The server step itself (spec 6.1): a client pruned to filters {0, 2} of conv2 contributes the
    global model's value (0) at filters 1 and 3: (1 + 0) / 2 = 0.5 there, not the holders' 1."""
    m = method(FedMP, tiny_net2, rho_levels=[0.0, 0.5])
    out = m.aggregate(*two_uploads(m), 1)["global"]
    assert out["features.conv2.weight"].flatten(1)[:, 0].tolist() == [2.0, 0.5, 2.0, 0.5]
    assert out["head.weight"].tolist() == [[2.0, 0.5, 2.0, 0.5]] * 2  # the head's columns follow conv2's channels


# ----------------------------------------------------------------------------- NeFL

def test_nested_plan_by_hand():
    plan = nested_plan([4, 10, 5, 64], 0.5)
    assert [p.tolist() for p in plan.values()][:3] == [[0, 1], [0, 1, 2, 3, 4], [0, 1, 2]]  # ceil(2.5) = 3
    assert len(nested_plan([64], 0.2)[0]) == 13  # ceil(12.8)
    assert len(nested_plan([10], 0.6)[0]) == 6 and len(nested_plan([10], 1.0)[0]) == 10
    narrow, wide = nested_plan([8], 0.25)[0], nested_plan([8], 0.75)[0]
    assert set(narrow.tolist()) < set(wide.tolist())  # nested


def test_nefedavg_by_hand():
    # A (width 0.5) updates channels 1-2 by (1, 1); B (full width) all four by (3, 3, 3, 3); equal weights
    prev = {"w": torch.zeros(4), "b": T([9.0, 9.0, 9.0, 9.0])}
    a = ({"w": T([1.0, 1.0]), "b": T([5.0, 5.0])}, {"w": (T([0, 1]), None), "b": (T([0, 1]), None)}, 1.0)
    b = ({"w": T([3.0, 3.0, 3.0, 3.0])}, {}, 1.0)
    out = nefedavg([a, b], prev, ["w", "b"])
    assert out["w"].tolist() == [2.0, 2.0, 3.0, 3.0]
    assert out["b"].tolist() == [5.0, 5.0, 9.0, 9.0]  # only A held b; entries nobody held keep prev
    # weights 1 : 3 -> (1 + 9) / 4 = 2.5 on the shared entries
    assert nefedavg([a, (b[0], {}, 3.0)], prev, ["w"])["w"].tolist() == [2.5, 2.5, 3.0, 3.0]


def test_inconsistent_group_mean_by_hand():
    prev = {"bn.weight": T([1.0, 1.0])}
    assert group_mean([({"bn.weight": T([2.0, 4.0])}, 1.0), ({"bn.weight": T([6.0, 8.0])}, 3.0)],
                      prev)["bn.weight"].tolist() == [5.0, 7.0]
    assert group_mean([], prev) is prev


def test_nefl_aggregate_splits_consistent_and_inconsistent():
    m = method(NeFL, tiny_net, rho_levels=[0.0, 0.5])  # client 0: width 1; client 1: width 0.5
    net = m.build_model()
    state = m.init_server(net)
    assert set(state["inconsistent"]) == {"0", "1"}
    assert state["inconsistent"]["1"]["features.bn1.weight"].shape == (2,)
    prev = state["global"]
    def upload(cid, value, bn):
        lv = m.level(cid)
        plan = m.level_plan(lv)
        sd = {k: torch.full_like(v, value) if v.is_floating_point() else v for k, v in prev.items()}
        sd["features.bn1.weight"] = torch.full((4,), bn)
        return Upload(extract(sd, slices(m.ref.dims, plan)), 1.0, extras={"plan": {str(g): i for g, i in plan.items()}})
    out = m.aggregate(state, AllUploads({0: upload(0, 3.0, 7.0), 1: upload(1, 1.0, 5.0)}), 1)
    g = out["global"]
    assert g["features.conv1.weight"].flatten().tolist() == [2.0, 2.0, 3.0, 3.0]  # NeFedAvg
    assert g["features.conv1.bias"].tolist() == [2.0, 2.0, 3.0, 3.0]
    assert g["head.weight"].tolist() == [[2.0, 2.0, 3.0, 3.0]] * 2  # input columns follow the channels
    assert g["head.bias"].tolist() == [2.0, 2.0]  # held by both
    assert out["inconsistent"]["1"]["features.bn1.weight"].tolist() == [5.0, 5.0]  # width-0.5 BN: client 1 alone
    assert out["inconsistent"]["0"]["features.bn1.weight"].tolist() == [7.0] * 4  # full BN: client 0 alone
    assert g["features.bn1.weight"].tolist() == [7.0] * 4  # the scored model: the widest sub-model's set
    # a client loads the consistent model and its own sub-model's BN
    m.load_client_model(net, m.broadcast(out, 2), m.init_client_state(1, net))
    assert net.features.bn1.weight[:2].tolist() == [5.0, 5.0]


def test_nefl_steps_scale_the_residual_branch():
    block = add_steps(nn.Sequential(BasicBlock(2, 2, 1, "bn", default_conv)))[0]
    assert "bn2.step" in block.state_dict() and "bn2.step" in inconsistent_keys(block)
    x = T([[[[-1.0, 2.0]], [[3.0, -4.0]]]])
    with torch.no_grad():
        block.bn2.step.fill_(0.0)
    assert block(x).tolist() == [[[[0.0, 2.0]], [[3.0, 0.0]]]]  # x + 0 * F(x), then ReLU
    with torch.no_grad():
        block.bn2.step.fill_(2.0)
    branch = block.bn2.forward(block.conv2(block.relu(block.bn1(block.conv1(x)))))  # .forward: without the hook
    assert torch.allclose(block(x), torch.relu(x + 2.0 * branch))


def test_nefl_client_step_keeps_its_width():
    m = method(NeFL, tiny_net, rho_levels=[0.0, 0.5])
    net = m.build_model()
    state = m.init_server(net)
    m.load_client_model(net, m.broadcast(state, 1), m.init_client_state(1, net))
    up = m.local_update(context(m, net, cid=1))
    assert up.tensors["features.conv1.weight"].shape == (2, 1, 1, 1) and up.tensors["head.weight"].shape == (2, 2)
    assert torch.all(net.features.conv1.weight[2:] == 0) and up.metrics["width"] == 0.5


# ----------------------------------------------------------------------------- footprints

def test_footprint_by_hand():
    # dense: conv 4 + 4, BN 4 + 4, head 8 + 2 = 26 params; MACs on 1x3x3: conv 9 x 4 + head 8 = 44
    # width 0.5 (2 channels): conv 2 + 2, BN 2 + 2, head 4 + 2 = 14; MACs 9 x 2 + 4 = 22
    m = method(NeFL, tiny_net, rho_levels=[0.0, 0.5])
    assert m.client_footprint(0, {}) == {"params": 26.0, "macs": 44.0}
    assert m.client_footprint(1, {}) == {"params": 14.0, "macs": 22.0}
    d = method(FedDrop, tiny_net, rho=0.75)  # 4 - 3 = 1 channel: conv 1 + 1, BN 2, head 2 + 2 = 8; MACs 9 + 2
    assert d.client_footprint(0, {}) == {"params": 8.0, "macs": 11.0}


@pytest.mark.parametrize("name", ["small_cnn", "resnet10"])
def test_footprints_shrink_with_the_ratio(name):
    s = testing.setup(num_classes=10, image_shape=(3, 16, 16), num_clients=5, client_domains=("d",) * 5,
                      model=ModelConfig(name=name), rounds=1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        dense_model = build(name, num_classes=10, in_channels=3, input_size=16)
    dense = {"params": float(count_params(dense_model)), "macs": float(count_flops(dense_model, (3, 16, 16)))}
    fedmp = FedMP(FedMP.Hparams(), s)
    nefl = NeFL(NeFL.Hparams(learnable_step=False), s)
    drop = FedDrop(FedDrop.Hparams(), s)
    assert fedmp.client_footprint(0, dense) == dense and nefl.client_footprint(0, dense) == dense  # tier C1, rho 0
    for m in (fedmp, nefl):
        p = [m.client_footprint(k, dense)["params"] for k in range(5)]
        f = [m.client_footprint(k, dense)["macs"] for k in range(5)]
        assert p == sorted(p, reverse=True) and f == sorted(f, reverse=True) and p[4] < 0.5 * dense["params"]
    # NeFL width 0.2: ~0.2^2 of the parameters
    assert nefl.client_footprint(4, dense)["params"] / dense["params"] == pytest.approx(0.04, abs=0.02)
    df = drop.client_footprint(3, dense)
    assert df["params"] / dense["params"] == pytest.approx(0.4 ** 2, abs=0.05) and df["macs"] < dense["macs"]


# ----------------------------------------------------------------------------- hyperparameters

def test_hparams_checked_and_defaults():
    assert FedDrop.Hparams().rho == 0.6 and FedMP.Hparams().rho_levels == (0.0, 0.2, 0.4, 0.6, 0.8)
    assert NeFL.Hparams().learnable_step is True
    for cls, bad in ((FedDrop, {"mask_scope": "x"}), (FedDrop, {"rho": 1.0}), (FedMP, {"rho_levels": []}),
                     (NeFL, {"rho_levels": [1.2]}), (FedDrop, {"aggregation": "mean"})):
        with pytest.raises(UserError):
            cls.Hparams.from_dict(bad, "hp", cls.name)
    assert set(FedDrop.Hparams.search_space()) == {"rho"} and set(FedMP.Hparams.search_space()) == {"rho"}


def test_profile_tier_beyond_the_levels_is_refused():
    s = testing.setup(num_classes=2, image_shape=(1, 3, 3), num_clients=1, client_domains=("d",), model=ModelConfig(),
                      rounds=1, client_profiles=({"tier": 7, "level": "L8"},))
    with pytest.raises(UserError, match="tier 7"):
        FedMP(FedMP.Hparams(), s).client_rho(0)
    s2 = testing.setup(num_classes=2, image_shape=(1, 3, 3), num_clients=1, client_domains=("d",), model=ModelConfig(),
                       rounds=1, client_profiles=({"tier": 3, "level": "C4"},))
    assert FedMP(FedMP.Hparams(), s2).client_rho(0) == 0.6


# ----------------------------------------------------------------------------- the client step is the sub-network's

def test_client_step_equals_training_the_extracted_sub_network():
    """FedDrop's upload = E epochs of SGD on the physically smaller network, from the first step."""
    m = method(FedDrop, tiny_net2, rho=0.5)
    net = m.build_model()
    start = {k: v.clone() for k, v in net.state_dict().items()}
    up = m.local_update(context(m, net, seed=123))
    gen = torch.Generator().manual_seed(123)
    plan = dropout_plan([g.size for g in m.ref.groups], 0.5, gen)  # the same draw, then the same batches
    assert all(torch.equal(plan[g], up.extras["plan"][str(g)]) for g in plan)
    small = Net(nn.Sequential(OrderedDict([
        ("conv1", nn.Conv2d(1, 2, 1)), ("bn1", nn.BatchNorm2d(2)), ("relu1", nn.ReLU()),
        ("conv2", nn.Conv2d(2, 2, 1)), ("bn2", nn.BatchNorm2d(2)), ("relu2", nn.ReLU()),
        ("pool", nn.AdaptiveAvgPool2d(1)), ("flat", nn.Flatten())])), nn.Linear(2, 2), (1, 3, 3))
    small.load_state_dict(extract(start, slices(m.ref.dims, plan)))
    ctx = context(m, small)
    ctx.generator = gen
    from raysim.core.training import train_epochs
    train_epochs(ctx)
    for k, v in small.state_dict().items():
        assert torch.allclose(up.tensors[k].to(v.dtype), v, atol=1e-5), k


def test_fedmp_at_ratio_zero_is_fedavg():
    from raysim.core.contract import Method
    from raysim.core.training import train_epochs
    m = method(FedMP, tiny_net2, rho_levels=[0.0])
    net = m.build_model()
    start = {k: v.clone() for k, v in net.state_dict().items()}
    up = m.local_update(context(m, net))
    up.tensors = {k: v.clone() for k, v in up.tensors.items()}  # the upload shares the live model's storage
    net.load_state_dict(start)
    train_epochs(context(m, net))
    assert all(torch.equal(up.tensors[k], v) for k, v in net.state_dict().items())
    prev = {k: torch.zeros_like(v) for k, v in start.items()}
    up.weight = 1.0
    two = AllUploads({0: up, 1: Upload({k: v * 3 for k, v in up.tensors.items()}, 3.0, extras=up.extras)})
    out = m.aggregate({"global": prev}, two, 1)["global"]
    assert torch.allclose(out["head.weight"], up.tensors["head.weight"] * 2.5)  # (1 w + 3 * 3w) / 4


def test_rescale_multiplies_readers_of_a_thinned_group_by_c_over_kept():
    torch.manual_seed(0)
    net = tiny_net2()
    x = torch.randn(2, 4, 3, 3)
    plain = net.features.conv2(x)
    hooks = rescale_inputs(net, channel_groups(net), {0: T([0, 1]), 1: T([0, 1, 2, 3])})  # group 0: 4 / 2 = 2
    assert len(hooks) == 1 and torch.allclose(net.features.conv2(x), 2.0 * plain)
    for h in hooks:
        h.remove()
    assert torch.allclose(net.features.conv2(x), plain)
