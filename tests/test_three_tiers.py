"""A chain of three tiers (docs/tiers.md, "Three tiers"; issue 36): every save commits
to the memory tier, every ``local_every``-th is promoted to the local disk tier and
every ``durable_every``-th to the durable store, both promotions reading the memory
copy; a load tries memory, local, durable in that order, falling back with a
TierFallbackWarning; a cold restart resumes from the local tier; a save over the
memory budget goes to the local tier."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch

import ckptstore
from ckptstore.supervisor import injob
from ckptstore.tiers import MemoryFullWarning, TierFallbackWarning

ROOT = Path(__file__).resolve().parents[1]

# Loading one saved rank's state with rank= in a single process (the two-rank test).
pytestmark = pytest.mark.filterwarnings(r"ignore:.*saved by \d+ ranks, loading on")


def state(step: int, rank: int = 0, n: int = 64 * 32) -> dict:
    g = torch.Generator().manual_seed(step * 100 + rank)
    return {"w": torch.randn(n, generator=g), "step": step}


def same(a: dict, b: dict) -> bool:
    return a["step"] == b["step"] and torch.equal(a["w"], b["w"])


def three(tmp_path: Path, mem: str = "mem", **kw) -> ckptstore.Store:
    return ckptstore.Store(tmp_path / "durable", memory=tmp_path / mem, local=tmp_path / "local", **kw)


def data_files(step_dir: Path) -> list[Path]:
    return [p for p in step_dir.rglob("data-*.bin") if p.is_file()]


def flip_a_byte(step_dir: Path) -> None:
    files = data_files(step_dir)
    assert files, f"no data file under {step_dir}"
    raw = bytearray(files[0].read_bytes())
    raw[len(raw) // 2] ^= 0x01
    files[0].write_bytes(bytes(raw))


@pytest.fixture(autouse=True)
def no_in_job(monkeypatch):
    """Outside ``ckptstore run --in-job``: memory= is an explicit path here."""
    for name in (injob.ENV_MEMORY_DIR, injob.ENV_MEMORY_BUDGET, injob.ENV_STORE, injob.ENV_PREFIX, injob.ENV_ROUND):
        monkeypatch.delenv(name, raising=False)


def test_saves_land_in_each_tier_at_its_own_cadence(tmp_path):
    """local_every=3, durable_every=4: the durable tier gets steps the local one never
    held (both promotions read the memory copy, not each other)."""
    store = three(tmp_path, durable_every=4, local_every=3, local_keep=ckptstore.Retention(last=10))
    assert (store.durable_every, store.local_every) == (4, 3)
    for step in range(1, 9):
        store.save(step, state(step)).result()
    ckptstore.wait()
    assert store.memory.steps() == [8]  # memory_keep: the last step
    assert store.local.steps() == [3, 6]
    assert store.committed_steps() == [4, 8]
    assert store.steps() == [3, 4, 6, 8]
    # a promotion keeps the save's attempt: the durable step 8 is the memory save's own
    assert store.memory.manifest(8).attempt == store.manifest(8).attempt
    for step in (3, 6):
        assert same(store.local.load(step), state(step))
    for step in (4, 8):
        assert same(ckptstore.Store(tmp_path / "durable").load(step), state(step))


def test_durability_does_not_wait_for_the_disk_copy_and_memory_keeps_a_step_until_both_are_done(
        tmp_path, monkeypatch):
    """The promotions to the local tier held up: the durable ones still commit (both
    read the memory copy), and the memory tier keeps every step the local ones still
    read, past memory_keep's last step, until they are done."""
    import threading

    from ckptstore import tiers

    real, release, durable_done = tiers.promote, threading.Event(), threading.Event()

    def promote(src, dst, manifest, rank, **kw):
        if "/local/" in dst.describe():
            assert release.wait(120), "the test never released the local promotions"
        result = real(src, dst, manifest, rank, **kw)
        if "/durable/" in dst.describe() and manifest.step == 3:
            durable_done.set()
        return result

    monkeypatch.setattr(tiers, "promote", promote)
    store = three(tmp_path, durable_every=1, local_every=1, local_keep=ckptstore.Retention(last=10))
    try:
        for step in (1, 2, 3):
            store.save(step, state(step)).result()
        assert durable_done.wait(120)
        assert store.committed_steps() == [1, 2, 3] and store.local.steps() == []
        assert store.memory.steps() == [1, 2, 3]  # the local promotions still read them
        assert store.memory.gc(dry_run=True).kept["step-000000000001"] == ["promotion in flight"]
    finally:
        release.set()
    ckptstore.wait()
    assert store.local.steps() == [1, 2, 3] and store.memory.steps() == [3]


