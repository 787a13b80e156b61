"""Format versions 1 to 3, the documents that hold every record: a vote carries its
rank's records (``state``, ``shards``, ``replicas``), a manifest every rank's
(``ranks``) and the global tensors' chunks (``tensors``). In and out, and what reading
such a manifest checks (I5: one state per rank, exact coverage; references; extents).
Versions 1 and 2 differ from 3 only in what a skeleton or a blob may say, not in shape.
"""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING

from ..errors import FormatError
from ..names import MAX_WORLD_SIZE
from .coverage import validate_coverage
from .head import (manifest_head, manifest_head_from_json, manifest_head_json, manifest_text, vote_head,
                   vote_head_json)
from .records import RankState, ReplicaHash, entries_from_json
from .strict import bounded_int, expect, iso_time
from .text import COMPACT, entries_json, entries_text, rank_text
from .validation import validate_extents, validate_ranks, validate_references

if TYPE_CHECKING:
    from .documents import Manifest, Vote

VOTE_FIELDS = frozenset({"state", "shards", "replicas"})
MANIFEST_FIELDS = frozenset({"ranks", "tensors"})


# ---------------------------------------------------------------------------- votes
def _vote_tail_json(v: Vote) -> dict:
    """The members after ``shards``."""
    return {"replicas": [r.to_json() for r in v.replicas], "written_at": v.written_at}


def vote_json(v: Vote) -> dict:
    return {**vote_head_json(v), "state": v.state.to_json() if v.state is not None else None,
            "shards": entries_json(v.shards), **_vote_tail_json(v)}


def vote_bytes(v: Vote) -> bytes:
    """``json.dumps(vote_json(v))``, compact, with the records written as text directly."""
    dumps = functools.partial(json.dumps, **COMPACT)
    names: dict[str, str] = {}
    state = "null" if v.state is None else rank_text(v.state, names)
    return (f'{dumps(vote_head_json(v))[:-1]},"state":{state},"shards":{entries_text(v.shards, names)},'
            f'{dumps(_vote_tail_json(v))[1:]}').encode()


def vote_from_json(cls: type[Vote], d: dict) -> Vote:
    attempt, ok = vote_head(d, VOTE_FIELDS)
    state = RankState.from_json(d["state"], "vote.state", attempt) if d["state"] is not None else None
    if ok and state is None:
        raise FormatError("a yes-vote must carry the rank's state")
    if d["error"] is not None:
        expect(d["error"], str, "vote.error")
    replicas = expect(d["replicas"], list, "vote.replicas")
    return cls(
        attempt=attempt,
        step=None if d["step"] is None else bounded_int(d["step"], "vote.step"),
        world_size=bounded_int(d["world_size"], "vote.world_size", 1, MAX_WORLD_SIZE),
        rank=bounded_int(d["rank"], "vote.rank", 0, MAX_WORLD_SIZE - 1),
        ok=ok,
        error=d["error"],
        state=state,
        shards=entries_from_json(d["shards"], "vote.shards", attempt),
        replicas=tuple(ReplicaHash.from_json(r, f"vote.replicas[{i}]") for i, r in enumerate(replicas)),
        written_at=iso_time(d["written_at"], "vote.written_at"),
    )


# ---------------------------------------------------------------------------- manifests
def manifest_json(m: Manifest) -> dict:
    d = manifest_head_json(m)
    d["ranks"] = [r.to_json() for r in m.ranks]
    d["tensors"] = entries_json(m.tensors)
    if m.epoch is not None:
        d["epoch"] = m.epoch
    return d


def manifest_bytes(m: Manifest) -> bytes:
    """``json.dumps(manifest_json(m))``, compact, with the chunk records written as text
    directly instead of through a dict each (a manifest holds one per chunk)."""
    names: dict[str, str] = {}
    ranks = ",".join(rank_text(r, names) for r in m.ranks)
    return manifest_text(m, f'"ranks":[{ranks}],"tensors":{entries_text(m.tensors, names)}')


def manifest_from_json(cls: type[Manifest], d: dict, version: int) -> Manifest:
    attempt, world_size = manifest_head(d, MANIFEST_FIELDS)
    ranks = expect(d["ranks"], list, "manifest.ranks")
    if len(ranks) != world_size:  # before parsing them: a claimed world size costs nothing
        raise FormatError(f"manifest.ranks holds {len(ranks)} ranks, world_size is {world_size}")
    m = cls(
        **manifest_head_from_json(d, attempt, world_size),
        ranks=tuple(RankState.from_json(r, f"manifest.ranks[{i}]", attempt) for i, r in enumerate(ranks)),
        tensors=entries_from_json(d["tensors"], "manifest.tensors", attempt),
        format_version=version,
    )
    validate_ranks(m.ranks, m.world_size)
    for key, entry in m.tensors.items():
        validate_coverage(entry, f"global tensor {key!r}")
    validate_references(m)
    validate_extents(m.blobs())
    return m
