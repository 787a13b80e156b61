"""Two tiers (issue 15, docs/tiers.md): every save commits to a local store, every K-th
is promoted to the durable store (here the moto S3 server, or a directory where a test
needs to look inside) with each blob's hash checked; loads take the nearest sound copy.
Two real ranks: tests/test_distributed.py (each rank promotes its own files)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import ckptstore
from ckptstore.api import TierFallbackWarning
from ckptstore.checkpoint import gc
from ckptstore.checkpoint.promote import promote
from ckptstore.checkpoint.manifests import latest_manifest
from ckptstore.checkpoint.retention import Retention
from ckptstore.checkpoint.verify import verify
from ckptstore import names
from ckptstore.errors import AlreadyExistsError, IntegrityError, ObjectNotFoundError
from ckptstore.storage import LocalStorage
from ckptstore.tiers import PromotionWarning

pytest.importorskip("moto.server")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import s3util  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def endpoint():
    return s3util.moto_endpoint()


@pytest.fixture
def bucket(endpoint, monkeypatch):
    s3util.point_boto3_at(endpoint, monkeypatch)
    name = s3util.new_bucket(endpoint)
    yield name
    s3util.empty_bucket(name, endpoint)


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(300, 200, generator=g), "ids": torch.randint(0, 1 << 40, (5000,), generator=g),
            "step": step}


def same(a: dict, b: dict) -> bool:
    return a["step"] == b["step"] and all(torch.equal(a[k], b[k]) for k in ("w", "ids"))


def tiered(bucket, tmp_path, **kw) -> ckptstore.Store:
    return ckptstore.Store(f"s3://{bucket}/run", local=tmp_path / "local", chunk_bytes=64 << 10, **kw)


def test_every_save_is_local_every_kth_durable_and_wait_covers_the_promotions(bucket, tmp_path):
    store = tiered(bucket, tmp_path, durable_every=3, local_keep=Retention(last=2))
    for step in range(1, 8):
        store.save(step, state(step))
    ckptstore.wait()
    assert store.local.steps() == [6, 7]  # its own retention
    assert store.committed_steps() == [3, 6]  # the 3rd and 6th saves, promoted
    assert store.steps() == [3, 6, 7] and [t for t, _ in store.tiers_of(6)] == ["local", "durable"]
    local, durable = latest_manifest(store.local.location(6)), latest_manifest(store.location(6))
    assert (durable.attempt, durable.ranks, durable.tensors, durable.created_at) == \
        (local.attempt, local.ranks, local.tensors, local.created_at)  # the same records, not re-encoded
    assert verify(store.location(3)) == [] and verify(store.location(6)) == []
    got, info = store.load(return_info=True)
    assert same(got, state(7)) and info.tier == "local"
    got, info = store.load(3, return_info=True)
    assert same(got, state(3)) and info.tier == "durable"

    from ckptstore.cli import main

    out = CliRunner().invoke(main, ["ls", store.url, "--local", str(tmp_path / "local"), "--json"])
    assert out.exit_code == 0, out.output
    assert [(r["step"], r["tiers"]) for r in json.loads(out.output)] == \
        [(3, ["durable"]), (6, ["local", "durable"]), (7, ["local"])]


def test_after_node_loss_resume_restores_the_newest_durable_step_bit_identical(bucket, tmp_path):
    store = tiered(bucket, tmp_path, durable_every=5)
    for step in range(1, 13):
        store.save(step, state(step))
    ckptstore.wait()
    shutil.rmtree(tmp_path / "local")  # the node and its local disk are gone
    fresh = tiered(bucket, tmp_path, durable_every=5)  # the job restarts elsewhere
    got, info = fresh.resume()
    assert (info.step, info.tier) == (10, "durable") and same(got, state(10))
    assert info.age_s is not None and info.age_s >= 0


def test_a_corrupted_local_copy_falls_back_to_the_durable_one(bucket, tmp_path):
    store = tiered(bucket, tmp_path, durable_every=1)
    store.save(4, state(4))
    ckptstore.wait()
    data = sorted((tmp_path / "local").rglob("data-*.bin"))
    assert data
    with open(data[0], "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0x40]))
    with pytest.warns(TierFallbackWarning, match="local copy of step 4"):
        got, info = store.resume()
    assert (info.step, info.tier) == (4, "durable") and same(got, state(4))


def test_a_promotion_checks_every_hash_and_publishes_nothing_it_could_not_check(tmp_path):
    store = ckptstore.Store(tmp_path / "durable", local=tmp_path / "local", durable_every=1000)
    manifest = store.save(1, state(1)).result()  # local only: durable_every not reached
    data = sorted((tmp_path / "local").rglob("data-*.bin"))
    with open(data[0], "r+b") as f:
        f.seek(-3, os.SEEK_END)
        f.write(b"\xff\xff\xff")
    with pytest.raises(IntegrityError, match="xxh3-128 mismatch"):
        promote(store.local.location(1), store.location(1), manifest, 0, timeout=10.0)
    assert store.committed_steps() == []  # nothing visible in the durable tier


def test_local_retention_keeps_a_step_whose_promotion_is_pending(tmp_path):
    store = ckptstore.Store(tmp_path / "s")
    for step in (1, 2, 3):
        store.save(step, state(step)).result()
    p = gc.plan(store.storage, Retention(last=1), protect={1})
    assert p.kept["step-000000000001"] == ["promotion in flight"]
    assert [d.location for d in p.deletions] == ["step-000000000002"]


def test_a_failed_promotion_warns_fails_wait_and_not_the_next_save(tmp_path, monkeypatch):
    import ckptstore.tiers as tiers

    def broken(*args, **kwargs):
        raise IntegrityError("durable tier: simulated bad copy")

    monkeypatch.setattr(tiers, "promote", broken)
    store = ckptstore.Store(tmp_path / "durable", local=tmp_path / "local", durable_every=1)
    with pytest.warns(PromotionWarning, match="promotion of step 1"):
        store.save(1, state(1)).result()
        worker = store._tiers.promoter._worker  # None once it has ended, the failed promotion with it
        if worker is not None:
            worker.join()
    monkeypatch.undo()  # the real promotion again
    store.save(2, state(2)).result()  # the earlier failure is not this save's...
    with pytest.raises(IntegrityError, match="simulated"):
        ckptstore.wait()  # ...but wait() raises it, even after it ended
    ckptstore.wait()
    assert store.committed_steps() == [2] and store.local.steps() == [1, 2]


def test_the_durable_tier_keeps_its_own_retention(tmp_path):
    store = ckptstore.Store(tmp_path / "durable", local=tmp_path / "local", durable_every=1,
                            keep=Retention(last=1), local_keep=Retention(last=3))
    for step in (1, 2, 3):
        store.save(step, state(step))
        ckptstore.wait()
    assert store.committed_steps() == [3] and store.local.steps() == [1, 2, 3]


def kill_mid_promotion(durable: str, local, env: dict) -> None:
    """tests/procs/promote_child.py until its promotion of step 2 is under way, then SIGKILL."""
    env = dict(env, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    child = subprocess.Popen([sys.executable, str(ROOT / "tests" / "procs" / "promote_child.py"), durable,
                              str(local)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        lines = []
        for line in child.stdout:  # the promoter and the main thread print in either order
            lines.append(line.strip())
            if {"mid-promotion", "committed 2"} <= set(lines):
                break
        assert {"mid-promotion", "committed 2"} <= set(lines), lines
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()


def test_sigkill_during_a_promotion_leaves_both_tiers_consistent(tmp_path):
    durable, local = tmp_path / "durable", tmp_path / "local"
    kill_mid_promotion(str(durable), local, dict(os.environ))
    partial = list(durable.rglob("data-*.bin"))
    assert partial, "the promotion had begun writing the durable tier"
    assert not list(durable.rglob("manifest-*.json"))  # nothing half-visible (I1)

    store = ckptstore.Store(durable, local=local, durable_every=2, chunk_bytes=64 << 10)
    assert store.committed_steps() == [] and store.local.steps() == [1, 2]
    got, info = store.resume()
    assert (info.step, info.tier) == (2, "local")
    assert torch.equal(got["t3"], torch.full((50_000,), 203.0))
    swept = store.gc(grace=0)  # the abandoned promotion is debris in the durable tier
    assert [d.kind for d in swept.deletions] == ["attempt"] and not list(durable.rglob("data-*.bin"))
    store.save(4, {"x": torch.ones(3)}, durable=True).result()
    ckptstore.wait()  # a later promotion goes through
    assert store.committed_steps() == [4]


@pytest.mark.parametrize("bad", [{"durable_every": 0}, {"durable_every": 1.5}, {"durable_every": True}])
def test_bad_tier_settings_are_refused(tmp_path, bad):
    with pytest.raises(ValueError, match="durable_every"):
        ckptstore.Store(tmp_path / "d", local=tmp_path / "l", **bad)


@pytest.mark.parametrize("local", ["d/local", "."])
def test_overlapping_tiers_are_refused(tmp_path, local):
    with pytest.raises(ValueError, match="overlap"):
        ckptstore.Store(tmp_path / "d", local=tmp_path / local if local != "." else tmp_path)


def test_a_preemption_save_is_promoted_whatever_durable_every_says(tmp_path):
    model = torch.nn.Linear(4, 2)
    store = ckptstore.Store(tmp_path / "durable", local=tmp_path / "local", durable_every=1000)
    ckpt = ckptstore.Checkpointer(store, model=model, every=2, rng=False, signals=())
    assert ckpt.resume() == 0
    assert not ckpt.step(0)  # due (every 2), local only
    ckpt._signalled.set()  # what the SIGTERM handler does
    assert ckpt.step(1)  # the preemption's save, waited for
    ckptstore.wait()
    ckpt.close()
    assert store.local.steps() == [0, 1] and store.committed_steps() == [1]
    fresh = ckptstore.Store(tmp_path / "durable")  # the node is gone: the durable tier alone
    assert torch.equal(fresh.load(1)["model"]["weight"], model.weight.detach())


def test_sigkill_during_a_promotion_to_s3_leaves_both_tiers_consistent(bucket, endpoint, tmp_path):
    url, local = f"s3://{bucket}/run", tmp_path / "local"
    # 8 MB tensors, killed 25 MiB into the copy: its multipart upload (16 MiB parts) is
    # usually created, with a part sent (s3transfer does that on its own threads)
    kill_mid_promotion(url, local, s3util.subprocess_env(endpoint, STOP_AFTER="400", NUMEL=str(2 << 20)))
    s3 = s3util.admin_client(endpoint)
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert not [k for k in keys if "manifest-" in k], keys  # nothing half-visible (I1)
    uploads = [u["Key"] for u in s3.list_multipart_uploads(Bucket=bucket).get("Uploads", [])]

    store = ckptstore.Store(url, local=local, durable_every=2, chunk_bytes=64 << 10)
    assert store.committed_steps() == [] and store.local.steps() == [1, 2]
    got, info = store.resume()
    assert (info.step, info.tier) == (2, "local")
    assert torch.equal(got["t1"][-5:], torch.full((5,), 201.0))
    swept = store.gc(grace=0)  # the abandoned upload is debris in the durable tier
    assert len(swept.aborted_uploads) == len(uploads) and not s3.list_multipart_uploads(Bucket=bucket).get("Uploads")
    store.save(4, {"x": torch.ones(3)}, durable=True).result()
    ckptstore.wait()  # a later promotion goes through
    assert store.committed_steps() == [4]


def test_a_split_local_tier_keeps_data_files_apart_from_the_commit_records(tmp_path):
    from ckptstore.storage import LocalStorage
    from ckptstore.storage.split import SplitStorage, is_data_key

    assert is_data_key("step-000000000001/attempts/20261202T000000-0123456789ab/data-r00001-s00.bin")
    assert is_data_key("attempts/20261202T000000-0123456789ab/data-r00001-s00.bin.tmp-0123abcd")
    assert not is_data_key("attempts/20261202T000000-0123456789ab/vote-r00001.json")
    assert not is_data_key("manifest-0000000001.json") and not is_data_key("data-r1.bin")
    split = SplitStorage(LocalStorage(tmp_path / "shared"), LocalStorage(tmp_path / "node"))
    store = ckptstore.Store(tmp_path / "unused")
    store.storage = split  # a one-rank store over it: the committer checks its own files only
    store.save(1, state(1)).result()
    assert sorted(p.name for p in (tmp_path / "node").rglob("*") if p.is_file()) == ["data-r00000-s00.bin"]
    assert sorted(p.name for p in (tmp_path / "shared").rglob("*") if p.is_file()) == [
        "manifest-0000000001.json"]  # (the commit mark, a commit record too, went once it landed)
    assert split.list("") == ["step-000000000001/"] and same(store.load(1), state(1))


def test_local_shared_needs_a_local_tier_and_a_place_of_its_own(tmp_path):
    with pytest.raises(ValueError, match="needs local="):
        ckptstore.Store(tmp_path / "d", local_shared=tmp_path / "s")
    with pytest.raises(ValueError, match="overlap"):
        ckptstore.Store(tmp_path / "d", local=tmp_path / "l", local_shared=tmp_path / "d" / "shared")


def test_status_shows_each_tiers_newest_step_and_the_tier_a_resume_used(tmp_path):
    from ckptstore.cli import main
    from ckptstore.supervisor.journal import Journal

    store = ckptstore.Store(tmp_path / "durable", local=tmp_path / "local", durable_every=2)
    for step in (1, 2, 3):
        store.save(step, state(step))
    ckptstore.wait()
    j = Journal(store.storage, "run-1")
    j.append("run_start", command=["train.py"], world_size=1, nnodes=1)
    j.append("attempt_start", attempt=0)
    j.append("resume", attempt=0, step=3, tier="local", checkpoint_age_s=4.5, skipped=[], first_step_s=1.0)
    out = CliRunner().invoke(main, ["status", str(tmp_path / "durable"), "--local", str(tmp_path / "local"),
                                    "--json"])
    assert out.exit_code == 0, out.output
    s = json.loads(out.output)
    assert {t: v and v["step"] for t, v in s["tiers"].items()} == {"local": 3, "durable": 2}
    assert s["last_resume"] == {"attempt": 0, "step": 3, "tier": "local", "checkpoint_age_s": 4.5}
    text = CliRunner().invoke(main, ["status", str(tmp_path / "durable"), "--local", str(tmp_path / "gone")])
    assert "local none, durable step 2" in text.output and "step 3 from the local tier (age 4.5s)" in text.output


def test_a_nodes_sweep_deletes_only_its_ranks_retired_or_idle_files(tmp_path):
    from ckptstore import names
    from ckptstore.tiers import sweep_own_data

    store = ckptstore.Store(tmp_path / "d", local=tmp_path / "node", local_shared=tmp_path / "shared",
                            durable_every=1000)
    store.save(2, state(2)).result()
    attempt = names.new_attempt_id()  # a save of step 1 in flight (or failed): unreferenced
    mine = tmp_path / "node" / "step-000000000001" / names.data_file_name(attempt, 0, 0)
    theirs = mine.with_name("data-r00001-s00.bin")
    for f in (mine, theirs):
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(b"x" * 10)
    assert sweep_own_data(store.local, 0, set(), set()) == []  # recent, not retired: in flight
    assert sweep_own_data(store.local, 0, {attempt}, {attempt}) == []  # a promotion holds it
    old = mine.stat().st_mtime + store.local.grace + 1
    # (the same durable store: a node directory belongs to one store, tiers.bind_local_tier)
    empty = ckptstore.Store(tmp_path / "d", local=tmp_path / "node", local_shared=tmp_path / "shared2")
    assert sweep_own_data(empty.local, 0, {attempt}, set(), now=old) == []  # the shared place lists nothing
    key = "step-000000000001/" + names.data_file_name(attempt, 0, 0)
    assert sweep_own_data(store.local, 0, {attempt}, set()) == [key] and not mine.exists()  # retired here
    assert theirs.exists()  # another rank's file: that rank sweeps it
    mine.write_bytes(b"y")
    assert sweep_own_data(store.local, 0, set(), set(), now=old) != [] and not mine.exists()  # idle past grace
    assert same(store.load(2), state(2))  # the committed step's files are untouched


def test_a_save_that_fails_locally_promotes_nothing_and_stays_the_saves_own_error(tmp_path, monkeypatch):
    import warnings

    from ckptstore.errors import CkptStoreError, StorageFullError

    store = ckptstore.Store(tmp_path / "durable", local=tmp_path / "local", durable_every=1)

    from ckptstore.storage import LocalStorage

    real = LocalStorage.open_append

    def full(self, key, **hints):
        if str(tmp_path / "local") in self.describe():  # the local disk fills up
            raise StorageFullError(f"{self.describe(key)}: no space left on device")
        return real(self, key, **hints)

    monkeypatch.setattr(LocalStorage, "open_append", full)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PromotionWarning)  # its promotion fails quietly
        f = store.save(1, state(1))
        assert isinstance(f._future.exception(), StorageFullError)  # (not observed: the next save reports it)
        worker = store._tiers.promoter._worker
        if worker is not None:
            worker.join()
    monkeypatch.undo()
    with pytest.raises(CkptStoreError, match="earlier save"):
        store.save(2, state(2))
    assert store.committed_steps() == [] and not list((tmp_path / "durable").rglob("manifest-*"))
    store.save(3, state(3)).result()
    ckptstore.wait()
    assert store.committed_steps() == [3]


def test_a_two_tier_store_saves_whole_checkpoints(tmp_path):
    store = ckptstore.Store(tmp_path / "durable", local=tmp_path / "local", durable_every=1)
    assert not store.incremental and not store.local.incremental
    frozen = {"w": torch.randn(512, 1024)}  # 2 MiB that never changes
    for step in (1, 2):
        store.save(step, dict(frozen)).result()
    ckptstore.wait()
    for tier in (store.local, store):
        m = latest_manifest(tier.location(2))
        assert not [b for _, _, b in m.blobs() if b.step is not None]


def test_a_durable_tier_outage_leaves_local_saves_going(tmp_path, monkeypatch):
    """Runs are claimed on the durable tier, and every local commit (and the local
    retention) checked that claim there: with S3 unreachable the local saves failed too,
    and a Checkpointer's next save raised, where the local tier is what keeps a job
    checkpointed through the outage."""
    from ckptstore.checkpoint import fencing
    from ckptstore.errors import TransientStorageError

    store = ckptstore.Store(tmp_path / "durable", local=tmp_path / "local", durable_every=100,
                            local_keep=Retention(last=2))
    store.resume(claim=True)
    store.save(1, {"w": torch.ones(2)}).result()
    ckptstore.wait()
    real = fencing.epochs

    def outage(storage):
        if storage.describe().startswith(str(tmp_path / "durable")):
            raise TransientStorageError(f"{storage.describe()}: EndpointConnectionError (the outage)")
        return real(storage)

    monkeypatch.setattr(fencing, "epochs", outage)
    with pytest.warns(RuntimeWarning, match="durable tier, where runs are claimed, cannot be read"):
        for step in (2, 3):
            store.save(step, {"w": torch.full((2,), float(step))}).result()
    assert store.local.steps() == [2, 3] or store.local.steps() == [1, 2, 3]
    torch.testing.assert_close(store.load(3)["w"], torch.full((2,), 3.0))
    monkeypatch.setattr(fencing, "epochs", real)
    store.save(4, {"w": torch.full((2,), 4.0)}).result()  # the outage over: fenced as before
    assert store.local.steps() == [3, 4]


def test_durable_every_counts_across_restarts(tmp_path):
    """Counted per process from 0, a job restarted every 2 saves with durable_every=3
    never promoted anything: losing the node lost every step."""
    durable, local = tmp_path / "durable", tmp_path / "local"
    step = 0
    for restart in range(4):  # each process: resume, two saves, gone
        store = ckptstore.Store(durable, local=local, durable_every=3)
        state, info = store.resume(claim=True)
        for _ in range(2):
            step += 1
            store.save(step, {"w": torch.full((2,), float(step))}).result()
        ckptstore.wait()
    assert ckptstore.Store(durable).steps() == [3, 6]


def test_a_durable_save_is_promoted_ahead_of_the_backlog(tmp_path):
    """A preemption's save (durable=True) queued behind a backlog of promotions: the
    exit deadline went to older steps first and the preempted step could miss it."""
    from ckptstore.checkpoint.save import SaveFuture
    from ckptstore.tiers import Promoter

    local = ckptstore.Store(tmp_path / "local")
    durable = ckptstore.Store(tmp_path / "durable")
    promoter = Promoter(durable, None, 60.0)
    saves = {step: SaveFuture(f"local step {step}", step, f"a{step}") for step in (1, 2, 3, 4)}
    promoted = [promoter.schedule("local", local, saves[step], 0, 1, None, first=(step == 4))
                for step in (1, 2, 3, 4)]
    with promoter._lock:  # step 1 may be the worker's already (it waits for that local commit)
        queued = [save.step for _, _, _, save, _, _ in promoter._queue]
    assert queued in ([4, 2, 3], [4, 1, 2, 3])
    for save in saves.values():  # let the worker finish: the local saves failed
        save._future.set_exception(RuntimeError("not committed"))
    for future in promoted:
        assert future.wait_settled(60)
    assert promoter.pending_steps() == set()


# ---------------------------------------------------------------------------- issue 34: whose local tier
def _aliases(tmp_path, how: str):
    """(durable, local) paths that name one directory, or one inside the other, by
    another path than a prefix of the other: symlinks, either way."""
    durable = tmp_path / "durable"
    durable.mkdir()
    if how == "symlink":  # the local tier is a symlink to the durable directory
        (tmp_path / "link").symlink_to(durable)
        return durable, tmp_path / "link"
    if how == "inside":  # ... to a directory inside it
        (durable / "node").mkdir()
        (tmp_path / "link").symlink_to(durable / "node")
        return durable, tmp_path / "link"
    if how == "below-link":  # a path below a symlink to it
        (tmp_path / "link").symlink_to(durable)
        return durable, tmp_path / "link" / "local"
    if how == "holds":  # the durable store lies in the local tier, through a symlink
        local = tmp_path / "local"
        local.mkdir()
        (local / "d").symlink_to(durable)
        return local / "d", local
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["symlink", "inside", "below-link", "holds"])
def test_a_local_tier_aliasing_the_durable_store_is_refused(tmp_path, how):
    """A local tier that was a symlink to the durable directory passed the overlap check
    (it compared the paths as given), and the local retention deleted durable steps."""
    durable, local = _aliases(tmp_path, how)
    one = ckptstore.Store(durable)
    for step in (1, 2, 3):
        one.save(step, {"w": torch.full((2,), float(step))}).result()
    with pytest.raises(ValueError, match=r"overlap .*give each a location of its own"):
        ckptstore.Store(durable, local=local, local_keep=Retention(last=1))
    assert ckptstore.Store(durable).steps() == [1, 2, 3]


def test_the_overlap_check_compares_directories_not_only_paths(tmp_path, monkeypatch):
    """A bind mount is another path to the same directory that no real path reveals:
    the check compares device and inode, of the roots and of every directory above."""
    from ckptstore import tiers
    from ckptstore.storage import LocalStorage

    durable, local = _aliases(tmp_path, "inside")
    monkeypatch.setattr(tiers.os.path, "realpath", lambda p: os.path.abspath(p))  # as for a bind mount
    places = {"the local tier": LocalStorage(local), "the durable store": LocalStorage(durable)}
    with pytest.raises(ValueError, match="device and inode"):
        tiers.refuse_overlaps(places)
    places = {"the local tier": LocalStorage(tmp_path / "elsewhere"), "the durable store": LocalStorage(durable)}
    tiers.refuse_overlaps(places)  # a directory that does not exist yet, beside it: fine


def test_a_local_directory_belongs_to_one_store(tmp_path):
    """Two jobs given one local directory: job B resumed job A's local steps, and each
    one's local retention deleted the other's only copies. The local tier is bound to
    the durable store's identity; another store is refused."""
    a, b, local = tmp_path / "a", tmp_path / "b", tmp_path / "local"
    store_a = ckptstore.Store(a, local=local, durable_every=100)
    store_a.save(5, {"w": torch.ones(2)}).result()
    ckptstore.wait()
    with pytest.raises(ValueError, match=r"belongs to another store.*'[^']*/a'.*a local directory of its own"):
        ckptstore.Store(b, local=local)
    assert ckptstore.Store(a, local=local).steps() == [5]  # the same store again (a restart): fine
    binding = json.loads((local / "tier-binding.json").read_text())
    ident = json.loads((a / "store-id.json").read_text())["id"]
    assert binding["store"] == ident and binding["durable"] == str(a)
    # a new store at the same URL (the old one deleted) is another store too
    shutil.rmtree(a)
    with pytest.raises(ValueError, match="belongs to another store"):
        ckptstore.Store(a, local=local)
    # local_shared is a local place as well
    ckptstore.Store(tmp_path / "c", local=tmp_path / "l1", local_shared=tmp_path / "shared")
    with pytest.raises(ValueError, match="local_shared .*belongs to another store"):
        ckptstore.Store(tmp_path / "d", local=tmp_path / "l2", local_shared=tmp_path / "shared")


