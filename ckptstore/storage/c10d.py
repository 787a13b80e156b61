"""A storage of small objects over a ``torch.distributed.Store`` (the in-job TCPStore,
or a ``HashStore`` in one process): where a memory tier on several nodes keeps its
commit records (votes, heartbeats, abort markers, manifests), the data files staying in
each node's tmpfs (storage/split.py). Design: docs/design/in-job-restart.md, 5.2.

Layout under the root ``<prefix>``: ``<prefix>o/<key>`` holds an object (a header of
magic, nonce and mtime, then its bytes); ``<prefix>i/<dir>`` is the index of a
directory: entries appended one by one, ``+name`` when a child appears and ``-name``
when it goes, each ended by a NUL (a byte no key may hold: storage/base.check_key); a
subdirectory's name ends with ``/``. The live children are the replay of its entries,
so a listing costs requests in proportion to what is there now, not to everything a
long job ever saved (a job saving every step listed thousands of dead names). A
directory whose last child went is marked gone in its parent, then its index is read
again: a child added meanwhile (whose writer appends to the index first, then looks
at the parent) is seen by one of the two, which marks the directory live again. Reads never block: a key is read with
``compare_set(key, PROBE, PROBE)``, which returns PROBE for a missing key and the value
unchanged for any other (``get`` would wait for a missing key until the store's
timeout). Create-only puts are ``compare_set(key, "", value)``: won iff the value
returned is ours (every value carries a random nonce, so no two writers' are equal).
Objects are capped at :data:`MAX_OBJECT_BYTES`. An index grows by a few bytes per
child ever written there; a replay that finds it over :data:`COMPACT_MIN_BYTES` and
over twice its live entries rewrites it as those entries with ``compare_set`` against
the value it replayed, so a concurrent append makes the swap fail (and the next replay
retry), never lost. Index entries are untrusted: each must be ``+`` or ``-`` and one
valid key part (storage/base.check_key); anything else, or an index over
:data:`MAX_INDEX_BYTES`, is a FormatError naming the index, never a name followed.
"""

from __future__ import annotations

import math
import os
import struct
import threading
import time
from typing import Iterator

from ..errors import (AlreadyExistsError, FormatError, ObjectNotFoundError, ObjectTooLargeError, StorageError,
                      TruncatedObjectError)
from .base import AppendWriter, BufferedAppendWriter, ObjectInfo, ReadHints, Storage, check_key

MAX_OBJECT_BYTES = 1 << 20
_MAGIC = b"CK1"
_HEADER = struct.Struct("<3s8sd")  # magic, nonce, mtime
PROBE = b"\x00probe"  # never a value of ours: every one starts with _MAGIC
SEP = "\0"
# An index is compacted (rewritten as its live entries) on a replay that finds it larger
# than this and than twice its live entries: a directory whose children come and go
# (the root: a step per save) is then replayed in time bounded by what is live.
COMPACT_MIN_BYTES = 4 << 10
MAX_INDEX_BYTES = 16 << 20  # larger: not ours (refused, not replayed)
MAX_NAME_CHARS = 1024  # an index entry's name (keys here are short: step-N/attempts/...)


