"""Commits beside gc: the committer's commit mark and gc's claim (docs/format.md,
"Commits beside gc").

A save that commits while gc runs must never end with a manifest naming files gc
deleted, whatever gc's grace. No backend offers an operation on two keys at once, so
each side writes before it looks at what the other wrote (the order of Dekker's mutual
exclusion), and one of the two always sees the other:

- the committer rewrites its commit mark (``committing.json``: the generation it is
  about to write) and only then takes its last look at the attempt (:func:`last_look`):
  a gc claim or an abort marker there refuses the commit, and the sizes its file checks
  use come from that look. It writes the manifest within ``COMMIT_WINDOW`` seconds of
  the mark, or marks and looks again;
- gc writes its claim (``gc-claim.json``, create-only) and only then looks at the
  attempt: a mark younger than ``COMMIT_LEASE`` that names a generation its location
  does not hold yet (:func:`committing`) means a committer may be between its look and
  its manifest, so gc leaves the attempt alone; else it lists the generations again and
  deletes only what no manifest names.

A committer that saw no claim looked before the claim was written, so it marked before
that too, and gc's look finds the mark: fresh, gc leaves the attempt; older than the
lease, the manifest (written within the window) is there for gc's listing. The one
assumption on time: a manifest lands less than ``COMMIT_LEASE - COMMIT_WINDOW`` seconds
after the committer's checks (a process or request stalled longer than that is the
residual risk), with gc's clock within that of the store's.

gc deletes its claim last, and only once nothing else ckptstore wrote is left in the
attempt: a committer that finds no claim then finds no files either. gc uses the same
marks store-wide before it deletes data a manifest named (a dropped checkpoint's, a
released attempt's): a committing save may reference it (incremental saves), and its
mark precedes its check of the base manifest (gc.py).
"""

from __future__ import annotations

import json

from .. import format as fmt
from .. import names
from ..errors import AlreadyExistsError, CkptStoreError, CommitError
from ..storage import Storage

# The committer writes its manifest at most this long after its commit mark (else it
# marks and checks again) ...
COMMIT_WINDOW = 15.0
# ... and gc takes a mark this young, naming a generation not yet written, for a commit
# in flight. The difference is what a manifest write may take after the checks.
COMMIT_LEASE = 120.0


def write_mark(storage: Storage, attempt: str, generation: int) -> None:
    """The committer's mark: about to write ``generation`` (a plain overwrite: a second
    try of the checks rewrites it)."""
    doc = {"attempt": attempt, "generation": generation, "at": fmt.utc_now()}
    storage.put(names.committing_name(attempt), json.dumps(doc).encode())


def withdraw_mark(storage: Storage, attempt: str) -> None:
    """The committer refused its commit after marking it: its mark goes (best effort), so
    gc need not wait out the lease for an attempt that never commits."""
    try:
        storage.delete(names.committing_name(attempt))
    except Exception:
        pass  # the lease ends it all the same


def attempt_listing(storage: Storage, attempt: str) -> list:
    """The entries directly in ``attempt``'s directory, as ObjectInfo (nothing
    ckptstore writes lies deeper: whatever is planted there is left out)."""
    top = names.attempt_dir(attempt) + "/"
    return [info for info in storage.walk(top) if "/" not in info.key[len(top):]]


def last_look(storage: Storage, attempt: str) -> dict[str, int]:
    """The committer's last look at its attempt, after its mark: {key: size} of the
    attempt's files; a CommitError when gc claimed the attempt or a rank aborted it."""
    listed = attempt_listing(storage, attempt)
    leaves = {info.key.rsplit("/", 1)[-1] for info in listed}
    sizes = {info.key: info.size for info in listed if info.kind == "file"}
    if names.CLAIM_LEAF in leaves:
        raise CommitError(f"{storage.describe()}: attempt {attempt} was claimed by gc as abandoned (a gc with a "
                          "grace shorter than this save's pauses); nothing was committed")
    if names.ABORT_LEAF in leaves:
        raise CommitError(f"{storage.describe()}: attempt {attempt} was aborted before its manifest; "
                          "nothing was committed")
    return sizes


def claim(storage: Storage, attempt: str, reason: str) -> None:
    """gc's claim on ``attempt`` (create-only: an earlier claim stands)."""
    doc = {"attempt": attempt, "reason": reason[:1024], "at": fmt.utc_now()}
    try:
        storage.put(names.claim_name(attempt), json.dumps(doc).encode(), if_absent=True)
    except AlreadyExistsError:
        pass


def marked_generation(storage: Storage, attempt: str) -> int | None:
    """The generation ``attempt``'s commit mark names; None when it cannot be read
    (gone, or not a mark: untrusted input)."""
    try:
        doc = fmt.loads_json(storage.read(names.committing_name(attempt), limit=fmt.MAX_MARKER_BYTES), "commit mark")
    except (CkptStoreError, ValueError):
        return None
    generation = doc.get("generation") if isinstance(doc, dict) else None
    ok = type(generation) is int and 0 < generation <= names.MAX_GENERATION
    return generation if ok else None


def committing(storage: Storage, attempt: str, mark_mtime: float | None, generations, now: float) -> bool:
    """Whether a committer may be writing ``attempt``'s manifest: its commit mark is
    younger than the lease and names a generation above every one of ``generations``
    (the location's, listed after the mark was looked at). A mark that cannot be read
    counts as one. A manifest naming the attempt is the caller's to look for."""
    if mark_mtime is None or now - mark_mtime >= COMMIT_LEASE:
        return False
    generation = marked_generation(storage, attempt)
    return generation is None or generation > max(generations, default=0)
