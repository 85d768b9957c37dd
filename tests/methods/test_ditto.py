"""Ditto: its key equations against values worked out by hand on scalars or tiny tensors (baselines
spec 3.1)."""
import math
import os
import shutil

import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from small_cnn_harness import Scalar, context, setup, small
from raysim.app.configs import load_checked
from raysim.app.experiment import federation, resume_config
from raysim.core.contract import sgd_step
from raysim.core.errors import UserError
from raysim.engine import checkpoint
from raysim.engine.backend import InProcess
from raysim.methods.ditto import Ditto, personal_objective
from raysim.testing import TINY, client_data, random_client_data, run_rounds


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


# ----------------------------------------------------------------------------- lam: auto

class Threshold(nn.Module):
    """Two classes of a scalar x: logits (0, x - theta), so class 1 iff x > theta (a tie is class 0)."""

    def __init__(self, theta: float):
        super().__init__()
        self.theta = nn.Parameter(torch.tensor([theta]))

    def forward(self, x):
        z = x.reshape(len(x), -1)[:, 0] - self.theta
        return torch.stack([torch.zeros_like(z), z], 1)


def auto_step(val, grid=None):
    """One client round of lam: auto, one SGD step at lr 1 on the example (x=1, y=0), from v_k = 1
    anchored at w^t = 0. By hand, the personal step with lambda l is
        theta <- 1 - (dCE/dtheta + l (1 - 0)) = 1 - (-sigmoid(1 - 1) + l) = 1.5 - l,
    so the grid (0.1, 1, 2) gives v = 1.4, 0.5, -0.5. ``val``: (x, y) pairs of the validation split."""
    hp = {"lam": "auto", **({} if grid is None else {"lam_grid": grid})}
    m = Ditto(Ditto.Hparams.from_dict(hp), setup(2))
    data = client_data(torch.tensor([[1.0]]), torch.tensor([0]),
                       val=None if val is None else (torch.tensor([[x] for x, _ in val]), torch.tensor([y for _, y in val])))
    ctx = context(m, Threshold(0.0), {"global": {"theta": torch.tensor([0.0])}}, {"v": {"theta": torch.tensor([1.0])}},
                  lr=1.0, data=data)
    up = m.local_update(ctx)
    return up, ctx


# validation splits (each pair twice: 4 samples, the paper's least to choose from) and, by hand,
# the accuracy of v = 1.4, 0.5, -0.5 on them
@pytest.mark.parametrize("val, best", [
    ([(1.0, 0)] * 4, 0.1),                  # class 0 at x = 1 needs theta >= 1: accuracies 1, 0, 0
    ([(0.0, 0), (1.0, 1)] * 2, 1.0),        # class 0 at 0 and class 1 at 1 need 0 <= theta < 1: 1/2, 1, 1/2
    ([(0.25, 1)] * 4, 2.0),                 # class 1 at x = 0.25 needs theta < 0.25: 0, 0, 1
])
def test_auto_keeps_the_personal_model_of_the_lambda_with_the_best_validation_accuracy(val, best):
    up, ctx = auto_step(val)
    assert ctx.state["lam"] == best and up.metrics["lam"] == best
    assert float(ctx.state["v"]["theta"]) == pytest.approx(1.5 - best, abs=1e-6)  # that lambda's v_k, kept
    # the reported personal loss is the kept solver's: CE at theta = 1 is log 2, plus (l / 2) (1 - 0)^2
    assert up.metrics["personal_loss"] == pytest.approx(math.log(2) + 0.5 * best, abs=1e-6)
    # the global solver trained as ever: 0 - (-sigmoid(1 - 0))
    assert float(up.tensors["theta"]) == pytest.approx(1 / (1 + math.exp(-1)), abs=1e-6)


def test_auto_breaks_an_accuracy_tie_by_the_lower_validation_loss():
    """Class 1 at x = 1: v = 0.5 and v = -0.5 are both right; -log sigmoid(1 - v) is 0.47 and 0.20,
    so lambda = 2, the later in the grid, wins."""
    up, ctx = auto_step([(1.0, 1)] * 4)
    assert ctx.state["lam"] == 2.0


def test_auto_grid_is_a_setting():
    up, ctx = auto_step([(0.0, 0), (1.0, 1)] * 2, grid=[0.05, 0.2, 1.25])  # v = 1.45, 1.3, 0.25: only 0.25 in [0, 1)
    assert ctx.state["lam"] == 1.25 and float(ctx.state["v"]["theta"]) == pytest.approx(0.25, abs=1e-6)


