"""``raysim new method NAME`` (and ``new dataset NAME``): your own in two files, ready to run and to edit.

``NAME.py`` holds the method (FedAvg with one hyperparameter and its own client step: label
smoothing, a real, small change whose equation a test can check by hand) and ``test_NAME.py``
beside it the tests it passes as written (the loss by hand; with the hyperparameter at 0 the
client step is FedAvg's; through :mod:`raysim.testing`, no Ray). Existing files are never
overwritten.

``raysim new method NAME --from fednova`` starts from a shipped example instead (examples/ in a
checkout, raysim/examples/ in the wheel): its method file, its test file and its tune config,
written under the user's name (module, class, method name, test and tune file), so that they run
and pass as the example does.

``raysim new dataset NAME``: a dataset loader of your own, ``NAME.py`` (``load_NAME``: two domains
of generated images whose samples carry their writer's id, marked where the user's own reading
code goes) and ``test_NAME.py`` (the loader's contract: every split, the same data for the same
seed, the writer ids, an option reaching it), used as ``data.dataset: NAME:load_NAME``.
"""
from __future__ import annotations

import ast
import importlib.util
import io
import os
import re
import sys
import tokenize

from raysim.core.errors import UserError
from raysim.core.files import write_text

METHOD = '''"""__CLASS__: FedAvg whose clients train on label-smoothed targets. A starting point: make it yours.

    client: E epochs of SGD on  (1 - eps) * CE(f(x), y) + eps * mean_c -log softmax(f(x))_c
            (label smoothing, Szegedy et al., "Rethinking the Inception Architecture", CVPR 2016, Sec. 7)
    server: FedAvg's n_k-weighted mean of the uploads

Test it:  python -m pytest test___NAME__.py
Run it:   raysim run configs/quickstart.yaml method=__NAME__:__CLASS__     (from this folder)
Set eps:  ... hp.__NAME__.smoothing=0.2
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from raysim.core.contract import ClientContext, Upload
from raysim.core.hparams import Hparams, Space
from raysim.core.settings import setting
from raysim.methods.fedavg import FedAvg


@dataclass(frozen=True)
class __CLASS__Hparams(Hparams):
    # eps, the probability mass moved from the label to the uniform distribution over the classes
    smoothing: float = setting(0.1, ge=0, lt=1, source="Szegedy et al., CVPR 2016, Sec. 7 (eps = 0.1 on ImageNet)")

    @classmethod
    def search_space(cls):
        """What `raysim tune` explores."""
        return {"smoothing": Space.uniform(0.0, 0.3)}


class __CLASS__(FedAvg):
    name = "__NAME__"  # config keys hp.__NAME__.* and per_method.__NAME__.*, the run folder __NAME__/
    Hparams = __CLASS__Hparams
    paper = ""  # "Author et al., Venue Year": `raysim methods` shows it
    shares = "shares the whole model; keeps nothing"

    def local_update(self, ctx: ClientContext) -> Upload:
        """The client step: FedAvg's loop on the smoothed loss. ctx.model holds the global model;
        ctx.batches() is train.epochs shuffled passes over this client's data, ctx.step() one SGD
        step (with train.grad_clip), ctx.stats() the round's mean loss and step count."""
        opt = ctx.optimizer()  # SGD at this round's lr, with train.momentum and train.weight_decay
        for x, y in ctx.batches():
            ctx.step(smoothed_cross_entropy(ctx.model(x), y, self.hp.smoothing), opt)
        return self.upload(ctx, ctx.stats())  # the trained model, weighted by the client's n_k

    # The server step stays FedAvg's. To change it, override
    #     def aggregate(self, state: dict, uploads, round: int) -> dict:
    # (uploads.mean: the n_k-weighted mean of the round's uploads; state["global"]: what is
    # broadcast next). raysim's methods/README.md lists every hook.


def smoothed_cross_entropy(logits: torch.Tensor, y: torch.Tensor, eps: float) -> torch.Tensor:
    """(1 - eps) * -log p_y + eps * mean_c -log p_c, p = softmax(logits), averaged over the batch:
    the cross-entropy against the label smoothed toward the uniform distribution (eps = 0: the
    plain cross-entropy)."""
    logp = F.log_softmax(logits, dim=1)
    nll = -logp.gather(1, y[:, None]).squeeze(1)
    uniform = -logp.mean(dim=1)
    return ((1 - eps) * nll + eps * uniform).mean()
'''

