"""``durable_every="auto"`` (issue 36 part 4; docs/design/in-job-restart.md 7.4,
ckptstore/durable_cadence.py): promote every sqrt(2 x P x M_cold) seconds, never while
a promotion is in flight, at least every 6 hours; M_cold from the journal's failures
that lose the memory tier (``status``'s ``mtbf_cold_s``); every rank promotes the same
steps whatever its own clock says."""

from __future__ import annotations

import json
import math
import os
import sys
import time

import pytest
import torch

import ckptstore
from ckptstore import durable_cadence as dc
from ckptstore.storage import LocalStorage
from ckptstore.supervisor import injob
from ckptstore.supervisor.injob import ENV_ROUND
from ckptstore.supervisor.journal import Journal, new_run_id
from ckptstore.supervisor.status import status, summarize

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from procs.harness import close_zygotes, free_port, start_zygotes  # noqa: E402


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


class Promotion:
    """A stand-in for a promotion's SaveFuture: done when ended, with its duration."""

    def __init__(self):
        self._done, self._callbacks = False, []

    def done(self):
        return self._done

    def add_done_callback(self, fn):
        self._callbacks.append(fn)

    def end(self, took):
        self.promotion_s, self._done = took, True
        for fn in self._callbacks:
            fn(self)


# ---------------------------------------------------------------------------- the policy
def test_the_interval_is_young_daly_on_the_promotion_and_the_cold_mtbf_capped_at_6_hours():
    assert dc.interval_s(2.0, 3600.0) == pytest.approx(math.sqrt(2 * 2.0 * 3600.0))  # 120 s
    assert dc.interval_s(30.0, 1e9) == dc.MAX_INTERVAL_S == 6 * 3600.0
    # a P or M that is not a positive finite number: its prior (hostile, or not measured yet)
    for bad in (None, 0, -1.0, math.nan, math.inf, True, "60"):
        assert dc.interval_s(bad, 3600.0) == pytest.approx(math.sqrt(2 * dc.PRIOR_PROMOTION_S * 3600.0))
        assert dc.interval_s(2.0, bad) == pytest.approx(math.sqrt(2 * 2.0 * dc.PRIOR_MTBF_COLD_S))


def test_any_rank_due_promotes_and_any_rank_busy_holds_it_back():
    assert dc.agreed([(True, False), (False, False)])
    assert not dc.agreed([(False, False), (False, False)])
    assert not dc.agreed([(True, False), (False, True)])  # never a queue of promotions


def test_a_process_promotes_its_first_save_then_once_per_interval_and_never_while_one_runs(monkeypatch):
    monkeypatch.delenv(ENV_ROUND, raising=False)
    clock = Clock()
    c = dc.Cadence(clock)
    c.mtbf_cold_s = 3600.0
    assert c.flags() == (True, False)  # round 0's first save: at once (it measures P)
    first = Promotion()
    c.note_promotion(10, first)
    clock.t += 1e6
    assert c.flags() == (True, True)  # due by the clock, but the first is still in flight
    first.end(2.0)
    assert c.promotion_s == 2.0 and c.flags() == (True, False)
    c.note_promotion(11, Promotion())
    second = c._in_flight[-1][0]
    second.end(2.0)
    clock.t += 119.0
    assert c.flags() == (False, False)  # sqrt(2 x 2 x 3600) = 120 s after the last one began
    clock.t += 1.0
    assert c.flags() == (True, False)
    assert list(c.promoted_steps) == [10, 11]
    first_failed = Promotion()  # a failed promotion's duration is P too (it held the durable path)
    c.note_promotion(12, first_failed)
    first_failed.end(8.0)
    assert c.promotion_s == 8.0 and c.interval_s() == pytest.approx(240.0)


def test_a_spare_of_a_later_round_counts_from_its_start_and_an_aborted_rounds_promotion_does_not_block(monkeypatch):
    clock = Clock()
    monkeypatch.setenv(ENV_ROUND, "0")
    c = dc.Cadence(clock)
    stuck = Promotion()  # round 0's, aborted with its round and never settled
    c.note_promotion(5, stuck)
    assert c.busy()
    monkeypatch.setenv(ENV_ROUND, "1")
    assert not c.busy()
    stuck.end(0.001)  # (ended by the abort: not a measure of P)
    assert c.promotion_s is None
    spare = dc.Cadence(clock)  # a warm spare starting in round 1
    assert spare.flags() == (False, False)
    clock.t += dc.interval_s(None, None)
    assert spare.due()


