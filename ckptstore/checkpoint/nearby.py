"""Where the checkpoints are, when a location holds none itself.

A store root passed where one checkpoint is expected (``load("runs/exp1")``), or a
directory whose checkpoints lie a level or two deeper (``ckptstore ls runs/``), is
answered with what lies there: the errors of ``load``, ``Store.load``, ``export`` and
``consolidate`` and the "nothing here" of ``ls`` and ``verify`` name a store's newest
steps and a few checkpoint paths below (docs/operations.md, "Nothing here").

Only error paths call this, and its work is bounded: at most ``MAX_LISTINGS``
listings (one request each on S3), breadth first, down to ``DEPTH`` levels below the
location; a store's step directories are looked into newest first until ``NEWEST``
committed ones are found. A listing that fails ends the search with what it found:
a hint must never hide the error it explains.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import names
from ..errors import CkptStoreError
from ..storage import Storage

MAX_LISTINGS = 40  # listings one search may make
MAX_SHOWN = 4  # locations a hint names
NEWEST = 3  # newest committed steps a hint names per store
DEPTH = 2  # levels below the location searched
# Directories ckptstore keeps at a store's root that hold no checkpoint.
_NOT_LOCATIONS = {names.ATTEMPTS_DIR, names.EPOCHS_DIR, "journal"}


@dataclass
class Found:
    """A checkpoint, or a store (step directories), at or below the searched location."""

    name: str  # relative to the searched location; "" for the location itself
    storage: Storage
    steps: list[int] = field(default_factory=list)  # a store: its newest committed steps, newest first
    step_dirs: int = 0  # a store: its step directories, committed or not

    @property
    def is_store(self) -> bool:
        return bool(self.steps)

    def text(self, root: str) -> str:
        where = f"{root.rstrip('/')}/{self.name}" if self.name else root
        if not self.is_store:
            return where
        more = f" of {self.step_dirs} step directories" if self.step_dirs > len(self.steps) else ""
        return f"{where} (a store; newest steps {', '.join(map(str, self.steps))}{more})"


@dataclass
class Search:
    found: list[Found]
    complete: bool  # False: the listing budget ran out (or a listing failed) first

    def below(self) -> list[Found]:
        return [f for f in self.found if f.name]

    def root_store(self) -> Found | None:
        return next((f for f in self.found if not f.name and f.is_store), None)

    def listing(self, root: str) -> str:
        """The checkpoints below, as a hint names them (at most MAX_SHOWN)."""
        below = self.below()
        text = ", ".join(f.text(root) for f in below[:MAX_SHOWN])
        return text + (", ..." if len(below) > MAX_SHOWN or not self.complete else "")


def search(storage: Storage, depth: int = DEPTH) -> Search:
    """The store at ``storage`` (when its step directories hold committed steps) and
    the checkpoints and stores up to ``depth`` levels below it, bounded as the module
    says."""
    budget = [MAX_LISTINGS]

    def listing(s: Storage) -> list[str] | None:
        if budget[0] <= 0:
            return None
        budget[0] -= 1
        try:
            return s.list("")
        except (CkptStoreError, OSError):
            budget[0] = 0
            return None

    found: list[Found] = []
    level = [("", storage)]
    for d in range(depth + 1):
        deeper = []
        for name, s in level:
            if len(found) > MAX_SHOWN:
                return Search(found, True)
            entries = listing(s)
            if entries is None:
                return Search(found, False)
            if d and any(names.parse_manifest_name(e) is not None for e in entries):
                found.append(Found(name, s))  # a checkpoint: nothing to find below it
                continue
            steps = sorted(((st, e) for e in entries if e.endswith("/")
                            for st in [names.parse_step_dir_name(e[:-1])] if st is not None), reverse=True)
            newest = []
            for st, e in steps:
                if len(newest) == NEWEST:
                    break
                sub = listing(s.child(e[:-1]))
                if sub is None:
                    break
                if any(names.parse_manifest_name(x) is not None for x in sub):
                    newest.append(st)
            if newest:
                found.append(Found(name, s, newest, len(steps)))
                continue
            if d < depth:
                deeper += [(f"{name}/{e[:-1]}" if name else e[:-1], s.child(e[:-1])) for e in sorted(entries)
                           if e.endswith("/") and e[:-1] not in _NOT_LOCATIONS
                           and names.parse_step_dir_name(e[:-1]) is None]
        level = deeper
    return Search(found, True)


def store_root_message(where: str, store: Found) -> str:
    """What to pass instead of a store root where one checkpoint is expected."""
    newest = store.steps[0]
    more = f" of {store.step_dirs} step directories" if store.step_dirs > len(store.steps) else ""
    return (f"{where}: a store root (newest steps {', '.join(map(str, store.steps))}{more}), not one checkpoint: "
            f"pass a step's directory ({where.rstrip('/')}/{names.step_dir_name(newest)} is the newest), or load "
            f"through the store: Store({where!r}).load() for the newest step, .load(step) for another")


def below_message(where: str, found: Search) -> str:
    """The part of a message that says which checkpoints lie below ``where``."""
    return f"checkpoints below it: {found.listing(where)}; pass one of them"
