"""Collective resume: every rank of a job starts from the same step, the newest one
that every rank can load with every hash checked and that the program accepts.

A rank that falls back on its own (rank 0 at step 60 because it read its shards fine,
rank 1 at step 50 because one of its bytes flipped) trains on mixed state until the
next save fails; so each candidate step is tried on every rank, the verdicts are
gathered, and a step any rank could not use is skipped on all of them.
"""

from __future__ import annotations

import json
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

from . import format as fmt
from . import names
from . import rng
from .checkpoint.catalog import skip_mark
from .checkpoint.fencing import claim_epoch
from .checkpoint.group import from_rank0, gather, rank_and_world
from .errors import (
    CheckpointNotFoundError,
    CkptStoreError,
    FormatError,
    IntegrityError,
    NotCommittedError,
    ObjectNotFoundError,
    TemplateMismatchError,
    TruncatedObjectError,
    UnsupportedVersionError,
)

# What makes a step unusable, rather than the program or the machine broken: its bytes
# or its files are bad or gone. Anything else (a template that does not fit, an unsafe
# type under weights_only, a storage outage, a step written by a newer ckptstore) would
# fail every older step the same way or means upgrading, and quietly falling back to an
# old step (or to none) would lose work: it is raised.
SKIPPABLE = (IntegrityError, FormatError, CheckpointNotFoundError, ObjectNotFoundError,
             TruncatedObjectError, NotCommittedError)


class CheckpointRejected(CkptStoreError):
    """Raised by a resume's ``validate`` callback to reject a step, with the reason."""


class NoLoadableCheckpointError(CheckpointNotFoundError):
    """The store holds committed steps, but a resume could use none of them."""


class ResumeError(CkptStoreError):
    """Another rank failed during a collective resume (its own error names why)."""


@dataclass(frozen=True)
class SkippedStep:
    step: int
    reason: str


@dataclass(frozen=True)
class ResumeInfo:
    """Where a resume started from, and what the program must adapt.

    With ``step`` None the store held no checkpoint: the program starts from scratch.
    When the world size changed (``resharded``), global (sharded) tensors were
    resharded, and rank-local state was read from saved rank ``rank_state_of``: the
    program keeps its global batch and data position with :meth:`local_batch` and its
    own global counters (see docs/training.md)."""

    url: str
    step: int | None
    world_size: int
    rank: int
    saved_world_size: int | None = None
    rank_state_of: int | None = None
    generation: int | None = None
    committed_at: str | None = None
    age_s: float | None = None  # seconds from the commit to this resume
    metrics: dict = field(default_factory=dict)
    skipped: tuple[SkippedStep, ...] = ()
    rng_rederived: bool = False  # RNG states in the state were re-derived for this rank
    epoch: int | None = None  # this run's epoch (claimed by the resume), recorded in its manifests
    tier: str | None = None  # with two tiers: "local" or "durable", the copy this rank loaded

    @property
    def resharded(self) -> bool:
        return self.saved_world_size is not None and self.saved_world_size != self.world_size

    def local_batch(self, global_batch: int) -> int:
        """The per-rank batch that keeps ``global_batch`` on this world size."""
        if global_batch % self.world_size:
            raise ValueError(f"a global batch of {global_batch} does not split over {self.world_size} ranks")
        return global_batch // self.world_size


def resume(store, template=None, *, map_location=None, weights_only: bool = True,
           validate: Callable[[Any, fmt.Manifest], Any] | None = None,
           mark_skipped: bool = True, claim: bool = False) -> tuple[Any, ResumeInfo]:
    """See :meth:`ckptstore.Store.resume`."""
    group = store.process_group
    rank, world = rank_and_world(group)
    # Claim the run's epoch before listing: a commit of an older run's orphaned workers
    # that lands after the claim is refused, so the steps listed here are all there is.
    # Whatever rank 0 meets here reaches every rank (none may wait in a collective for
    # a rank that raised).
    start = from_rank0(_claim_and_list(store, claim) if rank == 0 else None, group)
    if start[0] == "error":
        raise ResumeError(f"{store.url}: rank 0 could not start the resume: {start[1]}")
    _, epoch, steps = start
    if epoch is not None:
        store.epoch = epoch
    skipped: list[SkippedStep] = []
    try:
        return _first_usable(store, steps, template, map_location, weights_only, validate, mark_skipped,
                             skipped, rank, world, epoch, group)
    finally:
        # Only now, with every collective of the resume behind us: a warning turned
        # into an error (pytest -W error) then fails every rank alike, hanging none.
        if rank == 0:
            for s in skipped:
                warnings.warn(f"{store.url}: resume skipped step {s.step}: {s.reason}", CheckpointSkippedWarning,
                              stacklevel=3)


def _claim_and_list(store, claim: bool) -> tuple:
    try:
        return "ok", (claim_epoch(store.storage) if claim else None), store.steps()
    except Exception as e:
        return "error", f"{type(e).__name__}: {e}"[:2000]


