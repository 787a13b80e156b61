"""xxh3-128 of raw chunk bytes: the checksum every load verifies (I3).

xxhash releases the GIL while it hashes, so hashing runs in parallel on worker threads.
"""

import xxhash


def digest(data) -> str:
    """Hex xxh3-128 of a bytes-like object (bytes, memoryview, buffer)."""
    return xxhash.xxh3_128_hexdigest(data)


class Hasher:
    """Incremental xxh3-128, for hashing a blob piece by piece as it is read."""

    __slots__ = ("_h",)

    def __init__(self):
        self._h = xxhash.xxh3_128()

    def update(self, data) -> None:
        self._h.update(data)

    def hexdigest(self) -> str:
        return self._h.hexdigest()
