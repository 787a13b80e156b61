"""Format version 4's root manifest: its own members (the indexes as columns, the
global tensors, what its blobs read), in and out (docs/format.md, "Version 4")."""

from __future__ import annotations

import json
from typing import Mapping

from ..errors import FormatError
from ..names import data_file_name
from .index import INDEX_CODEC, INDEX_STREAM, GlobalEntry, Reads, _DUMPS, check_cap
from .records import Blob
from .strict import _Name, _expect, _fields


ROOT_FIELDS = frozenset({"indexes", "globals"}) | Reads.FIELDS
_INDEX_COLUMNS = ("offset", "length", "raw_length", "xxh3_128")


def parse_root(d: dict, attempt: str, world_size: int):
    """(indexes, globals, reads) of a version 4 root manifest's own fields."""
    what = "manifest.indexes"
    columns = _fields(d["indexes"], set(_INDEX_COLUMNS), set(), what)
    for c in _INDEX_COLUMNS:  # before parsing any: a claimed world size costs nothing
        if len(_expect(columns[c], list, what, f".{c}")) != world_size:
            raise FormatError(f"{what}.{c} holds {len(columns[c])} entries, world_size is {world_size}")
    parsed = []
    for rank, (offset, length, raw_length, digest) in enumerate(zip(*(columns[c] for c in _INDEX_COLUMNS))):
        b = Blob.from_json({"file": data_file_name(attempt, rank, INDEX_STREAM), "offset": offset,
                                "length": length, "raw_length": raw_length, "codec": list(INDEX_CODEC),
                                "xxh3_128": digest}, _Name("manifest.indexes[rank {}]", rank), attempt)
        check_cap(b, _Name("manifest.indexes[rank {}]", rank))
        parsed.append(b)
    globals_ = {k: GlobalEntry.from_json(v, _Name("manifest.globals[{!r}]", k), world_size)
                for k, v in _expect(d["globals"], dict, "manifest.globals").items()}
    return tuple(parsed), globals_, Reads.from_json(d, "manifest")


def root_text(indexes, globals_: Mapping[str, GlobalEntry], reads: Reads) -> str:
    """A root's own members, as JSON text without braces (after the header). The
    indexes are columns, each rank's at its position: about 60 bytes per rank, where a
    blob record each would be 250 (10,000 ranks: 0.6 MB, not 2.5)."""
    cols = {"offset": [b.offset for b in indexes], "length": [b.length for b in indexes],
            "raw_length": [b.raw_length for b in indexes], "xxh3_128": [b.xxh3_128 for b in indexes]}
    body = json.dumps({"indexes": cols, "globals": {k: g.to_json() for k, g in globals_.items()}, **reads.to_json()},
                      **_DUMPS)
    return body[1:-1]
