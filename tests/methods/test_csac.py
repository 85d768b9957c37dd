"""CSAC's equations on tiny tensors, checked against values computed by hand."""
import io
import math
from collections import OrderedDict

import pytest
import torch
from torch import nn

from raysim.config import TrainConfig
from raysim.core.errors import UserError
from raysim.core.aggregation import AllUploads
from raysim.core.contract import ClientData, Upload
from raysim.methods.csac import (CSAC, CSACHparams, FeatureTaps, Projections, attention_scores, attention_weights,
                                 default_layers, fuse, fusion_weights, mk_mmd, mk_mmd_pairs, projection_conv)
from raysim.models import build
from raysim.models.base import Net
from raysim.testing import InMemorySplit, client_context


pytestmark = pytest.mark.usefixtures("one_thread")


# tiny data: an epoch is one pass (the default, the official code's 60 / 20 iterations, is slower)
PASS = {"stage1_iters_per_epoch": 0, "iters_per_epoch": 0}


def method(**hp):
    return CSAC(CSAC.Hparams(**{**PASS, **hp}), setup=None)


# ============================================================================ Eqs. 3-4: fusion

def test_fusion_weights_by_hand_three_clients():
    # G = 0, 1, 5 (one coordinate, plus a constant one): AVG = 2, d = 2, 1, 3, w = d / 6
    stack = torch.tensor([[0.0, 7.0], [1.0, 7.0], [5.0, 7.0]])
    w = fusion_weights(stack)
    assert w.tolist() == pytest.approx([2 / 6, 1 / 6, 3 / 6], abs=1e-15)
    fused, weights = fuse([{"t": s} for s in stack])
    assert fused["t"].tolist() == pytest.approx([0 * 2 / 6 + 1 / 6 + 5 * 3 / 6, 7.0], abs=1e-6)
    assert fused["t"].dtype == torch.float32
    # the farther model gets the larger weight (semantic divergence), unlike the plain mean 2.0
    assert fused["t"][0] > stack[:, 0].mean()


def test_fusion_distance_is_the_l2_norm_of_the_whole_tensor():
    # G^1 = (0, 0), G^2 = (3, 4), G^3 = (-3, -4): AVG = 0, d = 0, 5, 5 -> w = 0, 1/2, 1/2
    stack = torch.tensor([[[0.0, 0.0]], [[3.0, 4.0]], [[-3.0, -4.0]]])
    assert fusion_weights(stack).tolist() == pytest.approx([0.0, 0.5, 0.5])


def test_two_clients_reduce_to_the_plain_average():
    torch.manual_seed(0)
    a = {"w": torch.randn(4, 3, 3, 3), "b": torch.randn(4), "bn.num_batches_tracked": torch.tensor(5)}
    b = {"w": torch.randn(4, 3, 3, 3) * 3 + 1, "b": torch.randn(4), "bn.num_batches_tracked": torch.tensor(9)}
    fused, weights = fuse([a, b])
    for k in ("w", "b"):
        assert weights[k].tolist() == [0.5, 0.5]
        assert torch.allclose(fused[k], (a[k] + b[k]) / 2, atol=1e-7)
    assert int(fused["bn.num_batches_tracked"]) == 9  # integer buffers: the max
    assert fused["bn.num_batches_tracked"].dtype == torch.int64


def test_identical_tensors_get_uniform_weights():
    t = torch.ones(3, 2)
    assert fusion_weights(torch.stack([t, t, t])).tolist() == pytest.approx([1 / 3] * 3)
    assert fusion_weights(torch.stack([t])).tolist() == [1.0]


