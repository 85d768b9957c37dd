"""gPerXAN / gFedAvg on tiny tensors: XAN, PerXAN's key split, the guiding regularizer and the
unseen-domain model, checked against values computed by hand."""
import copy
import math
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from raysim.config import ModelConfig, TrainConfig
from raysim.core.errors import UserError
from raysim.core.aggregation import Mean
from raysim.methods.gperxan import GFedAvg, GPerXAN
from raysim.methods.gperxan_layers import IBN, XAN, bn_side_keys, place, select
from raysim.models.base import Net
from raysim import testing

EPS = 1e-5


def setup_for(name="small_cnn", size=32, rounds=10, pretrained=None, norm="bn"):
    return testing.setup(num_classes=2, image_shape=(3, size, size), num_clients=2, client_domains=("a", "b"),
                         model=ModelConfig(name=name, norm=norm, pretrained=pretrained), rounds=rounds)


def method(cls=GPerXAN, rounds=10, **hp):
    return cls(cls.hparams_from(hp), setup_for(rounds=rounds))


def tiny_net(xan=False, seed=0):
    """conv1x1(1->2) - bn1 - flatten - head Linear(8, 2), inputs 1x2x2."""
    torch.manual_seed(seed)
    features = nn.Sequential(OrderedDict([("conv1", nn.Conv2d(1, 2, 1)), ("bn1", nn.BatchNorm2d(2)),
                                          ("flatten", nn.Flatten())]))
    model = Net(features, nn.Linear(8, 2), (1, 2, 2))
    if xan:
        place(model, select(model, "all", "xan"), "xan", score_init="ones")
    return model


def context(model, batches, lr=0.1, rnd=1, state=None, momentum=0.0, cid=0):
    return testing.client_context(None, model, testing.fixed_batches(*batches), client_id=cid, round=rnd,
                                  state=state or {}, train=TrainConfig(batch_size=4, lr=lr, momentum=momentum))


def bn_by_hand(x, mean, var, gamma, beta):
    v = lambda t: t.view(1, -1, 1, 1)  # noqa: E731
    return (x - v(mean)) / torch.sqrt(v(var) + EPS) * v(gamma) + v(beta)


def in_by_hand(x, gamma, beta):
    mu = x.mean(dim=(2, 3), keepdim=True)
    var = ((x - mu) ** 2).mean(dim=(2, 3), keepdim=True)  # biased, per sample and channel
    return (x - mu) / torch.sqrt(var + EPS) * gamma.view(1, -1, 1, 1) + beta.view(1, -1, 1, 1)


def set_xan(layer, s_bn, s_in):
    with torch.no_grad():
        layer.score_bn.fill_(s_bn)
        layer.score_in.fill_(s_in)
        layer.bn.weight.copy_(torch.tensor([1.5, -0.5]))
        layer.bn.bias.copy_(torch.tensor([0.2, 0.1]))
        layer.inst.weight.copy_(torch.tensor([0.7, 2.0]))
        layer.inst.bias.copy_(torch.tensor([-0.3, 0.4]))


# ----------------------------------------------------------------------------- XAN / IBN

def test_xan_output_is_the_softmax_mixture_of_bn_and_in_by_hand():
    torch.manual_seed(0)
    layer = XAN(2)
    set_xan(layer, 0.3, -0.2)
    x = torch.randn(4, 2, 3, 3) * 2 + 1
    w_bn = math.exp(0.3) / (math.exp(0.3) + math.exp(-0.2))  # softmax([s_bn, s_in])
    w_in = 1 - w_bn
    gb, bb = layer.bn.weight.detach(), layer.bn.bias.detach()
    gi, bi = layer.inst.weight.detach(), layer.inst.bias.detach()
    # training: BN uses the batch's per-channel mean / biased variance over (b, h, w)
    mean = x.mean(dim=(0, 2, 3))
    var_b = ((x - mean.view(1, -1, 1, 1)) ** 2).mean(dim=(0, 2, 3))
    expected = w_bn * bn_by_hand(x, mean, var_b, gb, bb) + w_in * in_by_hand(x, gi, bi)
    layer.train()
    assert torch.allclose(layer(x), expected, atol=1e-5)
    # running statistics: momentum 0.1, the unbiased batch variance (n = 4 * 3 * 3 = 36)
    assert torch.allclose(layer.bn.running_mean, 0.1 * mean, atol=1e-6)
    assert torch.allclose(layer.bn.running_var, 0.9 + 0.1 * var_b * 36 / 35, atol=1e-5)
    # eval: BN uses its running statistics, IN still each sample's own
    with torch.no_grad():
        layer.bn.running_mean.copy_(torch.tensor([0.5, -1.0]))
        layer.bn.running_var.copy_(torch.tensor([4.0, 0.25]))
    layer.eval()
    expected = w_bn * bn_by_hand(x, torch.tensor([0.5, -1.0]), torch.tensor([4.0, 0.25]), gb, bb) \
        + w_in * in_by_hand(x, gi, bi)
    assert torch.allclose(layer(x), expected, atol=1e-5)


