"""Flatten an object into a skeleton (a pickle) plus the storages its tensors use.

The skeleton is pickled the way ``torch.save`` pickles: tensors reduce to
``torch._utils._rebuild_tensor_v2`` over a storage, and each storage becomes a
persistent id ``("storage", storage type, key, location, numel)``, or for most
rank-local storages ``("storage", index)`` (format version 2,
:func:`implied_storage_dtype`). So a load can use torch's own weights-only unpickler
and allow-list, and views, shared storages, tied weights and ``nn.Parameter`` come
back exactly as torch.save would give them. Each distinct storage is stored once,
under a key named after the first state-dict path that reaches it.
"""

from __future__ import annotations

import functools
import io
import itertools
import math
import pickle
import sys
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..errors import SerializationError
from ..format import TYPED_STORAGE_DTYPES
from ..scopes import Scope
from ..staging.strided import row_major_boxes
from .weights_only import AS_IS, WeightsOnlyAudit


class UnserializableTensorError(SerializationError, RuntimeError):
    """torch refuses to serialise a tensor (a ZeroTensor; one buffer viewed as several
    dtypes): a RuntimeError, as torch.save raises, and a SerializationError."""


# Skeleton key scopes: this rank's own tensors, global tensors ("l", "g" when stored).
LOCAL, GLOBAL = Scope.LOCAL, Scope.GLOBAL


_SCOPES = {s.value: s for s in Scope}


# Version 2 of the format names a rank-local CPU storage in the skeleton by its index
# among the rank's stored tensors, the persistent id ("storage", index), when its tensor
# entry implies the rest of the five-item tuple: 4 pickle opcodes where the tuple is 9
# of a tensor's 30, each a turn of the weights-only unpickler's Python loop on every
# load. (A bare int would be one opcode, but torch's weights-only unpickler refuses int
# persistent ids before 2.9.) Global storages, storages off the CPU and bytes pickled
# untyped for a dtype that has a storage class keep the tuple.
_TYPED_STORAGE_DTYPES = frozenset(getattr(torch, name) for name in TYPED_STORAGE_DTYPES)


def index_pid(index: int) -> tuple[str, int]:
    return ("storage", index)


