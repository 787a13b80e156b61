"""Incremental saves (issue 16, docs/incremental.md): within a Store, a chunk unchanged
since the last committed save is recorded as a reference (format version 3,
``Blob.step``) to the blob that holds it; loads, verify and gc follow references."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import ckptstore
from ckptstore import format as fmt
from ckptstore.checkpoint.references import MIN_REFERENCE_BYTES
from ckptstore.checkpoint.retention import Retention
from ckptstore.cli import main
from ckptstore.errors import FormatError


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
    # a save that changes everything references nothing: step 1's data is then garbage
    store.save(6, model_state(6, frozen_layers=0)).result()
    store.save(7, model_state(7, frozen_layers=0)).result()
    assert store.steps() == [6, 7]
    freed = store.gc(dry_run=True).bytes
    assert freed >= 9 * (1 << 20)  # the frozen layers' file
    store.gc()
    assert not step1.exists() and same(store.load(7), model_state(7, frozen_layers=0))


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
