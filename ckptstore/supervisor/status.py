"""``ckptstore status``: a run's health, a pure function of its journal and the store's
newest committed checkpoint.

Definitions (t: an event's ``t``; events in journal order; one ``failure`` and one
``resume`` per attempt count: the first of each, since the supervisors of several
nodes may each journal the same one):

- ``start``: the first ``run_start`` (else the first event); ``end``: the terminal
  event (``finish``, ``give_up``, ``unhealthy``) when the run is over, else ``now``;
  ``wall_s = end - start``.
- ``state``: set by the last of run_start / attempt_start (``running``), finish
  (``finished``), give_up (``gave_up``), unhealthy (``unhealthy``); ``empty`` without
  events.
- ``restarts``: distinct attempts started, minus 1 (at least 0).
- ``mtbf_s = wall_s / failures``, ``preempted`` ones excluded (a preemption is the
  scheduler's, not a fault of the job); None without such failures.
- ``lost_steps``, ``lost_s``: sums over the failures' own figures (work redone).
- ``startup_s``: attempt 0's ``first_step_s``; when attempt 0 never reached a step,
  the first resume's ``t - start``; with no resume at all, ``wall_s`` (nothing has
  trained yet).
- ``recovery_s``: training is down from the first failure after a resume until the
  next resume: ``sum(resume_k.t - failure_{k-1}.t)`` when every attempt reaches a
  step, plus, when the run is down at ``end`` (failed and not yet resumed, or gave
  up), ``end - t`` of that failure. Failures before any resume are startup.
- ``goodput = (wall_s - startup_s - recovery_s - lost_s) / wall_s``, clamped to [0, 1];
  None while ``wall_s`` is 0.
- In-job recoveries (``recovery`` events, one per (attempt, round)): listed among
  ``failures`` with ``recovered: "in_job"`` (a cold one says ``"cold"``), counted in
  ``failures_by_class`` and ``mtbf_s``; their ``lost_steps`` / ``lost_s`` add to the
  sums; ``recovery_s`` adds each one's ``first_step_s`` (the fault to the last rank's
  first step of the new round); ``recoveries``: ``count``, ``median`` and ``max`` of
  each duration (``detect_s``, ``teardown_s``, ``decide_s``, ``reform_s``,
  ``restore_s``, ``first_step_s``), ``restore_from`` (tier -> ranks restored from it, summed);
  each recovery's own durations and ``restore_from`` are on its ``failures`` record.
- ``mtbf_cold_s = wall_s / cold_failures``, None without any: the MTBF of the failures
  that lose the memory tier (or the local tier in its place), after which only the
  durable tier restores (``durable_every="auto"``, durable_cadence.py). Each record of
  ``failures`` says ``loses_memory``: a cold restart (``failure``, not ``preempted``: a
  preemption's save goes to the durable tier) does, unless the next attempt's
  ``resume`` restored from the ``memory``, ``peer`` or ``local`` tier (one node: the
  memory directory outlives a relaunch); an in-job ``recovery`` does only when its
  ``restore_from`` names ``durable`` (a node lost without a surviving partner). ``recovery_failed`` and ``in_job_gave_up`` are not counted: a
  round that fails is retried in-job or ends in the attempt's ``failure``.
  ``recoveries.nodes_rejoined``: ``node_rejoined`` events (a lost node back in its
  running in-job attempt as a node of spares).
- Young/Daly: ``recommended_interval_s = min(MAX_INTERVAL_S, max(MIN_INTERVAL_SAVES * C,
  sqrt(2 * C * M)))``, C the latest journaled ``save_blocking_s``, M ``mtbf_s`` or,
  before the first failure that counts, ``PRIOR_MTBF_S``; ``recommended_interval_steps
  = max(1, round(interval / step_s))`` with the latest journaled ``step_s``. None while
  C (or step_s) was never measured.

The journal is untrusted input, and so is a caller's event list: an event's ``t`` is
taken into ``[0, now]`` (no event can show a run longer than the clock allows, so
``mtbf_s <= wall_s <= now - start``; a ``finish`` that claimed ``t: 1e300`` made the
MTBF 1e300 s and ``every="auto"`` stop saving), events are taken in time order, and
every field copied into the summary is reduced to its documented type and a bounded
size (``command``: at most ``MAX_LIST`` strings; ``checks``: at most ``MAX_LIST``
records of scalar fields), so that no event can crash ``status`` or its JSON. Every
string copied is redacted (``journal.redact_text``: no URL's password or signature),
also for journals written before the writer redacted.
"""

