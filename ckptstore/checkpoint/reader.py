"""The one blob reader: every load, template load (reshard) and verify reads stored
blobs through here, so each guarantee lives in one place.

A read is bounded by what is honestly stored: every blob's extent is checked against
its file's real size before anything is allocated for it (one stat per file), a
decode never produces more than the manifest's ``raw_length`` (codecs.decode_into),
and no byte reaches a caller before its xxh3-128 matched the manifest (I3). Small
neighbouring blobs are fetched by one read and split again; each is still checked on
its own, so an error names the same blob it would alone; a load's merged read is
scattered straight into the blobs' destinations (``Storage.readinto_scatter``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import wait
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from .. import format as fmt
from ..codecs import check_stated_size, decode_into
from ..errors import (
    CkptStoreError,
    FormatError,
    IntegrityError,
    NotRegularObjectError,
    ObjectNotFoundError,
    TruncatedObjectError,
)
from ..hashing import Hasher, digest
from ..storage import Storage


def _where(blob: fmt.Blob, what: str) -> str:
    return f"{what} (file {blob.file}, offset {blob.offset}, {blob.length} bytes)"


def verified(storage: Storage | None, blob: fmt.Blob, what: str, out,
             stored: memoryview | None = None) -> memoryview:
    """The read-verify-decode step. Reads the blob (unless a merged read already
    fetched its ``stored`` bytes), decodes it into ``out`` (exactly ``raw_length``
    bytes) and checks its hash; returns the verified raw bytes: ``out``, or for a raw
    blob cut out of a merged read ``stored`` itself (``out`` may then be None: the
    caller copies it only now that it matched). ``out`` may be a function that
    allocates it: a compressed blob's destination is then allocated only once its
    stored bytes are read and its zstd frame states exactly ``raw_length``, so a
    frame that lies costs nothing."""
    try:
        if blob.length != blob.raw_length and not blob.codec:
            raise FormatError(f"raw blob length {blob.length} != raw_length {blob.raw_length}")
        if not blob.codec and stored is not None:
            raw, actual = stored, digest(stored)
        elif not blob.codec:  # straight into place, hashed piece by piece while in cache
            out = out() if callable(out) else out  # raw: no larger than the file holds
            hasher = Hasher()
            storage.readinto(blob.file, blob.offset, out, on_piece=hasher.update)
            raw, actual = out, hasher.hexdigest()
        else:
            if stored is None:
                stored = memoryview(bytearray(blob.length))
                storage.readinto(blob.file, blob.offset, stored)
            check_stated_size(blob.codec, stored, blob.raw_length, "stored bytes")
            out = out() if callable(out) else out
            decode_into(blob.codec, stored, out, "stored bytes")
            raw, actual = out, digest(out)
    except ObjectNotFoundError as e:
        raise IntegrityError(f"{_where(blob, what)}: file is missing: {e}") from e
    except NotRegularObjectError as e:
        raise IntegrityError(f"{_where(blob, what)}: not a regular file: {e}") from e
    except TruncatedObjectError as e:
        raise IntegrityError(f"{_where(blob, what)}: file is truncated: {e}") from e
    except FormatError as e:
        raise IntegrityError(f"{_where(blob, what)}: cannot decode: {e}") from e
    if actual != blob.xxh3_128:
        raise IntegrityError(f"{_where(blob, what)}: xxh3-128 mismatch (stored {blob.xxh3_128}, read {actual})")
    return raw


# ---------------------------------------------------------------------------- extents
def file_sizes(storage: Storage, names, pool=None) -> dict[str, int | None]:
    """The size of each file (None: missing or not a regular file), stat'ed in
    parallel on ``pool`` when there are many (one HEAD each on S3)."""
    names = sorted(set(names))

    def size(name: str) -> int | None:
        try:
            return storage.stat(name).size
        except (ObjectNotFoundError, NotRegularObjectError):
            return None

    if pool is None or len(names) < 8:
        return {n: size(n) for n in names}
    return dict(zip(names, [j.result() for j in [pool.submit(size, n) for n in names]]))


def extent_problem(blob: fmt.Blob, sizes: dict[str, int | None]) -> str | None:
    """Why ``blob`` cannot be read from its file as it stands, or None."""
    size = sizes.get(blob.file)
    if size is None:
        return "file is missing or not a regular file"
    if blob.offset + blob.length > size:
        return f"file is truncated: blob ends at {blob.offset + blob.length}, file holds {size}"
    return None


def check_extents(storage: Storage, blobs, pool=None) -> None:
    """Raise IntegrityError for the first ``(blob, what)`` whose bytes its file does not
    hold: called before a load allocates anything for them."""
    blobs = list(blobs)
    sizes = file_sizes(storage, (b.file for b, _ in blobs), pool)
    for blob, what in blobs:
        problem = extent_problem(blob, sizes)
        if problem is not None:
            raise IntegrityError(f"{_where(blob, what)}: {problem}")


# ---------------------------------------------------------------------------- coalesced reads
@dataclass(eq=False)
class BlobRead:
    """One blob a load (or verify) needs. Its raw bytes go to ``out`` (exactly
    ``raw_length`` bytes); with ``out=None`` they are only checked, and handed to
    ``done`` (when given) as a new uint8 tensor once their hash matched. ``out`` must be
    a new buffer of the load's own: a read may put a raw blob's bytes there before its
    hash is checked, and a failed check fails the load, which drops it. ``what`` names
    the blob in errors (``"<checkpoint>: tensor 'key'"``)."""

    blob: fmt.Blob
    what: str
    out: memoryview | None = None
    done: Callable[[torch.Tensor], None] | None = None


def plan_reads(storage: Storage, reads: Sequence[BlobRead]) -> list[list[int]]:
    """Group ``reads`` (by index) into the reads the storage will see.

    Per ``storage.read_hints`` (:class:`~ckptstore.storage.ReadHints`): blobs of one
    file no larger than ``blob`` are merged, in offset order, while the bytes between
    two neighbours are at most ``gap`` and the merged range stays within ``limit``: one
    request fetches them all into a temporary buffer, which is split back per blob.
    Larger blobs are a read of their own, straight into their destination (streamed,
    hashed as they arrive), as are all blobs of a storage that does not coalesce (limit
    0). Groups come back in the order of their first read, so work and errors follow
    the caller's order."""
    hints = storage.read_hints
    limit = hints.limit
    if limit <= 0 or len(reads) < 2:
        return [[i] for i in range(len(reads))]
    gap = hints.gap
    small = min(limit, hints.blob)
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


