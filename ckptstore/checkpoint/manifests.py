"""Reading manifests: which generations a location holds, one manifest parsed and
validated, the visible one (the highest generation).

Everything that reads a checkpoint (load, verify, ``ls``, ``status``, gc, resume, the
commit's followers) starts here; nothing here writes. A stored document is untrusted
input: it is read only up to its size cap, and any defect is a FormatError naming the
file.
"""

from __future__ import annotations

from .. import format as fmt
from .. import names
from ..errors import (
    CheckpointNotFoundError,
    FormatError,
    NotACheckpointError,
    NotCommittedError,
    ObjectNotFoundError,
    ObjectTooLargeError,
)
from ..storage import Storage
from . import nearby


def read_capped(storage: Storage, key: str, cap: int, what: str) -> bytes:
    """A small stored document, refused unread when it is larger than ``cap`` (one
    request on an object store)."""
    try:
        return storage.read(key, limit=cap)
    except ObjectTooLargeError as e:
        raise FormatError(f"{what} is larger than the cap of {cap} bytes: {e}") from e


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


def latest_manifest(storage: Storage) -> fmt.Manifest:
    """The visible (highest-generation) manifest of a checkpoint location."""
    for _ in range(5):  # a newer commit may retire what we listed; look again
        gens = generations(storage)
        if not gens:
            break
        try:
            return read_manifest(storage, gens[-1])
        except ObjectNotFoundError:
            continue
    entries = storage.list("")
    where = storage.describe()
    if not entries:
        if storage.is_dir():
            raise NotACheckpointError(f"{where}: is an empty directory, not a ckptstore checkpoint")
        raise CheckpointNotFoundError(f"{where}: no checkpoint here (no such file or directory)")
    if f"{fmt.ATTEMPTS_DIR}/" in entries:
        raise NotCommittedError(f"{where}: holds save attempts but no committed manifest")
    # A store root, or a directory of checkpoints: say what to pass instead (nearby.py)
    found = nearby.search(storage)
    store = found.root_store()
    if store is not None:
        raise NotACheckpointError(nearby.store_root_message(where, store))
    below = f"; {nearby.below_message(where, found)}" if found.below() else ""
    raise NotACheckpointError(f"{where}: exists but is not a ckptstore checkpoint (no manifest){below}")
