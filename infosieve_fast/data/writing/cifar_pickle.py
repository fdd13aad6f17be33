"""CIFAR's python batches read without running code: a pickle names the functions it calls, and `pickle.load` calls
any of them (`os.system` included). The batches hold a dict of bytes, strings, ints, lists and one NumPy array, so
only the functions that rebuild a NumPy array are allowed; any other is refused, naming the file."""

from __future__ import annotations

import pickle
from pathlib import Path

# What NumPy pickles an array with (numpy 1 names numpy.core, numpy 2 numpy._core; `_frombuffer` at pickle
# protocol 5), and how Python 3 writes bytes at protocol 2 (`_codecs.encode` of a str): nothing else is ever called.
ALLOWED = {
    ("_codecs", "encode"),
    *((f"numpy.{core}.multiarray", "_reconstruct") for core in ("core", "_core")),
    *((f"numpy.{core}.numeric", "_frombuffer") for core in ("core", "_core")),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
}


class _ArraysOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in ALLOWED:
            raise pickle.UnpicklingError(f"it calls {module}.{name}, which a CIFAR batch never holds")
        return super().find_class(module, name)


def read_batch(path: Path) -> dict:
    """A CIFAR batch file's dict, its byte keys decoded; ValueError naming `path` for a file that is not one."""
    try:
        with open(path, "rb") as f:
            d = _ArraysOnly(f, encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as exn:
        raise ValueError(f"{path} is not a CIFAR batch file ({exn}): download the python version again") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path} is not a CIFAR batch file (it holds a {type(d).__name__}, not a dict)")
    return {(k.decode() if isinstance(k, bytes) else k): v for k, v in d.items()}
