"""Attempts of a drop-in location that this process's saves in flight reference.

A drop-in save (``ckptstore.save(obj, path)``) may reference chunks of the generation
visible when its writer starts (``Blob.earlier``). A save of the same path that commits
meanwhile retires that generation with its files (retire.retire_generations), and the
save in flight then failed ("data file vanished before the commit"): the loop
``save(a, p); save(b, p)`` without waiting lost its newest save. So a save holds the
attempts it may reference until it is done, and retiring keeps what is held. A lock per
location covers reading its references and retiring its generations' files: a save
either reads the new generation, or holds the old one's attempts before any of their
files can go. (Saves to one path from several processes are not supported: two writers.)
"""

from __future__ import annotations

import os
import threading

from ..storage import Storage

__all__ = ["Hold", "defer", "held_attempts", "references_lock", "take_deferred"]

_lock = threading.Lock()  # guards the maps below
_locks: dict[str, threading.RLock] = {}  # location -> its references lock
_held: dict[str, dict[str, frozenset[str]]] = {}  # location -> holding save's attempt -> attempts held
_deferred: dict[str, set[str]] = {}  # location -> attempts a retire kept only for a hold (defer)


def _key(storage: Storage) -> str:
    """One name per location, however it was reached (a local path through a symlink)."""
    root = getattr(storage, "root", None)
    return os.path.realpath(root) if isinstance(root, str) else storage.describe()


def references_lock(storage: Storage) -> threading.RLock:
    """The lock over reading ``storage``'s references and retiring its generations' files
    (one per location: saves to other paths never wait for it)."""
    key = _key(storage)
    with _lock:
        lock = _locks.get(key)
        if lock is None:
            lock = _locks[key] = threading.RLock()
        return lock


class Hold:
    """What the save of ``attempt`` holds of one location: ``take`` (under the location's
    ``references_lock``, with the read of the references) and ``release`` once the save
    is done (idempotent; a ``take`` after it holds nothing)."""

    def __init__(self, storage: Storage, attempt: str):
        self._key = _key(storage)
        self._attempt = attempt
        self._released = False

    def take(self, attempts) -> None:
        with _lock:
            if not self._released:
                _held.setdefault(self._key, {})[self._attempt] = frozenset(attempts)

    def release(self, *_ignored) -> None:
        with _lock:
            self._released = True
            holds = _held.get(self._key)
            if holds is not None:
                holds.pop(self._attempt, None)
                if not holds:
                    del _held[self._key]


def held_attempts(storage: Storage, but: str) -> frozenset[str]:
    """The attempts of ``storage``'s location that saves in flight hold, other than the
    save of attempt ``but`` (the one committing: what it reads, its manifest says)."""
    with _lock:
        holds = _held.get(_key(storage), {})
        return frozenset().union(*(held for holder, held in holds.items() if holder != but))


def defer(storage: Storage, attempts) -> None:
    """Attempts a retire kept only because a save in flight held them: no manifest names
    them any more, so the location's next retire looks at them again (take_deferred)."""
    if attempts:
        with _lock:
            _deferred.setdefault(_key(storage), set()).update(attempts)


def take_deferred(storage: Storage) -> set[str]:
    with _lock:
        return _deferred.pop(_key(storage), set())


def _after_fork_in_child() -> None:
    # A parent's thread may have held a lock; the holds are the parent's saves'.
    global _lock, _locks, _held, _deferred
    _lock = threading.Lock()
    _locks, _held, _deferred = {}, {}, {}


os.register_at_fork(after_in_child=_after_fork_in_child)
