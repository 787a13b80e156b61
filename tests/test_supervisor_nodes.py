"""Several nodes, one decision (issue 35, section 3): simulated nodes on one machine, one
``ckptstore run`` each (``--nnodes 2 --node-rank K``, c10d rendezvous on 127.0.0.1, one
CPU rank per node, one store), deciding together through the store's shared records
(ckptstore/supervisor/consensus.py, docs/format.md "Shared decisions").

Before: each node's supervisor decided alone. A deterministic error on node 1 stopped
node 1 (exit 10) while node 0 relaunched and waited for it in torch's rendezvous for its
default join timeout (600 s) on every attempt; attempts were numbered per node, and every
node journaled and alerted its own failure of each attempt.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import sys
import time
from pathlib import Path

import psutil

from ckptstore.storage import open_storage
from ckptstore.supervisor import consensus, runner
from ckptstore.supervisor.journal import Journal

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from jobutil import HANG_GUARD_S, Job, assert_bit_identical  # noqa: E402
from test_supervisor import SCRIPT, STEPS, kinds, reference, status  # noqa: E402,F401

RUN = "nodes"
# A lost node's report never comes and it never joins a relaunch: in the tests where a
# node is gone for good these waits are spent in full, so they are shorter there than the
# class's defaults (5 s each), which bound the waits for a node that does answer.
LOST_NODE_WAITS = ("--decision-wait", "2", "--join-timeout", "3")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Nodes:
    """``n`` simulated nodes of one run; ``faults[k]``: node k's FAULT (any rank of it)."""

    def __init__(self, store: Path, tmp: Path, *policy, n: int = 2, faults: dict | None = None,
                 nnodes: str | None = None, options: dict | None = None, staggered: bool = False):
        port = free_port()
        self.store, self.tmp = store, tmp
        self.final = tmp / f"final-{random.getrandbits(32):08x}.pt"
        self.alerts = [tmp / f"alerts-{k}.jsonl" for k in range(n)]
        self.jobs, self.cmds, self.envs = [], [], []
        for k in range(n):
            fault = (faults or {}).get(k)
            self.cmds.append(
                [sys.executable, "-m", "ckptstore.cli", "run", "--nnodes", nnodes or str(n), "--node-rank", str(k),
                 "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                 "--store", str(store), "--run-id", RUN, "--backoff", "0.05", "--decision-wait", "5",
                 "--join-timeout", "5", "--alert", f"cat >> {self.alerts[k]}; echo >> {self.alerts[k]}",
                 "--no-in-job", *policy,
                 *(options or {}).get(k, []),
                 str(SCRIPT), str(store), "--steps", str(STEPS), "--every", "5", "--final", str(self.final)])
            self.envs.append({"FAULT": fault or "none:-1", "FAULT_ANY_RANK": "1" if fault else ""})
            self.jobs.append(Job(self.cmds[k], env=self.envs[k]))
            if staggered and k == 0:  # the others start once node 0 launched (it waits in the rendezvous)
                first = consensus.node_name(socket.gethostname(), 0)
                deadline = time.monotonic() + HANG_GUARD_S
                while first not in self.shared().members(0):
                    assert time.monotonic() < deadline and self.jobs[0].proc.poll() is None, "node 0 never launched"
                    time.sleep(0.05)  # (a bounded poll of the store, not a synchronisation by time)

    def kill_node(self, k: int) -> None:
        """SIGKILL node k's supervisor and every process below it at once (a node that dies)."""
        job = self.jobs[k]
        for p in [job.proc, *psutil.Process(job.proc.pid).children(recursive=True)]:
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def restart(self, k: int) -> Job:
        """A new ``ckptstore run`` for node k (same options; the old one's output is kept)."""
        self.old = getattr(self, "old", []) + [self.jobs[k]]
        self.jobs[k] = Job(self.cmds[k], env=self.envs[k])
        return self.jobs[k]

    def finish(self) -> list[int]:
        return [job.finish() for job in self.jobs]

    def output(self) -> str:
        return "\n".join(f"--- node {k}\n" + job.output()[-3000:] for k, job in enumerate(self.jobs))

    def alert_events(self) -> list[dict]:
        out = []
        for path in self.alerts:
            if path.exists():
                out += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return sorted(out, key=lambda e: e["t"])

    def events(self) -> list[dict]:
        return Journal(open_storage(str(self.store)), RUN).events()

    def shared(self) -> consensus.Shared:
        return consensus.Shared(open_storage(str(self.store)), RUN, "reader")


def test_a_deterministic_error_on_one_node_stops_every_node_with_one_verdict_and_one_alert(tmp_path):
    """Node 1's rank raises the same error at step 12 on every attempt: the second time
    is deterministic for the run, both nodes exit 10 after two attempts, the run's two
    failures are journaled (and alerted) once each, by the verdict's writer."""
    nodes = Nodes(tmp_path / "store", tmp_path, faults={1: "raise:12"})
    assert nodes.finish() == [runner.EXIT_DETERMINISTIC] * 2, nodes.output()
    events = nodes.events()
    failures = kinds(events, "failure")
    assert [(f["attempt"], f["class"]) for f in failures] == [(0, "transient"), (1, "deterministic")], failures
    assert all("bad data shard at sample 192" in f["reason"] for f in failures)
    assert all(len(f["nodes"]) == 2 for f in failures)  # both nodes' own view, in the one record
    assert sorted(e["attempt"] for e in kinds(events, "attempt_start")) == [0, 0, 1, 1]
    assert len(kinds(events, "give_up")) == 1 and kinds(events, "give_up")[0]["code"] == runner.EXIT_DETERMINISTIC
    assert [e["kind"] for e in nodes.alert_events()] == ["failure", "failure", "give_up"]
    shared = nodes.shared()
    verdicts = [shared.verdict(n) for n in (0, 1)]
    assert [v["action"] for v in verdicts] == ["relaunch", "give_up"] and verdicts[0]["next_attempt"] == 1
    assert verdicts[0]["rdzv_id"] == f"{RUN}-a1"
    assert shared.verdict(2) is None and shared.latest() == 1
    st = status(nodes.store)
    assert (st["state"], st["restarts"], st["give_up"]["code"]) == ("gave_up", 1, runner.EXIT_DETERMINISTIC)
    assert [f["class"] for f in st["failures"]] == ["transient", "deterministic"]


