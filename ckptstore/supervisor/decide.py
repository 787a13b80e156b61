"""What ``ckptstore run`` does after a failed attempt: the one place where a failure's
class is made final, the limits are applied and the wait before the next launch is
chosen (docs/runbook.md, "Classification" and "Policy options").

:func:`decide` is pure over its inputs: the policy, the run's :class:`History` (which it
updates), the attempt's verdict from classify.py, whether the attempt left a newer
checkpoint, and the time. Given the same inputs, every node's supervisor would take the
same decision.

- **Repeats.** The same error (signature) as the last failure that counts is the
  program's: deterministic. So is a hang at the same step as the last failure's hang
  (a deadlock). An error that names an *outage* (classify.OUTAGE_PATTERNS) is retried
  until the outage has lasted ``outage_window_s`` (from the first failure of an
  unbroken run of outage failures without progress); those failures do not count
  towards ``no_progress_restarts``; once the window is over, the same error again is
  deterministic ("not an outage").
- **A node missing** at the attempt's rendezvous (several nodes: torch's join timeout
  passed) gives up at once (exit 16): a relaunch would wait for it again.
- **Limits**, in this order: deterministic (exit 10), no progress (12; ``no_progress_restarts``
  0: off), restart limit
  (11), failures per hour (11), preemptions per hour (11). Preemptions count only
  towards their own limit and are relaunched at once.
- **Backoff**: ``min(backoff_max_s, backoff_s * 2**(n-1))`` for the n-th failure since
  the last one that left a newer checkpoint (the runner waits a random time between
  half of it and all of it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from . import injob  # (its defaults of a node's loss; it imports nothing of the package)
from .classify import Verdict
from .health import HealthLimits

EXIT_DETERMINISTIC = 10
EXIT_RESTART_LIMIT = 11
EXIT_NO_PROGRESS = 12
EXIT_NODES_MISSING = 16  # several nodes: a node never joined the attempt's rendezvous (consensus.py)
HOUR_S = 3600.0


@dataclass(frozen=True)
class Policy:
    max_restarts: int = 100  # failures in all (preemptions excepted); the run's lifetime budget
    max_restarts_per_hour: int | None = 30  # the rate limit: fires before max_restarts at the defaults
    max_preemptions_per_hour: int | None = 10  # preemptions are relaunched at once: bound them too
    backoff_s: float = 1.0  # first delay before a relaunch; doubles per consecutive failure
    backoff_max_s: float = 60.0
    outage_window_s: float = 600.0  # how long an outage-looking error (or the store) is waited out
    health_wait_s: float = 120.0  # how long failed node health checks are rechecked before exit 13
    hang_timeout_s: float = 600.0  # no rank advanced for this long (saves and loads excepted)
    first_progress_timeout_s: float = 1800.0  # launch to first reported step
    run_timeout_s: float | None = None
    no_progress_restarts: int = 3  # failures in a row without a newer committed step (0: off)
    alert: str | None = None  # a shell command; the event arrives as JSON on its stdin
    health: HealthLimits = HealthLimits()
    # Sections (sections.py): ceilings, and the bound while nothing is measured; learned
    # bounds are min(ceiling, max(floor, section_factor x the longest measured)).
    resume_timeout_s: float = 1800.0
    save_timeout_s: float = 1800.0
    section_factor: float = 3.0  # 0: no learning, the ceilings only
    # During the run (watch.py, stragglers.py): seconds between two health checks of the
    # node and between two step-time reports; 0 turns either off.
    health_interval_s: float = 60.0
    straggler_report_s: float = 60.0
    # Several nodes (consensus.py): a relaunch's wait in torch's rendezvous for every node,
    # and the longest wait for the other nodes' reports of a failed attempt.
    join_timeout_s: float = 120.0
    decision_wait_s: float = 30.0
    # In-job recovery (agent.py, docs/design/in-job-restart.md): a failed rank replaced by
    # a warm spare while the others stay alive; off unless asked for.
    in_job: bool = False
    spares: int = 0  # warm spares per node (--spares; 1 with --in-job unless given)
    memory_dir: str = "/dev/shm/ckptstore"  # the memory tier's directory root (memory.py)
    memory_budget: str = "25%"  # bytes, or N% of MemAvailable at the start
    abort_timeout_s: float = 10.0  # the longest a survivor may take to leave a failed round
    reform_timeout_s: float = 60.0  # survivors' reports, a spare's arrival, a re-form: each bounded by this
    max_rounds_in_a_row: int = 3  # in-job recoveries in a row without a new step before going cold
    # In-job on several nodes (injob_nodes.BeatWatch): a node whose agent's beat stood
    # still for node_silent_s is lost. Sooner with corroborating evidence, once a rank's
    # collective failed (a fault notice in the round): its agent's port refuses a
    # connection (the agent is dead), or its beat stood still for node_fault_silent_s and
    # the agent did not answer within node_probe_timeout_s. A node whose agent answers is
    # never lost before node_silent_s. node_fault_silent_s 0: the beat timeout alone.
    node_silent_s: float = injob.NODE_SILENT_S
    node_fault_silent_s: float = injob.NODE_FAULT_SILENT_S
    node_probe_timeout_s: float = injob.NODE_PROBE_TIMEOUT_S
    # Each node's supervisor overwrites its heartbeat object in the store every
    # heartbeat_s (at most a quarter of the timeout); a peer whose beat did not change for
    # heartbeat_timeout_s, as this node watched it, is gone: its report is not waited
    # for, and a running attempt that counts on it is stopped (0: off).
    heartbeat_s: float = 5.0
    heartbeat_timeout_s: float = 20.0


@dataclass
class History:
    """What decisions remember of the run's failures."""

    failures: list[float] = field(default_factory=list)  # times of the failures that count
    preemptions: list[float] = field(default_factory=list)
    stalled: int = 0  # counted failures in a row without a newer checkpoint (outages excepted)
    consecutive: int = 0  # failures since the last that left a newer checkpoint (the backoff's n)
    previous: Verdict | None = None  # the last failure that counts (not a preemption)
    outage_since: float | None = None  # the first failure of the current outage
    outage_failures: int = 0


