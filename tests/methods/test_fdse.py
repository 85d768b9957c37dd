"""FDSE's equations on tiny tensors, checked against values computed by hand."""
import itertools
import math
from collections import OrderedDict

import numpy as np
import pytest
import torch
from torch import nn

from raysim.config import ModelConfig, TrainConfig
from raysim.core.errors import UserError
from raysim.core.aggregation import AllUploads
from raysim.core.contract import Upload
from raysim.core.hparams import Space
from raysim.methods.fdse import (FDSE, ConsistencyRegularizer, FDSEHparams, batch_stats, consensus_update,
                                 consistency_term, key_role, layer_weights, min_norm_simplex, similarity_mix)
from raysim.methods.fdse.layers import DSEConv, DSELinear, decompose, dse_blocks
from raysim.models import build, count_flops, count_params
from raysim.models.base import Net
from raysim.models.dropout import dropout_generator
from raysim.engine.host import tensors_nbytes
from raysim import testing


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_net():
    """conv(1->4, 3x3) BN ReLU pool flatten fc(16->6) BN1d ReLU | head fc(6->3)."""
    feats = nn.Sequential(OrderedDict([
        ("conv1", nn.Conv2d(1, 4, 3, 1, 1)), ("bn1", nn.BatchNorm2d(4)), ("relu1", nn.ReLU()),
        ("pool1", nn.MaxPool2d(2)), ("flatten", nn.Flatten()),
        ("fc1", nn.Linear(16, 6)), ("bn2", nn.BatchNorm1d(6)), ("relu2", nn.ReLU())]))
    return Net(feats, nn.Linear(6, 3), (1, 4, 4))


def fdse_tiny(seed=0):
    torch.manual_seed(seed)
    return decompose(tiny_net())


def method(**hp):
    return FDSE(FDSE.Hparams(**hp), setup=None)


# ============================================================================ Sec. 4.1 / Table A7

def test_dse_conv_block_shapes_and_parameter_count_by_hand():
    blk = DSEConv(3, 8, 3, 1, 1, G=2, dw=3)
    # dfe 3*4*9 + 4 bias = 112; BN_DSE 2*4 = 8; depthwise 4 * 1 * 3 * 3 = 36; BN_DFE 2*8 = 16
    assert blk.dfe.weight.shape == (4, 3, 3, 3) and blk.cheap.weight.shape == (4, 1, 3, 3)
    assert blk.cheap.groups == 4 and blk.cheap.bias is None
    assert count_params(blk) == 112 + 8 + 36 + 16 == 172
    x = torch.randn(2, 3, 5, 5)
    z = blk.deskew(x)
    assert z.shape == (2, 8, 5, 5) and blk(x).shape == (2, 8, 5, 5)
    # the first t channels are the identity copy ReLU(BN_DSE(DFE x)), the rest the cheap op of it
    h = torch.relu(blk.bn_dse(blk.dfe(x)))
    assert torch.allclose(z[:, :4], h) and torch.allclose(z[:, 4:], blk.cheap(h))


def test_dse_block_ceil_and_truncation_when_G_does_not_divide_T():
    blk = DSEConv(2, 8, 1, 1, 0, G=3, dw=1)  # t = ceil(8/3) = 3, 3 + 6 = 9 channels cut to 8
    assert blk.dfe.out_channels == 3 and blk.cheap.out_channels == 6
    assert blk.deskew(torch.randn(2, 2, 3, 3)).shape == (2, 8, 3, 3)


def test_dse_linear_block_by_hand():
    blk = DSELinear(10, 6, G=2, dw=1)
    # dfe 10*3 + 3 = 33; BN_DSE 6; per-channel scale 3; BN_DFE 12
    assert count_params(blk) == 33 + 6 + 3 + 12 == 54
    with torch.no_grad():
        blk.cheap.weight.copy_(torch.tensor([2.0, -1.0, 0.5]).view(3, 1, 1, 1))
    blk.eval()  # BN_DSE with running stats 0/1 and unit affine: identity up to its eps
    x = torch.randn(4, 10)
    h = torch.relu(blk.dfe(x) / math.sqrt(1 + blk.bn_dse.eps))
    assert torch.allclose(blk.deskew(x), torch.cat([h, h * torch.tensor([2.0, -1.0, 0.5])], 1), atol=1e-6)