def test_an_unhealthy_node_stops_the_others_waiting_in_the_rendezvous(tmp_path):
    """Node 1 fails its health check before the first launch (this machine has no GPU):
    it exits 13 and writes the run's verdict on attempt 0, which node 0 reads while its
    launcher waits in the rendezvous for node 1: it stops and exits 13 too, at once
    instead of after torch's join timeout; one `unhealthy` event, one alert."""
    nodes = Nodes(tmp_path / "store", tmp_path, options={1: ["--expected-gpus", "1", "--health-wait", "0"]},
                  staggered=True)
    assert nodes.finish() == [runner.EXIT_UNHEALTHY] * 2, nodes.output()
    verdict = nodes.shared().verdict(0)
    assert (verdict["action"], verdict["code"], verdict["node"]) == \
        ("give_up", runner.EXIT_UNHEALTHY, consensus.node_name(socket.gethostname(), 1))
    assert f"node {verdict['node']} is unhealthy" in nodes.jobs[0].output()
    assert nodes.shared().members(0) == {consensus.node_name(socket.gethostname(), 0)}  # it had launched
    assert [e["kind"] for e in nodes.events() if e["kind"] in ("unhealthy", "give_up", "failure")] == ["unhealthy"]
    assert [e["kind"] for e in nodes.alert_events()] == ["unhealthy"]


def test_a_rank_killed_on_one_node_recovers_bit_identical_under_one_attempt_number(tmp_path, reference):
    """Node 1's rank is SIGKILLed at step 12 once: both nodes relaunch as attempt 1
    (through a rendezvous of its own) and end bit-identical to an uninterrupted run; the
    failure is recorded once, with the killed rank as its cause."""
    nodes = Nodes(tmp_path / "store", tmp_path, faults={1: f"kill:12:{tmp_path / 'killed-once'}"})
    assert nodes.finish() == [runner.EXIT_FINISHED] * 2, nodes.output()
    assert_bit_identical(nodes.final, reference)
    events = nodes.events()
    failures = kinds(events, "failure")
    caused = [f for f in failures if not (f["class"] == "transient" and f["step"] == STEPS - 1)]  # (teardown)
    assert len(caused) == 1 and caused[0]["attempt"] == 0 and caused[0]["signal"] == "SIGKILL", failures
    assert len({f["attempt"] for f in failures}) == len(failures)  # one record per attempt, whoever saw it
    started = sorted(e["attempt"] for e in kinds(events, "attempt_start"))
    assert started == sorted([n for n in range(len(failures) + 1)] * 2), started
    assert len(kinds(events, "finish")) == 1
    shared = nodes.shared()
    assert shared.verdict(0)["action"] == "relaunch" and shared.verdict(len(failures))["action"] == "finish"
    assert [e["kind"] for e in nodes.alert_events()] == ["failure"] * len(failures)


