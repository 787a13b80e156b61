"""Check a committed checkpoint without loading it: every file present at the right
size and, in full mode, every blob read, decoded and its xxh3-128 matched, and every
rank's skeleton rebuilt over meta tensors (no tensor bytes), as a load would rebuild it."""

from __future__ import annotations

import os
import threading

import torch
from dataclasses import dataclass

from .. import format as fmt
from ..errors import CkptStoreError, NotACheckpointError, UnsafeLoadError
from ..storage import Storage, is_url, open_storage, shown
from .reader import BlobRead, check_blobs, extent_problem, file_sizes
from .manifests import latest_manifest
from .restore import _real_tensors, restore


@dataclass(frozen=True)
class Problem:
    checkpoint: str
    rank: int | None
    key: str | None  # tensor key; None for the skeleton or a whole file
    file: str | None
    offset: int | None
    message: str

    def __str__(self) -> str:
        if self.key is not None:
            what = f"global tensor {self.key!r}" if self.rank is None else f"rank {self.rank} tensor {self.key!r}"
        elif self.rank is not None:
            what = f"rank {self.rank} skeleton"
        else:
            what = "checkpoint"
        at = f" in {self.file} at byte {self.offset}" if self.file else ""
        return f"{self.checkpoint}: {what}{at}: {self.message}"


def verify_manifest(storage: Storage, manifest: fmt.Manifest, quick: bool = False, pool=None,
                    on_blob=None, seen: dict | None = None) -> list[Problem]:
    """Every problem found; an empty list means the checkpoint is sound. A reference's
    blob is read where it lies (checkpoint/references.py); its file reads
    ``../step-N/...`` in a problem. ``seen``, shared across the checkpoints of one
    store, makes each stored blob read once however many checkpoints reference it:
    a later one gets the first one's verdict."""
    from ..runtime import runtime
    from .indexes import expand
    from .references import resolve

    where = storage.describe()
    pool = pool or runtime().readers
    try:  # a version 4 root: every index, each checked against its hash and the root
        manifest = expand(storage, manifest, pool)
    except CkptStoreError as e:
        return [Problem(where, None, None, None, None, str(e))]
    storage, manifest = resolve(storage, manifest)
    problems: list[Problem] = []
    if manifest.byteorder != "little":  # load refuses it: so must verify
        problems.append(Problem(where, None, None, None, None, f"byteorder {manifest.byteorder!r}: "
                                "this reader loads little-endian checkpoints only"))
    sizes = file_sizes(storage, manifest.files(), pool)
    reads: list[BlobRead] = []
    checked: list[tuple[int | None, str | None, fmt.Blob]] = []
    known: list[tuple[int | None, str | None, fmt.Blob, str | None]] = []
    for rank, key, blob in manifest.blobs():
        problem = extent_problem(blob, sizes)
        if problem is not None:
            problems.append(Problem(where, rank, key, blob.file, blob.offset, problem))
            if on_blob is not None:
                on_blob(blob)
            continue
        if not quick:
            ident = _identity(storage, blob)
            if seen is not None and ident in seen:
                known.append((rank, key, blob, seen[ident]))
                if on_blob is not None:
                    on_blob(blob)
                continue
            reads.append(BlobRead(blob, f"tensor {key!r}" if key else "skeleton"))
            checked.append((rank, key, blob))
    # Read as a load does (neighbouring blobs coalesced into one read, each blob's hash
    # checked on its own), reporting every blob's problem instead of the first.
    errors = check_blobs(storage, reads, pool, scratch=_buffer, on_blob=on_blob, sizes=sizes)
    for (rank, key, blob), err in zip(checked, errors):
        if seen is not None:
            seen[_identity(storage, blob)] = None if err is None else str(err)
        if err is not None:
            problems.append(Problem(where, rank, key, blob.file, blob.offset, str(err)))
    for rank, key, blob, err in known:
        if err is not None:
            problems.append(Problem(where, rank, key, blob.file, blob.offset, err))
    if not quick:
        damaged = {p.rank for p in problems if p.key is None}  # skeletons already reported
        verdicts: dict[tuple, str | None] = {}  # ranks alike (data parallel) are rebuilt once
        for state in manifest.ranks:
            if state.rank not in damaged:
                alike = (state.skeleton.xxh3_128, tuple((k, e.dtype, tuple(e.shape)) for k, e in state.tensors.items()))
                if alike not in verdicts:
                    verdicts[alike] = _rebuild_problem(storage, manifest, state, pool)
                problem = verdicts[alike]
                if problem is not None:
                    problems.append(Problem(where, state.rank, None, state.skeleton.file, state.skeleton.offset,
                                            problem))
    return problems


