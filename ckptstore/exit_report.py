"""What a process says, and how it ends, when it exits with saves that did not commit.

The words of the exit drain (:mod:`ckptstore.lifecycle`) on stderr: what it waits for
and how much is left, which saves it gave up on, which failed saves nobody looked at;
and :func:`exit_now`, which ends a process that would otherwise exit with status 0.
Warnings are not used: at interpreter exit they may no longer show.

Why ``os._exit``: once the main module has finished (or ``sys.exit`` was called),
Python has fixed the exit status, and no hook of its shutdown can change it. So the
report is an atexit handler that ``ckptstore`` registers when it is imported
(:func:`register_report`); handlers run last-registered first, so the program's own,
wandb's and the like, and ckptstore's exit drain have run by then. When it must change
the status it first runs the atexit handlers registered *before* it (torch's, pybind11's,
coverage's, the program's own registered before ``import ckptstore``), which Python
would have run after it: it knows the ones registered after it (they ran already) because
it watches ``atexit.register`` from then on, unregisters those and itself, and calls
``atexit._run_exitfuncs``, which runs what is left, each handler once. Then it flushes
files left open, stdout and stderr, and calls ``os._exit``. What is skipped: the
interpreter's finalization (``__del__`` of objects still alive, C-level ``atexit``
functions of extension libraries) and a handler registered after the report with the
very function (by ``==``) of one registered before it (both are unregistered).

The status it keeps: a program ended by an uncaught exception already exits non-zero
and is left to end as it does; one that called ``sys.exit(n)`` with a non-zero ``n``
(in its main thread, through ``sys.exit``: :func:`watch_sys_exit`) is left to end with
``n``. Only a status that would be 0 becomes 1. Either way, a save still being written
makes the process end at once, with the status it was ending with.
"""

from __future__ import annotations

import atexit
import functools
import gc
import io
import os
import signal
import sys
import threading
from typing import NoReturn

from ._terminal import printable

__all__ = ["EXIT_STATUS", "chosen_status", "describe", "done_waiting", "exception_status", "exit_now", "failure",
           "gave_up", "lost", "register_report", "say", "waiting", "watch_sys_exit"]

EXIT_STATUS = 1  # what an uncaught exception (torch.save's error, say) would have given
PREFIX = "ckptstore: "
INTACT = "checkpoints committed earlier are intact"


def say(line: str) -> None:
    """One line on stderr, now (the interpreter may be exiting: no warnings, no logging)."""
    stream = sys.stderr if sys.stderr is not None else sys.__stderr__
    if stream is None:
        return
    try:
        print(PREFIX + line, file=stream, flush=True)
    except Exception:  # a closed or broken stderr: nothing else to tell
        pass


def describe(future) -> str:
    """"the save of step 5 to runs/exp1/step-000000000005 (rank 1 of 4)", "the save to
    ckpt/latest.pt", "the promotion of step 5 to the durable tier s3://..."."""
    what = "the promotion" if getattr(future, "promotion", False) else "the save"
    step = "" if future.step is None else f" of step {future.step}"
    where = " to the durable tier " if getattr(future, "promotion", False) else " to "
    rank = f" (rank {future.rank} of {future.world_size})" if future.world_size > 1 else ""
    return f"{what}{step}{where}{printable(future.where)}{rank}"


def left(future) -> str:
    """How much of a save in flight is left, in words ("" when unknown)."""
    p = future.progress()
    if p is None:
        return ""
    if p.committing:
        return "its data is written; its commit is running"
    if not p.chunks:
        return "writing"
    return (f"{_size(p.nbytes - p.bytes_written)} of {_size(p.nbytes)} still to write, "
            f"{p.chunks - p.chunks_written} of {p.chunks} chunks")


def waiting(pending: list, seconds: float) -> list[str]:
    """The drain's first words, once it has waited a moment: what it waits for, for how long."""
    n = len(pending)
    lines = [f"waiting up to {seconds:.0f}s for {n} save{'s' if n > 1 else ''} in flight to commit before "
             f"exiting (Ctrl-C stops waiting; what is not committed then is lost, {INTACT}):"]
    for f in pending:
        how = left(f)
        lines.append(f"  {describe(f)}" + (f": {how}" if how else ""))
    return lines


def done_waiting(waited: list) -> str:
    """The drain's last words when it said it waits and every save settled."""
    committed = [f for f in waited if f.done() and f.failure() is None]
    if len(waited) == 1:
        f = waited[0]
        return f"done waiting: {describe(f)} " + ("committed" if committed else "did not commit")
    return f"done waiting: {len(committed)} of {len(waited)} saves committed"


def gave_up(pending: list, why: str) -> list[str]:
    """The drain stopped waiting (``why``: Ctrl-C, its timeout): what is lost."""
    lines = []
    for f in pending:
        how = left(f)
        lines.append(f"stopped waiting ({why}): {describe(f)} is not committed"
                     + (f" ({how})" if how else "") + f"; {INTACT}")
    return lines


def failure(future) -> str:
    """One failed save nobody looked at: what, where, why."""
    exc = future.failure()
    line = f"{describe(future)} failed and nothing waited for its outcome: {type(exc).__name__}: {printable(exc)}"
    return line + " (the local tier holds the step)" if getattr(future, "promotion", False) else line


