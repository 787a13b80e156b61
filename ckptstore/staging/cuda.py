"""Batched device-to-host copies into staging buffers: :func:`stage_to_host` and the
:class:`StageHandle` it returns.

One batch per device, on a staging stream ordered after the producer's stream. It runs
on the extension's CUDA path (:func:`ckptstore.native.cuda_stage`: a gather kernel for
small copies, the copy engine for the rest) when that was compiled and sees the
devices (``native.cuda_info()``), else on torch side streams and ``Tensor.copy_``, with
bit-identical results. See docs/native.md.
"""

from __future__ import annotations

from typing import Iterable

import torch

from .. import native
from ..config import config
from .strided import copy_boxes

__all__ = ["SMALL_COPY_BYTES", "STRIDED_PIECE_BYTES", "StageHandle", "check_stream", "stage_strided", "stage_to_host"]

#: Copies below this size go through the gather kernel (native CUDA path).
SMALL_COPY_BYTES = 64 << 10
#: The most device memory a strided copy (:func:`stage_strided`) borrows at once: torch
#: copies a non-contiguous CUDA tensor to the host through a contiguous temporary on
#: the device, so the tensor goes over in pieces of at most this many bytes.
STRIDED_PIECE_BYTES = 16 << 20


class StageHandle:
    """Device-to-host copies in flight, from :func:`stage_to_host`.

    ``wait()`` blocks (without the GIL) until every copy has landed and raises a
    CUDA error if one occurred; it waits for every device's batch even when an
    earlier one failed, so the buffers are idle once it returns or raises.
    ``done()`` polls. The handle keeps the source and destination tensors alive
    until the copies are known complete; dropping it unwaited waits first.
    """

    __slots__ = ("backend", "count", "nbytes", "gathered", "_batches", "_events", "_keep")

    def __init__(self, backend: str):
        self.backend = backend  # "native" or "torch"
        self.count = 0  # copies (zero-sized ones excluded)
        self.nbytes = 0
        self.gathered = 0  # copies done by the gather kernel (native path)
        self._batches: list = []  # the extension's CudaBatch objects
        self._events: list = []  # torch.cuda.Event
        self._keep: list | None = []  # tensors to keep alive until done

    def wait(self) -> None:
        # Every batch and event is waited even after a failure: the others may still
        # be writing into buffers the caller recycles as soon as this raises.
        first: BaseException | None = None
        for finish in [b.wait for b in self._batches] + [ev.synchronize for ev in self._events]:
            try:
                finish()
            except BaseException as exc:
                if first is None:
                    first = exc
        self._keep = None
        if first is not None:
            raise first

    def done(self) -> bool:
        finished = all(b.query() for b in self._batches) and all(ev.query() for ev in self._events)
        if finished:
            self._keep = None
        return finished

    def __del__(self):
        if self._keep is not None:
            try:
                self.wait()
            except Exception:  # pragma: no cover - nothing left to report it to
                pass


_side_streams: dict[int, "torch.cuda.Stream"] = {}


def _torch_side_stream(device: int):
    s = _side_streams.get(device)
    if s is None:
        s = _side_streams[device] = torch.cuda.Stream(device=device)
    return s


def _producer_stream(stream, device: int):
    if stream is None:
        return torch.cuda.current_stream(device)
    if isinstance(stream, dict):
        s = stream.get(device)
        if s is None:
            return torch.cuda.current_stream(device)
        if s.device.index != device:
            raise ValueError(f"stage_to_host: stream[{device}] is on cuda:{s.device.index}, "
                             f"copies on cuda:{device}")
        return s
    if stream.device.index != device:
        raise ValueError(f"stage_to_host: stream is on cuda:{stream.device.index}, copies on cuda:{device}")
    return stream