def test_decompose_replaces_every_conv_and_hidden_fc_but_not_the_head():
    m = fdse_tiny()
    names = [n for n, _ in dse_blocks(m)]
    assert names == ["features.conv1", "features.fc1"]
    assert list(m.features._modules) == ["conv1", "pool1", "flatten", "fc1"]
    assert isinstance(m.head, nn.Linear) and m(torch.randn(3, 1, 4, 4)).shape == (3, 3)
    # conv1: 1*2*9+2 + 4 + 2*9 + 8 = 50; fc1: 16*3+3 + 6 + 3 + 12 = 72; head 6*3+3 = 21
    assert count_params(m) == 50 + 72 + 21


def alexnet_fdse_params_by_hand(num_classes=10):
    """Table A6 with Table A7's block: DFE conv + bias, BN_DSE, depthwise (T - t) dw^2, BN_DFE."""
    total = 0
    for S, T, k, dw in [(3, 64, 11, 3), (64, 192, 5, 3), (192, 384, 3, 3), (384, 256, 3, 3),
                        (256, 256, 3, 3), (9216, 1024, 1, 1), (1024, 1024, 1, 1)]:
        t = T // 2
        total += S * t * k * k + t + 2 * t + (T - t) * dw * dw + 2 * T
    return total + 1024 * num_classes + num_classes


def test_fdse_alexnet_table4_params_flops_and_state_size():
    # the paper's input size (A7.1: 224 x 224); parameter counts do not depend on it
    setup = testing.setup(num_classes=10, image_shape=(3, 224, 224), num_clients=6, model=ModelConfig(name="alexnet_fdse"),
                          rounds=1)
    fdse = FDSE(FDSE.Hparams(), setup).build_model()
    vanilla = build("alexnet_fdse", num_classes=10, in_channels=3, input_size=224, norm="bn")
    assert count_params(fdse) == alexnet_fdse_params_by_hand() == 6_504_810
    assert count_params(vanilla) == 12_974_154
    assert round(count_params(fdse) / 1e7, 2) == 0.65 and round(count_params(vanilla) / 1e7, 2) == 1.30  # Table 4
    mib = tensors_nbytes(fdse.state_dict()) / 2 ** 20
    assert abs(mib - 24.87) < 0.05 and abs(tensors_nbytes(vanilla.state_dict()) / 2 ** 20 - 49.52) < 0.01
    # Table 4's FLOPs (2.24e10 vs 4.41e10) are the MACs of a batch of 50 at 256 px (within 2 %);
    # at the 224 px the text states they would be 1.68e10 vs 3.33e10
    assert abs(count_flops(fdse, (3, 256, 256)) * 50 / 2.24e10 - 1) < 0.02
    assert abs(count_flops(vanilla, (3, 256, 256)) * 50 / 4.41e10 - 1) < 0.02
    assert round(count_flops(fdse) * 50 / 1e10, 2) == 1.68 and round(count_flops(vanilla) * 50 / 1e10, 2) == 3.33
    assert [b.bn_dfe.num_features for _, b in dse_blocks(fdse)] == [64, 192, 384, 256, 256, 1024, 1024]


def test_fdse_upload_is_about_half_of_fedavg():
    torch.manual_seed(0)
    fdse = decompose(build("alexnet_fdse", num_classes=10, input_size=256))
    vanilla = build("alexnet_fdse", num_classes=10, input_size=256)
    m = method()
    up = {k: v for k, v in fdse.state_dict().items() if k not in m.personal_keys(fdse)}
    ratio = tensors_nbytes(up) / tensors_nbytes(vanilla.state_dict())  # FedAvg uploads everything
    assert abs(ratio - 24.87 / 49.52) < 0.01


def test_fdse_cnn6_decomposition():
    torch.manual_seed(0)
    base = build("cnn6", num_classes=10, in_channels=3, input_size=32)
    torch.manual_seed(0)
    m = decompose(build("cnn6", num_classes=10, in_channels=3, input_size=32))
    assert [n for n, _ in dse_blocks(m)] == ["features.conv1", "features.conv2", "features.conv3",
                                             "features.fc1", "features.fc2"]
    by_hand = 0
    for S, T, k, dw in [(3, 64, 5, 3), (64, 64, 5, 3), (64, 128, 5, 3), (8192, 2048, 1, 1), (2048, 512, 1, 1)]:
        t = T // 2
        by_hand += S * t * k * k + t + 2 * t + (T - t) * dw * dw + 2 * T
    assert count_params(m) == by_hand + 512 * 10 + 10 == 9_086_314
    assert count_params(base) == 18_146_250
    assert isinstance(m.features.drop1, nn.Dropout)  # the rest of the backbone is untouched
    with dropout_generator(torch.Generator().manual_seed(0)):  # train mode, as inside a client step
        assert m(torch.randn(2, 3, 32, 32)).shape == (2, 10)


