"""The committer: rank 0's side of the two-phase commit, one short function of named steps.

:func:`commit` reads as the protocol does (docs/format.md, "Write order", steps 5 and 7,
and "Commits beside gc"):

1. :func:`gather_votes`: every rank's vote through storage (rank 0's own is in memory),
   until all are there, one says no, the attempt is aborted, a peer is presumed dead
   (exit mode) or the deadline passes;
2. :func:`validate`: the votes agree on attempt, step, world size and format version,
   and their records pass I5 by the rules of that version (:class:`Version3`,
   :class:`Version4`: one implementation each);
3. :func:`build`: the manifest of generation ``max + 1``, checked as a reader will check it;
4. :func:`mark_and_look`: the commit mark, then the last look at the attempt (a gc claim
   or an abort marker refuses), the files the manifest names, the base of an
   incremental save, the fence; these checks end within ``claims.COMMIT_WINDOW`` of the
   start of the mark's write, else they run again (``claims.Windowed``) until the
   commit's own timeout;
5. :func:`publish`: the manifest, create-only (I1), then the outcome the other ranks
   read, then the commit mark withdrawn (it has served: the manifest names the attempt);
6. :func:`retire`: older generations, manifests first (I6, I7); the commit stands
   whatever happens here, so a failure only warns.

A step that refuses raises a :class:`Refusal`. The one handler around steps 1 to 5 turns
it into what the other ranks learn (the abort marker, whose reason they raise) and what
gc needs (the commit mark withdrawn once written), and raises the refusal's error:
nothing was committed. Any other exception (a storage failure) propagates as it is.

The other ranks' side is follower.py; the messages through storage votes.py; the
heartbeats and waits heartbeat.py; what the checks check validation.py.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

from .._version import __version__
from .. import format as fmt
from .. import names
from ..errors import (
    AlreadyExistsError,
    CkptStoreError,
    CommitConflictError,
    CommitError,
    CommitTimeoutError,
    FormatError,
    IntegrityError,
)
from ..format import INDEX_VERSION
from ..runtime import runtime
from ..storage import Storage
from . import claims, exiting, heartbeat
from .heartbeat import Deadline, PeerWatch, committer_cadence
from .indexes import build_root
from .manifests import generations
from .references import has_references
from .retire import listing_with_newest, retire_generations
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
    c = Commit(storage, own, world_size, ends=time.monotonic() + timeout)
    try:
        votes = gather_votes(c, timeout)
        version, records = validate(c, votes)
        manifest, data = build(c, version, records, created_at, metrics, epoch)
        mark_and_look(c, version, manifest, base, fence)
        publish(c, manifest, data)
    except Refusal as r:
        c.refused(r)
        raise r.raised()
    retire(c, manifest, retire_files)
    return manifest


@dataclass
class Commit:
    """One commit in progress: where, whose, until when, and whether its mark is written."""

    storage: Storage
    own: fmt.Vote  # rank 0's vote
    world_size: int
    ends: float  # time.monotonic() at which the commit's own timeout ends (step 4 retries until then)
    marked: bool = False  # the commit mark is written (step 4): a refusal withdraws it

    @property
    def attempt(self) -> str:
        return self.own.attempt

    @property
    def where(self) -> str:
        return self.storage.describe()

    def refused(self, r: "Refusal") -> None:
        """Tell the other ranks why (the abort marker, when the refusal gives a reason) and
        let gc take the attempt (the mark withdrawn): it never commits."""
        if r.reason is not None:
            abort(self.storage, self.attempt, r.reason)
        if self.marked:
            claims.withdraw_mark(self.storage, self.attempt)


class Refusal(Exception):
    """A step refused the commit. ``error`` is what :func:`commit` raises; ``reason`` is
    what the abort marker tells the other ranks (None: no marker is written, because
    another rank aborted the attempt already or another writer committed the generation)."""

    def __init__(self, error: CkptStoreError, reason: str | None, cause: BaseException | None = None):
        super().__init__(str(error))
        self.error, self.reason = error, reason
        if cause is not None:
            error.__cause__ = cause

    def raised(self) -> CkptStoreError:
        """The error to raise: with its own traceback when a callee raised it, else the
        step's that refused; its cause kept, the refusal itself not shown."""
        error = self.error if self.error.__traceback__ is not None else self.error.with_traceback(self.__traceback__)
        error.__suppress_context__ = True
        return error