def test_the_cadence_is_one_per_process_and_durable_store():
    a = dc.for_store("s3://bucket/cadence-a")
    assert dc.for_store("s3://bucket/cadence-a") is a and dc.for_store("s3://bucket/cadence-b") is not a


# ---------------------------------------------------------------------------- mtbf_cold_s
def ev(kind, t, **fields):
    return {"kind": kind, "t": t, **fields}


def fail(t, attempt, klass="transient", **fields):
    return ev("failure", t, attempt=attempt, **{"class": klass}, **fields)


def test_status_counts_the_failures_that_lose_memory_and_not_in_job_recoveries_from_memory():
    events = [
        ev("run_start", 0.0), ev("attempt_start", 0.0, attempt=0), ev("resume", 5.0, attempt=0, step=None),
        fail(100.0, 0),  # cold; the next attempt resumed from durable: lost
        ev("attempt_start", 101.0, attempt=1), ev("resume", 110.0, attempt=1, step=50, tier="durable"),
        fail(200.0, 1, "hang"),  # cold, but the relaunch found the memory tier (one node): kept
        ev("attempt_start", 201.0, attempt=2), ev("resume", 210.0, attempt=2, step=90, tier="memory"),
        ev("recovery", 300.0, attempt=2, round=1, restore_from={"memory": [0], "peer": [1]}),  # kept
        ev("recovery", 300.5, attempt=2, round=1, restore_from={"durable": [1]}),  # a second node's copy: once
        ev("recovery", 400.0, attempt=2, round=2, restore_from={"memory": [0], "durable": [1]}),  # lost
        ev("recovery", 420.0, attempt=2, round=3, restore_from={"local": [1]}),  # a local tier in its place: kept
        ev("recovery_failed", 450.0, attempt=2, round=4, reason="x"),  # retried in-job: not a failure
        fail(500.0, 2, "preempted"),  # the scheduler's; its save went durable
        ev("attempt_start", 501.0, attempt=3), ev("resume", 510.0, attempt=3, step=120, tier="durable"),
        ev("in_job_gave_up", 590.0, attempt=3, round=1, reason="no spare"),
        fail(600.0, 3, reason="in-job recovery gave up: no spare"),  # cold, not resumed yet: lost
    ]
    s = summarize(events, now=1200.0)
    assert [f["loses_memory"] for f in s["failures"]] == [True, False, False, True, False, False, True]
    assert s["cold_failures"] == 3 and s["mtbf_cold_s"] == 400.0  # 1200 s / 3
    assert s["mtbf_s"] == 200.0  # 6 failures, the preemption left out: every failure counts there
    assert summarize(events[:3], now=50.0)["mtbf_cold_s"] is None  # none yet: durable_cadence's prior


def test_status_mtbf_cold_survives_hostile_journal_values():
    events = [ev("run_start", 0.0),
              fail(1e300, 0),  # taken into [0, now]
              fail(10.0, True), fail(11.0, 1 << 80), fail(12.0, "0", klass=["x"]),
              ev("recovery", 20.0, attempt=0, round=1, restore_from=["durable"]),  # not a dict: no evidence
              ev("recovery", 21.0, attempt=0, round=2, restore_from={"durable": "x" * 10}),
              ev("recovery", 22.0, attempt=0, round=3, restore_from=None),
              ev("resume", 30.0, attempt=1, tier={"memory": 1})]
    s = summarize(events, now=100.0)
    json.dumps(s, allow_nan=False)
    assert s["mtbf_cold_s"] is None or (0 < s["mtbf_cold_s"] <= 100.0)
    assert s["cold_failures"] == sum(f["loses_memory"] for f in s["failures"]) == 5


