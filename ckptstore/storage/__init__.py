"""Byte stores: one small interface (``base``), backends for local disk and memory.

``open_storage(url)`` picks the backend from the URL: ``memory://NAME/...`` for the
process-wide in-memory store, ``s3://`` once the S3 backend exists, else a local path.
"""

from __future__ import annotations

import os

from .base import AppendWriter, ObjectInfo, Storage
from .local import LocalStorage
from .memory import MemoryStorage


def is_url(f) -> bool:
    return isinstance(f, str) and "://" in f


def open_storage(url: str | os.PathLike) -> Storage:
    """The store rooted at a local path or URL."""
    if isinstance(url, str) and url.startswith("memory://"):
        name, _, prefix = url[len("memory://"):].partition("/")
        store = MemoryStorage.named(name)
        return store.child(prefix) if prefix else store
    if isinstance(url, str) and url.startswith("file://"):
        url = url[len("file://"):]
    if is_url(url):
        scheme = url.split("://", 1)[0]
        raise ValueError(f"unsupported URL scheme {scheme!r} in {url!r}")
    return LocalStorage(url)


__all__ = ["AppendWriter", "LocalStorage", "MemoryStorage", "ObjectInfo", "Storage", "open_storage", "is_url"]
