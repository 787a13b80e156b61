"""What a save may do to CUDA and to pinned memory, checked on the CPU (issue 20, items
2, 3, 4 and 6; the GPU halves are in tests/test_gpu_semantics.py):

* the staging budget: half the node's RAM shared by LOCAL_WORLD_SIZE ranks, pinned
  pools capped at that share, a bad LOCAL_WORLD_SIZE an error naming it;
* a CPU-only save calls nothing in ``torch.cuda`` nor the extension's CUDA probe, and
  pins nothing, even where CUDA would be available (``is_available`` faked in a
  subprocess: the decision logic only);
* ``stream=`` is checked at the entry, before anything is staged or written;
* row-major boxes cover a tensor exactly once (property test), and strided copies in
  bounded pieces give ``contiguous()``'s bytes, also through a save of a DTensor whose
  local tensor is not contiguous.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptstore
from ckptstore.checkpoint.flatten import region_byte_offset
from ckptstore.config import MIN_RANK_SHARE, NODE_STAGING_SHARE, Config, ConfigError, host_memory_bytes, rank_share_of_node
from ckptstore.runtime import Runtime
from ckptstore.staging import StagingCopier, StagingPool, check_stream, row_major_boxes
from ckptstore.staging.strided import copy_boxes

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def run_child(code: str, timeout: float = 120) -> dict:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, cwd="/")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- item 4: the staging budget of a node ----------------------------------------------


def test_default_budget_is_half_the_ram_shared_by_the_local_ranks():
    ram = host_memory_bytes()
    share = int(ram * NODE_STAGING_SHARE)
    assert NODE_STAGING_SHARE == 0.5
    assert Config.from_env({}).staging_capacity == share  # no LOCAL_WORLD_SIZE: one rank
    for n in (1, 2, 8, 64):
        cfg = Config.from_env({"LOCAL_WORLD_SIZE": str(n)})
        assert (cfg.local_world_size, cfg.staging_bytes) == (n, None)
        assert cfg.staging_capacity == cfg.pinned_capacity == share // n
        assert n * cfg.staging_capacity <= share  # the node's ranks together: at most the share
    assert Config.from_env({"LOCAL_WORLD_SIZE": " "}).local_world_size == 1  # empty = unset


def test_without_local_world_size_the_launchers_count_of_the_node_ranks_is_used():
    """srun and mpirun set no LOCAL_WORLD_SIZE: their own counts divide the share."""
    def local(env):
        return Config.from_env(env).local_world_size

    assert local({"SLURM_NTASKS_PER_NODE": "4"}) == 4
    assert local({"SLURM_NTASKS_PER_NODE": "4(x2)"}) == 4  # 4 tasks on each of 2 nodes
    assert local({"OMPI_COMM_WORLD_LOCAL_SIZE": "8", "SLURM_NTASKS_PER_NODE": "4"}) == 8
    assert local({"MPI_LOCALNRANKS": "2"}) == 2
    assert local({"LOCAL_WORLD_SIZE": "2", "SLURM_NTASKS_PER_NODE": "4"}) == 2  # torchrun's wins
    assert local({"SLURM_NTASKS_PER_NODE": "(x2)", "OMPI_COMM_WORLD_LOCAL_SIZE": "0"}) == 1  # unreadable: 1
    assert Config.from_env({"SLURM_NTASKS_PER_NODE": "4"}).staging_capacity == rank_share_of_node(4)


def test_rank_share_arithmetic():
    assert rank_share_of_node(8, ram=64 * GiB) == 4 * GiB
    assert rank_share_of_node(3, ram=10 * GiB) == 5 * GiB // 3
    # A huge count (a stray SLURM_NTASKS_PER_NODE) floors at a share a save can work in,
    # not at a few bytes that would make it crawl.
    assert rank_share_of_node(1000, ram=1000) == MIN_RANK_SHARE
    assert Config.from_env({"LOCAL_WORLD_SIZE": str(10**9)}).pinned_capacity == MIN_RANK_SHARE


def test_explicit_budget_is_kept_but_pinned_memory_stays_within_the_node_share():
    ram = host_memory_bytes()
    cfg = Config.from_env({"LOCAL_WORLD_SIZE": "4", "CKPTSTORE_STAGING_BYTES": str(ram)})
    assert cfg.staging_capacity == ram  # pageable memory: the operator's word
    assert cfg.pinned_capacity == int(ram * NODE_STAGING_SHARE) // 4  # page-locked: capped
    small = Config.from_env({"LOCAL_WORLD_SIZE": "4", "CKPTSTORE_STAGING_BYTES": str(64 * MiB)})
    assert small.staging_capacity == small.pinned_capacity == 64 * MiB
    assert Config(staging_bytes=None, local_world_size=2).staging_capacity == int(ram * NODE_STAGING_SHARE) // 2


@pytest.mark.parametrize("value", ["abc", "0", "-2", "1.5"])
def test_bad_local_world_size_is_an_error_naming_it(value):
    with pytest.raises(ConfigError, match=f"LOCAL_WORLD_SIZE={value!r}"):
        Config.from_env({"LOCAL_WORLD_SIZE": value})
    with pytest.raises(ConfigError, match="local_world_size=0"):
        Config(local_world_size=0)


def test_configuration_md_lists_every_variable():
    from pathlib import Path
    text = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text()
    for knob in Config.knobs():
        assert f"| `{knob['name']}` | `{knob['env']}` |" in text, knob["name"]


def test_a_direct_pinned_pool_defaults_to_the_pinned_capacity(monkeypatch):
    from ckptstore import config as config_mod
    cfg = Config.from_env({"CKPTSTORE_STAGING_BYTES": str(host_memory_bytes()), "LOCAL_WORLD_SIZE": "2"})
    monkeypatch.setattr(config_mod, "_config", cfg)
    assert StagingPool(pin_memory=True, backend="torch").capacity == cfg.pinned_capacity < cfg.staging_capacity
    assert StagingPool(pin_memory=False, backend="torch").capacity == cfg.staging_capacity


def test_runtime_pool_follows_the_budget_and_is_unpinned():
    rt = Runtime(workers=1, config=Config.from_env({"LOCAL_WORLD_SIZE": "8"}))
    try:
        assert rt.pool.capacity == rank_share_of_node(8)
        assert rt.pool.pin_memory is False and rt.pool.stats()["pinned"] is False
    finally:
        rt.shutdown()


def test_import_fails_with_the_variable_named_when_local_world_size_is_bad():
    proc = subprocess.run([sys.executable, "-c", "import ckptstore"], capture_output=True, text=True, cwd="/",
                          env={**__import__("os").environ, "LOCAL_WORLD_SIZE": "eight"}, timeout=120)
    assert proc.returncode != 0
    assert "environment variable LOCAL_WORLD_SIZE='eight': expected an integer" in proc.stderr


# ---- item 3: a pinned pool only for CUDA states -------------------------------------------


def test_runtime_swaps_in_a_pinned_pool_for_cuda_devices_even_while_the_old_one_lends():
    """A CUDA save gets a pinned pool at once, also while a CPU save still writes from
    the unpinned one (which then gets its buffer back, as its writer took it from it)."""
    rt = Runtime(workers=1, staging_bytes=4 * MiB)
    try:
        plain = rt.pool
        assert rt.staging_pool(frozenset()) is plain and not plain.pin_memory  # CPU state: as it is
        idle = plain.acquire(1 * MiB)
        plain.release(idle)
        buf = plain.acquire(1 * MiB)  # a save still being written holds this one
        pinned = rt.staging_pool(frozenset({0}))  # (no memory is allocated until acquire)
        assert pinned is not plain and pinned.pin_memory and rt.pool is pinned
        assert (plain.device, pinned.device) == (None, 0)  # the device it pins under
        assert pinned.capacity == rt.config.pinned_capacity == 4 * MiB
        assert plain.in_use == 1 * MiB  # the lent buffer stays lent ...
        plain.release(buf)  # ... and comes back to the pool it came from
        assert plain.in_use == 0 and pinned.in_use == 0
        assert rt.staging_pool(frozenset()) is pinned and rt.staging_pool(frozenset({1})) is pinned
    finally:
        rt.shutdown()


SPY = """
    import inspect, json, sys, threading, torch
    calls = []

    def spy(name, fn):
        def wrapper(*a, **k):
            caller = sys._getframe(1).f_code.co_filename
            if "/ckptstore/" in caller:
                calls.append(f"torch.cuda.{name} from {caller.rsplit('/', 2)[-2:]}")
            return fn(*a, **k)
        return wrapper

    for name in dir(torch.cuda):
        obj = getattr(torch.cuda, name)
        if name == "is_initialized":  # reads a flag of torch's: no driver call (rng.py asks it)
            continue
        if not name.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj)):
            setattr(torch.cuda, name, spy(name, obj))
    torch.cuda.is_available = spy("is_available", lambda: True)  # a GPU node, for the decisions
    torch.cuda.device_count = spy("device_count", lambda: 1)

    import ckptstore
    from ckptstore import native
    from ckptstore.runtime import runtime
    for name in ("cuda_info", "cuda_available", "cuda_stage"):
        setattr(native, name, spy(name, getattr(native, name)))
