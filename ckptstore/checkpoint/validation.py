"""What the committer checks before it publishes a manifest, beyond the votes' own
validation: every data file the manifest names is there at full length (I1), the base
of an incremental save is still present (I8), and the global tensors merged from every
rank's shards cover each tensor exactly once with replicas that match (I5).

Format version 4's committer uses :func:`check_sizes` for the index files and
:func:`merge_shards` only when a fingerprint does not add up (indexes.py); a rank uses
:func:`check_sizes` for the files its own references read before it votes.
"""

from __future__ import annotations

from .. import format as fmt
from .. import names
from .._threads import run_all
from ..errors import BaseRetiredError, CommitError, FormatError, NotRegularObjectError, ObjectNotFoundError
from ..storage import Storage
from .references import ReferencingStorage, read_key


def check_files(storage: Storage, ranks, tensors, listed: dict[str, int] | None = None) -> None:
    """Every data file the manifest will name is there and long enough: a file lost
    while the committer waited (deleted by hand, or by a gc run with a grace shorter
    than the wait) must not be published (I1). A reference's file (incremental saves)
    is looked up in its step's location; that it stays until this manifest lands is
    check_base's part (gc releases what a deleted base read for a grace)."""
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
    if storage.sees_all_data:
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


BASE_RETIRED = "references come from was deleted while it ran"  # (the abort reason the other ranks read)


def check_base(storage: Storage, base: tuple[int, int]) -> None:
    """The manifest an incremental save's references came from is still there. gc
    releases the files of a manifest it deletes and deletes them only after its grace
    (gc.py), so a base present now keeps the files this commit references for longer
    than the commit takes; a base deleted already may have taken them with it."""
    step, generation = base
    here = storage.sibling(names.step_dir_name(step))
    if not here.exists(names.manifest_name(generation)):
        raise BaseRetiredError(f"{here.describe(names.manifest_name(generation))}: the checkpoint this save's "
                               f"{BASE_RETIRED} (a gc run by another process?); nothing was committed, and "
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