from __future__ import annotations

import math
import time

from .. import format as fmt
from .. import names
from ..checkpoint.catalog import read_skip_mark, scan_location
from ..storage import Storage
from .journal import URL_TOKEN_MAX, Journal, finite_float, latest_run, redact_text
from .stragglers import from_events as stragglers_from_events

PRIOR_MTBF_S = 24 * 3600.0  # before a failure is seen: one a day, a common large-job figure
# The longest interval status recommends and every="auto" waits between saves, whatever
# the journal says: a failure then costs at most this much work.
MAX_INTERVAL_S = 6 * 3600.0
# The shortest: this many times the blocking cost of a save, whatever MTBF the journal
# claims (100,000 failure events in a minute made it ~0 and every="auto" save at every
# step), so the blocking saves never take more than a sixth of the run's time. Young/Daly
# is below it only for an MTBF under 12.5 save costs, where it no longer holds anyway.
MIN_INTERVAL_SAVES = 5.0
MAX_LIST = 256  # entries of a journaled list (command, checks) copied into a summary
CLASSES = ("transient", "deterministic", "hang", "preempted")
_TERMINAL = {"finish": "finished", "give_up": "gave_up", "unhealthy": "unhealthy"}
_TEXT = 4096  # hostile strings are cut to this many characters