# ============================================================================ Eqs. 4-7

def test_batch_stats_fc_and_conv():
    mu, var = batch_stats(torch.tensor([[1.0, 2.0], [3.0, 6.0]]))
    assert torch.equal(mu, torch.tensor([2.0, 4.0])) and torch.equal(var, torch.tensor([1.0, 4.0]))
    z = torch.zeros(2, 2, 1, 2)
    z[:, 0] = torch.tensor([[[0.0, 2.0]], [[4.0, 6.0]]])  # channel 0 values 0,2,4,6: mean 3, var 5
    mu, var = batch_stats(z)
    assert torch.allclose(mu, torch.tensor([3.0, 0.0])) and torch.allclose(var, torch.tensor([5.0, 0.0]))


def test_consistency_term_eq6_by_hand():
    # ||[2,4]-[0,1]||^2 / 2 = 13/2;  ((1+4) - (1+1)) / 2 = 1.5 -> 2.25
    v = consistency_term(torch.tensor([2.0, 4.0]), torch.tensor([1.0, 4.0]),
                         torch.tensor([0.0, 1.0]), torch.tensor([1.0, 1.0]))
    assert abs(v.item() - 8.75) < 1e-6


def test_layer_weights_eq7():
    assert torch.allclose(layer_weights(3, 0.0), torch.full((3,), 1 / 3))
    assert torch.allclose(layer_weights(2, math.log(2)), torch.tensor([1 / 3, 2 / 3]))
    w = layer_weights(7, 0.001)  # the paper's beta: ~uniform, deeper slightly heavier
    assert abs(w.sum().item() - 1) < 1e-6 and torch.all(w[1:] > w[:-1]) and abs(w[0].item() - 1 / 7) < 1e-3


def test_regularizer_ema_eq5_and_gradient_path():
    bn1, bn2 = nn.BatchNorm1d(2), nn.BatchNorm1d(2)
    with torch.no_grad():  # "received" global stats
        bn1.running_mean.copy_(torch.tensor([0.0, 1.0]))
        bn1.running_var.copy_(torch.tensor([1.0, 1.0]))
    reg = ConsistencyRegularizer([bn1, bn2], gamma=0.5, beta=0.0)
    hooks = reg.attach()
    z1 = torch.tensor([[1.0, 2.0], [3.0, 6.0]], requires_grad=True)  # mu [2,4], var [1,4]
    bn1(z1), bn2(torch.zeros(2, 2))
    l1 = reg.loss()
    # layer 1: 8.75 (test above); layer 2: mu 0 var 0 vs (0, 1): 0 + ((0 - 2)/2)^2 = 1; w = 1/2 each
    assert abs(l1.item() - 0.5 * (8.75 + 1.0)) < 1e-6
    # the forward updated BN's running stats; the regularizer still uses the received ones
    assert torch.equal(reg.mu_g[0], torch.tensor([0.0, 1.0]))
    z2 = torch.tensor([[0.0, 0.0], [2.0, 2.0]], requires_grad=True)  # mu [1,1], var [1,1]
    bn1(z2), bn2(torch.zeros(2, 2))
    l2 = reg.loss()
    # EMA with gamma 0.5: mu_hat [1.5, 2.5], var_hat [1, 2.5]: (2.25+2.25)/2 + ((3.5-2)/2)^2 = 2.8125
    assert torch.allclose(reg.ema_mu[0], torch.tensor([1.5, 2.5]))
    assert abs(l2.item() - 0.5 * (2.8125 + 1.0)) < 1e-6
    l2.backward()
    assert z1.grad is None and z2.grad is not None  # history detached: only the current batch
    for h in hooks:
        h.remove()


