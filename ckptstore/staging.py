"""The staging pool: bounded, reusable host buffers that hold tensors' bytes while the
background pipeline encodes and writes them.

Buffers are allocated at the exact size asked (no power-of-two rounding) and kept for
reuse: the same state saved again asks for the same sizes, so a training loop allocates
(and, on CUDA machines, page-locks) once. ``acquire`` blocks while the bytes in use plus
the new request would exceed the capacity: that is the back-pressure that lets a pool
smaller than the state work, and that stops saves from piling up until an OOM.

Two backends give the same interface:

* ``native`` (chosen by the default ``backend="auto"`` when the extension
  ``ckptstore._C`` is built, and sees a CUDA device if pinning is wanted): slabs of
  host memory from :class:`ckptstore.native.HostPool`, page-locked with
  ``cudaHostAlloc`` when CUDA is used, sub-allocated at exact sizes (64-byte aligned)
  with a best-fit, coalescing free list. Slabs are ``max(request, 64 MiB)`` capped by
  the capacity and are kept until :meth:`StagingPool.trim`. Slab bytes never exceed
  the capacity: a request that fits by count but in no hole (fragmentation) waits for
  releases too; only if none comes for a second (the caller may hold the buffers
  itself) does it get ordinary memory beyond the budget, freed on release.
* ``torch`` (no extension, or pinning wanted while the extension has no CUDA): one
  ``torch.empty(..., pin_memory=...)`` tensor per distinct size, kept for reuse.

:class:`StagingCopier` fills buffers for one save: CPU bytes at once (parallel copy,
no GIL), CUDA bytes in batches through :func:`ckptstore.native.stage_to_host`.
"""

from __future__ import annotations

import os
import threading
from collections import defaultdict
from typing import Callable

import torch

from . import native

__all__ = ["StagingBuffer", "StagingPool", "StagingCopier", "default_capacity"]

DEFAULT_SLAB_BYTES = 64 << 20
#: Backend of ``StagingPool(backend=None)`` unless CKPTSTORE_STAGING_POOL is set.
DEFAULT_BACKEND = "auto"


def default_capacity() -> int:
    """Half the machine's memory, or CKPTSTORE_STAGING_BYTES when set."""
    env = os.environ.get("CKPTSTORE_STAGING_BYTES")
    if env:
        return int(env)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


class StagingBuffer:
    """One host buffer lent by the pool.

    ``tensor`` is a 1-D uint8 CPU tensor over the buffer's memory, ``view`` a writable
    memoryview of it, ``ptr`` its address, ``nbytes`` its size. The memory belongs to
    the pool: use it only between ``acquire`` and ``release``.
    """

    __slots__ = ("tensor", "nbytes", "view", "_block")

    def __init__(self, tensor: torch.Tensor, view: memoryview | None = None, block=None):
        self.tensor = tensor
        self.nbytes = tensor.numel()
        if view is None:
            view = memoryview(tensor.numpy()) if self.nbytes else memoryview(bytearray())
        self.view = view
        self._block = block  # the native Block, or None

    @property
    def ptr(self) -> int:
        return self.tensor.data_ptr()


def _choose_backend(backend: str | None, pin: bool) -> str:
    if backend is None:
        # CKPTSTORE_STAGING_POOL=auto|native|torch overrides the default (an escape
        # hatch should the native pool misbehave on some machine).
        backend = os.environ.get("CKPTSTORE_STAGING_POOL", DEFAULT_BACKEND)
    if backend == "auto":
        if native.NATIVE and (not pin or native.cuda_available()):
            return "native"
        return "torch"
    if backend == "native":
        if not native.NATIVE:
            raise RuntimeError(f"StagingPool: the native backend is unavailable ({native._WHY_NOT})")
        return "native"
    if backend == "torch":
        return "torch"
    raise ValueError(f"StagingPool: unknown backend {backend!r}")