def _view(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy()) if t.numel() else memoryview(bytearray())


def _deliver(storage: Storage, r: BlobRead, scratch, stored: memoryview | None = None) -> None:
    """Read (or take from ``stored``) one blob, check it, and hand it over: into
    ``r.out``, to ``r.done`` as a new tensor, or nowhere (verify). Nothing reaches the
    caller before its hash matched; a compressed blob decoded into ``out``, a fresh
    buffer of the load, is discarded with the load if it does not match."""
    blob = r.blob
    if stored is not None and not blob.codec:
        raw = verified(storage, blob, r.what, None, stored)  # checked in place, copied once it matched
        if r.out is not None:
            r.out[:] = raw
        elif r.done is not None:  # a copy, aligned for the dtype: the slice may start at any byte
            tensor = torch.empty(len(raw), dtype=torch.uint8)
            _view(tensor)[:] = raw
            r.done(tensor)
        return
    if r.out is not None:
        verified(storage, blob, r.what, r.out, stored)
    elif r.done is None:
        verified(storage, blob, r.what, lambda: scratch(blob.raw_length), stored)
    else:
        made: list[torch.Tensor] = []

        def allocate() -> memoryview:
            made.append(torch.empty(blob.raw_length, dtype=torch.uint8))
            return _view(made[0])

        verified(storage, blob, r.what, allocate, stored)
        r.done(made[0])


def _scatter_plan(members: list[BlobRead], start: int):
    """Where a merged read of a load puts each blob's stored bytes: a raw blob straight
    into its destination (``out``, or the new tensor ``done`` will get), a compressed
    one into a temporary buffer it is decoded from, a gap between blobs into a scratch
    buffer. So the merged bytes are not copied again, and no temporary buffer the size
    of the read is faulted in. Returns (buffers in file order, per member (stored
    bytes, its new tensor or None)), or None where the blobs are only checked (verify)
    or overlap: one temporary buffer then, as before."""
    if any(r.out is None and r.done is None for r in members):
        return None
    buffers: list[memoryview] = []
    placed: list[tuple[memoryview, torch.Tensor | None]] = []
    pos = start
    for r in members:  # in file order (plan_reads)
        b = r.blob
        if b.offset < pos:
            return None
        if b.offset > pos:
            buffers.append(_new_buffer(b.offset - pos))
        tensor = None
        if b.codec:
            view = _new_buffer(b.length)
        elif r.out is not None:
            view = r.out  # a fresh buffer of the load: discarded with it if the hash fails
        else:
            tensor = torch.empty(b.length, dtype=torch.uint8)  # raw: no larger than its file holds
            view = _view(tensor)
        if len(view) != b.length:
            return None
        buffers.append(view)
        placed.append((view, tensor))
        pos = b.offset + b.length
    return buffers, placed


