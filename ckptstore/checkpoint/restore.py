"""Loading: read and check every chunk a manifest names, rebuild the object (which
manifest is the visible one: manifests.py).

Every blob read is decoded and its xxh3-128 compared with the manifest before any of
its bytes reach the caller (I3). The skeleton is unpickled with torch's weights-only
unpickler unless the caller opts out, so a load runs no code from the checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import math
import pickle
import pickletools
import re
import struct

import torch

from .. import format as fmt
from .._gc import gc_paused
from ..codecs import check_stated_size
from ..errors import CkptStoreError, FormatError, UnsafeLoadError
from ..storage import Storage
from .dtype_record import check_dtype_record, check_storage_dtype
from .flatten import GLOBAL, LOCAL, implied_storage_dtype, parse_skeleton_key, region_byte_offset, skeleton_key
from .reader import BlobRead, check_extents, read_blobs
from .walk import tensors_in
from .weights_only import weights_only_refusal


def _tensor_reads(tensors: dict[str, fmt.TensorEntry], where: str, reads: list[BlobRead],
                  storage: Storage) -> dict[str, torch.UntypedStorage]:
    """New CPU storages for ``tensors``, and (appended to ``reads``) the reads that fill them.

    A chunk whose region is contiguous in the tensor (rows of a row-major tensor) is
    read straight into place; any other region (a column shard, say) is read whole and
    copied into a strided view of the tensor.
    """
    out: dict[str, torch.UntypedStorage] = {}
    for key, entry in tensors.items():
        size = fmt.itemsize(entry.dtype)
        nbytes = entry.nbytes
        try:
            data = torch.empty(nbytes, dtype=torch.uint8)
        except RuntimeError as e:  # the manifest's claim is within the format's bounds, not this machine's
            # unless its frames say otherwise: a claim they do not state is the manifest's fault
            _check_stated_sizes(storage, entry, f"{where}: tensor {key!r}")
            raise MemoryError(f"{where}: tensor {key!r} needs {nbytes} bytes, which cannot be "
                              f"allocated here: {e}") from e
        view = memoryview(data.numpy())  # (also what makes the storage fixed-size: _check_not_grown)
        what = f"{where}: tensor {key!r}"
        chunks = entry.chunks
        if len(chunks) == 1 and chunks[0].sizes == entry.shape:  # the whole tensor (most tensors)
            reads.append(BlobRead(chunks[0].blob, what, view))
            out[key] = data.untyped_storage()
            continue
        for c in chunks:
            if _contiguous_region(entry.shape, c.offsets, c.sizes):
                start = region_byte_offset(entry.shape, c.offsets, size)
                reads.append(BlobRead(c.blob, what, view[start:start + c.blob.raw_length]))
            else:
                full = data.view(fmt.dtype_from_name(entry.dtype)).reshape(entry.shape)
                reads.append(BlobRead(c.blob, what, None, functools.partial(_into_region, c, full)))
        out[key] = data.untyped_storage()
    return out


def _check_stated_sizes(storage: Storage, entry: fmt.TensorEntry, what: str) -> None:
    """FormatError when a compressed chunk's zstd frame header (its first 18 bytes at
    most) does not state the raw length the manifest gives it."""
    for c in entry.chunks:
        blob = c.blob
        if blob.codec and blob.codec[-1].get("id") == "zstd":
            try:
                header = storage.read(blob.file, blob.offset, min(blob.length, _ZSTD_HEADER_MAX))
            except Exception:  # unreadable now: this chunk says nothing (the load reads it, if ever)
                continue
            check_stated_size(list(blob.codec), header, blob.raw_length, f"{what} (file {blob.file}, offset {blob.offset})")


_ZSTD_HEADER_MAX = 18  # a zstd frame header's largest size (magic 4 + descriptor 1 + window 1 + dict id 4 + size 8)


class _MetaStorages:
    """Meta storages of ``tensors``' sizes, each made when the skeleton first names it:
    what a load under a FakeTensorMode rebuilds its tensors over, as torch.load does,
    reading none of their bytes (and verify, whose ranks name few of the global ones)."""

    def __init__(self, tensors: dict[str, fmt.TensorEntry]):
        self._tensors = tensors

    def __contains__(self, key: str) -> bool:
        return key in self._tensors

    def __getitem__(self, key: str) -> torch.UntypedStorage:
        return torch.UntypedStorage(self._tensors[key].nbytes, device="meta")  # (loaded[] keeps one per key)


def _fake_location(location: str, map_location):
    """Where a fake tensor saved at ``location`` says it is: torch.load's rule under a
    FakeTensorMode (torch._utils._get_restore_location), which applies a str, device or
    dict ``map_location`` and leaves a callable one aside."""
    if isinstance(map_location, dict):
        return torch.device(map_location.get(location, location))
    if isinstance(map_location, (str, torch.device)):
        return torch.device(map_location)
    return torch.device(location)


def _place_fake_tensors(tensors: list[torch.Tensor], devices: dict[int, torch.device]) -> None:
    """Give each fake tensor the device its storage was saved on (``devices``: by the
    id of the meta storage it was rebuilt over); torch's own ``_rebuild_tensor_v2``
    does it per tensor, the plain ``_rebuild_tensor`` of no-grad tensors does not."""
    from torch._subclasses.fake_tensor import FakeTensor

    for t in tensors:
        if isinstance(t, FakeTensor) and t.layout == torch.strided:  # (a sparse one has no storage)
            device = devices.get(id(t.untyped_storage()))
            if device is not None:
                t.fake_device = device


def _check_meta_extents(tensors: list[torch.Tensor], growable: list[tuple[str, torch.UntypedStorage, int]],
                        where: str) -> None:
    """FormatError for a tensor over a meta storage (a fake one's too) that reaches past
    it: meta's set_ checks no bounds (a stride of 2**62 passes it), a CPU one does."""
    keys = {id(untyped): key for key, untyped, _ in growable}
    for t in tensors:
        if t.layout != torch.strided or not t.numel():
            continue
        storage = t.untyped_storage()
        if storage.device.type != "meta":
            continue
        reach = (t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * t.element_size()
        if reach > storage.nbytes():
            raise FormatError(f"{where}: malformed object skeleton: it rebuilds tensor "
                              f"{keys.get(id(storage), '?')!r} (shape {list(t.shape)}, strides {list(t.stride())}, "
                              f"offset {t.storage_offset()}) past the {storage.nbytes()} bytes stored")


def _contiguous_region(shape, offsets, sizes) -> bool:
    """Whether a region is one contiguous run of a row-major tensor: all dimensions
    after the first partial one are whole, and all before it have size one."""
    partial = [d for d in range(len(shape)) if sizes[d] != shape[d]]
    if not partial:
        return True
    first = partial[0]
    return all(sizes[d] == 1 for d in range(first)) and all(sizes[d] == shape[d] for d in range(first + 1, len(shape)))


def _into_region(c: fmt.Chunk, full: torch.Tensor, raw: torch.Tensor) -> None:
    full[tuple(slice(o, o + n) for o, n in zip(c.offsets, c.sizes))] = raw.view(full.dtype).reshape(c.sizes)


def read_regions(storage: Storage, requests, pool) -> list[torch.Tensor]:
    """One CPU tensor per ``(entry, where, offsets, sizes)``: that region of a stored
    tensor, assembled from the chunks that overlap it. Each overlapping chunk is read
    whole and its hash checked (I3): a load reads only the chunks it needs, never
    unverified bytes. The chunks of all regions together are read in parallel and small
    neighbours coalesced (:func:`plan_reads`), each chunk once however many regions
    overlap it. The collector is paused meanwhile, as in :func:`restore`."""
    with gc_paused():
        return _read_regions(storage, requests, pool)


def _read_regions(storage: Storage, requests, pool) -> list[torch.Tensor]:
    outs: list[torch.Tensor] = []
    reads: list[BlobRead] = []
    pending: dict[int, tuple[BlobRead, list]] = {}  # id(chunk) -> its read and the regions it fills
    for entry, where, offsets, sizes in requests:
        dtype = fmt.dtype_from_name(entry.dtype)
        out = torch.empty(tuple(sizes), dtype=dtype)
        outs.append(out)
        if out.numel() == 0:
            continue
        parts, total = [], 0
        for c in entry.chunks:
            lo = [max(a, b) for a, b in zip(offsets, c.offsets)]
            hi = [min(a + n, b + m) for a, n, b, m in zip(offsets, sizes, c.offsets, c.sizes)]
            if any(h <= low for low, h in zip(lo, hi)):
                continue
            part = _Region(tuple(a - o for a, o in zip(lo, offsets)), tuple(h - a for a, h in zip(lo, hi)))
            parts.append(part)
            total += math.prod(part.sizes)
            src = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, c.offsets))
            dst = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets))
            if id(c) not in pending:
                targets: list = []
                r = BlobRead(c.blob, where, None, functools.partial(_into_regions, c, dtype, targets))
                pending[id(c)] = (r, targets)
                reads.append(r)
            pending[id(c)][1].append((out, dst, src))
        # Nothing of the region may stay unwritten (a version 4 reader gathers chunks
        # from several indexes): the chunks that overlap it cover it exactly once.
        if total != out.numel():
            raise FormatError(f"{where}: the checkpoint's chunks cover {total} of the {out.numel()} elements "
                              f"at {list(offsets)} size {list(sizes)}")
        fmt.check_exact_cover(tuple(sizes), parts, f"{where}: region at {list(offsets)}")
    read_blobs(storage, reads, pool)
    return outs