class C10dStorage(Storage):
    """Objects in ``store`` (a ``torch.distributed.Store``) under ``prefix``."""

    # A read is one request for the whole object (at most 1 MiB): coalesce as memory does.
    read_hints = ReadHints(256 << 10, 0, MAX_OBJECT_BYTES)

    def __init__(self, store, prefix: str = "", name: str = "store", _root: str = "", _lock=None):
        self._store = store
        self._prefix = prefix  # the store's key prefix of this storage's objects and indexes
        self._root = _root  # this view's root below it ("" or "a/b")
        self._name = name
        self._lock = _lock if _lock is not None else threading.Lock()  # (one client serialises anyway)
        self.url = f"c10d://{name}/{prefix}{_root}".rstrip("/")

    # ------------------------------------------------------------------ keys
    def _full(self, key: str) -> str:
        return f"{self._root}/{key}" if self._root and key else (self._root or key)

    def _obj(self, full: str) -> str:
        return f"{self._prefix}o/{full}"

    def _idx(self, full_dir: str) -> str:
        return f"{self._prefix}i/{full_dir}"

    def _view(self, root: str) -> "C10dStorage":
        return C10dStorage(self._store, self._prefix, self._name, root, self._lock)

    def child(self, prefix: str) -> "C10dStorage":
        return self._view(self._full(self._check(prefix, prefix=True)))

    def sibling(self, name: str) -> "C10dStorage":
        if not self._root:
            return super().sibling(name)
        parent = self._root.rsplit("/", 1)[0] if "/" in self._root else ""
        return self._view(parent).child(name)

    # ------------------------------------------------------------------ raw access
    def _raw(self, full: str) -> bytes | None:
        """The stored value of ``full``, or None: a non-blocking read."""
        try:
            with self._lock:
                value = self._store.compare_set(self._obj(full), PROBE, PROBE)
        except Exception as e:  # (torch's DistStoreError: the store is gone)
            raise StorageError(f"{self.describe()}: the store cannot be read ({type(e).__name__}: {e})") from e
        return None if value == PROBE else bytes(value)

    def _value(self, data: bytes) -> bytes:
        if len(data) > MAX_OBJECT_BYTES:
            raise ObjectTooLargeError(f"{self.url}: an object of {len(data)} bytes; this store holds at most "
                                      f"{MAX_OBJECT_BYTES} (commit records only: data files go elsewhere)")
        return _HEADER.pack(_MAGIC, os.urandom(8), time.time()) + data

    def _entry(self, directory: str, sign: str, name: str) -> None:
        with self._lock:
            self._store.append(self._idx(directory), sign + name + SEP)

    def _index(self, full: str) -> None:
        """Name ``full`` live in its directory's index, then each directory above it in
        its parent's, up to the first that its parent lists live already (appended to
        the index first, the parent read after: see the module's note on races)."""
        parts = full.split("/")
        self._entry("/".join(parts[:-1]), "+", parts[-1])
        for depth in range(len(parts) - 2, -1, -1):
            parent, name = "/".join(parts[:depth]), parts[depth] + "/"
            if name in self._names(parent):
                return
            self._entry(parent, "+", name)

    def _prune(self, full_dir: str) -> None:
        """``full_dir`` lost a child: if it holds no live child, mark it gone in its
        parent (and so on up), unless a child appeared meanwhile."""
        while full_dir:
            parent, _, name = full_dir.rpartition("/")
            if self._names(full_dir):
                return
            self._entry(parent, "-", name + "/")
            if self._names(full_dir):  # a writer added a child meanwhile: live again
                self._entry(parent, "+", name + "/")
                return
            full_dir = parent

    def _names(self, full_dir: str) -> list[str]:
        """The live children of ``full_dir`` (the replay of its index), compacted when
        the index holds much more than what is live (see :meth:`_compact`)."""
        try:
            with self._lock:
                value = self._store.compare_set(self._idx(full_dir), PROBE, PROBE)
        except Exception as e:
            raise StorageError(f"{self.describe()}: the store cannot be read ({type(e).__name__}: {e})") from e
        if value == PROBE:
            return []
        value = bytes(value)
        live = self._replay(full_dir, value)
        if len(value) > COMPACT_MIN_BYTES and len(value) > 2 * _encoded(live):
            self._compact(full_dir, value, live)
        return sorted(live)

    def _replay(self, full_dir: str, value: bytes) -> set[str]:
        """The live names of an index's ``value``. Every entry is untrusted (anyone with
        the store's address may append): one that is not ``+`` or ``-`` and one valid key
        part (a directory's with one trailing ``/``) is refused, as is an index larger
        than :data:`MAX_INDEX_BYTES`: FormatError naming it, never a name followed."""
        where = f"{self.url}: the index of {full_dir or 'the root'!r} ({self._idx(full_dir)!r})"
        if len(value) > MAX_INDEX_BYTES:
            raise FormatError(f"{where} holds {len(value)} bytes, more than {MAX_INDEX_BYTES}: not replayed "
                              "(not written by ckptstore, which compacts its indexes); delete that key to reset "
                              "the directory's listing")
        try:
            text = value.decode()
        except UnicodeDecodeError:
            raise FormatError(f"{where} is not UTF-8: not replayed") from None
        live: set[str] = set()
        for entry in text.split(SEP):
            if not entry:
                continue  # (the last entry's NUL)
            sign, name = entry[:1], entry[1:]
            part = name[:-1] if name.endswith("/") else name
            bad = sign not in ("+", "-") or len(name) > MAX_NAME_CHARS or "/" in part
            if not bad:
                try:
                    check_key(part)
                except FormatError:
                    bad = True
            if bad:
                raise FormatError(f"{where} holds the entry {entry[:80]!r}: not a '+' or '-' and one valid key part "
                                  "(relative, no '..', '/', NUL or backslash, at most "
                                  f"{MAX_NAME_CHARS} characters): not followed; the directory cannot be listed")
            if sign == "+":
                live.add(name)
            else:
                live.discard(name)
        return live

    def _compact(self, full_dir: str, value: bytes, live: set[str]) -> None:
        """Replace the index ``value`` by one ``+`` entry per live name, atomically and
        only if nobody appended meanwhile (``compare_set`` against the value replayed):
        an entry appended between the read and the swap makes the swap fail, and the
        next replay tries again, so no writer's entry is ever lost."""
        compact = "".join(f"+{name}{SEP}" for name in sorted(live)).encode()
        try:
            with self._lock:
                self._store.compare_set(self._idx(full_dir), value, compact)
        except Exception:  # (the store went: the listing was read all the same; the next one retries)
            pass

        # ------------------------------------------------------------------ the contract
    def put(self, key: str, data, *, if_absent: bool = False) -> None:
        full = self._full(self._check(key))
        value = self._value(bytes(memoryview(data).cast("B")) if not isinstance(data, bytes) else data)
        try:
            with self._lock:
                if if_absent:
                    held = self._store.compare_set(self._obj(full), b"", value)
                else:
                    self._store.set(self._obj(full), value)
                    held = value
        except Exception as e:
            raise StorageError(f"{self.describe(key)}: the store cannot be written ({type(e).__name__}: {e})") from e
        if bytes(held) != value:
            raise AlreadyExistsError(f"{self.describe(key)}: already exists")
        self._index(full)

    def open_append(self, key: str, *, size_hint: int | None = None, writers: int = 1) -> AppendWriter:
        self.put(key, b"", if_absent=True)  # (never an existing key; empty while it is written)
        return BufferedAppendWriter(self, key, MAX_OBJECT_BYTES, "commit records only: data files go elsewhere")

    def _get(self, key: str) -> bytes:
        self._check(key)
        raw = self._raw(self._full(key))
        if raw is None:
            raise ObjectNotFoundError(f"{self.describe(key)}: not found")
        if _mtime(raw) is None:
            raise FormatError(f"{self.describe(key)}: not an object of this store (no {_MAGIC!r} header with a "
                              "finite mtime): written by something else; not read")
        return raw

    def readinto(self, key: str, offset: int, out: memoryview, on_piece=None) -> None:
        data = memoryview(self._get(key))[_HEADER.size:]
        if offset + len(out) > len(data):
            raise TruncatedObjectError(f"{self.describe(key)}: short read, wanted {len(out)} bytes at offset "
                                       f"{offset}, object holds {len(data)}")
        out[:] = data[offset:offset + len(out)]
        if on_piece is not None:
            on_piece(out)

    def stat(self, key: str) -> ObjectInfo:
        raw = self._get(key)
        _, _, mtime = _HEADER.unpack_from(raw)
        return ObjectInfo(key, len(raw) - _HEADER.size, mtime)

    def delete(self, key: str) -> None:
        full = self._full(self._check(key))
        try:
            with self._lock:
                self._store.delete_key(self._obj(full))
            directory, _, name = full.rpartition("/")
            self._entry(directory, "-", name)
            self._prune(directory)
        except StorageError:
            raise
        except Exception as e:
            raise StorageError(f"{self.describe(key)}: the store cannot be written ({type(e).__name__}: {e})") from e

    def list(self, prefix: str = "") -> list[str]:
        base = self._full(self._check(prefix, prefix=True))
        out = []
        for name in self._names(base):
            full = f"{base}/{name}" if base else name
            raw = None if name.endswith("/") else self._raw(full)
            if name.endswith("/") or (raw is not None and _mtime(raw) is not None):  # (a directory: live by its parent)
                out.append(name)
        return out

    def walk(self, prefix: str = "") -> Iterator[ObjectInfo]:
        base = self._full(self._check(prefix, prefix=True))  # checked now, not at the first next()
        found = []
        mine = f"{self._root}/" if self._root else ""
        stack = [base]
        while stack:
            directory = stack.pop()
            for name in self._names(directory):
                full = f"{directory}/{name}" if directory else name
                if name.endswith("/"):
                    stack.append(full.rstrip("/"))
                    continue
                raw = self._raw(full)
                if raw is not None and _mtime(raw) is not None:  # (a value not ours: left out, as a bad name)
                    found.append(ObjectInfo(full[len(mine):], len(raw) - _HEADER.size, _mtime(raw)))
        return iter(sorted(found, key=lambda info: info.key))


def _mtime(raw: bytes) -> float | None:
    """The mtime of a stored value, or None when it is not one of ours (too short, another
    magic, a mtime that is not a finite number: anyone with the store's address can set
    a key)."""
    if len(raw) < _HEADER.size:
        return None
    magic, _, mtime = _HEADER.unpack_from(raw)
    return mtime if magic == _MAGIC and math.isfinite(mtime) else None


def _encoded(live: set[str]) -> int:
    """The bytes of an index holding one ``+`` entry per name of ``live``."""
    return sum(len(name.encode()) + 2 for name in live)
