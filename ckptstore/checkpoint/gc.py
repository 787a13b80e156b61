"""Garbage collection: retention for committed checkpoints, and cleanup of superseded
generations and of the debris of failed or abandoned attempts.

Safe beside running saves (I7): an attempt no manifest references is deleted only
when nothing under it changed for the grace period; deletions are explicit keys
chosen when the plan was made, and each is checked again just before it runs: a
location that gained a generation since the plan is not deleted, and an attempt that
a manifest now present references is not deleted, so a save that commits while gc
runs keeps its checkpoint. A manifest is always deleted before the files it names, so
a gc killed at any moment leaves every listed checkpoint whole, and running it again
finishes the job. Names read from storage pass the grammar of ``names`` before gc
acts on them; entries outside it (symlinks, special files, foreign names) are
reported, never deleted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .. import names
from ..errors import CkptStoreError, ObjectNotFoundError
from ..storage import Storage
from .catalog import Location, read_pin, read_skip_mark, scan_store
from .commit import generations, read_manifest
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


@dataclass
class GcPlan:
    url: str
    kept: dict[str, list[str]] = field(default_factory=dict)
    deletions: list[Deletion] = field(default_factory=list)
    stale_upload_age: float | None = None  # abort multipart uploads idle longer than this
    aborted_uploads: list[str] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)  # entries gc never touches (symlinks, foreign names)

    @property
    def bytes(self) -> int:
        return sum(d.bytes for d in self.deletions if d.skipped is None)

    def to_json(self) -> dict:
        return {
            "url": self.url,
            "kept": [{"name": k, "reasons": v} for k, v in self.kept.items()],
            "deleted": [{"kind": d.kind, "location": d.location, "reason": d.reason, "bytes": d.bytes,
                         "objects": len(d.keys)} for d in self.deletions if d.skipped is None],
            "skipped": [{"kind": d.kind, "location": d.location, "reason": d.skipped}
                        for d in self.deletions if d.skipped is not None],
            "bytes": self.bytes,
            "stale_uploads": self.aborted_uploads,
            "foreign": self.foreign,
        }


def _attempt_keys(loc: Location, attempt: str) -> tuple[list[str], int]:
    infos = loc.attempt_files.get(attempt, [])  # from the location's one walk: no second listing
    return [i.key for i in infos], sum(i.size for i in infos)


def _label(loc: Location) -> str:
    return loc.name or "."


def plan(storage: Storage, policy: Retention = Retention(), grace: float = DEFAULT_GRACE,
         now: float | None = None, protect=frozenset()) -> GcPlan:
    """What gc would delete; ``protect``: steps kept whatever the policy says (a local
    tier's steps waiting for their promotion)."""
    now = time.time() if now is None else now
    locations = scan_store(storage)
    result = GcPlan(storage.describe(), stale_upload_age=grace)
    committed = [loc for loc in locations if loc.committed]
    cands = [Candidate(_label(loc), loc.step, loc.committed_at(), dict(loc.manifest.metrics), loc.pinned,
                       read_skip_mark(loc) is not None)
             for loc in committed]
    result.kept = select_kept(cands, policy, now)
    for loc in committed:
        if loc.step in protect:  # a mapping says why; a set: a local tier's promotion
            why = protect[loc.step] if isinstance(protect, dict) else "promotion in flight"
            result.kept.setdefault(_label(loc), []).append(why)
    # Incremental saves: a kept checkpoint's references keep the attempts they point at,
    # in whatever location (mark phase). A manifest that cannot be read may reference
    # anything: then no committed checkpoint's data is deleted, only manifests.
    live, unknown = _with_unreadable(
        references_of([loc.manifest for loc in committed if _label(loc) in result.kept]),
        [(loc.storage, loc.generations[-1]) for loc in locations if loc.manifest_error is not None])

    for loc in locations:
        label = _label(loc)
        seen = tuple(loc.generations)
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
            size, doomed, why = 0, [], "not kept by any policy"
            for attempt in sorted(referenced):
                if unknown or attempt in live.get(label, ()):
                    # a kept checkpoint reads these files: they stay (their location keeps
                    # no manifest; gc deletes them once nothing references them)
                    why += "; its data stays, referenced by a kept checkpoint" if not unknown else \
                        "; its data stays while a manifest of the store cannot be read"
                    continue
                files, n = _attempt_keys(loc, attempt)
                keys += files
                size += n
                doomed.append(attempt)
            result.deletions.append(Deletion("checkpoint", label, keys, size, why, seen, tuple(doomed)))
        elif loc.committed:
            for g in loc.generations[:-1]:
                keys = [names.manifest_name(g)]
                size = 0
                try:
                    old = read_manifest(loc.storage, g).attempt
                except (CkptStoreError, ValueError):
                    old = None
                doomed: tuple[str, ...] = ()
                if old and old not in referenced and old in loc.attempts and old not in live.get(label, ()):
                    files, size = _attempt_keys(loc, old)
                    keys += files
                    loc.attempts.pop(old)
                    doomed = (old,)
                result.deletions.append(Deletion("generation", label, keys, size, f"generation {g} superseded",
                                                 seen, doomed))
        for attempt, info in sorted(loc.attempts.items()):
            if attempt in referenced or attempt in live.get(label, ()):
                continue
            if info.age(now) < grace:
                continue  # may belong to a save still in flight
            files, size = _attempt_keys(loc, attempt)
            why = "aborted" if info.aborted else "never committed"
            result.deletions.append(Deletion("attempt", label, files, size,
                                             f"attempt {attempt} {why}, idle {info.age(now):.0f}s",
                                             seen, (attempt,)))
        for key, mtime in loc.temp_files:
            if now - mtime >= grace:
                result.deletions.append(Deletion("temp", label, [key], 0, "temporary file of an interrupted write",
                                                 seen))
    return result


class _Recheck:
    """What a location holds now, looked up again just before each deletion: its
    generations (one listing), and the attempts its present manifests reference (read
    again only when the generations changed since the last look)."""

    def __init__(self, storage: Storage):
        self.storage = storage
        self._gens: tuple[int, ...] | None = None
        self._live: dict[int, set[str] | None] = {}  # generation -> attempts it reads (None: unreadable)

    def generations(self) -> tuple[int, ...]:
        gens = tuple(generations(self.storage))
        if gens != self._gens:
            self._gens = gens
            self._live = {g: self._live[g] for g in gens if g in self._live}
            for g in gens:
                if g not in self._live:
                    try:
                        self._live[g] = attempts_named(read_manifest(self.storage, g))
                    except ObjectNotFoundError:
                        self._live[g] = set()  # retired while we looked: references nothing
                    except CkptStoreError:
                        self._live[g] = None
        return gens

    def why_not(self, d: Deletion) -> str | None:
        """Why ``d`` must not run now, or None."""
        gens = self.generations()
        doomed = {names.parse_manifest_name(k) for k in d.keys} - {None}
        if d.kind == "checkpoint" and gens != d.seen_generations:
            return f"generations changed since the plan ({list(d.seen_generations)} -> {list(gens)})"
        for g, attempt in self._live.items():
            if g in doomed:
                continue
            if attempt is None and d.attempts:
                return f"generation {g} cannot be read: it may reference these files"
            taken = sorted(attempt & set(d.attempts)) if attempt is not None else []
            if taken:
                return f"generation {g}, committed since the plan, references attempt {taken[0]}"
        return None


def attempts_named(m) -> set[str]:
    """The attempts of this location whose files manifest ``m`` reads: its own, and the
    earlier ones its blobs refer to (drop-in saves, ``Blob.earlier``)."""
    return {m.attempt} | m.earlier_attempts()


def references_of(manifests) -> dict[str, set[str]]:
    """{location name: attempts} that the blobs of ``manifests`` reference in other
    locations (incremental saves: Blob.step)."""
    live: dict[str, set[str]] = {}
    for m in manifests:
        for _, _, b in m.blobs():
            if b.step is not None:
                live.setdefault(names.step_dir_name(b.step), set()).add(names.parse_data_file(b.file)[0])
    return live


def _references_of_unreadable(storage: Storage, generation: int) -> dict[str, set[str]] | None:
    """What a manifest that does not pass validation may reference, read leniently:
    every record with a ``step`` and a data ``file``; None when that cannot be told
    (not JSON, or a reference that names no valid step or data file)."""
    import json

    from .. import format as fmt
    from .commit import read_capped

    refs: dict[str, set[str]] = {}

    def visit(o) -> None:
        if isinstance(o, dict):
            if "step" in o and "file" in o:
                step, parsed = o["step"], names.parse_data_file(o["file"]) if isinstance(o["file"], str) else None
                if type(step) is not int or not 0 <= step <= names.MAX_STEP or parsed is None:
                    raise ValueError("a reference that cannot be followed")
                refs.setdefault(names.step_dir_name(step), set()).add(parsed[0])
            for v in o.values():
                visit(v)
        elif isinstance(o, list):
            for v in o:
                visit(v)

    try:
        visit(json.loads(read_capped(storage, names.manifest_name(generation), fmt.max_manifest_bytes(), "manifest")))
    except (ValueError, RecursionError, CkptStoreError):
        return None
    return refs


def _with_unreadable(live: dict[str, set[str]], unreadable) -> tuple[dict[str, set[str]], bool]:
    """``live`` plus the references of the manifests ``unreadable`` ((storage,
    generation) that do not validate), read leniently; and whether one of them cannot
    be told at all."""
    unknown = False
    for storage, generation in unreadable:
        refs = _references_of_unreadable(storage, generation)
        unknown = unknown or refs is None
        for where, attempts in (refs or {}).items():
            live.setdefault(where, set()).update(attempts)
    return live, unknown


def _live_now(storage: Storage) -> tuple[dict[str, set[str]], bool]:
    """The references of every manifest present now (every generation), and whether
    one of them cannot be told; looked up once per execute, before its deletions."""
    manifests, unreadable = [], []
    for loc in scan_store(storage):
        for g in loc.generations:
            try:
                manifests.append(read_manifest(loc.storage, g))
            except ObjectNotFoundError:
                continue
            except CkptStoreError:
                unreadable.append((loc.storage, g))
    return _with_unreadable(references_of(manifests), unreadable)


def execute(storage: Storage, gc_plan: GcPlan, on_deleted=None) -> None:
    """Carry out a plan, deletion by deletion, each in its key order (manifests first).

    Each deletion is checked again against what its location holds now (see the module
    docstring); one that no longer holds is skipped and says why (``Deletion.skipped``).
    Keys are deleted through the store's root, so directories a deletion empties go
    too (the location's own directory included).
    """
    rechecks: dict[str, _Recheck] = {}
    live = None  # references of the manifests present now: read once, before the first data deletion
    for d in gc_plan.deletions:
        prefix = "" if d.location == "." else f"{d.location}/"
        check = rechecks.get(d.location)
        if check is None:
            check = rechecks[d.location] = _Recheck(storage.child(d.location) if prefix else storage)
        d.skipped = check.why_not(d)
        if d.skipped is None and d.attempts:
            if live is None:
                live = _live_now(storage)
            refs, unknown = live
            taken = sorted(set(d.attempts) & refs.get(d.location, set()))
            if unknown:
                d.skipped = "a manifest present cannot be read: it may reference these files"
            elif taken:
                d.skipped = f"attempt {taken[0]} is referenced by a checkpoint present now"
        if d.skipped is None:
            for key in d.keys:
                storage.delete(prefix + key)
        if on_deleted is not None:
            on_deleted(d)
    if gc_plan.stale_upload_age is not None:
        gc_plan.aborted_uploads = storage.abort_stale_uploads(gc_plan.stale_upload_age)


def collect(storage: Storage, policy: Retention = Retention(), grace: float = DEFAULT_GRACE,
            dry_run: bool = False, protect=frozenset()) -> GcPlan:
    p = plan(storage, policy, grace, protect=protect)
    if dry_run:
        p.aborted_uploads = storage.abort_stale_uploads(grace, dry_run=True)
    else:
        execute(storage, p)
    return p


__all__ = ["DEFAULT_GRACE", "Deletion", "GcPlan", "collect", "execute", "plan", "read_pin"]
