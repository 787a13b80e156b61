"""Two tiers: every save commits to a fast local store; every K-th is then promoted to
the durable store in the background (checkpoint/promote.py), one at a time, in order.

A promotion is a :class:`~ckptstore.SaveFuture` of the durable location, tracked like
a save: ``ckptstore.wait()`` waits for it and raises its error, the exit drain waits
for it (bounded) and beats its heartbeat, so gc in the durable store never takes a
promotion in flight for debris. A failed promotion does not fail the next save (the
local tier still works): it warns, and the next due one tries again.
"""

from __future__ import annotations

import threading
import warnings
from collections import deque

from . import lifecycle
from .checkpoint.promote import Throttle, promote
from .checkpoint.save import SaveFuture


class PromotionWarning(RuntimeWarning):
    """A promotion to the durable tier failed or falls behind; the local tier holds the step."""


class Promoter:
    """The background promotions of one :class:`~ckptstore.Store` in this process."""

    BACKLOG_WARN = 2  # promotions queued behind the running one before it warns

    def __init__(self, local, durable, bandwidth: float | None, timeout: float):
        self.local, self.durable = local, durable  # Stores
        self.throttle = Throttle(bandwidth)
        self.timeout = timeout
        self._lock = threading.Lock()
        self._queue: deque = deque()  # (future, local SaveFuture, rank, fence)
        self._pending: dict[int, int] = {}  # step -> promotions queued or running (local retention keeps it)
        self._worker: threading.Thread | None = None

    def pending_steps(self) -> set[int]:
        with self._lock:
            return set(self._pending)

    def schedule(self, save: SaveFuture, rank: int, world: int, fence) -> SaveFuture:
        """A promotion of ``save``'s checkpoint once it is committed locally (tracked now,
        so that a ``wait()`` right after the save already covers it)."""
        future = SaveFuture(self.durable.location(save.step).describe(), save.step, save.attempt,
                            storage=self.durable.location(save.step), rank=rank, world_size=world)
        future._staged.set()
        future.add_done_callback(_warn_on_failure)
        lifecycle.track(future)
        with self._lock:
            self._pending[save.step] = self._pending.get(save.step, 0) + 1
            self._queue.append((future, save, rank, fence))
            backlog = len(self._queue)
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(target=self._run, name="ckptstore-promote", daemon=True)
                self._worker.start()
        if backlog > self.BACKLOG_WARN + 1:
            warnings.warn(f"{self.durable.url}: {backlog} promotions wait for the durable tier; the local tier "
                          "keeps their steps until they are done (raise durable_every or promote_bandwidth)",
                          PromotionWarning, stacklevel=3)
        return future

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._worker = None
                    return
                future, save, rank, fence = self._queue.popleft()
            try:
                manifest = save.result()  # the local commit (its failure is the save's to report)
            except BaseException as e:
                future.observed = True
                self._finish(future, save.step, error=e, quiet=True)
                continue
            try:
                result = promote(self.local.location(save.step), self.durable.location(save.step), manifest,
                                 rank, timeout=self.timeout, fence=fence, throttle=self.throttle)
            except BaseException as e:
                self._finish(future, save.step, error=e, retain=rank == 0)
            else:
                self._finish(future, save.step, result=result, retain=rank == 0)

    def _retain(self) -> None:
        """The local tier's retention, once a promotion no longer holds its step (after a
        commit it ran while the step was still protected)."""
        try:
            self.local._apply_retention()
        except Exception as e:  # the promotion is done either way; the next commit retries
            warnings.warn(f"{self.local.url}: retention after a promotion failed: {e}", RuntimeWarning,
                          stacklevel=1)

    def _finish(self, future: SaveFuture, step: int, result=None, error=None, quiet=False,
                retain=False) -> None:
        with self._lock:
            left = self._pending.get(step, 0) - 1
            if left > 0:
                self._pending[step] = left
            else:
                self._pending.pop(step, None)
        if retain:  # before the future resolves: wait() covers it, as it covers a save's
            self._retain()
        if error is None:
            future._future.set_result(result)
        else:
            future._quiet = quiet
            future._future.set_exception(error)


def _warn_on_failure(future: SaveFuture) -> None:
    """A failed promotion warns; it is not an error of the next save (observed)."""
    exc = future._future.exception()
    if exc is None:
        return
    future.observed = True
    if not getattr(future, "_quiet", False):
        warnings.warn(f"{future.where}: promotion of step {future.step} to the durable tier failed: "
                      f"{type(exc).__name__}: {exc}", PromotionWarning, stacklevel=1)