def test_code_v2_regularizer_option_by_hand():
    bn = nn.BatchNorm1d(2)  # received stats 0 / 1
    reg = ConsistencyRegularizer([bn], gamma=0.9, beta=0.0, mode="code_v2")
    reg.attach()
    bn(torch.tensor([[1.0, 2.0], [3.0, 6.0]]))  # channel means c = [2, 4]: m = 3, v (unbiased) = 2
    # mean_c[(0 - 9) / 4] + 0.5 * mean_c[log 2 + 1/2]
    assert abs(reg.loss().item() - (-9 / 4 + 0.5 * (math.log(2) + 0.5))) < 1e-6


# ============================================================================ Eq. 8

def brute_force_simplex_qp(M):
    """Exact: try every support, solve its equality-constrained QP, keep the feasible best."""
    n = len(M)
    best, best_u = np.inf, None
    for r in range(1, n + 1):
        for S in itertools.combinations(range(n), r):
            K = np.zeros((r + 1, r + 1))
            K[:r, :r], K[:r, r], K[r, :r] = M[np.ix_(S, S)], 1, 1
            sol = np.linalg.lstsq(K, np.r_[np.zeros(r), 1.0], rcond=None)[0][:r]
            if sol.min() < -1e-12:
                continue
            u = np.zeros(n)
            u[list(S)] = sol
            if u @ M @ u < best - 1e-15:
                best, best_u = u @ M @ u, u
    return best, best_u


def test_min_norm_simplex_hand_cases():
    s = 1 / math.sqrt(2)
    cases = [
        (np.eye(2), [0.5, 0.5]),  # orthogonal pair: midpoint
        (np.eye(3), [1 / 3] * 3),  # orthonormal triple: centroid
        (None, [0.5, 0.5, 0.0]),  # e1, e2, (e1+e2)/sqrt2: the third lies beyond the e1-e2 edge
        (None, [0.5, 0.5, 0.0]),  # e1, -e1, e2: the origin is on the e1/-e1 edge
        (np.array([[1.0, 2.0], [2.0, 5.0]]), [1.0, 0.0]),  # p1=[1,0], p2=[2,1]: vertex p1
    ]
    pts = {2: np.array([[1, 0], [0, 1], [s, s]]), 3: np.array([[1, 0], [-1, 0], [0, 1]])}
    for i, (M, expect) in enumerate(cases):
        if M is None:
            M = pts[i] @ pts[i].T
        assert np.allclose(min_norm_simplex(M), expect, atol=1e-12), i


def test_min_norm_simplex_kkt_and_exactness_on_random_problems():
    rng = np.random.default_rng(0)
    for trial in range(120):
        n, d = int(rng.integers(2, 7)), int(rng.integers(1, 8))
        D = rng.normal(size=(n, d))
        if trial % 4 == 0:
            D[-1] = D[0]  # duplicated client update
        D /= np.linalg.norm(D, axis=1, keepdims=True)
        M = D @ D.T
        u = min_norm_simplex(M)
        obj, g = u @ M @ u, M @ u
        # KKT of min u'Mu on the simplex: u >= 0, sum 1, (Mu)_j >= u'Mu, equality on the support
        assert u.min() >= 0 and abs(u.sum() - 1) < 1e-12
        assert np.all(g >= obj - 1e-10)
        assert np.allclose(g[u > 1e-9], obj, atol=1e-9)
        assert obj <= brute_force_simplex_qp(M)[0] + 1e-12


def test_consensus_update_eq8_by_hand():
    cur = torch.zeros(2)
    delta, u = consensus_update(cur, [torch.tensor([2.0, 0.0]), torch.tensor([0.0, 4.0])])
    # dbar = (2 + 4) / 2 = 3, u = (1/2, 1/2): 3 * [0.5, 0.5]
    assert np.allclose(u, [0.5, 0.5]) and torch.allclose(delta, torch.tensor([1.5, 1.5], dtype=torch.float64))
    # a conflicting client: e1, -e1 (x2), e2 -> the origin is in the hull: nobody is contradicted
    delta, _ = consensus_update(cur, [torch.tensor([1.0, 0.0]), torch.tensor([-2.0, 0.0]), torch.tensor([0.0, 1.0])])
    assert torch.allclose(delta, torch.zeros(2, dtype=torch.float64), atol=1e-7)


