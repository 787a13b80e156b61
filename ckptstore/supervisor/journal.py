"""The run journal: every event of a supervised training run, kept in the checkpoint
store itself, so it works on every backend, survives the node, and needs no lock.

Layout (relative to the store root; ``journal/`` is reserved, checkpoint gc never
looks inside it: no name below it is a manifest or an ``attempts/`` directory)::

    journal/<run>/<16-digit microseconds since the epoch>-<8 hex>-<kind>.json

One object per event, written create-only (``put(if_absent=True)``): the time first,
so names sort by time; the random part keeps the supervisors of several nodes from
ever colliding. ``<run>`` matches ``[A-Za-z0-9][A-Za-z0-9._-]{0,63}`` (not ``attempts``,
so a journal can never look like a checkpoint location); ``<kind>`` matches
``[a-z][a-z0-9_]{0,31}``. ``new_run_id()`` gives ``YYYYMMDDTHHMMSS-<6 hex>`` (UTC).

An event is one JSON object, at most ``MAX_EVENT_BYTES``. Every event holds ``kind``,
``run``, ``at`` (ISO 8601 UTC), ``t`` (unix seconds, float; the same instant as ``at``
and as the name), ``host``; then the fields of its kind:

- ``run_start``: ``command`` (list of str), ``world_size`` (int, or None when the launch
  options do not fix it), ``nnodes`` (int), ``hosts`` (list of str), ``policy`` (dict;
  ``alert`` only says whether an alert command is set: it may hold a secret).
- ``attempt_start``: ``attempt`` (int: 0 for the first launch, then the restart count).
- ``resume``: ``attempt``, ``step`` (int, or None for a fresh start), ``skipped`` (list
  of int: steps validation refused), ``first_step_s`` (seconds from the attempt's launch
  to its first training step; the event is written at that first step).
- ``failure``: ``attempt``, ``class`` ("transient", "deterministic", "hang",
  "preempted"), ``reason`` (str), ``exit_code`` (int|None), ``signal`` (str|None),
  ``rank`` (int|None), ``traceback`` (str tail|None), ``step`` (last step reached),
  ``checkpoint_step`` (newest committed step at failure), ``checkpoint_age_s``,
  ``lost_steps``, ``lost_s`` (work redone after the restart), ``save_blocking_s``
  (the blocking time of the attempt's last save), ``step_s`` (a moving average of the
  training step time, as the ranks' progress reports last said).
- ``measure``: ``attempt``, ``save_blocking_s``, ``step_s``: written once per attempt,
  at its first save, so that ``status`` can advise an interval before any failure.
- ``give_up``: ``reason`` (str), ``code`` (int exit status), ``class`` ("deterministic",
  "restart_limit", "preemption_limit", "no_progress", "timeout", "store", "preempted",
  "nodes_missing").

Several nodes (consensus.py): the nodes' shared decisions live beside the runs, under
``journal/.shared/<run>/`` (not a run name); only the writer of an attempt's verdict
journals its ``failure`` (with ``nodes``: every node's own view, and ``node``: whose
evidence was chosen), ``give_up`` and ``finish``.
- ``unhealthy``: ``checks`` (the failed ones: list of {name, ok, detail, value}),
  ``reason`` (str); the last event of a run that stopped on an unhealthy node.
- ``finish``: ``attempt``, ``step`` (last step), ``save_blocking_s``, ``step_s``.
- ``sections``: ``attempt``, ``longest`` (dict: section -> seconds); ``section_timeout``:
  ``attempt``, ``section``, ``rank``, ``step``, ``elapsed_s``, ``bound_s``, ``source``,
  ``measured_s``, ``factor``, ``floor_s``, ``option`` (sections.py).
- ``run_health``: ``attempt``, ``action`` ("preempt", "warn"), ``checks`` (watch.py).
- ``step_times``: ``attempt``, ``ranks`` (dict: rank string -> median step time);
  ``straggler``: ``attempt``, ``rank``, ``step_s``, ``others_s``, ``ratio``, ``reports``,
  ``since``, ``alert_factor`` (stragglers.py).

- In-job recovery (``ckptstore run --in-job``, agent.py; the runner journals what the
  agent reports): ``recovery``: ``attempt``, ``round`` (the new one), ``ranks`` (the
  failed ranks), ``class``, ``reason``, ``signal``, ``exit_code``, ``traceback``,
  ``detected_by`` ("agent:exit", "agent:hang"), ``node``, ``step`` (the highest step
  reached before the fault), ``restored_step``, ``lost_steps``, ``lost_s``, ``step_s``,
  ``detect_s``, ``teardown_s``, ``decide_s`` (the last survivor left to the verdict:
  the wait for a warm spare), ``reform_s``, ``restore_s``, ``first_step_s`` (the
  fault to the last rank's first step of the new round: the recovery's wall cost),
  ``restore_from`` (tier -> ranks), ``spares`` (rank -> host, worker, warm_s),
  ``abandoned_steps``, ``node_lost`` (node -> ``decided_by``: "beat", "refused" or
  "fault+silence", ``silent_s``: the nodes lost with the failed ranks); ``recovery_failed``: ``attempt``, ``round``, ``reason`` (the new
  round failed before every rank trained); ``in_job_gave_up``: ``attempt``, ``round``,
  ``reason`` (the attempt goes cold: its ``failure`` event follows, reason "in-job
  recovery gave up: ..."); ``node_rejoined``: ``attempt``, ``round``, ``node``, ``join``,
  ``node_host``, ``spares`` (its warm spares' ids), ``lost_s`` (a lost node's restarted
  agent back in the running attempt as a node of spares: agent.py ``_admit_returned``).

Any event may carry ``save_blocking_s`` / ``step_s``; status takes the latest of each.

Credentials are never written: ``append`` passes every string of an event, at any
depth, through :func:`redact_text` (``urls.redact_url``: a URL's ``user:password@`` is
removed, credential-looking query values such as ``X-Amz-Signature`` become ``***``),
so a launch command, a failure reason or a traceback that holds a presigned or
password-bearing URL is journaled without it. An event nested more than
``MAX_EVENT_DEPTH`` deep is refused (readers would skip it).

Reading treats the store as hostile: each event is read with a cap, parsed strictly,
and skipped (counted ``unreadable``) unless it is a JSON object whose ``kind`` is the
kind its name says and whose values nest at most ``MAX_EVENT_DEPTH`` deep (a 1 KB event
of lists nested 500 deep crashed ``status`` with a RecursionError); names outside the
grammar are ignored (counted ``ignored``); at most ``MAX_EVENTS`` events of a run are
read (the oldest one and the newest rest). An event's ``t`` is read as its name's time
(the writer writes the two equal; a ``t`` of 1e300 made a run look 1e300 s long, and
``every="auto"`` stop saving). A bad event never raises; a store that cannot be listed
does.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import re
import secrets
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from .. import format as fmt
from ..checkpoint.manifests import read_capped
from ..errors import CkptStoreError
from ..names import ATTEMPTS_DIR
from ..storage import Storage
from ..storage.urls import redact_url

JOURNAL_DIR = "journal"
MAX_EVENT_BYTES = fmt.MAX_MARKER_BYTES  # 64 KiB: keep traceback tails well below it
MAX_EVENTS = 100_000  # per run; a real run journals a few events per restart
MAX_EVENT_DEPTH = 16  # containers nested in an event (a real one: 4, event > checks > check > value)
_READERS = 16  # concurrent reads: one request each on an object store

_RUN_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_KIND_RE = re.compile(r"[a-z][a-z0-9_]{0,31}")
_EVENT_RE = re.compile(r"([0-9]{16})-([0-9a-f]{8})-([a-z][a-z0-9_]{0,31})\.json")
_BASE_FIELDS = ("kind", "run", "at", "t", "host")


def is_run_id(run) -> bool:
    return isinstance(run, str) and _RUN_RE.fullmatch(run) is not None and run != ATTEMPTS_DIR


def check_run_id(run) -> str:
    if not is_run_id(run):
        raise ValueError(f"run id {run!r} is not [A-Za-z0-9][A-Za-z0-9._-]{{0,63}} (nor {ATTEMPTS_DIR!r})")
    return run


def new_run_id() -> str:
    return f"{_dt.datetime.now(_dt.timezone.utc):%Y%m%dT%H%M%S}-{secrets.token_hex(3)}"


def parse_event_name(name: str) -> tuple[float, str] | None:
    """(unix seconds, kind) of an event's file name, else None."""
    m = _EVENT_RE.fullmatch(name)
    return (int(m.group(1)) / 1e6, m.group(3)) if m else None


