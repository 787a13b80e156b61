"""Appended objects on S3: a streaming multipart upload through boto3's transfer layer.

``open_append`` returns an :class:`_S3AppendWriter`: appends land, in arrival order, in
a bounded buffer that a blocking file-like reader (:class:`_Feed`) hands to
``s3transfer.TransferManager.upload``, which sends it as a single PutObject when small,
else as a multipart upload, and aborts the upload when it fails. A size hint of two parts
or more starts the multipart upload at once (:class:`_MultipartFromStart`).

Part sizes come from a :class:`PartPlan` (:func:`plan_parts`): with a size hint, one
size for the whole upload, large enough that the hinted size fits in S3's 10,000 parts
(Cloudflare R2 requires every part but the last to be equal); without one, ``part_size``
for the first 1,000 parts, then doubling every 1,000, so that no object needs more than
10,000 parts. Either way an object that outgrows its plan's uniform parts gets growing
ones (docs/s3.md, "Streaming multipart appends").

The writer knows nothing of the store that opened it but an :class:`UploadTarget`: the
client, bucket and full key of its one object, how the store names it in messages and
translates errors, and the store's put and delete of that object.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Any, Callable

from boto3.s3.transfer import TransferConfig
from s3transfer.manager import TransferManager
from s3transfer.subscribers import BaseSubscriber

from ... import native
from ..._threads import DaemonThreadPool
from ...errors import CkptStoreError, StorageError
from ..base import AppendWriter
from .client import DEFAULT_CONCURRENCY, DEFAULT_PART_SIZE, MAX_PART_SIZE, MAX_PARTS, MiB

# Memory an upload may hold, in parts: those in flight, one read and waiting for a slot,
# and the two the append queue holds (see _S3AppendWriter).
_HELD_BEYOND_IN_FLIGHT = 3
# What one upload may hold with the default settings (10 + 3 parts of 16 MiB, 208 MiB):
# larger uniform parts lower the parts in flight to stay within it.
DEFAULT_UPLOAD_MEMORY = (DEFAULT_CONCURRENCY + _HELD_BEYOND_IN_FLIGHT) * DEFAULT_PART_SIZE
# S3 takes about 3,500 PUTs per second per prefix, and every rank of a save uploads into
# one: each writer's share of a part size, so that more writers make fewer, larger parts.
WRITER_PART_SHARE = 64 << 10
HINT_MARGIN = 16  # a size hint is an estimate: plan for 1/16 more


def _ceil_div(n: int, d: int) -> int:
    return -(-n // d)


def _round_up(n: int, unit: int) -> int:
    return _ceil_div(n, unit) * unit


@dataclass(frozen=True)
class PartPlan:
    """How one appended object is cut into parts: ``size`` for parts 1 to
    ``uniform_parts``, then (an object larger than planned) doubling every ``tier``
    parts, at most 5 GiB; ``in_flight`` parts upload at once."""

    size: int
    uniform_parts: int
    tier: int
    in_flight: int

    def part_size(self, part_number: int) -> int:
        """Size of part ``part_number`` (1-based)."""
        if part_number <= self.uniform_parts:
            return self.size
        doublings = 1 + (part_number - self.uniform_parts - 1) // self.tier
        return min(MAX_PART_SIZE, self.size << min(doublings, 40))

    @property
    def memory(self) -> int:
        """The most bytes the upload holds while its parts are ``size``."""
        return (self.in_flight + _HELD_BEYOND_IN_FLIGHT) * self.size


def plan_parts(part_size: int, max_concurrency: int, tier: int, size_hint: int | None = None,
               writers: int = 1) -> PartPlan:
    """The parts of one upload, from the store's ``part_size`` / ``max_concurrency`` /
    tier (1,000 parts) and the object's hints.

    ``size_hint`` (bytes, an estimate): one part size for the whole upload, the smallest
    multiple of 1 MiB that is at least ``part_size`` and fits the hint plus 1/16 in
    10,000 parts (``part_size`` itself when that fits), capped at 5 GiB. ``writers``
    (ranks uploading into one prefix at once): parts of at least ``writers`` x 64 KiB,
    rounded up to MiB (4,096 ranks: 256 MiB), so that the ranks together make fewer
    requests against S3's per-prefix rate. Parts larger than ``part_size`` lower the
    parts in flight so that the upload holds no more than the default settings' 208 MiB,
    or ``(max_concurrency + 3) x part_size`` when that is more, with at least one part
    in flight."""
    if size_hint is not None and size_hint < 0:
        raise ValueError(f"size_hint must be >= 0, got {size_hint}")
    if writers < 1:
        raise ValueError(f"writers must be >= 1, got {writers}")
    size = part_size
    if writers > 1:
        size = max(size, _round_up(writers * WRITER_PART_SHARE, MiB))
    covered = size_hint + size_hint // HINT_MARGIN if size_hint else 0
    if _ceil_div(covered, MAX_PARTS) > size:
        size = _round_up(_ceil_div(covered, MAX_PARTS), MiB)
    size = min(size, MAX_PART_SIZE)
    uniform_parts = max(tier, min(MAX_PARTS, _ceil_div(covered, size)))
    in_flight = max_concurrency
    if size > part_size:
        budget = max(DEFAULT_UPLOAD_MEMORY, (max_concurrency + _HELD_BEYOND_IN_FLIGHT) * part_size)
        in_flight = max(1, min(max_concurrency, budget // size - _HELD_BEYOND_IN_FLIGHT))
    return PartPlan(size, uniform_parts, tier, in_flight)


@dataclass(frozen=True)
class UploadTarget:
    """The one object an append writer uploads, and all it needs of the store that
    opened it (``S3Storage.open_append`` makes it)."""

    client: Any  # the boto3 S3 client
    bucket: str
    key: str  # the store's key of the object
    full_key: str  # its S3 key: the store's prefix, '/', key
    where: str  # its s3:// URL for messages, endpoint secrets redacted (the store's describe(key))
    translate: Callable[[BaseException], CkptStoreError]  # a failed request's error, as the store raises it
    put: Callable[[bytes], None]  # store the whole object with one PutObject
    delete: Callable[[], None]  # delete the object


def _byte_view(out) -> memoryview:
    mv = out if isinstance(out, memoryview) else memoryview(out)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


class _MultipartFromStart(BaseSubscriber):
    """Tells s3transfer, as the upload is queued, that the object takes at least one
    part: it then sends CreateMultipartUpload at once, instead of first reading a whole
    part from the feed to choose between one PutObject and a multipart upload, so the
    request's round trip overlaps the first part's encoding and hashing. (The size it
    is given decides only that: the feed is read until it ends.)"""

    def __init__(self, part_size: int):
        self._size = part_size

    def on_queued(self, future, **kwargs):
        future.meta.provide_transfer_size(self._size)


class _Feed:
    """The blocking, non-seekable file object s3transfer reads the appended bytes from."""

    def __init__(self, writer: "_S3AppendWriter"):
        self._writer = writer

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def read(self, amount: int | None = -1) -> bytes:
        return self._writer._take(amount)


class _S3AppendWriter(AppendWriter):
    """Streams appended bytes to S3 while they arrive.

    ``append`` takes an offset and copies the bytes under one lock, so offsets follow
    arrival order: straight into the part being filled (``native.BytesPart``, each of
    the size ``plan`` gives part by part, the copy made with the GIL released), which
    joins the queue of ready parts once full. s3transfer's submission thread takes whole
    parts off that queue (``_take``): each byte is copied once on its way, with no join
    of pieces into a part. Its request threads upload up to ``plan.in_flight`` parts at
    once. Memory stays bounded: ``append`` waits while two parts' worth is queued, and
    s3transfer holds at most ``plan.in_flight`` parts plus the one it is handing over.
    """

    def __init__(self, target: UploadTarget, plan: PartPlan, size_hint: int | None = None):
        self.key = target.key
        self._t = target
        self._plan = plan
        self._cv = threading.Condition()
        self._ready: collections.deque[bytes] = collections.deque()  # full parts, in order
        self._filling = None  # the native.BytesPart being filled, or None
        self._cut = 0  # parts filled so far (the next one is part _cut + 1)
        self._queued = 0  # bytes in _ready and _filling
        self._want = 0  # what a waiting _take needs queued
        self._size = 0
        self._parts = 0  # parts handed to s3transfer so far
        self._eof = False
        self._stop: BaseException | None = None  # raised to s3transfer (abort, too many parts)
        self._closed = False
        self._completed = False
        self._future = None
        # s3transfer reads the first part as its single-PUT-or-multipart probe and cuts
        # that into chunksize pieces: both must be the first part's size.
        config = TransferConfig(
            multipart_threshold=plan.part_size(1),
            multipart_chunksize=plan.part_size(1),
            max_concurrency=plan.in_flight,
            use_threads=True,
        )
        config.max_in_memory_upload_chunks = plan.in_flight  # parts held by s3transfer
        # A hint of two parts or more: multipart from the start (a hint is an upper bound:
        # an object that ends up one part is one UploadPart, an empty one is stored by
        # close() with one PutObject). Below that the first part decides, as usual.
        self._multipart = size_hint is not None and size_hint >= 2 * plan.part_size(1)
        subscribers = [_MultipartFromStart(plan.part_size(1))] if self._multipart else None
        self._manager = TransferManager(target.client, config, executor_cls=DaemonThreadPool)
        with self._cv:
            self._future = self._manager.upload(_Feed(self), target.bucket, target.full_key, subscribers=subscribers)

    # -- the producer side (any thread)
    def append(self, data) -> int:
        mv = _byte_view(data)
        n = mv.nbytes
        with self._cv:
            while True:
                if self._closed:
                    raise StorageError(f"{self._t.where}: append after close or abort")
                if self._stop is not None:
                    raise StorageError(str(self._stop))
                if self._future.done():
                    break  # the upload failed: report it below, outside the lock
                if self._queued < self._limit():
                    offset = self._size
                    self._size += n
                    if n:
                        try:
                            self._fill(mv)
                        except BaseException as e:  # (a part's memory): part of it may be in; nothing after is sound
                            self._stop = StorageError(f"{self._t.where}: append failed: {e}")
                            self._cv.notify_all()
                            raise
                        self._queued += n
                        self._cv.notify_all()
                    return offset
                self._cv.wait(0.05)  # back-pressure; also notices a failed upload
        raise self._failure()

    def _fill(self, mv: memoryview) -> None:
        """Copy ``mv`` into the parts (under the lock), cutting a part whenever one fills."""
        at = 0
        while at < len(mv):
            if self._filling is None:
                self._filling = native.BytesPart(self._plan.part_size(self._cut + 1))
            at += self._filling.write(mv, at)
            if self._filling.size == self._filling.capacity:
                self._ready.append(self._filling.take())
                self._filling = None
                self._cut += 1

    def _ready_bytes(self) -> int:
        return self._queued - (self._filling.size if self._filling is not None else 0)

    def _limit(self) -> int:
        """Bytes the queue may hold before appends wait: two parts, or more while a read
        waits for more than one (it must be able to get what it waits for)."""
        part = self._plan.part_size(self._parts + 1)
        return max(2 * part, self._want + part)

    def _failure(self) -> CkptStoreError:
        try:
            self._future.result()
        except BaseException as e:
            return self._t.translate(e)
        return StorageError(f"{self._t.where}: the upload ended before close")

    # -- the consumer side (s3transfer's submission thread)
    def _take(self, amount: int | None) -> bytes:
        with self._cv:
            if amount is None or amount < 0:
                want = None  # everything up to close (the single-PutObject path)
            else:
                self._parts += 1
                # Returning more than asked is how parts grow: s3transfer sizes each part
                # by the bytes read (checked by tests/test_s3.py::test_part_sizes_grow...).
                want = max(amount, self._plan.part_size(self._parts))
            self._want = want or 0  # appends may queue this much beyond their usual limit
            try:
                while True:
                    if self._stop is not None:
                        raise self._stop
                    if self._eof or (want is not None and self._ready_bytes() >= want):
                        break
                    if self._future is not None and self._future.done():
                        raise StorageError("upload failed")  # stop reading; the real error is on the future
                    self._cv.wait(0.05)
            finally:
                self._want = 0
            if want is not None and self._parts > MAX_PARTS and self._queued:  # (the read that finds the end is no part)
                self._stop = StorageError(f"{self._t.where}: object exceeds S3's {MAX_PARTS} parts; "
                                          "use a larger part_size")
                raise self._stop
            # Whole parts only: part k is plan.part_size(k), at least what is asked.
            pieces, got = [], 0
            while self._ready and (want is None or got < want):
                pieces.append(self._ready.popleft())
                got += len(pieces[-1])
            if self._eof and self._filling is not None and (want is None or got < want):
                pieces.append(self._filling.take())  # the last part
                self._filling = None
                got += len(pieces[-1])
            self._queued -= got
            self._cv.notify_all()
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    # -- finishing
    def close(self) -> int:
        with self._cv:
            if self._closed:
                raise StorageError(f"{self._t.where}: closed twice")
            self._closed = True
            empty = self._multipart and self._size == 0
            if empty:  # a multipart upload needs a part: stop it before it completes with none
                self._stop = StorageError(f"{self._t.where}: empty; stored with one PutObject")
            else:
                self._eof = True
            self._cv.notify_all()
        if empty:
            self._cancel()
            self._t.put(b"")
            self._completed = True
            return 0
        try:
            self._future.result()
        except BaseException as e:
            raise self._t.translate(e) from e
        finally:
            self._manager.shutdown()
        self._completed = True
        return self._size

    def _cancel(self) -> None:
        """End the transfer without completing it; s3transfer aborts a multipart upload
        it started."""
        if not self._future.done():
            self._future.cancel()
        try:
            self._future.result()
        except BaseException:
            pass
        self._manager.shutdown()

    def abort(self) -> None:
        try:
            with self._cv:
                self._closed = True
                if self._stop is None:
                    self._stop = StorageError(f"{self._t.where}: upload aborted")
                self._ready.clear()
                self._filling = None
                self._queued = 0
                self._cv.notify_all()
            self._cancel()
            if self._completed:
                self._t.delete()
        except BaseException:
            pass
