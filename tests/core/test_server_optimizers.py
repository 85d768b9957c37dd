"""The server optimizers (raysim.core.server_optimizers; Reddi et al. 2021 Alg. 2, Hsu et al. 2019)
on tiny tensors computed by hand, in both forms (``code``: Keras Adam, TF Addons Yogi and Keras
Adagrad, the reference forms their η was tuned with; ``paper``: Alg. 2 as printed), the default
aggregate that applies them, and their state in a checkpoint."""
import dataclasses
import io

import pytest
import torch

from raysim.config import ServerConfig, load_config
from raysim.core.aggregation import Mean
from raysim.core.contract import Method
from raysim.core.errors import UserError
from raysim.core.server_optimizers import STATE_KEY, ServerOptimizer, resolve
from raysim.testing import setup

# One step on two coordinates, in float64, with η = 0.1, β1 = 0.5, β2 = 0.75, τ = 0.5:
#   x_t = [1, 2], mean = [1.5, 1]  ->  Δ = mean − x_t = [0.5, −1],  Δ² = [0.25, 1]
#   m_t = β1 m + (1 − β1) Δ = 0.5 m + [0.25, −0.5]
X = torch.tensor([1.0, 2.0], dtype=torch.float64)
MEAN = torch.tensor([1.5, 1.0], dtype=torch.float64)


def one_step(opt: ServerOptimizer, state: dict) -> tuple[list[float], dict]:
    new, state = opt.step({"w": X}, {"w": MEAN - X}, state)
    return new["w"].tolist(), state


def given(m, v) -> dict:
    return {"m": {"w": torch.tensor(m, dtype=torch.float64)}, "v": {"w": torch.tensor(v, dtype=torch.float64)}}


def opt(name: str, form: str = "paper") -> ServerOptimizer:
    return ServerOptimizer(name=name, lr=0.1, momentum=0.5, betas=(0.5, 0.75), tau=0.5, form=form)


def test_sgd_steps_along_the_mean_update():
    # x = x + η Δ = [1 + 0.05, 2 − 0.1]
    new, _ = one_step(opt("sgd"), {})
    assert new == pytest.approx([1.05, 1.9], abs=1e-12)


def test_momentum_accumulates_the_mean_update():
    # v_{t−1} = [0.2, 0.4]: v_t = β v + Δ = [0.1 + 0.5, 0.2 − 1] = [0.6, −0.8]
    # x = x + η v_t = [1 + 0.06, 2 − 0.08]
    new, state = one_step(opt("momentum"), {"velocity": {"w": torch.tensor([0.2, 0.4], dtype=torch.float64)}})
    assert state["velocity"]["w"].tolist() == pytest.approx([0.6, -0.8], abs=1e-12)
    assert new == pytest.approx([1.06, 1.92], abs=1e-12)


def test_adam_alg2_literal():
    # m = [0.1, 0.2] -> m_t = [0.05 + 0.25, 0.1 − 0.5] = [0.3, −0.4]
    # v = [1.25, 0] -> v_t = β2 v + (1 − β2) Δ² = [0.9375 + 0.0625, 0 + 0.25] = [1, 0.25]
    # x = x + η m_t / (√v_t + τ) = [1 + 0.1·0.3/1.5, 2 − 0.1·0.4/1.0] = [1.02, 1.96]
    new, state = one_step(opt("adam"), given([0.1, 0.2], [1.25, 0.0]))
    assert state["m"]["w"].tolist() == pytest.approx([0.3, -0.4], abs=1e-12)
    assert state["v"]["w"].tolist() == pytest.approx([1.0, 0.25], abs=1e-12)
    assert new == pytest.approx([1.02, 1.96], abs=1e-12)


def test_yogi_moves_v_towards_the_squared_update_by_a_fixed_step():
    # v = [0.3125, 0]: v − Δ² = [0.0625, −1], sign [+1, −1]
    # v_t = v − (1 − β2) Δ² sign(v − Δ²) = [0.3125 − 0.0625, 0 + 0.25] = [0.25, 0.25]
    # m_t = [0.3, −0.4] (m = [0.1, 0.2]);  x = x + η m_t / (0.5 + 0.5) = [1.03, 1.96]
    new, state = one_step(opt("yogi"), given([0.1, 0.2], [0.3125, 0.0]))
    assert state["v"]["w"].tolist() == pytest.approx([0.25, 0.25], abs=1e-12)
    assert new == pytest.approx([1.03, 1.96], abs=1e-12)