"""


def test_cpu_only_save_calls_nothing_of_cuda_and_pins_nothing(tmp_path):
    """From the main thread and from a helper thread, ``save``, ``Store.save``,
    ``Checkpointer.save`` (RNG states included) and ``prepare`` of a CPU-only state (plain and through the pickling path) make no
    ``torch.cuda`` call and no call to the extension's CUDA probe, on a node where CUDA
    looks available; the runtime's pool stays unpinned."""
    result = run_child(SPY + f"""
    root = {str(tmp_path)!r}
    class Box:  # a user class: the pickling (flatten) path, not the capture
        def __init__(self, t):
            self.t = t
    state = {{"w": torch.randn(300, 300), "i": torch.arange(10), "step": 3}}
    ckptstore.prepare(state).result()
    ckptstore.save(state, root + "/a").result()
    ckptstore.save({{"box": Box(torch.ones(5))}}, root + "/b").result()
    def helper():
        ckptstore.Store(root + "/store").save(1, state).result()
        ckpt = ckptstore.Checkpointer(root + "/ckpt", model=torch.nn.Linear(4, 4), rng=True)
        ckpt.save(1).result()
    t = threading.Thread(target=helper)
    t.start(); t.join()
    loaded = ckptstore.load(root + "/a")
    print(json.dumps({{"calls": calls, "pinned": runtime().pool.pin_memory,
                      "stats_pinned": runtime().pool.stats()["pinned"],
                      "initialized": torch.cuda.is_initialized(),
                      "equal": bool(torch.equal(loaded["w"], state["w"]))}}))
    """)
    assert result == {"calls": [], "pinned": False, "stats_pinned": False, "initialized": False, "equal": True}


