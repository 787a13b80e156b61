"""The daemon thread pool behind the pipeline and the S3 backend; the process runtime
that owns the pools, and the config it is built from."""

from __future__ import annotations

import dataclasses
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
    from ckptstore.pipeline import RankWriter
    from ckptstore.runtime import Runtime
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


# ---- the process config and runtime ------------------------------------------------


def test_config_reads_every_variable_and_names_a_bad_one():
    from ckptstore.config import Config, ConfigError

    cfg = Config.from_env({"CKPTSTORE_WORKERS": "3", "CKPTSTORE_STAGING_BYTES": "1048576",
                           "CKPTSTORE_STAGING_POOL": "torch", "CKPTSTORE_DISABLE_NATIVE": "1",
                           "CKPTSTORE_CUDA_GATHER": "0", "CKPTSTORE_EXIT_TIMEOUT": "2.5",
                           "CKPTSTORE_HANDLE_SIGTERM": "0", "CKPTSTORE_MAX_MANIFEST_BYTES": "4096",
                           "AWS_MAX_ATTEMPTS": "4", "AWS_RETRY_MODE": "adaptive"})
    assert (cfg.workers, cfg.staging_bytes, cfg.staging_pool, cfg.disable_native, cfg.cuda_gather,
            cfg.exit_timeout, cfg.handle_sigterm, cfg.max_manifest_bytes, cfg.s3_max_attempts,
            cfg.s3_retry_mode) == (3, 1 << 20, "torch", True, False, 2.5, False, 4096, 4, "adaptive")
    empty = Config.from_env({"CKPTSTORE_WORKERS": "", "CKPTSTORE_EXIT_TIMEOUT": " "})  # empty = unset
    assert (empty.workers, empty.exit_timeout, empty.s3_max_attempts) == (Config().workers, 20.0, None)
    assert Config.from_env({"CKPTSTORE_WORKERS": "3"}, workers=5).workers == 5  # arguments win
    assert {k["env"] for k in Config.knobs()} >= {"CKPTSTORE_WORKERS", "CKPTSTORE_MAX_MANIFEST_BYTES"}
    for env, value in [("CKPTSTORE_WORKERS", "abc"), ("CKPTSTORE_WORKERS", "0"),
                       ("CKPTSTORE_STAGING_POOL", "bogus"), ("CKPTSTORE_HANDLE_SIGTERM", "maybe"),
                       ("CKPTSTORE_EXIT_TIMEOUT", "-1"), ("AWS_RETRY_MODE", "fast")]:
        with pytest.raises(ConfigError, match=f"{env}={value!r}"):
            Config.from_env({env: value})
    with pytest.raises(ValueError, match="workers=0"):
        Config(workers=0)
    with pytest.raises(ConfigError, match="unknown setting"):
        Config.from_env({}, worker=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.workers = 4  # frozen


def test_configure_replaces_the_config_and_the_runtime(monkeypatch):
    import ckptstore
    from ckptstore.config import ConfigError, config
    from ckptstore.runtime import runtime as pipeline_runtime
    from ckptstore.runtime import runtime

    try:
        rt = ckptstore.configure(workers=3, staging_bytes=1 << 20)
        assert runtime() is rt is pipeline_runtime()  # the pipeline re-exports the runtime
        assert (config().workers, rt.workers.max_workers, rt.pool.capacity) == (3, 3, 1 << 20)
        assert rt.config is config()
        monkeypatch.setenv("CKPTSTORE_WORKERS", "abc")
        with pytest.raises(ConfigError, match="CKPTSTORE_WORKERS='abc'"):
            ckptstore.configure()
        assert runtime() is rt and config().workers == 3  # a bad value changes nothing
        rt2 = ckptstore.configure(config().replace(exit_timeout=7))  # keep the rest
        assert (config().workers, config().exit_timeout, rt2.workers.max_workers) == (3, 7.0, 3)
        monkeypatch.setenv("CKPTSTORE_WORKERS", "2")
        assert ckptstore.configure().config.workers == 2  # re-reads the environment
    finally:
        monkeypatch.delenv("CKPTSTORE_WORKERS", raising=False)
        ckptstore.configure()


def test_the_codec_memo_belongs_to_the_runtime():
    """'auto' compression remembers its decision per chunk in the runtime's memo, not in
    a module global: a fresh runtime starts with none."""
    import torch

    from ckptstore import format as fmt
    from ckptstore.codecs import CodecMemo, CompressionPolicy, encode
    from ckptstore.pipeline import RankWriter
    from ckptstore.runtime import Runtime
    from ckptstore.scopes import Scope
    from ckptstore.storage import MemoryStorage

    rt = Runtime(workers=1, staging_bytes=1 << 20)
    try:
        writer = RankWriter(MemoryStorage(), fmt.new_attempt_id(), 0, CompressionPolicy(), rt)
        buf = rt.pool.acquire(4096)
        buf.tensor.copy_(torch.zeros(4096, dtype=torch.uint8))
        writer.submit_chunk("w", (0,), (1024,), 4, buf, Scope.GLOBAL)
        writer.submit_skeleton(b"skeleton")
        written = writer.finish()
        assert list(written.shards) == ["w"] and written.local == {}
        assert len(rt.codec_memo) == 1 and len(Runtime(workers=1, staging_bytes=1 << 20).codec_memo) == 0
    finally:
        rt.shutdown()
    memo, data = CodecMemo(retry_after=2), memoryview(bytes(100_000))
    first = encode(data, 4, CompressionPolicy(), ("k",), memo)
    assert memo.recall(((("k",), len(data), 4, CompressionPolicy()))) == (True, first[0][:-1])
    assert encode(data, 4, CompressionPolicy())[0] == first[0]  # no memo: the trial runs


def test_the_chunks_of_one_save_come_due_for_a_new_trial_a_few_at_a_time():
    """"auto" tries a chunk's codecs again after retry_after uses of its decision (each
    17th save); the 1,700 chunks of one save must not all come due at the same later
    save, but 100 at each."""
    from ckptstore.codecs import CodecMemo

    memo, keys = CodecMemo(retry_after=16), [("chunk", i) for i in range(1700)]
    for key in keys:  # the first save: a trial for each
        memo.remember(key, None)
    due_per_save = []
    for _save in range(48):
        due = [key for key in keys if not memo.recall(key)[0]]
        for key in due:  # the trial runs again, and its decision is kept
            memo.remember(key, None)
        due_per_save.append(len(due))
    assert due_per_save == [100] * 48

