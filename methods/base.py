"""The method contract: what an FL method tells the engine, and what the engine hands it.

A method is one class. Read top to bottom it is the paper's algorithm box:

* ``Hparams``           its hyperparameters (dataclass, paper defaults, declared search space);
* ``build_model``       how it changes the network (norm swap, decomposed convs, ...);
* ``personal_keys``     which state-dict entries never leave the client;
* ``init_server``       the server's state (the global tensors, plus anything else it keeps);
* ``broadcast`` / ``client_payload``  what every client / one client receives;
* ``local_update``      the client step, on the client's model and its persistent ``state``;
* ``aggregate``         the server step over the round's uploads.

The engine never special-cases a method. It runs ``local_update`` on the host that owns the
client, keeps ``ctx.state`` for that client between rounds (spilling it to disk when idle), and
hands ``aggregate`` either the weighted mean of the uploads (``aggregation = "mean"``: summed
per host, cheap) or every upload by client id (``aggregation = "per_client"``: FDSE, CSAC,
DapperFL need them).
"""
from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator

import torch
from torch import nn

from raysim.errors import UserError

Tensors = dict[str, torch.Tensor]


# ----------------------------------------------------------------------------- hyperparameters

@dataclass(frozen=True)
class Space:
    """A search range for one hyperparameter (read by tuning/ to build Tune/Optuna spaces)."""
    kind: str  # "loguniform" | "uniform" | "int" | "choice"
    low: float | None = None
    high: float | None = None
    choices: tuple | None = None

    @staticmethod
    def log(low: float, high: float) -> "Space":
        return Space("loguniform", low, high)

    @staticmethod
    def uniform(low: float, high: float) -> "Space":
        return Space("uniform", low, high)

    @staticmethod
    def integer(low: int, high: int) -> "Space":
        return Space("int", low, high)

    @staticmethod
    def choice(*options) -> "Space":
        return Space("choice", choices=tuple(options))


@dataclass(frozen=True)
class Hparams:
    """Base of every method's hyperparameters; subclasses add fields with the paper's defaults."""

    @classmethod
    def search_space(cls) -> dict[str, Space]:
        return {}


# ----------------------------------------------------------------------------- what flows

@dataclass(frozen=True)
class Setup:
    """What a method knows about the federation it runs in (same on the server and every host)."""
    num_classes: int
    image_shape: tuple[int, int, int]
    num_clients: int
    client_domains: tuple[str, ...]  # domain of each client id
    model: Any  # raysim.config.ModelConfig
    train: Any  # raysim.config.TrainConfig
    rounds: int
    seed: int
    client_profiles: tuple[dict, ...] = ()  # per-client system profile (e.g. DapperFL's tier)


@dataclass
class Upload:
    """What one client sends back after its local step."""
    tensors: Tensors  # usually the trained shared tensors
    weight: float  # aggregation weight (n_k by default, see train.weighting)
    extras: dict = field(default_factory=dict)  # anything else the server needs (masks, stats)
    metrics: dict = field(default_factory=dict)  # e.g. {"loss": mean training loss}


@dataclass
class Uploads:
    """The round's uploads as the server sees them."""
    mean: Tensors | None  # weighted mean of Upload.tensors over the round's clients
    total_weight: float
    clients: list[int]  # the round's client ids, ascending
    each: dict[int, Upload] | None = None  # every client's upload (aggregation == "per_client")


@dataclass
class ClientData:
    """One client's partition, already resident on its host."""
    train: Any  # raysim.data.Split restricted by index (see runtime.clientdata)
    val: Any
    test: Any
    num_train: int

    def batches(self, batch_size: int, generator: torch.Generator, device: torch.device,
                drop_last: bool = False) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """One epoch of shuffled training batches; order and augmentation come from ``generator``."""
        return self.train.batches(batch_size, generator=generator, device=device, drop_last=drop_last)


@dataclass
class ClientContext:
    """Everything one client step sees. ``state`` is the client's persistent store."""
    client_id: int
    domain: str
    round: int  # 1-based
    model: nn.Module  # shared tensors from the payload and personal tensors from ``state`` loaded
    payload: dict  # the round's broadcast (plus this client's personal payload, under "personal")
    state: dict  # persists across rounds on the client's host; the method owns its keys
    data: ClientData
    train: Any  # TrainConfig
    lr: float  # this round's learning rate (after lr_decay)
    generator: torch.Generator  # keyed by (seed, round, client, "train"): the only randomness
    device: torch.device
    profile: dict = field(default_factory=dict)


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


# ----------------------------------------------------------------------------- the contract

