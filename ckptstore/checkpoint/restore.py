"""Loading: find the visible manifest, read and check every chunk, rebuild the object.

Every blob read is decoded and its xxh3-128 compared with the manifest before any of
its bytes reach the caller (I3). The skeleton is unpickled with torch's weights-only
unpickler unless the caller opts out, so a load runs no code from the checkpoint.
"""

from __future__ import annotations

import functools
import io
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass

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
    where = _where(blob, what)
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


def _where(blob: fmt.Blob, what: str) -> str:
    return f"{what} (file {blob.file}, offset {blob.offset}, {blob.length} bytes)"


# ---------------------------------------------------------------------------- coalesced reads
@dataclass(eq=False)
class BlobRead:
    """One blob a load (or verify) needs. Its raw bytes go to ``out`` (exactly
    ``raw_length`` bytes); with ``out=None`` they are only checked, and handed to
    ``done`` (when given) as a new uint8 tensor once their hash matched. ``what`` names
    the blob in errors (``"<checkpoint>: tensor 'key'"``)."""

    blob: fmt.Blob
    what: str
    out: memoryview | None = None
    done: Callable[[torch.Tensor], None] | None = None


def plan_reads(storage: Storage, reads: Sequence[BlobRead]) -> list[list[int]]:
    """Group ``reads`` (by index) into the reads the storage will see.

    Blobs of one file no larger than ``storage.read_coalesce_blob`` are merged, in
    offset order, while the bytes between two neighbours are at most
    ``storage.read_coalesce_gap`` and the merged range stays within
    ``storage.read_coalesce_limit``: one request fetches them all into a temporary
    buffer, which is split back per blob. Larger blobs are a read of their own, straight
    into their destination (streamed, hashed as they arrive), as are all blobs of a
    storage that does not coalesce (limit 0). Groups come back in the order of their
    first read, so work and errors follow the caller's order."""
    limit = int(getattr(storage, "read_coalesce_limit", 0) or 0)
    if limit <= 0 or len(reads) < 2:
        return [[i] for i in range(len(reads))]
    gap = max(0, int(getattr(storage, "read_coalesce_gap", 0) or 0))
    small = min(limit, int(getattr(storage, "read_coalesce_blob", 0) or 0))
    order = sorted(range(len(reads)), key=lambda i: (reads[i].blob.file, reads[i].blob.offset, reads[i].blob.length))
    groups: list[list[int]] = []
    run: list[int] = []
    file, start, end = None, 0, 0
    for i in order:
        b = reads[i].blob
        if b.length > small:
            if run:
                groups.append(run)
                run = []
            groups.append([i])  # a big blob also ends the run it interrupts: never read twice
            continue
        if run and b.file == file and b.offset - end <= gap and max(end, b.offset + b.length) - start <= limit:
            run.append(i)
            end = max(end, b.offset + b.length)
            continue
        if run:
            groups.append(run)
        run, file, start, end = [i], b.file, b.offset, b.offset + b.length
    if run:
        groups.append(run)
    groups.sort(key=min)
    return groups


def _new_buffer(n: int) -> memoryview:
    return _view(torch.empty(n, dtype=torch.uint8))


def _read_alone(storage: Storage, r: BlobRead, scratch) -> None:
    """A read of its own, straight into ``r.out`` (or a temporary buffer)."""
    if r.out is not None:
        read_blob(storage, r.blob, r.out, r.what)
        return
    if r.done is None:
        read_blob(storage, r.blob, scratch(r.blob.raw_length), r.what)
        return
    raw = torch.empty(r.blob.raw_length, dtype=torch.uint8)
    read_blob(storage, r.blob, _view(raw), r.what)
    r.done(raw)


