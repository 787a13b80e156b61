"""ckptstore.inprocess (the rank side of in-job restart, docs/design/in-job-restart.md
sections 5.2 and 6) under a fake agent: the test hosts the in-job TCPStore, starts the
workers (tests/procs/inprocess_worker.py) with the agent's environment, and plays the
leader with injob's functions: fault notice, left records, a spare assigned, members,
fence, verdict. Real processes, real gloo groups, real SIGKILL / SIGSTOP."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from ckptstore import inprocess, names
from ckptstore.checkpoint import exiting
from ckptstore.supervisor import injob

WORKER = Path(__file__).parent / "procs" / "inprocess_worker.py"
ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "docs" / "examples" / "fault_tolerant_training.py"
GUARD_S = 60.0  # bounds every wait: a hang becomes a failure, never a timing (below the
# workers' gloo timeout, CKPTSTORE_INJOB_TIMEOUT: without the abort shim a test fails)


class Worker:
    def __init__(self, env: dict, argv: list[str]):
        self.proc = subprocess.Popen([sys.executable, *argv], env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[str] = []
        self._q: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.proc.stdout:
            self._q.put(line.rstrip("\n"))
        self._q.put(None)

    def expect(self, prefix: str) -> str:
        deadline = time.monotonic() + GUARD_S
        while True:
            try:
                line = self._q.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no line {prefix!r} within {GUARD_S}s:\n" + "\n".join(self.lines))
            if line is None:
                raise AssertionError(f"output ended before {prefix!r}:\n" + "\n".join(self.lines))
            self.lines.append(line)
            if line.startswith(prefix):
                return line

    def finish(self) -> int:
        try:
            code = self.proc.wait(timeout=GUARD_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError("worker hung:\n" + "\n".join(self.lines))
        while (line := self._q.get(timeout=GUARD_S)) is not None:
            self.lines.append(line)
        return code

    def drain(self) -> list[str]:
        with contextlib.suppress(queue.Empty):
            while (line := self._q.get(timeout=1)) is not None:
                self.lines.append(line)
        return self.lines

    def output(self) -> str:
        return "\n".join(self.lines)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()


class FakeAgent:
    """One node's agent and the leader, reduced to what a test needs."""

    def __init__(self, scenario: str, final_round: int, world: int, spares: int = 0, script=WORKER, **extra_env):
        self.server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=GUARD_S))
        self.prefix = "ckptstore/test/0"
        self.store = injob.attempt_store(self.server, self.prefix)
        self.argv = [str(script), scenario, str(final_round)] if script == WORKER else [str(script), *scenario]
        self.base = {k: v for k, v in os.environ.items() if not k.startswith(("CKPTSTORE_", "RANK", "WORLD_SIZE"))}
        self.base.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra_env)
        self.base.update({injob.ENV_STORE: f"127.0.0.1:{self.server.port}", injob.ENV_PREFIX: self.prefix,
                          injob.ENV_NODE: "0", injob.ENV_TIMEOUT: "120", injob.ENV_ABORT_TIMEOUT: "5"})
        self.world = world
        self.ranks: dict[int, Worker] = {}
        self.workers: dict[int, str] = {}
        self.spares: list[tuple[str, Worker]] = []
        self.n = 0
        for rank in range(world):
            self.ranks[rank] = self._start(rank=rank)
        for _ in range(spares):
            self.spares.append((f"0-{self.n}", self._start(rank=None)))

    def _start(self, rank: int | None) -> Worker:
        worker = f"0-{self.n}"
        self.n += 1
        env = dict(self.base, **{injob.ENV_WORKER: worker})
        if rank is None:
            env[injob.ENV_SPARE] = "1"
        else:
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(self.world),
                       LOCAL_WORLD_SIZE=str(self.world), GROUP_RANK="0")
            self.workers[rank] = worker
        return Worker(env, self.argv)

    def all_lines(self, prefix: str) -> list[str]:
        return [w.expect(prefix) for w in self.ranks.values()]

    def recover(self, round_: int, failed: list[int], cause: str, detected_by: str = "agent:exit") -> None:
        """The leader's steps 1 and 4: notice, left records, spares, members, fence, verdict."""
        injob.post_fault(self.store, round_, ranks=failed, cause=cause, detected_by=detected_by)
        survivors = [r for r in self.ranks if r not in failed]
        left = injob.wait_left(self.store, round_, survivors, GUARD_S)
        if sorted(left) != survivors:
            self.dump_stacks()
            raise AssertionError(f"left: {sorted(left)} of {survivors}:\n" + "\n".join(
                f"rank {r}: {w.proc.poll()}: " + "\n".join(w.drain()) for r, w in self.ranks.items()))
        for rank in failed:
            worker, proc = self.spares.pop(0)
            assert injob.wait_for(self.store, [injob.hello_key(worker)], GUARD_S), "the spare never said hello"
            injob.assign(self.store, worker, round_=round_ + 1, rank=rank, local_rank=rank, world=self.world,
                         local_world=self.world, node=0)
            self.ranks[rank], self.workers[rank] = proc, worker
        injob.post_members(self.store, round_ + 1, {r: {"worker": w, "node": 0} for r, w in self.workers.items()})
        injob.set_fence(self.store, round_ + 1)
        injob.post_verdict(self.store, round_, "continue", next_round=round_ + 1)
        self.left = left

    def dump_stacks(self):
        """Each live worker's stacks on its output (faulthandler on SIGUSR1, see the worker env)."""
        for w in self.ranks.values():
            if w.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.proc.pid, signal.SIGUSR1)

    def close(self):
        injob.end(self.store, "test over")
        for w in list(self.ranks.values()) + [w for _, w in self.spares]:
            w.kill()


