"""Experiment configuration: YAML in, typed dataclasses out, every mistake a one-line UserError.

A config is plain YAML read with the safe loader. Sections map to the dataclasses below; unknown
keys, wrong types and impossible values are reported with the dotted key, the value, and what was
expected. ``key=value`` overrides from the command line use the same dotted keys.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from raysim.core.errors import UserError
from raysim.core.files import write_yaml
from raysim.core.partition_spec import partition_spec
from raysim.core import server_optimizer_defaults as serveropt
from raysim.core.settings import build, setting

SELECT_RULES = ("val", "val_weighted", "test", "final")  # eval.select: see EvalConfig
AUTO_COHORT_MAX = 64  # the most clients runtime.cohort_size 'auto' puts in one cohort


@dataclass
class DataConfig:
    dataset: str = "digits5"
    root: str | None = None  # folder of a real dataset on disk; None for generated benchmarks
    options: dict = field(default_factory=dict)  # passed to the dataset loader (image_size, ...)
    # how the clients split the data: {kind: per_domain | dirichlet | cross_device, ...}, typed per
    # kind by raysim.core.partition_spec; kept as the mapping written (config.yaml, shard fingerprints)
    partition: dict = field(default_factory=lambda: {"kind": "per_domain"})
    # pre-written Parquet shards of this partition (a path or a pyarrow.fs URI: file://, s3://,
    # gs://), written by `raysim data shard CONFIG URI`; each host then reads only its clients' data
    shards: str | None = None

    def __post_init__(self):
        """The partition's keys and values are checked as the section is built, by its kind's
        dataclass (a ``per_method`` override's too); what needs the dataset is checked when the
        partition is built."""
        partition_spec(self.partition, "data.partition")


@dataclass
class ModelConfig:
    name: str = "cnn6"
    norm: str = "default"  # "default" = the paper's norm for that network; bn | gn | ln | in | none
    pretrained: str | None = None  # local weights file; nothing is downloaded
    options: dict = field(default_factory=dict)


@dataclass
class TrainConfig:
    epochs: int = setting(1, ge=1)
    batch_size: int = setting(32, ge=1)
    lr: float = setting(0.01, gt=0)
    momentum: float = setting(0.0, ge=0, lt=1, expected="0 <= momentum < 1")
    weight_decay: float = setting(0.0, ge=0)
    lr_decay: float = setting(1.0, gt=0, le=1)  # multiplied into lr once per round: lr_t = lr * lr_decay ** (t - 1)
    max_steps: int | None = setting(None, ge=1)  # cap on local steps per round (None: whole epochs)
    grad_clip: float | None = setting(None, gt=0)  # max global grad norm
    weighting: str = setting("samples", one_of=("samples", "uniform"))  # aggregation weights: n_k or 1


@dataclass
class EvalConfig:
    every: int = setting(1, ge=1)  # evaluate every k rounds (and always after the last)
    protocol: str = setting("personalized", one_of=("personalized", "global", "lodo"))
    holdout: Any = "all"  # lodo: "all", a domain name, or a list of domain names (held out in turn)
    splits: list = field(default_factory=lambda: ["val", "test"])
    clients: Any = "all"  # "all", or an int: a fixed seeded subset of clients is evaluated
    # personalized protocol: a client's model as it receives it for the next round ("received", after
    # aggregation), or as it left its last local training ("post_train": FLGo's and FDSE's code)
    point: str = setting("received", one_of=("received", "post_train"))
    # which evaluated round summary.md headlines: "val" (best validation AVG, the default; under lodo
    # the source clients' validation), "val_weighted" (best train-size-weighted mean of the clients'
    # validation accuracies: FDSE's code), "test" (best test AVG: peeks at the test split, as DapperFL
    # reports), "final" (the last round)
    select: str = setting("val", one_of=SELECT_RULES)
    # also evaluate whenever the simulated clock (client profiles) passed another multiple of this many
    # seconds since the last evaluation: curves against simulated hours at a fixed resolution; null: off
    every_s: float | None = setting(None, gt=0)
    # unseen clients (lodo targets): run the method's label-free adaptation on the client's unlabeled
    # test data before evaluating it (FedBN: BN statistics; FDSE: Alg. 3); false: the model as built
    adapt: bool = True


@dataclass
class RuntimeConfig:
    num_hosts: int | None = setting(2, ge=1)  # ClientHost actors; None: derived from clients_per_host
    clients_per_host: int | None = setting(None, ge=1)  # None: ceil(num_clients / num_hosts)
    cpus_per_host: float = setting(1.0, gt=0, expected="> 0")
    gpus_per_host: float = setting(0.0, ge=0)  # fractional GPUs per host, e.g. 0.25
    server_cpus: float = setting(0.0, ge=0)
    torch_threads: int | None = setting(None, ge=1)  # None: cpus_per_host rounded down (at least 1)
    state_memory_mb: float = setting(4096.0, ge=0)  # per host; idle clients' state beyond this spills to disk
    # per host: clients' data kept on its GPU once loaded, batches cut there (0: off; no effect on CPU)
    device_data_mb: float = setting(0.0, ge=0)
    # per host: clients' stored state kept on its GPU between rounds, LRU beyond it to CPU memory then disk (0: off)
    device_state_mb: float = setting(0.0, ge=0)
    # deterministic kernels on every host and the server (raysim.engine.determinism): torch's
    # use_deterministic_algorithms, cuDNN deterministic (no autotuning), CUBLAS_WORKSPACE_CONFIG set
    # before CUDA starts, so a GPU run repeats bit for bit; an operation without a deterministic
    # kernel stops the run with a one-line error naming it. CPU kernels are deterministic either way
    deterministic: bool = False
    # client cohorts (raysim.engine.cohort): a host trains up to this many of its round's clients
    # at once as one vectorized step, where the method allows it (Method.local_loss); 0 or 1: one by
    # one; "auto": as many as fit the host's share of GPU memory, at most AUTO_COHORT_MAX (off on a
    # CPU; refused with deterministic)
    cohort_size: int | str = setting(0, ge=0, expected="an integer >= 0 or 'auto'")
    spill_dir: str | None = None  # None: a temp folder per host
    address: str | None = None  # Ray address: None (local, or RAY_ADDRESS), "auto", "ray://..."
    pg_timeout_s: float = 60.0
    # federations of one run (methods x held-out domains) run at once; None: as many as the
    # cluster's free CPUs and GPUs fit, each with its own placement group
    parallel_federations: int | None = setting(None, ge=1)
    # "even": before a round the hosts' queues are evened out by what each client is expected to
    # cost (clients whose stored state is at most steal_state_mb may move: it travels through the
    # object store, and their data view is rebuilt on the host that trains them), then each host
    # trains its queue; "steal": the same, then a host whose queue is done takes clients still
    # queued on a busy one (for hosts whose speed changes within a round; each chunk is a call);
    # "owner": every client trains on its own host (client k on host k mod H). The results are the
    # same whichever host trains a client
    balance: str = setting("even", one_of=("even", "steal", "owner"))
    steal_state_mb: float = setting(4.0, ge=0)
    # the nice value of the Ray workers (hosts, server) when raysim starts Ray itself: 0, the
    # priority of any program you start (Ray's own default, 15, lets every other process on the
    # machine take the CPU from the simulation first); a cluster joined with --address keeps its own
    worker_niceness: int = setting(0, ge=0, le=19)
    # a lost ClientHost or Server is replaced and the federation replays from its last checkpoint;
    # this many in a row without progress (no round completed past the one that failed) end the run
    max_restarts: int = setting(3, ge=0)
    # the deadline of every wait on the server and hosts (raysim.engine.watchdog): past it, an actor
    # that does not answer a health check is replaced as lost; null: 10 x the median of the last
    # rounds' wall time, at least 60 s
    stall_timeout_s: float | None = setting(None, gt=0)


@dataclass
class CheckpointConfig:
    """When a checkpoint is written: after every ``every``-th round, and after any round that ends
    ``minutes`` of wall time after the last checkpoint (or the start), whichever comes first; either
    bounds what a lost driver or server costs. The time rule stretches its interval to 20 times the
    last checkpoint's write time, so checkpoints never take more than ~5% of a run (a 1M-client
    checkpoint is GBs through the driver)."""
    every: int = setting(0, ge=0)  # write a checkpoint every k rounds (0: by time only)
    minutes: float | None = setting(10.0, gt=0)  # and at most this long after the last one (null: by rounds only)
    keep: int = setting(2, ge=1)  # keep the newest k checkpoints


@dataclass
class ProfilesConfig:
    """Client system profiles: device levels and which client has which (DapperFL's capability
    tiers C1..C5). A client's profile is ``{"tier": index, "level": name, **the level's keys}``;
    the keys the simulated clock reads (raysim.core.tiers): ``flops`` (FLOP/s), ``memory_mb`` (the
    largest model it can train, float32 parameters), ``up_mbps`` / ``down_mbps`` (Mbit/s),
    ``availability`` (probability of being online in a round); others are free (e.g. a method's knob)."""
    # the device levels, weakest last by convention: names ("C1") or mappings ({name: C1, flops: 1e9,
    # ...}); an integer N means levels L1..LN; [] (default): no profiles
    levels: Any = field(default_factory=list)
    # which level each client gets: "round_robin" (client k -> k mod L: DapperFL's code), "random"
    # (balanced slots shuffled with the seed), or an explicit list of level indices, one per client
    assign: Any = "round_robin"
    shares: tuple[float, ...] | None = setting(None, ge=0)  # share of clients per level (default equal)
    # availability trace: a CSV file of "client,round" rows, the rounds each client is online (it
    # replaces the levels' availability); null: the levels' availability
    trace: str | None = None


@dataclass
class SelectionConfig:
    """Which online clients train in a round (raysim.core.selection), for any method: ``uniform``
    (FedAvg's draw of m), ``poisson`` (each client on its own with probability m / N: the sampling
    the classic DP analysis assumes) or ``power_of_choice`` (Cho et al. 2022: m of d candidates, the highest local
    losses). A method with its own ``select`` ignores it."""
    kind: str = setting("uniform", one_of=("uniform", "poisson", "power_of_choice"))
    # power_of_choice: candidates per round (>= clients per round); null: 2m
    d: int | None = setting(None, ge=1)
    # power_of_choice: pow-d asks the candidates their loss of the global model; rpow-d ranks by their last training loss
    variant: str = setting("pow-d", one_of=("pow-d", "rpow-d"))


@dataclass
class ScheduleConfig:
    """How the server steps (raysim.engine.timeline). ``rounds``: synchronous rounds, every sampled
    client of a round folded into one step. ``buffered``: asynchronous on the simulated clock (client
    profiles give each client's duration): ``concurrency`` clients train at once, each from the model
    version it was dispatched with; the server steps after every ``buffer`` arrivals (FedBuff's K),
    each upload's delta weighted by its staleness s(τ); new clients are dispatched at each step."""
    # null: the method's (rounds; buffered for fedbuff and fedasync)
    kind: str | None = setting(None, one_of=("rounds", "buffered"),
                               source="null: the method's (buffered for fedbuff and fedasync, rounds for the others)")
    concurrency: int | None = setting(None, ge=1)  # C, clients in flight; null: clients_per_round
    # K, arrivals per server step; null: the method's (FedBuff's 10, FedAsync's 1), at most C
    buffer: int | None = setting(None, ge=1, source="null: the method's: FedBuff's K = 10 (Nguyen et al. 2022), "
                                 "FedAsync's 1 (every arrival); at most the concurrency")
    # s(τ): sqrt (FedBuff), constant, polynomial (1+τ)^-a, hinge (b, a); null: the method's (raysim.core.staleness)
    staleness: str | None = setting(None, one_of=("sqrt", "constant", "polynomial", "hinge"))
    staleness_a: float | None = setting(None, gt=0)  # a of polynomial and hinge; null: the method's
    staleness_b: float | None = setting(None, ge=0)  # b of hinge; null: the method's
    max_staleness: int | None = setting(None, ge=0)  # arrivals staler than this are dropped; null: none
    # availability in simulated time: a client's online draw (or a trace's round r) holds for slot r of this many seconds
    slot_s: float = setting(60.0, gt=0)


@dataclass
class AdaptiveClipConfig:
    """Adaptive clipping (Andrew, Thakkar, McMahan, Ramaswamy, NeurIPS 2021): C follows the
    ``quantile`` of the clients' update norms, C <- C exp(-lr (b - quantile)), b the noisy fraction
    of unclipped updates; ``privacy.clip`` is its initial value."""
    quantile: float = setting(0.5, gt=0, lt=1, source="Andrew et al. 2021: γ = 0.5 (the median) in their experiments")
    lr: float = setting(0.2, gt=0, source="Andrew et al. 2021: η_C = 0.2, the geometric update's step")
    # σ_b, the noise on the count of unclipped updates; null: m / 20 (m the expected clients per round)
    count_noise: float | None = setting(None, gt=0, source="null: m / 20, Andrew et al. 2021's σ_b = m/20")


@dataclass
class PrivacyConfig:
    """Client-level differential privacy (raysim.core.privacy, raysim.core.stages): every client's
    update clipped to L2 norm ``clip``, clients weighted uniformly, Gaussian noise of standard
    deviation z C on the sum (DP-FedAvg, McMahan et al. 2018), divided by the expected clients per
    round; ε at ``delta`` from dp-accounting after every round. Give ``noise_multiplier`` (z) or
    ``target_epsilon`` (z found for the planned rounds before the run); neither: clip only (ε inf)."""
    clip: float | None = setting(None, gt=0)  # C (adaptive: C_0); required
    noise_multiplier: float | None = setting(None, ge=0)  # z
    target_epsilon: float | None = setting(None, gt=0)  # ε after the planned rounds; picks z
    delta: float | None = setting(None, gt=0, lt=1)  # δ; null: 1 / N (N training clients)
    accountant: str = setting("rdp", one_of=("rdp", "pld"))
    local: bool = False  # noise on each client's clipped update before it leaves the client (local DP)
    adaptive: None | AdaptiveClipConfig = None  # adaptive clipping; null: the fixed clip


@dataclass
class CompressionConfig:
    """Update compression (raysim.core.compression): ``topk`` keeps the ``fraction`` largest entries
    of each update with error feedback; ``quantize`` is QSGD's unbiased stochastic quantization to
    ``bits`` bits per entry. The upload's bytes and the simulated clock charge the compressed size."""
    kind: str = setting("topk", one_of=("topk", "quantize"))
    fraction: float = setting(0.01, gt=0, le=1)  # topk: the share of entries sent
    bits: int = setting(8, ge=2, le=16)  # quantize: bits per entry (a sign and bits - 1 of level)


@dataclass
class StopConfig:
    """Stop a federation early on the simulated clock (client profiles): after the step (round) at
    which it reaches ``sim_hours`` simulated hours; null: at ``rounds``."""
    sim_hours: float | None = setting(None, gt=0)


@dataclass
class ClientsConfig:
    profiles: ProfilesConfig = field(default_factory=ProfilesConfig)
    selection: SelectionConfig = field(default_factory=SelectionConfig)
    # a round's deadline in simulated seconds: a client whose simulated compute + transfer time
    # exceeds it is dropped from that round's aggregate (over-selection / deadline schemes); null: none
    deadline_s: float | None = setting(None, gt=0)


@dataclass
class ServerConfig:
    """The server's step on the round's mean (Reddi et al., "Adaptive Federated Optimization", ICLR
    2021, Alg. 2; FedJAX's server_optimizer): the default aggregate moves the global parameters
    along Δ = mean − global with this optimizer (raysim.core.server_optimizers: the equations);
    running BN statistics take the mean, integer buffers are left to it. The defaults (sgd at lr
    1) are FedAvg's plain mean, bit for bit. Only for methods that aggregate by the default mean
    (a method with its own ``aggregate`` refuses any other step); FedAvgM, FedAdam, FedYogi and
    FedAdagrad are FedAvg with momentum, adam, yogi and adagrad here."""
    # sgd | momentum | adam | yogi | adagrad; null: the method's own (sgd, FedAdam's adam, ...)
    optimizer: str | None = setting(None, one_of=serveropt.OPTIMIZERS,
                                    source="null: the method's (sgd for all but FedAvgM/FedAdam/FedYogi/FedAdagrad)")
    # η; null: the optimizer's (sgd 1, momentum 1, adagrad 0.1, adam 0.01, yogi 0.01)
    lr: float | None = setting(None, gt=0, source="Reddi et al. 2021: grid 10^-3..10^1, best per task in their code's "
                               "docs/hyperparameters.md: FedAvg/FedAvgM 1, FedAdagrad 0.1, FedAdam/FedYogi 0.01")
    # β of momentum (FedAvgM): v = β v + Δ, x = x + lr v
    momentum: float = setting(serveropt.DEFAULT_MOMENTUM, ge=0, lt=1, expected="0 <= momentum < 1",
                              source="Hsu et al. 2019; Reddi et al. 2021's FedAvgM (server_sgd_momentum=0.9)")
    # β1, β2 of adam, yogi (β1 also adagrad's first moment in the paper form, Alg. 2 line 11)
    # null: the form's, (0.9, 0.999) in the code form (Keras's, as Reddi et al.'s code ran), (0.9, 0.99) in the paper's
    betas: tuple[float, ...] | None = setting(None, ge=0, lt=1, expected="two numbers in [0, 1)",
                                              source="by the form: code (0.9, 0.999), Keras's defaults, which Reddi et "
                                              "al.'s code ran (docs/hyperparameters.md: 'we did not [change them]'); "
                                              "paper (0.9, 0.99), the paper's text (as Flower's FedAdam/FedYogi)")
    # τ, the adaptivity: x = x + lr c_t m / (sqrt(v) + τ)
    tau: float = setting(serveropt.DEFAULT_TAU, gt=0,
                         source="Reddi et al. 2021: τ = 1e-3, their code's recommended ε (docs/hyperparameters.md)")
    # code: the form lr was tuned with (Adam, Yogi bias-corrected; Adagrad without a first moment; v from 0
    # for all three); paper: Alg. 2 as printed (no bias correction, v from τ², β1 for all three)
    form: str = setting(serveropt.DEFAULT_FORM, one_of=serveropt.FORMS,
                        source="by the defaults rule: Reddi et al.'s code (Keras Adam/Adagrad, TF Addons Yogi, "
                        "ε = τ) tuned the grid's lr; paper: Alg. 2",
                        doc="code: Adam/Yogi bias-corrected, Adagrad without m, v from 0 | paper: Alg. 2 as printed")


@dataclass
class TrackingConfig:
    """Experiment tracking of every federation (raysim.app.tracking): TensorBoard event files in the
    federation's run directory (``<run_dir>/tb/``), and optionally an MLflow tracking server."""
    tensorboard: bool = True  # per-round scalars and the resolved config as hparams in <run_dir>/tb/
    # an MLflow tracking URI (http://host:5000, file:///path, sqlite:///mlflow.db); null: no MLflow.
    # Needs the optional extra: pip install raysim[mlflow]
    mlflow_uri: str | None = None
    mlflow_experiment: str | None = None  # the MLflow experiment's name; null: the config's name, else "raysim"
    run_name: str | None = None  # the MLflow run's name; null: <method>/seed-<s>[/holdout-<d>] (raysim tune: the trial's)
    # per-client training scalars (train/<metric>/client_<k>) in TensorBoard and MLflow for federations
    # of at most this many clients (cross-silo); 0: none; null: always. metrics.parquet keeps every row
    client_scalars: int | None = 100


# the keys of a named variant in ``methods`` besides the config sections it changes
VARIANT_KEYS = ("name", "method", "hp")
# what a variant cannot change: the comparison's layout, and the seeds every entry is paired over
NOT_PER_VARIANT = ("methods", "per_method", "variant", "seed", "seeds", "paper")
FOLDER_NAME = r"[A-Za-z0-9_][A-Za-z0-9_.-]*"  # a run's or a variant's name: it names a folder


@dataclass(frozen=True)
class MethodEntry:
    """One entry of ``methods``: a method by its name (``fedprox``; a plugin's ``module:Class``), or
    a named variant, ``{name: fedprox-mu1, method: fedprox, hp: {mu: 1.0}, train: {lr: 0.1}}``: the
    method with the settings that differ (``hp``: the method's own hyperparameters; any other key a
    config section, as ``per_method`` takes them). Each entry is one folder and one row."""
    method: str
    variant: str | None = None  # the variant's name; None: the method itself
    settings: dict = field(default_factory=dict)  # a variant's hp and config sections

    def name(self, method_key=None) -> str:
        """Its folder's and row's name: the variant's, else the method's key (``method_key(spec)``:
        a plugin ``module:Class`` is shown by its class's name)."""
        return self.variant or (method_key(self.method) if method_key else self.method)


def method_entry(item, where: str) -> MethodEntry:
    """An entry of ``methods`` as written (a name, or a variant's mapping), checked; ``where``
    names it in the errors (``methods[1]``)."""
    if isinstance(item, str):
        return MethodEntry(item)
    if not isinstance(item, dict):
        raise UserError("config needs 'method: NAME' or 'methods: [NAME, ...]'; an entry of 'methods' is a "
                        f"method's name or a variant {{name: NAME, method: METHOD, ...}}, got {where} = {item!r}")
    name = item.get("name")
    if name is None:
        raise UserError(f"{where}: a variant needs 'name: NAME' (its folder and its row), e.g. "
                        "{name: fedprox-mu1, method: fedprox, hp: {mu: 1.0}}")
    if not isinstance(name, str) or re.fullmatch(FOLDER_NAME, name) is None or name.startswith(("seed-", "holdout-")):
        raise UserError(f"{where}: name = {name!r}: expected letters, digits, '.', '_' or '-', not starting "
                        "with seed- or holdout- (it names the variant's folder)")
    where = f"{where} ({name})"
    method = item.get("method")
    if not isinstance(method, str) or not method:
        raise UserError(f"{where}: a variant needs 'method: NAME', the method it runs (e.g. method: fedprox)")
    sections = [f.name for f in dataclasses.fields(ExperimentConfig)
                if f.name not in NOT_PER_VARIANT + VARIANT_KEYS]
    for key in item:
        if key in NOT_PER_VARIANT:
            raise UserError(f"{where}: a variant cannot set '{key}': it is the comparison's (every entry of "
                            "'methods' runs its seeds, each in its own folder)")
        if key not in VARIANT_KEYS and key not in sections:
            raise UserError(f"{where}: unknown key '{key}'; expected name, method, hp (the method's "
                            f"hyperparameters) or a config section: {', '.join(sections)}")
    if not isinstance(item.get("hp", {}), dict):
        raise UserError(f"{where}: 'hp' must map the method's hyperparameters to values (e.g. hp: {{mu: 1.0}})")
    settings = {k: copy.deepcopy(v) for k, v in item.items() if k not in ("name", "method")}
    return MethodEntry(method, name, settings)


@dataclass
class ExperimentConfig:
    method: str | None = "fedavg"
    # one name for this config's federation of ``method`` (a variant's federation records its name
    # here, its run folder's config.yaml beside ``method``); null: the method's own. A comparison
    # names its variants in ``methods``
    variant: str | None = None
    # several methods on the same data and seed -> one comparison table; an entry is a method's name
    # or a named variant {name, method, hp, <sections>} (MethodEntry)
    methods: list | None = None
    rounds: int = setting(20, ge=1)
    seed: int = 0
    seeds: list | None = None  # several seeds: every method runs once per seed (takes the place of seed)
    clients_per_round: int | None = setting(None, ge=1)  # None with fraction None: every client every round
    fraction: float | None = setting(None, gt=0, le=1)
    name: str | None = None
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    clients: ClientsConfig = field(default_factory=ClientsConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    stop: StopConfig = field(default_factory=StopConfig)
    privacy: None | PrivacyConfig = None  # client-level DP stages; null: none
    compression: None | CompressionConfig = None  # update compression stage; null: none
    hp: dict = field(default_factory=dict)  # per-method hyperparameters: {method_name: {field: value}}
    # settings that differ per method in a comparison, e.g. {fedbn: {train: {lr: 0.05}}}
    per_method: dict = field(default_factory=dict)
    # REPORT-ONLY: the published numbers of the paper table the config reproduces: {source, dataset,
    # metrics: {AVG: {method: [mean, std]}, ...}}. No run reads it (nothing in raysim.engine does; a
    # checkpoint's fingerprint and the tracked params leave it out); it is written to the run folder's
    # config.yaml, from which `raysim report` and `raysim compare` show it beside the results
    paper: dict = field(default_factory=dict)

    def method_entries(self) -> list[MethodEntry]:
        """The entries of ``methods`` (or the one ``method``), each a method or a named variant."""
        if not self.methods:
            return [MethodEntry(self.method, self.variant)]
        return [method_entry(m, f"methods[{i}]") for i, m in enumerate(self.methods)]

    def method_names(self) -> list[str]:
        """The method each entry runs (a variant's ``method``; a method may appear more than once)."""
        return [e.method for e in self.method_entries()]

    def entry_names(self, method_key=None) -> list[str]:
        """The entries' names: their folders and rows (:meth:`MethodEntry.name`)."""
        return [e.name(method_key) for e in self.method_entries()]

    def for_method(self, name: str, method_key=None) -> "ExperimentConfig":
        """This config narrowed to one entry of a comparison: ``name`` is the entry's name (a
        variant's, or its method's key) or its method. The entry's ``per_method.<name>`` settings are
        merged in, then a variant's own (its ``hp`` into ``hp.<method's key>``). ``method_key(spec)``:
        a method's key (a plugin ``module:Class`` is keyed by its class's name:
        raysim.methods.registry.name_of); default the spec itself."""
        entries = self.method_entries()
        names = [e.name(method_key) for e in entries]
        entry = (entries[names.index(name)] if name in names
                 else next((e for e in entries if e.method == name), None))
        if entry is None:
            raise UserError(f"{name!r} is not one of the run's methods {names}")
        raw = self.to_dict()
        raw.update(method=entry.method, methods=None, per_method={}, variant=entry.variant)
        merge(raw, self.per_method.get(entry.name(method_key)) or {})
        settings = copy.deepcopy(entry.settings)
        hp = settings.pop("hp", None)
        merge(raw, settings)
        if hp:
            merge(raw.setdefault("hp", {}), {method_key(entry.method) if method_key else entry.method: hp})
        return build(ExperimentConfig, raw)

    def seed_list(self) -> list[int]:
        return list(self.seeds) if self.seeds else [self.seed]

    def for_seed(self, seed: int) -> "ExperimentConfig":
        """This config narrowed to one seed of a multi-seed run."""
        raw = self.to_dict()
        raw.update(seed=seed, seeds=None)
        return build(ExperimentConfig, raw)

    def to_dict(self) -> dict:
        """The config as plain data (config.yaml, the checkpoint's fingerprint); ``variant`` only where
        set, so a config without variants reads, and fingerprints, as before variants existed."""
        raw = dataclasses.asdict(self)
        for key in ("variant", "privacy", "compression"):  # unset: as before they existed
            if raw.get(key) is None:
                raw.pop(key, None)
        return raw


# ----------------------------------------------------------------------------- parsing

# Dotted keys (``train.lr``) and section merges: the config's, and raysim.tuning's for searched keys.

def merge(into: dict, extra: dict) -> None:
    """``extra`` merged into ``into`` in place: a mapping into a mapping key by key, anything else
    (a copy of it) replacing what was there."""
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            merge(into[k], v)
        else:
            into[k] = copy.deepcopy(v)


def get_path(raw: dict, path: str | list[str], default=None):
    """``raw[path[0]][path[1]]...`` (``path`` as a list or dotted, ``"train.lr"``), or ``default``
    where a step is missing or not a section."""
    node = raw
    for part in _steps(path):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def set_path(raw: dict, path: str | list[str], value, where: str | None = None) -> None:
    """Set ``raw[path[0]][path[1]]... = value`` (``path`` as a list or dotted), creating missing
    sections; ``where`` names the source (an override; default ``config key 'train.lr'``) in the
    error when a step is not a section."""
    path = _steps(path)
    where = where or f"config key '{'.'.join(path)}'"
    node = raw
    for part in path[:-1]:
        nxt = node.get(part)
        if nxt is None:
            nxt = node[part] = {}
        if not isinstance(nxt, dict):
            raise UserError(f"{where}: '{part}' is not a section")
        node = nxt
    node[path[-1]] = value


def _steps(path: str | list[str]) -> list[str]:
    return path.split(".") if isinstance(path, str) else list(path)


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text or text.startswith("="):
        raise UserError(f"override '{text}' is not of the form key=value (e.g. train.lr=0.05)")
    key, value = text.split("=", 1)
    try:
        parsed = yaml.safe_load(value) if value != "" else None
    except yaml.YAMLError:
        parsed = value
    return key.strip().split("."), parsed


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    raw = copy.deepcopy(raw)
    for text in overrides:
        path, value = parse_override(text)
        set_path(raw, path, value, where=f"override '{text}'")
        if path == ["method"]:  # method=NAME on the command line replaces a methods list (and a variant's name)
            raw.pop("methods", None)
            raw.pop("variant", None)
        if path == ["methods"]:
            raw.pop("method", None)
            raw.pop("variant", None)
        if path == ["seed"]:  # seed=N on the command line replaces a seeds list
            raw.pop("seeds", None)
    return raw


def read_yaml(path: str | os.PathLike) -> dict:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"config file not found: {path}")
    try:
        with open(path, encoding="utf-8") as fh:
            raw = yaml.safe_load(fh)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark else ""
        raise UserError(f"config file {path} is not valid YAML{where}") from None
    except UnicodeDecodeError:
        raise UserError(f"config file {path} is not UTF-8 text") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise UserError(f"config file {path} must hold a mapping of keys to values")
    return raw


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None,
                raw: dict | None = None, method_key=None) -> ExperimentConfig:
    """Read, override, type-check and validate an experiment config. ``method_key(name)``: a
    method's key in ``per_method`` and ``hp`` (default the name itself; the application passes
    raysim.methods.registry.name_of, which gives a plugin ``module:Class`` its class's name)."""
    base = read_yaml(path) if path is not None else dict(raw or {})
    base = apply_overrides(base, overrides or [])
    if "methods" in base and "method" not in base:
        base["method"] = None
    cfg = build(ExperimentConfig, base)
    validate(cfg, method_key)
    if cfg.data.shards and "://" not in cfg.data.shards:  # a local path means the driver's cwd
        cfg.data.shards = os.path.abspath(os.path.expanduser(cfg.data.shards))
    return cfg


