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

Incremental saves reference the files of the checkpoint they started from (their
base), which a gc run by another process may drop while the save is in flight. So
gc *releases* the files of a manifest it deletes instead of deleting them: before it
deletes the manifest it writes a release mark (``names.RELEASED_LEAF``) into each
attempt directory holding files that manifest reads (its own attempt's, and those its
references lead to). The mark makes the attempt young again, so the usual rule for
files no manifest names (idle for the grace) deletes them one grace later at the
earliest, and each attempt deletion checks the attempt's age again just before it
runs. A save checks that its base manifest is still there just before it commits
(commit.check_base): a base present then keeps its files for at least the grace, and
a base gone refuses the commit. The store's own writer, which protects the bases of
its saves itself (``Store``), and a run with no grace delete the files at once
(``immediate``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from .. import format as fmt
from .. import names
from ..errors import CkptStoreError, ObjectNotFoundError
from ..storage import Storage
from .catalog import Location, read_pin, read_skip_mark, scan_store
from .commit import attempt_files, generations, read_manifest
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

    @property
    def bytes(self) -> int:
        return sum(d.bytes for d in self.deletions if d.skipped is None)

    @property
    def released_bytes(self) -> int:
        return sum(d.released_bytes for d in self.deletions if d.skipped is None)

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
    result = GcPlan(storage.describe(), stale_upload_age=grace, grace=grace, clock_offset=now - started)
    committed = [loc for loc in locations if loc.committed]
    cands = [Candidate(_label(loc), loc.ranked_step, loc.committed_at(), dict(loc.manifest.metrics), loc.pinned,
                       read_skip_mark(loc) is not None)
             for loc in committed]
    result.kept = select_kept(cands, policy, now)
    for loc in committed:
        if loc.step in protect:  # a mapping says why; a set: a local tier's promotion
            why = protect[loc.step] if isinstance(protect, dict) else "promotion in flight"
            result.kept.setdefault(_label(loc), []).append(why)
    # Incremental saves: a kept checkpoint's references keep the attempts they point at,
    # in whatever location (mark phase). A manifest that cannot be read may reference
    # anything: then no data is deleted, only manifests (execute holds to the same).
    live, unknown = _with_unreadable(
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
                data.attempts, release=_releases(fresh, label, _every_generation(loc), where) if release else (),
                released_bytes=data.released))
        elif loc.committed:
            for g in loc.generations[:-1]:
                try:
                    old = read_manifest(loc.storage, g)
                except (CkptStoreError, ValueError):
                    old = None
                mine = {old.attempt} - referenced if old is not None and old.attempt in loc.attempts else set()
                data = _data_of(loc, mine, live.get(label, set()), unknown, release)
                released = _releases(fresh, label, [old] if old is not None else [], where) if release else ()
                for attempt in mine:
                    loc.attempts.pop(attempt)  # deleted or released here: not debris below
                result.deletions.append(Deletion(
                    "generation", label, [names.manifest_name(g)] + data.keys, data.bytes,
                    f"generation {g} superseded" + data.why, seen, data.attempts, release=released,
                    released_bytes=data.released))
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
            if info.age(now) < grace:
                continue  # may belong to a save still in flight, or be a released one's
            files, size = _attempt_keys(loc, attempt)
            # (no manifest: never committed, or a dropped step's kept for a step that read them)
            why = "released" if info.released else "aborted" if info.aborted else "has no manifest"
            result.deletions.append(Deletion("attempt", label, files, size,
                                             f"attempt {attempt} {why}, idle {info.age(now):.0f}s",
                                             seen, (attempt,)))
        for key, mtime in loc.temp_files:
            if now - mtime >= grace:
                result.deletions.append(Deletion("temp", label, [key], 0, "temporary file of an interrupted write",
                                                 seen))
    return result


@dataclass
class _Data:
    """What deleting a manifest does to the attempts it names in its own location."""

    keys: list[str] = field(default_factory=list)  # deleted now
    bytes: int = 0
    attempts: tuple[str, ...] = ()
    released: int = 0  # bytes released: deleted by a later run
    why: str = ""


def _data_of(loc: Location, attempts, live: set[str], unknown: bool, release: bool) -> _Data:
    out = _Data()
    doomed = []
    for attempt in sorted(attempts):
        files, n = _attempt_keys(loc, attempt)
        if unknown or attempt in live:
            # a kept checkpoint reads these files: they stay (their location keeps no
            # manifest; gc deletes them once nothing references them)
            out.why = "; its data stays while a manifest of the store cannot be read" if unknown else \
                "; its data stays, referenced by a kept checkpoint"
        elif release:
            out.released += n
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
        for step, attempts in m.referenced().items():  # (a version 4 root declares them: no index is read)
            live.setdefault(names.step_dir_name(step), set()).update(attempts)
    return live


