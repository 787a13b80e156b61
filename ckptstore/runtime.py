"""The process runtime: the thread pools, the staging pool and the codec memo that every
save, load and verify of the process shares, built from one :class:`~ckptstore.config.Config`.

``runtime()`` returns it, created on first use; ``configure(...)`` replaces the process
config and the runtime (only while no save is in flight). One runtime means one
memory budget (the staging pool) for every save in flight.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from ._threads import DaemonThreadPool
from .codecs import CodecMemo
from .config import Config, set_config
from .config import config as process_config
from .staging import StagingPool

__all__ = ["Runtime", "configure", "runtime"]


class Runtime:
    """Process-wide executors, staging pool and codec memo.

    ``Runtime()`` follows the process config; ``workers`` / ``staging_bytes`` override
    it for this runtime alone (tests, a second rank in one process); ``config`` gives
    the whole config. The staging pool is page-locked only once a save holds CUDA
    tensors (:meth:`staging_pool`).
    """

    def __init__(self, workers: int | None = None, staging_bytes: int | None = None, *,
                 config: Config | None = None):
        cfg = config if config is not None else process_config()
        changes = {k: v for k, v in (("workers", workers), ("staging_bytes", staging_bytes)) if v is not None}
        self.config = cfg.replace(**changes) if changes else cfg
        n = self.config.workers
        self.workers = DaemonThreadPool(n, "ckptstore-io")
        # Reads wait on I/O (disk, network) more than on CPU: more readers than cores pays.
        self.readers = DaemonThreadPool(max(n, 8), "ckptstore-read")
        # One commit thread: a process's saves commit in the order they were made, so a
        # later save of the same path always gets the later generation.
        self.committer = DaemonThreadPool(1, "ckptstore-commit")
        # Unpinned until a save holds CUDA tensors (staging_pool()): a process that only
        # saves CPU tensors never page-locks memory nor touches CUDA.
        self._pool = StagingPool(self.config.staging_capacity, pin_memory=False, backend=self.config.staging_pool)
        self._pool_lock = threading.Lock()
        # What "auto" compression decided per chunk in earlier saves (see codecs.CodecMemo).
        self.codec_memo = CodecMemo()

    @property
    def pool(self) -> StagingPool:
        """The staging pool now: unpinned until a save of CUDA tensors asked for a pinned one."""
        return self._pool

    def staging_pool(self, cuda_devices=()) -> StagingPool:
        """The pool a save stages from; ``cuda_devices``: the CUDA devices of its tensors.

        With none, the pool as it is (pinned or not): no CUDA call. With some, a
        page-locked pool: the first such save replaces the unpinned pool by one of
        ``config.pinned_capacity``, at once, even while the unpinned one still lends
        buffers to saves being written (each returns them to the pool it took them
        from, ``RankWriter.pool``; the unpinned pool's idle memory is freed now, and
        the rest once those saves are done: until then the two budgets add up). The
        caller makes one of ``cuda_devices`` current first, so that pinning creates no
        context on another GPU.
        """
        pool = self._pool
        if not cuda_devices or pool.pin_memory:
            return pool
        with self._pool_lock:
            pool = self._pool
            if pool.pin_memory:
                return pool
            pinned = StagingPool(self.config.pinned_capacity, pin_memory=True, backend=self.config.staging_pool,
                                 device=min(cuda_devices))
            pool.trim()
            self._pool = pinned
            return pinned

    def shutdown(self) -> None:
        for ex in (self.workers, self.readers, self.committer):
            ex.shutdown(wait=False)  # threads finish what they hold, then end


_runtime: Runtime | None = None
_runtime_lock = threading.Lock()
_config_of_parent: Config | None = None  # in a forked child: the config its parent's runtime had
_left_by_parent: list[Runtime] = []


def runtime() -> Runtime:
    """The process runtime (created from the process config on first use)."""
    global _runtime
    with _runtime_lock:
        if _runtime is None:
            _runtime = Runtime(config=_config_of_parent)
        return _runtime


def _after_fork_in_child() -> None:
    # A forked child gets a runtime of its own, with its parent's config, on first use.
    # The parent's is kept, never used nor freed: its staging pool lends buffers to the
    # parent's saves, its locks may have been held by the parent's threads, and pinned
    # memory must not be freed here (CUDA does not survive a fork).
    global _runtime, _runtime_lock, _config_of_parent
    _runtime_lock = threading.Lock()
    if _runtime is not None:
        _left_by_parent.append(_runtime)
        _config_of_parent = _runtime.config
        _runtime = None


os.register_at_fork(after_in_child=_after_fork_in_child)


def configure(cfg: Config | None = None, /, **settings: Any) -> Runtime:
    """Replace the process config and runtime (only while no save is in flight).

    ``configure(workers=4, staging_bytes=1 << 30)``: settings are
    :class:`~ckptstore.config.Config` fields; those not given (or None) come from the
    environment, read again, else their defaults. So ``configure()`` resets everything
    to the environment. ``configure(cfg)`` installs a whole config, e.g.
    ``configure(config().replace(workers=4))`` to change one knob and keep the rest.
    A bad value raises :class:`~ckptstore.config.ConfigError` naming it, and changes
    nothing. ``disable_native`` is read when ``ckptstore`` is imported: changing it
    later has no effect.
    """
    if cfg is not None and settings:
        raise TypeError("configure() takes a Config or settings, not both")
    new = cfg if cfg is not None else Config.from_env(**settings)
    if not isinstance(new, Config):
        raise TypeError(f"configure() expects a ckptstore Config, got {type(new).__name__}")
    global _runtime
    with _runtime_lock:
        rt = Runtime(config=new)  # before anything changes: a failure leaves the old one
        if _runtime is not None:
            _runtime.shutdown()  # threads finish what they hold, then end
        set_config(new)
        _runtime = rt
        return rt
