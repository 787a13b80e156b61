"""Liveness of a multi-rank save: the heartbeat each rank beats, how its peers read it,
and the paced, bounded waits that watch it.

- :class:`Heartbeat` beats one rank's heartbeat of an attempt from the start of its save
  to its end (every :func:`save_beat_every` seconds; fast once the process exits:
  :mod:`ckptstore.checkpoint.exiting`);
- :class:`PeerWatch` reads the heartbeats of the peers a commit still needs, and
  :func:`patience` says how long one may stay unchanged before the peer is presumed dead;
- :class:`Deadline` is every wait of the commit: polling storage with jittered backoff
  until a deadline, at the cadences :func:`committer_cadence` and
  :func:`follower_cadence` set for the world size (votes travel through storage, so no
  background thread needs a collective).

Liveness is judged by whether a heartbeat's *content* changed between two reads, on the
reader's own monotonic clock; no clock of another machine is compared with this one.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from .. import format as fmt
from .. import names
from .._jitter import jitter as _jitter
from ..errors import ObjectNotFoundError
from ..storage import Storage
from .exiting import active, beat_every, heartbeat_bytes, liveness, says_exiting
from .manifests import read_capped


# Every rank of a multi-rank save beats its heartbeat this often from its start to its
# end, commit waits included (Heartbeat; a save shorter than this writes none):
# what gc's grace and a peer in exit mode hold a silent rank to.
SAVE_BEAT_EVERY = 3.0
# ... and no faster than keeps all of a job's beats (one PUT and one HEAD each) under about
# this many a second on their one prefix: 4,096 ranks beat every 8 s.
SAVE_BEATS_PER_S = 500


def save_beat_every(world_size: int) -> float:
    """The heartbeat period of each rank of a ``world_size``-rank save."""
    return max(SAVE_BEAT_EVERY, world_size / SAVE_BEATS_PER_S)


class Heartbeat:
    """Beats one attempt's heartbeat of this rank while its multi-rank save is in
    flight, whatever stage it is in: every ``every`` seconds normally (the first beat
    after one period, so a short save writes none), and every :func:`beat_every`
    seconds once the process exits (:meth:`hurry`), when it also watches for the
    attempt's abort marker (one stat per beat).

    A peer judging this rank so always has a cadence to hold it to: a rank whose
    main thread cannot run its signal handler (blocked in a collective) still beats
    from here, and is not taken for dead while its upload goes on.

    Runs until ``settled`` is set (the save finished) or the attempt is aborted, in
    which case it calls ``on_aborted`` once and stops beating."""

    def __init__(self, storage: Storage, attempt: str, rank: int, every: float, settled: threading.Event,
                 on_aborted: Callable[[], None]):
        self._storage = storage
        self._key = names.heartbeat_name(attempt, rank)
        self._abort_key = names.abort_name(attempt)
        self._every = every
        self._settled = settled
        self._on_aborted = on_aborted
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"ckptstore-heartbeat-r{rank}", daemon=True)

    def start(self) -> "Heartbeat":
        self._thread.start()
        return self

    def hurry(self) -> None:
        """Exit mode began: beat now, then fast."""
        self._wake.set()

    def stop(self) -> None:
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait(beat_every() if active() else self._every)
            self._wake.clear()
            if self._settled.is_set():
                return
            try:
                self._storage.put(self._key, heartbeat_bytes())  # a plain overwrite, as every heartbeat
            except Exception:
                pass  # a missed beat costs a peer's patience, never data
            if not active():
                continue
            try:
                aborted = self._storage.exists(self._abort_key)
            except Exception:
                aborted = False
            if aborted:
                self._on_aborted()
                return


class PeerWatch:
    """Exit mode: how long each watched peer's heartbeat has gone unchanged.

    Each look reads the heartbeats of the ranks asked about (at most once per
    ``beat_every()``); a rank's silence is the time, on this process's
    monotonic clock, since its heartbeat's content last differed from the previous
    read, or since this watch first read it (a missing heartbeat counts as content).
    A heartbeat that cannot be read gives no evidence: that rank is left out.
    """

    def __init__(self, storage: Storage, attempt: str):
        self._storage = storage
        self._attempt = attempt
        self._seen: dict[int, tuple[bytes | None, float]] = {}  # rank -> (content, when it last changed)
        self._next = 0.0

    def due(self) -> bool:
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + beat_every()
        return True

    def look(self, ranks) -> dict[int, tuple[bytes | None, float]]:
        """{rank: (its heartbeat's content or None, seconds it has been unchanged)}."""
        out = {}
        for r in ranks:
            try:
                content = read_capped(self._storage, names.heartbeat_name(self._attempt, r),
                                      fmt.MAX_MARKER_BYTES, "heartbeat")
            except ObjectNotFoundError:
                content = None
            except Exception:
                continue  # no evidence either way
            now = time.monotonic()
            seen = self._seen.get(r)
            if seen is None or seen[0] != content:
                seen = self._seen[r] = (content, now)
            out[r] = (content, now - seen[1])
        return out


def patience(content: bytes | None, world_size: int) -> float:
    """How long a peer's heartbeat may stay unchanged before it is presumed dead: the
    window when it says the peer exits too (it beats fast), else its normal period plus
    the window (every rank in a multi-rank save beats every save_beat_every() seconds,
    even one whose main thread is stuck in a collective and never saw the signal)."""
    return liveness() if says_exiting(content) else save_beat_every(world_size) + liveness()


def presumed_dead(dead: list[int], me: int, silent: float) -> str:
    return (f"ranks {dead} presumed dead by rank {me}, which is exiting: their heartbeat did not change "
            f"for {silent:g}s (CKPTSTORE_EXIT_LIVENESS)")


class Deadline:
    """Polling with backoff until a deadline: waits on storage, never on the training
    process group (votes travel through storage, so background threads need no
    collectives). The waiting rank's heartbeat, which keeps gc from taking its attempt
    for abandoned (I7), is beaten by the save's own thread (:class:`Heartbeat`) from the
    start of the save to its end, waits included.

    The delay starts at ``start`` and doubles up to ``cap``; each sleep is jittered
    (half to all of it), so ranks that began waiting together do not poll in step."""

    def __init__(self, timeout: float, start: float = 0.002, cap: float = 0.25):
        self.end = time.monotonic() + timeout
        self.delay = start
        self.cap = max(cap, start)

    def sleep_or_expire(self) -> bool:
        left = self.end - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(self.delay * _jitter.uniform(0.5, 1.0), left))
        self.delay = min(self.delay * 2, self.cap)
        return True


# Every rank polls the same prefix while it waits, and an object store serves a prefix a
# bounded rate (S3: about 5,500 GETs and LISTs per second). The ranks that wait for the
# commit make one small GET per poll, spread so that together they make at most about
# FOLLOWER_POLLS_PER_S (at most eight times that at their first poll); the committer's
# one listing per poll (a page per 1,000 files: data, vote and heartbeat per rank) slows
# likewise. Below ~250 ranks the cadence is the fixed 0.25 s it always was.
FOLLOWER_POLLS_PER_S = 1000
COMMITTER_POLL_PAGES_PER_S = 12


def follower_cadence(world_size: int) -> tuple[float, float]:
    """(first delay, longest delay) of a rank waiting for the commit of ``world_size`` ranks."""
    cap = max(0.25, world_size / FOLLOWER_POLLS_PER_S)
    return max(0.002, world_size / (8 * FOLLOWER_POLLS_PER_S)), cap


def committer_cadence(world_size: int) -> tuple[float, float]:
    """(first delay, longest delay) of the committer waiting for the votes."""
    pages = 3 * world_size / 1000
    return 0.002, max(0.25, pages / COMMITTER_POLL_PAGES_PER_S)
