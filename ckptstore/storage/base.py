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
- ``remove_empty_dirs`` removes only directories that are empty and old enough, both
  judged before any is removed, never the root, never through a symlink; a store whose
  ``keeps_empty_dirs`` is False (no directories of its own: S3, memory) removes nothing.
  The store knows no checkpoint layout: the caller (gc) says which directories.
- Messages carry no secrets: URLs in them pass through :func:`redact_url` (storage/urls.py).

The calls of one save, in order (docs/format.md, "Write order" and "Commits beside gc";
``A`` is ``attempts/<attempt id>``; rank 0 is the committer):

1. (every rank) ``open_append(A/data-r<rank>-s<stream>.bin)``, on an I/O thread while
   the rank stages where ``opens_remotely`` (S3); then ``append`` from many worker
   threads, each returning its offset, and ``close``, which makes the file durable (I2).
2. (every rank of a multi-rank save, from its start to its end) ``put(A/heartbeat-r<rank>)``,
   a plain overwrite every few seconds; in exit mode also ``stat(A/abort.json)``.
3. (every rank but a one-rank save's) ``put(A/vote-r<rank>.json, if_absent=True)``.
4. (rank 0) ``walk(A/)`` and ``read(A/vote-*, limit=...)`` of the votes not read yet,
   once per poll until every vote is there (in exit mode ``read`` of the missing
   ranks' heartbeats); format version 4: ``readinto`` of the tables of global tensors
   (and of every index only when a fingerprint does not add up).
5. (rank 0) ``list("")``: the generations, to name the next one.
6. (rank 0) ``put(A/committing.json)``, the commit mark, then ``walk(A/)``, the last
   look (a claim or abort marker refuses; it gives the data files' sizes), ``stat`` of
   any file it did not list, ``stat`` of the base manifest of an incremental save in
   the ``sibling`` step, ``list`` of the store's ``epochs/`` (the fence of a run).
7. (rank 0) ``put(manifest-<generation>.json, if_absent=True)``: the commit (I1), once
   the checks of 6 ended within 60 s (``COMMIT_LEASE / 2``) of the start of the mark's
   write, else 6 again until the commit's timeout; then ``put(A/outcome.json,
   if_absent=True)`` (a multi-rank save) and ``delete(A/committing.json)``.
8. (other ranks, while 4 to 7 run) ``read(A/outcome.json, limit=...)`` per poll; every
   eighth poll ``list("")`` and ``read(manifest-*)``, and ``stat(A/abort.json)``.
9. (rank 0) ``list("")`` until the new generation is the newest listed; for each older
   one (a drop-in path: ``read`` first, for the attempts it names) ``delete`` of its
   manifest; then ``walk`` and ``delete_many`` of those attempts' files (I6, I7).

A rank that fails writes a no-vote at 3. A commit refused at 4 to 7 writes
``put(A/abort.json, if_absent=True)`` and ``put(A/outcome.json, if_absent=True)`` and,
once 6 ran, ``delete(A/committing.json)``; nothing else is undone: the attempt's files
are gc's. What a save reads before 1 (an
incremental save's base manifest, a drop-in path's generations) is not part of it.

Capability flags (class attributes; a backend overrides the ones it differs in):

- ``sees_all_data``: whether every rank sees every rank's data files through this store,
  so that the committer can check them all and a save can write format version 4's
  indexes into them. True for ``local`` (one file system), ``memory`` (one process) and
  ``s3``; False for ``SplitStorage`` (storage/split.py: a multi-node local tier, where
  each node holds only its own ranks' data files).
- ``opens_remotely``: whether opening an appended object costs round trips (True for
  ``s3``), so a save opens its data file on an I/O thread while it stages.
- ``keeps_empty_dirs``: whether directories outlive what they held (True for ``local``),
  so that ``remove_empty_dirs`` has something to remove; False for object stores.

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
from typing import Iterable, Iterator, Sequence

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


class BufferedAppendWriter(AppendWriter):
    """An appended object built in this process's memory and ``put`` whole at ``close``:
    for stores whose objects are small or live in memory anyway (memory.py, c10d.py).
    ``limit`` (bytes, None: none) refuses an append that would pass it, before it is
    buffered; ``why`` ends that message (what the store is for)."""

    def __init__(self, storage: "Storage", key: str, limit: int | None = None, why: str = ""):
        import threading

        self.key = key
        self._storage = storage
        self._limit = limit
        self._why = why
        self._buf = bytearray()
        self._lock = threading.Lock()

    def append(self, data) -> int:
        view = memoryview(data).cast("B")
        with self._lock:
            offset = len(self._buf)
            if self._limit is not None and offset + len(view) > self._limit:
                from ..errors import ObjectTooLargeError

                raise ObjectTooLargeError(f"{self._storage.describe(self.key)}: more than {self._limit} bytes "
                                          f"appended{f' ({self._why})' if self._why else ''}")
            self._buf += view
            return offset

    def close(self) -> int:
        with self._lock:
            self._storage.put(self.key, bytes(self._buf))
            return len(self._buf)

    def abort(self) -> None:
        try:
            self._storage.delete(self.key)
        except Exception:  # (abort never raises: best effort)
            pass


class Storage(abc.ABC):
    """A byte store rooted at ``url``."""

    url: str
    read_hints: ReadHints = ReadHints()  # no coalescing; backends override (see the module docstring)
    # Opening an appended object costs round trips (S3): a save then opens its data file
    # on an I/O thread while it stages (pipeline.RankWriter.open_soon).
    opens_remotely: bool = False
    # Every rank's data files are seen through this store (the committer checks them
    # all: validation.check_files; a multi-rank save writes version 4 indexes: save.py).
    # False only for SplitStorage, whose data files stay on each node.
    sees_all_data: bool = True
    # Directories are things of their own that outlive what they held (local disk), so a
    # save killed before its first file leaves empty ones: ``remove_empty_dirs`` removes
    # them. Object stores have prefixes only, which vanish with their last object.
    keeps_empty_dirs: bool = False

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

    def remove_empty_dirs(self, prefixes: Sequence[str], older_than: float, dry_run: bool = False) -> list[str]:
        """Remove the directories ``prefixes`` name, in the given order, each only when it
        is empty and unchanged for ``older_than`` seconds; returns the prefixes removed
        (without their trailing '/'; ``dry_run``: those it would remove, touching
        nothing). Emptiness and age are judged before anything is removed, so a caller
        gives children before their parents: a directory that holds nothing but
        directories removed earlier in the same call counts as empty. The root is never
        removed, nothing is reached through a symlink, one that is not empty when its
        turn comes stays, and a prefix that names no directory is passed over. Which
        directories to offer is the caller's choice (gc: the ones a killed save leaves).
        Stores without directories (``keeps_empty_dirs`` False): nothing."""
        for prefix in prefixes:
            self._check(prefix, prefix=True)
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