def test_fusion_ablations_of_table_4_by_hand():
    stack = torch.tensor([[0.0], [1.0], [5.0]])  # d = 2, 1, 3
    assert fusion_weights(stack, "average").tolist() == pytest.approx([1 / 3] * 3)
    inv = [1 / 2, 1, 1 / 3]
    assert fusion_weights(stack, "similarity").tolist() == pytest.approx([v / sum(inv) for v in inv])
    # L1 over (0,0), (1,1), (5,5) with AVG (2,2): d = 4, 2, 6
    two = torch.tensor([[0.0, 0.0], [1.0, 1.0], [5.0, 5.0]])
    assert fusion_weights(two, metric="l1").tolist() == pytest.approx([4 / 12, 2 / 12, 6 / 12])
    # cosine to AVG (1, 1): (1, 0) -> 1 - 1/sqrt2, (0, 1) -> same, (2, 2) -> 0
    cos = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 2.0]])
    assert fusion_weights(cos, metric="cosine").tolist() == pytest.approx([0.5, 0.5, 0.0], abs=1e-12)


def test_aggregate_uses_every_upload_not_the_sample_weights():
    m = method()
    state = {"global": {"t": torch.zeros(1)}}
    each = {c: Upload({"t": torch.tensor([v])}, weight=w) for c, v, w in ((0, 0.0, 1.0), (1, 1.0, 100.0),
                                                                         (2, 5.0, 1.0))}
    new = m.aggregate(state, AllUploads(each), 1)
    assert new["global"]["t"].item() == pytest.approx(16 / 6, abs=1e-6)
    assert new["fusion_weights"]["weights"]["t"].tolist() == pytest.approx([2 / 6, 1 / 6, 3 / 6])
    assert state["global"]["t"].item() == 0.0  # the old state is not mutated


# ============================================================================ MK-MMD

def mmd_direct(zs, zt, mults=tuple(3.0 ** k for k in range(-3, 2))):
    """Element by element, in float64."""
    z = torch.cat([zs, zt]).double()
    n, b = len(z), len(zs)
    d = [[float(((z[i] - z[j]) ** 2).sum()) for j in range(n)] for i in range(n)]
    mean = sum(map(sum, d)) / n ** 2

    def k(i, j):
        return sum(math.exp(-d[i][j] / (2 * (s * mean + 1e-8))) for s in mults)

    ss = sum(k(i, j) for i in range(b) for j in range(b) if i != j)
    tt = sum(k(b + i, b + j) for i in range(b) for j in range(b) if i != j)
    st = sum(k(i, b + j) for i in range(b) for j in range(b))
    return (ss + tt) / (b * (b - 1)) - 2 * st / b ** 2 + 2 / (b - 1)


def test_mk_mmd_matches_a_direct_computation():
    g = torch.Generator().manual_seed(1)
    zs = torch.randn(5, 3, 2, 2, generator=g)
    zt = torch.randn(5, 3, 2, 2, generator=g) * 2 + 0.5
    got = mk_mmd(zs.double(), zt.double())
    assert got.item() == pytest.approx(mmd_direct(zs.flatten(1), zt.flatten(1)), rel=1e-10)
    assert mk_mmd(zs, zt).item() == pytest.approx(mmd_direct(zs.flatten(1), zt.flatten(1)), rel=1e-5)


def test_vectorised_pairs_equal_the_pairwise_estimator():
    g = torch.Generator().manual_seed(4)
    a = torch.randn(3, 6, 2, 3, 3, generator=g, dtype=torch.float64)  # R=3, B=6, 2x3x3 features
    b = torch.randn(3, 6, 2, 3, 3, generator=g, dtype=torch.float64) * 1.5 + 0.3
    pairs = mk_mmd_pairs(a, b)
    assert pairs.shape == (3, 3)
    for l in range(3):
        for m in range(3):
            assert pairs[l, m].item() == pytest.approx(mk_mmd(a[l], b[m]).item(), rel=1e-10)


def test_mk_mmd_by_hand_on_two_points():
    # zs = {0, 1}, zt = {0, 1} (1-D): D = [[0,1,0,1],[1,0,1,0],...], mean D = 8/16 = 1/2
    zs = torch.tensor([[0.0], [1.0]], dtype=torch.float64)
    kern = sum(math.exp(-1 / (2 * (3.0 ** k * 0.5 + 1e-8))) for k in range(-3, 2))  # K at distance 1
    # ss = tt = 2 * kern (off-diagonal), st: 2 * 5 (equal points) + 2 * kern
    expect = (4 * kern) / 2 - 2 * (10 + 2 * kern) / 4 + 2
    assert mk_mmd(zs, zs.clone()).item() == pytest.approx(expect, rel=1e-12)
    assert expect == pytest.approx(kern - 3, rel=1e-12)


