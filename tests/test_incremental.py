"""Incremental saves (issue 16, docs/incremental.md): within a Store, a chunk unchanged
since the last committed save is recorded as a reference (format version 3,
``Blob.step``) to the blob that holds it; loads, verify and gc follow references."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import ckptstore
from ckptstore import format as fmt
from ckptstore import names
from ckptstore.checkpoint import gc as gc_mod
from ckptstore.checkpoint.references import MIN_REFERENCE_BYTES
from ckptstore.checkpoint.manifests import latest_manifest
from ckptstore.checkpoint.retention import Retention
from ckptstore.cli import main
from ckptstore.errors import BaseRetiredError, CommitError, FormatError
from ckptstore.storage import LocalStorage


def model_state(step: int, frozen_layers: int = 9) -> dict:
    """A model of ten 1 MiB layers: ``frozen_layers`` never change (fine-tuning's frozen
    base), the others change every step."""
    frozen = {f"base.{i}": torch.randn(256, 1024, generator=torch.Generator().manual_seed(i))
              for i in range(frozen_layers)}
    trained = {f"head.{i}": torch.full((256, 1024), float(step) * 100 + i) for i in range(10 - frozen_layers)}
    return {"model": {**frozen, **trained}, "step": step}


def written(store: ckptstore.Store, step: int) -> int:
    """Bytes of the data files the save of ``step`` wrote."""
    return sum(p.stat().st_size for p in Path(store.location(step).describe()).rglob("data-*.bin"))


def same(a: dict, b: dict) -> bool:
    return a["step"] == b["step"] and a["model"].keys() == b["model"].keys() and all(
        torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def test_a_frozen_90_percent_is_written_once_and_every_step_loads_bit_identical(tmp_path):
    store = ckptstore.Store(tmp_path / "s", compression="none")
    for step in range(1, 5):
        store.save(step, model_state(step)).result()
    full = written(store, 1)
    for step in (2, 3, 4):
        assert written(store, step) <= 0.15 * full, (step, written(store, step), full)
        m = store.manifest(step)
        assert m.format_version == 3 and {b.step for _, _, b in m.blobs() if b.step is not None} == {1}
    for step in range(1, 5):
        assert same(store.load(step), model_state(step))
    out = CliRunner().invoke(main, ["ls", str(tmp_path / "s"), "--json"])
    recs = {r["step"]: r for r in json.loads(out.output)}
    assert recs[1]["referenced_bytes"] == 0 and recs[1]["new_bytes"] == recs[1]["bytes"]
    assert recs[4]["referenced_bytes"] >= 9 * (1 << 20) and recs[4]["new_bytes"] < 2 * (1 << 20)


def test_a_fully_trained_model_references_nothing(tmp_path):
    store = ckptstore.Store(tmp_path / "s")
    for step in (1, 2):
        store.save(step, model_state(step, frozen_layers=0)).result()
    assert not [b for _, _, b in store.manifest(2).blobs() if b.step is not None]


def test_incremental_off_writes_everything(tmp_path):
    store = ckptstore.Store(tmp_path / "s", incremental=False, compression="none")
    for step in (1, 2):
        store.save(step, model_state(step)).result()
    assert written(store, 2) >= 0.95 * written(store, 1)


def test_gc_of_the_step_that_wrote_the_shared_chunks_keeps_them_for_the_newer_ones(tmp_path):
    store = ckptstore.Store(tmp_path / "s", keep=Retention(last=2), grace=0)
    for step in range(1, 6):
        store.save(step, model_state(step)).result()
    assert store.steps() == [4, 5]  # retention ran after each commit
    step1 = tmp_path / "s" / "step-000000000001"
    assert list(step1.rglob("data-*.bin")) and not list(step1.glob("manifest-*"))  # its data stays
    plan = store.gc(dry_run=True)
    assert plan.bytes == 0  # nothing to free: step 1's file is still read by steps 4 and 5
    store.gc()
    for step in (4, 5):
        assert same(store.load(step), model_state(step))
    # a save that changes everything references nothing: step 1's data is then garbage,
    # and goes with the manifest of its last reader (step 5, dropped after step 7)
    store.save(6, model_state(6, frozen_layers=0)).result()
    assert list(step1.rglob("data-*.bin"))  # step 5, kept, reads it
    store.save(7, model_state(7, frozen_layers=0)).result()
    assert store.steps() == [6, 7]
    assert not step1.exists() and store.gc(dry_run=True).bytes == 0
    assert same(store.load(7), model_state(7, frozen_layers=0))


def test_a_byte_flip_in_a_shared_chunk_is_found_for_every_checkpoint_that_uses_it(tmp_path):
    store = ckptstore.Store(tmp_path / "s", compression="none")
    for step in (1, 2, 3):
        store.save(step, model_state(step)).result()
    data = next((tmp_path / "s" / "step-000000000001").rglob("data-*.bin"))
    with open(data, "r+b") as f:  # inside the first frozen layer (the skeleton comes last)
        f.seek(4096)
        b = f.read(1)
        f.seek(4096)
        f.write(bytes([b[0] ^ 1]))
    out = CliRunner().invoke(main, ["verify", str(tmp_path / "s"), "--json"])
    assert out.exit_code == 1, out.output
    report = {c["step"]: c for c in json.loads(out.output)["checkpoints"]}
    assert [s for s, c in sorted(report.items()) if not c["ok"]] == [1, 2, 3]
    assert "../step-000000000001/" in report[3]["problems"][0]["file"]
    with pytest.raises(ckptstore.IntegrityError):
        store.load(3)


def test_a_resumed_run_references_the_step_it_resumed_from(tmp_path):
    store = ckptstore.Store(tmp_path / "s", compression="none")
    store.save(1, model_state(1)).result()
    fresh = ckptstore.Store(tmp_path / "s", compression="none")  # a restarted job
    state, info = fresh.resume()
    assert info.step == 1
    fresh.save(2, model_state(2)).result()
    assert written(fresh, 2) <= 0.15 * written(fresh, 1)
    assert same(fresh.load(2), model_state(2))


def test_resaving_a_step_never_references_that_step(tmp_path):
    store = ckptstore.Store(tmp_path / "s", compression="none")
    store.save(1, model_state(1)).result()
    store.save(1, model_state(1)).result()  # a new generation of step 1: written again
    m = store.manifest(1)
    assert m.generation == 2 and not [b for _, _, b in m.blobs() if b.step is not None]
    assert same(store.load(1), model_state(1))
    # the older generation's manifest is retired at once; its files are gc's to judge
    step1 = tmp_path / "s" / "step-000000000001" / "attempts"
    assert len(list(step1.iterdir())) == 2
    store.gc(grace=0)
    assert [p.name for p in step1.iterdir()] == [m.attempt] and same(store.load(1), model_state(1))


@pytest.mark.parametrize("how", ["store", "drop-in"])
@pytest.mark.parametrize("incremental", [False, True])
def test_resaving_a_step_that_later_steps_reference_keeps_its_files_for_them(tmp_path, incremental, how):
    """An incremental run saved steps 1-4 (2-4 reference step 1's frozen layers); a later
    run re-saves step 1 (a rollback, a schedule restarted), through a Store or by its
    path with ckptstore.save. Its commit retired the old generation with its files when
    the re-save itself made no references (incremental=False) or was a drop-in save:
    steps 2-4 stayed listed and could no longer load. A drop-in save over the step with
    incremental=True failed (it referenced the step's blobs as a store step does)."""
    root = tmp_path / "s"
    store = ckptstore.Store(root, compression="none")
    for step in range(1, 5):
        store.save(step, model_state(step)).result()
    assert [b.step for _, _, b in store.manifest(3).blobs() if b.step is not None]  # it does reference step 1
    if how == "store":
        ckptstore.Store(root, compression="none", incremental=incremental).save(1, model_state(1)).result()
    else:
        ckptstore.save(model_state(1), store.location(1).describe(), compression="none",
                       incremental=incremental).result()
    assert ckptstore.Store(root).steps() == [1, 2, 3, 4]
    for step in range(1, 5):
        assert same(ckptstore.Store(root).load(step), model_state(step))
    assert verified(root)
    ckptstore.Store(root).gc(grace=0)  # gc knows every reference: the old generation's files stay for 2-4
    for step in range(1, 5):
        assert same(ckptstore.Store(root).load(step), model_state(step))


def test_a_store_resumes_from_a_step_saved_over_by_path_and_saves_on(tmp_path):
    """A drop-in save over the newest step's directory leaves a manifest with no step
    there: resume reported step None, and the next save took that manifest's drop-in
    references as a step's and failed."""
    root = tmp_path / "s"
    store = ckptstore.Store(root, compression="none")
    store.save(1, model_state(1)).result()
    ckptstore.save(model_state(2), store.location(1).describe(), compression="none").result()
    again = ckptstore.Store(root, compression="none")
    state, info = again.resume()
    assert info.step == 1 and same(state, model_state(2))
    again.save(2, model_state(3)).result()
    assert same(ckptstore.Store(root).load(2), model_state(3)) and verified(root)


def test_consolidate_follows_references(tmp_path):
    store = ckptstore.Store(tmp_path / "s")
    for step in (1, 2):
        store.save(step, model_state(step)).result()
    out = CliRunner().invoke(main, ["consolidate", str(store.location(2).describe()), str(tmp_path / "whole")])
    assert out.exit_code == 0, out.output
    shutil.rmtree(tmp_path / "s" / "step-000000000001")
    assert same(ckptstore.load(str(tmp_path / "whole")), model_state(2))


# ---------------------------------------------------------------------------- the format
def manifest_json(tmp_path) -> dict:
    store = ckptstore.Store(tmp_path / "s")
    for step in (1, 2):
        store.save(step, model_state(step)).result()
    return store.manifest(2).to_json()


def test_references_need_format_version_3(tmp_path):
    d = manifest_json(tmp_path)
    d["format_version"] = 2
    with pytest.raises(FormatError, match="version 2 cannot say"):
        fmt.Manifest.from_json(d)


def test_a_reference_to_its_own_step_is_refused(tmp_path):
    d = manifest_json(tmp_path)
    for entry in d["ranks"][0]["tensors"].values():
        for c in entry["chunks"]:
            if "step" in c:
                c["step"] = 2
    with pytest.raises(FormatError, match="its own step"):
        fmt.Manifest.from_json(d)


def test_a_reference_outside_a_store_step_is_refused(tmp_path):
    d = manifest_json(tmp_path)
    d["step"] = None
    with pytest.raises(FormatError, match="not a step of a store"):
        fmt.Manifest.from_json(d)


@pytest.mark.parametrize("bad", [-1, "1", 1.5, None, 10**13])
def test_a_reference_with_a_bad_step_is_refused(tmp_path, bad):
    d = manifest_json(tmp_path)
    chunk = next(c for e in d["ranks"][0]["tensors"].values() for c in e["chunks"] if "step" in c)
    chunk["step"] = bad
    with pytest.raises(FormatError):
        fmt.Manifest.from_json(d)


def test_small_chunks_are_written_not_referenced(tmp_path):
    store = ckptstore.Store(tmp_path / "s")
    small = {"t": torch.ones(MIN_REFERENCE_BYTES // 4 - 1)}
    for step in (1, 2):
        store.save(step, dict(small)).result()
    assert not [b for _, _, b in store.manifest(2).blobs() if b.step is not None]
    assert os.path.exists(store.location(2).describe())


# ---------------------------------------------------------------------------- crashes
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_saves_and_gc_killed_at_random_never_leave_a_checkpoint_without_its_chunks(tmp_path, seed):
    """A saving process and a gc process on one store, SIGKILLed together at a random
    point: every checkpoint still listed loads bit-identical and verifies, before and
    after one more gc, and a restarted run goes on referencing."""
    import random
    import signal
    import subprocess
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "procs"))
    from incremental_child import state

    root = tmp_path / "s"
    child = Path(__file__).parent / "procs" / "incremental_child.py"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1]),
                                                       os.environ.get("PYTHONPATH", "")]))
    saver = subprocess.Popen([sys.executable, str(child), str(root), "save"], stdout=subprocess.PIPE, text=True,
                             env=env)
    collector = subprocess.Popen([sys.executable, str(child), str(root), "gc"], stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, env=env)
    try:
        last = random.Random(seed).randint(3, 12)
        for line in saver.stdout:
            if line.strip() == f"saved {last}":
                break
        os.kill(saver.pid, signal.SIGKILL)
        os.kill(collector.pid, signal.SIGKILL)
    finally:
        for p in (saver, collector):
            p.kill()
            p.wait()
    store = ckptstore.Store(root, keep=Retention(last=2), compression="none")
    steps = store.steps()
    assert steps and steps[-1] >= last - 1
    for _ in range(2):  # as the kill left it, then after one more gc
        for step in store.steps():
            got = store.load(step)
            assert got["step"] == step and all(torch.equal(got["model"][k], v)
                                                for k, v in state(step)["model"].items()), step
        out = CliRunner().invoke(main, ["verify", str(root)])
        assert out.exit_code == 0, out.output
        store.gc(grace=0)
    _, info = store.resume()
    store.save(info.step + 1, state(info.step + 1)).result()
    assert [b.step for _, _, b in store.manifest(info.step + 1).blobs() if b.step is not None]