def summarize(events: list[dict], now: float, checkpoint: dict | None = None) -> dict:
    """The status of one run (see the module docstring); never raises on odd events."""
    now = _num(now) or 0.0
    # each event at a time the clock allows, in time order (stable: ties keep their order)
    events = sorted(({**e, "t": min(max(0.0, _num(e.get("t"))), now)} for e in events
                     if isinstance(e, dict) and _num(e.get("t")) is not None), key=lambda e: e["t"])
    ckpt_step = _int(checkpoint.get("step")) if checkpoint else None
    ckpt_t = _num(checkpoint.get("committed_at_t")) if checkpoint else None
    out = {"run": None, "state": "empty", "started_at": None, "wall_s": 0.0, "restarts": 0, "attempts": 0,
           "step": None, "failures": [], "failures_by_class": dict.fromkeys(CLASSES, 0), "mtbf_s": None,
           "lost_steps": 0, "lost_s": 0.0, "startup_s": 0.0, "recovery_s": 0.0, "goodput": None,
           "cold_failures": 0, "mtbf_cold_s": None, "checkpoint_step": ckpt_step,
           "checkpoint_age_s": None if ckpt_t is None else max(0.0, now - ckpt_t),
           "last_failure": None, "last_resume": None, "last_event_at": None, "give_up": None, "unhealthy": None,
           "save_blocking_s": None, "step_s": None, "mtbf_source": None,
           "recommended_interval_s": None, "recommended_interval_steps": None, "stragglers": [],
           "section_timeouts": [], "run_health": [], "recoveries": _recoveries([])}
    if not events:
        return out
    first = next((e for e in events if e.get("kind") == "run_start"), events[0])
    start = first["t"]
    out.update(run=_str(first.get("run"), 128), started_at=_str(first.get("at"), 64),
               last_event_at=_str(events[-1].get("at"), 64))
    if first.get("kind") == "run_start":
        if "command" in first:
            out["command"] = _strs(first["command"])
        for k in ("world_size", "nnodes"):
            if k in first:
                out[k] = _int(first[k])

    state, end = "running", now
    attempts, failures, resumes, recoveries = set(), {}, {}, {}
    rejoins = set()  # (attempt, node, join): a lost node back in its in-job attempt (agent.py)
    for e in events:
        kind, attempt = _str(e.get("kind"), 64), _int(e.get("attempt"))
        if kind in ("run_start", "attempt_start"):
            state, end = "running", now
            if kind == "attempt_start":
                attempts.add(attempt)
        elif kind in _TERMINAL:
            state, end = _TERMINAL[kind], e["t"]
            if kind == "give_up":
                out["give_up"] = {"reason": _str(e.get("reason")), "code": _int(e.get("code")),
                                  "class": _str(e.get("class"), 64), "at": _str(e.get("at"), 64)}
            elif kind == "unhealthy":
                out["unhealthy"] = {"checks": _checks(e.get("checks")), "at": _str(e.get("at"), 64)}
        elif kind == "failure":
            failures.setdefault(attempt if attempt is not None else ("?", id(e)), e)
        elif kind == "recovery":  # (several nodes' supervisors: the first of each round counts)
            recoveries.setdefault((attempt, _int(e.get("round"))) if attempt is not None else ("?", id(e)), e)
        elif kind == "node_rejoined":
            rejoins.add((attempt, _int(e.get("node")), _int(e.get("join"))))
        elif kind == "resume":
            resumes.setdefault(attempt if attempt is not None else ("?", id(e)), e)
        for k in ("save_blocking_s", "step_s"):  # the latest measurement wins
            if (_num(e.get(k)) or 0) > 0:
                out[k] = float(e[k])
        if _int(e.get("step")) is not None and kind in ("resume", "failure", "finish"):
            out["step"] = _int(e["step"])
    wall = max(0.0, end - start)
    out.update(state=state, wall_s=wall, attempts=len(attempts), restarts=max(0, len(attempts) - 1))

    fails = sorted(failures.values(), key=lambda e: e["t"])
    in_job = sorted(recoveries.values(), key=lambda e: e["t"])
    both = sorted([(e["t"], _failure_record(e)) for e in fails] + [(e["t"], _recovery_record(e)) for e in in_job],
                  key=lambda te: te[0])
    out["failures"] = [{**f, "loses_memory": _loses_memory(f, resumes)} for _, f in both]
    for f in out["failures"]:
        out["failures_by_class"][f["class"]] = out["failures_by_class"].get(f["class"], 0) + 1
    if both:
        last = max(fails + in_job, key=lambda e: e["t"])
        out["last_failure"] = {**out["failures"][-1], "traceback": _str(last.get("traceback"), 16384)}
    out["recoveries"] = {**_recoveries(in_job), "nodes_rejoined": len(rejoins)}
    # (max: a journal written before lost work was clamped may hold a negative figure)
    out["lost_steps"] = sum(max(0, f["lost_steps"] or 0) for f in out["failures"])
    out["lost_s"] = sum(max(0.0, f["lost_s"] or 0.0) for f in out["failures"])
    counted = sum(f["class"] != "preempted" for f in out["failures"])
    out["mtbf_s"] = wall / counted if counted and wall > 0 else None  # (no time seen: no figure)
    cold = sum(f["loses_memory"] for f in out["failures"])
    out["cold_failures"] = cold
    out["mtbf_cold_s"] = wall / cold if cold and wall > 0 else None

    if resumes:  # where the latest attempt started from (two tiers: which copy)
        r = max(resumes.values(), key=lambda e: e["t"])
        out["last_resume"] = {"attempt": _int(r.get("attempt")), "step": _int(r.get("step")),
                              "tier": _str(r.get("tier"), 16), "checkpoint_age_s": _num(r.get("checkpoint_age_s"))}
    out["startup_s"], out["recovery_s"] = _downtime(sorted(resumes.values(), key=lambda e: e["t"]), fails,
                                                    resumes.get(0), start, end)
    out["recovery_s"] += sum(max(0.0, _num(e.get("first_step_s")) or 0.0) for e in in_job)
    if wall > 0:
        useful = wall - out["startup_s"] - out["recovery_s"] - out["lost_s"]
        out["goodput"] = min(1.0, max(0.0, useful / wall))

    out["stragglers"] = stragglers_from_events(events)
    out["section_timeouts"] = [_section_timeout(e) for e in events if e.get("kind") == "section_timeout"][-MAX_LIST:]
    out["run_health"] = [{"attempt": _int(e.get("attempt")), "action": _str(e.get("action"), 16),
                          "checks": _checks(e.get("checks")), "at": _str(e.get("at"), 64)}
                         for e in events if e.get("kind") == "run_health"][-MAX_LIST:]

    c = out["save_blocking_s"]
    observed = out["mtbf_s"] is not None
    out["mtbf_source"] = "observed" if observed else "prior"
    if c is not None:
        interval = young_daly(c, out["mtbf_s"] if observed else PRIOR_MTBF_S)
        out["recommended_interval_s"] = interval
        steps = interval / out["step_s"] if out["step_s"] else None
        if steps is not None and math.isfinite(steps):
            out["recommended_interval_steps"] = max(1, round(steps))
    return _finite(out)


def young_daly(save_s: float, mtbf_s: float) -> float:
    """Young/Daly's checkpoint interval ``sqrt(2 * save_s * mtbf_s)``, at least
    MIN_INTERVAL_SAVES times ``save_s`` and at most MAX_INTERVAL_S (0 for a cost or MTBF
    that is not a positive finite number)."""
    if not (_num(save_s) and _num(mtbf_s)) or save_s <= 0 or mtbf_s <= 0:
        return 0.0
    return min(MAX_INTERVAL_S, max(MIN_INTERVAL_SAVES * save_s, math.sqrt(2.0 * save_s * mtbf_s)))


