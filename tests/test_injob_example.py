"""``ckptstore run --in-job`` on the docs example (tests/procs/supervised_train.py: the
example through ``ckptstore.inprocess.run``, faults injected), 2 CPU ranks, one warm
spare: SIGKILLed ranks and a hung rank are recovered inside the attempt (the survivor
keeps its process, the spare takes the dead rank's number), each state comes back from
the node's memory tier, and the run ends bit-identical to an uninterrupted one."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from jobutil import assert_bit_identical  # noqa: E402
from test_supervisor import Supervised, journal, kinds, reference, status  # noqa: E402,F401


def _in_job(tmp_path, *extra, fault="none:-1") -> Supervised:
    # no --in-job: it is ckptstore run's default for a script that calls ckptstore.inprocess.run
    return Supervised(tmp_path / "store", tmp_path, "--memory-dir", str(tmp_path / "shm"), *extra, fault=fault,
                      in_job=True)


def test_ranks_killed_three_times_recover_in_job_from_memory_bit_identical(tmp_path, reference):
    job = _in_job(tmp_path)
    survivors = set()
    for rank, step in ((1, 4), (0, 11), (1, 19)):
        job.at_step(rank, step)
        victim, survivor = job.pids[rank], job.pids[1 - rank]
        os.kill(victim, 9)
        # the other rank keeps its process: its next step line carries the same pid
        job.expect(lambda line, s=survivor: line.startswith(f"rank {1 - rank}: step ") and line.endswith(f"pid {s}")
                   and job.pids.get(rank) not in (None, victim), f"rank {rank} replaced, rank {1 - rank} kept")
        survivors.add(survivor)
    assert job.finish() == 0, job.output()[-3000:]
    assert "ckptstore run: recovery: in-job" in job.output()  # the default, said at launch
    assert_bit_identical(job.final, reference)
    events = journal(tmp_path / "store")
    recoveries = kinds(events, "recovery")
    assert len(recoveries) == 3, events
    assert not kinds(events, "failure"), "every failure was recovered in the attempt"
    assert len(kinds(events, "attempt_start")) == 1
    for rec in recoveries:
        assert rec["restore_from"].get("memory") and not rec["restore_from"].get("durable"), rec
        assert rec["lost_steps"] < 10  # a save every 5 steps (one may be in flight when the rank dies)
    st = status(tmp_path / "store")
    assert st["restarts"] == 0
    assert [f.get("recovered") for f in st["failures"]] == ["in_job"] * 3
    assert not (tmp_path / "shm").exists() or not any((tmp_path / "shm").rglob("*.json")), \
        "the memory tier is removed at the end"


def test_a_hung_rank_is_woken_and_the_job_recovers_in_job(tmp_path, reference):
    marker = tmp_path / "hung-once"
    job = _in_job(tmp_path, "--hang-timeout", "3", fault=f"hang:8:{marker}")
    job.expect(lambda line: line == "rank 1: stopped at step 8", "rank 1 hanging")
    assert job.finish() == 0, job.output()[-3000:]
    assert_bit_identical(job.final, reference)
    recoveries = kinds(journal(tmp_path / "store"), "recovery")
    assert len(recoveries) == 1 and recoveries[0]["detected_by"] == "agent:hang", recoveries


def test_a_stopped_rank_is_replaced_without_waiting_out_the_abort_timeout(tmp_path, reference):
    """SIGSTOP: a process that runs no code cannot leave the round; the agent sees its
    state and replaces it at once (an abort timeout of 10 min would otherwise hold the run)."""
    job = _in_job(tmp_path, "--hang-timeout", "3", "--abort-timeout", "600")
    job.at_step(1, 6)
    os.kill(job.pids[1], 19)  # SIGSTOP
    assert job.finish() == 0, job.output()[-3000:]
    assert_bit_identical(job.final, reference)
    [rec] = kinds(journal(tmp_path / "store"), "recovery")
    assert rec["detected_by"] == "agent:hang" and rec["ranks"] == [1], rec
    assert "was stopped (SIGSTOP or a tracer)" in rec["reason"], rec