@dataclasses.dataclass(frozen=True, slots=True)
class _Region:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


def _into_regions(c: fmt.Chunk, dtype: torch.dtype, targets: list, raw: torch.Tensor) -> None:
    data = raw.view(dtype).reshape(c.sizes)
    for out, dst, src in targets:
        out[dst] = data[src]


def restore(storage: Storage, manifest: fmt.Manifest, rank: int, map_location=None,
            weights_only: bool = True, pool=None, pickle_load_args=None, globals_as_meta: bool = False,
            pickle_module=pickle, meta: bool = False):
    """Rebuild the object rank ``rank`` saved. Global tensors come back whole
    (consolidated) or, with ``globals_as_meta``, as meta tensors for a template to fill.
    ``meta``: every tensor comes back on the meta device and only the skeleton is read
    (what verify rebuilds a skeleton with); a rebuild that has no meta kernel (quantized,
    nested tensors) raises its NotImplementedError as it is."""
    from ..runtime import runtime

    if isinstance(map_location, torch.device) and map_location.type == "meta":
        map_location = "meta"  # as torch.load: meta:0 is the meta device (no index to restore to)
    pool = pool or runtime().readers
    where = storage.describe()
    try:
        state = next(r for r in manifest.ranks if r.rank == rank)
    except StopIteration:
        raise FormatError(f"{where}: the checkpoint holds no state for rank {rank}") from None
    if manifest.byteorder != "little":
        raise FormatError(f"{where}: big-endian checkpoints are not supported")
    # Every extent checked against its file before anything is allocated for it: a
    # manifest claiming more than its files hold costs nothing.
    wanted = [] if meta else [(c.blob, f"{where}: tensor {key!r}") for key, e in state.tensors.items()
                              for c in e.chunks]
    if not (globals_as_meta or meta):
        wanted += [(c.blob, f"{where}: tensor {key!r}") for key, e in manifest.tensors.items() for c in e.chunks]
    wanted.append((state.skeleton, f"{where}: object skeleton of rank {rank}"))
    check_extents(storage, wanted, pool)
    # One plan for all of it, so neighbours coalesce across tensors, global tensors and
    # the skeleton; the skeleton comes last: a damaged file then reports the tensor it
    # hit, not the skeleton.
    reads: list[BlobRead] = []
    # A tensor and a read per stored tensor, and a few objects per blob read: no
    # whole-heap collections meanwhile (in a process holding a large state, each took
    # 0.1-0.3 s, several per 10,000-tensor load).
    # Under a FakeTensorMode (torch.compile, export, meta initialisation) torch.load reads
    # no tensor bytes: it rebuilds fake tensors over meta storages. So does this, reading
    # only the skeleton (as real bytes, its hash checked).
    fake = not meta and torch._guards.detect_fake_mode(None) is not None  # (meta: its caller has none)
    over_meta = fake or meta
    tensor_reads = _MetaStorages if over_meta else functools.partial(_tensor_reads, where=where, reads=reads,
                                                                     storage=storage)
    with gc_paused(), _real_tensors(fake):
        raw = tensor_reads(state.tensors)
        raw_globals = {} if globals_as_meta else tensor_reads(dict(manifest.tensors))
        skeleton: list[torch.Tensor] = []  # allocated only once its stored bytes passed their checks
        reads.append(BlobRead(state.skeleton, f"{where}: object skeleton of rank {rank}", None, skeleton.append))
        read_blobs(storage, reads, pool, extents_checked=True)
        stream = io.BytesIO(memoryview(skeleton[0].numpy()) if skeleton[0].numel() else b"")

    fake_devices: dict[int, torch.device] = {}  # a meta storage's id -> where its fake tensor is

    def keep_meta(untyped, location):  # the meta storage stays; its fake tensor is placed after
        fake_devices[id(untyped)] = _fake_location(location, map_location)
        return untyped

    if meta:
        restore_location = _as_is
    else:
        restore_location = keep_meta if fake else torch.serialization._get_restore_location(map_location)
    placement_errors: list[BaseException] = []  # map_location's own: raised as torch raises them

    def place(untyped, location):
        try:
            return restore_location(untyped, location)
        except BaseException as e:
            placement_errors.append(e)
            raise
    loaded: dict[str, torch.storage.TypedStorage] = {}  # by skeleton key
    # Storages a rebuild could grow, and the bytes they held: the meta storages, and any
    # map_location made (a load's own CPU storages are fixed-size: shared with numpy).
    growable: list[tuple[str, torch.UntypedStorage, int]] = []

    def hand_out(ref: str, key: str, typed: torch.storage.TypedStorage, read=None):
        loaded[ref] = typed
        if over_meta or typed._untyped_storage is not read:
            growable.append((key, typed._untyped_storage, typed._untyped_storage.nbytes()))
        return typed

    local_keys: list[str] | None = None  # made on the first index persistent id
    local_ref = skeleton_key(LOCAL, "")  # the prefix, formatted once (an enum's format is Python code)

    def storage_at(pid: int):
        """Version 2's index persistent id ("storage", index): the rank's tensor at that
        index, over the storage its entry implies (flatten.implied_storage_dtype)."""
        nonlocal local_keys
        if local_keys is None:
            if manifest.format_version < 2:
                raise FormatError(f"{where}: the skeleton names a storage by index ({pid}), "
                                  f"which format version {manifest.format_version} does not allow")
            local_keys = list(state.tensors)
        if not 0 <= pid < len(local_keys):
            raise FormatError(f"{where}: the skeleton names tensor index {pid}; rank {rank} stored "
                              f"{len(local_keys)} tensors")
        key = local_keys[pid]
        ref = local_ref + key
        typed = loaded.get(ref)
        if typed is None:
            dtype = implied_storage_dtype(fmt.dtype_from_name(state.tensors[key].dtype))
            untyped = raw[key]
            typed = torch.storage.TypedStorage(wrap_storage=place(untyped, "cpu"), dtype=dtype, _internal=True)
            hand_out(ref, key, typed, untyped)
        return typed

    def persistent_load(pid):
        if type(pid) is tuple and len(pid) == 2 and pid[0] == "storage" and type(pid[1]) is int:
            return storage_at(pid[1])
        if not isinstance(pid, tuple) or len(pid) != 5 or pid[0] != "storage":
            raise FormatError(f"{where}: unexpected persistent id {pid!r} in the skeleton")
        storage_type, ref, location, numel = pid[1:]
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else getattr(storage_type, "dtype", None)
        if (not isinstance(ref, str) or not isinstance(location, str) or not isinstance(dtype, torch.dtype)
                or type(numel) is not int or numel < 0):
            raise FormatError(f"{where}: malformed storage reference {str(pid)[:200]} in the skeleton")
        if ref in loaded:
            return loaded[ref]
        try:
            scope, key = parse_skeleton_key(ref)
        except (ValueError, AttributeError):
            raise FormatError(f"{where}: bad tensor reference {ref!r} in the skeleton") from None
        if scope == GLOBAL and globals_as_meta:
            if key not in manifest.tensors:
                raise FormatError(f"{where}: the skeleton names global tensor {key!r}, which the manifest lacks")
            if storage_type is not torch.UntypedStorage:
                check_storage_dtype(manifest.tensors[key], dtype, key, where)
            if manifest.tensors[key].nbytes != numel * dtype.itemsize:
                raise FormatError(f"{where}: global tensor {key!r} holds {manifest.tensors[key].nbytes} bytes, "
                                  f"skeleton expects {numel * dtype.itemsize}")
            typed = torch.storage.TypedStorage(wrap_storage=torch.UntypedStorage(numel * dtype.itemsize, device="meta"),
                                               dtype=dtype, _internal=True)
            return hand_out(ref, key, typed)
        table = raw_globals if scope == GLOBAL else raw
        if key not in table:
            raise FormatError(f"{where}: the skeleton names tensor {key!r}, which the manifest lacks")
        if storage_type is not torch.UntypedStorage:
            check_storage_dtype((manifest.tensors if scope == GLOBAL else state.tensors)[key], dtype, key, where)
        untyped = table[key]
        if untyped.nbytes() != numel * dtype.itemsize:
            raise FormatError(f"{where}: tensor {key!r} holds {untyped.nbytes()} bytes, skeleton expects {numel * dtype.itemsize}")
        typed = torch.storage.TypedStorage(wrap_storage=place(untyped, location), dtype=dtype, _internal=True)
        return hand_out(ref, key, typed, untyped)

    args = {"encoding": "utf-8", **(pickle_load_args or {})}
    if weights_only:
        unpickler = torch._weights_only_unpickler.Unpickler(stream, **args)
    else:
        unpickler = _full_unpickler(pickle_module)(stream, **args)
    unpickler.persistent_load = persistent_load
    # torch's rebuilds of tensors not over a storage (wrapper subclasses, numpy-made)
    # read map_location from serialization's thread-local, as torch.load sets it
    tls = getattr(torch.serialization, "_serialization_tls", None)
    outer_map_location = getattr(tls, "map_location", None)
    try:
        if tls is not None:
            tls.map_location = map_location
        try:
            with gc_paused():  # rebuilds every tensor: no whole-heap collections meanwhile
                result = unpickler.load()
            check_dtype_record(stream.read(), state.tensors, where)  # (after the pickle's STOP)
        finally:
            if tls is not None:
                tls.map_location = outer_map_location
        _check_not_grown(growable, where)
    except CkptStoreError:
        raise
    except pickle.UnpicklingError as e:
        if weights_only and _parses(stream.getvalue()):  # a pickle the allow-list refuses, not a broken one
            raise UnsafeLoadError(f"{where}: {weights_only_refusal(e)}") from e
        raise FormatError(f"{where}: cannot unpickle the object skeleton: {e}") from e
    except EOFError as e:
        raise FormatError(f"{where}: the object skeleton ends early: {e}") from e
    except (TypeError, ValueError, AttributeError, IndexError, KeyError, OverflowError, RecursionError,
            RuntimeError, struct.error) as e:
        if (not weights_only or any(e is p for p in placement_errors) or _machines_limit(e, state, manifest)
                or (isinstance(e, NotImplementedError) and _any_meta(over_meta, growable))
                or (callable(map_location) and "map_location" in str(e))):
            # The checkpoint's own classes ran (opted in): their errors are theirs. A
            # map_location to a missing device (or a callable one, which torch's rebuild
            # of a wrapper subclass refuses), a rebuild that allocates more than the
            # machine has (a quantized tensor's), or one with no meta kernel (a
            # quantized or nested tensor's, on meta storages) fails as in torch.load.
            raise
        # The allow-list runs no code of the checkpoint's: these come from a malformed
        # skeleton (rebuild functions given arguments of the wrong kind or size, a
        # storage that does not hold the tensor the skeleton builds on it).
        raise FormatError(f"{where}: malformed object skeleton: {type(e).__name__}: {e}") from e
    _validate_sparse = getattr(torch._utils, "_validate_loaded_sparse_tensors", None)
    if _validate_sparse is not None:
        _validate_sparse()
    if _any_meta(over_meta, growable):  # (a fake load's too: one walk for both)
        tensors = list(tensors_in(result, attributes=True))
        _check_meta_extents(tensors, growable, where)
        if fake:
            _place_fake_tensors(tensors, fake_devices)
    return result


