"""The client seam is closed: a method reaches the client's data only through the contract
(``raysim.core.contract.ClientData``), never the engine's objects behind it, and no method writes
the engine's loops again (its own passes over the data, ``sgd_step``, a ``torch.optim`` optimizer)."""
import ast
import importlib
import os

import numpy as np
import pytest
import torch

from raysim.config import load_config
from raysim.core.contract import ClientData, DataSplit, Normalisation, UnseenClient

ATOMS = (str, bytes, int, float, bool, complex, type(None), np.ndarray, torch.Tensor, np.generic)


def reachable(root) -> list:
    """Every object reached from ``root`` through attributes without a leading underscore (a
    method's way in), items of tuples and lists, and the objects bound methods belong to."""
    seen, todo, out = set(), [root], []
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        out.append(obj)
        if isinstance(obj, ATOMS):
            continue
        if isinstance(obj, (tuple, list)):
            todo.extend(obj)
            continue
        owner = getattr(obj, "__self__", None)  # a bound method leads to its object
        if owner is not None and not isinstance(owner, type(os)):
            todo.append(owner)
        for name in dir(obj):
            if name.startswith("_"):
                continue
            try:
                todo.append(getattr(obj, name))
            except Exception:  # noqa: BLE001 - a property that needs more than an attribute read
                continue
    return out


def engine_objects(root) -> list[str]:
    return sorted({f"{type(o).__module__}.{type(o).__qualname__}" for o in reachable(root)
                   if type(o).__module__.startswith(("raysim.engine", "raysim.data"))})


def tiny_domains():
    """Four 3-class domains of random 1 x 8 x 8 images (12 train / 4 val / 10 test each)."""
    from raysim.data.splits import ArraySplit, MultiDomainDataset
    rng = np.random.default_rng(0)
    return MultiDomainDataset("tiny", {d: {s: ArraySplit(rng.integers(0, 255, (n, 1, 8, 8), dtype=np.uint8),
                                                         rng.integers(0, 3, n), (0.5,), (0.25,))
                                           for s, n in (("train", 12), ("val", 4), ("test", 10))}
                                       for d in "abcd"}, ["0", "1", "2"])


def test_a_method_reaches_the_contract_and_no_engine_object(monkeypatch):
    """A real host (no Ray): what ``local_update`` gets as ``ctx.data`` and ``adapt_to_unseen`` as
    ``client.data`` answers the contract with the host's values and leads to no engine object,
    while the host's own record of the same client does (the walk would see a leak)."""
    import raysim.data
    from raysim.engine.host import ClientHost
    monkeypatch.setattr(raysim.data, "load", lambda *a, **k: tiny_domains())
    cfg = load_config(raw={
        "method": "fedavg", "rounds": 1, "seed": 1,
        "data": {"dataset": "rotated_mnist", "partition": {"kind": "per_domain", "holdout": "d"}},
        "model": {"name": "small_cnn", "norm": "bn"}, "train": {"epochs": 1, "batch_size": 4},
        "eval": {"protocol": "lodo"}, "runtime": {"num_hosts": 1}})
    host = ClientHost(0, cfg, num_hosts=1, gpu_ids=[])
    host.start()
    m, seen = host.method, {}
    train = m.local_update
    m.local_update = lambda ctx: (seen.setdefault("ctx", ctx), train(ctx))[1]
    m.adapt_to_unseen = lambda model, client: (seen.setdefault("unseen", client), False)[1]
    srv = m.init_server(host.model)
    host.train_round(1, [m.broadcast(srv, 1)], [0])
    host.evaluate(1, [m.eval_payload(srv, 1)], {3: ["test"]}, "lodo")

    data, views = seen["ctx"].data, host.data[0]
    assert isinstance(data, ClientData) and isinstance(seen["unseen"], UnseenClient)
    assert all(isinstance(getattr(data, s), DataSplit) for s in ("train", "val", "test"))
    assert data.num_train == len(data.train) == data.train.size == 12 and len(data.val) == 4
    assert np.array_equal(data.train.labels, views.train.labels)
    assert data.train.classes == tuple(np.unique(views.train.labels).tolist())
    assert data.train.normalisation == Normalisation((0.5,), (0.25,))
    mean, std = data.train.normalisation.tensors()
    assert mean.shape == (1, 1, 1, 1) and float(std) == 0.25
    unseen = seen["unseen"]  # evaluated on its whole domain: 12 + 4 + 10 images, 6 batches of 4 and one of 2
    assert len(unseen.data.test) == 26 and len(list(unseen.unlabeled_batches(4))) == 7

    assert engine_objects(data) == [] and engine_objects(seen["unseen"].data) == []
    assert "raysim.engine.clientdata.SplitView" in engine_objects(views)  # the walk finds a view where there is one
    with pytest.raises(AttributeError):
        data.train.split  # noqa: B018 - the old way in


