"""The progress channel between a supervised training process and ``ckptstore run``.

``ckptstore run`` sets ``CKPTSTORE_PROGRESS_DIR`` (a node-local directory) for the job;
each rank's :class:`~ckptstore.Checkpointer` then keeps ``rank-<R>.json`` there up to
date: the step reached, what the rank is doing (``loading`` a checkpoint, ``train``,
``saving`` (also while ``ckptstore.wait()`` or the exit waits for its saves),
``preempted``, ``done``), its step time, the blocking cost of its saves, the step it
resumed from and the newest step it saw committed (where the next attempt resumes,
a local tier's commits included); the section it is in (``section``: ``resume``,
``step``, ``save``) and when that began (``section_t``, unix seconds; ``section_mono``,
``time.monotonic()``, what the supervisor judges the section's bound by), the longest
duration it measured of each section (``longest``: ``resume``, ``step``, ``save``:
a save's time from its start to its commit) and the median of its last
:data:`STEP_WINDOW` step times (``step_median_s``, for stragglers).
The supervisor reads these files for hang detection (no rank advanced for the hang
timeout), the bounds of each section (sections.py), stragglers (stragglers.py), lost
work and the checkpoint-interval advice.

One small local file per rank, replaced atomically, rewritten at each step
(tens of microseconds): nothing here touches the checkpoint store.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

ENV_DIR = "CKPTSTORE_PROGRESS_DIR"
REPORT_EVERY = 1.0  # seconds between two reports of one rank that say nothing new
STATES = ("loading", "train", "saving", "preempted", "done")
SECTIONS = ("resume", "step", "save")  # what a rank reports it is in (sections.py judges them)
STEP_WINDOW = 20  # step times in a rank's ``step_median_s``


class ProgressReporter:
    """One rank's side: :meth:`report` rewrites its file (throttled while training)."""

    def __init__(self, directory: str, rank: int):
        self.path = os.path.join(directory, f"rank-{rank}.json")
        self.rank = rank
        self.record: dict = {"rank": rank, "pid": os.getpid(), "step": None, "state": "loading",
                             "started_t": time.time()}
        self._last = float("-inf")
        # A commit's callback reports from a worker thread; reentrant: a SIGTERM handler's
        # drain may report on the main thread while it is inside a report.
        self._lock = threading.RLock()

    @classmethod
    def from_env(cls, rank: int) -> "ProgressReporter | None":
        directory = os.environ.get(ENV_DIR)
        return cls(directory, rank) if directory else None

    def report(self, state: str | None = None, step: int | None = None, force: bool = False,
               section: str | None = None, **fields) -> None:
        """``state`` None keeps the current one (a field's news, such as a commit).
        ``section``: the section the rank is in from now on; another section, or a new
        step of the ``step`` section, starts its clock (``section_t``)."""
        with self._lock:
            now = time.monotonic()
            state = self.record["state"] if state is None else state
            # Each new step is written (a few tens of microseconds: lost work is then exact);
            # a report that says nothing new at most once a second.
            new_step = step is not None and step != self.record["step"]
            changed = state != self.record["state"] or new_step
            if section is not None and (section != self.record.get("section") or (section == "step" and new_step)):
                # section_t (wall) for people and the journal; section_mono judges the bound
                # (CLOCK_MONOTONIC is system-wide on Linux: the supervisor on this node reads it too)
                self.record.update(section=section, section_t=time.time(), section_mono=time.monotonic())
                changed = True
            if step is not None:
                self.record["step"] = int(step)
            self.record.update(fields, state=state, t=time.time())
            if not (force or changed or now - self._last >= REPORT_EVERY):
                return
            self._last = now
            self._write()

    def note_committed(self, step: int, committed_t: float) -> None:
        """A step this rank saw committed (or resumed from, committed at ``committed_t``,
        unix seconds): written at once when newer than the last one. Not progress: the
        report's time stays, so a background commit does not hold a hang's clock."""
        with self._lock:
            if step <= (self.record.get("committed_step") or -1):
                return
            self.record.update(committed_step=int(step), committed_t=committed_t)
            self._write()

    def note_longest(self, section: str, seconds: float) -> None:
        """A duration of ``section`` this rank measured: kept (and written at once) when
        it is the longest so far. Not progress: the report's time stays."""
        with self._lock:
            longest = self.record.setdefault("longest", {})
            if seconds <= longest.get(section, -1.0):
                return
            longest[section] = float(seconds)
            self._write()

    def _write(self) -> None:
        tmp = f"{self.path}.tmp-{os.getpid()}"
        try:
            with open(tmp, "w") as f:
                json.dump(self.record, f)
            os.replace(tmp, self.path)
        except OSError:
            pass  # a missed report only makes the supervisor's view older


def read_progress(directory: str) -> dict[int, dict]:
    """Every rank's latest report in ``directory`` (unreadable or partial files skipped)."""
    out: dict[int, dict] = {}
    try:
        names = os.listdir(directory)
    except OSError:
        return out
    for name in names:
        if not (name.startswith("rank-") and name.endswith(".json")):
            continue
        try:
            with open(os.path.join(directory, name)) as f:
                record = json.load(f)
            rank = int(name[5:-5])
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and record.get("state") in STATES:
            out[rank] = record
    return out


def guard_worker() -> None:
    """In a supervised worker: die with the launcher (no orphan outlives it), and leave
    an uncaught exception in torchelastic's error file, as ``@record`` would, so the
    supervisor classifies the failure from the traceback without parsing logs."""
    if not os.environ.get(ENV_DIR):
        return
    die_with_parent(signal.SIGKILL)
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        import sys

        previous = sys.excepthook

        def record(exc_type, exc, tb):
            _write_error_file(path, exc_type, exc, tb)
            previous(exc_type, exc, tb)

        if getattr(sys.excepthook, "__name__", "") != "record":
            sys.excepthook = record


def _write_error_file(path: str, exc_type, exc, tb) -> None:
    """torchelastic's error-file format, with the traceback of the exception itself
    (``ErrorHandler.record_exception`` formats the one being handled)."""
    from .bootstrap import write_error_file

    if os.path.exists(path):  # the program's own @record got there first
        return
    write_error_file(path, exc.with_traceback(tb) if exc is not None else exc_type())


def die_with_parent(signum: int) -> None:
    """Have the kernel send ``signum`` to this process when its parent dies (Linux)."""
    try:
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the supervisor kills the launcher's process group instead