def test_xan_linear_mix_and_score_inits():
    torch.manual_seed(0)
    layer = XAN(2, mix="linear")
    set_xan(layer, 0.8, 0.6)  # raw Eq. (2) weights, no normalisation
    layer.eval()
    x = torch.randn(2, 2, 3, 3)
    expected = 0.8 * bn_by_hand(x, torch.zeros(2), torch.ones(2), layer.bn.weight.detach(), layer.bn.bias.detach()) \
        + 0.6 * in_by_hand(x, layer.inst.weight.detach(), layer.inst.bias.detach())
    assert torch.allclose(layer(x), expected, atol=1e-5)
    ones = XAN(3, score_init="ones")
    assert ones.score_bn.item() == 1.0 and ones.score_in.item() == 1.0  # code: ratios 0.5 / 0.5
    torch.manual_seed(5)
    rnd = XAN(3, score_init="random")
    torch.manual_seed(5)
    assert rnd.score_bn.item() != 1.0 and 0 <= rnd.score_bn.item() < 1 and 0 <= rnd.score_in.item() < 1


def test_ibn_is_in_on_the_first_half_and_bn_on_the_rest():
    torch.manual_seed(0)
    layer = IBN(4)
    x = torch.randn(3, 4, 2, 2)
    layer.train()
    mean = x[:, 2:].mean(dim=(0, 2, 3))
    var = ((x[:, 2:] - mean.view(1, -1, 1, 1)) ** 2).mean(dim=(0, 2, 3))
    expected = torch.cat([in_by_hand(x[:, :2], torch.ones(2), torch.zeros(2)),
                          bn_by_hand(x[:, 2:], mean, var, torch.ones(2), torch.zeros(2))], dim=1)
    assert torch.allclose(layer(x), expected, atol=1e-5)


# ----------------------------------------------------------------------------- placement

def test_placement_rule_per_backbone():
    s = testing.setup(num_classes=7, image_shape=(3, 32, 32), num_clients=3, client_domains=("a", "b", "c"),
                      model=ModelConfig(name="resnet18_tv"), rounds=1)
    plain = GFedAvg(GFedAvg.Hparams(), s).build_model()
    # PACS rule: every BN of the trunk (stem 1 + 4 stages x 2 blocks x 2 + 3 downsample = 20)
    assert len(select(plain, "auto", "xan")) == len(select(plain, "all", "xan")) == 20
    # Office-Home rule: stem + layer1 + layer2 (1 + 4 + 5)
    oh = select(plain, "stem,layer1,layer2", "xan")
    assert len(oh) == 10 and "features.layer2.0.downsample.bn" in oh and "features.bn1" in oh
    # IBN-Net-a: the first norm of every block of layer1-layer3
    assert select(plain, "auto", "ibn") == [f"features.layer{i}.{j}.bn1" for i in (1, 2, 3) for j in (0, 1)]
    with pytest.raises(UserError, match="unknown stage"):
        select(plain, "layer9", "xan")
    place(plain, oh, "xan")
    assert sum(isinstance(m, XAN) for m in plain.modules()) == 10
    assert sum(type(m) is nn.BatchNorm2d for m in plain.features.modules()) == 20  # 10 plain + 10 BN sides
    assert len(GPerXAN(GPerXAN.Hparams(), s).personal_keys(plain)) == 10 * 6
    # Alg. 1 line 6 read literally: the 10 BNs left outside XAN stay local as well (5 keys each)
    literal = GPerXAN(GPerXAN.hparams_from({"local_plain_bn": True}), s).personal_keys(plain)
    assert len(literal) == 10 * 6 + 10 * 5 and "features.layer3.0.bn1.running_mean" in literal
    small = GPerXAN(GPerXAN.Hparams(), setup_for()).build_model()  # plain CNN: every conv BN
    assert [n for n, m in small.named_modules() if isinstance(m, XAN)] == ["features.bn1", "features.bn2"]
    ibn = GPerXAN(GPerXAN.hparams_from({"norm": "ibn"}), setup_for()).build_model()
    assert [n for n, m in ibn.named_modules() if isinstance(m, IBN)] == ["features.bn1", "features.bn2"]