def test_mk_mmd_bandwidth_is_not_differentiated_and_grad_flows_to_both_sides():
    zs = torch.randn(4, 6, requires_grad=True)
    zt = torch.randn(4, 6, requires_grad=True)
    mk_mmd(zs, zt).backward()
    assert zs.grad.abs().sum() > 0 and zt.grad.abs().sum() > 0
    with pytest.raises(ValueError):
        mk_mmd(torch.randn(1, 3), torch.randn(1, 3))


# ============================================================================ Eqs. 7-9: attention

def test_attention_scores_equal_the_averaged_maps_of_eqs_7_and_8():
    g = torch.Generator().manual_seed(2)
    a = [torch.randn(3, 4, 2, 3, generator=g) for _ in range(3)]  # B=3, c=4, d=6
    b = [torch.randn(3, 4, 2, 3, generator=g) for _ in range(3)]
    s_p, s_c = attention_scores(a, b)
    for l in range(3):
        for m in range(3):
            A, B = a[l].flatten(2), b[m].flatten(2)  # B x c x d
            pos = torch.bmm(A.transpose(1, 2), B)  # A^T B: d x d per sample
            chan = torch.bmm(A, B.transpose(1, 2))  # A B^T: c x c per sample
            assert pos.shape[1:] == (6, 6) and chan.shape[1:] == (4, 4)
            assert s_p[l, m].item() == pytest.approx(pos.mean().item(), rel=1e-5, abs=1e-6)
            assert s_c[l, m].item() == pytest.approx(chan.mean().item(), rel=1e-5, abs=1e-6)


def test_attention_weights_by_hand_and_rows_sum_to_one():
    # 1x1x1x1 features: both maps are the product a_l * b_m: [[1, 3], [2, 6]]
    a = [torch.full((1, 1, 1, 1), 1.0), torch.full((1, 1, 1, 1), 2.0)]
    b = [torch.full((1, 1, 1, 1), 1.0), torch.full((1, 1, 1, 1), 3.0)]
    alpha = attention_weights(a, b)
    e2, e4 = math.exp(2), math.exp(4)
    assert alpha.tolist()[0] == pytest.approx([1 / (1 + e2), e2 / (1 + e2)])
    assert alpha.tolist()[1] == pytest.approx([1 / (1 + e4), e4 / (1 + e4)])
    g = torch.Generator().manual_seed(3)
    a = [torch.randn(4, 8, 3, 3, generator=g, requires_grad=True) for _ in range(3)]
    b = [torch.randn(4, 8, 3, 3, generator=g) for _ in range(3)]
    for mode in ("both", "position", "channel"):
        w = attention_weights(a, b, mode)
        assert w.shape == (3, 3) and not w.requires_grad  # a constant (stop-gradient)
        assert torch.allclose(w.sum(1), torch.ones(3))
        assert (w >= 0).all()
    s_p, s_c = attention_scores(a, b)
    both = attention_weights(a, b, "both")
    assert torch.allclose(both, 0.5 * (torch.softmax(s_p, 1) + torch.softmax(s_c, 1)))
    assert torch.allclose(attention_weights(a, b, "position", temperature=2.0), torch.softmax(s_p / 2, 1))


# ============================================================================ Eq. 5: projections, R

