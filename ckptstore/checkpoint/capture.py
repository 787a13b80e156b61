"""Capture a plain state in a few microseconds per tensor; pickle its skeleton later.

Most checkpoints are containers of plain tensors and plain values: a model's and an
optimizer's state dicts, a scheduler's, counters, the RNG states. For those,
:func:`capture` walks the object once on the caller's thread and keeps a frozen copy
of its structure: every container rebuilt, every tensor reduced to what torch would
pickle for it (storage, offset, size, stride, requires_grad). The skeleton is then
pickled from that copy by :func:`pickle_captured` on a worker thread, after ``save``
has returned and while the caller changes the original. Pickling on the caller's
thread (``flatten``) costs about 25 us per tensor, most of it in torch's
``Tensor.__reduce_ex__``; the walk costs a few.

The skeleton is the one ``flatten`` writes: the same rebuild functions with the same
arguments, the same persistent ids, and storage keys named after the same first path,
so a load cannot tell which path wrote it (tests/test_capture.py compares both).

Anything else makes :func:`capture` return None, and the caller pickles with
``flatten`` as before: a user class, a container subclass other than OrderedDict, a
tensor subclass or DTensor, a tensor off the CPU, sparse, quantized, nested,
conjugated or negated tensors, a tensor with Python attributes or backward hooks, a
buffer viewed as several dtypes, bytes (the weights-only audit watches them), a
custom ``pickle_module`` or a pickle protocol other than 2 (the default, and the one
the weights-only load reads: others get ``flatten``'s warning).
"""

from __future__ import annotations

import functools
import pickle
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..scopes import Scope
from .flatten import StorageRef, _unique, entry_shape, skeleton_key

__all__ = ["Captured", "capture", "pickle_captured"]

_LEAVES = frozenset({type(None), bool, int, float, str})
_V3_DTYPES = frozenset(torch.storage._new_dtypes())  # pickled over untyped bytes (_rebuild_tensor_v3)
_STRIDED = torch.strided
_rebuild_v2 = torch._utils._rebuild_tensor_v2
_rebuild_v3 = torch._utils._rebuild_tensor_v3
_rebuild_parameter = torch._utils._rebuild_parameter
_tensor_metadata = torch._C._get_tensor_metadata


class _NotPlain(Exception):
    """The object holds something only ``flatten`` pickles faithfully."""


class _Storage:
    """A storage in the frozen copy: pickled as its persistent id."""

    __slots__ = ("pid",)

    def __init__(self, pid: tuple):
        self.pid = pid


class _Tensor:
    """A tensor in the frozen copy: what torch's reduce would record for it."""

    __slots__ = ("storage", "offset", "size", "stride", "requires_grad", "v3_dtype")

    def __init__(self, storage, offset, size, stride, requires_grad, v3_dtype):
        self.storage = storage
        self.offset = offset
        self.size = size
        self.stride = stride
        self.requires_grad = requires_grad
        self.v3_dtype = v3_dtype  # None: pickled over a typed storage (_rebuild_tensor_v2)


class _Parameter:
    __slots__ = ("data", "requires_grad")

    def __init__(self, data: _Tensor, requires_grad: bool):
        self.data = data
        self.requires_grad = requires_grad


@dataclass
class Captured:
    """A plain state, captured: its frozen structure and the distinct storages to stage
    (with each one's data pointer, so the copy needs no further look-up)."""

    frozen: object
    storages: list[tuple[StorageRef, int]]


@functools.cache
def _typed_storage_class(dtype: torch.dtype):
    return getattr(torch, torch.storage._dtype_to_storage_type_map()[dtype])


def capture(obj, max_depth: int = 200) -> Captured | None:
    """Walk a plain state (see the module docstring); None when it is not one."""
    memo: dict[int, object] = {}  # id(original container or tensor) -> its frozen copy
    open_tuples: set[int] = set()  # tuples whose items are being visited
    firsts: dict[int, tuple[str, torch.Tensor]] = {}  # storage cdata -> first path and tensor reaching it
    tokens: dict = {}  # storage cdata (an unallocated one: (cdata, dtype)) -> _Storage
    dtypes: dict[int, torch.dtype] = {}  # data pointer -> the dtype it is pickled as
    used: set[str] = set()
    storages: list[tuple[StorageRef, int]] = []

    def frozen_tensor(t: torch.Tensor, path: str, requires_grad: bool) -> _Tensor:
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
        token = tokens.get(ident)
        v3 = dtype in _V3_DTYPES
        if token is None:
            first_path, first = firsts.get(cdata) or firsts.setdefault(cdata, (path or "tensor", t))
            # Named, and shaped, after the first path reaching the storage, as flatten does
            # (they differ from this tensor's only for an unallocated storage viewed as
            # several dtypes).
            nbytes = s.nbytes()
            itemsize = dtype.itemsize
            if v3:
                pid_type, pid_numel = torch.UntypedStorage, nbytes
                entry_dtype, numel = (dtype, nbytes // itemsize) if nbytes % itemsize == 0 else (torch.uint8, nbytes)
            else:
                pid_type, pid_numel = _typed_storage_class(dtype), nbytes // itemsize
                entry_dtype, numel = dtype, pid_numel
            key = _unique(first_path, used)
            token = tokens[ident] = _Storage(("storage", pid_type, skeleton_key(Scope.LOCAL, key), "cpu", pid_numel))
            ref = StorageRef(key, s, entry_dtype, entry_shape(first, numel, entry_dtype), "cpu")
            storages.append((ref, ptr))
        return _Tensor(token, t.storage_offset(), tuple(t.shape), t.stride(), requires_grad, dtype if v3 else None)

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
                out = _Parameter(frozen_tensor(o, path, False), o.requires_grad)
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
    except (_NotPlain, RuntimeError, RecursionError, KeyError):
        # RuntimeError: torch refused a query (a ZeroTensor, ...); KeyError: a dtype with
        # no storage class (int1..int7, say): flatten gives torch's own error for it
        return None
    return Captured(frozen, storages)


def pickle_captured(frozen) -> bytes:
    """The skeleton of a captured state (``Captured.frozen``), as ``flatten`` would
    have pickled the original (protocol 2)."""
    import io

    buf = io.BytesIO()
    _FrozenPickler(buf, protocol=2).dump(frozen)
    return buf.getvalue()


class _NoHooks:
    """A tensor's backward hooks as torch pickles them: a new empty OrderedDict for each
    tensor (the rebuilt tensor keeps it as its hook table: it must not be shared).
    Reduced directly, which gives the same opcodes as pickling an empty OrderedDict
    without the copyreg look-up that costs a few microseconds per tensor."""

    __slots__ = ()


_EMPTY_ORDERED_DICT = (OrderedDict, ())


class _FrozenPickler(pickle.Pickler):
    def persistent_id(self, o):
        return o.pid if type(o) is _Storage else None

    def reducer_override(self, o):
        kind = type(o)
        if kind is _Tensor:
            if o.v3_dtype is None:
                return _rebuild_v2, (o.storage, o.offset, o.size, o.stride, o.requires_grad, _NoHooks())
            return _rebuild_v3, (o.storage, o.offset, o.size, o.stride, o.requires_grad, _NoHooks(), o.v3_dtype)
        if kind is _NoHooks:
            return _EMPTY_ORDERED_DICT
        if kind is _Parameter:
            return _rebuild_parameter, (o.data, o.requires_grad, _NoHooks())
        return NotImplemented
