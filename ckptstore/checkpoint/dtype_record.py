"""The skeleton's own record of its tensors' dtypes (docs/format.md, "The dtype record").

An index persistent id (``("storage", i)``, format version 2) names a rank-local
tensor by position alone: its dtype, and so the storage a load builds for it, comes
from the manifest entry only, and no hash covers the manifest. A manifest whose entry
says ``int32`` where ``float32`` was saved (the same size, so every length and hash
still agrees) loaded the saved bytes as integers. So the skeleton blob, which the
manifest's xxh3-128 covers, ends with the dtypes its writer saw: after the pickle's
STOP opcode, ``ckptstore-dtypes:`` and the dtype names of the rank's tensor entries in
the order stored, comma-separated (ASCII). An unpickler stops at STOP, so readers of
earlier versions ignore it; a reader of this one refuses a manifest that disagrees."""

from __future__ import annotations

from .. import format as fmt
from ..errors import FormatError

MARK = b"ckptstore-dtypes:"


def dtype_record(local: dict) -> bytes:
    """The record of ``local`` ({key: (dtype name, shape)}, the rank's tensor entries in
    the order they are stored); empty when the rank stores no tensor of its own."""
    return MARK + ",".join(dtype for dtype, _ in local.values()).encode("ascii") if local else b""


def check_dtype_record(rest: bytes, tensors: dict, where: str) -> None:
    """``rest``, what the skeleton holds after its pickle, against ``tensors`` (the rank's
    entries): nothing (a skeleton written before the record, or one without tensors of
    its own), or a record naming exactly their dtypes. A FormatError names the first
    tensor whose manifest dtype is not the one saved."""
    if not rest:
        return
    if not rest.startswith(MARK):
        raise FormatError(f"{where}: malformed object skeleton: {len(rest)} bytes after its pickle")
    saved = rest[len(MARK):].split(b",")
    if len(saved) != len(tensors):
        raise FormatError(f"{where}: the object skeleton was saved with {len(saved)} tensors of its own, "
                          f"the manifest lists {len(tensors)}")
    expected = ",".join(e.dtype for e in tensors.values()).encode("ascii", "replace")
    if expected == rest[len(MARK):]:
        return
    for (key, entry), name in zip(tensors.items(), saved):
        if entry.dtype.encode("ascii", "replace") != name:
            raise FormatError(f"{where}: tensor {key!r}: the manifest says {entry.dtype}, but it was saved as "
                              f"{name.decode('ascii', 'replace')[:64]} (the manifest and the object skeleton "
                              "disagree: was the manifest edited?)")


def check_storage_dtype(entry: fmt.TensorEntry, dtype, key: str, where: str) -> None:
    """A tuple persistent id's typed storage (the skeleton's word on the dtype: torch
    pickles a tensor's storage as its dtype) against the tensor's entry. (An untyped
    storage may hold any dtype's bytes: a rank-local one is checked by the record.)"""
    if fmt.dtype_from_name(entry.dtype) != dtype:
        raise FormatError(f"{where}: tensor {key!r}: the manifest says {entry.dtype}, but the object skeleton "
                          f"stores it as {fmt.dtype_name(dtype)} (the manifest and the skeleton disagree: was the "
                          "manifest edited?)")
