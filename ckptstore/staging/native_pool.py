"""The native staging pool: slabs of host memory from the extension's ``HostPool``.

Slabs are page-locked with ``cuMemHostAlloc`` when CUDA is used, sub-allocated at exact
sizes (64-byte aligned) with a best-fit, coalescing free list, ``max(request, 64 MiB)``
each, capped by the capacity, and kept until :meth:`NativeStagingPool.trim`. A slab is
freed by the extension's reclaimer thread, never by the thread that drops it (freeing
page-locked memory synchronises the device); under capacity pressure an ``acquire`` that
needs the room waits for it with the GIL released.

Its capacity is a soft limit. Slab bytes never exceed it, and a request that fits by
count but in no free hole (fragmentation) waits for releases too; but if none comes
within ``overflow_after`` seconds (the caller may itself hold the buffers that block
it), the pool lends ordinary memory beyond the capacity, freed on release (stats:
``overflow_allocs``, ``overflow_bytes``). ``acquire(overflow_after=None)`` (what
:class:`~ckptstore.staging.copier.StagingCopier` uses) never does.
"""

from __future__ import annotations

import threading

import torch

from .. import native
from .pool import DEFAULT_OVERFLOW_AFTER, StagingBuffer, StagingPool

__all__ = ["NativeStagingPool"]


