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
commit still needs by their heartbeats (:class:`PeerWatch`), so a dead peer ends the
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

import contextlib
import json
import time
import warnings

from .._version import __version__
from .. import format as fmt
from .. import names
from ..errors import (
    AlreadyExistsError,
    BaseRetiredError,
    CkptStoreError,
    CommitConflictError,
    CommitError,
    CommitTimeoutError,
    FormatError,
    IntegrityError,
    NotRegularObjectError,
    ObjectNotFoundError,
    ObjectTooLargeError,
)
from .._jitter import jitter as _jitter
from .._threads import run_all
from ..runtime import runtime
from ..storage import Storage
from ..format import INDEX_VERSION
from . import claims, exiting
from .held import defer, held_attempts, references_lock, take_deferred
from .indexes import build_root



# Every rank of a multi-rank save beats its heartbeat this often from its start to its
# end, commit waits included (exiting.Heartbeat; a save shorter than this writes none):
# what gc's grace and a peer in exit mode hold a silent rank to.
SAVE_BEAT_EVERY = 3.0
# ... and no faster than keeps all of a job's beats (one PUT and one HEAD each) under about
# this many a second on their one prefix: 4,096 ranks beat every 8 s.
SAVE_BEATS_PER_S = 500


def save_beat_every(world_size: int) -> float:
    """The heartbeat period of each rank of a ``world_size``-rank save."""
    return max(SAVE_BEAT_EVERY, world_size / SAVE_BEATS_PER_S)


class Deadline:
    """Polling with backoff until a deadline: waits on storage, never on the training
    process group (votes travel through storage, so background threads need no
    collectives). The waiting rank's heartbeat, which keeps gc from taking its attempt
    for abandoned (I7), is beaten by the save's own thread (exiting.Heartbeat) from the
    start of the save to its end, waits included.

    The delay starts at ``start`` and doubles up to ``cap``; each sleep is jittered
    (half to all of it), so ranks that began waiting together do not poll in step."""

    def __init__(self, timeout: float, start: float = 0.002, cap: float = 0.25):
        self.end = time.monotonic() + timeout
        self.delay = start
        self.cap = max(cap, start)

    def sleep_or_expire(self) -> bool:
        left = self.end - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(self.delay * _jitter.uniform(0.5, 1.0), left))
        self.delay = min(self.delay * 2, self.cap)
        return True


# Every rank polls the same prefix while it waits, and an object store serves a prefix a
# bounded rate (S3: about 5,500 GETs and LISTs per second). The ranks that wait for the
# commit make one small GET per poll, spread so that together they make at most about
# FOLLOWER_POLLS_PER_S (at most eight times that at their first poll); the committer's
# one listing per poll (a page per 1,000 files: data, vote and heartbeat per rank) slows
# likewise. Below ~250 ranks the cadence is the fixed 0.25 s it always was.
FOLLOWER_POLLS_PER_S = 1000
COMMITTER_POLL_PAGES_PER_S = 12
FULL_LOOK_EVERY = 8  # a waiting rank's polls between full looks (a listing), see await_outcome


def follower_cadence(world_size: int) -> tuple[float, float]:
    """(first delay, longest delay) of a rank waiting for the commit of ``world_size`` ranks."""
    cap = max(0.25, world_size / FOLLOWER_POLLS_PER_S)
    return max(0.002, world_size / (8 * FOLLOWER_POLLS_PER_S)), cap


def committer_cadence(world_size: int) -> tuple[float, float]:
    """(first delay, longest delay) of the committer waiting for the votes."""
    pages = 3 * world_size / 1000
    return 0.002, max(0.25, pages / COMMITTER_POLL_PAGES_PER_S)


class PeerWatch:
    """Exit mode: how long each watched peer's heartbeat has gone unchanged.

    Each look reads the heartbeats of the ranks asked about (at most once per
    ``exiting.beat_every()``); a rank's silence is the time, on this process's
    monotonic clock, since its heartbeat's content last differed from the previous
    read, or since this watch first read it (a missing heartbeat counts as content).
    A heartbeat that cannot be read gives no evidence: that rank is left out.
    """

    def __init__(self, storage: Storage, attempt: str):
        self._storage = storage
        self._attempt = attempt
        self._seen: dict[int, tuple[bytes | None, float]] = {}  # rank -> (content, when it last changed)
        self._next = 0.0

    def due(self) -> bool:
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + exiting.beat_every()
        return True

    def look(self, ranks) -> dict[int, tuple[bytes | None, float]]:
        """{rank: (its heartbeat's content or None, seconds it has been unchanged)}."""
        out = {}
        for r in ranks:
            try:
                content = read_capped(self._storage, names.heartbeat_name(self._attempt, r),
                                      fmt.MAX_MARKER_BYTES, "heartbeat")
            except ObjectNotFoundError:
                content = None
            except Exception:
                continue  # no evidence either way
            now = time.monotonic()
            seen = self._seen.get(r)
            if seen is None or seen[0] != content:
                seen = self._seen[r] = (content, now)
            out[r] = (content, now - seen[1])
        return out


