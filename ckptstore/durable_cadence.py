"""When a Store with ``durable_every="auto"`` promotes a save to the durable tier
(docs/design/in-job-restart.md 7.4, docs/tiers.md).

Young/Daly on the failures the durable tier is for: a promotion is due
``interval_s = min(MAX_INTERVAL_S, sqrt(2 x P x M_cold))`` seconds after the last one
began, where

- ``P`` is the duration of this process's last promotion to end (``promote()`` itself,
  measured by ``tiers.Promoter``: copying the files and, on rank 0, the commit; a
  failed one counts too, it held the durable path as long). It runs in the
  background, so its cost to training is contention, bounded by
  ``promote_bandwidth``. Before any ended: ``PRIOR_PROMOTION_S``.
- ``M_cold`` is the MTBF of the failures that lose the memory tier, or the local tier
  in its place (``ckptstore status``'s ``mtbf_cold_s``: cold restarts whose relaunch
  did not find it, and in-job recoveries that restored from the durable tier), read
  from the run's journal once per process, in round 0
  (:meth:`Cadence.read_mtbf_cold`); before any such failure ``PRIOR_MTBF_COLD_S`` (a
  day), as for ``mtbf_s``.

Never more often than a promotion completes: while one this process scheduled in
the current in-job round is in flight, none is due (no queue of promotions builds
up behind a slow durable store). Steps, not seconds, are promoted: the first save at
or after the due time. A process's first save in round 0 is due at once: it measures
``P``, and a process started after a cold restart gets a durable copy of its new
work at once. A process started in a later round (a warm spare) counts from its
start, with the prior ``P``: the survivors, who measured theirs, decide.

Every rank must promote the same steps (the durable commit needs every rank's vote),
but each has its own ``P``, its own clock and may read another ``M_cold``: the ranks
combine their ``(due, busy)`` flags (:func:`agreed`): promote when any rank is due
and none is busy. The Checkpointer does it within the one all-reduce it makes per
step; a bare ``Store.save`` gathers the flags itself (:meth:`Cadence.decide`).

The state lives per process and per durable store (:func:`for_store`), not per
Store object: an in-job program builds a new Store every round, and the cadence must
outlive the rounds.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import deque

from .supervisor import injob  # (the in-job protocol's names; it imports nothing of the package)

PRIOR_MTBF_COLD_S = 24 * 3600.0  # before a failure that loses memory is seen: one a day
PRIOR_PROMOTION_S = 60.0  # before a promotion of this process ended (a spare's): a minute
MAX_INTERVAL_S = 6 * 3600.0  # never less often: a cold failure loses at most this much work
HISTORY = 64  # steps remembered as promoted (tests, people)


def interval_s(promotion_s: float | None, mtbf_cold_s: float | None) -> float:
    """``min(MAX_INTERVAL_S, sqrt(2 x P x M_cold))``; a P or M that is not a positive
    finite number is replaced by its prior."""
    p = promotion_s if _positive(promotion_s) else PRIOR_PROMOTION_S
    m = mtbf_cold_s if _positive(mtbf_cold_s) else PRIOR_MTBF_COLD_S
    return min(MAX_INTERVAL_S, math.sqrt(2.0 * p * m))


def agreed(flags) -> bool:
    """The ranks' ``(due, busy)`` flags combined: any rank due and no rank busy."""
    flags = list(flags)
    return any(due for due, _ in flags) and not any(busy for _, busy in flags)


def current_round() -> int:
    try:
        return int(os.environ.get(injob.ENV_ROUND) or 0)
    except ValueError:
        return 0


