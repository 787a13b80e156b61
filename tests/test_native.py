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
    assert set(info) == {"compiled", "available", "devices", "runtime_version", "driver_version", "error"}
    assert native.cuda_available() is bool(info["available"])
    if info["available"]:
        assert info["compiled"] and info["devices"] >= 1 and info["error"] == ""
    else:
        assert info["devices"] == 0 and info["error"] != ""
    if not torch.cuda.is_available():
        assert info["available"] is False


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
