"""Garbage collection: retention for committed checkpoints, and cleanup of superseded
generations and of the debris of failed or abandoned attempts. This module plans;
gc_run.py carries a plan out; gc_dirs.py says which empty directories of killed saves
the store removes.

Safe beside running saves (I7): an attempt no manifest references is deleted only
when nothing under it changed for the grace period; deletions are explicit keys
chosen when the plan was made, and each is checked again just before it runs: a
location that gained a generation since the plan is not deleted, and an attempt that
a manifest now present references is not deleted. Whatever the grace, a save that
commits while gc runs keeps its checkpoint: gc claims an attempt before it deletes
it and leaves one whose committer marked it (claims.py), and deletes data a manifest
named only once no commit is in flight in the store. A manifest is always deleted
before the files it names, so a gc killed at any moment leaves every listed
checkpoint whole, and running it again finishes the job. Names read from storage
pass the grammar of ``names`` before gc acts on them; entries outside it (symlinks,
special files, foreign names) are reported, never deleted.

Incremental saves reference the files of the checkpoint they started from (their
base), which a gc run by another process may drop while the save is in flight. So
gc *releases* the files of a manifest it deletes instead of deleting them: before it
deletes the manifest it writes a release mark (``names.RELEASED_LEAF``) into each
attempt directory holding files that manifest reads (its own attempt's, and those its
references lead to). The mark makes the attempt young again, so the usual rule for
files no manifest names (idle for the grace) deletes them one grace later at the
earliest, and each attempt deletion checks the attempt's age again just before it
runs. A save checks that its base manifest is still there just before it commits
(validation.check_base): a base present then keeps its files for at least the grace, and
a base gone refuses the commit. The store's own writer, which protects the bases of
its saves itself (``Store``), and a run with no grace delete the files at once
(``immediate``), but not while a commit is in flight.

What a run leaves for later is in the plan: what it released (bytes, files, from
when a run deletes it) and what is pending (young debris, released attempts, commits
in flight), each with the time it becomes deletable, so that a run that frees nothing
says why and until when.
"""

from __future__ import annotations

import datetime as _dt
import time
from dataclasses import dataclass, field

from .. import names
from ..errors import CkptStoreError
from ..storage import Storage
from . import claims
from .catalog import Location, read_pin, scan_store, skip_verdict
from .manifests import read_manifest
from .gc_dirs import empty_dirs
from .gc_run import run_deletions
from .liveness import attempts_named, references_of, with_unreadable
from .retention import Candidate, Retention, select_kept

DEFAULT_GRACE = 6 * 3600.0


@dataclass
class Deletion:
    kind: str  # "checkpoint", "generation", "attempt" or "temp"
    location: str
    keys: list[str]  # in deletion order: manifests first
    bytes: int
    reason: str
    seen_generations: tuple[int, ...] = ()  # the location's generations when planned
    attempts: tuple[str, ...] = ()  # attempts whose files it deletes
    skipped: str | None = None  # why execute left it alone (the store changed since the plan)
    release: tuple[tuple[str, str], ...] = ()  # (location, attempt): marked released before the keys go
    released_bytes: int = 0  # data this deletion releases: a run after the grace deletes it
    released_files: int = 0


@dataclass
class Pending:
    """What gc leaves for a later run: files no manifest keeps that are not idle for the
    grace yet (a failed save's, a release's), or that a commit in flight may use."""

    kind: str  # "attempt" or "temp"
    location: str
    name: str  # the attempt id, or the temporary file's key
    why: str  # "has no manifest", "aborted", "released", "is being committed", ...
    files: int
    bytes: int
    deletable_at: float  # unix time from which a gc run with the same grace deletes it

    def to_json(self) -> dict:
        return {"kind": self.kind, "location": self.location, "name": self.name, "reason": self.why,
                "files": self.files, "bytes": self.bytes, "deletable_at": _iso(self.deletable_at)}


def _iso(t: float | None) -> str | None:
    return None if t is None else _dt.datetime.fromtimestamp(t, _dt.timezone.utc).isoformat(timespec="seconds")


