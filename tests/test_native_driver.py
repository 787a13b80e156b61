"""The extension's CUDA driver-API path on a machine without a GPU, against
tests/fake_libcuda.c: a stand-in driver library, compiled here and found through
LD_LIBRARY_PATH, whose "device" memory is host memory and whose copies run at once.
It checks what is ours: loading libcuda and its entry points, the reasons the path is
off (old driver, no device), context save/restore, the eager kernel load, a batch's
gather and copy-engine parts landing the right bytes, the deadline, pinned slabs
freed by the reclaimer. What the real driver does (ordering, the kernel itself) is
checked on a GPU by tests/test_gpu.py and bench/gpu_check.sh."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from ckptstore import native

HERE = os.path.dirname(os.path.abspath(__file__))
pytestmark = [
    pytest.mark.skipif(not (native.NATIVE and native.cuda_info()["compiled"]),
                       reason="extension built without its CUDA path"),
    # With a real driver, a stand-in earlier on the library path could be bound by torch
    # too; and there tests/test_gpu*.py run this path for real.
    pytest.mark.skipif(torch.cuda.is_available(), reason="a real GPU and driver are here"),
]


@pytest.fixture(scope="module")
def fake_driver(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the fake driver")
    out = tmp_path_factory.mktemp("fake_cuda")
    r = subprocess.run([cc, "-shared", "-fPIC", "-O1", "-Wall", "-Wextra", "-o", str(out / "libcuda.so.1"),
                        os.path.join(HERE, "fake_libcuda.c")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return str(out)


def run(fake_driver, code: str, **env) -> dict:
    # cwd "/": from the repository root, "-c" would import the source tree, which holds
    # no built extension when the package is installed (not editable), as in CI.
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120,
                       cwd="/",
                       env={**os.environ, "LD_LIBRARY_PATH": fake_driver, "CUDA_VISIBLE_DEVICES": "0", **env})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


STAGE = """
    import ctypes, json, time, torch
    from ckptstore import native, _C
    fake = ctypes.CDLL("libcuda.so.1")
    pool = _C.HostPool(8 << 20, pinned=True, device=0, slab_bytes=4 << 20)
    small, large = pool.try_alloc(1000), pool.try_alloc(100_000)
    src_small = torch.randint(0, 256, (1003,), dtype=torch.uint8)   # "device" memory
    src_large = torch.randint(0, 256, (100_000,), dtype=torch.uint8)
    batch = native.cuda_stage(0, 0, [src_small.data_ptr() + 3, src_large.data_ptr()], [small.ptr, large.ptr],
                              [1000, 100_000], 64 << 10, True, timeout=TIMEOUT)
