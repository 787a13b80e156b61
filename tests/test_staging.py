"""ckptstore.staging: the staging pool (native slabs and the torch fallback, two classes
behind the StagingPool protocol, behave the same), the native slab allocator itself
(exact sizes, reuse, growth up to the capacity, coalescing, back-pressure), the
StagingCopier, stage_to_host's error paths (fake CUDA objects, no GPU), and save/load
round trips of awkward tensors staged through the pool.
Tests of the native backend skip when the extension is not built."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import ckptstore
from ckptstore import native, staging
from ckptstore.runtime import runtime
from ckptstore.staging import cuda as staging_cuda
from ckptstore.staging import NativeStagingPool, StagingCopier, StagingPool, TorchStagingPool, stage_to_host

needs_native = pytest.mark.skipif(not native.NATIVE, reason=f"native path off: {native.WHY_NOT}")
BACKENDS = [pytest.param("native", marks=needs_native), "torch"]

KiB, MiB = 1 << 10, 1 << 20


def pattern(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def storage_bytes(s: torch.UntypedStorage) -> bytes:
    return torch.empty(0, dtype=torch.uint8).set_(s).numpy().tobytes()


def native_pool(capacity: int, slab_bytes: int = 64 * MiB, alignment: int = 64):
    return native.HostPool(capacity, pinned=False, device=0, slab_bytes=slab_bytes, alignment=alignment)


def span(n: int, align: int = 64) -> int:
    return (n + align - 1) // align * align


# ---- the native slab allocator -------------------------------------------------


@needs_native
def test_blocks_have_exact_sizes_and_alignment():
    pool = native_pool(16 * MiB)
    sizes = [1, 3, 63, 64, 65, 1000, 4097, 65_537, (1 * MiB) + 13]
    blocks = [pool.try_alloc(n) for n in sizes]
    for n, b in zip(sizes, blocks):
        assert (b.nbytes, len(b), b.span) == (n, n, span(n))
        assert b.ptr % 64 == 0
        view = memoryview(b)
        assert (view.nbytes, view.readonly, view.format) == (n, False, "B")
    # No two live blocks overlap.
    ranges = sorted((b.ptr, b.ptr + b.nbytes) for b in blocks)
    assert all(hi <= lo for (_, hi), (lo, _) in zip(ranges, ranges[1:]))
    st = pool.stats()
    assert st["in_use"] == sum(sizes)
    assert st["used"] == sum(span(n) for n in sizes)
    assert st["slabs"] == 1 and st["overflow_allocs"] == 0


@needs_native
def test_alignment_is_configurable_and_checked():
    pool = native_pool(4 * MiB, alignment=256)
    blocks = [pool.try_alloc(n) for n in (1, 300, 513)]
    assert [b.span for b in blocks] == [256, 512, 768]
    assert all(b.ptr % 256 == 0 for b in blocks)
    with pytest.raises(ValueError):
        native_pool(MiB, alignment=48)
    with pytest.raises(ValueError):
        native_pool(0)


@needs_native
def test_reuse_across_cycles_same_addresses_no_new_slabs():
    pool = native_pool(64 * MiB, slab_bytes=8 * MiB)
    sizes = [5 * MiB + 3, 17, 1 * MiB, 333_333, 1]

    def cycle():
        blocks = [pool.try_alloc(n) for n in sizes]
        ptrs = [b.ptr for b in blocks]
        for b in blocks:
            pool.free(b)
        return ptrs

    first = cycle()
    after_first = pool.stats()
    for _ in range(5):
        assert cycle() == first
    st = pool.stats()
    assert st["slab_allocs"] == after_first["slab_allocs"] == 1
    assert st["held"] == after_first["held"] == 8 * MiB
    assert st["in_use"] == 0 and st["largest_free"] == 8 * MiB  # fully coalesced again


@needs_native
def test_growth_by_slabs_up_to_capacity_then_back_pressure():
    pool = native_pool(16 * MiB, slab_bytes=4 * MiB)
    blocks = []
    for i in range(16):
        blocks.append(pool.try_alloc(MiB))
        assert pool.stats()["slabs"] == i // 4 + 1
    st = pool.stats()
    assert (st["held"], st["in_use"], st["slab_allocs"], st["overflow_allocs"]) == (16 * MiB, 16 * MiB, 4, 0)
    assert pool.try_alloc(1) is None  # in_use + 1 > capacity: the caller must wait
    pool.free(blocks.pop())
    b = pool.try_alloc(MiB)
    assert b is not None and pool.stats()["slabs"] == 4
    with pytest.raises(ValueError):
        pool.try_alloc(16 * MiB + 1)  # can never fit


@needs_native
def test_large_request_gets_its_own_slab_capped_by_capacity():
    pool = native_pool(100 * MiB, slab_bytes=8 * MiB)
    big = pool.try_alloc(30 * MiB + 5)
    st = pool.stats()
    assert st["held"] == 32 * MiB  # rounded up to 2 MiB, not to a power of two
    tail = pool.try_alloc(68 * MiB)  # exactly the capacity left: a slab of that size
    st = pool.stats()
    assert not tail.overflow and (st["held"], st["slabs"], st["overflow_allocs"]) == (100 * MiB, 2, 0)
    pool.free(big)
    pool.free(tail)


@needs_native
def test_empty_slabs_are_freed_when_capacity_needs_room():
    pool = native_pool(8 * MiB, slab_bytes=2 * MiB)
    blocks = [pool.try_alloc(2 * MiB) for _ in range(4)]  # four 2 MiB slabs
    for b in blocks:
        pool.free(b)
    assert pool.stats()["slabs"] == 4
    big = pool.try_alloc(6 * MiB)  # no slab has room; three empty ones go
    st = pool.stats()
    assert big is not None and st["overflow_allocs"] == 0
    assert st["held"] <= 8 * MiB and st["slab_frees"] >= 3


@needs_native
def test_coalescing_neighbours_into_one_hole():
    pool = native_pool(MiB, slab_bytes=MiB)
    a, b, c, d = (pool.try_alloc(256 * KiB) for _ in range(4))
    assert pool.stats()["largest_free"] == 0
    pool.free(b)
    pool.free(c)
    assert pool.stats()["largest_free"] == 512 * KiB  # b and c merged
    e = pool.try_alloc(512 * KiB)
    assert e.ptr == b.ptr and pool.stats()["overflow_allocs"] == 0
    for x in (a, d, e):
        pool.free(x)
    st = pool.stats()
    assert (st["largest_free"], st["slabs"], st["used"]) == (MiB, 1, 0)


def fragmented(pool):
    """400 KiB, 200 KiB (freed), 376 KiB in a 1000 KiB slab: holes of 200 and 24 KiB."""
    a, b, c = pool.try_alloc(400 * KiB), pool.try_alloc(200 * KiB), pool.try_alloc(376 * KiB)
    pool.free(b)
    return a, c


@needs_native
def test_fragmentation_fails_the_try_until_a_neighbour_is_freed():
    """The slab bytes held never exceed the capacity: a request that fits by count
    but in no hole waits (None here) until a release makes a hole large enough."""
    pool = native_pool(1000 * KiB, slab_bytes=1000 * KiB)
    a, c = fragmented(pool)
    assert pool.try_alloc(220 * KiB) is None  # 776 + 220 <= 1000, but no 220 KiB hole
    st = pool.stats()
    assert (st["fragmentation_fails"], st["in_use"], st["held"]) == (1, 776 * KiB, 1000 * KiB)
    pool.free(a)  # merges with the 200 KiB hole
    x = pool.try_alloc(220 * KiB)
    assert x is not None and x.ptr == a.ptr and not x.overflow  # in the merged hole
    st = pool.stats()
    assert st["peak"] <= 1000 * KiB and st["slabs"] == 1
    for blk in (c, x):
        pool.free(blk)


@needs_native
def test_overflow_option_lends_ordinary_memory_instead():
    pool = native_pool(1000 * KiB, slab_bytes=1000 * KiB)
    a, c = fragmented(pool)
    assert pool.try_alloc(300 * KiB, overflow=True) is None  # 776 + 300 > 1000: back-pressure still holds
    x = pool.try_alloc(220 * KiB, overflow=True)
    assert x is not None and x.overflow and not x.pinned
    st = pool.stats()
    assert (st["overflow_allocs"], st["overflow_bytes"], st["in_use"]) == (1, span(220 * KiB), 996 * KiB)
    t = torch.frombuffer(x, dtype=torch.uint8)
    t.copy_(pattern(220 * KiB, 1))
    assert torch.equal(t, pattern(220 * KiB, 1))
    pool.free(x)
    assert pool.stats()["overflow_bytes"] == 0
    for blk in (a, c):
        pool.free(blk)


@needs_native
def test_capacity_not_a_multiple_of_the_alignment():
    pool = native_pool(1000)
    b = pool.try_alloc(990)  # its span, 1024, may exceed the capacity by < alignment
    assert b is not None and pool.stats()["held"] == 1024
    pool.free(b)
    b = pool.try_alloc(1000)
    assert b is not None and pool.try_alloc(1) is None
    pool.free(b)


@needs_native
def test_thousands_of_small_blocks_disjoint_intact_and_coalesced():
    rng = random.Random(5)
    pool = native_pool(64 * MiB, slab_bytes=16 * MiB)
    blocks = [pool.try_alloc(rng.randrange(1, 5000)) for _ in range(5000)]
    ranges = sorted((b.ptr, b.ptr + b.nbytes) for b in blocks)
    assert all(hi <= lo for (_, hi), (lo, _) in zip(ranges, ranges[1:]))
    assert all(b.ptr % 64 == 0 for b in blocks)
    tensors = [torch.frombuffer(b, dtype=torch.uint8) for b in blocks]
    for i, t in enumerate(tensors):
        t.fill_(i % 251)
    order = list(range(len(blocks)))
    rng.shuffle(order)
    for k, i in enumerate(order):
        assert int(tensors[i].min()) == int(tensors[i].max()) == i % 251, i
        pool.free(blocks[i])
        if k == len(order) // 2:  # refill half the holes with other sizes
            extra = [pool.try_alloc(rng.randrange(1, 3000)) for _ in range(1000)]
    for b in extra:
        pool.free(b)
    st = pool.stats()
    assert st["in_use"] == 0 and st["live_blocks"] == 0 and st["overflow_allocs"] == 0
    assert st["largest_free"] == st["held"] == 16 * MiB  # one slab, one hole


@needs_native
def test_double_free_and_foreign_blocks_are_rejected():
    p1, p2 = native_pool(MiB), native_pool(MiB)
    b = p1.try_alloc(100)
    with pytest.raises(ValueError, match="another pool"):
        p2.free(b)
    p1.free(b)
    with pytest.raises(ValueError, match="already freed"):
        p1.free(b)
    assert p1.stats()["in_use"] == 0


@needs_native
def test_memory_outlives_release_and_trim_while_viewed():
    """A tensor made from a block keeps the block, and the block its slab."""
    pool = native_pool(8 * MiB, slab_bytes=4 * MiB)
    b = pool.try_alloc(3 * MiB)
    t = torch.frombuffer(b, dtype=torch.uint8)
    t.copy_(pattern(3 * MiB, 2))
    pool.free(b)
    del b
    assert pool.trim() == 4 * MiB
    assert pool.stats()["held"] == 0
    assert torch.equal(t, pattern(3 * MiB, 2))  # still mapped, still intact


@needs_native
def test_pinned_request_without_cuda_falls_back_to_ordinary_memory():
    pool = native.HostPool(MiB, pinned=True, device=0)
    b = pool.try_alloc(1000)
    st = pool.stats()
    if native.cuda_available():
        assert st["pinned"] is True and b.pinned
    else:
        assert st["pinned"] is False and not b.pinned
        assert st["pin_error"] != ""
    pool.free(b)


# ---- StagingPool: one interface, two backends --------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_pool_exact_sizes_writable_views(backend):
    pool = StagingPool(8 * MiB, pin_memory=False, backend=backend)
    for n in [1, 7, 64, 65, 4097, 123_457]:
        buf = pool.acquire(n)
        assert (buf.nbytes, buf.tensor.numel(), len(buf.view)) == (n, n, n)
        assert buf.tensor.dtype == torch.uint8 and buf.tensor.device.type == "cpu"
        assert buf.ptr == buf.tensor.data_ptr()
        data = pattern(n, n)
        buf.view[:] = bytes(data.tolist())
        assert torch.equal(buf.tensor, data)  # tensor and view share the memory
        pool.release(buf)
    assert pool.stats()["in_use"] == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_pool_zero_size_buffers(backend):
    pool = StagingPool(MiB, pin_memory=False, backend=backend)
    buf = pool.acquire(0)
    assert (buf.nbytes, len(buf.view), buf.tensor.numel()) == (0, 0, 0)
    pool.release(buf)
    assert pool.stats()["in_use"] == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_pool_interface_same_for_both_backends(backend):
    pool = StagingPool(MiB, pin_memory=False, backend=backend)
    assert (pool.capacity, pool.pin_memory, pool.backend) == (MiB, False, backend)
    a = pool.acquire(600 * KiB)
    assert pool.try_acquire(500 * KiB) is None  # would exceed the capacity
    b = pool.try_acquire(400 * KiB)
    assert b is not None
    st = pool.stats()
    assert {"capacity", "in_use", "cached", "held", "peak", "pinned", "backend"} <= set(st)
    assert (st["capacity"], st["in_use"], st["pinned"], st["backend"]) == (MiB, 1000 * KiB, False, backend)
    assert 1000 * KiB <= st["peak"] <= MiB
    pool.release(a)
    pool.release(b)
    st = pool.stats()
    assert st["in_use"] == 0 and st["cached"] > 0  # kept for the next save
    pool.trim()
    assert pool.stats()["held"] == 0
    with pytest.raises(ValueError):
        pool.acquire(MiB + 1)
    with pytest.raises(ValueError):
        StagingPool(0)


def test_unknown_backend_is_an_error():
    with pytest.raises(ValueError):
        StagingPool(MiB, backend="gpu")


@pytest.mark.skipif(native.NATIVE, reason="only without the extension")
def test_native_backend_requires_the_extension():
    with pytest.raises(RuntimeError):
        StagingPool(MiB, backend="native")


@pytest.mark.parametrize("backend", BACKENDS)
def test_back_pressure_acquire_returns_only_after_a_release(backend):
    pool = StagingPool(MiB, pin_memory=False, backend=backend)
    held = pool.acquire(700 * KiB)
    state = {"released": False}
    started = threading.Event()
    result = {}

    def taker():
        started.set()
        buf = pool.acquire(500 * KiB)  # 700 + 500 > 1024: must wait for the release
        result["released_before"] = state["released"]
        result["in_use"] = pool.stats()["in_use"]
        pool.release(buf)

    t = threading.Thread(target=taker)
    t.start()
    started.wait()
    state["released"] = True
    pool.release(held)
    t.join()
    assert result == {"released_before": True, "in_use": 500 * KiB}
    assert pool.stats()["in_use"] == 0


def fragmented_staging_pool():
    pool = StagingPool(1000 * KiB, pin_memory=False, backend="native", slab_bytes=1000 * KiB)
    a, b, c = pool.acquire(400 * KiB), pool.acquire(200 * KiB), pool.acquire(376 * KiB)
    pool.release(b)  # holes of 200 and 24 KiB
    return pool, a, c


@needs_native
def test_acquire_under_fragmentation_can_lend_overflow_memory():
    """The escape from a fragmentation wait that no release ends (overflow_after:
    default 1 s; 0 here): ordinary memory beyond the budget, freed on release."""
    pool, a, c = fragmented_staging_pool()
    assert pool.try_acquire(220 * KiB) is None  # fits by count, in no hole
    x = pool.acquire(220 * KiB, overflow_after=0)
    x.tensor.copy_(pattern(220 * KiB, 3))
    st = pool.stats()
    assert (st["overflow_allocs"], st["in_use"]) == (1, 996 * KiB)
    assert torch.equal(x.tensor, pattern(220 * KiB, 3))
    for buf in (x, a, c):
        pool.release(buf)
    st = pool.stats()
    assert (st["in_use"], st["overflow_bytes"]) == (0, 0)


@needs_native
def test_strict_acquire_waits_out_fragmentation_then_succeeds():
    pool, a, c = fragmented_staging_pool()
    state = {"released": False}
    started = threading.Event()
    result = {}

    def taker():
        started.set()
        buf = pool.acquire(220 * KiB, overflow_after=None)
        result["released_before"] = state["released"]
        result["overflow"] = buf._block.overflow
        pool.release(buf)

    t = threading.Thread(target=taker)
    t.start()
    started.wait()
    state["released"] = True
    pool.release(a)  # merges with the 200 KiB hole
    t.join()
    assert result == {"released_before": True, "overflow": False}
    pool.release(c)
    st = pool.stats()
    assert st["in_use"] == 0 and st["peak"] <= 1000 * KiB and st["overflow_allocs"] == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_many_threads_share_a_small_pool(backend):
    pool = StagingPool(2 * MiB, pin_memory=False, backend=backend)
    barrier = threading.Barrier(4)
    errors = []

    def worker(k):
        rng = random.Random(k)
        try:
            barrier.wait()
            for i in range(300):
                n = rng.choice([1, 100, 4096, 70_000, 300_000, 700_000])
                buf = pool.acquire(n)
                data = pattern(n, k * 1000 + i)
                buf.tensor.copy_(data)
                assert torch.equal(buf.tensor, data)
                pool.release(buf)
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    st = pool.stats()
    assert st["in_use"] == 0
    assert st.get("peak_in_use", 0) <= 2 * MiB


@pytest.fixture(params=BACKENDS)
def staging_backend(request):
    """The process runtime's pool on each backend (through CKPTSTORE_STAGING_POOL)."""
    old = os.environ.get("CKPTSTORE_STAGING_POOL")
    os.environ["CKPTSTORE_STAGING_POOL"] = request.param
    ckptstore.configure()
    try:
        assert runtime().pool.backend == request.param
        yield request.param
    finally:
        if old is None:
            os.environ.pop("CKPTSTORE_STAGING_POOL", None)
        else:
            os.environ["CKPTSTORE_STAGING_POOL"] = old
        ckptstore.configure()