def test_consensus_update_never_contradicts_a_client():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        cur = torch.randn(3, 4, generator=g)
        ups = [cur + torch.randn(3, 4, generator=g) * float(torch.rand(1, generator=g) * 3) for _ in range(5)]
        delta, _ = consensus_update(cur, ups)
        for up in ups:
            assert float((delta * (up - cur).double()).sum()) >= -1e-9
        norms = [float((up - cur).norm()) for up in ups]
        assert float(delta.norm()) <= np.mean(norms) + 1e-9  # dbar times a point of the unit ball


def test_consensus_update_zero_updates_leave_the_tensor_unchanged():
    cur = torch.ones(3)
    delta, _ = consensus_update(cur, [cur.clone(), cur.clone()])
    assert torch.equal(delta, torch.zeros(3, dtype=torch.float64))
    delta, _ = consensus_update(cur, [cur.clone(), cur + torch.tensor([1.0, 0, 0])])
    assert torch.allclose(delta, torch.zeros(3, dtype=torch.float64))


# ============================================================================ Eq. 9

def test_similarity_mix_eq9_by_hand():
    V = torch.tensor([[1.0, 0.0], [0.0, 2.0]])  # cos-sim = I
    e = math.e
    out = similarity_mix(V, tau=1.0)  # softmax([1, 0]) = [e, 1]/(e+1)
    expect = torch.tensor([[e / (e + 1), 2 / (e + 1)], [1 / (e + 1), 2 * e / (e + 1)]], dtype=torch.float64)
    assert torch.allclose(out, expect)
    # Q/K are normalised, V is not: a client with the same direction counts fully
    out = similarity_mix(torch.tensor([[1.0, 0.0], [3.0, 0.0], [0.0, 1.0]]), tau=1.0)
    w = torch.tensor([e, e, 1.0]) / (2 * e + 1)
    assert torch.allclose(out[0], (w[:, None] * torch.tensor([[1.0, 0], [3, 0], [0, 1]])).sum(0).double())


def test_similarity_mix_temperature_limits():
    V = torch.tensor([[1.0, 2.0, 0.5], [-1.0, 0.3, 2.0], [0.2, -0.5, 1.0], [2.0, 2.0, 2.0]])
    assert torch.allclose(similarity_mix(V, tau=1e-4), V.double(), atol=1e-12)  # tau -> 0: own tensors
    big = similarity_mix(V, tau=1e6)  # tau -> inf: the plain mean for everyone
    assert torch.allclose(big, V.double().mean(0).expand(4, 3), atol=1e-5)


# ============================================================================ the method

def test_hparams_defaults_and_search_space():
    hp = FDSEHparams()
    assert (hp.lam, hp.tau, hp.beta, hp.gamma, hp.G, hp.dw, hp.dw_fc) == (0.1, 0.5, 0.001, 0.9, 2, 3, 1)
    assert FDSE.Hparams.search_space() == {"lam": Space.log(0.01, 1.0), "tau": Space.log(0.001, 0.5)}
    assert FDSE.hparams_from({"lam": 1, "tau": 0.01}).lam == 1.0
    with pytest.raises(UserError):
        FDSE.hparams_from({"con_mode": "nope"})
    with pytest.raises(UserError):
        FDSE.hparams_from({"tau": 0})


def test_key_roles_and_bn_dse_stats_are_personal():
    m = fdse_tiny()
    roles = {k: key_role(k) for k in m.state_dict()}
    assert roles["features.conv1.dfe.weight"] == "shared" and roles["head.bias"] == "shared"
    assert roles["features.conv1.bn_dfe.weight"] == "shared"
    assert roles["features.conv1.bn_dfe.running_var"] == "stat"
    assert roles["features.conv1.bn_dse.weight"] == "dse" and roles["features.fc1.cheap.weight"] == "dse"
    assert roles["features.fc1.bn_dse.running_mean"] == "local"
    personal = method().personal_keys(m)
    assert {k for k in personal if "running" in k} == {
        f"features.{b}.bn_dse.{s}" for b in ("conv1", "fc1") for s in ("running_mean", "running_var")}


def client_step(m, model, state_srv, cid, rnd, client_state, data):
    payload = {**m.broadcast(state_srv, rnd), "personal": m.client_payload(state_srv, cid, rnd)}
    m.load_client_model(model, payload, client_state)
    ctx = testing.client_context(m, model, data, client_id=cid, round=rnd, payload=payload, state=client_state,
                                 train=TrainConfig(epochs=1, batch_size=4, lr=0.05, grad_clip=10.0), seed=rnd * 10 + cid,
                                 domain=str(cid))
    return m.local_update(ctx)


