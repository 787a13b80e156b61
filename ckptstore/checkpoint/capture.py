"""Capture a plain state in a few microseconds per tensor; pickle its skeleton later.

Most checkpoints are containers of plain tensors and plain values: a model's and an
optimizer's state dicts (FSDP2's hold DTensors), a scheduler's, counters, the RNG
states. For those,
:func:`capture` walks the object once on the caller's thread and keeps a frozen copy
of its structure: every container rebuilt, every tensor reduced to what torch would
pickle for it (storage, offset, size, stride, requires_grad; a DTensor: its global
tensor's key, dtype and shape, as ``flatten``'s stand-in). The skeleton is then
pickled from that copy by :func:`pickle_captured` on a worker thread, after ``save``
has returned and while the caller changes the original. Pickling on the caller's
thread (``flatten``) costs about 25 us per tensor, most of it in torch's
``Tensor.__reduce_ex__``, and 40-60 us per DTensor; the walk costs a few.

The skeleton is the one ``flatten`` writes: the same rebuild functions with the same
arguments, the same persistent ids, and storage keys named after the same first path,
so a load cannot tell which path wrote it (tests/test_capture.py compares both), but for
one thing: a tensor's empty backward-hook table is pickled as None (see
``_FrozenPickler``), so its rebuilt tensor has no table, as a tensor made afresh has none.

Anything else makes :func:`capture` return None, and the caller pickles with
``flatten`` as before: a user class, a container subclass other than OrderedDict, a
tensor subclass, a tensor (or a DTensor's local tensor) off the CPU, sparse, quantized, nested,
conjugated or negated tensors, a tensor with Python attributes or backward hooks, a
buffer viewed as several dtypes, bytes (the weights-only audit watches them), a
custom ``pickle_module`` or a pickle protocol other than 2 (the default, and the one
the weights-only load reads: others get ``flatten``'s warning).
"""

from __future__ import annotations

import pickle
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..scopes import Scope
from .flatten import (DTensorRef, StorageRef, _dtensor_class, _unique, entry_shape, global_pid, global_rebuild,
                      implied_storage_dtype, index_pid, local_tensor, skeleton_key, unsaveable_local_kind)

__all__ = ["Captured", "capture", "pickle_captured"]

_LEAVES = frozenset({type(None), bool, int, float, str})
_V3_DTYPES = frozenset(torch.storage._new_dtypes())  # pickled over untyped bytes (_rebuild_tensor_v3)
_STRIDED = torch.strided
_rebuild_plain = torch._utils._rebuild_tensor
_rebuild_v2 = torch._utils._rebuild_tensor_v2
_rebuild_v3 = torch._utils._rebuild_tensor_v3
_rebuild_parameter = torch._utils._rebuild_parameter
_tensor_metadata = torch._C._get_tensor_metadata


class _NotPlain(Exception):
    """The object holds something only ``flatten`` pickles faithfully."""


# The frozen copy outlives ``save`` until a worker has pickled it, so its per-tensor
# records are exact tuples of untracked values (ints, tuples of ints, bools, dtypes and
# these markers): the collector's first young-generation pass stops tracking them, and
# they never reach the older generations. Objects of a class there, five per tensor,
# made the full collections that 100,000 tensors set off land in the blocking time.
# Plain objects (not a GC type, so a record can be untracked); the pickler refuses them,
# so a record the worker failed to turn back into an object fails the save.
_TENSOR = object()  # (_TENSOR, storage index, offset, requires_grad, v3 dtype or None, *size, *stride)
_PARAMETER = object()  # as _TENSOR; requires_grad is the Parameter's (its data pickles with False)
_DTENSOR = object()  # (_DTENSOR, global key, requires_grad, dtype, *global shape): flatten's stand-in


