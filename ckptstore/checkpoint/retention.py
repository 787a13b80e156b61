"""Retention policies: which committed checkpoints to keep.

A checkpoint is kept when any policy keeps it. Pinned checkpoints and the newest
committed checkpoint are always kept. With no policy at all, every committed
checkpoint is kept (gc then only removes debris and superseded generations).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str | float | int) -> float:
    """'90s', '30m', '12h', '7d', '2w' or a number of seconds."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text < 0 or not math.isfinite(text):
            raise ValueError(f"duration must be a non-negative number of seconds, got {text!r}")
        return float(text)
    m = _DURATION.match(str(text))
    if not m:
        raise ValueError(f"bad duration {text!r}: use a number with s, m, h, d or w (e.g. 7d)")
    return float(m.group(1)) * _UNITS[m.group(2)]


@dataclass(frozen=True)
class KeepBest:
    metric: str
    mode: str  # "min" or "max"
    count: int

    @classmethod
    def parse(cls, text: str) -> "KeepBest":
        parts = text.split(":")
        if len(parts) != 3 or parts[1] not in ("min", "max") or not parts[2].isdigit():
            raise ValueError(f"bad --keep-best {text!r}: use METRIC:min|max:N (e.g. loss:min:3)")
        return cls(parts[0], parts[1], int(parts[2]))


@dataclass(frozen=True)
class Retention:
    last: int | None = None
    every: int | None = None
    within: float | None = None  # seconds
    best: tuple[KeepBest, ...] = ()

    def __post_init__(self):
        for name in ("last", "every"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"keep {name} must be a positive int, got {v!r}")
        if isinstance(self.within, str):
            object.__setattr__(self, "within", parse_duration(self.within))
        if isinstance(self.best, KeepBest):
            object.__setattr__(self, "best", (self.best,))

    @property
    def empty(self) -> bool:
        return self.last is None and self.every is None and self.within is None and not self.best


@dataclass(frozen=True)
class Candidate:
    """What retention needs to know of one committed checkpoint."""

    name: str
    step: int | None
    committed_at: float  # epoch seconds
    metrics: dict
    pinned: bool
    # A resume could not use it (a skip mark on its visible generation): True for a mark
    # bound to the manifest's bytes, UNBOUND for one that is not (a previous release's).
    skipped: bool | str = False


# A skip mark that could not be checked against the manifest's bytes: the step counts as
# skipped when choosing the usable steps to keep, and is kept too wherever it would be
# kept without the mark. Such a mark may only ever make gc keep more, never less: gc
# never deletes the newest step a resume would load, whoever wrote the mark.
UNBOUND = "unbound"


def select_kept(cands: list[Candidate], policy: Retention, now: float) -> dict[str, list[str]]:
    """{name: reasons kept}; names absent from the result may be deleted."""
    kept = _select(cands, policy, now, lambda c: bool(c.skipped))
    if any(c.skipped == UNBOUND for c in cands):
        # and what it keeps were the unbound marks absent (UNBOUND)
        for name, whys in _select(cands, policy, now, lambda c: bool(c.skipped) and c.skipped != UNBOUND).items():
            if name not in kept:
                kept[name] = [f"{why} (its skip mark is not bound to the manifest)" for why in whys]
    return kept


def _select(cands: list[Candidate], policy: Retention, now: float, skipped) -> dict[str, list[str]]:
    kept: dict[str, list[str]] = {}

    def keep(c: Candidate, why: str) -> None:
        kept.setdefault(c.name, []).append(why)

    order = sorted(cands, key=lambda c: (c.step if c.step is not None else -1, c.committed_at, c.name))
    # A step a resume skipped (corrupt, rejected) is not what a restart would use: it
    # must not count as the newest or push a usable step out of "last N" or "best".
    usable = [c for c in order if not skipped(c)] or order[-1:]
    if usable:
        keep(usable[-1], "newest")
    for c in cands:
        if c.pinned:
            keep(c, "pinned")
    if policy.empty:
        for c in cands:
            keep(c, "no policy")
        return kept
    if policy.last:
        for c in usable[-policy.last:]:
            keep(c, f"last {policy.last}")
    if policy.every:
        for c in cands:
            if c.step is not None and c.step % policy.every == 0:
                keep(c, f"every {policy.every}")
    if policy.within is not None:
        for c in cands:
            if now - c.committed_at <= policy.within:
                keep(c, f"within {policy.within:g}s")
    for b in policy.best:
        scored = [c for c in cands if isinstance(c.metrics.get(b.metric), (int, float))
                  and not isinstance(c.metrics.get(b.metric), bool) and not skipped(c)]
        scored.sort(key=lambda c: c.metrics[b.metric], reverse=(b.mode == "max"))
        for c in scored[:b.count]:
            keep(c, f"best {b.count} {b.metric} {b.mode}")
    return kept
