"""raysim.core.files: the one atomic-write helper, by hand, and a scan that every write under
raysim/ and tuning/ goes through it (no rename, no open-for-write anywhere else)."""
from __future__ import annotations

import ast
import errno
import os
import re

import pytest

from raysim.core.files import WriteFailed, write_atomically, write_bytes, write_json, write_text

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def leftovers(folder) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.endswith(".tmp"))


# ----------------------------------------------------------------------------- the helper by hand

def test_the_content_lands_and_no_temporary_stays(tmp_path):
    path = tmp_path / "a.json"
    write_json(path, {"x": 1}, indent=1)
    write_text(tmp_path / "b.txt", "héllo\n")
    write_bytes(tmp_path / "c.bin", b"\0\1")
    assert path.read_text() == '{\n "x": 1\n}'
    assert (tmp_path / "b.txt").read_text(encoding="utf-8") == "héllo\n"
    assert (tmp_path / "c.bin").read_bytes() == b"\0\1"
    assert leftovers(tmp_path) == []


def test_a_write_that_raises_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "status.json"
    path.write_text("old")

    def half_then_fail(tmp):
        with open(tmp, "w") as fh:
            fh.write("new, half")
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError, match="killed mid-write"):  # not an OSError: as it was
        write_atomically(path, half_then_fail)
    assert path.read_text() == "old"
    assert leftovers(tmp_path) == []


def test_an_os_error_is_one_line_naming_the_file(tmp_path):
    path = tmp_path / "metrics.parquet"
    path.write_text("old")

    def disk_full(tmp):
        with open(tmp, "w") as fh:
            fh.write("partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), tmp)

    with pytest.raises(WriteFailed) as failed:
        write_atomically(path, disk_full)
    assert str(failed.value) == f"cannot write {path}: [Errno 28] No space left on device"
    assert path.read_text() == "old" and leftovers(tmp_path) == []
    with pytest.raises(WriteFailed, match=r"^cannot write round 4: \[Errno 28\]"):
        write_atomically(path, disk_full, what="round 4")
    with pytest.raises(OSError) as kept:  # keep_error: the caller names the failure itself
        write_atomically(path, disk_full, keep_error=True)
    assert kept.value.errno == errno.ENOSPC and leftovers(tmp_path) == []


def test_exclusive_refuses_an_existing_file_and_sets_the_mode(tmp_path):
    path = tmp_path / "raysim.lock"
    write_text(path, "first", exclusive=True, mode=0o640)
    with pytest.raises(FileExistsError):
        write_text(path, "second", exclusive=True)
    assert path.read_text() == "first" and leftovers(tmp_path) == []
    assert os.stat(path).st_mode & 0o777 == 0o640


def test_a_pyarrow_filesystem_gets_the_object_whole(tmp_path):
    import pyarrow.fs as pafs

    for fs, root in ((pafs.LocalFileSystem(), str(tmp_path)), (pafs._MockFileSystem(), "bucket")):
        fs.create_dir(root, recursive=True)
        write_bytes(f"{root}/index.json", b"{}", filesystem=fs)
        with fs.open_input_stream(f"{root}/index.json") as fh:
            assert fh.read() == b"{}"
        names = [i.base_name for i in fs.get_file_info(pafs.FileSelector(root))]
        assert names == ["index.json"]


# ----------------------------------------------------------------------------- the scan

# The one rename besides the helper's: a checkpoint's round-N.tmp folder becomes round-N whole.
RENAME_ALLOWED = {"raysim/engine/checkpoint.py": 1}
# Not converted on this branch: report.py and compare.py are another branch's part of issue 33.
# When they go through the helper, the scan says to take them off this list.
PENDING: set[str] = set()  # modules still to convert (none)

# Writes into memory, which name no file.
IN_MEMORY = {("raysim/engine/store.py", "to_bytes"): "torch.save into an io.BytesIO"}

MODE = re.compile(r"^[rwaxbtU+]{1,4}$")
DOTTED_WRITERS = {"torch.save", "np.save", "np.savez", "np.savez_compressed", "shutil.copy", "shutil.copyfile",
                  "shutil.copy2", "shutil.copytree"}
METHOD_WRITERS = {"savefig", "to_parquet", "to_csv", "write_table", "open_output_stream", "open_append_stream",
                  "write_text", "write_bytes"}


def _name(func) -> str:
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def _dotted(node) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return getattr(node, "id", "?")


def _is_rename(call: ast.Call) -> bool:
    return _dotted(call.func) in ("os.replace", "os.rename", "os.renames", "shutil.move") or \
        isinstance(call.func, ast.Attribute) and call.func.attr in ("rename", "move")  # Path.rename, fs.move


def _is_write(call: ast.Call) -> bool:
    name, dotted = _name(call.func), _dotted(call.func)
    if dotted == "os.open":
        return any(_name(n) in ("O_WRONLY", "O_RDWR", "O_CREAT", "O_APPEND") for n in ast.walk(call))
    if name in ("open", "fdopen"):  # open(p, "w"), os.fdopen(fd, "wb"), Path.open("a"), gzip.open(p, "wt")
        modes = [a.value for a in call.args[:2] + [k.value for k in call.keywords if k.arg == "mode"]
                 if isinstance(a, ast.Constant) and isinstance(a.value, str) and MODE.match(a.value)]
        return any(set(m) & set("wax+") for m in modes)
    if name in METHOD_WRITERS and isinstance(call.func, ast.Attribute):
        return _dotted(call.func.value) != "files"  # files.write_text is the helper
    return dotted in DOTTED_WRITERS


def _callbacks(tree) -> list:
    """The nodes passed as ``write`` to write_atomically: lambdas, and the defs it is given by
    name, directly or through functools.partial."""
    passed, names = [], set()
    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call) and _name(n.func) == "write_atomically"):
        for arg in call.args[1:2] + [k.value for k in call.keywords if k.arg == "write"]:
            if isinstance(arg, ast.Call) and _name(arg.func) == "partial" and arg.args:
                arg = arg.args[0]
            if isinstance(arg, ast.Lambda):
                passed.append(arg)
            elif isinstance(arg, ast.Name):
                names.add(arg.id)
    return passed + [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name in names]


