"""The method contract: what an FL method tells the engine, and what the engine hands it.

A method is one class (``methods/README.md`` documents every hook and who uses it). Read top to
bottom it is the paper's algorithm box:

* ``Hparams``           its hyperparameters (:mod:`raysim.core.hparams`: paper defaults, allowed values, search space);
* ``build_model``       how it changes the network (norm swap, decomposed convs, ...);
* ``personal_keys``     which state-dict entries never leave the client;
* ``init_server``       the server's state (the global tensors, plus anything else it keeps);
* ``selection``         which online clients train in a round: the configured selection
                        (``clients.selection``, :mod:`raysim.core.selection`) by default; a method
                        may override ``select`` instead (one phase, no loss query);
* ``broadcast`` / ``client_payload``  what every client / one client receives;
* ``local_update``      the client step, on the client's model and its persistent ``state``;
* ``local_loss``        (optional) the step as a per-batch loss instead, so a host may train many
                        clients at once (client cohorts, ``runtime.cohort_size``): the default
                        ``local_update`` then runs it for a client alone;
* ``aggregator`` + ``aggregate``  how uploads are combined (:mod:`raysim.core.aggregation`) and the server step.

The engine never special-cases a method. It runs ``local_update`` on the host that owns the
client, keeps ``ctx.state`` for that client between rounds (spilling it to disk when idle), folds
the uploads with the method's aggregator and hands the result to ``aggregate`` (only in a round
that has uploads).

Placement (where tensors live; on a CPU host everything is on the CPU and nothing moves):

* between rounds, the server's state, and every client's state (``ctx.state``, and the model it
  left training for ``eval.point: post_train``), are on the CPU (:func:`raysim.core.tensors.cpu_copy`):
  a host holds many clients, spills idle ones to disk and hands them to other hosts. With
  ``runtime.device_state_mb`` a GPU host keeps what a client step copied with ``cpu_copy`` on its
  device instead, up to that budget, the least recently used moving to CPU memory, then disk;
* during a round, the payload is on the host's device, moved there once per round per host (not
  per client) and loaded into each client's model device to device; the host's model and its
  initial state live there too;
* a client's upload stays on the device until the aggregator folds it:
  :class:`~raysim.core.aggregation.WeightedMean` sums on the device in float64,
  :class:`~raysim.core.aggregation.KeepAll` copies it to (pinned) CPU memory without waiting; the
  host's partial result leaves the device in one move per round, and the server reduces on the
  CPU.

Every move of tensors the engine makes between CPU and device memory (the data batches aside:
:mod:`raysim.engine.clientdata`, ``runtime.device_data_mb``) goes through
:func:`raysim.core.tensors.to_device`, which counts them (``tests/engine/test_device_hot_path.py``:
per host, not per client);
``tests/methods/test_placement.py`` checks every method against this rule.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterator, NamedTuple, Protocol, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from raysim.core.aggregation import Aggregator, WeightedMean
from raysim.core.buffered import BufferedUploads, step_target
from raysim.core.errors import TrainingDiverged
from raysim.core.hparams import Hparams
from raysim.core.selection import Selection, SelectionContext  # noqa: F401  (SelectionContext: part of the contract)
from raysim.core.server_optimizers import STATE_KEY as SERVER_OPTIMIZER_STATE
from raysim.core.server_optimizers import resolve as resolve_server_optimizer
from raysim.core.sgd import SGD
from raysim.core.staleness import Staleness
from raysim.core.tensors import Tensors, cpu_copy, load_tensors

_TRAIN_MAX_STEPS = object()  # ClientContext.batches: "train.max_steps"


# ----------------------------------------------------------------------------- what flows

@dataclass(frozen=True)
class Setup:
    """What a method knows about the federation it runs in (same on the server and every host)."""
    num_classes: int
    image_shape: tuple[int, int, int]
    num_clients: int  # training clients (unseen clients are not counted)
    client_domains: Sequence[str]  # domain of each client id (a lazy ClientDomains in a federation; any tuple works)
    model: Any  # raysim.config.ModelConfig
    train: Any  # raysim.config.TrainConfig
    rounds: int
    seed: int
    # per-client system profile (clients.profiles; a lazy ClientProfiles in a federation); empty without
    client_profiles: Sequence[dict] = ()
    # builds the federation's network from this setup (``model``, classes, input shape), keyword
    # overrides (``norm=``) allowed: the engine passes raysim.models.from_setup; the contract
    # itself builds no model (it sits below the model zoo)
    model_builder: Callable[..., nn.Module] | None = None
    # the config's server section (raysim.config.ServerConfig: the server optimizer of the default
    # aggregate); None: its defaults
    server: Any = None


@dataclass
class Upload:
    """What one client sends back after its local step.

    Non-model vectors the server averages (SCAFFOLD's control-variate update Delta c_i) go in
    ``statistics``, under their own names: :class:`~raysim.core.aggregation.WeightedMean` folds
    them as it folds ``tensors``, with the same weight, into ``Mean.statistics``. What the server
    needs client by client (masks, prototypes, a bank's entries) goes in ``extras``."""
    tensors: Tensors  # usually the trained shared tensors: folded by the method's aggregator
    weight: float  # aggregation weight (n_k by default, see train.weighting)
    extras: dict = field(default_factory=dict)  # anything else the server needs, by client (masks, prototypes)
    metrics: dict = field(default_factory=dict)  # e.g. {"loss": mean training loss}
    statistics: Tensors = field(default_factory=dict)  # averaged like ``tensors`` (same weight), kept apart


@dataclass
class LocalLoss:
    """A client step written as a per-batch loss, what :meth:`Method.local_loss` returns: the
    engine may then train several clients at once as one vectorized step (client cohorts,
    ``runtime.cohort_size``; :mod:`raysim.engine.cohort`), each with its own parameters, buffers,
    batches, optimizer state and random streams, exactly as ``local_update`` would one by one.

    The step it stands for: ``ctx.batches()`` with ``ctx.optimizer(lr=lr)`` and ``ctx.step(loss)``
    (gradient clipping at train.grad_clip), then ``finish(ctx)`` on the trained model; for one
    client alone, :func:`raysim.core.training.train_local_loss` runs it (the default
    :meth:`Method.local_update`)."""
    # loss(forward, params, batch, tensors) -> scalar: ``forward(x)`` is the model under this
    # client's parameters and buffers, ``params`` {name: parameter} (what ``model.named_parameters()``
    # gives), ``batch`` the (x, y) of ``ctx.batches()``, ``tensors`` the dict below. A pure function
    # of its arguments and the method's hyperparameters: whatever differs between clients goes in
    # ``tensors`` (every client of a cohort runs the first one's ``loss``)
    loss: Callable[..., torch.Tensor]
    tensors: dict = field(default_factory=dict)  # this client's tensors the loss reads (FedProx: w^{t-1}), on ctx.device
    # the upload, from the context once training ended (ctx.model holds the trained weights,
    # ctx.stats() the round's loss and steps); None: ``method.upload(ctx, ctx.stats())``
    finish: Callable[["ClientContext"], "Upload"] | None = None
    lr: float | None = None  # None: ctx.lr (the optimizer's learning rate, as ``ctx.optimizer(lr=...)``)


def cross_entropy(forward, params, batch, tensors) -> torch.Tensor:
    """FedAvg's per-batch loss (:class:`LocalLoss`): the cross-entropy of the model's logits."""
    x, y = batch
    return F.cross_entropy(forward(x), y)


class Normalisation(NamedTuple):
    """The per-channel (mean, std) a split's images were normalised with: a batch holds
    ``(pixels - mean) / std`` of [0, 1] pixels."""
    mean: tuple[float, ...]
    std: tuple[float, ...]

    def tensors(self, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, std) as float32 tensors of shape 1 x C x 1 x 1 on ``device``, to undo or redo the
        normalisation of a batch (``x * std + mean`` gives its [0, 1] pixels)."""
        return tuple(torch.tensor(v, dtype=torch.float32, device=device).view(1, -1, 1, 1) for v in self)


class ClientSplit(Protocol):
    """One split of a client's data, resident on its host: what the engine's views
    (``raysim.engine.clientdata.SplitView``) and ``raysim.testing``'s in-memory splits implement,
    and all a method may read of a split (through :class:`DataSplit`).

    Training passes draw their order (and any augmentation) from the generator they are given, so
    the same generator gives the same batches on any host."""

    def __len__(self) -> int: ...

    @property
    def labels(self) -> np.ndarray:
        """The split's labels (int64), in the split's order."""

    @property
    def classes(self) -> tuple[int, ...]:
        """The classes present in the split, ascending."""

    @property
    def normalisation(self) -> tuple[Sequence[float], Sequence[float]]:
        """The (mean, std) its images were normalised with."""

    def batches(self, batch_size: int, generator: torch.Generator, device,
                drop_last: bool = False) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """One shuffled pass of (images, labels), with train-time augmentation; the last batch is
        short unless ``drop_last``."""

    def unlabeled_batches(self, batch_size: int, generator: torch.Generator, device) -> Iterator[torch.Tensor]:
        """One shuffled pass of images without their labels and without augmentation (label-free
        adaptation); a final batch of one image is left out (BN)."""

    def eval_batches(self, batch_size: int, device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The split in order, without augmentation (evaluation)."""


class DataSplit:
    """One split of a client's data as a method sees it: the :class:`ClientSplit` contract and
    nothing else. It serves the engine's view without exposing it (no attribute leads to the
    engine's objects: ``tests/core/test_client_seam.py``), so a method written against it runs on
    any host, on raysim's test data, and on whatever the engine serves next."""
    __slots__ = ("_view",)

    def __init__(self, view: ClientSplit):
        self._view = view

    def __len__(self) -> int:
        return len(self._view)

    @property
    def size(self) -> int:
        """The number of examples."""
        return len(self._view)

    @property
    def labels(self) -> np.ndarray:
        """The labels (a copy: int64, in the split's order)."""
        return np.array(self._view.labels, dtype=np.int64)

    @property
    def classes(self) -> tuple[int, ...]:
        """The classes present, ascending."""
        return tuple(int(c) for c in self._view.classes)

    @property
    def normalisation(self) -> Normalisation:
        """The (mean, std) the images were normalised with (:class:`Normalisation`)."""
        mean, std = self._view.normalisation
        return Normalisation(tuple(float(m) for m in mean), tuple(float(s) for s in std))

    def batches(self, batch_size: int, generator: torch.Generator, device,
                drop_last: bool = False) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """One shuffled pass of (images, labels) with train-time augmentation; order and augmentation
        come from ``generator``. A client step draws its batches with ``ctx.batches()``."""
        return self._view.batches(batch_size, generator=generator, device=device, drop_last=drop_last)

    def unlabeled_batches(self, batch_size: int, generator: torch.Generator, device) -> Iterator[torch.Tensor]:
        """One shuffled pass of the images alone, without augmentation; a final batch of one image
        is left out (BN)."""
        return self._view.unlabeled_batches(batch_size, generator, device)

    def eval_batches(self, batch_size: int, device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The split in order, without augmentation (:func:`raysim.core.training.evaluate`)."""
        return self._view.eval_batches(batch_size, device)

    def __repr__(self) -> str:
        return f"DataSplit(n={len(self)})"


class ClientData:
    """One client's partition, already resident on its host, as a method sees it: its ``train``,
    ``val`` and ``test`` splits (each a :class:`DataSplit`, None where the client has none) and
    ``num_train``, the size its aggregation weight counts (``train.weighting: samples``).

    Built from anything implementing :class:`ClientSplit` (the engine's views, ``raysim.testing``'s
    splits); what it was built from stays out of a method's reach."""
    __slots__ = ("train", "val", "test", "num_train")

    def __init__(self, train: ClientSplit | None, val: ClientSplit | None = None, test: ClientSplit | None = None,
                 num_train: int | None = None):
        self.train, self.val, self.test = (None if s is None else s if isinstance(s, DataSplit) else DataSplit(s)
                                           for s in (train, val, test))
        self.num_train = int(len(self.train) if num_train is None else num_train)

    def batches(self, batch_size: int, generator: torch.Generator, device,
                drop_last: bool = False) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """One epoch of shuffled training batches (``train.batches``); order and augmentation come
        from ``generator``. A client step draws its batches with ``ctx.batches()``."""
        return self.train.batches(batch_size, generator, device, drop_last=drop_last)

    def __repr__(self) -> str:
        sizes = ", ".join(f"{s}={None if getattr(self, s) is None else len(getattr(self, s))}"
                          for s in ("train", "val", "test"))
        return f"ClientData({sizes}, num_train={self.num_train})"


@dataclass
class ClientContext:
    """Everything one client step sees, and the primitives its local loop is written with:

        opt = ctx.optimizer()
        for x, y in ctx.batches():
            ctx.step(F.cross_entropy(ctx.model(x), y) + extra_term, opt)
        return self.upload(ctx, ctx.stats())

    The running loss stays on the device (float64) and is checked for NaN once per epoch, so a
    step never waits for the device."""
    client_id: int
    domain: str
    round: int  # 1-based
    model: nn.Module  # shared tensors from the payload and personal tensors from ``state`` loaded
    payload: dict  # the round's broadcast (plus this client's personal payload, under "personal"), on ``device``
    state: dict  # persists across rounds on the client's host (tensors on the CPU: placement rule above); the method owns its keys
    data: ClientData
    train: Any  # TrainConfig
    lr: float  # this round's learning rate (after lr_decay)
    generator: torch.Generator  # keyed by (seed, round, client, "train"): the only randomness
    device: torch.device
    profile: dict = field(default_factory=dict)  # this client's system profile (clients.profiles)
    _loss_sum: torch.Tensor | None = field(default=None, repr=False)
    _steps: int = field(default=0, repr=False)

    def optimizer(self, params=None, lr: float | None = None) -> torch.optim.Optimizer:
        """SGD over ``params`` (the model's) at this round's lr (or ``lr``), with train.momentum
        and train.weight_decay."""
        t = self.train
        return SGD(self.model.parameters() if params is None else params,
                   lr=self.lr if lr is None else lr, momentum=t.momentum, weight_decay=t.weight_decay)

    def batches(self, epochs: int | None = None, *, iters_per_epoch: int | None = None,
                max_steps=_TRAIN_MAX_STEPS, drop_last: bool = False) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The model in train mode, then the client's training batches, shuffled afresh every pass:
        ``epochs`` (train.epochs) passes over its data, or, with ``iters_per_epoch``, ``epochs``
        epochs of that many batches, passes following one another across epoch boundaries (an
        epoch of a fixed number of iterations, as CSAC's code counts them); either way ending once
        ``max_steps`` (train.max_steps; None: no cap) of the client's steps were taken while
        iterating. Both limits are checked before the next batch is drawn. The running loss is
        checked for NaN after every pass."""
        cap = self.train.max_steps if max_steps is _TRAIN_MAX_STEPS else max_steps
        epochs = self.train.epochs if epochs is None else epochs
        budget = epochs * iters_per_epoch if iters_per_epoch else None  # batches, passes cycling
        start, drawn = self._steps, 0
        self.model.train()

        def spent() -> bool:
            return bool(cap and self._steps - start >= cap) or (budget is not None and drawn >= budget)
        passes = 0
        while (budget is not None or passes < epochs) and not spent():
            it = iter(self.data.batches(self.train.batch_size, self.generator, self.device, drop_last=drop_last))
            before = drawn
            while not spent():
                batch = next(it, None)
                if batch is None:
                    break
                drawn += 1
                yield batch
            passes += 1
            self.check_finite()
            if budget is not None and drawn == before:
                return  # an empty pass: nothing to cycle through

    def step(self, loss: torch.Tensor, *optimizers: torch.optim.Optimizer, clip=None, record: bool = True) -> None:
        """:func:`sgd_step` with the gradient norm clipped at train.grad_clip (over ``clip``,
        default the model's parameters), then the loss added to the running sum: one of the
        client's steps (``ctx.steps``: SCAFFOLD's K, train.max_steps, ``stats()``).

        ``record=False``: the same step for a solver beside the client's model (Ditto's personal
        model, FedADG's discriminator and generator): neither its loss nor the step is counted."""
        sgd_step(loss, *optimizers, clip=self.model.parameters() if clip is None else clip,
                 max_norm=self.train.grad_clip)
        if not record:
            return
        value = loss.detach().to(torch.float64)
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
        self._steps += 1

    @property
    def steps(self) -> int:
        """Optimizer steps taken so far this round."""
        return self._steps

    def check_finite(self) -> float:
        """The loss summed over the steps so far (one device sync); TrainingDiverged if not finite."""
        total = 0.0 if self._loss_sum is None else float(self._loss_sum)
        if not math.isfinite(total):
            raise TrainingDiverged(self.client_id, self.domain, self.round, total)
        return total

    def stats(self) -> dict:
        """``{"loss": mean loss over the round's steps, "steps": n}``."""
        return {"loss": self.check_finite() / max(self._steps, 1), "steps": self._steps}


def sgd_step(loss: torch.Tensor, *optimizers: torch.optim.Optimizer, clip=None, max_norm: float | None = None) -> None:
    """Zero-grad, backward, clip the gradient norm of ``clip`` at ``max_norm`` (if both are
    given), step every optimizer: the one optimisation step of every loop in raysim."""
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
    loss.backward()
    if max_norm and clip is not None:
        nn.utils.clip_grad_norm_(clip, max_norm)
    for opt in optimizers:
        opt.step()


@dataclass
class UnseenClient:
    """A client that never trained (a held-out domain, or a new client as in FDSE's Table 2): what
    a method's label-free adaptation may use. Its images come without labels."""
    client_id: int
    domain: str
    round: int  # the round after which it is evaluated
    data: ClientData  # ``data.test`` is the split it is evaluated on
    train: Any  # TrainConfig
    lr: float  # the learning rate of the last training round (FDSE Alg. 3's step size)
    generator: torch.Generator  # keyed by (seed, round, client, "adapt")
    device: torch.device

    def unlabeled_batches(self, batch_size: int) -> Iterator[torch.Tensor]:
        """One shuffled pass over the images the client is evaluated on, without their labels."""
        return self.data.test.unlabeled_batches(batch_size, self.generator, self.device)

    def optimizer(self, params, lr: float | None = None, momentum: float = 0.0,
                  weight_decay: float = 0.0) -> torch.optim.Optimizer:
        """SGD over ``params`` at ``lr`` (default: the last training round's), plain unless
        ``momentum`` or ``weight_decay`` are given: an adaptation's step, ``theta <- theta - lr *
        grad`` (FDSE Alg. 3), not the clients' training optimizer."""
        return SGD(params, lr=self.lr if lr is None else lr, momentum=momentum, weight_decay=weight_decay)

    def step(self, loss: torch.Tensor, *optimizers: torch.optim.Optimizer, clip=None) -> None:
        """:func:`sgd_step`: zero-grad, backward, step; the gradient norm of ``clip`` (parameters)
        clipped at train.grad_clip where it is given, none otherwise."""
        sgd_step(loss, *optimizers, clip=clip, max_norm=self.train.grad_clip if clip is not None else None)


# ----------------------------------------------------------------------------- the contract

class Method:
    """FedAvg semantics by default; a method overrides only what its paper changes."""
    name: ClassVar[str] = "base"
    Hparams: ClassVar[type[Hparams]] = Hparams
    aggregator: ClassVar[Aggregator] = WeightedMean()
    paper: ClassVar[str] = ""
    shares: ClassVar[str] = ""  # one line for `raysim methods`: what a client sends and what it keeps
    # data-derived statistics it sends between clients through the server (a privacy reviewer's
    # first question; summary.md and the README say it): "" for none beyond the model
    exchanges: ClassVar[str] = ""
    # what a client's upload carries beside its model that is not a data statistic (SCAFFOLD's
    # control-variate update): the privacy and compression stages cannot clip or compress it
    # (raysim.core.stages.refusal); "" for nothing
    uploads_beside_model: ClassVar[str] = ""
    # train one model on every client's data at once (DeepAll, the centralised reference): the
    # engine gives the federation a single client holding all the training clients' data
    pools_clients: ClassVar[bool] = False
    # the server optimizer of the default aggregate when the config names none (server.optimizer):
    # "sgd" (at server.lr 1, the plain mean); FedAvgM, FedAdam, ... (methods/fedopt.py) set theirs
    server_optimizer: ClassVar[str] = "sgd"
    # how the server steps when the config names no schedule (schedule.kind): synchronous "rounds",
    # or "buffered" (FedBuff, FedAsync); with it the buffer K (None: FedBuff's 10) and the staleness
    # weight s(τ) of a buffered step (raysim.core.buffered; a method may run buffered when
    # raysim.core.buffered.refusal finds nothing against it)
    schedule: ClassVar[str] = "rounds"
    buffer: ClassVar[int | None] = None
    buffer_fixed: ClassVar[bool] = False  # K is part of the method (FedAsync's 1): schedule.buffer may not change it
    staleness: ClassVar[Staleness] = Staleness("sqrt")
    # whether the hosts fold s(τ_i)·Δ_i (FedBuff's Δ̄); False: they fold Δ_i and buffered_step
    # applies s(τ) itself (FedAsync's mixing weight), from BufferedUploads.staleness_weights
    fold_staleness: ClassVar[bool] = True

    def __init__(self, hp: Hparams, setup: Setup):
        self.hp = hp
        self.setup = setup

    @classmethod
    def hparams_from(cls, values: dict | None, prefix: str = "hp") -> Hparams:
        """Typed, checked Hparams from a user dict (config ``hp.<method>``)."""
        return cls.Hparams.from_dict(values, prefix, cls.name)

    # ---- model ----------------------------------------------------------------------------
    def build_model(self) -> nn.Module:
        """The network this method trains: the configured model by default."""
        return self.base_model()

    def base_model(self, **overrides) -> nn.Module:
        """The configured model (``model.name``, its options), with ``overrides`` such as ``norm=``."""
        if self.setup.model_builder is None:
            raise TypeError("Setup.model_builder is not set: pass raysim.models.from_setup (the engine does)")
        return self.setup.model_builder(self.setup, **overrides)

    def personal_keys(self, model: nn.Module) -> set[str]:
        """State-dict keys that stay on the client (FedBN: the BN layers)."""
        return set()

    def upload_floor(self, model: nn.Module) -> int:
        """Bytes every client upload sends at least (tensors, statistics and extras), or 0 where
        that is not known (the default). A buffered schedule plans its server steps ahead with it
        (a job takes at least its transfers); a larger figure than an upload sends fails the run."""
        return 0

    # ---- server ---------------------------------------------------------------------------
    def init_server(self, model: nn.Module) -> dict:
        """Server state; ``state["global"]`` holds the shared tensors that are broadcast. Every
        tensor the server keeps is on the CPU (:func:`raysim.core.tensors.cpu_copy`)."""
        personal = self.personal_keys(model)
        return {"global": cpu_copy({k: v for k, v in model.state_dict().items() if k not in personal})}

    def selection(self, configured: Selection) -> Selection:
        """The selection this method's rounds run with: the configured one (``clients.selection``:
        uniform by default); Power-of-Choice's method returns its own."""
        return configured

    def select(self, state: dict, ctx: SelectionContext) -> list[int]:
        """Override to choose a round's clients yourself (a subset of ``ctx.online``, drawn only from
        ``ctx.rng``, ``state`` read, never written): the engine then calls this instead of the
        selection. Not overridden, the engine runs :meth:`selection`; called directly, this is the
        uniform draw."""
        return Selection().choose(None, ctx, {})

    def broadcast(self, state: dict, round: int) -> dict:
        """The one payload every client of the round receives (``ray.put`` once)."""
        return {"global": state["global"]}

    def client_payload(self, state: dict, client_id: int, round: int) -> dict | None:
        """A payload for one client only (FDSE's personalised mix); None for most methods."""
        return None

    def eval_payload(self, state: dict, round: int) -> dict:
        """What evaluation after round ``round``'s aggregation receives (gPerXAN adds the averaged
        BN sides it never broadcasts for training; FDSE the mean DSE mix)."""
        return self.broadcast(state, round)

    def aggregate(self, state: dict, uploads, round: int) -> dict:
        """The server step over what ``aggregator`` reduced the round's uploads to; FedAvg: the
        global tensors become the weighted mean (:class:`raysim.core.aggregation.Mean`). With a
        server optimizer (``server.optimizer``, or the method's ``server_optimizer``) the global
        parameters instead take its step along Δ = mean − global
        (:mod:`raysim.core.server_optimizers`), its state kept in the server's state; SGD at
        η = 1 skips it: the mean, bit for bit.

        Called only with uploads (at least one client of the round uploaded): a round whose
        clients all dropped (deadline, memory, availability) has no server step, and the state
        stays as it was."""
        opt = resolve_server_optimizer(getattr(self.setup, "server", None), self.server_optimizer, self.name)
        if opt.plain_mean:
            return {**state, "global": {**state["global"], **uploads.mean}}
        new, opt_state = opt.update(state["global"], uploads.mean, state.get(SERVER_OPTIMIZER_STATE))
        return {**state, "global": new, SERVER_OPTIMIZER_STATE: opt_state}

    def buffered_step(self, state: dict, uploads: BufferedUploads, step: int) -> dict:
        """The server step of a buffered schedule (FedBuff's): the server optimizer steps along
        Δ̄ = Σ w_i s(τ_i) Δ_i / Σ w_i (:mod:`raysim.core.buffered`), as :meth:`aggregate` steps
        along a round's mean update; SGD at η = 1 adds Δ̄."""
        opt = resolve_server_optimizer(getattr(self.setup, "server", None), self.server_optimizer, self.name)
        target = step_target(state["global"], uploads)
        if opt.plain_mean:
            return {**state, "global": {**state["global"], **target}}
        new, opt_state = opt.update(state["global"], target, state.get(SERVER_OPTIMIZER_STATE))
        return {**state, "global": new, SERVER_OPTIMIZER_STATE: opt_state}

    def client_footprint(self, client_id: int, dense: dict) -> dict:
        """What the client's device must hold, for its memory budget (``clients.profiles``
        memory_mb): ``{"params": n, "macs": forward multiply-accumulates per sample}``; ``dense`` is
        the full model's. Pruning methods (DapperFL) return their sub-model's. The simulated clock
        does not read it: it measures every pass the client step runs (raysim.engine.compute)."""
        return dense

    def server_metrics(self, state: dict) -> dict[str, float]:
        """Numbers about the server's state after a round's aggregation, logged as federation rows
        of split "server" (FDSE: the weight each client keeps on its own DSE in Eq. 9)."""
        return {}

    # ---- client ---------------------------------------------------------------------------
    def init_client_state(self, client_id: int, model: nn.Module) -> dict:
        """A client's state before its first round: its personal tensors as initialised. Every
        tensor of a client's state is on the CPU between rounds, whatever device trains it
        (:func:`raysim.core.tensors.cpu_copy`); ``model`` may be on the host's GPU."""
        personal = self.personal_keys(model)
        return {"personal": cpu_copy({k: v for k, v in model.state_dict().items() if k in personal})}

    def load_client_model(self, model: nn.Module, payload: dict, state: dict) -> None:
        """Put the broadcast's shared tensors and the client's personal tensors into ``model``."""
        load_tensors(model, payload["global"])
        load_tensors(model, state.get("personal", {}))

    def local_update(self, ctx: ClientContext) -> Upload:
        """The step of :meth:`local_loss` where the method gives one
        (:func:`raysim.core.training.train_local_loss`); else E epochs of SGD on the cross-entropy
        (:func:`raysim.core.training.train_epochs`)."""
        from raysim.core.training import train_epochs, train_local_loss
        spec = self.local_loss(ctx)
        if spec is None:
            return self.upload(ctx, train_epochs(ctx))
        return train_local_loss(self, ctx, spec)

    def local_loss(self, ctx: ClientContext) -> LocalLoss | None:
        """The client step written as a per-batch loss (:class:`LocalLoss`), for client cohorts,
        and run by the default ``local_update`` for a client alone; None (the default): the method
        trains its clients one by one. Called on the client's loaded model, where ``local_update``
        would be (it may read ``ctx.state`` and the payload, and run passes of its own first). The
        engine uses it only where the class that defines it also defines, or inherits unchanged,
        the ``local_update`` it stands for: this default one, or a step of its own written beside
        it (FedWon's); a subclass that overrides ``local_update`` alone trains one by one."""
        return None

    def upload(self, ctx: ClientContext, stats: dict) -> Upload:
        """Standard upload: keep personal tensors in ``state``, send the shared ones."""
        personal = self.personal_keys(ctx.model)
        sd = ctx.model.state_dict()
        ctx.state["personal"] = cpu_copy({k: v for k, v in sd.items() if k in personal})
        shared = {k: v for k, v in sd.items() if k not in personal}  # state_dict's tensors are detached
        return Upload(tensors=shared, weight=client_weight(ctx), metrics=stats)

    # ---- evaluation -----------------------------------------------------------------------
    def post_train_state(self, ctx: ClientContext) -> Tensors:
        """What ``eval.point: post_train`` scores: the client's model as it leaves training (Ditto:
        its personal model, which FLGo and FDSE score)."""
        return cpu_copy(ctx.model.state_dict())

    def eval_model(self, model: nn.Module, payload: dict, state: dict) -> nn.Module:
        """The model a client is evaluated with (personalised protocol)."""
        self.load_client_model(model, payload, state)
        return model

    def global_eval_model(self, model: nn.Module, payload: dict) -> nn.Module:
        """The global model (``eval.protocol`` global and lodo), built on the initial model.

        Tensors the broadcast lacks (FedBN's BN layers, Local's whole model) come from
        ``payload["personal_mean"]``: the uniform mean of the last round's clients' personal
        tensors, which the engine gathers for evaluation only under the global and lodo protocols."""
        load_tensors(model, payload["global"])
        load_tensors(model, payload.get("personal_mean", {}))
        return model

    def adapt_to_unseen(self, model: nn.Module, client: UnseenClient) -> bool:
        """Label-free adaptation of the global model to an unseen client before it is evaluated
        (FedBN: BN statistics, FDSE: Alg. 3). Returns whether it changed anything; FedAvg: none."""
        return False

    # ---- report ---------------------------------------------------------------------------
    @classmethod
    def report_markdown(cls, config, metrics) -> str:
        """Method-specific sections appended to a run's summary.md (markdown; "" for none), from
        one federation of the method (its first seed): ``config``, the federation's
        ``raysim.config.ExperimentConfig`` (None where its folder holds no config.yaml), and
        ``metrics``, its metrics as a pandas DataFrame in raysim's long format (the columns of
        ``raysim.engine.metrics.COLUMNS``). The app reads both; a method never reads a run folder."""
        return ""


class SpareModels:
    """Extra instances of the host's model (a frozen copy of the received global model, a client's
    previous or personal model), built once per host and reloaded for each client: nothing is
    rebuilt per client step."""

    def __init__(self):
        self._nets: dict[str, tuple[nn.Module, nn.Module]] = {}

    def get(self, key: str, like: nn.Module, tensors: Tensors, trainable: bool = False) -> nn.Module:
        """The ``key`` instance (a copy of ``like``'s architecture) holding ``tensors``: in train
        mode; frozen (no gradient) unless ``trainable``."""
        net, src = self._nets.get(key, (None, None))
        if net is None or src is not like:
            net = copy.deepcopy(like)
            self._nets[key] = (net, like)
        net.load_state_dict(tensors)
        net.train()
        net.requires_grad_(trainable)
        return net


def client_weight(ctx: ClientContext) -> float:
    return 1.0 if ctx.train.weighting == "uniform" else float(ctx.data.num_train)


def buffered_refusal(method, model: nn.Module | None = None) -> str:
    """Why ``method`` (a Method or its class) cannot run a buffered schedule, in a few words; ""
    where it can: its upload is the shared model, folded by the weighted mean, and its server
    step is the default one (or its own ``buffered_step``)."""
    cls = method if isinstance(method, type) else type(method)
    if not isinstance(cls.aggregator, WeightedMean):
        return "its server step needs every client's upload of one round (it keeps them all)"
    if cls.aggregate is not Method.aggregate and cls.buffered_step is Method.buffered_step:
        return "it has its own server step over every client of one round (aggregate)"
    if cls.client_payload is not Method.client_payload:
        return "it sends each client a payload of its own, built for the round"
    if cls.select is not Method.select:
        return "it selects each round's clients itself (select)"
    if cls.selection is not Method.selection:
        return "it runs its own client selection (selection), which a buffered dispatch's uniform draw would replace"
    if cls.pools_clients:
        return "it trains one model on every client's data at once"
    if model is not None and not isinstance(method, type) and method.personal_keys(model):
        return "it keeps personal tensors on the clients, which a buffered step does not gather"
    return ""
