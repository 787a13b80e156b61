"""``ckptstore run --in-job`` on several nodes (issue 36; docs/design/in-job-restart.md,
sections 5.1 and 9): simulated nodes on one machine, one ``ckptstore run`` each
(``--nnodes 2 --node-rank K``, c10d rendezvous on 127.0.0.1, one rank and one spare per
node, one store), over tests/procs/injob_fake_worker.py (it all-reduces ``step + 1``
every step: the final total shows a step lost or counted twice).

- a rank on node 1 SIGKILLed: node 1's agent reports it, the leader (node 0) gives the
  rank to node 1's own spare, in the same attempt; one ``recovery`` journaled, once;
- node 1's whole supervisor tree SIGKILLed: node 0's rank's collective fails, node 1's
  agent's port refuses the leader's probe, the leader counts its rank failed at once (not
  after the beat timeout) and gives it to node 0's spare, in the same attempt; node 1's
  agent alone killed with the fast rules off: the beat timeout decides;
- the leader's evidence rules (injob_nodes.BeatWatch) in one process: a refused port, a
  silent node that does not answer, and a live agent (never lost before the beat timeout);
- node 0's (the leader's, the in-job store's host) tree SIGKILLed and restarted: node 1
  loses the store, ends its workers ("in-job store lost"), and both nodes relaunch cold
  through the run's shared verdict;
- node 1 lost whole and restarted while attempt 0 runs: it rejoins the attempt as a
  node of spares (``node_rejoined``), and the next failure of rank 1 (held on node 0)
  goes to its spare; node 0 gone too: the restarted node 1 cannot rejoin, says why and
  takes today's path; a returning agent refuses another run's attempt and an ended one.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import psutil

from ckptstore.storage import open_storage
from ckptstore.supervisor import runner
from ckptstore.supervisor.journal import Journal

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from jobutil import Job  # noqa: E402
from test_supervisor_nodes import Nodes as _Nodes, free_port  # noqa: E402 (its kill_node, restart, finish)

WORKER = Path(__file__).resolve().parent / "procs" / "injob_fake_worker.py"
RUN = "injob-nodes"
STEPS = 20
TOTAL = 2 * sum(range(1, STEPS + 1))  # 2 ranks all-reduce step + 1 at every step


class InJobNodes(_Nodes):
    """Two nodes of one in-job run, one rank and ``--spares 1`` each."""

    def __init__(self, tmp: Path, *opts, fault: str = "none:-1"):
        port = free_port()
        self.store, self.tmp, self.final = tmp / "store", tmp, tmp / "final.json"
        (tmp / "work").mkdir()
        self.jobs, self.cmds, self.envs = [], [], []
        for k in range(2):
            self.cmds.append(
                [sys.executable, "-m", "ckptstore.cli", "run", "--nnodes", "2", "--node-rank", str(k),
                 "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                 "--store", str(self.store), "--run-id", RUN, "--backoff", "0.05", "--decision-wait", "10",
                 "--join-timeout", "30", "--health-interval", "0", "--straggler-report", "0",
                 "--in-job", "--spares", "1", "--memory-dir", str(tmp / "mem"), "--reform-timeout", "30", *opts,
                 str(WORKER), str(tmp / "work"), "--steps", str(STEPS), "--step-delay", "0.05",
                 "--final", str(self.final)])
            self.envs.append({"FAULT": fault})
            self.jobs.append(Job(self.cmds[k], env=self.envs[k]))

    def events(self, kind: str | None = None) -> list[dict]:
        events = Journal(open_storage(str(self.store)), RUN).events()
        return [e for e in events if kind is None or e["kind"] == kind]

    def total(self) -> float:
        return json.loads(self.final.read_text())["total"]


def test_a_rank_killed_on_node_1_is_replaced_by_node_1s_spare_within_the_attempt(tmp_path):
    nodes = InJobNodes(tmp_path)
    nodes.jobs[1].at_step(1, 8)
    os.kill(nodes.jobs[1].pids[1], 9)
    assert nodes.finish() == [runner.EXIT_FINISHED] * 2, nodes.output()
    assert nodes.total() == TOTAL  # no step lost or counted twice across the recovery
    assert sorted(e["attempt"] for e in nodes.events("attempt_start")) == [0, 0], \
        (nodes.events("failure"), nodes.output())
    assert nodes.events("failure") == []
    [rec] = nodes.events("recovery")  # journaled once, by the leader's node, not once per node
    assert (rec["attempt"], rec["round"], rec["ranks"], rec["signal"], rec["node"]) == (0, 1, [1], "SIGKILL", 1)
    assert rec["detected_by"] in ("agent:exit", "rank:collective"), rec  # whichever saw it first
    assert rec["node_lost"] == {}, rec  # node 1 lives (its agent answers): a rank's fault, not a node's
    assert [(k, s["node"], s["worker"].startswith("n1-")) for k, s in rec["spares"].items()] == [("1", 1, True)]


def test_node_1_lost_whole_is_replaced_by_node_0s_spare_decided_by_its_refused_port(tmp_path):
    nodes = InJobNodes(tmp_path)
    lost = nodes.jobs[1]
    lost.at_step(1, 8)
    nodes.kill_node(1)
    assert lost.finish() == -9
    assert nodes.jobs[0].finish() == runner.EXIT_FINISHED, nodes.output()
    assert nodes.total() == TOTAL
    assert sorted(e["attempt"] for e in nodes.events("attempt_start")) == [0, 0]
    assert nodes.events("failure") == []
    [rec] = nodes.events("recovery")
    assert (rec["attempt"], rec["round"], rec["ranks"], rec["node"]) == (0, 1, [1], 1), rec
    # its ranks' collectives failed at once, then its agent's port refused: no beat timeout waited out
    assert rec["node_lost"]["1"]["decided_by"] == "refused", rec
    assert rec["node_lost"]["1"]["silent_s"] < 3.0, rec
    assert "node 1 lost: a rank's collective failed and its agent's port refused" in rec["reason"], rec
    assert [(k, s["node"], s["worker"].startswith("n0-")) for k, s in rec["spares"].items()] == [("1", 0, True)]


def test_node_1s_agent_killed_its_supervisor_alive_the_leader_recovers_and_node_1_follows(tmp_path):
    """Node 1's agent alone SIGKILLed: its workers die with it (PDEATHSIG), its beat
    stops, node 0's spare takes rank 1; node 1's supervisor does not relaunch everyone:
    it waits for the run's verdict on the attempt, which node 0 writes when it finishes.
    The fast rules off (``--node-fault-silent 0``): the beat timeout alone decides."""
    nodes = InJobNodes(tmp_path, "--node-fault-silent", "0")
    nodes.jobs[1].at_step(1, 8)
    [agent] = [p for p in psutil.Process(nodes.jobs[1].proc.pid).children()
               if "ckptstore.supervisor.agent" in " ".join(p.cmdline())]
    agent.kill()
    assert nodes.finish() == [runner.EXIT_FINISHED] * 2, nodes.output()
    assert nodes.total() == TOTAL
    assert sorted(e["attempt"] for e in nodes.events("attempt_start")) == [0, 0]
    assert nodes.events("failure") == []
    [rec] = nodes.events("recovery")
    assert (rec["ranks"], rec["node"], [s["node"] for s in rec["spares"].values()]) == ([1], 1, [0]), rec
    assert rec["node_lost"]["1"]["decided_by"] == "beat", rec
    assert "node 1 lost: its agent's beat stood still for 3s" in rec["reason"], rec
    assert "the leader (node 0) recovers without this node" in nodes.jobs[1].output()


def test_the_leaders_node_lost_sends_every_node_cold_and_the_run_finishes(tmp_path):
    nodes = InJobNodes(tmp_path)
    lost = nodes.jobs[0]
    nodes.jobs[1].at_step(1, 8)
    nodes.kill_node(0)
    nodes.restart(0)
    assert lost.finish() == -9
    assert nodes.finish() == [runner.EXIT_FINISHED] * 2, nodes.output()
    assert nodes.total() == TOTAL
    assert nodes.events("recovery") == []
    failures = nodes.events("failure")
    assert failures and failures[0]["attempt"] == 0 and failures[0]["class"] == "transient", failures
    assert "in-job store lost" in failures[0]["reason"], failures
    # (the restarted node 0 may first join attempt 0, still open for it, until node 1's end of it)
    started = sorted(e["attempt"] for e in nodes.events("attempt_start") if e["attempt"] > 0)
    assert started == sorted(list(range(1, len(failures) + 1)) * 2), started  # both nodes in every relaunch


def test_spares_are_chosen_on_the_ranks_node_then_its_partner_then_anywhere(tmp_path):
    from types import SimpleNamespace

    from ckptstore.supervisor.agent import Conf, InJobAgent, Worker
    from ckptstore.supervisor.injob_nodes import advertised_host

    args = SimpleNamespace(nproc_per_node=2, nnodes="4", node_rank=0)
    agent = InJobAgent(args, Conf(), str(tmp_path / "result.json"), str(tmp_path / "events.jsonl"), env={})
    spare = {name: Worker(name, None, "", spare=True, started_t=t, node=node)
             for name, node, t in [("on-0", 0, 1.0), ("on-2", 2, 2.0), ("on-3-old", 3, 0.5), ("on-3", 3, 3.0)]}
    # rank 5 lives on node 2 (2 ranks a node): its own node; rank 3 on node 1: its partner, node 2
    assert {k: w.wid for k, w in agent._choose([5], list(spare.values())).items()} == {5: "on-2"}
    assert {k: w.wid for k, w in agent._choose([3], [spare["on-0"], spare["on-2"]]).items()} == {3: "on-2"}
    # rank 1 on node 0 and rank 7 on node 3 (partner node 0): own nodes first, then the longest warm
    chosen = agent._choose([1, 7, 2], [spare["on-3"], spare["on-0"], spare["on-3-old"]])
    assert {k: w.wid for k, w in chosen.items()} == {1: "on-0", 7: "on-3-old", 2: "on-3"}
    assert advertised_host("127.0.0.1") == advertised_host("localhost") == "127.0.0.1"


def test_a_node_is_lost_sooner_only_with_a_fault_and_corroborating_evidence():
    """BeatWatch over a HashStore, three silent nodes (none ever beats): node 1's agent
    port was open, then closed (refused); node 2's agent lives (its port accepts); node 3
    has no port to probe. Without a fault notice nobody is lost before the beat timeout;
    with one, node 1 goes on its refusal and node 3 after the short silence, and node 2,
    as silent as node 3, stays: only the beat timeout may count a live agent lost."""
    import time

    from torch.distributed import HashStore

    from ckptstore.supervisor.injob_nodes import AliveListener, BeatWatch

    dead, live = AliveListener("127.0.0.1"), AliveListener("127.0.0.1")
    addresses = {1: dead.address, 2: live.address}
    watch = BeatWatch(HashStore(), [1, 2, 3], silent_s=60.0, fault_silent_s=0.2, probe_timeout_s=5.0)
    for k, address in addresses.items():  # (the first probe of each, as the agent's _sync_nodes)
        watch.prober.start(k, address)
    deadline = time.monotonic() + 30.0
    while watch.prober.trusted != {1, 2} and time.monotonic() < deadline:
        watch.silent(False, addresses)
    assert watch.prober.trusted == {1, 2}  # both ports accepted once: their refusals count
    dead.close()
    lost: dict[int, str] = {}
    for k, by, _ in watch.silent(False, addresses):  # no fault: the beat timeout alone
        lost[k] = by
    assert lost == {}
    while 3 not in lost and time.monotonic() < deadline:
        lost.update({k: by for k, by, _ in watch.silent(True, addresses)})
    assert lost == {1: "refused", 3: "fault+silence"}, lost
    assert 2 in watch.seen  # as silent as node 3, but its agent answers
    live.close()


def _journaled(nodes: InJobNodes, kind: str) -> list[dict]:
    """The run's ``kind`` events once there is one (a bounded poll of the store)."""
    import time

    from jobutil import HANG_GUARD_S

    deadline = time.monotonic() + HANG_GUARD_S
    while not nodes.events(kind):
        assert time.monotonic() < deadline and nodes.jobs[0].proc.poll() is None, (kind, nodes.output())
        time.sleep(0.05)
    return nodes.events(kind)


