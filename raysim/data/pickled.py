"""Reading the pickled arrays some public dataset releases ship, without letting them run code.

FedBN's ``digit_dataset.zip`` (``<DOMAIN>/train.pkl``: an (images, labels) pair) and its
Office-Caltech-10 lists (``<site>_train.pkl``: a (paths, labels) pair) are pickles, which their
authors read with ``np.load(path, allow_pickle=True)``; a pickle can name any function to call
while it loads, so a tampered download would run code. raysim reads them with an unpickler that
resolves only what numpy arrays, numpy scalars and dtypes are built from (tuples, lists, strings
and numbers need no lookup); a file naming anything else is refused, before anything runs.
``np.load(allow_pickle=True)`` is used nowhere (tests/test_safe_loads.py checks).

A ``.npy`` file of a plain dtype is read by ``np.load(allow_pickle=False)``; one holding Python
objects (``dtype=object``) stores a pickle after its header, which goes through the same unpickler.
"""
from __future__ import annotations

import io
import pickle
import struct

import numpy as np

try:  # numpy >= 2
    from numpy._core import multiarray as _multiarray, numeric as _numeric
except ImportError:  # numpy 1.x
    from numpy.core import multiarray as _multiarray, numeric as _numeric

_NPY_MAGIC = b"\x93NUMPY"
_ALLOWED = {
    "_reconstruct": _multiarray._reconstruct,  # ndarray.__reduce__
    "scalar": _multiarray.scalar,  # numpy scalars (np.int64(3))
    "_frombuffer": _numeric._frombuffer,  # ndarray.__reduce_ex__ with protocol 5
}
_ALLOWED_MODULES = {"numpy.core.multiarray", "numpy._core.multiarray", "numpy.core.numeric",
                    "numpy._core.numeric"}


class _ArraysOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module in _ALLOWED_MODULES and name in _ALLOWED:
            return _ALLOWED[name]
        if module == "numpy" and name in ("ndarray", "dtype"):
            return getattr(np, name)
        if (module, name) == ("_codecs", "encode"):  # protocol 2 stores an array's bytes as latin-1 text
            return _latin1_encode
        raise pickle.UnpicklingError(f"it names {module}.{name}; only numpy arrays are read from a pickle")


def _latin1_encode(text: str, encoding: str = "latin1") -> bytes:
    if encoding != "latin1":
        raise pickle.UnpicklingError(f"unexpected text encoding {encoding!r} in a pickled array")
    return text.encode("latin1")


def load_arrays(path):
    """What the pickle (or ``.npy`` file) at ``path`` holds, built from numpy arrays, numpy
    scalars and Python's plain types only. Raises ``pickle.UnpicklingError`` (or ValueError,
    OSError) when the file holds anything else or is damaged."""
    with open(path, "rb") as fh:
        data = fh.read()
    if data.startswith(_NPY_MAGIC):
        return _load_npy(data)
    return _ArraysOnly(io.BytesIO(data)).load()


def _load_npy(data: bytes):
    major = data[6]
    if major == 1:
        start = 10 + struct.unpack("<H", data[8:10])[0]
    elif major in (2, 3):
        start = 12 + struct.unpack("<I", data[8:12])[0]
    else:
        raise ValueError(f"unknown .npy format version {major}")
    buf = io.BytesIO(data)
    try:
        return np.load(buf, allow_pickle=False)
    except ValueError as err:
        if "allow_pickle" not in str(err):
            raise
    return _ArraysOnly(io.BytesIO(data[start:])).load()  # an object array: a pickle after the header
