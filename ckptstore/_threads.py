"""Thread pools for ckptstore's background work (owned by the runtime, used by storage too)."""

from __future__ import annotations

import collections
import os
import threading
import weakref
from concurrent.futures import Future

__all__ = ["DaemonThreadPool", "in_background_thread", "run_all"]

_local = threading.local()
_pools: weakref.WeakSet = weakref.WeakSet()  # every DaemonThreadPool of the process (fork resets them)


def in_background_thread() -> bool:
    """Whether the calling thread is one of ckptstore's pool threads (not the caller's)."""
    return getattr(_local, "background", False)


class DaemonThreadPool:
    """A ``concurrent.futures``-style executor whose threads are daemons.

    ``ThreadPoolExecutor`` threads are joined before atexit handlers run, which would
    make interpreter exit wait, unbounded, for a write or upload in flight, or refuse
    its next part; ckptstore bounds that wait itself (``ckptstore.lifecycle``). Threads
    start on demand, up to ``max_workers``. The runtime uses it for its workers, and
    s3transfer takes it as ``executor_cls``.

    In a child made by ``fork()`` the pool starts afresh: none of the parent's threads
    exist there, and the work queued in the parent is dropped, never run (it writes the
    parent's saves: run twice, it would append to the parent's files). A child that
    waits on a future of the parent's waits forever; it makes its own saves instead.
    """

    def __init__(self, max_workers: int, name: str = "ckptstore"):
        self._max = max(1, int(max_workers))
        self._name = name
        self._shutdown = False
        self._start_empty()
        _pools.add(self)

    def _start_empty(self) -> None:
        self._queue: collections.deque = collections.deque()
        self._cv = threading.Condition()  # (after a fork: a lock a parent's thread held stays held)
        self._threads: list[threading.Thread] = []
        self._idle = 0

    def submit(self, fn, *args, **kwargs) -> Future:
        future: Future = Future()
        with self._cv:
            if self._shutdown:
                raise RuntimeError("executor is shut down")
            self._queue.append((future, fn, args, kwargs))
            # A thread that was notified but has not woken yet still counts as idle:
            # start another when the queue holds more items than there are waiters.
            if len(self._queue) > self._idle and len(self._threads) < self._max:
                t = threading.Thread(target=self._run, name=f"{self._name}-{len(self._threads)}", daemon=True)
                try:
                    t.start()  # counted only once started: a dead thread must not take a slot
                except BaseException:
                    if not self._threads:  # nobody would ever run it: the caller gets the error
                        self._queue.pop()
                        raise
                    self._cv.notify()  # a running thread takes it later
                else:
                    self._threads.append(t)
            else:
                self._cv.notify()
        return future

    def _run(self) -> None:
        _local.background = True
        while True:
            with self._cv:
                self._idle += 1
                while not self._queue and not self._shutdown:
                    self._cv.wait()
                self._idle -= 1
                if not self._queue:
                    return
                future, fn, args, kwargs = self._queue.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as e:
                future.set_exception(e)
            else:
                future.set_result(result)
            del future, fn, args, kwargs

    def shutdown(self, wait: bool = True) -> None:
        with self._cv:
            self._shutdown = True
            self._cv.notify_all()
            threads = list(self._threads)
        if wait:
            for t in threads:
                if t is not threading.current_thread():
                    t.join()

    @property
    def max_workers(self) -> int:
        return self._max


_left_by_parent: list = []


def _after_fork_in_child() -> None:
    for pool in list(_pools):
        # The parent's queued work is kept, never run: freeing it here would release
        # staging buffers into pools whose locks the parent's threads may have held.
        _left_by_parent.append(pool._queue)
        pool._start_empty()


os.register_at_fork(after_in_child=_after_fork_in_child)


def run_all(pool, jobs: list) -> list:
    """The results of ``jobs`` (functions of no argument), in order: on ``pool`` when
    there is one and more than one job, else one after the other. The first failure
    is raised, and the jobs not started yet are cancelled."""
    if pool is None or len(jobs) < 2:
        return [job() for job in jobs]
    futures = [pool.submit(job) for job in jobs]
    try:
        return [f.result() for f in futures]
    finally:
        for f in futures:
            f.cancel()
