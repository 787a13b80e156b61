"""Run epochs: fencing off the workers of an older incarnation of a job.

When a launcher dies, its workers can keep training and saving beside the relaunched
job (seen: both re-committed one step, as two generations). Each incarnation claims
the next epoch at resume, create-only (``epochs/epoch-<n>.json`` at the store root:
two claimants of one number cannot both win), records it in its manifests, and its
committer refuses to commit once a newer epoch has been claimed.

A commit checks the claims just before its manifest is written; a newer run that
claims in the moment between that check and the write does not stop it (one commit of
the older run can still land). The newer run's own commits are never refused.
"""

from __future__ import annotations

import json
import os
import socket

from .. import format as fmt
from .. import names
from ..errors import AlreadyExistsError, CommitError, FencedError
from ..storage import Storage

CLAIM_TRIES = 100  # racing claimants: each loss means another run took that number


def epochs(storage: Storage) -> list[int]:
    """The claimed epochs of the store at ``storage``, ascending."""
    found = (names.parse_epoch_leaf(n) for n in storage.list(names.EPOCHS_DIR + "/"))
    return sorted(e for e in found if e is not None)


def claim_epoch(storage: Storage, note: dict | None = None) -> int:
    """Claim the next epoch (create-only) and return it."""
    for _ in range(CLAIM_TRIES):
        claimed = epochs(storage)
        epoch = (claimed[-1] + 1) if claimed else 1
        if epoch > names.MAX_GENERATION:
            raise CommitError(f"{storage.describe(names.epoch_name(claimed[-1]))}: the highest epoch a claim name "
                              "can hold is taken (a planted or damaged claim?): remove it to run again")
        record = {"epoch": epoch, "at": fmt.utc_now(), "host": socket.gethostname(), "pid": os.getpid(),
                  **(note or {})}
        try:
            storage.put(names.epoch_name(epoch), json.dumps(record).encode(), if_absent=True)
            return epoch
        except AlreadyExistsError:
            continue
    raise CommitError(f"{storage.describe(names.EPOCHS_DIR)}: could not claim an epoch in {CLAIM_TRIES} tries")


def check_fence(storage: Storage, epoch: int | None) -> None:
    """Raise :class:`FencedError` when a run newer than ``epoch`` has claimed the store."""
    if epoch is None:
        return
    claimed = epochs(storage)
    if claimed and claimed[-1] > epoch:
        raise FencedError(f"{storage.describe()}: a newer run (epoch {claimed[-1]}) has claimed this store; "
                          f"this run (epoch {epoch}) may no longer commit (an orphaned worker of an older "
                          "launch?); nothing was committed")


def check_round_fence(store, round_: int) -> None:
    """Raise :class:`FencedError` unless the in-job store's ``fence`` (the current round
    of in-job recovery, set by the leader agent: supervisor/injob.py) is ``round_``.

    The memory tier's committer calls it just before the manifest instead of claiming a
    durable epoch per round (docs/design/in-job-restart.md, section 7.3): a hung rank of
    an older round that wakes up cannot commit to the memory tier the survivors of a
    newer round restore from. Before the leader first sets it (round 0 only) there is
    nothing to be fenced off."""
    from ..supervisor import injob  # (imports nothing of the package)

    current = injob.fence(store)
    if current is None and round_ == 0:
        return
    if current != round_:
        raise FencedError(f"in-job round {round_} may no longer commit to the memory tier: the job is in round "
                          f"{current if current is not None else '(none: the fence is unset)'} now (a rank of a "
                          "failed round that kept running?); nothing was committed")