def test_local_every_defaults_to_durable_every(tmp_path):
    store = three(tmp_path, durable_every=2, local_keep=ckptstore.Retention(last=10))
    assert store.local_every == 2
    for step in range(1, 5):
        store.save(step, state(step)).result()
    ckptstore.wait()
    assert store.local.steps() == [2, 4] and store.committed_steps() == [2, 4]


def test_load_order_is_memory_local_durable_and_each_bad_copy_falls_back(tmp_path):
    store = three(tmp_path, durable_every=1, local_every=1)
    store.save(5, state(5)).result()
    ckptstore.wait()
    assert [name for name, _ in store.tiers_of(5)] == ["memory", "local", "durable"]
    loaded, info = store.load(return_info=True)
    assert info.tier == "memory" and same(loaded, state(5))

    flip_a_byte(tmp_path / "mem" / "step-000000000005")
    with pytest.warns(TierFallbackWarning, match="memory copy of step 5 .*trying the local copy"):
        loaded, info = store.load(return_info=True)
    assert info.tier == "local" and same(loaded, state(5))  # bit-identical

    shutil.rmtree(tmp_path / "mem" / "step-000000000005")  # the memory copy gone
    with warnings.catch_warnings():
        warnings.simplefilter("error", TierFallbackWarning)  # not a fallback: memory does not list it
        loaded, info = store.load(return_info=True)
    assert info.tier == "local" and same(loaded, state(5))

    flip_a_byte(tmp_path / "local" / "step-000000000005")
    with pytest.warns(TierFallbackWarning, match="local copy of step 5 .*trying the durable copy"):
        loaded, info = store.load(return_info=True)
    assert info.tier == "durable" and same(loaded, state(5))

    shutil.rmtree(tmp_path / "local")  # local and memory gone: the durable tier alone
    shutil.rmtree(tmp_path / "mem")
    fresh = three(tmp_path, durable_every=1)
    loaded, info = fresh.resume()
    assert (info.step, info.tier) == (5, "durable") and same(loaded, state(5))


def test_a_cold_restart_resumes_from_the_local_tiers_newer_step_and_counts_on(tmp_path):
    store = three(tmp_path, durable_every=4, local_every=1)
    for step in range(1, 7):
        store.save(step, state(step)).result()
    ckptstore.wait()
    assert store.committed_steps() == [4] and store.local.steps() == [5, 6]
    # The node's memory is gone (a new memory directory): the local disk tier holds step 6.
    restarted = three(tmp_path, mem="mem-after-restart", durable_every=4, local_every=1)
    loaded, info = restarted.resume(claim=True)
    assert (info.step, info.tier) == (6, "local") and same(loaded, state(6))
    # Saves 5 and 6 counted toward the durable cadence: the 4th since step 4 is step 8.
    for step in (7, 8):
        restarted.save(step, state(step)).result()
    ckptstore.wait()
    assert restarted.committed_steps() == [4, 8]


