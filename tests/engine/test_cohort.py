"""Client cohorts (raysim.engine.cohort) against the per-client path, on the CPU, without Ray.

K clients trained as one vectorized step must leave every client where ``local_update`` alone
leaves it: its weights and buffers (BN running statistics), its upload, its loss and steps, and the
multiply-accumulates the simulated clock charges it, within 1e-5 relative. The clients have
unequal data sizes (so some stop before others, and some batches are short), gradient clipping,
momentum and weight decay, and start from different weights."""
import math
import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from raysim.models import from_setup
from raysim.core.contract import ClientContext, LocalLoss, Method, Setup
from raysim.models.dropout import KeyedDropout, dropout_generator
from raysim.engine.cohort import CohortClient, cohort_ready, run_cohort
from raysim.engine.compute import ComputeMeter
from raysim.core.tensors import load_tensors



pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors (tests/conftest.py)


SIZES = [5, 12, 7, 20, 3, 16, 9, 11]  # batch 4, 2 epochs: 2 to 10 steps, short last batches
TOL = 1e-5


class Toy:
    """A client's training split in memory: shuffled batches from the keyed generator."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def batches(self, batch_size, generator, device, drop_last=False):
        order = torch.randperm(len(self.y), generator=generator)
        for i in range(0, len(order), batch_size):
            j = order[i:i + batch_size]
            if drop_last and len(j) < batch_size:
                return
            yield self.x[j].to(device), self.y[j].to(device)


def mlp():
    return nn.Sequential(nn.Flatten(), nn.Linear(2 * 4 * 4, 16), nn.ReLU(), nn.Linear(16, 3))


def bn_cnn():
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(4 * 2 * 2, 3))


def dropout_cnn():
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), KeyedDropout(0.3), nn.Flatten(),
                         nn.Linear(4 * 4 * 4, 8), nn.ReLU(), KeyedDropout(0.5), nn.Linear(8, 3))


def train_cfg(**kw):
    base = dict(epochs=2, batch_size=4, lr=0.1, momentum=0.9, weight_decay=1e-3, lr_decay=1.0, max_steps=None,
                grad_clip=0.5, weighting="samples")
    return SimpleNamespace(**{**base, **kw})


def method_named(name, **hp):
    from raysim.methods import registry
    cls = registry.get(name) if hasattr(registry, "get") else registry.METHODS[name]
    setup = Setup(model_builder=from_setup, num_classes=3, image_shape=(2, 4, 4), num_clients=len(SIZES), client_domains=["a"] * len(SIZES),
                  model=None, train=train_cfg(), rounds=1, seed=0)
    return cls(cls.hparams_from(hp), setup)


def federation(make_model, seed=0):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # the same initial model on both paths
    model = make_model()
    starts = []
    for k in range(len(SIZES)):  # each client starts elsewhere (a personal layer, another round)
        starts.append({n: v + 0.05 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v.clone()
                       for n, v in model.state_dict().items()})
    data = [Toy(torch.randn(n, 2, 4, 4, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in SIZES]
    return model, starts, data


def context(model, k, data, train):
    return ClientContext(client_id=k, domain="a", round=1, model=model, payload={}, state={},
                         data=SimpleNamespace(batches=data[k].batches, num_train=len(data[k].y)), train=train,
                         lr=train.lr, generator=torch.Generator().manual_seed(100 + k), device=torch.device("cpu"))


def per_client(method, make_model, train):
    model, starts, data = federation(make_model)
    out = []
    for k in range(len(SIZES)):
        load_tensors(model, starts[k])
        ctx = context(model, k, data, train)
        with ComputeMeter() as meter, dropout_generator(torch.Generator().manual_seed(500 + k)):
            up = method.local_update(ctx)
        up.tensors = {n: v.clone() for n, v in up.tensors.items()}  # (views of the shared model)
        out.append(({n: v.clone() for n, v in model.state_dict().items()}, up, meter.macs))
    return out


def in_cohorts(method, make_model, train, K):
    model, starts, data = federation(make_model)
    out = []

    def after(ctx, up, macs):
        up.tensors = {n: v.clone() for n, v in up.tensors.items()}
        out.append(({n: v.clone() for n, v in model.state_dict().items()}, up, macs))

    for first in range(0, len(SIZES), K):
        clients = []
        for k in range(first, min(first + K, len(SIZES))):
            def start(k=k):
                load_tensors(model, starts[k])
                return context(model, k, data, train)
            clients.append(CohortClient(start, torch.Generator().manual_seed(500 + k)))
        run_cohort(method, model, clients, after, meter=True)
    return out


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def compare(ref, got):
    worst = 0.0
    assert len(ref) == len(got)
    for (sd_r, up_r, macs_r), (sd_g, up_g, macs_g) in zip(ref, got):
        for n in sd_r:
            if sd_r[n].is_floating_point():
                worst = max(worst, rel(sd_g[n], sd_r[n]))
            else:
                assert torch.equal(sd_g[n], sd_r[n]), n  # BN's batch counters
        for n in up_r.tensors:
            worst = max(worst, rel(up_g.tensors[n], up_r.tensors[n]))
        assert up_g.weight == up_r.weight
        assert up_g.metrics["steps"] == up_r.metrics["steps"]
        assert up_g.metrics["loss"] == pytest.approx(up_r.metrics["loss"], rel=TOL)
        assert macs_g == macs_r  # the clock charges the same passes
    assert worst <= TOL, worst
    return worst


@pytest.mark.parametrize("name,make_model", [("fedavg", mlp), ("fedprox", mlp), ("fedavg", bn_cnn),
                                             ("fedavg", dropout_cnn)])
def test_cohorts_of_1_3_8_train_every_client_as_alone(name, make_model):
    method = method_named(name, **({"mu": 0.5} if name == "fedprox" else {}))
    torch.manual_seed(0)
    train = train_cfg()
    ref = per_client(method, make_model, train)
    assert len({r[1].metrics["steps"] for r in ref}) > 3  # unequal data: clients stop at different steps
    for K in (1, 3, 8):
        worst = compare(ref, in_cohorts(method, make_model, train, K))
        print(f"{name} {make_model.__name__} K={K}: max relative difference {worst:.2e}")



def test_fedwon_at_its_own_learning_rate_trains_every_client_as_alone():
    """FedWon's hp.lr (its step at lr * hp.lr / train.lr, ``LocalLoss.lr`` in a cohort) set to 0.03,
    train.lr 0.1; batch 4 keeps AGC off ("auto"), so its clients train in cohorts."""
    method, train = method_named("fedwon", lr=0.03), train_cfg()
    ref = per_client(method, mlp, train)
    compare(ref, in_cohorts(method, mlp, train, 3))
    at_train_lr = per_client(method_named("fedwon"), mlp, train)
    assert rel(ref[3][0]["1.weight"], at_train_lr[3][0]["1.weight"]) > 1e-3  # hp.lr is not vacuous here



def frozen_head_mlp():
    """The mlp with its classifier frozen (requires_grad False): the gradient passes through it to
    the first layer, and SGD leaves it where it started."""
    model = mlp()
    model[3].requires_grad_(False)
    return model


def test_a_frozen_layer_trains_every_client_as_alone():
    method, train = method_named("fedavg"), train_cfg()
    ref = per_client(method, frozen_head_mlp, train)
    got = in_cohorts(method, frozen_head_mlp, train, 3)
    compare(ref, got)
    _, starts, _ = federation(frozen_head_mlp)
    for k, ((sd_r, _, _), (sd_g, _, _)) in enumerate(zip(ref, got)):
        for n in ("3.weight", "3.bias"):
            assert torch.equal(sd_r[n], starts[k][n]) and torch.equal(sd_g[n], starts[k][n])
        assert not torch.equal(sd_g["1.weight"], starts[k]["1.weight"])  # the layer before it trained



class UnusedParameter(nn.Module):
    """The mlp and a trainable parameter its forward never reads: alone, its ``.grad`` stays
    None, so ``torch.optim.SGD`` skips it (no weight decay, no momentum)."""

    def __init__(self):
        super().__init__()
        self.net = mlp()
        self.spare = nn.Parameter(torch.ones(5))

    def forward(self, x):
        return self.net(x)


@pytest.mark.parametrize("name", ["fedavg", "fedprox"])
def test_a_parameter_the_loss_never_reaches_trains_as_alone(name):
    """fedavg: the spare parameter stays exactly where it started, in a cohort as alone (it gets
    no weight decay, no momentum). fedprox: its proximal term reaches it (a zero gradient, not
    None), so weight decay moves it, alone as in a cohort."""
    method, train = method_named(name, **({"mu": 0.5} if name == "fedprox" else {})), train_cfg()
    ref = per_client(method, UnusedParameter, train)
    got = in_cohorts(method, UnusedParameter, train, 3)
    compare(ref, got)
    _, starts, _ = federation(UnusedParameter)
    for k, ((sd_r, _, _), (sd_g, _, _)) in enumerate(zip(ref, got)):
        assert torch.equal(sd_r["spare"], starts[k]["spare"]) == (name == "fedavg")
        if name == "fedavg":
            assert torch.equal(sd_g["spare"], starts[k]["spare"])


def test_max_steps_plain_sgd_and_no_clipping():
    method = method_named("fedavg")
    train = train_cfg(momentum=0.0, weight_decay=0.0, grad_clip=None, max_steps=4, epochs=3)
    ref = per_client(method, bn_cnn, train)
    assert {r[1].metrics["steps"] for r in ref} == {3, 4}  # the 3-sample client: 3 epochs of 1 step; the others capped
    compare(ref, in_cohorts(method, bn_cnn, train, 8))


def test_clipping_and_momentum_matter_here():
    """The equality above is not vacuous: clipping and momentum change the weights."""
    method = method_named("fedavg")
    a = per_client(method, mlp, train_cfg())
    b = per_client(method, mlp, train_cfg(grad_clip=None))
    assert rel(a[3][0]["1.weight"], b[3][0]["1.weight"]) > 1e-3



class Logits(nn.Module):
    """Two logits that are two parameters, whatever the input: a step's gradient by hand (two
    tensors, so the gradient's norm is over both, as ``clip_grad_norm_``'s)."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))

    def forward(self, x):
        return torch.cat([self.first, self.second]).expand(len(x), 2)

    def logits(self):
        return torch.cat([self.first, self.second]).detach().clone()


