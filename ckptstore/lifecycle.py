"""In-flight saves of this process: ``wait()``, errors surfaced on the next save, and a
bounded wait at interpreter exit and on SIGTERM (preemption) so that a save whose
``save()`` call returned gets its chance to commit.

The exit drain waits at most ``config().exit_timeout`` (default 20 s: well inside the
30 s a launcher such as torchrun gives before SIGKILL). When it begins with saves in
flight, the process enters exit mode (:mod:`ckptstore.checkpoint.exiting`): each
in-flight attempt beats its heartbeat fast, the commit's waits presume a silent peer
dead and abort, and the drain returns as soon as every save is committed, failed or
aborted, never later than the timeout.

Nothing about a save is silent at exit (:mod:`ckptstore.exit_report` has the words):
a drain that waits more than a second says for what and how much is left; a Ctrl-C
while it waits stops it, naming what is lost; and a failed save whose error the
program never saw (no ``result()`` / ``exception()`` on its future, no ``wait()``, no
later save that raised it) is reported on stderr when the process exits, which then
exits with status 1 unless it is already ending with a non-zero one (an exception,
``sys.exit(n)``)."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import threading
import time
import warnings
import weakref
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures

from . import exit_report
from .checkpoint import exiting
from .checkpoint.save import SaveFuture
from .config import config
from .errors import BaseRetiredError, CkptStoreError

# Reentrant: the SIGTERM handler runs on the main thread, maybe while it holds the lock.
_lock = threading.RLock()
_inflight: set[SaveFuture] = set()
_preparing: set[Future] = set()  # staging warm-ups in flight (ckptstore.prepare)


class Failures:
    """The failed saves whose error the program has not seen, in the order they failed.

    The program sees a failure by its future's ``result()`` / ``exception()`` (which set
    ``future.observed``), by :func:`wait`, or by a later save that raised it. Until then:

    - the next save raises it (:meth:`for_next_save`): each failure is offered to one save
      only; a save raises one and passes over the others, which stay for ``wait()`` and
      the exit report. A failed promotion (tiers.py) is never a save's: ``wait()`` raises it;
    - ``wait()`` takes them all (:meth:`take_all`) and raises the first;
    - the exit report names them (:meth:`unseen`).

    Callers hold ``lifecycle._lock``."""

    def __init__(self):
        self._unseen: dict[SaveFuture, bool] = {}  # failed future -> offered to a save already

    def add(self, future: SaveFuture) -> None:
        for f in [f for f in self._unseen if f.observed]:  # (seen since: dropped as new failures come)
            del self._unseen[f]
        self._unseen[future] = False

    def unseen(self) -> list[SaveFuture]:
        return [f for f in self._unseen if not f.observed]

    def for_next_save(self) -> list[SaveFuture]:
        """The failures not seen yet and not offered to a save before, promotions aside;
        offered now (the caller marks the one it raises :meth:`seen`)."""
        offer = [f for f, offered in self._unseen.items()
                 if not offered and not f.observed and not getattr(f, "promotion", False)]
        for f in offer:
            self._unseen[f] = True
        return offer

    def take_all(self) -> list[SaveFuture]:
        """Every failure not seen yet, all seen from now on (``wait()`` raises the first)."""
        taken = self.unseen()
        self._unseen.clear()
        self.seen(*taken)
        return taken

    @staticmethod
    def seen(*futures: SaveFuture) -> None:
        for f in futures:
            f.observed = True

    def clear(self) -> None:
        self._unseen.clear()


_failures = Failures()
_abandoned: set[SaveFuture] = set()  # in flight when a drain stopped waiting (timeout, Ctrl-C): lost
_reported: set[SaveFuture] = set()  # named on stderr already (by the SIGTERM handler's report)
ANNOUNCE_AFTER = 1.0  # seconds a drain waits before it says for what (a quick commit says nothing)
WAIT_SLICE = 1.0  # the drain's waits, at most
_hooks_installed = False
_left_by_parent: list = []
_wait_listeners: list[weakref.WeakMethod] = []


def on_wait(method) -> None:
    """Call ``method(True)`` when this process starts waiting for its in-flight saves
    (``wait()``, the exit drain) and ``method(False)`` when it stops: a Checkpointer
    tells a supervisor it is saving, not hung. Held weakly."""
    with _lock:
        _wait_listeners[:] = [m for m in _wait_listeners if m() is not None]
        _wait_listeners.append(weakref.WeakMethod(method))


@contextlib.contextmanager
def _waiting():
    with _lock:
        busy = bool(_inflight)
        listeners = [m for m in (ref() for ref in _wait_listeners) if m is not None] if busy else []
    for m in listeners:
        m(True)
    try:
        yield
    finally:
        for m in listeners:
            m(False)


def exit_timeout() -> float:
    """Seconds to wait at exit or SIGTERM: ``config().exit_timeout``
    (CKPTSTORE_EXIT_TIMEOUT, default 20), read when the wait begins."""
    return config().exit_timeout


def track(future: SaveFuture) -> SaveFuture:
    install_hooks()
    with _lock:
        _inflight.add(future)
    future.add_done_callback(_on_done)
    if exiting.active():  # saved after the exit began (a SIGTERM handler's last save)
        future.watch_exit()
    return future


def track_preparation(future: Future) -> Future:
    """A staging warm-up (``ckptstore.prepare``) on a worker thread. The exit drain
    cancels it if it has not begun and waits for it if it has: it runs native code with
    the GIL released, and a daemon thread coming back from there while the interpreter
    finalises aborts the process ("terminate called without an active exception")."""
    install_hooks()
    with _lock:
        _preparing.add(future)
    future.add_done_callback(_prepared)
    return future


def _prepared(future: Future) -> None:
    with _lock:
        _preparing.discard(future)


def _settle_preparations(timeout: float) -> None:
    with _lock:
        pending = list(_preparing)
    for f in pending:
        f.cancel()  # not begun: never begins
    wait_futures(pending, timeout)


def _on_done(future: SaveFuture) -> None:
    with _lock:
        _inflight.discard(future)
        if future.failure() is not None:
            _failures.add(future)
        _abandoned.discard(future)


def raise_earlier_failure() -> None:
    """Called at the start of a save: report a background failure nobody has seen yet."""
    with _lock:
        pending = _failures.for_next_save()
    # A save whose incremental base a gc beside the job deleted: documented, and this
    # save writes everything; the job goes on, told of the step it did not get.
    for f in [f for f in pending if isinstance(f.failure(), BaseRetiredError)]:
        pending.remove(f)
        _failures.seen(f)
        warnings.warn(f"an earlier save to {f.where} (step {f.step}) did not commit: {f.failure()}",
                      RuntimeWarning, stacklevel=3)
    if pending:  # (the others are passed over: wait() raises them, or the exit report names them)
        first = pending[0]
        _failures.seen(first)
        exc = first.failure()
        raise CkptStoreError(f"an earlier save to {first.where} (step {first.step}) failed: {exc}") from exc


def wait(timeout: float | None = None) -> None:
    """Wait for every in-flight save of this process; raise the first error (of a save
    waited for here, or of an earlier one nobody has looked at). Every failure it covers
    counts as seen: none is reported at exit."""
    deadline = None if timeout is None else time.monotonic() + timeout
    waited: list[SaveFuture] = []
    with _waiting():
        while True:
            with _lock:
                pending = [f for f in _inflight if f not in waited]
            if not pending:
                break
            for f in pending:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                f.exception(left)  # TimeoutError when the deadline passes
                waited.append(f)
    with _lock:  # the program asked for them all (it gets the first): none is reported at exit
        failed = _failures.take_all()
    for f in waited + failed:
        exc = f.failure()
        if exc is not None:
            raise exc


def drain(timeout: float) -> bool:
    """The exit drain (see :func:`_drain`). Says on stderr what it waits for once that
    takes more than ``ANNOUNCE_AFTER`` seconds, and which saves it gives up on: at its
    timeout, or at a Ctrl-C while it waits, which ends the wait (the KeyboardInterrupt
    is taken: the process goes on exiting). A save given up on is not waited for again."""
    try:
        with _waiting(), _ctrl_c_interrupts():
            done = _drain(timeout)
    except KeyboardInterrupt:
        _give_up("Ctrl-C")
        return False
    if not done:
        _give_up(f"after {timeout:g}s: CKPTSTORE_EXIT_TIMEOUT / CKPTSTORE_ATEXIT_TIMEOUT")
    return done


def _drain(timeout: float) -> bool:
    """The exit drain: wait up to ``timeout`` seconds for in-flight saves; True when
    none is left that could still commit.

    With saves in flight it enters exit mode and makes each of them beat its
    heartbeat; it returns once every one is settled: committed, failed, or aborted
    (by this rank, which judged a peer dead, or by another)."""
    start = time.monotonic()
    deadline = start + timeout
    _settle_preparations(timeout)
    with _lock:
        if not _waited_for():
            return True
    exiting.enter()
    announced: list[SaveFuture] = []
    watched: set[SaveFuture] = set()
    while True:
        with _lock:
            pending = _waited_for()
        if not pending:
            if announced:
                exit_report.say(exit_report.done_waiting(announced))
            return True
        for f in pending:
            if f not in watched:  # (once: each call beats the heartbeat now)
                watched.add(f)
                f.watch_exit()
        now = time.monotonic()
        if now >= deadline:
            return False
        if not announced and now - start >= ANNOUNCE_AFTER:
            announced = list(pending)
            for line in exit_report.waiting(pending, deadline - now):
                exit_report.say(line)
        until = deadline if announced else min(deadline, start + ANNOUNCE_AFTER)
        # (in slices: a Ctrl-C that lands just before a wait begins is seen at the next)
        pending[0].wait_settled(min(until - now, WAIT_SLICE))


def _waited_for() -> list[SaveFuture]:  # (under _lock)
    return [f for f in _inflight if not f.settled() and f not in _abandoned]


@contextlib.contextmanager
def _ctrl_c_interrupts():
    """While the drain waits, Ctrl-C raises KeyboardInterrupt (which ends the wait), even
    where the program set a SIGINT handler of its own (one that only sets a flag would
    leave an exiting process waiting): the process is exiting. Left alone where SIGINT
    is ignored or at its default action, and off the main thread (where it cannot be set)."""
    previous = None
    if threading.current_thread() is threading.main_thread():
        current = signal.getsignal(signal.SIGINT)
        if callable(current) and current is not signal.default_int_handler:
            previous = current
            signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def _give_up(why: str) -> None:
    """Say which saves the exit leaves behind (on stderr: warnings may no longer show at
    interpreter exit); their attempts stay uncommitted and gc cleans them up."""
    with _lock:
        pending = _waited_for()
        _abandoned.update(pending)
        _reported.update(pending)
    for line in exit_report.gave_up(pending, why):
        exit_report.say(line)


def _report() -> tuple[bool, bool]:
    """Name on stderr every failed save the program never looked at, and every save
    in flight that will not commit, that nothing has named yet. Returns (any failed
    unseen, any in flight), named now or before."""
    with _lock:
        failed = _failures.unseen()
        lost = [f for f in _inflight if not f.done()]
        new = [f for f in failed + lost if f not in _reported]
        _reported.update(new)
    for f in new:
        exit_report.say(exit_report.failure(f) if f.done() else exit_report.lost(f))
    if new:
        exit_report.say(f"nothing of {'it' if len(new) == 1 else 'them'} is committed; {exit_report.INTACT}. "
                        "To handle failed saves yourself, call .result() on the future a save returns, or "
                        "ckptstore.wait() before the program ends (it raises the first failure)")
    return bool(failed), bool(lost)


def report_at_exit() -> int | None:
    """The report at interpreter exit: wait for what a later atexit handler may still
    have saved, report (:func:`_report`), and say how the process must end: None, as
    it would have; else at once (:func:`exit_report.exit_now`) with that status.

    - a save failed and nobody saw it: status 1, unless the program is already
      ending with a non-zero status (None): an exception ends it, or it called
      ``sys.exit(n)`` with a non-zero ``n`` (``exit_report.chosen_status``);
    - a save is still in flight (the drain gave up on it): at once in any case, so
      that no write of it runs into the interpreter's finalization (a thread coming
      back from native code there aborts the process), with the status the program
      was ending with when an exception or ``sys.exit(n)`` ends it, else 1."""
    with _lock:
        late = bool(_waited_for())
    if late:
        drain(config().atexit_timeout)
    failed, lost = _report()
    if not (failed or lost):
        return None
    by_exception = exit_report.exception_status()
    if by_exception is not None:
        return by_exception if lost else None
    chosen = exit_report.chosen_status()  # sys.exit(n): a non-zero n stands
    if chosen:
        return chosen if lost else None
    exit_report.say(f"exit status {exit_report.EXIT_STATUS}: a save did not commit")
    return exit_report.EXIT_STATUS


def _at_exit() -> None:
    try:
        status = report_at_exit()
    except KeyboardInterrupt:  # one more Ctrl-C while it reports: stop now, as Ctrl-C does
        status = -signal.SIGINT
    if status is not None:
        exit_report.exit_now(status)


def _after_fork_in_child() -> None:
    # The parent's saves are the parent's: a forked child neither waits for them (in
    # wait() or at its exit) nor reports their failures; its lock may have been held.
    # (Kept, not freed: see _threads._after_fork_in_child.)
    global _lock, _failures
    _lock = threading.RLock()
    _left_by_parent.append((set(_inflight), set(_preparing), _failures, set(_abandoned), set(_reported)))
    _failures = Failures()
    for held in (_inflight, _preparing, _abandoned, _reported):
        held.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
# Registered when ckptstore is imported, so that it runs after the atexit handlers the
# program registers later (last registered, first run), the exit drain among them; when
# it ends the process it runs those registered before it first (exit_report).
exit_report.register_report(_at_exit)


def install_hooks() -> None:
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    atexit.register(lambda: drain(config().atexit_timeout))
    exit_report.watch_sys_exit()  # (the status a sys.exit(n) gives is kept: report_at_exit)
    if threading.current_thread() is not threading.main_thread():
        return
    if not config().handle_sigterm:  # CKPTSTORE_HANDLE_SIGTERM=0
        return
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum, frame):
        drain(exit_timeout())
        if callable(previous):
            previous(signum, frame)  # (if it exits, the report at exit names what did not commit)
        else:
            _report()  # no atexit handler runs after this; the status says SIGTERM
            # Default action: die by SIGTERM, as the process would have without us.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    if previous in (signal.SIG_DFL, None) or callable(previous):
        signal.signal(signal.SIGTERM, on_sigterm)


def abandon(reason: str, timeout: float) -> list[int | None]:
    """In-job restart (ckptstore.inprocess): this process's round failed, so none of its
    in-flight saves and promotions can commit (a peer's vote will never come). Write each
    one's abort marker (the commit's waits on every rank end at it), wait up to
    ``timeout`` seconds in all until each is settled, and count them seen: the next save
    does not raise them, ``wait()`` and the exit report do not name them. Returns their
    steps (the journal lists them). Without it the one commit thread of the process
    would wait ``commit_timeout`` for the dead rank's vote and hold every later commit
    behind it."""
    from .checkpoint.votes import abort

    with _lock:
        pending = [f for f in _inflight if not f.settled()]
        for f in pending:
            f.observed = True
    if not pending:
        return []
    # Exit mode while it waits: each attempt's heartbeat looks for its abort marker and
    # settles the save when it sees it, whatever stage the save is in.
    was_exiting = exiting.active()
    exiting.enter()
    try:
        for f in pending:
            if f.storage is not None:
                abort(f.storage, f.attempt, reason)
            f.watch_exit()  # (beats and looks now)
        deadline = time.monotonic() + timeout
        for f in pending:
            f.wait_settled(max(0.0, deadline - time.monotonic()))
    finally:
        if not was_exiting:
            exiting.leave()
    with _lock:
        for f in pending:
            f.observed = True
            if not f.settled():
                _abandoned.add(f)  # (the exit drain does not wait for it again)
                _reported.add(f)
    return [f.step for f in pending]
