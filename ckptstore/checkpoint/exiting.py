"""Exit mode: the process is going away (SIGTERM, interpreter exit) with saves in flight.

``ckptstore.lifecycle`` enters it when its exit drain begins with a save in flight;
it lasts until the process ends (a save made after it, say by a SIGTERM handler that
saves once more, runs in exit mode too). The checkpoint layer reads it:

- every in-flight attempt of this process beats its heartbeat every :func:`beat_every`
  seconds (:class:`ckptstore.checkpoint.heartbeat.Heartbeat`, one small thread per
  attempt, whatever stage the save is in: staging, writing, voting or waiting), and the
  heartbeat says ``exiting``;
- the commit's waits judge the peers the commit still needs by their heartbeats
  (:class:`ckptstore.checkpoint.heartbeat.PeerWatch`): a peer whose heartbeat has not
  changed for the liveness window is presumed dead, so the commit cannot succeed and
  the attempt is aborted at once instead of at the commit timeout;
- a save whose attempt carries an abort marker cannot commit: the drain stops waiting
  for it (``SaveFuture.settled``).

Outside exit mode nothing of this runs: no extra request is made. Liveness is judged
by whether a heartbeat's *content* changed between two reads, on the reader's own
monotonic clock; no clock of another machine is compared with this one.
"""

from __future__ import annotations

import threading

from .. import format as fmt
from ..config import config

EXITING_MARK = "exiting"  # the word a heartbeat written in exit mode carries after its time
MAX_BEAT_EVERY = 1.0  # seconds between two exit-mode heartbeats (less when the window is short)

_active = threading.Event()


def enter() -> None:
    """The process is exiting: switch every in-flight and future save to exit mode."""
    _active.set()


def leave() -> None:
    """Back to normal mode: a Checkpointer's preemption save is settled and the program
    decides itself whether it exits (the atexit drain enters exit mode again if needed)."""
    _active.clear()


def active() -> bool:
    return _active.is_set()


def wait_active(timeout: float | None = None) -> bool:
    """Block until exit mode begins (tests use it to hold a save in flight)."""
    return _active.wait(timeout)


def liveness() -> float:
    """The liveness window: ``config().exit_liveness`` (CKPTSTORE_EXIT_LIVENESS)."""
    return config().exit_liveness


def beat_every() -> float:
    """Seconds between two heartbeats of an exiting rank: at least three beats fit the
    liveness window, so a late write or two is not taken for a death."""
    return min(MAX_BEAT_EVERY, liveness() / 3)


def heartbeat_bytes() -> bytes:
    """A heartbeat's content: the time (microseconds, so every beat differs) and, in exit
    mode, the word ``exiting``: a reader then knows this rank promised fast beats."""
    text = fmt.utc_now()
    return f"{text} {EXITING_MARK}".encode() if active() else text.encode()


def says_exiting(content: bytes | None) -> bool:
    """Whether a heartbeat's content (untrusted) was written in exit mode."""
    return content is not None and content.split(b" ")[-1:] == [EXITING_MARK.encode()]
