"""What a save does on a GPU machine (issue 20, items 2, 3 and 6): ``stream=`` makes the
copies wait for the stream that wrote the tensors (a side stream, a save from a helper
thread), a CPU-only save makes no CUDA context and pins nothing, a save of CUDA tensors
on GPU 1 makes no context on GPU 0, and non-contiguous tensors (a DTensor's local
tensor) are staged with a bounded amount of device memory. Marker ``gpu``: every test
skips without a CUDA device. The CPU halves are in tests/test_save_cuda_policy.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import ckptstore
from ckptstore.config import config
from ckptstore.runtime import runtime
from ckptstore.staging import STRIDED_PIECE_BYTES, StagingCopier, StagingPool

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MiB = 1 << 20
SLEEP_CYCLES = 400_000_000  # torch.cuda._sleep: a fraction of a second of a busy stream


def write_late(stream, tensors, value) -> None:
    """Enqueue on ``stream`` a long kernel, then writes of ``value``: a copy that does
    not wait for ``stream`` reads what was there before (zeros)."""
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP_CYCLES)
        for t in tensors:
            t.fill_(value)


def zeros_state():
    torch.cuda.synchronize()
    state = {"big": torch.zeros(16 * MiB, device="cuda"),  # 64 MiB: the copy engine
             "small": [torch.zeros(n, device="cuda") for n in (1, 100, 3000)]}  # the gather path
    torch.cuda.synchronize()
    return state


def tensors_of(state):
    return [state["big"], *state["small"]]


def all_equal(state, value) -> bool:
    return all(bool((t == value).all()) for t in tensors_of(state))


def run_child(code: str, timeout: float = 300) -> dict:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, cwd="/")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- item 2: stream= ----------------------------------------------------------------------


@pytest.mark.parametrize("form", ["stream", "dict", "device-key", "store"])
def test_save_waits_for_the_stream_given_and_keeps_the_values_from_before(tmp_path, form):
    """Tensors last written on a side stream: with ``stream=`` the checkpoint holds the
    written values, and writes enqueued on that stream after ``save`` returned do not
    show."""
    state = zeros_state()
    side = torch.cuda.Stream()
    write_late(side, tensors_of(state), 1.0)  # the current (default) stream knows nothing of it
    dev = state["big"].device.index
    arg = {"stream": side, "dict": {dev: side}, "device-key": {torch.device("cuda", dev): side},
           "store": side}[form]
    if form == "store":
        store = ckptstore.Store(str(tmp_path / "s"))
        future = store.save(1, state, stream=arg)
    else:
        future = ckptstore.save(state, str(tmp_path / "ck"), stream=arg)
    with torch.cuda.stream(side):  # after save returned: must not reach the checkpoint
        for t in tensors_of(state):
            t.fill_(2.0)
    future.result()
    loaded = store.load(1, map_location="cpu") if form == "store" else ckptstore.load(str(tmp_path / "ck"),
                                                                                       map_location="cpu")
    assert all_equal(loaded, 1.0)
    side.synchronize()
    assert all_equal(state, 2.0)


def test_save_from_a_helper_thread_waits_for_the_training_stream(tmp_path):
    """The training thread writes on its stream; a helper thread saves, naming that
    stream: the helper's own current stream (the default one) would not wait for it."""
    state = zeros_state()
    train = torch.cuda.Stream()
    write_late(train, tensors_of(state), 3.0)
    store = ckptstore.Store(str(tmp_path / "s"))
    futures, errors = [], []

    def helper():
        try:
            futures.append(store.save(7, state, stream=train))
        except BaseException as e:  # surfaces in the assertion below
            errors.append(e)

    t = threading.Thread(target=helper)
    t.start()
    t.join()
    assert errors == []
    futures[0].result()
    assert all_equal(store.load(7, map_location="cpu"), 3.0)


def test_checkpointer_save_passes_the_stream(tmp_path):
    model = torch.nn.Linear(512, 512).cuda()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        with torch.no_grad():
            model.weight.fill_(5.0)
    with ckptstore.Checkpointer(ckptstore.Store(str(tmp_path / "s")), model=model) as ckpt:
        ckpt.save(1, stream=side).result()
    loaded = ckptstore.Store(str(tmp_path / "s")).load(1, map_location="cpu")
    weights = [v for k, v in _leaves(loaded) if k.endswith("weight")]
    assert weights and all(bool((w == 5.0).all()) for w in weights)


def _leaves(obj, path=""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, f"{path}.{k}" if path else str(k))
    elif isinstance(obj, torch.Tensor):
        yield path, obj


