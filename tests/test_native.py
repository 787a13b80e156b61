"""ckptstore.native: the compiled kernels and the torch/ctypes fallback agree
byte for byte, shuffle/unshuffle are exact inverses, and bad arguments fail
the same way on both paths. Native-vs-fallback comparisons skip when the
extension is not built."""

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
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptstore import native

needs_native = pytest.mark.skipif(not native.NATIVE, reason=f"native path off: {native.WHY_NOT}")

ITEMSIZES = list(range(1, 17)) + [17, 31, 64]


def rand_bytes(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def at_offset(data: torch.Tensor, offset: int) -> torch.Tensor:
    """A copy of `data` whose data_ptr is `offset` bytes past a 64-aligned base."""
    base = torch.zeros(data.numel() + offset + 64, dtype=torch.uint8)
    view = base[offset : offset + data.numel()]
    view.copy_(data)
    return view


def reference_shuffle(data: bytes, itemsize: int) -> bytes:
    """The definition, written out: byte plane j holds byte j of every element."""
    n = len(data) // itemsize
    planes = bytes(data[i * itemsize + j] for j in range(itemsize) for i in range(n))
    return planes + data[n * itemsize :]


def fallback_shuffle(src: torch.Tensor, itemsize: int) -> torch.Tensor:
    out = torch.empty_like(src)
    native._fallback_shuffle_into(out, src, itemsize)
    return out


def fallback_unshuffle(src: torch.Tensor, itemsize: int) -> torch.Tensor:
    out = torch.empty_like(src)
    native._fallback_unshuffle_into(out, src, itemsize)
    return out


def sizes_for(itemsize: int) -> list[int]:
    # zero, sub-element, one element, around the 16-element SIMD block and the
    # 512-element scalar tile, odd tails, and one larger buffer.
    s = itemsize
    return sorted({0, 1, s - 1, s, s + 1, 15 * s + 3, 16 * s, 16 * s + 5, 33 * s + 7,
                   513 * s + (s - 1), 4099, 100_003})


# ---- shuffle -----------------------------------------------------------------


@pytest.mark.parametrize("itemsize", [1, 2, 3, 4, 5, 8, 12, 16, 17])
def test_shuffle_matches_definition(itemsize):
    for n in [0, 1, itemsize, 16 * itemsize + 3, 40 * itemsize + 1, 700]:
        data = rand_bytes(n, seed=n)
        expected = reference_shuffle(bytes(data.tolist()), itemsize)
        assert bytes(native.shuffle(data, itemsize).tolist()) == expected
        assert bytes(fallback_shuffle(data, itemsize).tolist()) == expected


@pytest.mark.parametrize("itemsize", ITEMSIZES)
def test_roundtrip_every_itemsize(itemsize):
    for n in sizes_for(itemsize):
        data = rand_bytes(n, seed=itemsize * 1000 + n)
        assert torch.equal(native.unshuffle(native.shuffle(data, itemsize), itemsize), data)
        assert torch.equal(fallback_unshuffle(fallback_shuffle(data, itemsize), itemsize), data)


@needs_native
@pytest.mark.parametrize("itemsize", ITEMSIZES)
def test_native_equals_fallback_every_itemsize(itemsize):
    for n in sizes_for(itemsize):
        data = rand_bytes(n, seed=n)
        shuffled = native.shuffle(data, itemsize)
        assert torch.equal(shuffled, fallback_shuffle(data, itemsize)), n
        assert torch.equal(native.unshuffle(data, itemsize), fallback_unshuffle(data, itemsize)), n


@needs_native
@pytest.mark.parametrize("itemsize", [2, 3, 4, 8, 16])
def test_native_shuffle_unaligned(itemsize):
    data = rand_bytes(16 * 64 * itemsize + 11, seed=itemsize)
    expected = fallback_shuffle(data, itemsize)
    for src_off in (1, 3, 7):
        for dst_off in (0, 5, 13):
            src = at_offset(data, src_off)
            dst = at_offset(torch.zeros_like(data), dst_off)
            native.shuffle_into(dst, src, itemsize)
            assert torch.equal(dst, expected)
            back = at_offset(torch.zeros_like(data), src_off + dst_off)
            native.unshuffle_into(back, dst, itemsize)
            assert torch.equal(back, data)


@needs_native
def test_native_shuffle_large_fp32():
    data = torch.randn(1 << 20).view(torch.uint8)  # 4 MiB of fp32
    shuffled = native.shuffle(data, 4)
    assert torch.equal(shuffled, fallback_shuffle(data, 4))
    assert torch.equal(native.unshuffle(shuffled, 4), data)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=3000), itemsize=st.integers(1, 20), offset=st.integers(0, 15))
