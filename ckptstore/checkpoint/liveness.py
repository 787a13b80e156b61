"""What the manifests of a store keep alive: the attempts each manifest reads (its own,
earlier ones of its location, other steps' through references), read leniently from a
manifest that does not validate; and, looked at just before gc deletes data, every
manifest present and every commit in flight (claims.py)."""

from __future__ import annotations

import json

from .. import format as fmt
from .. import names
from ..errors import CkptStoreError, ObjectNotFoundError
from ..storage import Storage
from . import claims
from .catalog import scan_store
from .manifests import read_capped, read_manifest


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


def with_unreadable(live: dict[str, set[str]], unreadable) -> tuple[dict[str, set[str]], bool]:
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



def present(storage: Storage, now: float, committed=frozenset(), held=None) -> tuple[dict[str, set[str]], bool,
                                                                                    list[str]]:
    """What the store holds now: the references of every manifest present (every
    generation), whether one of them cannot be told, and the commits in flight
    (``location/attempts/attempt`` of each attempt no manifest names whose commit mark
    is fresh: claims.committing), but those known to have committed once: in
    ``committed`` (the attempts whose manifests the caller just deleted) or released
    (a gc deleted a manifest naming them). ``held``: {location: the highest generation
    it held before the caller deleted any}. One scan of the store."""
    manifests, unreadable, in_flight = [], [], []
    for loc in scan_store(storage):
        named: set[str] = set()
        for g in loc.generations:
            try:  # (the scan read the visible one already)
                m = loc.manifest if loc.manifest is not None and g == loc.generations[-1] else \
                    read_manifest(loc.storage, g)
            except ObjectNotFoundError:
                continue
            except CkptStoreError:
                unreadable.append((loc.storage, g))
                continue
            manifests.append(m)
            named |= attempts_named(m)
        for attempt, info in sorted(loc.attempts.items()):
            where = f"{loc.name or '.'}/{names.ATTEMPTS_DIR}/{attempt}"
            if attempt in named or info.released or where in committed:
                continue
            gens = loc.generations + [(held or {}).get(loc.name or ".", 0)]
            if claims.committing(loc.storage, attempt, info.committing, gens, now):
                in_flight.append(where)
    live, unknown = with_unreadable(references_of(manifests), unreadable)
    return live, unknown, in_flight
