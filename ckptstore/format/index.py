"""Format version 4, the hierarchical manifest: the records a root manifest, a vote and
a rank's index hold beyond version 3's (docs/format.md, "Version 4").

A version 4 manifest (the *root*) names one *index* per rank instead of holding every
chunk record: the index is a blob in the rank's own data file, hashed like any blob,
holding the rank's object (skeleton and rank-local tensors), the chunks of global
tensors it wrote and its replica hashes. The root keeps what every reader needs to
plan (the global tensors' dtypes and shapes, and which ranks' indexes hold them) and
what gc, ``ls`` and the commit need without reading any index (byte totals, the
attempts its blobs reference). Pure data, as ``format``: no I/O here.

Here: the records (a rank's :class:`Index`, its table of global tensors, its vote's
:class:`Summary`, :class:`Reads`, a root's :class:`GlobalEntry`, rank ranges); the
version 4 vote and root documents themselves are ``v4.py``'s.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping

from .._gc import gc_paused
from ..errors import FormatError
from ..names import MAX_STEP, MAX_WORLD_SIZE, check_attempt_id, data_file_name, parse_data_file
from .constants import FORMAT_NAME, INDEX_VERSION, MAX_BYTES, max_manifest_bytes
from .dtypes import dtype_from_name
from .records import Blob, RankState, ReplicaHash, TensorEntry, entries_from_json
from .strict import bounded_int, check_fields, expect, int_list, loads_json
from .text import COMPACT, entries_text, rank_text

# Every index and table is one zstd frame of this level (pipeline.RankWriter.store_metadata).
INDEX_CODEC = ({"id": "zstd", "level": 3},)
INDEX_STREAM = 0  # and lies in its rank's data file of this stream
FINGERPRINT_MODULUS = (1 << 61) - 1  # the coverage and replica fingerprints' prime


def rank_ranges(ranks) -> tuple[tuple[int, int], ...]:
    """Sorted ranks as inclusive (first, last) runs: 0..9999 is one pair."""
    out: list[list[int]] = []
    for r in sorted(set(ranks)):
        if out and out[-1][1] == r - 1:
            out[-1][1] = r
        else:
            out.append([r, r])
    return tuple((a, b) for a, b in out)


def in_ranges(rank: int, ranges) -> bool:
    return any(a <= rank <= b for a, b in ranges)


def ranges_ranks(ranges):
    for a, b in ranges:
        yield from range(a, b + 1)


def _ranges(v: Any, what: str, world_size: int) -> tuple[tuple[int, int], ...]:
    expect(v, list, what)
    if len(v) > world_size:
        raise FormatError(f"{what} holds {len(v)} rank ranges, more than the {world_size} ranks")
    out, last = [], -2
    for i, pair in enumerate(v):
        bounds = int_list(pair, what, f"[{i}]", max_len=2) if isinstance(pair, list) else ()
        if len(bounds) != 2 or not last + 1 < bounds[0] <= bounds[1] < world_size:
            raise FormatError(f"{what}[{i}] is not an ascending, disjoint rank range inside 0 .. {world_size - 1}")
        out.append(bounds)
        last = bounds[1]
    return tuple(out)


@dataclass(frozen=True, slots=True)
class GlobalEntry:
    """A global tensor as the root names it: dtype, global shape, and the ranks whose
    indexes may hold its chunks (those that hold a piece of it)."""

    dtype: str
    shape: tuple[int, ...]
    ranks: tuple[tuple[int, int], ...]

    def to_json(self) -> dict:
        return {"dtype": self.dtype, "shape": list(self.shape), "ranks": [list(p) for p in self.ranks]}

    @classmethod
    def from_json(cls, d: Any, what: str, world_size: int) -> "GlobalEntry":
        check_fields(d, {"dtype", "shape", "ranks"}, set(), what)
        dtype = expect(d["dtype"], str, what, ".dtype")
        size = dtype_from_name(dtype).itemsize
        shape = int_list(d["shape"], what, ".shape")
        entry = TensorEntry(dtype, shape, ())
        if entry.numel * size > MAX_BYTES:
            raise FormatError(f"{what}: shape {list(shape)} of {dtype} exceeds 2**62 bytes")
        return cls(dtype, shape, _ranges(d["ranks"], f"{what}.ranks", world_size))


def _references(v: Any, what: str) -> tuple[tuple[int, str], ...]:
    expect(v, list, what)
    out = []
    for i, pair in enumerate(v):
        check_fields(pair, {"step", "attempt"}, set(), f"{what}[{i}]")
        out.append((bounded_int(pair["step"], f"{what}[{i}].step", 0, MAX_STEP),
                    check_attempt_id(pair["attempt"], f"{what}[{i}].attempt")))
    if out != sorted(set(out)):
        raise FormatError(f"{what} is not sorted and unique")
    return tuple(out)


def _attempts(v: Any, what: str) -> tuple[str, ...]:
    expect(v, list, what)
    out = tuple(check_attempt_id(a, f"{what}[{i}]") for i, a in enumerate(v))
    if list(out) != sorted(set(out)):
        raise FormatError(f"{what} is not sorted and unique")
    return out


@dataclass(frozen=True)
class Reads:
    """What a manifest's (or a rank's) blobs read beyond its own attempt, and its byte
    totals: enough for gc, ``ls`` and a base check without reading any index."""

    stored_bytes: int = 0
    raw_bytes: int = 0
    referenced_bytes: int = 0
    references: tuple[tuple[int, str], ...] = ()  # (step, attempt) of other steps' locations
    earlier: tuple[str, ...] = ()  # earlier attempts of the same location

    FIELDS = frozenset({"stored_bytes", "raw_bytes", "referenced_bytes", "references", "earlier"})

    def to_json(self) -> dict:
        return {"stored_bytes": self.stored_bytes, "raw_bytes": self.raw_bytes,
                "referenced_bytes": self.referenced_bytes,
                "references": [{"step": s, "attempt": a} for s, a in self.references],
                "earlier": list(self.earlier)}

    @classmethod
    def from_json(cls, d: dict, what: str) -> "Reads":
        return cls(bounded_int(d["stored_bytes"], f"{what}.stored_bytes"), bounded_int(d["raw_bytes"], f"{what}.raw_bytes"),
                   bounded_int(d["referenced_bytes"], f"{what}.referenced_bytes"),
                   _references(d["references"], f"{what}.references"), _attempts(d["earlier"], f"{what}.earlier"))

    @classmethod
    def of_blobs(cls, blobs) -> "Reads":
        """The totals and references of ``blobs`` (every blob a rank's records name)."""
        stored = raw = referenced = 0
        refs, earlier = set(), set()
        for b in blobs:
            stored += b.length
            raw += b.raw_length
            if b.step is not None:
                referenced += b.length
                refs.add((b.step, parse_data_file(b.file)[0]))
            elif b.earlier:
                earlier.add(parse_data_file(b.file)[0])
        return cls(stored, raw, referenced, tuple(sorted(refs)), tuple(sorted(earlier)))

    def __add__(self, other: "Reads") -> "Reads":
        return Reads(self.stored_bytes + other.stored_bytes, self.raw_bytes + other.raw_bytes,
                     self.referenced_bytes + other.referenced_bytes,
                     tuple(sorted(set(self.references) | set(other.references))),
                     tuple(sorted(set(self.earlier) | set(other.earlier))))

    def covers(self, other: "Reads") -> bool:
        """Whether every reference of ``other`` is one of these."""
        return set(other.references) <= set(self.references) and set(other.earlier) <= set(self.earlier)


@dataclass(frozen=True)
class Summary:
    """What a rank's vote tells the committer in place of its records: its index, the
    table of global tensors it holds (a blob: ranks holding the same tensors write the
    same bytes, so the committer reads each distinct table once), the fingerprints of
    its written global chunks and its replica hashes, and its :class:`Reads`."""

    table: Blob | None
    coverage: int
    replicas: int
    reads: Reads = field(default_factory=Reads)

    def to_json(self) -> dict:
        return {"table": None if self.table is None else self.table.to_json(), "coverage": self.coverage,
                "replicas": self.replicas, **self.reads.to_json()}

    @classmethod
    def from_json(cls, d: Any, what: str, attempt: str) -> "Summary":
        check_fields(d, {"table", "coverage", "replicas"} | Reads.FIELDS, set(), what)
        table = None if d["table"] is None else Blob.from_json(d["table"], f"{what}.table", attempt)
        if table is not None:
            check_cap(table, f"{what}.table")
        return cls(table, bounded_int(d["coverage"], f"{what}.coverage", 0, FINGERPRINT_MODULUS - 1),
                   bounded_int(d["replicas"], f"{what}.replicas", 0, FINGERPRINT_MODULUS - 1), Reads.from_json(d, what))


def table_bytes(tensors: Mapping[str, tuple[str, tuple[int, ...]]]) -> bytes:
    """The stored table of the global tensors a rank holds: key -> dtype and shape,
    sorted by key, so that ranks holding the same tensors store the same bytes."""
    doc = {"format": FORMAT_NAME, "format_version": INDEX_VERSION, "kind": "table",
           "tensors": {k: {"dtype": d, "shape": list(s)} for k, (d, s) in sorted(tensors.items())}}
    return json.dumps(doc, **COMPACT).encode()


def parse_table(data, what: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    d = loads_json(bytes(data), what)
    expect(d, dict, what)
    _header(d, what, "table")
    check_fields(d, {"format", "format_version", "kind", "tensors"}, set(), what)
    out = {}
    for key, e in expect(d["tensors"], dict, f"{what}.tensors").items():
        g = GlobalEntry.from_json({**e, "ranks": []} if isinstance(e, dict) else e, f"{what}[{key!r}]", 1)
        out[key] = (g.dtype, g.shape)
    return out


def _header(d: dict, what: str, kind: str) -> None:
    if d.get("format") != FORMAT_NAME or d.get("format_version") != INDEX_VERSION or d.get("kind") != kind:
        raise FormatError(f"{what} is not a ckptstore version {INDEX_VERSION} {kind} "
                          f"(format {str(d.get('format'))[:32]!r}, version {str(d.get('format_version'))[:16]}, "
                          f"kind {str(d.get('kind'))[:32]!r})")


@dataclass(frozen=True)
class Index:
    """One rank's records (version 4): what its version 3 vote held."""

    attempt: str
    rank: int
    state: RankState
    shards: Mapping[str, TensorEntry]
    replicas: tuple[ReplicaHash, ...]
    summary: Summary

    def to_bytes(self) -> bytes:
        names: dict[str, str] = {}
        head = {"format": FORMAT_NAME, "format_version": INDEX_VERSION, "kind": "index",
                "attempt": self.attempt, "rank": self.rank}
        tail = {"replicas": [r.to_json() for r in self.replicas], "summary": self.summary.to_json()}
        return (f'{json.dumps(head, **COMPACT)[:-1]},"state":{rank_text(self.state, names)},'
                f'"shards":{entries_text(self.shards, names)},{json.dumps(tail, **COMPACT)[1:]}').encode()

    @classmethod
    def from_bytes(cls, data, what: str) -> "Index":
        with gc_paused():
            d = loads_json(bytes(data), what)
            expect(d, dict, what)
            _header(d, what, "index")
            check_fields(d, {"format", "format_version", "kind", "attempt", "rank", "state", "shards", "replicas",
                        "summary"}, set(), what)
            attempt = check_attempt_id(d["attempt"], f"{what}.attempt")
            replicas = expect(d["replicas"], list, f"{what}.replicas")
            return cls(
                attempt=attempt,
                rank=bounded_int(d["rank"], f"{what}.rank", 0, MAX_WORLD_SIZE - 1),
                state=RankState.from_json(d["state"], f"{what}.state", attempt),
                shards=entries_from_json(d["shards"], f"{what}.shards", attempt),
                replicas=tuple(ReplicaHash.from_json(r, f"{what}.replicas[{i}]") for i, r in enumerate(replicas)),
                summary=Summary.from_json(d["summary"], f"{what}.summary", attempt),
            )

    def blobs(self):
        """(key or None, blob) of every blob its records name: its state's, its shards'."""
        yield from self.state.blobs()
        for key, entry in self.shards.items():
            for c in entry.chunks:
                yield key, c.blob


def index_blob(d: Any, what: str, attempt: str, rank: int) -> Blob:
    """A vote's record of rank ``rank``'s index: one zstd frame (INDEX_CODEC) in that
    rank's own data file of ``attempt`` (stream INDEX_STREAM), within the manifest cap
    once decoded: what a root can name by offset, lengths and hash alone."""
    b = Blob.from_json(d, what, attempt)
    if b.file != data_file_name(attempt, rank, INDEX_STREAM):
        raise FormatError(f"{what}: rank {rank}'s index lies in {b.file}, not in "
                          f"{data_file_name(attempt, rank, INDEX_STREAM)}")
    if b.codec != INDEX_CODEC:
        raise FormatError(f"{what}: an index is one zstd frame of level {INDEX_CODEC[0]['level']}, not {list(b.codec)}")
    check_cap(b, what)
    return b


def check_cap(b: Blob, what) -> None:
    """An index or table: its stored and decoded lengths within the manifest cap."""
    if max(b.raw_length, b.length) > max_manifest_bytes():
        raise FormatError(f"{what} claims {b.raw_length} bytes, more than the cap of {max_manifest_bytes()} "
                          "(CKPTSTORE_MAX_MANIFEST_BYTES)")