def test_node_1_restarted_rejoins_the_running_attempt_as_spares_and_its_spare_takes_the_next_fault(tmp_path):
    """Node 1 lost whole: node 0's spare takes rank 1 (round 1) and holds at step 12
    (``hold:12:1``) while node 1's supervisor is restarted; it finds attempt 0 running
    (node 0's in-job store in the run's shared records), joins it as a node of spares
    (``node_rejoined``); then node 0's process holding rank 1 is SIGKILLed and rank 1
    goes home: to the returned node 1's spare, in the same attempt."""
    nodes = InJobNodes(tmp_path, "--reform-timeout", "60", fault="hold:12:1")
    nodes.jobs[1].at_step(1, 4)
    nodes.kill_node(1)
    assert nodes.jobs[1].finish() == -9
    nodes.restart(1)
    [rejoined] = _journaled(nodes, "node_rejoined")
    assert (rejoined["attempt"], rejoined["node"], rejoined["round"], rejoined["join"]) == (0, 1, 1, 1), rejoined
    assert [w.startswith("n1-r1-") for w in rejoined["spares"]] == [True], rejoined
    nodes.jobs[0].at_step(1, 11)  # node 0's spare holds rank 1, waiting at step 12
    os.kill(nodes.jobs[0].pids[1], 9)
    assert nodes.finish() == [runner.EXIT_FINISHED] * 2, nodes.output()
    assert nodes.total() == TOTAL  # no step lost or counted twice across both recoveries
    assert sorted(e["attempt"] for e in nodes.events("attempt_start")) == [0, 0]  # no relaunch, no new attempt
    assert nodes.events("failure") == []
    lost, home = nodes.events("recovery")
    assert (lost["round"], lost["ranks"], [s["node"] for s in lost["spares"].values()]) == (1, [1], [0]), lost
    assert (home["attempt"], home["round"], home["ranks"], home["node"]) == (0, 2, [1], 0), home
    assert [(s["node"], s["worker"]) for s in home["spares"].values()] == [(1, rejoined["spares"][0])], home
    assert "rejoining it as a node of spares" in nodes.jobs[1].output()
    assert f"rank 1: step {STEPS - 1} " in nodes.jobs[1].output()  # rank 1 trained to the end on node 1
    from test_supervisor_injob import status

    st = json.loads(status(nodes.store, "--json"))
    assert (st["recoveries"]["count"], st["recoveries"]["nodes_rejoined"]) == (2, 1), st["recoveries"]
    assert "2 recoveries" in status(nodes.store) and "1 node(s) rejoined as spares" in status(nodes.store)