class Cadence:
    """The promotion cadence of one durable store in this process."""

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self.mtbf_cold_s = PRIOR_MTBF_COLD_S
        self.mtbf_source = "prior"  # "journal" once read from one that observed a cold failure
        self._mtbf_read = False
        self.promotion_s: float | None = None  # the last ended promotion's duration
        # When the last promotion began; a spare (round > 0) counts from its start.
        self.last_promoted: float | None = None if current_round() == 0 else clock()
        self._in_flight: list = []  # (SaveFuture of a promotion, the round it was scheduled in)
        self.promoted_steps: deque = deque(maxlen=HISTORY)

    def interval_s(self) -> float:
        return interval_s(self.promotion_s, self.mtbf_cold_s)

    def busy(self) -> bool:
        """A promotion this process scheduled in the current round is in flight (one
        of an earlier round was aborted with it, and may never settle)."""
        now_round = current_round()
        with self._lock:
            self._in_flight = [(f, r) for f, r in self._in_flight if not f.done()]
            return any(r == now_round for _, r in self._in_flight)

    def due(self) -> bool:
        """This rank's own view: the interval has passed since the last promotion began
        (or there was none in this process)."""
        last = self.last_promoted
        return last is None or self._clock() - last >= self.interval_s()

    def flags(self) -> tuple[bool, bool]:
        """``(due, busy)``: what this rank contributes to :func:`agreed`."""
        return self.due(), self.busy()

    def decide(self, group=None) -> bool:
        """Whether this save is promoted, the same on every rank of ``group``: the flags
        gathered (a collective when there are several ranks; every rank calls it at
        the same save)."""
        from .checkpoint.group import gather

        return agreed(gather(self.flags(), group))

    def note_promotion(self, step: int, future) -> None:
        """A promotion of ``step`` was scheduled (its future): the next is due an interval
        from now; its duration becomes P when it ends (``future.promotion_s``, set by
        the Promoter; none for a promotion that never ran)."""
        round_ = current_round()
        with self._lock:
            self.last_promoted = self._clock()
            self._in_flight.append((future, round_))
            self.promoted_steps.append(step)
        future.add_done_callback(lambda f: self._ended(f, round_))

    def _ended(self, future, round_: int) -> None:
        took = getattr(future, "promotion_s", None)
        if _positive(took) and current_round() == round_:  # (not one its round's failure aborted)
            self.promotion_s = float(took)

    def read_mtbf_cold(self, storage) -> float:
        """``M_cold`` from the journal of the store rooted at ``storage`` (its latest
        run), once per process and only in round 0: an in-job round after it keeps the
        value (no durable-store read on a recovery's path; a spare keeps the prior).
        An unreadable journal, or one whose figure is not a positive finite number,
        leaves the prior."""
        with self._lock:
            if self._mtbf_read or current_round() > 0:
                return self.mtbf_cold_s
            self._mtbf_read = True
        found = journal_mtbf_cold(storage)
        if found is not None:
            self.mtbf_cold_s, self.mtbf_source = found, "journal"
        return self.mtbf_cold_s


def journal_mtbf_cold(storage) -> float | None:
    """``mtbf_cold_s`` of the latest run journaled in ``storage`` (supervisor/status.py:
    every event's time taken into [0, now], so it is at most the run's wall clock);
    None without a journal, a cold failure, or a sound figure."""
    from .supervisor.journal import Journal, latest_run
    from .supervisor.status import summarize

    try:
        run = latest_run(storage)
        if run is None:
            return None
        found = summarize(Journal(storage, run).read().events, time.time()).get("mtbf_cold_s")
    except Exception:  # (an unreadable journal teaches nothing; the prior stands)
        return None
    return float(found) if _positive(found) else None


_CADENCES: dict[str, Cadence] = {}
_CADENCES_LOCK = threading.Lock()


def _forget_in_child() -> None:
    """A forked child is another process: the parent's promotions never end in it."""
    global _CADENCES_LOCK
    _CADENCES.clear()
    _CADENCES_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def for_store(durable_url: str) -> Cadence:
    """The cadence of the durable store at ``durable_url`` in this process (made on
    first use): one per process, whatever Store objects open it."""
    with _CADENCES_LOCK:
        cadence = _CADENCES.get(durable_url)
        if cadence is None:
            cadence = _CADENCES[durable_url] = Cadence()
        return cadence


def _positive(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
