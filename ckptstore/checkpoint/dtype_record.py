"""The skeleton's own record of its tensors (docs/format.md, "The dtype record").

An index persistent id (``("storage", i)``, format version 2) names a rank-local
tensor by position alone: which entry of the manifest it is, and so its key, dtype and
the storage a load builds for it, come from the manifest only, and no hash covers the
manifest. A manifest whose entry says ``int32`` where ``float32`` was saved (the same
size, so every length and hash still agrees) loaded the saved bytes as integers; one
rewritten with its keys sorted (``jq -S``, ``json.dump(sort_keys=True)``: the same
JSON) loaded ``q_proj``'s bytes as ``k_proj``. So the skeleton blob, which the
manifest's xxh3-128 covers, ends with what its writer saw: after the pickle's STOP
opcode,

- ``ckptstore-tensors:``, the xxh3-128 (32 hex digits) of the rank's tensor entries in
  the order stored, as (key, dtype, shape) (:func:`tensors_digest`), ``:``, and their
  dtype names, comma-separated (ASCII); or, written before the digest,
- ``ckptstore-dtypes:`` and the dtype names alone.

An unpickler stops at STOP, so readers of versions before either ignore it; a reader
of this one refuses a manifest that disagrees."""

from __future__ import annotations

import json
import re

from .. import format as fmt
from ..errors import FormatError
from ..hashing import digest

MARK = b"ckptstore-tensors:"
MARK_DTYPES = b"ckptstore-dtypes:"  # the first record: dtypes only (read, never written)
_DIGEST = re.compile(rb"[0-9a-f]{32}")
_MISMATCH = "the manifest's tensor list does not match the skeleton's"


def tensors_digest(entries) -> str:
    """xxh3-128 of ``entries`` ((key, dtype name, shape) in the order stored), over
    their compact JSON text (ASCII): ``[["key","float32",[3,4]],...]``."""
    text = json.dumps([[key, dtype, [int(n) for n in shape]] for key, dtype, shape in entries],
                      separators=(",", ":"), ensure_ascii=True)
    return digest(text.encode("ascii"))


def dtype_record(local: dict) -> bytes:
    """The record of ``local`` ({key: (dtype name, shape)}, the rank's tensor entries in
    the order they are stored); empty when the rank stores no tensor of its own."""
    if not local:
        return b""
    entries = [(key, dtype, shape) for key, (dtype, shape) in local.items()]
    return (MARK + tensors_digest(entries).encode("ascii") + b":"
            + ",".join(dtype for dtype, _ in local.values()).encode("ascii"))


def check_dtype_record(rest: bytes, tensors: dict, where: str) -> None:
    """``rest``, what the skeleton holds after its pickle, against ``tensors`` (the rank's
    entries): nothing (a skeleton written before any record, or one without tensors of
    its own), or a record of exactly these entries. A FormatError names the first
    tensor whose manifest dtype is not the one saved, or says the list itself (keys,
    their order, shapes) is not the one saved."""
    if not rest:
        return
    if rest.startswith(MARK):
        digest_, colon, dtypes = rest[len(MARK):len(MARK) + 32], rest[len(MARK) + 32:len(MARK) + 33], \
            rest[len(MARK) + 33:]
        if not _DIGEST.fullmatch(digest_) or colon != b":":
            raise FormatError(f"{where}: malformed object skeleton: a tensor record without its digest")
    elif rest.startswith(MARK_DTYPES):
        digest_, dtypes = None, rest[len(MARK_DTYPES):]
    else:
        raise FormatError(f"{where}: malformed object skeleton: {len(rest)} bytes after its pickle")
    saved = dtypes.split(b",")
    if len(saved) != len(tensors):
        raise FormatError(f"{where}: {_MISMATCH}: the object skeleton was saved with {len(saved)} tensors of its "
                          f"own, the manifest lists {len(tensors)}")
    listed = [(key, e.dtype, e.shape) for key, e in tensors.items()]
    if digest_ is not None:
        if digest_.decode() == tensors_digest(listed):
            return
        as_saved = [(key, name.decode("ascii", "replace"), shape) for (key, _, shape), name in zip(listed, saved)]
        if digest_.decode() != tensors_digest(as_saved):  # not the dtypes alone: the keys, their order or shapes
            raise FormatError(f"{where}: {_MISMATCH}: its keys, their order or their shapes are not those "
                              f"saved{_sorted_hint(list(tensors))} (the skeleton names each tensor by its position "
                              "in the list: a load would give tensors under the wrong keys)")
    elif ",".join(e.dtype for e in tensors.values()).encode("ascii", "replace") == dtypes:
        return
    for (key, entry), name in zip(tensors.items(), saved):
        if entry.dtype.encode("ascii", "replace") != name:
            how = "was the manifest edited?" if digest_ is not None else \
                "was the manifest edited, or its tensors reordered?"  # (the first record cannot tell)
            raise FormatError(f"{where}: tensor {key!r}: the manifest says {entry.dtype}, but it was saved as "
                              f"{name.decode('ascii', 'replace')[:64]} (the manifest and the object skeleton "
                              f"disagree: {how})")


def _sorted_hint(keys: list) -> str:
    if len(keys) > 1 and keys == sorted(keys):
        return (": the manifest lists them in sorted order, as a rewrite with sorted keys (jq -S, "
                "json.dump(sort_keys=True)) leaves them")
    return ""


def check_storage_dtype(entry: fmt.TensorEntry, dtype, key: str, where: str) -> None:
    """A tuple persistent id's typed storage (the skeleton's word on the dtype: torch
    pickles a tensor's storage as its dtype) against the tensor's entry. (An untyped
    storage may hold any dtype's bytes: a rank-local one is checked by the record.)"""
    if fmt.dtype_from_name(entry.dtype) != dtype:
        raise FormatError(f"{where}: tensor {key!r}: the manifest says {entry.dtype}, but the object skeleton "
                          f"stores it as {fmt.dtype_name(dtype)} (the manifest and the skeleton disagree: was the "
                          "manifest edited?)")
