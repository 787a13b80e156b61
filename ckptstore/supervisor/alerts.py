"""The user's alert command (``ckptstore run --alert CMD``), run for each event in
the background: recovery never waits for it.

One command per event, the event as JSON on its stdin, in a session of its own, one
after the other in the order of the events (a give-up's alert never arrives before the
failure's), on one thread of the supervisor's. Each is waited for at most
:data:`TIMEOUT_S`, then its process group is killed (the shell and what it waits for, a
hung ``curl`` included; a command it started in the background and left is the
user's), and it is reaped. :meth:`Alerts.drain` waits for the alerts still to run when
the supervisor exits (each bounded by the timeout), so the alert of a give-up is sent
before ``ckptstore run`` returns.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading

TIMEOUT_S = 30.0


class Alerts:
    def __init__(self, command: str | None):
        self.command = command
        self._queue: queue.Queue = queue.Queue()
        self._worker: threading.Thread | None = None

    def send(self, event: dict) -> None:
        """Queue the command for ``event`` and return at once."""
        if not self.command:
            return
        self._queue.put(event)
        if self._worker is None:
            self._worker = threading.Thread(target=self._work, name="ckptstore-alerts", daemon=True)
            self._worker.start()

    def drain(self) -> None:
        """Wait until every queued alert has run (each at most TIMEOUT_S)."""
        if self._worker is not None:
            self._queue.join()

    def _work(self) -> None:
        while True:
            event = self._queue.get()
            try:
                run(self.command, event)
            except Exception as e:  # noqa: BLE001 - an alert must never take the supervisor down
                print(f"ckptstore run: the alert command failed: {type(e).__name__}", file=sys.stderr, flush=True)
            finally:
                self._queue.task_done()


def run(command: str, event: dict, timeout: float | None = None) -> None:
    """Run ``command`` with ``event`` as JSON on stdin, wait at most ``timeout`` seconds
    (default :data:`TIMEOUT_S`), kill its process group if it is still running, reap
    it. Best effort: a failure is said on stderr."""
    timeout = TIMEOUT_S if timeout is None else timeout
    # (what is printed never names the command: it may hold a webhook URL and its token)
    try:
        proc = subprocess.Popen(command, shell=True, stdin=subprocess.PIPE, text=True, start_new_session=True)
    except OSError as e:
        print(f"ckptstore run: the alert command failed to start: {_said(e)}", file=sys.stderr, flush=True)
        return
    try:
        proc.communicate(json.dumps(event, default=str), timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        # TimeoutExpired's text holds the command, and a webhook URL (its token) in it
        said = (f"timed out after {timeout:g} s; killed" if isinstance(e, subprocess.TimeoutExpired)
                else f"failed: {_said(e)}")
        print(f"ckptstore run: the alert command {said}", file=sys.stderr, flush=True)
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the shell and what it is waiting for
        except OSError:
            pass
        proc.wait()

def _said(e: OSError) -> str:
    """An OSError without its file name (the shell's path at most; never the command)."""
    return f"{type(e).__name__}: [Errno {e.errno}] {e.strerror}" if e.strerror else type(e).__name__
