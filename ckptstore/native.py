"""Fast byte movement: parallel memcpy, the byte-shuffle filter, the host memory of the
staging pool and batched device-to-host copies.

This is the only module that imports the compiled extension ``ckptstore._C``
(built from ``csrc/``). When the extension is missing, or the environment
variable ``CKPTSTORE_DISABLE_NATIVE=1`` is set, the same functions run on
``ctypes.memmove`` and torch views instead, with bit-identical results, and
one ``RuntimeWarning`` says why. ``NATIVE`` tells which path is active.

Pointers are plain ints (``tensor.data_ptr()``); shuffle functions take 1-D
contiguous ``torch.uint8`` CPU tensors. Overlapping source and destination
ranges are rejected with ``ValueError`` on both paths (memcpy semantics).
The native functions release the GIL while they work.

``HostPool`` is the extension's slab allocator (``None`` without the extension;
``ckptstore.staging.StagingPool`` then lends torch tensors). ``stage_to_host``
copies CUDA bytes into host memory in one batch per device, on a staging stream
ordered after the producer's stream; it runs on the extension's CUDA path when
that was compiled and sees the devices (``cuda_info()``), else on torch streams
and ``Tensor.copy_``, with bit-identical results. See docs/native.md.
"""

from __future__ import annotations

import ctypes
import os
import warnings
from typing import Iterable, Sequence

import torch

__all__ = [
    "NATIVE",
    "SMALL_COPY_BYTES",
    "HostPool",
    "StageHandle",
    "copy_bytes",
    "copy_many",
    "cuda_available",
    "cuda_info",
    "hardware_threads",
    "shuffle",
    "shuffle_into",
    "stage_to_host",
    "unshuffle",
    "unshuffle_into",
]


def _load_native():
    """Return (module or None, reason it is unavailable)."""
    if os.environ.get("CKPTSTORE_DISABLE_NATIVE") == "1":
        return None, "CKPTSTORE_DISABLE_NATIVE=1 is set"
    try:
        from . import _C
    except ImportError as exc:
        return None, f"ckptstore._C could not be imported: {exc}"
    return _C, ""


_C, _WHY_NOT = _load_native()
NATIVE: bool = _C is not None
#: The extension's host slab pool class (``ckptstore._C.HostPool``), or None.
HostPool = _C.HostPool if NATIVE else None
if not NATIVE:
    warnings.warn(
        f"ckptstore.native: using the slower pure-Python/torch fallback ({_WHY_NOT})",
        RuntimeWarning,
        stacklevel=2,
    )


# ---- argument checks shared by both paths ----------------------------------


def _check_ranges(dst: int, src: int, nbytes: int, what: str) -> None:
    if nbytes < 0:
        raise ValueError(f"{what}: nbytes must be >= 0, got {nbytes}")
    if nbytes == 0:
        return
    if not dst or not src:
        raise ValueError(f"{what}: null pointer (dst={dst}, src={src}, nbytes={nbytes})")
    if dst < src + nbytes and src < dst + nbytes:
        raise ValueError(
            f"{what}: source and destination overlap (dst={dst}, src={src}, nbytes={nbytes})"
        )


def _check_bytes_tensor(t: torch.Tensor, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.uint8 or t.dim() != 1 or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(
            f"{name} must be a 1-D contiguous uint8 CPU tensor, "
            f"got dtype={t.dtype} shape={tuple(t.shape)} device={t.device}"
        )


def _check_shuffle_args(dst: torch.Tensor, src: torch.Tensor, itemsize: int, what: str) -> None:
    _check_bytes_tensor(dst, "dst")
    _check_bytes_tensor(src, "src")
    if not isinstance(itemsize, int) or itemsize < 1:
        raise ValueError(f"{what}: itemsize must be an int >= 1, got {itemsize!r}")
    if dst.numel() != src.numel():
        raise ValueError(f"{what}: dst has {dst.numel()} bytes, src has {src.numel()}")
    _check_ranges(dst.data_ptr(), src.data_ptr(), src.numel(), what)


# ---- fallback implementations (arguments already checked) -------------------


def _fallback_copy_bytes(dst_ptr: int, src_ptr: int, nbytes: int) -> None:
    if nbytes:
        ctypes.memmove(dst_ptr, src_ptr, nbytes)


def _fallback_copy_many(dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int]) -> None:
    for d, s, n in zip(dsts, srcs, sizes):
        _fallback_copy_bytes(d, s, n)


def _fallback_shuffle_into(dst: torch.Tensor, src: torch.Tensor, itemsize: int) -> None:
    n = src.numel() // itemsize
    body = n * itemsize
    # (n, itemsize) -> (itemsize, n): row j is byte plane j.
    dst[:body].view(itemsize, n).copy_(src[:body].view(n, itemsize).t())
    dst[body:].copy_(src[body:])