def test_a_restarted_node_that_cannot_rejoin_the_attempt_waits_for_the_next_one(tmp_path):
    """Both nodes lost while attempt 0 has no verdict: node 1, restarted, finds node 0's
    published in-job store but nothing answers there; it says why and falls back to
    today's path: it reports attempt 0 lost (to join the next one)."""
    import time

    from jobutil import HANG_GUARD_S

    from ckptstore.supervisor.injob_nodes import published_store

    nodes = InJobNodes(tmp_path, "--decision-wait", "2", fault="hold:10:0")
    nodes.jobs[1].at_step(1, 9)  # rank 1 holds at step 10: the attempt runs until the kills
    deadline = time.monotonic() + HANG_GUARD_S
    while published_store(open_storage(str(nodes.store)), RUN, 0) is None:
        assert time.monotonic() < deadline, nodes.output()
        time.sleep(0.05)
    nodes.kill_node(1)
    nodes.kill_node(0)
    assert [job.finish() for job in nodes.jobs] == [-9, -9]
    back = nodes.restart(1)
    line = back.expect(lambda line: "could not rejoin attempt 0: " in line, "the rejoin's fallback")
    assert "node 0's in-job store at 127.0.0.1:" in line and "does not answer" in line, line
    back.expect(lambda line: "this node launched attempt 0 before it restarted: reported it lost" in line,
                "today's path")
    nodes.kill_node(1)
    assert back.finish() == -9
    assert nodes.events("node_rejoined") == []


