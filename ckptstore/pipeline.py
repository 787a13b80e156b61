"""The background half of a save: encode -> hash -> write, on worker threads.

The caller's thread fills staging buffers and hands each one to a :class:`RankWriter`,
which hashes the raw bytes, encodes them, returns the buffer to the pool as soon as
its bytes are no longer needed, and appends the stored bytes to the rank's data file.
zstandard, xxhash and file I/O release the GIL, so the workers run while training
runs. The process-wide :class:`~ckptstore.runtime.Runtime` (re-exported here with
``runtime`` and ``configure``) owns the workers, the commit thread, the staging pool
and the codec memo, and so one memory budget covers every save in flight.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Callable

from . import format as fmt
from .codecs import CompressionPolicy, encode, zstd_frame
from .errors import CkptStoreError, StorageError
from .hashing import digest
from .runtime import Runtime, configure, runtime  # runtime, configure: re-exported
from .scopes import Scope
from .staging import StagingBuffer
from .storage import AppendWriter, Storage

__all__ = ["RankWriter", "Runtime", "Written", "configure", "runtime"]


@dataclass(frozen=True)
class Written:
    """What one rank's writer made durable."""

    skeleton: fmt.Blob
    local: dict  # rank-local tensor key -> chunks
    shards: dict  # global tensor key -> the chunks this rank wrote
    replicas: tuple  # ReplicaHash of replicated chunks other ranks write


# Indexes and tables are JSON, which zstd shrinks 5-10x: compressed whatever the save's
# policy, always as one frame of this level (format.INDEX_CODEC).
METADATA_ZSTD_LEVEL = 3
BATCH_BYTES = 1 << 20  # small chunks go to the workers in batches of about this much
BATCH_ITEMS = 256


def _batches(pending: list[tuple]) -> list[tuple[int, int]]:
    """[start, end) runs of ``pending`` for one worker task each: a chunk of a megabyte
    or more alone, smaller ones together (one future and one thread hand-off per batch,
    not per tensor: at 10,000 small tensors those were most of a save's Python cost)."""
    out, start, size = [], 0, 0
    for i, (_fn, _args, buf) in enumerate(pending):
        size += buf.view.nbytes if buf is not None else BATCH_BYTES
        if size >= BATCH_BYTES or i + 1 - start >= BATCH_ITEMS:
            out.append((start, i + 1))
            start, size = i + 1, 0
    if start < len(pending):
        out.append((start, len(pending)))
    return out


def _run_batch(tasks: list[tuple]) -> None:
    # Each task catches its own errors (RankWriter._fail) and returns its buffer.
    for fn, args, _buf in tasks:
        fn(*args)


