"""Format v1: the manifest and vote schema, stored names, and their validation.

Pure data: frozen dataclasses with JSON in and out. No I/O happens here; see
``docs/format.md`` for the rules (I1-I7) these types encode.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import posixpath
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from .errors import FormatError, UnsupportedVersionError

FORMAT_NAME = "ckptstore"
FORMAT_VERSION = 1

# ---------------------------------------------------------------------------- names
ATTEMPTS_DIR = "attempts"
_MANIFEST_RE = re.compile(r"^manifest-(\d{10})\.json$")
_ATTEMPT_RE = re.compile(r"^[0-9]{8}T[0-9]{6}-[0-9a-f]{12}$")
_STEP_DIR_RE = re.compile(r"^step-(\d{12})$")


def manifest_name(generation: int) -> str:
    return f"manifest-{generation:010d}.json"


def parse_manifest_name(name: str) -> int | None:
    """The generation of a manifest file name, or None when it is not one."""
    m = _MANIFEST_RE.match(name)
    return int(m.group(1)) if m else None


def new_attempt_id() -> str:
    """A unique, time-sortable id for one save attempt (I2)."""
    now = _dt.datetime.now(_dt.timezone.utc)
    return f"{now:%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:12]}"


def is_attempt_id(name: str) -> bool:
    return bool(_ATTEMPT_RE.match(name))


def attempt_dir(attempt: str) -> str:
    return f"{ATTEMPTS_DIR}/{attempt}"


def data_file_name(attempt: str, rank: int, stream: int) -> str:
    return f"{attempt_dir(attempt)}/data-r{rank:05d}-s{stream:02d}.bin"


def vote_name(attempt: str, rank: int) -> str:
    return f"{attempt_dir(attempt)}/vote-r{rank:05d}.json"


def abort_name(attempt: str) -> str:
    return f"{attempt_dir(attempt)}/abort.json"


def step_dir_name(step: int) -> str:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    return f"step-{step:012d}"


def parse_step_dir_name(name: str) -> int | None:
    m = _STEP_DIR_RE.match(name)
    return int(m.group(1)) if m else None


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="microseconds")


def check_relative_name(name: Any, what: str = "file name") -> str:
    """Refuse names that could escape the checkpoint (I4)."""
    if not isinstance(name, str) or not name:
        raise FormatError(f"{what} must be a non-empty string, got {name!r}")
    if name.startswith("/") or "\\" in name or "\x00" in name:
        raise FormatError(f"{what} {name!r} is absolute or contains a forbidden character")
    parts = name.split("/")
    if any(p in ("", ".", "..") for p in parts) or posixpath.normpath(name) != name:
        raise FormatError(f"{what} {name!r} escapes the checkpoint or is not normalised")
    return name


# ---------------------------------------------------------------------------- dtypes
def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dt = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dt, torch.dtype):
        raise FormatError(f"unknown dtype {name!r}")
    return dt


def itemsize(dtype_str: str) -> int:
    return dtype_from_name(dtype_str).itemsize


# ---------------------------------------------------------------------------- helpers
def _expect(obj: Any, kind: type | tuple, what: str) -> Any:
    if kind is int and isinstance(obj, bool):
        raise FormatError(f"{what} must be an int, got {obj!r}")
    if not isinstance(obj, kind):
        raise FormatError(f"{what} has the wrong type: {type(obj).__name__}")
    return obj


def _fields(d: Any, required: set[str], optional: set[str], what: str) -> dict:
    """Check a JSON object has exactly the known fields (I4: unknown fields are errors)."""
    _expect(d, dict, what)
    missing = required - d.keys()
    unknown = d.keys() - required - optional
    if missing:
        raise FormatError(f"{what} lacks field(s) {sorted(missing)}")
    if unknown:
        raise FormatError(f"{what} has unknown field(s) {sorted(unknown)}")
    return d


def _int_list(v: Any, what: str) -> tuple[int, ...]:
    _expect(v, list, what)
    for x in v:
        if _expect(x, int, what) < 0:
            raise FormatError(f"{what} holds a negative value {x}")
    return tuple(v)


# ---------------------------------------------------------------------------- records
@dataclass(frozen=True)
class Blob:
    """A stored, encoded byte range: where it lives, how to decode it, its raw hash."""

    file: str
    offset: int
    length: int  # stored (encoded) length
    raw_length: int
    codec: tuple[Mapping[str, Any], ...]  # applied in order on write, reversed on read
    xxh3_128: str  # hex digest of the raw bytes

    _FIELDS = {"file", "offset", "length", "raw_length", "codec", "xxh3_128"}

    def to_json(self) -> dict:
        return {
            "file": self.file,
            "offset": self.offset,
            "length": self.length,
            "raw_length": self.raw_length,
            "codec": [dict(c) for c in self.codec],
            "xxh3_128": self.xxh3_128,
        }

    @classmethod
    def from_json(cls, d: dict, what: str, extra: set[str] = frozenset()) -> "Blob":
        _fields(d, cls._FIELDS | extra, set(), what)
        codec = _expect(d["codec"], list, f"{what}.codec")
        for c in codec:
            _expect(c, dict, f"{what}.codec[]")
            _expect(c.get("id"), str, f"{what}.codec[].id")
        digest = _expect(d["xxh3_128"], str, f"{what}.xxh3_128")
        if not re.fullmatch(r"[0-9a-f]{32}", digest):
            raise FormatError(f"{what}.xxh3_128 is not a 32-digit hex digest")
        return cls(
            file=check_relative_name(d["file"], f"{what}.file"),
            offset=_int_list([d["offset"]], f"{what}.offset")[0],
            length=_int_list([d["length"]], f"{what}.length")[0],
            raw_length=_int_list([d["raw_length"]], f"{what}.raw_length")[0],
            codec=tuple(codec),
            xxh3_128=digest,
        )


@dataclass(frozen=True)
class Chunk:
    """A region of a tensor (offsets and sizes per dimension) and the blob holding it."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    blob: Blob

    def to_json(self) -> dict:
        return {"offsets": list(self.offsets), "sizes": list(self.sizes), **self.blob.to_json()}

    @classmethod
    def from_json(cls, d: dict, what: str) -> "Chunk":
        _expect(d, dict, what)
        blob = Blob.from_json(d, what, extra={"offsets", "sizes"})
        return cls(_int_list(d["offsets"], f"{what}.offsets"), _int_list(d["sizes"], f"{what}.sizes"), blob)


