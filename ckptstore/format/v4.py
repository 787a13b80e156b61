"""Format version 4, the hierarchical documents (docs/format.md, "Version 4"): a
yes-vote names its rank's index and sums it up (``index``, ``summary``) instead of
holding its records; the manifest, the *root*, names one index per rank (as columns)
and holds the global tensors' dtypes, shapes and holders and what its blobs read
(``globals``, ``Reads``), not the records. In and out, and what reading a root checks.
The records an index and a summary hold are ``index.py``'s."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Mapping

from ..errors import FormatError
from ..names import MAX_WORLD_SIZE, data_file_name
from .head import manifest_head, manifest_head_from_json, manifest_text, vote_head, vote_head_json
from .index import INDEX_CODEC, INDEX_STREAM, GlobalEntry, Reads, Summary, check_cap, index_blob
from .records import Blob
from .strict import LazyName, bounded_int, check_fields, expect, iso_time
from .text import COMPACT
from .validation import validate_extents

if TYPE_CHECKING:
    from .documents import Manifest, Vote

VOTE_FIELDS = frozenset({"index", "summary"})


# ---------------------------------------------------------------------------- votes
def vote_json(v: Vote) -> dict:
    return {**vote_head_json(v), "index": v.index.to_json(), "summary": v.summary.to_json(),
            "written_at": v.written_at}


def vote_bytes(v: Vote) -> bytes:
    return json.dumps(vote_json(v), **COMPACT).encode()


def vote_from_json(cls: type[Vote], d: dict) -> Vote:
    attempt, ok = vote_head(d, VOTE_FIELDS)
    if d["error"] is not None:
        expect(d["error"], str, "vote.error")
    rank = bounded_int(d["rank"], "vote.rank", 0, MAX_WORLD_SIZE - 1)
    if ok and (d["index"] is None or d["summary"] is None):
        raise FormatError("a yes-vote must name the rank's index and carry its summary")
    return cls(
        attempt=attempt,
        step=None if d["step"] is None else bounded_int(d["step"], "vote.step"),
        world_size=bounded_int(d["world_size"], "vote.world_size", 1, MAX_WORLD_SIZE),
        rank=rank, ok=ok, error=d["error"],
        written_at=iso_time(d["written_at"], "vote.written_at"),
        index=None if d["index"] is None else index_blob(d["index"], "vote.index", attempt, rank),
        summary=None if d["summary"] is None else Summary.from_json(d["summary"], "vote.summary", attempt),
    )


# ---------------------------------------------------------------------------- the root
ROOT_FIELDS = frozenset({"indexes", "globals"}) | Reads.FIELDS
_INDEX_COLUMNS = ("offset", "length", "raw_length", "xxh3_128")


def parse_root(d: dict, attempt: str, world_size: int):
    """(indexes, globals, reads) of a version 4 root manifest's own fields."""
    what = "manifest.indexes"
    columns = check_fields(d["indexes"], set(_INDEX_COLUMNS), set(), what)
    for c in _INDEX_COLUMNS:  # before parsing any: a claimed world size costs nothing
        if len(expect(columns[c], list, what, f".{c}")) != world_size:
            raise FormatError(f"{what}.{c} holds {len(columns[c])} entries, world_size is {world_size}")
    parsed = []
    for rank, (offset, length, raw_length, digest) in enumerate(zip(*(columns[c] for c in _INDEX_COLUMNS))):
        b = Blob.from_json({"file": data_file_name(attempt, rank, INDEX_STREAM), "offset": offset,
                            "length": length, "raw_length": raw_length, "codec": list(INDEX_CODEC),
                            "xxh3_128": digest}, LazyName("manifest.indexes[rank {}]", rank), attempt)
        check_cap(b, LazyName("manifest.indexes[rank {}]", rank))
        parsed.append(b)
    globals_ = {k: GlobalEntry.from_json(v, LazyName("manifest.globals[{!r}]", k), world_size)
                for k, v in expect(d["globals"], dict, "manifest.globals").items()}
    return tuple(parsed), globals_, Reads.from_json(d, "manifest")


def root_text(indexes, globals_: Mapping[str, GlobalEntry], reads: Reads) -> str:
    """A root's own members, as JSON text without braces (after the header). The
    indexes are columns, each rank's at its position: about 60 bytes per rank, where a
    blob record each would be 250 (10,000 ranks: 0.6 MB, not 2.5)."""
    cols = {"offset": [b.offset for b in indexes], "length": [b.length for b in indexes],
            "raw_length": [b.raw_length for b in indexes], "xxh3_128": [b.xxh3_128 for b in indexes]}
    body = json.dumps({"indexes": cols, "globals": {k: g.to_json() for k, g in globals_.items()}, **reads.to_json()},
                      **COMPACT)
    return body[1:-1]


def manifest_json(m: Manifest) -> dict:
    return json.loads(manifest_bytes(m))


def manifest_bytes(m: Manifest) -> bytes:
    """A root is written as a root, whatever records were read into it."""
    return manifest_text(m, root_text(m.indexes, m.globals, m.reads))


def manifest_from_json(cls: type[Manifest], d: dict, version: int) -> Manifest:
    attempt, world_size = manifest_head(d, ROOT_FIELDS)
    indexes, globals_, reads = parse_root(d, attempt, world_size)
    m = cls(**manifest_head_from_json(d, attempt, world_size), ranks=(), format_version=d["format_version"],
            indexes=indexes, globals=globals_, reads=reads)
    if reads.references and m.step is None:
        raise FormatError("manifest.references: a checkpoint that is not a step of a store refers to other steps")
    if any(s == m.step for s, _ in reads.references):
        raise FormatError(f"manifest.references: names its own step {m.step}")
    if m.attempt in reads.earlier:
        raise FormatError("manifest.earlier: names the manifest's own attempt")
    validate_extents((r, None, b) for r, b in enumerate(indexes))
    return m