class Method:
    """FedAvg semantics by default; a method overrides only what its paper changes."""
    name: ClassVar[str] = "base"
    Hparams: ClassVar[type[Hparams]] = Hparams
    aggregation: ClassVar[str] = "mean"  # "mean" | "per_client"
    paper: ClassVar[str] = ""

    def __init__(self, hp: Hparams, setup: Setup):
        self.hp = hp
        self.setup = setup

    # ---- hyperparameters ------------------------------------------------------------------
    @classmethod
    def hparams_from(cls, values: dict | None, prefix: str = "hp") -> Hparams:
        """Typed construction of Hparams from a user dict (config ``hp.<method>``)."""
        values = dict(values or {})
        fields = {f.name: f for f in dataclasses.fields(cls.Hparams)}
        hints = typing.get_type_hints(cls.Hparams)
        for key, value in values.items():
            if key not in fields:
                valid = ", ".join(fields) or "(none)"
                raise UserError(f"unknown hyperparameter '{prefix}.{key}' for method {cls.name}; "
                                f"valid: {valid}")
            values[key] = _check_hp(value, hints[key], f"{prefix}.{key}")
        return cls.Hparams(**values)

    # ---- model ----------------------------------------------------------------------------
    def build_model(self) -> nn.Module:
        from raysim.models import build
        m = self.setup.model
        return build(m.name, num_classes=self.setup.num_classes, in_channels=self.setup.image_shape[0],
                     input_size=self.setup.image_shape[-1], norm=m.norm, pretrained=m.pretrained,
                     **m.options)

    def personal_keys(self, model: nn.Module) -> set[str]:
        """State-dict keys that stay on the client (FedBN: the BN layers)."""
        return set()

    # ---- server ---------------------------------------------------------------------------
    def init_server(self, model: nn.Module) -> dict:
        """Server state; ``state["global"]`` holds the shared tensors that are broadcast."""
        personal = self.personal_keys(model)
        return {"global": {k: v.detach().clone() for k, v in model.state_dict().items() if k not in personal}}

    def broadcast(self, state: dict, round: int) -> dict:
        """The one payload every client of the round receives (``ray.put`` once)."""
        return {"global": state["global"]}

    def eval_payload(self, state: dict, round: int) -> dict:
        """What evaluation after round ``round``'s aggregation receives (gPerXAN adds the averaged
        BN sides it never broadcasts for training)."""
        return self.broadcast(state, round)

    def client_payload(self, state: dict, client_id: int, round: int) -> dict | None:
        """A payload for one client only (FDSE's personalised mix); None for most methods."""
        return None

    def aggregate(self, state: dict, uploads: Uploads, round: int) -> dict:
        """FedAvg: the weighted mean of the shared tensors."""
        if uploads.mean is None:
            return state
        new_global = dict(state["global"])
        new_global.update(uploads.mean)
        return {**state, "global": new_global}

    def server_metrics(self, state: dict) -> dict[str, float]:
        """Numbers about the server's state after a round's aggregation, logged as federation rows
        of split "server" (FDSE: the weight each client keeps on its own DSE in Eq. 9)."""
        return {}

    # ---- client ---------------------------------------------------------------------------
    def init_client_state(self, client_id: int, model: nn.Module) -> dict:
        """A client's state before its first round: its personal tensors as initialised."""
        personal = self.personal_keys(model)
        return {"personal": {k: v.detach().clone() for k, v in model.state_dict().items() if k in personal}}

    def load_client_model(self, model: nn.Module, payload: dict, state: dict) -> None:
        """Put the broadcast's shared tensors and the client's personal tensors into ``model``."""
        load_tensors(model, payload["global"])
        load_tensors(model, state.get("personal", {}))

    def local_update(self, ctx: ClientContext) -> Upload:
        from raysim.training import train_epochs
        stats = train_epochs(ctx)
        return self.upload(ctx, stats)

    def upload(self, ctx: ClientContext, stats: dict) -> Upload:
        """Standard upload: keep personal tensors in ``state``, send the shared ones."""
        personal = self.personal_keys(ctx.model)
        sd = ctx.model.state_dict()
        ctx.state["personal"] = {k: v.detach().clone() for k, v in sd.items() if k in personal}
        shared = {k: v.detach() for k, v in sd.items() if k not in personal}
        return Upload(tensors=shared, weight=client_weight(ctx), metrics=stats)

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
    def report_markdown(cls, run_dir: str) -> str:
        """Method-specific sections appended to a run's summary.md (markdown; "" for none)."""
        return ""


# ----------------------------------------------------------------------------- helpers

def load_tensors(model: nn.Module, tensors: Tensors) -> None:
    """Copy named tensors into ``model``'s parameters and buffers in place (no re-allocation)."""
    if not tensors:
        return
    own = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for k, v in tensors.items():
            dst = own[k]
            dst.copy_(v.to(dst.device, dst.dtype) if v.device != dst.device or v.dtype != dst.dtype else v)


def client_weight(ctx: ClientContext) -> float:
    return 1.0 if ctx.train.weighting == "uniform" else float(ctx.data.num_train)


def bn_keys(model: nn.Module) -> set[str]:
    """State-dict keys of every batch-norm layer (weights, biases, running stats)."""
    keys = set()
    for name, mod in model.named_modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm):
            for k in mod.state_dict().keys():
                keys.add(f"{name}.{k}" if name else k)
    return keys


def _check_hp(value, tp, key):
    if tp is float and isinstance(value, str):  # YAML 1.1 reads 1e-3 as a string
        try:
            value = float(value)
        except ValueError:
            pass
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(float(value)):
            raise UserError(f"hyperparameter '{key}' = {value!r}: expected a finite number")
        return float(value)
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if tp is bool and isinstance(value, bool):
        return value
    if tp is str and isinstance(value, str):
        return value
    if tp not in (float, int, bool, str):
        return value
    raise UserError(f"hyperparameter '{key}' = {value!r}: expected {tp.__name__}")