@dataclass(frozen=True)
class TensorEntry:
    """One stored tensor (for the drop-in API: one storage) and the chunks covering it."""

    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)

    def to_json(self) -> dict:
        return {"dtype": self.dtype, "shape": list(self.shape), "chunks": [c.to_json() for c in self.chunks]}

    @classmethod
    def from_json(cls, d: dict, what: str) -> "TensorEntry":
        _fields(d, {"dtype", "shape", "chunks"}, set(), what)
        dtype = _expect(d["dtype"], str, f"{what}.dtype")
        dtype_from_name(dtype)
        chunks = _expect(d["chunks"], list, f"{what}.chunks")
        return cls(
            dtype,
            _int_list(d["shape"], f"{what}.shape"),
            tuple(Chunk.from_json(c, f"{what}.chunks[{i}]") for i, c in enumerate(chunks)),
        )


@dataclass(frozen=True)
class RankState:
    """What one rank saved: its object skeleton (a pickle) and its tensors by key."""

    rank: int
    skeleton: Blob
    tensors: Mapping[str, TensorEntry]

    def to_json(self) -> dict:
        return {
            "rank": self.rank,
            "skeleton": self.skeleton.to_json(),
            "tensors": {k: v.to_json() for k, v in self.tensors.items()},
        }

    @classmethod
    def from_json(cls, d: dict, what: str) -> "RankState":
        _fields(d, {"rank", "skeleton", "tensors"}, set(), what)
        tensors = _expect(d["tensors"], dict, f"{what}.tensors")
        return cls(
            rank=_int_list([d["rank"]], f"{what}.rank")[0],
            skeleton=Blob.from_json(d["skeleton"], f"{what}.skeleton"),
            tensors={k: TensorEntry.from_json(v, f"{what}.tensors[{k!r}]") for k, v in tensors.items()},
        )

    def blobs(self):
        """Every (tensor key or None for the skeleton, blob) this rank stored."""
        yield None, self.skeleton
        for key, entry in self.tensors.items():
            for chunk in entry.chunks:
                yield key, chunk.blob


