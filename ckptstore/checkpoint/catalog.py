"""What a store holds: its checkpoint locations, their generations and attempts.

A location is any prefix holding manifests or attempts: the store root itself (when a
drop-in ``save`` wrote it) or its immediate children (``step-N/`` from ``Store.save``,
or ``name/`` from ``save(obj, root / name)``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import format as fmt
from .. import hashing, names
from ..errors import CkptStoreError
from ..names import PIN_NAME
from ..storage import Storage
from .manifests import generations, read_capped, read_manifest
from .retention import UNBOUND


@dataclass
class Attempt:
    attempt: str
    files: int
    bytes: int
    newest_mtime: float  # the most recent write under the attempt (a release mark's included, gc's claim not)
    voted: list[int]
    aborted: bool
    released: bool = False  # a gc deleted a manifest that read it (names.RELEASED_LEAF)
    committing: float | None = None  # when its committer last marked it (claims.py), if it did

    def age(self, now: float) -> float:
        return max(0.0, now - self.newest_mtime)


@dataclass
class Location:
    """One checkpoint location and what sits in it."""

    name: str  # relative to the store root ("" for the root itself)
    storage: Storage
    generations: list[int]
    manifest: fmt.Manifest | None  # the visible one (highest generation), when readable
    manifest_error: str | None
    attempts: dict[str, Attempt] = field(default_factory=dict)
    temp_files: list[tuple[str, float]] = field(default_factory=list)  # (key, mtime)
    # Entries ckptstore never writes (a symlink, a FIFO, a name outside the grammar):
    # reported, never followed, read or deleted.
    foreign: list[str] = field(default_factory=list)
    # attempt -> every file ckptstore wrote in it, temporaries included (what deleting
    # the attempt deletes: the same files retire.attempt_files finds)
    attempt_files: dict[str, list] = field(default_factory=dict)
    pinned: bool = False
    skip_marked: bool = False  # a resume skipped this step (names.SKIPPED_NAME)

    @property
    def committed(self) -> bool:
        return self.manifest is not None

    @property
    def step(self) -> int | None:
        if self.manifest is not None and self.manifest.step is not None:
            return self.manifest.step
        return fmt.parse_step_dir_name(self.name)

    @property
    def ranked_step(self) -> int | None:
        """The step retention ranks this location by: its directory's (``step-N/``, whose
        manifest scan_location holds to it), else none, whatever a manifest says. A copy
        of ``step-N/`` under another name (``step-N.bak``), or a manifest that claims a
        huge step, must not outrank the step directories Store.load and resume read, or
        gc would keep it as the newest and delete them."""
        return names.parse_step_dir_name(self.name)

    def committed_at(self) -> float:
        return fmt.parse_time(self.manifest.committed_at) if self.manifest else 0.0


def scan_location(storage: Storage, name: str) -> Location:
    entries = storage.list("")
    gens = sorted(g for g in (names.parse_manifest_name(n) for n in entries) if g is not None)
    manifest, error = None, None
    if gens:
        try:
            manifest = read_manifest(storage, gens[-1])
        except CkptStoreError as e:  # every parse failure is a FormatError naming the file
            error = str(e)
        dir_step = names.parse_step_dir_name(name)
        if manifest is not None and None not in (dir_step, manifest.step) and manifest.step != dir_step:
            # retention orders by step: one that lies about it is unreadable, not misfiled
            manifest, error = None, f"{storage.describe()}: the manifest says step {manifest.step}, its directory {dir_step}"
    loc = Location(name, storage, gens, manifest, error, pinned=PIN_NAME in entries,
                   skip_marked=names.SKIPPED_NAME in entries)
    for info in storage.walk(""):
        parts = info.key.split("/")
        if info.kind != "file":
            loc.foreign.append(info.key)
            continue
        if len(parts) == 1:
            if names.is_temp_name(parts[0]):  # an interrupted manifest or pin write
                loc.temp_files.append((info.key, info.mtime))
            continue  # manifests, pin, and what else the location holds at its top
        if parts[0] != names.ATTEMPTS_DIR:
            continue  # not ours to judge: a nested location or the user's files
        ours = names.attempt_file_of(info.key)
        if ours is None:
            loc.foreign.append(info.key)
            continue
        loc.attempt_files.setdefault(parts[1], []).append(info)
        if ours[1] == "temp":
            # an interrupted vote or heartbeat write: gc's after the grace, even inside
            # an attempt a manifest references
            loc.temp_files.append((info.key, info.mtime))
    for attempt, infos in loc.attempt_files.items():
        a = summarize(attempt, infos)
        if a is not None:
            loc.attempts[attempt] = a
    return loc


def summarize(attempt: str, infos) -> Attempt | None:
    """What ``attempt``'s files (ObjectInfo of the files ckptstore wrote in it, as
    retire.attempt_files lists them) say of it; None when it holds only temporaries."""
    a = None
    for info in infos:
        leaf = info.key.rsplit("/", 1)[-1]
        kind = names.attempt_leaf_kind(leaf)
        if kind == "temp":
            continue
        if a is None:
            a = Attempt(attempt, 0, 0, 0.0, [], False)
        a.files += 1
        a.bytes += info.size
        if kind == "claim":  # gc's own word (claims.py): its writing makes nothing young
            continue
        a.newest_mtime = max(a.newest_mtime, info.mtime)
        if kind == "vote":
            a.voted.append(names.parse_vote_leaf(leaf))
        elif kind == "abort":
            a.aborted = True
        elif kind == "release":
            a.released = True
        elif kind == "committing":
            a.committing = info.mtime
    if a is not None:
        a.voted.sort()
    return a


def is_location(storage: Storage) -> bool:
    entries = storage.list("")
    return f"{names.ATTEMPTS_DIR}/" in entries or any(names.parse_manifest_name(n) is not None for n in entries)


def scan_store(storage: Storage) -> list[Location]:
    """Every checkpoint location at or directly below the root, committed ones first by
    step (then commit time), uncommitted ones last."""
    entries = storage.list("")  # a missing root: [] (the storage contract)
    found = []
    if is_location(storage):
        found.append(scan_location(storage, ""))
    for name in entries:
        if name.endswith("/") and name.rstrip("/") != names.ATTEMPTS_DIR:
            child = storage.child(name.rstrip("/"))
            if is_location(child):
                found.append(scan_location(child, name.rstrip("/")))
    return sorted(found, key=_order)


def _order(loc: Location):
    step = loc.ranked_step
    return (not loc.committed, step is None, step if step is not None else 0, loc.committed_at(), loc.name)


def read_pin(loc: Location) -> dict | None:
    return _read_marker(loc, PIN_NAME, "pin") if loc.pinned else None


def read_skip_mark(loc: Location) -> dict | None:
    """Why a resume skipped the visible manifest of ``loc``, or None: no mark, or one
    not bound to that manifest (:func:`check_skip_mark`)."""
    return check_skip_mark(loc)[0]


def check_skip_mark(loc: Location) -> tuple[dict | None, str | None]:
    """``(mark, None)`` when ``loc`` holds a skip mark that applies to its visible
    manifest; ``(None, why)`` when it holds one that does not, which every reader
    ignores; ``(None, None)`` without one.

    A mark is a verdict on one manifest. One written since issue 34 names the step, the
    generation, the attempt and the xxh3-128 of the manifest's bytes that the resume
    judged, and applies only while all four match the visible manifest (it is *bound*:
    :func:`skip_mark_is_bound`). One of the previous release names only the step and the
    generation (``{step, generation, reason, at}``); it applies while both match and its
    ``at`` is at or after the manifest's ``committed_at``: a mark left of an earlier
    checkpoint of the step (a gc killed between its manifest and its mark, then the step
    saved again as generation 1) predates the manifest that replaced it. Such a mark is
    not bound to the manifest's bytes, so retention may only ever keep *more* for it
    (retention.UNBOUND), never delete the step it names."""
    if not loc.skip_marked or loc.manifest is None:
        return None, None
    mark = _read_marker(loc, names.SKIPPED_NAME, "skip mark")
    m = loc.manifest
    legacy = "attempt" not in mark and SKIP_MARK_DIGEST not in mark
    for key, want in (("step", loc.step), ("generation", m.generation)) + (() if legacy else (("attempt", m.attempt),)):
        if key not in mark:
            return None, f"ignored: it has no {key} field"
        if mark[key] != want or isinstance(mark[key], bool):
            return None, f"ignored: it names {key} {str(mark[key])[:64]!r}, the manifest {want!r}"
    if legacy:
        return _check_legacy_mark(mark, loc)
    try:
        digest = manifest_digest(loc.storage, m.generation)
    except CkptStoreError as e:
        return None, f"ignored: the manifest could not be read to check it: {str(e)[:256]}"
    if mark.get(SKIP_MARK_DIGEST) != digest:
        return None, "ignored: it was written for other manifest bytes (xxh3-128 differs)"
    return mark, None


def _check_legacy_mark(mark: dict, loc: Location) -> tuple[dict | None, str | None]:
    """A previous release's mark (step and generation matched): it applies when it was
    written at or after the visible manifest was committed."""
    at = mark.get("at")
    try:
        written = fmt.parse_time(at) if isinstance(at, str) else None
    except (ValueError, OverflowError, OSError):
        written = None
    if written is None:
        return None, f"ignored: an older ckptstore's mark whose 'at' {str(at)[:64]!r} is not a time"
    if written < loc.committed_at():
        return None, (f"ignored: an older ckptstore's mark written at {at[:64]!r}, before the manifest "
                      f"was committed ({loc.manifest.committed_at}): it judged an earlier checkpoint")
    return mark, None


def skip_mark_is_bound(mark: dict) -> bool:
    """Whether ``mark`` (as :func:`check_skip_mark` returned it) was checked against the
    manifest's bytes, not only its step, generation and time (a previous release's)."""
    return SKIP_MARK_DIGEST in mark


def skip_verdict(loc: Location):
    """What retention counts ``loc``'s skip mark as (retention.Candidate.skipped):
    False without one that applies, True for a bound one, retention.UNBOUND else."""
    mark = read_skip_mark(loc)
    if mark is None:
        return False
    return True if skip_mark_is_bound(mark) else UNBOUND


SKIP_MARK_DIGEST = "manifest_xxh3_128"  # the skip mark's field binding it to the manifest's bytes


def manifest_digest(storage: Storage, generation: int) -> str:
    """The xxh3-128 (hex) of a location's stored manifest of ``generation``, as read."""
    return hashing.digest(read_capped(storage, names.manifest_name(generation), fmt.max_manifest_bytes(),
                                      "manifest"))


def skip_mark(storage: Storage, step: int, reason: str, at: str) -> dict:
    """The skip mark for the visible manifest of the location ``storage`` of ``step``:
    bound to its generation, attempt and bytes (:func:`check_skip_mark`), all from one
    read of the manifest."""
    generation = generations(storage)[-1]
    data = read_capped(storage, names.manifest_name(generation), fmt.max_manifest_bytes(), "manifest")
    try:
        attempt = fmt.Manifest.from_bytes(data).attempt
    except CkptStoreError:  # unreadable: no reader acts on a mark of it (check_skip_mark)
        attempt = None
    return {"step": step, "generation": generation, "attempt": attempt, SKIP_MARK_DIGEST: hashing.digest(data),
            "reason": reason[:4096], "at": at}


def _read_marker(loc: Location, name: str, what: str) -> dict:
    """A small JSON marker (untrusted): {} when unreadable."""
    try:
        data = fmt.loads_json(read_capped(loc.storage, name, fmt.MAX_MARKER_BYTES, what), what)
    except CkptStoreError:
        return {}
    return data if isinstance(data, dict) else {}