def _fallback_unshuffle_into(dst: torch.Tensor, src: torch.Tensor, itemsize: int) -> None:
    n = src.numel() // itemsize
    body = n * itemsize
    dst[:body].view(n, itemsize).copy_(src[:body].view(itemsize, n).t())
    dst[body:].copy_(src[body:])


# ---- public API --------------------------------------------------------------


def hardware_threads() -> int:
    """Number of hardware threads the native pool can use."""
    return _C.hardware_threads() if NATIVE else (os.cpu_count() or 1)


def copy_bytes(dst_ptr: int, src_ptr: int, nbytes: int, threads: int = 0) -> None:
    """memcpy ``nbytes`` from ``src_ptr`` to ``dst_ptr`` (threads=0: default count)."""
    _check_ranges(dst_ptr, src_ptr, nbytes, "copy_bytes")
    if NATIVE:
        _C.parallel_copy(dst_ptr, src_ptr, nbytes, threads)
    else:
        _fallback_copy_bytes(dst_ptr, src_ptr, nbytes)


def copy_many(
    dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int], threads: int = 0
) -> None:
    """Copy ``sizes[k]`` bytes from ``srcs[k]`` to ``dsts[k]`` for all k, in one call."""
    if not len(dsts) == len(srcs) == len(sizes):
        raise ValueError(
            f"copy_many: dsts, srcs and sizes differ in length "
            f"({len(dsts)}, {len(srcs)}, {len(sizes)})"
        )
    if NATIVE:
        _C.copy_many(dsts, srcs, sizes, threads)  # checks each range itself
    else:
        for k, (d, s, n) in enumerate(zip(dsts, srcs, sizes)):
            _check_ranges(d, s, n, f"copy_many[{k}]")
        _fallback_copy_many(dsts, srcs, sizes)


def shuffle_into(dst: torch.Tensor, src: torch.Tensor, itemsize: int) -> torch.Tensor:
    """Write the byte-plane shuffle of ``src`` into ``dst`` and return ``dst``.

    For n = len(src) // itemsize elements, byte plane j of the output holds byte
    j of every element (``dst[j*n + i] = src[i*itemsize + j]``); the trailing
    ``len(src) % itemsize`` bytes are copied unchanged at the end (as blosc).
    """
    _check_shuffle_args(dst, src, itemsize, "shuffle")
    if NATIVE:
        _C.shuffle(dst.data_ptr(), src.data_ptr(), src.numel(), itemsize)
    else:
        _fallback_shuffle_into(dst, src, itemsize)
    return dst


def unshuffle_into(dst: torch.Tensor, src: torch.Tensor, itemsize: int) -> torch.Tensor:
    """Inverse of :func:`shuffle_into`: write the unshuffled ``src`` into ``dst``."""
    _check_shuffle_args(dst, src, itemsize, "unshuffle")
    if NATIVE:
        _C.unshuffle(dst.data_ptr(), src.data_ptr(), src.numel(), itemsize)
    else:
        _fallback_unshuffle_into(dst, src, itemsize)
    return dst


def shuffle(src: torch.Tensor, itemsize: int) -> torch.Tensor:
    """Byte-plane shuffle of a 1-D uint8 CPU tensor into a new tensor."""
    _check_bytes_tensor(src, "src")
    return shuffle_into(torch.empty_like(src), src, itemsize)


def unshuffle(src: torch.Tensor, itemsize: int) -> torch.Tensor:
    """Inverse of :func:`shuffle`, into a new tensor."""
    _check_bytes_tensor(src, "src")
    return unshuffle_into(torch.empty_like(src), src, itemsize)


# ---- CUDA: runtime probe and batched device-to-host staging --------------------

#: Copies below this size go through the gather kernel (native CUDA path).
SMALL_COPY_BYTES = 64 << 10


def cuda_info() -> dict:
    """What the extension's CUDA runtime sees: compiled, available, devices,
    runtime_version, driver_version, error. Never raises; probes once."""
    if not NATIVE:
        return {"compiled": False, "available": False, "devices": 0, "runtime_version": 0,
                "driver_version": 0, "error": _WHY_NOT}
    return _C.cuda_info()


def cuda_available() -> bool:
    """True when the extension's CUDA path can run (compiled, driver, >= 1 device)."""
    return NATIVE and bool(_C.cuda_info()["available"])


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
        self._batches: list = []  # _C.CudaBatch
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

    ``backend``: None / "auto" (the extension when :func:`cuda_available`),
    "native" or "torch" (a torch side stream and ``Tensor.copy_``). Both give the
    same bytes.
    """
    if backend in (None, "auto"):
        backend = "native" if cuda_available() else "torch"
    elif backend == "native" and not cuda_available():
        raise RuntimeError(f"stage_to_host: the native CUDA path is unavailable ({cuda_info()['error']})")
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
            gather = os.environ.get("CKPTSTORE_CUDA_GATHER", "1") != "0"
            for dev, items in groups.items():
                producer = _producer_stream(stream, dev)
                batch = _C.cuda_stage(dev, producer.cuda_stream, [s.data_ptr() + o for s, o, _, _ in items],
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