@pytest.mark.parametrize("size_in,size_out,kind,kernel,stride", [
    ((28, 28), (7, 7), nn.Conv2d, (22, 22), (1, 1)),  # ResNet-18 layer2 -> 7x7
    ((14, 14), (7, 7), nn.Conv2d, (3, 3), (2, 2)),
    ((7, 7), (7, 7), nn.Conv2d, (1, 1), (1, 1)),
    ((4, 4), (8, 8), nn.ConvTranspose2d, (4, 4), (2, 2)),
    ((5, 5), (8, 8), nn.ConvTranspose2d, (4, 4), (1, 1)),
])
def test_projection_conv_rules(size_in, size_out, kind, kernel, stride):
    conv = projection_conv(6, size_in, 32, size_out)
    assert type(conv) is kind and conv.kernel_size == kernel and conv.stride == stride
    assert conv(torch.zeros(2, 6, *size_in)).shape == (2, 32, *size_out)


def test_projections_go_to_the_last_layers_size():
    proj = Projections([(32, 14, 14), (64, 7, 7)], channels=32)
    assert proj.out_shape == (32, 7, 7) and len(proj.fused) == len(proj.local) == 2
    assert proj.fused[0] is not proj.local[0]


@pytest.mark.parametrize("name,kw,expect", [
    ("mnist_cnn", {}, ("features.pool1", "features.pool2")),
    ("small_cnn", {}, ("features.pool1", "features.pool2")),
    ("cnn6", {"input_size": 16}, ("features.pool1", "features.pool2", "features.relu3")),
    ("resnet18_tv", {"input_size": 64}, ("features.layer2", "features.layer3", "features.layer4")),
    ("alexnet", {"hidden": 16, "input_size": 224}, ("features.relu3", "features.relu4", "features.pool5")),
])
def test_default_layer_sets(name, kw, expect):
    model = build(name, num_classes=10, **kw)
    assert default_layers(model) == expect


def test_mnist_cnn_taps_have_the_papers_shapes():
    model = build("mnist_cnn", num_classes=10)
    taps = FeatureTaps(model, default_layers(model))
    model(torch.zeros(2, 1, 28, 28))
    assert [tuple(f.shape[1:]) for f in taps.take()] == [(32, 14, 14), (64, 7, 7)]
    taps.remove()
    assert not model.features.pool1._forward_hooks


# ============================================================================ client steps

def tiny_net():
    feats = nn.Sequential(OrderedDict([
        ("conv1", nn.Conv2d(1, 4, 3, 1, 1)), ("bn1", nn.BatchNorm2d(4)), ("relu1", nn.ReLU()),
        ("pool1", nn.MaxPool2d(2)),
        ("conv2", nn.Conv2d(4, 6, 3, 1, 1)), ("relu2", nn.ReLU()), ("pool2", nn.MaxPool2d(2)),
        ("flatten", nn.Flatten())]))
    return Net(feats, nn.Linear(6 * 2 * 2, 3), (1, 8, 8))


def ctx_for(m, model, srv, cid, rnd, state, data, epochs=1):
    """``data``: the client's training split (an InMemorySplit, whose ``passes`` count the passes drawn)."""
    payload = m.broadcast(srv, rnd)
    m.load_client_model(model, payload, state)
    return client_context(m, model, ClientData(data), client_id=cid, round=rnd, payload=payload, state=state,
                          train=TrainConfig(epochs=epochs, batch_size=4, lr=0.05, momentum=0.5), seed=100 * rnd + cid,
                          domain=str(cid))


def federation(m, rounds, n_clients=3, epochs=1):
    """Run ``rounds`` rounds by hand; return (server state, client states, per-round uploads)."""
    torch.manual_seed(0)
    model = tiny_net()
    srv = m.init_server(model)
    states = {c: m.init_client_state(c, model) for c in range(n_clients)}
    g = torch.Generator().manual_seed(7)
    data = {c: InMemorySplit(torch.randn(10, 1, 8, 8, generator=g) + c, torch.randint(0, 3, (10,), generator=g))
            for c in range(n_clients)}
    history = []
    for rnd in range(1, rounds + 1):
        each = {}
        for c in range(n_clients):
            up = m.local_update(ctx_for(m, model, srv, c, rnd, states[c], data[c], epochs))
            each[c] = Upload({k: v.detach().clone() for k, v in up.tensors.items()}, up.weight, up.extras,
                             up.metrics)
        srv = m.aggregate(srv, AllUploads(each), rnd)
        history.append(each)
    return srv, states, history, data


