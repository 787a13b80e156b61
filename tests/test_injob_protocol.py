"""The in-job recovery protocol's records (ckptstore/supervisor/injob.py) on a
``HashStore``, in one process: create-only records, one verdict per round, bounded
waits, the faults of a round, membership and marks (docs/design/in-job-restart.md,
section 6, invariants R1-R4)."""

from __future__ import annotations

import threading

import pytest
from torch.distributed import HashStore

from ckptstore.supervisor import injob


@pytest.fixture
def store():
    return injob.attempt_store(HashStore(), injob.attempt_prefix("run1", 0))


def test_create_is_create_only_and_says_who_won(store):
    won, held = injob.create(store, "k", {"v": 1})
    assert (won, held) == (True, {"v": 1})
    won, held = injob.create(store, "k", {"v": 2})
    assert (won, held) == (False, {"v": 1})  # the first writer's record stands, and is what the loser reads
    assert injob.get(store, "k")["v"] == 1


def test_R2_a_rounds_verdict_is_written_once(store):
    first = injob.post_verdict(store, 3, "continue", "rank 1 died", next_round=4)
    second = injob.post_verdict(store, 3, "cold", "too late")
    assert (first["action"], first["next_round"]) == ("continue", 4)
    assert second["action"] == "continue"  # the later verdict is refused: every reader sees one
    assert injob.verdict(store, 3)["action"] == "continue"
    assert injob.verdict(store, 4) is None
    with pytest.raises(ValueError, match="not one of"):
        injob.post_verdict(store, 5, "retry")


def test_the_first_fault_notice_stands_and_every_notice_is_listed(store):
    assert injob.post_fault(store, 0, ranks=[1], cause="killed by SIGKILL", detected_by="agent:exit", t=10.0)
    assert not injob.post_fault(store, 0, ranks=[], cause="Connection closed by peer", detected_by="rank:collective")
    assert not injob.post_fault(store, 0, ranks=[2, 2], cause="killed", detected_by="agent:exit")
    assert injob.get(store, injob.round_key(0, "fault"))["detected_by"] == "agent:exit"
    listed = injob.faults(store, 0)
    assert [f["detected_by"] for f in listed] == ["agent:exit", "rank:collective", "agent:exit"]
    assert injob.failed_ranks(store, 0) == {1, 2}
    assert injob.faults(store, 1) == [] and injob.failed_ranks(store, 1) == set()


def test_R4_waits_are_bounded_and_a_stop_flag_ends_them(store):
    assert injob.wait_for(store, ["never"], timeout_s=0.05) is False
    stop = threading.Event()
    stop.set()
    assert injob.wait_for(store, ["never"], timeout_s=600, stop=stop) is False  # returns at once, not in 600 s
    assert injob.wait_record(store, "never", 0.01) is None
    injob.put(store, "there", {"x": 1})
    assert injob.wait_record(store, "there", 0.01) == {"x": 1}


def test_wait_left_returns_only_the_ranks_that_left(store):
    injob.post_left(store, 2, 0, step=17, teardown_s=0.01, abandoned=[16])
    got = injob.wait_left(store, 2, [0, 1], timeout_s=0.05)
    assert set(got) == {0} and got[0]["step"] == 17 and got[0]["abandoned"] == [16]


def test_membership_assignment_marks_fence_and_end(store):
    injob.say_hello(store, "n0-w2", spare=True, node=0, warm_s=0.5)
    assert injob.get(store, injob.hello_key("n0-w2"))["spare"] is True
    injob.assign(store, "n0-w2", round_=1, rank=1, local_rank=1, world=2, local_world=2, node=0)
    assert injob.get(store, injob.assign_key("n0-w2"))["rank"] == 1
    injob.post_members(store, 1, {0: {"worker": "n0-w0"}, 1: {"worker": "n0-w2"}})
    assert injob.members(store, 1) == {0: {"worker": "n0-w0"}, 1: {"worker": "n0-w2"}}
    injob.post_mark(store, 1, "restored", 1, step=9, tier="memory", seconds=0.01)
    assert set(injob.marks(store, 1, "restored", [0, 1])) == {1}
    assert injob.fence(store) is None
    injob.set_fence(store, 1)
    assert injob.fence(store) == 1
    assert injob.ended(store) is None
    injob.end(store, "finished")
    injob.end(store, "cold")  # the first end stands
    assert injob.ended(store)["reason"] == "finished"


def test_records_are_read_as_untrusted(store):
    store.set("junk", b"\xff not json")
    store.set("list", "[1, 2]")
    assert injob.get(store, "junk") is None and injob.get(store, "list") is None
    store.set(injob.round_key(0, "members"), '{"x": {}, "1": "no", "2": {"worker": "w"}}')
    assert injob.members(store, 0) == {2: {"worker": "w"}}


def test_R1_each_round_bootstraps_under_its_own_prefix(store):
    injob.round_pg_store(store, 0).set("k", "round 0")
    assert not injob.round_pg_store(store, 1).check(["k"])


def test_the_agent_stops_and_joins_its_beat_before_the_process_ends():
    """A daemon thread still inside a TCPStore call when the interpreter finalizes is
    ended by a forced unwind that aborts the process ("terminate called without an
    active exception": a leader that wrote its result then died by SIGABRT, seen in CI):
    the agent's close stops its beat and waits for its last call."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from ckptstore.supervisor.agent import InJobAgent
    from ckptstore.supervisor.injob_nodes import Beat

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    beat = Beat(f"127.0.0.1:{server.port}", "run/0/", 1)
    beat.start()
    agent = object.__new__(InJobAgent)  # (only what close() reads)
    agent.beat, agent.replica, agent.alive, agent.beats = beat, None, None, None
    agent.close()
    assert not beat.is_alive() and agent.beat is None
    assert int(injob.attempt_store(server, "run/0/").add(injob.agent_key(1, "beat"), 0)) >= 1  # it did beat