def test_federation_round_trip_bn_dse_stats_never_reach_the_server():
    torch.manual_seed(0)
    model = fdse_tiny()
    m = method(lam=1.0, tau=0.1)
    srv = m.init_server(model)
    clients = {c: m.init_client_state(c, model) for c in (0, 1)}
    data = {c: testing.client_data(torch.randn(9, 1, 4, 4) * (c + 1) + c, torch.randint(0, 3, (9,))) for c in (0, 1)}
    local_keys = m.personal_keys(model)

    def no_local(tensors):
        return not (set(tensors) & local_keys) and not any("bn_dse.running" in k for k in tensors)

    assert no_local(srv["global"]) and no_local(srv["dse_init"])
    for rnd in (1, 2):
        ups = {c: client_step(m, model, srv, c, rnd, clients[c], data[c]) for c in (0, 1)}
        for c, up in ups.items():
            assert no_local(up.tensors) and not up.extras
            assert set(clients[c]["personal"]) == local_keys  # kept on the client
            assert ("con_loss" in up.metrics) == (rnd > 1)  # L_Con skipped in round 1
            assert up.metrics["steps"] == 2  # 9 samples, batch 4: the last batch of 1 is skipped
        srv = m.aggregate(srv, AllUploads(ups), rnd)
        assert no_local(srv["global"]) and all(no_local(v) for v in srv["dse"].values())
        for c in (0, 1):
            assert no_local(m.client_payload(srv, c, rnd + 1)["dse"])
    # each client's BN_DSE stats are its own and survive the other client's use of the model
    s0 = clients[0]["personal"]["features.conv1.bn_dse.running_mean"]
    s1 = clients[1]["personal"]["features.conv1.bn_dse.running_mean"]
    assert not torch.allclose(s0, s1)
    m.eval_model(model, {**m.broadcast(srv, 3), "personal": m.client_payload(srv, 0, 3)}, clients[0])
    assert torch.equal(model.features.conv1.bn_dse.running_mean, s0)


def test_aggregate_by_hand_on_two_clients():
    m = method(tau=1.0)
    keys = {"features.b.dfe.weight": torch.zeros(2), "features.b.bn_dfe.running_mean": torch.zeros(2)}
    srv = {"global": dict(keys), "dse_init": {"features.b.cheap.weight": torch.zeros(2)}, "dse": {}}
    ups = {0: Upload({"features.b.dfe.weight": torch.tensor([2.0, 0.0]),
                      "features.b.bn_dfe.running_mean": torch.tensor([1.0, 3.0]),
                      "features.b.cheap.weight": torch.tensor([1.0, 0.0])}, weight=1.0),
           1: Upload({"features.b.dfe.weight": torch.tensor([0.0, 4.0]),
                      "features.b.bn_dfe.running_mean": torch.tensor([3.0, 5.0]),
                      "features.b.cheap.weight": torch.tensor([0.0, 2.0])}, weight=9.0)}
    new = m.aggregate(srv, AllUploads(ups), 1)
    assert torch.allclose(new["global"]["features.b.dfe.weight"], torch.tensor([1.5, 1.5]))  # Eq. 8
    assert torch.equal(new["global"]["features.b.bn_dfe.running_mean"], torch.tensor([2.0, 4.0]))  # unweighted
    e = math.e
    assert torch.allclose(m.client_payload(new, 0, 2)["dse"]["features.b.cheap.weight"],
                          torch.tensor([e / (e + 1), 2 / (e + 1)]))
    assert torch.allclose(m.client_payload(new, 1, 2)["dse"]["features.b.cheap.weight"],
                          torch.tensor([1 / (e + 1), 2 * e / (e + 1)]))
    # each client keeps e / (e + 1) of its own DSE (the attention's diagonal), logged by the server
    assert m.server_metrics(new) == {"dse_self_weight": pytest.approx(e / (e + 1))}
    # ablations: plain (n_k-weighted) mean for theta_u, purely local DSE
    abl = method(shared_agg="mean", dse_agg="local").aggregate(srv, AllUploads(ups), 1)
    assert torch.allclose(abl["global"]["features.b.dfe.weight"], torch.tensor([0.2, 3.6]))
    assert torch.equal(abl["dse"][1]["features.b.cheap.weight"], torch.tensor([0.0, 2.0]))
    assert srv["dse"] == {}  # the previous state is not mutated