class RankWriter:
    """One rank's data file for one save attempt, fed chunk by chunk."""

    def __init__(self, storage: Storage, attempt: str, rank: int, policy: CompressionPolicy,
                 rt: Runtime | None = None, references: dict | None = None, stream: int = 0, writers: int = 1):
        self.storage = storage
        # Incremental saves: {(raw length, xxh3-128): a committed blob of the same store
        # (Blob.step set)}; a chunk whose raw bytes match one is recorded as a reference
        # to it instead of being encoded and written. Each is used at most once (a
        # manifest references a stored blob once: format.validate_extents).
        # (or a function giving it, called once by the first chunk that asks: reading an
        # earlier manifest stays off the blocking part of a drop-in save)
        self._references = references if callable(references) else (dict(references) if references else None)
        self.attempt = attempt
        self.rank = rank
        self.policy = policy
        self.rt = rt or runtime()
        # The pool its buffers go back to: the one the snapshot staged from (which sets
        # it before the first hand-over), not whichever the runtime holds by then.
        self.pool = self.rt.pool
        self.file = fmt.data_file_name(attempt, rank, stream)
        # Hints for opening the data file (Storage.open_append; S3 sizes its parts by
        # them): about how many bytes it will hold, set by the snapshot before the first
        # append (the raw bytes it stages: stored bytes are no more, but for the small
        # skeleton and indexes, which the store's margin covers), or a function that
        # counts them; and how many ranks write data files into this location at once.
        self.size_hint: int | Callable[[], int] | None = None
        self.writers = writers
        self._out: AppendWriter | None = None
        self._appended = False  # anything written to _out (an early-opened file may get nothing)
        self._open_future: Future | None = None  # open_soon's open (not waited for by abort)
        self._aborted = False  # set by abort (under _lock): an open that ends after it is dropped
        self._open_lock = threading.Lock()
        self._futures: list[Future] = []
        self._pending: list[tuple] = []
        self._chunks: dict[tuple[Scope, str], list[fmt.Chunk]] = {}
        self._replicas: list[fmt.ReplicaHash] = []
        self._skeleton: fmt.Blob | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        # [chunks, raw bytes] handed over (caller's thread) and written of those (workers,
        # under _lock; a chunk referenced or only hashed counts as written): progress().
        self._handed = [0, 0]
        self._written = [0, 0]

    # -- feeding (caller's thread)
    def submit_chunk(self, key: str, offsets: tuple, sizes: tuple, itemsize: int, buf: StagingBuffer,
                     scope: Scope = Scope.LOCAL, write: bool = True) -> None:
        """Hand over a filled staging buffer; the writer returns it to the pool.

        ``scope``: a rank-local tensor (``Scope.LOCAL``) or a global one
        (``Scope.GLOBAL``). ``write=False`` only hashes: a replica that another rank
        writes, checked against it at commit.
        """
        self._pending.append((self._chunk_task, (key, offsets, sizes, itemsize, buf, scope, write), buf))
        self._handed[0] += 1
        self._handed[1] += buf.view.nbytes

    def submit_pack(self, buf: StagingBuffer, entries: list[tuple]) -> None:
        """Hand over one buffer holding several small chunks back to back
        (``StagingCopier.gather``): ``entries`` are (key, byte offset in ``buf``, nbytes,
        itemsize, shape) for a whole rank-local tensor, or (key, byte offset, nbytes,
        itemsize, sizes, offsets, write) for one chunk of a global tensor (a DTensor's
        local box; ``write`` as in :meth:`submit_chunk`): plain values only, so the
        collector soon stops tracking entries that wait for a worker. Each stays a chunk
        of its own, hashed and encoded as one; a worker appends the pack's stored bytes
        in one write."""
        self._pending.append((self._pack_task, (buf, entries), buf))
        self._handed[0] += len(entries)
        self._handed[1] += buf.view.nbytes  # (O(1) on the caller's thread: a pack's slack counts)

    def flush(self) -> None:
        """Start the background work handed over so far.

        Chunks are held back while the caller stages: on a machine with few cores the
        workers would otherwise compete with the staging copy, the only part of a save
        that training waits for. ``snapshot`` flushes before the pool could block it,
        and once everything is staged.
        """
        pending, self._pending = self._pending, []
        batches = _batches(pending)
        for start, end in batches:
            try:
                self._futures.append(self.rt.workers.submit(_run_batch, pending[start:end]))
            except BaseException:
                self._pending = pending[start:] + self._pending  # abort() returns their buffers
                raise

    def submit_skeleton(self, data: bytes | Callable[[], bytes]) -> None:
        """The last blob of a snapshot: starts every held-back chunk too. ``data`` may
        be a function that makes the bytes: a worker calls it (a captured state's
        skeleton is pickled off the caller's thread)."""
        self._pending.append((self._skeleton_task, (data,), None))
        self.flush()

    def store_blob(self, raw: memoryview, itemsize: int, hint=None) -> fmt.Blob:
        """Hash, encode and append one blob now, on the caller's thread: for adapters
        that lay out their own items (ckptstore.dcp); then :meth:`close`, not ``finish``."""
        return self._store(raw, itemsize, hint=hint)

    def close(self) -> None:
        """Make the data file durable (after :meth:`store_blob`; raises its errors)."""
        wait_futures(self._waitables())
        if self._out is not None:
            self._close_out()

    @property
    def failed(self) -> BaseException | None:
        return self._error

    def progress(self) -> tuple[int, int, int, int]:
        """(chunks written, chunks handed over, raw bytes written, raw bytes handed
        over): what the exit drain says is left of a save (written: appended to the data
        file, which a remote store may still be uploading). Read without ``_lock``: a
        worker may hold it across a round trip (the references' listing)."""
        written, handed = list(self._written), list(self._handed)
        return (written[0], handed[0], written[1], handed[1])

    def open_soon(self) -> None:
        """Open the data file on an I/O thread now, while the caller stages: on a remote
        store its round trips (S3: a HEAD and CreateMultipartUpload) then overlap the
        staging instead of delaying the first part. Errors are left for the first append,
        which opens again and raises them. Call once ``size_hint`` is set. Only for stores
        whose opens are round trips: a local file opens in microseconds, and counting a
        size hint while the caller stages would take the GIL from it."""
        if self._open_future is not None or not self.storage.opens_remotely:
            return

        def open_quietly() -> None:
            try:
                self._writer()
            except Exception:
                pass
        try:
            self._open_future = self.rt.readers.submit(open_quietly)
        except RuntimeError:  # the runtime is shutting down: the first append opens, as without this
            pass

    def _waitables(self) -> list[Future]:
        return self._futures + ([self._open_future] if self._open_future is not None else [])

    def _append(self, data) -> int:
        offset = self._writer().append(data)
        self._appended = True
        return offset

    # -- workers
    def _writer(self) -> AppendWriter:
        with self._open_lock:
            if self._out is None:
                if self._aborted:
                    raise StorageError(f"{self.storage.describe(self.file)}: the save was aborted")
                out = self.storage.open_append(self.file, size_hint=self._size_hint(), writers=self.writers)
                with self._lock:
                    dropped = self._aborted
                    if not dropped:
                        self._out = out
                if dropped:  # abort() ran while this opened (open_soon): give the file up here
                    out.abort()
                    raise StorageError(f"{self.storage.describe(self.file)}: the save was aborted")
            return self._out

    def _size_hint(self) -> int | None:
        """``size_hint``, counted now when it is a function (the snapshot's, so the
        training thread does not count); a hint that cannot be counted is no hint."""
        if callable(self.size_hint):
            try:
                counted = int(self.size_hint())
            except Exception:
                counted = None
            self.size_hint = counted  # not the function: it holds the captured state alive
        return self.size_hint

    def _store(self, raw: memoryview, itemsize: int, release=None, hint=None) -> fmt.Blob:
        """Hash, encode and append one blob; calls ``release`` once ``raw`` is not needed.
        A blob unchanged since a committed save of the store is not written: the
        reference to it is returned (``release`` is then the caller's)."""
        raw_hash = digest(raw)
        ref = self._reference(len(raw), raw_hash)
        if ref is not None:
            return ref
        chain, stored = encode(raw, itemsize, self.policy, hint, self.rt.codec_memo)
        if release is not None and stored is not raw:
            release()  # the encoded copy is all we still need
            release = None
        try:
            offset = self._append(stored) if len(stored) else 0
        finally:
            if release is not None:
                release()
        return fmt.Blob(self.file, offset, len(stored), len(raw), tuple(chain), raw_hash)

    def _reference(self, raw_length: int, raw_hash: str) -> fmt.Blob | None:
        if self._references is None or not raw_length:
            return None
        with self._lock:
            if callable(self._references):
                try:
                    self._references = dict(self._references() or {})
                except Exception:  # no earlier checkpoint to refer to: write everything
                    self._references = {}
            return self._references.pop((raw_length, raw_hash), None)

    def _chunk_task(self, key, offsets, sizes, itemsize, buf: StagingBuffer, scope: Scope, write: bool) -> None:
        released = False

        def release():
            nonlocal released
            if not released:
                released = True
                self.pool.release(buf)

        try:
            if self._error is not None:
                return
            if not write:
                replica = fmt.ReplicaHash(key, tuple(offsets), tuple(sizes), digest(buf.view))
                with self._lock:
                    self._replicas.append(replica)
                    self._count_written(1, buf.view.nbytes)
                return
            nbytes = buf.view.nbytes
            blob = self._store(buf.view, itemsize, release, hint=(scope, key, tuple(offsets)))
            with self._lock:
                self._chunks.setdefault((scope, key), []).append(fmt.Chunk(tuple(offsets), tuple(sizes), blob))
                self._count_written(1, nbytes)
        except BaseException as e:
            self._fail(e, f"tensor {key!r}")
        finally:
            release()

    def _pack_task(self, buf: StagingBuffer, entries: list[tuple]) -> None:
        try:
            if self._error is not None:
                return
            view, memo, policy = buf.view, self.rt.codec_memo, self.policy
            stored_parts, records, all_raw, refs, replicas = [], [], True, [], []
            for key, start, nbytes, itemsize, shape, *box in entries:
                raw = view[start:start + nbytes]
                if box:
                    scope, (offsets, write) = Scope.GLOBAL, box
                else:
                    scope, offsets, write = Scope.LOCAL, (0,) * len(shape), True
                raw_hash = digest(raw)
                if not write:  # a replica another rank writes: its hash is checked at commit
                    replicas.append(fmt.ReplicaHash(key, tuple(offsets), tuple(shape), raw_hash))
                    continue
                ref = self._reference(nbytes, raw_hash)
                if ref is not None:  # unchanged since a committed save: referenced, not written
                    refs.append(((scope, key), fmt.Chunk(offsets, shape, ref)))
                    continue
                chain, stored = encode(raw, itemsize, policy, (scope, key, offsets), memo)
                all_raw = all_raw and not chain
                stored_parts.append(stored)
                records.append(((scope, key), offsets, shape, len(stored), nbytes, tuple(chain), raw_hash))
            if not records:
                data = b""
            elif all_raw and not refs and not replicas:  # the buffer's bytes, in order: one write, no copy
                end = entries[-1][1] + entries[-1][2]
                data = view[entries[0][1]:end]
            else:
                data = b"".join(stored_parts)
            at = self._append(data) if len(data) else 0
            chunks = []
            for where, offsets, shape, length, nbytes, chain, raw_hash in records:
                chunks.append((where, fmt.Chunk(offsets, shape, fmt.Blob(self.file, at if length else 0, length,
                                                                        nbytes, chain, raw_hash))))
                at += length
            chunks += refs
            with self._lock:
                for where, chunk in chunks:
                    self._chunks.setdefault(where, []).append(chunk)
                self._replicas += replicas
                self._count_written(len(entries), buf.view.nbytes)
        except BaseException as e:
            self._fail(e, f"tensor {entries[0][0]!r} (or one of the {len(entries) - 1} packed after it)")
        finally:
            self.pool.release(buf)

    def _skeleton_task(self, data) -> None:
        try:
            if self._error is None:
                if callable(data):
                    data = data()
                self._skeleton = self._store(memoryview(data), 1)
        except BaseException as e:
            self._fail(e, "object skeleton")

    def _count_written(self, chunks: int, nbytes: int) -> None:  # (under _lock)
        self._written[0] += chunks
        self._written[1] += nbytes

    def _fail(self, e: BaseException, what: str) -> None:
        with self._lock:
            if self._error is None:
                if isinstance(e, CkptStoreError):
                    self._error = e
                else:
                    err = StorageError(f"writing {what} to {self.storage.describe(self.file)} failed: {e}")
                    err.__cause__ = e
                    self._error = err

    # -- finishing (commit thread)
    def finish(self, seal: Callable[["Written"], object] | None = None):
        """Wait for every chunk, make the data file durable; raise the first error.
        Returns what was written, or with ``seal`` what ``seal(written)`` returns: it
        runs before the file is made durable, so the blobs it stores (a version 4
        index: :meth:`store_metadata`) are made durable with it."""
        wait_futures(self._waitables())
        out: object = None
        if self._error is None:
            assert self._skeleton is not None
            for chunks in self._chunks.values():
                chunks.sort(key=lambda c: c.offsets)
            local = {k: v for (scope, k), v in self._chunks.items() if scope == Scope.LOCAL}
            shards = {k: v for (scope, k), v in self._chunks.items() if scope == Scope.GLOBAL}
            out = Written(self._skeleton, local, shards, tuple(sorted(self._replicas, key=lambda r: (r.key, r.offsets))))
            if seal is not None:
                try:
                    out = seal(out)
                except BaseException as e:
                    self._fail(e, "index")
        if self._error is None and self._out is not None:
            try:
                self._close_out()
            except BaseException as e:
                self._fail(e, "data file")
        if self._error is not None:
            self.abort()
            raise self._error
        return out

    def _close_out(self) -> None:
        """Make the data file durable; one opened early that got nothing (every chunk a
        reference) is dropped instead, as if never opened: no blob names it."""
        if self._appended:
            self._out.close()
        else:
            out, self._out = self._out, None
            out.abort()

    def store_metadata(self, raw: bytes) -> fmt.Blob:
        """Append a metadata document (a version 4 index or table) now, hashed and
        compressed like a blob, on the caller's thread; never a reference."""
        chain, stored = zstd_frame(raw, METADATA_ZSTD_LEVEL)
        offset = self._append(stored)
        return fmt.Blob(self.file, offset, len(stored), len(raw), tuple(chain), digest(memoryview(raw)))

    def abort(self) -> None:
        for _fn, _args, buf in self._pending:  # held back, never started: return the buffers
            if buf is not None:
                self.pool.release(buf)
        self._pending = []
        wait_futures(self._futures)
        # Not the early open: a save failing on the training thread does not wait for its
        # round trips; an open that ends after this drops its file itself (_writer).
        with self._lock:
            self._aborted = True
            out = self._out
        if out is not None:
            out.abort()
