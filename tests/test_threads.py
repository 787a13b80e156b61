"""The daemon thread pool behind the pipeline and the S3 backend."""

from __future__ import annotations

import threading

import pytest

from ckptstore._threads import DaemonThreadPool

HANG_GUARD_S = 60


@pytest.mark.parametrize("warm", [False, True])
def test_a_burst_gets_as_many_threads_as_it_has_tasks_up_to_the_limit(warm):
    """Four tasks that can only finish together (a 4-party barrier) must all run at
    once, also when an idle thread was notified and has not woken yet (warm)."""
    pool = DaemonThreadPool(4, "test")
    try:
        if warm:
            assert pool.submit(lambda: 1).result(HANG_GUARD_S) == 1
        barrier = threading.Barrier(4, timeout=HANG_GUARD_S)
        futures = [pool.submit(barrier.wait) for _ in range(4)]
        assert sorted(f.result(HANG_GUARD_S) for f in futures) == [0, 1, 2, 3]
        assert len(pool._threads) == 4
    finally:
        pool.shutdown()


def test_never_more_threads_than_the_limit_and_every_task_runs():
    pool = DaemonThreadPool(3, "test")
    try:
        results = [pool.submit(pow, i, 2) for i in range(200)]
        assert [f.result(HANG_GUARD_S) for f in results] == [i * i for i in range(200)]
        assert 1 <= len(pool._threads) <= 3
    finally:
        pool.shutdown()


def test_errors_reach_the_future_and_shutdown_refuses_new_work():
    pool = DaemonThreadPool(2, "test")
    fut = pool.submit(int, "not a number")
    with pytest.raises(ValueError):
        fut.result(HANG_GUARD_S)
    queued = [pool.submit(pow, 2, i) for i in range(10)]
    pool.shutdown(wait=True)  # threads finish what is queued, then end
    assert [f.result(0) for f in queued] == [2**i for i in range(10)]
    assert not any(t.is_alive() for t in pool._threads)
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(pow, 2, 2)


def test_a_flush_that_cannot_start_its_work_leaves_the_buffers_to_abort(tmp_path):
    """If the workers refuse new work mid-flush (the runtime was shut down), the chunks
    not started stay with the writer, and abort() returns their staging buffers: later
    saves must not wait forever for memory nobody holds."""
    from ckptstore import format as fmt
    from ckptstore.codecs import CompressionPolicy
    from ckptstore.pipeline import RankWriter, Runtime
    from ckptstore.storage import LocalStorage

    rt = Runtime(workers=1, staging_bytes=1 << 20)
    writer = RankWriter(LocalStorage(str(tmp_path)), fmt.new_attempt_id(), 0, CompressionPolicy(), rt)
    for i in range(3):
        buf = rt.pool.acquire(4096)
        writer.submit_chunk(f"t{i}", (0,), (1024,), 4, buf)
    assert rt.pool.in_use == 3 * 4096
    rt.workers.shutdown(wait=True)
    with pytest.raises(RuntimeError, match="shut down"):
        writer.flush()
    writer.abort()
    assert rt.pool.in_use == 0
    rt.shutdown()


def test_a_thread_that_fails_to_start_takes_no_slot(monkeypatch):
    pool = DaemonThreadPool(1, "test")
    real_start = threading.Thread.start

    def refuse(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    with pytest.raises(RuntimeError, match="can't start"):
        pool.submit(pow, 2, 3)
    monkeypatch.setattr(threading.Thread, "start", real_start)
    try:
        assert pool.submit(pow, 2, 3).result(HANG_GUARD_S) == 8  # the slot is still free
    finally:
        pool.shutdown()
