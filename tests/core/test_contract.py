"""The method contract's hooks, each on a toy method run by the real round loop in this process:
server state beyond the global model, client state holding whole model copies that spills to disk,
client uploads of non-model statistics and a server-built bank broadcast back, client profiles;
the loop primitives, the aggregators and the declared settings on hand-computed values."""
import math
import os
from dataclasses import dataclass, replace

import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F

from raysim.core.aggregation import Mean
from raysim.config import load_config
from raysim.core.contract import ClientData, LocalLoss, Method, Upload
from raysim.core.errors import TrainingDiverged, UserError
from raysim.app.experiment import federation
from raysim.core.hparams import Hparams
from raysim.methods import registry
from raysim.engine.backend import InProcess
from raysim.engine.loop import Callback
from raysim.core.settings import setting
from raysim.testing import FixedBatches, client_context, fixed_batches

BASE = {
    "rounds": 3, "seed": 2,
    "data": {"dataset": "digits5", "options": {"image_size": 16},
             "partition": {"kind": "per_domain", "train_size": 10, "domains": ["mnist", "usps"]}},
    "model": {"name": "small_cnn", "norm": "bn"},
    "train": {"epochs": 1, "batch_size": 5, "lr": 0.05},
    "eval": {"every": 1},
    "runtime": {"num_hosts": 2},
}


class KeepHosts(Callback):
    """The pool and the server as they ran (the loop lets go of both when it stops)."""

    def on_start(self, run):
        run.kept_hosts = [h.obj for h in run.hosts]
        run.kept_server = run.server.obj


def run(method: str, out, **raw):
    cfg = load_config(raw={**BASE, **raw, "method": method})
    fed = federation(cfg, str(out), progress=False, backend=InProcess())
    fed.callbacks.append(KeepHosts())
    fed.run()
    return fed, pq.read_table(os.path.join(out, "metrics.parquet")).to_pandas()


def client_rows(df, metric):
    rows = df[(df.split == "train") & (df.client >= 0) & (df.metric == metric)]
    return {(int(r), int(c)): v for r, c, v in zip(rows["round"], rows.client, rows.value)}


# ----------------------------------------------------------------------------- server state (SCAFFOLD's c, FedDyn's h)

@dataclass(frozen=True)
class NoHparams(Hparams):
    pass


class ServerCounter(Method):
    """The server keeps c beside the global model: c <- c + mean_k (k + 1), broadcast each round."""
    name = "toy_server_state"
    Hparams = NoHparams

    def init_server(self, model):
        return {**super().init_server(model), "c": torch.zeros(3)}

    def broadcast(self, state, round):
        return {**super().broadcast(state, round), "c": state["c"]}

    def local_update(self, ctx):
        up = super().local_update(ctx)
        up.extras = {"delta_c": torch.full((3,), float(ctx.client_id + 1))}
        up.metrics["c_seen"] = float(ctx.payload["c"][0])
        return up

    def aggregate(self, state, uploads: Mean, round):
        delta = torch.stack([e["delta_c"] for e in uploads.extras.values()]).mean(0)  # (1 + 2) / 2
        return {**super().aggregate(state, uploads, round), "c": state["c"] + delta}


def test_server_state_persists_between_rounds(ray_session, tmp_path):
    registry.register(ServerCounter.name, ServerCounter)
    fed, df = run(ServerCounter.name, tmp_path)
    assert torch.equal(fed.kept_server.state["c"], torch.full((3,), 4.5))  # three rounds of +1.5
    assert client_rows(df, "c_seen") == {(r, c): 1.5 * (r - 1) for r in (1, 2, 3) for c in (0, 1)}


# ----------------------------------------------------------------------------- client state with model copies (Ditto, MOON)

