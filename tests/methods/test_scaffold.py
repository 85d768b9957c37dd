"""SCAFFOLD: its key equations against values worked out by hand on scalars or tiny tensors (baselines
spec 2.1)."""
import pytest
import torch
import torch.nn.functional as F

from small_cnn_harness import Scalar, context, setup, small
from raysim.core.aggregation import Mean, WeightedMean
from raysim.config import TrainConfig
from raysim.core.contract import Upload, sgd_step
from raysim.core.errors import UserError
from raysim.methods.scaffold import Scaffold, control_update, correction
from raysim.testing import client_context, fixed_batches, random_client_data


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
            sgd_step(0.5 * (model.theta - ak).pow(2).sum() + correction(dict(model.named_parameters()), drift), opt)
            y = {"theta": model.theta.detach().clone()}
            new = control_update(c_k[k], c, x, y, 1, lr)
            ups.append(Upload(y, 1.0, statistics={"theta": new["theta"] - c_k[k]["theta"]}))
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


def random_variates(model, seed):
    """A server variate c (0.01 N(0, 1)) and a client's c_i (0.02 N(0, 1)) for each of ``model``'s
    parameters, drawn in that order from a generator seeded with ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    c = {k: 0.01 * torch.randn(p.shape, generator=gen) for k, p in model.named_parameters()}
    c_i = {k: 0.02 * torch.randn(p.shape, generator=gen) for k, p in model.named_parameters()}
    return c, c_i


def test_scaffold_client_step_is_sgd_on_the_corrected_gradient_and_option_two():
    m = Scaffold(Scaffold.Hparams(), setup(2))
    model = small()
    x = {k: v.clone() for k, v in model.state_dict().items()}
    c, c_i = random_variates(model, seed=3)
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
    assert up.weight == 1.0 and steps == 2 and set(up.tensors) == set(x)  # Delta c_i in up.statistics only
    for k in c_i:  # option II by hand: c_i - c + (x - y) / (K eta)
        expected = c_i[k] - c[k] + (x[k] - ref.state_dict()[k]) / (steps * 0.1)
        assert torch.allclose(ctx.state["c"][k], expected, atol=1e-5), k
        assert torch.allclose(up.statistics[k], expected - c_i[k], atol=1e-5), k


def test_scaffold_server_divides_the_variate_by_all_clients_and_steps_eta_g():
    m = Scaffold(Scaffold.Hparams.from_dict({"eta_g": 0.5}), setup(4))  # N = 4, 2 sampled
    state = {"global": {"w": torch.tensor([1.0]), "b": torch.tensor([5.0])}, "c": {"w": torch.tensor([1.0])}}
    uploads = Mean({"w": torch.tensor([3.0]), "b": torch.tensor([7.0])}, 2.0, [0, 1], statistics={"w": torch.tensor([2.0])})
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
        assert set(up.statistics) == set(state["c"]) and set(devices(up.statistics).values()) == {"accelerator"}
        assert set(ctx.state["c"]) == set(state["c"]) and set(devices(ctx.state["c"]).values()) == {"cpu"}


def test_scaffold_option_two_uses_the_steps_taken_and_this_rounds_lr():
    """Spec 2.1 pitfall 2: E = 2 epochs of 2 batches (4 and 2 images) is K = 4 steps (one epoch: 2), and eta_l
    is the round's decayed lr (ctx.lr = 0.05, train.lr = 0.1): c_i+ = c_i - c + (x - y) / (4 * 0.05)."""
    m = Scaffold(Scaffold.Hparams(), setup(2))
    model = small()
    x = {k: v.clone() for k, v in model.state_dict().items()}
    c, c_i = random_variates(model, seed=4)
    ctx = context(m, model, {"global": x, "c": c}, {"c": {k: v.clone() for k, v in c_i.items()}}, lr=0.05, epochs=2,
                  data=random_client_data(num_train=6))
    ctx.train = TrainConfig(epochs=2, batch_size=4, lr=0.1)  # the undecayed lr
    up = m.local_update(ctx)
    assert up.metrics["steps"] == 4
    for k in c_i:
        y = up.tensors[k].cpu()
        expected = c_i[k] - c[k] + (x[k] - y) / (4 * 0.05)
        assert torch.allclose(ctx.state["c"][k].cpu(), expected, atol=1e-5), k
        assert torch.allclose(up.statistics[k].cpu(), expected - c_i[k], atol=1e-5), k
