"""No load in the repository (tests included) can run code: no ``allow_pickle=True``, every
``torch.load`` with ``weights_only=True``, no ``pickle``/``cloudpickle`` load of a file, and the
pickled dataset files (FedBN's releases) read by an unpickler that builds numpy arrays only.

The one exception, documented in README.md's security note: resuming a search is Ray Tune's own
``Tuner.restore`` (tuning/search.py), which unpickles Tune's state in the search directory;
``raysim tune`` refuses a directory another user could have written before it restores."""
from __future__ import annotations

import ast
import os
import pickle
import re
from pathlib import Path

import numpy as np
import pytest

from raysim.data.pickled import load_arrays

REPO = Path(__file__).resolve().parents[1]
MAX_BYTES = 2_000_000  # source and docs; a data file or a run's output is skipped


_BUILD_OUTPUTS = {"__pycache__", "build", "dist", "runs"}  # ignored by .gitignore: never committed


def _files():
    """Every file of the repository (tests and docs included), without hidden folders (.git, the
    .venv `make` creates), caches, build outputs (a wheel built in the checkout leaves copies of
    the sources in build/), or the symlinks raysim/methods and raysim/tuning (os.walk does not
    follow them: their targets are scanned under their own names)."""
    for folder, dirs, names in os.walk(REPO):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in _BUILD_OUTPUTS and not d.endswith(".egg-info")]
        for name in names:
            path = Path(folder) / name
            if not path.is_symlink() and path.stat().st_size <= MAX_BYTES:
                yield path


def _is_true(node) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


_TORCH = ("torch", "torch.serialization")
_PICKLE = ("pickle", "cloudpickle", "ray.cloudpickle", "dill", "joblib")

# Each load that can run code and is allowed, by file and call: every one must still be there.
ALLOWED = {
    # README.md's security note: Tune's restore unpickles its own state; check_owned guards it
    ("tuning/search.py", "tune.Tuner.restore("),
    # this file's demonstration that a plain unpickle runs the payload the loaders refuse
    ("tests/test_safe_loads.py", "pickle.loads(data)"),
}


def _round_trip(node) -> bool:
    """``pickle.loads(pickle.dumps(x))``: an object of the program's own, not a file's bytes."""
    return (len(node.args) == 1 and isinstance(node.args[0], ast.Call) and isinstance(node.args[0].func, ast.Attribute)
            and node.args[0].func.attr == "dumps")


