"""Attempts of a drop-in location that this process's saves in flight reference.

A drop-in save (``ckptstore.save(obj, path)``) may reference chunks of the generation
visible when its writer starts (``Blob.earlier``). A save of the same path that commits
meanwhile retires that generation with its files (commit.retire_generations), and the
save in flight then failed ("data file vanished before the commit"): the loop
``save(a, p); save(b, p)`` without waiting lost its newest save. So a save holds the
attempts it may reference until it is done, and retiring keeps what is held. A lock per
location covers reading its references and retiring its generations' files: a save
either reads the new generation, or holds the old one's attempts before any of their
files can go. (Saves to one path from several processes are not supported: two writers.)
"""

from __future__ import annotations

import threading

from ..storage import Storage

__all__ = ["Hold", "held_attempts", "references_lock"]

_lock = threading.Lock()  # guards the two maps below
_locks: dict[str, threading.RLock] = {}  # location (Storage.describe()) -> its references lock
# location -> the holding save's attempt -> the attempts it holds
_held: dict[str, dict[str, frozenset[str]]] = {}


def references_lock(storage: Storage) -> threading.RLock:
    """The lock over reading ``storage``'s references and retiring its generations (one
    per location: saves to other paths never wait for it)."""
    where = storage.describe()
    with _lock:
        lock = _locks.get(where)
        if lock is None:
            lock = _locks[where] = threading.RLock()
        return lock


class Hold:
    """What the save of ``attempt`` holds of one location: ``take`` (under the location's
    ``references_lock``, with the read of the references) and ``release`` once the save
    is done (idempotent)."""

    def __init__(self, storage: Storage, attempt: str):
        self._where = storage.describe()
        self._attempt = attempt

    def take(self, attempts) -> None:
        with _lock:
            _held.setdefault(self._where, {})[self._attempt] = frozenset(attempts)

    def release(self, *_ignored) -> None:
        with _lock:
            holds = _held.get(self._where)
            if holds is not None:
                holds.pop(self._attempt, None)
                if not holds:
                    del _held[self._where]


def held_attempts(storage: Storage, but: str) -> frozenset[str]:
    """The attempts of ``storage``'s location that saves in flight hold, other than the
    save of attempt ``but`` (the one committing: what it reads, its manifest says)."""
    with _lock:
        holds = _held.get(storage.describe(), {})
        return frozenset().union(*(held for holder, held in holds.items() if holder != but))
