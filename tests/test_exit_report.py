"""A save that fails is never silent (issue 34, section 1): a failed save whose error the
program never saw is reported on stderr at exit, and the process exits non-zero; the
exit drain says what it waits for, and a Ctrl-C while it waits abandons it, naming what
is lost.

Two real processes (a ``python -c`` each: the exit status and the Ctrl-C need one); the
rest in this process, where ``lifecycle.report_at_exit()`` is what the atexit handler
runs before it ends the process (``exit_report.exit_now``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading

import pytest
import torch

import ckptstore
from ckptstore import exit_report, lifecycle, names
from ckptstore.checkpoint import exiting
from ckptstore.checkpoint.save import SaveOptions, start_save
from ckptstore.errors import CkptStoreError, StorageError
from ckptstore.runtime import runtime
from ckptstore.storage import LocalStorage

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from procs.harness import HANG_GUARD_S, LineReader, child_env  # noqa: E402
from s3util import aws_env  # noqa: E402

pytestmark = pytest.mark.usefixtures("observe_earlier_failures")


@pytest.fixture
def no_exception_ending(monkeypatch):
    """As at a normal exit: no uncaught exception recorded (pytest records a failed
    test's in sys.last_value, for post-mortem debugging)."""
    for name in ("last_exc", "last_value", "last_type", "last_traceback"):
        monkeypatch.delattr(sys, name, raising=False)
    monkeypatch.setattr(exit_report, "_exit_code", exit_report._NOT_CALLED)  # (a test's sys.exit under pytest.raises)


def _failed_unseen(tmp_path, name="bad"):
    """A save that fails in the background (its path lies under a regular file), done,
    its outcome not looked at. (Not through ckptstore.save, which would raise an earlier
    such failure instead.)"""
    blocker = tmp_path / f"{name}-file"
    blocker.write_bytes(b"not a directory")
    done = threading.Event()
    fut = lifecycle.track(start_save({"w": torch.ones(8)}, LocalStorage(blocker / "ckpt"), rt=runtime(),
                                     attempt=names.new_attempt_id(), step=None, rank=0, world_size=1, metrics=None,
                                     options=SaveOptions()))
    fut.add_done_callback(lambda _f: done.set())  # does not observe it
    assert done.wait(HANG_GUARD_S)
    return fut, str(blocker / "ckpt")


# ---------------------------------------------------------------- real processes

def test_a_failed_save_nobody_looked_at_is_reported_at_exit_and_the_status_is_1(tmp_path):
    """The issue's repro, ended by sys.exit(0): the report names the path, the reason and
    what to do, the status is 1, and a file the program left open is still flushed. The
    atexit handlers registered before ``import ckptstore`` (torch's, coverage's, the
    program's) run too, once, after those registered later (review of issue 34: they
    were skipped), and those registered later run once."""
    code = ("import atexit, sys\n"
            "atexit.register(lambda: print('handler registered before the import', flush=True))\n"
            "import torch, ckptstore\n"
            "atexit.register(lambda: print('handler registered after the import', flush=True))\n"
            "log = open('log.txt', 'w'); log.write('step 1 done')\n"
            "open('a_file', 'w').close()\n"
            "ckptstore.save({'w': torch.zeros(1000)}, 'a_file/sub/x.pt')\n"
            "sys.exit(0)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=child_env(), capture_output=True, text=True,
                       timeout=HANG_GUARD_S)
    assert r.returncode == 1, (r.returncode, r.stderr)
    lines = [line for line in r.stderr.splitlines() if line.startswith("ckptstore: ")]
    assert len(lines) == 3, r.stderr
    assert f"the save to {tmp_path / 'a_file/sub/x.pt'} failed" in lines[0], lines
    assert "StorageError" in lines[0] and "Not a directory" in lines[0], lines
    assert "is committed; checkpoints committed earlier are intact" in lines[1], lines
    assert ".result()" in lines[1] and "ckptstore.wait()" in lines[1], lines
    assert lines[2] == "ckptstore: exit status 1: a save did not commit", lines
    assert (tmp_path / "log.txt").read_text() == "step 1 done"
    assert r.stdout.splitlines() == ["handler registered after the import", "handler registered before the import"], \
        r.stdout


def test_the_status_the_program_chose_with_sys_exit_is_kept(tmp_path):
    """A failed save nobody looked at, then ``sys.exit(3)``: the report is printed and the
    status stays 3 (it was 1: only a status that would be 0 becomes 1)."""
    code = ("import sys, torch, ckptstore\n"
            "open('a_file', 'w').close()\n"
            "ckptstore.save({'w': torch.zeros(10)}, 'a_file/sub/x.pt')\n"
            "sys.exit(3)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=child_env(), capture_output=True, text=True,
                       timeout=HANG_GUARD_S)
    assert r.returncode == 3, (r.returncode, r.stderr)
    assert "failed and nothing waited for its outcome" in r.stderr and "exit status" not in r.stderr, r.stderr


def _next_or_stacks(proc, err, timeout: float = 60.0) -> str | None:
    """The child's next stderr line; none within ``timeout``: fail with its threads'
    stacks (SIGUSR1, faulthandler), /proc's signal masks and what it said."""
    try:
        return err.next(timeout)
    except AssertionError:
        status = [l.strip() for l in open(f"/proc/{proc.pid}/status") if l.startswith(("State", "Sig"))]
        proc.send_signal(signal.SIGUSR1)
        dump = []
        with contextlib.suppress(AssertionError):
            while (line := err.next(5.0)) is not None:
                dump.append(line)
        raise AssertionError(f"the child said nothing {timeout:g}s after Ctrl-C; {status}; its stacks:\n"
                             + "\n".join(dump[-80:])) from None


def test_ctrl_c_at_exit_says_what_it_waits_for_and_a_second_ctrl_c_abandons_the_wait(tmp_path):
    """A save to an unreachable S3 endpoint (a closed port: each request retries for tens
    of seconds) is in flight when Ctrl-C ends the program: the exit drain says what it
    waits for, how much is left and for how long; a second Ctrl-C ends the wait with a
    line naming the save that did not commit, and the process dies by SIGINT, as Python
    does after a KeyboardInterrupt."""
    url = "s3://bucket/run/x.pt"
    # The child's Ctrl-C is Python's own, whatever the suite's process left behind: a
    # signal ignored or blocked there is inherited across exec (twice in full runs the
    # first SIGINT did nothing and the child said nothing for 180 s).
    code = ("import faulthandler, signal, time, torch, ckptstore\n"
            "faulthandler.register(signal.SIGUSR1, all_threads=True)  # (the test asks when it hangs)\n"
            "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})\n"
            "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            f"ckptstore.save({{'w': torch.ones(300_000)}}, {url!r})\n"
            "print('saved', flush=True)\n"
            "while True:\n"
            "    time.sleep(0.05)  # training goes on until Ctrl-C\n")
    # A port held bound and never listened on: every connection is refused, and no other
    # process of the suite can take it meanwhile (a freed port could be reused by a
    # server that accepts and never answers: the child's requests would hang instead).
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    env = child_env(CKPTSTORE_ATEXIT_TIMEOUT=200, **aws_env(f"http://127.0.0.1:{closed.getsockname()[1]}"))
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    out, err = LineReader(proc.stdout), LineReader(proc.stderr)
    try:
        assert out.next() == "saved", err.lines
        proc.send_signal(signal.SIGINT)  # the first Ctrl-C: the program ends, the save in flight
        line = _next_or_stacks(proc, err)  # (the first Ctrl-C's traceback comes first)
        while line is not None and not line.startswith("ckptstore: waiting"):
            line = err.next()
        assert line is not None, err.lines  # (None: the child ended without saying it waits)
        assert line.startswith("ckptstore: waiting up to ") and "for 1 save in flight to commit" in line, line
        assert "Ctrl-C stops waiting" in line, line
        assert int(line.split("waiting up to ")[1].split("s ")[0]) <= 200, line
        what = err.next()
        assert what == f"ckptstore:   the save to {url}: 1.1 MiB of 1.1 MiB still to write, 1 of 1 chunks", what
        proc.send_signal(signal.SIGINT)  # the second: stop waiting
        rest = err.rest()
        code = proc.wait(HANG_GUARD_S)
    finally:
        proc.kill()
        proc.wait()
    assert code == -signal.SIGINT, (code, err.lines)
    assert rest[0] == (f"ckptstore: stopped waiting (Ctrl-C): the save to {url} is not committed (1.1 MiB of "
                       "1.1 MiB still to write, 1 of 1 chunks); checkpoints committed earlier are intact"), rest
    assert not any("Traceback" in line for line in rest), rest  # (the first Ctrl-C's came before the wait)


# ---------------------------------------------------------------- in this process

@pytest.mark.parametrize("how", ["result", "exception", "wait", "next save", "nobody"])
def test_a_failed_save_is_left_out_of_the_exit_report_once_the_program_saw_it(tmp_path, how, capsys,
                                                                            no_exception_ending):
    fut, where = _failed_unseen(tmp_path)
    if how == "result":
        with pytest.raises(StorageError):
            fut.result()
    elif how == "exception":
        assert isinstance(fut.exception(), StorageError)
    elif how == "wait":
        with pytest.raises(StorageError):
            ckptstore.wait()
    elif how == "next save":
        with pytest.raises(CkptStoreError, match="earlier save"):
            ckptstore.save({"x": torch.zeros(2)}, str(tmp_path / "good"))
    capsys.readouterr()
    status = lifecycle.report_at_exit()
    err = capsys.readouterr().err
    if how != "nobody":
        assert status is None and err == "", err
        return
    fut.exception()  # (observed now: the session's own exit is not this test's)
    assert status == 1, err
    assert f"ckptstore: the save to {where} failed and nothing waited for its outcome: StorageError: " in err, err
    assert err.rstrip().endswith("ckptstore: exit status 1: a save did not commit"), err


def test_sys_exit_with_a_non_zero_status_is_kept_and_zero_becomes_1(tmp_path, capsys, no_exception_ending):
    """In this process, what report_at_exit says after the main thread called sys.exit
    (caught here): a non-zero status stands (None: the exit is left alone; a message
    is status 1 by Python); 0 or None becomes 1; the last call counts; a call in another
    thread (it ends only that thread) does not."""
    fut, _ = _failed_unseen(tmp_path)  # (its save also installed the sys.exit watch)
    for code, status in [(3, None), ("a message", None), (256 + 7, None), (0, 1), (None, 1), (256, 1)]:
        with pytest.raises(SystemExit):
            sys.exit(code)
        assert exit_report.chosen_status() == (1 if code == "a message" else (code or 0) & 0xFF)
        assert lifecycle.report_at_exit() == status, code
    def exit_5():
        with pytest.raises(SystemExit):
            sys.exit(5)

    thread = threading.Thread(target=exit_5)
    thread.start()
    thread.join()
    assert lifecycle.report_at_exit() == 1  # still sys.exit(256)'s
    fut.exception()  # (observed now: the session's own exit is not this test's)


def test_a_failure_a_later_save_passed_over_is_raised_by_wait_or_reported_at_exit(tmp_path, capsys,
                                                                                 no_exception_ending):
    """The next save raises one earlier failure; another is not forgotten: wait()
    raises it, and without that the exit report names it."""
    first, _ = _failed_unseen(tmp_path, "one")
    second, where = _failed_unseen(tmp_path, "two")
    with pytest.raises(CkptStoreError, match="earlier save"):
        ckptstore.save({"x": torch.zeros(2)}, str(tmp_path / "good"))
    assert first.observed and not second.observed
    capsys.readouterr()
    assert lifecycle.report_at_exit() == 1
    assert f"the save to {where} failed" in capsys.readouterr().err
    with pytest.raises(StorageError) as ei:
        ckptstore.wait()
    assert ei.value is second.exception()
    assert lifecycle.report_at_exit() is None


class _Gated(LocalStorage):
    """Holds every put (the manifest) until the gate opens: a save in flight."""

    def __init__(self, root, gate: threading.Event, reached: threading.Event):
        super().__init__(root)
        self._gate, self._reached = gate, reached

    def put(self, key, data, **kwargs):
        self._reached.set()
        assert self._gate.wait(HANG_GUARD_S)
        return super().put(key, data, **kwargs)


def test_an_exception_ending_the_program_keeps_its_status_unless_a_save_is_still_written(tmp_path, capsys,
                                                                                       monkeypatch,
                                                                                       no_exception_ending):
    """An uncaught exception already makes the status non-zero: the report is printed
    and the exit left alone. A save the drain gave up on (timeout, Ctrl-C) is still being
    written: the process then ends at once, with the status Python gives that exception
    (death by SIGINT for a KeyboardInterrupt), so that no write runs into finalization."""
    monkeypatch.setattr(exiting, "_active", threading.Event())  # (exit mode is sticky: this test's alone)
    fut, where = _failed_unseen(tmp_path)
    monkeypatch.setattr(sys, "last_value", ValueError("the program's own error"), raising=False)
    capsys.readouterr()
    assert lifecycle.report_at_exit() is None
    err = capsys.readouterr().err
    assert f"the save to {where} failed" in err and "exit status" not in err, err
    fut.exception()

    gate, reached = threading.Event(), threading.Event()
    where = _Gated(str(tmp_path / "slow"), gate, reached)
    held = lifecycle.track(start_save({"w": torch.ones(8)}, where, rt=runtime(), attempt=names.new_attempt_id(),
                                      step=7, rank=0, world_size=1, metrics=None, options=SaveOptions()))
    try:
        assert reached.wait(HANG_GUARD_S)
        assert lifecycle.drain(0.0) is False  # the drain gives up at once: the save is lost
        err = capsys.readouterr().err
        assert (f"ckptstore: stopped waiting (after 0s: CKPTSTORE_EXIT_TIMEOUT / CKPTSTORE_ATEXIT_TIMEOUT): the save "
                f"of step 7 to {where.describe()} is not committed (its data is written; its commit is running); "
                "checkpoints committed earlier are intact") in err, err
        monkeypatch.setattr(sys, "last_value", KeyboardInterrupt(), raising=False)
        assert lifecycle.report_at_exit() == -signal.SIGINT
        monkeypatch.delattr(sys, "last_value")
        assert lifecycle.report_at_exit() == 1
        assert where.describe() not in capsys.readouterr().err  # named once: by the drain
    finally:
        gate.set()
    held.result(timeout=HANG_GUARD_S)  # it commits after all
    assert lifecycle.report_at_exit() is None


def test_the_exit_drain_says_what_it_waits_for_and_then_that_it_committed(tmp_path, monkeypatch):
    """In this process: a drain that waits says so (here at once) naming the save and
    what is left; the commit it waited for (released when the drain has said so) ends
    it with a line saying it committed."""
    monkeypatch.setattr(exiting, "_active", threading.Event())  # (exit mode is sticky: this test's alone)
    monkeypatch.setattr(lifecycle, "ANNOUNCE_AFTER", 0.0)
    gate, reached, said = threading.Event(), threading.Event(), []
    where = _Gated(str(tmp_path / "slow"), gate, reached)

    def say(line):
        said.append(line)
        if line.startswith("waiting"):
            gate.set()  # the commit goes on once the drain said what it waits for

    monkeypatch.setattr(lifecycle.exit_report, "say", say)
    held = lifecycle.track(start_save({"w": torch.ones(1000)}, where, rt=runtime(), attempt=names.new_attempt_id(),
                                      step=3, rank=0, world_size=1, metrics=None, options=SaveOptions()))
    try:
        assert reached.wait(HANG_GUARD_S)
        assert lifecycle.drain(HANG_GUARD_S) is True
    finally:
        gate.set()
    assert held.result(timeout=HANG_GUARD_S).step == 3
    assert said[0].startswith("waiting up to ") and "for 1 save in flight to commit before exiting" in said[0], said
    assert said[1:] == [f"  the save of step 3 to {where.describe()}: its data is written; its commit is running",
                        f"done waiting: the save of step 3 to {where.describe()} committed"], said
