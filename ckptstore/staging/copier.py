""":class:`StagingCopier`: fills staging buffers from tensor storages for one save, CPU
bytes by batched parallel copies (no GIL), CUDA bytes by batched
:func:`~ckptstore.staging.cuda.stage_to_host` calls."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .. import native
from .cuda import SMALL_COPY_BYTES, STRIDED_PIECE_BYTES, StageHandle, stage_strided, stage_to_host
from .pool import StagingBuffer, StagingPool
from .strided import copy_boxes

__all__ = ["StagingCopier"]


@dataclass(slots=True)
class QueuedCopy:
    """One copy the copier holds: ``nbytes`` bytes of ``storage`` from ``offset`` into
    ``buf``, which goes to ``then(buf)`` once they have landed. Holding ``storage``
    keeps the source alive until then."""

    storage: torch.UntypedStorage
    offset: int
    nbytes: int
    buf: StagingBuffer
    then: Callable[[StagingBuffer], None]


@dataclass(slots=True)
class _DeviceBatch:
    """A device batch in flight: its handle and the copies it carries."""

    handle: StageHandle
    copies: list[QueuedCopy]


class StagingCopier:
    """Fills staging buffers from tensor storages for one save.

    ``copy(storage, byte_offset, nbytes, then)`` takes a buffer from the pool and
    arranges for ``storage``'s bytes ``[byte_offset, byte_offset + nbytes)`` to land
    in it, then calls ``then(buf)`` (on the caller's thread), which takes ownership
    of the buffer. Copies are batched: CPU bytes by one parallel ``copy_many`` per
    ``cpu_batch_bytes`` (default ``batch_bytes``; one wake-up of the copy threads
    instead of one per chunk), CUDA bytes by one :func:`stage_to_host` call per device
    and ``batch_bytes``, each device batch running while the next one is queued; other
    devices by ``Tensor.copy_``, at once. ``copy_strided(tensor, then)`` stages a
    non-contiguous tensor row-major without a contiguous copy of it (CUDA: in pieces of
    at most ``strided_piece_bytes`` of device memory). The copier keeps every source
    referenced until its bytes have landed.
    ``finish()`` completes every copy and hands every buffer over. When the pool has
    no room (``try_acquire`` fails) it hands over everything it holds, calls
    ``before_wait()`` (e.g. ``writer.flush``: whoever holds the handed-over buffers
    must start releasing them), then waits in ``acquire(overflow_after=None)``: a pool
    smaller than the state drains instead of deadlocking, within a strict budget
    (it never lends past the capacity, even on the native pool).

    Use it as a context manager (``finish()`` on success; on an exception, waits for
    copies in flight and returns the buffers not handed over to the pool).
    """

    def __init__(self, pool: StagingPool, *, before_wait: Callable[[], None] | None = None,
                 batch_bytes: int | None = None, cpu_batch_bytes: int | None = None, stream=None,
                 backend: str | None = None, small_bytes: int = SMALL_COPY_BYTES,
                 strided_piece_bytes: int = STRIDED_PIECE_BYTES):
        self.pool = pool
        self.before_wait = before_wait
        self.batch_bytes = int(batch_bytes) if batch_bytes else max(1, min(pool.capacity // 4, 256 << 20))
        # CPU batches as large as device ones: the writer holds chunks back until the
        # staging ends anyway, and fewer, larger copy_many calls run closer to one memcpy.
        self.cpu_batch_bytes = int(cpu_batch_bytes) if cpu_batch_bytes else self.batch_bytes
        self.stream = stream
        self.backend = backend
        self.small_bytes = small_bytes
        self._cpu: list[QueuedCopy] = []
        self._cpu_bytes = 0
        self._dev: list[QueuedCopy] = []
        self._dev_bytes = 0
        self._inflight: _DeviceBatch | None = None
        self.strided_piece_bytes = int(strided_piece_bytes)
        self._strided: list[_DeviceBatch] = []  # copy_strided batches in flight
        self.batches = 0  # device batches launched (for tests and benchmarks)
        self.gathered = 0  # copies done by the native gather kernel

    def __enter__(self) -> "StagingCopier":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finish()
        else:
            self.abort()

    def copy(self, storage: torch.UntypedStorage, byte_offset: int, nbytes: int,
             then: Callable[[StagingBuffer], None]) -> None:
        buf = self._acquire(nbytes)
        kind = storage.device.type
        if kind == "cuda":
            self._dev.append(QueuedCopy(storage, byte_offset, nbytes, buf, then))
            self._dev_bytes += nbytes
            if self._dev_bytes >= self.batch_bytes:
                self._launch()
        elif kind == "cpu":
            self._cpu.append(QueuedCopy(storage, byte_offset, nbytes, buf, then))
            self._cpu_bytes += nbytes
            if self._cpu_bytes >= self.cpu_batch_bytes:
                self._flush_cpu()
        else:  # other devices: the device runtime, synchronously
            try:
                if nbytes:
                    src = torch.empty(0, dtype=torch.uint8, device=storage.device)
                    src.set_(storage, byte_offset, (nbytes,), (1,))
                    buf.tensor.copy_(src)
            except BaseException:
                self.pool.release(buf)
                raise
            then(buf)

    def copy_strided(self, tensor: torch.Tensor, then: Callable[[StagingBuffer], None]) -> None:
        """Stage a tensor of any strides, row-major (``tensor.contiguous()``'s bytes),
        into a buffer of its size, then call ``then(buf)``; no contiguous copy of the
        whole tensor is made. A CPU or other-device tensor is copied at once (straight
        into the buffer); a CUDA one by :func:`~ckptstore.staging.cuda.stage_strided`
        in pieces of at most ``strided_piece_bytes`` of device memory, completed with
        the device batches. The copier keeps ``tensor`` referenced until then."""
        nbytes = tensor.numel() * tensor.element_size()
        buf = self._acquire(nbytes)
        if tensor.device.type != "cuda":
            try:
                copy_boxes(tensor, buf.tensor, max(1, nbytes))
            except BaseException:
                self.pool.release(buf)
                raise
            then(buf)
            return
        try:
            handle = stage_strided([(tensor, buf.tensor)], stream=self.stream, piece_bytes=self.strided_piece_bytes)
        except BaseException:
            self.pool.release(buf)
            raise
        self._strided.append(_DeviceBatch(handle, [QueuedCopy(tensor.untyped_storage(), 0, nbytes, buf, then)]))

    def gather(self, pointers: list[int], sizes: list[int], then: Callable[[StagingBuffer], None]) -> None:
        """Copy several CPU byte ranges back to back into one buffer of their total size,
        now, then call ``then(buf)``. For many small tensors: one pool reservation, one
        parallel copy and one hand-over for all of them. The caller keeps the sources
        alive until this returns."""
        buf = self._acquire(sum(sizes))
        try:
            destinations, at = [], buf.ptr
            for n in sizes:
                destinations.append(at)
                at += n
            native.copy_many(destinations, pointers, sizes)
        except BaseException:
            self.pool.release(buf)
            raise
        then(buf)

    def finish(self) -> None:
        """Complete every queued copy and hand every buffer over."""
        self._drain()

    def abort(self) -> None:
        """Return every buffer not handed over, after the copies into them stopped."""
        inflight, self._inflight = self._inflight, None
        batches = ([inflight] if inflight is not None else []) + self._strided
        copies = self._cpu + self._dev
        self._cpu, self._cpu_bytes, self._dev, self._dev_bytes, self._strided = [], 0, [], 0, []
        try:
            for batch in batches:
                copies += batch.copies
                try:
                    batch.handle.wait()
                except Exception:  # the copies stopped either way; the caller has the error
                    pass
        finally:
            self._release(copies)

    # -- internals
    def _acquire(self, nbytes: int) -> StagingBuffer:
        buf = self.pool.try_acquire(nbytes)
        if buf is None:
            self._drain()  # our own buffers go to `then`, whose consumer frees them
            if self.before_wait is not None:
                self.before_wait()
            buf = self.pool.acquire(nbytes, overflow_after=None)
        return buf

    def _release(self, copies: list[QueuedCopy]) -> None:
        for c in copies:
            self.pool.release(c.buf)

    def _drain(self) -> None:
        self._flush_cpu()
        self._launch()
        self._complete_inflight()

    def _hand_over(self, copies: list[QueuedCopy]) -> None:
        for i, c in enumerate(copies):
            try:
                c.then(c.buf)
            except BaseException:
                self._release(copies[i + 1:])
                raise

    def _flush_cpu(self) -> None:
        if not self._cpu:
            return
        copies, self._cpu, self._cpu_bytes = self._cpu, [], 0
        try:
            native.copy_many([c.buf.ptr for c in copies], [c.storage.data_ptr() + c.offset for c in copies],
                             [c.nbytes for c in copies])
        except BaseException:
            self._release(copies)
            raise
        self._hand_over(copies)

    def _launch(self) -> None:
        """Hand over the device batch in flight, then start the queued one."""
        self._complete_inflight()
        if not self._dev:
            return
        copies, self._dev, self._dev_bytes = self._dev, [], 0
        try:
            handle = stage_to_host([(c.storage, c.offset, c.buf.tensor, c.nbytes) for c in copies],
                                   stream=self.stream, backend=self.backend, small_bytes=self.small_bytes)
        except BaseException:
            self._release(copies)
            raise
        self.batches += 1
        self.gathered += handle.gathered
        self._inflight = _DeviceBatch(handle, copies)

    def _complete_inflight(self) -> None:
        if self._inflight is not None:
            batch, self._inflight = self._inflight, None
            self._complete(batch)
        while self._strided:
            self._complete(self._strided.pop(0))

    def _complete(self, batch: _DeviceBatch) -> None:
        try:
            batch.handle.wait()
        except BaseException:
            self._release(batch.copies)
            raise
        self._hand_over(batch.copies)