def test_adagrad_sums_the_squared_updates():
    # m = [0.1, 0.3] -> m_t = [0.05 + 0.25, 0.15 − 0.5] = [0.3, −0.35]
    # v = [0.3125, 0.5625] -> v_t = v + Δ² = [0.5625, 1.5625], √v_t = [0.75, 1.25]
    # x = x + η m_t / (√v_t + τ) = [1 + 0.03/1.25, 2 − 0.035/1.75] = [1.024, 1.98]
    new, state = one_step(opt("adagrad"), given([0.1, 0.3], [0.3125, 0.5625]))
    assert state["v"]["w"].tolist() == pytest.approx([0.5625, 1.5625], abs=1e-12)
    assert new == pytest.approx([1.024, 1.98], abs=1e-12)


def test_paper_form_state_starts_at_zero_moments_and_v_at_tau_squared():
    p = {"w": X}
    assert ServerOptimizer("momentum").init(p)["velocity"]["w"].tolist() == [0.0, 0.0]
    for name in ("adam", "yogi", "adagrad"):
        state = ServerOptimizer(name, tau=0.5, form="paper").init(p)
        assert state["m"]["w"].tolist() == [0.0, 0.0]
        assert state["v"]["w"].tolist() == [0.25, 0.25]  # v_{−1} = τ² (Alg. 2: v_{−1} >= τ²)
    # first Adam step from it: m = [0.25, −0.5], v = 0.75·0.25 + 0.25·[0.25, 1] = [0.25, 0.4375]
    new, _ = one_step(opt("adam"), opt("adam").init(p))
    assert new == pytest.approx([1 + 0.1 * 0.25 / 1.0, 2 - 0.1 * 0.5 / (0.4375 ** 0.5 + 0.5)], abs=1e-12)


# ----------------------------------------------------------------------------- the code form (default)
# Two steps, each with Δ = [0.5, −1] (the same x_t, mean), η = 0.1, β1 = 0.5, β2 = 0.75, τ = 0.5.
# Bias correction c_t = √(1 − β2^t) / (1 − β1^t): c_1 = √0.25 / 0.5 = 1, c_2 = √0.4375 / 0.75.
C2 = 0.4375 ** 0.5 / 0.75


def two_steps(name: str) -> tuple[list[float], list[float], dict]:
    o = opt(name, form="code")
    first, state = one_step(o, o.init({"w": X}))
    second, state = one_step(o, state)
    return first, second, state


def test_the_code_form_is_the_default():
    assert ServerOptimizer("adam").form == "code" and resolve(None, "adam").form == "code"


def test_keras_adam_is_bias_corrected_from_v_zero():
    # step 1: m = 0.5 Δ = [0.25, −0.5], v = 0.25 Δ² = [0.0625, 0.25] (from v = 0), √v = [0.25, 0.5]
    #   x = x + η c_1 m / (√v + τ) = [1 + 0.1·0.25/0.75, 2 − 0.1·0.5/1.0]
    # step 2: m = [0.125 + 0.25, −0.25 − 0.5] = [0.375, −0.75];
    #   v = 0.75 [0.0625, 0.25] + 0.25 [0.25, 1] = [0.109375, 0.4375]
    first, second, state = two_steps("adam")
    assert first == pytest.approx([1 + 0.1 * 0.25 / 0.75, 1.95], abs=1e-12)
    assert state["v"]["w"].tolist() == pytest.approx([0.109375, 0.4375], abs=1e-12)
    assert state["step"] == 2
    assert second == pytest.approx([1 + 0.1 * C2 * 0.375 / (0.109375 ** 0.5 + 0.5),
                                    2 - 0.1 * C2 * 0.75 / (0.4375 ** 0.5 + 0.5)], abs=1e-12)