def test_a_supervised_workers_progress_record_names_the_local_tier_after_a_cold_restart(tmp_path):
    """The supervisor's journal takes a resume's tier from the progress record
    (``resumed_tier``): in a child process, as a supervised worker, after a cold restart."""
    store = three(tmp_path, durable_every=10, local_every=1)
    ck = ckptstore.Checkpointer(store, state={"s": {"w": torch.arange(8.0)}}, every=1, rng=False, signals=())
    for step in range(ck.resume(), 2):
        ck.step(step)
    ckptstore.wait()
    assert store.local.steps() == [0, 1] and store.committed_steps() == []
    resume = ("import sys, torch, ckptstore\n"
              "store = ckptstore.Store(sys.argv[1], memory=sys.argv[2], local=sys.argv[3], durable_every=10,"
              " local_every=1)\n"
              "ck = ckptstore.Checkpointer(store, state={'s': {'w': torch.zeros(8)}}, every=1, rng=False,"
              " signals=())\n"
              "assert ck.resume() == 2\n")
    progress = tmp_path / "progress"
    progress.mkdir()
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", resume, str(tmp_path / "durable"),
                           str(tmp_path / "mem-after-restart"), str(tmp_path / "local")],  # the memory gone
                          capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), CKPTSTORE_PROGRESS_DIR=str(progress)))
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((progress / "rank-0.json").read_text())
    assert (record["resumed_step"], record["resumed_tier"]) == (1, "local")


def test_a_save_over_the_memory_budget_goes_to_the_local_tier(tmp_path):
    store = three(tmp_path, durable_every=2, memory_budget=1024, local_keep=ckptstore.Retention(last=10))
    with pytest.warns(MemoryFullWarning, match=r"goes to the local tier \(.*local\) instead"):
        store.save(1, state(1)).result()
    assert store.memory_full
    store.save(2, state(2)).result()
    ckptstore.wait()
    assert store.memory.steps() == []
    assert store.local.steps() == [1, 2]
    assert store.committed_steps() == [2]  # promoted from the local tier, at its cadence
    loaded, info = store.load(1, return_info=True)
    assert info.tier == "local" and same(loaded, state(1))


def test_closing_the_checkpointer_promotes_the_newest_step_to_local_and_durable(tmp_path):
    store = three(tmp_path, durable_every=1000, local_every=1000)
    ck = ckptstore.Checkpointer(store, state={"s": {"w": torch.zeros(8)}}, every=1, rng=False, signals=())
    ck.resume()
    for step in range(3):
        ck.step(step)
    ckptstore.wait()
    assert store.local.steps() == [] and store.committed_steps() == []
    ck.close()
    ckptstore.wait()
    assert store.local.steps() == [2] and store.committed_steps() == [2]
    assert store.promote_newest() is None  # nothing left uncovered


def test_auto_outside_in_job_mode_is_the_two_tier_store(tmp_path):
    """memory="auto" under torchrun: no memory tier; local= alone is today's two tiers
    (durable_every defaults to 1, local_every means nothing)."""
    store = ckptstore.Store(tmp_path / "durable", memory="auto", local=tmp_path / "local", local_every=5)
    assert store.memory is None and store.local is not None
    assert (store.durable_every, store.local_every) == (1, None)
    store.save(1, state(1)).result()
    ckptstore.wait()
    assert store.local.steps() == [1] and store.committed_steps() == [1]
    assert [name for name, _ in store.tiers_of(1)] == ["local", "durable"]
    assert store.promote_newest() is None  # a local disk tier outlives the job: nothing to do at close


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_a_bad_local_every_is_refused(tmp_path, bad):
    with pytest.raises(ValueError, match=r"local_every must be an int >= 1"):
        three(tmp_path, local_every=bad)


def test_bad_combinations_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"local_every=2 .*needs local="):
        ckptstore.Store(tmp_path / "durable", memory=tmp_path / "mem", local_every=2)
    with pytest.raises(ValueError, match="the memory tier .*the local tier .*overlap"):
        ckptstore.Store(tmp_path / "durable", memory=tmp_path / "local" / "mem", local=tmp_path / "local")
    with pytest.raises(ValueError, match="overlap"):
        ckptstore.Store(tmp_path / "durable", memory=tmp_path / "durable" / "mem", local=tmp_path / "local")


