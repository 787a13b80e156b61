"""Reading a checkpoint whose blobs refer to other steps of its store (format version
3, incremental saves): each reference's bytes lie in the location of ``Blob.step``,
beside the checkpoint's own.

Readers address a blob by ``blob.file`` in the checkpoint's storage. :func:`resolve`
gives them a manifest in which each reference's file reads ``../step-N/<file>`` and a
storage (:class:`ReferencingStorage`) that reads such keys from step N's location, so
every reader (restore, reshard, verify) follows references without knowing of them.
The names a manifest stores are untouched; this is only how a reader addresses them.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Iterable, Iterator

from .. import format as fmt
from .. import names
from ..storage import Storage
from ..storage.base import AppendWriter, ObjectInfo

_UP = "../"


def read_key(blob: fmt.Blob) -> str:
    """How a reader addresses ``blob`` from its checkpoint's location."""
    return blob.file if blob.step is None else f"{_UP}{names.step_dir_name(blob.step)}/{blob.file}"


# Chunks smaller than this are written, not referenced: a record costs manifest bytes and
# a reader a request of its own, which a few KiB do not repay.
MIN_REFERENCE_BYTES = 64 << 10


def index(manifest: fmt.Manifest, rank: int) -> dict[tuple[int, str], fmt.Blob]:
    """What ``rank``'s next save may reference of ``manifest``: each tensor chunk of at
    least MIN_REFERENCE_BYTES that lies in a file this rank wrote, by (raw length,
    xxh3-128), as a reference: to the step whose location stores it (``manifest`` a step
    of a store), or to an earlier attempt of the same location (a drop-in save to one
    path, one rank: ``Blob.earlier``). Only its own files: two ranks holding equal
    chunks (a model every rank saves whole) then never reference the same stored blob,
    which a manifest may reference once."""
    out: dict[tuple[int, str], fmt.Blob] = {}
    drop_in = manifest.step is None
    if drop_in and manifest.world_size != 1:
        return out
    for key, b in _records(manifest):
        if key is None or b.raw_length < MIN_REFERENCE_BYTES:  # (key None: a skeleton)
            continue
        if names.parse_data_file(b.file)[1] != rank:
            continue
        if drop_in:  # (a drop-in's blobs name no step: format.validate_references)
            ref = b if b.earlier else dataclasses.replace(b, earlier=True)
        else:
            ref = b if b.step is not None else dataclasses.replace(b, step=manifest.step)
        out.setdefault((b.raw_length, b.xxh3_128), ref)
    return out


def _records(manifest: fmt.Manifest):
    """(key, blob) of the records at hand: all of them, or of a version 4 root those
    read into it (a rank's own: indexes.with_index)."""
    if manifest.complete:
        for _, key, b in manifest.blobs():
            yield key, b
        return
    for r in manifest.ranks:
        yield from r.blobs()
    for key, entry in manifest.tensors.items():
        for c in entry.chunks:
            yield key, c.blob


def has_references(manifest: fmt.Manifest) -> bool:
    return bool(manifest.referenced())


def resolve(storage: Storage, manifest: fmt.Manifest) -> tuple[Storage, fmt.Manifest]:
    """(storage, manifest) for reading ``manifest``'s checkpoint at ``storage``: as they
    are without references, else both made to address references (module docstring)."""
    if not has_references(manifest):
        return storage, manifest
    own = storage.describe().rstrip("/").rsplit("/", 1)[-1]
    if manifest.step is None or own != names.step_dir_name(manifest.step):
        # References lead beside the location; only a step's own directory of a store
        # may be followed there (a copy elsewhere would read whatever lies beside it).
        raise fmt.FormatError(f"{storage.describe()}: the checkpoint refers to other steps of its store, but this "
                              f"location is not its step's directory ({names.step_dir_name(manifest.step)}): "
                              "load it from its store, or consolidate it")
    return ReferencingStorage(storage), readable(manifest)


def readable(manifest: fmt.Manifest) -> fmt.Manifest:
    """``manifest`` with each reference's file named by its :func:`read_key`."""
    def blob(b: fmt.Blob) -> fmt.Blob:
        return b if b.step is None else dataclasses.replace(b, file=read_key(b))

    def entries(tensors):
        return {k: fmt.TensorEntry(e.dtype, e.shape, tuple(fmt.Chunk(c.offsets, c.sizes, blob(c.blob))
                                                           for c in e.chunks))
                for k, e in tensors.items()}

    ranks = tuple(fmt.RankState(r.rank, blob(r.skeleton), entries(r.tensors)) for r in manifest.ranks)
    mapped = getattr(manifest.tensors, "mapped", None)  # a version 4 root's, read on demand (indexes.LazyGlobals)
    return dataclasses.replace(manifest, ranks=ranks,
                               tensors=mapped(blob) if mapped is not None else entries(manifest.tensors))


class ReferencingStorage(Storage):
    """A checkpoint's location that also reads ``../step-N/<key>`` from step N's
    location beside it. Writes and listings are the location's own."""

    def __init__(self, base: Storage):
        self.base = base
        self.url = base.url
        self.read_hints = base.read_hints
        self.opens_remotely = base.opens_remotely
        self._siblings: dict[str, Storage] = {}
        self._lock = threading.Lock()

    def _route(self, key: str) -> tuple[Storage, str]:
        if not key.startswith(_UP):
            return self.base, key
        step_dir, _, rest = key[len(_UP):].partition("/")
        if names.parse_step_dir_name(step_dir) is None or not rest:
            return self.base, key  # not ours: the base refuses it as the bad key it is
        with self._lock:
            sib = self._siblings.get(step_dir)
            if sib is None:
                try:
                    sib = self._siblings[step_dir] = self.base.sibling(step_dir)
                except ValueError as e:
                    raise fmt.FormatError(f"{self.base.describe()}: a reference to {step_dir} cannot be "
                                          f"followed: {e}") from e
        return sib, rest

    def child(self, prefix: str) -> Storage:
        return self.base.child(prefix)

    def sibling(self, name: str) -> Storage:
        return self.base.sibling(name)

    def put(self, key: str, data, *, if_absent: bool = False) -> None:
        self.base.put(key, data, if_absent=if_absent)

    def open_append(self, key: str, *, size_hint: int | None = None, writers: int = 1) -> AppendWriter:
        return self.base.open_append(key, size_hint=size_hint, writers=writers)

    def readinto(self, key: str, offset: int, out: memoryview, on_piece=None) -> None:
        s, k = self._route(key)
        s.readinto(k, offset, out, on_piece)

    def readinto_scatter(self, key: str, offset: int, outs: list[memoryview]) -> None:
        s, k = self._route(key)
        s.readinto_scatter(k, offset, outs)

    def read(self, key: str, offset: int = 0, length: int | None = None, *, limit: int | None = None) -> bytes:
        s, k = self._route(key)
        return s.read(k, offset, length, limit=limit)

    def list(self, prefix: str = "") -> list[str]:
        return self.base.list(prefix)

    def walk(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return self.base.walk(prefix)

    def stat(self, key: str) -> ObjectInfo:
        s, k = self._route(key)
        return s.stat(k)

    def exists(self, key: str) -> bool:
        s, k = self._route(key)
        return s.exists(k)

    def delete(self, key: str) -> None:
        self.base.delete(key)

    def delete_many(self, keys: Iterable[str]) -> None:
        self.base.delete_many(keys)

    def is_dir(self) -> bool:
        return self.base.is_dir()

    def describe(self, key: str = "") -> str:
        s, k = self._route(key)
        return s.describe(k)
