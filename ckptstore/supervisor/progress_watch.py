"""Hang detection over the ranks' progress files (progress.py): what the runner
(one attempt, every rank) and the in-job node agent (agent.py, per round) both judge."""

from __future__ import annotations

import math
import time

from .decide import Policy


class ProgressWatch:
    """Hang detection over the ranks' progress files."""

    def __init__(self, launched: float):
        self.launched = launched
        self.last_change = launched
        self.seen: dict[int, tuple] = {}
        self.max_step: int | None = None
        self.first_step_t: float | None = None
        self.busy = False  # some rank is loading or saving: not a hang
        self.step_s: float | None = None
        self.save_blocking_s: float | None = None
        self.trained = False
        self.resume_reported = False  # some rank said where it resumed from (None: a fresh start)
        self.resumed_step: int | None = None
        self.committed_step: int | None = None  # the newest step a rank resumed from or committed
        self.committed_t: float | None = None  # when that step committed (unix seconds), if known

    def update(self, progress: dict[int, dict]) -> None:
        now = time.monotonic()
        for rank, p in progress.items():
            key = (p.get("state"), p.get("step"), p.get("t"))
            if self.seen.get(rank) != key:
                self.seen[rank] = key
                self.last_change = now
            if isinstance(p.get("step"), int) and p.get("first_step_t") is not None:
                self.trained = True
                self.max_step = p["step"] if self.max_step is None else max(self.max_step, p["step"])
            if rank == 0 or self.first_step_t is None:
                if isinstance(p.get("first_step_t"), (int, float)):
                    self.first_step_t = p["first_step_t"] if self.first_step_t is None else min(
                        self.first_step_t, p["first_step_t"])
            for name in ("step_s", "save_blocking_s"):
                if isinstance(p.get(name), (int, float)) and math.isfinite(p[name]):
                    setattr(self, name, p[name])
            if "resumed_step" in p:
                self.resume_reported = True
                if is_step(p["resumed_step"]):
                    self.resumed_step = p["resumed_step"]
            step = p.get("committed_step")  # (the step it resumed from, or a newer one it saw committed)
            if is_step(step) and (self.committed_step is None or step > self.committed_step):
                t = p.get("committed_t")
                self.committed_step = step
                self.committed_t = t if isinstance(t, (int, float)) and math.isfinite(t) else None
        self.busy = any(p.get("state") in ("loading", "saving") for p in progress.values())
        if self.busy:
            self.last_change = now

    def hung(self, policy: Policy, now: float | None = None) -> str | None:
        """Why the attempt is hung, or None. Only ranks that report progress are judged:
        a script that never reports (no Checkpointer) is never hung. Monotonic clock only
        (``launched``, ``last_change``: the supervisor's reads). The first-progress check is
        subsumed by sections.py's ``startup`` bound, which it precedes each poll; kept for
        its reason and journal (docs/runbook.md, "Two first-step timeouts")."""
        now = time.monotonic() if now is None else now
        if not self.seen:
            return None
        if not self.trained:
            if now - self.launched > policy.first_progress_timeout_s and not self.busy:
                return f"no training step within {policy.first_progress_timeout_s:.0f}s of the launch"
            return None
        if now - self.last_change > policy.hang_timeout_s:
            return f"no rank reported progress for {policy.hang_timeout_s:.0f}s (last step {self.max_step})"
        return None


def is_step(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 63
