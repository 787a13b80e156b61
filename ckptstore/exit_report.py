"""What a process says, and how it ends, when it exits with saves that did not commit.

The words of the exit drain (:mod:`ckptstore.lifecycle`) on stderr: what it waits for
and how much is left, which saves it gave up on, which failed saves nobody looked at;
and :func:`exit_now`, which ends a process that would otherwise exit with status 0.
Warnings are not used: at interpreter exit they may no longer show.

Why ``os._exit``: once the main module has finished (or ``sys.exit`` was called),
Python has fixed the exit status, and no hook of its shutdown can change it. So the
report, an atexit handler that ``ckptstore`` registers when it is imported (handlers
run last-registered first: the program's own, wandb's and the like, and ckptstore's
exit drain, have run by then), does what the rest of the shutdown would still do that
matters (finalizers of ``weakref.finalize`` and ``multiprocessing``, ``logging``, files
left open, stdout and stderr) and calls ``os._exit``. A program ended by an uncaught
exception already exits non-zero and is left to end as it does, unless a save is still
being written: then it ends at once too, with the status the exception gives.
"""

from __future__ import annotations

import gc
import io
import os
import signal
import sys
from typing import NoReturn

from ._terminal import printable

__all__ = ["EXIT_STATUS", "describe", "done_waiting", "exception_status", "exit_now", "failure", "gave_up", "lost",
           "say", "waiting"]

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
    committed = [f for f in waited if f.done() and f._future.exception() is None]
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
    exc = future._future.exception()
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


def exit_now(status: int = EXIT_STATUS) -> NoReturn:
    """End the process now, from an atexit handler, with ``status`` (``-N``: killed by
    signal N, as Python ends after a KeyboardInterrupt), after what the rest of Python's
    shutdown would do that matters: the exit hooks of ``weakref.finalize`` (temporary
    directories), ``multiprocessing`` (children joined or terminated) and ``logging``,
    the flush of files left open, stdout and stderr. What is skipped: atexit handlers
    registered before ``ckptstore`` was imported, other than those, and finalization."""
    for hook in _shutdown_hooks():
        try:
            hook()
        except BaseException:  # noqa: BLE001 - each is best effort; the exit must happen
            pass
    if status < 0:
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    os._exit(status if status > 0 else 128 - status)


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
    hooks.append(_flush_open_files)
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
