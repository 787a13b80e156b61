"""The staging pool: bounded, reusable host buffers that hold tensors' bytes while the
background pipeline encodes and writes them.

Buffers are allocated at the exact size asked (no power-of-two rounding) and kept for
reuse: the same state saved again asks for the same sizes, so a training loop allocates
(and, on CUDA machines, page-locks) once. ``acquire`` blocks while the bytes in use plus
the new request would exceed the capacity: that is the back-pressure that lets a pool
smaller than the state work, and that stops saves from piling up until an OOM.
"""

from __future__ import annotations

import os
import threading
from collections import defaultdict

import torch

from . import native


def default_capacity() -> int:
    """Half the machine's memory, or CKPTSTORE_STAGING_BYTES when set."""
    env = os.environ.get("CKPTSTORE_STAGING_BYTES")
    if env:
        return int(env)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


class StagingBuffer:
    """One host buffer lent by the pool; ``view`` is a writable memoryview of it."""

    __slots__ = ("tensor", "nbytes", "view")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.nbytes = tensor.numel()
        self.view = memoryview(tensor.numpy()) if self.nbytes else memoryview(bytearray())

    @property
    def ptr(self) -> int:
        return self.tensor.data_ptr()


class StagingPool:
    def __init__(self, capacity: int | None = None, pin_memory: bool | None = None):
        self.capacity = default_capacity() if capacity is None else int(capacity)
        if self.capacity <= 0:
            raise ValueError(f"staging capacity must be positive, got {self.capacity}")
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._cond = threading.Condition()
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._cached = 0  # bytes in free buffers
        self._in_use = 0
        self.peak = 0  # most bytes held (in use + cached) at once

    # -- reporting
    @property
    def in_use(self) -> int:
        return self._in_use

    @property
    def held(self) -> int:
        return self._in_use + self._cached

    def stats(self) -> dict:
        with self._cond:
            return {"capacity": self.capacity, "in_use": self._in_use, "cached": self._cached,
                    "peak": self.peak, "pinned": self.pin_memory}

    # -- lending
    def acquire(self, nbytes: int) -> StagingBuffer:
        """A buffer of exactly ``nbytes``; waits while the pool is full."""
        if nbytes > self.capacity:
            raise ValueError(f"a {nbytes}-byte buffer exceeds the staging capacity {self.capacity}")
        with self._cond:
            while self._in_use + nbytes > self.capacity:
                self._cond.wait()
            free = self._free.get(nbytes)
            if free:
                tensor = free.pop()
                self._cached -= nbytes
            else:
                self._evict(self._in_use + self._cached + nbytes - self.capacity)
                tensor = None
            self._in_use += nbytes
            self.peak = max(self.peak, self.held)
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

    def trim(self) -> None:
        """Free every cached buffer."""
        with self._cond:
            self._free.clear()
            self._cached = 0


def copy_into(buf: StagingBuffer, src_ptr: int, nbytes: int) -> None:
    """Copy host bytes into a staging buffer, in parallel and without the GIL."""
    if nbytes:
        native.copy_bytes(buf.ptr, src_ptr, nbytes)
