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
