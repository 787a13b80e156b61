"""GPU staging: bit-exact device-to-host copies of mixed-size CUDA tensors, ordering
after the producer stream, staging while other kernels run, native vs torch path,
and save/load round trips of CUDA tensors. Marker ``gpu``; every test skips without
a CUDA device, and native-path cases skip when the extension has no usable CUDA
(``ckptstore.native.cuda_info()`` says why).

``CKPTSTORE_GPU_TEST_GIB`` (default 3) sizes the large mixed-size test.
Run: ``python -m pytest tests/test_gpu.py -m gpu`` (bench/gpu_check.sh does it).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
import threading
import types

import pytest
import torch

import ckptstore
from ckptstore import native
from ckptstore.staging import StagingCopier, StagingPool, stage_to_host

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

native_cuda = pytest.mark.skipif(not native.cuda_available(),
                                 reason=f"native CUDA path off: {native.cuda_info()['error']}")
BACKENDS = [pytest.param("native", marks=native_cuda), "torch"]

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
TOTAL = int(float(os.environ.get("CKPTSTORE_GPU_TEST_GIB", "3")) * GiB)


def dev_bytes(n: int, seed: int, device="cuda") -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, device=device, generator=g)


def byte_view(storage: torch.UntypedStorage, offset: int, n: int) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, offset, (n,), (1,))


def mixed_sources(total: int, seed: int, small: int = 5000):
    """(storage, offset, nbytes): `small` tensors below 64 KiB (odd offsets too), then
    medium and large ones up to `total` bytes."""
    rng = random.Random(seed)
    out, acc = [], 0
    for i in range(small):
        n = rng.choice([1, 2, 3, 7, 64, 100, 1000, 4096, 4099, rng.randrange(1, 64 * KiB)])
        off = rng.choice([0, 0, 1, 3, 8, 13])
        t = dev_bytes(n + off, seed * 100_000 + i)
        out.append((t.untyped_storage(), off, n))
        acc += n
    i = 0
    while acc < total:
        n = min(rng.choice([rng.randrange(64 * KiB, 16 * MiB), rng.randrange(16 * MiB, 512 * MiB)]),
                total - acc)
        off = rng.choice([0, 0, 0, 5])
        t = dev_bytes(n + off, seed * 100_000 + small + i)
        out.append((t.untyped_storage(), off, n))
        acc += n
        i += 1
    return out


def stage_all(sources, pool, backend, **kw):
    bufs = [None] * len(sources)
    with StagingCopier(pool, backend=backend, **kw) as copier:
        for i, (s, off, n) in enumerate(sources):
            copier.copy(s, off, n, lambda buf, i=i: bufs.__setitem__(i, buf))
    return bufs, copier


def assert_staged_exact(sources, bufs):
    for i, ((s, off, n), buf) in enumerate(zip(sources, bufs)):
        assert buf.nbytes == n
        assert torch.equal(buf.tensor, byte_view(s, off, n).cpu()), f"copy {i} ({n} bytes at +{off}) differs"


def pinned_pool(capacity: int, backend: str) -> StagingPool:
    # The torch path is tested end to end with the torch pool; the native path with native slabs.
    return StagingPool(capacity, pin_memory=True, backend="native" if backend == "native" else "torch")


# ---- bit exactness ----------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_bit_exact_several_gib_mixed_sizes(backend):
    sources = mixed_sources(TOTAL, seed=1)
    pool = pinned_pool(TOTAL + 512 * MiB, backend)
    bufs, copier = stage_all(sources, pool, backend)
    assert_staged_exact(sources, bufs)
    if backend == "native":
        assert copier.gathered >= 4000  # the small ones went through the gather kernel
        st = pool.stats()
        assert st["pinned"] and st["pinned_slabs"] == st["slabs"]
    for b in bufs:
        pool.release(b)
    pool.trim()


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_alignment_of_source_and_destination(backend):
    """Odd source offsets and odd destination addresses inside pinned pool memory:
    every vector width of the gather kernel, and its byte tails."""
    pool = StagingPool(64 * MiB, pin_memory=True, backend="native" if backend == "native" else "torch")
    src = dev_bytes(4 * MiB, 11)
    s = src.untyped_storage()
    host = pool.acquire(8 * MiB)
    rng = random.Random(2)
    copies, expect, pos = [], [], 0
    for k in range(3000):
        n = rng.choice([1, 2, 3, 4, 5, 8, 15, 16, 17, 31, 33, 255, 256, 257, 4095, 65_535, 65_536, 70_001])
        so = rng.randrange(0, 4 * MiB - n)
        pos += rng.randrange(0, 17)
        if pos + n > 8 * MiB:
            break
        copies.append((s, so, host.tensor[pos:pos + n], n))
        expect.append((pos, so, n))
        pos += n
    h = stage_to_host(copies, backend=backend)
    h.wait()
    ref = src.cpu()
    for pos, so, n in expect:
        assert torch.equal(host.tensor[pos:pos + n], ref[so:so + n]), (pos, so, n)
    if backend == "native":
        assert h.gathered > 0
    pool.release(host)


@pytest.mark.parametrize("backend", BACKENDS)
def test_thousands_of_small_tensors_in_one_batch(backend):
    sources = mixed_sources(0, seed=3, small=10_000)
    pool = pinned_pool(1 * GiB, backend)
    bufs, copier = stage_all(sources, pool, backend, batch_bytes=1 * GiB)
    assert copier.batches == 1
    if backend == "native":
        assert copier.gathered == len(sources)
    assert_staged_exact(sources, bufs)
    for b in bufs:
        pool.release(b)


@native_cuda
def test_native_equals_torch_path():
    sources = mixed_sources(512 * MiB, seed=4, small=2000)
    pool = StagingPool(2 * GiB, pin_memory=True, backend="native")
    a, _ = stage_all(sources, pool, "native")
    b, _ = stage_all(sources, pool, "torch")
    for x, y in zip(a, b):
        assert torch.equal(x.tensor, y.tensor)
    assert_staged_exact(sources, a)
    for buf in a + b:
        pool.release(buf)


# ---- ordering and concurrency -------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("explicit_stream", [True, False])
def test_copies_wait_for_the_producer_stream(backend, explicit_stream):
    """A long kernel, then writes, enqueued on the producer stream just before staging:
    the staged bytes must be the written ones, never the zeros that were there before."""
    tensors = [torch.zeros(n, dtype=torch.uint8, device="cuda") for n in (1, 100, 4096, 60_000, 64 * MiB)]
    pool = pinned_pool(256 * MiB, backend)
    bufs = [pool.acquire(t.numel()) for t in tensors]
    torch.cuda.synchronize()
    producer = torch.cuda.Stream()
    with torch.cuda.stream(producer):
        torch.cuda._sleep(200_000_000)  # keeps the producer busy for ~0.1 s
        for i, t in enumerate(tensors):
            t.fill_(i + 7)
        copies = [(t, 0, b.tensor, t.numel()) for t, b in zip(tensors, bufs)]
        if explicit_stream:
            h = stage_to_host(copies, stream=producer, backend=backend)
        else:
            h = stage_to_host(copies, backend=backend)  # the current stream: producer
    h.wait()
    for i, b in enumerate(bufs):
        assert int(b.tensor.min()) == int(b.tensor.max()) == i + 7, i
    for b in bufs:
        pool.release(b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_staging_while_kernels_write_other_tensors(backend):
    sources = mixed_sources(768 * MiB, seed=5, small=1000)
    expected = [byte_view(s, o, n).cpu() for s, o, n in sources]
    y = torch.zeros(32 * MiB, dtype=torch.int32, device="cuda")
    pool = pinned_pool(1 * GiB, backend)
    torch.cuda.synchronize()
    other = torch.cuda.Stream()
    with torch.cuda.stream(other):
        for _ in range(300):
            y.add_(1)
    bufs, _ = stage_all(sources, pool, backend)  # meanwhile, from the default stream
    torch.cuda.synchronize()
    assert int(y.min()) == int(y.max()) == 300
    for i, (buf, exp) in enumerate(zip(bufs, expected)):
        assert torch.equal(buf.tensor, exp), i
    for b in bufs:
        pool.release(b)


@native_cuda
def test_dropped_batches_are_recycled_safely():
    """Batches dropped unwaited hand their resources back once complete; later batches
    reuse them without corrupting anything."""
    from ckptstore import _C

    pool = StagingPool(256 * MiB, pin_memory=True, backend="native")
    srcs = [dev_bytes(n, 20 + n) for n in (10, 1000, 50_000)]
    stream = torch.cuda.current_stream().cuda_stream
    for round_ in range(50):
        bufs = [pool.acquire(t.numel()) for t in srcs]
        batch = _C.cuda_stage(0, stream, [t.data_ptr() for t in srcs], [b.ptr for b in bufs],
                              [t.numel() for t in srcs], 64 * KiB, True)
        if round_ % 2:
            del batch  # never waited
            torch.cuda.synchronize()
        else:
            batch.wait()
            assert batch.query() is True and batch.finished
        for t, b in zip(srcs, bufs):
            assert torch.equal(b.tensor, t.cpu())
            pool.release(b)


@native_cuda
def test_concurrent_query_and_wait_finish_a_batch_once():
    """Threads polling query() and blocking in wait() on one batch at once: it is
    finished once (its descriptor buffer recycled once), so two later batches in
    flight together get distinct descriptor buffers and every byte lands where it should."""
    from ckptstore import _C

    pool = StagingPool(256 * MiB, pin_memory=True, backend="native")
    srcs = [dev_bytes(n, 40 + i) for i, n in enumerate((3, 100, 4000, 30_000))]
    refs = [t.cpu() for t in srcs]
    dev, stream = torch.cuda.current_device(), torch.cuda.current_stream().cuda_stream

    def stage():
        bufs = [pool.acquire(t.numel()) for t in srcs]
        for b in bufs:
            b.tensor.zero_()
        batch = _C.cuda_stage(dev, stream, [t.data_ptr() for t in srcs], [b.ptr for b in bufs],
                              [t.numel() for t in srcs], 64 * KiB, True)
        return batch, bufs

    def poll(batch, start, errors):
        start.wait()
        try:
            while not batch.query():
                pass
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def block(batch, start, errors):
        start.wait()
        try:
            batch.wait()
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    for _ in range(20):
        torch.cuda._sleep(20_000_000)  # keeps the batch in flight while the threads race
        batch, bufs = stage()
        start, errors = threading.Barrier(6), []
        threads = [threading.Thread(target=f, args=(batch, start, errors))
                   for f in (poll, poll, poll, block, block, block)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors and batch.finished and batch.query() is True
        torch.cuda._sleep(20_000_000)  # both next batches queued before either runs
        (b2, bufs2), (b3, bufs3) = stage(), stage()
        b2.wait()
        b3.wait()
        for k, ref in enumerate(refs):
            for got in (bufs, bufs2, bufs3):
                assert torch.equal(got[k].tensor, ref), k
        for b in bufs + bufs2 + bufs3:
            pool.release(b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_stream_dict_entry_on_another_device_is_rejected(backend):
    src = dev_bytes(1000, 30)
    dst = torch.zeros(1000, dtype=torch.uint8)
    dev = src.device.index
    wrong = types.SimpleNamespace(device=torch.device("cuda", dev + 1), cuda_stream=0)
    with pytest.raises(ValueError, match=rf"stream\[{dev}\] is on cuda:{dev + 1}, copies on cuda:{dev}"):
        stage_to_host([(src, 0, dst, 1000)], stream={dev: wrong}, backend=backend)
    h = stage_to_host([(src, 0, dst, 1000)], stream={dev: torch.cuda.current_stream(dev)},
                             backend=backend)
    h.wait()
    assert torch.equal(dst, src.cpu())


@native_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_pinned_pool_puts_no_context_on_its_creation_device():
    """A pool created with device=0 by a process working on GPU 1 pins (and trims, from a
    thread without a context) under GPU 1's context: GPU 0 gets no primary context."""
    code = textwrap.dedent("""
        import ctypes, json, threading, torch
        from ckptstore import _C
        cu = ctypes.CDLL("libcuda.so.1")
        def active(d):
            flags, act = ctypes.c_uint(), ctypes.c_int()
            assert cu.cuDevicePrimaryCtxGetState(d, ctypes.byref(flags), ctypes.byref(act)) == 0
            return bool(act.value)
        torch.cuda.set_device(1)
        torch.ones(1, device="cuda:1")
        before = active(0)
        pool = _C.HostPool(64 << 20, pinned=True, device=0)
        b = pool.try_alloc(1 << 20)
        pinned = b.pinned
        pool.free(b)
        t = threading.Thread(target=pool.trim)
        t.start()
        t.join()
        print(json.dumps({"before": before, "after": active(0), "pinned": pinned,
                          "current": torch.cuda.current_device()}))
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    if r["before"]:
        pytest.skip("torch itself made a context on GPU 0")
    assert (r["pinned"], r["after"], r["current"]) == (True, False, 1)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("backend", BACKENDS)
def test_two_devices_in_one_call_keep_the_current_device(backend):
    torch.cuda.set_device(0)
    a, b = dev_bytes(5 * MiB + 3, 1, "cuda:0"), dev_bytes(70_000, 2, "cuda:1")
    pool = pinned_pool(64 * MiB, backend)
    ba, bb = pool.acquire(a.numel()), pool.acquire(b.numel())
    h = stage_to_host([(a, 0, ba.tensor, a.numel()), (b, 0, bb.tensor, b.numel())], backend=backend)
    h.wait()
    assert torch.cuda.current_device() == 0
    assert torch.equal(ba.tensor, a.cpu()) and torch.equal(bb.tensor, b.cpu())
    pool.release(ba)
    pool.release(bb)


# ---- the pool and the whole save path ------------------------------------------------


@native_cuda
def test_pool_slabs_are_page_locked():
    pool = StagingPool(256 * MiB, pin_memory=True, backend="native")
    buf = pool.acquire(3 * MiB + 1)
    st = pool.stats()
    assert (st["pinned"], st["pinned_slabs"], st["slabs"]) == (True, 1, 1)
    assert buf.tensor.is_pinned()  # torch sees cudaHostAlloc memory as pinned
    pool.release(buf)


def test_save_load_roundtrip_cuda_tensors_with_map_location(tmp_path):
    g = torch.Generator(device="cuda").manual_seed(9)
    w = torch.randn(1000, 1000, device="cuda", generator=g)
    state = {
        "w": w,
        "view": w[3:5, 7:],
        "bf16": torch.randn(4097, device="cuda", generator=g).to(torch.bfloat16),
        "ints": torch.arange(100_003, device="cuda"),
        "small": [torch.randn(i, device="cuda", generator=g) for i in range(1, 300)],
        "empty": torch.empty(0, 3, device="cuda"),
        "cpu": torch.randn(10),
        "step": 5,
    }
    path = str(tmp_path / "ck")
    ckptstore.save(state, path).result()

    def check(a, b, device_type):
        if isinstance(a, torch.Tensor):
            assert b.device.type == device_type and b.dtype == a.dtype and b.shape == a.shape
            assert torch.equal(a.cpu(), b.cpu())
        elif isinstance(a, dict):
            for k in a:
                check(a[k], b[k], device_type)
        elif isinstance(a, list):
            for x, y in zip(a, b):
                check(x, y, device_type)
        else:
            assert a == b

    on_cpu = ckptstore.load(path, map_location="cpu")
    check({k: v for k, v in state.items() if k != "cpu"}, {k: v for k, v in on_cpu.items() if k != "cpu"}, "cpu")
    on_gpu = ckptstore.load(path, map_location="cuda:0")
    check({k: v for k, v in state.items() if k != "cpu"}, {k: v for k, v in on_gpu.items() if k != "cpu"}, "cuda")
    as_saved = ckptstore.load(path)
    assert as_saved["w"].device.type == "cuda" and as_saved["cpu"].device.type == "cpu"
    assert torch.equal(as_saved["cpu"], state["cpu"])
