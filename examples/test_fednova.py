"""FedNova's equations on numbers worked out by hand, with raysim's test harness (raysim.testing).

    pytest test_fednova.py          # from the folder holding fednova.py
"""
import torch

from raysim import testing
from raysim.core.contract import Upload

from fednova import A_NORM, STEP, FedNova, local_steps_norm


def fold(method, uploads):
    """What the engine hands ``aggregate``: the uploads folded by the method's aggregator."""
    partial = method.aggregator.start()
    for cid, up in enumerate(uploads):
        method.aggregator.add(partial, cid, up)
    return method.aggregator.reduce([partial])


def upload(d, running_mean, a_norm, n):
    return Upload(tensors={STEP + "w": torch.tensor(d), "bn.running_mean": torch.tensor(running_mean),
                           A_NORM: torch.tensor(a_norm, dtype=torch.float64)}, weight=float(n))


def test_server_step_rescales_the_average_of_the_normalised_updates():
    method = FedNova(FedNova.Hparams(), testing.setup())
    state = {"global": {"w": torch.tensor([1.0, 2.0]), "bn.running_mean": torch.tensor([0.0, 4.0])}}
    # client 1: n = 1, tau = 2, x - y = [0.2, 0.4] -> d = [0.1, 0.2]
    # client 2: n = 3, tau = 4, x - y = [0.8, 0.0] -> d = [0.2, 0.0]
    uploads = fold(method, [upload([0.1, 0.2], [1.0, 4.0], 2.0, 1), upload([0.2, 0.0], [2.0, 8.0], 4.0, 3)])
    new = method.aggregate(state, uploads, round=1)["global"]
    # p = (1/4, 3/4); tau_eff = 2/4 + 3 * 4/4 = 3.5; sum_i p_i d_i = [0.025 + 0.15, 0.05] = [0.175, 0.05]
    # w = [1 - 3.5 * 0.175, 2 - 3.5 * 0.05] = [0.3875, 1.825]      (FedAvg's mean: [0.35, 1.9])
    assert torch.allclose(new["w"], torch.tensor([0.3875, 1.825]), atol=1e-6, rtol=0)
    # buffers: the plain weighted mean [1/4 + 3 * 2/4, 4/4 + 3 * 8/4] = [1.75, 7.0]
    assert torch.allclose(new["bn.running_mean"], torch.tensor([1.75, 7.0]), atol=1e-6, rtol=0)


def test_equal_local_steps_give_fedavgs_mean():
    method = FedNova(FedNova.Hparams(), testing.setup())
    state = {"global": {"w": torch.tensor([1.0, 2.0]), "bn.running_mean": torch.tensor([0.0, 0.0])}}
    # tau = 2 for both: y_1 = [0.8, 1.6], y_2 = [0.2, 2.0]; FedAvg: (1 * y_1 + 3 * y_2) / 4 = [0.35, 1.9]
    uploads = fold(method, [upload([0.1, 0.2], [0.0, 0.0], 2.0, 1), upload([0.4, 0.0], [0.0, 0.0], 2.0, 3)])
    assert torch.allclose(method.aggregate(state, uploads, round=1)["global"]["w"], torch.tensor([0.35, 1.9]),
                          atol=1e-6, rtol=0)


def test_a_norm_is_the_weight_momentum_sgd_gives_the_gradients():
    # ||a||_1 for tau = 3, rho = 0.5: (1 - rho^m) / (1 - rho) for m = 1, 2, 3 -> 1 + 1.5 + 1.75 = 4.25
    assert local_steps_norm(3, 0.5) == 4.25 and local_steps_norm(3, 0.0) == 3.0
    # torch's momentum SGD under a constant gradient g = 2 moves w by lr * g * ||a||_1 = 0.1 * 2 * 4.25
    w = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1, momentum=0.5)
    for _ in range(3):
        opt.zero_grad()
        (2.0 * w).sum().backward()
        opt.step()
    assert torch.allclose(-w.detach(), torch.tensor([0.85]), atol=1e-6, rtol=0)


def test_client_uploads_its_update_divided_by_its_local_steps():
    method = FedNova(FedNova.Hparams(), testing.setup())
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 3))
    x = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(2, 1, 8, 8, generator=g), torch.tensor([0, 2])) for _ in range(3)]
    ctx = testing.client_context(method, model, testing.fixed_batches(*batches), train={"lr": 0.1})
    up = method.local_update(ctx)
    y = model.state_dict()
    assert ctx.steps == 3 and float(up.tensors[A_NORM]) == 3.0 and up.weight == 6.0
    for k in ("1.weight", "1.bias"):
        assert torch.allclose(up.tensors[STEP + k], (x[k] - y[k]) / 3, atol=1e-7, rtol=0)


def test_fednova_runs_rounds_and_scores_every_domain(tmp_path):
    metrics = testing.run_rounds("fednova:FedNova", tmp_path, "rounds=2")  # the real round loop, in this process
    test = metrics[(metrics.split == "test") & (metrics.metric == "accuracy")]
    assert {"mnist", "usps", "svhn", "AVG"} <= set(test.domain) and test.value.notna().all()
