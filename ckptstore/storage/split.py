"""A store split in two: data files in one backend (a node's local disk), every other
object (manifests, votes, heartbeats, markers) in another that every rank shares.

This is a multi-node job's local tier (docs/tiers.md, "Across nodes"): each rank writes
its data files to its own node and reads them back from there, while the two-phase
commit runs through the shared backend as it would through one store. No rank sees
another node's data files: ``sees_all_data`` says so to the committer, which then checks
only its own files before the manifest (each rank checked and fsynced its own before
voting), and a load that needs another node's file finds it missing, as it would a
deleted one.
"""

from __future__ import annotations

import itertools
from typing import Iterable, Iterator

from .. import names
from .base import AppendWriter, ObjectInfo, Storage


def is_data_key(key: str) -> bool:
    """A data file of an attempt, or a temporary of one (by its last path part)."""
    leaf = key.rsplit("/", 1)[-1]
    kind = names.attempt_leaf_kind(leaf)
    if kind == "temp":
        kind = names.attempt_leaf_kind(leaf.rsplit(names.TMP_MARK, 1)[0])
    return kind == "data"


class SplitStorage(Storage):
    sees_all_data = False  # data files of other nodes are not here (the Storage contract, base.py; validation.check_files)

    def __init__(self, shared: Storage, data: Storage):
        self.shared, self.data = shared, data
        self.url = shared.url
        self.read_hints = data.read_hints
        self.opens_remotely = data.opens_remotely

    def _route(self, key: str) -> Storage:
        return self.data if is_data_key(key) else self.shared

    def child(self, prefix: str) -> "SplitStorage":
        return SplitStorage(self.shared.child(prefix), self.data.child(prefix))

    def sibling(self, name: str) -> "SplitStorage":
        return SplitStorage(self.shared.sibling(name), self.data.sibling(name))

    def put(self, key: str, data, *, if_absent: bool = False) -> None:
        self._route(key).put(key, data, if_absent=if_absent)

    def open_append(self, key: str, *, size_hint: int | None = None, writers: int = 1) -> AppendWriter:
        return self._route(key).open_append(key, size_hint=size_hint, writers=writers)

    def readinto(self, key: str, offset: int, out: memoryview, on_piece=None) -> None:
        self._route(key).readinto(key, offset, out, on_piece)

    def readinto_scatter(self, key: str, offset: int, outs: list[memoryview]) -> None:
        self._route(key).readinto_scatter(key, offset, outs)

    def read(self, key: str, offset: int = 0, length: int | None = None, *, limit: int | None = None) -> bytes:
        return self._route(key).read(key, offset, length, limit=limit)

    def list(self, prefix: str = "") -> list[str]:
        return sorted(set(self.shared.list(prefix)) | set(self.data.list(prefix)))

    def walk(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return itertools.chain(self.shared.walk(prefix), self.data.walk(prefix))

    def stat(self, key: str) -> ObjectInfo:
        return self._route(key).stat(key)

    def delete(self, key: str) -> None:
        self._route(key).delete(key)

    def delete_many(self, keys: Iterable[str]) -> None:
        """Each key to its route's ``delete_many``, in the given order within each route:
        the shared keys (manifests, votes) first, then the data files, the order I7 wants
        should a caller mix them in one call."""
        keys = [self._check(k) for k in keys]  # every key, before anything is deleted
        for store, mine in ((self.shared, [k for k in keys if not is_data_key(k)]),
                            (self.data, [k for k in keys if is_data_key(k)])):
            if mine:
                store.delete_many(mine)

    def is_dir(self) -> bool:
        return self.shared.is_dir() or self.data.is_dir()

    def abort_stale_uploads(self, older_than: float, dry_run: bool = False) -> list[str]:
        return self.shared.abort_stale_uploads(older_than, dry_run) + self.data.abort_stale_uploads(older_than, dry_run)

    def describe(self, key: str = "") -> str:
        return self._route(key).describe(key) if key else self.shared.describe()
