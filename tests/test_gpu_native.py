"""The native CUDA path where a GPU is: it must be on (a GPU node where it silently
turned itself off would pass every other test on the torch fallback), it loads its
kernel ahead of the save, a stuck copy fails within its deadline, and pinned slabs are
freed off the saving thread.

``test_native_cuda_path_is_on_wherever_torch_sees_a_gpu`` runs everywhere; the others
need a CUDA device (marker ``gpu``). ``CKPTSTORE_TEST_NATIVE_CUDA_OPTIONAL=1`` is the
opt-out for a build made without the CUDA path on purpose (``CKPTSTORE_CUDA=OFF``):
then the check, and the native cases of tests/test_gpu.py, skip instead of failing
(tests/conftest.py turns their skips into failures otherwise).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from ckptstore import native

OPTIONAL_ENV = "CKPTSTORE_TEST_NATIVE_CUDA_OPTIONAL"
MiB = 1 << 20

gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_native_cuda_path_is_on_wherever_torch_sees_a_gpu():
    if not torch.cuda.is_available():
        assert native.cuda_available() is False  # nothing for it to run on
        return
    if os.environ.get(OPTIONAL_ENV) == "1" and not native.cuda_available():
        pytest.skip(f"{OPTIONAL_ENV}=1: native CUDA path off ({native.cuda_off_reason()})")
    assert native.cuda_available(), (
        f"torch sees {torch.cuda.device_count()} GPU(s) but ckptstore's native CUDA path is off: "
        f"{native.cuda_off_reason()} (cuda_info: {native.cuda_info()})")
    assert native.cuda_info()["devices"] == torch.cuda.device_count()


needs_native_cuda = pytest.mark.skipif(not native.cuda_available(),
                                       reason=f"native CUDA path off: {native.cuda_off_reason()}")


def _run(code: str, env: dict[str, str] | None = None, timeout: float = 120) -> str:
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                       env={**os.environ, **(env or {})}, timeout=timeout, cwd="/")  # the installed package
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@needs_native_cuda
def test_prepare_loads_the_gather_kernel_for_the_device():
    dev = torch.cuda.current_device()
    torch.empty(1, device=dev)  # torch's context, which prepare shares
    got = native.cuda_prepare(dev)
    major, minor = torch.cuda.get_device_capability(dev)
    assert got == {"device": dev, "compute_capability": f"{major}.{minor}", "gather": True,
                   "gather_error": ""}
    assert native._C.cuda_current_device() == dev


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@needs_native_cuda
def test_pinned_pool_prepares_the_current_device_at_creation():
    from ckptstore.staging import NativeStagingPool

    dev = torch.cuda.current_device()
    torch.empty(1, device=dev)
    pool = NativeStagingPool(4 * MiB, pin_memory=True)
    assert pool.cuda_devices[dev]["gather"] is True


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@needs_native_cuda
def test_a_stuck_copy_fails_within_its_deadline_and_its_buffer_is_withheld():
    """The producer stream spins for seconds (a hung kernel); the batch's wait gives up
    after 0.3 s with the reason, instead of blocking; the buffer is not lent again."""
    out = _run("""
        import json, time, torch
        from ckptstore import native
        from ckptstore.staging import NativeStagingPool
        pool = NativeStagingPool(4 << 20, pin_memory=True)
        src = torch.arange(1 << 20, dtype=torch.uint8, device="cuda")
        buf = pool.acquire(1 << 20)
        torch.cuda._sleep(int(8e9))  # several seconds of spinning on the current stream
        s = torch.cuda.current_stream()
        batch = native.cuda_stage(src.device.index, s.cuda_stream, [src.data_ptr()], [buf.ptr],
                                  [1 << 20], 64 << 10, True, timeout=0.3)
        t0 = time.perf_counter()
        try:
            batch.wait()
            err = ""
        except RuntimeError as exc:
            err = str(exc)
        waited = time.perf_counter() - t0
        again = ""
        try:
            batch.wait()
        except RuntimeError as exc:
            again = str(exc)
        pool.release(buf)
        torch.cuda.synchronize()
        print(json.dumps({"err": err, "again": again, "waited": waited, "stats": pool.stats(),
                          "timeout": batch.timeout}))
    """)
    r = json.loads(out)
    assert "did not complete within 0.3" in r["err"] and "CKPTSTORE_CUDA_COPY_TIMEOUT" in r["err"]
    assert r["again"] == r["err"] and r["timeout"] == 0.3
    assert 0.3 <= r["waited"] < 3.0
    assert r["stats"]["quarantined"] >= 1 << 20 and r["stats"]["in_use"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@needs_native_cuda
def test_the_environment_sets_the_deadline_of_every_batch():
    out = _run("""
        import json, torch
        from ckptstore import native
        from ckptstore.staging import NativeStagingPool
        pool = NativeStagingPool(4 << 20, pin_memory=True)
        src = torch.arange(4096, dtype=torch.uint8, device="cuda")
        buf = pool.acquire(4096)
        b = native.cuda_stage(0, torch.cuda.current_stream().cuda_stream, [src.data_ptr()], [buf.ptr],
                              [4096], 64 << 10, True)
        b.wait()
        print(json.dumps({"timeout": b.timeout, "ok": torch.equal(buf.tensor.cpu(), src.cpu()),
                          "gathered": b.gathered}))
    """, {"CKPTSTORE_CUDA_COPY_TIMEOUT": "7.5"})
    r = json.loads(out)
    assert r == {"timeout": 7.5, "ok": True, "gathered": 1}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@needs_native_cuda
def test_pinned_slabs_dropped_under_pressure_are_freed_by_the_reclaimer():
    pool = native.HostPool(8 * MiB, pinned=True, device=torch.cuda.current_device(), slab_bytes=2 * MiB)
    blocks = [pool.try_alloc(2 * MiB) for _ in range(4)]
    assert all(b.pinned for b in blocks)
    for b in blocks:
        pool.free(b)
    del blocks, b
    t0 = time.perf_counter()
    big = pool.try_alloc(6 * MiB)
    if big is None:
        assert pool.wait_reclaimed(60)
        big = pool.try_alloc(6 * MiB)
    st = pool.stats()
    assert big is not None and big.pinned and st["held"] <= 8 * MiB and st["reclaiming"] == 0
    assert time.perf_counter() - t0 < 30
    pool.free(big)


def test_conftest_turns_native_cuda_skips_into_failures_on_a_gpu_machine(tmp_path):
    """The rule above, for tests/test_gpu.py's native cases: checked here with torch's
    view faked to "a GPU is present" (the native path is off on this machine, or is
    made to look off)."""
    import shutil

    shutil.copy(os.path.join(os.path.dirname(__file__), "conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_fake_gpu.py").write_text(textwrap.dedent("""
        import pytest, torch
        from ckptstore import native
        torch.cuda.is_available = lambda: True
        native.cuda_off_reason = lambda: "faked off"

        @pytest.mark.skipif(True, reason="native CUDA path off: faked")
        def test_native_case():
            pass

        @pytest.mark.skipif(True, reason="needs two CUDA devices")
        def test_other_skip():
            pass
    """))

    def session(extra_env):  # both sessions run at once: each is mostly torch's import
        return subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                                env={**os.environ, **extra_env})

    def outcome(proc):
        out, _err = proc.communicate(timeout=300)
        return proc.returncode, out.strip().splitlines()[-1]

    strict, optional = session({OPTIONAL_ENV: "0"}), session({OPTIONAL_ENV: "1"})
    rc, summary = outcome(strict)
    assert rc == 1 and "1 error" in summary and "1 skipped" in summary, summary  # fails in setup
    rc, summary = outcome(optional)
    assert rc == 0 and "2 skipped" in summary, summary