def _header_fields(d: dict, kind: str) -> None:
    if d.get("format") != FORMAT_NAME:
        raise FormatError(f"not a ckptstore {kind}: format is {d.get('format')!r}")
    version = d.get("format_version")
    if type(version) is not int or version != FORMAT_VERSION:
        raise UnsupportedVersionError(
            f"{kind} has format_version {version!r}; this ckptstore reads version {FORMAT_VERSION}"
        )


@dataclass(frozen=True)
class ReplicaHash:
    """A rank's hash of a replicated chunk another rank wrote (checked at commit)."""

    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    xxh3_128: str

    def to_json(self) -> dict:
        return {"key": self.key, "offsets": list(self.offsets), "sizes": list(self.sizes), "xxh3_128": self.xxh3_128}

    @classmethod
    def from_json(cls, d: dict, what: str) -> "ReplicaHash":
        _fields(d, {"key", "offsets", "sizes", "xxh3_128"}, set(), what)
        return cls(_expect(d["key"], str, f"{what}.key"), _int_list(d["offsets"], f"{what}.offsets"),
                   _int_list(d["sizes"], f"{what}.sizes"), _expect(d["xxh3_128"], str, f"{what}.xxh3_128"))


def _entries_json(entries: Mapping[str, TensorEntry]) -> dict:
    return {k: v.to_json() for k, v in entries.items()}


def _entries_from_json(d: Any, what: str) -> dict[str, TensorEntry]:
    _expect(d, dict, what)
    return {k: TensorEntry.from_json(v, f"{what}[{k!r}]") for k, v in d.items()}


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

    def to_json(self) -> dict:
        return {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "kind": "vote",
            "attempt": self.attempt,
            "step": self.step,
            "world_size": self.world_size,
            "rank": self.rank,
            "ok": self.ok,
            "error": self.error,
            "state": self.state.to_json() if self.state is not None else None,
            "shards": _entries_json(self.shards),
            "replicas": [r.to_json() for r in self.replicas],
            "written_at": self.written_at,
        }

    @classmethod
    def from_json(cls, d: dict) -> "Vote":
        what = "vote"
        _expect(d, dict, what)
        _header_fields(d, what)
        _fields(d, {"format", "format_version", "kind", "attempt", "step", "world_size", "rank", "ok",
                    "error", "state", "shards", "replicas", "written_at"}, set(), what)
        if d["kind"] != "vote":
            raise FormatError(f"vote has kind {d['kind']!r}")
        ok = _expect(d["ok"], bool, "vote.ok")
        state = RankState.from_json(d["state"], "vote.state") if d["state"] is not None else None
        if ok and state is None:
            raise FormatError("a yes-vote must carry the rank's state")
        replicas = _expect(d["replicas"], list, "vote.replicas")
        return cls(
            attempt=_expect(d["attempt"], str, "vote.attempt"),
            step=None if d["step"] is None else _int_list([d["step"]], "vote.step")[0],
            world_size=_int_list([d["world_size"]], "vote.world_size")[0],
            rank=_int_list([d["rank"]], "vote.rank")[0],
            ok=ok,
            error=d["error"],
            state=state,
            shards=_entries_from_json(d["shards"], "vote.shards"),
            replicas=tuple(ReplicaHash.from_json(r, f"vote.replicas[{i}]") for i, r in enumerate(replicas)),
            written_at=_expect(d["written_at"], str, "vote.written_at"),
        )


