"""Loading: find the visible manifest, read and check every chunk, rebuild the object.

Every blob read is decoded and its xxh3-128 compared with the manifest before any of
its bytes reach the caller (I3). The skeleton is unpickled with torch's weights-only
unpickler unless the caller opts out, so a load runs no code from the checkpoint.
"""

from __future__ import annotations

import io
import pickle

import torch

from .. import format as fmt
from ..codecs import decode_into
from ..errors import (
    CheckpointNotFoundError,
    CkptStoreError,
    FormatError,
    IntegrityError,
    NotACheckpointError,
    NotCommittedError,
    ObjectNotFoundError,
    TruncatedObjectError,
    UnsafeLoadError,
)
from ..hashing import Hasher, digest
from ..storage import Storage
from .commit import generations, read_manifest
from .flatten import GLOBAL, parse_skeleton_key, region_byte_offset


def latest_manifest(storage: Storage) -> fmt.Manifest:
    """The visible (highest-generation) manifest of a checkpoint location."""
    for _ in range(5):  # a newer commit may retire what we listed; look again
        gens = generations(storage)
        if not gens:
            break
        try:
            return read_manifest(storage, gens[-1])
        except ObjectNotFoundError:
            continue
    names = storage.list("")
    where = storage.describe()
    if not names:
        if getattr(storage, "is_dir", lambda: False)():
            raise NotACheckpointError(f"{where}: is an empty directory, not a ckptstore checkpoint")
        raise CheckpointNotFoundError(f"{where}: no checkpoint here (no such file or directory)")
    if f"{fmt.ATTEMPTS_DIR}/" in names:
        raise NotCommittedError(f"{where}: holds save attempts but no committed manifest")
    raise NotACheckpointError(f"{where}: exists but is not a ckptstore checkpoint (no manifest)")


def read_blob(storage: Storage, blob: fmt.Blob, out: memoryview, what: str) -> None:
    """Read one blob into ``out`` (its raw length), decode it and check its hash."""
    where = f"{what} (file {blob.file}, offset {blob.offset}, {blob.length} bytes)"
    hasher = None
    try:
        if not blob.codec:
            if blob.length != blob.raw_length:
                raise FormatError(f"{where}: raw blob length {blob.length} != raw_length {blob.raw_length}")
            hasher = Hasher()
            storage.readinto(blob.file, blob.offset, out, on_piece=hasher.update)
        else:
            stored = bytearray(blob.length)
            storage.readinto(blob.file, blob.offset, memoryview(stored))
            decode_into(blob.codec, stored, out, where)
    except ObjectNotFoundError as e:
        raise IntegrityError(f"{where}: file is missing: {e}") from e
    except TruncatedObjectError as e:
        raise IntegrityError(f"{where}: file is truncated: {e}") from e
    except FormatError as e:
        raise IntegrityError(f"{where}: cannot decode: {e}") from e
    actual = hasher.hexdigest() if hasher is not None else digest(out)
    if actual != blob.xxh3_128:
        raise IntegrityError(f"{where}: xxh3-128 mismatch (stored {blob.xxh3_128}, read {actual})")


def read_tensors(storage: Storage, tensors: dict[str, fmt.TensorEntry], where: str,
                 pool) -> dict[str, torch.UntypedStorage]:
    """Read every chunk of every tensor into new CPU storages, all chunks in parallel.

    A chunk whose region is contiguous in the tensor (rows of a row-major tensor) is
    read straight into place; any other region (a column shard, say) is read whole and
    copied into a strided view of the tensor.
    """
    out: dict[str, torch.UntypedStorage] = {}
    jobs = []
    for key, entry in tensors.items():
        size = fmt.itemsize(entry.dtype)
        data = torch.empty(entry.nbytes, dtype=torch.uint8)
        view = memoryview(data.numpy()) if entry.nbytes else memoryview(bytearray())
        what = f"{where}: tensor {key!r}"
        for c in entry.chunks:
            if _contiguous_region(entry.shape, c.offsets, c.sizes):
                start = region_byte_offset(entry.shape, c.offsets, size)
                dst = view[start:start + c.blob.raw_length]
                jobs.append(pool.submit(read_blob, storage, c.blob, dst, what))
            else:
                full = data.view(fmt.dtype_from_name(entry.dtype)).reshape(entry.shape)
                jobs.append(pool.submit(_read_into_region, storage, c, full, what))
        out[key] = data.untyped_storage()
    try:
        for j in jobs:
            j.result()
    finally:
        for j in jobs:
            j.cancel()
    return out


def _contiguous_region(shape, offsets, sizes) -> bool:
    """Whether a region is one contiguous run of a row-major tensor: all dimensions
    after the first partial one are whole, and all before it have size one."""
    partial = [d for d in range(len(shape)) if sizes[d] != shape[d]]
    if not partial:
        return True
    first = partial[0]
    return all(sizes[d] == 1 for d in range(first)) and all(sizes[d] == shape[d] for d in range(first + 1, len(shape)))


def _read_into_region(storage: Storage, c: fmt.Chunk, full: torch.Tensor, what: str) -> None:
    chunk = _read_chunk(storage, c, full.dtype, what)
    full[tuple(slice(o, o + n) for o, n in zip(c.offsets, c.sizes))] = chunk