def test_a_rollback_keeps_the_step_the_next_save_references(tmp_path):
    store = ckptstore.Store(tmp_path / "s", keep=Retention(last=2), compression="none")
    for step in (10, 20, 30):
        store.save(step, model_state(step)).result()
    store.save(15, model_state(15)).result()  # back to an earlier step (a loss spike, say)
    assert 15 in store.steps()  # retention keeps what the next save references
    store.save(16, model_state(16)).result()
    store.gc(grace=0)
    for step in store.steps():
        assert same(store.load(step), model_state(step))
    assert 16 in store.steps() and written(store, 16) <= 0.15 * written(store, 10)


# ---------------------------------------------------------------------------- a gc elsewhere
def hooked(store: ckptstore.Store, op: str, when, action) -> list:
    """Make ``store`` run ``action()`` once, the first time its storage (any view of it)
    calls ``op(key)`` with ``when(view, key)`` true, before the call itself: an exact
    interleaving of a save with another process's gc. Returns the keys it fired on."""
    fired: list = []
    original = getattr(LocalStorage, op)

    def call(self, key, *args, **kwargs):
        if not fired and when(self, key):
            fired.append(self.describe(key))
            action()
        return original(self, key, *args, **kwargs)

    store.storage = type("Hooked", (LocalStorage,), {op: call})(store.url)
    return fired


