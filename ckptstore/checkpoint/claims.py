"""Commits beside gc: the committer's commit mark and gc's claim (docs/format.md,
"Commits beside gc").

A save that commits while gc runs must never end with a manifest naming files gc
deleted, whatever gc's grace. No backend offers an operation on two keys at once, so
each side writes before it looks at what the other wrote (the order of Dekker's mutual
exclusion), and one of the two always sees the other:

- the committer rewrites its commit mark (``committing.json``: the generation it is
  about to write) and only then takes its last look at the attempt (:func:`last_look`):
  a gc claim or an abort marker there refuses the commit, and the sizes its file checks
  use come from that look. Its checks end within ``COMMIT_WINDOW`` seconds of the start
  of the mark's write, or it marks and looks again (:class:`Windowed`), until the
  commit's own timeout;
- gc writes its claim (``gc-claim.json``, create-only) and only then looks at the
  attempt: a mark younger than ``COMMIT_LEASE`` that names a generation its location
  does not hold yet (:func:`committing`) means a committer may be between its look and
  its manifest, so gc leaves the attempt alone; else it lists the generations again and
  deletes only what no manifest names.

A committer that saw no claim looked before the claim was written, so it marked before
that too, and gc's look finds the mark: fresh, gc leaves the attempt; older than the
lease, the manifest (its checks ended within the window of the mark) is there for gc's
listing. The one assumption on time: a manifest lands less than ``COMMIT_LEASE -
COMMIT_WINDOW`` seconds after the committer's checks, less however far gc's clock is
ahead of the store's (a process or request stalled longer than that is the residual
risk). The window is measured from the start of the mark's write, not its end: the
mark's modification time, by which gc ages it, is set somewhere during the write (a
local file's before its fsync, an S3 object's when its PUT began).

A mark dated more than ``MARK_CLOCK_TOLERANCE`` (the same margin) after gc's now was
not written by a committer of a store whose clock agrees with gc's as the assumption
above requires: a planted file, one restored with its times (``rsync -a``, a backup)
or a clock far off. It is not a commit in flight: else a single such file kept gc from
deleting data anywhere in the store until that date.

gc deletes its claim last, and only once nothing else ckptstore wrote is left in the
attempt: a committer that finds no claim then finds no files either. gc uses the same
marks store-wide before it deletes data a manifest named (a dropped checkpoint's, a
released attempt's): a committing save may reference it (incremental saves), and its
mark precedes its check of the base manifest (gc.py).
"""

from __future__ import annotations

import json
import time

from .. import format as fmt
from .. import names
from ..errors import AlreadyExistsError, CkptStoreError, CommitError
from ..storage import Storage

# gc takes a mark this young, naming a generation not yet written, for a commit in
# flight ...
COMMIT_LEASE = 120.0
# ... and the committer's checks end at most this long after it started writing its
# commit mark (else it marks and checks again). Half the lease: a slow but healthy store
# (an fsync on a loaded NFS or Lustre, S3 retrying SlowDown) fits in it, and the other
# half is what the manifest write after the checks, and gc's clock ahead of the
# store's, may take together.
COMMIT_WINDOW = COMMIT_LEASE / 2
# A mark dated later than gc's now by more than this is not a commit in flight (see
# the module's docstring): the same margin the assumption on clocks allows.
MARK_CLOCK_TOLERANCE = COMMIT_LEASE - COMMIT_WINDOW


class Windowed:
    """The tries of work that must end within ``COMMIT_WINDOW`` of its start, on this
    process's monotonic clock: the committer's mark and last checks (commit.py), gc's
    release marks and the deletion of their manifest (gc_run.py). Iterate it and do the
    whole work in the body, from its first write (the mark) on; iterating ends after a
    try that kept to the window (``in_time``), or after one that overran once ``seconds``
    (from the first try's start: the commit's own timeout) have passed or ``tries`` were
    made. The first try is always made."""

    def __init__(self, seconds: float | None = None, tries: int | None = None):
        self.seconds, self.most = seconds, tries
        self.tries = 0
        self.in_time = False
        self.slowest = 0.0

    def __iter__(self):
        first = time.monotonic()
        while True:
            self.tries += 1
            started = time.monotonic()
            yield self.tries
            ended = time.monotonic()
            if ended - started <= COMMIT_WINDOW:
                self.in_time = True
                return
            self.slowest = max(self.slowest, ended - started)
            if (self.most is not None and self.tries >= self.most) or \
                    (self.seconds is not None and ended - first >= self.seconds):
                return

    def overran(self, what: str, until: str = "") -> str:
        """Why the work gave up: ``what`` took longer than the window every try."""
        return (f"{what} took longer than {COMMIT_WINDOW:g}s (COMMIT_LEASE / 2) each of {self.tries} time(s)"
                f"{until} (the slowest {self.slowest:.1f}s)")


def write_mark(storage: Storage, attempt: str, generation: int) -> None:
    """The committer's mark: about to write ``generation`` (a plain overwrite: a second
    try of the checks rewrites it)."""
    doc = {"attempt": attempt, "generation": generation, "at": fmt.utc_now()}
    storage.put(names.committing_name(attempt), json.dumps(doc).encode())


def withdraw_mark(storage: Storage, attempt: str) -> None:
    """The committer's mark goes once it has served (best effort): after the manifest
    landed (a manifest names the attempt: no gc takes it, and no mark is left behind in
    every committed attempt), or when it refused the commit after marking it (gc need
    not wait out the lease for an attempt that never commits). A mark left by a crash
    between is harmless: a manifest naming the attempt, or one of its generation, says
    the commit is over, the lease ends it all the same, and gc deletes it with the
    attempt."""
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
    younger than the lease, dated no later than ``MARK_CLOCK_TOLERANCE`` after ``now``,
    and names a generation above every one of ``generations`` (the location's, listed
    after the mark was looked at). A mark that cannot be read counts as one. A manifest
    naming the attempt is the caller's to look for."""
    if mark_mtime is None or now - mark_mtime >= COMMIT_LEASE or mark_mtime - now > MARK_CLOCK_TOLERANCE:
        return False
    generation = marked_generation(storage, attempt)
    return generation is None or generation > max(generations, default=0)