def implied_storage_dtype(entry_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the storage an index persistent id stands for, given its tensor
    entry's: the entry's own when it has a typed storage class, else bytes (torch
    pickles the others, uint16 or float8 say, over an untyped storage)."""
    return entry_dtype if entry_dtype in _TYPED_STORAGE_DTYPES else torch.uint8


def skeleton_key(scope: Scope | str, key: str) -> str:
    return f"{scope}:{key}"  # a Scope formats as its value


def parse_skeleton_key(text: str) -> tuple[Scope, str]:
    scope, sep, key = text.partition(":")
    member = _SCOPES.get(scope) if sep else None
    if member is None:
        raise ValueError(f"bad tensor reference {text!r}")
    return member, key


@dataclass
class StorageRef:
    """One distinct storage met while pickling."""

    key: str
    storage: torch.UntypedStorage
    dtype: torch.dtype
    shape: tuple[int, ...]  # the entry's shape: the tensor's when it covers the storage exactly
    location: str
    scope: Scope = LOCAL  # GLOBAL: declared replicated across ranks


@dataclass
class DTensorRef:
    """One DTensor met while pickling; stored as a global tensor."""

    key: str
    dtensor: "torch.Tensor"


def _is_dtensor(o) -> bool:
    cls = _dtensor_class()
    return cls is not None and isinstance(o, cls)


def local_tensor(dt) -> torch.Tensor:
    """A DTensor's local tensor, read for its bytes and metadata. ``to_local()`` runs an
    autograd Function for the gradient's way back (30-50 us a call); a save only reads
    the bytes, so it takes the tensor the DTensor holds when it is there."""
    local = getattr(dt, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else dt.to_local()


def _dtensor_class():
    # Importing torch.distributed.tensor costs a second or more; if nothing imported it,
    # no DTensor can exist, so the blocking part of a save never pays for that import.
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


@dataclass(frozen=True)
class LocalBox:
    """A box of a DTensor's local tensor that is one box of the global tensor too."""

    index: tuple[slice, ...]  # the box in the local tensor
    offsets: tuple[int, ...]  # its place in the global tensor
    sizes: tuple[int, ...]


MAX_LOCAL_BOXES = 1 << 16


def dtensor_boxes(dt, failure: str = "cannot save DTensor", meshes: dict | None = None) -> Sequence[LocalBox]:
    """The boxes of the global tensor that this rank's local tensor holds, with where
    each lies in the local tensor: one box for Shard and Replicate placements, several
    for ``_StridedShard`` layouts whose local rows are not a contiguous range of the
    global tensor (FSDP2 over tensor parallelism makes ``(_StridedShard(0, sf), Shard(0))``,
    which is one box; a strided shard after a plain one, or a view of a column shard,
    is not). Computed from the placements alone, following torch's sharding rules: a
    Shard splits the current index list of its dimension as ``torch.chunk`` does; a
    ``_StridedShard(d, split_factor=k)`` first chunks it into ``k`` pieces, chunks each
    piece over the mesh dimension and keeps this rank's part of every piece. Raises
    SerializationError for placements it does not know (Partial, say) and when the result
    disagrees with the local tensor's shape; ``failure`` begins its message. ``meshes``:
    a memo of each mesh's coordinate and shape, by id (for DTensors whose meshes stay
    alive meanwhile: a state's), so a state of many DTensors asks each mesh once."""
    mesh = dt.device_mesh
    known = meshes.get(id(mesh)) if meshes is not None else None
    if known is None:
        coord = mesh.get_coordinate()
        # mesh.shape, not mesh.mesh.shape: that builds the mesh's rank tensor on every call
        known = (None if coord is None else tuple(coord), tuple(mesh.shape))
        if meshes is not None:
            meshes[id(mesh)] = known
    coord, mesh_shape = known
    if coord is None:  # this rank is not part of the DTensor's mesh: it holds nothing
        return []
    facts = (tuple(dt.shape), tuple(local_tensor(dt).shape), mesh_shape, coord, tuple(dt.placements))
    try:
        return _boxes(*facts)  # a model's layers repeat their shapes: most DTensors are a look-up
    except _BoxError as e:
        raise SerializationError(f"{failure}: {e}") from None
    except TypeError:  # a placement that cannot be hashed: computed afresh
        return _boxes.__wrapped__(*facts)


class _BoxError(Exception):
    """Why a DTensor's boxes cannot be computed (dtensor_boxes names the tensor)."""


@functools.lru_cache(maxsize=4096)
def _boxes(shape, local_shape, mesh_shape, coord, placements) -> tuple[LocalBox, ...]:
    """dtensor_boxes from what it reads of the DTensor (a pure function of these)."""
    ndim = len(shape)
    index: list[Sequence[int]] = [range(n) for n in shape]  # ranges until a strided shard scatters one
    for m, p in enumerate(placements):
        if p.is_replicate():
            continue
        split_factor = getattr(p, "split_factor", None)
        if not (p.is_shard() or split_factor is not None) or not isinstance(getattr(p, "dim", None), int):
            raise _BoxError(f"placement {p!r} (placements {list(placements)}) "
                            "is neither Shard, _StridedShard nor Replicate; redistribute it first")
        d = p.dim % ndim if ndim else p.dim
        if not 0 <= d < ndim:
            raise _BoxError(f"placement {p!r} shards dimension {p.dim} of a {ndim}-dimensional tensor")
        n, c = mesh_shape[m], coord[m]
        if split_factor is None:
            index[d] = _chunk(index[d], n)[c]
        else:
            parts = [_chunk(piece, n)[c] for piece in _chunk(index[d], int(split_factor))]
            parts = [q for q in parts if len(q)]
            index[d] = parts[0] if len(parts) == 1 else [i for q in parts for i in q]
    if tuple(len(ix) for ix in index) != local_shape:
        raise _BoxError(
            f"placements {list(placements)} on a mesh of shape {list(mesh_shape)} give "
            f"rank coordinate {list(coord)} a local shape {[len(ix) for ix in index]}, but its local tensor "
            f"has shape {list(local_shape)}")
    if any(n == 0 for n in local_shape):
        return ()
    runs = [_runs(ix) for ix in index]
    count = math.prod(len(r) for r in runs)
    if count > MAX_LOCAL_BOXES:
        raise _BoxError(f"placements {list(placements)} scatter this rank's shard "
                        f"over {count} separate boxes of the global tensor; redistribute it first")
    return tuple(LocalBox(tuple(slice(lo, lo + k) for lo, _g, k in combo), tuple(g for _l, g, _k in combo),
                          tuple(k for _l, _g, k in combo))
                 for combo in itertools.product(*runs))


def _chunk(items: Sequence[int], n: int) -> list[Sequence[int]]:
    """``torch.chunk`` on a sequence (a range stays a range), padded with empty parts to
    ``n`` parts."""
    size = -(-len(items) // n) if len(items) else 0
    return [items[i * size:(i + 1) * size] if size else items[:0] for i in range(n)]


def _runs(index: Sequence[int]) -> list[tuple[int, int, int]]:
    """(local start, global start, length) of each run of consecutive global indices."""
    if isinstance(index, range) and index.step == 1:
        return [(0, index.start, len(index))] if len(index) else []
    runs: list[tuple[int, int, int]] = []
    for pos, g in enumerate(index):
        if runs and runs[-1][1] + runs[-1][2] == g:
            lo, start, k = runs[-1]
            runs[-1] = (lo, start, k + 1)
        else:
            runs.append((pos, g, 1))
    return runs


def tensor_paths(obj, prefix: str = "") -> tuple[dict[int, tuple[str, torch.Tensor]], dict[int, tuple[str, Any]]]:
    """Walk containers: storage ``_cdata`` -> first (path, tensor) reaching it, and
    id(DTensor) -> its first (path, DTensor)."""
    found: dict[int, tuple[str, torch.Tensor]] = {}
    dtensors: dict[int, tuple[str, Any]] = {}
    seen: set[int] = set()

    def visit(o, path: str) -> None:
        if isinstance(o, torch.Tensor):
            if _is_dtensor(o):
                dtensors.setdefault(id(o), (path or "tensor", o))
            elif o.layout == torch.strided and type(o) in (torch.Tensor, torch.nn.Parameter) and not o.is_nested:
                # (a strided nested tensor has no shape to lend; its buffer pickles as a plain tensor)
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
    return found, dtensors


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


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, out = 1, []
    for n in reversed(shape):
        out.append(stride)
        stride *= max(n, 1)
    return tuple(reversed(out))


def unsaveable_local_kind(local: torch.Tensor) -> str | None:
    """Why a DTensor's local tensor cannot be saved as its global chunks ("quantized",
    "nested", a layout), or None: the chunks hold raw bytes only, so a quantized
    tensor's scales, a sparse one's indices would be lost and the checkpoint would not
    load."""
    if local.is_quantized:
        return "quantized"
    if local.is_nested:
        return "nested"
    return None if local.layout == torch.strided else str(local.layout)


def _has_typed_storage(dtype: torch.dtype) -> bool:
    """Whether torch pickles this dtype over a legacy typed storage class (the map
    ``TypedStorage._pickle_storage_type`` reads; no TypedStorage made, so no warning
    to silence: ``warnings.catch_warnings`` is not thread-safe, and workers ask this)."""
    return dtype in torch.storage._dtype_to_storage_type_map()


# Types the pickler meets most that are never a storage (persistent_id's fast path).
_NEVER_STORAGE = frozenset({int, float, bool, str, bytes, tuple, list, dict, type(None), OrderedDict, torch.Size,
                            torch.dtype, torch.device, type(torch._utils._rebuild_tensor_v2)})


def flatten(obj, on_storage: Callable[[StorageRef], None], pickle_protocol: int = 2, *,
            on_dtensor: Callable[[DTensorRef], None] | None = None,
            replicated: Callable[[str], bool] | None = None, pickle_module=pickle,
            on_paths: Callable[[dict, dict], None] | None = None, paths: tuple[dict, dict] | None = None,
            warn_unsafe: bool = True) -> bytes:
    """Pickle ``obj``; call ``on_storage`` once per distinct storage and ``on_dtensor``
    once per DTensor, in pickling order.

    The callbacks must copy the bytes before they return: that copy is the snapshot,
    and the caller may change its tensors as soon as ``save`` returns. A DTensor is
    pickled as a plain tensor of its global shape over a global storage reference, so
    loading without a process group yields the full (consolidated) tensor.
    ``replicated(path)`` marks storages whose first path it accepts as global.
    ``pickle_module`` supplies the Pickler, as torch.save's argument does.
    ``on_paths`` gets :func:`tensor_paths`'s two maps before any other callback (the
    tensors reachable through containers: a save's size estimate); ``paths``: those
    maps when the caller has them already (one walk, not two).
    Warns once (UnsafeForWeightsOnlyWarning) when the default load, weights_only=True,
    will refuse the result (see :mod:`.weights_only`), unless ``warn_unsafe`` is False.
    """
    paths, dtensor_paths = tensor_paths(obj) if paths is None else paths
    if on_paths is not None:
        on_paths(paths, dtensor_paths)
    keys: dict = {}  # storage cdata (an unallocated one: (cdata, dtype)) -> skeleton key
    indexes: dict = {}  # the same -> its index persistent id, for those named by one
    dtypes: dict[int, torch.dtype] = {}  # data pointer -> the dtype it is pickled as
    used: dict[str, set[str]] = {LOCAL: set(), GLOBAL: set()}
    global_refs: dict[int, tuple[str, str]] = {}  # placeholder storage cdata -> (skeleton key, location)
    placeholders: dict[int, tuple] = {}  # id(DTensor) -> reduce value (kept alive while pickling)

    def persistent_id(o):
        # The pickler asks this of every object (about 19 per tensor): answer the
        # common ones with one set lookup.
        if type(o) in _NEVER_STORAGE or not (isinstance(o, torch.storage.TypedStorage) or torch.is_storage(o)):
            return None
        storage, dtype, storage_type, numel = _storage_pid(o)
        cdata = storage._cdata
        if cdata in global_refs:
            key, location = global_refs[cdata]
            return ("storage", storage_type, key, location, numel)
        # torch.save's rule: one allocated buffer must be pickled as one dtype; an
        # unallocated one holds no bytes, so each dtype viewing it gets an entry of its
        # own (torch.load too gives each its own storage).
        ptr = storage.data_ptr() if storage.device.type != "meta" else 0
        if ptr and dtypes.setdefault(ptr, dtype) != dtype:
            raise UnserializableTensorError(
                "Cannot save multiple tensors or storages that view the same data as different types "
                f"({dtypes[ptr]} and {dtype}, tensor {paths.get(cdata, ('?',))[0]!r})")
        ident = cdata if ptr else (cdata, dtype)
        if ident in keys:
            pid = indexes.get(ident)
            if pid is not None:
                return pid
            return ("storage", storage_type, keys[ident], torch.serialization.location_tag(storage), numel)
        if storage.device.type == "meta":
            raise SerializationError("cannot save a tensor on the meta device: it holds no data")
        path, tensor = paths.get(cdata, (f"storage.{len(keys)}", None))
        entry_dtype, entry_numel = dtype, numel
        if storage_type is torch.UntypedStorage and tensor is not None and numel % tensor.dtype.itemsize == 0:
            # torch pickles dtypes without a legacy storage class (uint16, float8, ...) over
            # untyped bytes; the manifest still records the tensor's own dtype.
            entry_dtype, entry_numel = tensor.dtype, numel // tensor.dtype.itemsize
        scope = GLOBAL if (replicated is not None and tensor is not None and replicated(path)) else LOCAL
        key = _unique(path, used[scope])
        keys[ident] = skeleton_key(scope, key)
        location = torch.serialization.location_tag(storage)
        on_storage(StorageRef(key, storage, entry_dtype, entry_shape(tensor, entry_numel, entry_dtype), location, scope))
        if scope == LOCAL and location == "cpu" and implied_storage_dtype(entry_dtype) == dtype:
            # its index among the rank-local storages met so far, one key each
            pid = indexes[ident] = index_pid(len(used[LOCAL]) - 1)
            return pid
        return ("storage", storage_type, keys[ident], location, numel)

    def reduce_dtensor(dt):
        if id(dt) in placeholders:
            return placeholders[id(dt)]
        if on_dtensor is None:
            raise SerializationError("DTensors can only be saved through Store.save")
        key = _unique(dtensor_paths.get(id(dt), (f"dtensor.{len(placeholders)}",))[0], used[GLOBAL])
        local = local_tensor(dt)
        kind = unsaveable_local_kind(local)
        if kind is not None:
            raise UnserializableTensorError(f"cannot save DTensor {key!r}: its local tensor is {kind}; "
                                            "only strided, unquantized local tensors can be saved")
        on_dtensor(DTensorRef(key, dt))
        location = torch.serialization.location_tag(local.untyped_storage())
        value = placeholders[id(dt)] = _global_stand_in(key, dt.dtype, tuple(dt.shape), location, dt.requires_grad,
                                                        global_refs)
        return value

    # Notes what the default load (weights_only=True) will refuse; warns once, below.
    audit = WeightsOnlyAudit(pickle_protocol, enabled=warn_unsafe)

    class _Pickler(pickle_module.Pickler):
        def persistent_id(self, o):
            return persistent_id(o)

        def reducer_override(self, o):
            if id(type(o)) in AS_IS:  # tensors, OrderedDicts, plain values: one look-up, nothing more
                return NotImplemented
            if isinstance(o, torch.Tensor) and _is_dtensor(o):
                return reduce_dtensor(o)
            return audit.reduce(self, o)

    pickler_class = _Pickler
    if audit.watches_bytes:  # protocol 3 only: a subclass, so protocol 2 pays nothing for it
        class _BytesNotingPickler(_Pickler):
            def persistent_id(self, o):
                if type(o) is bytes:
                    audit.note_bytes()
                return persistent_id(o)

        pickler_class = _BytesNotingPickler

    buf = io.BytesIO()
    try:
        pickler_class(buf, protocol=pickle_protocol).dump(obj)
    except SerializationError:
        raise
    except RuntimeError as e:  # torch refused a tensor (ZeroTensor, ...): keep the builtin type
        raise UnserializableTensorError(f"cannot save object: {e}") from e
    except (pickle.PicklingError, TypeError, AttributeError) as e:  # (SerializationError is all three)
        raise SerializationError(f"cannot save object: {e}") from e
    skeleton = buf.getvalue()
    audit.warn(skeleton)  # outside the try: a warning turned error propagates as itself
    return skeleton


def _storage_pid(o):
    """(untyped storage, dtype, storage type, numel) of a storage met while pickling."""
    if isinstance(o, torch.storage.TypedStorage):
        return o._untyped_storage, o.dtype, getattr(torch, o._pickle_storage_type()), o._size()
    return o, torch.uint8, torch.UntypedStorage, o.nbytes()


def _global_stand_in(key: str, dtype: torch.dtype, shape: tuple[int, ...], location: str, requires_grad: bool,
                     global_refs: dict) -> tuple:
    """The reduce value of global tensor ``key``: a storage that holds no memory stands
    in for its storage (registered in ``global_refs`` for the persistent id), rebuilt by
    the call torch.save itself uses for the dtype. The value keeps the stand-in alive."""
    if _has_typed_storage(dtype):
        stand_in = torch.storage.TypedStorage(math.prod(shape), dtype=dtype, device="meta", _internal=True)
        global_refs[stand_in._untyped_storage._cdata] = (skeleton_key(GLOBAL, key), location)
    else:
        stand_in = torch.UntypedStorage(math.prod(shape) * dtype.itemsize, device="meta")
        global_refs[stand_in._cdata] = (skeleton_key(GLOBAL, key), location)
    return global_rebuild(stand_in, dtype, shape, requires_grad)


def global_rebuild(storage, dtype: torch.dtype, shape: tuple[int, ...], requires_grad: bool) -> tuple:
    """The reduce value of a global tensor over ``storage`` (which the pickler names by
    :func:`global_pid`): the call torch.save itself uses for the dtype."""
    stride = _contiguous_stride(shape)
    if _has_typed_storage(dtype):
        return torch._utils._rebuild_tensor_v2, (storage, 0, shape, stride, requires_grad, OrderedDict())
    return torch._utils._rebuild_tensor_v3, (storage, 0, shape, stride, requires_grad, OrderedDict(), dtype)


def global_pid(skeleton_key_: str, dtype: torch.dtype, shape: tuple[int, ...], location: str) -> tuple:
    """The persistent id of a global tensor's storage, as ``flatten`` writes it for the
    stand-in of :func:`_global_stand_in`."""
    if _has_typed_storage(dtype):
        storage_type = getattr(torch, torch.storage._dtype_to_storage_type_map()[dtype])
        return ("storage", storage_type, skeleton_key_, location, math.prod(shape))
    return ("storage", torch.UntypedStorage, skeleton_key_, location, math.prod(shape) * dtype.itemsize)


def global_skeleton(entries, pickle_protocol: int = 2) -> bytes:
    """A skeleton for tensors another writer laid out (``ckptstore.dcp``): the pickled
    dict {key: the global tensor ``key``}, ``entries`` mapping each key to its (dtype,
    shape). Loading it without a process group gives every tensor whole."""
    global_refs: dict = {}

    class _Global:  # one per key: pickled as its reduce value
        def __init__(self, value):
            self.value = value

    refs = {key: _Global(_global_stand_in(key, dtype, tuple(shape), "cpu", False, global_refs))
            for key, (dtype, shape) in entries.items()}

    class _Pickler(pickle.Pickler):
        def persistent_id(self, o):
            if not (isinstance(o, torch.storage.TypedStorage) or torch.is_storage(o)):
                return None
            storage, _, storage_type, numel = _storage_pid(o)
            key, location = global_refs[storage._cdata]
            return ("storage", storage_type, key, location, numel)

        def reducer_override(self, o):
            return o.value if type(o) is _Global else NotImplemented

    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle_protocol).dump(refs)
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
    least), each contiguous in memory. Yields (offsets, sizes, byte offset, nbytes).
    (The staging's :func:`~ckptstore.staging.strided.row_major_boxes`.)"""
    return row_major_boxes(shape, itemsize, limit)


def region_byte_offset(shape, offsets, itemsize: int) -> int:
    """Byte offset of a region's first element in the row-major tensor."""
    stride, off = itemsize, 0
    for d in reversed(range(len(shape))):
        off += offsets[d] * stride
        stride *= shape[d]
    return off


__all__ = ["DTensorRef", "GLOBAL", "LOCAL", "LocalBox", "StorageRef", "UnserializableTensorError", "dtensor_boxes",
           "flatten", "global_pid", "global_rebuild", "global_skeleton", "implied_storage_dtype", "index_pid", "local_tensor", "parse_skeleton_key", "plan_chunks", "region_byte_offset",
           "skeleton_key", "tensor_paths", "unsaveable_local_kind"]
