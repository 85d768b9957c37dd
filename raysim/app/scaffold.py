"""``raysim new method NAME``: a method of your own in two files, ready to run and to edit.

``NAME.py`` holds the method (FedAvg with one hyperparameter and its own client step: label
smoothing, a real, small change whose equation a test can check by hand) and ``test_NAME.py``
beside it the tests it passes as written (the loss by hand; with the hyperparameter at 0 the
client step is FedAvg's; through :mod:`raysim.testing`, no Ray). Existing files are never
overwritten.

``raysim new method NAME --from fednova`` starts from a shipped example instead (examples/ in a
checkout, raysim/examples/ in the wheel): its method file, its test file and its tune config,
written under the user's name (module, class, method name, test and tune file), so that they run
and pass as the example does.
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
    import keyword

    if not _NAME.fullmatch(name) or keyword.iskeyword(name):
        raise UserError(f"method name {name!r}: expected a Python identifier of letters, digits and '_', "
                        "starting with a letter (it names the module NAME.py)")
    from raysim.methods import registry
    if name in registry.names():
        raise UserError(f"method name {name!r} is a built-in method's; choose another")
    if name in sys.stdlib_module_names or importlib.util.find_spec(name) is not None:
        raise UserError(f"method name {name!r} is an importable module's; choose another (NAME.py would hide it)")


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
