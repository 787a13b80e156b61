"""Promotion: a checkpoint committed in one store (the local tier) committed again in
another (the durable tier), by copying its files and replaying the two-phase commit.

Each rank copies the data files it wrote itself (their names carry its rank, so a rank
needs nothing from another node), byte for byte, checking every blob's xxh3-128 on the
way and re-encoding nothing; then it votes in the destination, and rank 0 commits there
with :func:`commit.commit`, from votes rebuilt out of the source manifest. The
destination checkpoint so has the same attempt, the same file names and the same
chunk records as the source; only its generation and commit time are its own. Until
rank 0's create-only manifest lands nothing of it is visible (I1), so a promotion
killed at any point leaves debris that gc removes after its grace, never a checkpoint
that looks complete and is not.
"""

from __future__ import annotations

import threading
import time

from .. import format as fmt
from .. import names
from ..errors import ObjectNotFoundError
from ..storage import Storage
from .commit import commit
from .follower import await_outcome
from .manifests import generations, read_manifest
from .indexes import read_indexes, vote_of_index
from .reader import verified
from .save import refuse
from .votes import write_vote

# One blob at a time is in memory (its stored bytes and, when compressed, its decoded
# bytes for the hash): at most about twice the chunk size of the save.


class Throttle:
    """At most ``bytes_per_s`` on average (None: unlimited), for the copy's reads."""

    def __init__(self, bytes_per_s: float | None):
        if bytes_per_s is not None and not bytes_per_s > 0:
            raise ValueError(f"a promotion bandwidth must be > 0 bytes/s, got {bytes_per_s!r}")
        self.rate = bytes_per_s
        self._lock = threading.Lock()
        self._free_at = time.monotonic()  # when the bytes taken so far are paid for

    def take(self, n: int) -> None:
        if self.rate is None:
            return
        with self._lock:
            now = time.monotonic()
            self._free_at = max(self._free_at, now) + n / self.rate
            wait = self._free_at - now - n / self.rate  # pay for earlier bytes, not these
        if wait > 0:
            time.sleep(wait)


def rank_of_file(name: str) -> int:
    parsed = names.parse_data_file(name)
    if parsed is None:  # the manifest was validated: its files all pass this grammar
        raise ValueError(f"{name!r} is not a data file name")
    return parsed[1]


def rank_vote(manifest: fmt.Manifest, rank: int) -> fmt.Vote:
    """The vote ``rank`` would have cast for ``manifest``'s checkpoint: its own object,
    and the chunks of global tensors that lie in its files (rank 0 names every global
    tensor, so one without chunks, an empty one, is not lost)."""
    shards = {}
    for key, entry in manifest.tensors.items():
        chunks = tuple(c for c in entry.chunks if rank_of_file(c.blob.file) == rank)
        if chunks or rank == 0:
            shards[key] = fmt.TensorEntry(entry.dtype, entry.shape, chunks)
    return fmt.Vote(manifest.attempt, manifest.step, manifest.world_size, rank, ok=True,
                    state=manifest.ranks[rank], shards=shards)


def promoted(dst: Storage, attempt: str) -> fmt.Manifest | None:
    """The manifest ``dst`` already holds for ``attempt`` (promoted before), else None."""
    for gen in reversed(generations(dst)):
        try:
            m = read_manifest(dst, gen)
        except ObjectNotFoundError:
            continue
        if m.attempt == attempt:
            return m
    return None


def copy_file(src: Storage, dst: Storage, name: str, blobs: list[fmt.Blob], throttle: Throttle,
              writers: int = 1) -> int:
    """``name`` from ``src`` to ``dst``, byte for byte, each blob checked against its
    hash before it is appended (an IntegrityError names the blob); returns the bytes.
    ``writers``: how many ranks copy into ``dst`` at once (a hint for its part size)."""
    size = src.stat(name).size
    extents = sorted({(b.offset, b.length): b for b in blobs}.items())
    writer = dst.open_append(name, size_hint=size, writers=writers)
    try:
        pos = 0
        for (offset, length), blob in extents:
            if offset > pos:  # bytes between blobs (none today): copied as they are
                _append(writer, src.read(name, pos, offset - pos), throttle)
            stored = memoryview(bytearray(length))
            throttle.take(length)
            src.readinto(name, offset, stored)
            verified(None, blob, f"{src.describe(name)}", lambda n=blob.raw_length: memoryview(bytearray(n)),
                     stored=stored)
            writer.append(stored)
            pos = offset + length
        if size > pos:
            _append(writer, src.read(name, pos, size - pos), throttle)
        return writer.close()
    except BaseException:
        writer.abort()
        raise


def _append(writer, data: bytes, throttle: Throttle) -> None:
    throttle.take(len(data))
    writer.append(data)


def promote(src: Storage, dst: Storage, manifest: fmt.Manifest, rank: int, *, timeout: float,
            fence=None, throttle: Throttle | None = None) -> fmt.Manifest:
    """Commit ``manifest``'s checkpoint (committed at ``src``) at ``dst``: this rank's
    part. Every rank of the saving job calls it for the same manifest; rank 0 commits.
    Returns the destination's manifest."""
    done = promoted(dst, manifest.attempt)
    if done is not None:
        return done
    world = manifest.world_size
    throttle = throttle or Throttle(None)
    try:
        mine: dict[str, list[fmt.Blob]] = {}
        if manifest.indexed:  # version 4: this rank's index says what its files hold
            index = read_indexes(src, manifest, [rank], None)[rank]
            blobs = [b for _, b in index.blobs()] + [manifest.indexes[rank]]
            blobs += [index.summary.table] if index.summary.table is not None else []
            vote = vote_of_index(index, manifest.indexes[rank], manifest.step, world)
        else:
            blobs = [b for _, _, b in manifest.blobs()]
            vote = rank_vote(manifest, rank)
        for blob in blobs:
            if rank_of_file(blob.file) == rank:
                mine.setdefault(blob.file, []).append(blob)
        for name in sorted(mine):
            copy_file(src, dst, name, mine[name], throttle, writers=world)
        if world > 1:
            write_vote(dst, vote)
        if rank == 0:
            return commit(dst, vote, world, manifest.created_at, dict(manifest.metrics), timeout,
                          epoch=manifest.epoch, fence=fence,
                          retire_files=manifest.step is None)  # other steps may reference a retired one's files
        return await_outcome(dst, manifest.attempt, timeout, rank, world)
    except BaseException as e:
        refuse(dst, manifest.attempt, manifest.step, world, rank, e)
        raise
