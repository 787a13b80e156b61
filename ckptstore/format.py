"""The storage format (versions 1 and 2): the manifest and vote schema, stored names,
and their validation.

Pure data: frozen dataclasses with JSON in and out. No I/O happens here; see
``docs/format.md`` for the rules (I1-I7) these types encode.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import functools
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from ._gc import gc_paused
from .config import config
from .errors import FormatError, UnsupportedVersionError


class IncompleteManifestError(FormatError):
    """A version 4 root was asked for records that lie in indexes it was not given."""

FORMAT_NAME = "ckptstore"
FORMAT_VERSION = 3  # what this writer writes
# What this reader reads. Version 2 adds one thing to version 1: a skeleton may name a
# rank-local storage by its index among the rank's tensors (docs/format.md). Version 3
# adds references: a blob may lie in another step's location of the same store
# (``Blob.step``: an incremental save recorded an unchanged chunk instead of writing it).
# Version 4 (format_index.py) replaces the one manifest of a multi-rank save by a root
# naming one index per rank; a one-rank save still writes version 3.
READ_VERSIONS = (1, 2, 3, 4)
REFERENCE_VERSION = 3  # the first version whose blobs may carry ``step``
# The dtypes whose storages torch pickles typed (FloatStorage, ...): an index persistent
# id stands for a typed storage of its entry's dtype when it is one of these, else for
# bytes. Fixed here, in the format, not read from the running torch's table.
TYPED_STORAGE_DTYPES = frozenset({
    "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
    "complex128", "complex64", "quint8", "qint8", "qint32", "quint4x2", "quint2x4",
})

# ---------------------------------------------------------------------------- names
# Stored names live in ``names``; re-exported here for the callers that know them as format's.
from .names import (  # noqa: E402, F401 (re-exported: callers know these as format's)
    ATTEMPTS_DIR,
    MAX_GENERATION,
    MAX_STEP,
    MAX_WORLD_SIZE,
    abort_name,
    attempt_dir,
    check_attempt_id,
    check_data_file,
    check_relative_name,
    data_file_name,
    is_attempt_id,
    manifest_name,
    new_attempt_id,
    parse_data_file,
    parse_manifest_name,
    parse_step_dir_name,
    step_dir_name,
    vote_name,
)

_DIGEST_RE = re.compile(r"[0-9a-f]{32}")


@functools.lru_cache(maxsize=4096)
def _data_file_attempt(name) -> str | None:
    """The attempt of a valid data file name, else None (memoised: every blob of a rank
    names the same file)."""
    try:
        check_relative_name(name)
    except (FormatError, TypeError):
        return None
    parsed = parse_data_file(name)
    return parsed[0] if parsed else None

# ---------------------------------------------------------------------------- size caps
# Claims a reader checks before it allocates or loops on them (docs/format.md, "Size
# caps"): a hostile or damaged manifest costs at most what it honestly holds.
MAX_NDIM = 64
MAX_BYTES = 1 << 62  # any offset, length, tensor size or element count
ZSTD_MAX_RATIO = 32768  # a zstd block is >= 4 bytes (RLE) and decodes to <= 128 KiB
def max_manifest_bytes() -> int:
    """The cap on a manifest's (and a vote's) size: ``config().max_manifest_bytes``
    (``CKPTSTORE_MAX_MANIFEST_BYTES``, 256 MiB by default)."""
    return config().max_manifest_bytes


MAX_MARKER_BYTES = 64 << 10  # abort markers, pins, heartbeats
# The exact-cover check sorts 2**k corner rows per chunk, k = the dimensions chunks
# split (1 or 2 in practice, at most 3 for FSDP over TP): both bounds keep a hostile
# manifest's cost per tensor near what an honest one of its size costs.
_CORNER_DIMS = 5
_MAX_CORNERS = 1 << 21  # corner rows per tensor (about 50 MiB of int64 at k = 3)


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="microseconds")


def parse_time(iso: str) -> float:
    """Epoch seconds of a stored ISO 8601 time (validated when its record was parsed)."""
    return _dt.datetime.fromisoformat(iso).timestamp()


def _time(v: Any, what: str) -> str:
    _expect(v, str, what)
    try:
        parse_time(v)
    except (ValueError, OverflowError, OSError) as e:
        raise FormatError(f"{what} {v[:64]!r} is not an ISO 8601 time") from e
    return v


def loads_json(data: bytes, what: str) -> Any:
    """Strict JSON: duplicate keys, NaN/Infinity, bad UTF-8 and runaway nesting are a
    FormatError naming ``what``, never another exception type."""
    try:
        return json.loads(data, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except FormatError as e:
        raise FormatError(f"{what}: {e}") from None
    except (ValueError, UnicodeDecodeError, RecursionError, TypeError) as e:
        raise FormatError(f"{what} is not valid JSON: {type(e).__name__}: {str(e)[:200]}") from None


def _no_duplicates(pairs: list) -> dict:
    d = dict(pairs)
    if len(d) != len(pairs):
        seen = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise FormatError(f"duplicate JSON key {dup[:64]!r}")
    return d


def _no_constant(name: str):
    raise FormatError(f"JSON constant {name} is not allowed")


# ---------------------------------------------------------------------------- dtypes
# Canonical stored names (``float32``, never an alias like ``float``), looked up once:
# every chunk record of a manifest names its dtype.
_DTYPE_NAMES: dict[torch.dtype, str] = {}
_DTYPES: dict[str, torch.dtype] = {}
for _dtype in {v for v in vars(torch).values() if isinstance(v, torch.dtype)}:
    _DTYPE_NAMES[_dtype] = str(_dtype).removeprefix("torch.")
    _DTYPES[_DTYPE_NAMES[_dtype]] = _dtype
del _dtype


def dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    return name if name is not None else str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """The dtype of its canonical stored name (``float32``, never an alias like ``float``)."""
    dt = _DTYPES.get(name) if type(name) is str else None
    if dt is None:
        raise FormatError(f"unknown dtype {name!r}")
    return dt


def itemsize(dtype_str: str) -> int:
    return dtype_from_name(dtype_str).itemsize


# ---------------------------------------------------------------------------- helpers
# Hot on large manifests (every chunk record passes here): error texts are built as
# ``what + field`` only when a check fails, never on the way through; a record's own
# name (``manifest.ranks[0].tensors['w'].chunks[0]``) is a _Name until then.
class _Name:
    """``template.format(*args)``, formatted only when an error message uses it."""

    __slots__ = ("template", "args")

    def __init__(self, template: str, *args):
        self.template = template
        self.args = args

    def __str__(self) -> str:
        return self.template.format(*self.args)


def _expect(obj: Any, kind: type | tuple, what: str, field: str = "") -> Any:
    if kind is int and isinstance(obj, bool):
        raise FormatError(f"{what}{field} must be an int, got {obj!r}")
    if not isinstance(obj, kind):
        raise FormatError(f"{what}{field} has the wrong type: {type(obj).__name__}")
    return obj


def _fields(d: Any, required: set[str] | frozenset, optional: set[str], what: str) -> dict:
    """Check a JSON object has exactly the known fields (I4: unknown fields are errors)."""
    _expect(d, dict, what)
    if not optional and d.keys() == required:
        return d
    missing = required - d.keys()
    unknown = d.keys() - required - optional
    if missing:
        raise FormatError(f"{what} lacks field(s) {sorted(missing)}")
    if unknown:
        raise FormatError(f"{what} has unknown field(s) {sorted(unknown)}")
    return d


def _int_list(v: Any, what: str, field: str = "", max_len: int = MAX_NDIM) -> tuple[int, ...]:
    _expect(v, list, what, field)
    if len(v) > max_len:
        raise FormatError(f"{what}{field} has {len(v)} entries, at most {max_len} are allowed")
    for x in v:
        if type(x) is not int:
            _expect(x, int, what, field)
        if not 0 <= x <= MAX_BYTES:
            raise FormatError(f"{what}{field} holds {x}, outside 0 .. 2**62")
    return tuple(v)


def _int(v: Any, what: str, low: int = 0, high: int = MAX_BYTES, field: str = "") -> int:
    if type(v) is not int:
        _expect(v, int, what, field)
    if not low <= v <= high:
        raise FormatError(f"{what}{field} is {v}, outside {low} .. {high}")
    return v


def _codec_chain(codec: Any, blob: str) -> tuple[dict, ...]:
    """The only chains versions 1 and 2 know, with exactly their parameters (I4).
    ``blob`` names the record holding it; its name is built only for an error."""
    if codec == []:
        return ()
    what = f"{blob}.codec"
    _expect(codec, list, what)
    for c in codec:
        _expect(c, dict, what, "[]")
    ids = [c.get("id") for c in codec]
    if ids not in ([], ["zstd"], ["shuffle", "zstd"]):
        raise FormatError(f"{what} is an unknown codec chain {ids}")
    for c in codec:
        if c["id"] == "zstd":
            if c.keys() != _ZSTD_FIELDS:
                _fields(c, _ZSTD_FIELDS, set(), f"{what} zstd record")
            _int(c["level"], what, 1, 22, field=" zstd level")
        else:
            if c.keys() != _SHUFFLE_FIELDS:
                _fields(c, _SHUFFLE_FIELDS, set(), f"{what} shuffle record")
            _int(c["elementsize"], what, 1, 64, field=" shuffle elementsize")
    return tuple(codec)


_ZSTD_FIELDS = frozenset({"id", "level"})
_SHUFFLE_FIELDS = frozenset({"id", "elementsize"})


# ---------------------------------------------------------------------------- records
@dataclass(frozen=True, slots=True)
class Blob:
    """A stored, encoded byte range: where it lives, how to decode it, its raw hash."""

    file: str
    offset: int
    length: int  # stored (encoded) length
    raw_length: int
    codec: tuple[Mapping[str, Any], ...]  # applied in order on write, reversed on read
    xxh3_128: str  # hex digest of the raw bytes
    # A reference (format version 3): the blob lies in the location of this step of the
    # same store, in a file of that location's attempt; None: in this checkpoint's files.
    step: int | None = None
    # A reference within this location (version 3, drop-in saves to one path): ``file``
    # is a data file of an older generation's attempt here.
    earlier: bool = False

    _FIELDS = frozenset({"file", "offset", "length", "raw_length", "codec", "xxh3_128"})
    _CHUNK_FIELDS = _FIELDS | {"offsets", "sizes"}

    def to_json(self) -> dict:
        d = {
            "file": self.file,
            "offset": self.offset,
            "length": self.length,
            "raw_length": self.raw_length,
            "codec": [dict(c) for c in self.codec],
            "xxh3_128": self.xxh3_128,
        }
        if self.step is not None:
            d["step"] = self.step
        if self.earlier:
            d["earlier"] = True
        return d

    @classmethod
    def from_json(cls, d: dict, what: str, attempt: str, fields: frozenset = _FIELDS) -> "Blob":
        """Parse and bound one blob record; ``attempt`` is the only attempt its file may
        lie in, unless the record is a reference (``step``), whose file may be any
        attempt's (of that step's location)."""
        step, earlier = None, False
        if type(d) is not dict or d.keys() != fields:
            _fields(d, fields, {"step", "earlier"}, what)
            if "step" in d:
                step = _int(d["step"], what, 0, MAX_STEP, ".step")
            if "earlier" in d:
                if d["earlier"] is not True:
                    raise FormatError(f"{what}.earlier must be true when present")
                if step is not None:
                    raise FormatError(f"{what}: a reference names another step or an earlier attempt here, not both")
                earlier = True
        codec = _codec_chain(d["codec"], what)
        digest = d["xxh3_128"]
        if type(digest) is not str or not _DIGEST_RE.fullmatch(digest):
            raise FormatError(f"{what}.xxh3_128 is not a 32-digit hex digest")
        length = _int(d["length"], what, field=".length")
        raw_length = _int(d["raw_length"], what, field=".raw_length")
        if not codec and raw_length != length:
            raise FormatError(f"{what}: a raw blob's raw_length {raw_length} != its length {length}")
        if codec and raw_length > length * ZSTD_MAX_RATIO:
            raise FormatError(f"{what}: {length} zstd bytes cannot decode to raw_length {raw_length}")
        file = d["file"]
        if type(file) is not str:  # (before the memoised name check, which could not even hash a list)
            raise FormatError(f"{what}.file must be a string, got {type(file).__name__}")
        if step is not None or earlier:
            if _data_file_attempt(file) is None:
                check_data_file(file, "", f"{what}.file")  # raises, naming what is wrong
            if earlier and _data_file_attempt(file) == attempt:
                raise FormatError(f"{what}: a reference to an earlier attempt names this checkpoint's own")
        elif _data_file_attempt(file) != attempt:
            check_data_file(file, attempt, f"{what}.file")  # raises, naming what is wrong
        if cls is not Blob:
            return cls(file=file, offset=_int(d["offset"], what, field=".offset"), length=length,
                       raw_length=raw_length, codec=codec, xxh3_128=digest, step=step, earlier=earlier)
        return _new_blob(file, _int(d["offset"], what, field=".offset"), length, raw_length, codec, digest, step,
                         earlier)


def _blob_maker():
    """``Blob(...)`` for the parser, which has checked every value: a frozen dataclass's
    ``__init__`` sets each of the eight fields through ``object.__setattr__``; setting
    the slots directly is 3x faster (2 us a chunk of a manifest's parse)."""
    new = object.__new__
    (file_, offset_, length_, raw_, codec_, digest_, step_, earlier_) = (
        Blob.__dict__[f.name].__set__ for f in dataclasses.fields(Blob))

    def make(file, offset, length, raw_length, codec, xxh3_128, step, earlier):
        b = new(Blob)
        file_(b, file), offset_(b, offset), length_(b, length), raw_(b, raw_length)
        codec_(b, codec), digest_(b, xxh3_128), step_(b, step), earlier_(b, earlier)
        return b

    return make


_new_blob = _blob_maker()


@dataclass(frozen=True, slots=True)
class Chunk:
    """A region of a tensor (offsets and sizes per dimension) and the blob holding it."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    blob: Blob

    def to_json(self) -> dict:
        return {"offsets": list(self.offsets), "sizes": list(self.sizes), **self.blob.to_json()}

    @classmethod
    def from_json(cls, d: dict, what: str, attempt: str) -> "Chunk":
        _expect(d, dict, what)
        blob = Blob.from_json(d, what, attempt, Blob._CHUNK_FIELDS)
        return cls(_int_list(d["offsets"], what, ".offsets"), _int_list(d["sizes"], what, ".sizes"), blob)


_ENTRY_FIELDS = frozenset({"dtype", "shape", "chunks"})


@dataclass(frozen=True, slots=True)
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
    def from_json(cls, d: dict, what: str, attempt: str) -> "TensorEntry":
        if type(d) is not dict or d.keys() != _ENTRY_FIELDS:
            _fields(d, _ENTRY_FIELDS, set(), what)
        dtype = _expect(d["dtype"], str, what, ".dtype")
        size = dtype_from_name(dtype).itemsize
        shape = _int_list(d["shape"], what, ".shape")
        if math.prod(shape) * size > MAX_BYTES:
            raise FormatError(f"{what}: shape {list(shape)} of {dtype} exceeds 2**62 bytes")
        chunks = _expect(d["chunks"], list, what, ".chunks")
        return cls(dtype, shape, tuple([Chunk.from_json(c, _Name("{}.chunks[{}]", what, i), attempt)
                                        for i, c in enumerate(chunks)]))


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
    def from_json(cls, d: dict, what: str, attempt: str) -> "RankState":
        _fields(d, {"rank", "skeleton", "tensors"}, set(), what)
        tensors = _expect(d["tensors"], dict, f"{what}.tensors")
        return cls(
            rank=_int(d["rank"], f"{what}.rank", 0, MAX_WORLD_SIZE - 1),
            skeleton=Blob.from_json(d["skeleton"], f"{what}.skeleton", attempt),
            tensors={k: TensorEntry.from_json(v, _Name("{}.tensors[{!r}]", what, k), attempt)
                     for k, v in tensors.items()},
        )

    def blobs(self):
        """Every (tensor key or None for the skeleton, blob) this rank stored."""
        yield None, self.skeleton
        for key, entry in self.tensors.items():
            for chunk in entry.chunks:
                yield key, chunk.blob


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


@dataclass(frozen=True, slots=True)
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
        digest = _expect(d["xxh3_128"], str, f"{what}.xxh3_128")
        if not _DIGEST_RE.fullmatch(digest):
            raise FormatError(f"{what}.xxh3_128 is not a 32-digit hex digest")
        return cls(_expect(d["key"], str, f"{what}.key"), _int_list(d["offsets"], f"{what}.offsets"),
                   _int_list(d["sizes"], f"{what}.sizes"), digest)


def _ints(values) -> str:
    return ",".join([str(int(v)) for v in values])


def _blob_fields(b: Blob, names: dict[str, str]) -> str:
    """A blob's JSON members, as Blob.to_json gives them, without the braces."""
    file = names.get(b.file)
    if file is None:
        file = names[b.file] = json.dumps(b.file)
    codec = "[]" if not b.codec else json.dumps([dict(c) for c in b.codec], separators=(",", ":"), allow_nan=False)
    step = "" if b.step is None else f',"step":{int(b.step)}'
    if b.earlier:
        step += ',"earlier":true'
    return (f'"file":{file},"offset":{int(b.offset)},"length":{int(b.length)},"raw_length":{int(b.raw_length)},'
            f'"codec":{codec},"xxh3_128":{json.dumps(b.xxh3_128)}{step}')


def _entries_text(entries: Mapping[str, TensorEntry], names: dict[str, str]) -> str:
    """``json.dumps(_entries_json(entries))``, compact, written directly."""
    parts = []
    for key, e in entries.items():
        chunks = ",".join([f'{{"offsets":[{_ints(c.offsets)}],"sizes":[{_ints(c.sizes)}],{_blob_fields(c.blob, names)}}}'
                           for c in e.chunks])
        parts.append(f'{json.dumps(key)}:{{"dtype":{json.dumps(e.dtype)},"shape":[{_ints(e.shape)}],"chunks":[{chunks}]}}')
    return "{" + ",".join(parts) + "}"


def _rank_text(r: "RankState", names: dict[str, str]) -> str:
    return f'{{"rank":{int(r.rank)},"skeleton":{{{_blob_fields(r.skeleton, names)}}},"tensors":{_entries_text(r.tensors, names)}}}'


def _entries_json(entries: Mapping[str, TensorEntry]) -> dict:
    return {k: v.to_json() for k, v in entries.items()}


def _entries_from_json(d: Any, what: str, attempt: str) -> dict[str, TensorEntry]:
    _expect(d, dict, what)
    return {k: TensorEntry.from_json(v, _Name("{}[{!r}]", what, k), attempt) for k, v in d.items()}


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
        from .format_index import Summary, index_blob

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
            from .format_index import root_text

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
            from .format_index import ROOT_FIELDS

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
        from .format_index import parse_root

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


# ---------------------------------------------------------------------------- validation
def validate_ranks(ranks: tuple[RankState, ...], world_size: int) -> None:
    """I5: one state per rank 0..world_size-1, and chunks covering each tensor exactly once."""
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise FormatError(f"world_size must be in 1 .. {MAX_WORLD_SIZE}, got {world_size}")
    seen = sorted(r.rank for r in ranks)
    if len(seen) != world_size or seen != list(range(world_size)):
        raise FormatError(f"ranks {seen[:16]}{'...' if len(seen) > 16 else ''} do not match world_size {world_size}")
    for r in ranks:
        for key, entry in r.tensors.items():
            validate_coverage(entry, _Name("rank {} tensor {!r}", r.rank, key))


def validate_references(m: "Manifest") -> None:
    """References exist from format version 3 on: ``Blob.step`` in a step's checkpoint
    of a store, pointing at another step; ``Blob.earlier`` at an earlier attempt of the
    same location."""
    if m.format_version < REFERENCE_VERSION and any(b.earlier for _, _, b in m.blobs()):
        raise FormatError(f"a blob refers to an earlier attempt, which format version {m.format_version} "
                          f"cannot say (references exist from version {REFERENCE_VERSION})")
    refs = [b for _, _, b in m.blobs() if b.step is not None]
    if not refs:
        return
    if m.format_version < REFERENCE_VERSION:
        raise FormatError(f"a blob refers to step {refs[0].step}, which format version {m.format_version} "
                          f"cannot say (references exist from version {REFERENCE_VERSION})")
    if m.step is None:
        raise FormatError(f"a blob refers to step {refs[0].step}, but this checkpoint is not a step of a store")
    if any(b.step == m.step for b in refs):
        raise FormatError(f"a blob refers to step {m.step}, its own step: a blob of its own files names no step")


def validate_extents(blobs) -> None:
    """No two blobs share stored bytes: each byte of a data file belongs to one blob, so
    what a manifest can make a reader allocate is bounded by its files' real sizes
    (raw blobs 1x, zstd at most ZSTD_MAX_RATIO x); a blob another step stores counts as
    that step's file, and may be referenced once. ``blobs``: (rank, key, blob)."""
    spans = sorted((((-1 if b.step is None else b.step, b.file), b.offset, b.offset + b.length, rank, key)
                    for rank, key, b in blobs if b.length), key=lambda s: s[:3])
    for (f1, _, end1, r1, k1), (f2, start2, _, r2, k2) in zip(spans, spans[1:]):
        if f1 == f2 and start2 < end1:
            a = "skeleton" if k1 is None else repr(k1)
            b = "skeleton" if k2 is None else repr(k2)
            where = f1[1] if f1[0] < 0 else f"{f1[1]} of step {f1[0]}"
            raise FormatError(f"blobs of {a} (rank {r1}) and {b} (rank {r2}) overlap in {where} at byte {start2}")


def validate_coverage(entry: TensorEntry, what: str) -> None:
    """Chunks lie inside the tensor, do not overlap, and add up to it; lengths agree.

    O(n log n) in the number of chunks (see :func:`check_exact_cover`), so a manifest
    of many chunks costs what it holds, never n squared."""
    shape = entry.shape
    nd = len(shape)
    size = itemsize(entry.dtype)
    chunks = entry.chunks
    if len(chunks) == 1 and chunks[0].sizes == shape and len(chunks[0].offsets) == nd and not any(chunks[0].offsets):
        # one chunk, the whole tensor (most tensors): only its length is left to check
        if chunks[0].blob.raw_length != math.prod(shape) * size:
            raise FormatError(f"{what}: chunk 0 raw_length {chunks[0].blob.raw_length} != {math.prod(shape) * size}")
        return
    total, boxes = validate_chunks(entry, what)
    if total != entry.numel:
        raise FormatError(f"{what}: chunks cover {total} of {entry.numel} elements")
    check_exact_cover(shape, boxes, what)


def validate_chunks(entry: TensorEntry, what: str) -> tuple[int, list]:
    """Each chunk lies inside the tensor, with the tensor's number of dimensions, and
    its raw_length is its region's bytes (a part of a tensor, as a version 4 index holds
    of a global one, can be checked no further). Returns (elements, non-empty chunks)."""
    shape = entry.shape
    nd = len(shape)
    size = itemsize(entry.dtype)
    total = 0
    boxes = []
    for i, c in enumerate(entry.chunks):
        if len(c.offsets) != nd or len(c.sizes) != nd:
            raise FormatError(f"{what}: chunk {i} has {len(c.offsets)} dims, tensor has {nd}")
        for d in range(nd):
            if c.offsets[d] + c.sizes[d] > shape[d]:
                raise FormatError(f"{what}: chunk {i} lies outside the tensor in dim {d}")
        vol = math.prod(c.sizes)
        if c.blob.raw_length != vol * size:
            raise FormatError(f"{what}: chunk {i} raw_length {c.blob.raw_length} != {vol * size}")
        total += vol
        if vol:
            boxes.append(c)
    return total, boxes


def check_exact_cover(shape: tuple[int, ...], boxes: list, what: str) -> None:
    """Non-empty boxes inside ``shape`` cover it exactly once, by signed corner counts.

    A box's indicator function is the signed sum of orthant steps at its 2**k corners
    (sign (-1)**(number of upper bounds)), and steps at distinct points are linearly
    independent. So the boxes cover every element exactly once iff their summed signed
    corners equal those of the whole tensor: one sort of n * 2**k corner rows, where k
    counts the dimensions some chunk splits (1 or 2 in practice)."""
    split = [d for d in range(len(shape)) if any(c.offsets[d] != 0 or c.sizes[d] != shape[d] for c in boxes)]
    if not split:
        return  # every box is the whole tensor, and their volumes add up to it: exactly one
    import numpy as np

    k, n = len(split), len(boxes)
    if k > _CORNER_DIMS or n << k > _MAX_CORNERS:
        raise FormatError(f"{what}: {n} chunks split {k} dimensions; a reader checks at most "
                          f"{_CORNER_DIMS} split dimensions and {_MAX_CORNERS} chunk corners per tensor")
    lo = np.array([[c.offsets[d] for d in split] for c in boxes], dtype=np.int64).reshape(n, k)
    hi = lo + np.array([[c.sizes[d] for d in split] for c in boxes], dtype=np.int64).reshape(n, k)
    corners, signs = [], []
    for mask in range(1 << k):
        upper = np.array([(mask >> j) & 1 for j in range(k)], dtype=bool)
        corners.append(np.where(upper, hi, lo))
        signs.append(np.full(n, -1 if bin(mask).count("1") % 2 else 1, dtype=np.int64))
    rows = np.concatenate(corners)
    weights = np.concatenate(signs)
    order = np.lexsort(rows.T[::-1])
    rows, weights = rows[order], weights[order]
    starts = np.flatnonzero(np.r_[True, np.any(rows[1:] != rows[:-1], axis=1)])
    sums = np.add.reduceat(weights, starts)
    got = {tuple(rows[s].tolist()): int(w) for s, w in zip(starts, sums) if w}
    full = [shape[d] for d in split]
    want = {tuple(full[j] if (mask >> j) & 1 else 0 for j in range(k)): (-1 if bin(mask).count("1") % 2 else 1)
            for mask in range(1 << k)}
    if got != want:
        where = sorted(set(got.items()) ^ set(want.items()))[0][0]
        at = [0] * len(shape)
        for j, d in enumerate(split):
            at[d] = where[j]
        raise FormatError(f"{what}: chunks overlap or leave a gap (near element {at})")
