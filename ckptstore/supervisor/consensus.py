"""Several nodes, one decision: what the supervisors (``ckptstore run``, one per node)
of a multi-node run share through the store (docs/format.md, "Shared decisions";
docs/runbook.md, "Several nodes").

No coordinator: every record is a small JSON object written create-only
(``put(if_absent=True)``), as journal events and run epochs are, so the first writer
wins, the others read what it wrote, and no node's loss takes the decisions with it::

    journal/.shared/<run>/attempt-<10 digits>/member-<node>.json   a node launched this attempt
    journal/.shared/<run>/attempt-<10 digits>/report-<node>.json   its own verdict on the attempt's end
    journal/.shared/<run>/attempt-<10 digits>/verdict.json         the run's decision after it

- **One attempt number.** Every node launches attempt 0 first; attempt N+1 exists only
  through attempt N's verdict (``action: relaunch``), so all nodes number alike, and
  each attempt's torch rendezvous has an id of its own (:func:`rdzv_id`): a round that
  torch's c10d handler closed when a launcher of the last attempt exited can never
  block the next one.
- **One verdict per failure.** A node whose attempt ended writes its report, then waits
  (at most ``wait_s``) for the reports of every node that launched the attempt; a node
  whose attempt is still running sees a peer's report (or the verdict) within a poll
  and stops its launcher. The first node with every report (or at the end of the wait)
  merges them (:func:`merge`: the strongest evidence of any node, as classify.py ranks
  evidence within one node), replays the run's earlier verdicts through
  :func:`decide.decide` (pure: the same inputs give every node the same history) and
  writes ``verdict.json`` create-only; every node follows the verdict it reads back.
- **Bounded waits.** A node that starts while an attempt without a valid verdict runs
  without it waits at most hang timeout + decision wait + join timeout, then writes the
  attempt's verdict as ``abandoned`` (a relaunch; ``verdict-2.json`` where
  ``verdict.json`` is garbage) and joins the next attempt. A node that restarts while the
  attempt its previous supervisor launched has no verdict reports that attempt lost
  instead of joining it again (:meth:`Shared.start`). Verdicts are validated on read
  (:func:`valid_verdict`); the chain of relaunch verdicts from attempt 0, not the
  highest directory name, says where the run is.
- **One alert per event.** Only the verdict's writer journals the ``failure`` and
  ``give_up`` (or ``finish``) events, so only it alerts.
- **Heartbeats.** Each node's supervisor overwrites ``nodes/<node>.json`` every
  ``heartbeat_s`` from a thread of its own (:class:`Heartbeats`); the others watch the
  objects' modification times with one listing per ``heartbeat_s``. A member of an
  attempt whose beat did not change for ``heartbeat_timeout_s``, as this node watched it
  (no clocks compared), is gone: its report is not waited for (the verdict is written at
  once, with "node K's supervisor stopped beating at T"), and a node whose attempt still
  runs stops it (its ranks may wait on a frozen peer for the process group's timeout).
- **A give-up stops every node.** A node that ends the run on its own (unhealthy before
  a launch or during the run, the run timeout) writes the verdict of the attempt the
  others are launching or running; they poll it (every second) while their launchers
  wait in the rendezvous or run, and stop with its exit code. A ``finish`` verdict
  interrupts nobody: the other nodes' ranks finish too.
"""

from __future__ import annotations

import copy
import json
import math
import re
import socket
import sys
import threading
import time
from datetime import datetime, timezone
from dataclasses import dataclass

from .. import format as fmt
from ..checkpoint.manifests import read_capped
from ..errors import AlreadyExistsError, CkptStoreError
from ..storage import Storage
from .classify import Verdict
from .decide import Decision, History, Policy, decide
from .journal import JOURNAL_DIR, MAX_EVENT_BYTES, check_run_id

