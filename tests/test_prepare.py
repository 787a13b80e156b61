"""Staging memory made ready ahead of the first save: ``HostPool.warm``,
``StagingPool.warm``, ``ckptstore.prepare`` and the Checkpointer's call of it.

Whether the pages are really populated is a matter of speed (bench/bench_core.py's
"first save" rows); here: what ``warm`` allocates, that it lends nothing, stays within
the capacity, and that the next save takes its memory instead of making slabs.
"""

from __future__ import annotations

import pytest
import torch

import ckptstore
from ckptstore import native
from ckptstore.api import state_nbytes
from ckptstore.staging import NativeStagingPool, TorchStagingPool

needs_native = pytest.mark.skipif(not native.NATIVE, reason=f"native path off: {native.WHY_NOT}")
MiB = 1 << 20


@needs_native
def test_warm_makes_slabs_up_to_the_request_and_lends_nothing():
    pool = native.HostPool(256 * MiB, pinned=False, device=0, slab_bytes=16 * MiB)
    assert pool.warm(40 * MiB) == 48 * MiB  # whole slabs
    stats = pool.stats()
    assert (stats["held"], stats["slabs"], stats["in_use"], stats["live_blocks"]) == (48 * MiB, 3, 0, 0)
    assert pool.warm(40 * MiB) == 0  # holds enough already
    assert pool.warm(10 << 30) == 208 * MiB and pool.stats()["held"] == 256 * MiB  # never past the capacity


@needs_native
def test_a_save_after_warm_takes_its_memory_from_the_warm_slabs():
    pool = native.HostPool(256 * MiB, pinned=False, device=0, slab_bytes=16 * MiB)
    pool.warm(64 * MiB)
    made = pool.stats()["slab_allocs"]
    blocks = [pool.try_alloc(4 * MiB) for _ in range(16)]
    assert all(b is not None for b in blocks) and pool.stats()["slab_allocs"] == made
    for i, b in enumerate(blocks):  # the memory is usable and distinct
        torch.frombuffer(b, dtype=torch.uint8).fill_(i)
    assert [int(torch.frombuffer(b, dtype=torch.uint8)[-1]) for b in blocks] == list(range(16))
    for b in blocks:
        pool.free(b)


@needs_native
def test_fresh_slab_blocks_are_usable_after_their_first_use_populates_them():
    """try_alloc populates the part of a new slab it lends (MADV_POPULATE_WRITE never
    changes contents): blocks lent from one slab, written and freed in any order, keep
    their bytes."""
    pool = native.HostPool(64 * MiB, pinned=False, device=0, slab_bytes=64 * MiB)
    first = pool.try_alloc(3 * MiB + 5)
    torch.frombuffer(first, dtype=torch.uint8).fill_(7)
    second = pool.try_alloc(5 * MiB)  # a later part of the same slab, populated now
    torch.frombuffer(second, dtype=torch.uint8).fill_(9)
    assert pool.stats()["slabs"] == 1
    assert bool((torch.frombuffer(first, dtype=torch.uint8) == 7).all())
    assert bool((torch.frombuffer(second, dtype=torch.uint8) == 9).all())
    pool.free(first)
    pool.free(second)


@needs_native
def test_native_staging_pool_warm_is_bounded_by_its_capacity():
    pool = NativeStagingPool(32 * MiB)
    assert pool.warm(1 << 40) == 32 * MiB and pool.held == 32 * MiB and pool.in_use == 0


def test_torch_pool_has_nothing_to_warm():
    pool = TorchStagingPool(32 * MiB)
    assert pool.warm(16 * MiB) == 0 and pool.held == 0


def test_state_nbytes_counts_each_storage_once():
    base = torch.zeros(1000)
    state = {"a": base, "view": base[10:20], "p": torch.nn.Parameter(torch.ones(10, 10)),
             "nested": [{"b": torch.zeros(5, dtype=torch.float64)}], "meta": torch.empty(100, device="meta"),
             "n": 3}
    assert state_nbytes(state) == 4000 + 400 + 40


def test_state_nbytes_walks_a_state_that_holds_itself():
    """A container reached again (a cycle, or nesting deeper than the stack) is walked
    once: before, one bound stopped at depth 100 and its twin recursed for ever."""
    looped: list = [torch.ones(10)]
    looped.append(looped)
    deep: list = [torch.ones(5)]
    for _ in range(5000):
        deep = [deep]
    assert state_nbytes({"a": looped, "b": deep}) == 40 + 20


@needs_native
def test_prepare_warms_the_process_pool_in_the_background(tmp_path):
    from ckptstore.pipeline import runtime

    ckptstore.configure(staging_bytes=64 * MiB)
    try:
        pool = runtime().pool
        state = {"w": torch.randn(3 * MiB)}  # 12 MiB
        added = ckptstore.prepare(state).result()
        assert added >= 12 * MiB and pool.held >= 12 * MiB and pool.in_use == 0
        assert ckptstore.prepare(nbytes=1).result() == 0
        made = pool.stats()["slab_allocs"]
        ckptstore.save(state, str(tmp_path / "c")).result()
        assert pool.stats()["slab_allocs"] == made  # the save used the prepared slabs
        assert torch.equal(ckptstore.load(str(tmp_path / "c"))["w"], state["w"])
    finally:
        ckptstore.configure()


@needs_native
def test_checkpointer_prepares_after_the_first_step(tmp_path):
    from ckptstore.pipeline import runtime

    ckptstore.configure(staging_bytes=256 * MiB)
    try:
        model = torch.nn.Linear(512, 512)
        opt = torch.optim.AdamW(model.parameters())
        ckpt = ckptstore.Checkpointer(str(tmp_path / "s"), model=model, optimizer=opt, every=2, signals=(),
                                      prepare=True)
        ckpt.resume()
        model(torch.randn(2, 512)).sum().backward()
        opt.step()
        assert ckpt._prepared is None
        ckpt.step(1)
        need = state_nbytes([list(model.parameters()), list(opt.state.values())])
        assert ckpt._prepared.result() >= need and runtime().pool.held >= need
        ckpt.close()
        off = ckptstore.Checkpointer(str(tmp_path / "t"), model=model, optimizer=opt, every=2, signals=())
        off.resume()
        off.step(1)
        assert off._prepared is None  # the default: no warm-up
        off.close()
    finally:
        ckptstore.configure()


def test_the_exit_drain_settles_warm_ups_in_flight():
    """A warm-up runs native code with the GIL released on a daemon thread: the exit
    drain cancels it if it has not begun and waits for it if it has, so no thread comes
    back into a finalising interpreter (which aborts the process)."""
    from ckptstore import lifecycle

    futures = [ckptstore.prepare(nbytes=64 * MiB) for _ in range(3)]
    assert lifecycle.drain(60)
    assert all(f.done() for f in futures) and not lifecycle._preparing
