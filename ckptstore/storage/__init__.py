"""Byte stores: one small interface (``base``: the contract, :class:`ReadHints`),
backends for local disk (``local``), memory (``memory``) and S3 (the ``s3`` package,
imported only for ``s3://`` URLs, as it needs boto3).

``open_storage(url)`` picks the backend from the URL: ``memory://NAME/...`` for the
process-wide in-memory store, ``s3://bucket/prefix`` for S3, else a local path.
"""

from __future__ import annotations

import os

from .base import AppendWriter, ObjectInfo, ReadHints, Storage, check_key, redact_url
from .local import LocalStorage
from .memory import MemoryStorage


def is_url(f) -> bool:
    return isinstance(f, str) and "://" in f


def open_storage(url: str | os.PathLike, **options) -> Storage:
    """The store rooted at a local path or URL.

    ``s3://bucket/prefix`` opens :class:`~ckptstore.storage.s3.S3Storage` (boto3; endpoint,
    region and credentials from boto3's standard configuration); ``options`` are passed
    to it (``part_size``, ``max_concurrency``, ``max_attempts``, ``endpoint_url``, ...).
    Local paths and ``memory://`` URLs take no options.
    """
    if isinstance(url, str) and url.startswith("s3://"):
        from .s3 import S3Storage

        bucket, _, prefix = url[len("s3://"):].partition("/")
        if not bucket:
            raise ValueError(f"no bucket in {redact_url(url)!r} (expected s3://bucket/prefix)")
        return S3Storage(bucket, prefix, **options)
    if options:
        raise TypeError(f"storage options {sorted(options)} apply to s3:// URLs only, not {redact_url(os.fspath(url))!r}")
    if isinstance(url, str) and url.startswith("memory://"):
        name, _, prefix = url[len("memory://"):].partition("/")
        store = MemoryStorage.named(name)
        return store.child(prefix) if prefix else store
    if isinstance(url, str) and url.startswith("file://"):
        url = url[len("file://"):]
    if is_url(url):
        scheme = url.split("://", 1)[0]
        raise ValueError(f"unsupported URL scheme {scheme!r} in {redact_url(url)!r}")
    return LocalStorage(url)


__all__ = ["AppendWriter", "LocalStorage", "MemoryStorage", "ObjectInfo", "ReadHints", "Storage", "check_key",
           "is_url", "open_storage", "redact_url"]
