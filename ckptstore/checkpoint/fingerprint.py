"""Fingerprints that let the committer of a version 4 save check I5 from one number
per rank instead of every chunk record (docs/format.md, "Version 4").

**Coverage.** Each global tensor ``key`` gets pseudo-random weights: a factor ``h(key)``
and per dimension ``d`` a base ``x(key, d)``, all modulo the prime ``P = 2**61 - 1``.
Element ``(i_0, i_1, ...)`` weighs ``h * x_0**i_0 * x_1**i_1 * ...``; a box's weight, the
sum over its elements, is a product of geometric sums, O(dims) to compute. Weights
add, so chunks that cover a tensor exactly once weigh what the whole tensor weighs.
A rank sends the sum over the chunks it wrote; the committer compares the sum over
all ranks with the sum over all global tensors. A gap or an overlap leaves a
difference that is a nonzero polynomial in the bases, which vanishes at pseudo-random
points with negligible probability for honest shapes (Schwartz-Zippel).

**Replicas.** A replicated chunk held by ``n`` ranks is written by one of them, which
adds ``(n - 1) * f(chunk, hash)``; each of the others adds ``-f(chunk, its hash)``. The
sum over all ranks is zero when every copy hashed alike, and otherwise differs from
zero with probability ``1 - 1/P`` (``f`` is a 64-bit hash of the chunk and its hash).

Either check failing sends the committer to the exact one (every index read, the
version 3 merge), which either names the chunk at fault or commits: a fingerprint
only decides whether the fast path may skip the records, never refuses by itself.
"""

from __future__ import annotations

import xxhash

P = (1 << 61) - 1


def _h(text: str) -> int:
    return xxhash.xxh3_64_intdigest(text.encode()) % (P - 2) + 2  # in 2 .. P-1: never 0 or 1


def _geometric(x: int, start: int, count: int) -> int:
    """x**start + ... + x**(start + count - 1), modulo P (x != 1)."""
    return pow(x, start, P) * (pow(x, count, P) - 1) % P * pow(x - 1, P - 2, P) % P


class Weights:
    """The weights of one global tensor (memoised per key by the caller)."""

    __slots__ = ("factor", "bases")

    def __init__(self, key: str, ndim: int):
        self.factor = _h(f"coverage|{key}")
        self.bases = [_h(f"coverage|{key}|{d}") for d in range(ndim)]

    def box(self, offsets, sizes) -> int:
        w = self.factor
        for x, o, n in zip(self.bases, offsets, sizes):
            w = w * _geometric(x, o, n) % P
        return w


def coverage(chunks_by_key) -> int:
    """Sum of the weights of ``{key: [(offsets, sizes), ...]}``."""
    total = 0
    for key, boxes in chunks_by_key.items():
        weights = None
        for offsets, sizes in boxes:
            weights = weights or Weights(key, len(offsets))
            total += weights.box(offsets, sizes)
    return total % P


def whole(tensors) -> int:
    """Sum of the weights of whole tensors, ``{key: shape}``."""
    return sum(Weights(key, len(shape)).box((0,) * len(shape), shape) for key, shape in tensors.items()) % P


def replica_term(key: str, offsets, sizes, digest: str) -> int:
    return xxhash.xxh3_64_intdigest(f"replica|{key}|{list(offsets)}|{list(sizes)}|{digest}".encode()) % P


def replicas(written, held, holders) -> int:
    """A rank's replica sum: ``written`` its (key, offsets, sizes, digest) of the global
    chunks it wrote, ``held`` those it holds and another rank writes, ``holders(key)``
    how many ranks hold each chunk of ``key`` (1: not replicated)."""
    total = 0
    for key, offsets, sizes, digest in written:
        n = holders(key)
        if n > 1:
            total += (n - 1) * replica_term(key, offsets, sizes, digest)
    for key, offsets, sizes, digest in held:
        total -= replica_term(key, offsets, sizes, digest)
    return total % P