class NativeStagingPool(StagingPool):
    """Staging memory in native slabs; lends past ``capacity`` after ``overflow_after``."""

    backend = "native"
    lends_past_capacity = True

    def _setup(self, slab_bytes: int) -> None:
        if not native.NATIVE:
            raise RuntimeError(f"StagingPool: the native backend is unavailable ({native.WHY_NOT})")
        # Pinned slabs are portable and allocated under the allocating thread's current
        # CUDA context; ``device`` (the pool's, else 0) is used only by a thread that has
        # none. (No torch.cuda.current_device() here: it would initialise CUDA in every
        # process that merely loads, and fix the device before set_device runs.)
        self._slabs = native.HostPool(self.capacity, pinned=self.pin_memory, device=self.device or 0,
                                      slab_bytes=slab_bytes)
        self._cond = threading.Condition()
        self._releases = 0  # bumped (under _cond) by every release: wakes waiters
        #: what :meth:`prepare_cuda` found ({device: cuda_prepare's dict, or {"error": ...}})
        self.cuda_devices: dict[int, dict] = {}
        if self.pin_memory:
            self.prepare_cuda()

    def prepare_cuda(self, device: int | None = None) -> dict | None:
        """Load the native CUDA path's per-device state (staging stream, gather kernel)
        now, outside any save: for ``device``, or (None) the device of the calling
        thread's current CUDA context if it has one; never creates a context on a device
        the process does not use. Best effort: returns what it found, None when there was
        nothing to prepare; an error is kept in ``cuda_devices``, not raised."""
        if not native.cuda_available():
            return None
        try:
            if device is None:
                device = native._C.cuda_current_device()
                if device < 0:
                    return None
            if device in self.cuda_devices:
                return self.cuda_devices[device]
            found = native.cuda_prepare(device)
        except Exception as exc:  # the save reports it, with its context, if it recurs
            if device is None:  # not even the current device could be told
                return None
            found = {"device": device, "error": f"{type(exc).__name__}: {exc}"}
        self.cuda_devices[device] = found
        return found

    # -- reporting
    @property
    def in_use(self) -> int:
        return self._slabs.in_use

    @property
    def held(self) -> int:
        s = self._slabs.stats()
        return s["held"] + s["overflow_bytes"]

    @property
    def peak(self) -> int:
        return self._slabs.stats()["peak"]

    def stats(self) -> dict:
        s = self._slabs.stats()
        s["held"] += s["overflow_bytes"]
        s["backend"] = "native"
        return s

    # -- lending
    def acquire(self, nbytes: int, *, overflow_after: float | None = DEFAULT_OVERFLOW_AFTER) -> StagingBuffer:
        """A buffer of exactly ``nbytes``; waits while in_use + nbytes > capacity.

        When the request fits by count but in no free hole and the capacity leaves no
        room for another slab (fragmentation), it waits for releases too. If no release
        comes for ``overflow_after`` seconds, it lends ordinary memory beyond the
        capacity instead, freed on release; ``overflow_after=None`` waits for as long as
        it takes, for a caller that holds no buffer it has not handed to whoever
        releases it (once nothing is lent, every request fits).
        """
        nbytes = self.check_size(nbytes)
        slabs = self._slabs
        while True:
            seen = self._releases
            reclaims = slabs.reclaim_fails
            block = slabs.try_alloc(nbytes)
            if block is not None:
                return _buffer(block)
            if slabs.reclaim_fails != reclaims:
                # Empty slabs were dropped to make room: it comes once the reclaimer
                # thread has freed them (off this thread; the GIL is released meanwhile).
                # A page-locked free waits for the device to be idle: a hung producer
                # stream would hold it, so CKPTSTORE_CUDA_COPY_TIMEOUT bounds this wait too.
                timeout = native.copy_timeout() if self.pin_memory else 0.0
                if not slabs.wait_reclaimed(timeout if timeout > 0 else -1.0):
                    raise RuntimeError(f"staging pool: freeing page-locked memory to make room for {nbytes} bytes "
                                       f"did not finish within {timeout} s (CKPTSTORE_CUDA_COPY_TIMEOUT): a "
                                       "free waits for the GPU to be idle (a hung kernel?)")
                continue
            in_use = slabs.in_use
            if in_use == 0:
                # Nothing is lent, yet there is no room: slab memory withheld after a
                # timed-out CUDA copy (stats()["quarantined"]) fills it, and no release
                # will come. Lend ordinary memory beyond the capacity instead of waiting.
                block = slabs.try_alloc(nbytes, overflow=True)
                if block is not None:
                    return _buffer(block)
            fragmented = in_use + nbytes <= self.capacity
            with self._cond:
                if fragmented and overflow_after is not None:
                    if self._cond.wait_for(lambda: self._releases != seen, overflow_after):
                        continue
                else:
                    while self._releases == seen:  # no release since the failed try
                        self._cond.wait()
                    continue
            block = slabs.try_alloc(nbytes, overflow=True)  # None if back-pressure meanwhile
            if block is not None:
                return _buffer(block)

    def try_acquire(self, nbytes: int) -> StagingBuffer | None:
        block = self._slabs.try_alloc(self.check_size(nbytes))
        return None if block is None else _buffer(block)

    def release(self, buf: StagingBuffer) -> None:
        self._slabs.free(buf._block)  # ValueError if released twice
        with self._cond:
            self._releases += 1
            self._cond.notify_all()

    def trim(self) -> None:
        """Free every slab that lends nothing (the only call besides capacity pressure
        that frees slabs; it returns once they are freed)."""
        self._slabs.trim()

    def warm(self, nbytes: int) -> int:
        """New slabs, populated (MADV_POPULATE_WRITE), until the pool holds
        ``min(nbytes, capacity)``; the GIL is released meanwhile. Also prepares the
        current device's CUDA staging state (:meth:`prepare_cuda`)."""
        if self.pin_memory:
            self.prepare_cuda()
        try:
            return self._slabs.warm(self.check_size(min(int(nbytes), self.capacity)))
        finally:
            # An acquire that found no room while warm held it (slabs being made) waits
            # for a release: the new slabs count as one, or it would wait for ever.
            with self._cond:
                self._releases += 1
                self._cond.notify_all()


def _buffer(block) -> StagingBuffer:
    if block.nbytes == 0:  # torch.frombuffer refuses empty buffers
        return StagingBuffer(torch.empty(0, dtype=torch.uint8), memoryview(bytearray()), block)
    return StagingBuffer(torch.frombuffer(block, dtype=torch.uint8), memoryview(block), block)