def test_a_local_tier_opens_during_a_durable_outage(tmp_path, monkeypatch):
    from ckptstore import tiers
    from ckptstore.errors import TransientStorageError

    def outage(storage):
        raise TransientStorageError(f"{storage.describe()}: EndpointConnectionError (the outage)")

    monkeypatch.setattr(tiers, "_store_identity", outage)
    with pytest.warns(RuntimeWarning, match="durable store cannot be read"):
        store = ckptstore.Store(tmp_path / "durable", local=tmp_path / "local")
    assert store.local is not None and not (tmp_path / "local" / "tier-binding.json").exists()


# ---------------------------------------------------------------------------- review of issue 34: store-id races
class _NoConditionalPuts(LocalStorage):
    """A durable store without atomic create-only puts (``conditional_writes=
    "single-writer"``: exists(), then a plain put). ``blind``: this rank looked before
    another rank's put landed, so it sees no store-id.json; ``racer``: a record another
    writer puts right after ours (last writer wins)."""

    blind = False
    racer = None

    def _hidden(self, key):
        return self.blind and key == names.STORE_ID_NAME

    def read(self, key, *args, **kwargs):
        if self._hidden(key):
            raise ObjectNotFoundError(key)
        return super().read(key, *args, **kwargs)

    def exists(self, key):
        return False if self._hidden(key) else super().exists(key)

    def put(self, key, data, if_absent=False):
        if if_absent and key == names.STORE_ID_NAME:
            if self.exists(key):
                raise AlreadyExistsError(key)
            super().put(key, data)
            if self.racer is not None:
                super().put(key, json.dumps(self.racer).encode())
            return
        return super().put(key, data, if_absent=if_absent)