def test_property_roundtrip_and_native_equals_fallback(data, itemsize, offset):
    src = at_offset(torch.tensor(list(data), dtype=torch.uint8), offset)
    shuffled = native.shuffle(src, itemsize)
    assert torch.equal(native.unshuffle(shuffled, itemsize), src)
    assert torch.equal(shuffled, fallback_shuffle(src, itemsize))
    assert torch.equal(fallback_unshuffle(shuffled, itemsize), src)


def test_shuffle_rejects_bad_arguments():
    x = rand_bytes(64)
    with pytest.raises(ValueError):
        native.shuffle(x, 0)
    with pytest.raises(ValueError):
        native.shuffle(x.view(torch.int32), 4)  # not uint8
    with pytest.raises(ValueError):
        native.shuffle(x.view(8, 8), 4)  # not 1-D
    with pytest.raises(ValueError):
        native.shuffle(x[::2], 4)  # not contiguous
    with pytest.raises(ValueError):
        native.shuffle_into(torch.empty(63, dtype=torch.uint8), x, 4)  # size mismatch
    with pytest.raises(ValueError):
        native.shuffle_into(x, x, 4)  # in place
    with pytest.raises(TypeError):
        native.shuffle(bytes(64), 4)


# ---- copies ------------------------------------------------------------------

COPY_SIZES = [0, 1, 7, 4095, 65_537, (1 << 20) + 13, (5 << 20) + 3]


@pytest.mark.parametrize("nbytes", COPY_SIZES)
@pytest.mark.parametrize("threads", [0, 1, 2, 64])
def test_copy_bytes_unaligned(nbytes, threads):
    data = rand_bytes(nbytes, seed=nbytes)
    for src_off, dst_off in [(0, 0), (1, 3), (7, 0), (0, 9)]:
        src = at_offset(data, src_off)
        dst = at_offset(torch.zeros_like(data), dst_off)
        native.copy_bytes(dst.data_ptr(), src.data_ptr(), nbytes, threads=threads)
        assert torch.equal(dst, data)
        ref = at_offset(torch.zeros_like(data), dst_off)
        native._fallback_copy_bytes(ref.data_ptr(), src.data_ptr(), nbytes)
        assert torch.equal(ref, dst)


def _many_copies(sizes, seed):
    """Source and destination buffers at odd offsets for each size."""
    rng = random.Random(seed)
    srcs = [at_offset(rand_bytes(n, seed=i), rng.randrange(16)) for i, n in enumerate(sizes)]
    dsts = [at_offset(torch.zeros(n, dtype=torch.uint8), rng.randrange(16)) for n in sizes]
    return srcs, dsts


@pytest.mark.parametrize("threads", [0, 1, 2])
def test_copy_many_thousands_of_small(threads):
    rng = random.Random(1)
    sizes = [rng.choice([0, 1, 2, 3, 8, 100, 4096, 5000]) for _ in range(5000)]
    srcs, dsts = _many_copies(sizes, seed=2)
    native.copy_many([d.data_ptr() for d in dsts], [s.data_ptr() for s in srcs], sizes,
                     threads=threads)
    for s, d in zip(srcs, dsts):
        assert torch.equal(s, d)


