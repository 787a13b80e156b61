"""Getting a save's staging memory ready before the first save (``ckptstore.prepare``),
and the bytes a state's tensors will take."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch

from . import lifecycle
from .checkpoint.walk import tensors_in
from .runtime import runtime


def prepare(state: Any = None, *, nbytes: int | None = None) -> Future:
    """Get the staging memory of the next save ready in the background: the process's
    staging pool grows to the bytes of ``state``'s tensors (or ``nbytes``), at most its
    capacity, with every page already provided by the kernel, so the first save copies
    as fast as later ones instead of taking a page fault per page (measured: 0.75 GiB
    staged in 0.04 s after ``prepare`` against 0.1-0.8 s into fresh memory). Call it
    once the state exists (after the first optimizer step, say); a
    :class:`~ckptstore.Checkpointer` built with ``prepare=True`` does. Returns at once; the future gives the bytes
    added (0 when the pool holds enough already, or with the torch staging pool). It
    holds no memory a save of ``state`` would not take anyway. With ``nbytes`` and no
    state, the pool warmed is the pinned one when the process has initialised CUDA
    (its saves will hold CUDA tensors), else the unpinned one."""
    if nbytes is None:
        nbytes = state_nbytes(state)
    devices = frozenset(d.index for d in map(_device_of, tensors_in(state)) if d.type == "cuda")
    if state is None and torch.cuda.is_initialized():
        # Bytes without a state, in a process that uses CUDA: its saves will be of CUDA
        # tensors, so warm the pinned pool they will take, not the unpinned one.
        devices = frozenset({torch.cuda.current_device()})
    rt = runtime()
    if devices:
        with torch.cuda.device(min(devices)):  # (a pinned pool made here pins under this device)
            pool = rt.staging_pool(devices)
        device = min(devices)
    else:
        pool = rt.pool
        device = pool.device if pool.pin_memory else None
    if device is None:  # an unpinned pool: no CUDA call
        return lifecycle.track_preparation(rt.workers.submit(pool.warm, int(nbytes)))
    return lifecycle.track_preparation(rt.workers.submit(_warm_on, pool, int(nbytes), device))


def _device_of(t: torch.Tensor) -> torch.device:
    return getattr(t, "_local_tensor", t).device


def _warm_on(pool, nbytes: int, device: int) -> int:
    """``pool.warm`` on a worker thread, under ``device``: a thread with no CUDA context
    would otherwise page-lock under GPU 0's, and create that context."""
    with torch.cuda.device(device):
        return pool.warm(nbytes)


def state_nbytes(state: Any) -> int:
    """Bytes of the distinct storages of ``state``'s tensors (a DTensor's local shard)."""
    seen: set[int] = set()
    total = 0
    for t in tensors_in(state):
        t = getattr(t, "_local_tensor", t)  # a DTensor stages its local shard
        if t.layout != torch.strided or t.is_nested or t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        if storage._cdata not in seen:
            seen.add(storage._cdata)
            total += storage.nbytes()
    return total