def _as_is(untyped, location):
    return untyped


def _any_meta(over_meta: bool, growable: list[tuple[str, torch.UntypedStorage, int]]) -> bool:
    """Whether tensors were rebuilt over meta storages (a meta or fake load, or a
    map_location to meta)."""
    return over_meta or any(untyped.device.type == "meta" for _, untyped, _ in growable)


def _parses(data: bytes) -> bool:
    """Whether ``data`` is a well-formed pickle (read, never run: pickletools)."""
    try:
        for _ in pickletools.genops(data):
            pass
    except Exception:
        return False
    return True


def _check_not_grown(growable: list[tuple[str, torch.UntypedStorage, int]], where: str) -> None:
    """FormatError when a rebuild reached past a tensor's stored bytes: torch grows a
    resizable storage to fit the tensor a rebuild asks for, where a fixed-size one
    makes the rebuild fail."""
    for key, untyped, nbytes in growable:
        if untyped.nbytes() != nbytes:
            raise FormatError(f"{where}: malformed object skeleton: it rebuilds tensor {key!r} over "
                              f"{untyped.nbytes()} bytes, {nbytes} stored")


_OOM = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError  # (torch.OutOfMemoryError: 2.5+)


def _out_of_memory(e: BaseException) -> bool:
    return isinstance(e, _OOM) or (isinstance(e, RuntimeError) and "allocate" in str(e))


