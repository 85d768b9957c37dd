"""The layers point one way: an AST scan of every import in raysim/, methods/ and tuning/ (those
inside functions too) against the allowed edges, no module importing another's underscore names,
and no import cycle inside raysim/.

    core -> nothing;  config -> core;  data, models -> core;  methods -> core, models;
    engine -> core, config, data, models, and methods through raysim.methods.registry only;
    app -> everything below;  tuning -> app and below;
    the entry points (raysim.cli, raysim.__main__) and raysim.testing -> everything
"""
from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOPS = {"raysim": "raysim", "methods": "raysim.methods", "tuning": "raysim.tuning"}

BELOW_APP = {"core", "config", "data", "models", "methods", "engine"}
ALLOWED = {
    "core": {"core"},
    "config": {"core", "config"},
    "data": {"core", "data"},
    "models": {"core", "models"},
    "methods": {"core", "models", "methods"},
    "engine": {"core", "config", "data", "models", "engine", "registry"},
    "app": BELOW_APP | {"registry", "app"},
    "tuning": BELOW_APP | {"registry", "app", "tuning"},
    "top": BELOW_APP | {"registry", "app", "tuning", "top"},
}
ALLOWED["registry"] = ALLOWED["methods"] | {"registry"}


def layer(module: str) -> str:
    """The layer of a dotted module name under raysim."""
    parts = module.split(".")
    if parts[:3] == ["raysim", "methods", "registry"]:
        return "registry"
    if len(parts) == 1:
        return "top"
    second = parts[1]
    if second in ("core", "data", "models", "methods", "engine", "app", "tuning"):
        return second
    if second == "config":
        return "config"
    return "top"  # the entry points raysim.cli, raysim.__main__; raysim.testing


def modules(root: str = ROOT):
    """(dotted name, path) of every module of the three packages."""
    for top, dotted in TOPS.items():
        for folder, dirs, files in os.walk(os.path.join(root, top)):
            dirs[:] = [d for d in dirs if d != "__pycache__" and not (top == "raysim" and d in ("methods", "tuning"))]
            for f in sorted(files):
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(folder, f), os.path.join(root, top))[:-3].split(os.sep)
                    name = ".".join([dotted] + [p for p in rel if p != "__init__"])
                    yield name, os.path.join(folder, f), f == "__init__.py"


def imports(path: str, name: str, is_package: bool):
    """(imported module, imported names, line) of every import statement, at any depth."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, (), node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            yield target, tuple(a.name for a in node.names), node.lineno


def project_edges(root: str = ROOT):
    """(importer, imported raysim module, names, line) for every import of a raysim module."""
    known = {name for name, _, _ in modules(root)}
    for name, path, is_package in modules(root):
        for target, names, line in imports(path, name, is_package):
            subs = [n for n in names if f"{target}.{n}" in known]  # ``from raysim.engine import checkpoint``
            for n in subs:
                yield name, f"{target}.{n}", (), line
            if target in known and (not names or len(subs) < len(names)):
                yield name, target, tuple(n for n in names if n not in subs), line


def wrong_way(root: str = ROOT) -> list[str]:
    return [f"{a} (line {line}, layer {layer(a)}) imports {b} (layer {layer(b)})"
            for a, b, _, line in project_edges(root) if layer(b) not in ALLOWED[layer(a)]]


def test_every_import_points_down():
    assert wrong_way() == []


def test_no_module_imports_another_modules_underscore_names():
    bad = [f"{a} (line {line}) imports {n} from {b}" for a, b, names, line in project_edges()
           for n in names if n.startswith("_") and not n.startswith("__")]
    assert bad == []


def test_no_import_cycles_inside_raysim():
    graph = {}
    for a, b, _, _ in project_edges():
        if a != b and not b.startswith(a + "."):  # a package importing its own submodules is no cycle
            graph.setdefault(a, set()).add(b)
    cycles, state = [], {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == []


def test_the_scan_sees_an_import_inside_a_function(tmp_path):
    """A core module that imports the engine inside a function is caught."""
    for top in TOPS:
        (tmp_path / top).mkdir()
    (tmp_path / "raysim" / "core").mkdir()
    (tmp_path / "raysim" / "engine").mkdir()
    (tmp_path / "raysim" / "core" / "lowly.py").write_text("def f():\n    from raysim.engine import loop\n")
    (tmp_path / "raysim" / "engine" / "loop.py").write_text("")
    assert wrong_way(str(tmp_path)) == ["raysim.core.lowly (line 2, layer core) imports raysim.engine.loop (layer engine)"]


@pytest.mark.parametrize("module, expected", [("raysim.core.contract", "core"), ("raysim.config", "config"),
                                              ("raysim.methods.registry", "registry"), ("raysim.methods.fedavg", "methods"),
                                              ("raysim.engine.loop", "engine"), ("raysim.app.report", "app"),
                                              ("raysim.tuning.search", "tuning"), ("raysim.__main__", "top"), ("raysim.cli", "top")])
def test_layer_names(module, expected):
    assert layer(module) == expected