def test_default_backend_and_its_environment_override(monkeypatch):
    """CKPTSTORE_STAGING_POOL is read into the process config (on first use and by
    every configure()); StagingPool(backend=None) follows the config."""
    monkeypatch.delenv("CKPTSTORE_STAGING_POOL", raising=False)
    try:
        ckptstore.configure()
        assert staging.DEFAULT_BACKEND == "auto" == ckptstore.Config().staging_pool
        # without pinning, "auto" takes the native pool whenever the extension is built
        assert StagingPool(MiB, pin_memory=False).backend == ("native" if native.NATIVE else "torch")
        monkeypatch.setenv("CKPTSTORE_STAGING_POOL", "torch")
        ckptstore.configure()
        assert StagingPool(MiB, pin_memory=False).backend == "torch"
        monkeypatch.setenv("CKPTSTORE_STAGING_POOL", "auto")
        ckptstore.configure()
        assert StagingPool(MiB, pin_memory=False).backend == ("native" if native.NATIVE else "torch")
        assert StagingPool(MiB, pin_memory=False, backend="torch").backend == "torch"  # explicit wins
        monkeypatch.setenv("CKPTSTORE_STAGING_POOL", "bogus")
        with pytest.raises(ValueError, match="CKPTSTORE_STAGING_POOL='bogus'"):
            ckptstore.configure()  # a ConfigError (a ValueError) naming the variable
        with pytest.raises(ValueError):
            StagingPool(MiB, backend="bogus")
    finally:
        monkeypatch.delenv("CKPTSTORE_STAGING_POOL", raising=False)
        ckptstore.configure()


