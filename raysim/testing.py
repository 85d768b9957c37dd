"""Helpers for testing methods, raysim's own and users': a public harness.

A method's client step is a function of a :class:`~raysim.core.contract.ClientContext`; build one
around tiny data, run the step, and check what it returns against values worked out by hand. Then
run the method for a few rounds through the real round loop (in this process, no Ray actors)::

    import torch
    from raysim import testing
    from raysim.methods import registry
    from mymethods import MyMethod                      # your Method subclass

    def test_my_method_trains_and_runs(tmp_path):
        method = MyMethod(MyMethod.Hparams(), testing.setup(num_clients=2))
        model = method.build_model()                    # small_cnn for 3 classes of 1x8x8 images
        ctx = testing.client_context(method, model, testing.random_client_data(num_train=8, seed=0),
                                     payload=method.broadcast(method.init_server(model), 1))
        upload = method.local_update(ctx)
        assert upload.weight == 8 and ctx.steps == 1    # one epoch: 8 images, one batch
        registry.register("my_method", MyMethod)        # this process only: what run_rounds needs
        metrics = testing.run_rounds("my_method", tmp_path, "rounds=2")
        assert metrics[metrics.metric == "accuracy"].value.notna().all()

* :func:`setup`: the :class:`~raysim.core.contract.Setup` a method is built with (models built by
  :func:`raysim.models.from_setup`, as in a run).
* :func:`random_client_data`, :func:`client_data`, :func:`fixed_batches`: a client's data in
  memory (random images from a seed, given tensors, or batches served as given).
* :func:`client_context`: the context of one client step on that data.
* :func:`run_rounds`: a few rounds of a registered method on a tiny federation, on the InProcess
  backend; the metrics as a DataFrame.
* :class:`ElsewherePlan`: a host plan that trains every client on another host than its owner,
  every round, so a method that keeps some client state outside the client's record shows it
  (its results change).
"""
from __future__ import annotations

import os

import torch

from raysim.config import ModelConfig, TrainConfig
from raysim.core.contract import ClientContext, ClientData, Setup
from raysim.engine.balance import StealingPlan
from raysim.models import from_setup

# A federation small enough for a unit test: 3 digit domains of 12 training images at 16 px, one
# host, 2 rounds; CSAC's and FDSE's extra stages cut to one epoch.
TINY = {
    "rounds": 2, "seed": 11,
    "data": {"dataset": "digits5", "options": {"image_size": 16},
             "partition": {"kind": "per_domain", "train_size": 12, "domains": ["mnist", "usps", "svhn"]}},
    "model": {"name": "small_cnn", "norm": "bn"},
    "train": {"epochs": 1, "batch_size": 8, "lr": 0.05, "momentum": 0.5, "grad_clip": 10.0},
    "eval": {"every": 1, "splits": ["val", "test"]},
    "runtime": {"num_hosts": 1},
    "hp": {"csac": {"stage1_epochs": 1, "stage1_iters_per_epoch": 0, "iters_per_epoch": 0}, "fdse": {"adapt_epochs": 1}},
}


# two device levels for the simulated clock: what a method that runs buffered by default (fedbuff,
# fedasync) needs to run on TINY (the clock's durations order its arrivals)
CLOCKED = {"levels": [{"name": "fast", "flops": 2.0e9}, {"name": "slow", "flops": 0.5e9}], "assign": "round_robin"}


def config_for(method: str, config: dict | None = None) -> dict:
    """``config`` (default :data:`TINY`) for ``method``: with device levels where the method runs
    buffered by default and the config gives none."""
    import copy

    from raysim.methods import registry
    raw = {**copy.deepcopy(TINY if config is None else config), "method": method}
    if registry.get(method).schedule == "buffered" and not raw.get("clients", {}).get("profiles", {}).get("levels"):
        raw.setdefault("clients", {}).setdefault("profiles", {}).update(copy.deepcopy(CLOCKED))
    return raw


# ----------------------------------------------------------------------------- what a method is built with

def setup(num_classes: int = 3, image_shape: tuple[int, int, int] = (1, 8, 8), num_clients: int = 2,
          client_domains=None, model: ModelConfig | dict | None = None, train: TrainConfig | dict | None = None,
          rounds: int = 3, seed: int = 0, client_profiles=()) -> Setup:
    """The federation a method is built for: ``num_clients`` clients, all of domain "a" unless
    ``client_domains`` names each one's; ``model`` small_cnn with BN unless given (a dict is read
    as ModelConfig's fields, as ``train`` is TrainConfig's)."""
    return Setup(model_builder=from_setup, num_classes=num_classes, image_shape=tuple(image_shape),
                 num_clients=num_clients,
                 client_domains=("a",) * num_clients if client_domains is None else tuple(client_domains),
                 model=ModelConfig(name="small_cnn", norm="bn") if model is None else _config(ModelConfig, model), train=_config(TrainConfig, train), rounds=rounds, seed=seed,
                 client_profiles=client_profiles)