def test_a_node_that_never_returns_stops_the_others_within_the_join_timeout(tmp_path):
    """Node 1 is lost at step 8 (every process of it SIGKILLed, as a node that dies): node
    0 waits at most --decision-wait for its report, relaunches, waits at most
    --join-timeout in the rendezvous of attempt 1 and stops with exit 16, naming the
    node. (Both waits are spent in full, node 1 being gone: shorter than the class's.)"""
    nodes = Nodes(tmp_path / "store", tmp_path, *LOST_NODE_WAITS)
    lost = nodes.jobs[1]
    lost.expect(lambda l: l.startswith("rank ") and " step 8 " in l, "a step 8 on node 1")
    tree = [lost.proc, *psutil.Process(lost.proc.pid).children(recursive=True)]
    for p in tree:
        try:
            os.kill(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert nodes.jobs[0].finish() == runner.EXIT_NODES_MISSING, nodes.output()
    lost.finish()
    give_up = kinds(nodes.events(), "give_up")
    assert len(give_up) == 1 and give_up[0]["class"] == "nodes_missing", give_up
    assert "join timeout" in give_up[0]["reason"] and f"{socket.gethostname()}-1" in give_up[0]["reason"]
    assert nodes.shared().verdict(1)["unreported"] == []  # node 1 never launched attempt 1
    assert nodes.shared().verdict(0)["unreported"] == [consensus.node_name(socket.gethostname(), 1)]


def test_with_min_max_nodes_the_others_continue_without_a_lost_node(tmp_path):
    """``--nnodes 1:2``: node 1 is lost at step 8; node 0 relaunches, torch's rendezvous
    completes with the one node left (after its last-call wait), and the job resumes on
    one rank from the two ranks' checkpoint (resharded) and finishes."""
    nodes = Nodes(tmp_path / "store", tmp_path, "--rdzv-conf", "last_call_timeout=2", "--decision-wait",
                  LOST_NODE_WAITS[1], nnodes="1:2")  # (node 1's report never comes: the wait is spent in full)
    lost = nodes.jobs[1]
    lost.expect(lambda l: l.startswith("rank ") and " step 8 " in l, "a step 8 on node 1")
    for p in [lost.proc, *psutil.Process(lost.proc.pid).children(recursive=True)]:
        try:
            os.kill(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert nodes.jobs[0].finish() == runner.EXIT_FINISHED, nodes.output()
    lost.finish()
    resumed = [line for line in nodes.jobs[0].lines if line.startswith("rank 0: resumed at step")]
    assert resumed and "saved by 2 ranks" in resumed[-1], nodes.output()
    shared = nodes.shared()  # (an attempt before the loss may have ended early: torch's elastic rounds)
    last = shared.latest()
    assert last >= 1 and shared.verdict(last)["action"] == "finish"
    assert shared.members(last) == {consensus.node_name(socket.gethostname(), 0)}


def _recovered(nodes: Nodes, reference) -> list[dict]:
    """Both nodes finished bit-identical; one failure record per attempt under one
    numbering, each attempt started by both nodes, one finish; the failures, returned."""
    assert nodes.finish() == [runner.EXIT_FINISHED] * 2, nodes.output()
    assert_bit_identical(nodes.final, reference)
    events = nodes.events()
    failures = kinds(events, "failure")
    assert [f["attempt"] for f in failures] == list(range(len(failures))), failures  # one per attempt, in order
    assert len(kinds(events, "finish")) == 1 and len(kinds(events, "give_up")) == 0
    shared = nodes.shared()
    assert shared.latest() == len(failures) and shared.verdict(len(failures))["action"] == "finish"
    assert all(shared.verdict(n)["action"] == "relaunch" for n in range(len(failures)))
    assert [e["kind"] for e in nodes.alert_events()] == ["failure"] * len(failures)
    return failures


def _caused(failures: list[dict]) -> list[dict]:
    return [f for f in failures if not (f["class"] == "transient" and f["step"] == STEPS - 1)]  # (teardown)


def test_a_rank_killed_on_the_rendezvous_hosts_node_recovers_bit_identical(tmp_path, reference):
    """Node 0 (whose address is the --rdzv-endpoint: its launcher hosts torch's c10d
    store) has its rank SIGKILLed at step 12 once: node 0's launcher lives on, both nodes
    relaunch as attempt 1 and end bit-identical, the failure recorded once."""
    nodes = Nodes(tmp_path / "store", tmp_path, faults={0: f"kill:12:{tmp_path / 'killed-once'}"})
    failures = _recovered(nodes, reference)
    caused = _caused(failures)
    assert len(caused) == 1 and caused[0]["attempt"] == 0 and caused[0]["signal"] == "SIGKILL", failures
    started = sorted(e["attempt"] for e in kinds(nodes.events(), "attempt_start"))
    assert started == sorted(list(range(len(failures) + 1)) * 2), started


def test_a_rank_killed_on_each_node_at_once_recovers_with_one_failure_record(tmp_path, reference):
    """Both nodes' ranks are SIGKILLed at step 12 (both nodes report a killed rank): one
    verdict, one failure record for attempt 0, both relaunch and end bit-identical."""
    nodes = Nodes(tmp_path / "store", tmp_path, faults={0: f"kill:12:{tmp_path / 'k0'}",
                                                         1: f"kill:12:{tmp_path / 'k1'}"})
    failures = _recovered(nodes, reference)
    caused = _caused(failures)
    assert len(caused) == 1 and caused[0]["attempt"] == 0 and caused[0]["signal"] == "SIGKILL", failures
    assert len(caused[0]["nodes"]) == 2, caused[0]  # both nodes' views in the one record
    started = sorted(e["attempt"] for e in kinds(nodes.events(), "attempt_start"))
    assert started == sorted(list(range(len(failures) + 1)) * 2), started


def test_a_hang_on_one_node_is_detected_once_and_recovers(tmp_path, reference):
    """Node 1's rank blocks at step 12 (once): with --hang-timeout 8 the hang is detected,
    the run's one verdict on attempt 0 is a hang, both nodes relaunch and end
    bit-identical. (Not 4 s: on a loaded machine a rank's exit after its last step,
    which reports no progress, took over 4 s and was judged a hang twice.)"""
    nodes = Nodes(tmp_path / "store", tmp_path, "--hang-timeout", "8", faults={1: f"hang:12:{tmp_path / 'hung'}"})
    failures = _recovered(nodes, reference)
    caused = _caused(failures)
    assert len(caused) == 1 and caused[0]["attempt"] == 0 and caused[0]["class"] == "hang", failures
    assert "no rank reported progress" in caused[0]["reason"], caused[0]
    started = sorted(e["attempt"] for e in kinds(nodes.events(), "attempt_start"))
    assert started == sorted(list(range(len(failures) + 1)) * 2), started


def test_a_whole_node_restarted_at_once_rejoins_and_the_run_finishes_bit_identical(tmp_path, reference):
    """Node 1's supervisor and ranks are SIGKILLed at step 8 (a node that reboots) and a
    new ``ckptstore run`` for node 1 starts at once: it reports the attempt its first
    supervisor launched lost (without joining it again), joins the next one, and both
    nodes finish bit-identical under one attempt numbering."""
    nodes = Nodes(tmp_path / "store", tmp_path, "--join-timeout", "20")
    lost = nodes.jobs[1]
    lost.expect(lambda l: l.startswith("rank ") and " step 8 " in l, "a step 8 on node 1")
    nodes.kill_node(1)
    nodes.restart(1)
    assert lost.finish() == -signal.SIGKILL
    failures = _recovered(nodes, reference)
    assert failures and failures[0]["class"] == "transient", failures  # (a lost peer: the killed node never reported)
    started = sorted(e["attempt"] for e in kinds(nodes.events(), "attempt_start") if e["attempt"] > 0)
    assert started == sorted(list(range(1, len(failures) + 1)) * 2), started  # the new node 1 in every relaunch
    assert [e["attempt"] for e in kinds(nodes.events(), "attempt_start")].count(0) == 2  # not joined again
    report = nodes.shared().reports(0)[consensus.node_name(socket.gethostname(), 1)]
    assert "restarted: its processes of attempt 0 were lost" in report["verdict"]["reason"], report
    assert any(line.startswith("rank ") and " step " in line for line in nodes.jobs[1].lines), nodes.output()


# Node 0 alone hosts torch's c10d store (as on separate machines, where only the host
# whose address --rdzv-endpoint names does): node 1 never hosts it, not even on a relaunch.
PINNED = {0: ["--rdzv-conf", "is_host=1"], 1: ["--rdzv-conf", "is_host=0"]}


def _lose(nodes: Nodes, k: int, step: int = 8) -> Job:
    """SIGKILL node k whole once a rank of it reported ``step``; its old job, returned."""
    lost = nodes.jobs[k]
    lost.expect(lambda l: l.startswith("rank ") and f" step {step} " in l, f"a step {step} on node {k}")
    nodes.kill_node(k)
    return lost


def _wait_launched(nodes: Nodes, attempt: int, k: int) -> None:
    """Until node k joined ``attempt`` (its launcher then starts: a bounded poll of the store)."""
    name = consensus.node_name(socket.gethostname(), k)
    deadline = time.monotonic() + HANG_GUARD_S
    while name not in nodes.shared().members(attempt):
        assert time.monotonic() < deadline and nodes.jobs[k].proc.poll() is None, nodes.output()
        time.sleep(0.05)


def test_the_rendezvous_hosts_whole_node_restarted_at_once_recovers_bit_identical(tmp_path, reference):
    """Node 0, whose launcher alone hosts torch's c10d store, is SIGKILLed whole at step 8
    (supervisor, launcher, ranks: the store dies with it) and restarted at once: node 1
    does not hang (its ranks lose their peer, its launcher the store), the new node 0
    hosts the store again, and both finish bit-identical under one attempt numbering."""
    nodes = Nodes(tmp_path / "store", tmp_path, "--join-timeout", "20", options=PINNED)
    lost = _lose(nodes, 0)
    nodes.restart(0)
    assert lost.finish() == -signal.SIGKILL
    failures = _recovered(nodes, reference)
    assert failures and failures[0]["class"] == "transient", failures
    assert [e["attempt"] for e in kinds(nodes.events(), "attempt_start")].count(0) == 2  # not joined again
    assert "restarted" in nodes.shared().reports(0)[consensus.node_name(socket.gethostname(), 0)]["verdict"]["reason"]
    assert any(line.startswith("rank ") and " step " in line for line in nodes.jobs[0].lines), nodes.output()


def test_the_rendezvous_host_restarted_late_is_waited_for_and_recovers_bit_identical(tmp_path, reference):
    """Node 0 (the c10d store's only host) is lost at step 8 and restarted only once node
    1's relaunch is waiting for the store that died with it (within the join timeout):
    node 1's launcher connects when the new node 0 hosts the store again, attempt 0 has
    one failure record, and both finish bit-identical."""
    nodes = Nodes(tmp_path / "store", tmp_path, "--join-timeout", "30", "--decision-wait", LOST_NODE_WAITS[1],
                  options=PINNED)  # (node 0's report of attempt 0 never comes: that wait is spent in full)
    lost = _lose(nodes, 0)
    _wait_launched(nodes, 1, 1)  # node 1 relaunched without node 0: its launcher waits for the store
    nodes.restart(0)
    assert lost.finish() == -signal.SIGKILL
    failures = _recovered(nodes, reference)
    assert failures[0]["class"] == "transient", failures
    verdict = nodes.shared().verdict(0)
    assert verdict["unreported"] == [consensus.node_name(socket.gethostname(), 0)], verdict  # decided without it
    started = sorted(e["attempt"] for e in kinds(nodes.events(), "attempt_start"))
    assert started.count(1) == 2, started  # the new node 0 joined the attempt node 1 was waiting in


def test_a_rendezvous_host_that_never_returns_stops_the_others_with_exit_16(tmp_path):
    """Node 0 (the c10d store's only host) is lost for good at step 8: node 1 relaunches,
    its launcher finds no store at the --rdzv-endpoint within the join timeout (torch's
    read_timeout, which the supervisor sets to --join-timeout on a relaunch: 3 s here) and
    the run stops with exit 16 at once, naming the endpoint. Before, it retried a
    rendezvous nobody hosts until the no-progress limit (exit 12, four failures)."""
    nodes = Nodes(tmp_path / "store", tmp_path, *LOST_NODE_WAITS, options=PINNED)
    lost = _lose(nodes, 0)
    assert nodes.jobs[1].finish() == runner.EXIT_NODES_MISSING, nodes.output()
    lost.finish()
    give_up = kinds(nodes.events(), "give_up")
    assert len(give_up) == 1 and give_up[0]["class"] == "nodes_missing", give_up
    assert "rendezvous endpoint 127.0.0.1:" in give_up[0]["reason"], give_up
    assert [f["attempt"] for f in kinds(nodes.events(), "failure")] == [0, 1]



def test_a_frozen_node_is_recognised_by_its_heartbeat_and_the_others_stop_with_exit_16(tmp_path):
    """Node 1 freezes at step 8 (SIGSTOP to its supervisor, launcher and rank: a machine
    that hangs or loses power sends no connection reset, and node 0's rank would wait in
    gloo for the process group's timeout): node 0 sees node 1's heartbeat stop
    (--heartbeat-timeout 3), stops its attempt, decides at once without node 1's report
    ("stopped beating"), and its relaunch stops with exit 16 after the join timeout.
    Before heartbeats, node 0 waited until its hang timeout (600 s here)."""
    nodes = Nodes(tmp_path / "store", tmp_path, "--heartbeat-timeout", "3", "--join-timeout", LOST_NODE_WAITS[3],
                  options=PINNED)  # (node 1 never joins the relaunch: the join timeout is spent in full)
    frozen = nodes.jobs[1]
    frozen.expect(lambda l: l.startswith("rank ") and " step 8 " in l, "a step 8 on node 1")
    tree = [frozen.proc, *psutil.Process(frozen.proc.pid).children(recursive=True)]
    for p in tree:
        os.kill(p.pid, signal.SIGSTOP)
    try:
        assert nodes.jobs[0].finish() == runner.EXIT_NODES_MISSING, nodes.output()
    finally:
        for p in tree:
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    frozen.finish()
    name = consensus.node_name(socket.gethostname(), 1)
    verdict = nodes.shared().verdict(0)
    assert verdict["stopped_beating"] == [name] and verdict["unreported"] == [name], verdict
    assert f"node {name}'s supervisor stopped beating at " in verdict["reason"], verdict
    assert f"stopped: node {name}'s supervisor stopped beating" in nodes.jobs[0].output()
    give_up = kinds(nodes.events(), "give_up")
    assert len(give_up) == 1 and give_up[0]["class"] == "nodes_missing", give_up


# ------------------------------------------------------------------ the shared records, in process
def test_a_node_that_starts_late_joins_an_open_attempt_waits_out_a_running_one_and_follows_an_end():
    clock = [1000.0]
    storage = open_storage(f"memory://late-{random.getrandbits(32):08x}")
    early = consensus.Shared(storage, RUN, "a-0", clock=lambda: clock[0])
    late = consensus.Shared(storage, RUN, "b-1", clock=lambda: clock[0], sleep=lambda s: None)
    assert late.start() == (0, None)  # nothing yet: attempt 0
    early.join(0)
    clock[0] += 10
    assert late.start(lambda n: 60) == (0, None)  # its rendezvous may still be open: join it
    clock[0] += 100
    polls = []

    def stopped():  # the running attempt ends (a relaunch) while the late node waits
        polls.append(1)
        if len(polls) == 2:
            early.decree(0, "give_up", 10, "deterministic", "x")  # (any verdict ends the wait)
        return False
    attempt, ended = late.start(lambda n: 60, stopped=stopped)
    assert (attempt, ended["action"], ended["code"]) == (0, "give_up", 10) and len(polls) == 2
    assert late.settled_from(ended, False).decision.code == 10


def test_the_verdict_merges_every_nodes_evidence_and_replays_the_history():
    from ckptstore.supervisor.classify import Verdict
    from ckptstore.supervisor.decide import Policy

    storage = open_storage(f"memory://merge-{random.getrandbits(32):08x}")
    a, b = (consensus.Shared(storage, RUN, n, wait_s=0) for n in ("a-0", "b-1"))
    lost_peer = Verdict("transient", "rank 0: RuntimeError: Connection closed by peer")
    own = Verdict("transient", "rank 1: ValueError: bad", signature="ValueError: bad @ step 11")
    for n in (0, 1):
        a.join(n), b.join(n)
        a.report(n, lost_peer, False, 10)
        b.report(n, own, False, 10)
    first = a.settle(0, Policy())
    assert first.mine and first.record["failure_node"] == "b-1" and first.decision.code is None
    assert first.record["next_attempt"] == 1 and first.record["rdzv_id"] == f"{RUN}-a1"
    assert not b.settle(0, Policy()).mine  # the first verdict is followed
    second = b.settle(1, Policy())  # the history of attempt 0 comes from its verdict: a repeat
    assert second.mine and second.decision.code == 10 and second.failure.klass == "deterministic"


def test_a_running_attempt_stops_for_a_peers_end_but_not_for_a_finish():
    storage = open_storage(f"memory://peer-{random.getrandbits(32):08x}")
    from ckptstore.supervisor.classify import Verdict

    a, b = (consensus.Shared(storage, RUN, n) for n in ("a-0", "b-1"))
    a.join(0), b.join(0)
    assert a.interrupted(0) is None
    a.report(0, Verdict("transient", "rank 0 was killed by SIGKILL", signal="SIGKILL"), False, None)
    assert a.interrupted(0) is None and b.interrupted(0) == "attempt 0 ended on node a-0"
    a.join(1), b.join(1)
    assert a.decree(1, "finish", 0, "finished", "the script finished").mine
    assert b.interrupted(1) is None  # its ranks finish too


# ------------------------------------------------------------------ hostile or stale shared records (issue b35)
def _mem(name: str):
    return open_storage(f"memory://{name}-{random.getrandbits(32):08x}")


class _CountingStorage:
    """A storage that counts gets (reads) by leaf name."""

    def __init__(self, inner):
        self.inner, self.gets = inner, {}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def read(self, key, *a, **k):
        self.gets[key] = self.gets.get(key, 0) + 1
        return self.inner.read(key, *a, **k)


def _relaunches(storage, n: int):
    from ckptstore.supervisor.classify import Verdict
    from ckptstore.supervisor.decide import Policy

    a = consensus.Shared(storage, RUN, "a-0", wait_s=0)
    for k in range(n):
        a.join(k)
        a.report(k, Verdict("transient", f"rank 0 was killed by SIGKILL ({k})", signal="SIGKILL"), True, k)
        assert a.settle(k, Policy(max_restarts_per_hour=None, max_restarts=10**6)).decision.code is None


def test_a_far_future_attempt_directory_is_ignored_and_history_is_replayed_once():
    from ckptstore.supervisor.classify import Verdict
    from ckptstore.supervisor.decide import Policy

    storage = _mem("future")
    _relaunches(storage, 3)
    ghost = f"{consensus.attempt_dir(RUN, 9999999000)}/member-ghost.json"
    storage.put(ghost, json.dumps({"run": RUN, "attempt": 9999999000, "node": "ghost", "t": 1.0}).encode())
    counting = _CountingStorage(storage)
    b = consensus.Shared(counting, RUN, "b-1", wait_s=0, sleep=lambda s: None)
    assert b.start() == (3, None) and b.latest() == 3  # the chain of verdicts, not the highest number
    policy = Policy(max_restarts_per_hour=None, max_restarts=10**6)
    for k in range(3, 6):  # every failure reads each earlier verdict at most once
        b.join(k)
        b.report(k, Verdict("transient", "rank 0 was killed by SIGKILL", signal="SIGKILL"), True, k)
        assert b.settle(k, policy).decision.code is None
    verdict_reads = {k: c for k, c in counting.gets.items() if k.endswith(consensus.VERDICT_LEAF)}
    assert len(verdict_reads) == 6 and max(verdict_reads.values()) <= 4, verdict_reads  # (reads before written)
    assert all(verdict_reads[f"{consensus.attempt_dir(RUN, k)}/verdict.json"] == 1 for k in range(3)), verdict_reads
    stops = []
    h = consensus.Shared(storage, RUN, "c-2").history(policy, 6, stopped=lambda: stops.append(1) or True)
    assert h.failures == [] and stops  # a stop ends the replay


def test_an_attempt_whose_nodes_are_gone_is_abandoned_after_a_bound():
    clock = [1000.0]

    def sleep(s):
        clock[0] += s
    storage = _mem("gone")
    consensus.Shared(storage, RUN, "old-0", clock=lambda: clock[0]).join(0)  # SIGKILLed: no report, no verdict
    clock[0] += 5000
    new = consensus.Shared(storage, RUN, "new-0", clock=lambda: clock[0], sleep=sleep)
    assert new.start(lambda n: 60, abandon_s=100) == (1, None)
    assert 5100 <= clock[0] - 1000 <= 5110
    v = new.verdict(0)
    assert (v["action"], v["class"], v["node"]) == ("relaunch", "abandoned", "new-0")
    other = consensus.Shared(storage, RUN, "new-1", clock=lambda: clock[0], sleep=sleep)
    assert other.start(lambda n: 60, abandon_s=100) == (1, None)  # follows the written abandonment


def test_a_garbage_verdict_is_superseded_and_a_finish_is_journaled_by_its_writer():
    from ckptstore.supervisor.decide import Policy

    clock = [1000.0]

    def sleep(s):
        clock[0] += s
    storage = _mem("garbage")
    a = consensus.Shared(storage, RUN, "a-0", clock=lambda: clock[0], sleep=sleep)
    a.join(0)
    storage.put(f"{consensus.attempt_dir(RUN, 0)}/verdict.json", b"{not json")
    assert a.verdict(0) is None
    settled = a.decree(0, "finish", 0, "finished", "the script finished")
    assert settled.mine and settled.record["node"] == "a-0"  # so this node journals `finish`
    assert a.verdict(0)["action"] == "finish"
    storage2 = _mem("garbage2")
    b = consensus.Shared(storage2, RUN, "b-0", clock=lambda: clock[0], sleep=sleep)
    b.join(0)
    storage2.put(f"{consensus.attempt_dir(RUN, 0)}/verdict.json", json.dumps(
        {"action": "give_up", "code": "x", "class": "deterministic"}).encode())
    assert b.start(lambda n: 60, abandon_s=50) == (1, None)  # an invalid verdict: waited for, then superseded
    assert b.verdict(0)["class"] == "abandoned"
    for bad in ({"action": "relaunch", "backoff_s": 1e400}, {"action": "give_up", "code": 143.5},
                {"action": "give_up", "code": 99}, {"action": "explode"}, {"action": "finish", "code": 10}):
        assert not consensus.valid_verdict(bad), bad
    rec = {"action": "relaunch", "class": "transient", "reason": "x", "backoff_s": 1e300, "code": None}
    assert consensus.valid_verdict(rec)
    assert b.settled_from(rec, False).decision.backoff_s == Policy().backoff_max_s


def test_a_verdict_of_a_thousand_nodes_fits_and_reports_are_read_once():
    from ckptstore.supervisor.classify import Verdict
    from ckptstore.supervisor.decide import Policy

    storage = _mem("scale")
    n = 1000
    names = [f"gpu-node-{i:04d}.cluster.example.com-{i % 8}" for i in range(n)]
    for i, node in enumerate(names):
        s = consensus.Shared(storage, RUN, node, wait_s=0)
        s.join(0)
        v = Verdict("transient", "stopped: peer " + "x" * 400 if i else "rank 3 was killed by SIGKILL", signal=None if i
                    else "SIGKILL")
        v.evidence["peer"] = bool(i)
        s.report(0, v, False, None)
    s = consensus.Shared(storage, RUN, "extra-0", wait_s=0)
    s.join(0)  # a member that never reports
    counting = _CountingStorage(storage)
    clock = [0.0]
    first = consensus.Shared(counting, RUN, names[0], wait_s=2, poll_s=0.5, clock=lambda: clock[0],
                             sleep=lambda t: clock.__setitem__(0, clock[0] + t))
    settled = first.settle(0, Policy())
    assert settled.mine and settled.record["nodes_reported"] == n
    assert len(settled.record["nodes"]) == consensus.NODE_LINES and names[0] in settled.record["nodes"]
    assert settled.record["node_classes"] == {"transient": n} and settled.record["unreported_count"] == 1
    reads = {k: c for k, c in counting.gets.items() if "/report-" in k}
    assert len(reads) == n and max(reads.values()) == 1  # four polls, each report read once


def test_a_stray_report_file_interrupts_nobody():
    from ckptstore.supervisor.classify import Verdict

    storage = _mem("stray")
    a, b = (consensus.Shared(storage, RUN, n) for n in ("a-0", "b-1"))
    a.join(0), b.join(0)
    storage.put(f"{consensus.attempt_dir(RUN, 0)}/report-x.json", b"junk")
    storage.put(f"{consensus.attempt_dir(RUN, 0)}/report-ghost.json", json.dumps(
        {"verdict": {"class": "transient"}}).encode())  # valid, but ghost launched nothing
    assert a.interrupted(0) is None and b.interrupted(0) is None
    a.report(0, Verdict("transient", "rank 0 was killed by SIGKILL", signal="SIGKILL"), False, None)
    assert b.interrupted(0) == "attempt 0 ended on node a-0"
    assert b.interrupted(0, in_job=True) is None


def test_the_multi_node_defaults_live_in_the_policy():
    from ckptstore.cli.run import _parser
    from ckptstore.supervisor.decide import Policy

    defaults = _parser().parse_args(["--store", "x"])
    assert (defaults.join_timeout, defaults.decision_wait) == (Policy().join_timeout_s, Policy().decision_wait_s)
    assert defaults.heartbeat_timeout == Policy().heartbeat_timeout_s
    assert runner.JOIN_TIMEOUT_S == Policy().join_timeout_s and consensus.WAIT_S == Policy().decision_wait_s
    sup = runner.Supervisor(f"memory://pol-{random.getrandbits(32):08x}", ["x.py"], Policy(join_timeout_s=7.0),
                            run_id=RUN, nnodes=2, node_rank=0, decision_wait_s=3.0)
    assert (sup.join_timeout_s, sup.shared.wait_s, sup.policy.decision_wait_s) == (7.0, 3.0, 3.0)



def test_a_supervisor_that_stopped_beating_is_not_waited_for_and_stops_a_running_attempt():
    from ckptstore.supervisor.classify import Verdict
    from ckptstore.supervisor.decide import Policy

    mono, waits = [0.0], []
    policy = Policy(heartbeat_s=1.0, heartbeat_timeout_s=4.0)
    storage = _mem("beats")

    def sleep(s):  # a's beating thread goes on while it waits
        waits.append(s)
        mono[0] += s
        a.beats.beat()
    a, b = (consensus.Shared(storage, RUN, n, wait_s=30, sleep=sleep, policy=policy, monotonic=lambda: mono[0])
            for n in ("a-0", "b-1"))
    a.beats.beat(), b.beats.beat()
    a.join(0), b.join(0)
    assert a.interrupted(0) is None  # a's first look: both beat
    for _ in range(3):  # b beats no more (its supervisor was SIGKILLed, or froze): quiet for 3 s < 4 s
        mono[0] += 1.0
        a.beats.beat()
        assert a.interrupted(0) is None
    mono[0] += 1.5
    a.beats.beat()
    why = a.interrupted(0)
    assert why is not None and why.startswith("node b-1's supervisor stopped beating at 20"), why
    # in-job, a lost node's ranks are taken by spares inside the attempt: only a verdict stops it
    assert a.interrupted(0, in_job=True) is None
    a.report(0, Verdict("transient", f"stopped: {why}"), False, None)
    settled = a.settle(0, policy)
    assert waits == [] and settled.mine, waits  # no wait for a report that will never come
    assert settled.record["stopped_beating"] == ["b-1"] and settled.record["unreported"] == ["b-1"]
    assert "decided without node b-1's supervisor stopped beating at" in settled.failure.reason
    b.beats.beat()  # b restarted: beating again, it is waited for
    mono[0] += 1.0
    a.beats.beat()
    a.join(1), b.join(1)
    assert a.interrupted(1) is None and a.beats.stopped({"b-1"}) == {}
    mono[0] += 10.0  # a's own beat no longer shows (the store is not showing beats): nobody is judged
    assert a.beats.stopped({"b-1"}) == {}
    off = consensus.Shared(storage, RUN, "c-2", policy=Policy(heartbeat_timeout_s=0), monotonic=lambda: mono[0])
    mono[0] += 100.0
    off.beats.beat()
    assert off.beats.stopped({"b-1"}) == {}  # --heartbeat-timeout 0: off
    assert (Policy().heartbeat_s, Policy().heartbeat_timeout_s) == (5.0, 20.0)
    assert consensus.Shared(storage, RUN, "d-3", policy=Policy(heartbeat_timeout_s=8)).beats.beat_s == 2.0


def test_the_leader_alone_alerts_once_per_straggler_of_any_node():
    """One rank per node: no node sees a straggler among its own ranks. Each node
    publishes its ranks' step times in its heartbeat; the leader (the lowest-named live
    node) judges every node's together and alerts once for node b-1's slow rank; b-1,
    not the leader, alerts nothing; a node's step times are taken once per publication."""
    from ckptstore.supervisor.decide import Policy
    from ckptstore.supervisor.stragglers import Tracker

    mono = [0.0]
    policy = Policy(heartbeat_s=1.0, heartbeat_timeout_s=4.0)
    storage = _mem("stragglers")
    a, b = (consensus.Shared(storage, RUN, n, policy=policy, monotonic=lambda: mono[0]) for n in ("a-0", "b-1"))
    trackers, alerts = {"a-0": Tracker(), "b-1": Tracker()}, {"a-0": [], "b-1": []}
    a.beats.beat()
    for k in range(5):
        mono[0] += 1.0
        for node, ranks in ((b, {1: 3.0}), (a, {0: 1.0})):
            for host, rs in node.beats.cross_node(0, ranks):
                alerts[node.node] += trackers[node.node].update(0, rs, host, f"t{k}")
    assert alerts["b-1"] == []
    assert [(s.rank, s.reports, round(s.ratio, 1)) for s in alerts["a-0"]] == [(1, 3, 3.0)], alerts
    assert a.beats.cross_node(0, {0: 1.0}) == [(socket.gethostname(), {0: 1.0})]  # b-1 published nothing new
    mono[0] += 10.0  # a-0 stopped beating (its supervisor is gone): once b-1 saw it quiet, b-1 leads
    b.beats.refresh()  # (a-0's last beat, new to b-1: quiet from now on, as b-1 watches it)
    mono[0] += 10.0
    assert [rs for _, rs in b.beats.cross_node(0, {1: 3.0})] == [{1: 3.0}]


def test_a_restarted_node_reports_the_attempt_it_launched_lost_and_joins_the_next():
    """A node whose previous supervisor launched attempt 0 restarts while attempt 0 has no
    verdict: it does not join attempt 0 again (torch would restart the other nodes'
    workers in place for the newcomer), reports attempt 0 lost, which stops the other
    node's attempt at once, and joins attempt 1 after the verdict; alone in its attempt,
    it abandons it after twice the decision wait."""
    from ckptstore.supervisor.decide import Policy

    clock = [1000.0]
    storage = _mem("restarted")
    a = consensus.Shared(storage, RUN, "a-0", clock=lambda: clock[0], wait_s=5)
    a.join(0)
    consensus.Shared(storage, RUN, "b-1", clock=lambda: clock[0]).join(0)  # b-1's first supervisor

    def sleep(s):  # a-0 sees b-1's report within its poll, and decides
        clock[0] += s
        assert a.interrupted(0) == "attempt 0 ended on node b-1"
        a.report(0, consensus.verdict_from({"class": "transient", "reason": "rank 0: gloo: Connection reset"}),
                  False, None)
        assert a.settle(0, Policy()).mine
    b = consensus.Shared(storage, RUN, "b-1", clock=lambda: clock[0], sleep=sleep, wait_s=5)
    lines = []
    assert b.start(lambda n: 600, say=lines.append) == (1, None)
    assert "restarted" in b.reports(0)["b-1"]["verdict"]["reason"] and "reported it lost" in lines[0]
    assert a.verdict(0)["nodes_reported"] == 2 and a.verdict(0)["unreported"] == []
    lone = _mem("restarted-alone")
    consensus.Shared(lone, RUN, "c-0", clock=lambda: clock[0]).join(0)

    def tick(s):
        clock[0] += s
    c = consensus.Shared(lone, RUN, "c-0", clock=lambda: clock[0], sleep=tick, wait_s=5)
    start = clock[0]
    assert c.start(lambda n: 600) == (1, None) and c.verdict(0)["class"] == "abandoned"
    assert 10 <= clock[0] - start <= 15


def test_a_relaunch_bounds_its_wait_for_the_rendezvous_store_and_an_unreachable_one_is_a_missing_node():
    from types import SimpleNamespace

    from ckptstore.supervisor import launch
    from ckptstore.supervisor.classify import classify

    args = SimpleNamespace(rdzv_id="x", rdzv_conf="is_host=0")
    launch.rendezvous(args, {launch.ENV_RDZV_ID: "nodes-a1", launch.ENV_JOIN_TIMEOUT: "7.5"})
    assert (args.rdzv_id, args.rdzv_conf) == ("nodes-a1", "is_host=0,join_timeout=7.5,read_timeout=8")
    own = SimpleNamespace(rdzv_id="x", rdzv_conf="read_timeout=30")
    launch.rendezvous(own, {launch.ENV_JOIN_TIMEOUT: "5"})
    assert own.rdzv_conf == "read_timeout=30,join_timeout=5"  # the user's own is kept
    first = SimpleNamespace(rdzv_id="x", rdzv_conf="")
    launch.rendezvous(first, {launch.ENV_RDZV_ID: "nodes-a0"})  # the first attempt keeps torch's timeouts
    assert first.rdzv_conf == ""
    result = {"ok": False, "failures": {}, "rendezvous_unreachable": "h0:29400",
              "launcher_error": "RendezvousConnectionError: The connection to the C10d store has failed."}
    lost = classify(result, None, relaunched=True)
    assert lost.evidence.get("nodes_missing") and "rendezvous endpoint h0:29400 did not answer" in lost.reason
    assert not classify(result, None, relaunched=False).evidence.get("nodes_missing")  # nodes may start apart
    assert not classify(result, 12, relaunched=True).evidence.get("nodes_missing")  # the store died mid-run
