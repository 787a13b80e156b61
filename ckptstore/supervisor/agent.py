"""The node agent of an in-job attempt (docs/design/in-job-restart.md, sections 5.1
and 6): it replaces launch.py when ``ckptstore run --in-job`` runs, starts the node's
ranks and warm spares itself, and when a rank dies, replaces it with a spare while the
other ranks stay alive (a new *round* of the same attempt).

    python -c "<command()'s stub>" RESULT.json EVENTS.jsonl [torchrun options] SCRIPT [ARGS...]

The runner passes its in-job settings in ``CKPTSTORE_AGENT_CONF`` (JSON: run, attempt,
spares, abort/reform timeouts, rounds in a row, hang and first-progress timeouts, the
memory directory and budget). ``RESULT.json`` is launch.py's format (results.py), so
the runner classifies and relaunches as before; ``EVENTS.jsonl`` gets one JSON line per
in-job event (``recovery``, ``recovery_failed``, ``in_job_gave_up``, ``node_rejoined``),
which the runner journals as it reads them, and the leader's ``in_job_store`` (its
store's address, which node 0's runner publishes in the run's shared records).

A lost node restarted while its attempt still runs (``conf.rejoin``: that store's
address) joins it as a node of spares only (``_rejoin``; the leader's side:
``_admit_returned``); its ranks are not moved back (that would cost a recovery).

On one node (``--standalone`` or ``--nnodes 1``) the agent hosts the in-job TCPStore
itself (127.0.0.1, a free port) and is the leader. On several nodes (``--nnodes N``,
fixed) node 0's agent is the leader and hosts it, the others connect (the address is
agreed in the attempt's rendezvous: injob_nodes.py); node k runs global ranks
k*nproc .. k*nproc+nproc-1. Each agent publishes ``agent/<node>`` (members, live spares)
and beats; the others report their workers' ends (``exited/<worker>``, then the round's
fault for a dead rank), kill what the leader asks (``kill/<worker>``), adopt the
membership the leader posts and end on its verdicts (``stop``, ``cold``) or ``end``; the
leader counts a node whose beat stood still for ``--node-lost-timeout`` (3 s) lost, with
every rank on it (``agent:node``), sooner with a round's fault notice and corroborating
evidence (its agent's port refuses a connection, or a shorter silence and no answer:
injob_nodes.BeatWatch; the ``recovery`` event's ``node_lost`` names it), and picks
spares on the rank's node, then its partner node, then any. The leader's store lost -> the others end their workers (``launcher_error``:
"in-job store lost"): the runners relaunch cold. Each agent of several nodes runs a
replica server (replica.py) for its memory directory, and gives every worker the
address of its partner's (node (k+1) mod N, ``CKPTSTORE_PEER_REPLICA``): node k's
memory commits are copied there, where a spare for a lost node k's rank restores them
(peers.py; tier ``peer``). Workers start through
bootstrap.py (error files as under torchrun), each in a session of its own; spares at
nice 5. The loop looks at every child each :data:`TICK_S` (``Popen.poll``: one
``waitpid(WNOHANG)`` each).

The leader's side of a failed round r (a member died: its exit, or the agent killed it
for a hang):

1. ``round/<r>/fault`` with the dead rank (``agent:exit`` / ``agent:hang``);
2. the other members' ``left`` records, bounded by the reform timeout; a member that
   does not leave (or dies meanwhile) is killed and counted failed;
3. the dead rank's evidence (classify.classify_one): ``deterministic`` (a
   DeterministicError, or the same error at the same step as the previous in-job
   failure) -> verdict ``stop``, the attempt ends with that failure (the runner exits
   10); more than ``max_rounds_in_a_row`` recoveries without a new step, no warm spare
   within the reform timeout, a finished or in-job-unaware member (no ``hello``) ->
   ``cold`` (every worker killed; the runner relaunches as today);
4. otherwise a warm spare per failed rank (none when every member left: a rank's
   collective failed with every process alive; the same members re-form): ``assign``, ``round/<r+1>/members``,
   ``fence``, then verdict ``continue``; a replacement spare starts at once;
5. once every member's ``first`` mark of round r+1 is in, one ``recovery`` event with
   the durations measured from the keys' times.

Hangs (progress_watch.py over the ranks' progress files, ``--hang-timeout``): the agent
posts the round's fault notice (``agent:hang``); the ranks it wakes leave the round (a
rank blocked in a peer's collective, or hung in Python code, which the rank side
aborts), and those that do not leave within the abort timeout are killed and replaced
by spares. No culprit is guessed: the ranks that cannot leave are the hung ones (the
stack-dump rule of the design's section 8 is later work). Before the first step, a hang
ends the attempt (cold).

SIGTERM to the agent (a preemption): forwarded to the members (they save and stop),
spares told to end; no in-job recovery.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from . import injob
from .classify import Verdict, classify_one
from .launch import ENV_SUPERVISOR, rendezvous, through_bootstrap
from .progress import ENV_DIR, die_with_parent, read_progress
from .progress_watch import ProgressWatch
from .results import exited, write

ENV_CONF = "CKPTSTORE_AGENT_CONF"
EVENT_KINDS = ("recovery", "recovery_failed", "in_job_gave_up", "node_rejoined")  # journaled (journal.py)
STORE_EVENT = "in_job_store"  # EVENTS.jsonl: where the leader's store listens (the runner publishes it)
TICK_S = 0.01  # how often the agent looks at its children and the store
HANG_CHECK_S = 0.25  # how often the progress files are read for hangs
SPARE_NICE = 5  # spares warm up beside training: lower CPU priority
END_GRACE_S = 10.0  # members and spares told to end (the ``end`` key, SIGTERM) before SIGKILL
BEAT_JOIN_S = 15.0  # the beat's last store call (its client's timeout is 10 s) at the agent's end
MAX_SPARE_DEATHS = 3  # spares that died before their hello, in a row, before no more are started
EXITS_KEY = "exited"  # several nodes: a counter the agents bump after each ``exited/<worker>`` record


def command(result_path: str, events_path: str, launcher_args: list[str]) -> list[str]:
    """The agent's command line, importing this package as launch.command does."""
    from .launch import PACKAGE_ROOT

    stub = (f"import sys; sys.path[:1 if sys.path and sys.path[0] == '' else 0] = [{PACKAGE_ROOT!r}]; "
            "from ckptstore.supervisor.agent import main; from ckptstore.supervisor.quick_exit import exit_with; "
            "exit_with(main)")
    return [sys.executable, "-c", stub, result_path, events_path, *launcher_args]


@dataclass
class Conf:
    run: str = "run"
    attempt: int = 0
    spares: int = 1
    abort_timeout_s: float = 10.0
    reform_timeout_s: float = 60.0
    max_rounds_in_a_row: int = 3
    hang_timeout_s: float = 600.0
    first_progress_timeout_s: float = 1800.0
    memory_dir: str = ""
    memory_budget: int = 0
    # several nodes: when a node is lost (injob_nodes.BeatWatch; decide.Policy documents them)
    node_silent_s: float = injob.NODE_SILENT_S
    node_fault_silent_s: float = injob.NODE_FAULT_SILENT_S
    node_probe_timeout_s: float = injob.NODE_PROBE_TIMEOUT_S
    # a restarted node: the running attempt's in-job store (``host:port``) to join as a
    # node of spares (``_rejoin``); "" joins through the attempt's rendezvous as usual
    rejoin: str = ""

    @classmethod
    def from_env(cls, env) -> "Conf":
        data = json.loads(env.get(ENV_CONF) or "{}")
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