def test_m_cold_is_read_from_the_journal_once_per_process_and_never_in_a_later_round(tmp_path, monkeypatch):
    storage = LocalStorage(str(tmp_path / "store"))
    times = iter([time.time() - 100.0, time.time() - 99.0, time.time() - 50.0])
    journal = Journal(storage, new_run_id(), clock=lambda: next(times))
    journal.append("run_start", command=["x"], world_size=1, nnodes=1, hosts=["h"], policy={})
    journal.append("attempt_start", attempt=0)
    journal.append("failure", attempt=0, **{"class": "transient"}, reason="killed")
    assert 99.0 < dc.journal_mtbf_cold(storage) < 200.0  # the run's 100 s, one cold failure

    touched = []

    class Untouchable:  # the durable store, as a later round must not use it
        def __getattr__(self, name):
            touched.append(name)
            raise AssertionError(f"the durable store was used: {name}")

    monkeypatch.setenv(ENV_ROUND, "3")  # a later round: the durable store is not read
    c = dc.Cadence()
    assert c.read_mtbf_cold(Untouchable()) == dc.PRIOR_MTBF_COLD_S and c.mtbf_source == "prior"
    assert touched == []
    monkeypatch.setenv(ENV_ROUND, "0")
    c = dc.Cadence()
    assert c.read_mtbf_cold(storage) == pytest.approx(dc.journal_mtbf_cold(storage), abs=5.0)
    assert c.mtbf_source == "journal" and c.mtbf_cold_s < dc.PRIOR_MTBF_COLD_S
    c.mtbf_cold_s = 7.0
    assert c.read_mtbf_cold(Untouchable()) == 7.0 and touched == []  # once per process: kept
    assert dc.journal_mtbf_cold(LocalStorage(str(tmp_path / "none"))) is None


# ---------------------------------------------------------------------------- a Store
def state(step: int) -> dict:
    return {"w": torch.full((64,), float(step)), "step": step}


def test_a_store_with_durable_every_auto_promotes_by_the_cadence(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_ROUND, raising=False)
    store = ckptstore.Store(tmp_path / "durable", local=tmp_path / "local", durable_every="auto")
    assert store.durable_every == "auto" and store.durable_cadence is dc.for_store(store.url)
    for step in (1, 2, 3):
        store.save(step, state(step))
        ckptstore.wait()
    assert store.committed_steps() == [1]  # the first at once; then a day's prior M_cold says wait
    assert store.durable_cadence.promotion_s > 0  # measured by the Promoter
    store.durable_cadence.mtbf_cold_s = 1e-9  # failures that lose memory all the time: due at once
    for step in (4, 5):
        store.save(step, state(step))
        ckptstore.wait()
    assert store.committed_steps() == [1, 4, 5]
    got = ckptstore.Store(tmp_path / "durable").load(5)
    assert torch.equal(got["w"], state(5)["w"])
    # durable=True (a preemption's save) is promoted whatever the cadence says, as before
    store.durable_cadence.mtbf_cold_s = 1e12
    store.save(6, state(6), durable=True)
    ckptstore.wait()
    assert store.committed_steps() == [1, 4, 5, 6]


@pytest.mark.parametrize("bad", ["often", 0, 1.5, True])
def test_bad_durable_every_is_refused(tmp_path, bad, monkeypatch):
    with pytest.raises(ValueError, match="durable_every"):
        ckptstore.Store(tmp_path / "durable", local=tmp_path / "local", durable_every=bad)
    # memory="auto" outside ckptstore run is one tier: still refused there, not only in-job
    monkeypatch.delenv(injob.ENV_MEMORY_DIR, raising=False)
    with pytest.raises(ValueError, match="durable_every"):
        ckptstore.Store(tmp_path / "durable", memory="auto", durable_every=bad)


# ---------------------------------------------------------------------------- two ranks
@pytest.fixture(scope="module")
def zygotes():
    zs = start_zygotes(2)
    yield zs
    close_zygotes(zs)


def run_ranks(zygotes, scenario: str, tmp_path, timeout: float) -> dict[int, tuple[int, list[str]]]:
    port, children, results = free_port(), {}, {}
    try:
        for rank in range(2):
            children[rank] = zygotes[rank].run(
                "durable_auto_worker.py", scenario, tmp_path / "durable", tmp_path / "local", timeout,
                RANK=rank, WORLD_SIZE=2, LOCAL_RANK=rank, LOCAL_WORLD_SIZE=2, MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port, GLOO_SOCKET_IFNAME="lo")
        for rank, child in children.items():
            results[rank] = (child.finish(), child.lines)
            print(f"rank {rank}: {results[rank]}")
        return results
    finally:
        for child in children.values():
            if child.code is None:
                try:
                    child.kill()
                except ProcessLookupError:
                    pass
                child.finish()