def verified(root) -> bool:
    out = CliRunner().invoke(main, ["verify", str(root)])
    return out.exit_code == 0 or print(out.output)


def rolled_back_to_step_1(root) -> ckptstore.Store:
    """Steps 1, 2, 3 committed, then a run resumed from step 1 (a loss spike after it,
    which it leaves unmarked): its next save references step 1, not the newest step."""
    store = ckptstore.Store(root, compression="none")
    for step in (1, 2, 3):  # steps 2 and 3 change every layer: they reference nothing
        store.save(step, model_state(step, frozen_layers=9 if step == 1 else 0)).result()
    store = ckptstore.Store(root, compression="none")
    _, info = store.resume(validate=lambda state, m: m.step == 1, mark_skipped=False)
    assert info.step == 1
    return store


def gc_elsewhere(root, **kw):
    """Another process's gc keeping only the newest step (the CLI's rules)."""
    return lambda: gc_mod.collect(LocalStorage(root), Retention(last=1), **kw)


@pytest.mark.parametrize("immediate", [False, True], ids=["released", "deleted-at-once"])
def test_a_gc_elsewhere_dropping_the_base_just_before_the_manifest_lands(tmp_path, immediate):
    """The narrowest window: the commit has checked its base and its files, and another
    process's gc drops that base before the manifest is written. gc releases the base's
    files instead of deleting them, so the new checkpoint stays whole, through later
    gc runs too. A gc that deletes them at once (as a store's own writer may, or one
    with no grace) finds the commit in flight (its commit mark, claims.py) once the
    base's manifest is gone, and leaves the files for a later run."""
    root = tmp_path / "s"
    store = rolled_back_to_step_1(root)
    fired = hooked(store, "put", lambda view, key: names.parse_manifest_name(key) is not None,
                   gc_elsewhere(root, immediate=immediate))
    store.save(2, model_state(2)).result()  # the run goes on from step 1: step 2 again
    assert len(fired) == 1 and "step-000000000002" in fired[0]
    m = store.manifest(2)
    assert m.generation == 2 and {b.step for _, _, b in m.blobs() if b.step is not None} == {1}
    assert not (root / "step-000000000001" / fmt.manifest_name(1)).exists()  # the base is gone
    if immediate:
        assert same(store.load(2), model_state(2)) and verified(root)
        assert list((root / "step-000000000001").rglob(names.RELEASED_LEAF))  # its files stay, marked released
        return
    assert same(store.load(2), model_state(2))
    assert list((root / "step-000000000001").rglob(names.RELEASED_LEAF))
    listing = {r["name"]: r for r in json.loads(CliRunner().invoke(main, ["ls", "--all", "--json", str(root)]).output)}
    [kept] = listing["step-000000000001"]["attempts"]
    assert kept["read_by"] == ["step-000000000002"] and kept["released"] is True
    assert "read by step-000000000002" in CliRunner().invoke(main, ["ls", "--all", str(root)]).output
    # Later gc runs, after the grace too, keep step 1's files while step 2 reads them.
    storage = LocalStorage(root)
    gc_mod.execute(storage, gc_mod.plan(storage, Retention(last=2), now=time.time() + gc_mod.DEFAULT_GRACE + 60))
    assert store.steps() == [2, 3]
    assert same(store.load(2), model_state(2)) and verified(root)
    # Once no checkpoint reads them, they go (one grace after the manifest that read them).
    gc_mod.collect(storage, Retention(last=1))
    assert list((root / "step-000000000001").rglob("data-*.bin"))
    gc_mod.execute(storage, gc_mod.plan(storage, Retention(last=1), now=time.time() + gc_mod.DEFAULT_GRACE + 60))
    assert not (root / "step-000000000001").exists() and store.steps() == [3]


