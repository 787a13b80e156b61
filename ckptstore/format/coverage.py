"""Coverage geometry (I5): chunks lie inside their tensor and cover it exactly once,
checked in O(n log n) by signed corner counts (:func:`check_exact_cover`)."""

from __future__ import annotations

import math

from ..errors import FormatError
from .dtypes import itemsize
from .records import TensorEntry

# The exact-cover check sorts 2**k corner rows per chunk, k = the dimensions chunks
# split (1 or 2 in practice, at most 3 for FSDP over TP): both bounds keep a hostile
# manifest's cost per tensor near what an honest one of its size costs.
_CORNER_DIMS = 5
_MAX_CORNERS = 1 << 21  # corner rows per tensor (about 50 MiB of int64 at k = 3)


def validate_coverage(entry: TensorEntry, what: str) -> None:
    """Chunks lie inside the tensor, do not overlap, and add up to it; lengths agree.

    O(n log n) in the number of chunks (see :func:`check_exact_cover`), so a manifest
    of many chunks costs what it holds, never n squared."""
    shape = entry.shape
    nd = len(shape)
    size = itemsize(entry.dtype)
    chunks = entry.chunks
    if len(chunks) == 1 and chunks[0].sizes == shape and len(chunks[0].offsets) == nd and not any(chunks[0].offsets):
        # one chunk, the whole tensor (most tensors): only its length is left to check
        if chunks[0].blob.raw_length != math.prod(shape) * size:
            raise FormatError(f"{what}: chunk 0 raw_length {chunks[0].blob.raw_length} != {math.prod(shape) * size}")
        return
    total, boxes = validate_chunks(entry, what)
    if total != entry.numel:
        raise FormatError(f"{what}: chunks cover {total} of {entry.numel} elements")
    check_exact_cover(shape, boxes, what)


def validate_chunks(entry: TensorEntry, what: str) -> tuple[int, list]:
    """Each chunk lies inside the tensor, with the tensor's number of dimensions, and
    its raw_length is its region's bytes (a part of a tensor, as a version 4 index holds
    of a global one, can be checked no further). Returns (elements, non-empty chunks)."""
    shape = entry.shape
    nd = len(shape)
    size = itemsize(entry.dtype)
    total = 0
    boxes = []
    for i, c in enumerate(entry.chunks):
        if len(c.offsets) != nd or len(c.sizes) != nd:
            raise FormatError(f"{what}: chunk {i} has {len(c.offsets)} dims, tensor has {nd}")
        for d in range(nd):
            if c.offsets[d] + c.sizes[d] > shape[d]:
                raise FormatError(f"{what}: chunk {i} lies outside the tensor in dim {d}")
        vol = math.prod(c.sizes)
        if c.blob.raw_length != vol * size:
            raise FormatError(f"{what}: chunk {i} raw_length {c.blob.raw_length} != {vol * size}")
        total += vol
        if vol:
            boxes.append(c)
    return total, boxes


def check_exact_cover(shape: tuple[int, ...], boxes: list, what: str) -> None:
    """Non-empty boxes inside ``shape`` cover it exactly once, by signed corner counts.

    A box's indicator function is the signed sum of orthant steps at its 2**k corners
    (sign (-1)**(number of upper bounds)), and steps at distinct points are linearly
    independent. So the boxes cover every element exactly once iff their summed signed
    corners equal those of the whole tensor: one sort of n * 2**k corner rows, where k
    counts the dimensions some chunk splits (1 or 2 in practice)."""
    split = [d for d in range(len(shape)) if any(c.offsets[d] != 0 or c.sizes[d] != shape[d] for c in boxes)]
    if not split:
        return  # every box is the whole tensor, and their volumes add up to it: exactly one
    import numpy as np

    k, n = len(split), len(boxes)
    if k > _CORNER_DIMS or n << k > _MAX_CORNERS:
        raise FormatError(f"{what}: {n} chunks split {k} dimensions; a reader checks at most "
                          f"{_CORNER_DIMS} split dimensions and {_MAX_CORNERS} chunk corners per tensor")
    lo = np.array([[c.offsets[d] for d in split] for c in boxes], dtype=np.int64).reshape(n, k)
    hi = lo + np.array([[c.sizes[d] for d in split] for c in boxes], dtype=np.int64).reshape(n, k)
    corners, signs = [], []
    for mask in range(1 << k):
        upper = np.array([(mask >> j) & 1 for j in range(k)], dtype=bool)
        corners.append(np.where(upper, hi, lo))
        signs.append(np.full(n, -1 if bin(mask).count("1") % 2 else 1, dtype=np.int64))
    rows = np.concatenate(corners)
    weights = np.concatenate(signs)
    order = np.lexsort(rows.T[::-1])
    rows, weights = rows[order], weights[order]
    starts = np.flatnonzero(np.r_[True, np.any(rows[1:] != rows[:-1], axis=1)])
    sums = np.add.reduceat(weights, starts)
    got = {tuple(rows[s].tolist()): int(w) for s, w in zip(starts, sums) if w}
    full = [shape[d] for d in split]
    want = {tuple(full[j] if (mask >> j) & 1 else 0 for j in range(k)): (-1 if bin(mask).count("1") % 2 else 1)
            for mask in range(1 << k)}
    if got != want:
        where = sorted(set(got.items()) ^ set(want.items()))[0][0]
        at = [0] * len(shape)
        for j, d in enumerate(split):
            at[d] = where[j]
        raise FormatError(f"{what}: chunks overlap or leave a gap (near element {at})")
