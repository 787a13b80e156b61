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


def from_rank0(value, group=None):
    """Rank 0's ``value`` on every rank of ``group`` (collective; other ranks' values are
    ignored). Without a group of several ranks, ``value`` itself."""
    if rank_and_world(group)[1] == 1:
        return value
    box = [value]
    src = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def gather(value, group=None) -> list:
    """Every rank's ``value``, by rank (collective)."""
    world = rank_and_world(group)[1]
    if world == 1:
        return [value]
    out = [None] * world
    dist.all_gather_object(out, value, group=group)
    return out


def agree_on_attempt(step: int | None, group=None) -> tuple[str, int | None]:
    """A fresh attempt id that every rank of ``group`` shares, and rank 0's step
    (collective). The caller checks that its own step is rank 0's."""
    return from_rank0((names.new_attempt_id(), step), group)