def test_each_backend_is_its_own_class_behind_one_protocol():
    pools = [StagingPool(MiB, pin_memory=False, backend="torch")]
    assert type(pools[0]) is TorchStagingPool and not pools[0].lends_past_capacity
    if native.NATIVE:
        pools.append(StagingPool(MiB, pin_memory=False, backend="native"))
        assert type(pools[1]) is NativeStagingPool and pools[1].lends_past_capacity
        assert type(NativeStagingPool(MiB, pin_memory=False)) is NativeStagingPool
    for pool in pools:
        assert isinstance(pool, StagingPool) and pool.backend == pool.stats()["backend"]
        buf = pool.acquire(1000)
        assert (pool.in_use, buf.nbytes) == (1000, 1000)
        pool.release(buf)
        assert pool.in_use == 0
    with pytest.raises(ValueError, match="not 'native'"):
        TorchStagingPool(MiB, backend="native")


@needs_native
def test_native_runtime_pool_reuses_memory_across_saves(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTSTORE_STAGING_POOL", "native")
    ckptstore.configure(staging_bytes=64 * MiB)
    try:
        pool = runtime().pool
        assert pool.backend == "native"
        state = {f"t{i}": torch.randn(1000 + i) for i in range(50)}
        for k in range(3):
            ckptstore.save(state, str(tmp_path / "ck")).result()
            if k == 0:
                first = pool.stats()
        st = pool.stats()
        assert st["slab_allocs"] == first["slab_allocs"] == 1
        assert st["held"] == first["held"] and st["in_use"] == 0
    finally:
        monkeypatch.delenv("CKPTSTORE_STAGING_POOL")
        ckptstore.configure()


# ---- StagingCopier -----------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_copier_cpu_storages_bit_exact_with_back_pressure(backend):
    pool = StagingPool(256 * KiB, pin_memory=False, backend=backend)
    tensors = [torch.randn(n) for n in (1, 17, 20_000, 60_000, 3, 50_000)]  # > 4x the pool
    got = []
    released = []

    def consume(buf, k):
        got.append((k, bytes(buf.view)))
        pool.release(buf)  # the writer's job, done at once here
        released.append(k)

    with StagingCopier(pool) as copier:
        for k, t in enumerate(tensors):
            s = t.untyped_storage()
            copier.copy(s, 0, s.nbytes(), lambda buf, k=k: consume(buf, k))
    assert [k for k, _ in got] == list(range(len(tensors)))
    for k, data in got:
        assert data == storage_bytes(tensors[k].untyped_storage())
    assert pool.stats()["in_use"] == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_copier_offsets_within_a_storage(backend):
    pool = StagingPool(MiB, pin_memory=False, backend=backend)
    t = torch.arange(1000, dtype=torch.int32)
    s = t.untyped_storage()
    out = {}
    with StagingCopier(pool) as copier:
        for off, n in [(0, 4), (3, 5), (4000 - 7, 7), (1024, 0)]:
            copier.copy(s, off, n, lambda buf, key=(off, n): out.__setitem__(key, bytes(buf.view)))
    raw = storage_bytes(s)
    assert out == {(o, n): raw[o:o + n] for o, n in out}
    assert len(out) == 4


@pytest.mark.parametrize("backend", BACKENDS)
def test_copier_calls_before_wait_so_a_holding_consumer_drains(backend):
    """The consumer keeps buffers until it is told to start (like the writer, which
    holds chunks back until flush()): the copier must call before_wait, not hang."""
    pool = StagingPool(64 * KiB, pin_memory=False, backend=backend)
    held, out, flushes = [], {}, []

    def consume(buf, k):
        held.append((k, buf))

    def flush():
        flushes.append(len(held))
        while held:
            k, buf = held.pop()
            out[k] = bytes(buf.view)
            pool.release(buf)

    tensors = [torch.randn(n) for n in (3000, 5, 7000, 4000, 1, 6000)]  # 4x the pool
    with StagingCopier(pool, before_wait=flush) as copier:
        for k, t in enumerate(tensors):
            s = t.untyped_storage()
            copier.copy(s, 0, s.nbytes(), lambda buf, k=k: consume(buf, k))
    waits = list(flushes)
    flush()
    assert len(waits) >= 1 and all(n > 0 for n in waits)  # called, each time with buffers to free
    assert out == {k: storage_bytes(t.untyped_storage()) for k, t in enumerate(tensors)}
    st = pool.stats()
    assert st["in_use"] == 0 and st["peak"] <= 64 * KiB


def test_copier_abort_returns_buffers_not_handed_over():
    pool = StagingPool(MiB, pin_memory=False)
    kept = []
    with pytest.raises(RuntimeError, match="boom"):
        with StagingCopier(pool, cpu_batch_bytes=40) as copier:
            copier.copy(torch.ones(10).untyped_storage(), 0, 40, kept.append)  # a full batch: handed over
            copier.copy(torch.ones(10).untyped_storage(), 0, 8, kept.append)  # still queued
            assert pool.stats()["in_use"] == 48
            raise RuntimeError("boom")
    assert [b.nbytes for b in kept] == [40]  # the consumer owns it
    assert pool.stats()["in_use"] == 40  # the queued one went back to the pool
    pool.release(kept[0])
    assert pool.stats()["in_use"] == 0


def test_copier_batches_cpu_copies_and_hands_over_in_order():
    pool = StagingPool(MiB, pin_memory=False)
    got = []
    tensors = [torch.full((n,), float(n)) for n in range(1, 200)]
    with StagingCopier(pool, cpu_batch_bytes=10_000) as copier:
        for k, t in enumerate(tensors):
            s = t.untyped_storage()
            copier.copy(s, 0, s.nbytes(), lambda buf, k=k: (got.append((k, bytes(buf.view))), pool.release(buf)))
            assert pool.stats()["in_use"] < 10_000 + s.nbytes()  # at most one batch queued
    assert [k for k, _ in got] == list(range(len(tensors)))
    assert all(data == storage_bytes(tensors[k].untyped_storage()) for k, data in got)


def test_stage_to_host_rejects_cpu_sources_and_bad_ranges():
    dst = torch.empty(16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="CUDA"):
        stage_to_host([(torch.ones(4).untyped_storage(), 0, dst, 16)])
    with pytest.raises(TypeError):
        stage_to_host([(b"abc", 0, dst, 3)])
    with pytest.raises(ValueError):
        stage_to_host([], backend="tpu")
    if not native.cuda_available():
        with pytest.raises(RuntimeError):
            stage_to_host([], backend="native")
    h = stage_to_host([], backend="torch")  # nothing to copy: done at once
    h.wait()
    assert (h.count, h.nbytes, h.done()) == (0, 0, True)


# ---- stage_to_host / StageHandle error paths (fake CUDA objects, no GPU) ------------


class _FakeBatch:
    """Stands in for _C.CudaBatch: records its wait, optionally fails it."""

    def __init__(self, log: list, name: str, fail: Exception | None = None, handle=None):
        self.log, self.name, self.fail, self.handle = log, name, fail, handle
        self.gathered = 0

    def wait(self):
        # The handle must still keep the tensors alive while any batch is waited.
        self.log.append((self.name, self.handle is None or self.handle._keep is not None))
        if self.fail is not None:
            raise self.fail


class _FakeEvent(_FakeBatch):
    def synchronize(self):
        self.wait()


def test_stage_handle_wait_waits_everything_before_raising_the_first_error():
    log: list = []
    h = staging_cuda.StageHandle("native")
    h._keep = [object()]
    first, second = RuntimeError("device 0 failed"), RuntimeError("device 2 failed")
    h._batches = [_FakeBatch(log, "b0", first, h), _FakeBatch(log, "b1", None, h),
                  _FakeBatch(log, "b2", second, h)]
    h._events = [_FakeEvent(log, "e0", None, h)]
    with pytest.raises(RuntimeError) as info:
        h.wait()
    assert info.value is first
    # every batch and event waited, each while the buffers were still kept alive
    assert log == [("b0", True), ("b1", True), ("b2", True), ("e0", True)]
    assert h._keep is None


def test_stage_handle_wait_without_errors_drops_what_it_keeps():
    log: list = []
    h = staging_cuda.StageHandle("torch")
    h._keep = [object()]
    h._events = [_FakeEvent(log, "e0", None, h), _FakeEvent(log, "e1", None, h)]
    h.wait()
    assert log == [("e0", True), ("e1", True)] and h._keep is None


class _FakeStorage:
    def __init__(self, device: int, n: int):
        self.device = torch.device("cuda", device)
        self._n = n

    def data_ptr(self) -> int:
        return 0x10000 * (self.device.index + 1)

    def nbytes(self) -> int:
        return self._n


class _FakeStream:
    def __init__(self, device: int):
        self.device = torch.device("cuda", device)
        self.cuda_stream = 1000 + device


@pytest.fixture
def fake_native_cuda(monkeypatch):
    """native with a fake _C whose CUDA path is 'available': native.cuda_stage returns
    _FakeBatch objects (recorded in .batches) or raises for devices in .fail_on."""
    log: list = []
    fake = type("FakeC", (), {})()
    fake.batches, fake.fail_on, fake.log = [], {}, log
    fake.cuda_info = lambda: {"compiled": True, "available": True, "devices": 4, "runtime_version": 0,
                              "driver_version": 0, "error": ""}

    def cuda_stage(dev, stream, srcs, dsts, sizes, small_bytes, gather):
        if dev in fake.fail_on:
            raise fake.fail_on[dev]
        b = _FakeBatch(log, f"dev{dev}")
        fake.batches.append(b)
        return b

    fake.cuda_stage = cuda_stage
    monkeypatch.setattr(native, "_C", fake)
    monkeypatch.setattr(native, "NATIVE", True)
    monkeypatch.setattr(staging_cuda, "_src_parts", lambda src, what: (src, 0, src.nbytes()))
    return fake


def _fake_copies(devices):
    return [(_FakeStorage(d, 64), 0, torch.zeros(64, dtype=torch.uint8), 64) for d in devices]


def test_stage_to_host_waits_queued_batches_when_a_later_device_fails(fake_native_cuda):
    fake_native_cuda.fail_on = {2: RuntimeError("cuda_stage failed on device 2")}
    streams = {d: _FakeStream(d) for d in (0, 1, 2)}
    with pytest.raises(RuntimeError, match="device 2"):
        stage_to_host(_fake_copies([0, 1, 2]), stream=streams, backend="native")
    # the batches already queued for devices 0 and 1 were waited before the error surfaced
    assert [b.name for b in fake_native_cuda.batches] == ["dev0", "dev1"]
    assert [name for name, _ in fake_native_cuda.log] == ["dev0", "dev1"]


def test_stage_to_host_rejects_a_stream_dict_entry_on_another_device(fake_native_cuda):
    streams = {0: _FakeStream(0), 1: _FakeStream(3)}  # device 1's entry is on cuda:3
    with pytest.raises(ValueError, match=r"stream\[1\] is on cuda:3, copies on cuda:1"):
        stage_to_host(_fake_copies([0, 1]), stream=streams, backend="native")
    assert [name for name, _ in fake_native_cuda.log] == ["dev0"]  # device 0's batch waited


def test_stage_to_host_success_queues_one_batch_per_device(fake_native_cuda):
    h = stage_to_host(_fake_copies([0, 1, 0]), stream={0: _FakeStream(0), 1: _FakeStream(1)},
                      backend="native")
    assert [b.name for b in fake_native_cuda.batches] == ["dev0", "dev1"]
    assert (h.count, h.nbytes, fake_native_cuda.log) == (3, 192, [])
    h.wait()
    assert [name for name, _ in fake_native_cuda.log] == ["dev0", "dev1"] and h._keep is None


def test_producer_stream_checks_the_device_of_every_stream():
    s0, s1 = _FakeStream(0), _FakeStream(1)
    assert staging_cuda._producer_stream(s0, 0) is s0
    assert staging_cuda._producer_stream({0: s0, 1: s1}, 1) is s1
    with pytest.raises(ValueError, match="stream is on cuda:1, copies on cuda:0"):
        staging_cuda._producer_stream(s1, 0)
    with pytest.raises(ValueError, match=r"stream\[0\] is on cuda:1, copies on cuda:0"):
        staging_cuda._producer_stream({0: s1}, 0)



class _CpuAsCuda:
    """A CPU storage dressed as a CUDA one, for the copier's device path without a GPU."""

    def __init__(self, storage: torch.UntypedStorage):
        self.real = storage
        self.device = torch.device("cuda", 0)


def test_copier_device_batches_without_a_gpu(monkeypatch):
    """The copier's CUDA path (stage_to_host replaced by CPU copies): one call per
    batch_bytes, each batch handed over (in order) only once the next one is queued
    or the copier finishes, and a failed launch returns the buffers of that batch."""
    from ckptstore.staging import copier as copier_mod

    calls = []

    class Handle:
        gathered = 0

        def __init__(self, copies):
            self.copies = copies

        def wait(self):
            for src, off, dst, n in self.copies:
                dst[:n].copy_(torch.empty(0, dtype=torch.uint8).set_(src.real)[off:off + n])

    def fake_stage_to_host(copies, *, stream=None, backend=None, small_bytes=0):
        calls.append([n for _, _, _, n in copies])
        if any(n == 13 for n in calls[-1]):
            raise RuntimeError("launch failed")
        return Handle(copies)

    monkeypatch.setattr(copier_mod, "stage_to_host", fake_stage_to_host)
    pool = StagingPool(MiB, pin_memory=False, backend="torch")
    tensors = [pattern(1000 + k, k) for k in range(5)]
    got = []
    with StagingCopier(pool, batch_bytes=2000) as copier:
        for k, t in enumerate(tensors):
            copier.copy(_CpuAsCuda(t.untyped_storage()), 0, t.numel(),
                        lambda buf, k=k: (got.append((k, bytes(buf.view))), pool.release(buf)))
    assert calls == [[1000, 1001], [1002, 1003], [1004]] and copier.batches == 3
    assert [k for k, _ in got] == list(range(5))
    assert all(data == tensor_bytes(tensors[k]) for k, data in got)
    assert pool.in_use == 0
    with pytest.raises(RuntimeError, match="launch failed"):
        with StagingCopier(pool, batch_bytes=1) as copier:
            copier.copy(_CpuAsCuda(pattern(13, 0).untyped_storage()), 0, 13, lambda buf: pool.release(buf))
    assert pool.in_use == 0


# ---- save/load round trips through the pool ------------------------------------


def equal_bitwise(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and a.stride() == b.stride() and tensor_bytes(a) == tensor_bytes(b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal_bitwise(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(equal_bitwise(x, y) for x, y in zip(a, b))
    return a == b


DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128]
DTYPES += [getattr(torch, n) for n in ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2")
           if hasattr(torch, n)]


def awkward_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    state = {}
    for dt in DTYPES:
        for n in (1, 3, 17, 4097, 65_537):
            raw = torch.randint(0, 256, (n * dt.itemsize,), dtype=torch.uint8, generator=g)
            state[f"{dt}_{n}"] = raw.view(dt)
    base = torch.randn(64, 33, generator=g)
    state["view_slice"] = base[5:40, 3:]  # storage offset, non-contiguous
    state["view_t"] = base.t()
    state["tied"] = base  # shares storage with the views
    state["zero"] = torch.empty(0, 7)
    state["zero_int"] = torch.zeros(0, dtype=torch.int64)
    state["scalar"] = torch.tensor(3.5)
    state["odd_bytes"] = torch.randint(0, 256, (1_000_003,), dtype=torch.uint8, generator=g)
    state["meta"] = {"step": 7, "lr": 0.1, "name": "x"}
    return state


@pytest.mark.parametrize("chunk_bytes", [None, 4093])
def test_roundtrip_every_dtype_odd_sizes_views_zero_size(tmp_path, chunk_bytes, staging_backend):
    state = awkward_state(1)
    path = str(tmp_path / "ck")
    ckptstore.save(state, path, chunk_bytes=chunk_bytes).result()
    back = ckptstore.load(path)
    assert equal_bitwise(back, state)
    assert back["view_slice"].untyped_storage().data_ptr() == back["tied"].untyped_storage().data_ptr()


def test_roundtrip_thousands_of_small_tensors_through_a_small_pool(tmp_path, staging_backend):
    g = torch.Generator().manual_seed(3)
    state = {f"p{i}": torch.randn(1 + i % 97, generator=g) for i in range(3000)}
    state["int"] = [torch.randint(-5, 5, (i % 13,), generator=g) for i in range(500)]
    ckptstore.configure(staging_bytes=64 * KiB)
    try:
        path = str(tmp_path / "ck")
        ckptstore.save(state, path, chunk_bytes=1000).result()
        st = runtime().pool.stats()
        assert (st["backend"], st["in_use"]) == (staging_backend, 0)
        assert st["peak"] <= 64 * KiB
        assert equal_bitwise(ckptstore.load(path), state)
    finally:
        ckptstore.configure()


def test_native_and_fallback_saves_load_identically(tmp_path, staging_backend):
    """The same state saved by this process and by one without the extension."""
    state_file = tmp_path / "state.pt"
    torch.save(awkward_state(2), state_file)
    code = textwrap.dedent(f"""
        import json, sys, torch, ckptstore
        from ckptstore import native
        from ckptstore.runtime import runtime
        state = torch.load({str(state_file)!r})
        ckptstore.save(state, {str(tmp_path / 'fallback')!r}, chunk_bytes=10_000).result()
        print(json.dumps({{"native": native.NATIVE, "backend": runtime().pool.backend}}))
    """)
    env = dict(os.environ, CKPTSTORE_DISABLE_NATIVE="1", CKPTSTORE_STAGING_POOL="auto")
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd="/", capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"native": False, "backend": "torch"}
    state = torch.load(state_file)
    ckptstore.save(state, str(tmp_path / "here"), chunk_bytes=10_000).result()
    a, b = ckptstore.load(str(tmp_path / "fallback")), ckptstore.load(str(tmp_path / "here"))
    assert equal_bitwise(a, state) and equal_bitwise(b, state)