TEST = '''"""Tests of __NAME__.py: its loss by hand, and its client step through raysim.testing (no Ray)."""
import math

import torch

from raysim import testing
from raysim.methods.fedavg import FedAvg

from __NAME__ import __CLASS__, smoothed_cross_entropy


def test_the_loss_by_hand():
    # logits (ln 3, 0): softmax (3/4, 1/4), so -log p = (ln 4/3, ln 4); label 0, eps = 0.2:
    # 0.8 * ln(4/3) + 0.2 * (ln(4/3) + ln 4) / 2
    logits = torch.tensor([[math.log(3.0), 0.0]])
    expected = 0.8 * math.log(4 / 3) + 0.1 * (math.log(4 / 3) + math.log(4))
    assert math.isclose(smoothed_cross_entropy(logits, torch.tensor([0]), 0.2).item(), expected, rel_tol=1e-6)


def one_client_step(method, start: dict):
    """``method``'s client step from the model ``start`` on 8 random images (one batch, one epoch)."""
    model = method.build_model()
    model.load_state_dict(start)
    ctx = testing.client_context(method, model, testing.random_client_data(num_train=8, seed=0))
    upload = method.local_update(ctx)
    assert ctx.steps == 1 and upload.weight == 8
    return upload.tensors


def test_without_smoothing_the_client_step_is_fedavgs():
    setup = testing.setup(num_clients=2)  # small_cnn with BN, 3 classes of 1x8x8 images
    fedavg = FedAvg(FedAvg.Hparams(), setup)
    start = fedavg.build_model().state_dict()
    plain = one_client_step(fedavg, start)
    same = one_client_step(__CLASS__(__CLASS__.Hparams(smoothing=0.0), setup), start)
    smoothed = one_client_step(__CLASS__(__CLASS__.Hparams(smoothing=0.5), setup), start)
    for key in plain:
        torch.testing.assert_close(same[key], plain[key])
    assert any(not torch.equal(smoothed[k], plain[k]) for k in plain)  # the hyperparameter reaches the step
'''

_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")


def class_name(name: str) -> str:
    """``my_method`` -> ``MyMethod``."""
    return "".join(part[:1].upper() + part[1:] for part in name.split("_"))


def check_name(name: str) -> None:
    """NAME is the module's name and the method's: an identifier that hides nothing."""
    from raysim.methods import registry

    check_module_name(name, "method", registry.names())


def check_module_name(name: str, what: str, builtins) -> None:
    """NAME names the module NAME.py a scaffold writes: an identifier, no built-in ``what``'s name
    (``builtins``), and no importable module's (NAME.py would hide it)."""
    import keyword

    if not _NAME.fullmatch(name) or keyword.iskeyword(name):
        raise UserError(f"{what} name {name!r}: expected a Python identifier of letters, digits and '_', "
                        "starting with a letter (it names the module NAME.py)")
    if name in builtins:
        raise UserError(f"{what} name {name!r} is a built-in {what}'s; choose another")
    if name in sys.stdlib_module_names or importlib.util.find_spec(name) is not None:
        raise UserError(f"{what} name {name!r} is an importable module's; choose another (NAME.py would hide it)")


def new_method(name: str, folder: str = ".", example: str | None = None) -> list[str]:
    """Write ``NAME.py`` and ``test_NAME.py`` into ``folder`` (created if missing), from the
    template or, with ``example``, from that shipped example (with its ``NAME_tune.yaml``); the
    paths written. Refuses (UserError) where any of the files exists, and then writes none."""
    check_name(name)
    if example is None:
        cls = class_name(name)
        texts = {f"{name}.py": METHOD, f"test_{name}.py": TEST}
        texts = {f: t.replace("__NAME__", name).replace("__CLASS__", cls) for f, t in texts.items()}
    else:
        texts = from_example(example, name)
    return write_new_files(folder, texts)


