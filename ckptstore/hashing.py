"""xxh3-128 of raw chunk bytes: the checksum every load verifies (I3).

xxhash releases the GIL while it hashes, so hashing runs in parallel on worker threads.
"""

import xxhash


def digest(data) -> str:
    """Hex xxh3-128 of a bytes-like object (bytes, memoryview, buffer)."""
    return xxhash.xxh3_128_hexdigest(data)