def test_each_clients_clip_coefficient_is_capped_at_one():
    """One plain SGD step (lr 1, train.grad_clip 1) on one class-0 example, two clients in one
    cohort. From b = (0, 0) the gradient softmax - onehot is (-1/2, 1/2), norm 0.71 < 1: the
    coefficient is exactly 1 (not 1 / 0.71), b = (1/2, -1/2) bit for bit. From b = (-3, 3) it is
    (q - 1, 1 - q), q = 1 / (1 + e^6), norm r = sqrt(2) (1 - q) = 1.41 > 1: scaled by 1 / (r + 1e-6),
    as ``clip_grad_norm_``. Alone, each client's step is the same."""
    from raysim import testing

    method, model = method_named("fedavg"), Logits()
    starts = {0: torch.tensor([0.0, 0.0]), 1: torch.tensor([-3.0, 3.0])}
    one = (torch.zeros(1, 1), torch.tensor([0]))

    def start(k):
        with torch.no_grad():
            model.first.copy_(starts[k][:1])
            model.second.copy_(starts[k][1:])
        return testing.client_context(method, model, testing.fixed_batches(one), client_id=k,
                                      train={"epochs": 1, "batch_size": 1, "lr": 1.0, "grad_clip": 1.0})
    q = 1 / (1 + math.exp(6))
    r = math.sqrt(2) * (1 - q)
    below, above = torch.tensor([0.5, -0.5]), torch.tensor([-3 + (1 - q) / (r + 1e-6), 3 - (1 - q) / (r + 1e-6)])
    together = {}
    run_cohort(method, model, [CohortClient(lambda k=k: start(k)) for k in (0, 1)],
               lambda ctx, up, macs: together.update({ctx.client_id: model.logits()}))
    assert torch.equal(together[0], below)
    assert torch.allclose(together[1], above, rtol=1e-6, atol=0)
    for k, expected in ((0, below), (1, above)):
        method.local_update(start(k))
        assert torch.allclose(model.logits(), expected, rtol=1e-6, atol=0)