@dataclass
class Captured:
    """A plain state, captured: its frozen structure and its distinct storages.

    ``frozen`` holds each tensor as a record naming its storage by index, which is also
    its persistent id's index (format version 2). Per storage index: ``storages`` what
    staging needs (key, data pointer, entry dtype, then the entry's shape inline);
    ``sources`` the storage itself. ``dtensors``: each DTensor met, in walk order (which
    is pickling order), under its global tensor's key."""

    frozen: object
    storages: list[tuple]
    sources: list
    dtensors: list[DTensorRef]

    def ref(self, index: int) -> StorageRef:
        key, _ptr, dtype, *shape = self.storages[index]
        return StorageRef(key, self.sources[index], dtype, tuple(shape), "cpu")


def capture(obj, max_depth: int = 200) -> Captured | None:
    """Walk a plain state (see the module docstring); None when it is not one."""
    memo: dict[int, object] = {}  # id(original container or tensor) -> its frozen copy
    open_tuples: set[int] = set()  # tuples whose items are being visited
    firsts: dict[int, tuple[str, torch.Tensor]] = {}  # storage cdata -> first path and tensor reaching it
    indexes: dict = {}  # storage cdata (an unallocated one: (cdata, dtype)) -> storage index
    dtypes: dict[int, torch.dtype] = {}  # data pointer -> the dtype it is pickled as
    used: set[str] = set()
    storages: list[tuple] = []
    sources: list = []
    dtensors: list[DTensorRef] = []
    used_global: set[str] = set()
    dtensor_class = _dtensor_class()  # None unless torch.distributed.tensor was imported

    def frozen_tensor(t: torch.Tensor, path: str, requires_grad: bool) -> tuple:
        if (t.__dict__ or not t.is_cpu or t.layout is not _STRIDED or t.is_quantized or t.is_nested
                or t._backward_hooks or _tensor_metadata(t)):
            raise _NotPlain
        s = t.untyped_storage()
        dtype = t.dtype
        cdata = s._cdata
        ptr = s.data_ptr()
        if ptr and dtypes.setdefault(ptr, dtype) != dtype:
            raise _NotPlain  # one buffer, several dtypes: flatten raises torch's error
        ident = cdata if ptr else (cdata, dtype)
        index = indexes.get(ident)
        v3 = dtype in _V3_DTYPES
        if index is None:
            first_path, first = firsts.get(cdata) or firsts.setdefault(cdata, (path or "tensor", t))
            # Named, and shaped, after the first path reaching the storage, as flatten does
            # (they differ from this tensor's only for an unallocated storage viewed as
            # several dtypes).
            nbytes = s.nbytes()
            itemsize = dtype.itemsize
            if v3:
                entry_dtype, numel = (dtype, nbytes // itemsize) if nbytes % itemsize == 0 else (torch.uint8, nbytes)
            else:
                entry_dtype, numel = dtype, nbytes // itemsize
            if implied_storage_dtype(entry_dtype) != (torch.uint8 if v3 else dtype):
                # Its persistent id would need the five-item tuple (flatten writes it, and
                # torch's error for a dtype it cannot pickle, int1..int7 say).
                raise _NotPlain
            key = _unique(first_path, used)
            index = indexes[ident] = len(storages)
            storages.append((key, ptr, entry_dtype, *entry_shape(first, numel, entry_dtype)))
            sources.append(s)
        # Size and stride inline, not as tuples of their own: a tuple holding a tuple is
        # only untracked by the collector's second pass.
        return (_TENSOR, index, t.storage_offset(), requires_grad, dtype if v3 else None, *t.shape, *t.stride())

    def frozen_dtensor(dt, path: str) -> tuple:
        # flatten pickles a DTensor as a plain tensor of its global shape over a global
        # storage, whatever its Python attributes (FSDP2 marks parameters with one).
        local = local_tensor(dt)
        if not local.is_cpu:
            raise _NotPlain  # staging it needs the device path (flatten finds the devices)
        if unsaveable_local_kind(local) is not None:
            raise _NotPlain  # flatten gives these their errors
        key = _unique(path or "tensor", used_global)
        dtensors.append(DTensorRef(key, dt))
        return (_DTENSOR, key, dt.requires_grad, dt.dtype, *dt.shape)

    def visit(o, path: str, depth: int, tensors_allowed: bool = True):
        kind = type(o)
        if kind in _LEAVES:
            return o
        found = memo.get(id(o))
        if found is not None:
            return found
        if depth > max_depth:
            raise _NotPlain
        if kind is torch.Tensor or kind is torch.nn.Parameter:
            if not tensors_allowed:
                raise _NotPlain
            if kind is torch.Tensor:
                out = frozen_tensor(o, path, o.requires_grad)
            else:
                if o.__dict__:
                    raise _NotPlain
                # The record of its data (which pickles with requires_grad False), marked
                # as a Parameter and carrying the Parameter's own requires_grad instead.
                out = (_PARAMETER, *frozen_tensor(o, path, o.requires_grad)[1:])
        elif kind is dtensor_class:
            if not tensors_allowed:
                raise _NotPlain
            out = frozen_dtensor(o, path)
        elif kind is dict or kind is OrderedDict:
            out = memo[id(o)] = kind()
            for k, v in o.items():
                if type(k) not in _LEAVES:
                    raise _NotPlain
                out[k] = visit(v, f"{path}.{k}" if path else str(k), depth + 1, tensors_allowed)
            if kind is OrderedDict and o.__dict__:
                # A module's state_dict carries `_metadata` here; pickled after the items.
                # flatten names no tensor through it, so none may be found there.
                out.__dict__.update(visit(o.__dict__, path, depth + 1, False))
            return out
        elif kind is list:
            out = memo[id(o)] = []
            for i, v in enumerate(o):
                out.append(visit(v, f"{path}.{i}" if path else str(i), depth + 1, tensors_allowed))
            return out
        elif kind is tuple:
            if id(o) in open_tuples:
                raise _NotPlain  # a tuple reached again through its own items: pickle's memo games
            open_tuples.add(id(o))
            items = [visit(v, f"{path}.{i}" if path else str(i), depth + 1, tensors_allowed) for i, v in enumerate(o)]
            open_tuples.discard(id(o))
            out = o if all(a is b for a, b in zip(items, o)) else tuple(items)
        else:
            raise _NotPlain
        memo[id(o)] = out
        return out

    try:
        frozen = visit(obj, "", 0)
    except (_NotPlain, RuntimeError, RecursionError):
        # RuntimeError: torch refused a query (a ZeroTensor, ...)
        return None
    return Captured(frozen, storages, sources, dtensors)


def pickle_captured(frozen, n_storages: int) -> bytes:
    """The skeleton of a captured state (``Captured.frozen``, over its
    ``len(Captured.storages)`` storages), as ``flatten`` would have pickled the original
    (protocol 2): every storage is rank-local and named by its index (format version 2).
    Runs on a worker: it turns the records back into objects the pickler reduces, in
    place (the frozen copy is ckptstore's own and is pickled once)."""
    import io

    storages = [_Storage(index_pid(index)) for index in range(n_storages)]
    buf = io.BytesIO()
    _FrozenPickler(buf, protocol=2).dump(_thaw(frozen, storages, {}, set()))
    return buf.getvalue()


def _thaw(o, storages: list, made: dict, seen: set):
    """``o`` with every record replaced by the object the pickler reduces for it; a record
    or tuple reached twice gives the same object, so the pickle's memo still shares it."""
    kind = type(o)
    if kind is tuple:
        found = made.get(id(o))
        if found is not None:
            return found
        head = o[0] if o else None
        if head is _TENSOR or head is _PARAMETER:
            ndim = (len(o) - 5) // 2
            size, stride = o[5:5 + ndim], o[5 + ndim:]
            if head is _TENSOR:
                out = _Tensor(storages[o[1]], o[2], size, stride, o[3], o[4])
            else:
                out = _Parameter(_Tensor(storages[o[1]], o[2], size, stride, False, o[4]), o[3])
        elif head is _DTENSOR:
            shape = o[4:]
            pid = global_pid(skeleton_key(Scope.GLOBAL, o[1]), o[3], shape, "cpu")
            out = _GlobalTensor(_Storage(pid), o[3], shape, o[2])
        else:
            items = [_thaw(v, storages, made, seen) for v in o]
            out = o if all(a is b for a, b in zip(items, o)) else tuple(items)
        made[id(o)] = out
        return out
    if kind is dict or kind is OrderedDict:
        if id(o) not in seen:
            seen.add(id(o))
            for k, v in o.items():
                if type(v) in _CONTAINERS:
                    o[k] = _thaw(v, storages, made, seen)
            if kind is OrderedDict and o.__dict__:
                # Its attributes (a state_dict's _metadata) may reach a tensor met before.
                _thaw(o.__dict__, storages, made, seen)
    elif kind is list:
        if id(o) not in seen:
            seen.add(id(o))
            for i, v in enumerate(o):
                if type(v) in _CONTAINERS:
                    o[i] = _thaw(v, storages, made, seen)
    return o


_CONTAINERS = frozenset({tuple, list, dict, OrderedDict})


class _Storage:
    """A storage while pickling: pickled as its persistent id."""

    __slots__ = ("pid",)

    def __init__(self, pid: tuple):
        self.pid = pid


class _Tensor:
    """A tensor while pickling: what torch's reduce would record for it."""

    __slots__ = ("storage", "offset", "size", "stride", "requires_grad", "v3_dtype")

    def __init__(self, storage, offset, size, stride, requires_grad, v3_dtype):
        self.storage = storage
        self.offset = offset
        self.size = size
        self.stride = stride
        self.requires_grad = requires_grad
        self.v3_dtype = v3_dtype  # None: pickled over a typed storage (_rebuild_tensor_v2)


class _GlobalTensor:
    """A DTensor while pickling: ``flatten``'s stand-in for it."""

    __slots__ = ("storage", "dtype", "shape", "requires_grad")

    def __init__(self, storage, dtype, shape, requires_grad):
        self.storage = storage
        self.dtype = dtype
        self.shape = shape
        self.requires_grad = requires_grad


class _Parameter:
    __slots__ = ("data", "requires_grad")

    def __init__(self, data: _Tensor, requires_grad: bool):
        self.data = data
        self.requires_grad = requires_grad


class _FrozenPickler(pickle.Pickler):
    def persistent_id(self, o):
        if type(o) is _Storage:
            return o.pid
        if o is _TENSOR or o is _PARAMETER or o is _DTENSOR:
            raise pickle.PicklingError("ckptstore internal error: a captured tensor record reached the pickler")
        return None

    # A tensor's backward hooks are pickled as None, where torch pickles a new empty
    # OrderedDict (which the rebuilt tensor keeps as its hook table): a tensor made
    # afresh has None there too, and None is one pickle opcode where the OrderedDict is
    # four, one of them a REDUCE that the weights-only unpickler checks against its
    # allow-list, on every load.
    #
    # A tensor that needs no gradient is rebuilt by ``_rebuild_tensor`` (storage, offset,
    # size, stride), which torch.load also reads: ``_rebuild_tensor_v2`` would set the
    # flag and the hook table to what a fresh tensor has anyway, and looks for a fake
    # tensor mode on every call (half of its cost: about 5 us a tensor, 0.5 s a load of
    # 100,000 tensors).
    def reducer_override(self, o):
        kind = type(o)
        if kind is _Tensor:
            if o.v3_dtype is None:
                if not o.requires_grad:
                    return _rebuild_plain, (o.storage, o.offset, o.size, o.stride)
                return _rebuild_v2, (o.storage, o.offset, o.size, o.stride, o.requires_grad, None)
            return _rebuild_v3, (o.storage, o.offset, o.size, o.stride, o.requires_grad, None, o.v3_dtype)
        if kind is _Parameter:
            return _rebuild_parameter, (o.data, o.requires_grad, None)
        if kind is _GlobalTensor:
            return global_rebuild(o.storage, o.dtype, o.shape, o.requires_grad)
        return NotImplemented