class PreviousModel(Method):
    """Each client keeps its whole model from the previous round (MOON's w_i^{t-1}, Ditto's v_i)."""
    name = "toy_model_copy"
    Hparams = NoHparams

    def local_update(self, ctx):
        prev = ctx.state.get("previous")
        if prev is not None:  # what it stored last round, back from disk
            ctx.state["seen_previous"] = float(sum(v.double().sum() for v in prev.values() if v.is_floating_point()))
        up = super().local_update(ctx)
        ctx.state["previous"] = {k: v.detach().clone() for k, v in ctx.model.state_dict().items()}
        up.metrics["stored"] = float(sum(v.double().sum() for v in ctx.state["previous"].values()
                                         if v.is_floating_point()))
        up.metrics["seen"] = ctx.state.get("seen_previous", math.nan)
        return up


def test_client_model_copies_spill_to_disk_and_come_back(ray_session, tmp_path):
    registry.register(PreviousModel.name, PreviousModel)
    fed, df = run(PreviousModel.name, tmp_path / "run",
                  runtime={"num_hosts": 1, "state_memory_mb": 0, "spill_dir": str(tmp_path / "spill")})
    stored, seen = client_rows(df, "stored"), client_rows(df, "seen")
    assert fed.kept_hosts[0].store.spills > 0  # a zero budget spills every idle client
    for c in (0, 1):
        assert seen[(2, c)] == stored[(1, c)] and seen[(3, c)] == stored[(2, c)]


# ----------------------------------------------------------------------------- statistics up, a data-derived bank down (FPL, CCST, ELCFS)

class ClassMeans(Method):
    """Clients upload per-class (pixel sum, count); the server's bank is the per-class mean pixel
    over every client, broadcast to all in the next round."""
    name = "toy_bank"
    Hparams = NoHparams

    def init_server(self, model):
        return {**super().init_server(model), "bank": torch.zeros(10)}

    def broadcast(self, state, round):
        return {**super().broadcast(state, round), "bank": state["bank"]}

    def local_update(self, ctx):
        sums, counts = torch.zeros(10, dtype=torch.float64), torch.zeros(10, dtype=torch.float64)
        for x, y in ctx.data.train.eval_batches(100, ctx.device):  # the client's own data, one pass
            sums.index_add_(0, y, x.flatten(1).double().mean(1))
            counts.index_add_(0, y, torch.ones(len(y), dtype=torch.float64))
        up = super().local_update(ctx)
        up.extras = {"sums": sums, "counts": counts}
        up.metrics["bank_seen"] = float(ctx.payload["bank"].sum())
        return up

    def aggregate(self, state, uploads: Mean, round):
        sums = sum(e["sums"] for e in uploads.extras.values())
        counts = sum(e["counts"] for e in uploads.extras.values())
        bank = torch.where(counts > 0, sums / counts.clamp_min(1), torch.zeros_like(sums)).float()
        return {**super().aggregate(state, uploads, round), "bank": bank}


def test_uploaded_statistics_build_a_bank_every_client_receives(ray_session, tmp_path):
    from raysim.engine.federation import Federation
    registry.register(ClassMeans.name, ClassMeans)
    fed, df = run(ClassMeans.name, tmp_path, rounds=2)
    # the bank by hand: every training image of both clients, grouped by label
    cfg = load_config(raw={**BASE, "method": ClassMeans.name})
    f = Federation(cfg)
    xs, ys = zip(*(b for c in range(f.num_clients) for b in f.client_data(c).train.eval_batches(100, "cpu")))
    x, y = torch.cat(xs).flatten(1).double().mean(1), torch.cat(ys)
    expected = torch.stack([x[y == k].mean() if (y == k).any() else torch.tensor(0.0, dtype=torch.float64)
                            for k in range(10)]).float()
    assert torch.allclose(fed.kept_server.state["bank"], expected)
    seen = client_rows(df, "bank_seen")
    assert seen[(1, 0)] == 0.0 and seen[(2, 0)] == seen[(2, 1)] == pytest.approx(float(expected.sum()))


# ----------------------------------------------------------------------------- client profiles

