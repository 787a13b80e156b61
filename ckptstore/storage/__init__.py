"""Byte stores: one small interface (``base``: the contract, :class:`ReadHints`),
backends for local disk (``local``), memory (``memory``) and S3 (the ``s3`` package,
imported only for ``s3://`` URLs, as it needs boto3).

``open_storage(url)`` picks the backend from the URL: ``memory://NAME/...`` for the
process-wide in-memory store, ``s3://bucket/prefix`` for S3, ``file://PATH`` or a
local path for the disk. What counts as a URL, what is refused and how locations are
shown without credentials: ``urls.py``.
"""

from __future__ import annotations

import os

from ..errors import InvalidURLError
from .base import AppendWriter, ObjectInfo, ReadHints, Storage, check_key
from .local import LocalStorage
from .memory import MemoryStorage
from .urls import is_url, parse_location, redact_url, shown


def open_storage(url: str | os.PathLike, **options) -> Storage:
    """The store rooted at a local path or URL (the rule: storage/urls.py).

    ``s3://bucket/prefix`` opens :class:`~ckptstore.storage.s3.S3Storage` (boto3; endpoint,
    region and credentials from boto3's standard configuration); ``options`` are passed
    to it (``part_size``, ``max_concurrency``, ``max_attempts``, ``endpoint_url``, ...).
    Local paths and ``memory://`` URLs take no options. An unsupported or malformed URL
    raises :class:`~ckptstore.errors.InvalidURLError` (a ``ValueError``).
    """
    scheme, rest = parse_location(url)
    if scheme == "s3":
        from .s3 import S3Storage

        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise InvalidURLError(f"{shown(url)}: no bucket (expected s3://bucket/prefix)")
        return S3Storage(bucket, prefix, **options)
    if options:
        raise TypeError(f"storage options {sorted(options)} apply to s3:// URLs only, not {shown(url)!r}")
    if scheme == "memory":
        name, _, prefix = rest.partition("/")
        store = MemoryStorage.named(name)
        return store.child(prefix) if prefix else store
    return LocalStorage(rest)  # a path, or what follows file://


__all__ = ["AppendWriter", "InvalidURLError", "LocalStorage", "MemoryStorage", "ObjectInfo", "ReadHints", "Storage",
           "check_key", "is_url", "open_storage", "redact_url", "shown"]
