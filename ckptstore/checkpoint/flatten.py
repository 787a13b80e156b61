"""Flatten an object into a skeleton (a pickle) plus the storages its tensors use.

The skeleton is pickled the way ``torch.save`` pickles: tensors reduce to
``torch._utils._rebuild_tensor_v2`` over a storage, and each storage becomes a
persistent id ``("storage", storage type, key, location, numel)``. So a load can use
torch's own weights-only unpickler and allow-list, and views, shared storages, tied
weights and ``nn.Parameter`` come back exactly as torch.save would give them. Each
distinct storage is stored once, under a key named after the first state-dict path
that reaches it.
"""

from __future__ import annotations

import io
import math
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable

import torch

from .. import format as fmt
from ..errors import SerializationError


@dataclass
class StorageRef:
    """One distinct storage met while pickling."""

    key: str
    storage: torch.UntypedStorage
    dtype: torch.dtype
    shape: tuple[int, ...]  # the entry's shape: the tensor's when it covers the storage exactly
    location: str


def tensor_paths(obj, prefix: str = "") -> dict[int, tuple[str, torch.Tensor]]:
    """Map each storage (by its ``_cdata``) to the first container path reaching a tensor of it."""
    found: dict[int, tuple[str, torch.Tensor]] = {}
    seen: set[int] = set()

    def visit(o, path: str) -> None:
        if isinstance(o, torch.Tensor):
            if o.layout == torch.strided and type(o) in (torch.Tensor, torch.nn.Parameter):
                found.setdefault(o.untyped_storage()._cdata, (path or "tensor", o))
            return
        if id(o) in seen:
            return
        if isinstance(o, Mapping):
            seen.add(id(o))
            for k, v in o.items():
                visit(v, f"{path}.{k}" if path else str(k))
        elif isinstance(o, (list, tuple)):
            seen.add(id(o))
            for i, v in enumerate(o):
                visit(v, f"{path}.{i}" if path else str(i))

    visit(obj, prefix)
    return found


def entry_shape(tensor: torch.Tensor | None, numel: int, dtype: torch.dtype) -> tuple[int, ...]:
    """A tensor that covers its whole storage contiguously lends it its shape."""
    if (
        tensor is not None
        and tensor.dtype == dtype
        and tensor.storage_offset() == 0
        and tensor.is_contiguous()
        and tensor.numel() == numel
        and tensor.dim() > 0
    ):
        return tuple(tensor.shape)
    if tensor is not None and tensor.dim() == 0 and numel == 1 and tensor.dtype == dtype:
        return ()
    return (numel,)


def flatten(obj, on_storage: Callable[[StorageRef], None], pickle_protocol: int = 2) -> bytes:
    """Pickle ``obj``; call ``on_storage`` once per distinct storage, in pickling order.

    ``on_storage`` must copy the storage's bytes before it returns: that copy is the
    snapshot, and the caller may change its tensors as soon as ``save`` returns.
    """
    paths = tensor_paths(obj)
    keys: dict[int, str] = {}
    dtypes: dict[int, torch.dtype] = {}
    used: set[str] = set()

    def persistent_id(o):
        if not (isinstance(o, torch.storage.TypedStorage) or torch.is_storage(o)):
            return None
        if isinstance(o, torch.storage.TypedStorage):
            storage = o._untyped_storage
            dtype = o.dtype
            storage_type = getattr(torch, o._pickle_storage_type())
            numel = o._size()
        else:
            storage = o
            dtype = torch.uint8
            storage_type = torch.UntypedStorage
            numel = storage.nbytes()
        cdata = storage._cdata
        if cdata in keys:
            if dtypes[cdata] != dtype:
                raise SerializationError(
                    "cannot save tensors that view the same storage as different dtypes "
                    f"({dtypes[cdata]} and {dtype}, storage {keys[cdata]!r})"
                )
            return ("storage", storage_type, keys[cdata], torch.serialization.location_tag(storage), numel)
        if storage.device.type == "meta":
            raise SerializationError("cannot save a tensor on the meta device: it holds no data")
        path, tensor = paths.get(cdata, (f"storage.{len(keys)}", None))
        key = _unique(path, used)
        keys[cdata] = key
        dtypes[cdata] = dtype
        location = torch.serialization.location_tag(storage)
        on_storage(StorageRef(key, storage, dtype, entry_shape(tensor, numel, dtype), location))
        return ("storage", storage_type, key, location, numel)

    class _Pickler(pickle.Pickler):
        def persistent_id(self, o):
            return persistent_id(o)

    buf = io.BytesIO()
    try:
        _Pickler(buf, protocol=pickle_protocol).dump(obj)
    except SerializationError:
        raise
    except (pickle.PicklingError, TypeError, AttributeError, RuntimeError) as e:
        raise SerializationError(f"cannot save object: {e}") from e
    return buf.getvalue()


def _unique(path: str, used: set[str]) -> str:
    key, n = path, 1
    while key in used:
        n += 1
        key = f"{path}#{n}"
    used.add(key)
    return key


def plan_chunks(shape: tuple[int, ...], itemsize: int, limit: int):
    """Split a row-major tensor into regions of at most ``limit`` bytes (one row at
    least), each contiguous in memory. Yields (offsets, sizes, byte offset, nbytes)."""
    nd = len(shape)
    total = math.prod(shape) * itemsize
    if total == 0:
        return
    if nd == 0 or total <= limit:
        yield (0,) * nd, tuple(shape), 0, total
        return
    row = math.prod(shape[1:]) * itemsize
    if row <= limit or nd == 1:
        rows = max(1, limit // row)
        for start in range(0, shape[0], rows):
            n = min(rows, shape[0] - start)
            yield (start,) + (0,) * (nd - 1), (n,) + tuple(shape[1:]), start * row, n * row
        return
    for i in range(shape[0]):
        for off, sz, b, n in plan_chunks(tuple(shape[1:]), itemsize, limit):
            yield (i,) + off, (1,) + sz, i * row + b, n


def region_byte_offset(shape, offsets, itemsize: int) -> int:
    """Byte offset of a region's first element in the row-major tensor."""
    stride, off = itemsize, 0
    for d in reversed(range(len(shape))):
        off += offsets[d] * stride
        stride *= shape[d]
    return off


__all__ = ["StorageRef", "flatten", "plan_chunks", "region_byte_offset", "tensor_paths", "fmt"]
