"""Retiring older generations once a new one is committed (I6, I7): every older
manifest first, then (a drop-in path) their attempts' files, except those the new
generation or a save of this process in flight may read. A store's step leaves the
older generation's files to gc, which knows what every kept manifest references.
"""

from __future__ import annotations

import contextlib
import time

from .. import names
from ..errors import CkptStoreError
from ..storage import Storage
from .held import defer, held_attempts, references_lock, take_deferred
from .manifests import generations, read_manifest


def attempt_files(storage: Storage, attempt: str):
    """The files ckptstore wrote in ``attempt`` (data, votes, heartbeats, abort marker,
    temporaries of those), as ObjectInfo: what deleting an attempt deletes. Anything else
    in its directory (a symlink, a special file, a subdirectory, a foreign name) is not
    ours and stays, reported by gc as foreign."""
    for info in storage.walk(names.attempt_dir(attempt) + "/"):
        if info.kind == "file" and names.attempt_file_of(info.key) is not None:
            yield info


def retire_generations(storage: Storage, below: int, live_attempt: str, files: bool = True,
                       keep=frozenset(), listed: list[int] | None = None) -> None:
    """Delete generations older than ``below``: every such manifest first, then their
    files (I7: no file goes while a manifest that reads it is left; ``files=False``: the
    manifests only). A retired generation's files go with it, and so do those of the
    earlier attempts it read (``Blob.earlier``: kept for it when it committed, nobody's
    once it is retired). The files of ``live_attempt`` (the new generation's) and of the
    attempts in ``keep`` (earlier ones it refers to) are never deleted, whatever an older
    manifest claims, nor are those of a retired store step (a drop-in save over one:
    other steps may read them; gc judges them); those that other saves of this process
    in flight hold (they may reference them: held.py) are deferred to the location's
    next retire. Retiring files
    holds the location's references lock: a drop-in save in flight reads its references,
    or holds them, not in between. ``listed``: the generations as a listing just made
    shows them (else one is made)."""
    with references_lock(storage) if files else contextlib.nullcontext():
        _retire(storage, below, live_attempt, files, keep, listed)


def _retire(storage: Storage, below: int, live_attempt: str, files: bool, keep, listed) -> None:
    retired: set[str] = set()
    for gen in (generations(storage) if listed is None else listed):
        if gen >= below:
            break
        if files:  # (read only for what it names: store steps leave files to gc)
            try:
                old = read_manifest(storage, gen)
                if old.step is None:  # a drop-in's own files; a store step's (others may read them) are gc's
                    retired |= {old.attempt} | old.earlier_attempts()
            except (CkptStoreError, ValueError):
                pass  # unreadable: drop the manifest, leave its files to gc
        storage.delete(names.manifest_name(gen))
    if not files:
        return
    doomed = (retired | take_deferred(storage)) - set(keep) - {live_attempt}
    held = held_attempts(storage, but=live_attempt)
    defer(storage, doomed & held)
    for attempt in sorted(doomed - held):  # (parsed: grammar)
        storage.delete_many([info.key for info in attempt_files(storage, attempt)])


LISTING_LAG_TRIES = 4  # listings (0.05, 0.1, 0.2 s apart) before a just-written manifest counts as not listed


def listing_with_newest(storage: Storage, generation: int) -> list[int] | None:
    """A listing of the generations that shows ``generation`` as the newest, or None: a
    store whose listings may lag a write for a moment (some S3-compatible ones) gets a
    short, bounded back-off before retiring is skipped (gc retires later)."""
    for attempt in range(LISTING_LAG_TRIES):
        gens = generations(storage)
        if gens[-1:] == [generation]:
            return gens
        if gens and gens[-1] > generation:  # a newer one: no wait changes that
            return None
        if attempt + 1 < LISTING_LAG_TRIES:
            time.sleep(0.05 * 2 ** attempt)
    return None