def _rebuild_problem(storage: Storage, manifest: fmt.Manifest, state: fmt.RankState, pool) -> str | None:
    """What a load of this rank would fail on in its skeleton (a rebuild past a tensor's
    stored bytes, a storage the manifest lacks, a malformed pickle), found by rebuilding
    it over meta storages; None when it rebuilds, or when it cannot be checked without
    its tensors' bytes (no meta kernel: quantized, nested) or without running code the
    weights-only unpickler refuses (its loader opts in to that)."""
    try:
        with _real_tensors(torch._guards.detect_fake_mode(None) is not None):  # meta ones, not fakes
            restore(storage, manifest, state.rank, pool=pool, meta=True)
    except (NotImplementedError, UnsafeLoadError):
        return None
    except CkptStoreError as e:
        return str(e).removeprefix(f"{storage.describe()}: ")  # a Problem names the checkpoint itself
    except Exception as e:  # whatever a load would fail on, verify reports (and goes on)
        return f"the object skeleton does not rebuild: {type(e).__name__}: {e}"
    return None


def _identity(storage: Storage, blob: fmt.Blob) -> tuple:
    """A stored blob and everything a record says of it: two records agree on a verdict
    only when they describe the same bytes the same way."""
    return (storage.describe(blob.file), blob.offset, blob.length, blob.raw_length, repr(blob.codec),
            blob.xxh3_128)


_scratch = threading.local()


KEEP_SCRATCH = 64 << 20  # a reader thread keeps a scratch buffer up to this size between blobs


def _buffer(n: int) -> memoryview:
    """A per-thread scratch buffer (verify reads every blob but keeps none of them),
    reused while it is at most KEEP_SCRATCH; uninitialised (torch.empty): only what a
    decode writes is ever touched."""
    buf = getattr(_scratch, "buf", None)
    if buf is not None and len(buf) >= n:
        return buf[:n]
    fresh = memoryview(torch.empty(max(n, 1 << 20), dtype=torch.uint8).numpy())
    if len(fresh) <= KEEP_SCRATCH:
        _scratch.buf = fresh
    return fresh[:n]


def verify(location, quick: bool = False) -> list[Problem]:
    """Verify the visible checkpoint at a path or URL (a single-file container too);
    returns the problems found."""
    try:
        storage = location if isinstance(location, Storage) else _open(location)
    except CkptStoreError as e:
        return [Problem(shown(location), None, None, None, None, str(e))]  # (a URL without credentials)
    try:
        manifest = latest_manifest(storage)
    except CkptStoreError as e:
        return [Problem(storage.describe(), None, None, None, None, str(e))]
    return verify_manifest(storage, manifest, quick)


def _open(location) -> Storage:
    """The store at ``location``; a local regular file is read as a container (what a
    save over a plain file writes), as load reads it."""
    from .container import read_container_file

    if not is_url(location) and os.path.isfile(location):
        store = read_container_file(location)
        if store is None:
            raise NotACheckpointError(f"{os.fspath(location)}: a file that is not a ckptstore container "
                                      "(a torch.save file? verify checks ckptstore checkpoints)")
        return store
    return open_storage(location)