def _references_of_unreadable(storage: Storage, generation: int) -> dict[str, set[str]] | None:
    """What a manifest that does not pass validation may reference, read leniently:
    every record with a ``step`` and a data ``file`` (or, in a version 4 root, a
    ``step`` and an ``attempt``); None when that cannot be told
    (not JSON, or a reference that names no valid step or data file)."""
    from .commit import read_capped

    refs: dict[str, set[str]] = {}

    def visit(o) -> None:
        if isinstance(o, dict):
            if "step" in o and "file" in o:
                step, parsed = o["step"], names.parse_data_file(o["file"]) if isinstance(o["file"], str) else None
                if type(step) is not int or not 0 <= step <= names.MAX_STEP or parsed is None:
                    raise ValueError("a reference that cannot be followed")
                refs.setdefault(names.step_dir_name(step), set()).add(parsed[0])
            elif o.keys() == {"step", "attempt"}:  # a version 4 root's declaration of one
                step, attempt = o["step"], o["attempt"]
                if type(step) is not int or not 0 <= step <= names.MAX_STEP or not names.is_attempt_id(attempt):
                    raise ValueError("a reference that cannot be followed")
                refs.setdefault(names.step_dir_name(step), set()).add(attempt)
            for v in o.values():
                visit(v)
        elif isinstance(o, list):
            for v in o:
                visit(v)

    try:
        doc = json.loads(read_capped(storage, names.manifest_name(generation), fmt.max_manifest_bytes(), "manifest"))
        visit(doc)
    except (ValueError, RecursionError, CkptStoreError):
        return None
    if isinstance(doc, dict) and ("indexes" in doc or doc.get("format_version") == 4) \
            and not isinstance(doc.get("references"), list):
        return None  # a version 4 root's references are its declaration alone: without it, cannot be told
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
            elif taken and d.kind in ("checkpoint", "generation"):
                # Retention drops the manifest all the same; only the files stay. (A manifest
                # this plan deletes later counts as present now: had that skipped it, a store
                # whose dropped steps read each other kept them listed, run after run.)
                _keep_files_of(d, set(taken))
            elif taken:
                d.skipped = f"attempt {taken[0]} is referenced by a checkpoint present now"
            elif d.kind == "attempt":
                # Written to since the plan (another gc released it: a save may reference it)?
                now = time.time() + gc_plan.clock_offset
                young = [a for a in d.attempts if _idle(check.storage, a, now) < gc_plan.grace]
                if young:
                    d.skipped = f"attempt {young[0]} was written to since the plan"
        if d.skipped is None:
            for loc_name, attempt in d.release:  # before the manifest goes (a gc killed between: nothing lost)
                mark = {"released_at": fmt.utc_now(), "by": d.location, "reason": d.reason}
                storage.put(("" if loc_name == "." else f"{loc_name}/") + names.released_name(attempt),
                            json.dumps(mark).encode())
            # Manifests first, then what they name (I7): a store may batch each group.
            manifests = {k for k in d.keys if names.parse_manifest_name(k) is not None}
            storage.delete_many(prefix + k for k in d.keys if k in manifests)
            storage.delete_many(prefix + k for k in d.keys if k not in manifests)
        if on_deleted is not None:
            on_deleted(d)
    if gc_plan.stale_upload_age is not None:
        gc_plan.aborted_uploads = storage.abort_stale_uploads(gc_plan.stale_upload_age)
        gc_plan.empty_dirs = empty_dirs(storage, gc_plan.stale_upload_age)


# A save makes its attempt's directory, then its first file: however short the grace (0
# for a Store's own retention), an empty one younger than this may be a save's next step.
EMPTY_DIR_MIN_AGE = 600.0


def empty_dirs(storage: Storage, grace: float, dry_run: bool = False) -> list[str]:
    """Remove (or list) the empty directories of saves killed before their first file."""
    return storage.remove_stale_empty_dirs(max(grace, EMPTY_DIR_MIN_AGE), dry_run=dry_run)


def preview(storage: Storage, gc_plan: GcPlan) -> None:
    """A dry run's plan: what ``execute`` would also clear after the deletions (stale
    multipart uploads, the empty directories of killed saves), listed, not touched."""
    gc_plan.aborted_uploads = storage.abort_stale_uploads(gc_plan.grace, dry_run=True)
    gc_plan.empty_dirs = empty_dirs(storage, gc_plan.grace, dry_run=True)


def _keep_files_of(d: Deletion, attempts: set[str]) -> None:
    """Leave ``attempts``' files out of ``d`` (a checkpoint or generation whose manifest
    still goes): a checkpoint present now reads them; a later run deletes them once none
    does."""
    prefix = names.ATTEMPTS_DIR + "/"
    d.keys = [k for k in d.keys if not (k.startswith(prefix) and k.split("/")[1] in attempts)]
    d.attempts = tuple(a for a in d.attempts if a not in attempts)
    if not d.attempts:
        d.bytes = 0
    d.reason += f"; the files of attempt {sorted(attempts)[0]} stay: a checkpoint present now reads them"


def _idle(location: Storage, attempt: str, now: float) -> float:
    """Seconds since ckptstore last wrote a file of ``attempt`` (as the plan counts them)."""
    newest = max((info.mtime for info in attempt_files(location, attempt)), default=0.0)
    return max(0.0, now - newest)


def collect(storage: Storage, policy: Retention = Retention(), grace: float = DEFAULT_GRACE,
            dry_run: bool = False, protect=frozenset(), immediate: bool = False) -> GcPlan:
    p = plan(storage, policy, grace, protect=protect, immediate=immediate)
    if dry_run:
        preview(storage, p)
    else:
        execute(storage, p)
    return p


__all__ = ["DEFAULT_GRACE", "Deletion", "GcPlan", "collect", "empty_dirs", "execute", "plan", "preview", "read_pin"]