def check_stream(stream, what: str = "save"):
    """``stream`` checked and normalised for :func:`stage_to_host`: None, a
    ``torch.cuda.Stream``, or a dict {device index or ``torch.device``: stream} (keys
    become ints). Raises TypeError / ValueError naming ``what`` at once, so a bad
    argument fails before anything is staged. Touches no CUDA API."""
    if stream is None:
        return None
    if isinstance(stream, torch.cuda.Stream):
        return stream
    if not isinstance(stream, dict):
        raise TypeError(f"{what}: stream= must be None, a torch.cuda.Stream or a dict "
                        f"{{device index: torch.cuda.Stream}}, got {type(stream).__name__}")
    out = {}
    for key, s in stream.items():
        if isinstance(key, torch.device) and key.type == "cuda" and key.index is not None:
            dev = key.index
        elif isinstance(key, int) and not isinstance(key, bool) and key >= 0:
            dev = key
        else:
            raise TypeError(f"{what}: stream= dict keys must be CUDA device indexes, got {key!r}")
        if not isinstance(s, torch.cuda.Stream):
            raise TypeError(f"{what}: stream[{dev}] must be a torch.cuda.Stream, got {type(s).__name__}")
        if s.device.index != dev:
            raise ValueError(f"{what}: stream[{dev}] is on cuda:{s.device.index}")
        out[dev] = s
    return out


def _src_parts(src, what: str):
    """(storage, byte offset of src's first byte in it, bytes available from there)."""
    if isinstance(src, torch.UntypedStorage):
        storage, base = src, 0
    elif isinstance(src, torch.Tensor):
        storage, base = src.untyped_storage(), src.storage_offset() * src.element_size()
    else:
        raise TypeError(f"{what}: src must be a torch.UntypedStorage or torch.Tensor, got {type(src).__name__}")
    if storage.device.type != "cuda":
        raise ValueError(f"{what}: src must be on a CUDA device, got {storage.device}")
    return storage, base, storage.nbytes() - base


def stage_to_host(copies: Iterable[tuple], *, stream=None, backend: str | None = None,
                  small_bytes: int = SMALL_COPY_BYTES) -> StageHandle:
    """Copy CUDA bytes into host tensors, one batch per device, and return at once.

    ``copies``: ``(src, src_offset, dst, nbytes)`` tuples. ``src`` is a CUDA
    ``torch.UntypedStorage`` or ``torch.Tensor`` (bytes counted from its first
    element); ``dst`` a contiguous ``torch.uint8`` CPU tensor whose first
    ``nbytes`` receive the bytes ``[src_offset, src_offset + nbytes)`` of src.
    Page-locked destinations (the staging pool's) make the copies asynchronous;
    pageable ones work but the call then returns only once they are done.

    The copies run on a staging stream per device that first waits for the work
    enqueued so far on the producer ``stream``: None (each device's current
    stream), a ``torch.cuda.Stream`` (one device) or ``{device index: stream}``.
    The caller must not free or overwrite the sources until ``wait()`` returns.

    ``backend``: None / "auto" (the extension when ``native.cuda_available()``),
    "native" or "torch" (a torch side stream and ``Tensor.copy_``). Both give the
    same bytes.
    """
    if backend in (None, "auto"):
        backend = "native" if native.cuda_available() else "torch"
    elif backend == "native" and not native.cuda_available():
        raise RuntimeError(f"stage_to_host: the native CUDA path is unavailable ({native.cuda_info()['error']})")
    elif backend not in ("native", "torch"):
        raise ValueError(f"stage_to_host: unknown backend {backend!r}")
    handle = StageHandle(backend)
    keep = handle._keep
    groups: dict[int, list] = {}
    for k, item in enumerate(copies):
        what = f"stage_to_host: copy {k}"
        src, off, dst, n = item
        storage, base, avail = _src_parts(src, what)
        if n < 0 or off < 0 or off + n > avail:
            raise ValueError(f"{what}: bytes [{off}, {off + n}) outside the {avail}-byte source")
        if (not isinstance(dst, torch.Tensor) or dst.dtype != torch.uint8 or dst.device.type != "cpu"
                or not dst.is_contiguous()):
            raise ValueError(f"{what}: dst must be a contiguous uint8 CPU tensor")
        if dst.numel() < n:
            raise ValueError(f"{what}: dst holds {dst.numel()} bytes, needs {n}")
        if n == 0:
            continue
        keep.append(src)
        keep.append(dst)
        groups.setdefault(storage.device.index, []).append((storage, base + off, dst, n))
        handle.count += 1
        handle.nbytes += n
    sides = []  # torch side streams given work
    try:
        if backend == "native":
            gather = config().cuda_gather
            for dev, items in groups.items():
                producer = _producer_stream(stream, dev)
                batch = native.cuda_stage(dev, producer.cuda_stream, [s.data_ptr() + o for s, o, _, _ in items],
                                          [d.data_ptr() for _, _, d, _ in items], [n for _, _, _, n in items],
                                          small_bytes, gather)
                handle._batches.append(batch)
                handle.gathered += batch.gathered
        else:
            for dev, items in groups.items():
                producer = _producer_stream(stream, dev)
                side = _torch_side_stream(dev)
                side.wait_stream(producer)
                sides.append(side)
                with torch.cuda.stream(side):
                    for storage, o, dst, n in items:
                        view = torch.empty(0, dtype=torch.uint8, device=storage.device)
                        view.set_(storage, o, (n,), (1,))
                        dst[:n].copy_(view, non_blocking=True)
                        keep.append(view)
                    ev = torch.cuda.Event(blocking=True)  # waiters sleep instead of spinning
                    ev.record(side)
                handle._events.append(ev)
    except BaseException:
        # Failed for one device: the batches queued for the others (and any copies
        # queued before the failure) still write into the destinations, which the
        # caller recycles once this raises. Let them land first.
        for side in sides:
            try:
                side.synchronize()
            except BaseException:
                pass
        try:
            handle.wait()
        except BaseException:
            pass
        raise
    return handle