def _config(cls, value):
    return cls() if value is None else cls(**value) if isinstance(value, dict) else value


# ----------------------------------------------------------------------------- a client's data

class InMemorySplit:
    """Images and labels held in memory, served as a host serves a client's split
    (:class:`~raysim.core.contract.ClientSplit`): training batches in an order drawn from the
    client's generator (the last batch short unless ``drop_last``), label-free batches likewise
    (a final batch of one image left out), evaluation batches in order. ``normalisation`` is the
    (mean, std) the images count as normalised with (default: none, mean 0 and std 1 per
    channel). ``passes`` records each training pass asked for (its ``drop_last``), so a test can
    check how many epochs a method drew."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, normalisation: tuple | None = None):
        self.x, self.y = x, y
        channels = x.shape[1] if x.dim() > 1 else 1
        self.normalisation = ((0.0,) * channels, (1.0,) * channels) if normalisation is None else normalisation
        self.passes: list[bool] = []

    def __len__(self) -> int:
        return len(self.y)

    @property
    def labels(self):
        return self.y.numpy()

    @property
    def classes(self) -> tuple[int, ...]:
        return tuple(int(c) for c in torch.unique(self.y))

    def batches(self, batch_size: int, generator: torch.Generator | None = None, device=None,
                drop_last: bool = False):
        self.passes.append(drop_last)
        order = torch.randperm(len(self.y), generator=generator)
        stop = len(order) - len(order) % batch_size if drop_last else len(order)
        for start in range(0, stop, batch_size):
            idx = order[start:start + batch_size]
            yield _on(self.x[idx], device), _on(self.y[idx], device)

    def unlabeled_batches(self, batch_size: int, generator: torch.Generator | None = None, device=None):
        order = torch.randperm(len(self.y), generator=generator)
        for start in range(0, len(order), batch_size):
            idx = order[start:start + batch_size]
            if len(idx) < 2 and len(order) > 1:
                continue
            yield _on(self.x[idx], device)

    def eval_batches(self, batch_size: int, device=None):
        for start in range(0, len(self.y), batch_size):
            yield _on(self.x[start:start + batch_size], device), _on(self.y[start:start + batch_size], device)


class FixedBatches:
    """Training data served as the given batches, in that order, every pass (no shuffling): the
    data of client steps computed by hand. Label-free and evaluation passes serve them too."""

    def __init__(self, batches, normalisation: tuple | None = None):
        self.list = list(batches)
        channels = self.list[0][0].shape[1] if self.list and self.list[0][0].dim() > 1 else 1
        self.normalisation = ((0.0,) * channels, (1.0,) * channels) if normalisation is None else normalisation

    def __len__(self) -> int:
        return sum(len(y) for _, y in self.list)

    @property
    def labels(self):
        return torch.cat([y for _, y in self.list]).numpy() if self.list else torch.zeros(0, dtype=torch.int64).numpy()

    @property
    def classes(self) -> tuple[int, ...]:
        return tuple(int(c) for c in sorted(set(self.labels.tolist())))

    def batches(self, batch_size: int, generator=None, device=None, drop_last: bool = False):
        yield from self.list

    def unlabeled_batches(self, batch_size: int, generator=None, device=None):
        yield from (x for x, _ in self.list)

    def eval_batches(self, batch_size: int, device=None):
        yield from self.list


def _on(t: torch.Tensor, device) -> torch.Tensor:
    return t if device is None else t.to(device)


def random_images(n: int, seed: int, image_shape=(1, 8, 8), num_classes: int = 3,
                  normalisation: tuple | None = None) -> InMemorySplit:
    """``n`` standard-normal images and uniform labels, from a generator seeded with ``seed``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *image_shape, generator=g)
    return InMemorySplit(x, torch.randint(0, num_classes, (n,), generator=g), normalisation)


