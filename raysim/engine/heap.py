"""How a host or server process keeps the memory it frees (glibc's malloc settings).

A buffered window allocates and frees tens of megabytes a host: a float64 partial sum per server
step, a private copy of each version's payload. glibc serves blocks that big from fresh mappings
or trims them off the top of its heap once freed, so the next window touches new pages and every
4 KiB page costs a minor fault (3-4 us on the 2-core VM): 2,000-9,000 faults a window on each
host of the benchmark's async arm. :func:`keep_freed_memory` has glibc serve blocks under
:data:`MMAP_THRESHOLD` from its heap and keep up to :data:`TRIM_THRESHOLD` of freed memory there,
so a window reuses the last one's pages. It changes no value, only where memory comes from.

It applies to Ray actors only (the driver, and hosts run in the driver's process by the
``InProcess`` backend, keep glibc's defaults) and where the C library has ``mallopt`` (glibc; not
macOS, where it is a no-op).
"""
from __future__ import annotations

import ctypes

MMAP_THRESHOLD = 32 << 20  # glibc's own ceiling for its dynamic threshold on 64-bit
TRIM_THRESHOLD = 64 << 20  # freed memory kept at the heap's top: about two windows of D's partials
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # malloc.h


def keep_freed_memory() -> bool:
    """In a Ray actor on glibc, set its malloc to reuse freed blocks; whether it did."""
    import ray
    if not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