def _deliver_scattered(storage: Storage, r: BlobRead, scratch, stored: memoryview, tensor) -> None:
    """Check one blob a scattered read put in place, and hand it over (``_deliver``)."""
    if r.blob.codec:
        _deliver(storage, r, scratch, stored)
        return
    verified(storage, r.blob, r.what, None, stored)
    if r.done is not None:
        r.done(tensor)


def _read_group(storage: Storage, reads: Sequence[BlobRead], group: list[int], scratch=_new_buffer):
    """Read one group of ``plan_reads``; returns ``[(index, IntegrityError)]`` for the
    blobs that failed their checks (the others were delivered). Storage errors that are
    no integrity problem (transient, permission) propagate."""
    failed: list[tuple[int, IntegrityError]] = []
    members = [reads[i] for i in group]
    if len(group) > 1:
        start = min(r.blob.offset for r in members)
        end = max(r.blob.offset + r.blob.length for r in members)
        scatter = _scatter_plan(members, start)
        try:
            if scatter is None:
                buf = _new_buffer(end - start)
                storage.readinto(members[0].blob.file, start, buf)
            else:
                storage.readinto_scatter(members[0].blob.file, start, scatter[0])
        except (ObjectNotFoundError, NotRegularObjectError) as e:
            return [(i, IntegrityError(f"{_where(r.blob, r.what)}: file is missing: {e}")) for i, r in zip(group, members)]
        except TruncatedObjectError:
            pass  # some may still lie inside the file: read each alone, so every error names its blob
        else:
            for j, (i, r) in enumerate(zip(group, members)):
                try:
                    if scatter is None:
                        a = r.blob.offset - start
                        _deliver(storage, r, scratch, buf[a:a + r.blob.length])
                    else:
                        _deliver_scattered(storage, r, scratch, *scatter[1][j])
                except IntegrityError as e:
                    failed.append((i, e))
            return failed
    for i, r in zip(group, members):
        try:
            _deliver(storage, r, scratch)
        except IntegrityError as e:
            failed.append((i, e))
    return failed


# A caller's view of a long load (``ckptstore consolidate``'s progress bar): called with
# the stored bytes of each group of blobs once read and checked, on the caller's thread.
on_bytes_read: ContextVar[Callable[[int], None] | None] = ContextVar("on_bytes_read", default=None)


def read_blobs(storage: Storage, reads: Sequence[BlobRead], pool, extents_checked: bool = False) -> None:
    """Read and check every blob of ``reads`` on ``pool``, neighbours coalesced
    (:func:`plan_reads`); raises the error of the first read, in the caller's order,
    that failed. Extents are checked first unless the caller already did. Returns or
    raises only once no read of it is running: none writes into a caller's tensor,
    or sends a request, after the load has failed."""
    if not extents_checked:
        check_extents(storage, ((r.blob, r.what) for r in reads), pool)
    groups = plan_reads(storage, reads)
    jobs = [pool.submit(_read_group, storage, reads, g) for g in groups]
    report = on_bytes_read.get()
    try:
        for g, j in zip(groups, jobs):
            failed = j.result()
            if failed:
                raise min(failed, key=lambda f: f[0])[1]
            if report is not None:
                report(sum(reads[i].blob.length for i in g))
    finally:
        for j in jobs:
            j.cancel()
        wait(jobs)


def check_blobs(storage: Storage, reads: Sequence[BlobRead], pool, scratch=_new_buffer,
                on_blob=None, sizes: dict[str, int | None] | None = None) -> list[CkptStoreError | None]:
    """Like :func:`read_blobs`, but every read's error (or None) instead of raising:
    for verify. A blob its file cannot hold is reported without being read.
    ``on_blob(blob)`` is called once per blob as it is settled."""
    if sizes is None:
        sizes = file_sizes(storage, (r.blob.file for r in reads), pool)
    results: list[CkptStoreError | None] = [None] * len(reads)
    readable = []
    for i, r in enumerate(reads):
        problem = extent_problem(r.blob, sizes)
        if problem is None:
            readable.append(i)
            continue
        results[i] = IntegrityError(f"{_where(r.blob, r.what)}: {problem}")
        if on_blob is not None:
            on_blob(r.blob)
    subset = [reads[i] for i in readable]
    groups = plan_reads(storage, subset)
    jobs = [pool.submit(_read_group, storage, subset, g, scratch) for g in groups]
    for group, job in zip(groups, jobs):
        try:
            for i, e in job.result():
                results[readable[i]] = e
        except CkptStoreError as e:  # the group's read failed as a whole: none of it was checked
            for i in group:
                results[readable[i]] = e
        if on_blob is not None:
            for i in group:
                on_blob(subset[i].blob)
    return results
