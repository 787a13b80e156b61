"""``ckptstore run``: launch a training job with torch's own launcher, watch it, and
after a failure decide from evidence whether to relaunch it, and record everything in
the run's journal in the store.

Per attempt: the gate (gate.py: the last attempt's GPU memory freed, the node's health
checks, rechecked for a bounded time); the launcher (launch.py: torch's launcher, in a
session of its own, ``--max-restarts 0``: the supervisor relaunches it whole, which
re-forms the process group every time, where torchrun's in-place worker restarts did
not; every worker through bootstrap.py); the ranks' progress files (progress.py) for
hang detection; at the end, the launcher's result for the classification
(classify.py) and the decision (decide.py). Every failure and relaunch is one
``ckptstore run:`` line on stderr; the alert command runs in the background
(alerts.py).

With ``--in-job`` (``policy.in_job``) the node agent (agent.py) takes the launcher's
place: it replaces a failed rank with a warm spare inside the attempt and reports each
recovery in its EVENTS.jsonl, which the supervisor journals as it polls; its hang watch
replaces the supervisor's. The node's memory directory (memory.py) is claimed once per
run and removed however the run ends.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace

from .. import format as fmt
from .._jitter import jitter as _jitter
from ..storage import Storage, open_storage
from . import agent, consensus, launch, memory
from .alerts import Alerts
from .classify import Verdict, classify
from .decide import (EXIT_DETERMINISTIC, EXIT_NO_PROGRESS, EXIT_NODES_MISSING, EXIT_RESTART_LIMIT, History, Policy,
                     decide)
from .gate import EXIT_STORE_UNREACHABLE, Gate
from .health import EXIT_UNHEALTHY, check_node, checks_json, local_store_path
from .journal import Journal, new_run_id
from .launch import ENV_SUPERVISOR
from .progress import ENV_DIR, read_progress
from .progress_watch import ProgressWatch as _ProgressWatch
from .sections import Sections
from .status import newest_checkpoint
from .stragglers import ALERT_FACTOR, Tracker, report_of
from .watch import NodeWatch, run_checks

__all__ = ["EXIT_DETERMINISTIC", "EXIT_FINISHED", "EXIT_NODES_MISSING", "EXIT_NO_PROGRESS", "EXIT_RESTART_LIMIT",
           "EXIT_RUN_TIMEOUT",
           "EXIT_STOPPED", "EXIT_STORE_UNREACHABLE", "EXIT_UNHEALTHY", "Policy", "Supervisor"]

# Exit status of `ckptstore run` (docs/runbook.md); 10-12: decide.py, 13: health.py, 15: gate.py.
EXIT_FINISHED = 0
EXIT_RUN_TIMEOUT = 14
EXIT_STOPPED = 143  # the supervisor itself got SIGTERM (the whole job preempted): no restart

POLL_S = 0.5  # how often the supervisor looks at the job (progress files, exit)
PEER_POLL_S = 1.0  # several nodes: how often it looks for another node's end of the attempt (consensus.py)
JOIN_TIMEOUT_S = Policy.join_timeout_s  # several nodes: a relaunch's wait in torch's rendezvous for every node
STOP_GRACE_S = 30.0  # SIGTERM to SIGKILL, as torchrun gives its workers


def say(line: str) -> None:
    """One line of the supervisor's own on stderr."""
    print(f"ckptstore run: {line}", file=sys.stderr, flush=True)