@dataclass
class GcPlan:
    url: str
    kept: dict[str, list[str]] = field(default_factory=dict)
    deletions: list[Deletion] = field(default_factory=list)
    stale_upload_age: float | None = None  # abort multipart uploads idle longer than this
    grace: float = DEFAULT_GRACE  # an attempt idle less long stays (checked again at execution)
    clock_offset: float = 0.0  # plan(now=...) minus the time it ran: execute keeps that clock
    aborted_uploads: list[str] = field(default_factory=list)
    empty_dirs: list[str] = field(default_factory=list)  # left by saves killed before their first file
    foreign: list[str] = field(default_factory=list)  # entries gc never touches (symlinks, foreign names)
    held_back: str | None = None  # why no data of the store is deleted this run (a manifest unreadable)
    generations: dict[str, int] = field(default_factory=dict)  # location -> its highest generation when planned
    pending: list[Pending] = field(default_factory=list)  # debris and released data not deletable yet
    released_until: float | None = None  # unix time from which a later run deletes what this one releases

    @property
    def bytes(self) -> int:
        return sum(d.bytes for d in self.deletions if d.skipped is None)

    @property
    def released_bytes(self) -> int:
        return sum(d.released_bytes for d in self.deletions if d.skipped is None)

    @property
    def released_files(self) -> int:
        return sum(d.released_files for d in self.deletions if d.skipped is None)

    def to_json(self) -> dict:
        return {
            "url": self.url,
            "kept": [{"name": k, "reasons": v} for k, v in self.kept.items()],
            "deleted": [{"kind": d.kind, "location": d.location, "reason": d.reason, "bytes": d.bytes,
                         "objects": len(d.keys)} for d in self.deletions if d.skipped is None],
            "skipped": [{"kind": d.kind, "location": d.location, "reason": d.skipped}
                        for d in self.deletions if d.skipped is not None],
            "bytes": self.bytes,
            "released_bytes": self.released_bytes,
            "released_files": self.released_files,
            "released_deletable_at": _iso(self.released_until) if self.released_bytes else None,
            "pending": [p.to_json() for p in self.pending],
            "pending_bytes": sum(p.bytes for p in self.pending),
            "pending_files": sum(p.files for p in self.pending),
            "held_back": self.held_back,
            "stale_uploads": self.aborted_uploads,
            "empty_dirs": self.empty_dirs,
            "foreign": self.foreign,
        }


def _attempt_keys(loc: Location, attempt: str) -> tuple[list[str], int]:
    infos = loc.attempt_files.get(attempt, [])  # from the location's one walk: no second listing
    return [i.key for i in infos], sum(i.size for i in infos)


def _label(loc: Location) -> str:
    return loc.name or "."


