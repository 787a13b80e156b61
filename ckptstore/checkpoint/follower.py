"""Ranks other than 0: wait until the committer committed the attempt or gave up.

Each poll reads the outcome the committer writes (votes.write_outcome); every
``FULL_LOOK_EVERY``-th poll, and at the deadline, a full look (the location's manifests,
the abort marker) instead, so a committer that died between its manifest and its
outcome delays the wait, never fails it. In exit mode a rank that voted judges rank 0
by its heartbeat (heartbeat.PeerWatch) and aborts the attempt when rank 0 is presumed
dead, unless a full look finds the attempt committed.
"""

from __future__ import annotations

from .. import format as fmt
from .. import names
from ..errors import BaseRetiredError, CommitError, CommitTimeoutError, FormatError, ObjectNotFoundError
from ..storage import Storage
from . import exiting, heartbeat
from .heartbeat import Deadline, PeerWatch, follower_cadence
from .manifests import generations, read_manifest
from .validation import BASE_RETIRED
from .votes import abort, read_abort_reason, read_outcome

FULL_LOOK_EVERY = 8  # a waiting rank's polls between full looks (a listing), see await_outcome


def await_outcome(storage: Storage, attempt: str, timeout: float, rank: int = 1,
                  world_size: int = 2) -> fmt.Manifest:
    """Ranks other than 0: wait until rank 0 committed this attempt or gave up.

    Each poll is one small GET, of the outcome the committer writes (write_outcome),
    paced by :func:`follower_cadence`. Every ``FULL_LOOK_EVERY``-th poll, and once more
    at the deadline, the rank takes a full look instead (the location's manifests and
    the abort marker), so an outcome that was never written (the committer died between
    its manifest and its outcome) delays it, never fails it."""
    where = storage.describe()
    deadline = Deadline(timeout, *follower_cadence(world_size))
    seen: set[int] = set()
    watch: PeerWatch | None = None
    polls = 0
    while True:
        polls += 1
        outcome = read_outcome(storage, attempt)
        if outcome is not None or polls % FULL_LOOK_EVERY == 0:
            manifest = _conclude(storage, attempt, outcome, seen, where)
            if manifest is not None:
                return manifest
        if exiting.active() and rank != 0:
            watch = watch or PeerWatch(storage, attempt)
            if watch.due():
                manifest = _judge_committer(storage, attempt, rank, watch, where, world_size, seen)
                if manifest is not None:
                    return manifest
        if not deadline.sleep_or_expire():
            manifest = _conclude(storage, attempt, None, seen, where)
            if manifest is not None:
                return manifest
            raise CommitTimeoutError(f"{where}: attempt {attempt} was not committed within {timeout}s")


def _conclude(storage: Storage, attempt: str, outcome: dict | None, seen: set[int],
              where: str) -> fmt.Manifest | None:
    """What ends a waiting rank's wait: the manifest of ``attempt``, or a CommitError
    when the attempt was aborted and no manifest names it (a commit that raced an abort
    stands); None while neither is so."""
    generation = (outcome or {}).get("committed")
    if generation is not None:
        try:
            m = read_manifest(storage, generation)
            if m.attempt == attempt:
                return m
        except (ObjectNotFoundError, FormatError):
            pass  # retired, or not what the outcome says: look at every generation
    for gen in reversed(generations(storage)):
        if gen in seen:
            continue
        try:
            m = read_manifest(storage, gen)
        except ObjectNotFoundError:
            continue  # retired while we looked
        except FormatError:
            seen.add(gen)  # not ours, whatever it is: rank 0 decides and says so
            continue
        seen.add(gen)
        if m.attempt == attempt:
            return m
    if outcome is not None and "aborted" in outcome:
        reason = str(outcome["aborted"])
    elif storage.exists(names.abort_name(attempt)):
        reason = read_abort_reason(storage, attempt)
    else:
        return None
    # Every rank raises what rank 0 raised for a retired base: a later save of each warns
    # of it and goes on, and the ranks stay together in their next collective save.
    error = BaseRetiredError if BASE_RETIRED in reason else CommitError
    raise error(f"{where}: rank 0 did not commit attempt {attempt}: {reason}")


def _judge_committer(storage: Storage, attempt: str, rank: int, watch: PeerWatch, where: str,
                     world_size: int, seen: set[int]) -> fmt.Manifest | None:
    """Exit mode, a rank that voted: abort when rank 0 stopped beating (by the cadence
    its heartbeat promises: :func:`heartbeat.patience`), unless a full look finds the attempt
    committed (rank 0 died after its manifest, before its outcome): then its manifest."""
    looked = watch.look([0])
    if 0 not in looked:
        return None
    content, silent = looked[0]
    limit = heartbeat.patience(content, world_size)
    if silent < limit:
        return None
    manifest = _conclude(storage, attempt, None, seen, where)
    if manifest is not None:
        return manifest
    reason = heartbeat.presumed_dead([0], rank, limit)
    abort(storage, attempt, reason)
    raise CommitError(f"{where}: {reason}; nothing was committed")