def test_profiles_from_the_config_reach_setup_and_context(ray_session, tmp_path):
    from raysim.methods.dapperfl import DapperFL
    profiles = {"levels": [{"name": "C1", "speed": 10}, "C2", "C3"], "assign": "round_robin"}
    raw = {"data": {**BASE["data"], "partition": {"kind": "per_domain", "train_size": 10, "clients_per_domain": 2,
                                                  "domains": ["mnist", "usps"]}},
           "clients": {"profiles": profiles}, "rounds": 1}
    fed, df = run("dapperfl", tmp_path, **raw)
    setup = fed.kept_server.fed.setup
    assert [p["level"] for p in setup.client_profiles] == ["C1", "C2", "C3", "C1"]
    assert setup.client_profiles[0] == {"speed": 10, "tier": 0, "level": "C1"}
    tiers = client_rows(df, "tier")  # DapperFL's tiers are the profiles' (rho_levels[tier])
    assert [tiers[(1, c)] for c in range(4)] == [0, 1, 2, 0]
    assert [client_rows(df, "rho")[(1, c)] for c in range(4)] == [0.0, 0.2, 0.4, 0.0]
    assert DapperFL  # the method reads setup.client_profiles, never an id convention
    for bad, msg in (({"levels": 2, "assign": "sideways"}, "clients.profiles.assign"),
                     ({"levels": [3]}, "clients.profiles.levels"),
                     ({"levels": 2, "shares": [1.0]}, "clients.profiles.shares")):
        with pytest.raises(UserError, match=msg):
            load_config(raw={**BASE, "method": "fedavg", "clients": {"profiles": bad}})
    with pytest.raises(UserError, match="lists 3 levels but the federation has 2 clients"):
        run("fedavg", tmp_path / "bad", clients={"profiles": {"levels": 2, "assign": [0, 1, 1]}})


# ----------------------------------------------------------------------------- loop primitives

