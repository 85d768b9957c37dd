"""SCAFFOLD, FedDyn, MOON, Ditto, LG-FedAvg and PartialFed: each key equation against values
worked out by hand on scalars or tiny tensors (baselines spec sections 2-3)."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from raysim.core.aggregation import Mean, WeightedMean
from raysim.config import TrainConfig
from raysim.core.contract import Upload, sgd_step
from raysim.core.errors import UserError
from raysim.methods.ditto import Ditto, personal_objective
from raysim.methods.feddyn import FedDyn, dynamic_regularizer, server_step
from raysim.methods.lg_fedavg import LGFedAvg, global_modules
from raysim.methods.moon import MOON, model_contrastive_loss
from raysim.methods.partialfed import PartialFed, kept_keys
from raysim.methods.scaffold import DELTA_C, Scaffold, control_update, correction
from raysim.models import build
from raysim import testing
from raysim.testing import client_context, fixed_batches, random_client_data


def setup(n=2, **kw):
    return testing.setup(num_clients=n, **kw)  # 3 classes of 1 x 8 x 8 images, small_cnn with BN, 3 rounds


def small(seed=0):
    torch.manual_seed(seed)
    return build("small_cnn", num_classes=3, in_channels=1, input_size=8, norm="bn")


def context(method, model, payload, state, cid=0, rnd=2, lr=0.1, epochs=1, data=None):
    return client_context(method, model, data or random_client_data(seed=cid), client_id=cid, round=rnd,
                          payload=payload, state=state, train=TrainConfig(epochs=epochs, batch_size=4, lr=lr), seed=7)


class Scalar(nn.Module):
    def __init__(self, value=0.0):
        super().__init__()
        self.theta = nn.Parameter(torch.tensor([value]))


# ----------------------------------------------------------------------------- SCAFFOLD

def test_scaffold_removes_the_client_drift_on_two_quadratics():
    """f_k = (theta - a_k)^2 / 2, a = (1, 3), x = 0, c = c_k = 0, eta_l = 0.1, K = 1 (spec 2.1):
    round 1: y = (0.1, 0.3), c_k = (-1, -3) = grad f_k(0), c = -2, x = 0.2; round 2: both corrected
    gradients are -1.8 (the global gradient at 0.2), so y_1 = y_2 = 0.38."""
    a, lr = (1.0, 3.0), 0.1
    m = Scaffold(Scaffold.Hparams(), setup(2))
    state = {"global": {"theta": torch.zeros(1)}, "c": {"theta": torch.zeros(1)}}
    c_k = [{"theta": torch.zeros(1)} for _ in a]
    history = []
    for rnd in (1, 2):
        x, c = state["global"], state["c"]
        ups = []
        for k, ak in enumerate(a):
            model = Scalar(float(x["theta"]))
            opt = torch.optim.SGD(model.parameters(), lr=lr)
            drift = {n: c[n] - c_k[k][n] for n in c}
            sgd_step(0.5 * (model.theta - ak).pow(2).sum() + correction(model, drift), opt)
            y = {"theta": model.theta.detach().clone()}
            new = control_update(c_k[k], c, x, y, 1, lr)
            ups.append(Upload({**y, DELTA_C + "theta": new["theta"] - c_k[k]["theta"]}, 1.0))
            c_k[k] = new
        history.append([float(u.tensors["theta"]) for u in ups])
        agg = WeightedMean()
        part = agg.start()
        for k, u in enumerate(ups):
            agg.add(part, k, u)
        state = m.aggregate(state, agg.reduce([part]), rnd)
        if rnd == 1:
            assert [float(ck["theta"]) for ck in c_k] == pytest.approx([-1.0, -3.0])
            assert float(state["c"]["theta"]) == pytest.approx(-2.0) and float(state["global"]["theta"]) == pytest.approx(0.2)
    assert history[0] == pytest.approx([0.1, 0.3]) and history[1] == pytest.approx([0.38, 0.38])


def test_scaffold_client_step_is_sgd_on_the_corrected_gradient_and_option_two():
    m = Scaffold(Scaffold.Hparams(), setup(2))
    model = small()
    x = {k: v.clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(3)
    c = {k: 0.01 * torch.randn(p.shape, generator=gen) for k, p in model.named_parameters()}
    c_i = {k: 0.02 * torch.randn(p.shape, generator=gen) for k, p in model.named_parameters()}
    ctx = context(m, model, {"global": x, "c": c}, {"c": {k: v.clone() for k, v in c_i.items()}})
    up = m.local_update(ctx)
    # by hand: the same batches, plain SGD on grad CE + c - c_i
    ref = small()
    ref.load_state_dict(x)
    ref.train()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    steps = 0
    for xb, yb in random_client_data(seed=0).batches(4, torch.Generator().manual_seed(7), "cpu"):
        opt.zero_grad()
        F.cross_entropy(ref(xb), yb).backward()
        for k, p in ref.named_parameters():
            p.grad += c[k] - c_i[k]
        opt.step()
        steps += 1
    for k, v in ref.state_dict().items():
        assert torch.allclose(up.tensors[k], v, atol=1e-6), k
    assert up.weight == 1.0 and steps == 2
    for k in c_i:  # option II by hand: c_i - c + (x - y) / (K eta)
        expected = c_i[k] - c[k] + (x[k] - ref.state_dict()[k]) / (steps * 0.1)
        assert torch.allclose(ctx.state["c"][k], expected, atol=1e-5), k
        assert torch.allclose(up.tensors[DELTA_C + k], expected - c_i[k], atol=1e-5), k


def test_scaffold_server_divides_the_variate_by_all_clients_and_steps_eta_g():
    m = Scaffold(Scaffold.Hparams.from_dict({"eta_g": 0.5}), setup(4))  # N = 4, 2 sampled
    state = {"global": {"w": torch.tensor([1.0]), "b": torch.tensor([5.0])}, "c": {"w": torch.tensor([1.0])}}
    uploads = Mean({"w": torch.tensor([3.0]), "b": torch.tensor([7.0]), DELTA_C + "w": torch.tensor([2.0])}, 2.0, [0, 1])
    new = m.aggregate(state, uploads, 1)
    assert float(new["global"]["w"]) == 2.0  # 1 + 0.5 (3 - 1)
    assert float(new["global"]["b"]) == 7.0  # not a parameter (a buffer): plain mean
    assert float(new["c"]["w"]) == 2.0  # 1 + (1/4) (2 + 2)
    with pytest.raises(UserError, match="option"):
        Scaffold.hparams_from({"option": "III"})


def test_scaffold_keeps_its_variates_on_the_cpu_and_does_the_arithmetic_on_the_model_device():
    """The server's c and each c_i live on the CPU whatever device trains; a round's drift c - c_i,
    option II's c_i+ and Delta c_i are computed on ctx.device. The simulated accelerator of
    accelerator.py stands for a GPU: CPU variates mixed into its arithmetic fail, as on a GPU."""
    import warnings
    from accelerator import devices, on_accelerator, simulated_accelerator
    m = Scaffold(Scaffold.Hparams(), setup(2))
    with warnings.catch_warnings(), simulated_accelerator() as device:
        warnings.simplefilter("ignore")
        model = on_accelerator(small())
        server = m.init_server(model)
        payload, state = m.broadcast(server, 1), m.init_client_state(0, model)
        for variates in (server["c"], payload["c"], state["c"]):
            assert variates and set(devices(variates).values()) == {"cpu"}
        # a client whose epoch has no batch: a round on a ``meta`` model takes no step (a meta
        # tensor has no values for a loss to be read from)
        ctx = client_context(m, model, fixed_batches(), payload=payload, state=state,
                             train=TrainConfig(batch_size=4, lr=0.1), seed=7, device=device)
        up = m.local_update(ctx)
        assert set(devices({k: up.tensors[DELTA_C + k] for k in state["c"]}).values()) == {"accelerator"}
        assert set(ctx.state["c"]) == set(state["c"]) and set(devices(ctx.state["c"]).values()) == {"cpu"}


def test_scaffold_option_two_uses_the_steps_taken_and_this_rounds_lr():
    """Spec 2.1 pitfall 2: E = 2 epochs of 2 batches (4 and 2 images) is K = 4 steps (one epoch: 2), and eta_l
    is the round's decayed lr (ctx.lr = 0.05, train.lr = 0.1): c_i+ = c_i - c + (x - y) / (4 * 0.05)."""
    m = Scaffold(Scaffold.Hparams(), setup(2))
    model = small()
    x = {k: v.clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(4)
    c = {k: 0.01 * torch.randn(p.shape, generator=gen) for k, p in model.named_parameters()}
    c_i = {k: 0.02 * torch.randn(p.shape, generator=gen) for k, p in model.named_parameters()}
    ctx = context(m, model, {"global": x, "c": c}, {"c": {k: v.clone() for k, v in c_i.items()}}, lr=0.05, epochs=2,
                  data=random_client_data(num_train=6))
    ctx.train = TrainConfig(epochs=2, batch_size=4, lr=0.1)  # the undecayed lr
    up = m.local_update(ctx)
    assert up.metrics["steps"] == 4
    for k in c_i:
        y = up.tensors[k].cpu()
        expected = c_i[k] - c[k] + (x[k] - y) / (4 * 0.05)
        assert torch.allclose(ctx.state["c"][k].cpu(), expected, atol=1e-5), k
        assert torch.allclose(up.tensors[DELTA_C + k].cpu(), expected - c_i[k], atol=1e-5), k


# ----------------------------------------------------------------------------- FedDyn

def test_feddyn_reaches_the_global_optimum_on_two_quadratics():
    """L_k = (theta - a_k)^2 / 2, a = (1, 3), alpha = 1, exact local solves
    theta_k = (a_k + g_k + alpha theta^{t-1}) / (1 + alpha) (spec 2.2): round 1 theta_k = (0.5, 1.5),
    g = (-0.5, -1.5), h = -1, theta^1 = 2; round 2 theta_k = (1.25, 1.75), g = (0.25, -1.25), h = -0.5,
    theta^2 = 2."""
    a, alpha = (1.0, 3.0), 1.0
    theta, h, g = torch.zeros(1), {"t": torch.zeros(1)}, [torch.zeros(1), torch.zeros(1)]
    expected = [((0.5, 1.5), (-0.5, -1.5), -1.0), ((1.25, 1.75), (0.25, -1.25), -0.5)]
    for local_exp, g_exp, h_exp in expected:
        local = [(ak + g[k] + alpha * theta) / (1 + alpha) for k, ak in enumerate(a)]
        # the exact solve is where the gradient of L_k - <g_k, .> + alpha/2 ||. - theta||^2 vanishes
        for k, ak in enumerate(a):
            p = local[k].clone().requires_grad_(True)
            (0.5 * (p - ak) ** 2 + dynamic_regularizer({"t": p}, {"t": g[k]}, {"t": theta}, alpha)).sum().backward()
            assert abs(float(p.grad)) < 1e-6
        g = [g[k] - alpha * (local[k] - theta) for k in range(2)]
        new, h = server_step({"t": theta}, {"t": (local[0] + local[1]) / 2}, h, alpha, 2, 2)
        theta = new["t"]
        assert [float(v) for v in local] == pytest.approx(local_exp)
        assert [float(v) for v in g] == pytest.approx(g_exp) and float(h["t"]) == pytest.approx(h_exp)
        assert float(theta) == pytest.approx(2.0)


def test_feddyn_client_updates_its_linear_term_from_its_drift():
    m = FedDyn(FedDyn.Hparams.from_dict({"alpha": 0.1}), setup(2))
    model = small()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    g0 = {k: torch.full_like(p, 0.01) for k, p in model.named_parameters()}
    ctx = context(m, model, {"global": start}, {"g": {k: v.clone() for k, v in g0.items()}})
    up = m.local_update(ctx)
    for k in g0:  # g_k <- g_k - alpha (theta_k - theta^{t-1})
        assert torch.allclose(ctx.state["g"][k], g0[k] - 0.1 * (up.tensors[k] - start[k]), atol=1e-7), k
    assert up.weight == 1.0
    assert FedDyn.Hparams.search_space()["alpha"].choices == (0.001, 0.01, 0.03, 0.1)


def test_feddyn_server_divides_h_by_all_clients_under_partial_participation():
    """N = 4, |S| = 2, alpha = 0.5, theta^{t-1} = 1, the clients' mean 3 (sum of drifts 4), h = 0.2:
    h <- 0.2 - (0.5 / 4) * 4 = -0.3 (1/|S| would give -0.8); theta^t = 3 + 0.3 / 0.5 = 3.6; a buffer
    takes the mean."""
    m = FedDyn(FedDyn.Hparams.from_dict({"alpha": 0.5}), setup(4))
    state = {"global": {"w": torch.tensor([1.0]), "rm": torch.tensor([5.0])}, "h": {"w": torch.tensor([0.2])}}
    new = m.aggregate(state, Mean({"w": torch.tensor([3.0]), "rm": torch.tensor([7.0])}, 2.0, [0, 1]), 1)
    assert float(new["h"]["w"]) == pytest.approx(-0.3)
    assert float(new["global"]["w"]) == pytest.approx(3.6) and float(new["global"]["rm"]) == 7.0


# ----------------------------------------------------------------------------- MOON

def test_moon_contrastive_loss_by_hand():
    z = torch.tensor([[1.0, 0.0]])
    # z = z_glob, z orthogonal to z_prev: -log(e^2 / (e^2 + e^0)) = log(1 + e^-2)
    assert float(model_contrastive_loss(z, z.clone(), torch.tensor([[0.0, 3.0]]), 0.5)) == pytest.approx(
        math.log(1 + math.exp(-2)), abs=1e-5)
    assert float(model_contrastive_loss(z, z * 2, z * 5, 0.5)) == pytest.approx(math.log(2), abs=1e-6)
    # a batch is averaged: the second sample has z = -z_glob, z = z_prev: log(1 + e^{(1 - (-1)) / 0.5})
    zb = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    zg, zp = torch.tensor([[1.0, 0.0], [0.0, -1.0]]), torch.tensor([[0.0, 1.0], [0.0, 1.0]])
    expected = (math.log(1 + math.exp(-2)) + math.log(1 + math.exp(4))) / 2
    assert float(model_contrastive_loss(zb, zg, zp, 0.5)) == pytest.approx(expected, abs=1e-5)


def test_moon_keeps_its_previous_model_and_contrasts_from_its_second_round():
    m = MOON(MOON.Hparams.from_dict({"mu": 1.0}), setup(2))
    model = small()
    glob = {k: v.clone() for k, v in model.state_dict().items()}
    state = m.init_client_state(0, model)
    first = m.local_update(context(m, model, {"global": glob}, state, rnd=1))
    assert "con_loss" not in first.metrics  # no previous model: l_con = 0 (FLGo)
    prev = state["previous"]
    assert all(torch.equal(prev[k], first.tensors[k]) for k in prev)
    model.load_state_dict(glob)
    second = m.local_update(context(m, model, {"global": glob}, state, rnd=2))
    assert second.metrics["con_loss"] > 0
    # MOON with mu = 0 is FedAvg's step
    plain = MOON(MOON.Hparams.from_dict({"mu": 0.0}), setup(2))
    model.load_state_dict(glob)
    a = plain.local_update(context(plain, model, {"global": glob}, {"previous": prev}))
    from raysim.methods.fedavg import FedAvg
    model.load_state_dict(glob)
    b = FedAvg(FedAvg.Hparams(), setup(2)).local_update(context(plain, model, {"global": glob}, {}))
    assert all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)
    head = MOON(MOON.Hparams.from_dict({"head": "mlp", "proj_dim": 16}), setup(2)).build_model()
    assert head.head.in_features == 16 and head.feature_dim == 16


