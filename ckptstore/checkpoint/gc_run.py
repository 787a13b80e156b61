"""Carrying out a gc plan beside running saves (I7, I8; gc.py plans).

Each deletion is checked again just before it runs, against what its location holds
now (:class:`Recheck`). Then it runs in two phases:

1. in plan order, each deletion's manifests go (after the release marks of the files
   they read, when it releases them); an attempt is claimed first and looked at again
   (claims.py: a committer between its last look and its manifest keeps it);
2. once every manifest of the run is gone, one look at the whole store (liveness.
   present): what the manifests present reference, and the commits in flight. Data a
   present manifest reads stays; while any commit is in flight no data goes at all (its
   save may reference what a manifest deleted above named: its commit mark came before
   its check of that manifest); the rest goes, each attempt's claim last.
"""

from __future__ import annotations

import json
import time

from .. import format as fmt
from .. import names
from ..errors import CkptStoreError, ObjectNotFoundError
from ..storage import Storage
from . import claims
from .catalog import summarize
from .manifests import generations, read_manifest
from .retire import attempt_files
from .liveness import attempts_named, present


class Recheck:
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

    def why_not(self, d) -> str | None:
        """Why deletion ``d`` must not run now, or None."""
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


def run_deletions(storage: Storage, gc_plan, on_deleted=None) -> None:
    """Carry out a plan (module docstring); a deletion that no longer holds is skipped
    and says why (``Deletion.skipped``). Keys are deleted through the store's root, so
    directories a deletion empties go too (the location's own directory included)."""
    rechecks: dict[str, Recheck] = {}
    data: list[tuple[object, str, Recheck]] = []  # deletions whose files wait for phase 2
    committed: set[str] = set()  # attempts whose manifests phase 1 deleted: their commits are over

    def done(d) -> None:
        if on_deleted is not None:
            on_deleted(d)

    for d in gc_plan.deletions:
        prefix = "" if d.location == "." else f"{d.location}/"
        check = rechecks.get(d.location)
        if check is None:
            check = rechecks[d.location] = Recheck(storage.child(d.location) if prefix else storage)
        d.skipped = check.why_not(d)
        if d.skipped is None and d.kind == "attempt":
            d.skipped = _claim_and_look(check, d, gc_plan)
        if d.skipped is not None:
            done(d)
            continue
        d.skipped = _release(storage, d)  # before the manifests go (a gc killed between: nothing lost)
        if d.skipped is not None:
            done(d)
            continue
        storage.delete_many(prefix + k for k in d.keys if names.parse_manifest_name(k) is not None
                            or d.kind == "temp")  # (an interrupted put's: nothing reads it)
        if d.kind in ("checkpoint", "generation"):
            committed.update(f"{d.location}/{names.ATTEMPTS_DIR}/{a}" for a in d.attempts)
        if d.kind != "temp" and any(names.parse_manifest_name(k) is None for k in d.keys):
            data.append((d, prefix, check))
        else:
            done(d)
    if data:
        live, unknown, in_flight = present(storage, time.time() + gc_plan.clock_offset, committed,
                                           gc_plan.generations)
        for d, prefix, check in data:
            kept = _settle(d, live.get(d.location, set()), unknown, in_flight)
            _mark_released(storage, d, kept)
            if d.skipped is None:
                storage.delete_many(prefix + k for k in d.keys
                                    if names.parse_manifest_name(k) is None and not _is_claim(k))
                for attempt in d.attempts if d.kind == "attempt" else ():
                    _drop_claim(storage, prefix, check.storage, attempt)
            done(d)


RELEASE_TRIES = 3  # writes of a deletion's release marks before gc leaves it to a later run


def _release(storage: Storage, d) -> str | None:
    """Rewrite the release mark of every attempt ``d``'s manifests read; why ``d`` must
    not run now, or None. A manifest must go within claims.COMMIT_WINDOW of its marks (a
    save that checked it was there commits within the lease of its check, so the marks
    outlast its commit by the grace): marks that took longer to write are written again,
    and after RELEASE_TRIES such tries the deletion is skipped whole (its manifest and
    files stay; the marks written say only that no commit of those attempts is to come,
    as after a gc killed right after them)."""
    if not d.release:
        return None
    tries = claims.Windowed(tries=RELEASE_TRIES)
    for _ in tries:
        _mark_released(storage, d, d.release)
    return None if tries.in_time else tries.overran("writing its release marks") + "; a later run deletes it"


