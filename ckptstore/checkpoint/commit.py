"""Phase two of a save: votes through storage, validation, the create-only manifest.

Every rank, once its data file is durable, writes its vote (create-only). Rank 0, the
committer, waits for all votes, checks them (same attempt, step and world size; chunks
cover each tensor exactly once: I5), and writes ``manifest-<generation>.json``
create-only (I1). The other ranks wait until that manifest or an abort marker
appears. Both waits end at a deadline, so a dead rank means a clean failure, never a
hang and never a partial commit. An abort marker, whichever rank wrote it, ends both
waits. After committing, older generations of the same checkpoint are retired:
manifest first, then their files (I6, I7).

In exit mode (:mod:`ckptstore.checkpoint.exiting`) the waits also judge the peers the
commit still needs by their heartbeats (:class:`~ckptstore.checkpoint.heartbeat.PeerWatch`), so a dead peer ends the
wait within the liveness window instead of the commit timeout:

- rank 0 judges the ranks whose vote is missing, each by the cadence it promised (every
  rank of a multi-rank save beats every ``save_beat_every()`` seconds from start to end,
  and fast once it exits): one whose heartbeat says it exits and did not change for the
  window, or any other whose heartbeat did not change for the period plus the window,
  is presumed dead;
- another rank, once it voted, judges rank 0 only, by the same cadences. A rank that
  is told to exit while rank 0 is not (part of a job preempted, or rank 0's main thread
  blocked in a collective) so gives rank 0 the time its normal heartbeat promises
  instead of aborting a commit rank 0 can still finish.

A rank that presumes a peer dead writes the abort marker naming it (create-only) and
fails its save with a :class:`CommitError`.
"""

from __future__ import annotations

import time
import warnings

from .._version import __version__
from .. import format as fmt
from .. import names
from ..errors import AlreadyExistsError, CommitConflictError, CommitError, CommitTimeoutError, FormatError, IntegrityError
from ..runtime import runtime
from ..storage import Storage
from ..format import INDEX_VERSION
from . import claims, exiting, heartbeat
from .heartbeat import Deadline, PeerWatch, committer_cadence
from .indexes import build_root
from .manifests import generations
from .retire import retire_generations
from .validation import check_base, check_files, check_sizes, here, merge_shards
from .votes import abort, read_abort_reason, read_votes, write_outcome