def test_tfa_yogi_is_bias_corrected_from_v_zero():
    # step 1: v = 0 − 0.25 Δ² sign(0 − Δ²) = [0.0625, 0.25]: Adam's first step
    # step 2: v − Δ² = [−0.1875, −0.75] < 0  ->  v = v + 0.25 Δ² = [0.125, 0.5]; m = [0.375, −0.75]
    first, second, state = two_steps("yogi")
    assert first == pytest.approx([1 + 0.1 * 0.25 / 0.75, 1.95], abs=1e-12)
    assert state["v"]["w"].tolist() == pytest.approx([0.125, 0.5], abs=1e-12)
    assert second == pytest.approx([1 + 0.1 * C2 * 0.375 / (0.125 ** 0.5 + 0.5),
                                    2 - 0.1 * C2 * 0.75 / (0.5 ** 0.5 + 0.5)], abs=1e-12)


def test_keras_adagrad_has_no_first_moment_and_no_bias_correction():
    # Keras Adagrad: acc += g², x −= η g / (√acc + ε), g = −Δ; acc from 0 (the code's
    # initial_accumulator_value=0.0).  step 1: v = Δ² = [0.25, 1];  step 2: v = [0.5, 2];
    # m = Δ both times (β1 = 0), c_t = 1
    first, second, state = two_steps("adagrad")
    assert first == pytest.approx([1 + 0.1 * 0.5 / (0.5 + 0.5), 2 - 0.1 / (1 + 0.5)], abs=1e-12)
    assert state["m"]["w"].tolist() == pytest.approx([0.5, -1.0], abs=1e-12)
    assert second == pytest.approx([1 + 0.1 * 0.5 / (0.5 ** 0.5 + 0.5), 2 - 0.1 / (2 ** 0.5 + 0.5)], abs=1e-12)


# ----------------------------------------------------------------------------- the default aggregate

def bn_state(conv, running_mean, running_var, tracked) -> dict:
    return {"conv.weight": torch.tensor(conv), "bn.running_mean": torch.tensor(running_mean),
            "bn.running_var": torch.tensor(running_var), "bn.num_batches_tracked": torch.tensor(tracked)}


def aggregate(server, state: dict, mean: dict, method=Method) -> dict:
    m = method(method.Hparams(), dataclasses.replace(setup(), server=server))
    return m.aggregate(state, Mean(mean=mean, total_weight=2.0, clients=[0, 1]), round=1)


def test_running_statistics_take_the_mean_and_integer_buffers_are_left_to_it():
    glob = bn_state([1.0, 2.0], [0.0, 0.0], [1.0, 1.0], 4)
    mean = bn_state([1.5, 1.0], [0.3, -0.2], [0.8, 1.2], 6)
    out = aggregate(ServerConfig(optimizer="adam", lr=0.1, betas=(0.5, 0.75), tau=0.5, form="paper"),
                    {"global": glob}, mean)
    new = out["global"]
    for k in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked"):
        assert torch.equal(new[k], mean[k]), k
    assert new["bn.num_batches_tracked"].dtype == torch.int64
    # conv.weight took Adam's first step from v = τ² = 0.25, m = 0 (test above, in float32)
    expected = [1 + 0.1 * 0.25 / 1.0, 2 - 0.1 * 0.5 / (0.4375 ** 0.5 + 0.5)]
    assert new["conv.weight"].tolist() == pytest.approx(expected, abs=1e-6)
    assert set(out[STATE_KEY]["m"]) == {"conv.weight"}  # only the parameters carry optimizer state


def test_the_state_carries_from_round_to_round():
    # momentum, β = 0.5, η = 0.1, from v = 0:  x0 = [1, 2], mean1 = [1.5, 1]: Δ1 = [0.5, −1] = v1,
    # x1 = [1.05, 1.9];  mean2 = [1.25, 2.1]: Δ2 = [0.2, 0.2], v2 = 0.5 v1 + Δ2 = [0.45, −0.3],
    # x2 = x1 + 0.1 v2 = [1.095, 1.87]
    server = ServerConfig(optimizer="momentum", lr=0.1, momentum=0.5)
    one = aggregate(server, {"global": {"w": X}}, {"w": MEAN})
    two = aggregate(server, one, {"w": torch.tensor([1.25, 2.1], dtype=torch.float64)})
    assert two[STATE_KEY]["velocity"]["w"].tolist() == pytest.approx([0.45, -0.3], abs=1e-12)
    assert two["global"]["w"].tolist() == pytest.approx([1.095, 1.87], abs=1e-12)


