"""What a store holds: its checkpoint locations, their generations and attempts.

A location is any prefix holding manifests or attempts: the store root itself (when a
drop-in ``save`` wrote it) or its immediate children (``step-N/`` from ``Store.save``,
or ``name/`` from ``save(obj, root / name)``).
"""

from __future__ import annotations

import datetime as _dt
import json
from dataclasses import dataclass, field

from .. import format as fmt
from ..errors import CkptStoreError, ObjectNotFoundError
from ..storage import Storage
from .commit import read_manifest

PIN_NAME = "pin.json"


@dataclass
class Attempt:
    attempt: str
    files: int
    bytes: int
    newest_mtime: float  # the most recent write under the attempt
    voted: list[int]
    aborted: bool

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
    pinned: bool = False

    @property
    def committed(self) -> bool:
        return self.manifest is not None

    @property
    def step(self) -> int | None:
        if self.manifest is not None and self.manifest.step is not None:
            return self.manifest.step
        return fmt.parse_step_dir_name(self.name)

    def committed_at(self) -> float:
        return parse_time(self.manifest.committed_at) if self.manifest else 0.0


def parse_time(iso: str) -> float:
    return _dt.datetime.fromisoformat(iso).timestamp()


def scan_location(storage: Storage, name: str) -> Location:
    entries = storage.list("")
    gens = sorted(g for g in (fmt.parse_manifest_name(n) for n in entries) if g is not None)
    manifest, error = None, None
    if gens:
        try:
            manifest = read_manifest(storage, gens[-1])
        except (CkptStoreError, ValueError) as e:
            error = str(e)
    loc = Location(name, storage, gens, manifest, error, pinned=PIN_NAME in entries)
    for info in storage.walk(""):
        if ".tmp-" in info.key.rsplit("/", 1)[-1]:
            loc.temp_files.append((info.key, info.mtime))
            continue
        parts = info.key.split("/")
        if len(parts) < 3 or parts[0] != fmt.ATTEMPTS_DIR:
            continue
        a = loc.attempts.get(parts[1])
        if a is None:
            a = loc.attempts[parts[1]] = Attempt(parts[1], 0, 0, 0.0, [], False)
        a.files += 1
        a.bytes += info.size
        a.newest_mtime = max(a.newest_mtime, info.mtime)
        leaf = parts[-1]
        if leaf.startswith("vote-r") and leaf.endswith(".json"):
            try:
                a.voted.append(int(leaf[len("vote-r"):-len(".json")]))
            except ValueError:
                pass
        elif leaf == "abort.json":
            a.aborted = True
    for a in loc.attempts.values():
        a.voted.sort()
    return loc


def is_location(storage: Storage) -> bool:
    names = storage.list("")
    return f"{fmt.ATTEMPTS_DIR}/" in names or any(fmt.parse_manifest_name(n) is not None for n in names)


def scan_store(storage: Storage) -> list[Location]:
    """Every checkpoint location at or directly below the root, committed ones first by
    step (then commit time), uncommitted ones last."""
    try:
        names = storage.list("")
    except ObjectNotFoundError:
        return []
    found = []
    if is_location(storage):
        found.append(scan_location(storage, ""))
    for name in names:
        if name.endswith("/") and name.rstrip("/") != fmt.ATTEMPTS_DIR:
            child = storage.child(name.rstrip("/"))
            if is_location(child):
                found.append(scan_location(child, name.rstrip("/")))
    return sorted(found, key=_order)


def _order(loc: Location):
    step = loc.step
    return (not loc.committed, step is None, step if step is not None else 0, loc.committed_at(), loc.name)


def read_pin(loc: Location) -> dict | None:
    if not loc.pinned:
        return None
    try:
        return json.loads(loc.storage.read(PIN_NAME))
    except (ObjectNotFoundError, ValueError):
        return {}
