"""``ckptstore run --in-job`` (issue 36; docs/design/in-job-restart.md): the node agent
(ckptstore/supervisor/agent.py) replaces a dead rank with a warm spare inside the same
attempt. Real supervisors, 2 gloo ranks and real SIGKILLs, over
tests/procs/injob_fake_worker.py (a minimal worker of the protocol: it all-reduces
``step + 1`` every step, so the final total shows a step lost or counted twice).

- a rank SIGKILLed recovers in-job: one attempt, a ``recovery`` event, status shows it;
- a round failed with every process alive (a rank's notice, a hang) re-forms; ranks
  that cannot leave a hung round are killed and replaced;
- the same error at the same step on the spare -> exit 10 at its first repeat (a
  DeterministicError: test_classify_one_...);
- SIGTERM to the supervisor -> exit 143, as without --in-job;
- no spare (``--spares 0``) -> the agent goes cold and the runner relaunches.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckptstore.storage import open_storage
from ckptstore.supervisor import memory, runner
from ckptstore.supervisor.classify import classify_one
from ckptstore.supervisor.journal import Journal, latest_run

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from jobutil import Job  # noqa: E402

WORKER = Path(__file__).resolve().parent / "procs" / "injob_fake_worker.py"
STEPS = 20
TOTAL = 2 * sum(range(1, STEPS + 1))  # 2 ranks all-reduce step + 1 at every step


class InJob(Job):
    def __init__(self, tmp: Path, *opts, fault: str = "none:-1"):
        self.store, self.final, self.mem = tmp / "store", tmp / "final.json", tmp / "mem"
        (tmp / "work").mkdir()
        super().__init__([sys.executable, "-m", "ckptstore.cli", "run", "--standalone", "--nproc-per-node=2",
                          "--store", str(self.store), "--backoff", "0.1", "--health-interval", "0",
                          "--straggler-report", "0", "--in-job", "--memory-dir", str(self.mem),
                          "--reform-timeout", "30", *opts, str(WORKER), str(tmp / "work"), "--steps", str(STEPS),
                          "--step-delay", "0.05", "--final", str(self.final)], env={"FAULT": fault})

    def events(self, kind: str | None = None) -> list[dict]:
        storage = open_storage(str(self.store))
        events = Journal(storage, latest_run(storage)).events()
        return [e for e in events if kind is None or e["kind"] == kind]

    def total(self) -> float:
        return self.result()["total"]

    def result(self) -> dict:
        return json.loads(self.final.read_text())


def status(store, *extra) -> CliRunner:
    from ckptstore.cli import main

    out = CliRunner().invoke(main, ["status", str(store), *extra])
    assert out.exit_code == 0, out.output
    return out.output


def test_a_killed_rank_is_replaced_by_a_spare_within_the_attempt(tmp_path):
    job = InJob(tmp_path, "--spares", "1")
    job.at_step(1, 8)
    os.kill(job.pids[1], signal.SIGKILL)
    assert job.finish() == runner.EXIT_FINISHED, job.output()[-3000:]
    assert job.total() == TOTAL  # no step lost or counted twice across the recovery
    assert len(job.events("attempt_start")) == 1 and job.events("failure") == []
    [rec] = job.events("recovery")
    assert (rec["attempt"], rec["round"], rec["ranks"], rec["class"], rec["signal"]) == \
        (0, 1, [1], "transient", "SIGKILL")
    assert rec["detected_by"] in ("agent:exit", "rank:collective")  # whichever saw it first
    assert rec["step"] >= 8 and rec["restored_step"] <= rec["step"] and rec["lost_steps"] >= 0
    assert rec["restore_from"] == {"local": [0, 1]} and list(rec["spares"]) == ["1"]
    for part in ("detect_s", "teardown_s", "reform_s", "restore_s", "first_step_s"):
        assert rec[part] is not None and rec[part] >= 0, (part, rec)
    st = json.loads(status(job.store, "--json"))
    assert st["restarts"] == 0 and [f["recovered"] for f in st["failures"]] == ["in_job"]
    assert st["recoveries"]["count"] == 1 and st["recoveries"]["restore_from"] == {"local": 2}
    assert st["recovery_s"] >= rec["first_step_s"]
    text = status(job.store)
    assert re.search(r"^in-job +1 recovery, median", text, re.M), text  # (the label column's width varies)
    assert re.search(r"^last recovery +round 1 in [0-9.]+s \(detect [0-9.]+, teardown [0-9.]+, re-form [0-9.]+, "
                     r"restore [0-9.]+\), restored from local 2$", text, re.M), text
    run = memory.run_dir_name(latest_run(open_storage(str(job.store))), str(job.store))  # (its id, its store's digest)
    assert job.result()["memory_dir"] == str(job.mem / run / "0") and int(job.result()["memory_budget"]) > 0
    assert not (job.mem / run).exists()  # the memory directory went with the run


def test_the_same_error_again_on_the_spare_stops_with_the_deterministic_code(tmp_path):
    job = InJob(tmp_path, fault="raise:8")
    assert job.finish() == runner.EXIT_DETERMINISTIC, job.output()[-3000:]
    # The first time it was taken for transient and round 1 began; the spare raised it
    # again before round 1's first step: that recovery failed, and the attempt stopped.
    assert job.events("recovery") == []
    [failed] = job.events("recovery_failed")
    assert failed["round"] == 1 and "bad data shard at step 8" in failed["reason"]
    [failure] = job.events("failure")  # the spare raised it again at the same step: the program's
    assert failure["class"] == "deterministic" and "failed the same way twice" in failure["reason"]
    assert len(job.events("attempt_start")) == 1
    assert [g["code"] for g in job.events("give_up")] == [runner.EXIT_DETERMINISTIC]


def test_sigterm_to_the_supervisor_stops_the_job_with_143(tmp_path):
    job = InJob(tmp_path, "--spares", "0")
    job.at_step(0, 5)
    job.proc.send_signal(signal.SIGTERM)
    assert job.finish() == runner.EXIT_STOPPED, job.output()[-3000:]  # (finish: every worker gone too)
    assert [f["class"] for f in job.events("failure")] == ["preempted"]
    assert job.events("recovery") == []


def test_rounds_failed_with_processes_alive_re_form_and_ranks_that_cannot_leave_are_replaced(tmp_path):
    """Round 0: a rank's collective failed (its notice, ``rank:collective``) and no
    process died; round 1: a hang that the agent's notice ends (the ranks leave): both
    times the same members re-form, no spare used. Round 2: a hang no notice ends (both
    ranks stuck: one hung, one in its all-reduce): neither leaves within
    ``--abort-timeout``, both are killed and the two spares take their ranks."""
    job = InJob(tmp_path, "--spares", "2", "--hang-timeout", "3", "--abort-timeout", "1",
                fault="notice:6:0,hang:10:1,stuck:14:2")
    assert job.finish() == runner.EXIT_FINISHED, job.output()[-3000:]
    assert job.total() == TOTAL
    notice, hang, stuck = job.events("recovery")
    assert (notice["round"], notice["ranks"], notice["spares"], notice["detected_by"]) == \
        (1, [], {}, "rank:collective")
    assert "simulated collective error at step 6" in notice["reason"]
    assert (hang["round"], hang["ranks"], hang["spares"], hang["detected_by"]) == (2, [], {}, "agent:hang")
    assert "no rank reported progress for 3s" in hang["reason"]
    assert (stuck["round"], stuck["ranks"], sorted(stuck["spares"]), stuck["detected_by"]) == \
        (3, [0, 1], ["0", "1"], "agent:hang")
    assert "did not leave round 2 within 1s" in stuck["reason"]
    assert len(job.events("attempt_start")) == 1 and job.events("failure") == [], job.output()[-3000:]


def test_without_a_spare_the_attempt_goes_cold_and_is_relaunched(tmp_path):
    job = InJob(tmp_path, "--spares", "0")
    job.at_step(1, 8)
    os.kill(job.pids[1], signal.SIGKILL)
    assert job.finish() == runner.EXIT_FINISHED, job.output()[-3000:]
    assert job.total() == TOTAL
    [gave_up] = job.events("in_job_gave_up")
    assert "no warm spare" in gave_up["reason"]
    [failure] = job.events("failure")
    assert failure["class"] == "transient" and failure["reason"].startswith("in-job recovery gave up: no warm spare")
    assert len(job.events("attempt_start")) == 2 and job.events("recovery") == []


def test_recoveries_in_a_row_without_a_new_step_go_cold(tmp_path):
    """Rank 1 exits at step 8 in round 0, and its spare at step 8 again in round 1 (no
    error file: not "the same error"): no new step between the two faults, and
    ``--max-rounds-in-a-row 1`` sends the attempt cold; the relaunch finishes."""
    job = InJob(tmp_path, "--spares", "1", "--max-rounds-in-a-row", "1", fault="exit:8:0,exit:8:1")
    assert job.finish() == runner.EXIT_FINISHED, job.output()[-3000:]
    assert job.total() == TOTAL
    [failed] = job.events("recovery_failed")  # round 1 never trained
    assert failed["round"] == 1
    [gave_up] = job.events("in_job_gave_up")
    assert "1 in-job recoveries in a row without a new step" in gave_up["reason"]
    assert len(job.events("attempt_start")) == 2 and len(job.events("failure")) == 1


@pytest.mark.parametrize("args, message", [
    (["--spares", "1"], "--spares needs in-job recovery (spares replace failed ranks only there); it is off: the "
                        "script does not call ckptstore.inprocess.run"),
    (["--no-in-job", "--spares", "1"], "it is off: --no-in-job"),
    (["--in-job", "--nnodes", "1:2"], "elastic membership is not supported in-job"),
    (["--in-job", "--memory-budget", "120%"], "at most 100"),
])
def test_in_job_options_that_cannot_run_are_refused(args, message):
    from ckptstore.cli import main

    out = CliRunner().invoke(main, ["run", "--store", "S", "--standalone", *args, str(WORKER)])
    assert out.exit_code == 2 and message in out.output, out.output


def test_the_memory_directory_and_budget(tmp_path):
    path = memory.claim_dir(str(tmp_path / "shm"), "run1", 0)
    assert os.stat(path).st_mode & 0o777 == 0o700
    memory.release_dir(str(tmp_path / "shm"), "run1", 0)
    assert not os.path.exists(path) and not (tmp_path / "shm" / "run1").exists() and (tmp_path / "shm").exists()
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 4000 kB\nMemAvailable: 2000 kB\n")
    assert memory.budget_bytes("25%", str(meminfo)) == 500 * 1024
    assert memory.budget_bytes("12345", str(meminfo)) == 12345
    with pytest.raises(ValueError):
        memory.parse_budget("lots")


def test_classify_one_finds_the_repeat_and_the_programs_verdict():
    own = {"exitcode": 1, "signal": None, "error": "ValueError: bad data shard at step 8", "traceback": None}
    first = classify_one(own, 1, 8)
    assert first.klass == "transient" and first.signature
    assert classify_one(own, 1, 8, previous=first.signature).klass == "deterministic"
    assert classify_one(own, 1, 9, previous=first.signature).klass == "transient"  # another step: not the same
    killed = {"exitcode": -9, "signal": "SIGKILL", "error": None}
    assert classify_one(killed, 0, 8, previous=first.signature).klass == "transient"
    said = {"exitcode": 1, "error": "ckptstore.errors.DeterministicError: non-finite loss"}
    assert classify_one(said, 0, 3).klass == "deterministic"
