"""Stragglers: ranks persistently slower than the others (docs/runbook.md,
"Stragglers").

Each rank reports ``step_median_s``, the median of its last ``STEP_WINDOW`` (20) step
times (progress.py; a step time is the time from one ``Checkpointer.step()`` return to
the next call: saves and the Checkpointer's own per-step agreement excluded, so a rank
that waits for a slower one at that agreement does not look slow). Every
``straggler_report_s`` (60 s) each node's supervisor journals one ``step_times`` event
with its ranks' medians. The rule, applied to those reports in time order by the
supervisor (alerts) and by ``status`` (a pure function of the journal):

- a rank's **ratio** is its median over the median of the other ranks' latest medians
  (of the same attempt, from every node's reports; at least one other rank);
- a rank is **slow** in a report when its ratio exceeds :data:`FACTOR` (1.5);
- a rank is a **straggler** once it was slow in :data:`REPORTS` (3) reports in a row;
  one report that is not slow ends it (and ends its episode);
- an **alert** (a ``straggler`` event, and ``--alert``) is sent once per rank per
  episode, when a straggler's ratio exceeds :data:`ALERT_FACTOR` (2.0).

Limitation: in synchronous data parallelism the ranks wait for each other inside the
step too (DDP's gradient all-reduce): there, only the part of a rank's slowness after
its last collective of the step shows in its step time.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

FACTOR = 1.5
REPORTS = 3
ALERT_FACTOR = 2.0
MAX_RANKS = 100_000  # ranks of one report taken from the (untrusted) journal


@dataclass
class Straggler:
    rank: int
    host: str | None
    step_s: float
    others_s: float
    ratio: float
    reports: int  # slow reports in a row
    since: str | None  # ``at`` of the first of them

    def as_dict(self) -> dict:
        return {"rank": self.rank, "host": self.host, "step_s": self.step_s, "others_s": self.others_s,
                "ratio": self.ratio, "reports": self.reports, "since": self.since}


@dataclass
class Tracker:
    """The rule over a stream of reports (see the module docstring)."""

    latest: dict[int, tuple] = field(default_factory=dict)  # rank -> (attempt, median_s, host)
    slow: dict[int, Straggler] = field(default_factory=dict)  # ranks slow in their latest report(s)
    alerted: set[int] = field(default_factory=set)  # ranks alerted in their current episode

    def update(self, attempt, ranks: dict[int, float], host: str | None = None, at: str | None = None) -> list[Straggler]:
        """One report (a node's ranks: ``{rank: median step time}``); returns the
        stragglers to alert on now (once per rank per episode)."""
        ranks = dict(list(ranks.items())[:MAX_RANKS])
        for rank, s in ranks.items():
            if rank in self.latest and self.latest[rank][0] != attempt:  # a new attempt: a new episode
                self.slow.pop(rank, None)
                self.alerted.discard(rank)
            self.latest[rank] = (attempt, s, host)
        alerts = []
        for rank, s in sorted(ranks.items()):
            others = [v for r, (a, v, _) in self.latest.items() if r != rank and a == attempt]
            median = statistics.median(others) if others else None
            ratio = s / median if median else None
            if ratio is None or not ratio > FACTOR:
                self.slow.pop(rank, None)
                self.alerted.discard(rank)
                continue
            prev = self.slow.get(rank)
            self.slow[rank] = Straggler(rank, host, s, median, ratio, (prev.reports if prev else 0) + 1,
                                        prev.since if prev else at)
            if self.slow[rank].reports >= REPORTS and ratio > ALERT_FACTOR and rank not in self.alerted:
                self.alerted.add(rank)
                alerts.append(self.slow[rank])
        return alerts

    def stragglers(self) -> list[Straggler]:
        return [s for _, s in sorted(self.slow.items()) if s.reports >= REPORTS]


def report_of(progress: dict[int, dict]) -> dict[int, float]:
    """``{rank: step_median_s}`` of the ranks that report one (training ranks only)."""
    return {r: float(p["step_median_s"]) for r, p in progress.items()
            if p.get("state") == "train" and _pos(p.get("step_median_s"))}


def from_events(events: list[dict]) -> list[dict]:
    """The current stragglers of a run's journal (its ``step_times`` events, in order)."""
    t = Tracker()
    for e in events:
        if e.get("kind") != "step_times" or not isinstance(e.get("ranks"), dict):
            continue
        ranks = {}
        for k, v in list(e["ranks"].items())[:MAX_RANKS]:
            try:
                rank = int(k)
            except (TypeError, ValueError):
                continue
            if 0 <= rank < 1 << 31 and _pos(v):
                ranks[rank] = float(v)
        attempt = e.get("attempt") if isinstance(e.get("attempt"), int) else None
        host = e.get("host")[:256] if isinstance(e.get("host"), str) else None
        at = e.get("at")[:64] if isinstance(e.get("at"), str) else None
        t.update(attempt, ranks, host, at)
    return [s.as_dict() for s in t.stragglers()]


def _pos(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
