"""The records manifests, votes and indexes are made of: :class:`Blob` (a stored,
encoded byte range), :class:`Chunk`, :class:`TensorEntry`, :class:`RankState` and
:class:`ReplicaHash`, each a frozen dataclass with its strict JSON parser; the codec
chains a blob may name."""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import FormatError
from ..names import MAX_STEP, MAX_WORLD_SIZE, check_data_file, check_relative_name, parse_data_file
from .constants import MAX_BYTES, ZSTD_MAX_RATIO
from .dtypes import dtype_from_name, itemsize
from .strict import LazyName, bounded_int, check_fields, expect, int_list

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


def _codec_chain(codec: Any, blob: str) -> tuple[dict, ...]:
    """The only chains versions 1 and 2 know, with exactly their parameters (I4).
    ``blob`` names the record holding it; its name is built only for an error."""
    if codec == []:
        return ()
    what = f"{blob}.codec"
    expect(codec, list, what)
    for c in codec:
        expect(c, dict, what, "[]")
    ids = [c.get("id") for c in codec]
    if ids not in ([], ["zstd"], ["shuffle", "zstd"]):
        raise FormatError(f"{what} is an unknown codec chain {ids}")
    for c in codec:
        if c["id"] == "zstd":
            if c.keys() != _ZSTD_FIELDS:
                check_fields(c, _ZSTD_FIELDS, set(), f"{what} zstd record")
            bounded_int(c["level"], what, 1, 22, field=" zstd level")
        else:
            if c.keys() != _SHUFFLE_FIELDS:
                check_fields(c, _SHUFFLE_FIELDS, set(), f"{what} shuffle record")
            bounded_int(c["elementsize"], what, 1, 64, field=" shuffle elementsize")
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
            check_fields(d, fields, {"step", "earlier"}, what)
            if "step" in d:
                step = bounded_int(d["step"], what, 0, MAX_STEP, ".step")
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
        length = bounded_int(d["length"], what, field=".length")
        raw_length = bounded_int(d["raw_length"], what, field=".raw_length")
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
            return cls(file=file, offset=bounded_int(d["offset"], what, field=".offset"), length=length,
                       raw_length=raw_length, codec=codec, xxh3_128=digest, step=step, earlier=earlier)
        return _new_blob(file, bounded_int(d["offset"], what, field=".offset"), length, raw_length, codec, digest,
                         step, earlier)


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
        expect(d, dict, what)
        blob = Blob.from_json(d, what, attempt, Blob._CHUNK_FIELDS)
        return cls(int_list(d["offsets"], what, ".offsets"), int_list(d["sizes"], what, ".sizes"), blob)


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
            check_fields(d, _ENTRY_FIELDS, set(), what)
        dtype = expect(d["dtype"], str, what, ".dtype")
        size = dtype_from_name(dtype).itemsize
        shape = int_list(d["shape"], what, ".shape")
        if math.prod(shape) * size > MAX_BYTES:
            raise FormatError(f"{what}: shape {list(shape)} of {dtype} exceeds 2**62 bytes")
        chunks = expect(d["chunks"], list, what, ".chunks")
        return cls(dtype, shape, tuple([Chunk.from_json(c, LazyName("{}.chunks[{}]", what, i), attempt)
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
        check_fields(d, {"rank", "skeleton", "tensors"}, set(), what)
        tensors = expect(d["tensors"], dict, f"{what}.tensors")
        return cls(
            rank=bounded_int(d["rank"], f"{what}.rank", 0, MAX_WORLD_SIZE - 1),
            skeleton=Blob.from_json(d["skeleton"], f"{what}.skeleton", attempt),
            tensors={k: TensorEntry.from_json(v, LazyName("{}.tensors[{!r}]", what, k), attempt)
                     for k, v in tensors.items()},
        )

    def blobs(self):
        """Every (tensor key or None for the skeleton, blob) this rank stored."""
        yield None, self.skeleton
        for key, entry in self.tensors.items():
            for chunk in entry.chunks:
                yield key, chunk.blob



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
        check_fields(d, {"key", "offsets", "sizes", "xxh3_128"}, set(), what)
        digest = expect(d["xxh3_128"], str, f"{what}.xxh3_128")
        if not _DIGEST_RE.fullmatch(digest):
            raise FormatError(f"{what}.xxh3_128 is not a 32-digit hex digest")
        return cls(expect(d["key"], str, f"{what}.key"), int_list(d["offsets"], f"{what}.offsets"),
                   int_list(d["sizes"], f"{what}.sizes"), digest)


def entries_from_json(d: Any, what: str, attempt: str) -> dict[str, TensorEntry]:
    """A JSON object of tensor entries by key (a manifest's ``tensors``, a vote's or index's ``shards``)."""
    expect(d, dict, what)
    return {k: TensorEntry.from_json(v, LazyName("{}[{!r}]", what, k), attempt) for k, v in d.items()}