def unsafe_calls(source: str, where: str) -> list[str]:
    """``np.load``-style calls with ``allow_pickle`` not literally False, ``torch.load`` (or
    ``torch.serialization.load``) calls without ``weights_only=True``, ``pickle``-style ``load``
    and ``loads`` (``pickle``, ``cloudpickle``, ``dill``, ``joblib``; a round trip of an object in
    memory is fine), ``read_pickle``, Tune's ``Tuner.restore`` (it unpickles), and ``load`` or
    ``loads`` imported from those modules by name (their calls would not say whose load they are)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.ImportFrom) and node.module in _TORCH + _PICKLE
                and any(a.name in ("load", "loads") for a in node.names)):
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)[:80]}")
        if not isinstance(node, ast.Call):
            continue
        kw = {k.arg: k.value for k in node.keywords}
        if "allow_pickle" in kw and not (isinstance(kw["allow_pickle"], ast.Constant)
                                         and kw["allow_pickle"].value is False):
            found.append(f"{where}:{node.lineno}: allow_pickle={ast.unparse(kw['allow_pickle'])}")
        f = node.func
        if (isinstance(f, ast.Attribute) and f.attr == "load" and ast.unparse(f.value) in _TORCH
                and not _is_true(kw.get("weights_only"))):
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)[:80]}")
        if isinstance(f, ast.Attribute) and (
                (f.attr in ("load", "loads") and ast.unparse(f.value) in _PICKLE and not _round_trip(node))
                or f.attr == "read_pickle" or (f.attr == "restore" and ast.unparse(f.value).endswith("Tuner"))):
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)[:80]}")
    return found


_TEXT_ALLOW = re.compile(r"allow_pickle\s*=\s*True")
_TEXT_TORCH = re.compile(r"torch\.load\((?![^)]*weights_only\s*=\s*True)")
_CANDIDATE = re.compile(r"allow_pickle|torch\s*\.\s*load|from\s+torch\s+import[^\n]*\bload\b|pickle|dill|joblib|Tuner")


def test_no_load_in_the_repository_can_run_code():
    found, scanned = [], 0
    for path in _files():
        rel = path.relative_to(REPO)
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        scanned += 1
        if path.suffix == ".py":
            if _CANDIDATE.search(text):  # parsing only these keeps the scan fast
                found += unsafe_calls(text, str(rel))
        else:  # shell, YAML, Dockerfile, docs: a plain search
            for no, line in enumerate(text.splitlines(), 1):
                if _TEXT_ALLOW.search(line) or _TEXT_TORCH.search(line):
                    found.append(f"{rel}:{no}: {line.strip()[:80]}")
    assert scanned > 100
    allowed = [f for f in found if any(f.startswith(f"{path}:") and f.split(": ", 1)[1].startswith(call)
                                       for path, call in ALLOWED)]
    assert not set(found) - set(allowed), "loads that can run code:\n" + "\n".join(sorted(set(found) - set(allowed)))
    assert {(f.split(":", 1)[0], call) for f in allowed for path, call in ALLOWED
            if f.startswith(f"{path}:") and f.split(": ", 1)[1].startswith(call)} == ALLOWED, allowed


@pytest.mark.parametrize("line", [
    "x = np.load(p, allow_pickle=True)",
    "x = numpy.load(p, mmap_mode='r', allow_pickle=flag)",
    "s = torch.load(p)",
    "s = torch.load(p, map_location='cpu', weights_only=False)",
    "s = torch.load(\n    p,\n    map_location='cpu',\n)",
    "s = torch.serialization.load(p)",
    "from torch import load",
    "x = pickle.load(fh)", "x = cloudpickle.load(fh)", "x = ray.cloudpickle.loads(f.readall())",
    "from cloudpickle import loads", "df = pd.read_pickle(p)", "t = tune.Tuner.restore(p, trainable=f)",
])
def test_the_scan_catches_unsafe_loads(line):
    assert unsafe_calls(line, "x.py")


@pytest.mark.parametrize("line", [
    "x = np.load(p)", "x = np.load(p, allow_pickle=False)",
    "s = torch.load(p, weights_only=True)", "s = torch.load(\n    p,\n    weights_only=True,\n)",
    "y = pickle.loads(pickle.dumps(x))",
])
def test_the_scan_passes_safe_loads(line):
    assert not unsafe_calls(line, "x.py")


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_pickled_arrays_load_as_fedbn_writes_them(tmp_path, protocol):
    images = np.arange(2 * 4 * 4 * 3, dtype=np.uint8).reshape(2, 4, 4, 3)
    labels = np.array([3, 7])
    paths = np.array(["amazon/mug/1.jpg", "amazon/bike/2.jpg"])
    names = np.array(["mug", "bike"], dtype=object)
    path = tmp_path / "train.pkl"
    path.write_bytes(pickle.dumps((images, labels, paths, names, np.int64(5)), protocol=protocol))
    x, y, p, n, k = load_arrays(path)
    assert np.array_equal(x, images) and x.dtype == np.uint8 and np.array_equal(y, labels)
    assert list(p) == list(paths) and list(n) == ["mug", "bike"] and k == 5


def test_npy_files_load_with_or_without_objects(tmp_path):
    np.save(tmp_path / "plain.npy", np.arange(6).reshape(2, 3))
    assert np.array_equal(load_arrays(tmp_path / "plain.npy"), np.arange(6).reshape(2, 3))
    pair = np.empty(2, dtype=object)
    pair[0], pair[1] = np.ones((2, 2), np.uint8), np.array([1, 2])
    np.save(tmp_path / "pair.npy", pair)  # how np.save stores an (images, labels) pair (it pickles by default)
    x, y = load_arrays(tmp_path / "pair.npy")
    assert np.array_equal(x, np.ones((2, 2), np.uint8)) and np.array_equal(y, [1, 2])


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


@pytest.mark.parametrize("container", ["top", "inside_an_object_array"])
def test_a_pickle_that_would_run_code_is_refused_before_it_runs(tmp_path, container):
    marker = str(tmp_path / "ran")
    payload = _RunsCode(marker)
    if container == "top":
        data = pickle.dumps((np.zeros(2), payload))
    else:
        arr = np.empty(1, dtype=object)
        arr[0] = payload
        data = pickle.dumps((arr, np.zeros(2)))
    path = tmp_path / "evil.pkl"
    path.write_bytes(data)
    with pytest.raises(pickle.UnpicklingError, match=r"names posix\.mkdir; only numpy arrays"):
        load_arrays(path)
    assert not os.path.exists(marker)
    pickle.loads(data)  # what the loaders' np.load with pickles allowed did before: it runs the payload
    assert os.path.exists(marker)


def test_the_dataset_loaders_refuse_a_pickle_that_would_run_code(tmp_path):
    from raysim.data.digits5_real import _load_pkl
    from raysim.core.errors import UserError

    marker = str(tmp_path / "ran")
    (tmp_path / "train.pkl").write_bytes(pickle.dumps((np.zeros((2, 28, 28), np.uint8), _RunsCode(marker))))
    with pytest.raises(UserError, match="is not a pickled .* only numpy arrays are read"):
        _load_pkl(tmp_path / "train.pkl")
    assert not os.path.exists(marker)