"""


def test_the_path_loads_and_a_batch_lands_its_bytes(fake_driver):
    r = run(fake_driver, STAGE.replace("TIMEOUT", "None") + """
    batch.wait()
    ok = bytes(memoryview(small)) == bytes(src_small[3:].numpy()) and bytes(memoryview(large)) == bytes(src_large.numpy())
    print(json.dumps({"info": native.cuda_info(), "prep": native.cuda_prepare(0), "ok": ok, "pinned": small.pinned,
                      "count": batch.count, "gathered": batch.gathered, "launches": fake.fake_cuda_counter(0),
                      "memcpys": fake.fake_cuda_counter(1), "ctx_after": _C.cuda_current_device()}))
    """)
    info = r["info"]
    assert info["available"] and info["devices"] == 1 and info["driver_version"] == 12040 and not info["error"]
    assert info["library"].startswith(fake_driver)
    assert r["prep"] == {"device": 0, "compute_capability": "9.0", "gather": True, "gather_error": ""}
    assert r["ok"] and r["pinned"] and (r["count"], r["gathered"], r["launches"], r["memcpys"]) == (2, 1, 1, 1)
    assert r["ctx_after"] == -1  # the caller had no context before, and has none after


def test_a_batch_that_never_completes_fails_at_its_deadline(fake_driver):
    r = run(fake_driver, STAGE.replace("TIMEOUT", "0.2") + """
    t0 = time.perf_counter()
    errs = []
    for _ in range(2):
        try:
            batch.wait()
        except RuntimeError as exc:
            errs.append(str(exc))
    waited = time.perf_counter() - t0
    pool.free(small); pool.free(large)
    print(json.dumps({"errs": errs, "waited": waited, "query": batch.finished, "stats": pool.stats()}))
    """, FAKE_CUDA_HANG="1")
    assert len(r["errs"]) == 2 and r["errs"][0] == r["errs"][1]
    assert r["errs"][0].startswith("CUDA staging batch on cuda:0 (2 copies, 101000 bytes) did not complete "
                                   "within 0.2")
    assert "CKPTSTORE_CUDA_COPY_TIMEOUT" in r["errs"][0] and "withheld from reuse" in r["errs"][0]
    assert 0.2 <= r["waited"] < 5  # the second wait fails at once
    st = r["stats"]
    assert st["quarantined"] == 1024 + 100_032 and st["in_use"] == 0  # both blocks withheld (spans)


def test_without_the_kernel_small_copies_go_one_by_one(fake_driver):
    r = run(fake_driver, STAGE.replace("TIMEOUT", "None") + """
    batch.wait()
    ok = bytes(memoryview(small)) == bytes(src_small[3:].numpy())
    print(json.dumps({"prep": native.cuda_prepare(0), "ok": ok, "gathered": batch.gathered,
                      "memcpys": fake.fake_cuda_counter(1)}))
    """, FAKE_CUDA_NO_GATHER="1")
    assert r["prep"]["gather"] is False and r["prep"]["gather_error"].startswith(
        "cuModuleLoadData (PTX 7.0 sm_50") and "CUDA_ERROR_INVALID_PTX" in r["prep"]["gather_error"]
    assert r["ok"] and (r["gathered"], r["memcpys"]) == (0, 2)


@pytest.mark.parametrize("env,reason", [
    ({"FAKE_CUDA_DRIVER": "10020"}, "the NVIDIA driver supports CUDA 10.2; ckptstore's CUDA path needs CUDA 11.0 "
                                    "(driver >= 450)"),
    ({"FAKE_CUDA_NO_DEVICE": "1"}, "cuInit failed: CUDA_ERROR_NO_DEVICE (no CUDA-capable device is detected)"),
])
def test_why_the_path_is_off_is_said_plainly(fake_driver, env, reason):
    r = run(fake_driver, """
    import json
    from ckptstore import native, _C
    pool = _C.HostPool(1 << 20, pinned=True)
    print(json.dumps({"info": native.cuda_info(), "why": native.cuda_off_reason(), "pin_error": pool.stats()["pin_error"]}))
    """, **env)
    assert r["info"]["available"] is False and r["why"] == reason and r["pin_error"] == reason


@pytest.mark.parametrize("entry", ["cuEventCreate", "cuDeviceGetAttribute"])
def test_a_device_whose_setup_fails_leaves_no_stream_or_event_behind(fake_driver, entry):
    """A save retried after the device's setup failed (its event, or a query after it)
    makes the stream and event afresh: each failed try must destroy what it made."""
    r = run(fake_driver, """
    import ctypes, json
    from ckptstore import native
    fake = ctypes.CDLL("libcuda.so.1")
    errs = []
    for _ in range(3):
        try:
            native.cuda_prepare(0)
        except RuntimeError as exc:
            errs.append(str(exc))
    print(json.dumps({"errs": errs, "streams": fake.fake_cuda_counter(3), "events": fake.fake_cuda_counter(4)}))
    """, FAKE_CUDA_FAIL=entry)
    assert len(r["errs"]) == 3 and all(e == f"{entry} failed: CUDA_ERROR_OUT_OF_MEMORY (fake)" for e in r["errs"])
    assert (r["streams"], r["events"]) == (0, 0)


@pytest.mark.parametrize("entry", ["cuModuleGetFunction", "cuFuncLoad"])
def test_a_gather_kernel_that_fails_to_load_unloads_its_module(fake_driver, entry):
    """The module loaded but its function did not: the device copies piece by piece,
    says why, and holds no module it cannot use."""
    r = run(fake_driver, """
    import ctypes, json
    from ckptstore import native
    fake = ctypes.CDLL("libcuda.so.1")
    print(json.dumps({"prep": native.cuda_prepare(0), "modules": fake.fake_cuda_counter(5)}))
    """, FAKE_CUDA_FAIL=entry)
    assert r["prep"]["gather"] is False
    assert r["prep"]["gather_error"] == "loading ckpt_gather failed: CUDA_ERROR_OUT_OF_MEMORY (fake)"
    assert r["modules"] == 0


def test_pinned_slabs_are_freed_by_the_reclaimer_under_pressure_and_by_trim(fake_driver):
    r = run(fake_driver, """
    import ctypes, json
    from ckptstore import _C
    fake = ctypes.CDLL("libcuda.so.1")
    pool = _C.HostPool(8 << 20, pinned=True, device=0, slab_bytes=2 << 20)
    blocks = [pool.try_alloc(2 << 20) for _ in range(4)]
    pinned = all(b.pinned for b in blocks)
    for b in blocks:
        pool.free(b)
    del blocks, b
    big = pool.try_alloc(6 << 20)
    waited = big is None
    if waited:
        assert pool.wait_reclaimed(30)
        big = pool.try_alloc(6 << 20)
    frees_pressure = fake.fake_cuda_counter(2)
    pool.free(big)
    del big
    trimmed = pool.trim()
    print(json.dumps({"pinned": pinned, "frees_pressure": frees_pressure, "trimmed": trimmed,
                      "frees": fake.fake_cuda_counter(2), "stats": pool.stats(), "ctx": _C.cuda_current_device()}))
    """)
    st = r["stats"]
    # Three 2 MiB slabs went for the 6 MiB one; trim freed it and the fourth; all by cuMemFreeHost.
    assert r["pinned"] and r["frees_pressure"] == 3 and r["trimmed"] == 8 << 20
    assert r["frees"] == st["slab_frees"] == 5 and st["held"] == 0 and st["reclaiming"] == 0
    assert r["ctx"] == -1  # the reclaimer's context switches stay on its own thread