def test_independent_heads_are_each_clients_own_draw_and_the_trunk_is_shared():
    """Default (official code): each client draws its own head before stage 1, from its own
    generator; the trunk stays the received one. False: every client keeps the received head."""
    torch.manual_seed(0)
    model = tiny_net()
    data = InMemorySplit(torch.randn(4, 1, 8, 8), torch.randint(0, 3, (4,)))
    for independent in (True, False):
        m = method(stage1_epochs=0, independent_head_init=independent)
        srv = m.init_server(model)
        ups = [m.local_update(ctx_for(m, tiny_net(), srv, cid, 1, {}, data)).tensors for cid in (0, 1, 0)]
        for k, v in srv["global"].items():
            same = [torch.equal(u[k], v) for u in ups]
            assert all(same) == (not independent or not k.startswith("head.")), k
        if independent:
            assert not torch.equal(ups[0]["head.weight"], ups[1]["head.weight"])  # one draw per client
            assert torch.equal(ups[0]["head.weight"], ups[2]["head.weight"])  # from its own generator


def test_frozen_reference_never_changes_across_rounds():
    m = method(stage1_epochs=2)
    srv, states, history, _ = federation(m, rounds=4)
    for c, state in states.items():
        ref = state["reference"]
        stage1 = history[0][c].tensors  # the reference is the client's stage-1 model G^h ...
        assert set(ref) == set(stage1)
        assert all(torch.equal(ref[k], stage1[k]) for k in ref)  # ... bit for bit, after 3 more rounds
        assert state["acquired_round"] == 1
        # while the calibrated copies did move away from it
        last = history[-1][c].tensors
        assert any(not torch.equal(ref[k], last[k]) for k in ref if ref[k].is_floating_point())
        buf = io.BytesIO()  # the engine spills client state with torch.save / weights_only load
        torch.save(state, buf)
        buf.seek(0)
        back = torch.load(buf, weights_only=True)
        assert all(torch.equal(back["reference"][k], ref[k]) for k in ref)


def test_round_one_is_stage_one_and_later_rounds_calibrate():
    m = method(stage1_epochs=3)
    srv, states, history, data = federation(m, rounds=2, epochs=2)
    r1, r2 = history[0][0].metrics, history[1][0].metrics
    assert r1["stage"] == 1 and r1["steps"] == 3 * 3  # 3 epochs of ceil(10 / 4) batches
    assert r2["stage"] == 2 and r2["steps"] == 2 * 2  # 2 epochs of floor(10 / 4) (drop_last: MMD needs B >= 2)
    assert r2["align"] > 0 and r2["ce"] > 0
    assert r2["loss"] == pytest.approx(r2["ce"] + 0.6 * r2["align"], rel=1e-6)
    assert 0 <= r2["alpha_entropy"] <= math.log(2) + 1e-6
    assert data[0].passes[:3] == [False] * 3 and data[0].passes[3:] == [True, True]


def test_stage_one_uses_label_smoothing_and_the_iteration_budget():
    m = method(stage1_epochs=2, stage1_iters_per_epoch=5)
    torch.manual_seed(0)
    model = tiny_net()
    srv = m.init_server(model)
    data = InMemorySplit(torch.randn(10, 1, 8, 8), torch.randint(0, 3, (10,)))
    state = {}
    up = m.local_update(ctx_for(m, model, srv, 0, 1, state, data))
    assert up.metrics["steps"] == 10  # 2 x 5 iterations, cycling through 3 passes of 3 batches
    assert len(data.passes) == 4
    # plain CE of the official code's variant gives a different first loss on the same batch
    # (one shared initial head, so that the loss can be checked against the received model)
    ls = method(stage1_epochs=1, stage1_iters_per_epoch=1, independent_head_init=False)
    oc = method(stage1_epochs=1, stage1_iters_per_epoch=1, variant="official_code", independent_head_init=False)
    losses = []
    for mm in (ls, oc):
        model = tiny_net()
        model.load_state_dict(srv["global"])
        losses.append(mm.local_update(ctx_for(mm, model, srv, 0, 1, {}, data)).metrics["loss"])
    x, y = next(InMemorySplit(data.x, data.y).batches(4, torch.Generator().manual_seed(100), None))
    model = tiny_net()
    model.load_state_dict(srv["global"])
    model.train()
    assert losses[0] == pytest.approx(nn.functional.cross_entropy(model(x), y, label_smoothing=0.1).item(), rel=1e-5)
    model.load_state_dict(srv["global"])
    assert losses[1] == pytest.approx(nn.functional.cross_entropy(model(x), y).item(), rel=1e-5)