def test_bn_side_starts_from_the_pretrained_bn(tmp_path):
    torch.manual_seed(1)
    plain = GFedAvg(GFedAvg.Hparams(), setup_for()).build_model()
    with torch.no_grad():
        plain.features.bn2.running_mean.uniform_(-1, 1)
        plain.features.bn2.weight.uniform_(0.5, 2)
    path = tmp_path / "w.pt"
    torch.save(plain.state_dict(), path)
    m = GPerXAN(GPerXAN.hparams_from({"in_affine_init": "copy_bn"}), setup_for(pretrained=str(path)))
    model = m.build_model()  # loads into plain BN layers, then each becomes an XAN's BN side
    xan = model.features.bn2
    assert torch.equal(xan.bn.running_mean, plain.features.bn2.running_mean)
    assert torch.equal(xan.bn.weight, plain.features.bn2.weight)
    assert torch.equal(xan.inst.weight, plain.features.bn2.weight)  # copy_bn
    assert torch.equal(model.features.conv1.weight, plain.features.conv1.weight)
    with pytest.raises(UserError, match="pretrained weights file not found"):
        GPerXAN(GPerXAN.Hparams(), setup_for(pretrained=str(tmp_path / "missing.pt"))).build_model()


def test_hparams_defaults_and_errors():
    hp = GPerXAN.Hparams()
    assert (hp.lam, hp.norm, hp.mix, hp.local_bn_score) == (0.5, "perxan", "softmax", True)
    assert GPerXAN.Hparams.search_space()["lam"].choices == (0.0, 0.25, 0.5, 0.75, 1.0)
    for bad in ({"norm": "dson"}, {"mix": "max"}, {"lam": -1.0}, {"lr_schedule": "step"}):
        with pytest.raises(UserError):
            GPerXAN.hparams_from(bad)
    with pytest.raises(UserError, match="unknown hyperparameter"):
        GFedAvg.hparams_from({"norm": "perxan"})  # gFedAvg is plain BN


# ----------------------------------------------------------------------------- PerXAN key split

def test_bn_sides_are_personal_and_never_in_the_training_broadcast():
    model = tiny_net(xan=True)
    m = method()
    bn_side = {"features.bn1.bn.weight", "features.bn1.bn.bias", "features.bn1.bn.running_mean",
               "features.bn1.bn.running_var", "features.bn1.bn.num_batches_tracked", "features.bn1.score_bn"}
    assert m.personal_keys(model) == bn_side_keys(model) == bn_side
    state = m.init_server(model)
    payload = m.broadcast(state, 1)
    assert not bn_side & set(payload["global"])
    assert {"features.bn1.inst.weight", "features.bn1.inst.bias", "features.bn1.score_in",
            "head.weight", "features.conv1.weight"} <= set(payload["global"])
    assert method(local_bn_score=False).personal_keys(model) == bn_side - {"features.bn1.score_bn"}
    assert method(norm="xan").personal_keys(model) == set()  # the not-personalized ablation


def federate_one_round(m, rounds=1):
    """Two clients with different data run round 1 on the same model instance (as a host does);
    returns (server state after aggregation, client states, uploads, weights)."""
    model = tiny_net(xan=True)
    server = m.init_server(model)
    init_sd = copy.deepcopy(model.state_dict())
    torch.manual_seed(3)
    data = {0: [(torch.randn(4, 1, 2, 2), torch.tensor([0, 1, 0, 1]))],
            1: [(torch.randn(4, 1, 2, 2) * 3 + 2, torch.tensor([1, 1, 0, 0])),
                (torch.randn(8, 1, 2, 2) * 3 + 2, torch.tensor([0, 1] * 4))]}
    states, uploads = {}, {}
    payload = m.broadcast(server, 1)
    for cid in (0, 1):
        model.load_state_dict(init_sd)
        states[cid] = m.init_client_state(cid, model)
        m.load_client_model(model, payload, states[cid])
        ctx = context(model, data[cid], state=states[cid], cid=cid)
        uploads[cid] = up = m.local_update(ctx)
        up.tensors = {k: v.clone() for k, v in up.tensors.items()}  # the host sums them at once
    n = {c: uploads[c].weight for c in uploads}
    assert n == {0: 4.0, 1: 12.0}
    mean = {k: (n[0] * uploads[0].tensors[k].double() + n[1] * uploads[1].tensors[k].double()) / 16
            for k in uploads[0].tensors}  # the engine's n_k-weighted mean, by hand
    mean = {k: (v.round().long() if not uploads[0].tensors[k].is_floating_point() else v.float())
            for k, v in mean.items()}
    server = m.aggregate(server, Mean(mean, 16, [0, 1]), 1)
    return model, server, states, uploads, mean


