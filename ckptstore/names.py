"""Every name ckptstore stores, built and parsed in one place.

A name read back from storage (a listing, a manifest's ``attempt`` or blob ``file``, a
vote's file name) is untrusted input: gc deletes by these names, so each parser here
accepts exactly the grammar of docs/format.md ("Names") and nothing else. Builders
refuse values their fixed-width fields cannot hold, so nothing is ever written under
a name the parsers would not list. Pure functions, no I/O.
"""

from __future__ import annotations

import datetime as _dt
import posixpath
import re
import uuid

from .errors import FormatError

ATTEMPTS_DIR = "attempts"
PIN_NAME = "pin.json"
SKIPPED_NAME = "resume-skipped.json"  # a resume could not use this step (informational)
PROGRESS_NAME = "progress.json"  # at a store's root: the last step a run reached
# Two tiers (tiers.py): the durable store's identity, created once at its root, and the
# binding at a local tier's root naming the store it belongs to (both create-only).
STORE_ID_NAME = "store-id.json"
TIER_BINDING_NAME = "tier-binding.json"
EPOCHS_DIR = "epochs"  # at a store's root: one create-only claim per run incarnation
ABORT_LEAF = "abort.json"
# The committer's word to the ranks that wait: "committed as generation g" or "aborted"
# (follower.await_outcome polls this one small object instead of listing the location).
OUTCOME_LEAF = "outcome.json"
# In an attempt: a gc deleted a manifest that read this attempt's files, which a save in
# flight may still reference; rewriting it makes the attempt young again, so the files go
# only once it has been idle for the grace (gc.py).
RELEASED_LEAF = "released.json"
# In an attempt: the committer's word that it is about to write the manifest (generation
# and time), rewritten right before its last look at the attempt; gc leaves an attempt
# whose commit mark is fresh alone, whatever its grace (gc.py, "Commits beside gc").
COMMITTING_LEAF = "committing.json"
# In an attempt: gc's claim, written create-only before it deletes the files of an
# attempt no manifest names; a committer that finds it (or an abort marker) at its last
# look refuses to commit.
CLAIM_LEAF = "gc-claim.json"
TMP_MARK = ".tmp-"  # a temporary file of an unfinished put: "<final name>.tmp-<8 hex>"

GENERATION_DIGITS = 10
MAX_GENERATION = 10**GENERATION_DIGITS - 1
STEP_DIGITS = 12
MAX_STEP = 10**STEP_DIGITS - 1
RANK_DIGITS = 5
MAX_WORLD_SIZE = 10**RANK_DIGITS  # ranks 0 .. 99999 fit the data, vote and heartbeat names
STREAM_DIGITS = 2

_MANIFEST_RE = re.compile(r"manifest-([0-9]{10})\.json")
_STEP_DIR_RE = re.compile(r"step-([0-9]{12})")
_ATTEMPT_RE = re.compile(r"[0-9]{8}T[0-9]{6}-[0-9a-f]{12}")
_DATA_RE = re.compile(r"data-r([0-9]{5})-s([0-9]{2})\.bin")
_VOTE_RE = re.compile(r"vote-r([0-9]{5})\.json")
_HEARTBEAT_RE = re.compile(r"heartbeat-r([0-9]{5})")
_TMP_RE = re.compile(r"(.+)\.tmp-[0-9a-f]{8}")


# ---------------------------------------------------------------------------- manifests
def manifest_name(generation: int) -> str:
    if not _is_int(generation) or not 1 <= generation <= MAX_GENERATION:
        raise FormatError(f"generation {generation!r} does not fit a manifest name (1 .. {MAX_GENERATION})")
    return f"manifest-{generation:0{GENERATION_DIGITS}d}.json"


def parse_manifest_name(name: str) -> int | None:
    """The generation a manifest file name holds, or None when it is not one."""
    m = _MANIFEST_RE.fullmatch(name)
    return int(m.group(1)) if m and int(m.group(1)) >= 1 else None


