"""FedDyn: its key equations against values worked out by hand on scalars or tiny tensors (baselines
spec 2.2)."""
import pytest
import torch

from small_cnn_harness import context, setup, small
from raysim.core.aggregation import Mean
from raysim.methods.feddyn import FedDyn, dynamic_regularizer, server_step


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