@pytest.fixture
def agents():
    made: list[FakeAgent] = []
    yield lambda *a, **k: made.append(FakeAgent(*a, **k)) or made[-1]
    for a in made:
        a.close()


def firsts(agent: FakeAgent, round_: int) -> dict[int, list[str]]:
    out = {}
    for w in agent.ranks.values():
        f = w.expect(f"first {round_} ").split()
        out[int(f[2])] = f
    return out


def finish_all(agent: FakeAgent) -> None:
    for rank, w in agent.ranks.items():
        assert w.finish() == 0, f"rank {rank}:\n" + "\n".join(w.lines)
        assert f"result done {rank}" in w.lines


def test_a_dead_then_a_hung_rank_are_replaced_by_spares(agents):
    """Round 0: rank 0 SIGKILLed while the others block in all_reduce (rank 2 is no ring
    neighbour of rank 0: only the notice and the shim wake it). Round 1: rank 0, now the
    first spare, hangs (SIGSTOP: no socket closes); the notice wakes the others, the
    agent kills it, the second spare takes rank 0. Round 2: every rank returns."""
    agent = agents("ring", 2, world=4, spares=2, VICTIM="0")
    pids = {r: int(f[7]) for r, f in firsts(agent, 0).items()}
    spares = list(agent.spares)
    for worker, _ in spares:  # warm: waiting for a rank
        assert injob.wait_for(agent.store, [injob.hello_key(worker)], GUARD_S)
        assert injob.get(agent.store, injob.hello_key(worker))["spare"] is True
    for round_, how in enumerate(["kill", "hang"]):
        agent.all_lines(f"ready {round_} ")
        victim = agent.ranks[0]
        if how == "kill":
            t_fault = time.time()
            victim.proc.kill()
            victim.proc.wait(timeout=GUARD_S)
            agent.recover(round_, [0], "SIGKILL")
        else:
            os.kill(victim.proc.pid, signal.SIGSTOP)
            t_fault = time.time()
            injob.post_fault(agent.store, round_, ranks=[0], cause="no progress", detected_by="agent:hang")
            for r in (1, 2, 3):
                assert "RuntimeError" in agent.ranks[r].expect(f"aborted {r} ").split()[2]  # the shim woke it
            victim.proc.kill()  # a hang becomes a death: it never rejoins
            victim.proc.wait(timeout=GUARD_S)
            agent.recover(round_, [0], "hang")
        f = firsts(agent, round_ + 1)
        assert {x[4] for x in f.values()} == {"10"}  # 1+2+3+4: a spare holds rank 0
        assert int(f[0][7]) == spares[round_][1].proc.pid
        assert all(x[10:12] == [str(r), str(round_ + 1)] for r, x in f.items())  # RANK and the round, exported
        for r in (1, 2, 3):
            assert int(f[r][7]) == pids[r]  # survivors kept their process
        print(f"\n{how}: fault to every rank's first collective of round {round_ + 1}: "
              f"{(max(float(x[3]) for x in f.values()) - t_fault) * 1000:.0f} ms; left after "
              f"{[round(agent.left[r]['t'] - t_fault, 3) for r in (1, 2, 3)]} s; teardown, gc "
              f"{[(f[r][8], f[r][9]) for r in (1, 2, 3)]} s")
    finish_all(agent)


