"""The client's hot path is ready for a GPU, checked on the CPU.

* A host sync (the CPU waiting for the device) happens whenever Python reads a tensor's value:
  ``.item()``, ``float(t)``, ``int(t)`` and ``bool(t)`` all end in ``aten::_local_scalar_dense``
  (one event per read; ``aten::item`` would count most reads twice), and ``aten::nonzero`` (boolean
  masks) must read its result's size. The PyTorch profiler records those ops on the CPU too, so
  counting them while a client trains or is evaluated shows every sync a GPU run would have, and
  whether their number grows with the number of batches.
* ``runtime.device_data_mb`` keeps a client's data on its device and cuts batches there; forced on
  with the CPU as the device, those batches must equal the ones prepared batch by batch.
"""
import gc
from collections import Counter

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from raysim.config import TrainConfig, load_config
from raysim.core.contract import ClientContext, ClientData
from raysim.data import load
from raysim.data.augment import make_augment
from raysim.data.splits import ArraySplit
from raysim.models import build
from raysim.engine.clientdata import DeviceBudget, SplitView, device_budget, keep_on_device
from raysim.core.training import evaluate, train_epochs

SYNC_OPS = ("aten::_local_scalar_dense", "aten::nonzero")
CPU = torch.device("cpu")
BATCH = 4
EPOCHS = 3


def host_syncs(fn) -> tuple[int, object]:
    """How many host syncs ``fn()`` makes (profiled on the CPU), and what it returned."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = fn()
    counts = Counter(e.name for e in prof.events())
    return sum(counts[op] for op in SYNC_OPS), out


@pytest.fixture(scope="module")
def split():
    """A real training split: digits5's MNIST domain at 16 px (read from the dataset cache)."""
    return load("digits5", seed=0, image_size=16).split("mnist", "train")


@pytest.fixture(scope="module")
def augmented(split):
    """The same images with DapperFL's crop+flip augmentation at train time."""
    return ArraySplit(split.uint8, split.labels, split.mean, split.std, make_augment("crop_flip"))


def client(split, num_batches: int, budget=None) -> ClientContext:
    view = SplitView(split, np.arange(num_batches * BATCH), budget)
    torch.manual_seed(0)
    model = build("small_cnn", num_classes=10, in_channels=3, input_size=16, norm="bn")
    train = TrainConfig(epochs=EPOCHS, batch_size=BATCH, lr=0.05, momentum=0.9, grad_clip=1.0)
    return ClientContext(client_id=0, domain="mnist", round=1, model=model, payload={}, state={},
                         data=ClientData(train=view, val=view, test=view, num_train=len(view)), train=train,
                         lr=0.05, generator=torch.Generator().manual_seed(1), device=CPU)


# ----------------------------------------------------------------------------- no sync per step

@pytest.mark.parametrize("on_device", [False, True], ids=["cpu-cut", "device-resident"])
def test_training_syncs_once_per_epoch_whatever_the_number_of_steps(split, on_device):
    """E epochs of train_epochs: one NaN check per epoch plus one read in stats(), for 2 and for 8
    batches per epoch alike (``loss.item()`` in ClientContext.step would add one per step)."""
    syncs = {}
    for num_batches in (2, 8):
        ctx = client(split, num_batches, DeviceBudget(CPU, 64) if on_device else None)
        syncs[num_batches], stats = host_syncs(lambda: train_epochs(ctx))
        assert stats["steps"] == EPOCHS * num_batches
    assert syncs[2] == syncs[8] <= EPOCHS + 1, syncs


def test_evaluation_reads_the_device_once_whatever_the_number_of_batches(split):
    """Correct count and loss sum accumulate on the device and are read at the end; the result
    has the same keys, types and values as summing batch by batch in Python."""
    model = client(split, 1).model
    syncs = {}
    for num_batches in (2, 8):
        view = SplitView(split, np.arange(num_batches * BATCH))
        syncs[num_batches], result = host_syncs(lambda: evaluate(model, view, BATCH, CPU))
        correct, loss_sum = 0, 0.0
        with torch.no_grad():
            for x, y in view.eval_batches(BATCH, CPU):
                logits = model(x)
                loss_sum += F.cross_entropy(logits, y, reduction="sum").item()
                correct += int((logits.argmax(1) == y).sum())
        assert result == {"correct": correct, "loss_sum": loss_sum, "n": num_batches * BATCH}
        assert [type(result[k]) for k in ("correct", "loss_sum", "n")] == [int, float, int]
    assert syncs[2] == syncs[8] <= 2, syncs