SHARED_DIR = f"{JOURNAL_DIR}/.shared"  # not a run name (a dot first): journal readers skip it
ATTEMPT_DIGITS = 10
MAX_ATTEMPT = 10**ATTEMPT_DIGITS - 1
_ATTEMPT_RE = re.compile(r"attempt-([0-9]{10})/?")
_NODE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_MEMBER_RE = re.compile(r"member-([A-Za-z0-9][A-Za-z0-9._-]{0,63})\.json")
_REPORT_RE = re.compile(r"report-([A-Za-z0-9][A-Za-z0-9._-]{0,63})\.json")
VERDICT_LEAF = "verdict.json"
VERDICT2_LEAF = "verdict-2.json"  # read only when verdict.json exists and is invalid (garbage): supersedes it
WAIT_S = Policy.decision_wait_s  # the longest wait for the reports of the other nodes of an attempt
NODE_LINES = 16  # a verdict's `nodes`: the first K node lines (strongest evidence first); the rest counted
ACTIONS = ("relaunch", "give_up", "finish")
# The exit codes a give-up verdict may carry (decide.py, gate.py, health.py, runner.py).
EXIT_CODES = frozenset({10, 11, 12, 13, 14, 15, 16, 143})
FIRST_JOIN_S = 600.0  # torch's own join timeout, which the first attempt keeps
POLL_S = 0.5
MAX_PUBLISHED_RANKS = 1024  # ranks' step times one node's heartbeat carries
MAX_STEP_TIME_S = 86400.0  # a published step time at or above a day is not one (ignored)


def node_name(host: str, node_rank) -> str:
    """A node's name in the shared records: its host and ``--node-rank``, reduced to
    ``[A-Za-z0-9][A-Za-z0-9._-]{0,63}``."""
    base = re.sub(r"[^A-Za-z0-9._-]", "_", str(host)).lstrip("._-") or "host"
    suffix = f"-{node_rank}" if str(node_rank).isdigit() else ""
    return (base[:64 - len(suffix)] + suffix)[:64]


def attempt_dir(run: str, attempt: int) -> str:
    if not isinstance(attempt, int) or isinstance(attempt, bool) or not 0 <= attempt <= MAX_ATTEMPT:
        raise ValueError(f"attempt {attempt!r} does not fit a shared record name (0 .. {MAX_ATTEMPT})")
    return f"{SHARED_DIR}/{check_run_id(run)}/attempt-{attempt:0{ATTEMPT_DIGITS}d}"


def beats_dir(run: str) -> str:
    return f"{SHARED_DIR}/{check_run_id(run)}/nodes"


def rdzv_id(run: str, attempt: int) -> str:
    """The torch rendezvous id of ``attempt``: the same on every node, new per attempt."""
    return f"{run}-a{attempt}"


# ------------------------------------------------------------------ evidence
def verdict_json(v: Verdict) -> dict:
    return {"class": v.klass, "reason": str(v.reason)[:4000], "rank": v.rank, "exit_code": v.exit_code,
            "signal": v.signal, "signature": v.signature, "outage": bool(v.outage),
            "step": v.evidence.get("step"), "peer": bool(v.evidence.get("peer")),
            "nodes_missing": bool(v.evidence.get("nodes_missing")),
            "traceback": (v.traceback or None) and v.traceback[-4000:]}


def verdict_from(d: dict) -> Verdict:
    v = Verdict(str(d.get("class") or "transient"), str(d.get("reason") or ""), _int(d.get("rank")),
                _int(d.get("exit_code")), d.get("signal") if isinstance(d.get("signal"), str) else None,
                d.get("traceback") if isinstance(d.get("traceback"), str) else None,
                d.get("signature") if isinstance(d.get("signature"), str) else None,
                outage=bool(d.get("outage")))
    v.evidence["step"] = _int(d.get("step"))
    v.evidence["peer"] = bool(d.get("peer"))
    if d.get("nodes_missing"):
        v.evidence["nodes_missing"] = True
    return v


def weight(v: dict) -> int:
    """How strongly one node's verdict explains the attempt's end (lower: stronger): the
    program said so; a rank's own error; a hang; a rank killed by a signal; an outage; a
    preemption; a node missing at the rendezvous; the machinery (lost peers); a node
    stopped because a peer failed."""
    klass = v.get("class")
    if klass == "deterministic":
        return 0
    if v.get("peer"):
        return 8
    if v.get("signature") and not v.get("outage"):
        return 1
    if klass == "hang":
        return 2
    if klass == "transient" and v.get("signal") not in (None, "SIGTERM"):
        return 3
    if v.get("outage"):
        return 4
    if klass == "preempted":
        return 5
    if v.get("nodes_missing"):
        return 6
    return 7


def merge(reports: dict[str, dict]) -> tuple[str, dict]:
    """(node, report) of the report whose verdict explains the attempt's end best: the
    strongest evidence, then the earliest end, then the node name."""
    return min(reports.items(), key=lambda kv: (weight(kv[1].get("verdict") or {}), _num(kv[1].get("t")), kv[0]))