def test_many_rounds_in_one_process_atomic_sleep_and_no_leaks(agents):
    """Round 0: rank 0 inside atomic() (the abort waits for its end), rank 1 in time.sleep
    (woken by the async exception) keeping a subgroup (dist.new_group) in a module-level
    object (warned of once). Rounds 1-7: rank 0 in a collective (woken by the shim), rank 1 asleep. The
    same two processes throughout, with constant fd and thread counts. Round 8: rank 1's
    own error ends it; rank 0 leaves and stops at the verdict; the spare ends quietly."""
    rounds = 8
    agent = agents("rounds", rounds, world=2, spares=1)
    a0, a1 = agent.ranks[0], agent.ranks[1]
    pids, fds, threads, lost = {0: set(), 1: set()}, {0: [], 1: []}, {0: [], 1: []}, []
    t_fault = 0.0  # (set when a round's fault is posted, read in the next round)
    for r in range(rounds + 1):
        for rank, f in firsts(agent, r).items():
            pids[rank].add(f[7])
            fds[rank].append(int(f[5]))
            threads[rank].append(int(f[6]))
            if r:
                lost.append(float(f[3]) - t_fault)
        if r == rounds:
            break
        agent.all_lines(f"ready {r} ")
        t_fault = time.time()
        agent.recover(r, [], "test", detected_by="test")
        if r == 0:
            assert a0.expect("aborted ") == "aborted atomic-exit RoundAborted"
            assert a0.lines[-2:-1] == ["deferred"]  # (and not "after atomic": it raised at the exit)
        else:
            assert "RuntimeError" in a0.expect("aborted 0 ").split()[2]  # in the collective: the shim
        assert a1.expect("aborted 1 ").split()[2] == "RoundAborted"  # in time.sleep
    # the final round: rank 1's own error ends its process (no left record); rank 0's
    # collective fails, it leaves and is told to stop
    assert a1.finish() == 1 and "ValueError: a bug of the program" in a1.output()
    assert injob.wait_left(agent.store, rounds, [0], GUARD_S).keys() == {0}
    assert injob.get(agent.store, injob.round_key(rounds, "left", 1)) is None
    assert [f["detected_by"] for f in injob.faults(agent.store, rounds)] == ["rank:collective"]
    injob.post_verdict(agent.store, rounds, "stop", "rank 1: a deterministic error")
    assert a0.finish() == 1
    assert f"the job stops after round {rounds}: rank 1: a deterministic error" in a0.output()
    injob.end(agent.store, "stopped", 10)
    spare = agent.spares[0][1]
    # never assigned: exits quietly at the end (a checkout without the built extension
    # warns once at import that it uses the slower fallback: not the spare's saying)
    said = [line for line in spare.lines if "ckptstore.native" not in line and "import native" not in line]
    assert spare.finish() == 0 and said == [], spare.lines
    assert all(len(p) == 1 for p in pids.values())
    for rank in (0, 1):
        assert len(set(fds[rank][1:])) == 1, f"rank {rank} fds per round: {fds[rank]}"
        assert len(set(threads[rank][1:])) == 1, f"rank {rank} threads per round: {threads[rank]}"
    kept = [l for l in a1.lines if "still referred to" in l]
    assert len(kept) == 1 and "round 0: its process group or a subgroup of it (dist.new_group, a DeviceMesh) is still " \
        "referred to (by Holder)" in kept[0]
    assert "RuntimeWarning" in kept[0] and "built outside the training function" in kept[0]
    assert not any("still referred to" in l for l in a0.lines)
    print(f"\nnotice to first collective of the next round: median {statistics.median(lost) * 1000:.0f} ms, "
          f"max {max(lost) * 1000:.0f} ms over {rounds} rounds")


def test_plain_call_without_the_agent(monkeypatch):
    monkeypatch.delenv(injob.ENV_STORE, raising=False)
    assert inprocess.run(lambda a, *, b: (a, b), 1, b=2) == (1, 2)
    assert inprocess.round() == 0 and not inprocess.active()
    with inprocess.atomic():
        pass