def test_a_gc_elsewhere_dropping_the_base_before_the_commit_checks_it_refuses_the_commit(tmp_path):
    """gc drops the base while the save writes or checks its files: the commit finds the
    base gone and refuses, naming why; nothing committed is lost, and the next save
    writes everything."""
    root = tmp_path / "s"
    store = rolled_back_to_step_1(root)
    fired = hooked(store, "stat", lambda view, key: key.endswith(".bin"), gc_elsewhere(root))
    with pytest.raises(CommitError, match="references come from was deleted"):
        store.save(2, model_state(2)).result()
    assert fired and "step-000000000001" in fired[0]
    assert store.steps() == [3] and same(store.load(3), model_state(3, frozen_layers=0))
    store.save(2, model_state(2)).result()
    m = store.manifest(2)
    assert not [b for _, _, b in m.blobs() if b.step is not None] and same(store.load(2), model_state(2))


def test_a_commit_refused_for_its_dropped_base_does_not_stop_the_training_loop(tmp_path):
    """The README's loop never looks at a save's future: the next save raised this
    documented refusal as "an earlier save failed" and the job died. It warns instead;
    the refused save's own future still raises it."""
    root = tmp_path / "s"
    store = rolled_back_to_step_1(root)
    fired = hooked(store, "stat", lambda view, key: key.endswith(".bin"), gc_elsewhere(root))
    refused = store.save(2, model_state(2))
    assert refused.wait_settled(60) and fired
    with pytest.warns(RuntimeWarning, match=r"step 2\) did not commit: .*references come from was deleted"):
        store.save(4, model_state(4)).result()
    assert store.steps() == [3, 4] and same(store.load(4), model_state(4))
    with pytest.raises(BaseRetiredError):
        refused.result()


