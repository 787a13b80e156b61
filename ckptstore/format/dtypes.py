"""Stored dtype names: the canonical name of each torch dtype (``float32``, never an
alias), and the dtypes torch pickles typed. The only module of ``format`` that imports torch."""

from __future__ import annotations

import torch

from ..errors import FormatError

# The dtypes whose storages torch pickles typed (FloatStorage, ...): an index persistent
# id stands for a typed storage of its entry's dtype when it is one of these, else for
# bytes. Fixed here, in the format, not read from the running torch's table.
TYPED_STORAGE_DTYPES = frozenset({
    "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
    "complex128", "complex64", "quint8", "qint8", "qint32", "quint4x2", "quint2x4",
})


# ---------------------------------------------------------------------------- dtypes
# Canonical stored names (``float32``, never an alias like ``float``), looked up once:
# every chunk record of a manifest names its dtype.
_DTYPE_NAMES: dict[torch.dtype, str] = {}
_DTYPES: dict[str, torch.dtype] = {}
for _dtype in {v for v in vars(torch).values() if isinstance(v, torch.dtype)}:
    _DTYPE_NAMES[_dtype] = str(_dtype).removeprefix("torch.")
    _DTYPES[_DTYPE_NAMES[_dtype]] = _dtype
del _dtype


def dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    return name if name is not None else str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """The dtype of its canonical stored name (``float32``, never an alias like ``float``)."""
    dt = _DTYPES.get(name) if type(name) is str else None
    if dt is None:
        raise FormatError(f"unknown dtype {name!r}")
    return dt


def itemsize(dtype_str: str) -> int:
    return dtype_from_name(dtype_str).itemsize
