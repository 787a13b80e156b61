"""A child made by fork() (multiprocessing's default start method on Linux before
Python 3.14, Lightning's ddp_fork, a DataLoader worker) after the parent used ckptstore:
none of the parent's threads exist there. The child must get pools and a runtime of its
own, never run the parent's queued work, and not wait for the parent's saves.
Each child reports through its exit code; the parent's join is a hang guard only.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import threading

import pytest
import torch

import ckptstore
from ckptstore import lifecycle, native
from ckptstore._threads import DaemonThreadPool
from ckptstore import names
from ckptstore.checkpoint.save import SaveOptions, start_save
from ckptstore.runtime import runtime
from ckptstore.storage import LocalStorage

HANG_GUARD_S = 120

pytestmark = pytest.mark.skipif("fork" not in mp.get_all_start_methods(), reason="no fork() here")


def _one_thread(target, *args) -> None:
    # As a DataLoader worker does: GNU OpenMP is not fork-safe, and torch's parallel ops
    # in a child of a parent that ran some hang (torch.equal here, after the parent ran
    # other tests).
    torch.set_num_threads(1)
    target(*args)


def _in_forked_child(target, *args) -> int:
    child = mp.get_context("fork").Process(target=_one_thread, args=(target, *args))
    child.start()
    child.join(HANG_GUARD_S)
    if child.is_alive():
        child.kill()
        child.join()
        pytest.fail("the forked child hung")
    return child.exitcode


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 1024, generator=g), "b": torch.randn(7, generator=g), "step": seed}


def _saves_and_loads(root: str) -> None:
    state = _state(2)
    ckptstore.save(state, os.path.join(root, "child.ckpt")).result(timeout=HANG_GUARD_S)
    out = ckptstore.load(os.path.join(root, "child.ckpt"))
    store = ckptstore.Store(os.path.join(root, "child-store"))
    store.save(1, state).result(timeout=HANG_GUARD_S)
    again = store.load(1)
    ok = all(torch.equal(out[k], state[k]) and torch.equal(again[k], state[k]) for k in ("w", "b"))
    os._exit(0 if ok else 3)


def test_a_forked_child_saves_and_loads_with_pools_of_its_own(tmp_path):
    parent_state = _state(1)
    ckptstore.save(parent_state, tmp_path / "parent.ckpt").result(timeout=HANG_GUARD_S)  # threads and pools running
    ckptstore.load(tmp_path / "parent.ckpt")
    assert _in_forked_child(_saves_and_loads, str(tmp_path)) == 0
    # The parent's runtime is untouched by the child's.
    ckptstore.save(parent_state, tmp_path / "parent2.ckpt").result(timeout=HANG_GUARD_S)
    assert torch.equal(ckptstore.load(tmp_path / "parent2.ckpt")["w"], parent_state["w"])


def _runs_its_own_work_only(pool: DaemonThreadPool, marker: str) -> None:
    ok = pool.submit(lambda: 42).result(timeout=HANG_GUARD_S) == 42
    # One thread, first in first out: had the parent's queued job been kept, it would have run first.
    os._exit(0 if ok and not os.path.exists(marker) else 3)


def test_a_forked_child_never_runs_the_work_its_parent_queued(tmp_path):
    pool = DaemonThreadPool(1, "test-fork")
    gate, busy = threading.Event(), threading.Event()
    marker = str(tmp_path / "written-by")

    def hold():
        busy.set()
        gate.wait()

    def write_marker():
        with open(marker, "w") as f:
            f.write(str(os.getpid()))

    pool.submit(hold)
    queued = pool.submit(write_marker)
    assert busy.wait(HANG_GUARD_S)
    try:
        assert _in_forked_child(_runs_its_own_work_only, pool, marker) == 0
    finally:
        gate.set()
    queued.result(timeout=HANG_GUARD_S)  # the parent's own work still runs, in the parent
    with open(marker) as f:
        assert f.read() == str(os.getpid())
    pool.shutdown()


class _GatedStorage(LocalStorage):
    """Holds every put (votes, the manifest) until the gate opens: a save in flight."""

    def __init__(self, root: str, gate: threading.Event, reached: threading.Event):
        super().__init__(root)
        self._gate, self._reached = gate, reached

    def put(self, key, data, **kwargs):
        self._reached.set()
        self._gate.wait()
        return super().put(key, data, **kwargs)


def _waits_for_nothing_of_the_parents() -> None:
    lifecycle.wait(timeout=HANG_GUARD_S)  # raised TimeoutError (after the guard) when it waited on the parent's
    os._exit(0 if lifecycle._drain(0.0) else 3)  # and the exit drain finds nothing of the parent's


def test_a_forked_child_neither_waits_for_nor_drains_the_parents_saves(tmp_path):
    gate, reached = threading.Event(), threading.Event()
    where = _GatedStorage(str(tmp_path / "ckpt"), gate, reached)
    future = lifecycle.track(start_save(_state(3), where, rt=runtime(), attempt=names.new_attempt_id(), step=None,
                                        rank=0, world_size=1, metrics=None, options=SaveOptions()))
    try:
        assert reached.wait(HANG_GUARD_S) and not future.done()
        assert _in_forked_child(_waits_for_nothing_of_the_parents) == 0
    finally:
        gate.set()
    future.result(timeout=HANG_GUARD_S)
    assert torch.equal(ckptstore.load(tmp_path / "ckpt")["w"], _state(3)["w"])


def _reports_nothing_of_the_parents() -> None:
    for name in ("last_exc", "last_value"):  # (pytest records a failed test's exception there)
        sys.__dict__.pop(name, None)
    os._exit(0 if lifecycle.report_at_exit() is None else 3)


def test_a_forked_child_does_not_report_its_parents_failed_saves(tmp_path):
    """A save of the parent failed and nobody looked at it: the parent's exit reports it;
    a child's exit (an os.fork() child that ends through sys.exit runs the parent's
    atexit handlers) neither reports it nor exits non-zero for it."""
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"not a directory")
    future = lifecycle.track(start_save(_state(4), LocalStorage(blocker / "ckpt"), rt=runtime(),
                                        attempt=names.new_attempt_id(), step=None, rank=0, world_size=1, metrics=None,
                                        options=SaveOptions()))
    done = threading.Event()
    future.add_done_callback(lambda _f: done.set())  # does not observe it
    assert done.wait(HANG_GUARD_S) and not future.observed
    try:
        assert _in_forked_child(_reports_nothing_of_the_parents) == 0
    finally:
        future.exception()  # observed: the parent (this test process) does not report it either


def _staging_memory_is_absent(ptr: int, pool) -> None:
    with open("/proc/self/maps") as f:
        spans = [tuple(int(x, 16) for x in line.split()[0].split("-")) for line in f]
    absent = not any(lo <= ptr < hi for lo, hi in spans)
    del pool  # the parent's slabs are not this process's to free (their range may be reused)
    os._exit(0 if absent else 3)


@pytest.mark.skipif(not native.NATIVE or not os.path.exists("/proc/self/maps"), reason="native pool, Linux")
def test_a_forked_child_does_not_share_the_staging_slabs():
    """MADV_DONTFORK, as the CUDA driver does for page-locked memory: otherwise every
    page of a slab is shared copy-on-write with a living child, and the parent's next
    save into it page-faults like a first save (measured: 0.77 s against 0.07 s for
    512 MiB) while the child keeps the old pages."""
    pool = native.HostPool(8 << 20, slab_bytes=4 << 20)
    block = pool.try_alloc(1 << 20)
    memoryview(block)[:] = b"\x01" * (1 << 20)
    assert _in_forked_child(_staging_memory_is_absent, block.ptr, pool) == 0
    memoryview(block)[:4] = b"\x02\x02\x02\x02"  # the parent's still its own
    assert bytes(memoryview(block)[:5]) == b"\x02\x02\x02\x02\x01"
    pool.free(block)


def _saves_twice(path: str) -> None:
    state = _state(4)
    for _ in range(2):  # the second reads the first one's references, under the location's lock
        ckptstore.save(state, path).result(timeout=HANG_GUARD_S)
    os._exit(0 if torch.equal(ckptstore.load(path)["w"], state["w"]) else 3)


def test_a_lock_a_parents_thread_held_at_the_fork_does_not_hold_the_child(tmp_path):
    """A drop-in location's references lock (checkpoint/held.py), held by a parent's
    thread while it read references or retired files, stayed held in the child for good."""
    from ckptstore.checkpoint.held import references_lock

    path = str(tmp_path / "latest.pt")
    ckptstore.save(_state(4), path).result(timeout=HANG_GUARD_S)
    held, done = threading.Event(), threading.Event()

    def hold_it():
        with references_lock(LocalStorage(path)):
            held.set()
            done.wait()

    t = threading.Thread(target=hold_it)
    t.start()
    try:
        assert held.wait(HANG_GUARD_S)
        assert _in_forked_child(_saves_twice, path) == 0
    finally:
        done.set()
        t.join()


_QUARANTINE_IN_CHILD = """
import json, os, sys
import torch
from ckptstore import native
MiB = 1 << 20

def lend_and_free():
    pool = native.HostPool(4 * MiB, slab_bytes=4 * MiB)
    pool.free(pool.try_alloc(MiB))
    return pool.stats()["quarantined"]

native._C.quarantine_host_range(1 << 12, 1 << 47)  # every address a slab can have
torch.set_num_threads(1)
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.write(w, json.dumps(lend_and_free()).encode())
    os._exit(0)
os.close(w)
child = json.loads(os.read(r, 100))
os.waitpid(pid, 0)
print(json.dumps({"child": child, "parent": lend_and_free()}))
"""


@pytest.mark.skipif(not native.NATIVE, reason="needs the native extension")
def test_a_forked_child_starts_with_no_quarantined_memory():
    """The parent's quarantined ranges (where a timed-out device copy may still land)
    are not the child's: its slabs there are its own memory, lent and reused as usual."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _QUARANTINE_IN_CHILD], cwd="/", capture_output=True, text=True,
                         timeout=HANG_GUARD_S)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"child": 0, "parent": 1 << 20}
