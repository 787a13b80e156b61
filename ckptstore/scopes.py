"""Tensor scopes (format layer; imports nothing of the package).

A tensor of a checkpoint is either rank-local (each rank stores its own under the same
key: RNG states, a non-sharded model saved per rank) or global (one tensor of the
checkpoint, written once in total as chunks by the ranks: DTensor shards, tensors
declared replicated). The value is the prefix of a tensor reference in the stored
skeleton (``"l:model.w"``, ``"g:model.w"``; see ``checkpoint/flatten.skeleton_key``).
"""

from __future__ import annotations

import enum

__all__ = ["Scope"]


class Scope(str, enum.Enum):
    """Where a tensor lives: ``LOCAL`` ("l") on one rank, ``GLOBAL`` ("g") across ranks.

    A ``str`` enum: members compare and hash equal to their stored values, and
    ``str()`` / ``format()`` give the value ("l"), never "Scope.LOCAL".
    """

    LOCAL = "l"
    GLOBAL = "g"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)