def test_every_rank_of_a_commit_refused_for_its_dropped_base_gets_that_error(tmp_path):
    """Rank 0 finds the base gone; the other ranks learn it from the abort: each raises
    BaseRetiredError, so a later save of each warns and they all go on together (a plain
    CommitError there made the next save raise on those ranks only)."""
    from ckptstore.checkpoint.follower import _conclude
    from ckptstore.checkpoint.validation import check_base
    from ckptstore.checkpoint.votes import abort

    storage = LocalStorage(str(tmp_path / "s")).child(fmt.step_dir_name(2))
    attempt = names.new_attempt_id()
    with pytest.raises(BaseRetiredError) as refused:
        check_base(storage, (1, 1))
    abort(storage, attempt, str(refused.value))
    with pytest.raises(BaseRetiredError, match="references come from was deleted"):
        _conclude(storage, attempt, None, set(), "here")
    other = names.new_attempt_id()
    abort(storage, other, "rank 1 voted failure")
    with pytest.raises(CommitError) as plain:
        _conclude(storage, other, None, set(), "here")
    assert not isinstance(plain.value, BaseRetiredError)


def test_a_base_dropped_before_the_save_starts_makes_it_write_everything(tmp_path):
    root = tmp_path / "s"
    store = rolled_back_to_step_1(root)
    gc_elsewhere(root)()
    store.save(2, model_state(2)).result()  # the writer's first chunk finds no base: no references
    assert not [b for _, _, b in store.manifest(2).blobs() if b.step is not None]
    assert same(store.load(2), model_state(2))


def test_retention_keeps_the_base_of_a_save_still_in_flight(tmp_path):
    """Saves overlap: step 3 is staged (its references come from step 1) while step 2
    commits, and step 2's retention (the last 1) would drop step 1 at once. It keeps step
    1 until step 3 has settled."""
    import threading

    root = tmp_path / "s"
    store = ckptstore.Store(root, compression="none", keep=Retention(last=1))
    store.save(1, model_state(1)).result()
    go = threading.Event()
    hooked(store, "put", lambda view, key: names.parse_manifest_name(key) is not None and
           "step-000000000002" in view.describe(key), lambda: go.wait(60))
    second = store.save(2, model_state(2))  # its commit waits for ``go``
    third = store.save(3, model_state(3))  # staged now: its references still come from step 1
    go.set()
    second.result()
    third.result()
    assert {b.step for _, _, b in store.manifest(3).blobs() if b.step is not None} == {1}
    assert store.steps() == [3] and same(store.load(3), model_state(3))
    store.save(4, model_state(4)).result()
    assert store.steps() == [4] and same(store.load(4), model_state(4)) and verified(root)


def test_a_save_started_while_retention_runs_keeps_its_base(tmp_path):
    """Step 3's save starts while the retention after step 2's commit runs (the last 1:
    it drops step 1 at once). Step 3 then references step 2, or step 1 stays: its base is
    never deleted under it."""
    root = tmp_path / "s"
    store = ckptstore.Store(root, compression="none", keep=Retention(last=1))
    store.save(1, model_state(1)).result()
    third = []
    fired = hooked(store, "delete", lambda view, key: names.parse_manifest_name(key.rsplit("/", 1)[-1]) is not None,
                   lambda: third.append(store.save(3, model_state(3))))  # in the middle of the retention
    store.save(2, model_state(2)).result()
    assert fired and "step-000000000001" in fired[0]
    third[0].result()
    assert store.steps() == [3] and same(store.load(3), model_state(3)) and verified(root)
    assert {b.step for _, _, b in store.manifest(3).blobs() if b.step is not None} == {1}


def test_dropping_the_last_reader_of_old_released_files_releases_them_again(tmp_path):
    """Step 1's files, released long ago, stay while step 2 reads them. The run that drops
    step 2 must not delete them too: a save whose base is step 2 may be committing."""
    root = tmp_path / "s"
    store = ckptstore.Store(root, compression="none")
    for step in (1, 2, 3):  # step 2 references step 1; step 3 changes everything
        store.save(step, model_state(step, frozen_layers=0 if step == 3 else 9)).result()
    storage = LocalStorage(root)
    gc_mod.collect(storage, Retention(last=2))  # drops step 1: its files stay (step 2 reads them)
    step1 = root / "step-000000000001"
    assert list(step1.rglob(names.RELEASED_LEAF)) and list(step1.rglob("data-*.bin"))
    grace = gc_mod.DEFAULT_GRACE
    later = time.time() + grace + 60  # step 1's release has aged
    plan = gc_mod.plan(storage, Retention(last=1), now=later)
    assert ("checkpoint", "step-000000000002") in [(d.kind, d.location) for d in plan.deletions]
    assert not [d for d in plan.deletions if d.location == "step-000000000001"]  # its files are released again
    gc_mod.execute(storage, plan)
    assert list(step1.rglob("data-*.bin")) and store.steps() == [3]
    # A grace after that, both go.
    gc_mod.execute(storage, gc_mod.plan(storage, Retention(last=1), now=time.time() + grace + 60))
    assert sorted(p.name for p in root.iterdir()) == ["step-000000000003"]