def _mark_released(storage: Storage, d, attempts) -> None:
    """The release marks of ``attempts`` ((location, attempt) pairs): no manifest of ``d``
    names them any more (and none of theirs is to come: claims.committing)."""
    for loc_name, attempt in attempts:
        mark = {"released_at": fmt.utc_now(), "by": d.location, "reason": d.reason}
        storage.put(("" if loc_name == "." else f"{loc_name}/") + names.released_name(attempt),
                    json.dumps(mark).encode())


def _claim_and_look(check: Recheck, d, gc_plan) -> str | None:
    """Claim the attempts of ``d`` and look at them again (claims.py); why they must
    stay, or None. Nothing is claimed that looks written to since the plan."""
    young = _young(check, d, gc_plan)
    if young is not None:
        return young
    for attempt in d.attempts:
        claims.claim(check.storage, attempt, d.reason)
    return _young(check, d, gc_plan) or check.why_not(d)


def _young(check: Recheck, d, gc_plan) -> str | None:
    """Why an attempt of ``d`` is not idle now: written to within the grace (another gc
    released it, a save resumed), or its committer may be writing its manifest."""
    now = time.time() + gc_plan.clock_offset
    for attempt in d.attempts:
        a = summarize(attempt, attempt_files(check.storage, attempt))
        if a is None:
            continue  # (nothing but temporaries left: nothing a save could commit)
        if a.age(now) < gc_plan.grace:
            return f"attempt {attempt} was written to since the plan"
        held = check.generations() + d.seen_generations  # (those this run deleted too: their commits are over)
        if not a.released and claims.committing(check.storage, attempt, a.committing, held, now):
            return f"attempt {attempt} is being committed (its commit mark is {now - a.committing:.0f}s old)"
    return None


def _settle(d, live: set[str], unknown: bool, in_flight: list[str]) -> tuple[tuple[str, str], ...]:
    """Phase 2: which of ``d``'s files go, given the store now. A checkpoint or
    generation whose manifests went keeps only files (returned as (location, attempt):
    they need a release mark); an attempt is skipped whole."""
    taken = set(d.attempts) & live
    if unknown:
        why = "a manifest present cannot be read: it may reference these files"
    elif in_flight:
        why = f"a save is committing ({in_flight[0]}): it may reference these files; a later run deletes them"
    elif taken:
        why = f"attempt {sorted(taken)[0]} is referenced by a checkpoint present now"
    else:
        return ()
    if d.kind == "attempt":
        d.skipped = why
        return ()
    stay = set(d.attempts) if (unknown or in_flight) else taken
    _keep_files_of(d, stay, why)
    return tuple((d.location, a) for a in sorted(stay))


def _keep_files_of(d, attempts: set[str], why: str) -> None:
    """Leave ``attempts``' files out of ``d`` (a checkpoint or generation whose manifest
    went): a later run deletes them once nothing keeps them."""
    prefix = names.ATTEMPTS_DIR + "/"
    d.keys = [k for k in d.keys if not (k.startswith(prefix) and k.split("/")[1] in attempts)]
    d.attempts = tuple(a for a in d.attempts if a not in attempts)
    if not d.attempts:
        d.bytes = 0
    d.reason += f"; its files stay ({why})"


def _is_claim(key: str) -> bool:
    ours = names.attempt_file_of(key)
    return ours is not None and ours[1] == "claim"


def _drop_claim(storage: Storage, prefix: str, location: Storage, attempt: str) -> None:
    """The claim goes last, once nothing else ckptstore wrote is left in the attempt: a
    committer that then finds no claim finds no files (claims.py). (Through the store's
    root, as every deletion: the directories it empties go too.)"""
    left = [info.key for info in attempt_files(location, attempt)]
    if left and all(_is_claim(k) for k in left):
        storage.delete_many(prefix + k for k in left)