def test_the_spy_sees_a_cuda_state(tmp_path):
    """The spy of the test above works: a state that claims a CUDA tensor makes the save
    ask for a pinned pool and enter the tensor's device (the save then fails: no GPU)."""
    result = run_child(SPY + f"""
    from ckptstore.checkpoint import snapshot
    snapshot.cuda_devices = lambda found, dtensors: frozenset({{0}})  # as if a tensor were on cuda:0
    class Box:  # (a plain state of CPU tensors is captured: CPU-only by construction)
        def __init__(self, t):
            self.t = t
    try:
        ckptstore.save({{"box": Box(torch.ones(3))}}, {str(tmp_path / "a")!r}).result()
    except Exception as e:
        err = type(e).__name__
    else:
        err = None
    print(json.dumps({{"calls": calls, "err": err}}))
    """)
    assert any(c.startswith("torch.cuda.device from") for c in result["calls"]), result


# ---- item 2: stream= is checked at the entry ----------------------------------------------


@pytest.mark.parametrize("bad, error, match", [
    ("default", TypeError, "stream= must be None, a torch.cuda.Stream or a dict"),
    (0, TypeError, "got int"),
    ({"cuda:0": None}, TypeError, "keys must be CUDA device indexes, got 'cuda:0'"),
    ({-1: None}, TypeError, "keys must be CUDA device indexes"),
    ({True: None}, TypeError, "keys must be CUDA device indexes"),
    ({0: "s"}, TypeError, r"stream\[0\] must be a torch.cuda.Stream, got str"),
    ({torch.device("cuda", 1): 5}, TypeError, r"stream\[1\] must be a torch.cuda.Stream, got int"),
])
def test_bad_stream_fails_before_anything_is_written(tmp_path, bad, error, match):
    state = {"w": torch.ones(4)}
    with pytest.raises(error, match="ckptstore.save: .*" + match):
        ckptstore.save(state, str(tmp_path / "a"), stream=bad)
    with pytest.raises(error, match="Store.save: .*" + match):
        ckptstore.Store(str(tmp_path / "s")).save(1, state, stream=bad)
    assert not (tmp_path / "a").exists() and not list((tmp_path / "s").glob("*/*"))