def read_region(storage: Storage, entry: fmt.TensorEntry, where: str, offsets, sizes, pool) -> torch.Tensor:
    """A CPU tensor holding one region of a stored tensor, assembled from the chunks that
    overlap it. Each overlapping chunk is read whole and its hash checked (I3): a load
    reads only the chunks it needs, never unverified bytes."""
    dtype = fmt.dtype_from_name(entry.dtype)
    out = torch.empty(tuple(sizes), dtype=dtype)
    if out.numel() == 0:
        return out
    jobs = []
    for c in entry.chunks:
        lo = [max(a, b) for a, b in zip(offsets, c.offsets)]
        hi = [min(a + n, b + m) for a, n, b, m in zip(offsets, sizes, c.offsets, c.sizes)]
        if any(h <= low for low, h in zip(lo, hi)):
            continue
        jobs.append((c, lo, hi, pool.submit(_read_chunk, storage, c, dtype, where)))
    for c, lo, hi, job in jobs:
        data = job.result()
        src = data[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, c.offsets))]
        out[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets))] = src
    return out


def _read_chunk(storage: Storage, c: fmt.Chunk, dtype: torch.dtype, where: str) -> torch.Tensor:
    raw = torch.empty(c.blob.raw_length, dtype=torch.uint8)
    read_blob(storage, c.blob, memoryview(raw.numpy()) if c.blob.raw_length else memoryview(bytearray()), where)
    return raw.view(dtype).reshape(c.sizes)


def restore(storage: Storage, manifest: fmt.Manifest, rank: int, map_location=None,
            weights_only: bool = True, pool=None, pickle_load_args=None, globals_as_meta: bool = False):
    """Rebuild the object rank ``rank`` saved. Global tensors come back whole
    (consolidated) or, with ``globals_as_meta``, as meta tensors for a template to fill."""
    from ..pipeline import runtime

    pool = pool or runtime().readers
    where = storage.describe()
    try:
        state = next(r for r in manifest.ranks if r.rank == rank)
    except StopIteration:
        raise FormatError(f"{where}: the checkpoint holds no state for rank {rank}") from None
    if manifest.byteorder != "little":
        raise FormatError(f"{where}: big-endian checkpoints are not supported")
    skeleton = bytearray(state.skeleton.raw_length)
    skeleton_job = pool.submit(read_blob, storage, state.skeleton, memoryview(skeleton),
                               f"{where}: object skeleton of rank {rank}")
    # Tensor errors first: a damaged file then reports the tensor it hit, not the skeleton.
    raw = read_tensors(storage, state.tensors, where, pool)
    needed_globals = {} if globals_as_meta else dict(manifest.tensors)
    raw_globals = read_tensors(storage, needed_globals, where, pool)
    skeleton_job.result()

    restore_location = torch.serialization._get_restore_location(map_location)
    loaded: dict[str, torch.storage.TypedStorage] = {}

    def persistent_load(pid):
        if not isinstance(pid, tuple) or len(pid) != 5 or pid[0] != "storage":
            raise FormatError(f"{where}: unexpected persistent id {pid!r} in the skeleton")
        storage_type, ref, location, numel = pid[1:]
        if ref in loaded:
            return loaded[ref]
        try:
            scope, key = parse_skeleton_key(ref)
        except (ValueError, AttributeError):
            raise FormatError(f"{where}: bad tensor reference {ref!r} in the skeleton") from None
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        if scope == GLOBAL and globals_as_meta:
            if key not in manifest.tensors:
                raise FormatError(f"{where}: the skeleton names global tensor {key!r}, which the manifest lacks")
            typed = torch.storage.TypedStorage(numel, dtype=dtype, device="meta")
            loaded[ref] = typed
            return typed
        table = raw_globals if scope == GLOBAL else raw
        if key not in table:
            raise FormatError(f"{where}: the skeleton names tensor {key!r}, which the manifest lacks")
        untyped = table[key]
        if untyped.nbytes() != numel * dtype.itemsize:
            raise FormatError(f"{where}: tensor {key!r} holds {untyped.nbytes()} bytes, skeleton expects {numel * dtype.itemsize}")
        typed = torch.storage.TypedStorage(wrap_storage=restore_location(untyped, location), dtype=dtype, _internal=True)
        loaded[ref] = typed
        return typed

    args = {"encoding": "utf-8", **(pickle_load_args or {})}
    if weights_only:
        unpickler = torch._weights_only_unpickler.Unpickler(io.BytesIO(skeleton), **args)
    else:
        unpickler = _FullUnpickler(io.BytesIO(skeleton), **args)
    unpickler.persistent_load = persistent_load
    try:
        result = unpickler.load()
    except CkptStoreError:
        raise
    except pickle.UnpicklingError as e:
        if weights_only:
            raise UnsafeLoadError(
                f"{where}: weights_only=True refused this checkpoint: {e}. Load it with "
                "weights_only=False only if you trust its source, or allow the type with "
                "torch.serialization.add_safe_globals([...])."
            ) from e
        raise FormatError(f"{where}: cannot unpickle the object skeleton: {e}") from e
    _validate_sparse = getattr(torch._utils, "_validate_loaded_sparse_tensors", None)
    if _validate_sparse is not None:
        _validate_sparse()
    return result


class _StorageType:
    """What ``find_class`` returns for legacy storage classes (as torch.load does)."""

    def __init__(self, name: str):
        self.dtype = torch.serialization.StorageType(name).dtype


class _FullUnpickler(pickle.Unpickler):
    """weights_only=False: plain pickle (runs code by design), with torch's storage names."""

    def find_class(self, module, name):
        if isinstance(name, str) and "Storage" in name:
            try:
                return _StorageType(name)
            except (KeyError, AttributeError):
                pass
        if module == "torch.tensor":
            module = "torch._tensor"
        return super().find_class(module, name)
