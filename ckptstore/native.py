"""Fast byte movement on the CPU: parallel memcpy, the byte-shuffle filter, the host
memory of the native staging pool, and the probe and raw batch call of the
extension's CUDA path.

This is the only module that imports the compiled extension ``ckptstore._C``
(built from ``csrc/``). When the extension is missing, or ``CKPTSTORE_DISABLE_NATIVE=1``
(``config().disable_native``, read when this module is imported), the same functions
run on ``ctypes.memmove`` and torch views instead, with bit-identical results, and
one ``RuntimeWarning`` says why. ``NATIVE`` tells which path is active.

Pointers are plain ints (``tensor.data_ptr()``); shuffle functions take 1-D
contiguous ``torch.uint8`` CPU tensors. Overlapping source and destination
ranges are rejected with ``ValueError`` on both paths (memcpy semantics).
The native functions release the GIL while they work.

``HostPool`` is the extension's slab allocator (``None`` without the extension).

The CUDA path uses the CUDA driver API through ``libcuda.so.1``, loaded at run time:
no CUDA runtime, so it runs on every driver >= 450 that supports the GPU. When torch
sees a GPU but this path is off, :func:`cuda_available` warns once per process with
the reason (:func:`cuda_off_reason`). ``CKPTSTORE_CUDA_COPY_TIMEOUT`` (seconds, default
none) is the deadline of each staging batch's ``wait()`` (:func:`copy_timeout`).
Policy lives above, in :mod:`ckptstore.staging`: the pools that lend staging
buffers, and the batched device-to-host copies (``stage_to_host``) built on
:func:`cuda_stage`. See docs/native.md.
"""

from __future__ import annotations

import ctypes
import os
import warnings
from typing import Sequence

import torch

from .config import config

__all__ = [
    "NATIVE",
    "HostPool",
    "copy_bytes",
    "copy_many",
    "copy_timeout",
    "cuda_available",
    "cuda_info",
    "cuda_off_reason",
    "cuda_prepare",
    "cuda_stage",
    "hardware_threads",
    "shuffle",
    "shuffle_into",
    "unshuffle",
    "unshuffle_into",
]


def _load_native():
    """Return (module or None, reason it is unavailable)."""
    if config().disable_native:
        return None, "CKPTSTORE_DISABLE_NATIVE=1 is set"
    try:
        from . import _C
    except ImportError as exc:
        return None, f"ckptstore._C could not be imported: {exc}"
    return _C, ""


_C, WHY_NOT = _load_native()  # WHY_NOT: why the extension is off ("" when it is on)
NATIVE: bool = _C is not None
#: The extension's host slab pool class (``ckptstore._C.HostPool``), or None.
HostPool = _C.HostPool if NATIVE else None
if not NATIVE:
    warnings.warn(
        f"ckptstore.native: using the slower pure-Python/torch fallback ({WHY_NOT})",
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


class _FallbackBytesPart:
    """``_C.BytesPart`` without the extension: a bytearray, copied out whole by take()
    (one copy more, with the GIL held)."""

    def __init__(self, capacity: int):
        self._buf: bytearray | None = bytearray(capacity)
        self.capacity = capacity
        self.size = 0

    def write(self, src, start: int = 0) -> int:
        if self._buf is None:
            raise RuntimeError("BytesPart.write: the part was taken")
        src = memoryview(src).cast("B")
        if start > len(src):
            raise ValueError("BytesPart.write: start beyond the source's end")
        n = min(len(src) - start, self.capacity - self.size)
        self._buf[self.size:self.size + n] = src[start:start + n]
        self.size += n
        return n

    def take(self) -> bytes:
        if self._buf is None:
            raise RuntimeError("BytesPart.take: the part was taken")
        buf, self._buf = self._buf, None
        return bytes(memoryview(buf)[:self.size])


#: A bytes object of ``capacity`` bytes filled in place by ``write(src, start=0)`` (as
#: much of ``src[start:]`` as fits; returns the count), then handed out by ``take()``
#: (once; what was written, the object itself shrunk in place when not full). The S3
#: writer builds its upload parts in them. Callers serialise their calls.
BytesPart = _C.BytesPart if NATIVE else _FallbackBytesPart


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


# ---- CUDA: the driver probe and the raw batch call --------------------------------

#: Environment variable: seconds a staging batch's ``wait()`` may take before the save
#: fails (a hung producer stream, a lost GPU); unset, empty or 0: no limit.
COPY_TIMEOUT_ENV = "CKPTSTORE_CUDA_COPY_TIMEOUT"

_warned_cuda_off = False


def copy_timeout() -> float:
    """The deadline of native staging batches, from ``CKPTSTORE_CUDA_COPY_TIMEOUT``
    (read at each call; 0.0 = none). ``ValueError`` if it is not a number >= 0."""
    raw = os.environ.get(COPY_TIMEOUT_ENV, "").strip()
    if not raw:
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"{COPY_TIMEOUT_ENV}={raw!r}: expected a number of seconds >= 0 (0: no limit)")
    return value