def test_an_attempt_released_again_since_the_plan_is_not_deleted(tmp_path):
    """Another gc released step 1's files after this gc planned their deletion (a save
    may reference them): the deletion, checked again just before it runs, is skipped."""
    root = tmp_path / "s"
    store = ckptstore.Store(root, compression="none")
    for step in (1, 2):
        store.save(step, model_state(step, frozen_layers=0)).result()
    storage = LocalStorage(root)
    gc_mod.collect(storage, Retention(last=1))
    later = time.time() + gc_mod.DEFAULT_GRACE + 60
    plan = gc_mod.plan(storage, Retention(last=1), now=later)
    assert [(d.kind, d.location) for d in plan.deletions] == [("attempt", "step-000000000001")]
    [mark] = (root / "step-000000000001").rglob(names.RELEASED_LEAF)
    os.utime(mark, (later - 10, later - 10))  # rewritten, on the plan's clock, 10 s before it runs
    gc_mod.execute(storage, plan)
    assert plan.deletions[0].skipped and "written to since the plan" in plan.deletions[0].skipped
    assert list((root / "step-000000000001").rglob("data-*.bin"))


def test_while_a_manifest_cannot_be_read_gc_plans_no_data_deletion_and_executes_its_plan(tmp_path):
    """A manifest that is not JSON may reference any file: gc then deletes manifests
    only, and its plan (what --dry-run prints) is exactly what it executes."""
    root = tmp_path / "s"
    store = ckptstore.Store(root, compression="none")
    for step in (1, 2, 3, 4):
        store.save(step, model_state(step)).result()
    store.save(4, model_state(4)).result()  # a superseded generation, once retiring is undone:
    (root / "step-000000000004" / fmt.manifest_name(1)).write_bytes(
        (root / "step-000000000004" / fmt.manifest_name(2)).read_bytes().replace(b'"generation":2', b'"generation":1'))
    (root / "step-000000000002" / fmt.manifest_name(1)).write_bytes(b"not json")
    before = sorted(str(p.relative_to(root)) for p in root.rglob("data-*.bin"))
    storage = LocalStorage(root)
    later = time.time() + gc_mod.DEFAULT_GRACE + 60  # everything idle, every mark aged
    plan = gc_mod.plan(storage, Retention(last=1), now=later)
    assert plan.held_back and "cannot be read" in plan.held_back
    assert sorted((d.kind, d.location) for d in plan.deletions) == [
        ("checkpoint", "step-000000000001"), ("checkpoint", "step-000000000003"),
        ("generation", "step-000000000004")]
    assert plan.bytes == 0 and plan.released_bytes == 0
    gc_mod.execute(storage, plan)
    assert [d.skipped for d in plan.deletions] == [None] * 3
    assert sorted(str(p.relative_to(root)) for p in root.rglob("data-*.bin")) == before
    assert same(store.load(4), model_state(4))
    out = CliRunner().invoke(main, ["gc", str(root), "--keep-last", "1", "--dry-run"])
    assert "held    data: a manifest of the store cannot be read" in out.output


def test_a_step_directory_copied_elsewhere_is_refused_and_a_symlink_is_followed(tmp_path):
    store = ckptstore.Store(tmp_path / "s")
    for step in (1, 2):
        store.save(step, model_state(step)).result()
    shutil.copytree(store.location(2).describe(), tmp_path / "copy")
    with pytest.raises(FormatError, match="not its step's directory"):
        ckptstore.load(str(tmp_path / "copy"))
    os.symlink(store.location(2).describe(), tmp_path / "latest")  # beside it: not the store
    (tmp_path / "step-000000000002").symlink_to(store.location(2).describe())
    assert same(ckptstore.load(str(tmp_path / "step-000000000002")), model_state(2))