def _finite(o):
    """``o`` with every float that is not finite (a journaled 1e308 summed, or divided by
    a tiny one) made None: no figure, rather than a crash or JSON's non-standard Infinity."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, list):
        return [_finite(v) for v in o]
    return o


def _downtime(resumes: list[dict], fails: list[dict], resume0: dict | None, start: float, end: float):
    """(startup_s, recovery_s) as the module docstring defines them."""
    if not resumes:
        return max(0.0, end - start), 0.0
    startup = _num(resume0.get("first_step_s")) if resume0 is not None else None
    startup = max(0.0, startup if startup is not None else resumes[0]["t"] - start)
    # merge the two time-ordered streams: "up" at a resume, "down" at the first failure after one
    recovery, down_since, up = 0.0, None, False
    marks = sorted([(e["t"], 1, "resume") for e in resumes] + [(e["t"], 0, "failure") for e in fails])
    for t, _, what in marks:
        if what == "resume":
            if down_since is not None:
                recovery += max(0.0, t - down_since)
            down_since, up = None, True
        elif up:
            down_since, up = t, False
    if down_since is not None:
        recovery += max(0.0, end - down_since)
    return startup, recovery


RECOVERY_PARTS = ("detect_s", "teardown_s", "decide_s", "reform_s", "restore_s", "first_step_s")


def _recoveries(events: list[dict]) -> dict:
    """The ``recoveries`` summary (module docstring) of in-job ``recovery`` events."""
    out: dict = {"count": len(events)}
    for part in RECOVERY_PARTS:
        values = sorted(v for v in (_nonneg(e.get(part)) for e in events) if v is not None)
        out[part] = {"median": _median(values), "max": values[-1] if values else None}
    tiers: dict[str, int] = {}
    for e in events:
        for name, count in _restored_from(e).items():
            tiers[name] = tiers.get(name, 0) + count
    out["restore_from"] = tiers
    return out


def _restored_from(e: dict) -> dict[str, int]:
    """A recovery event's ``restore_from`` as tier -> how many ranks restored from it."""
    where = e.get("restore_from")
    tiers: dict[str, int] = {}
    for tier, ranks in (list(where.items())[:MAX_LIST] if isinstance(where, dict) else []):
        name = _str(tier, 32)
        if name:
            tiers[name] = tiers.get(name, 0) + (len(ranks) if isinstance(ranks, list) else 0)
    return tiers


def _median(values: list[float]) -> float | None:
    if not values:
        return None
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def _recovery_record(e: dict) -> dict:
    """An in-job recovery as a failure of the ``failures`` list."""
    ranks = e.get("ranks") if isinstance(e.get("ranks"), list) else []
    rank = next((r for r in (_int(x) for x in ranks) if r is not None), None)
    return {**_failure_record({**e, "rank": rank, "checkpoint_step": e.get("restored_step")}),
            "recovered": "in_job", "round": _int(e.get("round")), "detected_by": _str(e.get("detected_by"), 64),
            **{part: _nonneg(e.get(part)) for part in RECOVERY_PARTS}, "restore_from": _restored_from(e)}


def _nonneg(value) -> float | None:
    v = _num(value)
    return v if v is not None and v >= 0 else None


# A restore from these tiers: the tier above the durable one survived the failure (a
# local tier is the memory tier's place in a store of two tiers); from "durable": lost.
_UPPER_TIERS = ("memory", "peer", "local")


def _loses_memory(record: dict, resumes: dict) -> bool:
    """Whether a failure lost the memory tier (module docstring, ``mtbf_cold_s``)."""
    if record["recovered"] == "in_job":
        return "durable" in record["restore_from"]
    if record["class"] == "preempted":
        return False
    attempt = record["attempt"]
    after = resumes.get(attempt + 1) if attempt is not None else None
    return not (after is not None and _str(after.get("tier"), 16) in _UPPER_TIERS)


def _section_timeout(e: dict) -> dict:
    return {"attempt": _int(e.get("attempt")), "section": _str(e.get("section"), 16), "rank": _int(e.get("rank")),
            "step": _int(e.get("step")), "elapsed_s": _num(e.get("elapsed_s")), "bound_s": _num(e.get("bound_s")),
            "source": _str(e.get("source"), 16), "measured_s": _num(e.get("measured_s")),
            "at": _str(e.get("at"), 64)}


