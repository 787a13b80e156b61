"""A lost node restores from its partner's memory (issue 36: "a lost node restores with
no byte read from the durable store"): ``ckptstore run --in-job`` on two simulated nodes
(one machine, c10d rendezvous on 127.0.0.1, one rank and one spare per node, a memory
directory per node, one store on local disk), over the docs example through
``ckptstore.inprocess.run`` (tests/procs/supervised_train.py).

Each node's agent runs a replica server; node k's ranks copy each memory commit to
node (k+1) mod 2's. Node 1's whole supervisor tree is SIGKILLed once rank 1's replica
of a step is sealed on node 0: node 0's spare takes rank 1 in the same attempt and
restores it from the replica in node 0's memory (tier ``peer``), rank 0 from its own
(``memory``), and node 0 finishes alone, bit-identical to the uninterrupted run.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from ckptstore.storage import open_storage
from ckptstore.supervisor import runner
from ckptstore.supervisor.journal import Journal

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from jobutil import HANG_GUARD_S, Job, assert_bit_identical  # noqa: E402
from test_supervisor import SCRIPT, STEPS, reference  # noqa: E402,F401
from test_supervisor_nodes import Nodes as _Nodes, free_port  # noqa: E402 (its kill_node, finish, output)

RUN = "injob-example-nodes"


class ExampleNodes(_Nodes):
    """Two nodes of one in-job run of the example, one rank and ``--spares 1`` each."""

    def __init__(self, tmp: Path):
        port = free_port()
        self.store, self.tmp, self.final = tmp / "store", tmp, tmp / "final.pt"
        self.mem = [tmp / f"mem{k}" for k in range(2)]
        self.alerts = []
        self.jobs, self.cmds, self.envs = [], [], []
        for k in range(2):
            self.cmds.append(
                [sys.executable, "-m", "ckptstore.cli", "run", "--nnodes", "2", "--node-rank", str(k),
                 "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                 "--store", str(self.store), "--run-id", RUN, "--backoff", "0.05", "--decision-wait", "10",
                 "--join-timeout", "30", "--health-interval", "0", "--straggler-report", "0",
                 "--in-job", "--spares", "1", "--memory-dir", str(self.mem[k]), "--reform-timeout", "30",
                 # (a step delay: node 1 is lost mid-run; it changes no state)
                 str(SCRIPT), str(self.store), "--steps", str(STEPS), "--every", "5", "--step-delay", "0.2",
                 "--final", str(self.final)])
            self.envs.append({})
            self.jobs.append(Job(self.cmds[k], env=self.envs[k]))

    def events(self, kind: str | None = None) -> list[dict]:
        events = Journal(open_storage(str(self.store)), RUN).events()
        return [e for e in events if kind is None or e["kind"] == kind]

    def sealed_replicas(self, node: int, rank: int) -> list[int]:
        """The steps whose replica of ``rank``'s files node ``node``'s server sealed."""
        out = []
        for marker in self.mem[node].rglob(f"replicas/step-*/r{rank:05d}.json"):
            try:
                found = json.loads(marker.read_text())
            except (OSError, ValueError):
                continue  # (replaced under us)
            if found.get("sealed") is True:
                out.append(int(found["step"]))
        return sorted(out)


def durable_steps(store: Path) -> list[int]:
    import ckptstore

    return ckptstore.Store(str(store)).committed_steps()


def test_a_lost_node_restores_from_its_partners_memory_and_node_0_finishes_alone(tmp_path, reference):
    nodes = ExampleNodes(tmp_path)
    lost = nodes.jobs[1]
    lost.expect(lambda l: l.startswith("rank 1: committed step "), "a memory commit on node 1")
    deadline = time.monotonic() + HANG_GUARD_S
    while not nodes.sealed_replicas(0, 1):  # rank 1's commit copied to node 0 (a bounded poll of files)
        assert time.monotonic() < deadline and lost.proc.poll() is None, nodes.output()
        time.sleep(0.02)
    replicated = nodes.sealed_replicas(0, 1)[-1]
    assert durable_steps(nodes.store) == [], "nothing durable yet: a restore can come from memory only"
    nodes.kill_node(1)
    assert lost.finish() == -9
    assert nodes.jobs[0].finish() == runner.EXIT_FINISHED, nodes.output()
    assert_bit_identical(nodes.final, reference)
    assert sorted(e["attempt"] for e in nodes.events("attempt_start")) == [0, 0]  # no cold relaunch
    assert nodes.events("failure") == []
    [rec] = nodes.events("recovery")
    assert (rec["attempt"], rec["round"], rec["ranks"], rec["node"]) == (0, 1, [1], 1), rec
    assert rec["detected_by"] in ("rank:collective", "agent:node"), rec
    assert [(k, s["node"]) for k, s in rec["spares"].items()] == [("1", 0)], rec
    assert rec["restore_from"] == {"memory": [0], "peer": [1]}, rec  # no rank read the durable store
    assert rec["restored_step"] >= replicated, rec
    resumed = [line for line in nodes.jobs[0].lines if line.startswith("rank 1: resumed at step")]
    assert resumed and "saved by 2 ranks" in resumed[-1], nodes.output()
    # the durable store held no checkpoint of this run until its end (the first promotion
    # would be the 10th save): the recovery read memory only; at the end the newest step
    # was promoted (Checkpointer.close: the memory tier is removed with the job)
    committed = [int(line.rsplit(" ", 1)[1]) for line in nodes.jobs[0].lines
                 if line.startswith("rank 0: committed step ")]
    assert durable_steps(nodes.store) == [committed[-1]]


def test_node_ks_replicas_go_where_the_leader_first_looks_for_a_spare_after_node_k(tmp_path):
    """Node k's workers replicate to ``partner_replica(k)``; with no spare on node k the
    leader takes one on that same node for node k's ranks."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from ckptstore.supervisor import injob
    from ckptstore.supervisor.agent import Conf, InJobAgent, Worker

    nnodes, store = 4, dist.HashStore()
    for node in range(nnodes):
        injob.post_replica_server(store, node, f"host{node}", 7000 + node)
    agent = InJobAgent(SimpleNamespace(nproc_per_node=2, nnodes=str(nnodes), node_rank=0), Conf(),
                       str(tmp_path / "result.json"), str(tmp_path / "events.jsonl"), env={})
    for k in range(nnodes):
        spares = [Worker(f"on-{j}", None, "", spare=True, started_t=float(j), node=j) for j in range(nnodes) if j != k]
        chosen = agent._choose([2 * k], spares)[2 * k]  # (rank 2k: node k's first)
        assert injob.partner_replica(store, k, nnodes, timeout_s=0) == f"host{chosen.node}:{7000 + chosen.node}"


def test_a_spare_holding_a_lost_nodes_rank_keeps_the_memory_tiers_records_in_the_in_job_store(tmp_path, monkeypatch):
    """Node 0's spare given rank 1 of two nodes has WORLD_SIZE == LOCAL_WORLD_SIZE (2):
    before, its memory tier took itself for one node's (records in its directory), found
    no commit of the survivors and restored nothing from memory."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from ckptstore.storage.c10d import C10dStorage
    from ckptstore.supervisor import injob
    from ckptstore.tiers import memory_place

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    for name, value in {injob.ENV_MEMORY_DIR: str(tmp_path / "mem"), injob.ENV_STORE: f"127.0.0.1:{server.port}",
                        injob.ENV_PREFIX: "ckptstore/r/0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                        "GROUP_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    assert memory_place("auto", None, None) == (str(tmp_path / "mem"), None)  # one node: records beside the files
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    assert isinstance(memory_place("auto", None, None)[1], C10dStorage)