def test_copy_many_large_spans_split_across_threads():
    sizes = [(3 << 20) + 1, 17, 0, (2 << 20) + 5, 1, (1 << 20) - 3] * 2
    srcs, dsts = _many_copies(sizes, seed=3)
    ptrs = ([d.data_ptr() for d in dsts], [s.data_ptr() for s in srcs], sizes)
    native.copy_many(*ptrs)
    for s, d in zip(srcs, dsts):
        assert torch.equal(s, d)
    refs = [torch.zeros_like(d) for d in dsts]
    native._fallback_copy_many([r.data_ptr() for r in refs], ptrs[1], sizes)
    for r, d in zip(refs, dsts):
        assert torch.equal(r, d)


def test_copy_rejects_bad_arguments():
    buf = torch.zeros(100, dtype=torch.uint8)
    p = buf.data_ptr()
    with pytest.raises(ValueError, match="overlap"):
        native.copy_bytes(p + 10, p, 50)
    with pytest.raises(ValueError, match="null"):
        native.copy_bytes(0, p, 10)
    with pytest.raises(ValueError):
        native.copy_many([p], [p + 50], [10, 20])
    with pytest.raises(ValueError, match="overlap"):
        native.copy_many([p, p + 60], [p + 20, p + 50], [10, 20])
    native.copy_bytes(0, 0, 0)  # empty copies need no memory
    native.copy_many([], [], [])


@needs_native
def test_concurrent_callers_share_the_pool():
    """Python threads call in parallel (the GIL is released); results stay exact."""
    data = rand_bytes((3 << 20) + 7, seed=5)
    errors = []

    def worker(k):
        try:
            for _ in range(10):
                dst = torch.empty_like(data)
                native.copy_bytes(dst.data_ptr(), data.data_ptr(), data.numel())
                assert torch.equal(dst, data)
                assert torch.equal(native.unshuffle(native.shuffle(data, 4), 4), data)
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


# ---- subprocesses: fallback selection and fork safety -------------------------


def _run(code: str, env_extra: dict[str, str]) -> str:
    env = dict(os.environ, **env_extra)
    # cwd "/": ``python -c`` puts the working directory first on sys.path, and a source
    # checkout there (without the built _C) would shadow the installed package.
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd="/",
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_disable_env_var_selects_fallback_with_one_warning():
    out = _run("""
        import json, warnings, torch
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            from ckptstore import native
        x = torch.arange(1000, dtype=torch.int32).view(torch.uint8)
        s = native.shuffle(x, 4)
        dst = torch.empty_like(x)
        native.copy_bytes(dst.data_ptr(), x.data_ptr(), x.numel())
        print(json.dumps({
            "native": native.NATIVE,
            "warnings": [(w.category.__name__, str(w.message)) for w in caught],
            "shuffled": s.tolist(),
            "roundtrip": torch.equal(native.unshuffle(s, 4), x),
            "copied": torch.equal(dst, x),
        }))
    """, {"CKPTSTORE_DISABLE_NATIVE": "1"})
    result = json.loads(out)
    assert result["native"] is False
    assert len(result["warnings"]) == 1
    category, message = result["warnings"][0]
    assert category == "RuntimeWarning" and "CKPTSTORE_DISABLE_NATIVE" in message
    x = torch.arange(1000, dtype=torch.int32).view(torch.uint8)
    assert result["shuffled"] == native.shuffle(x, 4).tolist()
    assert result["roundtrip"] and result["copied"]


@needs_native
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_pool_works_in_forked_child():
    out = _run("""
        import os, torch
        from ckptstore import native
        x = torch.randint(0, 256, (8 << 20,), dtype=torch.uint8)
        y = torch.empty_like(x)
        native.copy_bytes(y.data_ptr(), x.data_ptr(), x.numel(), threads=2)  # pool started
        pid = os.fork()
        if pid == 0:
            z = torch.empty_like(x)
            native.copy_bytes(z.data_ptr(), x.data_ptr(), x.numel(), threads=2)
            os._exit(0 if torch.equal(z, x) else 1)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status))
    """, {})
    assert out.strip() == "0"


# ---- host pool blocks and the CUDA probe ----------------------------------------