def _split(r: BlobRead, stored: memoryview, scratch) -> None:
    """Check one blob's bytes cut out of a merged read and deliver them (I3: nothing
    reaches the caller before the hash matched; ``done`` gets the bytes only then, and a
    compressed blob decoded into ``out``, a fresh buffer of the load, is discarded with
    the load if it does not match)."""
    blob = r.blob
    where = _where(blob, r.what)
    tensor = None
    try:
        if not blob.codec:
            if blob.length != blob.raw_length:
                raise FormatError(f"{where}: raw blob length {blob.length} != raw_length {blob.raw_length}")
            raw = stored  # checked in place; copied out only once it matched
        elif r.out is not None:
            raw = r.out
        elif r.done is not None:
            tensor = torch.empty(blob.raw_length, dtype=torch.uint8)
            raw = _view(tensor)
        else:
            raw = scratch(blob.raw_length)
        if blob.codec:
            decode_into(blob.codec, stored, raw, where)
    except FormatError as e:
        raise IntegrityError(f"{where}: cannot decode: {e}") from e
    actual = digest(raw)
    if actual != blob.xxh3_128:
        raise IntegrityError(f"{where}: xxh3-128 mismatch (stored {blob.xxh3_128}, read {actual})")
    if r.out is not None:
        if raw is not r.out:
            r.out[:] = raw
    elif r.done is not None:
        if tensor is None:  # a copy, aligned for the dtype: the slice may start at any byte
            tensor = torch.empty(blob.raw_length, dtype=torch.uint8)
            _view(tensor)[:] = raw
        r.done(tensor)


def _view(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy()) if t.numel() else memoryview(bytearray())


def _read_group(storage: Storage, reads: Sequence[BlobRead], group: list[int], scratch=_new_buffer):
    """Read one group of ``plan_reads``; returns ``[(index, IntegrityError)]`` for the
    blobs that failed their checks (the others were delivered). Storage errors that are
    no integrity problem (transient, permission) propagate."""
    failed: list[tuple[int, IntegrityError]] = []
    if len(group) == 1:
        try:
            _read_alone(storage, reads[group[0]], scratch)
        except IntegrityError as e:
            failed.append((group[0], e))
        return failed
    members = [reads[i] for i in group]
    start = min(r.blob.offset for r in members)
    end = max(r.blob.offset + r.blob.length for r in members)
    buf = _new_buffer(end - start)
    try:
        storage.readinto(members[0].blob.file, start, buf)
    except ObjectNotFoundError as e:
        return [(i, IntegrityError(f"{_where(r.blob, r.what)}: file is missing: {e}")) for i, r in zip(group, members)]
    except TruncatedObjectError:
        # Some of them may still lie inside the file: read each alone, so every error
        # names the blob it hit and the others load as they would have unmerged.
        for i, r in zip(group, members):
            try:
                _read_alone(storage, r, scratch)
            except IntegrityError as e:
                failed.append((i, e))
        return failed
    for i, r in zip(group, members):
        a = r.blob.offset - start
        try:
            _split(r, buf[a:a + r.blob.length], scratch)
        except IntegrityError as e:
            failed.append((i, e))
    return failed


def read_blobs(storage: Storage, reads: Sequence[BlobRead], pool) -> None:
    """Read and check every blob of ``reads`` on ``pool``, neighbours coalesced
    (:func:`plan_reads`); raises the error of the first read, in the caller's order,
    that failed."""
    jobs = [pool.submit(_read_group, storage, reads, g) for g in plan_reads(storage, reads)]
    try:
        for j in jobs:
            failed = j.result()
            if failed:
                raise min(failed, key=lambda f: f[0])[1]
    finally:
        for j in jobs:
            j.cancel()


def check_blobs(storage: Storage, reads: Sequence[BlobRead], pool, scratch=_new_buffer,
                on_blob=None) -> list[CkptStoreError | None]:
    """Like :func:`read_blobs`, but every read's error (or None) instead of raising:
    for verify. ``on_blob()`` is called once per blob as its group completes."""
    results: list[CkptStoreError | None] = [None] * len(reads)
    groups = plan_reads(storage, reads)
    jobs = [pool.submit(_read_group, storage, reads, g, scratch) for g in groups]
    for group, job in zip(groups, jobs):
        try:
            for i, e in job.result():
                results[i] = e
        except CkptStoreError as e:  # the group's read failed as a whole: none of it was checked
            for i in group:
                results[i] = e
        if on_blob is not None:
            for _ in group:
                on_blob()
    return results