def test_on_several_nodes_memory_records_go_to_the_in_job_store_and_local_ones_to_local_shared(tmp_path,
                                                                                              monkeypatch):
    """As a worker of ``ckptstore run --in-job`` on one of two nodes sees it: the memory
    tier's commit records in the in-job store, the local tier's in ``local_shared``,
    every data file on the node."""
    from ckptstore.storage.c10d import C10dStorage

    server = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
    prefix = injob.attempt_prefix("run", 0)
    for name, value in ((injob.ENV_STORE, f"127.0.0.1:{server.port}"), (injob.ENV_PREFIX, prefix),
                        (injob.ENV_ROUND, "0"), (injob.ENV_MEMORY_DIR, str(tmp_path / "mem")),
                        ("WORLD_SIZE", "4"), ("LOCAL_WORLD_SIZE", "2")):
        monkeypatch.setenv(name, value)
    store = ckptstore.Store(tmp_path / "durable", memory="auto", local=tmp_path / "local",
                            local_shared=tmp_path / "shared", durable_every=2, local_every=1)
    for step in (1, 2):
        store.save(step, state(step)).result()
    ckptstore.wait()
    assert "step-000000000002/" in C10dStorage(injob.attempt_store(server, prefix), "mem/").list("")
    for node_dir in (tmp_path / "mem", tmp_path / "local"):  # data files on the node, no records
        assert data_files(node_dir / "step-000000000002")
        assert not list((node_dir / "step-000000000002").glob("manifest*"))
    assert list((tmp_path / "shared" / "step-000000000002").glob("manifest*"))
    assert not list((tmp_path / "shared").rglob("data-*.bin"))
    assert [name for name, _ in store.tiers_of(2)] == ["memory", "local", "durable"]
    shutil.rmtree(tmp_path / "mem" / "step-000000000002")  # this node's memory copy gone: the records remain
    with pytest.warns(TierFallbackWarning, match="memory copy of step 2"):
        loaded, info = store.load(return_info=True)
    assert info.tier == "local" and same(loaded, state(2))


# ---------------------------------------------------------------------------- two ranks (gloo)
def _two_ranks(rank: int, world: int, port: int, root: str) -> None:
    """One rank of a two-rank job on one node: the cadence, then a budget only rank 1's
    state passes (every rank skips the memory tier alike)."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        base = Path(root)
        store = ckptstore.Store(base / "durable", memory=base / "mem", local=base / "local", durable_every=3,
                                local_every=2, local_keep=ckptstore.Retention(last=10), commit_timeout=120)
        for step in range(1, 7):
            store.save(step, state(step, rank)).result()
        ckptstore.wait()
        # rank 1's state is 64 KiB, rank 0's 4 KiB: only rank 1 is over 32 KiB
        tight = ckptstore.Store(base / "durable2", memory=base / "mem2", local=base / "local2", durable_every=1,
                                memory_budget=32 << 10, commit_timeout=120)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tight.save(1, state(1, rank, n=1024 if rank == 0 else 16384)).result()
        ckptstore.wait()
        (base / f"rank-{rank}.json").write_text(json.dumps({
            "full": tight.memory_full, "warned": any(issubclass(w.category, MemoryFullWarning) for w in caught)}))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_promote_the_same_steps_and_skip_the_memory_tier_alike(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_two_ranks, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    store = ckptstore.Store(tmp_path / "durable", memory=tmp_path / "mem", local=tmp_path / "local",
                            durable_every=3, local_every=2)
    assert store.memory.steps() == [6]
    assert store.local.steps() == [2, 4, 6]
    assert store.committed_steps() == [3, 6]
    for step, tier in ((6, "memory"), (4, "local"), (3, "durable")):
        for rank in (0, 1):
            loaded, info = store.load(step, rank=rank, return_info=True)
            assert info.tier == tier and same(loaded, state(step, rank)), (step, rank, info.tier)
    for rank in (0, 1):  # rank 0 fits the budget, rank 1 does not: both skipped, both warned
        assert json.loads((tmp_path / f"rank-{rank}.json").read_text()) == {"full": True, "warned": True}
    tight = ckptstore.Store(tmp_path / "durable2", memory=tmp_path / "mem2", local=tmp_path / "local2")
    assert tight.memory.steps() == [] and tight.local.steps() == [1] and tight.committed_steps() == [1]
    assert same(tight.load(1, rank=0), state(1, 0, n=1024))
