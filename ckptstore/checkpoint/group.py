"""Rank, world size and the one start-of-save agreement, from torch.distributed.

The agreement is the only collective ckptstore makes, and it runs in the blocking part
of ``Store.save``, on the caller's thread: rank 0 picks the attempt id and broadcasts
it with the step it saves, and every rank checks that it is saving the same step.
"""

from __future__ import annotations

import torch.distributed as dist

from .. import names


def rank_and_world(group=None) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def agree_on_attempt(step: int | None, group=None) -> tuple[str, int | None]:
    """A fresh attempt id that every rank of ``group`` shares, and rank 0's step
    (collective). The caller checks that its own step is rank 0's."""
    rank, world = rank_and_world(group)
    attempt = names.new_attempt_id()
    if world == 1:
        return attempt, step
    payload = [attempt, step] if rank == 0 else [None, None]
    src = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast_object_list(payload, src=src, group=group)
    return payload[0], payload[1]