def test_clients_keep_their_own_bn_sides_across_rounds():
    m = method()
    model, server, states, uploads, mean = federate_one_round(m)
    bn_side = m.personal_keys(model)
    # uploads carry every tensor (the server averages all of f_i) ...
    assert set(uploads[0].tensors) == set(model.state_dict())
    # ... the clients' BN sides differ from each other and from their average (A17)
    for k in ("features.bn1.bn.running_mean", "features.bn1.bn.weight"):
        a, b = states[0]["personal"][k], states[1]["personal"][k]
        assert not torch.allclose(a, b) and not torch.allclose(a, server["global"][k])
    # round 2's broadcast has no BN side; loading it keeps client 0's own BN side, shared = average
    payload = m.broadcast(server, 2)
    assert not bn_side & set(payload["global"])
    m.load_client_model(model, payload, states[0])
    sd = model.state_dict()
    for k in bn_side:
        assert torch.equal(sd[k], states[0]["personal"][k])
    for k in ("features.bn1.inst.weight", "features.bn1.score_in", "head.weight", "features.conv1.bias"):
        assert torch.equal(sd[k], mean[k])
    # even a payload that holds BN sides (the evaluation one) never overwrites a client's own
    m.load_client_model(model, m.eval_payload(server, 1), states[1])
    assert torch.equal(model.features.bn1.bn.running_mean, states[1]["personal"]["features.bn1.bn.running_mean"])


def test_unseen_domain_model_uses_the_averaged_bn_side():
    m = method()
    model, server, states, uploads, mean = federate_one_round(m)
    p0, p1 = states[0]["personal"], states[1]["personal"]
    # the evaluation payload (after round 1's aggregation) is f_g whole; training's never is
    payload = m.eval_payload(server, 1)
    assert m.personal_keys(model) <= set(payload["global"]) and not m.personal_keys(model) & set(m.broadcast(server, 1)["global"])
    fresh = tiny_net(xan=True, seed=9)
    g = m.global_eval_model(fresh, payload)
    layer = g.features.bn1
    for leaf in ("weight", "bias", "running_mean", "running_var"):
        by_hand = (4 * p0[f"features.bn1.bn.{leaf}"] + 12 * p1[f"features.bn1.bn.{leaf}"]) / 16
        assert torch.allclose(getattr(layer.bn, leaf), by_hand, atol=1e-6)
    s_bn = (4 * p0["features.bn1.score_bn"] + 12 * p1["features.bn1.score_bn"]) / 16
    assert torch.allclose(layer.score_bn, s_bn)
    # its output on an unseen sample, by hand: averaged BN side (running stats), global IN side
    g.eval()
    x = torch.randn(3, 1, 2, 2)
    h = F.conv2d(x, mean["features.conv1.weight"], mean["features.conv1.bias"])
    w = torch.softmax(torch.stack([s_bn, mean["features.bn1.score_in"]]), 0)
    y_bn = bn_by_hand(h, layer.bn.running_mean, layer.bn.running_var, layer.bn.weight, layer.bn.bias)
    y_in = in_by_hand(h, mean["features.bn1.inst.weight"], mean["features.bn1.inst.bias"])
    z = (w[0] * y_bn + w[1] * y_in).flatten(1)
    assert torch.allclose(g(x), F.linear(z, mean["head.weight"], mean["head.bias"]), atol=1e-5)
    # the training payload cannot build it: it lacks the BN sides
    with pytest.raises(RuntimeError, match="averaged BN sides"):
        m.global_eval_model(tiny_net(xan=True), m.broadcast(server, 1))