def test_a_returning_agent_joins_neither_another_runs_attempt_nor_an_ended_one(tmp_path):
    """The agent's own checks of the store it was given (in one process): a store that
    holds another run's attempt, then this run's attempt once it ended: refused each
    time (RESULT.json ``rejoin_failed``), and nothing written into the attempt."""
    from datetime import timedelta
    from types import SimpleNamespace

    from torch.distributed import TCPStore

    from ckptstore.supervisor import injob
    from ckptstore.supervisor.agent import Conf, InJobAgent
    from ckptstore.supervisor.injob_nodes import rejoin_key

    base = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    address = f"127.0.0.1:{base.port}"

    def attempt(run: str):
        store = injob.attempt_store(base, injob.attempt_prefix(run, 0))
        injob.set_fence(store, 0)
        injob.put(store, injob.agent_key(0), {"host": "node-0"})
        return store

    def rejoin() -> str:
        args = SimpleNamespace(nproc_per_node=1, nnodes="2", node_rank=1)
        agent = InJobAgent(args, Conf(run="mine", attempt=0, rejoin=address, spares=1),
                           str(tmp_path / "result.json"), str(tmp_path / "events.jsonl"), env={})
        assert agent.run() == 1
        return json.loads((tmp_path / "result.json").read_text())["rejoin_failed"]

    attempt("another-run")
    assert rejoin() == f"the store at {address} holds no in-job attempt 0 of run mine"
    mine = attempt("mine")
    injob.end(mine, "finished")
    assert rejoin() == "attempt 0 ended (finished)"
    assert not mine.check([rejoin_key(1, "n")]) and not mine.check([rejoin_key(1)])
