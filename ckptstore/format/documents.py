"""The documents: :class:`Vote` (phase one of the commit) and :class:`Manifest` (a
committed checkpoint), with their JSON in and out."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any, Mapping

from .._gc import gc_paused
from ..errors import FormatError, UnsupportedVersionError
from ..names import MAX_GENERATION, MAX_STEP, MAX_WORLD_SIZE, check_attempt_id, parse_data_file
from .constants import FORMAT_NAME, FORMAT_VERSION, READ_VERSIONS, max_manifest_bytes
from .coverage import validate_coverage
from .records import Blob, RankState, ReplicaHash, TensorEntry, _entries_from_json
from .strict import _expect, _fields, _int, _time, loads_json, utc_now
from .text import _entries_json, _entries_text, _rank_text
from .validation import validate_extents, validate_ranks, validate_references


class IncompleteManifestError(FormatError):
    """A version 4 root was asked for records that lie in indexes it was not given."""


def _header_fields(d: dict, kind: str) -> int:
    """Check the header; returns the format version."""
    if d.get("format") != FORMAT_NAME:
        raise FormatError(f"not a ckptstore {kind}: format is {d.get('format')!r}")
    version = d.get("format_version")
    if type(version) is not int or version not in READ_VERSIONS:
        raise UnsupportedVersionError(
            f"{kind} has format_version {version!r}; this ckptstore reads versions "
            f"{', '.join(map(str, READ_VERSIONS))}"
        )
    return version


@dataclass(frozen=True)
class Vote:
    """Phase one of the commit: one rank's data is durable, and this is what it wrote.

    ``state`` is the rank's own object (skeleton and rank-local tensors); ``shards`` the
    chunks it wrote of global tensors (DTensor shards, replicated tensors it was chosen
    to write); ``replicas`` its hashes of replicated chunks another rank wrote.
    """

    attempt: str
    step: int | None
    world_size: int
    rank: int
    ok: bool
    error: str | None = None
    state: RankState | None = None
    shards: Mapping[str, TensorEntry] = field(default_factory=dict)
    replicas: tuple[ReplicaHash, ...] = ()
    written_at: str = field(default_factory=utc_now)
    # Version 4 (format_index.py): a yes-vote names the rank's index instead of holding
    # its records (``state``, ``shards`` and ``replicas`` stay empty), and sums them up.
    index: Blob | None = None
    summary: Any = None  # format_index.Summary

    @property
    def format_version(self) -> int:
        return 4 if self.index is not None else FORMAT_VERSION

    def _head_json(self) -> dict:
        """The members before ``state`` (the records follow them)."""
        return {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "kind": "vote",
            "attempt": self.attempt,
            "step": self.step,
            "world_size": self.world_size,
            "rank": self.rank,
            "ok": self.ok,
            "error": self.error,
        }

    def _tail_json(self) -> dict:
        """The members after ``shards``."""
        return {"replicas": [r.to_json() for r in self.replicas], "written_at": self.written_at}

    def to_json(self) -> dict:
        if self.index is not None:
            return json.loads(self.to_bytes())
        return {**self._head_json(), "state": self.state.to_json() if self.state is not None else None,
                "shards": _entries_json(self.shards), **self._tail_json()}

    def to_bytes(self) -> bytes:
        """The stored vote: ``json.dumps(self.to_json())``, compact, byte for byte, with
        the chunk records written as text directly (as :meth:`Manifest.to_bytes`)."""
        dumps = functools.partial(json.dumps, separators=(",", ":"), allow_nan=False)
        if self.index is not None:
            return dumps({**self._head_json(), "index": self.index.to_json(), "summary": self.summary.to_json(),
                          "written_at": self.written_at}).encode()
        names: dict[str, str] = {}
        state = "null" if self.state is None else _rank_text(self.state, names)
        return (f'{dumps(self._head_json())[:-1]},"state":{state},"shards":{_entries_text(self.shards, names)},'
                f'{dumps(self._tail_json())[1:]}').encode()

    @classmethod
    def from_json(cls, d: dict) -> "Vote":
        what = "vote"
        _expect(d, dict, what)
        version = _header_fields(d, what)
        head = {"format", "format_version", "kind", "attempt", "step", "world_size", "rank", "ok", "error", "written_at"}
        _fields(d, head | ({"index", "summary"} if version >= 4 else {"state", "shards", "replicas"}), set(), what)
        if d["kind"] != "vote":
            raise FormatError(f"vote has kind {d['kind']!r}")
        attempt = check_attempt_id(d["attempt"], "vote.attempt")
        ok = _expect(d["ok"], bool, "vote.ok")
        if version >= 4:
            return cls._from_json_v4(d, attempt, ok)
        state = RankState.from_json(d["state"], "vote.state", attempt) if d["state"] is not None else None
        if ok and state is None:
            raise FormatError("a yes-vote must carry the rank's state")
        if d["error"] is not None:
            _expect(d["error"], str, "vote.error")
        replicas = _expect(d["replicas"], list, "vote.replicas")
        return cls(
            attempt=attempt,
            step=None if d["step"] is None else _int(d["step"], "vote.step"),
            world_size=_int(d["world_size"], "vote.world_size", 1, MAX_WORLD_SIZE),
            rank=_int(d["rank"], "vote.rank", 0, MAX_WORLD_SIZE - 1),
            ok=ok,
            error=d["error"],
            state=state,
            shards=_entries_from_json(d["shards"], "vote.shards", attempt),
            replicas=tuple(ReplicaHash.from_json(r, f"vote.replicas[{i}]") for i, r in enumerate(replicas)),
            written_at=_time(d["written_at"], "vote.written_at"),
        )

    @classmethod
    def _from_json_v4(cls, d: dict, attempt: str, ok: bool) -> "Vote":
        from .index import Summary, index_blob

        if d["error"] is not None:
            _expect(d["error"], str, "vote.error")
        rank = _int(d["rank"], "vote.rank", 0, MAX_WORLD_SIZE - 1)
        if ok and (d["index"] is None or d["summary"] is None):
            raise FormatError("a yes-vote must name the rank's index and carry its summary")
        return cls(
            attempt=attempt,
            step=None if d["step"] is None else _int(d["step"], "vote.step"),
            world_size=_int(d["world_size"], "vote.world_size", 1, MAX_WORLD_SIZE),
            rank=rank, ok=ok, error=d["error"],
            written_at=_time(d["written_at"], "vote.written_at"),
            index=None if d["index"] is None else index_blob(d["index"], "vote.index", attempt, rank),
            summary=None if d["summary"] is None else Summary.from_json(d["summary"], "vote.summary", attempt),
        )

    @classmethod
    def from_bytes(cls, data: bytes, what: str = "vote") -> "Vote":
        with gc_paused():
            return cls.from_json(loads_json(data, what))


_HEAD_FIELDS = frozenset({
    "format", "format_version", "kind", "generation", "attempt", "step", "world_size",
    "created_at", "committed_at", "byteorder", "metrics", "library",
})
_MANIFEST_FIELDS = _HEAD_FIELDS | {"ranks", "tensors"}


@dataclass(frozen=True)
class Manifest:
    """A committed checkpoint. Its existence is the commit (I1).

    ``ranks`` holds each rank's own object; ``tensors`` the global tensors (sharded or
    replicated across ranks), whose chunks may lie in the files of several ranks.
    """

    generation: int
    attempt: str
    step: int | None
    world_size: int
    created_at: str
    committed_at: str
    ranks: tuple[RankState, ...]
    tensors: Mapping[str, TensorEntry] = field(default_factory=dict)
    metrics: Mapping[str, Any] = field(default_factory=dict)
    byteorder: str = "little"
    library: str = ""
    epoch: int | None = None  # the run incarnation that committed it (fencing; absent: none)
    format_version: int = FORMAT_VERSION  # as read; what the skeletons may hold depends on it
    # Version 4, a root (format_index.py): rank i's index blob, the global tensors'
    # dtypes, shapes and holders, and what its blobs read. As read, ``ranks`` and
    # ``tensors`` are empty; checkpoint/indexes.py fills them from the indexes a
    # reader needs (all of them: ``complete``).
    indexes: tuple[Blob, ...] | None = None
    globals: Mapping[str, Any] = field(default_factory=dict)  # key -> format_index.GlobalEntry
    reads: Any = None  # format_index.Reads
    # The tables of global tensors the indexes read into it name (not stored in the
    # root: each rank's summary names its own), so that blobs() covers every byte.
    tables: tuple[Blob, ...] = ()

    @property
    def indexed(self) -> bool:
        return self.indexes is not None

    @property
    def complete(self) -> bool:
        """Whether every record is here: always for versions 1-3, for a version 4 root
        once every rank's index was read into it."""
        return self.indexes is None or len(self.ranks) == self.world_size

    def _head_json(self) -> dict:
        """The members before ``ranks`` (the records follow them, ``epoch`` last)."""
        return {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "kind": "manifest",
            "generation": self.generation,
            "attempt": self.attempt,
            "step": self.step,
            "world_size": self.world_size,
            "created_at": self.created_at,
            "committed_at": self.committed_at,
            "byteorder": self.byteorder,
            "metrics": dict(self.metrics),
            "library": self.library,
        }

    def to_json(self) -> dict:
        if self.indexes is not None:
            return json.loads(self.to_bytes())
        d = self._head_json()
        d["ranks"] = [r.to_json() for r in self.ranks]
        d["tensors"] = _entries_json(self.tensors)
        if self.epoch is not None:
            d["epoch"] = self.epoch
        return d

    def to_bytes(self) -> bytes:
        """The stored manifest: ``json.dumps(self.to_json())``, compact, byte for byte,
        with the chunk records written as text directly instead of through a dict each
        (a manifest holds one per chunk; tests/test_format.py holds the two equal). A
        version 4 root is written as a root, whatever records were read into it."""
        text = json.dumps(self._head_json(), separators=(",", ":"), allow_nan=False)
        tail = "" if self.epoch is None else f',"epoch":{json.dumps(self.epoch)}'
        if self.indexes is not None:
            from .v4 import root_text

            return f'{text[:-1]},{root_text(self.indexes, self.globals, self.reads)}{tail}}}'.encode()
        names: dict[str, str] = {}
        ranks = ",".join(_rank_text(r, names) for r in self.ranks)
        return f'{text[:-1]},"ranks":[{ranks}],"tensors":{_entries_text(self.tensors, names)}{tail}}}'.encode()

    @classmethod
    def from_json(cls, d: Any) -> "Manifest":
        what = "manifest"
        _expect(d, dict, what)
        version = _header_fields(d, what)
        if version >= 4:
            from .v4 import ROOT_FIELDS

            _fields(d, _HEAD_FIELDS | ROOT_FIELDS, {"epoch"}, what)
        else:
            _fields(d, _MANIFEST_FIELDS, {"epoch"}, what)
        if d["kind"] != "manifest":
            raise FormatError(f"manifest has kind {d['kind']!r}")
        if d["byteorder"] not in ("little", "big"):
            raise FormatError(f"manifest.byteorder is {d['byteorder']!r}")
        world_size = _int(d["world_size"], "manifest.world_size", 1, MAX_WORLD_SIZE)
        attempt = check_attempt_id(d["attempt"], "manifest.attempt")
        if version >= 4:
            return cls._root_from_json(d, attempt, world_size)
        ranks = _expect(d["ranks"], list, "manifest.ranks")
        if len(ranks) != world_size:  # before parsing them: a claimed world size costs nothing
            raise FormatError(f"manifest.ranks holds {len(ranks)} ranks, world_size is {world_size}")
        m = cls(
            **cls._head_from_json(d, attempt, world_size),
            ranks=tuple(RankState.from_json(r, f"manifest.ranks[{i}]", attempt) for i, r in enumerate(ranks)),
            tensors=_entries_from_json(d["tensors"], "manifest.tensors", attempt),
            format_version=version,
        )
        validate_ranks(m.ranks, m.world_size)
        for key, entry in m.tensors.items():
            validate_coverage(entry, f"global tensor {key!r}")
        validate_references(m)
        validate_extents(m.blobs())
        return m

    @classmethod
    def _root_from_json(cls, d: dict, attempt: str, world_size: int) -> "Manifest":
        from .v4 import parse_root

        indexes, globals_, reads = parse_root(d, attempt, world_size)
        m = cls(**cls._head_from_json(d, attempt, world_size), ranks=(), format_version=d["format_version"],
                indexes=indexes, globals=globals_, reads=reads)
        if reads.references and m.step is None:
            raise FormatError("manifest.references: a checkpoint that is not a step of a store refers to other steps")
        if any(s == m.step for s, _ in reads.references):
            raise FormatError(f"manifest.references: names its own step {m.step}")
        if m.attempt in reads.earlier:
            raise FormatError("manifest.earlier: names the manifest's own attempt")
        validate_extents((r, None, b) for r, b in enumerate(indexes))
        return m

    @staticmethod
    def _head_from_json(d: dict, attempt: str, world_size: int) -> dict:
        return dict(
            generation=_int(d["generation"], "manifest.generation", 1, MAX_GENERATION),
            attempt=attempt,
            step=None if d["step"] is None else _int(d["step"], "manifest.step", 0, MAX_STEP),
            world_size=world_size,
            created_at=_time(d["created_at"], "manifest.created_at"),
            committed_at=_time(d["committed_at"], "manifest.committed_at"),
            metrics=_expect(d["metrics"], dict, "manifest.metrics"),
            byteorder=d["byteorder"],
            library=_expect(d["library"], str, "manifest.library"),
            epoch=_int(d["epoch"], "manifest.epoch", 1, MAX_GENERATION) if "epoch" in d else None,
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> "Manifest":
        cap = max_manifest_bytes()
        if len(data) > cap:
            raise FormatError(f"manifest holds {len(data)} bytes, more than the cap of {cap} "
                              "(CKPTSTORE_MAX_MANIFEST_BYTES)")
        with gc_paused():
            return cls.from_json(loads_json(data, "manifest"))

    # -- summaries
    def blobs(self):
        """Every (rank or None for global tensors, tensor key or None, blob) of the
        checkpoint; a version 4 root's indexes are blobs of their ranks (key None, as
        skeletons). A root whose indexes were not all read cannot say: IncompleteManifestError."""
        if not self.complete:
            raise IncompleteManifestError(
                f"generation {self.generation} is a version 4 root: its records lie in its ranks' indexes, "
                "read them first (checkpoint/indexes.py)")
        for rank, blob in enumerate(self.indexes or ()):
            yield rank, None, blob
        for blob in self.tables:
            yield parse_data_file(blob.file)[1], None, blob
        for r in self.ranks:
            for key, blob in r.blobs():
                yield r.rank, key, blob
        for key, entry in self.tensors.items():
            for chunk in entry.chunks:
                yield None, key, chunk.blob

    def earlier_attempts(self) -> set[str]:
        """The earlier attempts of its location whose files it reads (``Blob.earlier``)."""
        if self.reads is not None:
            return set(self.reads.earlier)
        return {parse_data_file(b.file)[0] for _, _, b in self.blobs() if b.earlier}

    def referenced(self) -> dict[int, set[str]]:
        """{step: attempts} whose files its blobs reference in other steps' locations."""
        out: dict[int, set[str]] = {}
        if self.reads is not None:
            for step, attempt in self.reads.references:
                out.setdefault(step, set()).add(attempt)
            return out
        for _, _, b in self.blobs():
            if b.step is not None:
                out.setdefault(b.step, set()).add(parse_data_file(b.file)[0])
        return out

    def files(self) -> set[str]:
        return {blob.file for _, _, blob in self.blobs()}

    @property
    def stored_bytes(self) -> int:
        if self.reads is not None:
            return self.reads.stored_bytes
        return sum(b.length for _, _, b in self.blobs())

    @property
    def raw_bytes(self) -> int:
        if self.reads is not None:
            return self.reads.raw_bytes
        return sum(b.raw_length for _, _, b in self.blobs())

    @property
    def referenced_bytes(self) -> int:
        if self.reads is not None:
            return self.reads.referenced_bytes
        return sum(b.length for _, _, b in self.blobs() if b.step is not None)

