"""Row-major boxes of a tensor, and strided copies into host buffers box by box.

A tensor of shape ``(d0, d1, ...)`` split into boxes of at most ``limit`` bytes, each
contiguous in the tensor's row-major order: runs of whole rows along the outermost
dimension, or, when one row is larger than ``limit``, one index of the outermost
dimension at a time with the rest split the same way. The boxes cover every element
exactly once, in order, so box ``k`` starts in a row-major buffer where box ``k - 1``
ends. The checkpoint's chunk plan (``flatten.plan_chunks``) is this function; the
staging uses it to copy non-contiguous tensors in bounded pieces.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch

__all__ = ["copy_boxes", "row_major_boxes"]


def row_major_boxes(shape: tuple[int, ...], itemsize: int, limit: int) -> Iterator[tuple]:
    """Split a row-major tensor into boxes of at most ``limit`` bytes (one element at
    least), each contiguous in memory. Yields (offsets, sizes, byte offset, nbytes);
    nothing for an empty tensor."""
    nd = len(shape)
    total = math.prod(shape) * itemsize
    if total == 0:
        return
    if nd == 0 or total <= limit:
        yield (0,) * nd, tuple(shape), 0, total
        return
    row = math.prod(shape[1:]) * itemsize
    if row <= limit or nd == 1:
        rows = max(1, limit // row)
        for start in range(0, shape[0], rows):
            n = min(rows, shape[0] - start)
            yield (start,) + (0,) * (nd - 1), (n,) + tuple(shape[1:]), start * row, n * row
        return
    for i in range(shape[0]):
        for off, sz, b, n in row_major_boxes(tuple(shape[1:]), itemsize, limit):
            yield (i,) + off, (1,) + sz, i * row + b, n


def copy_boxes(src: torch.Tensor, dst: torch.Tensor, piece_bytes: int, *, non_blocking: bool = False) -> None:
    """Write ``src``'s elements, row-major, into the first bytes of ``dst`` (a contiguous
    uint8 CPU tensor), one box of at most ``piece_bytes`` at a time: ``Tensor.copy_``
    handles any strides, and a CUDA source's contiguous temporary on the device is one
    box, not the whole tensor. The caller orders the copies (a CUDA stream)."""
    dtype = src.dtype
    for offsets, sizes, start, nbytes in row_major_boxes(tuple(src.shape), src.element_size(), piece_bytes):
        index = tuple(slice(o, o + n) for o, n in zip(offsets, sizes))
        dst[start:start + nbytes].view(dtype).view(sizes).copy_(src[index], non_blocking=non_blocking)