@dataclass
class Worker:
    """A worker of the attempt: this node's own (``proc``), or, on the leader, one of
    another node (``proc`` None; its agent reports its end in ``exited/<worker>``)."""
    wid: str
    proc: subprocess.Popen | None
    error_file: str
    spare: bool
    started_t: float
    rank: int | None = None
    local_rank: int | None = None
    hello: dict | None = None
    returncode: int | None = None
    killed_for: str | None = None  # "hang", "not left", "stopped": why the agent killed it
    exit_t: float | None = None
    node: int = 0
    record: dict | None = None  # how it ended, from its own agent (another node's worker)
    detected_by: str = "agent:exit"  # "agent:node": its node went silent

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else (self.hello or {}).get("pid")


@dataclass
class Pending:
    """A recovery whose new round has not yet trained on every rank."""
    round: int
    event: dict
    fault_t: float
    ranks: list[int] = field(default_factory=list)


class InJobAgent:
    def __init__(self, args, conf: Conf, result_path: str, events_path: str, env=None):
        self.args, self.conf = args, conf
        self.result_path, self.events_path = result_path, events_path
        self.env = dict(os.environ if env is None else env)
        self.errors_dir = os.path.join(os.path.dirname(os.path.abspath(result_path)), "errors")
        os.makedirs(self.errors_dir, exist_ok=True)
        self.nproc = int(args.nproc_per_node)
        self.nnodes = int(str(args.nnodes).split(":")[-1]) if str(args.nnodes).split(":")[-1].isdigit() else 1
        self.node = int(args.node_rank or 0) if self.nnodes > 1 else 0
        self.world = self.nproc * self.nnodes
        self.leader = self.node == 0
        self.nodes = None  # injob_nodes.NodesStore (several nodes)
        self.store = None  # the attempt's in-job store (_open_store)
        self.beat = None
        self.beats = None  # the leader's BeatWatch of the other nodes (several nodes)
        self.lost_nodes: set[int] = set()
        self.agent_hosts: dict[int, str] = {}
        self.published = None
        self.exits_seen = -1  # the leader's last look at EXITS_KEY (-1: look once at the start)
        self.workers: dict[str, Worker] = {}
        self.members: dict[int, Worker] = {}  # rank -> the worker holding it in the current round
        self.round = 0
        self.started = 0
        self.stop_signal: int | None = None
        self.previous_signature: str | None = None
        self.stalled = 0  # recoveries in a row without a new step
        self.last_fault_step: int | None = None
        self.spare_deaths = 0
        self.pending: Pending | None = None
        self.progress_dir = self.env.get(ENV_DIR, "")
        self.watch = ProgressWatch(time.monotonic())
        self.replica = None  # replica.ReplicaServer: this node's, for its partner's peer replicas
        self.alive = None  # injob_nodes.AliveListener: the leader's probe of this agent (several nodes)
        self.alive_at: dict[int, str] = {}  # the leader: node -> its agent's AliveListener address
        self.node_loss: dict[int, dict] = {}  # the leader: node -> what decided it lost, when
        self.gen = ""  # a returning agent's worker id part (injob_nodes.rejoin_prefix): "r<j>-"
        self.admitted: dict[int, int] = {}  # the leader: node -> the last join number looked at
        self.node_gen: dict[int, str] = {}  # the leader: a returned node -> its workers' id prefix

    # ------------------------------------------------------------------ set-up
    def _open_store(self) -> None:
        from datetime import timedelta

        from torch.distributed import TCPStore

        self.prefix = injob.attempt_prefix(self.conf.run, self.conf.attempt)
        if self.nnodes > 1:  # the leader's store, found through the attempt's rendezvous (injob_nodes.py)
            from .injob_nodes import AliveListener, Beat, NodesStore

            rendezvous(self.args, self.env)
            self.nodes = NodesStore(self.args, self.node, self.nnodes, self.conf.reform_timeout_s)
            self.own_host = self.nodes.own_host
            self.alive = AliveListener(self.own_host) if not self.leader else None
            self.base, self.address, self.host = self.nodes.base, self.nodes.address, self.nodes.host
            self.store = injob.attempt_store(self.base, self.prefix)
            self.beat = Beat(self.address, self.prefix, self.node)
            self.beat.start()
            self._serve_replicas()
            return
        self.base = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                             timeout=timedelta(seconds=max(30.0, self.conf.reform_timeout_s)))
        self.address, self.host = f"127.0.0.1:{self.base.port}", "127.0.0.1"
        self.store = injob.attempt_store(self.base, self.prefix)

    def _serve_replicas(self) -> None:
        """Several nodes: this node's replica server (node k-1's ranks copy their memory
        commits to it) before any worker starts, and the partner's address (node k+1's
        server) in every worker's environment, members and spares alike (a spare given a
        rank later replicates too). Node k's replicas live on node k+1, where the leader's
        spare choice (``_choose``) looks first after node k itself. The partner not there
        in time: no replication (a warning), the attempt goes on (a lost node's ranks then
        restore from the durable store)."""
        from .replica import ReplicaServer

        self.replica = ReplicaServer(self.conf.memory_dir, self.conf.memory_budget or None) \
            if self.conf.memory_dir else None
        if self.replica is None:
            return  # (no memory tier: nothing to replicate)
        injob.post_replica_server(self.store, self.node, self.own_host, self.replica.start())
        wait_s = min(30.0, self.conf.reform_timeout_s)
        partner = injob.partner_replica(self.store, self.node, self.nnodes, timeout_s=wait_s)
        if partner is None:
            print(f"ckptstore agent: node {(self.node + 1) % self.nnodes}'s replica server did not say where it "
                  f"listens within {wait_s:g}s: node {self.node}'s memory commits are not replicated (if this "
                  "node is lost, its ranks restore from the durable store)", file=sys.stderr, flush=True)
            return
        self.env[injob.ENV_PEER_REPLICA] = partner

    def close(self) -> None:
        """What the agent holds beyond its workers: the beat, the replica server, the probe port."""
        if self.beat is not None:
            # Stopped and joined before the process ends: a daemon thread still inside the
            # store's C++ call when the interpreter finalizes is ended by a forced unwind,
            # which aborts the process ("terminate called without an active exception").
            self.beat.stop.set()
            self.beat.join(timeout=BEAT_JOIN_S)
            self.beat = None
        if self.replica is not None:
            self.replica.close()
            self.replica = None
        if self.alive is not None:
            self.alive.close()
            self.alive = None
        if self.beats is not None:
            self.beats.close()

    def _cmd(self) -> list[str]:
        a = self.args
        if a.no_python:
            return [a.training_script, *a.training_script_args]
        return [sys.executable, "-u", *(["-m"] if a.module else []), a.training_script, *a.training_script_args]

    def _start(self, *, rank: int | None) -> Worker:
        wid = f"n{self.node}-{self.gen}w{self.started}"
        self.started += 1
        error_file = os.path.join(self.errors_dir, f"{wid}.json")
        env = dict(self.env)
        env.update({injob.ENV_STORE: self.address, injob.ENV_PREFIX: self.prefix, injob.ENV_WORKER: wid,
                    injob.ENV_NODE: str(self.node), injob.ENV_TIMEOUT: f"{self.conf.reform_timeout_s:g}",
                    injob.ENV_ABORT_TIMEOUT: f"{self.conf.abort_timeout_s:g}",
                    injob.ENV_MEMORY_DIR: self.conf.memory_dir,
                    injob.ENV_MEMORY_BUDGET: str(self.conf.memory_budget),
                    # the attempt's node count, to spares too: a spare given another node's rank
                    # has WORLD_SIZE == LOCAL_WORLD_SIZE on one node of two, yet its memory
                    # tier's records must stay in the in-job store (tiers.memory_place)
                    "GROUP_WORLD_SIZE": str(self.nnodes),
                    "TORCHELASTIC_ERROR_FILE": error_file,
                    "TORCHELASTIC_RUN_ID": self._run_id(),
                    "TORCHELASTIC_RESTART_COUNT": str(self.conf.attempt),
                    "TORCHELASTIC_MAX_RESTARTS": "0",
                    # a plain init_process_group() (env://) joins this store, as under torch's agent
                    "TORCHELASTIC_USE_AGENT_STORE": "True",
                    "MASTER_ADDR": self.host, "MASTER_PORT": self.address.rpartition(":")[2]})
        if self.nproc > 1 and "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = "1"  # torchrun's default
        env.pop(ENV_SUPERVISOR, None)
        for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                  injob.ENV_SPARE):
            env.pop(k, None)
        if rank is None:
            env[injob.ENV_SPARE] = "1"
        else:
            env.update(self._rank_env(rank))
        proc = subprocess.Popen(self._cmd(), env=env, start_new_session=True,
                                preexec_fn=(lambda: os.nice(SPARE_NICE)) if rank is None else None)
        w = Worker(wid, proc, error_file, spare=rank is None, started_t=time.time(), rank=rank,
                   local_rank=None if rank is None else rank % self.nproc, node=self.node)
        self.workers[wid] = w
        if rank is not None:
            self.members[rank] = w
        return w

    def _run_id(self) -> str:
        """torchrun's ``--rdzv-id`` when given, else the attempt's own (``<run>-a<attempt>``)."""
        given = str(self.args.rdzv_id or "none")
        return given if given != "none" else f"{self.conf.run}-a{self.conf.attempt}"

    def _rank_env(self, rank: int) -> dict:
        """torchrun's variables for global ``rank`` of this node (node k holds ranks
        k * nproc .. k * nproc + nproc - 1)."""
        world = str(self.world)
        return {"RANK": str(rank), "LOCAL_RANK": str(rank % self.nproc), "WORLD_SIZE": world,
                "LOCAL_WORLD_SIZE": str(self.nproc), "GROUP_RANK": str(self.node), "ROLE_RANK": str(rank),
                "ROLE_NAME": "default", "ROLE_WORLD_SIZE": world, "GROUP_WORLD_SIZE": str(self.nnodes)}

    # ------------------------------------------------------------------ the loop
    def run(self) -> int:
        try:
            return self._run()
        finally:
            self.close()  # (after the workers ended on every path: their last replication is in)

    def _run(self) -> int:
        if self.conf.rejoin:
            return self._rejoin()
        self._open_store()
        for r in range(self.node * self.nproc, (self.node + 1) * self.nproc):
            self._start(rank=r)
        for _ in range(self.conf.spares):
            self._start(rank=None)
        if self.nnodes > 1:
            self._publish()
            if not self.leader:
                return self._follow()
            self._await_nodes()
            self._emit(STORE_EVENT, attempt=self.conf.attempt, address=self.address)
        self._post_members(0)
        injob.set_fence(self.store, 0)
        next_hang_check = 0.0
        while True:
            if self.stop_signal is not None:
                return self._preempted()
            self._poll_all()
            self._note_hellos()
            self._replenish()
            self._check_pending()
            if self.lost_nodes:
                self._admit_returned()
            dead = [w for w in self.members.values() if w.returncode not in (None, 0)]
            if dead or self.store.check([injob.round_key(self.round, "fault")]):
                code = self._recover(min(dead, key=lambda w: (w.exit_t or 0, w.rank)) if dead else None)
                if code is not None:
                    return code
                continue
            if all(w.returncode == 0 for w in self.members.values()):
                return self._finished()
            if time.monotonic() >= next_hang_check:  # (progress files change at most once a step)
                next_hang_check = time.monotonic() + HANG_CHECK_S
                hung = self._hang()
                if hung is not None:
                    return hung
            time.sleep(TICK_S)

    def _poll_all(self) -> None:
        remote = False
        if self.leader and self.nnodes > 1:  # another node's worker ended: its agent bumped the counter
            count = self.store.add(EXITS_KEY, 0)
            remote, self.exits_seen = count != self.exits_seen, count
        for w in list(self.workers.values()):
            if w.returncode is not None or (w.proc is None and not remote):
                continue
            if w.proc is None:  # another node's worker: its agent says how it ended
                rec = injob.get(self.store, injob.exited_key(w.wid))
                if rec is None:
                    continue
                w.returncode, w.exit_t = injob.int_of(rec.get("returncode"), 1), _num(rec.get("t")) or time.time()
                w.record = rec.get("record") if isinstance(rec.get("record"), dict) else None
            elif w.proc.poll() is not None:
                w.returncode, w.exit_t = w.proc.returncode, time.time()
                if self.nnodes > 1 and not self.leader:
                    self._report_exit(w)
            else:
                continue
            if w.spare and w.rank is None:
                self.spare_deaths = self.spare_deaths + 1 if w.hello is None else 0
                if self.spare_deaths == MAX_SPARE_DEATHS:
                    # (said once: from here on a failure on this node relaunches cold)
                    print(f"ckptstore agent: node {self.node}'s spares died before they were warm "
                          f"{MAX_SPARE_DEATHS} times in a row (the last exit code {w.returncode}; its traceback, "
                          "if any, is above); no more are started, so a failure on this node now "
                          "relaunches cold: check the script's warmup= and that it calls ckptstore.inprocess.run",
                          file=sys.stderr, flush=True)
        if self.leader and self.nnodes > 1:
            self._sync_nodes()

    def _note_hellos(self) -> None:
        for w in self.workers.values():
            if w.hello is None and w.returncode is None:
                w.hello = injob.get(self.store, injob.hello_key(w.wid))
                if w.hello is not None and w.spare:
                    self.spare_deaths = 0

    def _warm_spares(self) -> list[Worker]:
        return [w for w in self.workers.values()
                if w.spare and w.rank is None and w.returncode is None and w.hello is not None]

    def _replenish(self) -> None:
        """Keep ``spares`` spare processes (warm or warming) alive; a spare that keeps
        dying before its hello (a script without inprocess.run) is not restarted."""
        alive = [w for w in self.workers.values()
                 if w.spare and w.rank is None and w.returncode is None and w.proc is not None]
        if self.spare_deaths >= MAX_SPARE_DEATHS:
            return
        for _ in range(self.conf.spares - len(alive)):
            self._start(rank=None)

    def _post_members(self, round_: int) -> None:
        injob.post_members(self.store, round_, {r: {"worker": w.wid, "node": w.node, "pid": w.pid}
                                                for r, w in sorted(self.members.items())})

    # ------------------------------------------------------------------ a failed round
    def _recover(self, dead: Worker | None) -> int | None:
        """The leader's side of a failed round (module docstring): ``dead`` the member
        whose death ended it, or None when a rank posted the notice (its collective
        failed) and no process has died (yet). None: the next round runs; else the
        agent's exit status (the attempt is over)."""
        r = self.round
        unaware = [w for w in self.members.values() if w.hello is None and w.returncode is None]
        finished = [w for w in self.members.values() if w.returncode == 0]
        primary_node = self.node  # the failed rank's node (below), else the leader's
        if dead is not None:
            detected_by = dead.detected_by
            record = self._record(dead)
            fault_t = dead.exit_t or time.time()
            what = record.get("error") or _how(record)
            failed = {dead.rank: record}
            for w in self.members.values():  # dead with it (a node lost: every rank on it)
                if w is not dead and w.returncode not in (None, 0):
                    failed[w.rank] = self._record(w)
            if not injob.post_fault(self.store, r, ranks=sorted(failed), cause=what, detected_by=detected_by,
                                    t=fault_t):
                first = injob.get(self.store, injob.round_key(r, "fault")) or {}  # a rank saw it first
                detected_by = str(first.get("detected_by") or detected_by)[:64]
        else:
            notice = injob.get(self.store, injob.round_key(r, "fault")) or {}
            detected_by = str(notice.get("detected_by") or "rank")[:64]
            fault_t = _num(notice.get("t")) or time.time()
            what = str(notice.get("cause") or "a rank said the round failed")
            failed = {}
        notice_t = time.time()
        if unaware or finished:
            why = ("a rank of the script never joined the in-job protocol (no inprocess.run): "
                   "in-job recovery is unsupported by the script") if unaware else \
                "some ranks had already finished"
            return self._cold(r, failed, why)
        survivors = [k for k, w in self.members.items() if w.returncode is None]
        hang = detected_by == "agent:hang"  # the ranks must leave within the abort timeout, or are killed
        bound = self.conf.abort_timeout_s if hang else self.conf.reform_timeout_s
        left = self._wait_left(r, survivors, failed, bound)
        if self.stop_signal is not None:
            injob.post_verdict(self.store, r, "cold", "the agent was stopped")
            return self._preempted()
        step = self._step(left)
        if failed:
            primary = dead.rank if dead is not None else min(failed)
            primary_node = self.members[primary].node
            record = failed[primary]
            verdict = classify_one(record, primary, step, self.previous_signature)
            if self.members[primary].killed_for == "not left":
                verdict.reason = f"rank {primary} did not leave round {r} within {bound:g}s ({what[:500]}): killed"
            elif self.members[primary].killed_for == "stopped":
                verdict.reason = f"rank {primary} was stopped (SIGSTOP or a tracer) in round {r} ({what[:500]}): killed"
        else:  # every member left: the same members re-form
            primary, record = None, {}
            verdict = Verdict("transient", f"round {r} failed with no process lost: {what[:1000]}")
        self.previous_signature = verdict.signature or self.previous_signature
        if self.pending is not None and self.pending.round == r:  # the recovery into round r failed
            who = f"rank {primary}" if failed else "a rank"
            why = (record.get("error") or _how(record)) if record else what
            self._emit("recovery_failed", attempt=self.conf.attempt, round=r,
                       reason=f"{who} failed before every rank trained in round {r}: {why[:1000]}")
            self.pending = None
        if verdict.klass == "deterministic":
            return self._stop(r, failed, primary, verdict)
        progressed = self.last_fault_step is None or (step is not None and step > self.last_fault_step)
        self.stalled = 0 if progressed else self.stalled + 1
        self.last_fault_step = step if step is not None else self.last_fault_step
        if self.stalled >= self.conf.max_rounds_in_a_row:
            return self._cold(r, failed, f"{self.stalled} in-job recoveries in a row without a new step "
                              f"(--max-rounds-in-a-row {self.conf.max_rounds_in_a_row})")
        failed_nodes = {self.members[k].node for k in failed}  # (before the spares take their ranks)
        spares = self._take_spares(sorted(failed))
        if spares is None:
            if self.stop_signal is not None:
                injob.post_verdict(self.store, r, "cold", "the agent was stopped")
                return self._preempted()
            return self._cold(r, failed, f"no warm spare for rank(s) {sorted(failed)} within "
                              f"{self.conf.reform_timeout_s:g}s (--spares {self.conf.spares})")
        nxt = r + 1
        for rank, w in spares.items():
            # its local rank on its own node: the replaced rank's own on its home node, else the
            # lowest one free there (nproc and up beside that node's members)
            taken = {m.local_rank for k, m in self.members.items()
                     if m.node == w.node and k not in failed and m.returncode is None}
            local = next(i for i in range(self.nproc + len(spares) + 1) if i not in taken)
            injob.assign(self.store, w.wid, round_=nxt, rank=rank, local_rank=local, world=self.world,
                         local_world=len(taken) + 1, node=w.node)
            w.rank, w.local_rank = rank, local
            self.members[rank] = w
        self._post_members(nxt)
        injob.set_fence(self.store, nxt)
        verdict_rec = injob.post_verdict(self.store, r, "continue", verdict.reason, next_round=nxt)
        self.round = nxt
        self._replenish()
        self.watch = ProgressWatch(time.monotonic())  # the new round is judged from now
        first_fault = min([fault_t, *(_num(f.get("t")) or fault_t for f in injob.faults(self.store, r))])
        teardown_end = max([notice_t, *(_num(rec.get("t")) or notice_t for rec in left.values())])
        event = {"attempt": self.conf.attempt, "round": nxt, "ranks": sorted(failed), "class": verdict.klass,
                 "reason": verdict.reason, "signal": record.get("signal"), "exit_code": record.get("exitcode"),
                 "traceback": (record.get("traceback") or None) and record["traceback"][-4000:],
                 "detected_by": detected_by, "node": primary_node, "step": step, "step_s": self._step_s(),
                 # the nodes lost with the failed ranks, and what evidence decided each
                 "node_lost": {str(k): {f: v for f, v in self.node_loss[k].items() if f != "t"}
                               for k in sorted(failed_nodes) if k in self.node_loss},
                 "detect_s": max(0.0, notice_t - first_fault), "teardown_s": max(0.0, teardown_end - notice_t),
                 # the last survivor left -> the verdict: classification and the wait for a warm spare
                 "decide_s": max(0.0, (_num(verdict_rec.get("t")) or time.time()) - teardown_end),
                 "verdict_t": _num(verdict_rec.get("t")) or time.time(),
                 "abandoned_steps": sorted({s for rec in left.values() for s in (rec.get("abandoned") or [])
                                            if isinstance(s, int)}),
                 "spares": {str(k): {"host": self._host_of(w), "node": w.node, "worker": w.wid,
                                     "warm_s": _num((w.hello or {}).get("warm_s"))} for k, w in spares.items()}}
        self.pending = Pending(nxt, event, first_fault, sorted(self.members))
        return None

    def _wait_left(self, r: int, survivors: list[int], failed: dict, bound_s: float) -> dict[int, dict]:
        """The survivors' ``left`` records, bounded by ``bound_s``; a survivor that dies or
        does not leave in time is failed (killed: R3, never in two rounds)."""
        deadline = time.monotonic() + bound_s
        pending, got = set(survivors), {}
        while pending and self.stop_signal is None:
            self._poll_all()
            for k in list(pending):
                rec = injob.get(self.store, injob.round_key(r, "left", k))
                w = self.members[k]
                if rec is not None:
                    got[k] = rec
                    pending.discard(k)
                elif w.returncode is not None:
                    pending.discard(k)
                    failed[k] = self._record(w)
                    injob.post_fault(self.store, r, ranks=[k], cause=_how(failed[k]), detected_by=w.detected_by)
            # A stopped process (SIGSTOP, a debugger) cannot leave whatever the wait: it
            # is failed now, not after the whole bound.
            frozen = {k for k in pending if _stopped(self.members[k])}
            if frozen or (pending and time.monotonic() >= deadline):
                for k in (frozen or pending):
                    w = self.members[k]
                    w.killed_for = "stopped" if k in frozen else "not left"
                    self._kill(w)
                    failed[k] = {"local_rank": w.local_rank, "pid": w.pid, "exitcode": -9, "signal": "SIGKILL",
                                 "error": None, "first": None, "traceback": None, "timestamp": int(time.time())}
                pending -= frozen or pending
                if not pending:
                    break
                continue
            time.sleep(TICK_S)
        return got

    def _take_spares(self, ranks: list[int]) -> dict[int, Worker] | None:
        """A warm spare per rank, waiting up to the reform timeout for spares to warm."""
        deadline = time.monotonic() + self.conf.reform_timeout_s
        while self.stop_signal is None:
            self._poll_all()
            self._note_hellos()
            self._replenish()
            warm = sorted(self._warm_spares(), key=lambda w: w.started_t)
            if len(warm) >= len(ranks):
                return self._choose(ranks, warm)
            if time.monotonic() >= deadline or (self.conf.spares == 0) or self.spare_deaths >= MAX_SPARE_DEATHS:
                return None
            time.sleep(TICK_S)
        return None

    def _step(self, left: dict[int, dict]) -> int | None:
        steps = [rec.get("step") for rec in left.values()]
        steps += [p.get("step") for p in read_progress(self.progress_dir).values()] if self.progress_dir else []
        steps = [s for s in steps if isinstance(s, int) and not isinstance(s, bool)]
        return max(steps) if steps else None

    def _step_s(self) -> float | None:
        """The ranks' latest reported step time (progress files), for ``lost_s``."""
        times = [p.get("step_s") for p in read_progress(self.progress_dir).values()] if self.progress_dir else []
        times = [t for t in times if _num(t) is not None and t > 0]
        return max(times) if times else None

    def _check_pending(self) -> None:
        """Journal the recovery once every member of its round has trained a step."""
        p = self.pending
        if p is None or p.round != self.round:
            return
        firsts = injob.marks(self.store, p.round, "first", p.ranks)
        if len(firsts) < len(p.ranks):
            return
        restored = injob.marks(self.store, p.round, "restored", p.ranks)
        e = dict(p.event)
        verdict_t = e.pop("verdict_t")
        starts = [(_num(m.get("t")) or verdict_t) - (_num(m.get("seconds")) or 0.0) for m in restored.values()]
        e["reform_s"] = max(0.0, max(starts) - verdict_t) if starts else None
        e["restore_s"] = max((_num(m.get("seconds")) or 0.0) for m in restored.values()) if restored else None
        e["first_step_s"] = max(0.0, max(_num(m.get("t")) or p.fault_t for m in firsts.values()) - p.fault_t)
        steps = [m.get("step") for m in restored.values() if isinstance(m.get("step"), int)]
        e["restored_step"] = min(steps) if steps else None
        e["lost_steps"] = None if (e["step"] is None or e["restored_step"] is None) else \
            max(0, e["step"] - e["restored_step"])
        e["lost_s"] = None if (e["lost_steps"] is None or e["step_s"] is None) else e["lost_steps"] * e["step_s"]
        tiers: dict[str, list[int]] = {}
        for k, m in sorted(restored.items()):
            tiers.setdefault(str(m.get("tier") or "none"), []).append(k)
        e["restore_from"] = tiers
        self._emit("recovery", **e)
        self.pending = None
        self.watch = ProgressWatch(time.monotonic())  # the round trains: hangs are judged from here

    def _hang(self) -> int | None:
        """A hang fails the round (module docstring); before any step: the attempt ends."""
        if not self.progress_dir:
            return None
        p = self.pending
        if p is not None and p.round == self.round:
            # A new round is starting (spares' re-form and restore are not steps): bounded by
            # the reform timeout from its verdict, judged by the hang timeout once it trained.
            if time.time() - p.event["verdict_t"] > self.conf.reform_timeout_s:
                injob.post_fault(self.store, self.round, ranks=[], detected_by="agent:hang",
                                 cause=f"round {self.round} did not train within {self.conf.reform_timeout_s:g}s")
            return None
        progress = read_progress(self.progress_dir)
        self.watch.update(progress)
        from .decide import Policy

        why = self.watch.hung(Policy(hang_timeout_s=self.conf.hang_timeout_s,
                                     first_progress_timeout_s=self.conf.first_progress_timeout_s))
        if why is None:
            return None
        if not self.watch.trained:
            self._end_workers("hang")
            write(self.result_path, {"ok": False, "failures": {}, "hang_reason": why})
            return 1
        # The round fails: the ranks that can leave it (woken by the notice) are not the
        # hung one; those that do not leave within the abort timeout are killed and replaced.
        injob.post_fault(self.store, self.round, ranks=[], cause=f"hang: {why}", detected_by="agent:hang")
        self.watch = ProgressWatch(time.monotonic())
        return None

    # ------------------------------------------------------------------ endings
    def _stop(self, r: int, failed: dict, rank: int, verdict) -> int:
        injob.post_verdict(self.store, r, "stop", verdict.reason)
        self._end_workers("stop")
        failed[rank] = {**failed[rank], "signature": verdict.signature}
        write(self.result_path, {"ok": False, "failures": {str(k): f for k, f in failed.items()},
                                 "stop_reason": verdict.reason, "stop_rank": rank})
        return 1

    def _cold(self, r: int, failed: dict, reason: str) -> int:
        injob.post_verdict(self.store, r, "cold", reason)
        self._emit("in_job_gave_up", attempt=self.conf.attempt, round=r, reason=reason)
        self._end_workers("cold", kill=True)
        write(self.result_path, {"ok": False, "failures": {str(k): f for k, f in failed.items()},
                                 "in_job_gave_up": reason})
        return 1

    def _finished(self) -> int:
        self._end_workers("finished")
        write(self.result_path, {"ok": True, "failures": {}})
        return 0

    def _preempted(self) -> int:
        """SIGTERM: the members save and stop (their own handlers), the spares end."""
        for w in self.members.values():
            if w.returncode is None:
                _signal(w, signal.SIGTERM)
        self._end_workers("stopped")
        name = signal.Signals(self.stop_signal).name
        write(self.result_path, {"ok": False, "launcher_signal": name, "failures": {}})
        return 128 + int(self.stop_signal)

    def _end_workers(self, reason: str, kill: bool = False) -> None:
        """Say ``end`` (waiting workers exit 0), wait for every worker a bounded time, then
        kill what is left: no process of the attempt outlives it. Only the leader says
        ``end`` (the whole attempt's); another node kills its own spares instead. The
        leader then waits, bounded, for the other agents' ``done``: its store must
        outlive their last look at it."""
        if self.leader:
            try:
                injob.end(self.store, reason)
            except Exception:  # noqa: BLE001 - the store is ours; if it fails, the kills below still end them
                pass
        live = [w for w in self.workers.values() if w.returncode is None and w.proc is not None]
        for w in live:  # a spare still starting (no hello yet) would read ``end`` only once warm
            if kill or (w.rank is None and (w.hello is None or not self.leader)):
                self._kill(w)
        deadline = time.monotonic() + END_GRACE_S
        for w in live:
            try:
                w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._kill(w)
                w.proc.wait()
            w.returncode = w.proc.returncode
        if self.nnodes > 1 and not self.leader:
            try:
                self.store.set(injob.agent_key(self.node, "done"), reason)
            except Exception:  # noqa: BLE001 - the leader's store is gone: nobody waits for this
                pass
        elif self.nnodes > 1 and self.store is not None:  # (None: the agent failed before it had one)
            others = [injob.agent_key(k, "done") for k in range(1, self.nnodes) if k not in self.lost_nodes]
            injob.wait_for(self.store, others, END_GRACE_S + 5.0)

    def _kill(self, w: Worker) -> None:
        """SIGKILL a worker: this node's own, or another node's through its agent."""
        if w.proc is not None:
            _signal(w, signal.SIGKILL)
        elif w.node not in self.lost_nodes:
            self.store.set(injob.kill_key(w.wid), "1")

    def _record(self, w: Worker) -> dict:
        """How a dead worker ended: its agent's record (another node), else its exit here."""
        if w.record is not None:
            return w.record
        return exited(w.rank, w.pid or 0, _status(w.returncode or 0), w.error_file)

    def _host_of(self, w: Worker) -> str:
        return _host() if w.node == self.node else self.agent_hosts.get(w.node, f"node {w.node}")

    # ------------------------------------------------------------------ several nodes: the leader
    def _choose(self, ranks: list[int], warm: list[Worker]) -> dict[int, Worker]:
        """A warm spare per rank: on the rank's own node first, else on its partner node
        ((k + 1) mod nnodes: it holds node k's peer replicas), else anywhere; the longest
        warm first."""
        pool, out = list(warm), {}
        for rank in ranks:
            home = rank // self.nproc
            near = [home, (home + 1) % self.nnodes]
            best = min(pool, key=lambda w: (near.index(w.node) if w.node in near else 2, w.started_t))
            pool.remove(best)
            out[rank] = best
        return out

    def _await_nodes(self) -> None:
        """The other agents' records (their members and spares), bounded by the reform timeout."""
        from .injob_nodes import BeatWatch

        deadline = time.monotonic() + self.conf.reform_timeout_s
        for k in range(1, self.nnodes):
            rec = injob.wait_record(self.store, injob.agent_key(k), max(0.0, deadline - time.monotonic()))
            if rec is None:
                raise RuntimeError(f"node {k}'s agent joined the rendezvous but never published its workers "
                                   f"within {self.conf.reform_timeout_s:g}s")
            for rank, wid in injob.agent_members(rec).items():  # (malformed entries left out)
                w = Worker(wid, None, "", spare=False, started_t=time.time(), rank=rank,
                           local_rank=rank % self.nproc, node=k)
                self.workers[w.wid] = self.members[w.rank] = w
        c = self.conf
        self.beats = BeatWatch(self.store, list(range(1, self.nnodes)), silent_s=c.node_silent_s,
                               fault_silent_s=c.node_fault_silent_s, probe_timeout_s=c.node_probe_timeout_s)
        self.next_sync = 0.0
        self._sync_nodes()

    def _sync_nodes(self) -> None:
        """The other nodes' spares (their agents' records) and beats."""
        if time.monotonic() < self.next_sync:
            return
        self.next_sync = time.monotonic() + 0.05
        for k in range(1, self.nnodes):
            if k in self.lost_nodes:
                continue
            rec = injob.get(self.store, injob.agent_key(k)) or {}
            self.agent_hosts[k] = str(rec.get("host") or f"node {k}")
            alive = rec.get("alive")
            if isinstance(alive, str) and alive != self.alive_at.get(k):  # probed once now: trusted if it accepts
                self.alive_at[k] = alive
                self.beats.prober.start(k, alive)
            for wid in rec.get("spares") or []:
                if isinstance(wid, str) and wid not in self.workers and wid.startswith(self.node_gen.get(k, "")):
                    self.workers[wid] = Worker(wid, None, "", spare=True, started_t=time.time(), node=k)
        fault = self.store.check([injob.round_key(self.round, "fault")])
        for k, decided_by, silent_s in self.beats.silent(fault, self.alive_at):
            self._node_lost(k, decided_by, silent_s)

    def _node_lost(self, k: int, decided_by: str = "beat", silent_s: float | None = None) -> None:
        """Node k is lost (``decided_by``: injob_nodes.BeatWatch's evidence): every worker
        on it is dead (its ranks fail)."""
        from .injob_nodes import BY_BEAT, BY_REFUSED

        self.lost_nodes.add(k)
        silent = self.conf.node_silent_s if silent_s is None else silent_s
        self.node_loss[k] = {"decided_by": decided_by, "silent_s": round(silent, 3), "t": time.time()}
        if decided_by == BY_BEAT:
            why = (f"node {k} lost: its agent's beat stood still for {self.conf.node_silent_s:g}s "
                   "(the node, its supervisor or its agent died)")
        elif decided_by == BY_REFUSED:
            why = (f"node {k} lost: a rank's collective failed and its agent's port refused a connection "
                   f"(its beat silent {silent:.2f}s: the agent died, with every rank on the node)")
        else:
            why = (f"node {k} lost: a rank's collective failed, its agent's beat stood still for {silent:.2f}s "
                   f"(--node-fault-silent {self.conf.node_fault_silent_s:g}) and it did not answer a connection")
        for w in self.workers.values():
            if w.node == k and w.returncode is None:
                w.returncode, w.exit_t, w.detected_by = -int(signal.SIGKILL), time.time(), "agent:node"
                w.record = {"local_rank": w.local_rank, "pid": w.pid, "exitcode": -9, "signal": "SIGKILL",
                            "error": why, "first": None, "traceback": None, "timestamp": int(time.time())}

    def _admit_returned(self) -> None:
        """A lost node's returning agent asks to rejoin (``_rejoin``): between rounds (no
        fault notice), the leader admits it as a node of spares. Its ranks stay where the
        recovery put them (moving them back would cost a recovery); its warm spares count
        from now, on the own-node-first rule (``_choose``). The admission is create-only
        against the agent's own give-up: never both."""
        from .injob_nodes import rejoin_key, rejoin_prefix, rejoined_key

        if self.store.check([injob.round_key(self.round, "fault")]):
            return
        for k in sorted(self.lost_nodes):
            req = injob.get(self.store, rejoin_key(k))  # (None: no request)
            if req is None:
                continue
            join = injob.int_of(req.get("join"), 0, 0)
            if join <= self.admitted.get(k, 0):
                continue
            self.admitted[k] = join
            won, _ = injob.create(self.store, rejoined_key(k, join), {"round": self.round, "t": time.time()})
            if not won:  # (it gave up waiting first)
                continue
            prefix = rejoin_prefix(k, join)
            self.lost_nodes.discard(k)
            self.node_gen[k] = prefix
            self.beats.watch(k)
            self.alive_at.pop(k, None)
            self.agent_hosts[k] = str(req.get("host") or f"node {k}")[:256]
            spares = req.get("spares") if isinstance(req.get("spares"), list) else []  # (read as untrusted)
            for wid in spares[:1024]:
                if isinstance(wid, str) and wid.startswith(prefix) and wid not in self.workers:
                    self.workers[wid] = Worker(wid, None, "", spare=True, started_t=time.time(), node=k)
            self._note_hellos()
            warm = [w.wid for w in self._warm_spares() if w.node == k]
            lost_t = _num(self.node_loss.get(k, {}).get("t"))
            self._emit("node_rejoined", attempt=self.conf.attempt, round=self.round, node=k, join=join,
                       node_host=self.agent_hosts[k], spares=warm,
                       lost_s=None if lost_t is None else round(max(0.0, time.time() - lost_t), 3))
            print(f"ckptstore agent: node {k} rejoined attempt {self.conf.attempt} in round {self.round} "
                  f"with {len(warm)} warm spare(s); its ranks stay where they are", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ several nodes: a lost node's return
    def _rejoin(self) -> int:
        """This node was lost and restarted while its run's in-job attempt still runs:
        join it as a node of spares (``conf.rejoin``: the leader's store, found by the
        runner in the run's shared records). The store must hold this very attempt (its
        prefix names the run and the attempt) and not have ended; the spares warm, the
        request is posted, and the leader admits it between rounds (``_admit_returned``)
        within the reform timeout, else the agent gives up (create-only: never admitted
        as well). On any failure the spares end and RESULT.json says ``rejoin_failed``:
        the runner then waits for the next attempt as before."""
        from .injob_nodes import (AliveListener, Beat, advertised_host, answers, rejoin_key, rejoin_prefix,
                                  rejoined_key)

        self.prefix = injob.attempt_prefix(self.conf.run, self.conf.attempt)
        address = self.conf.rejoin
        why = answers(address, 2.0)
        if why is not None:
            return self._rejoin_failed(f"node 0's in-job store at {address} does not answer ({why[:200]})")
        self.base = injob.connect(address, 10.0)
        self.store = injob.attempt_store(self.base, self.prefix)
        self.address, self.host = address, address.rpartition(":")[0]
        if injob.fence(self.store) is None or injob.get(self.store, injob.agent_key(0)) is None:
            return self._rejoin_failed(f"the store at {address} holds no in-job attempt {self.conf.attempt} of run "
                                       f"{self.conf.run}")
        ended = injob.ended(self.store)
        if ended is not None:
            return self._rejoin_failed(f"attempt {self.conf.attempt} ended ({str(ended.get('reason'))[:200]})")
        join = self.store.add(rejoin_key(self.node, "n"), 1)
        self.gen = rejoin_prefix(self.node, join).split("-", 1)[1]
        self.own_host = advertised_host(self.host)
        self.alive = AliveListener(self.own_host)
        self._serve_replicas()
        for _ in range(self.conf.spares):
            self._start(rank=None)
        deadline = time.monotonic() + self.conf.reform_timeout_s
        while not self._warm_spares():  # (a returned node is worth admitting only with a warm spare)
            self._poll_all()
            self._note_hellos()
            self._replenish()
            if injob.ended(self.store) is not None:
                return self._rejoin_failed(f"attempt {self.conf.attempt} ended while this node's spares warmed")
            if time.monotonic() >= deadline or self.conf.spares == 0 or self.spare_deaths >= MAX_SPARE_DEATHS \
                    or self.stop_signal is not None:
                return self._rejoin_failed(f"no spare of this node warm within {self.conf.reform_timeout_s:g}s "
                                           f"(--spares {self.conf.spares})")
            time.sleep(TICK_S)
        injob.put(self.store, rejoin_key(self.node), {
            "join": join, "host": _host(), "pid": os.getpid(), "alive": self.alive.address,
            "spares": sorted(w.wid for w in self.workers.values() if w.spare and w.returncode is None)})
        key = rejoined_key(self.node, join)
        while not self.store.check([key]) and time.monotonic() < deadline and self.stop_signal is None \
                and injob.ended(self.store) is None:
            time.sleep(TICK_S)
        won, admitted = injob.create(self.store, key, {"gave_up": True})
        if won or not admitted or "round" not in admitted:
            why = "it ended" if injob.ended(self.store) is not None else \
                f"node 0 did not admit this node within {self.conf.reform_timeout_s:g}s"
            return self._rejoin_failed(f"attempt {self.conf.attempt}: {why}")
        self.round = injob.int_of(admitted.get("round"), 0, 0)
        self._publish()
        self.beat = Beat(self.address, self.prefix, self.node)
        self.beat.start()
        print(f"ckptstore agent: node {self.node} rejoined attempt {self.conf.attempt} (round {self.round}) as "
              "a node of spares", file=sys.stderr, flush=True)
        return self._follow()

    def _rejoin_failed(self, why: str) -> int:
        """Not rejoined: this node's spares end (none was ever the leader's), the runner
        waits for the next attempt."""
        for w in self.workers.values():
            if w.returncode is None and w.proc is not None:
                _signal(w, signal.SIGKILL)
                w.proc.wait()
                w.returncode = w.proc.returncode
        write(self.result_path, {"ok": False, "failures": {}, "rejoin_failed": why})
        return 1

    # ------------------------------------------------------------------ several nodes: the others
    def _publish(self) -> None:
        """``agent/<node>``: this node's host, members and live unassigned spares."""
        rec = {"host": _host(), "pid": os.getpid(), "alive": self.alive.address if self.alive else None,
               "members": {str(w.rank): {"worker": w.wid, "pid": w.pid} for w in self.workers.values()
                           if w.rank is not None and w.returncode is None},
               "spares": sorted(w.wid for w in self.workers.values()
                                if w.spare and w.rank is None and w.returncode is None)}
        if rec != self.published:
            injob.put(self.store, injob.agent_key(self.node), rec)
            self.published = rec

    def _report_exit(self, w: Worker) -> None:
        """Tell the leader how this node's worker ended; a member's death fails the round."""
        record = exited(w.rank if w.rank is not None else -1, w.pid, _status(w.returncode), w.error_file)
        injob.put(self.store, injob.exited_key(w.wid), {"returncode": w.returncode, "t": w.exit_t,
                                                        "record": record})
        self.store.add(EXITS_KEY, 1)  # after the record: the leader looks when the count moves
        if w.rank is not None and w.returncode != 0:
            injob.post_fault(self.store, self.round, ranks=[w.rank], detected_by="agent:exit",
                             cause=record.get("error") or _how(record), t=w.exit_t)

    def _follow(self) -> int:
        """A node other than the leader's: run this node's workers, report their ends,
        follow the leader's membership and verdicts; the leader's store lost -> end."""
        next_hang_check = 0.0
        while True:
            if self.stop_signal is not None:
                return self._preempted()
            try:
                code = self._follow_tick()
                if code is not None:
                    return code
                if time.monotonic() >= next_hang_check and self.progress_dir:
                    next_hang_check = time.monotonic() + HANG_CHECK_S
                    self._watch_hang()
            except Exception as e:  # noqa: BLE001 - the leader's store failed: its host is gone
                return self._store_lost(f"{type(e).__name__}: {str(e)[:300]}")
            if self.beat.lost.is_set():
                return self._store_lost("the beat could not be written")
            time.sleep(TICK_S)

    def _follow_tick(self) -> int | None:
        self._poll_all()
        self._note_hellos()
        for w in self.workers.values():
            if w.returncode is None and self.store.check([injob.kill_key(w.wid)]):
                w.killed_for = "not left"
                self._kill(w)
        f = injob.fence(self.store)
        if f is not None and f > self.round:
            self._adopt(f)
        self._replenish()
        self._publish()
        v = injob.verdict(self.store, self.round)
        if v is not None and v["action"] in ("stop", "cold"):
            return self._leader_ended(v["action"], str(v.get("reason") or ""))
        e = injob.ended(self.store)
        if e is not None:
            return self._leader_ended("end", str(e.get("reason") or ""))
        return None

    def _adopt(self, round_: int) -> None:
        """Round ``round_``'s membership: this node's spares the leader assigned are members."""
        self.round = round_
        self.members = {}  # a rank of this node given to another node's spare is no longer ours
        for rank, m in injob.members(self.store, round_).items():
            w = self.workers.get(str(m.get("worker")))
            if w is None or m.get("node") != self.node:
                continue
            if w.rank is None:
                a = injob.get(self.store, injob.assign_key(w.wid)) or {}
                w.rank, w.local_rank = rank, injob.int_of(a.get("local_rank"), rank % self.nproc, 0, self.nproc - 1)
            self.members[rank] = w
        self.watch = ProgressWatch(time.monotonic())

    def _watch_hang(self) -> None:
        """This node's ranks' progress; a hang is posted as the round's fault (the leader decides)."""
        self.watch.update(read_progress(self.progress_dir))
        from .decide import Policy

        why = self.watch.hung(Policy(hang_timeout_s=self.conf.hang_timeout_s,
                                     first_progress_timeout_s=self.conf.first_progress_timeout_s))
        if why is not None:
            injob.post_fault(self.store, self.round, ranks=[], cause=f"hang on node {self.node}: {why}",
                             detected_by="agent:hang")
            self.watch = ProgressWatch(time.monotonic())

    def _leader_ended(self, how: str, reason: str) -> int:
        """The leader's verdict ended the attempt (``stop``, ``cold``) or it said ``end``."""
        self._end_workers(how, kill=how == "cold")
        mine = list(self.members.values())  # this node's members of the current round
        spares_only = not mine and bool(self.conf.rejoin) and reason == "finished"  # a returned node's
        if how == "end" and (spares_only or (mine and all(w.returncode == 0 for w in mine))):
            write(self.result_path, {"ok": True, "failures": {}})
            return 0
        if how == "stop":
            write(self.result_path, {"ok": False, "failures": {}, "stop_reason": reason})
        elif how == "cold":
            write(self.result_path, {"ok": False, "failures": {}, "in_job_gave_up": reason})
        else:
            write(self.result_path, {"ok": False, "failures": {},
                                     "launcher_error": f"the in-job leader (node 0) ended the attempt: {reason}"})
        return 1

    def _store_lost(self, why: str) -> int:
        """The leader's host is gone (its store with it): this node's workers end; the
        runners relaunch cold. Members that had all finished: the job is done."""
        mine = list(self.members.values())  # this node's members of the current round
        done = bool(mine) and all(w.returncode == 0 for w in mine)
        self._end_workers("store lost", kill=True)
        if done:
            write(self.result_path, {"ok": True, "failures": {}})
            return 0
        write(self.result_path, {"ok": False, "failures": {},
                                 "launcher_error": f"in-job store lost: node 0 (the leader, {self.address}) is "
                                                   f"gone ({why}); this node's workers were ended, the attempt "
                                                   "is relaunched cold"})
        return 1

    def _emit(self, kind: str, **fields) -> None:
        with open(self.events_path, "a") as f:
            f.write(json.dumps({"kind": kind, **fields}) + "\n")


def _status(returncode: int) -> int:
    """A ``waitpid`` status from ``Popen.returncode`` (negative: the signal)."""
    return -returncode if returncode < 0 else returncode << 8


def _how(record: dict) -> str:
    if record.get("signal"):
        return f"killed by {record['signal']}"
    return f"exited with code {record.get('exitcode')}"


def _stopped(w: Worker) -> bool:
    """Whether this node's worker ``w`` is stopped (state T or t in /proc: SIGSTOP, a
    tracer): it runs no code, so it will never leave a round."""
    if w.proc is None or w.returncode is not None:
        return False
    try:
        with open(f"/proc/{w.proc.pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return False
    end = stat.rfind(b")")  # (the command name may hold spaces and parentheses)
    return stat[end + 2:end + 3] in (b"T", b"t")


def _signal(w: Worker, signum: int) -> None:
    if w.proc is None:  # another node's: its own supervisor signals it
        return
    try:
        w.proc.send_signal(signum)
    except ProcessLookupError:
        pass


def _num(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _host() -> str:
    import socket

    return socket.gethostname()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    result_path, events_path, rest = argv[0], argv[1], argv[2:]
    die_with_parent(signal.SIGTERM)  # as launch.py: never train unwatched
    supervisor = os.environ.get(ENV_SUPERVISOR)
    if supervisor and str(os.getppid()) != supervisor:
        return 128 + int(signal.SIGTERM)
    from torch.distributed import run as torchrun

    args = torchrun.parse_args(rest)
    through_bootstrap(args)
    agent = InJobAgent(args, Conf.from_env(os.environ), result_path, events_path)

    def on_signal(signum, frame):
        agent.stop_signal = signum

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, on_signal)
    try:
        return agent.run()
    except Exception as e:  # noqa: BLE001 - the agent's own failure: no worker may outlive it
        agent._end_workers("agent failed", kill=True)
        write(result_path, {"ok": False, "failures": {}, "launcher_error": f"in-job agent: {type(e).__name__}: "
                            f"{str(e)[:2000]}"})
        return 1


if __name__ == "__main__":
    sys.exit(main())