def _first_usable(store, steps, template, map_location, weights_only, validate, mark_skipped, skipped,
                  rank, world, epoch, group):
    for step in reversed(steps):
        state, info, verdict, own_error = _try_step(store, step, template, map_location, weights_only, validate)
        verdicts = gather(verdict, group)
        failed = [(r, text) for r, (kind, text) in enumerate(verdicts) if kind == "error"]
        if failed:
            if own_error is not None and verdict[0] == "error":
                raise own_error
            r, text = failed[0]
            raise ResumeError(f"{store.url}: rank {r} failed while resuming step {step}: {text}")
        bad = [(r, text) for r, (kind, text) in enumerate(verdicts) if kind == "skip"]
        if not bad:
            return _finish(store, state, info, rank, world, skipped, epoch)
        reason = "; ".join(f"rank {r}: {text}" for r, text in bad[:4])
        reason += f" (and {len(bad) - 4} more ranks)" if len(bad) > 4 else ""
        skipped.append(SkippedStep(step, reason))
        if rank == 0 and mark_skipped:
            _mark_skipped(store, step, reason)
    if skipped:
        listing = "; ".join(f"step {s.step}: {s.reason}" for s in skipped)
        raise NoLoadableCheckpointError(f"{store.url}: no committed step could be resumed ({listing})")
    return None, ResumeInfo(store.url, None, world, rank, epoch=epoch)


class CheckpointSkippedWarning(UserWarning):
    """A resume could not use a step (and fell back to an older one)."""


def _try_step(store, step, template, map_location, weights_only, validate):
    """(state, LoadInfo, verdict, error): verdict is ("ok", ""), ("skip", why) for a
    step this rank cannot use, or ("error", why) for a failure that is not the step's."""
    try:
        state, info = store.load(step, map_location, weights_only, template=template, return_info=True)
        if validate is not None:
            verdict = validate(state, info.manifest)
            if not _accepted(verdict):
                said = "" if verdict is False else f" (it returned {_short(verdict)})"
                raise CheckpointRejected(f"rejected by validate(){said}")
        return state, info, ("ok", ""), None
    except (TemplateMismatchError, UnsupportedVersionError) as e:  # FormatErrors, not the step's: SKIPPABLE
        return None, None, ("error", f"{type(e).__name__}: {e}"[:2000]), e
    except (CheckpointRejected, *SKIPPABLE) as e:
        return None, None, ("skip", f"{type(e).__name__}: {e}"[:2000]), e
    except Exception as e:  # not the step's fault: every rank must hear of it, then raise
        return None, None, ("error", f"{type(e).__name__}: {e}"[:2000]), e


def _accepted(verdict) -> bool:
    """A ``validate`` callback's verdict by its truth value: None (no return) accepts,
    anything false rejects (``False``, ``0``, ``numpy.False_``, ``torch.tensor(False)``:
    an ``is False`` test took all but the first for acceptance and loaded the step). One
    without a single truth value (a tensor or array of several elements) is a TypeError,
    raised on every rank, never a guess."""
    if verdict is None:
        return True
    try:
        return bool(verdict)
    except Exception as e:  # a multi-element tensor (RuntimeError) or array (ValueError), a __bool__ that raises
        raise TypeError(f"validate() returned {type(verdict).__name__} {_short(verdict)}, which has no single "
                        f"truth value ({type(e).__name__}: {e}): return True or False, or raise "
                        "ckptstore.CheckpointRejected(reason)") from None


def _short(v) -> str:
    try:
        text = repr(v)
    except Exception:
        return "(no repr)"
    return text if len(text) <= 80 else text[:77] + "..."


def _finish(store, state, info, rank: int, world: int, skipped, epoch) -> tuple[Any, ResumeInfo]:
    manifest = info.manifest
    rederived = False
    if info.rank_state_of != rank:
        # This rank reads another rank's own state (the world grew): two ranks would
        # draw the same random numbers. Give each its own stream, deterministically.
        state, rederived = _rederive_rng(state, rank)
    age = max(0.0, time.time() - fmt.parse_time(manifest.committed_at))
    if info.tier is None:  # the store's own checkpoint: the next incremental save may reference it
        store.note_committed(manifest)
    return state, ResumeInfo(
        store.url, info.step, world, rank, info.saved_world_size, info.rank_state_of, manifest.generation,
        manifest.committed_at, age, dict(manifest.metrics), tuple(skipped), rederived, epoch, info.tier)


def _rederive_rng(obj, rank: int):
    """``obj`` with every RNG state (:func:`ckptstore.rng_state`) in its dicts and
    lists re-derived for ``rank``, and whether there was one."""
    if rng.is_rng_state(obj):
        return rng.rederive(obj, rank), True
    found = False
    if isinstance(obj, dict):
        for k, v in list(obj.items()):
            obj[k], hit = _rederive_rng(v, rank)
            found |= hit
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            obj[i], hit = _rederive_rng(v, rank)
            found |= hit
    elif isinstance(obj, tuple) and not hasattr(obj, "_fields"):  # a namedtuple is left as it is
        items = [_rederive_rng(v, rank) for v in obj]
        if any(hit for _, hit in items):
            return type(obj)(v for v, _ in items), True
    return obj, found


def _mark_skipped(store, step: int, reason: str) -> None:
    """Leave a note in the step (``ckptstore ls`` shows it); best effort."""
    try:
        holders = store.tiers_of(step)  # each tier that holds the step (two tiers: both)
    except Exception:
        return
    for _, holder in holders:
        try:
            loc = holder.location(step)
            # bound to the visible manifest's generation, attempt and bytes: gc and status
            # act on a mark only while it matches the manifest it judged
            note = skip_mark(loc, step, reason, fmt.utc_now())
            loc.put(names.SKIPPED_NAME, json.dumps(note).encode())
        except Exception:
            pass  # the note is for people; the resume itself already moved on
