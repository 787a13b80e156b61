"""The commit's messages through storage: each rank's vote (or no-vote), the abort
marker any rank may write, and the outcome the committer writes for the ranks waiting on
it. Every one is a small create-only object in the attempt's directory; none makes
anything visible (docs/format.md, "Votes and abort markers"). What is read back is
untrusted input, read up to its size cap.
"""

from __future__ import annotations

import json

from .. import format as fmt
from .. import names
from ..errors import CkptStoreError, FormatError, ObjectNotFoundError
from ..storage import Storage
from .manifests import read_capped


def write_vote(storage: Storage, vote: fmt.Vote) -> None:
    storage.put(names.vote_name(vote.attempt, vote.rank), vote.to_bytes(), if_absent=True)


def write_failure_vote(storage: Storage, attempt: str, step, world_size: int, rank: int, error: BaseException) -> None:
    """Tell the committer at once that this rank cannot vote yes (best effort)."""
    try:
        write_vote(storage, fmt.Vote(attempt, step, world_size, rank, ok=False, error=f"{type(error).__name__}: {error}"))
    except BaseException:
        pass


def read_votes(storage: Storage, attempt: str, entries: list[str] | None = None,
               have=frozenset(), pool=None) -> dict[int, fmt.Vote]:
    """The votes of ``attempt`` but those of the ranks in ``have`` (read already: a
    committer polling for the last votes reads each vote once); ``entries``: a listing
    of its directory already made. With a ``pool`` the votes' bytes are fetched in
    parallel, as many at once as it has threads (the latency of an object store, not
    the count of ranks, bounds the wait), and parsed here one by one, in rank order
    (parsing holds the GIL: threads would only contend for it); the first bad vote in
    rank order is the error."""
    prefix = names.attempt_dir(attempt)
    todo = []
    for name in (storage.list(prefix) if entries is None else entries):
        rank = names.parse_vote_leaf(name)
        if rank is not None and rank not in have:
            todo.append((rank, f"{prefix}/{name}"))
    todo.sort()

    def fetch(key: str) -> bytes:
        return read_capped(storage, key, fmt.max_manifest_bytes(), "vote")

    fetched = [pool.submit(fetch, key) for _, key in todo] if pool is not None and len(todo) > 1 else None
    votes = {}
    try:
        for i, (rank, key) in enumerate(todo):
            try:
                v = fmt.Vote.from_bytes(fetched[i].result() if fetched is not None else fetch(key))
            except (FormatError, ObjectNotFoundError) as e:
                raise FormatError(f"{storage.describe(key)}: unreadable vote: {e}") from e
            if (v.attempt, v.rank) != (attempt, rank):
                raise FormatError(f"{storage.describe(key)}: holds the vote of rank {v.rank} for attempt {v.attempt}")
            votes[v.rank] = v
    finally:
        for f in fetched or ():
            f.cancel()
    return votes


def abort(storage: Storage, attempt: str, reason) -> None:
    try:
        data = json.dumps({"attempt": attempt, "reason": str(reason)[:4096], "at": fmt.utc_now()}).encode()
        storage.put(names.abort_name(attempt), data, if_absent=True)
    except BaseException:
        pass
    write_outcome(storage, attempt, {"aborted": str(reason)[:4096]})


def write_outcome(storage: Storage, attempt: str, outcome: dict) -> None:
    """Tell the waiting ranks how ``attempt`` ended (best effort, create-only: the first
    word stands). It is a hint they act on only after checking it (await_outcome): a
    "committed" is read from its manifest, an "aborted" is believed only when no
    manifest names the attempt, and a lost outcome costs a waiting rank time, not
    correctness (its full looks find the manifest or the abort marker)."""
    try:
        data = json.dumps({"attempt": attempt, **outcome, "at": fmt.utc_now()}).encode()
        storage.put(names.outcome_name(attempt), data, if_absent=True)
    except BaseException:
        pass


def read_outcome(storage: Storage, attempt: str) -> dict | None:
    """The outcome the committer wrote for ``attempt``: {"committed": generation} or
    {"aborted": reason}; None when there is none yet, or it cannot be read or is not
    one (untrusted input: a waiting rank then takes a full look instead)."""
    try:
        doc = fmt.loads_json(read_capped(storage, names.outcome_name(attempt), fmt.MAX_MARKER_BYTES, "outcome"),
                             "outcome")
    except CkptStoreError:
        return None
    if not isinstance(doc, dict) or doc.get("attempt") != attempt:
        return None
    generation = doc.get("committed")
    if isinstance(generation, int) and not isinstance(generation, bool) and 0 < generation <= names.MAX_GENERATION:
        return {"committed": generation}
    reason = doc.get("aborted")
    return {"aborted": reason[:4096]} if isinstance(reason, str) else None


def read_abort_reason(storage: Storage, attempt: str) -> str:
    """The reason an abort marker gives, or why it cannot be read (it is untrusted input)."""
    try:
        marker = fmt.loads_json(read_capped(storage, names.abort_name(attempt), fmt.MAX_MARKER_BYTES, "abort marker"),
                                "abort marker")
        reason = marker.get("reason") if isinstance(marker, dict) else None
        return reason[:4096] if isinstance(reason, str) else "(no reason given)"
    except CkptStoreError as e:
        return f"(unreadable abort marker: {e})"
