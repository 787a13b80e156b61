"""Phase two of a save: votes through storage, validation, the create-only manifest.

Every rank, once its data file is durable, writes its vote (create-only). Rank 0, the
committer, waits for all votes, checks them (same attempt, step and world size; chunks
cover each tensor exactly once: I5), and writes ``manifest-<generation>.json``
create-only (I1). The other ranks wait until that manifest or an abort marker
appears. Both waits end at a deadline, so a dead rank means a clean failure, never a
hang and never a partial commit. After committing, older generations of the same
checkpoint are retired: manifest first, then their files (I6, I7).
"""

from __future__ import annotations

import json
import time
import warnings

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
    ObjectNotFoundError,
    ObjectTooLargeError,
)
from ..storage import Storage


HEARTBEAT_EVERY = 10.0  # seconds between heartbeats of a rank waiting in the commit


class Deadline:
    """Polling with backoff until a deadline: waits on storage, never on the training
    process group (votes travel through storage, so background threads need no
    collectives).

    While it waits, the rank rewrites a heartbeat file in its attempt now and then:
    gc judges an attempt's age by its newest file, so an attempt whose ranks are still
    waiting never looks abandoned (I7).
    """

    def __init__(self, timeout: float, storage: Storage | None = None, attempt: str = "", rank: int = 0):
        self.end = time.monotonic() + timeout
        self.delay = 0.002
        self._beat = (storage, names.heartbeat_name(attempt, rank)) if storage else None
        self._last_beat = time.monotonic()

    def sleep_or_expire(self) -> bool:
        now = time.monotonic()
        left = self.end - now
        if left <= 0:
            return False
        if self._beat is not None and now - self._last_beat >= HEARTBEAT_EVERY:
            self._last_beat = now
            try:
                self._beat[0].put(self._beat[1], fmt.utc_now().encode())
            except Exception:
                pass  # a missed heartbeat only makes gc's view older, never wrong data
        time.sleep(min(self.delay, left))
        self.delay = min(self.delay * 2, 0.25)
        return True


def write_vote(storage: Storage, vote: fmt.Vote) -> None:
    data = json.dumps(vote.to_json(), separators=(",", ":")).encode()
    storage.put(names.vote_name(vote.attempt, vote.rank), data, if_absent=True)


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


def read_votes(storage: Storage, attempt: str) -> dict[int, fmt.Vote]:
    votes = {}
    prefix = names.attempt_dir(attempt)
    for name in storage.list(prefix):
        rank = names.parse_vote_leaf(name)
        if rank is None:
            continue
        key = f"{prefix}/{name}"
        try:
            v = fmt.Vote.from_bytes(read_capped(storage, key, fmt.max_manifest_bytes(), "vote"))
        except (FormatError, ObjectNotFoundError) as e:
            raise FormatError(f"{storage.describe(key)}: unreadable vote: {e}") from e
        if (v.attempt, v.rank) != (attempt, rank):
            raise FormatError(f"{storage.describe(key)}: holds the vote of rank {v.rank} for attempt {v.attempt}")
        votes[v.rank] = v
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
           timeout: float) -> fmt.Manifest:
    """Rank 0: gather and validate votes, write the manifest, retire older generations."""
    attempt = own.attempt
    where = storage.describe()
    votes = {0: own}
    deadline = Deadline(timeout, storage, attempt, 0)
    while True:
        if world_size > 1:
            votes.update(read_votes(storage, attempt))
        refusals = [v for v in votes.values() if not v.ok]
        if refusals:
            abort(storage, attempt, refusals[0].error)
            raise CommitError(f"{where}: rank {refusals[0].rank} failed: {refusals[0].error}; nothing was committed")
        if len(votes) >= world_size:
            break
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
    ranks = tuple(votes[r].state for r in sorted(votes))
    try:
        fmt.validate_ranks(ranks, world_size)
        tensors = merge_shards([votes[r] for r in sorted(votes)])
    except FormatError as e:
        abort(storage, attempt, str(e))
        raise CommitError(f"{where}: refusing to commit: {e}") from e
    try:
        check_files(storage, ranks, tensors)
    except CommitError as e:
        abort(storage, attempt, str(e))
        raise
    previous = generations(storage)
    generation = (previous[-1] + 1) if previous else 1
    if generation > names.MAX_GENERATION:
        abort(storage, attempt, f"generation {generation} does not fit a manifest name")
        raise CommitError(f"{where}: the location already holds generation {previous[-1]}, the highest a "
                          "manifest name can hold (a planted or damaged manifest?); nothing was committed")
    manifest = fmt.Manifest(
        generation=generation, attempt=attempt, step=own.step, world_size=world_size,
        created_at=created_at, committed_at=fmt.utc_now(), ranks=ranks, tensors=tensors, metrics=metrics,
        library=f"ckptstore {__version__}",
    )
    try:
        storage.put(names.manifest_name(generation), manifest.to_bytes(), if_absent=True)
    except AlreadyExistsError as e:
        raise CommitConflictError(
            f"{where}: another writer committed generation {generation} first; this save was not committed"
        ) from e
    try:
        # Retire only once a reader's own listing shows the new generation as the visible one.
        if generations(storage)[-1:] != [generation]:
            raise CommitError(f"generation {generation} is not the visible one after its commit")
        retire_generations(storage, below=generation, live_attempt=attempt)
    except Exception as e:  # committed already: a leftover generation is gc's to clean
        warnings.warn(f"{where}: committed generation {generation}, but retiring older ones failed: {e}",
                      RuntimeWarning, stacklevel=2)
    return manifest