def _racer():
    return {"format": "ckptstore", "kind": "store_id", "id": "ab" * 16, "created_at": "2026-01-01T00:00:00+00:00"}


def test_the_store_id_read_back_after_a_put_is_the_one_bound(tmp_path):
    """``_create_or_read`` returned its own record after a put and never read back: where
    another writer's put replaced it, the local tier was bound to an id that is not
    stored, and every restart was refused as "belongs to another store"."""
    from ckptstore import tiers

    durable = _NoConditionalPuts(tmp_path / "durable")
    durable.racer = _racer()
    tiers.check_places({"the local tier": LocalStorage(tmp_path / "local"), "the durable store": durable})
    binding = json.loads((tmp_path / "local" / names.TIER_BINDING_NAME).read_text())
    assert binding["store"] == json.loads((tmp_path / "durable" / names.STORE_ID_NAME).read_text())["id"]
    ckptstore.Store(tmp_path / "durable", local=tmp_path / "local")  # a restart is not refused


def test_only_rank_0_creates_the_store_id_and_no_rank_binds_an_id_not_stored(tmp_path, monkeypatch):
    """Every rank created store-id.json: on a store without atomic create-only puts rank 1,
    which looked before rank 0's put landed, wrote its own id over rank 0's, and rank 1
    or every later start was refused ("belongs to another store")."""
    from ckptstore import tiers

    rank = [0]
    monkeypatch.setattr(tiers, "rank_and_world", lambda group=None: (rank[0], 2), raising=False)
    durable = _NoConditionalPuts(tmp_path / "durable")
    for r in (0, 1):
        rank[0], durable.blind = r, r == 1  # rank 1 looked before rank 0's put landed
        tiers.check_places({"the local tier": LocalStorage(tmp_path / f"node{r}"), "the durable store": durable})
    ident = json.loads((tmp_path / "durable" / names.STORE_ID_NAME).read_text())["id"]
    assert json.loads((tmp_path / "node0" / names.TIER_BINDING_NAME).read_text())["store"] == ident
    assert not (tmp_path / "node1" / names.TIER_BINDING_NAME).exists()  # bound at its next start:
    durable.blind = False
    tiers.check_places({"the local tier": LocalStorage(tmp_path / "node1"), "the durable store": durable})
    assert json.loads((tmp_path / "node1" / names.TIER_BINDING_NAME).read_text())["store"] == ident
    for r in (0, 1):  # every restart of either rank is let in
        rank[0] = r
        tiers.check_places({"the local tier": LocalStorage(tmp_path / f"node{r}"), "the durable store": durable})