# ---------------------------------------------------------------------------- 1. votes
def gather_votes(c: Commit, timeout: float) -> dict[int, fmt.Vote]:
    """Every rank's vote, by rank. One listing a poll gives the votes and the abort
    marker (the data files' sizes come from the last look, after the commit mark: no
    HEAD per file at commit). In exit mode the ranks whose vote is missing are judged by
    their heartbeats (heartbeat.patience)."""
    storage, attempt, world_size, where = c.storage, c.attempt, c.world_size, c.where
    votes = {0: c.own}
    deadline = Deadline(timeout, *committer_cadence(world_size))
    watch: PeerWatch | None = None
    while True:
        entries: list[str] = []
        if world_size > 1:
            entries = [info.key.rsplit("/", 1)[-1] for info in claims.attempt_listing(storage, attempt)]
            votes.update(read_votes(storage, attempt, entries, have=votes.keys(), pool=runtime().readers))
        refusals = [v for v in votes.values() if not v.ok]
        if refusals:
            raise Refusal(CommitError(f"{where}: rank {refusals[0].rank} failed: {refusals[0].error}; "
                                      "nothing was committed"), refusals[0].error)
        if names.ABORT_LEAF in entries:  # another rank gave up on this attempt: it never commits
            raise Refusal(CommitError(f"{where}: attempt {attempt} was aborted: "
                                      f"{read_abort_reason(storage, attempt)}; nothing was committed"), None)
        if len(votes) >= world_size:
            return votes
        missing = sorted(set(range(world_size)) - votes.keys())
        if exiting.active():
            watch = watch or PeerWatch(storage, attempt)
            if watch.due():
                dead = sorted(r for r, (content, silent) in watch.look(missing).items()
                              if silent >= heartbeat.patience(content, world_size))
                if dead:
                    reason = heartbeat.presumed_dead(dead, 0, exiting.liveness())
                    raise Refusal(CommitError(f"{where}: {reason}; nothing was committed"), reason)
        if not deadline.sleep_or_expire():
            reason = f"ranks {missing} did not vote within {timeout}s"
            raise Refusal(CommitTimeoutError(f"{where}: {reason}; nothing was committed"), reason)


# ---------------------------------------------------------------------------- 2. validation
class Version3:
    """Format version 3: every vote holds its rank's records; the manifest holds them all."""

    def records(self, storage: Storage, votes: dict[int, fmt.Vote], world_size: int) -> dict:
        ranks = tuple(votes[r].state for r in sorted(votes))
        fmt.validate_ranks(ranks, world_size)
        return {"ranks": ranks, "tensors": merge_shards([votes[r] for r in sorted(votes)])}

    def check_whole(self, manifest: fmt.Manifest, data: bytes) -> None:
        fmt.validate_references(manifest)
        fmt.validate_extents(manifest.blobs())

    def check_files(self, storage: Storage, manifest: fmt.Manifest, sizes: dict[str, int]) -> None:
        check_files(storage, manifest.ranks, manifest.tensors, listed=sizes)


class Version4:
    """Format version 4: every vote names its rank's index; the manifest is a root that
    names them (indexes.py), checked by fingerprints rather than record by record."""

    def records(self, storage: Storage, votes: dict[int, fmt.Vote], world_size: int) -> dict:
        root = build_root(storage, votes, world_size, runtime().readers)
        return {"ranks": (), "tensors": {}, "format_version": INDEX_VERSION, **root}

    def check_whole(self, manifest: fmt.Manifest, data: bytes) -> None:
        fmt.Manifest.from_bytes(data)  # (each rank checked its own records before it voted: indexes.seal)

    def check_files(self, storage: Storage, manifest: fmt.Manifest, sizes: dict[str, int]) -> None:
        # each index is its data file's last blob: a file that holds it holds the rank's blobs
        check_sizes(storage, here({b.file: b.offset + b.length for b in manifest.indexes}, storage),
                    "data file", "the votes", runtime().readers, listed=sizes)


def validate(c: Commit, votes: dict[int, fmt.Vote]) -> tuple[Version3 | Version4, dict]:
    """The format version the votes were cast in, and the manifest's records built from
    them; refuses votes that disagree or records that fail I5."""
    own = c.own
    for v in votes.values():
        if (v.attempt, v.step, v.world_size) != (c.attempt, own.step, c.world_size):
            raise Refusal(CommitError(
                f"{c.where}: rank {v.rank} voted for attempt {v.attempt} step {v.step} world size "
                f"{v.world_size}, rank 0 for attempt {c.attempt} step {own.step} world size {c.world_size}"
            ), "votes disagree")
    indexed = own.index is not None  # format version 4: the votes name indexes (indexes.py)
    version = Version4() if indexed else Version3()
    try:
        mixed = sorted(r for r, v in votes.items() if (v.index is not None) != indexed)
        if mixed:
            raise FormatError(f"ranks {mixed[:8]} voted in format version {4 if not indexed else 3}, rank 0 in "
                              f"{4 if indexed else 3} (mixed library versions or options?)")
        return version, version.records(c.storage, votes, c.world_size)
    except (FormatError, IntegrityError) as e:  # (a table or index that cannot be read: refuse, do not hang)
        raise Refusal(CommitError(f"{c.where}: refusing to commit: {e}"), str(e), e) from e