def test_moon_previous_model_is_its_own_last_local_model_every_round():
    """Spec 2.3: z_prev comes from the client's model at the end of its last participation, never
    the received global model, in every round (the contrastive ones included)."""
    m = MOON(MOON.Hparams.from_dict({"mu": 1.0}), setup(2))
    model = small()
    glob = {k: v.clone() for k, v in model.state_dict().items()}
    state = m.init_client_state(0, model)
    for rnd in (1, 2):
        model.load_state_dict(glob)
        up = m.local_update(context(m, model, {"global": glob}, state, rnd=rnd, data=random_client_data(num_train=4)))
        assert ("con_loss" in up.metrics) == (rnd > 1)
        assert all(torch.equal(state["previous"][k], up.tensors[k]) for k in up.tensors), rnd
        assert not torch.equal(state["previous"]["head.weight"], glob["head.weight"])


# ----------------------------------------------------------------------------- Ditto

def test_ditto_personal_solver_converges_geometrically_to_its_fixed_point():
    """L(v) = (v - 3)^2 / 2, w = 1, lambda = 1: v* = (3 + 1) / 2 = 2, and gradient steps of 0.1
    from v = 0 give |v_t - 2| = 2 * 0.8^t exactly (spec 3.1)."""
    v = Scalar(0.0)
    opt = torch.optim.SGD(v.parameters(), lr=0.1)
    anchor = {"theta": torch.tensor([1.0])}
    for t in range(1, 6):
        loss = personal_objective(0.5 * ((v.theta - 3) ** 2).sum(), dict(v.named_parameters()), anchor, 1.0)
        sgd_step(loss, opt)
        assert abs(float(v.theta.detach()) - 2) == pytest.approx(2 * 0.8 ** t, rel=1e-5)