def write_new_files(folder: str, texts: dict[str, str]) -> list[str]:
    """Write each {file name: text} into ``folder`` (created if missing), none if any exists."""
    files = {os.path.join(folder, f): text for f, text in texts.items()}
    for path in files:
        if os.path.exists(path):
            raise UserError(f"{path} exists; raysim new never overwrites a file (remove it or choose another NAME)")
    os.makedirs(folder, exist_ok=True)
    for path, text in files.items():
        write_text(path, text, exclusive=True)
    return list(files)


def next_steps(name: str, folder: str, tune: bool = False) -> str:
    """What ``raysim new method`` prints after writing the files."""
    cls = class_name(name)
    cd = "" if os.path.abspath(folder) == os.getcwd() else f"cd {folder} && "
    return (f"test it:  {cd}python -m pytest test_{name}.py\n"
            f"run it:   {cd}raysim run configs/quickstart.yaml method={name}:{cls}\n"
            + (f"tune it:  {cd}raysim tune {name}_tune.yaml\n" if tune else ""))


# ----------------------------------------------------------------------------- from an example

def examples() -> list[str]:
    """The shipped examples: each ``E.py`` with its ``test_E.py`` beside it."""
    from raysim.app.shipped import shipped_examples

    folder = shipped_examples()
    return sorted(f[:-3] for f in os.listdir(folder) if f.endswith(".py") and not f.startswith("test_")
                  and os.path.isfile(folder / f"test_{f}")) if folder.is_dir() else []


def from_example(example: str, name: str) -> dict[str, str]:
    """The shipped example ``example``'s files as ``name``'s: file name -> text. Its method class
    (the one whose ``name`` is ``example``) and every identifier built on it (``FedNovaHparams``)
    become ``class_name(name)``'s; ``example:Class`` becomes ``name:Class``; and ``example``
    becomes ``name`` wherever it appears (module, method name, config keys, file names). Prose
    that names the algorithm (``FedNova averages ...``) keeps its name."""
    from raysim.app.shipped import shipped_examples

    known = examples()
    if example not in known:
        raise UserError(f"--from {example}: no such example; raysim ships {', '.join(known) or 'none'}")
    folder = shipped_examples()
    method = (folder / f"{example}.py").read_text(encoding="utf-8")
    old, cls = method_class(method, example), class_name(name)
    py = [f"{example}.py", f"test_{example}.py"]
    names = [*py, f"{example}_tune.yaml"]
    texts = {f: (folder / f).read_text(encoding="utf-8") for f in names if (folder / f).is_file()}
    out = {}
    for fname, text in texts.items():
        if fname in py:
            taken = {t.string for t in _tokens(text) if t.type == tokenize.NAME and not t.string.startswith(old)}
            if cls in taken:
                raise UserError(f"method name {name!r}: its class name {cls} is a name {fname} already uses; "
                                "choose another")
            text = rename_identifiers(text, old, cls)
        text = text.replace(f"{example}:{old}", f"{name}:{cls}").replace(example, name)
        out[fname.replace(example, name)] = text
    out[f"{name}.py"] = (f"# {name}.py: raysim's {old} example (raysim new method {name} --from {example}), "
                         "now yours to change.\n" + out[f"{name}.py"])
    return out


def method_class(source: str, example: str) -> str:
    """The name of the class in ``source`` that declares ``name = "<example>"``."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef):
            for stmt in node.body:
                names = [t.id for t in getattr(stmt, "targets", ()) if isinstance(t, ast.Name)]
                if "name" in names and isinstance(stmt.value, ast.Constant) and stmt.value.value == example:
                    return node.name
    raise UserError(f"example {example!r}: no class in {example}.py declares name = {example!r}")


def _tokens(source: str):
    return list(tokenize.generate_tokens(io.StringIO(source).readline))


def rename_identifiers(source: str, old: str, new: str) -> str:
    """``source`` with every identifier that starts with ``old`` (``FedNova``, ``FedNovaHparams``)
    starting with ``new`` instead; strings and comments untouched."""
    lines = source.splitlines(keepends=True)
    hits = [t.start for t in _tokens(source) if t.type == tokenize.NAME and t.string.startswith(old)]
    for row, col in reversed(hits):  # right to left: earlier columns stay valid
        line = lines[row - 1]
        lines[row - 1] = line[:col] + new + line[col + len(old):]
    return "".join(lines)


# ----------------------------------------------------------------------------- a dataset

DATASET = '''"""__NAME__: a dataset of your own for raysim. A starting point: put your reading code where marked.