def lost(future) -> str:
    """A save in flight at exit that nothing named yet (its attempt aborted, say)."""
    why = "its attempt was aborted" if future.aborted else "still in flight at exit"
    return f"{describe(future)} is not committed ({why})"


def exception_status() -> int | None:
    """How an uncaught exception that is ending the program ends it, or None when none
    is: Python printed its traceback and set ``sys.last_exc`` (3.12) / ``sys.last_value``,
    and exits with status 1, or dies by SIGINT for a KeyboardInterrupt (``-SIGINT``)."""
    exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if exc is None:
        return None
    return -signal.SIGINT if isinstance(exc, KeyboardInterrupt) else 1


_NOT_CALLED = object()
_exit_code = _NOT_CALLED  # what the main thread last passed to sys.exit (watch_sys_exit)


def watch_sys_exit() -> None:
    """From now on, note what the main thread passes to ``sys.exit`` (a thin wrapper:
    the status a ``SystemExit`` gives is not visible to an atexit handler). Not seen:
    ``raise SystemExit(n)`` and the ``exit()`` / ``quit()`` of the interactive
    interpreter, a ``from sys import exit`` taken before, ``sys.exit`` in another
    thread (it ends only that thread). The last call counts: one whose ``SystemExit``
    the program caught and went on from counts until the next."""
    original = sys.exit
    if getattr(original, "_ckptstore_watch", False):
        return

    @functools.wraps(original)
    def exit(status=None, /):  # noqa: A001 - it is sys.exit
        global _exit_code
        if threading.current_thread() is threading.main_thread():
            _exit_code = status
        original(status)

    exit._ckptstore_watch = True
    sys.exit = exit


def chosen_status() -> int | None:
    """The status the program chose with ``sys.exit`` (:func:`watch_sys_exit`), as
    Python turns it into one (None: 0; an int: its low 8 bits; anything else, which
    Python prints: 1); None when it did not call it."""
    code = _exit_code
    if code is _NOT_CALLED:
        return None
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    return 1


_registered_after: list = []  # what atexit.register got after the report: those have run when it runs
_report = None


def register_report(report) -> None:
    """Register ``report`` with atexit, and from then on note what else is registered
    (by a thin wrapper of ``atexit.register``), so that :func:`exit_now` can run the
    handlers registered before it, and only those (see the module's docstring)."""
    global _report
    original = atexit.register
    original = getattr(original, "__wrapped__", original) if getattr(original, "_ckptstore_watch", False) else original
    _report = report
    original(report)

    @functools.wraps(original)
    def register(func, /, *args, **kwargs):
        _registered_after.append(func)
        return original(func, *args, **kwargs)

    register._ckptstore_watch = True
    atexit.register = register


def exit_now(status: int = EXIT_STATUS) -> NoReturn:
    """End the process now, from the report's atexit handler, with ``status`` (``-N``:
    killed by signal N, as Python ends after a KeyboardInterrupt), after what the rest
    of Python's shutdown would do that matters: the atexit handlers registered before
    the report (``weakref.finalize``'s, ``multiprocessing``'s, ``logging``'s, torch's,
    the program's: :func:`register_report`), then the flush of files left open, stdout
    and stderr. What is skipped: the interpreter's finalization."""
    _run_earlier_handlers()
    _flush_open_files()
    if status < 0:
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    os._exit(status if status > 0 else 128 - status)


def _run_earlier_handlers() -> None:
    run = getattr(atexit, "_run_exitfuncs", None)
    if run is None or _report is None:  # (not CPython: the hooks that matter, by name)
        for hook in _shutdown_hooks():
            try:
                hook()
            except BaseException:  # noqa: BLE001 - each is best effort; the exit must happen
                pass
        return
    for func in list(_registered_after) + [_report]:  # (they ran: atexit runs the last registered first)
        atexit.unregister(func)
    try:
        run()  # (prints, as Python does, what a handler raises, and goes on)
    except BaseException:  # noqa: BLE001 - a Ctrl-C in one: the exit must happen
        pass


def _shutdown_hooks() -> list:
    hooks = []
    finalize = getattr(sys.modules.get("weakref"), "finalize", None)
    if finalize is not None and hasattr(finalize, "_exitfunc"):
        hooks.append(finalize._exitfunc)
    mp_util = sys.modules.get("multiprocessing.util")
    if mp_util is not None and hasattr(mp_util, "_exit_function"):
        hooks.append(mp_util._exit_function)
    logging = sys.modules.get("logging")
    if logging is not None:
        hooks.append(logging.shutdown)
    return hooks


def _flush_open_files() -> None:
    """Files the program left open hold buffered writes that the interpreter's
    finalization would have flushed."""
    writers = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom, io.BufferedRWPair)
    for obj in gc.get_objects():
        # (by type, not isinstance: that may read an arbitrary object's __class__)
        if issubclass(type(obj), writers):
            try:
                if not obj.closed and obj.writable():
                    obj.flush()
            except Exception:
                pass
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except Exception:
            pass


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            break
    return f"{n:.1f} {unit}"