def plan(storage: Storage, policy: Retention = Retention(), grace: float = DEFAULT_GRACE,
         now: float | None = None, protect=frozenset(), immediate: bool = False) -> GcPlan:
    """What gc would delete; ``protect``: steps kept whatever the policy says (a local
    tier's steps waiting for their promotion, the writer's next reference base);
    ``immediate``: the caller is the store's only writer, so a dropped checkpoint's
    files go with its manifest instead of being released (module docstring)."""
    started = time.time()
    now = started if now is None else now
    release = not immediate and grace > 0
    locations = scan_store(storage)
    result = GcPlan(storage.describe(), stale_upload_age=grace, grace=grace, clock_offset=now - started,
                    released_until=started + grace)
    committed = [loc for loc in locations if loc.committed]
    cands = [Candidate(_label(loc), loc.ranked_step, loc.committed_at(), dict(loc.manifest.metrics), loc.pinned,
                       skip_verdict(loc))
             for loc in committed]
    result.kept = select_kept(cands, policy, now)
    for loc in committed:
        if loc.step in protect:  # a mapping says why; a set: a local tier's promotion
            why = protect[loc.step] if isinstance(protect, dict) else "promotion in flight"
            result.kept.setdefault(_label(loc), []).append(why)
    # Incremental saves: a kept checkpoint's references keep the attempts they point at,
    # in whatever location (mark phase). A manifest that cannot be read may reference
    # anything: then no data is deleted, only manifests (execute holds to the same).
    live, unknown = with_unreadable(
        references_of([loc.manifest for loc in committed if _label(loc) in result.kept]),
        [(loc.storage, loc.generations[-1]) for loc in locations if loc.manifest_error is not None])
    if unknown:
        result.held_back = "a manifest of the store cannot be read: it may reference any data"

    # First the manifests that go, and the files that releases ...
    fresh: dict[str, set[str]] = {}  # location -> attempts released by this run
    where = {_label(loc): loc for loc in locations}
    for loc in locations:
        label = _label(loc)
        seen = tuple(loc.generations)
        if seen:  # (a commit mark naming one of these is no commit to come, whatever this run deletes)
            result.generations[label] = seen[-1]
        result.foreign += [f"{label}/{key}" for key in loc.foreign]
        if loc.manifest_error is not None:
            # A manifest we cannot read (corrupt, or a newer format) still claims its files:
            # keep the whole location and let a person look (verify reports it).
            result.kept[label] = [f"unreadable manifest: {loc.manifest_error}"]
            continue
        referenced = attempts_named(loc.manifest) if loc.manifest else set()
        if loc.committed and label not in result.kept:
            # The whole checkpoint goes: its manifests, then the attempts they name.
            keys = [names.manifest_name(g) for g in loc.generations]
            if loc.skip_marked:  # informational, and only about this checkpoint
                keys.append(names.SKIPPED_NAME)
            data = _data_of(loc, referenced, live.get(label, set()), unknown, release)
            result.deletions.append(Deletion(
                "checkpoint", label, keys + data.keys, data.bytes, "not kept by any policy" + data.why, seen,
                data.attempts, release=_releases(fresh, label, _every_generation(loc), where) if release else data.kept,
                released_bytes=data.released, released_files=data.released_files))
        elif loc.committed:
            for g in loc.generations[:-1]:
                try:
                    old = read_manifest(loc.storage, g)
                except (CkptStoreError, ValueError):
                    old = None
                mine = {old.attempt} - referenced if old is not None and old.attempt in loc.attempts else set()
                data = _data_of(loc, mine, live.get(label, set()), unknown, release)
                released = _releases(fresh, label, [old] if old is not None else [], where) if release else data.kept
                for attempt in mine:
                    loc.attempts.pop(attempt)  # deleted or released here: not debris below
                result.deletions.append(Deletion(
                    "generation", label, [names.manifest_name(g)] + data.keys, data.bytes,
                    f"generation {g} superseded" + data.why, seen, data.attempts, release=released,
                    released_bytes=data.released, released_files=data.released_files))
    # ... then the files no manifest names: debris, and what earlier runs released.
    for loc in locations:
        if loc.manifest_error is not None:
            continue
        label = _label(loc)
        seen = tuple(loc.generations)
        referenced = attempts_named(loc.manifest) if loc.manifest else set()
        for attempt, info in sorted(loc.attempts.items()):
            if attempt in referenced or attempt in live.get(label, ()) or attempt in fresh.get(label, ()) \
                    or unknown:
                continue
            files, size = _attempt_keys(loc, attempt)
            # (no manifest: never committed, or a dropped step's kept for a step that read them)
            why = "released" if info.released else "aborted" if info.aborted else "has no manifest"
            wait = info.newest_mtime + grace
            if not info.released and claims.committing(loc.storage, attempt, info.committing, loc.generations, now):
                why, wait = "is being committed", max(wait, info.committing + claims.COMMIT_LEASE)
            elif info.age(now) >= grace:
                result.deletions.append(Deletion("attempt", label, files, size,
                                                 f"attempt {attempt} {why}, idle {info.age(now):.0f}s",
                                                 seen, (attempt,)))
                continue
            # may belong to a save still in flight, or be a released one's: a later run's
            result.pending.append(Pending("attempt", label, attempt, why, len(files), size, wait))
        for key, mtime in loc.temp_files:
            if now - mtime >= grace:
                result.deletions.append(Deletion("temp", label, [key], 0, "temporary file of an interrupted write",
                                                 seen))
            else:
                result.pending.append(Pending("temp", label, key, "temporary file of a write", 1, 0,
                                              mtime + grace))
    return result