def validate(cfg: ExperimentConfig, method_key=None) -> None:
    """What the declarations cannot say: settings that exclude each other. Types and ranges were
    checked when the dataclasses were built; the methods' names and hyperparameters are checked
    against the method registry by the application (``raysim.app.configs.check_methods``),
    checks needing the data or the cluster where those are. ``method_key``: as in :func:`load_config`."""
    def need(ok: bool, msg: str):
        if not ok:
            raise UserError(msg)

    need(cfg.methods is None or isinstance(cfg.methods, list) and bool(cfg.methods),
         "config needs 'method: NAME' or 'methods: [NAME, ...]'")
    entries = cfg.method_entries()  # each entry's own keys checked
    need(all(isinstance(e.method, str) and e.method for e in entries),
         "config needs 'method: NAME' or 'methods: [NAME, ...]'")
    plain = [e.method for e in entries if e.variant is None]
    need(len(set(plain)) == len(plain), f"'methods' lists a method twice: {plain}")
    names = [e.name(method_key) for e in entries]
    twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
    need(twice is None or all(e.variant is None for e in entries if e.name(method_key) == twice),
         f"'methods' has two entries named {twice!r}; give each variant a name of its own (it names its "
         "folder and its row)")
    need(twice is None, f"two of the methods {cfg.method_names()} have the same name")
    need(cfg.variant is None or (cfg.methods is None and re.fullmatch(FOLDER_NAME, cfg.variant) is not None),
         f"config key 'variant' = {cfg.variant!r}: a variant's name (letters, digits, '.', '_' or '-') beside "
         "'method'; in a comparison, name each variant in its entry of 'methods'")
    need(cfg.name is None or (re.fullmatch(FOLDER_NAME, cfg.name) is not None),
         f"config key 'name' = {cfg.name!r}: expected letters, digits, '.', '_' or '-' (it names the run folder)")
    need(cfg.seeds is None or (bool(cfg.seeds) and all(isinstance(x, int) and not isinstance(x, bool)
                                                       and x >= 0 for x in cfg.seeds)),
         f"config key 'seeds' = {cfg.seeds!r}: expected a non-empty list of non-negative integers")
    need(cfg.seeds is None or len(set(cfg.seeds)) == len(cfg.seeds), f"'seeds' lists a seed twice: {cfg.seeds}")
    for n, extra in cfg.per_method.items():
        need(n in names, f"config key 'per_method.{n}': {n!r} is not one of the run's methods {names}")
        need(isinstance(extra, dict), f"config key 'per_method.{n}' must be a mapping of settings")
        need(not {"method", "methods", "per_method", "variant"} & set(extra),
             f"config key 'per_method.{n}' cannot set method, methods, per_method or variant")
    for i, (e, n) in enumerate(zip(entries, names)):
        if n in cfg.per_method or e.settings:
            try:
                cfg.for_method(n, method_key)  # type-checks the merged settings
            except UserError as err:
                where = f"per_method.{n}" if e.variant is None else f"methods[{i}] ({n})"
                raise UserError(f"in {where}: {err}") from None
    for n, hp in cfg.hp.items():
        need(isinstance(hp, dict), f"config key 'hp.{n}' must map hyperparameter names to values")
    need(cfg.clients_per_round is None or cfg.fraction is None,
         "set either 'clients_per_round' or 'fraction', not both")
    e = cfg.eval
    need(all(s in ("val", "test") for s in e.splits) and e.splits,
         f"config key 'eval.splits' = {e.splits!r}: expected a list of 'val' and/or 'test'")
    held_out = e.holdout if isinstance(e.holdout, list) else [e.holdout]
    need(bool(held_out) and all(isinstance(d, (str, int)) and not isinstance(d, bool) for d in held_out)
         and len({str(d) for d in held_out}) == len(held_out),
         f"config key 'eval.holdout' = {e.holdout!r}: expected 'all', a domain's name, or a list of distinct "
         "domain names")
    need(e.clients == "all" or (isinstance(e.clients, int) and not isinstance(e.clients, bool)
                                and e.clients >= 1),
         f"config key 'eval.clients' = {e.clients!r}: expected 'all' or a positive integer")
    r = cfg.runtime
    need(r.num_hosts is not None or r.clients_per_host is not None,
         "set 'runtime.num_hosts' or 'runtime.clients_per_host'")
    need(r.gpus_per_host <= 1 or float(r.gpus_per_host).is_integer(),
         f"config key 'runtime.gpus_per_host' = {r.gpus_per_host}: fractions must be at most 1")
    need(not isinstance(r.cohort_size, str) or r.cohort_size == "auto",
         f"config key 'runtime.cohort_size' = {r.cohort_size!r}: expected an integer >= 0 or 'auto'")
    need(not (r.cohort_size == "auto" and r.deterministic),
         "runtime.cohort_size 'auto' sizes cohorts from free GPU memory, which varies between runs: "
         "give an integer with runtime.deterministic")
    need(r.spill_dir is None or ".." not in Path(r.spill_dir).parts,
         f"config key 'runtime.spill_dir' = {r.spill_dir!r}: '..' is not allowed in a scratch path")
    need(cfg.data.shards is None or cfg.data.shards.strip() != "",
         "config key 'data.shards' is empty; expected a path or URI (file://, s3://, gs://) or null")
    need(not cfg.paper or isinstance(cfg.paper.get("metrics", {}), dict) and all(
        isinstance(v, dict) for v in cfg.paper.get("metrics", {}).values()),
         "config key 'paper.metrics' must map a metric (AVG, ALL, ...) to {method: [mean, std]}")
    t = cfg.tracking
    need(t.mlflow_uri is None or t.mlflow_uri.strip() != "",
         "config key 'tracking.mlflow_uri' is empty; expected a tracking URI (e.g. http://127.0.0.1:5000) or null")
    need(t.mlflow_experiment is None or t.mlflow_experiment.strip() != "",
         "config key 'tracking.mlflow_experiment' is empty; expected an experiment name or null")
    need(t.client_scalars is None or isinstance(t.client_scalars, int) and not isinstance(t.client_scalars, bool)
         and t.client_scalars >= 0,
         f"config key 'tracking.client_scalars' = {t.client_scalars!r}: expected a client count >= 0 "
         "(per-client scalars for federations of at most that many clients; 0: none) or null (always)")
    need(cfg.server.betas is None or len(cfg.server.betas) == 2,
         f"config key 'server.betas' = {list(cfg.server.betas or [])}: expected two numbers in [0, 1) (β1, β2)")
    p = cfg.privacy
    if p is not None:
        need(p.clip is not None, "privacy: give 'clip', the L2 norm C every client's update is clipped to "
             "(with adaptive clipping its initial value)")
        need(p.noise_multiplier is None or p.target_epsilon is None,
             "privacy: set either 'noise_multiplier' or 'target_epsilon', not both")
        need(not (p.local and cfg.compression is not None),
             "privacy.local adds noise to every entry of the update, which undoes compression: run local DP without "
             "'compression'")
    from raysim.core.tiers import check_profiles
    check_profiles(cfg.clients.profiles)


def dump_yaml(cfg: ExperimentConfig, path: str | os.PathLike) -> None:
    write_yaml(path, cfg.to_dict())