# ---------------------------------------------------------------------------- 3. the manifest
def build(c: Commit, version: Version3 | Version4, records: dict, created_at: str, metrics: dict,
          epoch: int | None) -> tuple[fmt.Manifest, bytes]:
    """The manifest of the next generation and its bytes, refused when a reader would
    refuse it: no manifest goes out that a load would not read."""
    previous = generations(c.storage)
    generation = (previous[-1] + 1) if previous else 1
    if generation > names.MAX_GENERATION:
        raise Refusal(CommitError(f"{c.where}: the location already holds generation {previous[-1]}, the highest "
                                  "a manifest name can hold (a planted or damaged manifest?); nothing was committed"),
                      f"generation {generation} does not fit a manifest name")
    manifest = fmt.Manifest(
        generation=generation, attempt=c.attempt, step=c.own.step, world_size=c.world_size,
        created_at=created_at, committed_at=fmt.utc_now(), metrics=metrics,
        library=f"ckptstore {__version__}", epoch=epoch, **records,
    )
    data = manifest.to_bytes()
    try:
        version.check_whole(manifest, data)
    except FormatError as e:
        raise Refusal(CommitError(f"{c.where}: refusing to commit: {e}"), str(e), e) from e
    return manifest, data


# ---------------------------------------------------------------------------- 4. mark, last look
def mark_and_look(c: Commit, version: Version3 | Version4, manifest: fmt.Manifest,
                  base: tuple[int, int] | None, fence) -> None:
    """What must hold right before the manifest goes out, checked after the commit mark
    (claims.py): no gc claim or abort marker, every file the manifest names there at
    full length (the sizes from the look after the mark), the base of an incremental
    save that references it still present, no newer run (``fence``). The checks must end
    within claims.COMMIT_WINDOW of the start of the mark's write, so checks that took
    longer run again after a new mark, until the commit's own timeout (``c.ends``)."""
    storage, attempt = c.storage, c.attempt
    base = base if base is not None and has_references(manifest) else None
    tries = claims.Windowed(seconds=c.ends - time.monotonic())
    for _ in tries:
        try:
            claims.write_mark(storage, attempt, manifest.generation)
            c.marked = True
            version.check_files(storage, manifest, claims.last_look(storage, attempt))
            if base is not None:
                check_base(storage, base)
        except CommitError as e:
            raise Refusal(e, str(e)) from e
        if fence is not None:
            try:
                fence()
            except CommitError as e:  # the other ranks learn why (FencedError)
                raise Refusal(e, f"{type(e).__name__}: {e}") from e
    if tries.in_time:
        return
    reason = tries.overran("the checks before the manifest", " until the commit's timeout")
    raise Refusal(CommitError(f"{c.where}: {reason}; nothing was committed"), reason)


# ---------------------------------------------------------------------------- 5. publish
def publish(c: Commit, manifest: fmt.Manifest, data: bytes) -> None:
    """The manifest, create-only (I1): it is the commit. Then the outcome the waiting
    ranks poll for (a hint: follower.py checks it). Then the commit mark goes: it has
    served (a manifest names the attempt, so no gc takes it), and no mark is left behind
    in every committed attempt."""
    try:
        c.storage.put(names.manifest_name(manifest.generation), data, if_absent=True)
    except AlreadyExistsError as e:  # (this attempt never commits: its mark goes, gc may take it)
        raise Refusal(CommitConflictError(f"{c.where}: another writer committed generation {manifest.generation} "
                                          "first; this save was not committed"), None, e) from e
    if c.world_size > 1:
        write_outcome(c.storage, c.attempt, {"committed": manifest.generation})
    claims.withdraw_mark(c.storage, c.attempt)
    c.marked = False


# ---------------------------------------------------------------------------- 6. retire
def retire(c: Commit, manifest: fmt.Manifest, files: bool) -> None:
    """Older generations go once a reader's own listing shows the new one as the visible
    one (that listing also says which); the commit stands whatever happens here, and a
    leftover generation is gc's to clean."""
    generation = manifest.generation
    if generation == 1:
        return  # nothing older to retire (the first save of a location: no listing)
    try:
        listed = listing_with_newest(c.storage, generation)
        if listed is None:
            raise CommitError(f"generation {generation} is not the visible one after its commit")
        retire_generations(c.storage, below=generation, live_attempt=c.attempt, files=files,
                           keep=manifest.earlier_attempts(), listed=listed)
    except Exception as e:
        warnings.warn(f"{c.where}: committed generation {generation}, but retiring older ones failed: {e}",
                      RuntimeWarning, stacklevel=3)
