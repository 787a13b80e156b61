"""The byte-store interface every backend implements.

Keys are relative, '/'-separated names under the store's root. The contract, which the
conformance suite (tests/test_storage_conformance.py) checks for every backend:

- ``put`` is atomic and durable on return: a reader sees all of the bytes or none, and
  the bytes survive a crash. With ``if_absent=True`` it is create-only: when the key
  exists it raises :class:`AlreadyExistsError` and leaves the key untouched (I1).
- ``open_append`` creates a new key (never an existing one) and returns an
  :class:`AppendWriter`; its ``close`` makes every appended byte durable.
- ``readinto`` fills the whole buffer from ``offset`` or raises
  :class:`TruncatedObjectError` (a short object is an error, never a silent short
  read). ``on_piece``, when given, is called with each filled piece in order, while it
  is still in the CPU cache (load hashes as it reads). ``read`` returns bytes.
- ``list`` names the immediate children of a prefix; sub-prefixes end with '/'. A
  missing prefix (nothing stored under it, a path that names no directory or goes
  through a symlink on disk, a root that was never written to) has no children:
  ``list`` returns ``[]`` and raises nothing, so callers need no not-found case.
- ``walk`` yields every object under a prefix, recursively, with size and mtime (a
  missing prefix: nothing).
- ``delete`` of a missing key is not an error; nor is it for ``delete_many``, which
  checks every key before it deletes any.
- Missing keys raise :class:`ObjectNotFoundError` (a ``FileNotFoundError``).
- ``is_dir()`` says whether the store's root exists as a place that holds objects, so
  an empty checkpoint directory and a path that names nothing can be told apart:
  local disk, whether the root is a directory (reached without a symlink below the
  base root), empty or not; S3, whether anything lies under the prefix (the bucket
  root: True, a missing bucket raises); memory and the default, whether ``list("")``
  names anything (stores without containers: a prefix exists while it holds objects).
- Every key and prefix is untrusted input: each method checks it with :func:`check_key`
  before touching anything, and a bad one raises :class:`~ckptstore.errors.FormatError`
  (a ``ValueError``) naming the store and the key. A key is a relative, normalised,
  '/'-separated name: not absolute, no empty, '.' or '..' part, no backslash, no NUL. A
  prefix is a key with at most one trailing '/', or "" for the root. ``walk`` and ``list``
  leave out stored names that are not valid keys (written by other tools): no method
  could address them.
- No method follows a symlink below the root (the local backend: see storage/local.py);
  ``walk`` reports what is not a regular object in ``ObjectInfo.kind``, and reading one
  raises :class:`~ckptstore.errors.NotRegularObjectError`.
- Messages carry no secrets: URLs in them pass through :func:`redact_url` (storage/urls.py).

Capability flags (class attributes; a backend overrides the ones it differs in):

- ``sees_all_data``: whether every rank sees every rank's data files through this store,
  so that the committer can check them all and a save can write format version 4's
  indexes into them. True for ``local`` (one file system), ``memory`` (one process) and
  ``s3``; False for ``SplitStorage`` (storage/split.py: a multi-node local tier, where
  each node holds only its own ranks' data files).
- ``opens_remotely``: whether opening an appended object costs round trips (True for
  ``s3``), so a save opens its data file on an I/O thread while it stages.

Read coalescing (a hint to loaders, not part of the contract): a load merges the reads
of small blobs that lie close together in one file into one ``readinto`` and splits
the bytes back per blob (``ckptstore.checkpoint.reader.plan_reads``). A backend says how
far it wants that to go in its ``read_hints`` (a :class:`ReadHints`), because a request
costs very different amounts on disk and on an object store. The default,
``ReadHints()``, turns coalescing off. Backends: local 256 KiB / 0 / 4 MiB
(storage/local.py), memory the same, S3 1 MiB / 64 KiB / ``read_part_size`` from its
settings (storage/s3/client.py).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Iterable, Iterator

from ..errors import FormatError
from .urls import redact_url  # noqa: F401 (re-exported: the one redaction, storage/urls.py)


@dataclass(frozen=True)
class ReadHints:
    """How far a load merges the reads of small neighbouring blobs of one file.

    ``blob``: only blobs at most this large are merged; larger ones are read on their
    own, straight into their destination. ``gap``: two neighbours are merged when at
    most this many unneeded bytes lie between them (those are read and dropped).
    ``limit``: the largest merged read, gaps included; 0 turns coalescing off."""

    blob: int = 0
    gap: int = 0
    limit: int = 0  # 0: every blob is a read of its own

    def __post_init__(self):
        if min(self.blob, self.gap, self.limit) < 0:
            raise ValueError(f"read hints must be >= 0, got {self}")


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    mtime: float  # seconds since the epoch
    # "file": a regular object. Local disk only, never descended into or followed, size 0:
    # "symlink" (a symbolic link) and "other" (FIFO, socket, device). S3 and memory: "file".
    kind: str = "file"


def check_key(key: str, what: str = "key", prefix: bool = False) -> str:
    """``key`` when it is a valid key (``prefix=True``: a valid prefix), else raise
    :class:`~ckptstore.errors.FormatError` naming ``what`` and the key.

    A key is relative and normalised, '/'-separated: not absolute, no empty, '.' or '..'
    part, no backslash, no NUL. A prefix may also end in one '/', and "" is the root.
    Returns the key unchanged; a prefix without its trailing '/'. ``what`` names the key
    in the message; backends pass their store's location (``"<describe()>: key"``).
    """
    if not isinstance(key, str):
        raise FormatError(f"{what} {key!r}: not a string")
    name = key[:-1] if prefix and key.endswith("/") else key
    if prefix and not key:
        return ""
    reason = None
    if key.startswith("/"):
        reason = "absolute"
    elif not name:
        reason = "empty"
    elif "\0" in name:
        reason = "a NUL"
    elif "\\" in name:
        reason = "a backslash"
    else:
        for part in name.split("/"):
            if part in ("", ".", ".."):
                reason = f"a {part!r} part" if part else "an empty part"
                break
    if reason is not None:
        raise FormatError(f"{what} {key!r} is invalid ({reason}): keys are relative, normalised, "
                          "'/'-separated names")
    return name


class AppendWriter(abc.ABC):
    """A new object written by appending; ``append`` is safe to call from many threads."""

    key: str

    @abc.abstractmethod
    def append(self, data) -> int:
        """Append a bytes-like object; returns the byte offset it was written at."""

    @abc.abstractmethod
    def close(self) -> int:
        """Make everything appended durable; returns the final size."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Give up: remove what was written (best effort), never raise."""


