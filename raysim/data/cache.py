"""On-disk cache for generated datasets: ``${RAYSIM_CACHE:-~/.cache/raysim}``.

Writes are atomic (:func:`raysim.core.files.write_atomically`: a temporary file in the same
folder, renamed into place) because many Ray workers may generate the same benchmark at once on
a shared disk: each writes its own temporary file and the last rename wins; all of them hold the
same bytes.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import numpy as np

from raysim.core.files import WriteFailed, write_atomically


def cache_dir() -> Path:
    return Path(os.environ.get("RAYSIM_CACHE") or Path.home() / ".cache" / "raysim")


def load_npz(path: Path) -> dict[str, np.ndarray] | None:
    """The arrays in ``path``, or None when it is absent or unreadable (then regenerate)."""
    if not path.exists():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError):
        return None


def save_npz_atomic(path: Path, arrays: dict[str, np.ndarray]) -> bool:
    """Write ``arrays`` to ``path`` atomically; False (no exception) if the disk refuses."""
    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)  # uncompressed: loads ~8x faster; it is only a cache

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, write, mode=0o644)  # a shared cache must be readable by all
        return True
    except (OSError, WriteFailed):
        return False


def cached_arrays(path: Path, wanted: set[str], make, use_cache: bool = True) -> tuple[dict, str]:
    """A generated benchmark's arrays: read from ``path`` when it holds every ``wanted`` key, else
    ``make()`` (then written to ``path``); with the source, "cache" or "generated"."""
    arrays = load_npz(path) if use_cache else None
    if arrays is not None and not wanted <= set(arrays):
        arrays = None  # written by something else: regenerate
    if arrays is not None:
        return arrays, "cache"
    arrays = make()
    if use_cache:
        save_npz_atomic(path, arrays)
    return arrays, "generated"