def test_checkpointer_passes_stream_to_the_store(tmp_path):
    with ckptstore.Checkpointer(str(tmp_path / "c"), state={"progress": {"n": 1}}, every=1, rng=False) as ckpt:
        with pytest.raises(TypeError, match="Store.save: stream= must be"):
            ckpt.save(1, stream="side")
        with pytest.raises(TypeError, match="Store.save: stream= must be"):
            ckpt.step(1, stream=3)
        ckpt.step(2, stream=None)
    ckptstore.wait()
    assert ckptstore.Store(str(tmp_path / "c")).steps() == [2]


def test_no_stream_and_an_empty_dict_are_accepted(tmp_path):
    assert check_stream(None) is None and check_stream({}) == {}
    state = {"w": torch.arange(6.0)}
    ckptstore.save(state, str(tmp_path / "a"), stream={}).result()  # a CPU state ignores it
    store = ckptstore.Store(str(tmp_path / "s"))
    store.save(1, state, stream=None).result()
    assert torch.equal(ckptstore.load(str(tmp_path / "a"))["w"], state["w"])
    assert torch.equal(store.load(1)["w"], state["w"])


# ---- item 6: bounded row-major boxes and strided copies ------------------------------------


@settings(max_examples=300, deadline=None)
@given(shape=st.lists(st.integers(0, 6), min_size=0, max_size=4), itemsize=st.sampled_from([1, 2, 4, 8, 16]),
       limit=st.integers(1, 700))
def test_row_major_boxes_cover_the_tensor_exactly_once_in_order(shape, itemsize, limit):
    shape = tuple(shape)
    hits = torch.zeros(shape, dtype=torch.int32)
    at = 0
    for offsets, sizes, start, nbytes in row_major_boxes(shape, itemsize, limit):
        assert len(offsets) == len(sizes) == len(shape)
        assert nbytes == math.prod(sizes) * itemsize > 0
        assert nbytes <= max(limit, itemsize)  # bounded (one element at least)
        assert start == at == region_byte_offset(shape, offsets, itemsize)  # back to back, row-major
        at += nbytes
        hits[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))] += 1
        # the box is one contiguous run of the row-major tensor
        index = torch.arange(math.prod(shape)).reshape(shape)[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]
        flat = index.reshape(-1)
        assert torch.equal(flat, torch.arange(int(flat[0]), int(flat[0]) + flat.numel()))
    assert at == math.prod(shape) * itemsize
    assert bool((hits == 1).all())