@pytest.mark.parametrize("val", [None, [(0.25, 1)] * 3])
def test_auto_falls_back_to_lambda_1_with_fewer_than_4_validation_samples(val):
    """The paper: a device with fewer than 4 validation samples keeps lambda = 1 (where lambda = 2
    would validate best here: the last case above)."""
    up, ctx = auto_step(val)
    assert ctx.state["lam"] == 1.0 and up.metrics["lam"] == 1.0
    assert float(ctx.state["v"]["theta"]) == pytest.approx(0.5, abs=1e-6)


def test_a_fixed_lambda_keeps_no_lambda_in_state_and_reports_none():
    m = Ditto(Ditto.Hparams.from_dict({"lam": 2.0}), setup(2))
    data = client_data(torch.tensor([[1.0]]), torch.tensor([0]), val=(torch.tensor([[0.25]] * 4), torch.tensor([1] * 4)))
    ctx = context(m, Threshold(0.0), {"global": {"theta": torch.tensor([0.0])}}, {"v": {"theta": torch.tensor([1.0])}},
                  lr=1.0, data=data)
    up = m.local_update(ctx)
    assert float(ctx.state["v"]["theta"]) == pytest.approx(-0.5, abs=1e-6)
    assert "lam" not in ctx.state and "lam" not in up.metrics


@pytest.mark.parametrize("hp, message", [
    ({"lam": "banana"}, "hyperparameter 'hp.ditto.lam' = 'banana': expected a number >= 0 or 'auto'"),
    ({"lam": -1}, "hyperparameter 'hp.ditto.lam' = -1.0: expected a number >= 0 or 'auto'"),
    ({"lam_grid": []}, "hyperparameter 'hp.ditto.lam_grid' = (): expected a non-empty list of numbers >= 0"),
    ({"lam_grid": [0.1, -2]}, "hyperparameter 'hp.ditto.lam_grid' = (0.1, -2.0): expected >= 0"),
])
def test_an_invalid_lambda_is_a_one_line_config_error(hp, message):
    with pytest.raises(UserError) as err:
        load_checked(raw={**TINY, "method": "ditto", "hp": {"ditto": hp}})
    assert str(err.value) == message and "\n" not in str(err.value)


def test_lam_auto_and_numbers_as_strings_are_read():
    assert Ditto.Hparams.from_dict({"lam": "auto"}).lam == "auto"
    assert Ditto.Hparams.from_dict({"lam": "1e-3"}).lam == 0.001  # YAML 1.1 reads 1e-3 as a string


@pytest.mark.slow  # two runs of TINY through the round loop (~25 s here on a loaded 2-core machine)
def test_auto_lambdas_are_checkpointed_and_a_resumed_run_equals_the_undisturbed_one(tmp_path):
    """Two rounds of lam auto on TINY (InProcess: no Ray), a checkpoint after round 1: each client's
    checkpointed state holds the lambda it reported in round 1, and the run resumed from there ends
    with the undisturbed run's metrics (round 2's lambdas included)."""
    run, overrides = str(tmp_path / "run"), ["hp.ditto.lam=auto", "checkpoint.every=1"]
    undisturbed = run_rounds("ditto", run, *overrides)
    stored = checkpoint.read(run, 1, load_checked(raw={**TINY, "method": "ditto"}, overrides=overrides))["clients"]
    reported = undisturbed[(undisturbed.metric == "lam") & (undisturbed["round"] == 1) & (undisturbed.client >= 0)]
    assert len(reported) == 3 and {int(r.client): r.value for r in reported.itertuples()} == {
        c: stored[c]["state"]["lam"] for c in stored}
    resumed = str(tmp_path / "resumed")
    shutil.copytree(run, resumed)
    for name in ("metrics.parquet", "status.json"):  # the run's own, as a run stopped after round 1 leaves it
        os.remove(os.path.join(resumed, name))
    result = federation(resume_config(resumed, []), resumed, progress=False, backend=InProcess()).run(resume=True)
    assert result.rounds_done == 2 and len(result.round_seconds) == 1  # round 2 only: it resumed
    assert pq.read_table(os.path.join(resumed, "metrics.parquet")).to_pandas().equals(undisturbed)