_EPOCH_RE = re.compile(r"epoch-([0-9]{10})\.json")


def epoch_name(epoch: int) -> str:
    """The claim of run incarnation ``epoch`` (1, 2, ...), relative to the store root."""
    if not _is_int(epoch) or not 1 <= epoch <= MAX_GENERATION:
        raise FormatError(f"epoch {epoch!r} does not fit a claim name (1 .. {MAX_GENERATION})")
    return f"{EPOCHS_DIR}/epoch-{epoch:0{GENERATION_DIGITS}d}.json"


def parse_epoch_leaf(leaf: str) -> int | None:
    m = _EPOCH_RE.fullmatch(leaf)
    return int(m.group(1)) if m and int(m.group(1)) >= 1 else None


# ---------------------------------------------------------------------------- steps
def step_dir_name(step: int) -> str:
    if not _is_int(step) or not 0 <= step <= MAX_STEP:
        raise ValueError(f"step must be an int in 0 .. {MAX_STEP}, got {step!r}")
    return f"step-{step:0{STEP_DIGITS}d}"


def parse_step_dir_name(name: str) -> int | None:
    m = _STEP_DIR_RE.fullmatch(name)
    return int(m.group(1)) if m else None


# ---------------------------------------------------------------------------- attempts
def new_attempt_id() -> str:
    """A unique, time-sortable id for one save attempt (I2)."""
    now = _dt.datetime.now(_dt.timezone.utc)
    return f"{now:%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:12]}"


def is_attempt_id(name) -> bool:
    return isinstance(name, str) and _ATTEMPT_RE.fullmatch(name) is not None


def check_attempt_id(name, what: str = "attempt") -> str:
    if not is_attempt_id(name):
        raise FormatError(f"{what} {name!r} is not an attempt id (YYYYMMDDTHHMMSS-<12 hex>)")
    return name


def attempt_dir(attempt: str) -> str:
    return f"{ATTEMPTS_DIR}/{check_attempt_id(attempt)}"


def _rank_field(rank: int) -> str:
    if not _is_int(rank) or not 0 <= rank < MAX_WORLD_SIZE:
        raise FormatError(f"rank {rank!r} does not fit a stored name (0 .. {MAX_WORLD_SIZE - 1})")
    return f"{rank:0{RANK_DIGITS}d}"


def data_file_name(attempt: str, rank: int, stream: int) -> str:
    if not _is_int(stream) or not 0 <= stream < 10**STREAM_DIGITS:
        raise FormatError(f"stream {stream!r} does not fit a data file name")
    return f"{attempt_dir(attempt)}/data-r{_rank_field(rank)}-s{stream:0{STREAM_DIGITS}d}.bin"


def vote_name(attempt: str, rank: int) -> str:
    return f"{attempt_dir(attempt)}/vote-r{_rank_field(rank)}.json"


def released_name(attempt: str) -> str:
    return f"{attempt_dir(attempt)}/{RELEASED_LEAF}"


def abort_name(attempt: str) -> str:
    return f"{attempt_dir(attempt)}/{ABORT_LEAF}"


def outcome_name(attempt: str) -> str:
    return f"{attempt_dir(attempt)}/{OUTCOME_LEAF}"


def committing_name(attempt: str) -> str:
    return f"{attempt_dir(attempt)}/{COMMITTING_LEAF}"


def claim_name(attempt: str) -> str:
    return f"{attempt_dir(attempt)}/{CLAIM_LEAF}"


def heartbeat_name(attempt: str, rank: int) -> str:
    return f"{attempt_dir(attempt)}/heartbeat-r{_rank_field(rank)}"


def parse_data_file(name: str) -> tuple[str, int, int] | None:
    """(attempt, rank, stream) of a data file name relative to its location, else None."""
    parts = name.split("/")
    if len(parts) != 3 or parts[0] != ATTEMPTS_DIR or not is_attempt_id(parts[1]):
        return None
    m = _DATA_RE.fullmatch(parts[2])
    return (parts[1], int(m.group(1)), int(m.group(2))) if m else None