def test_calibration_step_matches_eq_11_by_hand():
    """One calibration step: the loss is CE + lam * sum alpha * MMD on the projected taps."""
    m = method(stage1_epochs=1, iters_per_epoch=1)
    srv, states, history, data = federation(m, rounds=1)
    torch.manual_seed(0)
    model = tiny_net()
    ctx = ctx_for(m, model, srv, 0, 2, states[0], data[0])
    gen_copy = torch.Generator().manual_seed(200)
    up = m.local_update(ctx)
    # rebuild by hand what the step saw
    from raysim.methods.csac.method import _build_projections
    model.load_state_dict(srv["global"])
    model.train()
    ref = tiny_net()
    ref.load_state_dict(states[0]["reference"])
    ref.eval()
    x, y = next(data[0].batches(4, gen_copy, None, drop_last=True))
    layers = ("features.pool1", "features.pool2")
    tm, tl = FeatureTaps(model, layers), FeatureTaps(ref, layers)
    logits = model(x)
    with torch.no_grad():
        ref(x)
    fm, fl = tm.take(), tl.take()

    class C:  # the projection seed is the next draw of the round's generator
        generator, device = gen_copy, torch.device("cpu")
    proj = _build_projections(fm, m.hp, C)
    a = [p(f) for p, f in zip(proj.fused, fm)]
    b = [p(f) for p, f in zip(proj.local, fl)]
    alpha = attention_weights(a, b)
    l_al = sum(alpha[i, j] * mk_mmd(a[i], b[j]) for i in range(2) for j in range(2))
    ce = nn.functional.cross_entropy(logits, y)
    assert up.metrics["steps"] == 1
    assert up.metrics["ce"] == pytest.approx(ce.item(), rel=1e-5)
    assert up.metrics["align"] == pytest.approx(l_al.item(), rel=1e-4)
    assert up.metrics["loss"] == pytest.approx((ce + 0.6 * l_al).item(), rel=1e-4)


def test_official_code_variant_has_no_alignment_but_a_logit_mmd():
    hp = CSACHparams(variant="official_code")
    assert hp.use_alignment == "none" and hp.use_label_smoothing == 0.0 and hp.use_logit_mmd_weight == 0.6
    m = method(stage1_epochs=1, variant="official_code")
    _, _, history, _ = federation(m, rounds=2)
    r2 = history[1][0].metrics
    assert r2["align"] == 0.0 and r2["logit_mmd"] != 0.0 and "alpha_entropy" not in r2
    assert r2["loss"] == pytest.approx(r2["ce"] + 0.6 * r2["logit_mmd"], rel=1e-6)


@pytest.mark.parametrize("alignment", ["same_layer", "uniform", "none"])
def test_alignment_ablations_run(alignment):
    m = method(stage1_epochs=1, alignment=alignment, discrepancy="mse" if alignment == "uniform" else "mmd")
    _, _, history, _ = federation(m, rounds=2, n_clients=2)
    r2 = history[1][1].metrics
    assert (r2["align"] == 0.0) == (alignment == "none")


def test_without_retraining_loss_only_the_alignment_trains():
    m = method(stage1_epochs=1, retrain_loss=False)
    _, _, history, _ = federation(m, rounds=2, n_clients=2)
    r2 = history[1][0].metrics
    assert r2["ce"] > 0 and r2["loss"] == pytest.approx(0.6 * r2["align"], rel=1e-6)


