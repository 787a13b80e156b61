"""The supervisor's view of progress and lost work, in process (no launcher): where the
next attempt resumes (the ranks' reports, the store's steps no later than the step
reached, never one a resume marked skipped), what counts as progress (never a store
that could not be read, nor a step behind where the attempt started), the rank that
speaks for a node, a rank's wait for its saves (no hang), the classification of chained
exceptions and NCCL's misuse verdict, option abbreviations, hostile journal figures, and
an alert command that hangs."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import threading
import time
import warnings

import psutil
import pytest
import torch

import ckptstore
from ckptstore import lifecycle
from ckptstore.checkpoint import exiting
from ckptstore.checkpoint.save import SaveFuture
from ckptstore.storage import open_storage
from ckptstore.supervisor import runner
from ckptstore.supervisor import alerts
from ckptstore.supervisor.classify import Verdict, classify
from ckptstore.supervisor.decide import History, decide
from ckptstore.supervisor.cli_run import _Refused, split_argv
from ckptstore.supervisor.health import Check
from ckptstore.supervisor.journal import Journal
from ckptstore.supervisor.progress import read_progress
from ckptstore.supervisor.status import newest_checkpoint, summarize


def _supervisor(store, monkeypatch, **policy) -> runner.Supervisor:
    monkeypatch.setattr(runner, "check_node", lambda *a, **k: [Check("node", True, "")])
    return runner.Supervisor(str(store), ["train.py"], runner.Policy(backoff_s=0, **policy))


def _failures(sup) -> list[dict]:
    return [e for e in sup.journal.events() if e["kind"] == "failure"]


def _save(store, *steps):
    s = ckptstore.Store(store)
    for step in steps:
        s.save(step, {"w": torch.full((4,), float(step))}).result()
    return s


def test_a_store_that_cannot_be_read_is_no_progress(tmp_path, monkeypatch):
    """A failed look at the store used to read as a new step (100, then None, then 100
    again): the run went on to its restart limit instead of stopping for no progress."""
    _save(tmp_path / "run", 100)
    sup = _supervisor(tmp_path / "run", monkeypatch, no_progress_restarts=3, max_restarts=20)
    real, calls = newest_checkpoint, itertools.count()

    def flaky(storage, at_most=None):
        if next(calls) % 2:
            raise OSError("the store is unreachable")
        return real(storage) if at_most is None else real(storage, at_most=at_most)

    monkeypatch.setattr(runner, "newest_checkpoint", flaky)
    attempts = []
    sup._attempt = lambda attempt, started: attempts.append(attempt) or Verdict(
        "transient", "rank 1 was killed by SIGKILL", evidence={"step": 120})
    assert sup.run() == runner.EXIT_NO_PROGRESS
    assert attempts == [0, 1, 2]


def test_a_step_the_resume_passed_over_is_not_where_it_resumes(tmp_path, monkeypatch):
    """Steps 100 and 200 committed, 200 rejected by validation: each attempt resumes at
    its newest usable step and commits a newer one below 200. Lost work was negative
    (measured from 200) and the run gave up for no progress though every attempt made
    some."""
    store = tmp_path / "run"
    _save(store, 100, 200)
    sup = _supervisor(store, monkeypatch, no_progress_restarts=2, max_restarts=4)
    newer = itertools.count(110, 10)

    def attempt(attempt, started):
        s = ckptstore.Store(store)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the skip's warning
            _, info = s.resume(validate=lambda state, manifest: manifest.step != 200)
        step = next(newer)
        s.save(step, {"w": torch.zeros(4)}).result()
        return Verdict("transient", "rank 1 was killed by SIGKILL", evidence={"step": step + 5})

    sup._attempt = attempt
    assert sup.run() == runner.EXIT_RESTART_LIMIT  # progress every time: only the limit stops it
    failures = _failures(sup)
    assert [(f["checkpoint_step"], f["lost_steps"]) for f in failures] == [(110, 5), (120, 5), (130, 5),
                                                                            (140, 5), (150, 5)]
    assert newest_checkpoint(open_storage(str(store)))["step"] == 150  # 200 is marked skipped


def test_lost_work_is_never_negative(tmp_path, monkeypatch):
    store = tmp_path / "run"
    _save(store, 100)
    sup = _supervisor(store, monkeypatch)
    # the ranks report a commit newer than the step reached (a report that came late)
    sup._record_failure(0, Verdict("transient", "killed", evidence={"step": 90, "step_s": 2.0}), 100, None)
    (failure,) = _failures(sup)
    assert failure["lost_steps"] == 0 and failure["lost_s"] == 0.0
    out = summarize([*sup.journal.events(), {"kind": "failure", "attempt": 1, "class": "transient", "t": 1e9,
                                             "lost_steps": -50, "lost_s": -100.0}], now=2e9)
    assert out["lost_steps"] == 0 and out["lost_s"] == 0.0  # an older journal's negative figure


def test_the_ranks_report_where_the_next_attempt_resumes_a_local_tiers_commits_too(tmp_path):
    """A two-tier store: the durable tier (what --store names) holds nothing yet, the
    local tier every step. The ranks' progress files say which step they resumed from
    and which they saw committed; the supervisor takes those."""
    progress = tmp_path / "progress"
    progress.mkdir()
    child = f"""
