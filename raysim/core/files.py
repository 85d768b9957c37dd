"""File writes: one helper that every write under ``raysim/`` and ``raysim.tuning`` goes through.

A file is written beside its final name (``NAME.<pid>-<tag>.tmp``) and renamed into place, so a
reader (another host, ``raysim report`` during a run, a resumed run) sees the old file or the new
one, never half of one, and a failed write (no space, no permission, a read-only file system) leaves
the old file as it was, no temporary behind, and a one-line :class:`WriteFailed` naming the file.
"""
from __future__ import annotations

import contextlib
import errno as errno_codes
import json
import os
import secrets
from typing import Callable

from raysim.core.errors import RunFailed


def write_atomically(path: str | os.PathLike, write: Callable[[str], None], *, what: str | None = None,
                     exclusive: bool = False, mode: int | None = None, filesystem=None,
                     keep_error: bool = False) -> None:
    """``write(tmp)`` writes the content to a temporary path, which then replaces ``path``.

    ``exclusive``: create ``path`` only where none exists (a lock file): a hard link, which only
    one writer can make, on a local disk and on an NFS server alike; it fails with
    FileExistsError, untranslated, if another writer got there first.
    ``mode``: the file's permission bits (default: what ``open`` gives under the umask).
    ``what`` names the file in a WriteFailed (default: the path).
    ``keep_error``: raise the original error instead of a WriteFailed (a caller that names the
    failure itself, as a checkpoint does for the several files of one round).
    ``filesystem``: a ``pyarrow.fs.FileSystem`` (local, S3, GCS, ...) that ``write`` writes the
    temporary object to and that moves it into place; ``exclusive`` and ``mode`` are for local
    files only. On an object store a PUT is atomic already (a reader sees the old object or the
    new one), so there the move, a copy and a delete, only keeps one code path for every store."""
    if filesystem is not None and (exclusive or mode is not None):
        raise ValueError("write_atomically: exclusive and mode are for local files, not a filesystem=")
    path = os.fspath(path)
    # pid and a random tag: writers in other threads, processes or hosts (a shared cache) never
    # share a temporary file
    tmp = f"{path}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
    passing = (FileExistsError,) if exclusive else ()
    with contextlib.nullcontext() if keep_error else writing(what or path, passing):
        try:
            write(tmp)
            if mode is not None:
                os.chmod(tmp, mode)
            if filesystem is not None:
                filesystem.move(tmp, path)
            elif exclusive:
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    # an NFS server that lost its reply to a link that worked answers the client's
                    # retry with EEXIST: the temporary file's second link tells
                    if os.stat(tmp).st_nlink < 2:
                        raise
            else:
                os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                if filesystem is not None:
                    filesystem.delete_file(tmp)
                else:
                    os.remove(tmp)
            raise
        if exclusive:
            with contextlib.suppress(OSError):
                os.remove(tmp)


def write_text(path: str | os.PathLike, text: str, **kw) -> None:
    """``text`` as the file's whole content (UTF-8), atomically."""
    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
    write_atomically(path, write, **kw)


def write_bytes(path: str | os.PathLike, data: bytes, *, filesystem=None, **kw) -> None:
    """``data`` as the file's whole content, atomically; on a ``pyarrow.fs`` ``filesystem`` too."""
    def write(tmp):
        with filesystem.open_output_stream(tmp) if filesystem is not None else open(tmp, "wb") as fh:
            fh.write(data)
    write_atomically(path, write, filesystem=filesystem, **kw)


def write_json(path: str | os.PathLike, obj, *, indent: int | None = None, default=None, **kw) -> None:
    """``obj`` as JSON, atomically."""
    write_text(path, json.dumps(obj, indent=indent, default=default), **kw)


def write_yaml(path: str | os.PathLike, data, **kw) -> None:
    """``data`` as YAML in its own key order, atomically."""
    import yaml
    write_text(path, yaml.safe_dump(data, sort_keys=False), **kw)


class WriteFailed(RunFailed):
    """A write into the run folder failed (no space, no permission, read-only file system, ...)."""

    def __init__(self, what: str, err: BaseException | str):
        self.what, self.err = what, err
        super().__init__(f"cannot write {what}: {err if isinstance(err, str) else describe(err)}")


@contextlib.contextmanager
def writing(what: str, passing: tuple = ()):
    """Turn an OSError raised inside into a :class:`WriteFailed` naming ``what`` (a path, or
    words such as "the checkpoint of round 4"); the OSError types in ``passing`` go through."""
    try:
        yield
    except (WriteFailed, *passing):
        raise
    except OSError as err:
        raise WriteFailed(what, err) from None


def describe(err: BaseException) -> str:
    """The original error in one line: ``[Errno 28] No space left on device`` for an OSError
    that carries an errno, else its type and first line."""
    code = getattr(err, "errno", None)
    if isinstance(err, OSError) and isinstance(code, int) and code in errno_codes.errorcode:
        return f"[Errno {code}] {os.strerror(code)}"
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    return f"{type(err).__name__}: {lines[0][:200]}" if lines else type(err).__name__


def free_space_note(path: str) -> str:
    """``; 12 KiB free on its file system`` (or read-only), to explain a write error that does
    not say why (torch.save's "unexpected pos")."""
    probe = path
    while probe and not os.path.exists(probe):
        probe = os.path.dirname(probe)
    try:
        st = os.statvfs(probe or ".")
    except OSError:
        return ""
    if st.f_flag & os.ST_RDONLY:
        return "; its file system is read-only"
    free = st.f_bavail * st.f_frsize
    if free < max(1 << 20, 0.001 * st.f_blocks * st.f_frsize):
        return f"; no space left on device ({_size(free)} free)"
    return f"; {_size(free)} free on its file system"


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:.0f} GiB"
