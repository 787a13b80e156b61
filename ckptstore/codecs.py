"""Codecs: bytes -> bytes transforms, each recording its own id and parameters.

A chunk's ``codec`` field is the list of codec records applied on write, in order;
reading applies their inverses in reverse. An empty list means raw bytes. Known ids:

- ``{"id": "shuffle", "elementsize": N}``: byte-plane shuffle (blosc's filter), which
  groups the bytes of each element by significance so that zstd finds the redundancy in
  float exponents.
- ``{"id": "zstd", "level": L}``: zstandard frame with the content size in its header.

``encode`` picks per chunk: it trial-compresses a small sample with and without the
shuffle and keeps compression only when it saves enough to pay for the CPU it costs on
write and, above all, on every read. A :class:`CodecMemo`, owned by the caller (the
process runtime holds one), lets it reuse that decision for the same chunk in later
saves; this module keeps no state between calls but per-thread zstd contexts.
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass
from typing import Any, Mapping

import zstandard

from . import native
from .errors import FormatError

_local = threading.local()

SAMPLE_BYTES = 64 << 10  # per sample slice; three slices per chunk
SMALL_BYTES = 256 << 10  # below this, try the whole chunk instead of a sample


@dataclass(frozen=True)
class CompressionPolicy:
    """How ``encode`` chooses. ``mode``: "auto", "zstd" (always, when smaller) or "none".

    ``max_ratio``: auto keeps zstd only when stored/raw <= this on the sample and on the
    whole chunk; the default demands a 20% saving, since decoding costs every load.
    """

    mode: str = "auto"
    level: int = 1
    max_ratio: float = 0.8

    def __post_init__(self):
        if self.mode not in ("auto", "zstd", "none"):
            raise ValueError(f"compression must be 'auto', 'zstd' or 'none', got {self.mode!r}")
        if not (1 <= self.level <= 22):
            raise ValueError(f"zstd level must be in 1..22, got {self.level}")


def _compressor(level: int) -> zstandard.ZstdCompressor:
    # ZstdCompressor objects are not safe to share between threads: one per thread+level.
    cache = getattr(_local, "compressors", None)
    if cache is None:
        cache = _local.compressors = {}
    c = cache.get(level)
    if c is None:
        c = cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return c


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "decompressor", None)
    if d is None:
        d = _local.decompressor = zstandard.ZstdDecompressor()
    return d


def _shuffle_bytes(data: memoryview, elementsize: int) -> memoryview:
    import torch

    if not len(data):
        src = torch.empty(0, dtype=torch.uint8)
    else:
        with warnings.catch_warnings():  # the buffer may be read-only; the shuffle only reads it
            warnings.simplefilter("ignore", UserWarning)
            src = torch.frombuffer(data, dtype=torch.uint8)
    return memoryview(native.shuffle(src, elementsize).numpy())


def _sample(data: memoryview) -> memoryview | bytes:
    n = len(data)
    if n <= SMALL_BYTES:
        return data
    mid = (n // 2) - (SAMPLE_BYTES // 2)
    return b"".join((data[:SAMPLE_BYTES], data[mid:mid + SAMPLE_BYTES], data[n - SAMPLE_BYTES:]))


def _candidates(elementsize: int) -> list[list[dict]]:
    chains = [[]]
    if elementsize > 1:
        chains.append([{"id": "shuffle", "elementsize": elementsize}])
    return chains


def _apply(chain: list[dict], data: memoryview, level: int) -> memoryview | bytes:
    for c in chain:
        if c["id"] == "shuffle":
            data = _shuffle_bytes(data, c["elementsize"])
    return _compressor(level).compress(data)


def zstd_frame(data, level: int) -> tuple[list[dict], bytes]:
    """``data`` as one zstd frame whatever its size (a version 4 index or table: every
    one of a checkpoint has the same codec chain, so a root need not state it per rank)."""
    return [{"id": "zstd", "level": level}], _compressor(level).compress(data)


class CodecMemo:
    """What ``encode`` decided for a chunk in earlier saves, so that "auto" need not
    trial-compress the same chunk every time: the same tensor of the next checkpoint
    almost always compresses as well as it did, so the trial runs again only every
    ``retry_after`` uses of a decision. A first decision starts part-way through its
    count (new decisions in turn at 0, 1, ..., retry_after uses): the chunks of one save
    then come due a few at a time over the next saves, not all at the same one (100,000
    trials at every seventeenth save of 100,000 tensors).

    Keys are ``(hint, size, element size, policy)``; the hint is whatever the caller
    names a chunk by (opaque here). The caller owns the memo and its lifetime (the
    process runtime holds one: ``ckptstore.runtime.Runtime.codec_memo``). Thread-safe.
    """

    RETRY_AFTER = 16
    MAX_ENTRIES = 1_000_000

    def __init__(self, retry_after: int = RETRY_AFTER, max_entries: int = MAX_ENTRIES):
        self.retry_after = retry_after
        self.max_entries = max_entries
        self._decisions: dict[tuple, list] = {}  # key -> [chain or None, uses]
        self._lock = threading.Lock()
        self._new = 0  # first decisions made: where the next one starts its count

    def __len__(self) -> int:
        return len(self._decisions)

    def recall(self, key: tuple) -> tuple[bool, list[dict] | None]:
        """(True, chain) when a decision for ``key`` may be reused (None: store raw);
        (False, None) when the trial must run (none yet, or due for a retry)."""
        with self._lock:
            entry = self._decisions.get(key)
            if entry is None or entry[1] >= self.retry_after:
                return False, None
            entry[1] += 1
            return True, entry[0]

    def remember(self, key: tuple, chain: list[dict] | None) -> None:
        with self._lock:
            if len(self._decisions) > self.max_entries:
                self._decisions.clear()
            if key in self._decisions:  # a retried decision: a whole count again
                self._decisions[key] = [chain, 0]
            else:
                self._decisions[key] = [chain, self._new % (self.retry_after + 1)]
                self._new += 1

    def clear(self) -> None:
        with self._lock:
            self._decisions.clear()


def encode(data: memoryview, elementsize: int, policy: CompressionPolicy,
           hint: tuple | None = None, memo: CodecMemo | None = None) -> tuple[list[dict], Any]:
    """Encode raw chunk bytes; returns (codec records, stored bytes-like).

    With a ``memo`` and a ``hint`` naming the chunk (any hashable: the pipeline passes
    scope, tensor key and offsets), "auto" reuses the decision it made for the same
    chunk in an earlier save instead of trial-compressing again.
    """
    n = len(data)
    if policy.mode == "none" or n == 0:
        return [], data
    limit = policy.max_ratio if policy.mode == "auto" else 1.0
    memo_key = (hint, n, elementsize, policy) if hint is not None and memo is not None else None
    known, best_chain = memo.recall(memo_key) if memo_key is not None else (False, None)
    if not known:
        best_chain, best_ratio = None, 1.0
        sample = _sample(data)
        for filters in _candidates(elementsize):
            ratio = len(_apply(filters, memoryview(sample), 1)) / len(sample)
            if ratio < best_ratio:
                best_chain, best_ratio = filters, ratio
        if best_ratio > limit:
            best_chain = None
        if memo_key is not None:
            memo.remember(memo_key, best_chain)
    if best_chain is None:
        return [], data
    out = _apply(best_chain, data, policy.level)
    if len(out) > n * limit or len(out) >= n:
        return [], data
    return best_chain + [{"id": "zstd", "level": policy.level}], out


def decode_into(chain: list[Mapping[str, Any]], stored, out: memoryview, what: str) -> None:
    """Decode ``stored`` into the preallocated ``out`` (exactly raw_length bytes).

    Never allocates more than ``len(out)`` however the stored bytes lie: the zstd frame
    must state exactly that content size (python-zstandard would otherwise allocate
    what the frame claims, ignoring ``max_output_size``), and large frames decode
    straight into ``out`` (or the one unshuffle buffer)."""
    ids = [c.get("id") for c in chain]
    if ids == []:
        if len(stored) != len(out):
            raise FormatError(f"{what}: raw chunk holds {len(stored)} bytes, expected {len(out)}")
        out[:] = stored
        return
    if ids not in (["zstd"], ["shuffle", "zstd"]):
        raise FormatError(f"{what}: unknown codec chain {ids}")
    size = chain[0].get("elementsize") if ids[0] == "shuffle" else None
    if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
        raise FormatError(f"{what}: bad shuffle elementsize {size!r}")
    target = out if size is None else memoryview(bytearray(len(out)))
    _zstd_into(stored, target, what)
    if size is not None and len(out):
        import torch

        native.unshuffle_into(torch.frombuffer(out, dtype=torch.uint8),
                              torch.frombuffer(target, dtype=torch.uint8), size)


def check_stated_size(chain: list[Mapping[str, Any]], stored, raw_length: int, what: str) -> None:
    """Refuse, before anything is allocated for the decoded bytes, stored bytes whose
    zstd frame does not state exactly ``raw_length`` as its content size."""
    if chain and chain[-1].get("id") == "zstd":
        try:
            claimed = zstandard.frame_content_size(stored)
        except zstandard.ZstdError as e:
            raise FormatError(f"{what}: zstd frame is corrupt: {e}") from e
        if claimed != raw_length:
            told = "no size" if claimed < 0 else f"{claimed} bytes"
            raise FormatError(f"{what}: zstd frame states {told}, the manifest {raw_length}")


STREAM_DECODE_BYTES = 1 << 20  # above this, decode into the destination (saves a copy)


def _zstd_into(stored, out: memoryview, what: str) -> None:
    check_stated_size([{"id": "zstd"}], stored, len(out), what)
    try:
        if len(out) <= STREAM_DECODE_BYTES:
            raw = _decompressor().decompress(stored, max_output_size=len(out))
            if len(raw) != len(out):
                raise FormatError(f"{what}: decoded {len(raw)} bytes, expected {len(out)}")
            out[:] = raw
            return
        reader = _decompressor().stream_reader(stored, read_across_frames=False)
        got = 0
        while got < len(out):
            n = reader.readinto(out[got:])
            if n == 0:
                raise FormatError(f"{what}: zstd frame ends after {got} of {len(out)} bytes")
            got += n
        if reader.read(1):
            raise FormatError(f"{what}: zstd frame holds more than {len(out)} bytes")
    except zstandard.ZstdError as e:
        raise FormatError(f"{what}: zstd frame is corrupt: {e}") from e
