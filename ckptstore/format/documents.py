"""The documents: :class:`Vote` (phase one of the commit) and :class:`Manifest` (a
committed checkpoint): their fields, what a manifest sums up, and the thin dispatcher
that sends JSON in and out to the code of the document's format version: ``v3.py``
(versions 1 to 3: the document holds every record), ``v4.py`` (version 4: votes and
a root that name per-rank indexes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from .._gc import gc_paused
from ..errors import FormatError
from ..names import parse_data_file
from . import v3, v4
from .constants import FORMAT_VERSION, INDEX_VERSION, max_manifest_bytes
from .head import check_header
from .index import GlobalEntry, Reads, Summary
from .records import Blob, RankState, ReplicaHash, TensorEntry
from .strict import expect, loads_json, utc_now


class IncompleteManifestError(FormatError):
    """A version 4 root was asked for records that lie in indexes it was not given."""


def _shape(version: int):
    """The module that reads and writes the documents of format ``version``."""
    return v4 if version >= INDEX_VERSION else v3


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
    # Version 4 (v4.py): a yes-vote names the rank's index instead of holding its
    # records (``state``, ``shards`` and ``replicas`` stay empty), and sums them up.
    index: Blob | None = None
    summary: Summary | None = None

    @property
    def format_version(self) -> int:
        return INDEX_VERSION if self.index is not None else FORMAT_VERSION

    def to_json(self) -> dict:
        return _shape(self.format_version).vote_json(self)

    def to_bytes(self) -> bytes:
        """The stored vote: ``json.dumps(self.to_json())``, compact, byte for byte, with
        the chunk records written as text directly (as :meth:`Manifest.to_bytes`)."""
        return _shape(self.format_version).vote_bytes(self)

    @classmethod
    def from_json(cls, d: dict) -> "Vote":
        expect(d, dict, "vote")
        return _shape(check_header(d, "vote")).vote_from_json(cls, d)

    @classmethod
    def from_bytes(cls, data: bytes, what: str = "vote") -> "Vote":
        with gc_paused():
            return cls.from_json(loads_json(data, what))


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
    # Version 4, a root (v4.py): rank i's index blob, the global tensors' dtypes, shapes
    # and holders, and what its blobs read. As read, ``ranks`` and ``tensors`` are
    # empty; checkpoint/indexes.py fills them from the indexes a reader needs (all of
    # them: ``complete``).
    indexes: tuple[Blob, ...] | None = None
    globals: Mapping[str, GlobalEntry] = field(default_factory=dict)
    reads: Reads | None = None
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

    def to_json(self) -> dict:
        return (v4 if self.indexed else v3).manifest_json(self)

    def to_bytes(self) -> bytes:
        """The stored manifest: ``json.dumps(self.to_json())``, compact, byte for byte,
        with the chunk records written as text directly instead of through a dict each
        (a manifest holds one per chunk; tests/test_format.py holds the two equal). A
        version 4 root is written as a root, whatever records were read into it."""
        return (v4 if self.indexed else v3).manifest_bytes(self)

    @classmethod
    def from_json(cls, d: Any) -> "Manifest":
        expect(d, dict, "manifest")
        version = check_header(d, "manifest")
        return _shape(version).manifest_from_json(cls, d, version)

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