@needs_native
def test_block_buffer_protocol_shares_memory_with_tensor():
    pool = native.HostPool(1 << 20)
    b = pool.try_alloc(100)
    t = torch.frombuffer(b, dtype=torch.uint8)
    view = memoryview(b)
    assert (t.data_ptr(), t.numel(), len(view), view.readonly) == (b.ptr, 100, 100, False)
    view[3] = 201
    t[4] = 7
    assert (int(t[3]), view[4]) == (201, 7)
    with pytest.raises(TypeError):
        type(b)()  # blocks come only from a pool
    pool.free(b)


def test_cuda_info_reports_without_raising():
    info = native.cuda_info()
    assert set(info) == {"compiled", "available", "devices", "runtime_version", "driver_version",
                         "min_driver_version", "api", "library", "kernel", "error"}
    assert native.cuda_available() is bool(info["available"])
    assert info["runtime_version"] == 0  # no CUDA runtime is linked: the driver API only
    if info["available"]:
        assert info["compiled"] and info["devices"] >= 1 and info["error"] == ""
        assert info["driver_version"] >= info["min_driver_version"] == 11000
        assert native.cuda_off_reason() is None
    else:
        assert info["devices"] == 0 and info["error"] != ""
        assert info["error"] in native.cuda_off_reason()
    if not torch.cuda.is_available():
        assert info["available"] is False
    if native.NATIVE and info["compiled"]:
        assert (info["api"], info["min_driver_version"]) == ("driver", 11000)
        assert info["kernel"].startswith("PTX 7.0 sm_50")


# ---- the CUDA path without a GPU: the driver loader, the kernel image, the warning ----

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GATHER_PTX = os.path.join(REPO, "csrc", "gather.ptx")
needs_cuda_build = pytest.mark.skipif(not (native.NATIVE and native.cuda_info()["compiled"]),
                                      reason="extension built without its CUDA path")


def test_gather_ptx_is_old_enough_for_every_supported_driver():
    """The kernel is JIT-compiled by the driver: its PTX ISA version decides the oldest
    driver that loads it (7.0: CUDA 11.0, driver 450), its target the oldest GPU."""
    text = open(GATHER_PTX).read()
    code = [ln.split("//")[0].strip() for ln in text.splitlines()]
    code = [ln for ln in code if ln]
    assert code[:3] == [".version 7.0", ".target sm_50", ".address_size 64"]
    assert ".visible .entry ckpt_gather(" in code
    entry = text.index(".visible .entry ckpt_gather(")
    head = text[entry:text.index("{", entry)]
    assert head.count(".param .u64") == 2  # (descs, count): what cuda_stage.cpp passes
    # Every branch target is a label of the kernel.
    labels = {ln[:-1] for ln in code if ln.endswith(":")}
    targets = {ln.split()[-1].rstrip(";") for ln in code if " bra" in f" {ln}"}
    assert targets and targets <= labels


def test_gather_ptx_assembles_for_turing_and_hopper():
    """ptxas (from any CUDA toolkit, when one is installed) accepts the kernel as PTX 7.0
    and compiles it for sm_75 and sm_90: no instruction newer than its declared ISA."""
    import shutil

    ptxas = shutil.which("ptxas")
    if ptxas is None:
        pytest.skip("no ptxas (CUDA toolkit) on this machine")
    for arch in ("sm_75", "sm_90"):
        r = subprocess.run([ptxas, f"-arch={arch}", GATHER_PTX, "-o", os.devnull],
                           capture_output=True, text=True)
        assert r.returncode == 0, f"ptxas -arch={arch}: {r.stderr}"


def test_every_driver_entry_point_is_checked_against_cuda_h():
    """cuda_driver.cpp binds libcuda's entry points by name; cuda_driver_check.cpp
    (compiled where a toolkit's cuda.h is found, as here) asserts each of those names
    has the prototype the module assumes. Both lists must be the same."""
    import re

    src = open(os.path.join(REPO, "csrc", "cuda_driver.cpp")).read()
    check = open(os.path.join(REPO, "csrc", "cuda_driver_check.cpp")).read()
    bound = set(re.findall(r'bind\(lib, a\.\w+, "(\w+)"', src))
    checked = set(re.findall(r"^CKPT_EXPECT\((\w+),", check, re.M))
    assert len(bound) >= 25 and bound == checked