def _patience(content: bytes | None, world_size: int) -> float:
    """How long a peer's heartbeat may stay unchanged before it is presumed dead: the
    window when it says the peer exits too (it beats fast), else its normal period plus
    the window (every rank in a multi-rank save beats every save_beat_every() seconds,
    even one whose main thread is stuck in a collective and never saw the signal)."""
    return exiting.liveness() if exiting.says_exiting(content) else save_beat_every(world_size) + exiting.liveness()


def _presumed_dead(dead: list[int], me: int, silent: float) -> str:
    return (f"ranks {dead} presumed dead by rank {me}, which is exiting: their heartbeat did not change "
            f"for {silent:g}s (CKPTSTORE_EXIT_LIVENESS)")


def write_vote(storage: Storage, vote: fmt.Vote) -> None:
    storage.put(names.vote_name(vote.attempt, vote.rank), vote.to_bytes(), if_absent=True)


def write_failure_vote(storage: Storage, attempt: str, step, world_size: int, rank: int, error: BaseException) -> None:
    """Tell the committer at once that this rank cannot vote yes (best effort)."""
    try:
        write_vote(storage, fmt.Vote(attempt, step, world_size, rank, ok=False, error=f"{type(error).__name__}: {error}"))
    except BaseException:
        pass


def read_capped(storage: Storage, key: str, cap: int, what: str) -> bytes:
    """A small stored document, refused unread when it is larger than ``cap`` (one
    request on an object store)."""
    try:
        return storage.read(key, limit=cap)
    except ObjectTooLargeError as e:
        raise FormatError(f"{what} is larger than the cap of {cap} bytes: {e}") from e


def read_votes(storage: Storage, attempt: str, entries: list[str] | None = None,
               have=frozenset(), pool=None) -> dict[int, fmt.Vote]:
    """The votes of ``attempt`` but those of the ranks in ``have`` (read already: a
    committer polling for the last votes reads each vote once); ``entries``: a listing
    of its directory already made. With a ``pool`` the votes' bytes are fetched in
    parallel, as many at once as it has threads (the latency of an object store, not
    the count of ranks, bounds the wait), and parsed here one by one, in rank order
    (parsing holds the GIL: threads would only contend for it); the first bad vote in
    rank order is the error."""
    prefix = names.attempt_dir(attempt)
    todo = []
    for name in (storage.list(prefix) if entries is None else entries):
        rank = names.parse_vote_leaf(name)
        if rank is not None and rank not in have:
            todo.append((rank, f"{prefix}/{name}"))
    todo.sort()

    def fetch(key: str) -> bytes:
        return read_capped(storage, key, fmt.max_manifest_bytes(), "vote")

    fetched = [pool.submit(fetch, key) for _, key in todo] if pool is not None and len(todo) > 1 else None
    votes = {}
    try:
        for i, (rank, key) in enumerate(todo):
            try:
                v = fmt.Vote.from_bytes(fetched[i].result() if fetched is not None else fetch(key))
            except (FormatError, ObjectNotFoundError) as e:
                raise FormatError(f"{storage.describe(key)}: unreadable vote: {e}") from e
            if (v.attempt, v.rank) != (attempt, rank):
                raise FormatError(f"{storage.describe(key)}: holds the vote of rank {v.rank} for attempt {v.attempt}")
            votes[v.rank] = v
    finally:
        for f in fetched or ():
            f.cancel()
    return votes


def generations(storage: Storage) -> list[int]:
    """The generations of the manifests present, ascending."""
    gens = (names.parse_manifest_name(n) for n in storage.list(""))
    return sorted(g for g in gens if g is not None)