def context(batches, **train):
    model = torch.nn.Linear(1, 2, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    # training data of fixed batches (no shuffling needed to compute by hand)
    return client_context(None, model, fixed_batches(*batches), client_id=3, round=2, domain="d",
                          train={"batch_size": 2, "lr": 0.5, **train}, lr=0.5)


def test_step_and_stats_by_hand():
    # two batches per epoch, 2 epochs; a zero model gives CE = ln 2 on the first step, then learns
    x = torch.tensor([[1.0], [1.0]])
    ctx = context([(x, torch.tensor([0, 0])), (x, torch.tensor([0, 0]))], epochs=2)
    opt = ctx.optimizer()
    losses = []
    for xb, yb in ctx.batches():
        loss = F.cross_entropy(ctx.model(xb), yb)
        losses.append(float(loss.detach()))
        ctx.step(loss, opt)
    assert losses[0] == pytest.approx(math.log(2)) and len(losses) == 4
    assert ctx.stats() == {"loss": pytest.approx(sum(losses) / 4), "steps": 4}
    # one step by hand: dCE/dlogits = softmax - onehot = [-0.5, 0.5], x = 1 -> w = -0.5 * grad = [0.25, -0.25]
    one = context([(x, torch.tensor([0, 0]))])
    for xb, yb in one.batches():
        one.step(F.cross_entropy(one.model(xb), yb), one.optimizer())
    assert torch.allclose(one.model.weight, torch.tensor([[0.25], [-0.25]]))
    # train.max_steps ends the round mid-epoch, without drawing another batch
    drawn = []

    class Counted(FixedBatches):
        def batches(self, *a, **k):
            for b in self.list:
                drawn.append(1)
                yield b
    capped = context([], epochs=3, max_steps=3)
    capped.data = ClientData(Counted([(x, torch.tensor([1, 1]))] * 5))
    opt = capped.optimizer()
    for xb, yb in capped.batches():
        capped.step(F.cross_entropy(capped.model(xb), yb), opt)
    assert capped.steps == 3 and len(drawn) == 3


def shifted_loss(forward, params, batch, mine):
    return F.cross_entropy(forward(batch[0]), batch[1]) + (mine["shift"] * params["weight"]).sum()


class Shifted(Method):
    """A step written only as a per-batch loss: CE + <shift, w>, at its own lr 0.2."""
    name = "toy_local_loss"
    Hparams = NoHparams

    def local_loss(self, ctx):
        return LocalLoss(shifted_loss, tensors={"shift": torch.tensor([[1.0], [0.0]])}, lr=0.2)


class ShiftedFinished(Shifted):
    """The same step, its upload made by the loss's ``finish``."""

    def local_loss(self, ctx):
        return replace(super().local_loss(ctx), finish=lambda ctx: Upload({}, weight=7.0, metrics=ctx.stats()))


def test_the_default_local_update_runs_the_local_loss_by_hand():
    """One batch (x = 1, y = 0) from w = 0: the gradient is softmax - onehot + shift = (-1/2, 1/2) +
    (1, 0), and the step at the loss's lr 0.2 (not the round's 0.5) gives w = (-0.1, -0.1). Then
    the loss's finish makes the upload, or without one the method's standard upload; a method
    without a loss trains FedAvg's step at the round's lr."""
    x, y = torch.tensor([[1.0]]), torch.tensor([0])
    method = Shifted(NoHparams(), None)
    ctx = context([(x, y)])
    up = method.local_update(ctx)
    assert torch.allclose(ctx.model.weight, torch.tensor([[-0.1], [-0.1]]), rtol=0, atol=1e-7)
    assert up.metrics == {"loss": pytest.approx(math.log(2)), "steps": 1} and up.weight == 1.0
    assert torch.equal(up.tensors["weight"], ctx.model.weight)
    assert ShiftedFinished(NoHparams(), None).local_update(context([(x, y)])).weight == 7.0
    plain = context([(x, y)])
    Method(NoHparams(), None).local_update(plain)
    assert torch.allclose(plain.model.weight, torch.tensor([[0.25], [-0.25]]), rtol=0, atol=1e-7)


def test_iterations_per_epoch_cycle_through_passes_and_stop_at_the_budget():
    """Passes of 3 batches: 2 epochs of 4 iterations are 8 batches from 3 passes (3 + 3 + 2, the
    third stopped before its last batch is drawn); max_steps 5 ends them sooner; an empty client
    ends at once instead of cycling forever."""
    x = torch.tensor([[1.0], [1.0]])
    batches = [(x * (k + 1), torch.tensor([0, 1])) for k in range(3)]  # batch k holds images k + 1
    drawn = []

    class Counted(FixedBatches):
        def batches(self, *a, **k):
            drawn.append(0)
            assert len(drawn) < 10, "passes cycling without end"
            for b in self.list:
                drawn[-1] += 1
                yield b
    for cap, steps, passes in ((None, 8, [3, 3, 2]), (5, 5, [3, 2])):
        drawn.clear()
        ctx = context([], epochs=1, max_steps=cap)
        ctx.data = ClientData(Counted(batches))
        opt = ctx.optimizer()
        seen = []
        for xb, yb in ctx.batches(2, iters_per_epoch=4):
            seen.append(int(xb[0, 0]))
            ctx.step(F.cross_entropy(ctx.model(xb), yb), opt)
        assert ctx.steps == steps and drawn == passes and seen == [1, 2, 3, 1, 2, 3, 1, 2][:steps]
    drawn.clear()
    empty = context([], epochs=1)
    empty.data = ClientData(Counted([]))
    assert list(empty.batches(3, iters_per_epoch=4)) == [] and drawn == [0]
    assert list(empty.batches(0, iters_per_epoch=4)) == [] and drawn == [0]  # no budget: not even a pass


def test_an_unrecorded_step_moves_its_parameters_and_counts_nowhere():
    """record=False (a second solver beside the model): the same clipped SGD step, but neither its
    loss nor the step enters ctx.stats() / ctx.steps. grad_clip 0.1: the gradient [-0.5, 0.5] of
    the first step (norm 0.707) is clipped to norm 0.1, so w moves by 0.5 * 0.1 / sqrt 2."""
    x = torch.tensor([[1.0], [1.0]])
    ctx = context([(x, torch.tensor([0, 0]))], grad_clip=0.1)
    other = torch.nn.Linear(1, 2, bias=False)
    with torch.no_grad():
        other.weight.zero_()
    opt, opt_other = ctx.optimizer(), ctx.optimizer(other.parameters())
    for xb, yb in ctx.batches():
        ctx.step(F.cross_entropy(ctx.model(xb), yb), opt)
        ctx.step(F.cross_entropy(other(xb), yb) * 3.0, opt_other, clip=other.parameters(), record=False)
    step = 0.5 * 0.1 / math.sqrt(2)
    assert torch.allclose(other.weight, torch.tensor([[step], [-step]]))
    assert torch.allclose(ctx.model.weight, other.weight)  # the same clipped step
    assert ctx.stats() == {"loss": pytest.approx(math.log(2)), "steps": 1}


def test_an_unseen_clients_optimizer_is_plain_sgd_at_the_last_rounds_lr():
    """theta <- theta - lr * grad, no momentum, no weight decay (FDSE Alg. 3); step() clips only
    what it is told to."""
    from raysim.config import TrainConfig
    from raysim.core.contract import UnseenClient
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    client = UnseenClient(client_id=5, domain="t", round=3, data=fixed_batches(), lr=0.25, device=torch.device("cpu"),
                          train=TrainConfig(momentum=0.9, weight_decay=0.1, grad_clip=0.5),
                          generator=torch.Generator().manual_seed(0))
    opt = client.optimizer([w])
    for _ in range(2):  # grad of sum(w^2) / 2 is w: w <- 0.75 w, twice (no momentum would add more)
        client.step((w ** 2).sum() / 2, opt)
    assert torch.allclose(w.detach(), torch.tensor([1.0, -2.0]) * 0.75 ** 2)
    client.step((w ** 2).sum() / 2, client.optimizer([w], lr=1.0), clip=[w])  # grad w, ||w|| = 1.26, clipped to 0.5
    assert float(w.detach().norm()) == pytest.approx(0.5625 * math.sqrt(5) - 0.5, rel=1e-5)


def test_a_diverged_loss_is_reported_at_the_end_of_the_epoch():
    x = torch.tensor([[1.0], [1.0]])
    ctx = context([(x, torch.tensor([0, 1]))] * 3)
    opt = ctx.optimizer()
    steps = 0
    with pytest.raises(TrainingDiverged, match="client 3 .domain d. in round 2"):
        for xb, yb in ctx.batches():
            ctx.step(F.cross_entropy(ctx.model(xb), yb) * (math.nan if steps == 1 else 1.0), opt)
            steps += 1
    assert steps == 3  # the epoch finished: no sync inside it


# ----------------------------------------------------------------------------- settings declared once

@dataclass(frozen=True)
class Declared(Hparams):
    ratio: float = setting(0.5, ge=0, lt=1)
    mode: str = setting("a", one_of=("a", "b", "c"))
    sizes: tuple[int, ...] = setting((1,), ge=1)


def test_declared_settings_give_one_line_errors():
    assert Declared.from_dict({"ratio": "1e-1", "sizes": 3}) == Declared(0.1, "a", (3,))
    for bad, msg in (({"ratio": 1}, "hyperparameter 'hp.toy.ratio' = 1.0: expected a number in [0, 1)"),
                     ({"mode": "d"}, "hyperparameter 'hp.toy.mode' = 'd': expected one of 'a', 'b', 'c'"),
                     ({"sizes": [1, 0]}, "hyperparameter 'hp.toy.sizes' = (1, 0): expected at least 1"),
                     ({"ratio": "x"}, "hyperparameter 'hp.toy.ratio' = 'x': expected float"),
                     ({"nope": 1}, "unknown hyperparameter 'hp.toy.nope' for method toy; valid: ratio, mode, sizes")):
        with pytest.raises(UserError) as err:
            Declared.from_dict(bad, "hp.toy", "toy")
        assert str(err.value) == msg