@dataclass
class _Data:
    """What deleting a manifest does to the attempts it names in its own location."""

    keys: list[str] = field(default_factory=list)  # deleted now
    bytes: int = 0
    attempts: tuple[str, ...] = ()
    released: int = 0  # bytes released: deleted by a later run
    released_files: int = 0
    kept: tuple[tuple[str, str], ...] = ()  # (location, attempt) whose files stay: marked released all the same
    why: str = ""


def _data_of(loc: Location, attempts, live: set[str], unknown: bool, release: bool) -> _Data:
    out = _Data()
    doomed = []
    for attempt in sorted(attempts):
        files, n = _attempt_keys(loc, attempt)
        if unknown or attempt in live:
            # a kept checkpoint reads these files: they stay (their location keeps no
            # manifest; gc deletes them once nothing references them). Their release mark
            # says they were committed: no commit of theirs is to come (claims.committing).
            out.why = "; its data stays while a manifest of the store cannot be read" if unknown else \
                "; its data stays, referenced by a kept checkpoint"
            out.kept += ((loc.name or ".", attempt),)
        elif release:
            out.released += n
            out.released_files += len(files)
        else:
            out.keys += files
            out.bytes += n
            doomed.append(attempt)
    if out.released:
        out.why += "; its data is released: a gc run after the grace deletes it"
    out.attempts = tuple(doomed)
    return out


def _every_generation(loc: Location) -> list:
    """The readable manifests of ``loc``, the visible one and any older ones left."""
    older = []
    for g in loc.generations[:-1]:
        try:
            older.append(read_manifest(loc.storage, g))
        except (CkptStoreError, ValueError):
            continue
    return older + [loc.manifest]


def _releases(fresh: dict[str, set[str]], label: str, manifests: list, where: dict) -> tuple[tuple[str, str], ...]:
    """The (location, attempt) whose files ``manifests`` (of location ``label``) read,
    their own and those their references lead to, that the store holds; each is added
    to ``fresh``."""
    reads: dict[str, set[str]] = {label: set()}
    for m in manifests:
        reads[label] |= attempts_named(m)
    for loc_name, attempts in references_of(manifests).items():
        reads.setdefault(loc_name, set()).update(attempts)
    out = []
    for loc_name, attempts in sorted(reads.items()):
        fresh.setdefault(loc_name, set()).update(attempts)
        held = where[loc_name].attempts if loc_name in where else {}
        out += [(loc_name, a) for a in sorted(attempts) if a in held]
    return tuple(out)


def execute(storage: Storage, gc_plan: GcPlan, on_deleted=None) -> None:
    """Carry out a plan, deletion by deletion, each checked again against the store as
    it is now (gc_run.py: manifests first, then the data of the run once no commit is
    in flight); then abort stale multipart uploads and remove killed saves' empty
    directories. ``on_deleted(deletion)`` after each deletion, skipped or not."""
    run_deletions(storage, gc_plan, on_deleted)
    gc_plan.released_until = time.time() + gc_plan.grace  # (after the last release mark: a run from then deletes)
    if gc_plan.stale_upload_age is not None:
        gc_plan.aborted_uploads = storage.abort_stale_uploads(gc_plan.stale_upload_age)
        gc_plan.empty_dirs = empty_dirs(storage, gc_plan.stale_upload_age)


def preview(storage: Storage, gc_plan: GcPlan) -> None:
    """A dry run's plan: what ``execute`` would also clear after the deletions (stale
    multipart uploads, the empty directories of killed saves), listed, not touched."""
    gc_plan.aborted_uploads = storage.abort_stale_uploads(gc_plan.grace, dry_run=True)
    gc_plan.empty_dirs = empty_dirs(storage, gc_plan.grace, dry_run=True)


def collect(storage: Storage, policy: Retention = Retention(), grace: float = DEFAULT_GRACE,
            dry_run: bool = False, protect=frozenset(), immediate: bool = False) -> GcPlan:
    p = plan(storage, policy, grace, protect=protect, immediate=immediate)
    if dry_run:
        preview(storage, p)
    else:
        execute(storage, p)
    return p


# (attempts_named and references_of live in liveness.py; named here too for the callers
# that import them from gc)
__all__ = ["DEFAULT_GRACE", "Deletion", "GcPlan", "Pending", "attempts_named", "collect",
           "empty_dirs", "execute", "plan", "preview", "read_pin", "references_of"]