# ----------------------------------------------------------------------------- the methods' source

def engine_loop_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) for every place a method re-implements the engine's loop: a pass over
    ``<...>.data.batches`` or ``<...>.data.<split>.batches`` (``ctx.batches()`` draws a client's
    batches), ``sgd_step`` (``ctx.step``), a ``torch.optim`` optimizer built or imported
    (``ctx.optimizer``, ``UnseenClient.optimizer``)."""
    def dotted(node) -> str:
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name):
            parts.append(node.id)
        return ".".join(reversed(parts))
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            path = dotted(node).split(".")
            if path[-1] == "batches" and ("data" in path[-2:-1] or path[-3:-2] == ["data"]):
                hits.append((node.lineno, ".data.batches"))
            if node.attr == "sgd_step":
                hits.append((node.lineno, "sgd_step"))
        elif isinstance(node, ast.Name) and node.id == "sgd_step":
            hits.append((node.lineno, "sgd_step"))
        elif isinstance(node, ast.Call) and dotted(node.func).startswith("torch.optim."):
            hits.append((node.lineno, "torch.optim."))
        elif isinstance(node, ast.ImportFrom):
            if any(a.name == "sgd_step" for a in node.names):
                hits.append((node.lineno, "sgd_step"))
            if node.module == "torch.optim" or (node.module == "torch" and any(a.name == "optim" for a in node.names)):
                hits.append((node.lineno, "torch.optim."))
        elif isinstance(node, ast.Import) and any(a.name == "torch.optim" for a in node.names):
            hits.append((node.lineno, "torch.optim."))
    return sorted(hits)


def test_the_scan_sees_each_pattern():
    src = """
from raysim.core.contract import sgd_step
from torch.optim import SGD
def local_update(self, ctx):
    for x, y in ctx.data.batches(4, ctx.generator, ctx.device): pass
    for x in client.data.test.batches(4, g, d): pass
    opt = torch.optim.SGD(ctx.model.parameters(), lr=0.1)
    contract.sgd_step(loss, opt)
    anno: torch.optim.Optimizer = ctx.optimizer()       # an annotation is no optimizer
    for x, y in ctx.batches(): ctx.step(loss, opt)     # the contract's own
"""
    assert [what for _, what in engine_loop_uses(ast.parse(src))] == [
        "sgd_step", "torch.optim.", ".data.batches", ".data.batches", "torch.optim.", "sgd_step"]


def test_no_method_writes_the_engines_loops_again():
    root = importlib.import_module("raysim.methods").__path__[0]
    found = []
    for folder, _, files in os.walk(root):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as f:
                    tree = ast.parse(f.read(), path)
                found += [f"{os.path.relpath(path, root)}:{line}: {what}" for line, what in engine_loop_uses(tree)]
    assert not found, "methods write the engine's loops again (use ctx.batches, ctx.step, ctx.optimizer):\n" + \
        "\n".join(found)
