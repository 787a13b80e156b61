"""In-memory backend: for tests, and the staging area of single-stream containers.

Keys and prefixes are checked like on every backend (``check_key`` in storage/base.py),
so a key that would be refused on disk or S3 is refused here too."""

from __future__ import annotations

import threading
import time
from typing import Iterator

from ..errors import AlreadyExistsError, ObjectNotFoundError, TruncatedObjectError
from .base import AppendWriter, BufferedAppendWriter, ObjectInfo, ReadHints, Storage

class _Objects(dict):
    """key -> [bytes, mtime], with the lock every view of the store shares."""

    def __init__(self):
        super().__init__()
        self.lock = threading.RLock()


_NAMED: dict[str, _Objects] = {}
_NAMED_LOCK = threading.Lock()


class MemoryStorage(Storage):
    """Objects in a dict shared by every view of the same store."""

    # As on local disk (storage/local.py): a read is a slice copy, so what coalescing
    # saves is the per-read job and call overhead. is_dir: the default (anything stored
    # under the root), as there are no directories here.
    read_hints = ReadHints(256 << 10, 0, 4 << 20)

    def __init__(self, objects: _Objects | None = None, prefix: str = "", name: str = ""):
        self._objects = _Objects() if objects is None else objects
        self._lock = self._objects.lock
        self._prefix = prefix
        self._name = name
        self.url = f"memory://{name}/{prefix}".rstrip("/")

    @classmethod
    def named(cls, name: str) -> "MemoryStorage":
        """The process-wide store behind ``memory://name`` URLs."""
        with _NAMED_LOCK:
            objects = _NAMED.setdefault(name, _Objects())
        return cls(objects, "", name)

    def _k(self, key: str) -> str:
        if not self._prefix:
            return key
        return f"{self._prefix}/{key}" if key else self._prefix

    def sibling(self, name: str) -> "MemoryStorage":
        if not self._prefix:
            return super().sibling(name)
        parent = self._prefix.rsplit("/", 1)[0] if "/" in self._prefix else ""
        return MemoryStorage(self._objects, parent, self._name).child(name)

    def child(self, prefix: str) -> "MemoryStorage":
        return MemoryStorage(self._objects, self._k(self._check(prefix, prefix=True)), self._name)

    def put(self, key: str, data, *, if_absent: bool = False) -> None:
        k = self._k(self._check(key))
        with self._lock:
            if if_absent and k in self._objects:
                raise AlreadyExistsError(f"{self.describe(key)}: already exists")
            self._objects[k] = [bytes(data), time.time()]

    def open_append(self, key: str, *, size_hint: int | None = None, writers: int = 1) -> AppendWriter:
        k = self._k(self._check(key))
        with self._lock:
            if k in self._objects:
                raise AlreadyExistsError(f"{self.describe(key)}: already exists")
            self._objects[k] = [b"", time.time()]
        return BufferedAppendWriter(self, key)  # (close puts the whole object: one dict entry)

    def readinto(self, key: str, offset: int, out: memoryview, on_piece=None) -> None:
        data = self._get(key)
        if offset + len(out) > len(data):
            raise TruncatedObjectError(
                f"{self.describe(key)}: short read, wanted {len(out)} bytes at offset {offset}, "
                f"object holds {len(data)}"
            )
        out[:] = data[offset:offset + len(out)]
        if on_piece is not None:
            on_piece(out)

    def _get(self, key: str) -> bytes:
        self._check(key)
        with self._lock:
            try:
                return self._objects[self._k(key)][0]
            except KeyError:
                raise ObjectNotFoundError(f"{self.describe(key)}: not found") from None

    def list(self, prefix: str = "") -> list[str]:
        base = self._k(self._check(prefix, prefix=True))
        base = f"{base}/" if base else ""
        names = set()
        with self._lock:
            keys = list(self._objects)
        for k in keys:
            if k.startswith(base):
                rest = k[len(base):]
                head, sep, _ = rest.partition("/")
                names.add(head + sep)
        return sorted(names)

    def walk(self, prefix: str = "") -> Iterator[ObjectInfo]:
        base = self._k(self._check(prefix, prefix=True))  # checked now, not at the first next()
        base = f"{base}/" if base else ""
        mine = f"{self._prefix}/" if self._prefix else ""
        with self._lock:
            items = [(k, v) for k, v in self._objects.items() if k.startswith(base)]
        return iter([ObjectInfo(k[len(mine):], len(data), mtime) for k, (data, mtime) in sorted(items)])

    def stat(self, key: str) -> ObjectInfo:
        self._check(key)
        with self._lock:
            try:
                data, mtime = self._objects[self._k(key)]
            except KeyError:
                raise ObjectNotFoundError(f"{self.describe(key)}: not found") from None
        return ObjectInfo(key, len(data), mtime)

    def delete(self, key: str) -> None:
        self._check(key)
        with self._lock:
            self._objects.pop(self._k(key), None)

    def items(self) -> list[tuple[str, bytes]]:
        """Every (key, bytes) below this root, for serialising a container."""
        return [(info.key, self._get(info.key)) for info in self.walk()]
