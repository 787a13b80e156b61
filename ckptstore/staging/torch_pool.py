"""The torch staging pool: one ``torch.empty(..., pin_memory=...)`` tensor per distinct
size, kept for reuse. Used when the extension is not built, when pinning is wanted and
the extension has no CUDA, or with CKPTSTORE_STAGING_POOL=torch. Its capacity is a hard
limit: it never lends past it."""

from __future__ import annotations

import threading
from collections import defaultdict

import torch

from .pool import DEFAULT_OVERFLOW_AFTER, StagingBuffer, StagingPool

__all__ = ["TorchStagingPool"]


class TorchStagingPool(StagingPool):
    """Staging memory in torch tensors, cached by size; a strict budget."""

    backend = "torch"
    lends_past_capacity = False

    def _setup(self, slab_bytes: int) -> None:  # slab_bytes: native pool only
        self._cond = threading.Condition()
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._cached = 0  # bytes in free buffers
        self._in_use = 0
        self._peak = 0  # most bytes held (in use + cached) at once

    # -- reporting
    @property
    def in_use(self) -> int:
        return self._in_use

    @property
    def held(self) -> int:
        return self._in_use + self._cached

    @property
    def peak(self) -> int:
        return self._peak

    def stats(self) -> dict:
        with self._cond:
            return {"capacity": self.capacity, "in_use": self._in_use, "cached": self._cached,
                    "held": self._in_use + self._cached, "peak": self._peak,
                    "pinned": self.pin_memory, "backend": "torch"}

    # -- lending
    def acquire(self, nbytes: int, *, overflow_after: float | None = DEFAULT_OVERFLOW_AFTER) -> StagingBuffer:
        """A buffer of exactly ``nbytes``; waits while in_use + nbytes > capacity
        (``overflow_after`` is ignored: this pool never lends past its capacity)."""
        return self._acquire(self.check_size(nbytes), wait=True)

    def try_acquire(self, nbytes: int) -> StagingBuffer | None:
        return self._acquire(self.check_size(nbytes), wait=False)

    def _acquire(self, nbytes: int, wait: bool) -> StagingBuffer | None:
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

    def release(self, buf: StagingBuffer) -> None:
        with self._cond:
            self._in_use -= buf.nbytes
            self._free[buf.nbytes].append(buf.tensor)
            self._cached += buf.nbytes
            self._cond.notify_all()

    def trim(self) -> None:
        """Free every cached buffer."""
        with self._cond:
            self._free.clear()
            self._cached = 0

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