class Supervisor:
    def __init__(self, store_url: str, launcher_args: list[str], policy: Policy = Policy(),
                 run_id: str | None = None, staging_dirs: tuple[str, ...] = (), world_size: int | None = None,
                 nnodes: int = 1, nnodes_max: int | None = None, node_rank=None,
                 join_timeout_s: float | None = None, decision_wait_s: float | None = None):
        self.store_url = store_url
        self.launcher_args = list(launcher_args)
        policy = replace(policy, join_timeout_s=policy.join_timeout_s if join_timeout_s is None else join_timeout_s,
                         decision_wait_s=policy.decision_wait_s if decision_wait_s is None else decision_wait_s)
        self.policy = policy
        self.storage: Storage = open_storage(store_url)
        self.journal = Journal(self.storage, run_id or new_run_id())
        self.staging_dirs = tuple(staging_dirs)
        self.world_size, self.nnodes = world_size, nnodes
        self._stop_signal: int | None = None
        self._proc: subprocess.Popen | None = None
        self.alerts = Alerts(policy.alert)
        self.gate = Gate(lambda: check_node(self.store_url, list(self.staging_dirs), self.policy.health),
                         policy, lambda: self._stop_signal is not None)
        self._worker_pids: set[int] = set()  # the current attempt's ranks (progress files)
        self._progress_dir = ""
        self.sections = Sections(policy)  # the run's measured sections and their bounds
        self._reported_before: bool | None = None  # an attempt of this run reported (None: journal unread)
        self.stragglers = Tracker()
        # Several nodes: one attempt number, one verdict per failure, one alert per event,
        # shared through the store (consensus.py); a single node decides alone, as before.
        self.node_rank, self.join_timeout_s = node_rank, policy.join_timeout_s
        self.shared: consensus.Shared | None = None
        if (nnodes_max or nnodes) > 1:
            self.shared = consensus.Shared(self.storage, self.journal.run_id,
                                           consensus.node_name(socket.gethostname(), node_rank), policy=policy)

    # ------------------------------------------------------------------ the loop
    def run(self) -> int:
        if self.shared is not None:  # the others see this supervisor alive (consensus.Heartbeats)
            self.shared.beats.start()
        try:
            self._claim_memory()
            return self._run()
        finally:
            self._release_memory()  # the memory tier lives as long as the run, on every exit path
            if self.shared is not None:
                self.shared.beats.stop()
            self.alerts.drain()  # the last events' alerts (a give-up's) go out before the exit

    def _run(self) -> int:
        started = time.monotonic()
        self._install_signals()
        policy = asdict(self.policy)
        policy["alert"] = bool(self.policy.alert)  # the command may hold a secret (a webhook URL)
        self._event("run_start", command=self.launcher_args, world_size=self.world_size, nnodes=self.nnodes,
                    hosts=[socket.gethostname()], policy=policy)
        history = self._history = History()
        last_ckpt = self._stored_checkpoint()[0]  # where the last attempt (or the first) resumes
        attempt, rejoined = 0, None
        if self.shared is not None:  # a restarted node rejoins its run's running in-job attempt, if it can
            rejoined = self._rejoin(started)
        if rejoined is not None:
            attempt, rejoined = rejoined
        elif self.shared is not None:  # a node (re)started late joins where the run is
            attempt, ended = self.shared.start(
                lambda n: self.join_timeout_s if n > 0 else consensus.FIRST_JOIN_S,
                stopped=lambda: self._stop_signal is not None, say=say)
            if ended is not None:
                return self._follow(attempt, self.shared.settled_from(ended, False))
        while True:
            if rejoined is not None:  # the rejoined attempt ended: settled as any attempt
                outcome, rejoined = rejoined, None
            else:
                fit = self.gate.before_launch(relaunch=attempt > 0)
                if fit.state == "stopped":
                    return self._stopped()
                if fit.state == "unhealthy":
                    # the last event: `status` reads the run as ended on an unhealthy node
                    self._event("unhealthy", checks=[c for c in checks_json(fit.checks) if not c["ok"]],
                                reason=fit.reason)
                    say(f"unhealthy node: {fit.reason} (exit {EXIT_UNHEALTHY})")
                    if self.shared is not None:  # the others, waiting for this node in the rendezvous, stop too
                        self._decree(attempt, "give_up", EXIT_UNHEALTHY, "unhealthy",
                                     f"node {self.shared.node} is unhealthy: {fit.reason}")
                    return EXIT_UNHEALTHY
                if fit.state == "store":
                    return self._give_up(f"the store is unreachable: {fit.reason} (checked for "
                                         f"{self.policy.outage_window_s:g}s; the node is healthy)",
                                         EXIT_STORE_UNREACHABLE, "store")
                self._event("attempt_start", attempt=attempt)
                if self.shared is not None:
                    self._shared_call(self.shared.join, attempt, self.node_rank)
                outcome = self._attempt(attempt, started)
            if outcome.klass == "unhealthy":  # a GPU failed during the run: the job saved and stopped
                return self._unhealthy_in_run(attempt, outcome)
            if outcome.klass == "finished" and self.shared is not None:
                settled = self._decree(attempt, "finish", EXIT_FINISHED, "finished", "the script finished")
                if not settled.mine:
                    return self._follow(attempt, settled)
            if outcome.klass == "finished":
                self._event("finish", attempt=attempt, step=outcome.evidence.get("step"),
                            save_blocking_s=outcome.evidence.get("save_blocking_s"),
                            step_s=outcome.evidence.get("step_s"))
                say(f"finished: attempt {attempt}, {_last_step(outcome.evidence.get('step'))}")
                return EXIT_FINISHED
            if outcome.klass == "timeout":
                if self.shared is not None:
                    settled = self._decree(attempt, "give_up", EXIT_RUN_TIMEOUT, "timeout", outcome.reason)
                    if not settled.mine:
                        return self._follow(attempt, settled)
                return self._give_up(outcome.reason, EXIT_RUN_TIMEOUT, "timeout")
            ckpt, ckpt_t = self._resume_point(outcome.evidence)
            # Progress: a step committed beyond where this attempt started (where its ranks
            # say they resumed, else the previous failure's resume point); never a step
            # that went back, nor a store that could not be read.
            start = outcome.evidence["resumed_step"] if outcome.evidence.get("resume_reported") else last_ckpt
            advanced = ckpt is not None and (start is None or ckpt > start)
            last_ckpt = ckpt if ckpt is not None else last_ckpt
            if self.shared is not None:
                settled = self._settle(attempt, outcome, advanced, ckpt)
                if settled.record["action"] == "finish":
                    return self._follow(attempt, settled)
                decision, local = settled.decision, outcome
                outcome = settled.failure
                outcome.evidence = {**local.evidence, **{k: v for k, v in outcome.evidence.items() if v is not None}}
                if settled.mine:
                    self._record_failure(attempt, outcome, ckpt, ckpt_t, nodes=settled.record.get("nodes"),
                                         node=settled.record.get("failure_node"),
                                         nodes_reported=settled.record.get("nodes_reported"),
                                         node_classes=settled.record.get("node_classes"))
                else:
                    say(f"attempt {attempt} failed here: {local.klass}: {' '.join(str(local.reason).split())[:300]}; "
                        f"the run's verdict, by node {settled.record.get('node')}, follows")
            else:
                decision = decide(self.policy, history, outcome, advanced, time.monotonic(), checkpoint=ckpt)
                outcome.klass, outcome.reason = decision.klass, decision.reason
                self._record_failure(attempt, outcome, ckpt, ckpt_t)
            failed = _failure_line(attempt, outcome)
            if self._stop_signal is not None:
                say(f"{failed}; not relaunched: the supervisor was stopped")
                return self._stopped()
            if decision.code is not None:
                say(f"{failed}; not relaunched")
                return self._give_up(decision.give_up_reason, decision.code, decision.give_up_class,
                                     journal=self.shared is None or settled.mine)
            wait = _jitter.uniform(decision.backoff_s / 2, decision.backoff_s) if decision.backoff_s > 0 else 0.0
            resumes = f"resuming from step {ckpt}" if ckpt is not None else "from the start (no checkpoint)"
            say(f"{failed}; relaunch in {wait:.1f}s as attempt {attempt + 1}, {resumes}")
            self._sleep(wait)  # jitter: the nodes do not relaunch in lockstep
            if self._stop_signal is not None:  # stopped while waiting: no new launch
                return self._stopped()
            attempt += 1

    # ------------------------------------------------------------------ one attempt
    def _attempt(self, attempt: int, started: float, rejoin: str = "") -> Verdict:
        work = tempfile.mkdtemp(prefix=f"ckptstore-run-{attempt}-")
        try:
            return self._attempt_in(work, attempt, started, rejoin)
        finally:  # however the attempt ends (a run timeout returns from inside it)
            shutil.rmtree(work, ignore_errors=True)

    def _attempt_in(self, work: str, attempt: int, started: float, rejoin: str = "") -> Verdict:
        progress_dir = os.path.join(work, "progress")
        os.mkdir(progress_dir)
        result_path = os.path.join(work, "result.json")
        env = dict(os.environ, **{ENV_DIR: progress_dir, ENV_SUPERVISOR: str(os.getpid())})
        if self.shared is not None:  # the attempt's own rendezvous; a relaunch waits a bounded time for every node
            env[launch.ENV_RDZV_ID] = consensus.rdzv_id(self.journal.run_id, attempt)
            if attempt > 0:
                env[launch.ENV_JOIN_TIMEOUT] = f"{self.join_timeout_s:g}"
        events_path = os.path.join(work, "events.jsonl")
        self._events_read = 0
        if self.policy.in_job:  # the node agent (agent.py) in torch's launcher's place
            env[agent.ENV_CONF] = json.dumps({**self._agent_conf(attempt), "rejoin": rejoin})
            cmd = agent.command(result_path, events_path, self.launcher_args)
        else:
            cmd = launch.command(result_path, ["--max-restarts=0", *self.launcher_args])
        launched = time.monotonic()
        launched_t = time.time()
        self._proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        self._worker_pids = set()
        self._progress_dir = progress_dir
        watch = _ProgressWatch(launched)
        resumed_logged = measured = False
        verdict: Verdict | None = None
        peer_check = time.monotonic() + PEER_POLL_S
        self._learn_sections()
        node = NodeWatch(lambda: run_checks(self.staging_dirs, local_store_path(self.store_url), self.policy.health),
                         self.policy.health_interval_s)
        next_report = launched + self.policy.straggler_report_s
        try:
            while True:
                try:
                    self._proc.wait(timeout=POLL_S)
                    break
                except subprocess.TimeoutExpired:
                    pass
                progress = read_progress(progress_dir)
                watch.update(progress)
                self._worker_pids.update(p["pid"] for p in progress.values() if isinstance(p.get("pid"), int))
                resumed_logged = resumed_logged or self._log_resume(attempt, watch, progress, launched_t)
                if not measured and watch.save_blocking_s is not None and watch.step_s is not None:
                    measured = True  # the save cost, for `status`'s interval advice before any failure
                    self._event("measure", attempt=attempt, save_blocking_s=watch.save_blocking_s,
                                step_s=watch.step_s)
                if self.policy.run_timeout_s is not None and time.monotonic() - started > self.policy.run_timeout_s:
                    self._kill(signal.SIGTERM)
                    return Verdict("timeout", f"run timeout of {self.policy.run_timeout_s}s reached")
                self._drain_events(events_path)
                hung = None if self.policy.in_job else watch.hung(self.policy)  # in-job: the agent's watch
                if hung:
                    self._kill(signal.SIGKILL)  # a hung rank does not answer SIGTERM
                    verdict = Verdict("hang", hung)
                    break
                verdict = self._in_run_checks(attempt, progress, launched, node)
                if verdict is not None:
                    break
                if self.policy.straggler_report_s > 0 and time.monotonic() >= next_report:
                    next_report = time.monotonic() + self.policy.straggler_report_s
                    self._report_step_times(attempt, progress)
                if self._stop_signal is not None:
                    self._kill(self._stop_signal)
                    break
                if self.shared is not None and time.monotonic() >= peer_check:
                    peer_check = time.monotonic() + PEER_POLL_S
                    why = self._shared_call(self.shared.interrupted, attempt, self.policy.in_job)
                    if why:  # the attempt ended elsewhere: this node's ranks wait for peers that are gone
                        self._kill(signal.SIGKILL)
                        verdict = Verdict("transient", f"stopped: {why}")
                        verdict.evidence["peer"] = True
                        break
        finally:
            self._reap()
            self._drain_events(events_path)
        self._await_leader(attempt, result_path)
        progress = read_progress(progress_dir)
        watch.update(progress)
        if not resumed_logged:  # the first step came after the last look (a short attempt)
            self._log_resume(attempt, watch, progress, launched_t)
        self._journal_sections(attempt, progress, watch, launched_t)
        evidence = {"step": watch.max_step, "step_s": watch.step_s, "save_blocking_s": watch.save_blocking_s,
                    "resume_reported": watch.resume_reported, "resumed_step": watch.resumed_step,
                    "committed_step": watch.committed_step, "committed_t": watch.committed_t}
        code = self._proc.returncode
        if verdict is None:
            if any(p.get("state") == "preempted" for p in progress.values()):
                verdict = Verdict("preempted", "the job saved and stopped on a signal (preemption)",
                                  exit_code=code)
            elif code == 0:
                verdict = Verdict("finished", "the script finished")
            elif self._stop_signal is not None:  # told to stop before the ranks could say so (launching)
                verdict = Verdict("preempted", f"stopped by {signal.Signals(self._stop_signal).name} "
                                  "before the job could save", exit_code=code)
            else:
                result = _read_json(result_path) or {"failures": {}, "launcher_error": f"exit code {code}"}
                verdict = classify(result, watch.max_step, relaunched=attempt > 0 and not watch.trained)
                if rejoin and isinstance(result.get("rejoin_failed"), str):  # (_rejoin falls back)
                    verdict.evidence["rejoin_failed"] = result["rejoin_failed"][:500]
        verdict.evidence.update(evidence)
        return verdict

    # ------------------------------------------------------------------ in-job attempts (agent.py)
    def _node(self) -> str:
        return str(self.node_rank if self.node_rank is not None else 0)

    def _claim_memory(self) -> None:
        """The node's memory directory and budget for the whole run (memory.py)."""
        self._memory_path, self._memory_budget = "", 0
        if not self.policy.in_job:
            return
        self._memory_budget = memory.budget_bytes(self.policy.memory_budget)
        swept: list[str] = []
        try:
            self._memory_path = memory.claim_dir(self.policy.memory_dir, self._memory_run(), self._node(),
                                                 say=say, swept=swept)
        except OSError as e:  # no tmpfs there, or a live supervisor's: the ranks save without the memory tier
            say(f"memory tier: cannot create {self.policy.memory_dir}/{self._memory_run()}/{self._node()}: {e}")
        if swept:  # killed supervisors' memory directories (memory.sweep_stale)
            self._event("memory_swept", paths=swept[:64], count=len(swept))

    def _memory_run(self) -> str:
        return memory.run_dir_name(self.journal.run_id, self.store_url)

    def _release_memory(self) -> None:
        if getattr(self, "_memory_path", ""):
            memory.release_dir(self.policy.memory_dir, self._memory_run(), self._node())

    def _agent_conf(self, attempt: int) -> dict:
        p = self.policy
        return {"run": self.journal.run_id, "attempt": attempt, "spares": p.spares,
                "abort_timeout_s": p.abort_timeout_s, "reform_timeout_s": p.reform_timeout_s,
                "max_rounds_in_a_row": p.max_rounds_in_a_row, "hang_timeout_s": p.hang_timeout_s,
                "first_progress_timeout_s": p.first_progress_timeout_s,
                "memory_dir": self._memory_path, "memory_budget": self._memory_budget,
                "node_silent_s": p.node_silent_s, "node_fault_silent_s": p.node_fault_silent_s,
                "node_probe_timeout_s": p.node_probe_timeout_s}

    def _rejoin(self, started: float) -> tuple[int, Verdict] | None:
        """In-job, a node other than 0 restarted while the attempt its previous
        supervisor launched still runs (no verdict; node 0 published its in-job store:
        injob_nodes.publish_store): join it as a node of spares (agent.py, ``_rejoin``).
        (the attempt, how it ended) once joined; None when there is nothing to join or it
        could not be joined (said why): the node then waits for the next attempt."""
        if not (self.policy.in_job and self.node_rank not in (None, 0) and self.policy.spares > 0):
            return None
        from .injob_nodes import answers, published_store

        n = self._shared_call(self.shared.chain)
        if not isinstance(n, int) or self._shared_call(self.shared.verdict, n) is not None \
                or self.shared.node not in (self._shared_call(self.shared.members, n) or ()):
            return None
        address = published_store(self.storage, self.journal.run_id, n)
        if address is None:
            say(f"attempt {n} runs without this node and node 0 published no in-job store for it: "
                "this node cannot rejoin it")
            return None
        if self.gate.before_launch(relaunch=False).state != "ok":
            return None  # (the loop's gate says why)
        why = answers(address, 2.0)  # (the agent checks again, and that the store holds this attempt)
        if why is not None:  # node 0 is gone too: no agent started for nothing
            say(f"could not rejoin attempt {n}: node 0's in-job store at {address} does not answer ({why[:200]}); "
                "this node waits for the next attempt")
            return None
        say(f"attempt {n} still runs without this node: rejoining it as a node of spares (node 0's in-job store "
            f"at {address})")
        outcome = self._attempt(n, started, rejoin=address)
        why = outcome.evidence.get("rejoin_failed")
        if why:
            say(f"could not rejoin attempt {n}: {why}; this node waits for the next attempt")
            return None
        return n, outcome

    def _await_leader(self, attempt: int, result_path: str) -> None:
        """In-job on a node other than 0: this node's agent died (killed, no RESULT.json)
        while the leader lives on; the leader replaces this node's ranks with spares
        elsewhere (agent.py, its beat watch) and the attempt goes on without this node. Its
        end is the leader's node's to report: wait for the run's verdict on it, then settle
        as it says (finish, relaunch, give up), rather than relaunching everyone now."""
        if not (self.policy.in_job and self.shared is not None and self.node_rank not in (None, 0)
                and (self._proc.returncode or 0) < 0 and not os.path.exists(result_path)):
            return
        say(f"the in-job agent of attempt {attempt} died here; the leader (node 0) recovers without this "
            "node: waiting for the run's verdict on the attempt")
        while self._stop_signal is None and self._shared_call(self.shared.verdict, attempt) is None:
            time.sleep(PEER_POLL_S)

    def _drain_events(self, path: str) -> None:
        """Journal the agent's in-job events (EVENTS.jsonl) written since the last look:
        one process per node writes the journal and sends the alerts."""
        try:
            with open(path, "rb") as f:
                f.seek(self._events_read)
                data = f.read()
        except OSError:  # none yet (or not an in-job attempt)
            return
        end = data.rfind(b"\n") + 1  # complete lines only: the agent may be writing the next
        self._events_read += end
        for line in data[:end].splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue
            kind = e.pop("kind", None) if isinstance(e, dict) else None
            if kind == agent.STORE_EVENT and self.shared is not None and isinstance(e.get("address"), str):
                from .injob_nodes import publish_store  # where a lost node's return finds the attempt

                self._shared_call(publish_store, self.storage, self.journal.run_id, e.get("attempt"), e["address"])
                continue
            if kind not in agent.EVENT_KINDS:
                continue
            self._event(kind, **e)
            if kind == "recovery":
                say(f"in-job recovery: {e.get('reason')}; round {e.get('round')} "
                    f"trained {e.get('first_step_s') or 0:.2f}s after the fault, from step {e.get('restored_step')}")
            elif kind == "node_rejoined":
                say(f"in-job: node {e.get('node')} rejoined attempt {e.get('attempt')} as a node of spares "
                    f"(round {e.get('round')}, {len(e.get('spares') or [])} warm)")
            else:
                say(f"in-job {kind.removeprefix('in_job_').replace('_', ' ')}: {e.get('reason')}")

    # ------------------------------------------------------------------ during the attempt
    def _learn_sections(self) -> None:
        """Once per supervisor: what this run's journal measured (a --run-id used before)."""
        if self._reported_before is not None:
            return
        try:
            events = self.journal.events()
        except Exception:  # an unreadable journal teaches nothing
            events = []
        self.sections.learn_from_journal(events)
        self._reported_before = any(e.get("kind") in ("resume", "sections") for e in events)

    def _in_run_checks(self, attempt: int, progress: dict, launched: float, node: NodeWatch) -> Verdict | None:
        """The sections' bounds (sections.py) and the node's health (watch.py): the
        verdict that ends the attempt, or None. ``launched``: the launch, ``time.monotonic()``."""
        self._reported_before = self._reported_before or bool(progress)
        late = self.sections.judge(progress, launched, time.monotonic(), bool(self._reported_before), time.time())
        if late is not None:
            self._event("section_timeout", attempt=attempt, **late.event())
            self._kill(signal.SIGKILL)  # as for a hang: a stuck rank does not answer SIGTERM
            return Verdict("hang", late.reason(), evidence={"section": late.section})
        finding = node.poll()
        if finding is None:
            return None
        for c in finding.warnings:
            self._event("run_health", attempt=attempt, action="warn", checks=checks_json([c]))
            say(f"health check failed during the run: {c.name}: {c.detail} (the job goes on)")
        if not finding.unhealthy:
            return None
        reason = "; ".join(f"{c.name}: {c.detail}" for c in finding.unhealthy)
        self._event("run_health", attempt=attempt, action="preempt", checks=checks_json(finding.unhealthy))
        say(f"unhealthy GPU during the run: {reason}; stopping the job with SIGTERM (its preemption save)")
        self._kill(signal.SIGTERM)  # the Checkpointer saves (to the durable tier too) and stops
        return Verdict("unhealthy", reason, evidence={"checks": checks_json(finding.unhealthy)})

    def _report_step_times(self, attempt: int, progress: dict) -> None:
        """A ``step_times`` report of this node's ranks; a ``straggler`` event (and alert)
        for each rank that became one beyond the alert factor (stragglers.py)."""
        ranks = report_of(progress)
        if not ranks or self.world_size == 1:
            return
        self._event("step_times", attempt=attempt, ranks={str(r): s for r, s in sorted(ranks.items())})
        reports = [(socket.gethostname(), ranks)]
        if self.shared is not None:  # several nodes: the leader judges every node's ranks, so one alert each
            reports = self._shared_call(self.shared.beats.cross_node, attempt, ranks) or []
        for host, node_ranks in reports:
            for s in self.stragglers.update(attempt, node_ranks, host, fmt.utc_now()):
                fields = {k: v for k, v in s.as_dict().items() if k != "host"}  # (the event's own host: this node)
                if host != socket.gethostname():  # another node's rank (several nodes: judged by the leader)
                    fields["rank_host"] = host
                self._event("straggler", attempt=attempt, alert_factor=ALERT_FACTOR, **fields)
                say(f"straggler: rank {s.rank} steps in {s.step_s:.3g}s, {s.ratio:.1f}x the other ranks' "
                    f"median {s.others_s:.3g}s, for {s.reports} reports")

    def _journal_sections(self, attempt: int, progress: dict, watch: "_ProgressWatch", launched_t: float) -> None:
        """What this attempt measured of each section: learned from, and journaled."""
        first = None if watch.first_step_t is None else max(0.0, watch.first_step_t - launched_t)
        longest = self.sections.attempt_longest(progress, first)
        for name, seconds in longest.items():
            self.sections.observe(name, seconds)
        if longest:
            self._event("sections", attempt=attempt, longest=longest)

    def _unhealthy_in_run(self, attempt: int, v: Verdict) -> int:
        """The end of a run whose GPU failed while it ran: the job stopped after its
        preemption save; the node is to be replaced."""
        ckpt, _ = self._resume_point(v.evidence)
        self._event("unhealthy", checks=v.evidence.get("checks") or [], reason=v.reason, attempt=attempt,
                    during_run=True, step=v.evidence.get("step"), checkpoint_step=ckpt)
        saved = f"; the next run resumes from step {ckpt}" if ckpt is not None else "; no checkpoint committed"
        say(f"unhealthy node during the run: {v.reason}{saved} (exit {EXIT_UNHEALTHY})")
        if self.shared is not None:  # the others' ranks lost this node's: they stop with the run's verdict
            self._decree(attempt, "give_up", EXIT_UNHEALTHY, "unhealthy",
                         f"node {self.shared.node} is unhealthy during the run: {v.reason}")
        return EXIT_UNHEALTHY

    def _log_resume(self, attempt: int, watch: "_ProgressWatch", progress: dict, launched_t: float) -> bool:
        """Journal where the attempt resumed from, once its first step is reported."""
        if watch.first_step_t is None:
            return False
        r0 = progress[min(progress)] if progress else {}  # this node's first rank (rank 0 on one node only)
        self._event("resume", attempt=attempt, step=r0.get("resumed_step"), tier=r0.get("resumed_tier"),
                    checkpoint_age_s=r0.get("resumed_age_s"), skipped=r0.get("skipped") or [], first_step_s=watch.first_step_t - launched_t)
        return True

    def _kill(self, signum: int) -> None:
        """SIGKILL: the launcher and every process below it, at once. Another signal
        goes to the launcher, which forwards it to its workers once (a Checkpointer
        saves, then stops), as torchrun does; whatever is left after the grace is
        killed."""
        proc = self._proc
        if signum == signal.SIGKILL:
            _kill_tree(proc.pid)
            return
        try:
            os.kill(proc.pid, signum)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            _kill_tree(proc.pid)

    def _reap(self) -> None:
        """The attempt is over: no process of it may outlive it. torch's launcher starts
        each worker in a session of its own, so the launcher's process group does not
        hold them: the workers are found as its descendants (and, once it is gone, by
        the pids their progress files name) and killed."""
        proc = self._proc
        if proc.poll() is None:
            proc.wait()
        for pid in self._worker_pids:
            _kill_worker(pid, self._progress_dir)

    # ------------------------------------------------------------------ records
    def _record_failure(self, attempt: int, v: Verdict, ckpt_step: int | None, ckpt_t: float | None,
                        **shared) -> None:
        step = v.evidence.get("step")
        lost = None if step is None else max(0, step - (ckpt_step if ckpt_step is not None else -1))
        step_s = v.evidence.get("step_s")
        self._event("failure", attempt=attempt, **{"class": v.klass}, reason=v.reason, exit_code=v.exit_code,
                    signal=v.signal, rank=v.rank, traceback=(v.traceback or None) and v.traceback[-4000:],
                    step=step, checkpoint_step=ckpt_step,
                    checkpoint_age_s=None if ckpt_t is None else max(0.0, time.time() - ckpt_t),
                    lost_steps=lost, lost_s=None if (lost is None or step_s is None) else lost * step_s,
                    save_blocking_s=v.evidence.get("save_blocking_s"), step_s=step_s, **shared)

    def _stopped(self) -> int:
        return self._give_up(f"the supervisor was stopped by {signal.Signals(self._stop_signal).name}",
                             EXIT_STOPPED, "preempted")

    def _give_up(self, reason: str, code: int, klass: str, journal: bool = True) -> int:
        if journal:  # several nodes: only the verdict's writer journals (and alerts) it
            self._event("give_up", reason=reason, code=code, **{"class": klass})
        say(f"gave up: {reason} (exit {code})")
        return code

    # ------------------------------------------------------------------ several nodes (consensus.py)
    def _shared_call(self, fn, *args):
        """A shared-record read or write that must not take the supervisor down: None
        when the store fails (the next poll tries again)."""
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001
            say(f"shared records: {type(e).__name__}: {e}")
            return None

    def _settle(self, attempt: int, outcome: Verdict, advanced: bool, ckpt: int | None) -> "consensus.Settled":
        self._shared_call(self.shared.report, attempt, outcome, advanced, ckpt)
        try:
            return self.shared.settle(attempt, self.policy, stopped=lambda: self._stop_signal is not None)
        except Exception as e:  # noqa: BLE001 - the store failed: this node decides alone, from its history
            say(f"shared records: {type(e).__name__}: {e}; deciding from this node's evidence alone")
            local = Verdict(outcome.klass, outcome.reason, outcome.rank, outcome.exit_code, outcome.signal,
                            outcome.traceback, outcome.signature, dict(outcome.evidence), outcome.outage)
            d = decide(self.policy, self._history, local, advanced, time.time(), checkpoint=ckpt)
            local.klass, local.reason = d.klass, d.reason
            return consensus.Settled({"action": "relaunch" if d.code is None else "give_up"}, True, local, d)

    def _decree(self, attempt: int, action: str, code: int, klass: str, reason: str) -> "consensus.Settled":
        settled = self._shared_call(self.shared.decree, attempt, action, code, klass, reason)
        if settled is None:  # the store failed: this node's word stands for itself
            return consensus.Settled({"action": action, "code": code}, True, Verdict(klass, reason),
                                     consensus.Decision(klass, reason, code=code))
        return settled

    def _follow(self, attempt: int, settled: "consensus.Settled") -> int:
        """End as the run's verdict on ``attempt``, written by another node, says."""
        rec = settled.record
        by = rec.get("node")
        if rec.get("action") == "finish":
            say(f"finished: attempt {attempt} (the run's verdict, by node {by})")
            return EXIT_FINISHED
        code = settled.decision.code if settled.decision.code is not None else EXIT_STOPPED
        reason = settled.decision.give_up_reason or settled.failure.reason
        say(f"gave up: {reason} (the run's verdict on attempt {attempt}, by node {by}) (exit {code})")
        return code

    def _event(self, kind: str, **fields) -> None:
        try:
            event = self.journal.append(kind, **fields)
        except Exception as e:  # the journal must not take the job down with it
            event = {"kind": kind, "run": self.journal.run_id, "at": fmt.utc_now(), **fields}
            say(f"could not journal {kind}: {e}")
        if kind in ("failure", "give_up", "unhealthy", "straggler", "run_health"):
            self.alerts.send(event)

    def _stored_checkpoint(self, at_most: int | None = None) -> tuple[int | None, float | None]:
        """The store's newest committed step (not above ``at_most``) and its commit time
        (unix seconds); None, None when there is none or the store cannot be read."""
        try:
            newest = newest_checkpoint(self.storage, at_most=at_most)
        except Exception:
            newest = None
        return (newest["step"], newest["committed_at_t"]) if newest else (None, None)

    def _resume_point(self, evidence: dict) -> tuple[int | None, float | None]:
        """Where the next attempt resumes, and when that step committed: the newest step
        the ranks resumed from or committed (they know which steps their validation
        took, and a local tier's commits, which the store at ``--store`` does not hold),
        or the store's newest committed step no later than the step the job reached
        (a newer one is one its resume passed over)."""
        reported, reported_t = evidence.get("committed_step"), evidence.get("committed_t")
        bound = evidence.get("step")
        if bound is None:  # no step reached: nothing newer than where it resumed can be its
            bound = evidence.get("resumed_step")
        stored, stored_t = self._stored_checkpoint(at_most=bound)
        if stored is not None and (reported is None or stored > reported):
            return stored, stored_t
        return reported, reported_t

    def _sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while self._stop_signal is None and time.monotonic() < end:
            time.sleep(min(POLL_S, max(0.0, end - time.monotonic())))

    def _install_signals(self) -> None:
        def on_signal(signum, frame):
            self._stop_signal = signum

        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, on_signal)


def _kill_tree(pid: int) -> None:
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass


def _kill_worker(pid: int, progress_dir: str) -> None:
    """SIGKILL ``pid`` if it still is a worker of this attempt (its environment names
    the attempt's progress directory: a pid reused since is left alone)."""
    import psutil

    try:
        p = psutil.Process(pid)
        if p.environ().get(ENV_DIR) == progress_dir:
            p.kill()
    except psutil.Error:
        pass


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


def _last_step(step) -> str:
    return f"last step {step}" if step is not None else "no step reported"


def _failure_line(attempt: int, v: Verdict) -> str:
    """The one stderr line of a failed attempt (the relaunch or its absence is added)."""
    reason = " ".join(str(v.reason).split())
    if len(reason) > 400:
        reason = reason[:400] + "..."
    where = "" if "step" in reason else f" ({_last_step(v.evidence.get('step'))})"
    return f"attempt {attempt} failed: {v.klass}: {reason}{where}"