def stage_strided(copies: Iterable[tuple], *, stream=None, piece_bytes: int = STRIDED_PIECE_BYTES) -> StageHandle:
    """Copy non-contiguous CUDA tensors into host buffers, row-major, and return at once.

    ``copies``: ``(src, dst)``, ``src`` a CUDA tensor of any strides, ``dst`` a
    contiguous uint8 CPU tensor of at least ``src.numel() * src.element_size()`` bytes,
    which receives ``src``'s elements in row-major order (``src.contiguous()``'s bytes).
    torch copies a non-contiguous device tensor to the host through a contiguous
    temporary on the device; here each source goes over in row-major boxes of at most
    ``piece_bytes`` (:func:`~ckptstore.staging.strided.row_major_boxes`), one after the
    other on one side stream per device, so the temporaries reuse one block of the
    caching allocator: the device memory borrowed stays about ``piece_bytes``, not the
    tensor's size. Ordered after ``stream`` as :func:`stage_to_host`; torch path only
    (the extension copies byte ranges). The caller must not change the sources until
    ``wait()`` returns.
    """
    stream = check_stream(stream, "stage_strided")
    handle = StageHandle("torch")
    keep = handle._keep
    groups: dict[int, list] = {}
    for k, (src, dst) in enumerate(copies):
        if not isinstance(src, torch.Tensor) or src.device.type != "cuda":
            raise ValueError(f"stage_strided: copy {k}: src must be a CUDA tensor")
        n = src.numel() * src.element_size()
        if (not isinstance(dst, torch.Tensor) or dst.dtype != torch.uint8 or dst.device.type != "cpu"
                or not dst.is_contiguous() or dst.numel() < n):
            raise ValueError(f"stage_strided: copy {k}: dst must be a contiguous uint8 CPU tensor of >= {n} bytes")
        if n == 0:
            continue
        keep += (src, dst)
        groups.setdefault(src.device.index, []).append((src, dst))
        handle.count += 1
        handle.nbytes += n
    sides = []
    try:
        for dev, items in groups.items():
            side = _torch_side_stream(dev)
            side.wait_stream(_producer_stream(stream, dev))
            sides.append(side)
            with torch.cuda.stream(side):
                for src, dst in items:
                    copy_boxes(src, dst, piece_bytes, non_blocking=True)
                ev = torch.cuda.Event(blocking=True)
                ev.record(side)
            handle._events.append(ev)
    except BaseException:
        for side in sides:  # let queued copies land before the caller recycles the buffers
            try:
                side.synchronize()
            except BaseException:
                pass
        handle._keep = None
        raise
    return handle