# ----------------------------------------------------------------------------- the regularizer

@pytest.mark.parametrize("cls", [GFedAvg, GPerXAN])
def test_regularizer_gradient_reaches_the_features_not_the_frozen_head(cls):
    lam, lr = 0.5, 0.1
    model = tiny_net(xan=cls is GPerXAN)
    ref = copy.deepcopy(model)
    x, y = torch.randn(4, 1, 2, 2), torch.tensor([0, 1, 1, 0])
    m = method(cls, lam=lam, lr_schedule="engine")  # lr as given (the default anneals it per round)
    up = m.local_update(context(model, [(x, y)], lr=lr))
    # One SGD step. At that step h_g = h_i, so dL/d(theta_g) = (1 + lam) dCE/d(theta_g), while the
    # head gets dCE/d(theta_h) only: the lam term reaches g_i and never the (frozen) head.
    ref.train()
    ce = F.cross_entropy(ref(x), y)
    names = [n for n, _ in ref.named_parameters()]
    grads = dict(zip(names, torch.autograd.grad(ce, list(ref.parameters()))))
    for name, p in model.named_parameters():
        factor = 1.0 if name.startswith("head.") else 1.0 + lam
        expected = dict(ref.named_parameters())[name].detach() - lr * factor * grads[name]
        assert torch.allclose(p.detach(), expected, atol=1e-6), name
    assert abs(up.metrics["loss"] - (1 + lam) * ce.item()) < 1e-5
    assert not model.head._forward_pre_hooks  # the feature hook is gone after the step


def test_regularizer_uses_the_received_head_while_the_local_head_drifts():
    lam, lr = 0.75, 0.2
    model = tiny_net(xan=True)
    ref = copy.deepcopy(model)
    torch.manual_seed(4)
    batches = [(torch.randn(4, 1, 2, 2), torch.tensor([0, 1, 1, 0])) for _ in range(3)]
    method(lam=lam, lr_schedule="engine").local_update(context(model, batches, lr=lr))
    # Eq. (3)-(4) by hand: h_g is the head as received, frozen for the whole round
    h_g_w, h_g_b = ref.head.weight.detach().clone(), ref.head.bias.detach().clone()
    ref.train()
    for x, y in batches:
        z = ref.features(x)
        loss = F.cross_entropy(ref.head(z), y) + lam * F.cross_entropy(F.linear(z, h_g_w, h_g_b), y)
        grads = torch.autograd.grad(loss, list(ref.parameters()))
        with torch.no_grad():
            for p, g in zip(ref.parameters(), grads):
                p -= lr * g
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p, q, atol=1e-5), name
    assert torch.allclose(model.features.bn1.bn.running_mean, ref.features.bn1.bn.running_mean, atol=1e-6)


def test_lam_zero_is_plain_sgd_and_cosine_and_momentum_options():
    model = tiny_net()
    ref = copy.deepcopy(model)
    x, y = torch.randn(4, 1, 2, 2), torch.tensor([0, 1, 1, 0])
    method(GFedAvg, lam=0.0, lr_schedule="engine").local_update(context(model, [(x, y)], lr=0.1))
    ref.train()
    grads = torch.autograd.grad(F.cross_entropy(ref(x), y), list(ref.parameters()))
    for p, q, g in zip(model.parameters(), ref.parameters(), grads):
        assert torch.allclose(p, q - 0.1 * g, atol=1e-6)
    # the official code's per-round cosine: lr_t = lr (1 + cos(pi t / T)) / 2
    m = method(GFedAvg, rounds=10, lr_schedule="cosine")
    assert m.lr(context(model, [], lr=0.2, rnd=5)) == pytest.approx(0.1)
    assert m.lr(context(model, [], lr=0.2, rnd=10)) == pytest.approx(0.0, abs=1e-12)
    # momentum buffers persist across rounds on the client when asked
    m = method(GFedAvg, persist_optimizer=True)
    ctx = context(model, [(x, y)], lr=0.1, momentum=0.9)
    m.local_update(ctx)
    buf = ctx.state["momentum"]
    assert set(buf) == {n for n, _ in model.named_parameters()}
    opt = m.optimizer(context(model, [], lr=0.1, momentum=0.9, state=ctx.state))
    p = dict(model.named_parameters())["head.weight"]
    assert torch.equal(opt.state[p]["momentum_buffer"], buf["head.weight"])