# ============================================================================ unseen client (Sec. 5.4, Alg. 3)

class UnlabeledTest:
    """A target client's test split as label-free adaptation sees it: images only."""

    def __init__(self, x):
        self.x = x

    def unlabeled_batches(self, batch_size, generator, device):
        order = torch.randperm(len(self.x), generator=generator)
        for s in range(0, len(order), batch_size):
            if len(order[s:s + batch_size]) > 1:
                yield self.x[order[s:s + batch_size]]


def con_loss_on(model, x, hp):
    """sum_l w_l L_Con^(l) of one eval-mode pass over x (one batch, so the EMA is that batch's)."""
    reg = ConsistencyRegularizer([b.bn_dfe for _, b in dse_blocks(model)], hp.gamma, hp.beta)
    handles = reg.attach(in_eval_mode=True)
    model.eval()
    with torch.no_grad():
        model(x)
        value = float(reg.loss())
    for h in handles:
        h.remove()
    return value


def test_unseen_client_model_is_the_mean_dse_and_alg3_adapts_only_the_dse():
    from raysim.core.contract import ClientData, UnseenClient
    torch.manual_seed(0)
    model = fdse_tiny()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    m = method(lam=1.0, tau=0.1, adapt_epochs=4, adapt_batch=4)
    srv = m.init_server(model)
    clients = {c: m.init_client_state(c, model) for c in (0, 1)}
    data = {c: testing.client_data(torch.randn(9, 1, 4, 4) * (c + 1) + c, torch.randint(0, 3, (9,))) for c in (0, 1)}
    for rnd in (1, 2):
        ups = {c: client_step(m, model, srv, c, rnd, clients[c], data[c]) for c in (0, 1)}
        srv = m.aggregate(srv, AllUploads(ups), rnd)
    personal_mean = {k: (clients[0]["personal"][k].double() + clients[1]["personal"][k].double()).div(2)
                     .to(init[k].dtype) for k in clients[0]["personal"] if init[k].is_floating_point()}
    payload = {**m.eval_payload(srv, 2), "personal_mean": personal_mean}

    target = fdse_tiny(seed=5)  # any weights: the global model overwrites every tensor
    target.load_state_dict(init)
    m.global_eval_model(target, payload)
    sd = target.state_dict()
    for k in srv["dse_init"]:  # theta_v = the uniform mean of the clients' Eq. 9 mixes, not theta_v^0
        mean = (srv["dse"][0][k] + srv["dse"][1][k]) / 2
        assert torch.allclose(sd[k], mean, atol=1e-7) and not torch.allclose(sd[k], init[k]), k
    for k, v in personal_mean.items():  # BN_DSE statistics: the clients' mean, estimated on their data
        assert torch.equal(sd[k], v) and not torch.equal(v, init[k]), k
    for k, v in srv["global"].items():
        assert torch.equal(sd[k], v), k

    x_target = torch.randn(12, 1, 4, 4) * 3 - 2  # a shifted domain, no labels
    client = UnseenClient(client_id=2, domain="new", round=2, data=ClientData(None, None, UnlabeledTest(x_target), 0),
                          train=TrainConfig(), lr=0.05, generator=torch.Generator().manual_seed(1),
                          device=torch.device("cpu"))
    before = {k: v.clone() for k, v in sd.items()}
    loss_before = con_loss_on(target, x_target, m.hp)
    assert m.adapt_to_unseen(target, client) is True
    after = target.state_dict()
    assert con_loss_on(target, x_target, m.hp) < loss_before  # Alg. 3 minimises L_Con
    for k in after:
        role = key_role(k)
        if role in ("shared", "stat"):  # frozen parameters, BN_DFE statistics fixed (line 1)
            assert torch.equal(after[k], before[k]), k
        elif role == "dse":
            assert not torch.equal(after[k], before[k]), k
        elif "running" in k:  # BN_DSE statistics re-estimated on the target's images
            assert not torch.equal(after[k], before[k]), k
    assert all(p.requires_grad for p in target.parameters())  # the host's model trains again next round
    # the "- align" row of Table 2: no adaptation
    assert method(adapt_epochs=0).adapt_to_unseen(target, client) is False
    with pytest.raises(UserError, match="adapt_epochs"):
        FDSE.hparams_from({"adapt_epochs": -1})