# What torch's allocators say: "tried to allocate 1125899906842624 bytes" (CPU),
# "Tried to allocate 1024.00 GiB" (CUDA).
_TRIED = re.compile(r"tried to allocate (\d+(?:\.\d+)?) ?(bytes|B|KiB|MiB|GiB|TiB|PiB)\b", re.IGNORECASE)
_UNITS = {"bytes": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "pib": 1 << 50}


def _machines_limit(e: BaseException, state: fmt.RankState, manifest: fmt.Manifest) -> bool:
    """Whether ``e`` is an allocation failure a sound skeleton could meet: the machine's
    limit. A rebuild asking for more than the rank's tensors stored in all (a quantized
    tensor's, sized by the skeleton) is the skeleton's fault."""
    if not _out_of_memory(e):
        return False
    found = _TRIED.search(str(e))
    if not found:
        return True
    asked = float(found.group(1)) * _UNITS[found.group(2).lower()]
    stored = sum(t.nbytes for t in state.tensors.values()) + sum(t.nbytes for t in manifest.tensors.values())
    return asked <= stored * 1.01  # (a rounded figure: "1024.00 GiB")


def _real_tensors(fake: bool):
    """A context in which tensors are real even under a FakeTensorMode (the skeleton's
    bytes are read and hashed for real), or nothing."""
    if not fake:
        return contextlib.nullcontext()
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


class _StorageType:
    """What ``find_class`` returns for legacy storage classes (as torch.load does)."""

    def __init__(self, name: str):
        self.dtype = torch.serialization.StorageType(name).dtype


def _full_unpickler(pickle_module=pickle):
    """weights_only=False: ``pickle_module``'s Unpickler (runs code by design), with
    torch's storage names, as torch.load's own wrapper does. Not cached: a
    ``pickle_module`` need not be hashable."""

    class _FullUnpickler(pickle_module.Unpickler):
        def find_class(self, module, name):
            if isinstance(name, str) and "Storage" in name:
                try:
                    return _StorageType(name)
                except (KeyError, AttributeError):
                    pass
            if module == "torch.tensor":
                module = "torch._tensor"
            return super().find_class(module, name)

    return _FullUnpickler