def test_sgd_at_lr_1_is_the_plain_mean_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    glob = {"w": torch.randn(5, 3, generator=gen), "bn.num_batches_tracked": torch.tensor(2)}
    mean = {"w": torch.randn(5, 3, generator=gen), "bn.num_batches_tracked": torch.tensor(3)}
    for server in (None, ServerConfig(), ServerConfig(optimizer="sgd", lr=1.0)):
        out = aggregate(server, {"global": glob, "c": 1}, mean)
        assert out == {"global": {**glob, **mean}, "c": 1}  # no optimizer state: the step was skipped
        assert all(out["global"][k] is mean[k] for k in mean)
    # sgd at another lr steps: x + 0.5 (mean − x)
    out = aggregate(ServerConfig(optimizer="sgd", lr=0.5), {"global": glob}, mean)
    assert torch.allclose(out["global"]["w"], glob["w"] + 0.5 * (mean["w"] - glob["w"]))


def test_the_optimizer_state_round_trips_through_a_checkpoint():
    server = ServerConfig(optimizer="yogi", lr=0.1)
    glob = bn_state([1.0, 2.0], [0.0, 0.0], [1.0, 1.0], 4)
    state = aggregate(server, {"global": glob}, bn_state([1.5, 1.0], [0.3, -0.2], [0.8, 1.2], 6))
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    nxt = bn_state([1.2, 0.5], [0.1, 0.1], [0.9, 1.1], 8)
    a, b = aggregate(server, state, nxt), aggregate(server, loaded, nxt)
    for part in ("m", "v"):
        assert torch.equal(a[STATE_KEY][part]["conv.weight"], b[STATE_KEY][part]["conv.weight"])
    assert torch.equal(a["global"]["conv.weight"], b["global"]["conv.weight"])


# ----------------------------------------------------------------------------- settings

def test_lr_and_optimizer_default_to_the_method_s():
    assert resolve(None) == ServerOptimizer("sgd", lr=1.0)
    assert resolve(ServerConfig(), "adam").lr == 0.01
    assert resolve(ServerConfig(optimizer="adagrad")).lr == 0.1
    assert resolve(ServerConfig(optimizer="adam", lr=0.3), "adam").lr == 0.3


def test_a_fedopt_variant_refuses_another_optimizer():
    with pytest.raises(UserError, match="fedadam is FedAvg with server.optimizer=adam"):
        resolve(ServerConfig(optimizer="yogi"), "adam", "fedadam")


def test_a_method_with_its_own_aggregate_refuses_a_server_optimizer():
    class Own(Method):
        name = "own"

        def aggregate(self, state, uploads, round):
            return state

    assert resolve(ServerConfig(optimizer="sgd"), own_aggregate=True).plain_mean
    with pytest.raises(UserError, match="own has its own server step"):
        resolve(ServerConfig(optimizer="adam"), method="own", own_aggregate=True)
    from raysim.app.configs import check_methods
    with pytest.raises(UserError, match="^method scaffold has its own server step[^\n]*$"):
        check_methods(load_config(raw={"method": "scaffold", "server": {"optimizer": "adam"}}))
    check_methods(load_config(raw={"methods": ["fedavg", "scaffold"],
                                   "per_method": {"fedavg": {"server": {"optimizer": "adam"}}}}))


@pytest.mark.parametrize("raw, message", [
    ({"optimizer": "lamb"}, "server.optimizer"),
    ({"betas": [0.9]}, "server.betas"),
    ({"betas": [0.9, 1.0]}, "server.betas"),
    ({"tau": 0}, "server.tau"),
    ({"lr": -1}, "server.lr"),
    ({"form": "keras"}, "server.form"),
])
def test_bad_server_settings_are_one_line_errors(raw, message):
    with pytest.raises(UserError, match=message):
        load_config(raw={"server": raw})