def test_references_on_s3_follow_the_store_and_gc_keeps_what_they_read(monkeypatch):
    """The moto S3 server: references are read from the step's prefix beside the
    checkpoint; a dropped step's data stays while a kept one references it."""
    pytest.importorskip("moto.server")
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import s3util

    endpoint = s3util.moto_endpoint()
    s3util.point_boto3_at(endpoint, monkeypatch)
    bucket = s3util.new_bucket(endpoint)
    try:
        store = ckptstore.Store(f"s3://{bucket}/run", keep=Retention(last=2), grace=0)
        for step in range(1, 5):
            store.save(step, model_state(step)).result()
        assert store.steps() == [3, 4]
        assert {b.step for _, _, b in store.manifest(4).blobs() if b.step is not None} == {1}
        assert same(store.load(4), model_state(4))
        assert same(ckptstore.load(f"s3://{bucket}/run/step-000000000004"), model_state(4))
        out = CliRunner().invoke(main, ["verify", f"s3://{bucket}/run"])
        assert out.exit_code == 0, out.output
        store.gc()
        assert same(store.load(3), model_state(3))
    finally:
        s3util.empty_bucket(bucket, endpoint)


# ---------------------------------------------------------------------------- drop-in saves to one path
def test_saving_again_to_one_path_writes_only_what_changed(tmp_path):
    path = tmp_path / "ckpt"
    sizes = []
    for step in range(1, 4):
        ckptstore.save(model_state(step), str(path), compression="none").result()
        sizes.append(sum(p.stat().st_size for p in path.rglob("data-*.bin")))
    assert sizes[1] - sizes[0] <= 0.15 * sizes[0] and sizes[2] - sizes[1] <= 0.15 * sizes[0]
    m = ckptstore.api.latest_manifest(ckptstore.storage.open_storage(str(path)))
    assert m.generation == 3 and any(b.earlier for _, _, b in m.blobs())
    # the first generation's file stays (the third reads it); the second's went with it
    attempts = sorted(p.name for p in (path / "attempts").iterdir())
    assert len(attempts) == 2 and m.attempt in attempts
    assert same(ckptstore.load(str(path)), model_state(3))
    out = CliRunner().invoke(main, ["verify", str(path)])
    assert out.exit_code == 0, out.output
    plan = CliRunner().invoke(main, ["gc", str(path), "--grace", "0", "--json"])  # the referenced file stays
    assert plan.exit_code == 0, plan.output
    assert sorted(p.name for p in (path / "attempts").iterdir()) == attempts
    assert same(ckptstore.load(str(path)), model_state(3))


def test_saving_again_to_one_path_without_incremental_writes_everything(tmp_path):
    path = tmp_path / "ckpt"
    for step in (1, 2):
        ckptstore.save(model_state(step), str(path), compression="none", incremental=False).result()
    m = ckptstore.api.latest_manifest(ckptstore.storage.open_storage(str(path)))
    assert not any(b.earlier for _, _, b in m.blobs())
    assert [p.name for p in (path / "attempts").iterdir()] == [m.attempt]


def earlier_json(tmp_path) -> dict:
    path = tmp_path / "ckpt"
    for step in (1, 2):
        ckptstore.save(model_state(step), str(path)).result()
    return ckptstore.api.latest_manifest(ckptstore.storage.open_storage(str(path))).to_json()


def _first_earlier(d: dict) -> dict:
    return next(c for e in d["ranks"][0]["tensors"].values() for c in e["chunks"] if c.get("earlier"))


@pytest.mark.parametrize("change", ["false", "with_step", "own_attempt", "version_2"])
def test_a_bad_earlier_reference_is_refused(tmp_path, change):
    d = earlier_json(tmp_path)
    chunk = _first_earlier(d)
    if change == "false":
        chunk["earlier"] = False
    elif change == "with_step":
        chunk["step"] = 1
    elif change == "own_attempt":
        chunk["file"] = chunk["file"].replace(chunk["file"].split("/")[1], d["attempt"])
    else:
        d["format_version"] = 2
    with pytest.raises(FormatError):
        fmt.Manifest.from_json(d)