def test_bn_running_statistics_are_each_clients_own():
    method = method_named("fedavg")
    got = in_cohorts(method, bn_cnn, train_cfg(), 8)
    means = [g[0]["1.running_mean"] for g in got]
    assert all(not torch.allclose(means[0], m) for m in means[1:])
    assert [int(g[0]["1.num_batches_tracked"]) for g in got] == [r[1].metrics["steps"] for r in got]


def test_opt_in_follows_the_class_that_defines_local_update():
    class Mine(type(method_named("fedavg"))):
        def local_update(self, ctx):
            raise AssertionError
    fedavg = method_named("fedavg")
    assert cohort_ready(fedavg)
    assert not cohort_ready(Mine(fedavg.hp, fedavg.setup))  # a new step without its loss: per client
    assert not cohort_ready(Method(fedavg.hp, fedavg.setup))
    assert isinstance(fedavg.local_loss(None), LocalLoss)


def test_in_float64_the_zoo_cnn_agrees_to_rounding(monkeypatch):
    """The zoo's small_cnn (BN, in-place ReLU, max-pooling): in float32 its two paths may drift
    apart by more than 1e-5 on an ill-conditioned tensor (a ReLU or a max-pool's choice flips on a
    rounding difference: ~2e-3 on bn1.bias after 4 steps at 32 px); in float64 they agree to 1e-12,
    so the cohort computes the same function and the float32 gap is rounding."""
    from raysim.models import build

    def make():
        return build("small_cnn", num_classes=3, in_channels=2, input_size=16, norm="bn").double()

    def fed(make_model, seed=0):
        g = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        model = make_model()
        sizes = [40, 17, 9]
        starts = [{n: v.clone() for n, v in model.state_dict().items()} for _ in sizes]
        data = [Toy(torch.randn(n, 2, 16, 16, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g))
                for n in sizes]
        return model, starts, data
    monkeypatch.setattr(sys.modules[__name__], "federation", fed)
    monkeypatch.setattr(sys.modules[__name__], "SIZES", [40, 17, 9])
    method, train = method_named("fedavg"), train_cfg(epochs=1, batch_size=8)
    ref, got = per_client(method, make, train), in_cohorts(method, make, train, 3)
    worst = max(rel(g[0][n], r[0][n]) for r, g in zip(ref, got) for n in r[0] if r[0][n].is_floating_point())
    assert worst < 1e-12, worst


def test_cohort_size_setting():
    from raysim.config import load_config
    from raysim.core.errors import UserError
    from raysim.engine.cohort import auto_cohort_size
    raw = {"method": "fedavg", "data": {"dataset": "digits5", "partition": {"kind": "per_domain"}}}
    assert load_config(raw=raw).runtime.cohort_size == 0  # off by default
    assert load_config(raw=raw, overrides=["runtime.cohort_size=auto"]).runtime.cohort_size == "auto"
    for bad, match in ((["runtime.cohort_size=auto", "runtime.deterministic=true"], "deterministic"),
                       (["runtime.cohort_size=many"], "integer >= 0 or 'auto'"),
                       (["runtime.cohort_size=-2"], "integer >= 0 or 'auto'")):
        with pytest.raises(UserError, match=match):
            load_config(raw=raw, overrides=bad)
    assert auto_cohort_size(mlp(), torch.device("cpu"), 32, (2, 4, 4)) == 0  # off on a CPU
