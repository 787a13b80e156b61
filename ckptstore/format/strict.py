"""Strict, bounded JSON in: what every record and document parser of ``ckptstore.format``
reads with. Duplicate keys, NaN, unknown or missing fields, wrong types and ints outside
their bounds are a FormatError naming the record; record names are built only for an
error (``LazyName``). Also the stored times (ISO 8601, UTC)."""

from __future__ import annotations

import datetime as _dt
import json
from typing import Any

from ..errors import FormatError
from .constants import MAX_BYTES, MAX_NDIM


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="microseconds")


def parse_time(iso: str) -> float:
    """Epoch seconds of a stored ISO 8601 time (validated when its record was parsed)."""
    return _dt.datetime.fromisoformat(iso).timestamp()


def iso_time(v: Any, what: str) -> str:
    """A stored ISO 8601 time, checked (kept as its text)."""
    expect(v, str, what)
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


# ---------------------------------------------------------------------------- helpers
# Hot on large manifests (every chunk record passes here): error texts are built as
# ``what + field`` only when a check fails, never on the way through; a record's own
# name (``manifest.ranks[0].tensors['w'].chunks[0]``) is a LazyName until then.
class LazyName:
    """``template.format(*args)``, formatted only when an error message uses it."""

    __slots__ = ("template", "args")

    def __init__(self, template: str, *args):
        self.template = template
        self.args = args

    def __str__(self) -> str:
        return self.template.format(*self.args)


def expect(obj: Any, kind: type | tuple, what: str, field: str = "") -> Any:
    """``obj``, if it is a ``kind`` (a bool is no int), else a FormatError naming ``what + field``."""
    if kind is int and isinstance(obj, bool):
        raise FormatError(f"{what}{field} must be an int, got {obj!r}")
    if not isinstance(obj, kind):
        raise FormatError(f"{what}{field} has the wrong type: {type(obj).__name__}")
    return obj


def check_fields(d: Any, required: set[str] | frozenset, optional: set[str], what: str) -> dict:
    """Check a JSON object has exactly the known fields (I4: unknown fields are errors)."""
    expect(d, dict, what)
    if not optional and d.keys() == required:
        return d
    missing = required - d.keys()
    unknown = d.keys() - required - optional
    if missing:
        raise FormatError(f"{what} lacks field(s) {sorted(missing)}")
    if unknown:
        raise FormatError(f"{what} has unknown field(s) {sorted(unknown)}")
    return d


def int_list(v: Any, what: str, field: str = "", max_len: int = MAX_NDIM) -> tuple[int, ...]:
    """A list of at most ``max_len`` ints in 0 .. 2**62 (offsets, sizes, a shape), as a tuple."""
    expect(v, list, what, field)
    if len(v) > max_len:
        raise FormatError(f"{what}{field} has {len(v)} entries, at most {max_len} are allowed")
    for x in v:
        if type(x) is not int:
            expect(x, int, what, field)
        if not 0 <= x <= MAX_BYTES:
            raise FormatError(f"{what}{field} holds {x}, outside 0 .. 2**62")
    return tuple(v)


def bounded_int(v: Any, what: str, low: int = 0, high: int = MAX_BYTES, field: str = "") -> int:
    """An int in ``low .. high`` (by default a byte count: 0 .. 2**62)."""
    if type(v) is not int:
        expect(v, int, what, field)
    if not low <= v <= high:
        raise FormatError(f"{what}{field} is {v}, outside {low} .. {high}")
    return v
