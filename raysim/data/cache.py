"""On-disk cache for generated datasets: ``${RAYSIM_CACHE:-~/.cache/raysim}``.

Writes are atomic (temporary file in the same folder, then ``os.replace``) because many Ray
workers may generate the same benchmark at once on a shared disk: each writes its own
temporary file and the last rename wins; all of them hold the same bytes.
"""

from __future__ import annotations

import os
import tempfile
import zipfile
from pathlib import Path

import numpy as np


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
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    except OSError:
        return False
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)  # uncompressed: loads ~8x faster; it is only a cache
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a shared cache must be readable by all
        os.replace(tmp, path)
        return True
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return False