class StagingPool:
    """Bounded, reusable host staging memory.

    ``capacity``: most bytes lent at once (default :func:`default_capacity`).
    ``pin_memory``: page-lock the memory (default: when CUDA is available).
    ``backend``: "auto" (native when the extension can serve the request: built, and
    CUDA visible to it if pinning is wanted), "native" or "torch"; None means
    ``$CKPTSTORE_STAGING_POOL`` or :data:`DEFAULT_BACKEND`.
    ``slab_bytes``: usual slab size of the native backend.
    """

    def __init__(self, capacity: int | None = None, pin_memory: bool | None = None, *,
                 backend: str | None = None, slab_bytes: int = DEFAULT_SLAB_BYTES):
        self.capacity = default_capacity() if capacity is None else int(capacity)
        if self.capacity <= 0:
            raise ValueError(f"staging capacity must be positive, got {self.capacity}")
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        self.backend = _choose_backend(backend, self.pin_memory)
        self._cond = threading.Condition()
        self._native = None
        if self.backend == "native":
            # Pinned slabs are portable and allocated under the allocating thread's
            # current CUDA context; ``device`` is used only by a thread that has none.
            # (No torch.cuda.current_device() here: it would initialise CUDA in every
            # process that merely loads, and fix the device before set_device runs.)
            self._native = native.HostPool(self.capacity, pinned=self.pin_memory, device=0,
                                           slab_bytes=int(slab_bytes))
            self._releases = 0  # bumped (under _cond) by every release: wakes waiters
        else:
            self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
            self._cached = 0  # bytes in free buffers
            self._in_use = 0
            self._peak = 0  # most bytes held (in use + cached) at once

    # -- reporting
    @property
    def in_use(self) -> int:
        return self._native.in_use if self._native is not None else self._in_use

    @property
    def held(self) -> int:
        if self._native is not None:
            s = self._native.stats()
            return s["held"] + s["overflow_bytes"]
        return self._in_use + self._cached

    @property
    def peak(self) -> int:
        return self._native.stats()["peak"] if self._native is not None else self._peak

    def stats(self) -> dict:
        """capacity, in_use (bytes lent), cached (held, not lent), held, peak (most bytes
        held at once), pinned, backend; the native backend adds its slab figures."""
        if self._native is not None:
            s = self._native.stats()
            s["held"] += s["overflow_bytes"]
            s["backend"] = "native"
            return s
        with self._cond:
            return {"capacity": self.capacity, "in_use": self._in_use, "cached": self._cached,
                    "held": self._in_use + self._cached, "peak": self._peak,
                    "pinned": self.pin_memory, "backend": "torch"}

    # -- lending
    def _check_size(self, nbytes: int) -> int:
        nbytes = int(nbytes)
        if nbytes < 0:
            raise ValueError(f"a buffer size must be >= 0, got {nbytes}")
        if nbytes > self.capacity:
            raise ValueError(f"a {nbytes}-byte buffer exceeds the staging capacity {self.capacity}")
        return nbytes

    def acquire(self, nbytes: int, *, overflow_after: float | None = 1.0) -> StagingBuffer:
        """A buffer of exactly ``nbytes``; waits while in_use + nbytes > capacity.

        Native backend, when the request fits by count but in no free hole and the
        capacity leaves no room for another slab (fragmentation), it waits for releases
        too: the budget stays strict. If no release comes for ``overflow_after``
        seconds (the caller may itself hold the buffers that block it), it lends
        ordinary memory beyond the capacity instead, freed on release (stats:
        ``overflow_allocs``); ``overflow_after=None`` waits for as long as it takes,
        for a caller that holds no buffer it has not handed to whoever releases it
        (once nothing is lent, every request fits).
        """
        nbytes = self._check_size(nbytes)
        if self._native is None:
            return self._torch_acquire(nbytes, wait=True)
        pool = self._native
        while True:
            seen = self._releases
            block = pool.try_alloc(nbytes)
            if block is not None:
                return _native_buffer(block)
            fragmented = pool.in_use + nbytes <= self.capacity
            with self._cond:
                if fragmented and overflow_after is not None:
                    if self._cond.wait_for(lambda: self._releases != seen, overflow_after):
                        continue
                else:
                    while self._releases == seen:  # no release since the failed try
                        self._cond.wait()
                    continue
            block = pool.try_alloc(nbytes, overflow=True)  # None if back-pressure meanwhile
            if block is not None:
                return _native_buffer(block)

    def try_acquire(self, nbytes: int) -> StagingBuffer | None:
        """A buffer of exactly ``nbytes`` from the budget at once, or None (back-pressure,
        or native fragmentation) instead of waiting."""
        nbytes = self._check_size(nbytes)
        if self._native is None:
            return self._torch_acquire(nbytes, wait=False)
        block = self._native.try_alloc(nbytes)
        return None if block is None else _native_buffer(block)

    def release(self, buf: StagingBuffer) -> None:
        if self._native is None:
            self._torch_release(buf)
            return
        self._native.free(buf._block)  # ValueError if released twice
        with self._cond:
            self._releases += 1
            self._cond.notify_all()

    def trim(self) -> None:
        """Free every cached buffer (native: every slab that lends nothing)."""
        if self._native is not None:
            self._native.trim()
            return
        with self._cond:
            self._free.clear()
            self._cached = 0

    # -- torch backend
    def _torch_acquire(self, nbytes: int, wait: bool) -> StagingBuffer | None:
        with self._cond:
            while self._in_use + nbytes > self.capacity:
                if not wait:
                    return None
                self._cond.wait()
            free = self._free.get(nbytes)
            if free:
                tensor = free.pop()
                self._cached -= nbytes
            else:
                self._evict(self._in_use + self._cached + nbytes - self.capacity)
                tensor = None
            self._in_use += nbytes
            self._peak = max(self._peak, self._in_use + self._cached)
        if tensor is None:
            try:
                tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin_memory)
            except BaseException:
                with self._cond:
                    self._in_use -= nbytes
                    self._cond.notify_all()
                raise
        return StagingBuffer(tensor)

    def _torch_release(self, buf: StagingBuffer) -> None:
        with self._cond:
            self._in_use -= buf.nbytes
            self._free[buf.nbytes].append(buf.tensor)
            self._cached += buf.nbytes
            self._cond.notify_all()

    def _evict(self, need: int) -> None:
        # Free cached buffers of other sizes until ``need`` bytes are gone.
        for size in sorted(self._free, reverse=True):
            lst = self._free[size]
            while lst and need > 0:
                lst.pop()
                self._cached -= size
                need -= size
            if need <= 0:
                break