@dataclass(frozen=True)
class Decision:
    klass: str  # the failure's final class (journaled)
    reason: str
    backoff_s: float = 0.0  # the longest wait before the relaunch (0: at once)
    code: int | None = None  # give up with this exit status (None: relaunch)
    give_up_class: str | None = None
    give_up_reason: str | None = None


def decide(policy: Policy, history: History, v: Verdict, advanced: bool, now: float,
           checkpoint: int | None = None) -> Decision:
    """The final class of the failure ``v`` and what to do next (see the module
    docstring). ``advanced``: the attempt left a checkpoint newer than the one it
    started from; ``checkpoint``: the step the next attempt resumes from (None: none).
    Updates ``history``."""
    if v.klass == "preempted":
        history.preemptions.append(now)
        history.stalled = 0  # a preemption is no fault of the job: the no-progress count starts over
        if advanced:
            history.consecutive = 0
        hour = [t for t in history.preemptions if now - t < HOUR_S]
        limit = policy.max_preemptions_per_hour
        if limit is not None and len(hour) > limit:
            return Decision(v.klass, v.reason, code=EXIT_RESTART_LIMIT, give_up_class="preemption_limit",
                            give_up_reason=f"{len(hour)} preemptions within an hour (limit {limit}): something "
                            "keeps stopping the job")
        return Decision(v.klass, v.reason)
    if v.klass == "deterministic":
        return _give_up(v.klass, v.reason, EXIT_DETERMINISTIC, "deterministic", f"deterministic error: {v.reason}")
    if v.evidence.get("nodes_missing"):  # relaunching would wait the join timeout again, for nobody
        return _give_up(v.klass, v.reason, EXIT_NODES_MISSING, "nodes_missing", v.reason)

    prev = history.previous
    klass, reason = v.klass, v.reason
    in_outage = False
    if v.outage:
        if history.outage_since is None or advanced:
            history.outage_since, history.outage_failures = now, 0
        history.outage_failures += 1
        lasted = now - history.outage_since
        in_outage = lasted < policy.outage_window_s
    else:
        history.outage_since, history.outage_failures = None, 0
    same = prev is not None and v.signature is not None and v.signature == prev.signature
    if v.klass == "hang" and prev is not None and prev.klass == "hang" and \
            v.evidence.get("step") is not None and v.evidence.get("step") == prev.evidence.get("step"):
        klass, reason = "deterministic", f"hung twice at step {v.evidence['step']} (a deadlock?): {v.reason}"
    elif same and v.outage and not in_outage:
        klass, reason = "deterministic", (f"the same error for {lasted:.0f}s, {history.outage_failures} failures "
                                          f"(outage window {policy.outage_window_s:g}s): not an outage: {v.reason}")
    elif same and not v.outage:
        klass, reason = "deterministic", f"failed the same way twice: {v.reason}"
    elif in_outage:
        reason = (f"{v.reason} (an outage? retried until it has lasted {policy.outage_window_s:g}s: "
                  f"{lasted:.0f}s so far)")
    elif v.signature is not None:
        reason = f"{v.reason} (first time: retried)"
    if klass == "deterministic":
        return _give_up(klass, reason, EXIT_DETERMINISTIC, "deterministic", f"deterministic error: {reason}")

    history.failures.append(now)
    history.previous = v
    history.stalled = 0 if advanced else history.stalled + (0 if in_outage else 1)
    history.consecutive = 1 if advanced else history.consecutive + 1
    if policy.no_progress_restarts > 0 and history.stalled >= policy.no_progress_restarts:  # 0: off
        newer = f"no checkpoint newer than step {checkpoint}" if checkpoint is not None else \
            "no checkpoint committed"
        return _give_up(klass, reason, EXIT_NO_PROGRESS, "no_progress",
                        f"{newer} in {history.stalled} failures in a row")
    if len(history.failures) > policy.max_restarts:
        return _give_up(klass, reason, EXIT_RESTART_LIMIT, "restart_limit",
                        f"restart limit reached ({policy.max_restarts})")
    hour = [t for t in history.failures if now - t < HOUR_S]
    if policy.max_restarts_per_hour is not None and len(hour) > policy.max_restarts_per_hour:
        return _give_up(klass, reason, EXIT_RESTART_LIMIT, "restart_limit",
                        f"{len(hour)} failures within an hour (limit {policy.max_restarts_per_hour})")
    return Decision(klass, reason, backoff_s=backoff(policy, history.consecutive))


def backoff(policy: Policy, n: int) -> float:
    """The longest wait before relaunch number ``n`` of a stretch without progress."""
    if n <= 0:
        return 0.0
    return min(policy.backoff_max_s, policy.backoff_s * 2 ** min(n - 1, 64))


def outage_relaunches(policy: Policy) -> int:
    """The most relaunches one outage can take: the waits are at least half the backoff,
    so this many of them fill the outage window (documented in the runbook)."""
    waited, n = 0.0, 0
    while waited < policy.outage_window_s and n < 10_000:
        n += 1
        step = backoff(policy, n) / 2
        if step <= 0 or not math.isfinite(step):
            return 10_000
        waited += step
    return n


def _give_up(klass: str, reason: str, code: int, give_up_class: str, give_up_reason: str) -> Decision:
    return Decision(klass, reason, code=code, give_up_class=give_up_class, give_up_reason=give_up_reason)