def read_manifest(storage: Storage, generation: int) -> fmt.Manifest:
    """The manifest of ``generation``, parsed and validated: any defect is a FormatError
    naming the file (never another exception type), so one bad manifest costs the tools
    that checkpoint, not the store."""
    name = names.manifest_name(generation)
    try:
        m = fmt.Manifest.from_bytes(read_capped(storage, name, fmt.max_manifest_bytes(), "manifest"))
    except FormatError as e:
        raise type(e)(f"{storage.describe(name)}: {e}") from e
    if m.generation != generation:
        raise FormatError(f"{storage.describe(name)}: holds generation {m.generation}, its name says {generation}")
    return m


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
                              if silent >= _patience(content, world_size))
                if dead:
                    reason = _presumed_dead(dead, 0, exiting.liveness())
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
                 base if base is not None and has_references(manifest) else None, fence,
                 deadline.end - time.monotonic())
    try:
        storage.put(names.manifest_name(generation), data, if_absent=True)
    except AlreadyExistsError as e:
        claims.withdraw_mark(storage, attempt)  # (this attempt never commits: gc may take it)
        raise CommitConflictError(
            f"{where}: another writer committed generation {generation} first; this save was not committed"
        ) from e
    if world_size > 1:
        write_outcome(storage, attempt, {"committed": generation})
    claims.withdraw_mark(storage, attempt)  # (served: the manifest names the attempt)
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


def _last_checks(storage: Storage, attempt: str, generation: int, ranks, tensors, root: dict | None,
                 base: tuple[int, int] | None, fence, left: float) -> None:
    """What must hold right before the manifest goes out, checked after the commit mark
    (claims.py): no gc claim or abort marker, every file the manifest names there at
    full length (the sizes from the look after the mark), the base of an incremental
    save still present, no newer run (``fence``). The checks must end within
    claims.COMMIT_WINDOW of the mark, so checks that took longer run again after a new
    mark, for the ``left`` seconds of the commit's timeout. Any refusal aborts the attempt."""
    tries = claims.Windowed(seconds=left)
    for _ in tries:
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
    if tries.in_time:
        return
    reason = tries.overran("the checks before the manifest", " until the commit's timeout")
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


def check_files(storage: Storage, ranks, tensors, listed: dict[str, int] | None = None) -> None:
    """Every data file the manifest will name is there and long enough: a file lost
    while the committer waited (deleted by hand, or by a gc run with a grace shorter
    than the wait) must not be published (I1). A reference's file (incremental saves)
    is looked up in its step's location; that it stays until this manifest lands is
    check_base's part (gc releases what a deleted base read for a grace)."""
    from .references import ReferencingStorage, read_key

    need: dict[str, int] = {}
    blobs = [b for r in ranks for _, b in r.blobs()]
    blobs += [c.blob for e in tensors.values() for c in e.chunks]
    for b in blobs:
        key = read_key(b)
        need[key] = max(need.get(key, 0), b.offset + b.length)
    need = here(need, storage)
    if any(b.step is not None for b in blobs):
        storage = ReferencingStorage(storage)
    check_sizes(storage, need, "data file", "the votes", listed=listed)


def here(need: dict[str, int], storage: Storage) -> dict[str, int]:
    """The data files of ``need`` the committer can see: all, except on a multi-node
    local tier (storage/split.py), where only this node's are here; every other rank
    wrote and fsynced its own before it voted."""
    if getattr(storage, "sees_all_data", True):
        return need
    return {name: size for name, size in need.items() if names.parse_data_file(name)[1] == 0}


def check_sizes(storage: Storage, need: dict[str, int], what: str, claimed_by: str, pool=None,
                listed: dict[str, int] | None = None) -> None:
    """Each file of ``need`` is there and holds at least its number of bytes, else a
    CommitError naming it (``what`` it is, ``claimed_by`` whom). Sizes come from
    ``listed`` (a listing just made: {key: size}) where it has them; the other files
    are stat'ed, in parallel on ``pool`` when given (one HEAD per file on S3)."""
    listed = listed or {}

    def size(name: str) -> int | None:
        if name in listed:
            return listed[name]
        try:
            return storage.stat(name).size
        except (ObjectNotFoundError, NotRegularObjectError):  # (a FIFO in its place is no data file either)
            return None

    ordered = sorted(need)
    for name, have in zip(ordered, run_all(pool, [lambda n=n: size(n) for n in ordered])):
        if have is None:
            raise CommitError(f"{storage.describe(name)}: {what} vanished before the commit; "
                              "nothing was committed")
        if have < need[name]:
            raise CommitError(f"{storage.describe(name)}: {what} holds {have} bytes, {claimed_by} "
                              f"name {need[name]}; nothing was committed")