def strided_cases():
    g = torch.Generator().manual_seed(5)
    base = torch.randn(37, 29, 6, generator=g)
    yield "transposed", base.transpose(0, 1)
    yield "stepped", base[::3, 1::2]
    yield "permuted bf16", base.to(torch.bfloat16).permute(2, 0, 1)
    yield "complex columns", torch.randn(40, 30, dtype=torch.complex64, generator=g)[:, 3:17]
    yield "bool", (base > 0)[:, ::2, 0]
    yield "int8 expanded", torch.arange(7, dtype=torch.int8).expand(5, 7)
    yield "scalar", base[3, 4, 5]
    yield "empty", base[:, :0]


@pytest.mark.parametrize("name, src", list(strided_cases()), ids=[n for n, _ in strided_cases()])
@pytest.mark.parametrize("piece", [1, 7, 100, 1 << 20])
def test_copy_boxes_writes_contiguous_bytes(name, src, piece):
    n = src.numel() * src.element_size()
    dst = torch.full((n + 5,), 0xAB, dtype=torch.uint8)
    copy_boxes(src, dst, piece)
    want = src.contiguous().reshape(-1).view(torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
    assert torch.equal(dst[:n], want)
    assert bool((dst[n:] == 0xAB).all())  # nothing past the tensor


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_copier_stages_a_strided_tensor_without_a_contiguous_copy(backend, monkeypatch):
    from ckptstore import native
    if backend == "native" and not native.NATIVE:
        pytest.skip(native.WHY_NOT)
    src = torch.randn(300, 200).t()[5:190]
    made = []
    real = torch.Tensor.contiguous
    monkeypatch.setattr(torch.Tensor, "contiguous", lambda self, *a, **k: made.append(1) or real(self, *a, **k))
    pool = StagingPool(4 * MiB, pin_memory=False, backend=backend)
    got = []
    with StagingCopier(pool) as copier:
        copier.copy_strided(src, got.append)
    monkeypatch.undo()
    assert made == []
    assert len(got) == 1 and torch.equal(got[0].tensor, src.contiguous().reshape(-1).view(torch.uint8))
    pool.release(got[0])
    assert pool.in_use == 0


def test_dtensor_with_a_non_contiguous_local_tensor_saves_and_loads_exactly(tmp_path):
    """One gloo rank: DTensors whose local tensors are transposed or column slices are
    staged by strided copies (in chunks smaller than the tensor), not by .contiguous()."""
    result = run_child(f"""
    import json, os, torch, torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 2000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    import ckptstore
    from ckptstore.staging import StagingCopier
    strided = []
    real = StagingCopier.copy_strided
    StagingCopier.copy_strided = lambda self, t, then: (strided.append(t.shape), real(self, t, then))[1]
    mesh = init_device_mesh("cpu", (1,))
    g = torch.Generator().manual_seed(3)
    a = torch.randn(64, 48, generator=g)
    b = torch.randn(40, 90, generator=g).to(torch.bfloat16)
    locals_ = {{"t": a.t(), "cols": b[:, 7:70]}}
    state = {{k: DTensor.from_local(v, mesh, [Shard(0)], run_check=False) for k, v in locals_.items()}}
    pre = {{k: dt.to_local().is_contiguous() for k, dt in state.items()}}
    store = ckptstore.Store({str(tmp_path / "s")!r}, chunk_bytes=1000)
    store.save(1, state).result()
    dist.destroy_process_group()
    loaded = store.load(1)
    print(json.dumps({{"pre": pre, "pieces": len(strided),
                      "equal": {{k: bool(torch.equal(loaded[k], v)) for k, v in locals_.items()}}}}))
    """, timeout=300)
    assert result["pre"] == {"t": False, "cols": False}
    assert result["equal"] == {"t": True, "cols": True}
    assert result["pieces"] > 2  # chunked: more than one strided copy per tensor


def test_a_pool_made_for_a_device_keeps_it():
    """Runtime.staging_pool makes the pinned pool for the state's device: the native
    slabs pin under it from a thread without a context, not under GPU 0."""
    pool = StagingPool(1 * MiB, pin_memory=False, device=1)
    assert pool.device == 1
    assert StagingPool(1 * MiB, pin_memory=False).device is None