raysim calls  load___NAME__(root=data.root, seed=<the run's seed>, **data.options)  on the driver and
on every Ray host, and wants a raysim.data.MultiDomainDataset back: named domains (the sites,
devices or styles the data comes from), each with train/val/test splits. As generated here, two
domains of 3-class images from 8 "writers" each; every sample carries its writer's id (groups),
so a partition can give each writer a client of their own.

Look at it:  raysim data show __NAME__:load___NAME__
Test it:     python -m pytest test___NAME__.py
Run it:      raysim run configs/quickstart.yaml data.dataset=__NAME__:load___NAME__     (from this folder)
A client per writer:  ... "data.partition={kind: natural, by: group}"
The contract: raysim/data/README.md in raysim's repository
"""
from __future__ import annotations

import numpy as np

from raysim.data import ArraySplit, MultiDomainDataset
from raysim.data.splits import group_carve

CLASSES = ("horizontal", "vertical", "diagonal")  # label k is CLASSES[k]
DOMAINS = ("paper", "screen")
MEAN, STD = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)  # a channel's value x in [0, 1] is trained on as (x - mean) / std


def load___NAME__(root=None, seed: int = 0, image_size: int = 24, writers: int = 8, per_writer: int = 80,
                  val_fraction: float = 0.1, test_fraction: float = 0.2) -> MultiDomainDataset:
    """The dataset. ``root``: data.root, the folder your data is in (the generated stand-in needs
    none). ``seed``: the run's seed; draw every random choice from it, so the same seed gives the
    same data on every host and in every rerun. The other parameters are the options a config
    sets under data.options; each needs a default."""
    rng = np.random.default_rng(seed)
    splits = {}
    for d, domain in enumerate(DOMAINS):
        # ---- your reading code goes here: for this domain, from files under root, build
        #   images: uint8 (N, C, H, W)   labels: ints 0..len(CLASSES)-1 (N,)
        #   groups: ints (N,), who produced each sample (a writer, a user, a patient); or None
        images, labels, groups = stand_in(d, writers, per_writer, image_size, rng)
        # ---- (images larger than memory: raysim.data.FileSplit(paths, labels, image_size, MEAN, STD)
        # decodes them on demand; reading that takes long: cache its arrays, e.g. as .npz under
        # raysim.data.cache.cache_dir(), keyed by root, seed and the options)
        train, val, test = group_carve(groups, val_fraction, test_fraction, rng)  # within each writer
        splits[domain] = {name: ArraySplit(images[pos], labels[pos], MEAN, STD, groups=groups[pos])
                          for name, pos in (("train", train), ("val", val), ("test", test))}
    return MultiDomainDataset("__NAME__", splits, CLASSES, info={"source": "generated stand-in", "root": root})


def stand_in(domain: int, writers: int, per_writer: int, image_size: int, rng: np.random.Generator):
    """Generated images: the class is a stroke's direction, a writer's own the stroke's width and
    place, the domain the colours (dark ink on light paper, light ink on a dark screen)."""
    n = writers * per_writer
    groups = np.repeat(np.arange(writers) + domain * writers, per_writer)  # writer ids, unique across domains
    labels = rng.integers(0, len(CLASSES), n)
    rows, cols = np.mgrid[0:image_size, 0:image_size]
    width = 0.6 + (groups % 3)[:, None, None] * 0.5
    shift = ((groups * 5) % max(image_size // 3, 1) - image_size // 6)[:, None, None]
    centre = image_size // 2 + shift
    kind = labels[:, None, None]
    distance = np.where(kind == 0, np.abs(rows - centre),
                        np.where(kind == 1, np.abs(cols - centre), np.abs(cols - rows - shift) / np.sqrt(2)))
    ink = (distance <= width).astype(np.float32)
    paper, stroke = (0.9, 0.1) if domain == 0 else (0.1, 0.9)
    gray = paper + (stroke - paper) * ink + rng.normal(0.0, 0.1, ink.shape)
    images = np.clip(np.repeat(gray[:, None], 3, axis=1) * 255, 0, 255).astype(np.uint8)
    return images, labels, groups
'''

DATASET_TEST = '''"""Tests of __NAME__.py: its loader keeps raysim's contract (raysim/data/README.md)."""
import numpy as np
import torch

from raysim.data import SPLITS, MultiDomainDataset, load

from __NAME__ import load___NAME__

SPEC = "__NAME__:load___NAME__"  # as a config names it: data.dataset


def test_it_loads_as_raysim_loads_it_with_every_split():
    ds = load(SPEC, seed=0)  # raysim's own call: the options checked, what comes back checked
    assert isinstance(ds, MultiDomainDataset) and ds.num_classes >= 2 and len(ds.domains) >= 1
    for domain in ds.domains:
        for split in SPLITS:
            part = ds.split(domain, split)
            assert len(part) > 0, (domain, split)
            assert 0 <= part.labels.min() and part.labels.max() < ds.num_classes
            assert tuple(part.image_shape) == ds.image_shape  # one image shape throughout
    x, y = ds.split(ds.domains[0], "train").tensors(np.arange(4))
    assert x.shape == (4, *ds.image_shape) and x.dtype == torch.float32 and y.dtype == torch.int64


def test_the_same_seed_gives_the_same_data():
    a, b, other = load___NAME__(seed=0), load___NAME__(seed=0), load___NAME__(seed=1)
    for domain in a.domains:
        for split in SPLITS:
            first, again = a.split(domain, split), b.split(domain, split)
            assert np.array_equal(first.labels, again.labels)
            assert np.array_equal(first.images(np.arange(len(first))), again.images(np.arange(len(again))))
    assert not np.array_equal(a.split(a.domains[0], "train").labels, other.split(a.domains[0], "train").labels)


def test_every_sample_names_its_writer_and_each_writer_trains():
    # (data without groups: delete this test)
    ds = load___NAME__(seed=0)
    seen = {}
    for domain in ds.domains:
        train, val, test = (ds.split(domain, s) for s in SPLITS)
        for part in (train, val, test):
            assert part.groups is not None and len(part.groups) == len(part)
        # a writer's held-out samples come with training samples of theirs
        assert set(val.groups) | set(test.groups) <= set(train.groups)
        seen[domain] = set(train.groups)
    assert not set.intersection(*seen.values())  # a writer belongs to one domain


def test_an_option_reaches_the_loader():
    assert load(SPEC, seed=0, image_size=12).image_shape == (3, 12, 12)
'''


def dataset_loader_name(name: str) -> str:
    return f"load_{name}"


def check_dataset_name(name: str) -> None:
    """NAME is the module's name: an identifier that hides no importable module nor a dataset."""
    from raysim import data

    check_module_name(name, "dataset", data.available())


def new_dataset(name: str, folder: str = ".") -> list[str]:
    """Write ``NAME.py`` (the loader ``load_NAME``) and ``test_NAME.py`` into ``folder`` (created if
    missing); the paths written. Refuses (UserError) where either file exists, and then writes none."""
    check_dataset_name(name)
    texts = {f"{name}.py": DATASET, f"test_{name}.py": DATASET_TEST}
    return write_new_files(folder, {f: text.replace("__NAME__", name) for f, text in texts.items()})


def dataset_next_steps(name: str, folder: str) -> str:
    """What ``raysim new dataset`` prints after writing the files."""
    spec = f"{name}:{dataset_loader_name(name)}"
    cd = "" if os.path.abspath(folder) == os.getcwd() else f"cd {folder} && "
    return (f"test it:  {cd}python -m pytest test_{name}.py\n"
            f"look:     {cd}raysim data show {spec}\n"
            f"run it:   {cd}raysim run configs/quickstart.yaml data.dataset={spec}\n"
            f"          (a client per writer: add \"data.partition={{kind: natural, by: group}}\")\n"
            f"or in a config:  data: {{dataset: \"{spec}\", options: {{image_size: 24}}}}\n"
            "then put your own reading code where NAME.py marks it (raysim/data/README.md: the contract)\n"
            .replace("NAME.py", f"{name}.py"))