_BASE_RETIRED = "references come from was deleted while it ran"  # (the abort reason the other ranks read)


def check_base(storage: Storage, base: tuple[int, int]) -> None:
    """The manifest an incremental save's references came from is still there. gc
    releases the files of a manifest it deletes and deletes them only after its grace
    (gc.py), so a base present now keeps the files this commit references for longer
    than the commit takes; a base deleted already may have taken them with it."""
    step, generation = base
    here = storage.sibling(names.step_dir_name(step))
    if not here.exists(names.manifest_name(generation)):
        raise BaseRetiredError(f"{here.describe(names.manifest_name(generation))}: the checkpoint this save's "
                               f"{_BASE_RETIRED} (a gc run by another process?); nothing was committed, and "
                               "the next save writes everything")


def merge_shards(votes: list[fmt.Vote]) -> dict[str, fmt.TensorEntry]:
    """Global tensors from every rank's shards: one dtype and shape per key, chunks that
    cover each tensor exactly once (I5), replicas whose hashes match the written copy."""
    meta: dict[str, tuple[str, tuple[int, ...], int]] = {}
    chunks: dict[str, list[fmt.Chunk]] = {}
    for v in votes:
        for key, entry in v.shards.items():
            seen = meta.setdefault(key, (entry.dtype, entry.shape, v.rank))
            if seen[:2] != (entry.dtype, entry.shape):
                raise FormatError(
                    f"global tensor {key!r}: rank {seen[2]} saved {seen[0]}{list(seen[1])}, "
                    f"rank {v.rank} saved {entry.dtype}{list(entry.shape)}"
                )
            chunks.setdefault(key, []).extend(entry.chunks)
    merged = {key: fmt.TensorEntry(dtype, shape, tuple(sorted(chunks[key], key=lambda c: c.offsets)))
              for key, (dtype, shape, _) in meta.items()}
    for key, entry in merged.items():
        fmt.validate_coverage(entry, f"global tensor {key!r}")
    written = {(k, c.offsets, c.sizes): c.blob.xxh3_128 for k, e in merged.items() for c in e.chunks}
    for v in votes:
        for r in v.replicas:
            digest = written.get((r.key, r.offsets, r.sizes))
            if digest is None:
                raise FormatError(f"global tensor {r.key!r}: rank {v.rank} holds a replica of chunk "
                                  f"{list(r.offsets)} that no rank wrote")
            if digest != r.xxh3_128:
                raise FormatError(f"global tensor {r.key!r}: replicated chunk at {list(r.offsets)} differs "
                                  f"between ranks (rank {v.rank} hashed {r.xxh3_128}, written copy {digest})")
    return merged


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


def abort(storage: Storage, attempt: str, reason) -> None:
    try:
        data = json.dumps({"attempt": attempt, "reason": str(reason)[:4096], "at": fmt.utc_now()}).encode()
        storage.put(names.abort_name(attempt), data, if_absent=True)
    except BaseException:
        pass
    write_outcome(storage, attempt, {"aborted": str(reason)[:4096]})


def write_outcome(storage: Storage, attempt: str, outcome: dict) -> None:
    """Tell the waiting ranks how ``attempt`` ended (best effort, create-only: the first
    word stands). It is a hint they act on only after checking it (await_outcome): a
    "committed" is read from its manifest, an "aborted" is believed only when no
    manifest names the attempt, and a lost outcome costs a waiting rank time, not
    correctness (its full looks find the manifest or the abort marker)."""
    try:
        data = json.dumps({"attempt": attempt, **outcome, "at": fmt.utc_now()}).encode()
        storage.put(names.outcome_name(attempt), data, if_absent=True)
    except BaseException:
        pass


def read_outcome(storage: Storage, attempt: str) -> dict | None:
    """The outcome the committer wrote for ``attempt``: {"committed": generation} or
    {"aborted": reason}; None when there is none yet, or it cannot be read or is not
    one (untrusted input: a waiting rank then takes a full look instead)."""
    try:
        doc = fmt.loads_json(read_capped(storage, names.outcome_name(attempt), fmt.MAX_MARKER_BYTES, "outcome"),
                             "outcome")
    except CkptStoreError:
        return None
    if not isinstance(doc, dict) or doc.get("attempt") != attempt:
        return None
    generation = doc.get("committed")
    if isinstance(generation, int) and not isinstance(generation, bool) and 0 < generation <= names.MAX_GENERATION:
        return {"committed": generation}
    reason = doc.get("aborted")
    return {"aborted": reason[:4096]} if isinstance(reason, str) else None


