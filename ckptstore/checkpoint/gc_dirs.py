"""The empty directories gc removes: those a save killed before its first file leaves
behind (``attempts/<id>/``, ``attempts/``, and a ``step-N/`` that held only those).

gc decides which directories, from the checkpoint layout (names.py); the store removes
them (:meth:`~ckptstore.storage.Storage.remove_empty_dirs`: only one that is empty and
unchanged for long enough, both judged before any is removed, never through a symlink,
never the root). A store whose directories vanish with their last object (an object
store: ``keeps_empty_dirs`` False) is not even listed.
"""

from __future__ import annotations

from .. import names
from ..storage import Storage

# A save makes its attempt's directory, then its first file: however short the grace (0
# for a Store's own retention), an empty one younger than this may be a save's next step.
EMPTY_DIR_MIN_AGE = 600.0


def empty_dirs(storage: Storage, grace: float, dry_run: bool = False) -> list[str]:
    """Remove (or list) the empty directories of saves killed before their first file."""
    if not storage.keeps_empty_dirs:
        return []
    return storage.remove_empty_dirs(killed_save_dirs(storage), max(grace, EMPTY_DIR_MIN_AGE), dry_run=dry_run)


def killed_save_dirs(storage: Storage) -> list[str]:
    """Where a save makes directories and a listing shows them possibly empty, children
    before their parents: at the root, ``attempts/<id>/`` and ``attempts/`` (a checkpoint
    path) and each ``step-N/``; in a ``step-N/`` whose only directory is ``attempts/``,
    its ``attempts/<id>/`` and ``attempts/``. Nothing else is offered (a user's directory,
    one deeper down, a step holding other directories); whether each is empty and old
    enough is the store's to judge, on what it holds then."""
    offered: list[str] = []

    def attempts(prefix: str) -> bool:
        """Offer ``prefix``'s empty attempt directories, and ``prefix`` itself when they
        are all it holds; whether it was offered."""
        entries = storage.list(prefix + "/")
        empty = [e[:-1] for e in entries
                 if e.endswith("/") and names.is_attempt_id(e[:-1]) and not storage.list(f"{prefix}/{e}")]
        offered.extend(f"{prefix}/{a}" for a in empty)
        if len(empty) < len(entries):
            return False
        offered.append(prefix)
        return True

    for entry in storage.list(""):
        if entry == f"{names.ATTEMPTS_DIR}/":
            attempts(names.ATTEMPTS_DIR)
        elif entry.endswith("/") and names.parse_step_dir_name(entry[:-1]) is not None:
            step = entry[:-1]
            inside = storage.list(entry)
            subdirs = [e for e in inside if e.endswith("/")]
            emptied = subdirs == [f"{names.ATTEMPTS_DIR}/"] and attempts(f"{step}/{names.ATTEMPTS_DIR}")
            if len(subdirs) == len(inside) and (not subdirs or emptied):
                offered.append(step)
    return offered