def test_refused_programs(monkeypatch):
    def gen():
        yield 1

    async def coro():
        return 1

    for fn in (gen, coro):
        with pytest.raises(inprocess.InJobUnsupportedError, match="generator or coroutine"):
            inprocess.run(fn)
    monkeypatch.setenv(injob.ENV_STORE, "127.0.0.1:1")  # never reached: refused before connecting
    with pytest.raises(inprocess.InJobUnsupportedError, match="backend 'mpi'"):
        inprocess.run(lambda: None, backend="mpi")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(inprocess.InJobUnsupportedError, match="default process group exists already"):
            inprocess.run(lambda: None)
    finally:
        dist.destroy_process_group()


def test_abandon_aborts_settles_and_hides_an_in_flight_save(tmp_path):
    from ckptstore import lifecycle
    from ckptstore.checkpoint.save import SaveFuture
    from ckptstore.errors import CommitError
    from ckptstore.storage import LocalStorage

    assert lifecycle.abandon("nothing in flight", 1.0) == []
    storage = LocalStorage(str(tmp_path))
    # rank 1 of 2, waiting for an outcome that the dead peer will never make
    attempt = names.new_attempt_id()
    future = lifecycle.track(SaveFuture("test", 7, attempt, storage=storage, rank=1, world_size=2))
    try:
        assert lifecycle.abandon("in-job round 0 failed", GUARD_S) == [7]
        assert future.settled() and future.observed
        assert storage.exists(names.abort_name(attempt))
        assert not exiting.active()
    finally:  # what its commit thread does once it reads the marker
        future._future.set_exception(CommitError(f"attempt {attempt} was aborted"))
    lifecycle.raise_earlier_failure()  # seen: the next save does not raise it
    assert future not in lifecycle._failures.unseen()


def test_the_example_recovers_in_job_bit_identical(agents, tmp_path):
    """docs/examples/fault_tolerant_training.py under the fake agent: rank 0 SIGKILLed
    mid-run, the warm spare takes rank 0, rank 1 keeps its process; the result equals
    an in-job run without a fault, bit for bit."""
    import torch

    def example(name, spares, **env):
        # (the step delay keeps the job running for 2 s after the kill's step: the kill lands mid-run)
        args = [str(tmp_path / name), "--steps", "40", "--every", "2", "--step-delay", "0.05",
                "--final", str(tmp_path / f"{name}.pt")]
        return agents(args, None, world=2, spares=spares, script=EXAMPLE, **env)

    progress = tmp_path / "progress"
    progress.mkdir()
    clean = example("clean", 0)  # the reference, beside it
    agent = example("faulted", 1, CKPTSTORE_PROGRESS_DIR=str(progress))
    spare_worker, spare = agent.spares[0]
    assert injob.wait_for(agent.store, [injob.hello_key(spare_worker)], GUARD_S)
    assert injob.get(agent.store, injob.hello_key(spare_worker))["warm_s"] > 0  # build_model_once ran
    victim, survivor = agent.ranks[0], agent.ranks[1]
    victim.expect("rank 0: step 5 pid")
    t_kill = time.time()
    victim.proc.kill()
    victim.proc.wait(timeout=GUARD_S)
    agent.recover(0, [0], "SIGKILL")
    for rank, w in [*agent.ranks.items(), *clean.ranks.items()]:
        assert w.finish() == 0 and f"rank {rank}: done" in w.lines, "\n".join(w.lines)
        assert not any("still referred to" in l for l in w.lines), "\n".join(w.lines)
    restored = injob.marks(agent.store, 1, "restored", [0, 1])
    assert sorted(restored) == [0, 1] and restored[0]["step"] == restored[1]["step"] >= 2
    first = injob.marks(agent.store, 1, "first", [0, 1])
    assert sorted(first) == [0, 1]
    print(f"\nexample: kill to every rank's first step of round 1: "
          f"{(max(m['t'] for m in first.values()) - t_kill) * 1000:.0f} ms (resume "
          f"{[restored[r]['seconds'] for r in (0, 1)]} s, from step {restored[0]['step']}, tier {restored[0]['tier']})")
    assert "resumed at step" in "\n".join(survivor.lines)
    records = {r: json.loads((progress / f"rank-{r}.json").read_text()) for r in (0, 1)}
    assert records[0]["pid"] == spare.proc.pid and records[1]["pid"] == survivor.proc.pid
    assert records[0]["round"] == records[1]["round"] == 1
    got, want = torch.load(tmp_path / "faulted.pt"), torch.load(tmp_path / "clean.pt")
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k].view(torch.int32), want[k].view(torch.int32)), k
