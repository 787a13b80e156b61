"""Appended objects on S3: a streaming multipart upload through boto3's transfer layer.

``open_append`` returns an :class:`_S3AppendWriter`: appends land, in arrival order, in
a bounded buffer that a blocking file-like reader (:class:`_Feed`) hands to
``s3transfer.TransferManager.upload``, which sends it as a single PutObject when small,
else as a multipart upload with ``max_concurrency`` parts in flight, and aborts the
upload when it fails. Part sizes grow so that no object needs more than S3's 10,000
parts (docs/s3.md, "Streaming multipart appends").
"""

from __future__ import annotations

import collections
import threading
from typing import TYPE_CHECKING

from boto3.s3.transfer import TransferConfig
from s3transfer.manager import TransferManager

from ..._threads import DaemonThreadPool
from ...errors import CkptStoreError, StorageError
from ..base import AppendWriter
from .client import MAX_PARTS

if TYPE_CHECKING:
    from .store import S3Storage


def _byte_view(out) -> memoryview:
    mv = out if isinstance(out, memoryview) else memoryview(out)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


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

    ``append`` takes an offset and queues the bytes (a copy, unless they are an immutable
    ``bytes``) under one lock, so offsets follow arrival order and the queue is the
    object's byte order. s3transfer's
    submission thread reads parts off the queue (``_take``); its request threads upload
    up to ``max_concurrency`` parts at once. Memory stays bounded: ``append`` waits while
    two parts' worth is queued, and s3transfer holds at most ``max_concurrency`` parts.
    """

    def __init__(self, storage: S3Storage, key: str):
        self.key = key
        self._s = storage
        sh = storage._shared
        self._cv = threading.Condition()
        self._queue: collections.deque[memoryview] = collections.deque()
        self._queued = 0
        self._size = 0
        self._parts = 0  # parts handed to s3transfer so far
        self._eof = False
        self._stop: BaseException | None = None  # raised to s3transfer (abort, too many parts)
        self._closed = False
        self._completed = False
        self._future = None
        config = TransferConfig(
            multipart_threshold=sh.part_size,
            multipart_chunksize=sh.part_size,
            max_concurrency=sh.max_concurrency,
            use_threads=True,
        )
        config.max_in_memory_upload_chunks = sh.max_concurrency  # parts held by s3transfer
        self._manager = TransferManager(sh.client, config, executor_cls=DaemonThreadPool)
        with self._cv:
            self._future = self._manager.upload(_Feed(self), sh.bucket, storage._k(key))

    # -- the producer side (any thread)
    def append(self, data) -> int:
        mv = _byte_view(data)
        n = mv.nbytes
        with self._cv:
            while True:
                if self._closed:
                    raise StorageError(f"{self._s.describe(self.key)}: append after close or abort")
                if self._stop is not None:
                    raise StorageError(str(self._stop))
                if self._future.done():
                    break  # the upload failed: report it below, outside the lock
                if self._queued < self._limit():
                    offset = self._size
                    self._size += n
                    if n:  # bytes are immutable: keep them; anything else may be reused, copy it
                        self._queue.append(mv if isinstance(data, bytes) else memoryview(bytes(mv)))
                        self._queued += n
                        self._cv.notify_all()
                    return offset
                self._cv.wait(0.05)  # back-pressure; also notices a failed upload
        raise self._failure()

    def _limit(self) -> int:
        return 2 * self._s.part_size_for(self._parts + 1)

    def _failure(self) -> CkptStoreError:
        try:
            self._future.result()
        except BaseException as e:
            return self._s._translate(e, self.key)
        return StorageError(f"{self._s.describe(self.key)}: the upload ended before close")

    # -- the consumer side (s3transfer's submission thread)
    def _take(self, amount: int | None) -> bytes:
        with self._cv:
            if amount is None or amount < 0:
                want = None  # everything up to close (the single-PutObject path)
            else:
                self._parts += 1
                if self._parts > MAX_PARTS:
                    self._stop = StorageError(
                        f"{self._s.describe(self.key)}: object exceeds S3's {MAX_PARTS} parts; "
                        "use a larger part_size")
                # Returning more than asked is how parts grow: s3transfer sizes each part
                # by the bytes read (checked by tests/test_s3.py::test_part_sizes_grow...).
                want = max(amount, self._s.part_size_for(self._parts))
            while True:
                if self._stop is not None:
                    raise self._stop
                if self._eof or (want is not None and self._queued >= want):
                    break
                if self._future is not None and self._future.done():
                    raise StorageError("upload failed")  # stop reading; the real error is on the future
                self._cv.wait(0.05)
            pieces, got = [], 0
            while self._queue and (want is None or got < want):
                head = self._queue.popleft()
                if want is not None and got + len(head) > want:
                    k = want - got
                    self._queue.appendleft(head[k:])
                    head = head[:k]
                pieces.append(head)
                got += len(head)
            self._queued -= got
            self._cv.notify_all()
        return b"".join(pieces)

    # -- finishing
    def close(self) -> int:
        with self._cv:
            if self._closed:
                raise StorageError(f"{self._s.describe(self.key)}: closed twice")
            self._eof = True
            self._closed = True
            self._cv.notify_all()
        try:
            self._future.result()
        except BaseException as e:
            raise self._s._translate(e, self.key) from e
        finally:
            self._manager.shutdown()
        self._completed = True
        return self._size

    def abort(self) -> None:
        try:
            with self._cv:
                self._closed = True
                if self._stop is None:
                    self._stop = StorageError(f"{self._s.describe(self.key)}: upload aborted")
                self._queue.clear()
                self._queued = 0
                self._cv.notify_all()
            if not self._future.done():
                self._future.cancel()  # s3transfer then aborts the multipart upload
            try:
                self._future.result()
            except BaseException:
                pass
            self._manager.shutdown()
            if self._completed:
                self._s.delete(self.key)
        except BaseException:
            pass
