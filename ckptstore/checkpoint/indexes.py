"""Format version 4 at work: a rank seals its index into its data file, the committer
builds the root from the votes alone, and readers read only the indexes they need.

- **Writing** (:func:`seal`, on the rank's commit thread, before its data file is made
  durable): the table of global tensors the rank holds and its index are appended as
  two more blobs; the vote names the index and sums it up (format.Summary).
- **Committing** (:func:`build_root`): the committer reads each distinct table once
  and checks I5 by fingerprints (fingerprint.py), so its work grows with the ranks,
  not with their chunks. A fingerprint that does not add up sends it to the exact
  check over every index, which names the chunk at fault.
- **Reading**: :func:`read_indexes` fetches indexes in parallel, each checked against
  the root's hash (I3) and against the root's claims before it is used;
  :func:`expand` reads all of them (verify, promotion, a consolidating load);
  :func:`for_load` reads one rank's, and :class:`LazyGlobals` the others' only when the
  chunks a template needs are not in it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from .. import format as fmt
from .._threads import run_all
from ..errors import FormatError
from ..format import (
    GlobalEntry,
    Index,
    Reads,
    Summary,
    check_cap,
    in_ranges,
    index_blob,
    parse_table,
    rank_ranges,
    ranges_ranks,
    table_bytes,
)
from ..storage import Storage
from . import fingerprint
from .reader import verified
from .references import ReferencingStorage, read_key
from .validation import check_sizes, merge_shards


# ---------------------------------------------------------------------------- a rank
def rank_records(rank: int, written, staged) -> tuple[fmt.RankState, dict[str, fmt.TensorEntry]]:
    """A rank's own object and the chunks of global tensors it wrote (an entry for every
    global tensor it holds, without chunks where another rank writes them)."""
    tensors = {key: fmt.TensorEntry(dtype, shape, tuple(written.local.get(key, ())))
               for key, (dtype, shape) in staged.local.items()}
    shards = {key: fmt.TensorEntry(dtype, shape, tuple(written.shards.get(key, ())))
              for key, (dtype, shape) in staged.shards.items()}
    return fmt.RankState(rank, written.skeleton, tensors), shards


def seal(writer, written, staged, *, step: int | None, world_size: int) -> tuple[fmt.Vote, Index]:
    """Append this rank's table and index to its data file (before it is made durable)
    and return its version 4 vote and the index. Checks first what the committer no longer reads:
    its own tensors' coverage, its blobs' extents and references (I4, I5)."""
    rank, attempt = writer.rank, writer.attempt
    state, shards = rank_records(rank, written, staged)
    for key, entry in state.tensors.items():
        fmt.validate_coverage(entry, f"rank {rank} tensor {key!r}")
    for key, entry in shards.items():
        fmt.validate_chunks(entry, f"rank {rank} global tensor {key!r}")
    blobs = [b for _, b in state.blobs()] + [c.blob for e in shards.values() for c in e.chunks]
    fmt.validate_extents((rank, None, b) for b in blobs)
    check_referenced_files(writer.storage, blobs)
    table = writer.store_metadata(table_bytes(staged.shards)) if staged.shards else None
    reads = Reads.of_blobs(blobs + ([table] if table is not None else []))
    if reads.references and step is None:
        raise FormatError("a checkpoint that is not a step of a store cannot refer to other steps")
    summary = Summary(
        table,
        fingerprint.coverage({k: [(c.offsets, c.sizes) for c in e.chunks] for k, e in shards.items()}),
        fingerprint.replicas([(k, c.offsets, c.sizes, c.blob.xxh3_128) for k, e in shards.items() for c in e.chunks],
                             [(r.key, r.offsets, r.sizes, r.xxh3_128) for r in written.replicas],
                             lambda key: staged.holders.get(key, 1)),
        reads,
    )
    index = Index(attempt, rank, state, shards, tuple(written.replicas), summary)
    vote = fmt.Vote(attempt, step, world_size, rank, ok=True, index=writer.store_metadata(index.to_bytes()),
                    summary=summary)
    return vote, index


def with_index(storage: Storage, root: fmt.Manifest, index: Index, pool) -> fmt.Manifest:
    """``root`` with one rank's ``index`` read into it (the rank that wrote it, after its
    commit: what its next incremental save may reference; a load of that rank), the
    other indexes read on demand (:class:`LazyGlobals`)."""
    return dataclasses.replace(root, ranks=(index.state,), tensors=LazyGlobals(storage, root, pool, {index.rank: index}),
                               tables=_tables([index]))


def _tables(indexes) -> tuple[fmt.Blob, ...]:
    return tuple(i.summary.table for i in indexes if i.summary.table is not None)


def check_referenced_files(storage: Storage, blobs) -> None:
    """The files this rank's references read (incremental saves) are there and long
    enough: what the committer checked of every vote's references in version 3, each
    rank checks of its own before it votes (validation.check_base then keeps them)."""
    need: dict[str, int] = {}
    for b in blobs:
        if b.step is not None or b.earlier:
            key = read_key(b)
            need[key] = max(need.get(key, 0), b.offset + b.length)
    if need:
        check_sizes(ReferencingStorage(storage), need, "a file this save refers to", "its references")


def vote_of_index(index: Index, blob: fmt.Blob, step: int | None, world_size: int) -> fmt.Vote:
    """The vote a rank cast for the index it stored at ``blob`` (a promotion replays it)."""
    return fmt.Vote(index.attempt, step, world_size, index.rank, ok=True, index=blob, summary=index.summary)


# ---------------------------------------------------------------------------- the committer
def build_root(storage: Storage, votes: dict[int, fmt.Vote], world_size: int, pool) -> dict:
    """The root's own fields (``indexes``, ``globals``, ``reads``) from every rank's
    version 4 vote; raises FormatError, naming what is wrong, for a checkpoint the
    committer must refuse."""
    ranks = sorted(votes)
    old = [r for r in ranks if votes[r].index is None]
    if old:
        raise FormatError(f"ranks {old[:8]} voted in format version 3, others in version 4 (mixed library versions?)")
    # What a root can name by position: the votes read from storage were checked when
    # parsed (format.Vote); the committer's own, rank 0's, is checked here.
    index_blob(votes[0].index.to_json(), "rank 0's vote", votes[0].attempt, 0)
    tables: dict[str, list[int]] = {}
    for r in ranks:
        t = votes[r].summary.table
        if t is not None:
            tables.setdefault(t.xxh3_128, []).append(r)
    fetched = run_all(pool, [(lambda b=votes[rs[0]].summary.table, r=rs[0]: parse_table(
        _metadata(storage, b, f"{storage.describe(b.file)}: rank {r}'s table of global tensors"),
        f"rank {r}'s table")) for rs in tables.values()])
    meta: dict[str, tuple[str, tuple[int, ...], int]] = {}
    holders: dict[str, list[int]] = {}
    for rs, table in zip(tables.values(), fetched):
        for key, (dtype, shape) in table.items():
            seen = meta.setdefault(key, (dtype, shape, rs[0]))
            if seen[:2] != (dtype, shape):
                raise FormatError(f"global tensor {key!r}: rank {seen[2]} saved {seen[0]}{list(seen[1])}, "
                                  f"rank {rs[0]} saved {dtype}{list(shape)}")
            holders.setdefault(key, []).extend(rs)
    globals_ = {k: GlobalEntry(d, s, rank_ranges(holders[k])) for k, (d, s, _) in sorted(meta.items())}
    covered = sum(votes[r].summary.coverage for r in ranks) % fingerprint.P
    balance = sum(votes[r].summary.replicas for r in ranks) % fingerprint.P
    if covered != fingerprint.whole({k: g.shape for k, g in globals_.items()}) or balance:
        exact_check(storage, votes, pool)  # raises, naming the chunk; passes only if the fingerprints were wrong
    reads = Reads(sum(votes[r].index.length for r in ranks), sum(votes[r].index.raw_length for r in ranks))
    for r in ranks:
        reads = reads + votes[r].summary.reads
    return {"indexes": tuple(votes[r].index for r in ranks), "globals": globals_, "reads": reads}


def exact_check(storage: Storage, votes: dict[int, fmt.Vote], pool) -> None:
    """The version 3 check of I5 over every rank's index (the fingerprints' fallback)."""
    blobs = {r: v.index for r, v in votes.items()}
    indexes = _read(storage, blobs, {r: v.attempt for r, v in votes.items()}, pool)
    merge_shards([indexes[r] for r in sorted(indexes)])


# ---------------------------------------------------------------------------- readers
def _metadata(storage: Storage, blob: fmt.Blob, what: str) -> memoryview:
    """A table's or index's raw bytes, read and checked against its hash (I3)."""
    check_cap(blob, what)
    return verified(storage, blob, what, lambda n=blob.raw_length: memoryview(bytearray(n)))


def _read(storage: Storage, blobs: dict[int, fmt.Blob], attempts: dict[int, str], pool) -> dict[int, Index]:
    """Indexes fetched, hash-checked and decoded in parallel (I/O, xxhash and zstd
    release the GIL), then parsed one by one in rank order: parsing holds the GIL, and
    threads contending for it were slower than one (docs/performance.md)."""
    ranks = sorted(blobs)
    what = {r: f"{storage.describe(blobs[r].file)}: index of rank {r}" for r in ranks}
    raw = run_all(pool, [lambda r=r: _metadata(storage, blobs[r], what[r]) for r in ranks])
    out = {}
    for rank, data in zip(ranks, raw):
        index = Index.from_bytes(data, what[rank])
        if (index.attempt, index.rank, index.state.rank) != (attempts[rank], rank, rank):
            raise FormatError(f"{what[rank]}: holds the index of rank {index.rank} (state of rank "
                              f"{index.state.rank}) for attempt {index.attempt}")
        out[rank] = index
    return out


def read_indexes(storage: Storage, root: fmt.Manifest, ranks, pool) -> dict[int, Index]:
    """The indexes of ``ranks``, each checked against what the root claims of it: its
    references are among the root's, its global tensors are the root's with the same
    dtype and shape, and the root names it a holder of each."""
    ranks = sorted(set(ranks))
    out = _read(storage, {r: root.indexes[r] for r in ranks}, dict.fromkeys(ranks, root.attempt), pool)
    for rank, index in out.items():
        what = f"{storage.describe(root.indexes[rank].file)}: index of rank {rank}"
        # gc knows a checkpoint's references from its root only: an index that reads
        # more than the root declares is refused, whatever its own summary says
        if not root.reads.covers(Reads.of_blobs([b for _, b in index.blobs()])):
            raise FormatError(f"{what}: refers to files the manifest does not declare")
        for key, entry in index.shards.items():
            g = root.globals.get(key)
            if g is None or (g.dtype, g.shape) != (entry.dtype, entry.shape) or not in_ranges(rank, g.ranks):
                raise FormatError(f"{what}: global tensor {key!r} ({entry.dtype}{list(entry.shape)}) is not "
                                  "the manifest's, or the manifest does not name this rank a holder")
            fmt.validate_chunks(entry, f"{what}: global tensor {key!r}")
        for r in index.replicas:
            if r.key not in root.globals:
                raise FormatError(f"{what}: a replica of {r.key!r}, which the manifest does not hold")
    return out


def expand(storage: Storage, root: fmt.Manifest, pool=None) -> fmt.Manifest:
    """``root`` with every rank's index read into it: a complete manifest, validated
    as a version 3 one is (coverage of every tensor, replicas, extents, references)."""
    if not root.indexed or root.complete:
        return root
    from ..runtime import runtime

    pool = pool or runtime().readers
    indexes = read_indexes(storage, root, range(root.world_size), pool)
    ordered = [indexes[r] for r in range(root.world_size)]
    states = tuple(i.state for i in ordered)
    fmt.validate_ranks(states, root.world_size)
    merged = merge_shards(ordered)
    tensors = {k: merged.get(k, fmt.TensorEntry(g.dtype, g.shape, ())) for k, g in root.globals.items()}
    for key, entry in tensors.items():
        if key not in merged:
            fmt.validate_coverage(entry, f"global tensor {key!r}")
    m = dataclasses.replace(root, ranks=states, tensors=tensors, tables=_tables(ordered))
    fmt.validate_references(m)
    fmt.validate_extents(m.blobs())
    return m


def for_load(storage: Storage, root: fmt.Manifest, rank: int, whole_globals: bool, pool) -> fmt.Manifest:
    """What a load of saved rank ``rank`` needs of ``root``: that rank's index, and the
    global tensors' chunks, all of them (``whole_globals``: a load without a template
    consolidates them) or as a template asks for them (:class:`LazyGlobals`)."""
    if not root.indexed or root.complete:
        return root
    if whole_globals and root.globals:
        return expand(storage, root, pool)
    indexes = read_indexes(storage, root, [rank], pool)
    state = indexes[rank].state
    for key, entry in state.tensors.items():
        fmt.validate_coverage(entry, f"rank {rank} tensor {key!r}")
    fmt.validate_extents((rank, key, b) for key, b in indexes[rank].blobs())
    return with_index(storage, root, indexes[rank], pool)


class LazyGlobals(Mapping):
    """A version 4 root's global tensors, whose chunks come from the indexes read so far.

    Keys, dtypes and shapes are the root's. :meth:`ensure` reads, in one parallel
    batch, the unread indexes of the holders of every tensor whose chunks read so far do
    not cover a region a load needs (a rank loading what it saved finds them in its
    own index and reads no other). ``transform`` maps each chunk's blob (references:
    how a reader addresses another step's file)."""

    def __init__(self, storage: Storage, root: fmt.Manifest, pool, indexes: dict[int, Index], transform=None):
        self._storage, self._root, self._pool = storage, root, pool
        self._indexes = indexes
        self._transform = transform
        self._chunks: dict[str, list[fmt.Chunk]] = {}
        for index in indexes.values():
            self._add(index)

    def _add(self, index: Index) -> None:
        for key, entry in index.shards.items():
            chunks = entry.chunks if self._transform is None else [
                fmt.Chunk(c.offsets, c.sizes, self._transform(c.blob)) for c in entry.chunks]
            self._chunks.setdefault(key, []).extend(chunks)

    def mapped(self, transform) -> "LazyGlobals":
        return LazyGlobals(self._storage, self._root, self._pool, dict(self._indexes), transform)

    def __getitem__(self, key: str) -> fmt.TensorEntry:
        g = self._root.globals[key]
        return fmt.TensorEntry(g.dtype, g.shape, tuple(self._chunks.get(key, ())))

    def __iter__(self):
        return iter(self._root.globals)

    def __len__(self) -> int:
        return len(self._root.globals)

    def __contains__(self, key) -> bool:
        return key in self._root.globals

    def ensure(self, regions) -> None:
        """Read what covers ``regions``, (key, offsets, sizes) each."""
        short = {key for key, offsets, sizes in regions if covered(self[key].chunks, offsets, sizes) < math.prod(sizes)}
        todo = sorted({r for key in short for r in ranges_ranks(self._root.globals[key].ranks)} - self._indexes.keys())
        if not todo:
            return
        fresh = read_indexes(self._storage, self._root, todo, self._pool)
        # no two records of what was read share stored bytes: each allocates at most what its file holds
        fmt.validate_extents((r, key, b) for r, i in {**self._indexes, **fresh}.items() for key, b in i.blobs())
        for rank in todo:
            self._indexes[rank] = fresh[rank]
            self._add(fresh[rank])


def covered(chunks, offsets, sizes) -> int:
    """How many elements of the region the chunks cover (counting overlaps twice)."""
    total = 0
    for c in chunks:
        n = 1
        for o, s, co, cs in zip(offsets, sizes, c.offsets, c.sizes):
            n *= max(0, min(o + s, co + cs) - max(o, co))
            if not n:
                break
        total += n
    return total