@dataclass
class Reading:
    """What :meth:`Journal.read` found: the readable events in name (= time) order."""

    events: list[dict] = field(default_factory=list)
    unreadable: int = 0  # valid names whose content was refused (size, JSON, shape, a symlink)
    ignored: int = 0  # names outside the grammar (never read)
    truncated: int = 0  # events left unread beyond MAX_EVENTS


class Journal:
    """The events of run ``run_id`` in the store rooted at ``storage``."""

    def __init__(self, storage: Storage, run_id: str, clock=time.time):
        self.storage = storage
        self.run_id = check_run_id(run_id)
        self.prefix = f"{JOURNAL_DIR}/{run_id}"
        self._clock = clock  # a test's fixed clock; the supervisor keeps time.time
        self._host = socket.gethostname()

    def __repr__(self) -> str:
        return f"Journal({self.storage.describe(self.prefix)!r})"

    def append(self, kind: str, /, **fields) -> dict:
        """Write one event; returns it. Raises what the storage raises (the caller
        decides whether journaling is worth failing for), ValueError for a bad kind, a
        reserved field name, or an event larger than MAX_EVENT_BYTES."""
        if not isinstance(kind, str) or not _KIND_RE.fullmatch(kind):
            raise ValueError(f"event kind {kind!r} is not [a-z][a-z0-9_]{{0,31}}")
        clash = sorted(set(fields) & set(_BASE_FIELDS))
        if clash:
            raise ValueError(f"event fields {clash} are set by the journal itself")
        t = self._clock()
        us = int(round(t * 1e6))
        at = _dt.datetime.fromtimestamp(us / 1e6, _dt.timezone.utc).isoformat(timespec="microseconds")
        event = {"kind": kind, "run": self.run_id, "at": at, "t": us / 1e6, "host": self._host,
                 **_clean(fields, 1)}
        data = json.dumps(event, allow_nan=False, sort_keys=False).encode()
        if len(data) > MAX_EVENT_BYTES:
            raise ValueError(f"{kind} event of {len(data)} bytes exceeds {MAX_EVENT_BYTES} (shorten the traceback)")
        key = f"{self.prefix}/{us:016d}-{secrets.token_hex(4)}-{kind}.json"
        self.storage.put(key, data, if_absent=True)  # 32 random bits per microsecond: a clash raises
        return event

    def events(self) -> list[dict]:
        return self.read().events

    def read(self) -> Reading:
        out = Reading()
        names = []
        for name in self.storage.list(self.prefix):
            parsed = parse_event_name(name)
            if parsed is None:
                out.ignored += 1  # a sub-directory, a temporary, someone else's file
            else:
                names.append((name, parsed[1]))
        names.sort()
        if len(names) > MAX_EVENTS:  # keep the run's first event (run_start) and the newest
            out.truncated = len(names) - MAX_EVENTS
            names = names[:1] + names[-(MAX_EVENTS - 1):]
        with ThreadPoolExecutor(min(_READERS, max(1, len(names)))) as pool:
            for event in pool.map(self._read_one, names):
                if event is None:
                    out.unreadable += 1
                else:
                    out.events.append(event)
        return out

    def _read_one(self, entry: tuple[str, str]) -> dict | None:
        name, kind = entry
        try:
            data = read_capped(self.storage, f"{self.prefix}/{name}", MAX_EVENT_BYTES, "journal event")
            event = fmt.loads_json(data, "journal event")
        except (CkptStoreError, OSError):  # too large, not JSON, a symlink, gone, a flaky read
            return None
        if not isinstance(event, dict) or event.get("kind") != kind or not nests_within(event, MAX_EVENT_DEPTH):
            return None
        # The name's time is the event's (the writer writes both from one clock reading):
        # names sort by it and are bounded by their 16 digits, where a `t` of 1e300, a
        # string or -inf would be taken for the run's length.
        event["t"] = parse_event_name(name)[0]
        return event