import ckptstore, torch, sys
store = ckptstore.Store({str(tmp_path / "durable")!r}, local={str(tmp_path / "local")!r}, durable_every=100)
model = torch.nn.Linear(2, 2)
ck = ckptstore.Checkpointer(store, model=model, every=1)
start = ck.resume()
for step in range(start, start + 2):
    ck.step(step)
ckptstore.wait()
print(start)
"""
    env = {**os.environ, "CKPTSTORE_PROGRESS_DIR": str(progress)}
    starts = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", child], env=env, cwd="/", capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr
        starts.append(int(out.stdout.split()[-1]))
        record = read_progress(str(progress))[0]
    assert starts == [0, 2]
    assert record["resumed_step"] == 1 and record["committed_step"] == 3
    assert newest_checkpoint(open_storage(str(tmp_path / "durable"))) is None
    watch = runner._ProgressWatch(0.0)
    watch.update({0: record})
    assert (watch.resume_reported, watch.resumed_step, watch.committed_step) == (True, 1, 3)
    sup = runner.Supervisor(str(tmp_path / "durable"), ["train.py"])
    step, t = sup._resume_point({"step": 3, "committed_step": watch.committed_step,
                                 "committed_t": watch.committed_t})
    assert step == 3 and t is not None


@pytest.mark.parametrize("how", ["wait", "exit drain"])
def test_a_rank_waiting_for_its_saves_reports_saving(tmp_path, monkeypatch, how):
    """After the loop, ``ckptstore.wait()`` (or the exit's drain) for the final save's
    commit: no step is reported meanwhile, and the supervisor took a slow upload for a
    hang."""
    from ckptstore import training

    monkeypatch.setenv("CKPTSTORE_PROGRESS_DIR", str(tmp_path))
    monkeypatch.setattr(training, "guard_worker", lambda: None)  # (no parent-death signal for pytest)
    ck = ckptstore.Checkpointer(ckptstore.Store(tmp_path / "run"), state={"x": {}})
    ck._report("train", 5, force=True)
    waiting = threading.Event()
    flag = _Flag(waiting)  # (held weakly by lifecycle: kept alive here)
    lifecycle.on_wait(flag.set)  # after the Checkpointer's: called after it
    future = lifecycle.track(SaveFuture("slow upload", 5, "a"))
    waiter = threading.Thread(target=ckptstore.wait if how == "wait" else lambda: lifecycle.drain(60))
    waiter.start()
    try:
        assert waiting.wait(60)
        assert read_progress(str(tmp_path))[0]["state"] == "saving"
        watch = runner._ProgressWatch(0.0)
        watch.update(read_progress(str(tmp_path)))
        assert watch.busy  # the hang clock is held
    finally:
        future._future.set_result(None)
        waiter.join(60)
        exiting.leave()  # (the drain entered exit mode: this process goes on)
    assert read_progress(str(tmp_path))[0]["state"] == "train"


class _Flag:
    def __init__(self, event):
        self.event = event

    def set(self, waiting: bool) -> None:
        if waiting:
            self.event.set()


def test_a_node_without_rank_0_journals_its_own_resume(tmp_path, monkeypatch):
    sup = _supervisor(tmp_path / "run", monkeypatch)
    watch = runner._ProgressWatch(0.0)
    progress = {r: {"state": "train", "step": 101, "first_step_t": 5.0, "resumed_step": 100,
                    "resumed_age_s": 3.0} for r in (4, 5, 6, 7)}
    watch.update(progress)
    assert sup._log_resume(0, watch, progress, 0.0)
    (resume,) = [e for e in sup.journal.events() if e["kind"] == "resume"]
    assert resume["step"] == 100 and resume["checkpoint_age_s"] == 3.0


@pytest.mark.parametrize("error, traceback, first", [
    # raised while handling a dropped connection: a cleanup that failed for the same fault
    ("KeyError: 'x'", "ConnectionResetError: Connection reset by peer\n\nDuring handling of the above exception, "
     "another exception occurred:\n\nKeyError: 'x'", "machinery"),
    # raised from one (raise ... from): the dropped connection is the cause
    ("RuntimeError: save failed", "ConnectionResetError: Connection reset by peer\n\nThe above exception was the "
     "direct cause of the following exception:\n\nRuntimeError: save failed", "machinery"),
    ("torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1, invalid usage (run with "
     "NCCL_DEBUG=WARN for details), NCCL version 2.21.5\nncclInvalidUsage: This usually reflects invalid usage",
     "", "own"),
    ("torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1, remote process exited or there "
     "was a network error\nncclRemoteError", "", "machinery"),
])
def test_which_errors_are_the_programs_own(error, traceback, first):
    result = {"failures": {"0": {"error": error, "traceback": traceback, "exitcode": 1, "timestamp": 1}}}
    history, policy = History(), runner.Policy(backoff_s=0)
    d1 = decide(policy, history, classify(result, 7), False, 0.0)
    d2 = decide(policy, history, classify(result, 7), False, 1.0)
    assert d1.klass == "transient"
    assert d2.klass == ("deterministic" if first == "own" else "transient")


def test_an_abbreviation_of_torchruns_options_is_refused():
    """--nproc-per: its value was taken for the script, our later options given to it."""
    with pytest.raises(_Refused, match="--nproc-per-node"):
        split_argv(["--store", "S", "--standalone", "--nproc-per", "2", "--max-restarts", "0", "train.py"])
    ours, theirs = split_argv(["--store", "S", "--nproc_per_node", "2", "--max-restarts", "0", "train.py"])
    assert ours.max_restarts == 0 and theirs == ["--nproc_per_node", "2", "train.py"]


def test_status_survives_figures_beyond_any_real_one(tmp_path):
    storage = open_storage(str(tmp_path / "run"))
    journal = Journal(storage, "r1")
    for attempt in range(2):
        # each as many digits as a number may have to be printed; their sum one more
        journal.append("failure", attempt=attempt, **{"class": "transient"}, lost_steps=int("9" * 4300))
    from ckptstore.cli import main
    from click.testing import CliRunner

    for args in ([], ["--json"]):
        out = CliRunner().invoke(main, ["status", str(tmp_path / "run"), *args])
        assert out.exit_code == 0, out.output
    assert summarize(journal.events(), now=2e9)["lost_steps"] == 0


def test_an_alert_that_hangs_is_killed_with_what_it_started(tmp_path, monkeypatch):
    monkeypatch.setattr(alerts, "TIMEOUT_S", 5.0)
    pid_file = tmp_path / "pid"
    alerts.run(f"sleep 600 & echo $! > {pid_file}; wait", {"kind": "failure"})
    assert _dies(int(pid_file.read_text()))  # (the SIGKILL lands asynchronously)
    # a command left running in the background on purpose is the user's
    alerts.run(f"(sleep 600 & echo $! > {pid_file})", {"kind": "failure"})
    survivor = psutil.Process(int(pid_file.read_text()))
    assert survivor.is_running() and survivor.status() != psutil.STATUS_ZOMBIE
    survivor.kill()


def _dies(pid: int, within: float = 60.0) -> bool:
    """Whether ``pid`` is gone or a zombie (killed; a container's init may not reap it)
    before ``within`` seconds pass."""
    end = time.monotonic() + within
    while time.monotonic() < end:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False