class Heartbeats:
    """Node ``node``'s heartbeat in the store (``nodes/<node>.json``, overwritten every
    ``beat_s``), and its watch of every node's: one listing (names, sizes, modification
    times) at most every ``beat_s``. A node whose object did not change for
    ``timeout_s`` of this node's monotonic clock is gone (the store's and the nodes'
    clocks are never compared). Nobody is judged while this node's own beat looks stale
    too (the store or the listing failed: no evidence)."""

    def __init__(self, storage: Storage, run: str, node: str, beat_s: float, timeout_s: float,
                 clock=time.time, monotonic=time.monotonic):
        self.storage, self.run, self.node = storage, check_run_id(run), node
        self.timeout_s = timeout_s
        self.beat_s = min(beat_s, timeout_s / 4) if timeout_s > 0 else beat_s
        self.clock, self.monotonic = clock, monotonic
        self.started = monotonic()
        self.seq = 0
        self._seen: dict[str, tuple[tuple, float]] = {}  # node -> ((mtime, size), when it last changed: monotonic)
        self._listed: float | None = None
        self._lock = threading.Lock()
        self._put_lock = threading.Lock()
        self._stop = threading.Event()
        self.published: dict = {}  # this node's ranks' step times, carried by its beats (cross-node stragglers)
        self._consumed: dict[str, int] = {}  # node -> the last step_times_seq the leader took from it
        self.ignored: set[tuple[str, str]] = set()  # (node, why) of beats left out, each said once

    def beat(self) -> None:
        with self._put_lock:
            self.seq += 1
            data = json.dumps({"run": self.run, "node": self.node, "host": socket.gethostname(), "t": self.clock(),
                               "seq": self.seq, **self.published}).encode()
            self.storage.put(f"{beats_dir(self.run)}/{self.node}.json", data)

    def start(self) -> None:
        """Beat every ``beat_s`` from a daemon thread until :meth:`stop` (or the process's end)."""
        def loop():
            while not self._stop.is_set():
                try:
                    self.beat()
                except Exception:  # noqa: BLE001 - the store failed: the next beat tries again
                    pass
                self._stop.wait(self.beat_s)
        threading.Thread(target=loop, name="ckptstore-heartbeat", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def refresh(self) -> None:
        now = self.monotonic()
        with self._lock:
            if self._listed is not None and now - self._listed < self.beat_s:
                return
            try:
                infos = list(self.storage.walk(beats_dir(self.run)))
            except (CkptStoreError, OSError):
                return  # no evidence: nobody's beat is judged older for it
            self._listed = now
            for info in infos:
                leaf = info.key.rsplit("/", 1)[-1]
                if not leaf.endswith(".json") or not _NODE_RE.fullmatch(leaf[:-5]):
                    continue
                if not (isinstance(info.mtime, (int, float)) and math.isfinite(info.mtime)):
                    # (NaN is never equal to itself: such a beat would look new at every look)
                    self._ignore(leaf[:-5], f"its heartbeat object's modification time is {info.mtime!r}")
                    continue
                version = (info.mtime, info.size)
                seen = self._seen.get(leaf[:-5])
                if seen is None or seen[0] != version:
                    self._seen[leaf[:-5]] = (version, now)

    def cross_node(self, attempt: int, ranks: dict[int, float]) -> list[tuple[str | None, dict[int, float]]]:
        """Publish this node's ranks' step times (``{rank: median s}``) with its beat;
        on the leader (the lowest-named node whose beat goes on), return every node's
        step times of ``attempt`` not returned before, as ``(host, ranks)``, this node's
        first; elsewhere ``[]``: only the leader judges stragglers (stragglers.py), so
        each is alerted once for the run."""
        seq = int(self.published.get("step_times_seq", 0)) + 1
        self.published = {"attempt": attempt, "step_times_seq": seq,
                          "step_times": {str(r): float(v) for r, v in sorted(ranks.items())[:MAX_PUBLISHED_RANKS]}}
        self.beat()
        self.refresh()
        now = self.monotonic()
        with self._lock:
            live = sorted(n for n in self._seen if self.timeout_s <= 0 or self._quiet_s(n, now) < self.timeout_s)
        if min([*live, self.node]) != self.node:
            return []
        out: list[tuple[str | None, dict[int, float]]] = [(socket.gethostname(), dict(ranks))]
        for n in live:
            if n == self.node:
                continue
            try:
                rec = fmt.loads_json(read_capped(self.storage, f"{beats_dir(self.run)}/{n}.json", MAX_EVENT_BYTES,
                                                 "heartbeat"), "heartbeat")
            except (CkptStoreError, OSError) as e:
                self._ignore(n, f"its heartbeat cannot be read ({str(e)[:200]})")
                continue
            if not isinstance(rec, dict):
                self._ignore(n, "its heartbeat is not a JSON object")
                continue
            if rec.get("attempt") != attempt or not isinstance(rec.get("step_times"), dict):
                continue
            got = _int(rec.get("step_times_seq"))
            if got is None or got == self._consumed.get(n):
                continue  # not published anew since the last look: not one more report
            self._consumed[n] = got
            theirs = {}
            for k, v in list(rec["step_times"].items())[:MAX_PUBLISHED_RANKS]:
                if isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 9 and \
                        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and \
                        0 < v < MAX_STEP_TIME_S:
                    theirs[int(k)] = float(v)
            if theirs:
                out.append((rec.get("host")[:256] if isinstance(rec.get("host"), str) else None, theirs))
        return out

    def _ignore(self, node: str, why: str) -> None:
        """Say once per node and reason that a beat was left out (read as absent)."""
        if (node, why) not in self.ignored:
            self.ignored.add((node, why))
            print(f"ckptstore run: node {node}'s heartbeat ignored: {why} (read as absent: no beat, no step times)",
                  file=sys.stderr, flush=True)

    def _quiet_s(self, node: str, now: float) -> float:
        seen = self._seen.get(node)
        return now - (seen[1] if seen is not None else self.started)

    def stopped(self, nodes) -> dict[str, str]:
        """{node: "node K's supervisor stopped beating at T"} for each of ``nodes`` (this
        node excepted) whose beat did not change for ``timeout_s``."""
        if self.timeout_s <= 0:
            return {}
        self.refresh()
        now = self.monotonic()
        with self._lock:
            if self._quiet_s(self.node, now) >= self.timeout_s:
                return {}  # this node's own beat looks stale: the store is not showing beats
            out = {}
            for n in sorted(set(nodes) - {self.node}):
                if self._quiet_s(n, now) >= self.timeout_s:
                    seen = self._seen.get(n)
                    at = _utc(seen[0][0]) if seen is not None else "its start (it never beat here)"
                    out[n] = f"node {n}'s supervisor stopped beating at {at}"
            return out


@dataclass
class Settled:
    record: dict  # verdict.json as read back
    mine: bool  # this node wrote it (journals the failure and the give-up, alerts)
    failure: Verdict  # the merged failure, with its final class and reason
    decision: Decision


class Shared:
    """The shared records of run ``run`` for node ``node``."""

    def __init__(self, storage: Storage, run: str, node: str, wait_s: float | None = None, poll_s: float = POLL_S,
                 clock=time.time, sleep=time.sleep, policy: Policy = Policy(), monotonic=time.monotonic):
        if not _NODE_RE.fullmatch(node):
            raise ValueError(f"node name {node!r} is not [A-Za-z0-9][A-Za-z0-9._-]{{0,63}}")
        self.storage, self.run, self.node = storage, check_run_id(run), node
        self.policy = policy
        self.wait_s = policy.decision_wait_s if wait_s is None else wait_s
        self.poll_s, self.clock, self.sleep = poll_s, clock, sleep
        self.host = socket.gethostname()
        # Records never change once written: what was read valid is kept.
        self._verdicts: dict[int, dict] = {}
        self._reports: dict[tuple[int, str], dict | None] = {}  # (attempt, leaf) -> the report (None: invalid)
        self._history: tuple[Policy, int, History] | None = None  # (policy, attempts replayed, history)
        self.beats = Heartbeats(storage, self.run, node, policy.heartbeat_s, policy.heartbeat_timeout_s,
                                clock=clock, monotonic=monotonic)
        self.silent: dict[str, str] = {}  # the last gather's members gone silent (Heartbeats.stopped)

    # ------------------------------------------------------------------ records
    def _put(self, key: str, record: dict) -> bool:
        """Create-only; False when the object exists (someone else's)."""
        data = json.dumps(record, allow_nan=False, default=str).encode()
        if len(data) > MAX_EVENT_BYTES:
            raise ValueError(f"shared record {key} of {len(data)} bytes exceeds {MAX_EVENT_BYTES}")
        try:
            self.storage.put(key, data, if_absent=True)
            return True
        except AlreadyExistsError:
            return False

    def _get(self, key: str) -> dict | None:
        try:
            data = read_capped(self.storage, key, MAX_EVENT_BYTES, "shared record")
            rec = fmt.loads_json(data, "shared record")
        except (CkptStoreError, OSError):
            return None
        return rec if isinstance(rec, dict) else None

    def _base(self, attempt: int) -> dict:
        return {"run": self.run, "attempt": attempt, "node": self.node, "host": self.host, "t": self.clock()}

    def join(self, attempt: int, node_rank=None) -> None:
        """Say that this node launches ``attempt``."""
        self._put(f"{attempt_dir(self.run, attempt)}/member-{self.node}.json",
                  {**self._base(attempt), "node_rank": node_rank})

    def _leaves(self, attempt: int) -> list[str]:
        try:
            return self.storage.list(attempt_dir(self.run, attempt))
        except (CkptStoreError, OSError):
            return []

    def members(self, attempt: int) -> set[str]:
        return {m.group(1) for m in map(_MEMBER_RE.fullmatch, self._leaves(attempt)) if m}

    def reports(self, attempt: int, leaves: list[str] | None = None) -> dict[str, dict]:
        """The valid reports of ``attempt``; each is read once (records never change)."""
        out = {}
        for m in map(_REPORT_RE.fullmatch, self._leaves(attempt) if leaves is None else leaves):
            if m:
                key = (attempt, m.group(0))
                if key not in self._reports:
                    rec = self._get(f"{attempt_dir(self.run, attempt)}/{m.group(0)}")
                    ok = rec is not None and isinstance(rec.get("verdict"), dict)
                    self._reports[key] = rec if ok else None
                if self._reports[key] is not None:
                    out[m.group(1)] = self._reports[key]
        return out

    def verdict(self, attempt: int) -> dict | None:
        """The run's valid verdict on ``attempt``: ``verdict.json``, or, where that exists
        but is invalid, ``verdict-2.json`` (which supersedes it); None while neither is."""
        if attempt in self._verdicts:
            return self._verdicts[attempt]
        for leaf in (VERDICT_LEAF, VERDICT2_LEAF):
            rec = self._get(f"{attempt_dir(self.run, attempt)}/{leaf}")
            if rec is not None and valid_verdict(rec, self.policy):
                self._verdicts[attempt] = rec
                return rec
        return None

    def _verdict_exists(self, attempt: int) -> bool:
        return VERDICT_LEAF in self._leaves(attempt)

    def _write_verdict(self, attempt: int, rec: dict) -> tuple[dict | None, bool]:
        """Write ``rec`` as the verdict on ``attempt``, create-only: (the verdict that
        counts, whether it is ``rec``). A ``verdict.json`` that exists but is invalid is
        superseded by ``verdict-2.json`` (create-only as well: whoever wins)."""
        for leaf in (VERDICT_LEAF, VERDICT2_LEAF):
            if self._put(f"{attempt_dir(self.run, attempt)}/{leaf}", rec):
                self._verdicts[attempt] = rec
                return rec, True
            found = self.verdict(attempt)
            if found is not None:
                return found, False
        return None, False

    def chain(self, stopped=lambda: False) -> int:
        """The attempt the run is at: attempt 0, followed through every ``relaunch``
        verdict (attempt N+1 exists only through N's); an attempt directory no verdict
        leads to is never looked at."""
        n = 0
        while n < MAX_ATTEMPT and not stopped():
            v = self.verdict(n)
            if v is None or v["action"] != "relaunch":
                return n
            n += 1
        return n

    def latest(self) -> int | None:
        """The attempt the run is at (:meth:`chain`); None when it has no record."""
        n = self.chain()
        return n if n > 0 or self._leaves(0) else None

    def start(self, window_s=lambda attempt: FIRST_JOIN_S, stopped=lambda: False, say=lambda line: None,
              wait_poll_s: float = 1.0, abandon_s: float | None = None) -> tuple[int, dict | None]:
        """Where a node that starts (or restarts) joins the run: (the attempt to launch,
        None), or (the attempt, its verdict) when the run already ended there. The
        newest attempt without a verdict is joined while its rendezvous may still be
        open (its first member record younger than ``window_s(attempt)``, torch's join
        timeout); one that runs without this node is not disturbed: the node waits for
        its verdict and joins the next attempt (or ends as the run did), at most
        ``abandon_s`` (default: the policy's hang timeout + decision wait + join timeout:
        the longest its nodes take to end an attempt that lost this node); then the
        attempt is abandoned: this node writes its verdict (a relaunch of class
        ``abandoned``, create-only: whoever wins) and joins the next one. The attempts
        are found by following the verdicts from attempt 0 (:meth:`chain`).

        A node that restarts while an attempt its previous supervisor launched has no
        verdict (its member record is there) never joins that attempt again: its
        processes of it are gone, so the attempt is lost, and a new launcher in its
        completed rendezvous would make torch restart the other nodes' workers in place
        (a membership change, which torch does not count as a restart). It reports the
        attempt lost at once (the others stop and decide without waiting for it), waits
        for the verdict and joins the next attempt."""
        if abandon_s is None:
            p = self.policy
            abandon_s = p.hang_timeout_s + p.decision_wait_s + p.join_timeout_s
        while not stopped():
            n = self.chain(stopped)
            if n == 0 and not self._leaves(0):
                return 0, None
            v = self.verdict(n)
            if v is None:
                first = self.first_member_t(n)
                garbage = self._verdict_exists(n)
                restarted = self.node in self.members(n)
                if restarted:
                    self.report(n, Verdict("transient", f"node {self.node} restarted: its processes of attempt {n} "
                                           "were lost"), False, None)
                    say(f"this node launched attempt {n} before it restarted: reported it lost; it joins the next one")
                elif not garbage and (first is None or self.clock() - first < window_s(n)):
                    return n, None
                if not restarted:
                    say(f"attempt {n} runs without this node (since {self.clock() - (first or self.clock()):.0f}s)"
                        + (" and its verdict.json is invalid" if garbage else "") + ": it joins the next one")
                # (a restarted node's report ends the attempt: its peers decide within seconds,
                # and an attempt it alone launched has nobody else to write the verdict)
                bound = min(abandon_s, 2 * self.wait_s) if restarted else abandon_s
                end = self.clock() + bound
                while v is None and not stopped() and self.clock() < end:
                    self.sleep(wait_poll_s)
                    v = self.verdict(n)
                if v is None and stopped():
                    return n, None
                if v is None:
                    say(f"attempt {n}: no valid verdict within {bound:g}s: abandoned; the run goes on at "
                        f"attempt {n + 1}")
                    v, _ = self._write_verdict(n, self.abandoned(n, bound, garbage))
                    if v is None:
                        raise CkptStoreError(f"the verdict on attempt {n} cannot be written or read")
            if v["action"] == "relaunch":
                return n + 1, None
            return n, v
        return 0, None

    def abandoned(self, attempt: int, waited_s: float, garbage: bool = False) -> dict:
        """The verdict on an attempt that produced none in time (its nodes are gone, or
        its verdict.json is invalid): relaunch, no failure (it counts towards no limit)."""
        why = "its verdict.json is invalid" if garbage else "its nodes are gone"
        return {**self._base(attempt), "action": "relaunch", "class": "abandoned",
                "reason": f"no valid verdict within {waited_s:g}s ({why})", "code": None, "give_up_class": None,
                "give_up_reason": None, "backoff_s": 0.0, "next_attempt": attempt + 1,
                "rdzv_id": rdzv_id(self.run, attempt + 1)}

    def first_member_t(self, attempt: int) -> float | None:
        times = []
        for m in map(_MEMBER_RE.fullmatch, self._leaves(attempt)):
            rec = self._get(f"{attempt_dir(self.run, attempt)}/{m.group(0)}") if m else None
            if rec is not None and isinstance(rec.get("t"), (int, float)) and not isinstance(rec.get("t"), bool):
                times.append(float(rec["t"]))
        return min(times) if times else None

    # ------------------------------------------------------------------ during an attempt
    def interrupted(self, attempt: int, in_job: bool = False) -> str | None:
        """Why this node's attempt must stop although its launcher still runs: the
        attempt's verdict is written, or another node reported its end or stopped
        beating. ``in_job``: only the verdict counts: a lost node's ranks are taken by
        spares inside the attempt (its leader, agent.py, decides; a node whose
        supervisor is gone or restarted no longer counts), and an attempt that cannot go
        on ends through the agent."""
        v = self.verdict(attempt)
        if v is not None and v["action"] == "finish":
            return None  # another node finished first: this one's ranks finish too (rank 0 may still write)
        if v is not None:
            return f"the run's verdict on attempt {attempt} ({v['action']}, by {v.get('node')})"
        if in_job:
            return None
        leaves = self._leaves(attempt)
        members = {m.group(1) for m in map(_MEMBER_RE.fullmatch, leaves) if m}
        if any(m and m.group(1) != self.node for m in map(_REPORT_RE.fullmatch, leaves)):
            peers = sorted(n for n in self.reports(attempt, leaves) if n != self.node and n in members)
            if peers:
                return f"attempt {attempt} ended on node {peers[0]}"
        silent = self.beats.stopped(members)  # a frozen node's ranks may never break this node's
        if silent:
            return "; ".join(silent.values())
        return None

    # ------------------------------------------------------------------ after an attempt
    def report(self, attempt: int, v: Verdict, advanced: bool, checkpoint: int | None) -> None:
        self._put(f"{attempt_dir(self.run, attempt)}/report-{self.node}.json",
                  {**self._base(attempt), "verdict": verdict_json(v), "advanced": bool(advanced),
                   "checkpoint": checkpoint})

    def gather(self, attempt: int, stopped=lambda: False) -> tuple[dict | None, dict[str, dict]]:
        """(the verdict, if one is written, else None; the reports) once every member
        of ``attempt`` reported, a verdict exists, or ``wait_s`` passed."""
        end = self.clock() + self.wait_s
        while True:
            v = self.verdict(attempt)
            if v is not None:
                return v, {}
            leaves = self._leaves(attempt)  # one listing per poll; each report is read once
            reports = self.reports(attempt, leaves)
            members = {m.group(1) for m in map(_MEMBER_RE.fullmatch, leaves) if m}
            self.silent = self.beats.stopped(members - set(reports))  # their reports will never come
            if members <= set(reports) | set(self.silent) or self.clock() >= end or stopped():
                return None, reports
            self.sleep(self.poll_s)

    def history(self, policy: Policy, before: int, stopped=lambda: False) -> History:
        """The run's history as the verdicts of attempts 0 .. before-1 made it: each is
        replayed through decide() with the inputs it recorded, following the chain of
        relaunch verdicts (it ends at the first attempt without one). The replay is kept:
        each verdict is read and replayed once per node."""
        if self._history is not None and self._history[0] == policy and self._history[1] <= before:
            _, n, h = self._history
        else:
            n, h = 0, History()
        while n < before and not stopped():
            rec = self.verdict(n)
            if rec is None:
                break
            if isinstance(rec.get("failure"), dict):
                decide(policy, h, verdict_from(rec["failure"]), bool(rec.get("advanced")), _num(rec.get("now")),
                       checkpoint=_int(rec.get("checkpoint")))
            n += 1
            if rec["action"] != "relaunch":
                break
        self._history = (policy, n, h)
        return copy.deepcopy(h)

    def settle(self, attempt: int, policy: Policy, stopped=lambda: False) -> Settled:
        """The run's decision after ``attempt`` failed: gather the nodes' reports, merge
        them, decide, write the verdict create-only; what was written first is followed."""
        found, reports = self.gather(attempt, stopped)
        if found is None:
            if not reports:  # (our own report could not be written: decide alone)
                raise CkptStoreError(f"no report of attempt {attempt} could be read from the store")
            node, chosen = merge(reports)
            failure = verdict_from(chosen["verdict"])
            silent = {n: why for n, why in self.silent.items() if n not in reports}
            if silent:
                failure.reason += "; decided without " + "; ".join(list(silent.values())[:NODE_LINES])
            if failure.evidence.get("nodes_missing") and attempt > 0:
                gone = sorted(self.members(attempt - 1) - self.members(attempt))
                if gone:
                    failure.reason += f" (launched attempt {attempt - 1}, not this one: {', '.join(gone)})"
            advanced = any(bool(r.get("advanced")) for r in reports.values())
            ckpts = [c for c in (_int(r.get("checkpoint")) for r in reports.values()) if c is not None]
            ckpt = max(ckpts) if ckpts else None
            now = self.clock()
            failure_in = verdict_json(failure)
            d = decide(policy, self.history(policy, attempt, stopped), failure, advanced, now, checkpoint=ckpt)
            missing = sorted(self.members(attempt) - set(reports))
            lines = sorted(reports.items(), key=lambda kv: (weight(kv[1]["verdict"]), kv[0]))[:NODE_LINES]
            classes: dict[str, int] = {}
            for r in reports.values():
                k = str(r["verdict"].get("class"))[:32]
                classes[k] = classes.get(k, 0) + 1
            rec = {**self._base(attempt), "action": "relaunch" if d.code is None else "give_up",
                   "failure": failure_in, "failure_node": node, "class": d.klass, "reason": d.reason,
                   "backoff_s": d.backoff_s, "code": d.code, "give_up_class": d.give_up_class,
                   "give_up_reason": d.give_up_reason, "advanced": advanced, "checkpoint": ckpt, "now": now,
                   "nodes": {n: _line(r["verdict"]) for n, r in lines}, "nodes_reported": len(reports),
                   "node_classes": dict(sorted(classes.items())[:NODE_LINES]),
                   "unreported": missing[:NODE_LINES], "unreported_count": len(missing),
                   "stopped_beating": sorted(silent)[:NODE_LINES]}
            if d.code is None:
                rec.update(next_attempt=attempt + 1, rdzv_id=rdzv_id(self.run, attempt + 1))
            found, mine = self._write_verdict(attempt, rec)
            if found is None:
                raise CkptStoreError(f"the verdict on attempt {attempt} exists but cannot be read")
        else:
            mine = False
        return self.settled_from(found, mine)

    def settled_from(self, rec: dict, mine: bool) -> Settled:
        failure = verdict_from(rec.get("failure") if isinstance(rec.get("failure"), dict) else {})
        failure.klass = str(rec.get("class") or failure.klass)
        failure.reason = str(rec.get("reason") or failure.reason)
        code = _int(rec.get("code"))
        if rec["action"] == "finish":
            code = 0
        backoff_s = min(max(_num(rec.get("backoff_s")), 0.0), self.policy.backoff_max_s)
        d = Decision(failure.klass, failure.reason, backoff_s=backoff_s, code=code,
                     give_up_class=rec.get("give_up_class"), give_up_reason=rec.get("give_up_reason"))
        return Settled(rec, mine, failure, d)

    def decree(self, attempt: int, action: str, code: int | None, klass: str, reason: str) -> Settled:
        """This node ends the run at ``attempt`` (finished, gave up before or without a
        merged failure); the first such verdict counts, and is returned."""
        rec = {**self._base(attempt), "action": action, "class": klass, "reason": reason, "code": code,
               "give_up_class": klass if action == "give_up" else None,
               "give_up_reason": reason if action == "give_up" else None}
        found, mine = self._write_verdict(attempt, rec)
        return self.settled_from(found or rec, mine if found is not None else True)


def valid_verdict(rec: dict, policy: Policy = Policy()) -> bool:
    """A verdict every node can follow: a known ``action``; ``code`` null for a relaunch,
    0 (or null) for a finish, one of the known exit codes for a give-up; ``backoff_s``
    absent or a finite number (clamped on use to [0, backoff_max_s]); ``class`` a string;
    ``failure`` absent or an object."""
    action, code, backoff = rec.get("action"), rec.get("code"), rec.get("backoff_s", 0.0)
    if action not in ACTIONS or not isinstance(rec.get("class", ""), str):
        return False
    if code is not None and _int(code) is None:
        return False
    if action == "relaunch" and code is not None or action == "finish" and code not in (None, 0):
        return False
    if action == "give_up" and code not in EXIT_CODES:
        return False
    if backoff is not None and (_int(backoff) is None and not isinstance(backoff, float) or
                                not math.isfinite(float(backoff))):
        return False
    return rec.get("failure") is None or isinstance(rec.get("failure"), dict)


def _utc(t: float) -> str:
    try:
        return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    except (OverflowError, OSError, ValueError, TypeError):  # (a store's mtime out of any calendar)
        return f"t={str(t)[:40]}"


def _line(v: dict) -> str:
    return f"{v.get('class')}: {str(v.get('reason'))[:300]}"


def _int(v) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _num(v) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0