def commit(storage: Storage, own: fmt.Vote, world_size: int, created_at: str, metrics: dict,
           timeout: float, epoch: int | None = None, fence=None, retire_files: bool = True,
           base: tuple[int, int] | None = None) -> fmt.Manifest:
    """Rank 0: gather and validate votes, write the manifest, retire older generations.
    ``fence()``, when given, runs just before the manifest is written and raises to
    refuse the commit (a newer run has claimed the store: fencing.py).
    ``retire_files=False`` (a store whose checkpoints may reference each other's data):
    retiring deletes the older manifests only, and gc, which knows what every kept
    manifest references, deletes their files. ``base``: (step, generation) of the
    manifest the votes' references came from (incremental saves): it must still be
    there just before the manifest is written (check_base)."""
    from .references import has_references

    attempt = own.attempt
    where = storage.describe()
    votes = {0: own}
    deadline = Deadline(timeout, *committer_cadence(world_size))
    watch: PeerWatch | None = None
    while True:
        entries: list[str] = []
        if world_size > 1:
            # One listing a poll: votes and abort marker (the data files' sizes come from
            # the last look, after the commit mark: no HEAD per file at commit).
            entries = [info.key.rsplit("/", 1)[-1] for info in claims.attempt_listing(storage, attempt)]
            votes.update(read_votes(storage, attempt, entries, have=votes.keys(), pool=runtime().readers))
        refusals = [v for v in votes.values() if not v.ok]
        if refusals:
            abort(storage, attempt, refusals[0].error)
            raise CommitError(f"{where}: rank {refusals[0].rank} failed: {refusals[0].error}; nothing was committed")
        if names.ABORT_LEAF in entries:  # another rank gave up on this attempt: it never commits
            raise CommitError(f"{where}: attempt {attempt} was aborted: {read_abort_reason(storage, attempt)}; "
                              "nothing was committed")
        if len(votes) >= world_size:
            break
        if exiting.active():
            watch = watch or PeerWatch(storage, attempt)
            if watch.due():
                missing = sorted(set(range(world_size)) - votes.keys())
                dead = sorted(r for r, (content, silent) in watch.look(missing).items()
                              if silent >= heartbeat.patience(content, world_size))
                if dead:
                    reason = heartbeat.presumed_dead(dead, 0, exiting.liveness())
                    abort(storage, attempt, reason)
                    raise CommitError(f"{where}: {reason}; nothing was committed")
        if not deadline.sleep_or_expire():
            missing = sorted(set(range(world_size)) - votes.keys())
            abort(storage, attempt, f"ranks {missing} did not vote within {timeout}s")
            raise CommitTimeoutError(
                f"{where}: ranks {missing} did not vote within {timeout}s; nothing was committed"
            )
    for v in votes.values():
        if (v.attempt, v.step, v.world_size) != (attempt, own.step, world_size):
            abort(storage, attempt, "votes disagree")
            raise CommitError(
                f"{where}: rank {v.rank} voted for attempt {v.attempt} step {v.step} world size "
                f"{v.world_size}, rank 0 for attempt {attempt} step {own.step} world size {world_size}"
            )
    indexed = own.index is not None  # format version 4: the votes name indexes (indexes.py)
    root: dict = {}
    ranks, tensors = (), {}
    try:
        mixed = sorted(r for r, v in votes.items() if (v.index is not None) != indexed)
        if mixed:
            raise FormatError(f"ranks {mixed[:8]} voted in format version {4 if not indexed else 3}, rank 0 in "
                              f"{4 if indexed else 3} (mixed library versions or options?)")
        if indexed:
            root = build_root(storage, votes, world_size, runtime().readers)
        else:
            ranks = tuple(votes[r].state for r in sorted(votes))
            fmt.validate_ranks(ranks, world_size)
            tensors = merge_shards([votes[r] for r in sorted(votes)])
    except (FormatError, IntegrityError) as e:  # (a table or index that cannot be read: refuse, do not hang)
        abort(storage, attempt, str(e))
        raise CommitError(f"{where}: refusing to commit: {e}") from e
    previous = generations(storage)
    generation = (previous[-1] + 1) if previous else 1
    if generation > names.MAX_GENERATION:
        abort(storage, attempt, f"generation {generation} does not fit a manifest name")
        raise CommitError(f"{where}: the location already holds generation {previous[-1]}, the highest a "
                          "manifest name can hold (a planted or damaged manifest?); nothing was committed")
    manifest = fmt.Manifest(
        generation=generation, attempt=attempt, step=own.step, world_size=world_size,
        created_at=created_at, committed_at=fmt.utc_now(), ranks=ranks, tensors=tensors, metrics=metrics,
        library=f"ckptstore {__version__}", epoch=epoch,
        **({"format_version": INDEX_VERSION, **root} if indexed else {}),
    )
    data = manifest.to_bytes()
    try:  # what a reader will check of the whole: no manifest goes out that it would refuse
        if indexed:  # (each rank checked its own records before it voted: indexes.seal)
            fmt.Manifest.from_bytes(data)
        else:
            fmt.validate_references(manifest)
            fmt.validate_extents(manifest.blobs())
    except FormatError as e:
        abort(storage, attempt, str(e))
        raise CommitError(f"{where}: refusing to commit: {e}") from e
    _last_checks(storage, attempt, generation, ranks, tensors, root if indexed else None,
                 base if base is not None and has_references(manifest) else None, fence)
    try:
        storage.put(names.manifest_name(generation), data, if_absent=True)
    except AlreadyExistsError as e:
        claims.withdraw_mark(storage, attempt)  # (this attempt never commits: gc may take it)
        raise CommitConflictError(
            f"{where}: another writer committed generation {generation} first; this save was not committed"
        ) from e
    if world_size > 1:
        write_outcome(storage, attempt, {"committed": generation})
    if generation == 1:
        return manifest  # nothing older to retire (the first save of a location: no listing)
    try:
        # Retire only once a reader's own listing shows the new generation as the visible
        # one; that listing also says which older ones to retire.
        listed = _listing_with_newest(storage, generation)
        if listed is None:
            raise CommitError(f"generation {generation} is not the visible one after its commit")
        retire_generations(storage, below=generation, live_attempt=attempt, files=retire_files,
                           keep=manifest.earlier_attempts(), listed=listed)
    except Exception as e:  # committed already: a leftover generation is gc's to clean
        warnings.warn(f"{where}: committed generation {generation}, but retiring older ones failed: {e}",
                      RuntimeWarning, stacklevel=2)
    return manifest


LAST_CHECK_TRIES = 3  # commit marks before a commit whose checks keep overrunning the window gives up


def _last_checks(storage: Storage, attempt: str, generation: int, ranks, tensors, root: dict | None,
                 base: tuple[int, int] | None, fence) -> None:
    """What must hold right before the manifest goes out, checked after the commit mark
    (claims.py): no gc claim or abort marker, every file the manifest names there at
    full length (the sizes from the look after the mark), the base of an incremental
    save still present, no newer run (``fence``). The manifest must follow within
    claims.COMMIT_WINDOW of the mark, so checks that took longer run again after a new
    mark. Any refusal aborts the attempt."""
    for _ in range(LAST_CHECK_TRIES):
        marked = time.monotonic()
        try:
            claims.write_mark(storage, attempt, generation)
            sizes = claims.last_look(storage, attempt)
            if root is not None:  # each index is its data file's last blob: a file that holds it holds the rank's blobs
                check_sizes(storage, here({b.file: b.offset + b.length for b in root["indexes"]}, storage),
                            "data file", "the votes", runtime().readers, listed=sizes)
            else:
                check_files(storage, ranks, tensors, listed=sizes)
            if base is not None:
                check_base(storage, base)
        except CommitError as e:
            _refuse(storage, attempt, str(e))
            raise
        if fence is not None:
            try:
                fence()
            except CommitError as e:
                _refuse(storage, attempt, f"{type(e).__name__}: {e}")  # the other ranks learn why (FencedError)
                raise
        if time.monotonic() - marked <= claims.COMMIT_WINDOW:
            return
    reason = f"the checks before the manifest took longer than {claims.COMMIT_WINDOW:g}s {LAST_CHECK_TRIES} times"
    _refuse(storage, attempt, reason)
    raise CommitError(f"{storage.describe()}: {reason}; nothing was committed")


def _refuse(storage: Storage, attempt: str, reason: str) -> None:
    """A commit refused after its mark: abort the attempt, take the mark back."""
    abort(storage, attempt, reason)
    claims.withdraw_mark(storage, attempt)


LISTING_LAG_TRIES = 4  # listings (0.05, 0.1, 0.2 s apart) before a just-written manifest counts as not listed


def _listing_with_newest(storage: Storage, generation: int) -> list[int] | None:
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
