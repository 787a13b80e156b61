"""In-flight saves of this process: ``wait()``, errors surfaced on the next save, and a
bounded wait at interpreter exit and on SIGTERM (preemption) so that a save whose
``save()`` call returned gets its chance to commit.

The exit drain waits at most ``config().exit_timeout`` (default 20 s: well inside the
30 s a launcher such as torchrun gives before SIGKILL). When it begins with saves in
flight, the process enters exit mode (:mod:`ckptstore.checkpoint.exiting`): each
in-flight attempt beats its heartbeat fast, the commit's waits presume a silent peer
dead and abort, and the drain returns as soon as every save is committed, failed or
aborted, never later than the timeout."""

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

from .checkpoint import exiting
from .checkpoint.save import SaveFuture
from .config import config
from .errors import BaseRetiredError, CkptStoreError

# Reentrant: the SIGTERM handler runs on the main thread, maybe while it holds the lock.
_lock = threading.RLock()
_inflight: set[SaveFuture] = set()
_preparing: set[Future] = set()  # staging warm-ups in flight (ckptstore.prepare)
_unobserved_failures: list[SaveFuture] = []
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
        if future._future.exception() is not None:
            _unobserved_failures.append(future)


def raise_earlier_failure() -> None:
    """Called at the start of a save: report a background failure nobody has seen yet."""
    with _lock:
        # A failed promotion (tiers.py) is not this save's business: wait() raises it.
        pending = [f for f in _unobserved_failures if not f.observed and not getattr(f, "promotion", False)]
        _unobserved_failures[:] = [f for f in _unobserved_failures
                                   if not f.observed and getattr(f, "promotion", False)]
    # A save whose incremental base a gc beside the job deleted: documented, and this
    # save writes everything; the job goes on, told of the step it did not get.
    for f in [f for f in pending if isinstance(f._future.exception(), BaseRetiredError)]:
        pending.remove(f)
        f.observed = True
        warnings.warn(f"an earlier save to {f.where} (step {f.step}) did not commit: {f._future.exception()}",
                      RuntimeWarning, stacklevel=3)
    if pending:
        first = pending[0]
        first.observed = True
        exc = first._future.exception()
        raise CkptStoreError(f"an earlier save to {first.where} (step {first.step}) failed: {exc}") from exc


def wait(timeout: float | None = None) -> None:
    """Wait for every in-flight save of this process; raise the first error (of a save
    waited for here, or of an earlier one nobody has looked at)."""
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
    with _lock:
        failed = [f for f in _unobserved_failures if not f.observed]
        _unobserved_failures.clear()
    for f in waited + failed:
        exc = f._future.exception()
        if exc is not None:
            f.observed = True
            raise exc


def drain(timeout: float) -> bool:
    """The exit drain (see :func:`_drain`); says on stderr which saves it gives up on."""
    with _waiting():
        done = _drain(timeout)
    if not done:
        _report_abandoned(timeout)
    return done


def _drain(timeout: float) -> bool:
    """The exit drain: wait up to ``timeout`` seconds for in-flight saves; True when
    none is left that could still commit.

    With saves in flight it enters exit mode and makes each of them beat its
    heartbeat; it returns once every one is settled: committed, failed, or aborted
    (by this rank, which judged a peer dead, or by another)."""
    deadline = time.monotonic() + timeout
    _settle_preparations(timeout)
    with _lock:
        if not _inflight:
            return True
    exiting.enter()
    while True:
        with _lock:
            pending = [f for f in _inflight if not f.settled()]
        if not pending:
            return True
        for f in pending:
            f.watch_exit()
        for f in pending:
            left = deadline - time.monotonic()
            if left <= 0 or not f.wait_settled(left):
                return False


def _report_abandoned(timeout: float) -> None:
    """Say which saves the exit leaves behind (on stderr: warnings may no longer show at
    interpreter exit); their attempts stay uncommitted and gc cleans them up."""
    import sys

    with _lock:
        pending = [f for f in _inflight if not f.settled()]
    for f in pending:
        print(f"ckptstore: exiting without waiting longer for the save of step {f.step} to {f.where} "
              f"(waited {timeout:g}s; CKPTSTORE_EXIT_TIMEOUT / CKPTSTORE_ATEXIT_TIMEOUT): it is not committed",
              file=sys.stderr, flush=True)


def _after_fork_in_child() -> None:
    # The parent's saves are the parent's: a forked child neither waits for them (in
    # wait() or at its exit) nor reports their failures; its lock may have been held.
    # (Kept, not freed: see _threads._after_fork_in_child.)
    global _lock
    _lock = threading.RLock()
    _left_by_parent.append((set(_inflight), set(_preparing), list(_unobserved_failures)))
    _inflight.clear()
    _preparing.clear()
    _unobserved_failures.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def install_hooks() -> None:
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    atexit.register(lambda: drain(config().atexit_timeout))
    if threading.current_thread() is not threading.main_thread():
        return
    if not config().handle_sigterm:  # CKPTSTORE_HANDLE_SIGTERM=0
        return
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum, frame):
        drain(exit_timeout())
        if callable(previous):
            previous(signum, frame)
        else:
            # Default action: die by SIGTERM, as the process would have without us.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    if previous in (signal.SIG_DFL, None) or callable(previous):
        signal.signal(signal.SIGTERM, on_sigterm)