def test_stream_on_another_device_than_its_key_is_refused(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    s1 = torch.cuda.Stream(device=1)
    with pytest.raises(ValueError, match=r"ckptstore.save: stream\[0\] is on cuda:1"):
        ckptstore.save({"x": torch.ones(3, device="cuda:0")}, str(tmp_path / "a"), stream={0: s1})
    assert not (tmp_path / "a").exists()


# ---- item 3: contexts and pinned memory -----------------------------------------------------

PRIMARY_CTX = """
    import ctypes
    cu = ctypes.CDLL("libcuda.so.1")
    assert cu.cuInit(0) == 0
    def active(d):
        flags, act = ctypes.c_uint(), ctypes.c_int()
        assert cu.cuDevicePrimaryCtxGetState(d, ctypes.byref(flags), ctypes.byref(act)) == 0
        return bool(act.value)
"""


def test_cpu_only_save_from_a_helper_thread_makes_no_context_and_pins_nothing(tmp_path):
    r = run_child(PRIMARY_CTX + f"""
    import json, threading, torch
    import ckptstore
    from ckptstore.runtime import runtime
    state = {{"w": torch.randn(1000, 1000), "step": 1}}
    def helper():
        ckptstore.save(state, {str(tmp_path / "a")!r}).result()
        ckptstore.Store({str(tmp_path / "s")!r}).save(1, state).result()
        ckptstore.prepare(state).result()
    t = threading.Thread(target=helper)
    t.start(); t.join()
    ckptstore.save(state, {str(tmp_path / "b")!r}).result()  # and from the main thread
    print(json.dumps({{"ctx0": active(0), "initialized": torch.cuda.is_initialized(),
                      "pinned": runtime().pool.pin_memory, "stats_pinned": runtime().pool.stats()["pinned"]}}))
    """)
    assert r == {"ctx0": False, "initialized": False, "pinned": False, "stats_pinned": False}


def test_cuda_save_on_gpu1_from_a_helper_thread_makes_no_context_on_gpu0(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    r = run_child(PRIMARY_CTX + f"""
    import json, threading, torch
    import ckptstore
    from ckptstore.runtime import runtime
    torch.cuda.set_device(1)
    state = {{"w": torch.randn(4096, 1024, device="cuda:1"), "v": torch.randn(1000, device="cuda:1")[::3],
              "cpu": torch.ones(10)}}
    torch.cuda.synchronize(1)
    before = active(0)
    def helper():  # a new thread: no current context, torch's current device 0
        ckptstore.save(state, {str(tmp_path / "a")!r}).result()
        ckptstore.prepare(state).result()
    t = threading.Thread(target=helper)
    t.start(); t.join()
    after = active(0)
    def cpu_helper():  # CPU tensors, more than the pool holds: it grows, pinned, under GPU 1
        ckptstore.save({{"big": torch.randn(64 << 20)}}, {str(tmp_path / "b")!r}).result()
    t = threading.Thread(target=cpu_helper)
    t.start(); t.join()
    after_cpu = active(0)
    loaded = ckptstore.load({str(tmp_path / "a")!r}, map_location="cpu")
    print(json.dumps({{"before": before, "after": after, "after_cpu": after_cpu,
                      "pinned": runtime().pool.pin_memory, "device": runtime().pool.device,
                      "equal": bool(torch.equal(loaded["w"], state["w"].cpu()))}}))
    """)
    if r["before"]:
        pytest.skip("torch itself made a context on GPU 0")
    assert r == {"before": False, "after": False, "after_cpu": False, "pinned": True, "device": 1, "equal": True}


def test_a_cuda_save_stages_through_a_pinned_pool_of_the_pinned_capacity(tmp_path):
    ckptstore.wait()  # an earlier save still holding unpinned buffers would delay the swap
    state = {"w": torch.randn(1 << 20, device="cuda")}
    ckptstore.save(state, str(tmp_path / "a")).result()
    pool = runtime().pool
    assert pool.pin_memory and pool.stats()["pinned"]
    assert pool.capacity == config().pinned_capacity
    assert torch.equal(ckptstore.load(str(tmp_path / "a"), map_location="cpu")["w"], state["w"].cpu())


def test_a_cuda_save_while_a_cpu_save_still_writes_gets_a_pinned_pool(tmp_path):
    """The pinned pool comes at the first CUDA save, even while a CPU save (made just
    before, in a fresh process) still holds unpinned buffers."""
    r = run_child(f"""
    import json, torch
    import ckptstore
    from ckptstore.runtime import runtime
    cpu = ckptstore.save({{"w": torch.randn(32 << 20)}}, {str(tmp_path / "cpu")!r})  # not waited for
    state = {{"w": torch.randn(1 << 20, device="cuda")}}
    ckptstore.save(state, {str(tmp_path / "gpu")!r}).result()
    cpu.result()
    pool = runtime().pool
    print(json.dumps({{"pinned": pool.pin_memory, "stats_pinned": pool.stats()["pinned"],
                      "equal": bool(torch.equal(ckptstore.load({str(tmp_path / "gpu")!r}, map_location="cpu")["w"],
                                                state["w"].cpu()))}}))
    """)
    assert r == {"pinned": True, "stats_pinned": True, "equal": True}


def test_cuda_tensors_only_pickling_finds_are_saved_and_later_saves_pin(tmp_path):
    """A module (pickled whole) hides its CUDA parameters from the container walk: the
    save is still exact (pageable staging), says so once, and readies the pinned pool."""
    r = run_child(f"""
    import json, warnings, torch
    import ckptstore
    from ckptstore.runtime import runtime
    model = torch.nn.Linear(64, 32).cuda()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ckptstore.save({{"model": model}}, {str(tmp_path / "m")!r}).result()
    back = ckptstore.load({str(tmp_path / "m")!r}, weights_only=False, map_location="cpu")["model"]
    print(json.dumps({{"warned": sum("only pickling looks into" in str(w.message) for w in caught),
                      "pinned": runtime().pool.pin_memory,
                      "equal": bool(torch.equal(back.weight, model.weight.detach().cpu()))}}))
    """)
    assert r == {"warned": 1, "pinned": True, "equal": True}


def test_one_stream_for_a_state_on_two_devices_is_refused_before_anything_is_staged(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    state = {"a": torch.ones(3, device="cuda:0"), "b": torch.ones(3, device="cuda:1")}
    with pytest.raises(ValueError, match=r"stream of cuda:0, but the state holds tensors on cuda:\[0, 1\]"):
        ckptstore.save(state, str(tmp_path / "a"), stream=torch.cuda.Stream(device=0)).result()


def test_prepare_by_bytes_in_a_cuda_process_warms_the_pinned_pool(tmp_path):
    r = run_child("""
    import json, torch
    import ckptstore
    from ckptstore.runtime import runtime
    torch.zeros(1, device="cuda")  # the process uses CUDA
    added = ckptstore.prepare(nbytes=64 << 20).result()
    pool = runtime().pool
    print(json.dumps({"pinned": pool.pin_memory, "warm": added > 0 or pool.held >= 64 << 20}))
    """)
    assert r == {"pinned": True, "warm": True}


# ---- item 6: non-contiguous tensors in bounded device memory ---------------------------------


def test_strided_staging_of_a_large_transposed_tensor_borrows_at_most_one_piece():
    src = torch.randn(8192, 8192, device="cuda")  # 256 MiB
    view = src.t()[100:]
    n = view.numel() * view.element_size()
    pool = StagingPool(n + 64 * MiB, pin_memory=True)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    got = []
    with StagingCopier(pool) as copier:
        copier.copy_strided(view, got.append)
    borrowed = torch.cuda.max_memory_allocated() - base
    assert borrowed <= STRIDED_PIECE_BYTES + 2 * MiB, borrowed  # a whole-tensor copy would be ~250 MiB
    assert torch.equal(got[0].tensor, view.contiguous().reshape(-1).view(torch.uint8).cpu())
    pool.release(got[0])


def test_dtensor_with_a_large_non_contiguous_cuda_local_tensor_saves_in_bounded_memory(tmp_path):
    r = run_child(f"""
    import json, os, torch, torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 2000))
    dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    import ckptstore
    from ckptstore.staging import STRIDED_PIECE_BYTES
    mesh = init_device_mesh("cuda", (1,))
    full = torch.randn(8192, 8192, device="cuda")  # 256 MiB
    dt = DTensor.from_local(full.t(), mesh, [Shard(0)], run_check=False)
    contiguous = dt.to_local().is_contiguous()
    store = ckptstore.Store({str(tmp_path / "s")!r})
    warm = DTensor.from_local(torch.ones(4, 4, device="cuda").t(), mesh, [Shard(0)], run_check=False)
    store.save(0, {{"w": warm}}).result()  # collectives, pools and streams set up outside the measure
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    store.save(1, {{"w": dt}}).result()
    borrowed = torch.cuda.max_memory_allocated() - base
    dist.destroy_process_group()
    loaded = store.load(1, map_location="cpu")
    print(json.dumps({{"contiguous": contiguous, "borrowed": borrowed, "limit": STRIDED_PIECE_BYTES + 4 * (1 << 20),
                      "equal": bool(torch.equal(loaded["w"], full.t().cpu()))}}))
    """)
    assert r["contiguous"] is False and r["equal"] is True
    assert r["borrowed"] <= r["limit"], r