def random_client_data(num_train: int = 8, seed: int = 0, image_shape=(1, 8, 8), num_classes: int = 3,
                       num_val: int = 0, num_test: int = 0, normalisation: tuple | None = None) -> ClientData:
    """A client's data of random images (:func:`random_images`): training from ``seed``,
    validation from ``seed + 100``, test from ``seed + 200`` (None where the size is 0); the same
    seed gives the same data. ``normalisation``: the (mean, std) they count as normalised with."""
    def split(n, s):
        return random_images(n, s, image_shape, num_classes, normalisation) if n else None
    return ClientData(train=split(num_train, seed), val=split(num_val, seed + 100), test=split(num_test, seed + 200),
                      num_train=num_train)


def client_data(x: torch.Tensor, y: torch.Tensor, val: tuple | None = None, test: tuple | None = None,
                normalisation: tuple | None = None) -> ClientData:
    """A client's data of the given images and labels (``val``, ``test``: ``(x, y)`` pairs),
    normalised with ``normalisation`` (mean, std; default none)."""
    return ClientData(train=InMemorySplit(x, y, normalisation),
                      val=None if val is None else InMemorySplit(*val, normalisation),
                      test=None if test is None else InMemorySplit(*test, normalisation), num_train=len(y))


def fixed_batches(*batches: tuple[torch.Tensor, torch.Tensor]) -> ClientData:
    """A client whose every training pass is exactly ``batches`` (:class:`FixedBatches`), whatever
    the batch size; none: an epoch with no step."""
    return ClientData(train=FixedBatches(batches), val=None, test=None, num_train=sum(len(y) for _, y in batches))


# ----------------------------------------------------------------------------- one client step

def client_context(method, model: torch.nn.Module, data=None, *, client_id: int = 0, round: int = 1,
                   payload: dict | None = None, state: dict | None = None, train: TrainConfig | dict | None = None,
                   lr: float | None = None, seed: int = 0, domain: str = "a", device="cpu",
                   profile: dict | None = None) -> ClientContext:
    """The context of client ``client_id``'s step in round ``round``, as a host builds it:
    ``data`` (default: 8 random images seeded with the client id), ``state`` (default: the
    method's ``init_client_state``, or {} without a method), ``train`` (a TrainConfig or its
    fields), ``lr`` this round's learning rate (default train.lr), the step's generator seeded with
    ``seed``. ``model`` is used as given: load the payload into it first where the method needs."""
    train = _config(TrainConfig, train)
    if state is None:
        state = {} if method is None else method.init_client_state(client_id, model)
    return ClientContext(client_id=client_id, domain=domain, round=round, model=model,
                         payload={} if payload is None else payload, state=state,
                         data=random_client_data(seed=client_id) if data is None else data, train=train,
                         lr=train.lr if lr is None else lr, generator=torch.Generator().manual_seed(seed),
                         device=torch.device(device), profile={} if profile is None else profile)


# ----------------------------------------------------------------------------- a few rounds

def run_rounds(method: str, run_dir, *overrides: str, config: dict | None = None, plan=None):
    """``method`` (a registered name) run on a tiny federation (``config``, default :data:`TINY`,
    with ``overrides`` such as ``"rounds=3"``) through the real round loop on the InProcess backend
    (server and hosts in this process, no Ray actors); ``plan`` replaces the host plan (e.g.
    :class:`ElsewherePlan`). Returns ``run_dir``'s metrics.parquet as a pandas DataFrame."""
    import pyarrow.parquet as pq

    from raysim.app.configs import load_checked
    from raysim.app.experiment import federation
    from raysim.engine.backend import InProcess

    cfg = load_checked(raw=config_for(method, config), overrides=list(overrides))
    fed = federation(cfg, str(run_dir), progress=False, backend=InProcess())
    if plan is not None:
        fed.plan = plan
    fed.run()
    return pq.read_table(os.path.join(str(run_dir), "metrics.parquet")).to_pandas()


# ----------------------------------------------------------------------------- host plans

class ElsewherePlan(StealingPlan):
    """Every client trains on the host after its owner's, whatever its state's size: each
    client's record leaves its owner and comes back every round. A check, not a policy: a method
    whose results change under it keeps something of a client outside the client's record."""

    def __init__(self, rnd: int, queues: dict[int, list[int]], num_hosts: int, movable=None, least=None, costs=None):
        super().__init__(rnd, queues, num_hosts, lambda c: True)  # the owners' queues, not evened out

    def next_chunk(self, host: int, in_flight: int) -> tuple[int | None, list[int]]:
        owner = (host - 1) % self.num_hosts
        queue = self.queues[owner]
        if not queue or in_flight:
            return None, []
        chunk = list(queue)
        queue.clear()
        return owner, chunk
