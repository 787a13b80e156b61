"""torch.distributed.checkpoint through ckptstore (``ckptstore.dcp.Writer`` / ``Reader``):
real ``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` on FSDP2 over gloo ranks, resharding
on load, the checkpoint as ckptstore sees it (ls, verify, gc, load), and damage found."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner

import ckptstore
import ckptstore.dcp
from ckptstore import format as fmt
from ckptstore import names
from ckptstore.cli import main

sys.path.insert(0, str(Path(__file__).parent))
import sharded_procs as sp  # noqa: E402
from test_sharded import assert_same  # noqa: E402

SAVED_WORLD = 2
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # (one-process DCP says so)


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module", params=["save", "async_save"])
def saved(request, tmp_path_factory):
    base = tmp_path_factory.mktemp(f"dcp-{request.param}")
    url, ref = base / "store", base / "reference.pt"
    sp.run_job(sp.dcp_save, SAVED_WORLD, base / "job", str(url), str(ref), request.param == "async_save")
    return {"url": url, "reference": torch.load(ref, weights_only=False)}


def test_dcp_save_commits_an_ordinary_ckptstore_checkpoint(saved):
    url = saved["url"]
    location = url / names.step_dir_name(1)
    manifest = ckptstore.Store(str(url)).manifest(1)
    assert manifest.world_size == SAVED_WORLD and manifest.step == 1
    files = {sp.file_rank(c.blob.file) for e in manifest.tensors.values() for c in e.chunks}
    assert files == {0, 1}  # every rank wrote its own shards
    pickled = manifest.metrics[ckptstore.dcp.BYTES_METRIC]  # what DCP pickled: plain values
    assert {"extra.epoch", "extra.name", "optim.param_groups.0.lr"} <= set(pickled)
    assert not any(k.startswith(("model.", "big")) for k in pickled)
    r = cli("verify", url)
    assert r.exit_code == 0, r.output
    assert "step-000000000001" in cli("ls", url).output
    # ckptstore.load gives every tensor whole, by DCP's flat names
    with pytest.warns(ckptstore.WorldSizeChangedWarning):
        flat = ckptstore.load(str(location))
    ref = saved["reference"]
    assert_same(flat["big"], ref["big"], "big")
    for key, want in ref["model"].items():
        assert_same(flat[f"model.{key}"], want, key)
    assert bytes(flat["extra.epoch"].numpy()) and flat["extra.epoch"].dtype == torch.uint8  # torch.save bytes


@pytest.mark.parametrize("mesh", [(2,), (1,), (3,)], ids=["same", "one-rank", "three-ranks"])
def test_dcp_load_gives_fsdp2_its_state_back_on_any_mesh(saved, tmp_path, mesh):
    results = sp.run_job(sp.dcp_load, mesh[0], tmp_path / "job", str(saved["url"]), mesh)
    assert all("error" not in r for r in results), [r.get("error") for r in results]
    assert_same(results[0]["gathered"], saved["reference"])
    assert all(r["extra"] == {"epoch": 7, "name": "run-7"} for r in results)


def test_a_byte_flip_fails_dcp_load_on_every_rank_naming_the_chunk(saved, tmp_path):
    import shutil

    url = tmp_path / "store"
    shutil.copytree(saved["url"], url)
    manifest = ckptstore.Store(str(url)).manifest(1)
    blob = manifest.tensors["big"].chunks[0].blob
    path = url / names.step_dir_name(1) / blob.file
    with open(path, "r+b") as f:
        f.seek(blob.offset + 5)
        b = f.read(1)
        f.seek(blob.offset + 5)
        f.write(bytes([b[0] ^ 0x10]))
    results = sp.run_job(sp.dcp_load, SAVED_WORLD, tmp_path / "job", str(url), (SAVED_WORLD,))
    errors = [r.get("error", "") for r in results]
    assert any("xxh3-128 mismatch" in e for e in errors), errors
    assert all(e for e in errors), errors  # no rank goes on with a half-loaded state
    assert cli("verify", url).exit_code == 1


# ---------------------------------------------------------------------------- one process
def single_state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, 64, generator=g), "b": torch.randn(64, generator=g).to(torch.bfloat16),
            "empty": torch.empty(0, 3), "step": step}


def test_one_process_round_trip_and_gc_retention_of_dcp_steps(tmp_path):
    url = tmp_path / "store"
    for step in (1, 2, 3):
        dcp.save(single_state(step), storage_writer=ckptstore.dcp.Writer(url, step=step))
    assert ckptstore.Store(str(url)).steps() == [1, 2, 3]
    target = {"w": torch.zeros(256, 64), "b": torch.zeros(64, dtype=torch.bfloat16), "empty": torch.empty(0, 3),
              "step": 0}
    dcp.load(target, storage_reader=ckptstore.dcp.Reader(url, step=2))
    want = single_state(2)
    assert torch.equal(target["w"], want["w"]) and torch.equal(target["b"], want["b"]) and target["step"] == 2
    r = cli("gc", url, "--keep-last", "1", "--grace", "0", "--json")
    assert r.exit_code == 0, r.output
    assert ckptstore.Store(str(url)).steps() == [3] and sorted(os.listdir(url)) == [names.step_dir_name(3)]


def test_the_data_file_is_opened_with_the_plans_raw_bytes_and_world_size(tmp_path, monkeypatch):
    """The size hint a store sizes its upload parts by (S3: docs/s3.md)."""
    from ckptstore.storage import LocalStorage

    opened, real = [], LocalStorage.open_append

    def noting(self, key, **hints):
        opened.append((key, hints))
        return real(self, key, **hints)

    monkeypatch.setattr(LocalStorage, "open_append", noting)
    dcp.save(single_state(1), storage_writer=ckptstore.dcp.Writer(tmp_path / "store", step=1))
    data = [hints for key, hints in opened if key.endswith("-s00.bin")]  # (not the committer's skeleton, -s01)
    assert data == [{"size_hint": (256 * 64) * 4 + 64 * 2, "writers": 1}], opened


def test_checkpoint_id_names_the_location_and_a_second_save_is_a_new_generation(tmp_path):
    path = tmp_path / "ckpt"
    dcp.save(single_state(1), checkpoint_id=str(path), storage_writer=ckptstore.dcp.Writer())
    dcp.save(single_state(2), checkpoint_id=str(path), storage_writer=ckptstore.dcp.Writer())
    names_ = sorted(p.name for p in path.iterdir() if p.name.startswith("manifest"))
    assert names_ == [fmt.manifest_name(2)]  # the first generation was retired
    target = {"w": torch.zeros(256, 64), "b": torch.zeros(64, dtype=torch.bfloat16), "empty": torch.empty(0, 3),
              "step": 0}
    dcp.load(target, checkpoint_id=str(path), storage_reader=ckptstore.dcp.Reader())
    assert target["step"] == 2 and torch.equal(target["w"], single_state(2)["w"])


def test_a_save_that_fails_midway_commits_nothing(tmp_path):
    from torch.distributed.checkpoint.api import CheckpointException

    path = tmp_path / "ckpt"
    dcp.save(single_state(1), checkpoint_id=str(path), storage_writer=ckptstore.dcp.Writer())
    writer = ckptstore.dcp.Writer(path)
    real = ckptstore.pipeline.RankWriter.store_blob
    calls = []

    def failing(self, raw, itemsize, hint=None):
        calls.append(hint)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(self, raw, itemsize, hint)

    ckptstore.pipeline.RankWriter.store_blob = failing
    try:
        with pytest.raises(CheckpointException, match="No space left"):
            dcp.save(single_state(2), storage_writer=writer)
    finally:
        ckptstore.pipeline.RankWriter.store_blob = real
    target = {"w": torch.zeros(256, 64), "b": torch.zeros(64, dtype=torch.bfloat16), "empty": torch.empty(0, 3),
              "step": 0}
    dcp.load(target, storage_reader=ckptstore.dcp.Reader(path))
    assert target["step"] == 1  # the committed checkpoint is untouched
    assert len([p for p in path.iterdir() if p.name.startswith("manifest")]) == 1


def test_dcp_on_s3(monkeypatch):
    pytest.importorskip("moto.server")
    import s3util

    endpoint = s3util.moto_endpoint()
    s3util.point_boto3_at(endpoint, monkeypatch)
    bucket = s3util.new_bucket(endpoint)
    url = f"s3://{bucket}/dcp"
    dcp.save(single_state(5), storage_writer=ckptstore.dcp.Writer(url, step=5))
    target = {"w": torch.zeros(256, 64), "b": torch.zeros(64, dtype=torch.bfloat16), "empty": torch.empty(0, 3),
              "step": 0}
    dcp.load(target, storage_reader=ckptstore.dcp.Reader(url, step=5))
    assert target["step"] == 5 and torch.equal(target["w"], single_state(5)["w"])
    r = cli("verify", url, "--json")
    assert r.exit_code == 0 and json.loads(r.output)["ok"], r.output


def test_dcp_plan_caching_is_refused_and_the_committed_checkpoint_stays(tmp_path):
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.api import CheckpointException

    path = tmp_path / "ckpt"
    dcp.save(single_state(1), storage_writer=ckptstore.dcp.Writer(path),
             planner=DefaultSavePlanner(enable_plan_caching=True))
    with pytest.raises((ckptstore.CkptStoreError, CheckpointException), match="plan caching"):
        dcp.save(single_state(1), storage_writer=ckptstore.dcp.Writer(path),
                 planner=DefaultSavePlanner(enable_plan_caching=True))
    target = {"w": torch.zeros(256, 64), "b": torch.zeros(64, dtype=torch.bfloat16), "empty": torch.empty(0, 3),
              "step": 0}
    dcp.load(target, storage_reader=ckptstore.dcp.Reader(path))
    assert target["step"] == 1 and torch.equal(target["w"], single_state(1)["w"])
    assert cli("verify", path).exit_code == 0