def test_same_seed_same_result():
    a = federation(method(stage1_epochs=1), rounds=2)[0]["global"]
    b = federation(method(stage1_epochs=1), rounds=2)[0]["global"]
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("bad", [{"fusion": "mean"}, {"alignment": "all"}, {"lam": -1.0}, {"variant": "code"},
                                 {"layers": [1, 2]}, {"label_smoothing": 1.0}, {"alpha_temperature": 0.0}])
def test_bad_hyperparameters(bad):
    with pytest.raises(UserError, match="hp.csac"):
        CSAC.hparams_from(bad, prefix="hp.csac")


def test_layers_from_a_list_and_unknown_layer():
    assert CSAC.hparams_from({"layers": ["features.pool1", "features.pool2"]}).layers == ("features.pool1",
                                                                                        "features.pool2")
    m = method(stage1_epochs=1, layers=("features.nowhere",))
    with pytest.raises(UserError, match="no module"):
        federation(m, rounds=2, n_clients=1)


def tiny_domains():
    """Four 3-class domains of random 1x8x8 uint8 images (10 train / 4 val / 6 test each)."""
    import numpy as np
    from raysim.data.splits import ArraySplit, MultiDomainDataset

    rng = np.random.default_rng(0)
    splits = {}
    for k, d in enumerate("abcd"):
        splits[d] = {s: ArraySplit(rng.integers(0, 255, (n, 1, 8, 8), dtype=np.uint8) // (k + 1),
                                   rng.integers(0, 3, n), (0.5,), (0.5,))
                     for s, n in (("train", 10), ("val", 4), ("test", 6))}
    return MultiDomainDataset("tiny", splits, ["0", "1", "2"])


def test_on_a_real_host_the_reference_survives_spilling_and_the_fused_model_is_evaluated(tmp_path, monkeypatch):
    """ClientHost (no Ray), clients' state spilled to disk after every step (state_memory_mb 0)."""
    import raysim.data
    from raysim.config import load_config
    from raysim.engine.host import ClientHost

    monkeypatch.setattr(raysim.data, "load", lambda *a, **k: tiny_domains())
    cfg = load_config(raw={
        "method": "csac", "rounds": 3, "seed": 1,
        "data": {"dataset": "rotated_mnist", "partition": {"kind": "per_domain", "holdout": "d"}},
        "model": {"name": "small_cnn", "norm": "bn"},
        "train": {"epochs": 1, "batch_size": 4, "lr": 0.05, "momentum": 0.5},
        "eval": {"protocol": "lodo"},
        "runtime": {"num_hosts": 1, "state_memory_mb": 0, "spill_dir": str(tmp_path)},
        "hp": {"csac": {"stage1_epochs": 1, **PASS}},
    })
    clients = [0, 1, 2]
    host = ClientHost(0, cfg, num_hosts=1, gpu_ids=[])  # holds 0..2 and 3, the held-out domain's client
    assert host.start()["clients"] == 4 and list(host.client_ids) == clients + [3]
    m = host.method
    srv = m.init_server(host.model)
    refs = None
    for rnd in (1, 2, 3):
        res = host.train_round(rnd, [m.broadcast(srv, rnd)], clients)
        assert all(res.client_metrics[c]["stage"] == (1 if rnd == 1 else 2) for c in clients)
        srv = m.aggregate(srv, m.aggregator.reduce([res.uploads]), rnd)
        assert host.store.spills > 0
        now = {c: host.store.get(c)["state"]["reference"] for c in clients}
        if refs is None:
            refs = now
            for c in clients:  # L^h is the stage-1 upload
                assert all(torch.equal(refs[c][k], res.uploads[c].tensors[k]) for k in refs[c])
        for c in clients:
            assert all(torch.equal(refs[c][k], now[c][k]) for k in refs[c])
    out = host.evaluate(3, [m.broadcast(srv, 3)], {3: ["test"]}, "lodo")
    assert out[3]["test"].num_samples == 20  # the unseen domain, whole
