"""Rules over a whole checkpoint: one state per rank (I5), references only where the
format version and the checkpoint allow them, and no two blobs sharing stored bytes."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import FormatError
from ..names import MAX_WORLD_SIZE
from .constants import REFERENCE_VERSION
from .coverage import validate_coverage
from .records import RankState
from .strict import LazyName

if TYPE_CHECKING:
    from .documents import Manifest


def validate_ranks(ranks: tuple[RankState, ...], world_size: int) -> None:
    """I5: one state per rank 0..world_size-1, and chunks covering each tensor exactly once."""
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise FormatError(f"world_size must be in 1 .. {MAX_WORLD_SIZE}, got {world_size}")
    seen = sorted(r.rank for r in ranks)
    if len(seen) != world_size or seen != list(range(world_size)):
        raise FormatError(f"ranks {seen[:16]}{'...' if len(seen) > 16 else ''} do not match world_size {world_size}")
    for r in ranks:
        for key, entry in r.tensors.items():
            validate_coverage(entry, LazyName("rank {} tensor {!r}", r.rank, key))


def validate_references(m: "Manifest") -> None:
    """References exist from format version 3 on: ``Blob.step`` in a step's checkpoint
    of a store, pointing at another step; ``Blob.earlier`` at an earlier attempt of the
    same location."""
    if m.format_version < REFERENCE_VERSION and any(b.earlier for _, _, b in m.blobs()):
        raise FormatError(f"a blob refers to an earlier attempt, which format version {m.format_version} "
                          f"cannot say (references exist from version {REFERENCE_VERSION})")
    refs = [b for _, _, b in m.blobs() if b.step is not None]
    if not refs:
        return
    if m.format_version < REFERENCE_VERSION:
        raise FormatError(f"a blob refers to step {refs[0].step}, which format version {m.format_version} "
                          f"cannot say (references exist from version {REFERENCE_VERSION})")
    if m.step is None:
        raise FormatError(f"a blob refers to step {refs[0].step}, but this checkpoint is not a step of a store")
    if any(b.step == m.step for b in refs):
        raise FormatError(f"a blob refers to step {m.step}, its own step: a blob of its own files names no step")


def validate_extents(blobs) -> None:
    """No two blobs share stored bytes: each byte of a data file belongs to one blob, so
    what a manifest can make a reader allocate is bounded by its files' real sizes
    (raw blobs 1x, zstd at most ZSTD_MAX_RATIO x); a blob another step stores counts as
    that step's file, and may be referenced once. ``blobs``: (rank, key, blob)."""
    spans = sorted((((-1 if b.step is None else b.step, b.file), b.offset, b.offset + b.length, rank, key)
                    for rank, key, b in blobs if b.length), key=lambda s: s[:3])
    for (f1, _, end1, r1, k1), (f2, start2, _, r2, k2) in zip(spans, spans[1:]):
        if f1 == f2 and start2 < end1:
            a = "skeleton" if k1 is None else repr(k1)
            b = "skeleton" if k2 is None else repr(k2)
            where = f1[1] if f1[0] < 0 else f"{f1[1]} of step {f1[0]}"
            raise FormatError(f"blobs of {a} (rank {r1}) and {b} (rank {r2}) overlap in {where} at byte {start2}")