@pytest.mark.parametrize("scenario", ["checkpointer", "raw"])
def test_ranks_with_different_due_times_promote_exactly_the_same_steps(zygotes, tmp_path, scenario):
    """Rank 0's clock says a promotion is due at every save, rank 1's only at its first:
    agreed (the Checkpointer's all-reduce, or the Store's gather) every rank promotes
    every step and each commits in the durable tier. Left to each rank, rank 0 would
    promote steps rank 1 never votes for (its commits time out)."""
    results = run_ranks(zygotes, scenario, tmp_path, timeout=6.0)
    for rank, (code, lines) in results.items():
        assert code == 0, (rank, lines)
        assert lines == ["promoted 1,2,3,4", "durable 1,2,3,4"], (rank, lines)
    assert ckptstore.Store(tmp_path / "durable").committed_steps() == [1, 2, 3, 4]


def test_the_checkpointer_reads_m_cold_at_resume_and_status_shows_it(tmp_path, monkeypatch):
    from ckptstore.cli.status import render

    monkeypatch.delenv(ENV_ROUND, raising=False)
    durable = tmp_path / "durable"
    times = iter([time.time() - 100.0, time.time() - 99.0, time.time() - 50.0])
    journal = Journal(LocalStorage(str(durable)), new_run_id(), clock=lambda: next(times))
    journal.append("run_start", command=["x"], world_size=1, nnodes=1, hosts=["h"], policy={})
    journal.append("attempt_start", attempt=0)
    journal.append("failure", attempt=0, **{"class": "transient"}, reason="killed")
    store = ckptstore.Store(durable, local=tmp_path / "local", durable_every="auto")
    ckpt = ckptstore.Checkpointer(store, state={"s": {"x": 1}}, rng=False, signals=())
    assert ckpt.resume() == 0
    assert store.durable_cadence.mtbf_source == "journal" and 99.0 < store.durable_cadence.mtbf_cold_s < 200.0
    s = status(LocalStorage(str(durable)))
    assert 99.0 < s["mtbf_cold_s"] < 200.0 and s["cold_failures"] == 1
    assert "MTBF cold" in render(s) and "1 failure(s) lost the memory tier" in render(s)


def test_a_forked_child_starts_with_no_cadence_of_its_parent():
    parent = dc.for_store("s3://bucket/cadence-fork")
    parent.note_promotion(3, Promotion())  # in flight in the parent, forever in a child
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            child = dc.for_store("s3://bucket/cadence-fork")
            os.write(w, b"%d" % (child is not parent and not child.busy() and not child.promoted_steps))
        finally:
            os._exit(0)
    os.close(w)
    assert os.read(r, 8) == b"1"
    os.waitpid(pid, 0)


def test_each_in_job_recovery_carries_its_own_breakdown_and_status_prints_the_last():
    from ckptstore.cli.status import render

    events = [ev("run_start", 0.0), ev("attempt_start", 0.0, attempt=0), ev("resume", 5.0, attempt=0, step=None),
              ev("recovery", 50.0, attempt=0, round=1, ranks=[1], reason="rank 1 was killed", detect_s=0.01,
                 teardown_s=0.02, decide_s=0.001, reform_s=0.09, restore_s=0.15, first_step_s=0.37,
                 restore_from={"memory": [0], "peer": [1]}, restored_step=20),
              ev("recovery", 60.0, attempt=0, round=2, ranks=[0], detect_s=-1.0, reform_s="x",
                 restore_from={"durable": "not a list"})]  # (hostile parts read as absent)
    s = summarize(events, now=100.0)
    first, second = (f for f in s["failures"] if f["recovered"] == "in_job")
    assert (first["detect_s"], first["reform_s"], first["restore_s"], first["first_step_s"]) == (0.01, 0.09, 0.15, 0.37)
    assert first["restore_from"] == {"memory": 1, "peer": 1}
    assert second["detect_s"] is None and second["reform_s"] is None and second["restore_from"] == {"durable": 0}
    text = render({**s, "run": "r", "started_at": None})
    assert "last recovery" in text and "round 2 in -" in text
    s["failures"], s["last_failure"] = s["failures"][:1], s["failures"][0]
    assert ("round 1 in 0.37s (detect 0.01, teardown 0.02, re-form 0.09, restore 0.15), restored from memory 1, "
            "peer 1") in render({**s, "run": "r", "started_at": None})