def runs(storage: Storage) -> list[str]:
    """The run ids with a journal in the store, sorted by name."""
    return sorted(n[:-1] for n in storage.list(JOURNAL_DIR) if n.endswith("/") and is_run_id(n[:-1]))


def latest_run(storage: Storage) -> str | None:
    """The run whose newest event is the newest (by the time in its names)."""
    best, best_t = None, -math.inf
    for run in runs(storage):
        times = [p[0] for p in map(parse_event_name, storage.list(f"{JOURNAL_DIR}/{run}")) if p is not None]
        if times and max(times) > best_t:
            best, best_t = run, max(times)
    return best


def finite_float(v) -> float | None:
    """``v`` as a finite float, or None: not a number, a bool, NaN, an infinity, or an int
    too large for a float (untrusted journal input: ``10**400`` must not raise)."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def nests_within(value, depth: int) -> bool:
    """Whether ``value`` holds no dict or list more than ``depth`` levels deep (itself
    the first), found without recursion: untrusted JSON must not exhaust the stack of
    whoever walks it later."""
    todo = [(value, 1)]
    while todo:
        v, level = todo.pop()
        if isinstance(v, (dict, list)):
            if level > depth:
                return False
            todo.extend((x, level + 1) for x in (v.values() if isinstance(v, dict) else v))
    return True


# A URL in a text: a scheme (its last 32 characters are enough to find it, in linear
# time), ":/", then up to whitespace or a quote, as urls.redact_url finds one.
_URL_START = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]{0,31}:/")
_URL_END = re.compile(r"""[\s'"<>]""")
URL_TOKEN_MAX = 2048  # a URL longer than this is cut here ("..."): what lay beyond is never shown


def redact_text(text: str) -> str:
    """``urls.redact_url(text)``, in time linear in ``len(text)``: each URL of ``text``
    is redacted on its own (one without '@' or '?' has nothing to redact), and one
    longer than ``URL_TOKEN_MAX`` is cut to that length first, so that no crafted
    string (64 KiB of letters) makes a reader or the writer spend seconds on it."""
    if ":/" not in text:
        return text
    out, pos = [], 0
    while (m := _URL_START.search(text, pos)) is not None:
        end = _URL_END.search(text, m.end())
        end = len(text) if end is None else end.start()
        url = text[m.start():end]
        cut = len(url) > URL_TOKEN_MAX
        url = url[:URL_TOKEN_MAX]
        out += [text[pos:m.start()], (redact_url(url) if "@" in url or "?" in url else url) + ("..." if cut else "")]
        pos = end
    out.append(text[pos:])
    return "".join(out)


def _clean(v, level: int):
    """``v`` as an event may hold it: every string redacted (:func:`redact_text`), NaN
    and infinities as None (strict JSON, what the reader accepts, has no spelling for
    them, and one bad median must not lose an event); ValueError for containers nested
    deeper than MAX_EVENT_DEPTH (``level``: the depth of ``v``, the event's own 1)."""
    if isinstance(v, str):
        return redact_text(v)
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, (dict, list, tuple)) and level > MAX_EVENT_DEPTH:
        raise ValueError(f"event values nest deeper than {MAX_EVENT_DEPTH} levels")
    if isinstance(v, dict):
        return {k: _clean(x, level + 1) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x, level + 1) for x in v]
    return v