def _native_buffer(block) -> StagingBuffer:
    if block.nbytes == 0:  # torch.frombuffer refuses empty buffers
        return StagingBuffer(torch.empty(0, dtype=torch.uint8), memoryview(bytearray()), block)
    return StagingBuffer(torch.frombuffer(block, dtype=torch.uint8), memoryview(block), block)


class StagingCopier:
    """Fills staging buffers from tensor storages for one save.

    ``copy(storage, byte_offset, nbytes, then)`` takes a buffer from the pool and
    arranges for ``storage``'s bytes ``[byte_offset, byte_offset + nbytes)`` to land
    in it, then calls ``then(buf)`` (on the caller's thread), which takes ownership
    of the buffer. Copies are batched: CPU bytes by one parallel ``copy_many`` per
    ``cpu_batch_bytes`` (default ``batch_bytes``; one wake-up of the copy threads instead of one per chunk),
    CUDA bytes by one :func:`ckptstore.native.stage_to_host` call per device and
    ``batch_bytes``, each device batch running while the next one is queued; other
    devices by ``Tensor.copy_``, at once. The copier keeps every source storage
    referenced until its bytes have landed.
    ``finish()`` completes every copy and hands every buffer over. When the pool has
    no room (``try_acquire`` fails) it hands over everything it holds, calls
    ``before_wait()`` (e.g. ``writer.flush``: whoever holds the handed-over buffers
    must start releasing them), then waits in ``acquire(overflow_after=None)``: a pool
    smaller than the state drains instead of deadlocking, within a strict budget.

    Use it as a context manager (``finish()`` on success; on an exception, waits for
    copies in flight and returns the buffers not handed over to the pool).
    """

    def __init__(self, pool: StagingPool, *, before_wait: Callable[[], None] | None = None,
                 batch_bytes: int | None = None, cpu_batch_bytes: int | None = None, stream=None,
                 backend: str | None = None, small_bytes: int = native.SMALL_COPY_BYTES):
        self.pool = pool
        self.before_wait = before_wait
        self.batch_bytes = int(batch_bytes) if batch_bytes else max(1, min(pool.capacity // 4, 256 << 20))
        # CPU batches as large as device ones: the writer holds chunks back until the
        # staging ends anyway, and fewer, larger copy_many calls run closer to one memcpy.
        self.cpu_batch_bytes = int(cpu_batch_bytes) if cpu_batch_bytes else self.batch_bytes
        self.stream = stream
        self.backend = backend
        self.small_bytes = small_bytes
        self._cpu: list[tuple] = []  # (storage, src_ptr, nbytes, buf, then)
        self._cpu_bytes = 0
        self._dev: list[tuple] = []  # (storage, byte_offset, nbytes, buf, then)
        self._dev_bytes = 0
        self._inflight: tuple | None = None  # (StageHandle, entries)
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
        buf = self.pool.try_acquire(nbytes)
        if buf is None:
            self._drain()  # our own buffers go to `then`, whose consumer frees them
            if self.before_wait is not None:
                self.before_wait()
            buf = self.pool.acquire(nbytes, overflow_after=None)
        kind = storage.device.type
        if kind == "cuda":
            self._dev.append((storage, byte_offset, nbytes, buf, then))
            self._dev_bytes += nbytes
            if self._dev_bytes >= self.batch_bytes:
                self._launch()
        elif kind == "cpu":
            self._cpu.append((storage, storage.data_ptr() + byte_offset, nbytes, buf, then))
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

    def finish(self) -> None:
        """Complete every queued copy and hand every buffer over."""
        self._drain()

    def abort(self) -> None:
        """Return every buffer not handed over, after the copies into them stopped."""
        inflight, self._inflight = self._inflight, None
        entries = self._cpu + self._dev
        self._cpu, self._cpu_bytes, self._dev, self._dev_bytes = [], 0, [], 0
        try:
            if inflight is not None:
                entries += inflight[1]
                try:
                    inflight[0].wait()
                except Exception:  # the copies stopped either way; the caller has the error
                    pass
        finally:
            for entry in entries:
                self.pool.release(entry[3])

    # -- internals
    def _drain(self) -> None:
        self._flush_cpu()
        self._launch()
        self._complete_inflight()

    def _hand_over(self, entries: list) -> None:
        for i, entry in enumerate(entries):
            try:
                entry[4](entry[3])
            except BaseException:
                for rest in entries[i + 1:]:
                    self.pool.release(rest[3])
                raise

    def _flush_cpu(self) -> None:
        if not self._cpu:
            return
        entries, self._cpu, self._cpu_bytes = self._cpu, [], 0
        try:
            native.copy_many([e[3].ptr for e in entries], [e[1] for e in entries], [e[2] for e in entries])
        except BaseException:
            for entry in entries:
                self.pool.release(entry[3])
            raise
        self._hand_over(entries)

    def _launch(self) -> None:
        """Hand over the device batch in flight, then start the queued one."""
        self._complete_inflight()
        if not self._dev:
            return
        entries, self._dev, self._dev_bytes = self._dev, [], 0
        try:
            handle = native.stage_to_host([(s, o, b.tensor, n) for s, o, n, b, _ in entries],
                                          stream=self.stream, backend=self.backend,
                                          small_bytes=self.small_bytes)
        except BaseException:
            for entry in entries:
                self.pool.release(entry[3])
            raise
        self.batches += 1
        self.gathered += handle.gathered
        self._inflight = (handle, entries)

    def _complete_inflight(self) -> None:
        if self._inflight is None:
            return
        handle, entries = self._inflight
        self._inflight = None
        try:
            handle.wait()
        except BaseException:
            for entry in entries:
                self.pool.release(entry[3])
            raise
        self._hand_over(entries)