def test_one_overlap_check_sees_an_alias_below_a_directory_not_created_yet(tmp_path, monkeypatch):
    """The overlap check ran twice (before and after binding) because a place that does
    not exist yet was not compared as a directory; a bind-mount alias of the durable
    store's directory, with the local tier below it, is refused before anything is
    written."""
    from ckptstore import tiers

    durable = tmp_path / "durable"
    durable.mkdir()
    (tmp_path / "mnt").symlink_to(durable)  # stands for a bind mount: no real path reveals it
    monkeypatch.setattr(tiers.os.path, "realpath", lambda p: os.path.abspath(p))
    places = {"the local tier": LocalStorage(tmp_path / "mnt" / "node" / "local"),
              "the durable store": LocalStorage(durable)}
    with pytest.raises(ValueError, match="device and inode"):
        tiers.refuse_overlaps(places)
    assert not (durable / "node").exists()
    for fresh in (("a", "b"), ("a", "b", "c")):  # neither created yet: judged by where they would be
        places = {"x": LocalStorage(tmp_path.joinpath(*fresh[:2])), "y": LocalStorage(tmp_path.joinpath(*fresh))}
        with pytest.raises(ValueError, match="overlap"):
            tiers.refuse_overlaps(places)
    tiers.refuse_overlaps({"x": LocalStorage(tmp_path / "a" / "b"), "y": LocalStorage(tmp_path / "a" / "c")})