def cuda_info() -> dict:
    """What the extension sees of the CUDA driver: compiled, available, devices,
    driver_version, min_driver_version, api, library, kernel, error (and
    runtime_version, always 0: no CUDA runtime is linked). Never raises; probes once."""
    if not NATIVE:
        return {"compiled": False, "available": False, "devices": 0, "runtime_version": 0,
                "driver_version": 0, "min_driver_version": 0, "api": "", "library": "", "kernel": "",
                "error": WHY_NOT}
    return _C.cuda_info()


def cuda_off_reason() -> str | None:
    """Why the native CUDA path is off, in words, or None when it is on."""
    info = cuda_info()
    if info["available"]:
        return None
    if not NATIVE:
        return f"the extension is not loaded: {WHY_NOT}"
    if not info["compiled"]:
        return f"the extension was built without its CUDA path: {info['error']}"
    return info["error"] or "unknown"


def cuda_available() -> bool:
    """True when the extension's CUDA path can run (built with it, driver, >= 1 device).

    False while torch sees a GPU: one ``RuntimeWarning`` per process says why (staging
    then runs on torch streams)."""
    if NATIVE and _C.cuda_info()["available"]:
        return True
    global _warned_cuda_off
    if not _warned_cuda_off and torch.cuda.is_available():
        _warned_cuda_off = True
        warnings.warn(f"ckptstore: the native CUDA staging path is off ({cuda_off_reason()}); "
                      "device-to-host staging uses torch streams instead (slower for many small "
                      "tensors). `ckptstore doctor` shows the details.", RuntimeWarning, stacklevel=2)
    return False


def cuda_prepare(device: int) -> dict:
    """Create ``device``'s staging state now: its stream and events, and the gather
    kernel loaded (JIT-compiled once per process; a lazy load could synchronise the
    device in the middle of a save). ``cuda_stage`` does this on a device's first use;
    call it ahead of the first save to keep that out of the save. Retains the device's
    primary context (the one torch uses): call it for devices the process uses only.
    Returns ``{device, compute_capability, gather, gather_error}``."""
    if not cuda_available():
        raise RuntimeError(f"cuda_prepare: the native CUDA path is unavailable ({cuda_off_reason()})")
    return _C.cuda_prepare(int(device))


def cuda_stage(device: int, stream_handle: int, src_ptrs: Sequence[int], dst_ptrs: Sequence[int],
               sizes: Sequence[int], small_bytes: int, gather: bool, timeout: float | None = None):
    """One batch of device-to-host copies on ``device``'s staging stream, ordered after
    the producer stream ``stream_handle`` (a ``cudaStream_t`` as int); returns the
    extension's ``CudaBatch`` (``wait()``, ``query()``, ``gathered``). ``timeout``: the
    seconds its ``wait()`` may take before it raises (None: :func:`copy_timeout`; 0: no
    limit). The raw binding: pointers are not checked here. Use
    :func:`ckptstore.staging.stage_to_host`, which checks every range, keeps the tensors
    alive and falls back to torch streams."""
    if not cuda_available():
        raise RuntimeError(f"cuda_stage: the native CUDA path is unavailable ({cuda_off_reason()})")
    t = copy_timeout() if timeout is None else float(timeout)
    if t:
        return _C.cuda_stage(device, stream_handle, src_ptrs, dst_ptrs, sizes, small_bytes, gather, timeout=t)
    return _C.cuda_stage(device, stream_handle, src_ptrs, dst_ptrs, sizes, small_bytes, gather)  # no deadline
