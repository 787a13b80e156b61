"""The run journal (ckptstore.supervisor.journal), the status summary (supervisor.status)
and ``ckptstore status``.

What is checked: events round-trip on local disk, memory and a moto S3 server, named
so they sort by time, written create-only; run ids follow their grammar; a hostile
journal (oversized, not JSON, a list, a foreign name, a symlink) is read around, each
bad event counted, never raised; summarize() gives the exact figures its docstring
defines (restarts, failures by class, MTBF, lost work, startup and recovery, goodput,
Young/Daly with a measured MTBF and with the prior); status() finds the newest
committed step; the click command prints JSON and text and exits 0 / 1 / 2; gc, ls and
verify neither delete nor report a journal. Issue 34: an event nested too deep is
unreadable, a field of any wrong type is no figure, an event's time is its name's and
no later than now, and the recommended interval has a maximum: no journal crashes
``status`` or stops ``every="auto"`` from saving.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re

import pytest
import torch
from click.testing import CliRunner

import ckptstore
from ckptstore.cli_status import render
from ckptstore.cli_status import status as status_cmd
from ckptstore.errors import AlreadyExistsError
from ckptstore.storage import LocalStorage, MemoryStorage, open_storage
from ckptstore.supervisor import journal as jmod
from ckptstore.supervisor.journal import (
    JOURNAL_DIR,
    MAX_EVENT_BYTES,
    Journal,
    is_run_id,
    latest_run,
    new_run_id,
    parse_event_name,
    runs,
)
from ckptstore.supervisor.status import PRIOR_MTBF_S, newest_checkpoint, status, summarize
from cliutil import age_files, cli, files_below

T0 = 1_700_000_000.0  # a fixed clock start: event names and times are exact


def clock(start: float = T0, step: float = 1.0):
    ticks = itertools.count()
    return lambda: start + step * next(ticks)


def write_run(storage, run="run-1", start=T0):
    j = Journal(storage, run, clock=clock(start))
    written = [j.append("run_start", command=["train.py", "--lr", "0.1"], world_size=2, nnodes=1,
                        policy={"max_restarts": 3}),
               j.append("attempt_start", attempt=0),
               j.append("resume", attempt=0, step=None, skipped=[], first_step_s=0.5),
               j.append("failure", attempt=0, reason="rank 1 killed by SIGKILL", exit_code=None, signal="SIGKILL",
                        rank=1, traceback=None, step=12, checkpoint_step=10, checkpoint_age_s=4.0, lost_steps=2,
                        lost_s=0.25, save_blocking_s=0.125, step_s=0.0625, **{"class": "transient"})]
    return j, written


# ---------------------------------------------------------------------------- round trip
def check_round_trip(storage):
    j, written = write_run(storage)
    assert j.events() == written
    assert [e["kind"] for e in written] == ["run_start", "attempt_start", "resume", "failure"]
    first = written[0]
    assert (first["run"], first["t"], first["host"]) == ("run-1", T0, os.uname().nodename)
    assert first["at"] == "2023-11-14T22:13:20.000000+00:00"  # T0 in ISO UTC
    assert first["command"] == ["train.py", "--lr", "0.1"] and first["policy"] == {"max_restarts": 3}
    assert written[3]["class"] == "transient" and written[3]["lost_s"] == 0.25
    leaves = storage.list(f"{JOURNAL_DIR}/run-1")
    assert len(leaves) == 4
    assert [parse_event_name(n) for n in leaves] == [(T0 + i, k) for i, k in
                                                      enumerate(["run_start", "attempt_start", "resume", "failure"])]
    assert leaves[0].startswith(f"{int(T0 * 1e6):016d}-") and leaves[0].endswith("-run_start.json")
    assert runs(storage) == ["run-1"] and latest_run(storage) == "run-1"
    reading = j.read()
    assert (reading.unreadable, reading.ignored, reading.truncated) == (0, 0, 0)


def test_round_trip_local(tmp_path):
    check_round_trip(LocalStorage(tmp_path / "store"))


def test_round_trip_memory():
    check_round_trip(MemoryStorage())


@pytest.fixture
def s3env(monkeypatch):
    pytest.importorskip("boto3")
    pytest.importorskip("moto.server")
    import s3util

    endpoint = s3util.moto_endpoint()
    s3util.point_boto3_at(endpoint, monkeypatch)
    bucket = s3util.new_bucket(endpoint)
    yield bucket
    s3util.empty_bucket(bucket, endpoint)


def test_round_trip_s3(s3env):
    storage = open_storage(f"s3://{s3env}/runs/exp")
    check_round_trip(storage)
    # the same store through its URL, as ckptstore status opens it
    assert status(open_storage(f"s3://{s3env}/runs/exp"), now=T0 + 10)["restarts"] == 0


def test_events_sort_by_time_across_writers():
    storage = MemoryStorage()
    a = Journal(storage, "r", clock=clock(T0, 2.0))  # node A: T0, T0+2, T0+4
    b = Journal(storage, "r", clock=clock(T0 + 1, 2.0))  # node B: T0+1, T0+3
    for i in range(3):
        a.append("attempt_start", attempt=i)
        if i < 2:
            b.append("attempt_start", attempt=10 + i)
    assert [e["attempt"] for e in a.events()] == [0, 10, 1, 11, 2]


def test_append_is_create_only(monkeypatch):
    storage = MemoryStorage()
    j = Journal(storage, "r", clock=lambda: T0)
    monkeypatch.setattr(jmod.secrets, "token_hex", lambda n: "ab" * n)  # force the same name twice
    j.append("attempt_start", attempt=0)
    with pytest.raises(AlreadyExistsError):
        j.append("attempt_start", attempt=1)
    assert [e["attempt"] for e in j.events()] == [0]  # the first event is untouched


def test_run_ids():
    for good in ("a", "run-1", "20240101T000000-abc123", "A.b_c-9", "x" * 64):
        assert is_run_id(good) and Journal(MemoryStorage(), good).run_id == good
    for bad in ("", "-a", ".a", "a/b", "..", "a b", "x" * 65, "attempts", None, 5, "é"):
        assert not is_run_id(bad)
        with pytest.raises(ValueError):
            Journal(MemoryStorage(), bad)
    rid = new_run_id()
    assert is_run_id(rid) and len(rid) == 22 and rid[8] == "T" and rid[15] == "-"
    assert int(rid[16:], 16) >= 0


def test_append_refuses_bad_kinds_fields_and_sizes():
    j = Journal(MemoryStorage(), "r", clock=lambda: T0)
    for kind in ("", "Run", "a-b", "a" * 33, "../x"):
        with pytest.raises(ValueError):
            j.append(kind)
    for reserved in ("kind", "run", "at", "t", "host"):
        with pytest.raises(ValueError, match="set by the journal"):
            j.append("failure", **{reserved: 1})
    with pytest.raises(ValueError, match="exceeds"):
        j.append("failure", traceback="x" * MAX_EVENT_BYTES)
    assert j.events() == []
    e = j.append("failure", lost_s=float("nan"), nested={"x": [float("inf"), 1.5]})
    assert e["lost_s"] is None and e["nested"] == {"x": [None, 1.5]}
    assert j.events() == [e]


# ---------------------------------------------------------------------------- hostile journals
def test_hostile_events_are_skipped_and_counted(tmp_path):
    root = tmp_path / "store"
    storage = LocalStorage(root)
    j, written = write_run(storage)
    d = f"{JOURNAL_DIR}/run-1"
    us = int(T0 * 1e6) + 500_000  # between the first two good events

    def name(i, kind="failure"):
        return f"{d}/{us + i:016d}-0000000{i}-{kind}.json"

    storage.put(name(1), b"{" + b" " * MAX_EVENT_BYTES + b"}")  # oversized
    storage.put(name(2), b"not json")
    storage.put(name(3), b"[1, 2, 3]")  # a list
    storage.put(name(4), json.dumps({"kind": "finish"}).encode())  # kind differs from its name
    storage.put(name(5), b'{"kind": "failure", "lost_s": NaN}')  # not strict JSON
    storage.put(name(6), b'{"kind": "failure", "kind": "failure"}')  # duplicate key
    storage.put(name(7), json.dumps({"kind": 7}).encode())  # kind not a str
    outside = tmp_path / "elsewhere.json"
    outside.write_text(json.dumps({"kind": "failure", "t": T0}))
    os.symlink(outside, root / name(8))  # a valid name that is a symlink: never followed
    storage.put(f"{d}/notes.txt", b"{}")  # names outside the grammar: ignored, not read
    storage.put(f"{d}/{us:016d}-xyz-failure.json", json.dumps({"kind": "failure"}).encode())
    storage.put(f"{d}/sub/{us:016d}-00000000-failure.json", json.dumps({"kind": "failure"}).encode())
    # an event without a usable time gets the time its name says (a time too large for a
    # float is not one either)
    storage.put(name(9, "resume"), json.dumps({"kind": "resume", "t": "soon"}).encode())
    storage.put(f"{d}/{us + 10:016d}-0000000a-resume.json", json.dumps({"kind": "resume", "t": 10**400,
                                                "checkpoint_age_s": 10**400, "step": 3}).encode())

    reading = j.read()
    assert (reading.unreadable, reading.ignored, reading.truncated) == (8, 3, 0)
    assert [e["kind"] for e in reading.events] == ["run_start", "resume", "resume", "attempt_start", "resume",
                                                   "failure"]
    assert reading.events[1]["t"] == (us + 9) / 1e6 and reading.events[2]["t"] == (us + 10) / 1e6
    assert [e for e in reading.events if e not in reading.events[1:3]] == written
    summary = status(storage, now=T0 + 10)
    assert summary["journal"] == {"unreadable": 8, "ignored": 3, "truncated": 0}
    json.dumps(summary)


def test_hostile_run_directories_are_not_runs(tmp_path):
    root = tmp_path / "store"
    storage = LocalStorage(root)
    write_run(storage, "good")
    elsewhere = tmp_path / "elsewhere"
    write_run(LocalStorage(elsewhere), "linked")
    os.symlink(elsewhere / JOURNAL_DIR / "linked", root / JOURNAL_DIR / "linked")
    storage.put(f"{JOURNAL_DIR}/attempts/x.json", b"{}")  # reserved: a journal never looks like a location
    storage.put(f"{JOURNAL_DIR}/-bad/x.json", b"{}")
    storage.put(f"{JOURNAL_DIR}/plainfile", b"{}")
    assert runs(storage) == ["good"]
    assert latest_run(storage) == "good"
    assert Journal(storage, "linked").read().events == []  # a symlinked run directory lists nothing


def test_events_read_are_capped(monkeypatch):
    storage = MemoryStorage()
    j = Journal(storage, "r", clock=clock())
    for i in range(8):
        j.append("attempt_start", attempt=i)
    monkeypatch.setattr(jmod, "MAX_EVENTS", 5)
    reading = j.read()
    assert [e["attempt"] for e in reading.events] == [0, 4, 5, 6, 7]  # the first and the newest
    assert reading.truncated == 3


def test_latest_run_is_the_one_with_the_newest_event():
    storage = MemoryStorage()
    assert runs(storage) == [] and latest_run(storage) is None
    Journal(storage, "b-older", clock=clock(T0)).append("run_start")
    late = Journal(storage, "a-newer", clock=clock(T0 - 100, 200))  # starts earlier, writes later
    late.append("run_start")
    late.append("attempt_start", attempt=0)
    assert runs(storage) == ["a-newer", "b-older"]
    assert latest_run(storage) == "a-newer"


# ---------------------------------------------------------------------------- summarize
def ev(kind, t, **fields):
    return {"kind": kind, "t": float(t), "run": "r", "at": f"at-{t}", "host": "h", **fields}


def fail(t, attempt, klass, **fields):
    return ev("failure", t, attempt=attempt, reason=f"{klass} at {t}", **{"class": klass}, **fields)


def test_summarize_a_run_with_three_kinds_of_failure():
    events = [
        ev("run_start", 0, command=["x"], world_size=4, nnodes=2, policy={}),
        ev("attempt_start", 1, attempt=0),
        ev("resume", 11, attempt=0, step=None, skipped=[], first_step_s=10.0),
        fail(100, 0, "transient", step=50, lost_steps=5, lost_s=20.0, checkpoint_age_s=20.0,
             save_blocking_s=2.0, step_s=0.5),
        ev("attempt_start", 105, attempt=1),
        ev("resume", 120, attempt=1, step=45, skipped=[], first_step_s=15.0),
        fail(300, 1, "preempted", step=200, lost_steps=0, lost_s=0.0),
        ev("attempt_start", 301, attempt=2),
        ev("resume", 310, attempt=2, step=200, skipped=[190], first_step_s=9.0),
        fail(500, 2, "hang", step=400, lost_steps=10, lost_s=30.0, save_blocking_s=4.0, step_s=1.0),
        ev("attempt_start", 510, attempt=3),
        ev("resume", 530, attempt=3, step=390, skipped=[], first_step_s=20.0),
        ev("finish", 1000, attempt=3, step=900, save_blocking_s=3.0, step_s=0.8),
    ]
    s = summarize(events, now=5000.0, checkpoint={"step": 900, "committed_at_t": 4990.0})
    assert (s["state"], s["run"], s["started_at"], s["step"]) == ("finished", "r", "at-0", 900)
    assert (s["wall_s"], s["restarts"], s["attempts"]) == (1000.0, 3, 4)  # wall ends at finish, not now
    assert s["failures_by_class"] == {"transient": 1, "deterministic": 0, "hang": 1, "preempted": 1}
    assert [(f["attempt"], f["class"], f["step"], f["lost_steps"], f["lost_s"]) for f in s["failures"]] == [
        (0, "transient", 50, 5, 20.0), (1, "preempted", 200, 0, 0.0), (2, "hang", 400, 10, 30.0)]
    assert s["failures"][0]["checkpoint_age_s"] == 20.0 and s["failures"][0]["at"] == "at-100"
    assert s["mtbf_s"] == 500.0  # 1000 s / 2 failures: the preemption is not counted
    assert (s["lost_steps"], s["lost_s"]) == (15, 50.0)
    assert s["startup_s"] == 10.0  # attempt 0's first_step_s
    assert s["recovery_s"] == (120 - 100) + (310 - 300) + (530 - 500)
    assert s["goodput"] == pytest.approx((1000 - 10 - 60 - 50) / 1000)
    assert s["checkpoint_age_s"] == 10.0 and s["checkpoint_step"] == 900
    assert s["last_failure"]["class"] == "hang" and s["last_failure"]["reason"] == "hang at 500"
    # Young/Daly: C = the latest save cost (finish: 3 s), M = the observed MTBF
    assert (s["save_blocking_s"], s["step_s"], s["mtbf_source"]) == (3.0, 0.8, "observed")
    assert s["recommended_interval_s"] == pytest.approx(math.sqrt(2 * 3.0 * 500.0))  # 54.77 s
    assert s["recommended_interval_steps"] == 68  # round(54.77 / 0.8)
    assert json.loads(json.dumps(s)) == s  # JSON-able as it is


def test_summarize_without_failures_uses_the_prior():
    events = [ev("run_start", 0), ev("attempt_start", 0, attempt=0),
              ev("resume", 5, attempt=0, step=None, skipped=[], first_step_s=4.0),
              ev("finish", 100, attempt=0, step=400, save_blocking_s=1.5, step_s=0.25)]
    s = summarize(events, now=1e9)
    assert (s["state"], s["restarts"], s["failures"], s["mtbf_s"], s["last_failure"]) == ("finished", 0, [], None, None)
    assert s["goodput"] == pytest.approx(0.96)  # (100 - 4) / 100
    assert s["mtbf_source"] == "prior" and PRIOR_MTBF_S == 86400.0
    assert s["recommended_interval_s"] == pytest.approx(math.sqrt(2 * 1.5 * 86400.0))  # 509.1 s
    assert s["recommended_interval_steps"] == 2036  # round(509.12 / 0.25)
    assert s["checkpoint_age_s"] is None


def test_summarize_recommends_nothing_until_measured():
    base = [ev("run_start", 0), ev("attempt_start", 0, attempt=0)]
    s = summarize(base, now=50.0)
    assert (s["recommended_interval_s"], s["recommended_interval_steps"]) == (None, None)
    assert (s["state"], s["wall_s"], s["startup_s"], s["goodput"]) == ("running", 50.0, 50.0, 0.0)  # no step yet
    s = summarize(base + [fail(10, 0, "transient", save_blocking_s=2.0)], now=50.0)  # no step time yet
    assert s["recommended_interval_s"] == pytest.approx(math.sqrt(2 * 2.0 * 50.0))
    assert s["recommended_interval_steps"] is None


def test_summarize_a_run_that_gave_up():
    events = [ev("run_start", 0), ev("attempt_start", 0, attempt=0),
              ev("resume", 10, attempt=0, step=None, skipped=[], first_step_s=10.0),
              fail(50, 0, "deterministic", step=7, lost_steps=7, lost_s=40.0),
              ev("attempt_start", 51, attempt=1), ev("resume", 60, attempt=1, step=None, skipped=[], first_step_s=9.0),
              fail(70, 1, "deterministic", step=7, lost_steps=7, lost_s=10.0),
              ev("give_up", 71, reason="same error twice at step 7", code=3, **{"class": "deterministic"})]
    s = summarize(events, now=1e6)
    assert (s["state"], s["wall_s"], s["restarts"]) == ("gave_up", 71.0, 1)
    assert s["give_up"] == {"reason": "same error twice at step 7", "code": 3, "class": "deterministic", "at": "at-71"}
    assert s["recovery_s"] == (60 - 50) + (71 - 70)  # down from the last failure to the give-up
    assert s["goodput"] == pytest.approx((71 - 10 - 11 - 50) / 71)  # = 0: clamped at 0, not below
    assert s["goodput"] == 0.0
    assert s["mtbf_s"] == 35.5


def test_summarize_is_down_while_waiting_to_restart():
    events = [ev("run_start", 0), ev("attempt_start", 0, attempt=0),
              ev("resume", 2, attempt=0, step=None, skipped=[], first_step_s=2.0),
              fail(150, 0, "transient", lost_s=8.0)]
    s = summarize(events, now=200.0)
    assert (s["state"], s["wall_s"], s["recovery_s"]) == ("running", 200.0, 50.0)
    assert s["goodput"] == pytest.approx((200 - 2 - 50 - 8) / 200)


def test_summarize_counts_one_failure_per_attempt_and_startup_failures():
    # attempt 0 fails before its first step; two nodes journal the failure of attempt 1
    events = [ev("run_start", 0), ev("attempt_start", 1, attempt=0), fail(5, 0, "transient"),
              ev("attempt_start", 6, attempt=1), ev("attempt_start", 6, attempt=1),
              ev("resume", 20, attempt=1, step=None, skipped=[], first_step_s=14.0),
              fail(60, 1, "transient", lost_steps=3), fail(61, 1, "hang", lost_steps=3),
              ev("attempt_start", 62, attempt=2), ev("resume", 70, attempt=2, step=None, skipped=[], first_step_s=8.0)]
    s = summarize(events, now=100.0)
    assert (s["restarts"], len(s["failures"]), s["lost_steps"]) == (2, 2, 3)
    assert s["failures_by_class"]["transient"] == 2 and s["failures_by_class"]["hang"] == 0
    assert s["startup_s"] == 20.0  # no step in attempt 0: from the start to the first resume
    assert s["recovery_s"] == 10.0  # 60 -> 70; the failure at 5 is part of the startup
    assert s["goodput"] == pytest.approx(0.7)


def test_summarize_unhealthy_and_empty():
    s = summarize([ev("run_start", 0), ev("unhealthy", 3, checks=[{"name": "gpu", "ok": False, "detail": "ECC"}])],
                  now=100.0)
    assert (s["state"], s["wall_s"]) == ("unhealthy", 3.0)
    assert s["unhealthy"]["checks"] == [{"name": "gpu", "ok": False, "detail": "ECC"}]
    e = summarize([], now=1.0)
    assert (e["state"], e["run"], e["goodput"], e["restarts"], e["failures"]) == ("empty", None, None, 0, [])


def test_summarize_never_raises_on_hostile_fields():
    events = [ev("run_start", 0), {"kind": "failure"}, "not a dict", ev("attempt_start", 1, attempt=True),
              ev("failure", 2, attempt="0", reason=5, lost_steps="9", lost_s=[1], save_blocking_s=-3,
                 step_s=True, **{"class": ["x"]}),
              ev("resume", 3, attempt=0, first_step_s="soon"), ev("finish", 4, step=2.5)]
    s = summarize(events, now=10.0, checkpoint={"step": "x", "committed_at_t": None})
    assert (s["state"], s["lost_steps"], s["lost_s"]) == ("finished", 0, 0.0)
    assert (s["save_blocking_s"], s["step_s"]) == (None, None)
    assert [f["class"] for f in s["failures"]] == ["unknown"] and s["failures"][0]["reason"] is None
    assert s["checkpoint_step"] is None and s["checkpoint_age_s"] is None and s["step"] is None
    assert s["startup_s"] == 3.0  # first_step_s unusable: resume time - start
    json.dumps(s)


# ---------------------------------------------------------------------------- status() on a store
def small_state(i: int) -> dict:
    return {"w": torch.full((4,), float(i)), "step": i}


def test_status_reads_the_latest_run_and_the_newest_checkpoint(tmp_path):
    url = tmp_path / "store"
    store = ckptstore.Store(url)
    store.save(1, small_state(1)).result()
    store.save(2, small_state(2)).result()
    storage = open_storage(str(url))
    assert status(storage)["run"] is None and status(storage)["state"] == "empty"
    write_run(storage, "old", start=T0 - 1000)
    write_run(storage, "new")
    committed = newest_checkpoint(storage)
    assert committed["step"] == 2
    assert committed["committed_at_t"] == ckptstore.format.parse_time(store.manifest(2).committed_at)
    s = status(storage, now=committed["committed_at_t"] + 7.0)
    assert (s["run"], s["checkpoint_step"], s["checkpoint_age_s"]) == ("new", 2, pytest.approx(7.0))
    assert (s["restarts"], s["failures_by_class"]["transient"], s["lost_steps"]) == (0, 1, 2)
    assert status(storage, "old", now=T0)["run"] == "old"
    assert newest_checkpoint(MemoryStorage()) is None


# ---------------------------------------------------------------------------- the command
def run_status(*args):
    return CliRunner().invoke(status_cmd, list(args), catch_exceptions=False)


def test_status_command_json_and_text(tmp_path):
    url = str(tmp_path / "store")
    ckptstore.Store(url).save(3, small_state(3)).result()
    write_run(open_storage(url))
    r = run_status(url, "--json")
    assert r.exit_code == 0, r.output
    s = json.loads(r.output)
    assert (s["run"], s["state"], s["restarts"], s["checkpoint_step"]) == ("run-1", "running", 0, 3)
    assert [(f["class"], f["step"], f["lost_steps"]) for f in s["failures"]] == [("transient", 12, 2)]
    assert s["recommended_interval_steps"] == max(1, round(math.sqrt(2 * 0.125 * s["mtbf_s"]) / 0.0625))
    assert 0.0 <= s["goodput"] <= 1.0
    r = run_status(url, "--run", "run-1")
    assert r.exit_code == 0, r.output
    assert "state" in r.output and "running" in r.output and "transient 1" in r.output
    assert "rank 1 killed by SIGKILL" in r.output and "goodput" in r.output and "%" in r.output


def test_status_command_exit_codes(tmp_path):
    url = str(tmp_path / "store")
    ckptstore.Store(url).save(1, small_state(1)).result()
    r = run_status(url)
    assert r.exit_code == 1 and "no run journal" in r.output
    write_run(open_storage(url))
    r = run_status(url, "--run", "other", "--json")
    assert r.exit_code == 1 and "no journal for run other" in r.output
    r = run_status(url, "--run", "../x")
    assert r.exit_code == 2 and "not a run id" in r.output
    r = run_status(str(tmp_path / "missing"))
    assert r.exit_code == 2 and "cannot open" in r.output


def test_render_a_finished_run_with_advice():
    s = summarize([ev("run_start", 0), ev("attempt_start", 0, attempt=0),
                   ev("resume", 5, attempt=0, step=None, skipped=[], first_step_s=4.0),
                   ev("finish", 3700, attempt=0, step=400, save_blocking_s=1.5, step_s=0.25)], now=4000.0)
    text = render({**s, "run": "r", "journal": {"unreadable": 2, "ignored": 0, "truncated": 0}})
    assert "finished, at step 400" in text and "wall 1h 01m" in text
    assert "every 2036 steps (8m 29s; Young/Daly, save 1.5s, MTBF prior)" in text
    assert "2 unreadable event(s) left out" in text and re.search(r"\nMTBF +no failure yet\n", text)


# ---------------------------------------------------------------------------- other commands leave it alone
@pytest.mark.parametrize("layout", ["store", "drop-in"])
def test_gc_ls_verify_leave_the_journal_alone(tmp_path, layout):
    root = tmp_path / "store"
    if layout == "store":
        store = ckptstore.Store(root)
        for step in (1, 2, 3):
            store.save(step, small_state(step)).result()
    else:  # a checkpoint at the store root itself (ckptstore.save(obj, path))
        ckptstore.save(small_state(1), root).result()
    storage = open_storage(str(root))
    write_run(storage)
    write_run(storage, "attempts-2")  # a run id close to a reserved name
    storage.put(f"{JOURNAL_DIR}/run-1/{int(T0 * 1e6):016d}-ffffffff-failure.json.tmp-0123abcd", b"{")
    age_files(root / JOURNAL_DIR, 30 * 24 * 3600)  # old enough for any grace period
    before = {k: v for k, v in files_below(root).items() if k.startswith(JOURNAL_DIR)}
    assert len(before) == 9

    r = cli("ls", str(root), "--json", "--all")
    assert r.exit_code == 0, r.output
    listed = json.loads(r.output)
    assert [x["name"] for x in listed] == (["step-000000000001", "step-000000000002", "step-000000000003"]
                                           if layout == "store" else ["."])
    assert all("foreign" not in x and "error" not in x for x in listed)
    r = cli("verify", str(root), "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["ok"] is True
    r = cli("gc", str(root), "--keep-last", "1", "--grace", "0s", "--json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.output)
    assert report["foreign"] == []
    assert all(JOURNAL_DIR not in d["location"] for d in report["deleted"])
    assert len(report["deleted"]) == (2 if layout == "store" else 0)  # gc did run: steps 1 and 2 went
    after = {k: v for k, v in files_below(root).items() if k.startswith(JOURNAL_DIR)}
    assert after == before
    assert [e["kind"] for e in Journal(storage, "run-1").events()][-1] == "failure"


def test_summarize_overflowing_figures_are_no_figures_not_a_crash():
    """Finite journaled values whose sums or quotients overflow (1e308 lost twice, a step
    time of 5e-324) crashed `status` (round(inf)), or printed JSON's non-standard
    Infinity."""
    from ckptstore.cli_status import _dur

    events = [ev("run_start", 0), ev("attempt_start", 1, attempt=0),
              ev("resume", 2, attempt=0, step=None, skipped=[], first_step_s=1.0),
              ev("measure", 3, attempt=0, save_blocking_s=1e308, step_s=5e-324),
              fail(10, 0, "transient", lost_s=1e308), ev("attempt_start", 11, attempt=1),
              fail(20, 1, "transient", lost_s=1e308)]
    s = summarize(events, now=30.0)
    assert s["lost_s"] is None and s["recommended_interval_steps"] is None
    assert json.loads(json.dumps(s, allow_nan=False)) == s
    assert _dur(float("inf")) == "-"


# ---------------------------------------------------------------------------- issue 34: hostile events
def _event_file(storage, run, us, kind, event: dict | bytes, tag="0000aaaa"):
    data = event if isinstance(event, bytes) else json.dumps({"kind": kind, "run": run, "at": "x", "host": "h",
                                                              **event}).encode()
    storage.put(f"{JOURNAL_DIR}/{run}/{us:016d}-{tag}-{kind}.json", data)


def _status_both_ways(url):
    """``ckptstore status`` as text and as JSON: exit 0 (never an exception), and the JSON."""
    for args in ([url], [url, "--json"]):
        r = run_status(*args)  # catch_exceptions=False: a crash fails the test with its traceback
        assert r.exit_code == 0, r.output
    return json.loads(r.output), run_status(url).output


def test_a_deeply_nested_event_is_unreadable_and_status_survives(tmp_path):
    """A 1 KB event of lists nested 500 deep (under JSON's recursion limit, so it
    parsed) crashed ``ckptstore status``, text and ``--json``, with a RecursionError."""
    url = str(tmp_path / "store")
    storage = open_storage(url)
    j, _ = write_run(storage)
    deep = 0
    for _ in range(500):
        deep = [deep]
    us = int(T0 * 1e6) + 10_000_000
    _event_file(storage, "run-1", us, "unhealthy", {"t": us / 1e6, "checks": deep, "reason": "x"})
    _event_file(storage, "run-1", us + 1, "finish", {"t": us / 1e6, "step": 3, "x": {"y": deep}})
    assert len(json.dumps({"checks": deep})) < 1100
    s, text = _status_both_ways(url)
    assert s["journal"]["unreadable"] == 2 and s["state"] == "running" and s["unhealthy"] is None
    assert "2 unreadable event(s) left out" in text
    reading = j.read()
    assert reading.unreadable == 2 and [e["kind"] for e in reading.events][-1] == "failure"
    # at the limit an event is read (a real one nests 4 deep), one deeper is not
    assert jmod.nests_within({"a": [[{"b": 1}]]}, 4) and not jmod.nests_within({"a": [[{"b": []}]]}, 4)
    # summarize() is a pure function of what it is given: a caller's deep event is cut, not followed
    s = summarize([ev("run_start", 0, command=deep), ev("unhealthy", 1, checks=[{"name": "gpu", "value": deep},
                                                                             deep])], now=2.0)
    assert s["command"] == [None] and s["unhealthy"]["checks"] == [{"name": "gpu", "value": None}]
    json.dumps(s, indent=2)


def test_status_survives_wrong_types_in_every_field_it_reads(tmp_path):
    """Every field status copies or computes with, of every wrong type: no crash, no
    figure from a wrong one, output of the documented types and bounded size."""
    url = str(tmp_path / "store")
    storage = open_storage(url)
    odd = [{"a": {"b": [1]}}, None, True, "s", 10**400, -1e308, 1e308, [], {}, [[1]], "\x1b[2J"]
    us = int(T0 * 1e6)
    fields = ("run", "at", "host", "attempt", "command", "world_size", "nnodes", "policy", "step", "class",
              "reason", "exit_code", "signal", "rank", "traceback", "checkpoint_step", "checkpoint_age_s",
              "lost_steps", "lost_s", "save_blocking_s", "step_s", "first_step_s", "tier", "skipped", "code",
              "checks")
    for i, value in enumerate(odd):
        for kind in ("run_start", "attempt_start", "resume", "measure", "failure", "give_up", "unhealthy"):
            us += 1
            _event_file(storage, "run-1", us, kind, {"t": value, **{f: value for f in fields}},
                        tag=f"{i:04x}{len(kind):04x}")
    _event_file(storage, "run-1", us + 1, "failure", {"checks": [{"name": [1], "ok": "yes", "value": {"a": [1]}}],
                                                      "command": ["a", 1, {"b": 2}] * 1000})
    s, text = _status_both_ways(url)
    assert s["journal"] == {"unreadable": 0, "ignored": 0, "truncated": 0}
    assert s["state"] == "unhealthy" and s["run"] == "run-1"
    assert s["command"] is None and s["world_size"] is None and s["nnodes"] is None
    for f in s["failures"]:
        assert all(f[k] is None or isinstance(f[k], int) and not isinstance(f[k], bool)
                   for k in ("attempt", "step", "rank", "exit_code", "checkpoint_step", "lost_steps"))
        assert all(f[k] is None or isinstance(f[k], str) for k in ("reason", "at", "host", "signal"))
    assert all(isinstance(c, dict) for c in s["unhealthy"]["checks"])
    assert s["wall_s"] == pytest.approx((us - int(T0 * 1e6)) / 1e6, abs=1e-3)  # the names' times
    assert "\x1b" not in text
    # summarize() itself, with what the reader never hands it: unhashable kinds, odd times
    s = summarize([ev("run_start", 0), {"kind": ["failure"], "t": 1.0}, {"kind": {"a": 1}, "t": 2.0},
                   {"kind": "finish", "t": float("nan")}, {"kind": "finish", "t": "3"}], now=5.0)
    assert s["state"] == "running" and s["wall_s"] == 5.0


def test_event_times_are_their_names_and_never_after_now(tmp_path):
    """A run whose ``finish`` event claimed ``t: 1e300`` looked 1e300 s long: its MTBF
    was 1e300 s, and every="auto" saved once, then never again."""
    url = str(tmp_path / "store")
    storage = open_storage(url)
    j = Journal(storage, "run-1", clock=clock(T0, 10.0))
    j.append("run_start")
    j.append("attempt_start", attempt=0)
    j.append("failure", attempt=0, reason="x", save_blocking_s=2.0, **{"class": "transient"})
    us = int((T0 + 30) * 1e6)
    _event_file(storage, "run-1", us, "finish", {"t": 1e300, "step": 5})
    s = status(storage, now=T0 + 100)
    assert (s["state"], s["wall_s"], s["mtbf_s"]) == ("finished", 30.0, 30.0)
    assert [e["t"] for e in j.events()] == [T0, T0 + 10, T0 + 20, T0 + 30]
    assert s["recommended_interval_s"] == pytest.approx(math.sqrt(2 * 2.0 * 30.0))
    # a name in the future (its 16 digits allow the year 2286): no later than now
    _event_file(storage, "run-1", 9_999_999_999_999_999, "finish", {"t": 1e300})
    s = status(storage, now=T0 + 100)
    assert (s["state"], s["wall_s"], s["mtbf_s"]) == ("finished", 100.0, 100.0)
    # summarize() given times of every kind: each taken into [0, now]
    for start, end in ((-1e300, 50.0), (float("-inf"), 50.0), (10.0, 1e300), (10.0, float("inf")),
                       (10.0, 10**400)):
        s = summarize([ev("run_start", 0), {**ev("run_start", 0), "t": start}, fail(20, 0, "transient"),
                       {**ev("finish", 0), "t": end}], now=100.0)
        assert 0.0 <= s["wall_s"] <= 100.0 and s["mtbf_s"] is not None and s["mtbf_s"] <= 100.0, (start, end, s)
    # a finish before the start: running since the start (time order), not a negative run
    s = summarize([ev("run_start", 50), ev("failure", 60, attempt=0, **{"class": "transient"}),
                   ev("finish", 40)], now=100.0)
    assert (s["state"], s["wall_s"], s["mtbf_s"]) == ("running", 50.0, 50.0)
    # no time observed: no MTBF (the prior), not an interval of 0
    s = summarize([ev("run_start", 7), fail(7, 0, "transient", save_blocking_s=1.0), ev("finish", 7)], now=7.0)
    assert s["mtbf_s"] is None and s["mtbf_source"] == "prior"
    assert s["recommended_interval_s"] == pytest.approx(math.sqrt(2 * PRIOR_MTBF_S))


def test_the_recommended_interval_has_a_maximum():
    month, six_hours = 30 * 86400.0, 6 * 3600.0
    s = summarize([ev("run_start", 0), fail(month, 0, "transient", save_blocking_s=600.0, step_s=1.0)],
                  now=month)
    assert s["mtbf_s"] == month and math.sqrt(2 * 600.0 * month) > six_hours
    assert (s["recommended_interval_s"], s["recommended_interval_steps"]) == (six_hours, int(six_hours))

    from ckptstore.supervisor.status import MAX_INTERVAL_S, young_daly

    assert MAX_INTERVAL_S == six_hours
    assert young_daly(2.0, 100.0) == 20.0
    assert young_daly(1e300, 1e300) == MAX_INTERVAL_S
    assert [young_daly(c, m) for c, m in ((0.0, 1.0), (-1.0, 1.0), (1.0, float("inf")), (float("nan"), 1.0))] \
        == [0.0] * 4


# ---------------------------------------------------------------------------- review of issue 34: credentials
SECRETS = ("hunter2", "alice", "deadbeef", "AKIAEXAMPLE", "bob:pw", "s3cr3t")


def _secret_events():
    command = ["train.py", "--data", "https://alice:hunter2@host/x",
               "--url=https://h/o?X-Amz-Signature=deadbeef&X-Amz-Credential=AKIAEXAMPLE%2Fx"]
    reason = "rank 0: upload to https://bob:pw@minio:9000/bucket/key failed"
    return command, reason


def _assert_no_secret(text: str) -> None:
    assert not [s for s in SECRETS if s in text], text


def test_the_journal_and_status_show_no_credentials(tmp_path):
    """The runner journals the launch command as given, and failure reasons and
    tracebacks as the ranks wrote them; ``ckptstore status`` printed them back, with a
    URL's password and a presigned URL's signature in clear."""
    url = str(tmp_path / "store")
    storage = open_storage(url)
    ckptstore.Store(url).save(3, small_state(3)).result()
    command, reason = _secret_events()
    j = Journal(storage, "run-1", clock=clock())
    j.append("run_start", command=command, world_size=1, nnodes=1, policy={"alert": {"to": ["https://x:s3cr3t@h/"]}})
    j.append("attempt_start", attempt=0)
    j.append("failure", attempt=0, reason=reason, traceback=f"Traceback ...\nOSError: {reason}", rank=0,
             step=5, **{"class": "transient"})
    stored = "".join(storage.read(f"{JOURNAL_DIR}/run-1/{n}").decode() for n in storage.list(f"{JOURNAL_DIR}/run-1"))
    _assert_no_secret(stored)
    assert "https://host/x" in stored and "X-Amz-Signature=***" in stored and "https://minio:9000/bucket/key" in stored
    s, text = _status_both_ways(url)
    _assert_no_secret(json.dumps(s) + text)
    assert s["command"][2] == "https://host/x" and "https://minio:9000/bucket/key" in s["last_failure"]["reason"]


def test_status_redacts_a_journal_written_before_the_writer_did(tmp_path):
    """Journals that exist already hold credentials as written: status redacts what it
    copies out, also a URL its length limit would cut in two, and in bounded time."""
    url = str(tmp_path / "store")
    storage = open_storage(url)
    command, reason = _secret_events()
    us = int(T0 * 1e6)
    _event_file(storage, "run-1", us, "run_start", {"t": T0, "command": command})
    _event_file(storage, "run-1", us + 1, "failure", {"t": T0, "attempt": 0, "class": "transient", "reason": reason,
                                                      "traceback": reason})
    _event_file(storage, "run-1", us + 2, "give_up", {"t": T0, "reason": "x" * 4080 + " https://al:hunter2@h/"})
    _event_file(storage, "run-1", us + 3, "unhealthy", {"t": T0, "checks": [{"name": "s3", "detail": reason,
                                                                             "value": {"url": command[3]}}]})
    s, text = _status_both_ways(url)
    _assert_no_secret(json.dumps(s) + text)
    assert s["last_failure"]["reason"] == "rank 0: upload to https://minio:9000/bucket/key failed"
    # a crafted string (no spaces, letters and '@') costs a bounded time, not seconds
    import time

    started = time.perf_counter()
    assert len(jmod.redact_text("x://" + "a" * 60_000 + "/@")) <= jmod.URL_TOKEN_MAX + 3
    assert time.perf_counter() - started < 1.0


def test_the_recommended_interval_has_a_minimum_whatever_the_journal_claims():
    """A hostile journal of many failures in a short run drove the MTBF near 0 and the
    interval with it: ``every="auto"`` saved at almost every step. The interval is at
    least MIN_INTERVAL_SAVES blocking save costs."""
    from ckptstore.supervisor.status import young_daly

    assert young_daly(1.0, 1e-9) == 5.0 and young_daly(0.5, 1e-300) == 2.5
    assert young_daly(2.0, 100.0) == 20.0  # above it, Young/Daly as before
    events = [ev("run_start", 0)] + [fail(1 + i * 1e-4, None, "transient", save_blocking_s=0.2, step_s=0.01)
                                     for i in range(5000)]
    s = summarize(events, now=2.0)
    assert s["mtbf_s"] < 1e-3
    assert s["recommended_interval_s"] == pytest.approx(1.0) and s["recommended_interval_steps"] == 100
    # and Checkpointer(every="auto") with that MTBF
    ckpt = ckptstore.Checkpointer.__new__(ckptstore.Checkpointer)
    ckpt._save_blocking_s, ckpt._mtbf_s = 0.2, s["mtbf_s"]
    assert ckpt.auto_interval_s() == pytest.approx(1.0)
    from ckptstore.supervisor.status import MIN_INTERVAL_SAVES

    assert MIN_INTERVAL_SAVES == 5.0