@needs_cuda_build
def test_embedded_kernel_is_the_checked_in_ptx():
    assert native._C.gather_ptx() == open(GATHER_PTX).read()


@needs_cuda_build
def test_no_driver_library_is_reported_with_the_reason():
    """Without libcuda.so.1 on the library path (as here, or on a CPU node) the module
    imports, reports why, and the raw calls fail with that reason."""
    out = _run("""
        import json, os
        from ckptstore import native
        info = native.cuda_info()
        try:
            native._C.cuda_stage(0, 0, [1], [2], [3], 64, True, 0.0)
            raised = ""
        except RuntimeError as exc:
            raised = str(exc)
        print(json.dumps({"info": info, "raised": raised, "current": native._C.cuda_current_device()}))
    """, {"LD_LIBRARY_PATH": "/nonexistent", "CUDA_VISIBLE_DEVICES": ""})
    r = json.loads(out)
    assert r["info"]["available"] is False and r["info"]["error"]
    assert r["raised"] == "CUDA staging unavailable: " + r["info"]["error"]
    assert r["current"] == -1
    if not torch.cuda.is_available():  # this machine has no driver at all
        assert "libcuda.so.1" in r["info"]["error"] or "cuInit" in r["info"]["error"]


def test_cuda_off_warns_once_per_process_when_torch_sees_a_gpu(monkeypatch):
    if native.cuda_available():
        pytest.skip("the native CUDA path is on here")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # torch's view only
    monkeypatch.setattr(native, "_warned_cuda_off", False)
    with pytest.warns(RuntimeWarning, match="native CUDA staging path is off") as caught:
        assert native.cuda_available() is False
        assert native.cuda_available() is False
    ours = [w for w in caught if "native CUDA staging path" in str(w.message)]
    assert len(ours) == 1 and native.cuda_off_reason() in str(ours[0].message)


def test_doctor_says_why_the_native_cuda_path_is_off():
    from ckptstore.cli import doctor_report

    rep = doctor_report()
    assert rep["cuda"]["native_off"] == native.cuda_off_reason()
    assert (rep["cuda"]["native_off"] is None) == native.cuda_available()


@pytest.mark.parametrize("raw,expected", [("", 0.0), ("0", 0.0), ("2.5", 2.5), (" 30 ", 30.0)])
def test_copy_timeout_from_the_environment(monkeypatch, raw, expected):
    monkeypatch.setenv(native.COPY_TIMEOUT_ENV, raw)
    assert native.copy_timeout() == expected


@pytest.mark.parametrize("raw", ["-1", "soon", "nan", "inf"])
def test_copy_timeout_rejects_nonsense(monkeypatch, raw):
    monkeypatch.setenv(native.COPY_TIMEOUT_ENV, raw)
    with pytest.raises(ValueError, match="CKPTSTORE_CUDA_COPY_TIMEOUT"):
        native.copy_timeout()


# ---- slab frees: deferred to the reclaimer thread, counted until done -------------

MiB = 1 << 20


def _empty_slabs(pool, count: int, size: int) -> None:
    """Make `count` slabs of `size` bytes, all empty, with no Block object left."""
    blocks = [pool.try_alloc(size) for _ in range(count)]
    assert all(b is not None for b in blocks) and pool.stats()["slabs"] == count
    for b in blocks:
        pool.free(b)