def _failure_record(e: dict) -> dict:
    klass = _str(e.get("class"), 64) or "unknown"
    return {"attempt": _int(e.get("attempt")), "class": klass, "reason": _str(e.get("reason")),
            "at": _str(e.get("at"), 64), "host": _str(e.get("host"), 256), "step": _int(e.get("step")),
            "rank": _int(e.get("rank")), "exit_code": _int(e.get("exit_code")), "signal": _str(e.get("signal"), 64),
            "checkpoint_step": _int(e.get("checkpoint_step")), "checkpoint_age_s": _num(e.get("checkpoint_age_s")),
            "lost_steps": _int(e.get("lost_steps")), "lost_s": _num(e.get("lost_s")), "recovered": "cold"}


def newest_checkpoint(storage: Storage, at_most: int | None = None) -> dict | None:
    """{"step", "committed_at_t"} of the highest committed ``step-N/`` of the store, not
    above ``at_most`` when given. A step whose manifest is unreadable, or that a resume
    marked as one it could not use, is passed over, as resume passes it over; a mark
    counts only while it is bound to the visible manifest (``catalog.check_skip_mark``):
    a step skipped, then saved again, is the newest again."""
    steps = sorted((s for s in (names.parse_step_dir_name(n[:-1]) for n in storage.list("") if n.endswith("/"))
                    if s is not None and (at_most is None or s <= at_most)), reverse=True)
    for step in steps:
        loc = scan_location(storage.child(names.step_dir_name(step)), names.step_dir_name(step))
        if loc.committed and read_skip_mark(loc) is None:  # a mark bound to this very manifest
            return {"step": loc.step, "committed_at_t": fmt.parse_time(loc.manifest.committed_at)}
    return None


def status(storage: Storage, run_id: str | None = None, now: float | None = None) -> dict:
    """The summary of run ``run_id`` (default: the latest run) of the store rooted at
    ``storage``, plus the journal's own counts (``unreadable``, ``ignored``,
    ``truncated`` events). ``run`` is None when the store holds no journal."""
    now = time.time() if now is None else now
    run_id = run_id if run_id is not None else latest_run(storage)
    reading = Journal(storage, run_id).read() if run_id is not None else None
    out = summarize(reading.events if reading else [], now, newest_checkpoint(storage))
    out["run"] = run_id  # the name it is stored under, whatever its events claim
    out["journal"] = {"unreadable": reading.unreadable, "ignored": reading.ignored,
                      "truncated": reading.truncated} if reading else None
    return out


_num = finite_float


_INT_LIMIT = 1 << 63  # a journaled figure beyond any real one is no figure (sums stay printable)


def _int(v) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and -_INT_LIMIT < v < _INT_LIMIT else None


def _str(v, limit: int = _TEXT) -> str | None:
    """A journaled string, cut to ``limit`` characters, with its credentials redacted
    (``journal.redact_text``): journals written before the writer redacted hold them
    as written. Redacted before it is cut, so that a URL cut in two shows no part of
    its password; at most ``URL_TOKEN_MAX`` characters beyond ``limit`` are read."""
    return redact_text(v[:limit + URL_TOKEN_MAX])[:limit] if isinstance(v, str) else None


def _strs(v) -> list | None:
    """A journaled list of strings (``command``): at most MAX_LIST of them, anything
    else in it None."""
    return [_str(x) for x in v[:MAX_LIST]] if isinstance(v, list) else None


def _scalar(v):
    if v is None or isinstance(v, bool):
        return v
    return _str(v) if isinstance(v, str) else _int(v) if isinstance(v, int) else _num(v)


def _checks(v) -> list:
    """An ``unhealthy`` event's failed checks as records of the fields ``name``, ``ok``,
    ``detail`` and ``value`` each holds, of their types (else None; ``value`` a flat
    dict of scalars): at most MAX_LIST of them, anything else left out."""
    out = []
    for c in (v[:MAX_LIST] if isinstance(v, list) else []):
        if not isinstance(c, dict):
            continue
        value = c.get("value")
        clean = {"name": _str(c.get("name"), 256), "ok": c.get("ok") if isinstance(c.get("ok"), bool) else None,
                 "detail": _str(c.get("detail")),
                 "value": ({_str(k, 64): _scalar(x) for k, x in list(value.items())[:MAX_LIST]}
                           if isinstance(value, dict) else None)}
        out.append({k: x for k, x in clean.items() if k in c})
    return out