class Storage(abc.ABC):
    """A byte store rooted at ``url``."""

    url: str
    read_hints: ReadHints = ReadHints()  # no coalescing; backends override (see the module docstring)
    # Opening an appended object costs round trips (S3): a save then opens its data file
    # on an I/O thread while it stages (pipeline.RankWriter.open_soon).
    opens_remotely: bool = False
    # Every rank's data files are seen through this store (the committer checks them
    # all: commit.check_files; a multi-rank save writes version 4 indexes: save.py).
    # False only for SplitStorage, whose data files stay on each node.
    sees_all_data: bool = True

    def _check(self, key: str, prefix: bool = False) -> str:
        """``check_key`` naming this store in the message (built only for a bad key)."""
        try:
            return check_key(key, "key", prefix)
        except FormatError:
            return check_key(key, f"{self.describe()}: {'prefix' if prefix else 'key'}", prefix)

    @abc.abstractmethod
    def child(self, prefix: str) -> "Storage":
        """The same store rooted at ``prefix`` below this root."""

    def sibling(self, name: str) -> "Storage":
        """The location ``name`` beside this one, under the same parent (a step of the
        same store, for a checkpoint's references). A store at the top of its backend
        (a bucket, a file system root) has none: ValueError."""
        raise ValueError(f"{self.describe()}: this store cannot reach locations beside it")

    @abc.abstractmethod
    def put(self, key: str, data, *, if_absent: bool = False) -> None: ...

    @abc.abstractmethod
    def open_append(self, key: str, *, size_hint: int | None = None, writers: int = 1) -> AppendWriter:
        """A new object ``key`` written by appending (never an existing key).

        Hints, which a store may ignore (only S3 uses them, to choose its multipart part
        size: docs/s3.md): ``size_hint``, about how many bytes the object will hold (an
        estimate; more or fewer must still work); ``writers``, how many writers (ranks)
        upload into the same location at once."""

    @abc.abstractmethod
    def readinto(self, key: str, offset: int, out: memoryview, on_piece=None) -> None: ...

    def readinto_scatter(self, key: str, offset: int, outs: list[memoryview]) -> None:
        """Fill ``outs`` in turn with the bytes from ``offset`` on: one contiguous range
        of their summed length, read as one request straight into its destinations (a
        merged read of neighbouring blobs). This default reads into one temporary buffer
        and copies out; the local backend scatters with ``preadv``."""
        buf = memoryview(bytearray(sum(len(o) for o in outs)))
        self.readinto(key, offset, buf)
        pos = 0
        for out in outs:
            out[:] = buf[pos:pos + len(out)]
            pos += len(out)

    def read(self, key: str, offset: int = 0, length: int | None = None, *, limit: int | None = None) -> bytes:
        """``length`` bytes from ``offset`` (None: to the end). With ``limit``, a read to
        the end refuses an object holding more than ``limit`` bytes from ``offset`` with
        :class:`ObjectTooLargeError`, before it allocates or transfers them."""
        self._check(key)
        if length is None:
            length = self.stat(key).size - offset
            _check_limit(self, key, length, limit)
        buf = bytearray(length)
        self.readinto(key, offset, memoryview(buf))
        return bytes(buf)

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[str]: ...

    @abc.abstractmethod
    def walk(self, prefix: str = "") -> Iterator[ObjectInfo]: ...

    @abc.abstractmethod
    def stat(self, key: str) -> ObjectInfo: ...

    def exists(self, key: str) -> bool:
        from ..errors import ObjectNotFoundError

        self._check(key)
        try:
            self.stat(key)
            return True
        except ObjectNotFoundError:
            return False

    @abc.abstractmethod
    def delete(self, key: str) -> None: ...

    def delete_many(self, keys: Iterable[str]) -> None:
        """Delete ``keys`` (a missing one is not an error, as for ``delete``). Every key is
        checked before any is deleted. This default deletes them one by one, in the
        given order; a store may batch them (S3: DeleteObjects of 1,000 keys), so no
        order holds *within* one call. A caller that needs one group gone before another
        (manifests before the files they name: invariant I7) calls it once per group."""
        keys = [self._check(k) for k in keys]
        for key in keys:
            self.delete(key)

    def delete_prefix(self, prefix: str) -> None:
        """Delete every object under ``prefix`` (a key ending in '/')."""
        self._check(prefix, prefix=True)
        for info in list(self.walk(prefix)):
            self.delete(info.key)

    def is_dir(self) -> bool:
        """Whether the root exists as a place that holds objects (see the module
        docstring). This default suits stores without containers: whether anything lies
        under the root."""
        return bool(self.list(""))

    def abort_stale_uploads(self, older_than: float, dry_run: bool = False) -> list[str]:
        """Abort unfinished multipart uploads under this root started more than
        ``older_than`` seconds ago; returns their keys. Stores without them: nothing."""
        return []

    def remove_stale_empty_dirs(self, older_than: float, dry_run: bool = False) -> list[str]:
        """Remove the empty directories a save killed before its first file left
        (``attempts/<id>/``, ``attempts/``, and a ``step-N/`` that held only those),
        unchanged for ``older_than`` seconds; returns their keys. Stores without
        directories: nothing."""
        return []

    def describe(self, key: str = "") -> str:
        """A human-readable location for error messages."""
        return f"{self.url.rstrip('/')}/{key}" if key else self.url

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


def _check_limit(storage: "Storage", key: str, size: int, limit: int | None) -> None:
    if limit is not None and size > limit:
        from ..errors import ObjectTooLargeError

        raise ObjectTooLargeError(f"{storage.describe(key)}: holds {size} bytes, more than the limit of {limit}")