def test_ditto_anchors_the_personal_model_to_the_received_global_model():
    m = Ditto(Ditto.Hparams.from_dict({"lam": 0.5}), setup(2))
    model = small()
    received = {k: v.clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(5)
    v0 = {k: v + 0.05 * torch.randn(v.shape, generator=gen) if v.is_floating_point() else v.clone()
          for k, v in received.items()}
    ctx = context(m, model, {"global": received}, {"v": {k: t.clone() for k, t in v0.items()}})
    up = m.local_update(ctx)
    # by hand: the personal solver alone, anchored at w^t = received, on the same batches
    ref = small()
    ref.load_state_dict(v0)
    ref.train()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    anchor = {k: received[k] for k, _ in ref.named_parameters()}
    for xb, yb in random_client_data(seed=0).batches(4, torch.Generator().manual_seed(7), "cpu"):
        sgd_step(personal_objective(F.cross_entropy(ref(xb), yb), dict(ref.named_parameters()), anchor, 0.5), opt)
    for k, t in ref.state_dict().items():
        assert torch.allclose(ctx.state["v"][k].float(), t.float(), atol=1e-6), k
    assert not torch.equal(up.tensors["head.weight"], received["head.weight"])  # the global copy trained too
    # scored with the personal model
    probe = small(9)
    m.eval_model(probe, {"global": received}, ctx.state)
    assert torch.equal(probe.state_dict()["head.weight"], ctx.state["v"]["head.weight"])


def test_ditto_post_train_state_is_the_personal_model():
    """eval.point post_train scores v_k (FLGo, FDSE), not the global copy the client trained."""
    m = Ditto(Ditto.Hparams.from_dict({"lam": 0.5}), setup(2))
    model = small()
    received = {k: v.clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(6)
    v0 = {k: v + 0.05 * torch.randn(v.shape, generator=gen) if v.is_floating_point() else v.clone()
          for k, v in received.items()}
    ctx = context(m, model, {"global": received}, {"v": v0}, data=random_client_data(num_train=4))
    m.local_update(ctx)
    post = m.post_train_state(ctx)
    assert set(post) == set(ctx.state["v"]) and all(torch.equal(post[k], ctx.state["v"][k]) for k in post)
    assert not torch.equal(post["head.weight"], model.state_dict()["head.weight"])


# ----------------------------------------------------------------------------- LG-FedAvg

def test_lg_fedavg_shares_the_top_layers_and_keeps_the_representation():
    model = small()
    assert global_modules(model, 2) == ["features.fc1", "head"]
    m = LGFedAvg(LGFedAvg.Hparams(), setup(3))
    personal = m.personal_keys(model)
    assert {k.split(".")[1] for k in personal} == {"conv1", "bn1", "conv2", "bn2"}
    assert not any(k.startswith(("head.", "features.fc1.")) for k in personal)
    with pytest.raises(UserError, match="global_layers = 9"):
        LGFedAvg(LGFedAvg.Hparams.from_dict({"global_layers": 9}), setup()).personal_keys(model)
    # two clients train, the server averages omega, and every client (the idle one too) gets it
    state = m.init_server(model)
    clients = {c: m.init_client_state(c, model) for c in range(3)}
    ups = {}
    for c in (0, 1):
        m.load_client_model(model, m.broadcast(state, 1), clients[c])
        ups[c] = m.local_update(context(m, model, m.broadcast(state, 1), clients[c], cid=c))
    agg = WeightedMean()
    part = agg.start()
    for c, u in ups.items():
        agg.add(part, c, u)
    state = m.aggregate(state, agg.reduce([part]), 1)
    for k in state["global"]:
        assert torch.allclose(state["global"][k], (ups[0].tensors[k] + ups[1].tensors[k]) / 2), k
    for c in range(3):
        m.eval_model(model, m.eval_payload(state, 1), clients[c])
        sd = model.state_dict()
        assert all(torch.equal(sd[k], state["global"][k]) for k in state["global"])
        assert all(torch.equal(sd[k], clients[c]["personal"][k]) for k in personal)
    assert not torch.equal(clients[0]["personal"]["features.conv1.weight"], clients[1]["personal"]["features.conv1.weight"])


# ----------------------------------------------------------------------------- PartialFed

class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer1, self.layer2 = nn.Linear(2, 2), nn.Linear(2, 2)


def test_partialfed_starts_from_the_global_model_except_the_kept_layers():
    net = TwoLayers()
    m = PartialFed(PartialFed.Hparams.from_dict({"keep": ["layer2"]}), setup(2))
    assert kept_keys(net, ("layer2",)) == {"layer2.weight", "layer2.bias"}
    glob = {k: torch.full_like(v, 1.0) for k, v in net.state_dict().items()}
    own = {k: torch.full_like(v, 7.0) for k, v in net.state_dict().items()}
    m.load_client_model(net, {"global": glob}, {"model": own})  # init[1] = theta^t[1], init[2] = theta_c[2]
    assert float(net.layer1.weight.mean()) == 1.0 and float(net.layer2.weight.mean()) == 7.0
    m.load_client_model(net, {"global": glob}, {})  # first participation: everything loaded
    assert float(net.layer2.weight.mean()) == 1.0
    # kept layers are still uploaded and averaged: the server's layer 2 is the weighted mean
    state = m.aggregate({"global": glob}, Mean({k: torch.full_like(v, 4.0) for k, v in glob.items()}, 2, [0, 1]), 1)
    assert float(state["global"]["layer2.weight"].mean()) == 4.0
    default = kept_keys(small(), ("bn", "head"))
    assert default == {k for k in small().state_dict() if k.startswith(("features.bn", "head."))}
    assert m.personal_keys(net) == set()  # nothing stays out of the average


def test_partialfed_uploads_the_kept_layers_and_the_server_averages_them():
    """Spec 3.3 pitfall 1: unlike FedBN, BN and head are uploaded and averaged; only the starting
    point is personal. Two clients start from their own kept layers; the server's head is the
    n_k-weighted mean of their trained heads."""
    m = PartialFed(PartialFed.Hparams(), setup(2))
    model = small()
    glob = {k: v.clone() for k, v in model.state_dict().items()}
    kept = kept_keys(model, m.hp.keep)
    agg = WeightedMean()
    part, heads = agg.start(), []
    for cid in (0, 1):
        own = {k: v + 0.1 * (cid + 1) if v.is_floating_point() else v.clone() for k, v in glob.items()}
        state = {"model": own}
        m.load_client_model(model, {"global": glob}, state)
        up = m.local_update(context(m, model, {"global": glob}, state, cid=cid, data=random_client_data(num_train=4, seed=cid)))
        assert set(up.tensors) == set(model.state_dict()) and kept <= set(up.tensors)
        heads.append((up.tensors["head.weight"].clone(), up.weight))
        agg.add(part, cid, up)
    new = m.aggregate({"global": glob}, agg.reduce([part]), 1)["global"]
    mean = sum(h * w for h, w in heads) / sum(w for _, w in heads)
    assert torch.allclose(new["head.weight"], mean, atol=1e-6)