def check_files(storage: Storage, ranks, tensors) -> None:
    """Every data file the manifest will name is there and long enough: a file lost
    while the committer waited (deleted by hand, or by a gc run with a grace shorter
    than the wait) must not be published (I1)."""
    need: dict[str, int] = {}
    blobs = [b for r in ranks for _, b in r.blobs()]
    blobs += [c.blob for e in tensors.values() for c in e.chunks]
    for b in blobs:
        need[b.file] = max(need.get(b.file, 0), b.offset + b.length)
    for name, size in sorted(need.items()):
        try:
            have = storage.stat(name).size
        except ObjectNotFoundError:
            raise CommitError(f"{storage.describe(name)}: data file vanished before the commit; "
                              "nothing was committed") from None
        if have < size:
            raise CommitError(f"{storage.describe(name)}: data file holds {have} bytes, the votes "
                              f"name {size}; nothing was committed")


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


def retire_generations(storage: Storage, below: int, live_attempt: str) -> None:
    """Delete generations older than ``below``: each manifest before its files (I7).
    The files of ``live_attempt`` (the new generation's) are never deleted, whatever an
    older manifest claims."""
    for gen in generations(storage):
        if gen >= below:
            break
        try:
            old = read_manifest(storage, gen)
            attempt = old.attempt
        except (CkptStoreError, ValueError):
            attempt = None  # unreadable: drop the manifest, leave files to gc
        storage.delete(names.manifest_name(gen))
        if attempt is not None and attempt != live_attempt:  # parsed: the attempt passed the grammar
            for info in list(attempt_files(storage, attempt)):
                storage.delete(info.key)


def abort(storage: Storage, attempt: str, reason) -> None:
    try:
        data = json.dumps({"attempt": attempt, "reason": str(reason)[:4096], "at": fmt.utc_now()}).encode()
        storage.put(names.abort_name(attempt), data, if_absent=True)
    except BaseException:
        pass


def read_abort_reason(storage: Storage, attempt: str) -> str:
    """The reason an abort marker gives, or why it cannot be read (it is untrusted input)."""
    try:
        marker = fmt.loads_json(read_capped(storage, names.abort_name(attempt), fmt.MAX_MARKER_BYTES, "abort marker"),
                                "abort marker")
        reason = marker.get("reason") if isinstance(marker, dict) else None
        return reason[:4096] if isinstance(reason, str) else "(no reason given)"
    except CkptStoreError as e:
        return f"(unreadable abort marker: {e})"


def await_outcome(storage: Storage, attempt: str, timeout: float, rank: int = 1) -> fmt.Manifest:
    """Ranks other than 0: wait until rank 0 committed this attempt or gave up."""
    where = storage.describe()
    deadline = Deadline(timeout, storage, attempt, rank)
    seen: set[int] = set()
    while True:
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
        if storage.exists(names.abort_name(attempt)):
            raise CommitError(f"{where}: rank 0 did not commit attempt {attempt}: {read_abort_reason(storage, attempt)}")
        if not deadline.sleep_or_expire():
            raise CommitTimeoutError(f"{where}: attempt {attempt} was not committed within {timeout}s")
