"""Bounded sections: every phase of a supervised rank ends in bounded time
(docs/runbook.md, "Section timeouts").

A rank under ``ckptstore run`` reports the section it is in (progress.py: ``section``,
``section_t``) and the longest duration it measured of each (``longest``). Sections:

- ``startup``: from the launch to the attempt's first training step (the resume
  included). Judged by the supervisor from the launch time. Before any rank of the
  attempt has reported, it is judged only when an earlier attempt of this run reported
  (this run's journal holds a measured ``startup``): the script is then known to report,
  and a hang in its imports or the process group's set-up ends too.
- ``resume``: inside ``Checkpointer.resume()`` (state ``loading``).
- ``save``: the blocking part of a save, and a wait for saves to commit (after a
  SIGTERM, ``ckptstore.wait()``, the exit's drain). Measured as a save's time from its
  start to its commit, which bounds both.
- ``step``: between two ``Checkpointer.step()`` calls: ``--hang-timeout``, judged as
  before by runner._ProgressWatch (no rank's report changed), never learned (an
  evaluation pass inside the loop is a step the Checkpointer cannot tell from a slow
  one).

The bound of ``startup``, ``resume`` and ``save``:

    measured:     min(ceiling, max(floor, FACTOR x the longest measured duration))
    not measured: ceiling

where ceiling is the policy's ``first_progress_timeout_s`` / ``resume_timeout_s`` /
``save_timeout_s`` (``--first-progress-timeout``, ``--resume-timeout``,
``--save-timeout``), the floors are :data:`FLOORS`, and the longest duration is the
longest of this run: the ``sections`` events of its journal (one per attempt) and what
the ranks of the running attempt report. ``section_factor`` 0 turns learning off (the
ceilings only). :func:`judge` is pure over its inputs (the ranks' reports, the clock).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

FACTOR = 3.0  # x the longest measured duration of a section in this run
# Nothing measured is ended sooner than this: a first save after a resize, a resume
# from the durable tier after the local one was lost, a cold cache take longer than
# anything measured before.
FLOORS = {"startup": 600.0, "resume": 300.0, "save": 300.0}
LEARNED = ("startup", "resume", "save")


@dataclass(frozen=True)
class Bound:
    section: str
    seconds: float
    source: str  # "learned", "floor", "ceiling" (nothing measured, or learning off)
    measured_s: float | None  # the longest duration measured in this run, if any
    option: str  # the option that sets the ceiling
    factor: float = FACTOR

    def explain(self) -> str:
        if self.source == "ceiling" and self.measured_s is None:
            return f"{self.option} {self.seconds:g}s; nothing measured yet"
        if self.source == "ceiling":
            return f"{self.option} {self.seconds:g}s (the ceiling; longest measured {self.measured_s:.3g}s)"
        if self.source == "floor":
            return f"the floor {self.seconds:g}s (longest measured {self.measured_s:.3g}s)"
        return f"learned: {self.factor:g} x the longest measured {self.measured_s:.3g}s"


@dataclass(frozen=True)
class Timeout:
    """A section that ran past its bound: the evidence journaled (``section_timeout``)."""

    section: str
    rank: int | None  # None: the attempt's startup before any rank reported
    step: int | None
    elapsed_s: float
    bound: Bound

    def reason(self) -> str:
        who = f"rank {self.rank}" if self.rank is not None else "the attempt"
        at = f" at step {self.step}" if self.step is not None else ""
        return (f"{who}: {self.section} section{at} still running after {self.elapsed_s:.0f}s, over its bound "
                f"of {self.bound.seconds:g}s ({self.bound.explain()})")

    def event(self) -> dict:
        return {"section": self.section, "rank": self.rank, "step": self.step, "elapsed_s": self.elapsed_s,
                "bound_s": self.bound.seconds, "source": self.bound.source, "measured_s": self.bound.measured_s,
                "factor": self.bound.factor, "floor_s": FLOORS.get(self.section), "option": self.bound.option}


_OPTION = {"startup": ("first_progress_timeout_s", "--first-progress-timeout"),
           "resume": ("resume_timeout_s", "--resume-timeout"),
           "save": ("save_timeout_s", "--save-timeout")}


class Sections:
    """The run's longest measured section durations, and the bounds they give."""

    def __init__(self, policy):
        self.policy = policy
        self.longest: dict[str, float] = {}
        # (rank, section, clock, start) of a section dated in the future -> ``now`` (monotonic)
        # when first seen: its elapsed time counts from there
        self._future: dict[tuple, float] = {}

    def observe(self, section: str, seconds) -> None:
        if section in LEARNED and _seconds(seconds) is not None:
            self.longest[section] = max(self.longest.get(section, 0.0), float(seconds))

    def learn_from_journal(self, events: list[dict]) -> None:
        """``sections`` events (``longest``) and ``resume`` events (``first_step_s``:
        a startup) of this run."""
        for e in events:
            if e.get("kind") == "sections" and isinstance(e.get("longest"), dict):
                for name, s in e["longest"].items():
                    self.observe(name, s)
            elif e.get("kind") == "resume":
                self.observe("startup", e.get("first_step_s"))

    def observe_progress(self, progress: dict[int, dict]) -> None:
        for p in progress.values():
            longest = p.get("longest")
            if isinstance(longest, dict):
                for name in ("resume", "save"):
                    self.observe(name, longest.get(name))

    def bound(self, section: str) -> Bound:
        attr, option = _OPTION[section]
        ceiling = float(getattr(self.policy, attr))
        measured = self.longest.get(section)
        factor = float(getattr(self.policy, "section_factor", FACTOR))
        if measured is None or not factor > 0:
            return Bound(section, ceiling, "ceiling", measured, option, factor)
        floor = FLOORS[section]
        learned = factor * measured
        if learned >= ceiling or floor >= ceiling:
            return Bound(section, ceiling, "ceiling", measured, option, factor)
        if learned <= floor:
            return Bound(section, floor, "floor", measured, option, factor)
        return Bound(section, learned, "learned", measured, option, factor)

    def judge(self, progress: dict[int, dict], launched: float, now: float, reported_before: bool,
              now_t: float | None = None) -> Timeout | None:
        """The first section (of the ranks, lowest rank first) past its bound, else None.
        ``launched``, ``now``: ``time.monotonic()`` seconds (system-wide on Linux: the
        ranks' progress files are node-local and carry ``section_mono`` on that clock);
        ``now_t``: unix seconds, for files without ``section_mono`` (older ranks) only;
        ``reported_before``: an earlier attempt of this run reported (the startup is
        judged before any rank of this one has)."""
        self.observe_progress(progress)
        for rank in sorted(progress):
            p = progress[rank]
            section = p.get("section")
            if section not in ("resume", "save") or p.get("state") not in ("loading", "saving"):
                continue
            elapsed = self._elapsed(rank, p, now, now_t)
            if elapsed is None:
                continue
            b = self.bound(section)
            if elapsed > b.seconds:
                return Timeout(section, rank, _step(p.get("step")), elapsed, b)
        # The startup: launch to the first step, the time of a resume excepted while one runs
        # (the resume has its own bound).
        started = any(isinstance(p.get("first_step_t"), (int, float)) for p in progress.values())
        loading = any(p.get("state") == "loading" for p in progress.values())
        if started or loading or not (progress or reported_before):
            return None
        b = self.bound("startup")
        elapsed = max(0.0, now - launched)
        if elapsed > b.seconds:
            steps = [s for s in (_step(p.get("step")) for p in progress.values()) if s is not None]
            return Timeout("startup", None, max(steps) if steps else None, elapsed, b)
        return None

    def _elapsed(self, rank: int, p: dict, now: float, now_t: float | None) -> float | None:
        """How long the rank has been in its section: by ``section_mono`` against ``now``,
        else (an older file) by the wall clock, ``section_t`` (or ``t``) against ``now_t``.
        A start in the future (a clock stepped back, a skewed writer) counts as starting
        when first seen, remembered: judged from then on, never off for good."""
        clock, began = "mono", _seconds(p.get("section_mono"))
        if began is None:
            clock, began = "wall", _seconds(p.get("section_t"))
            if began is None:
                began = _seconds(p.get("t"))
        if began is None:
            return None
        ref = now if clock == "mono" else (now_t if now_t is not None else time.time())
        if began <= ref:
            return ref - began
        key = (rank, p.get("section"), clock, began)
        if key not in self._future:
            if len(self._future) > 4096:  # a bound on hostile files; a forgotten one restarts its wait
                self._future.clear()
            self._future[key] = now
        return max(0.0, now - self._future[key])

    def attempt_longest(self, progress: dict[int, dict], first_step_s: float | None) -> dict:
        """What this attempt measured (journaled as its ``sections`` event)."""
        out: dict[str, float] = {}
        for p in progress.values():
            longest = p.get("longest")
            if isinstance(longest, dict):
                for name in ("resume", "step", "save"):
                    s = _seconds(longest.get(name))
                    if s is not None:
                        out[name] = max(out.get(name, 0.0), s)
        if _seconds(first_step_s) is not None:
            out["startup"] = float(first_step_s)
        return out


def _seconds(v) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        return None
    return float(v)


def _step(v) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 63 else None