@needs_native
def test_pressure_hands_empty_slabs_to_the_reclaimer_and_counts_them_until_freed():
    pool = native.HostPool(8 * MiB, slab_bytes=2 * MiB)
    _empty_slabs(pool, 4, 2 * MiB)
    native._C.flush_reclaims()
    before = pool.stats()
    big = pool.try_alloc(6 * MiB)  # no hole fits; three empty slabs must go first
    st = pool.stats()
    if big is None:  # the reclaimer has not freed them yet: their bytes still count
        assert st["reclaim_fails"] == before["reclaim_fails"] + 1
        assert st["held"] + st["reclaiming"] <= 8 * MiB and st["in_use"] == 0
        assert pool.wait_reclaimed(60)
        big = pool.try_alloc(6 * MiB)
    st = pool.stats()
    assert big is not None and not big.overflow and len(big) == 6 * MiB
    assert st["reclaiming"] == 0 and st["slab_frees"] == before["slab_frees"] + 3
    assert st["held"] == 8 * MiB and st["peak"] <= 8 * MiB and st["overflow_allocs"] == 0
    pool.free(big)


@needs_native
def test_the_pool_acquire_waits_for_the_reclaimer_not_for_a_release():
    """A strict acquire (the copier's) that needs dropped slabs freed gets its buffer
    without any release: it waits for the reclaimer, GIL released."""
    from ckptstore.staging import NativeStagingPool

    pool = NativeStagingPool(8 * MiB, pin_memory=False, slab_bytes=2 * MiB)
    bufs = [pool.acquire(2 * MiB, overflow_after=None) for _ in range(4)]
    for b in bufs:
        pool.release(b)
    del bufs, b
    done = []
    t = threading.Thread(target=lambda: done.append(pool.acquire(6 * MiB, overflow_after=None)))
    t.start()
    t.join(60)
    assert not t.is_alive() and done[0].nbytes == 6 * MiB
    st = pool.stats()
    assert st["reclaiming"] == 0 and st["held"] <= 8 * MiB and st["overflow_allocs"] == 0
    pool.release(done[0])


@needs_native
def test_a_slab_a_stale_block_still_holds_is_not_counted_against_the_capacity():
    """A Block object kept after its free keeps its slab mapped; counting that slab
    until the object dies could keep the capacity taken for good, so it is not."""
    pool = native.HostPool(8 * MiB, slab_bytes=2 * MiB)
    stale = [pool.try_alloc(2 * MiB) for _ in range(4)]
    for b in stale:
        pool.free(b)
    big = pool.try_alloc(6 * MiB)
    assert big is not None and pool.stats()["reclaiming"] == 0
    pool.free(big)
    del stale


@needs_native
def test_pinned_pool_prepares_cuda_only_where_a_context_is_current():
    """Without a usable CUDA path (or with no context on this thread) the pinned pool's
    preparation does nothing and creates nothing; on a GPU, test_gpu_native.py checks
    what it loads."""
    from ckptstore.staging import NativeStagingPool

    if native.cuda_available():
        pytest.skip("the CUDA case is tests/test_gpu_native.py's")
    pool = NativeStagingPool(4 * MiB, pin_memory=True, slab_bytes=2 * MiB)
    assert pool.cuda_devices == {} and pool.prepare_cuda() is None
    assert pool.warm(2 * MiB) == 2 * MiB and pool.cuda_devices == {}
    assert native._C.cuda_current_device() == -1


@needs_native
def test_trim_returns_once_the_slabs_are_freed():
    pool = native.HostPool(16 * MiB, slab_bytes=4 * MiB)
    _empty_slabs(pool, 3, 4 * MiB)
    assert pool.trim() == 12 * MiB
    st = pool.stats()
    assert (st["held"], st["reclaiming"], st["slabs"], st["slab_frees"]) == (0, 0, 0, 3)
    assert pool.wait_reclaimed(0)  # nothing left to wait for