def read_abort_reason(storage: Storage, attempt: str) -> str:
    """The reason an abort marker gives, or why it cannot be read (it is untrusted input)."""
    try:
        marker = fmt.loads_json(read_capped(storage, names.abort_name(attempt), fmt.MAX_MARKER_BYTES, "abort marker"),
                                "abort marker")
        reason = marker.get("reason") if isinstance(marker, dict) else None
        return reason[:4096] if isinstance(reason, str) else "(no reason given)"
    except CkptStoreError as e:
        return f"(unreadable abort marker: {e})"


def await_outcome(storage: Storage, attempt: str, timeout: float, rank: int = 1,
                  world_size: int = 2) -> fmt.Manifest:
    """Ranks other than 0: wait until rank 0 committed this attempt or gave up.

    Each poll is one small GET, of the outcome the committer writes (write_outcome),
    paced by :func:`follower_cadence`. Every ``FULL_LOOK_EVERY``-th poll, and once more
    at the deadline, the rank takes a full look instead (the location's manifests and
    the abort marker), so an outcome that was never written (the committer died between
    its manifest and its outcome) delays it, never fails it."""
    where = storage.describe()
    deadline = Deadline(timeout, *follower_cadence(world_size))
    seen: set[int] = set()
    watch: PeerWatch | None = None
    polls = 0
    while True:
        polls += 1
        outcome = read_outcome(storage, attempt)
        if outcome is not None or polls % FULL_LOOK_EVERY == 0:
            manifest = _conclude(storage, attempt, outcome, seen, where)
            if manifest is not None:
                return manifest
        if exiting.active() and rank != 0:
            watch = watch or PeerWatch(storage, attempt)
            if watch.due():
                manifest = _judge_committer(storage, attempt, rank, watch, where, world_size, seen)
                if manifest is not None:
                    return manifest
        if not deadline.sleep_or_expire():
            manifest = _conclude(storage, attempt, None, seen, where)
            if manifest is not None:
                return manifest
            raise CommitTimeoutError(f"{where}: attempt {attempt} was not committed within {timeout}s")


def _conclude(storage: Storage, attempt: str, outcome: dict | None, seen: set[int],
              where: str) -> fmt.Manifest | None:
    """What ends a waiting rank's wait: the manifest of ``attempt``, or a CommitError
    when the attempt was aborted and no manifest names it (a commit that raced an abort
    stands); None while neither is so."""
    generation = (outcome or {}).get("committed")
    if generation is not None:
        try:
            m = read_manifest(storage, generation)
            if m.attempt == attempt:
                return m
        except (ObjectNotFoundError, FormatError):
            pass  # retired, or not what the outcome says: look at every generation
    for gen in reversed(generations(storage)):
        if gen in seen:
            continue
        try:
            m = read_manifest(storage, gen)
        except ObjectNotFoundError:
            continue  # retired while we looked
        except FormatError:
            seen.add(gen)  # not ours, whatever it is: rank 0 decides and says so
            continue
        seen.add(gen)
        if m.attempt == attempt:
            return m
    if outcome is not None and "aborted" in outcome:
        reason = str(outcome["aborted"])
    elif storage.exists(names.abort_name(attempt)):
        reason = read_abort_reason(storage, attempt)
    else:
        return None
    # Every rank raises what rank 0 raised for a retired base: a later save of each warns
    # of it and goes on, and the ranks stay together in their next collective save.
    error = BaseRetiredError if _BASE_RETIRED in reason else CommitError
    raise error(f"{where}: rank 0 did not commit attempt {attempt}: {reason}")


def _judge_committer(storage: Storage, attempt: str, rank: int, watch: PeerWatch, where: str,
                     world_size: int, seen: set[int]) -> fmt.Manifest | None:
    """Exit mode, a rank that voted: abort when rank 0 stopped beating (by the cadence
    its heartbeat promises: :func:`_patience`), unless a full look finds the attempt
    committed (rank 0 died after its manifest, before its outcome): then its manifest."""
    looked = watch.look([0])
    if 0 not in looked:
        return None
    content, silent = looked[0]
    limit = _patience(content, world_size)
    if silent < limit:
        return None
    manifest = _conclude(storage, attempt, None, seen, where)
    if manifest is not None:
        return manifest
    reason = _presumed_dead([0], rank, limit)
    abort(storage, attempt, reason)
    raise CommitError(f"{where}: {reason}; nothing was committed")