_MANIFEST_FIELDS = {
    "format", "format_version", "kind", "generation", "attempt", "step", "world_size",
    "created_at", "committed_at", "byteorder", "metrics", "library", "ranks", "tensors",
}


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

    def to_json(self) -> dict:
        return {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
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
            "ranks": [r.to_json() for r in self.ranks],
            "tensors": _entries_json(self.tensors),
        }

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_json(), separators=(",", ":"), allow_nan=False).encode()

    @classmethod
    def from_json(cls, d: Any) -> "Manifest":
        what = "manifest"
        _expect(d, dict, what)
        _header_fields(d, what)
        _fields(d, _MANIFEST_FIELDS, set(), what)
        if d["kind"] != "manifest":
            raise FormatError(f"manifest has kind {d['kind']!r}")
        if d["byteorder"] not in ("little", "big"):
            raise FormatError(f"manifest.byteorder is {d['byteorder']!r}")
        ranks = _expect(d["ranks"], list, "manifest.ranks")
        m = cls(
            generation=_int_list([d["generation"]], "manifest.generation")[0],
            attempt=_expect(d["attempt"], str, "manifest.attempt"),
            step=None if d["step"] is None else _int_list([d["step"]], "manifest.step")[0],
            world_size=_int_list([d["world_size"]], "manifest.world_size")[0],
            created_at=_expect(d["created_at"], str, "manifest.created_at"),
            committed_at=_expect(d["committed_at"], str, "manifest.committed_at"),
            ranks=tuple(RankState.from_json(r, f"manifest.ranks[{i}]") for i, r in enumerate(ranks)),
            tensors=_entries_from_json(d["tensors"], "manifest.tensors"),
            metrics=_expect(d["metrics"], dict, "manifest.metrics"),
            byteorder=d["byteorder"],
            library=_expect(d["library"], str, "manifest.library"),
        )
        validate_ranks(m.ranks, m.world_size)
        for key, entry in m.tensors.items():
            validate_coverage(entry, f"global tensor {key!r}")
        return m

    @classmethod
    def from_bytes(cls, data: bytes) -> "Manifest":
        try:
            d = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise FormatError(f"manifest is not valid JSON: {e}") from e
        return cls.from_json(d)

    # -- summaries
    def blobs(self):
        """Every (rank or None for global tensors, tensor key or None, blob) of the checkpoint."""
        for r in self.ranks:
            for key, blob in r.blobs():
                yield r.rank, key, blob
        for key, entry in self.tensors.items():
            for chunk in entry.chunks:
                yield None, key, chunk.blob

    def files(self) -> set[str]:
        return {blob.file for _, _, blob in self.blobs()}

    @property
    def stored_bytes(self) -> int:
        return sum(b.length for _, _, b in self.blobs())

    @property
    def raw_bytes(self) -> int:
        return sum(b.raw_length for _, _, b in self.blobs())


# ---------------------------------------------------------------------------- validation
def validate_ranks(ranks: tuple[RankState, ...], world_size: int) -> None:
    """I5: one state per rank 0..world_size-1, and chunks covering each tensor exactly once."""
    if world_size < 1:
        raise FormatError(f"world_size must be >= 1, got {world_size}")
    seen = sorted(r.rank for r in ranks)
    if seen != list(range(world_size)):
        raise FormatError(f"ranks {seen} do not match world_size {world_size}")
    for r in ranks:
        for key, entry in r.tensors.items():
            validate_coverage(entry, f"rank {r.rank} tensor {key!r}")


def validate_coverage(entry: TensorEntry, what: str) -> None:
    """Chunks lie inside the tensor, do not overlap, and add up to it; lengths agree."""
    nd = len(entry.shape)
    size = itemsize(entry.dtype)
    total = 0
    boxes = []
    for i, c in enumerate(entry.chunks):
        if len(c.offsets) != nd or len(c.sizes) != nd:
            raise FormatError(f"{what}: chunk {i} has {len(c.offsets)} dims, tensor has {nd}")
        for d in range(nd):
            if c.offsets[d] + c.sizes[d] > entry.shape[d]:
                raise FormatError(f"{what}: chunk {i} lies outside the tensor in dim {d}")
        vol = math.prod(c.sizes)
        if c.blob.raw_length != vol * size:
            raise FormatError(f"{what}: chunk {i} raw_length {c.blob.raw_length} != {vol * size}")
        total += vol
        if vol:
            boxes.append((c.offsets, c.sizes, i))
    if total != entry.numel:
        raise FormatError(f"{what}: chunks cover {total} of {entry.numel} elements")
    _check_disjoint(boxes, what)


def _check_disjoint(boxes: list, what: str) -> None:
    # Sweep along dim 0: only boxes still open at a box's start can overlap it.
    if not boxes or not boxes[0][0]:
        if len(boxes) > 1:
            raise FormatError(f"{what}: a 0-dim tensor has {len(boxes)} chunks")
        return
    boxes.sort()
    active: list = []
    for off, sz, i in boxes:
        active = [b for b in active if b[0][0] + b[1][0] > off[0]]
        for o2, s2, j in active:
            if all(off[d] < o2[d] + s2[d] and o2[d] < off[d] + sz[d] for d in range(len(off))):
                raise FormatError(f"{what}: chunks {j} and {i} overlap")
        active.append((off, sz, i))