def _enclosing_functions(tree) -> dict:
    """id(node) -> the name of the outermost def around it."""
    where = {}
    for top in ast.walk(tree):
        if isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for n in ast.walk(top):
                where.setdefault(id(n), top.name)
    return where


def scan(root: str = ROOT) -> list[str]:
    """``path:line: call`` for every rename and every write to a file outside the helper."""
    found = []
    for top in ("raysim", "tuning"):
        for folder, dirs, files in os.walk(os.path.join(root, top)):
            dirs[:] = [d for d in dirs if d != "__pycache__" and not (top == "raysim" and d in ("methods", "tuning"))]
            for f in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(folder, f)
                rel = os.path.relpath(path, root).replace(os.sep, "/")
                if rel == "raysim/core/files.py":
                    continue
                tree = ast.parse(open(path, encoding="utf-8").read(), path)
                calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
                renames = [n for n in calls if _is_rename(n)]
                if len(renames) > RENAME_ALLOWED.get(rel, 0):
                    found += [f"{rel}:{n.lineno}: {_dotted(n.func)}" for n in renames]
                inside = {id(n) for cb in _callbacks(tree) for n in ast.walk(cb)}
                function = _enclosing_functions(tree)
                found += [f"{rel}:{n.lineno}: {_dotted(n.func)}" for n in calls
                          if _is_write(n) and id(n) not in inside and (rel, function.get(id(n))) not in IN_MEMORY]
    return sorted(found)


def test_every_write_goes_through_the_helper():
    found = scan()
    unexpected = [f for f in found if f.split(":")[0] not in PENDING]
    assert not unexpected, ("write these through raysim.core.files.write_atomically (or write_text, write_json, "
                            "write_yaml, write_bytes):\n" + "\n".join(unexpected))
    stale = PENDING - {f.split(":")[0] for f in found}
    assert not stale, f"{sorted(stale)} write through the helper now: take them off PENDING"


def test_the_scan_sees_a_direct_write_and_a_rename(tmp_path):
    for top in ("raysim", "tuning"):
        (tmp_path / top).mkdir()
    (tmp_path / "raysim" / "direct.py").write_text(
        "import os\nfrom raysim.core.files import write_atomically\n\n"
        "def ok(path):\n    def write(tmp):\n        with open(tmp, 'w') as fh:\n            fh.write('x')\n"
        "    write_atomically(path, write)\n    write_atomically(path, lambda t: open(t, 'wb').write(b''))\n\n"
        "def bad(path, fig):\n    with open(path, 'a') as fh:\n        fh.write('x')\n"
        "    os.replace(path + '.tmp', path)\n    fig.savefig(path)\n    open(path).read()\n")
    assert scan(str(tmp_path)) == ["raysim/direct.py:12: open", "raysim/direct.py:14: os.replace",
                                   "raysim/direct.py:15: fig.savefig"]