def read_tensors(storage: Storage, tensors: dict[str, fmt.TensorEntry], where: str,
                 pool) -> dict[str, torch.UntypedStorage]:
    """Read every chunk of every tensor into new CPU storages, all chunks in parallel
    (small neighbours in one read, see :func:`plan_reads`)."""
    reads: list[BlobRead] = []
    out = _tensor_reads(tensors, where, reads)
    read_blobs(storage, reads, pool)
    return out


def _tensor_reads(tensors: dict[str, fmt.TensorEntry], where: str,
                  reads: list[BlobRead]) -> dict[str, torch.UntypedStorage]:
    """New CPU storages for ``tensors``, and (appended to ``reads``) the reads that fill them.

    A chunk whose region is contiguous in the tensor (rows of a row-major tensor) is
    read straight into place; any other region (a column shard, say) is read whole and
    copied into a strided view of the tensor.
    """
    out: dict[str, torch.UntypedStorage] = {}
    for key, entry in tensors.items():
        size = fmt.itemsize(entry.dtype)
        data = torch.empty(entry.nbytes, dtype=torch.uint8)
        view = memoryview(data.numpy()) if entry.nbytes else memoryview(bytearray())
        what = f"{where}: tensor {key!r}"
        for c in entry.chunks:
            if _contiguous_region(entry.shape, c.offsets, c.sizes):
                start = region_byte_offset(entry.shape, c.offsets, size)
                reads.append(BlobRead(c.blob, what, view[start:start + c.blob.raw_length]))
            else:
                full = data.view(fmt.dtype_from_name(entry.dtype)).reshape(entry.shape)
                reads.append(BlobRead(c.blob, what, None, functools.partial(_into_region, c, full)))
        out[key] = data.untyped_storage()
    return out


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
    overlap it."""
    outs: list[torch.Tensor] = []
    reads: list[BlobRead] = []
    pending: dict[int, tuple[BlobRead, list]] = {}  # id(chunk) -> its read and the regions it fills
    for entry, where, offsets, sizes in requests:
        dtype = fmt.dtype_from_name(entry.dtype)
        out = torch.empty(tuple(sizes), dtype=dtype)
        outs.append(out)
        if out.numel() == 0:
            continue
        for c in entry.chunks:
            lo = [max(a, b) for a, b in zip(offsets, c.offsets)]
            hi = [min(a + n, b + m) for a, n, b, m in zip(offsets, sizes, c.offsets, c.sizes)]
            if any(h <= low for low, h in zip(lo, hi)):
                continue
            src = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, c.offsets))
            dst = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets))
            if id(c) not in pending:
                targets: list = []
                r = BlobRead(c.blob, where, None, functools.partial(_into_regions, c, dtype, targets))
                pending[id(c)] = (r, targets)
                reads.append(r)
            pending[id(c)][1].append((out, dst, src))
    read_blobs(storage, reads, pool)
    return outs


def _into_regions(c: fmt.Chunk, dtype: torch.dtype, targets: list, raw: torch.Tensor) -> None:
    data = raw.view(dtype).reshape(c.sizes)
    for out, dst, src in targets:
        out[dst] = data[src]


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
    # One plan for all of it, so neighbours coalesce across tensors, global tensors and
    # the skeleton; the skeleton comes last: a damaged file then reports the tensor it
    # hit, not the skeleton.
    reads: list[BlobRead] = []
    raw = _tensor_reads(state.tensors, where, reads)
    raw_globals = {} if globals_as_meta else _tensor_reads(dict(manifest.tensors), where, reads)
    skeleton = bytearray(state.skeleton.raw_length)
    reads.append(BlobRead(state.skeleton, f"{where}: object skeleton of rank {rank}", memoryview(skeleton)))
    read_blobs(storage, reads, pool)

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
            typed = torch.storage.TypedStorage(wrap_storage=torch.UntypedStorage(numel * dtype.itemsize, device="meta"),
                                               dtype=dtype, _internal=True)
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
