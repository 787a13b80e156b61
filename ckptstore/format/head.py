"""The head of a document: the members a manifest, or a vote, holds in every format
version (format name and version, kind, attempt, step, world size, ...), in and out, and
the header check whose version picks the document's code path (``v3.py``, ``v4.py``).
Version-specific members follow the head; each version module reads and writes its own.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from ..errors import FormatError, UnsupportedVersionError
from ..names import MAX_GENERATION, MAX_STEP, MAX_WORLD_SIZE, check_attempt_id
from .constants import FORMAT_NAME, READ_VERSIONS
from .strict import bounded_int, check_fields, expect, iso_time
from .text import COMPACT

if TYPE_CHECKING:
    from .documents import Manifest, Vote


def check_header(d: dict, kind: str) -> int:
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


# ---------------------------------------------------------------------------- votes
VOTE_HEAD_FIELDS = frozenset({
    "format", "format_version", "kind", "attempt", "step", "world_size", "rank", "ok", "error", "written_at",
})


def vote_head_json(v: Vote) -> dict:
    """The members before the version's own (the records, or the index, follow them)."""
    return {
        "format": FORMAT_NAME,
        "format_version": v.format_version,
        "kind": "vote",
        "attempt": v.attempt,
        "step": v.step,
        "world_size": v.world_size,
        "rank": v.rank,
        "ok": v.ok,
        "error": v.error,
    }


def vote_head(d: dict, own: frozenset) -> tuple[str, bool]:
    """Check a vote's members (the head's and the version's ``own``) and kind; returns
    its (attempt, ok)."""
    check_fields(d, VOTE_HEAD_FIELDS | own, set(), "vote")
    if d["kind"] != "vote":
        raise FormatError(f"vote has kind {d['kind']!r}")
    attempt = check_attempt_id(d["attempt"], "vote.attempt")
    ok = expect(d["ok"], bool, "vote.ok")
    return attempt, ok


# ---------------------------------------------------------------------------- manifests
MANIFEST_HEAD_FIELDS = frozenset({
    "format", "format_version", "kind", "generation", "attempt", "step", "world_size",
    "created_at", "committed_at", "byteorder", "metrics", "library",
})


def manifest_head_json(m: Manifest) -> dict:
    """The members before the version's own (the records follow them, ``epoch`` last)."""
    return {
        "format": FORMAT_NAME,
        "format_version": m.format_version,
        "kind": "manifest",
        "generation": m.generation,
        "attempt": m.attempt,
        "step": m.step,
        "world_size": m.world_size,
        "created_at": m.created_at,
        "committed_at": m.committed_at,
        "byteorder": m.byteorder,
        "metrics": dict(m.metrics),
        "library": m.library,
    }


def manifest_text(m: Manifest, own: str) -> bytes:
    """The stored manifest: its head, then ``own`` (the version's members as JSON text,
    without braces), then ``epoch`` when it has one."""
    text = json.dumps(manifest_head_json(m), **COMPACT)
    tail = "" if m.epoch is None else f',"epoch":{json.dumps(m.epoch)}'
    return f'{text[:-1]},{own}{tail}}}'.encode()


def manifest_head(d: dict, own: frozenset) -> tuple[str, int]:
    """Check a manifest's members (the head's, the version's ``own``, an optional
    ``epoch``), kind and byte order; returns its (attempt, world_size)."""
    check_fields(d, MANIFEST_HEAD_FIELDS | own, {"epoch"}, "manifest")
    if d["kind"] != "manifest":
        raise FormatError(f"manifest has kind {d['kind']!r}")
    if d["byteorder"] not in ("little", "big"):
        raise FormatError(f"manifest.byteorder is {d['byteorder']!r}")
    world_size = bounded_int(d["world_size"], "manifest.world_size", 1, MAX_WORLD_SIZE)
    attempt = check_attempt_id(d["attempt"], "manifest.attempt")
    return attempt, world_size


def manifest_head_from_json(d: dict, attempt: str, world_size: int) -> dict:
    """The head's members as :class:`~.documents.Manifest` keyword arguments."""
    return dict(
        generation=bounded_int(d["generation"], "manifest.generation", 1, MAX_GENERATION),
        attempt=attempt,
        step=None if d["step"] is None else bounded_int(d["step"], "manifest.step", 0, MAX_STEP),
        world_size=world_size,
        created_at=iso_time(d["created_at"], "manifest.created_at"),
        committed_at=iso_time(d["committed_at"], "manifest.committed_at"),
        metrics=expect(d["metrics"], dict, "manifest.metrics"),
        byteorder=d["byteorder"],
        library=expect(d["library"], str, "manifest.library"),
        epoch=bounded_int(d["epoch"], "manifest.epoch", 1, MAX_GENERATION) if "epoch" in d else None,
    )