# ----------------------------------------------------------------------------- data kept on the device

def same_batches(a, b) -> bool:
    a, b = list(a), list(b)
    return len(a) == len(b) and all(
        all(torch.equal(u, v) for u, v in zip(p if isinstance(p, tuple) else (p,), q if isinstance(q, tuple) else (q,)))
        for p, q in zip(a, b))


@pytest.mark.parametrize("which", ["plain", "augmented"])
def test_batches_kept_on_the_device_equal_the_batches_cut_on_the_cpu(split, augmented, which):
    """Train batches (augmented ones from the same generator draws), evaluation batches and
    label-free batches are bit-identical with and without the device copy, and the generator
    ends in the same state, so every later draw is the same too."""
    source = split if which == "plain" else augmented
    indices = np.arange(3, 3 + 27)  # not a multiple of the batch size
    budget = DeviceBudget(CPU, 64)
    resident, plain = SplitView(source, indices, budget), SplitView(source, indices)
    for drop_last in (False, True):
        g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
        assert same_batches(resident.batches(BATCH, g1, CPU, drop_last), plain.batches(BATCH, g2, CPU, drop_last))
        assert torch.equal(g1.get_state(), g2.get_state())
    g1, g2 = torch.Generator().manual_seed(6), torch.Generator().manual_seed(6)
    assert same_batches(resident.unlabeled_batches(BATCH, g1, CPU), plain.unlabeled_batches(BATCH, g2, CPU))
    assert same_batches(resident.eval_batches(BATCH, CPU), plain.eval_batches(BATCH, CPU))
    assert resident.resident(CPU) is not None and plain.resident(CPU) is None
    assert budget.used == 27 * (4 * 3 * 16 * 16 + 8)


def test_training_on_device_resident_data_gives_the_same_model(split):
    """Whole train_epochs runs: same loss, same weights, bit for bit."""
    runs = []
    for budget in (None, DeviceBudget(CPU, 64)):
        ctx = client(split, 3, budget)
        runs.append((train_epochs(ctx), ctx.model.state_dict()))
    (stats_a, sd_a), (stats_b, sd_b) = runs
    assert stats_a == stats_b and all(torch.equal(sd_a[k], sd_b[k]) for k in sd_a)


def test_the_budget_bounds_what_a_host_keeps_and_is_returned_when_a_view_is_dropped(split):
    per_view = 10 * (4 * 3 * 16 * 16 + 8)
    budget = DeviceBudget(CPU, 1.5 * per_view / 2**20)
    first, second = SplitView(split, np.arange(10), budget), SplitView(split, np.arange(10, 20), budget)
    assert first.resident(CPU) is not None and second.resident(CPU) is None  # no room: cut on the CPU
    assert budget.used == per_view
    assert same_batches(second.eval_batches(BATCH, CPU), SplitView(split, np.arange(10, 20)).eval_batches(BATCH, CPU))
    del first
    gc.collect()
    assert budget.used == 0 and second.resident(CPU) is not None  # fits once the first is gone


def test_the_budget_is_off_by_default_and_on_the_cpu():
    assert device_budget(CPU, 256) is None
    assert device_budget("cuda", 0) is None
    assert isinstance(device_budget("cuda", 1), DeviceBudget)
    data = ClientData(train=None, val=None, test=None, num_train=0)
    assert keep_on_device(data, None) is data
    cfg = load_config(raw={"method": "fedavg", "data": {"dataset": "digits5"}})
    assert cfg.runtime.device_data_mb == 0
    assert load_config(raw={"method": "fedavg", "data": {"dataset": "digits5"},
                            "runtime": {"device_data_mb": 512}}).runtime.device_data_mb == 512