def parse_vote_leaf(leaf: str) -> int | None:
    """The rank of a vote file name (the last path part), else None."""
    m = _VOTE_RE.fullmatch(leaf)
    return int(m.group(1)) if m else None


def attempt_leaf_kind(leaf: str) -> str | None:
    """What a file directly inside an attempt directory is: "data", "vote", "abort",
    "outcome", "release", "committing", "claim", "heartbeat" or "temp"; None for a name
    ckptstore never writes there."""
    if _DATA_RE.fullmatch(leaf):
        return "data"
    if _VOTE_RE.fullmatch(leaf):
        return "vote"
    if leaf == ABORT_LEAF:
        return "abort"
    if leaf == OUTCOME_LEAF:
        return "outcome"
    if leaf == RELEASED_LEAF:
        return "release"
    if leaf == COMMITTING_LEAF:
        return "committing"
    if leaf == CLAIM_LEAF:
        return "claim"
    if _HEARTBEAT_RE.fullmatch(leaf):
        return "heartbeat"
    if is_temp_name(leaf):
        return "temp"
    return None


def temp_name(final: str) -> str:
    """A fresh temporary name beside ``final`` (the last path part), for a put in progress."""
    return f"{final}{TMP_MARK}{uuid.uuid4().hex[:8]}"


def attempt_file_of(key: str) -> tuple[str, str] | None:
    """(attempt, kind) when ``key`` (relative to its location) is a file ckptstore
    writes in an attempt directory, kind as :func:`attempt_leaf_kind` says; else None
    (a foreign name, or one nested deeper)."""
    parts = key.split("/")
    if len(parts) != 3 or parts[0] != ATTEMPTS_DIR or not is_attempt_id(parts[1]):
        return None
    kind = attempt_leaf_kind(parts[2])
    return (parts[1], kind) if kind is not None else None


def is_temp_name(leaf: str) -> bool:
    """A temporary file left by an interrupted put (local disk) of a name ckptstore
    writes: a manifest, a pin, a skip mark, or a file of an attempt. Anyone else's ``x.tmp-...`` is not."""
    m = _TMP_RE.fullmatch(leaf)
    if m is None:
        return False
    final = m.group(1)
    return (parse_manifest_name(final) is not None or final in (PIN_NAME, SKIPPED_NAME)
            or (attempt_leaf_kind(final) not in (None, "temp")))


# ---------------------------------------------------------------------------- any stored file name
def check_relative_name(name, what: str = "file name") -> str:
    """Refuse names that could escape the checkpoint (I4)."""
    if not isinstance(name, str) or not name:
        raise FormatError(f"{what} must be a non-empty string, got {name!r}")
    if name.startswith("/") or "\\" in name or "\x00" in name:
        raise FormatError(f"{what} {name!r} is absolute or contains a forbidden character")
    parts = name.split("/")
    if any(p in ("", ".", "..") for p in parts) or posixpath.normpath(name) != name:
        raise FormatError(f"{what} {name!r} escapes the checkpoint or is not normalised")
    return name


def check_data_file(name, attempt: str, what: str) -> str:
    """A blob's file: a data file of ``attempt`` (the manifest's or vote's own), nothing
    else. A checkpoint never names another attempt's files, so gc's liveness rule (an
    attempt is live iff a retained manifest names it) covers every byte it reads."""
    check_relative_name(name, what)
    parsed = parse_data_file(name)
    if parsed is None:
        raise FormatError(f"{what} {name!r} is not a data file name (attempts/<attempt>/data-rNNNNN-sNN.bin)")
    if parsed[0] != attempt:
        raise FormatError(f"{what} {name!r} lies in another attempt than {attempt!r}")
    return name


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