def slowly_changing(i: int) -> dict:
    """Four 1 MiB layers; layer k changes every k + 2 saves (so each save references a
    mix of earlier attempts)."""
    return {f"l{k}": torch.full((256, 1024), float(i // (k + 2) * 10 + k)) for k in range(4)}


def test_drop_in_saves_to_one_path_leave_only_the_attempts_the_visible_checkpoint_reads(tmp_path):
    """An earlier attempt kept because the next generation read it was never deleted once
    no generation read it any more: 40 saves of a 2.5 MiB state left 14 attempts, 15 MiB."""
    path = tmp_path / "latest.pt"
    for i in range(16):
        ckptstore.save(slowly_changing(i), path, compression="none").result()
        storage = LocalStorage(str(path))
        m = latest_manifest(storage)
        assert set(os.listdir(path / names.ATTEMPTS_DIR)) == {m.attempt} | m.earlier_attempts(), i
        loaded = ckptstore.load(path)
        assert all(torch.equal(loaded[k], v) for k, v in slowly_changing(i).items())
    assert m.earlier_attempts()  # it did reference


@pytest.mark.parametrize("second_references", [True, False])
def test_two_drop_in_saves_in_flight_to_one_path_both_commit(tmp_path, monkeypatch, second_references):
    """save(b, p) then save(a, p) without waiting: the second read its references from the
    generation visible then, which the first one's commit retired with its files, and it
    failed ("data file vanished"). Here the first commit waits until the second save has
    read its references, the order that lost it. A second save that references none of
    them still held them meanwhile: its own commit must delete them (deferred), or they
    stayed for good."""
    import ckptstore.api as api_mod

    path = tmp_path / "latest.pt"
    a, b = slowly_changing(0), {k: v + 100 for k, v in slowly_changing(0).items()}  # b shares no chunk with a
    again = a if second_references else {k: v + 200 for k, v in a.items()}
    ckptstore.save(a, path, compression="none").result()
    read_twice = threading.Event()
    reads = []
    earlier = api_mod._earlier_references

    def counting(storage, hold):
        out = earlier(storage, hold)
        reads.append(len(out))
        if len(reads) == 2:
            read_twice.set()
        return out

    class FirstCommitWaits(LocalStorage):
        def put(self, key, data, **kwargs):
            if names.parse_manifest_name(key) == 2:  # the first save's commit
                assert read_twice.wait(60)
            return super().put(key, data, **kwargs)

    monkeypatch.setattr(api_mod, "_earlier_references", counting)
    monkeypatch.setattr(api_mod, "open_storage", lambda f, **kw: FirstCommitWaits(str(f)))
    first = ckptstore.save(b, path, compression="none")
    second = ckptstore.save(again, path, compression="none")
    first.result(timeout=60)
    second.result(timeout=60)
    assert reads[1] > 0  # the second save could reference the generation the first one retired
    loaded = ckptstore.load(path)
    assert all(torch.equal(loaded[k], v) for k, v in again.items())
    m = latest_manifest(LocalStorage(str(path)))
    assert m.generation == 3 and set(os.listdir(path / names.ATTEMPTS_DIR)) == {m.attempt} | m.earlier_attempts()


def test_retention_drops_steps_that_read_each_other_in_one_run(tmp_path):
    """Steps 0-11 saved incrementally, then a writer with keep=last 2: each dropped step's
    data deletion was checked against every manifest present before the run, the other
    dropped ones included, and skipped with its manifest: dropped steps stayed listed."""
    root = tmp_path / "s"
    store = ckptstore.Store(root, compression="none")
    for i in range(12):
        store.save(i, slowly_changing(i)).result()
    assert any(b.step is not None for _, _, b in store.manifest(11).blobs())
    ckptstore.Store(root, compression="none", keep=Retention(last=2)).save(12, slowly_changing(12)).result()
    assert ckptstore.Store(root).steps() == [11, 12]
    ckptstore.Store(root).gc(keep=Retention(last=2), grace=0)  # now only what 11 and 12 read stays
    kept = ckptstore.Store(root)
    read = {s for m in (kept.manifest(11), kept.manifest(12)) for s in m.referenced()} | {11, 12}
    assert {int(p.name.split("-")[1]) for p in root.iterdir() if p.name.startswith("step-")} == read
    for i in (11, 12):
        assert all(torch.equal(kept.load(i)[k], v) for k, v in slowly_changing(i).items())
    assert verified(root)


def test_overlapping_drop_in_saves_leave_no_attempt_behind(tmp_path):
    """save(a, p); save(b, p) without waiting, five times, every chunk changed each time:
    an attempt a commit kept only because the save in flight held it was named by no
    manifest afterwards, and no later retire looked at it again (6 attempts left for 1)."""
    path = tmp_path / "latest.pt"
    for r in range(5):
        first = ckptstore.save({k: v + 10 * r for k, v in slowly_changing(0).items()}, path, compression="none")
        second = ckptstore.save({k: v + 10 * r + 5 for k, v in slowly_changing(0).items()}, path, compression="none")
        first.result(timeout=60)
        second.result(timeout=60)
    m = latest_manifest(LocalStorage(str(path)))
    assert set(os.listdir(path / names.ATTEMPTS_DIR)) == {m.attempt} | m.earlier_attempts()
    loaded = ckptstore.load(path)
    assert all(torch.equal(loaded[k], v + 45) for k, v in slowly_changing(0).items())


def test_a_hold_is_per_location_however_reached_and_a_take_after_release_holds_nothing(tmp_path):
    from ckptstore.checkpoint.held import Hold, held_attempts, references_lock

    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    via_link, direct = LocalStorage(str(tmp_path / "link")), LocalStorage(str(real))
    assert references_lock(via_link) is references_lock(direct)
    hold = Hold(via_link, "saving")
    hold.take({"a1"})
    assert held_attempts(direct, but="other") == {"a1"} and held_attempts(direct, but="saving") == frozenset()
    hold.release()
    hold.release()  # idempotent
    assert held_attempts(direct, but="other") == frozenset()
    late = Hold(direct, "late")
    late.release()  # the save failed before its writer read the references ...
    late.take({"a2"})  # ... which a worker then did: nothing stays held for good
    assert held_attempts(direct, but="other") == frozenset()
