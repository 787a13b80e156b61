"""The format's identity, versions and size caps: the constants every record and
document of ``ckptstore.format`` checks against (docs/format.md, "Size caps")."""

from __future__ import annotations

from ..config import config

FORMAT_NAME = "ckptstore"
FORMAT_VERSION = 3  # what this writer writes
# What this reader reads. Version 2 adds one thing to version 1: a skeleton may name a
# rank-local storage by its index among the rank's tensors (docs/format.md). Version 3
# adds references: a blob may lie in another step's location of the same store
# (``Blob.step``: an incremental save recorded an unchanged chunk instead of writing it).
# Version 4 (index.py, v4.py) replaces the one manifest of a multi-rank save by a root
# naming one index per rank; a one-rank save still writes version 3.
READ_VERSIONS = (1, 2, 3, 4)
REFERENCE_VERSION = 3  # the first version whose blobs may carry ``step``
INDEX_VERSION = 4  # the version whose manifests name indexes

# ---------------------------------------------------------------------------- size caps
# Claims a reader checks before it allocates or loops on them (docs/format.md, "Size
# caps"): a hostile or damaged manifest costs at most what it honestly holds.
MAX_NDIM = 64
MAX_BYTES = 1 << 62  # any offset, length, tensor size or element count
ZSTD_MAX_RATIO = 32768  # a zstd block is >= 4 bytes (RLE) and decodes to <= 128 KiB


def max_manifest_bytes() -> int:
    """The cap on a manifest's (and a vote's) size: ``config().max_manifest_bytes``
    (``CKPTSTORE_MAX_MANIFEST_BYTES``, 256 MiB by default)."""
    return config().max_manifest_bytes


MAX_MARKER_BYTES = 64 << 10  # abort markers, pins, heartbeats
