"""The attempt's outcome as the launchers write it (``RESULT.json``), shared by
launch.py (torch's launcher) and agent.py (the in-job node agent): how each failed
rank ended, read from its exit status and torchelastic's error file.

``{"ok": bool, "failures": {rank: failure_record(...)}, ...}``; the launchers add
``launcher_signal``, ``launcher_error``, ``rendezvous_timeout``; the agent adds
``stop_reason`` (its in-job verdict was ``stop``: deterministic) and ``in_job_gave_up``
(it went cold). classify.py reads it.
"""

from __future__ import annotations

import json
import os

from .classify import first_exception

TRACEBACK_CHARS = 8000  # of a rank's traceback (and first exception) in the result and journal


def failure_record(f) -> dict:
    """One failed rank's record from torch's ``ProcessFailure`` ``f`` (which read the
    error file, if any)."""
    # No error file (a rank killed by a signal, or a script without @record / ckptstore's
    # hook): torch fills in placeholders, which are not the rank's error.
    has_file = f.error_file and os.path.isfile(f.error_file)
    data = f.error_file_data if (has_file and isinstance(f.error_file_data, dict)) else {}
    message = data.get("message")
    traceback = None
    if isinstance(message, dict):
        extra = message.get("extraInfo") if isinstance(message.get("extraInfo"), dict) else {}
        traceback = extra.get("py_callstack")
        message = message.get("message")
    message = message if isinstance(message, str) else None
    traceback = traceback if isinstance(traceback, str) else None
    # The first exception of the chain, read from the whole traceback: the journal keeps
    # only its head and tail (a C++ backtrace in a later exception runs to many KB).
    first = first_exception(message, traceback) if message is not None else None
    return {"local_rank": f.local_rank, "pid": f.pid, "exitcode": f.exitcode,
            "signal": f.signal_name() if f.exitcode < 0 else None,
            "error": message, "first": clip(first, TRACEBACK_CHARS) if first is not None else None,
            "traceback": clip(traceback, TRACEBACK_CHARS) if traceback is not None else None,
            "timestamp": f.timestamp}


def exited(local_rank: int, pid: int, status: int, error_file: str) -> dict:
    """The record of a process the agent reaped itself (``os.waitpid``'s ``status``)."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    return failure_record(ProcessFailure(local_rank=local_rank, pid=pid, exitcode=code, error_file=error_file))


def clip(text: str, limit: int) -> str:
    """``text`` within about ``limit`` characters: its head (where the first exception of
    a chain is) and its tail (the exception raised), what lies between left out."""
    if len(text) <= limit:
        return text
    head, tail = limit * 3 // 8, limit * 5 // 8
    return f"{text[:head]}\n[... {len(text) - head - tail} characters left out ...]\n{text[-tail:]}"


def write(path: str, result: dict) -> None:
    """Replace ``path`` with ``result`` atomically (the runner reads it after the exit)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(result, fh)
    os.replace(tmp, path)