@needs_native
def test_quarantined_memory_is_never_lent_again():
    """What a timed-out device copy does to its destinations: freed blocks there are
    withheld (the copy may still land), the rest of the pool works on."""
    pool = native.HostPool(4 * MiB, slab_bytes=4 * MiB)
    a = pool.try_alloc(MiB)
    b = pool.try_alloc(MiB)
    native._C.quarantine_host_range(a.ptr + 100, 10)
    pool.free(a)
    pool.free(b)
    st = pool.stats()
    assert st["quarantined"] == MiB and st["in_use"] == 0 and st["used"] == MiB
    got = [pool.try_alloc(MiB) for _ in range(3)]  # only 3 MiB of the slab are lendable
    assert all(g is not None for g in got)
    assert all(not (g.ptr < a.ptr + MiB and a.ptr < g.ptr + MiB) for g in got)
    for g in got:
        pool.free(g)
    assert pool.trim() == 0  # the slab is never empty again (nor freed: it is leaked, so
    # its addresses never come back to another pool, where the quarantine would hold)


@needs_native
def test_a_pool_filled_by_quarantined_memory_lends_beyond_it_instead_of_waiting():
    """Memory withheld after a timed-out copy can fill a pool that lends nothing: no
    release will come, so a waiting acquire lends ordinary memory beyond the capacity."""
    from ckptstore.staging import NativeStagingPool

    pool = NativeStagingPool(2 * MiB, pin_memory=False, slab_bytes=2 * MiB)
    whole = pool.acquire(2 * MiB)
    native._C.quarantine_host_range(whole.tensor.data_ptr(), 2 * MiB)
    pool.release(whole)
    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(MiB, overflow_after=None)), daemon=True)
    waiter.start()
    waiter.join(120)  # a hang guard, not a timing: the acquire returns at once or never
    assert got, "acquire waited for a release that cannot come"
    assert pool._slabs.stats()["quarantined"] == 2 * MiB
    got[0].tensor.fill_(7)  # usable memory
    pool.release(got[0])


@needs_native
def test_extension_imports_without_a_visible_gpu():
    """With no device visible (or no driver at all) the module imports, reports why, and
    its host pool still works in ordinary memory."""
    out = _run("""
        import json
        from ckptstore import _C
        info = _C.cuda_info()
        pool = _C.HostPool(1 << 20, pinned=True)
        b = pool.try_alloc(10)
        print(json.dumps({"info": info, "pinned": pool.stats()["pinned"], "block_pinned": b.pinned}))
    """, {"CUDA_VISIBLE_DEVICES": ""})
    result = json.loads(out)
    assert result["info"]["available"] is False and result["info"]["devices"] == 0
    assert result["info"]["error"] != ""
    assert (result["pinned"], result["block_pinned"]) == (False, False)


# ---------------------------------------------------------------------------- BytesPart
BYTES_PARTS = [pytest.param(native._FallbackBytesPart, id="fallback")]
if native.NATIVE:
    BYTES_PARTS.append(pytest.param(native._C.BytesPart, id="native"))


@pytest.mark.parametrize("cls", BYTES_PARTS)
def test_bytes_part_fills_in_order_and_hands_out_exact_bytes_once(cls):
    """The S3 writer's upload parts: writes land back to back, as much as fits; take()
    gives exactly what was written (the whole object when full, else the prefix), once."""
    rng = random.Random(3)
    pieces = [rng.randbytes(rng.randrange(0, 5000)) for _ in range(20)]
    stream = b"".join(pieces)
    capacity = len(stream) // 2
    part, rest = cls(capacity), b""
    for p in pieces:
        src = memoryview(bytearray(p))  # any C-contiguous buffer, writable or not
        n = part.write(src)
        assert n == min(len(p), capacity - (part.size - n))
        rest += p[n:]
    assert (part.size, part.capacity) == (capacity, capacity)
    assert part.write(b"more") == 0  # full: nothing fits
    out = part.take()
    assert type(out) is bytes and out == stream[:capacity]
    with pytest.raises(RuntimeError, match="taken"):
        part.take()
    with pytest.raises(RuntimeError, match="taken"):
        part.write(b"x")
    # start= copies from inside the source; a part not full gives its prefix.
    part = cls(10)
    assert part.write(b"0123456789abcdef", 12) == 4 and part.write(memoryview(b"xyz"), 1) == 2
    assert part.take() == b"cdefyz"
    with pytest.raises(ValueError, match="beyond"):
        cls(4).write(b"ab", 3)
    assert cls(0).take() == b""
