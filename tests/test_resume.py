"""Collective resume (issue 12): the newest step every rank can use, skipped steps
reported (a warning, ResumeInfo.skipped, a note ``ckptstore ls`` shows), program errors
raised rather than skipped over, RNG states re-derived when a rank reads another's.

One-process cases here; the same rules across real 2-rank gloo groups are in the
second half (ranks started by tests/resume_procs.py)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import ckptstore
from ckptstore import format as fmt, names
from ckptstore.cli import main as cli
from ckptstore.errors import UnsafeLoadError

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import resume_procs as rp  # noqa: E402
import sharded_procs as sp  # noqa: E402


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 64, generator=g), "step": step}


def _flip_a_byte(store: ckptstore.Store, step: int, rank: int = 0) -> None:
    """One flipped byte inside ``rank``'s data of ``step`` (the stored bytes of its
    first chunk: the hash check must catch it)."""
    m = store.manifest(step)
    blobs = [b for key, b in m.ranks[rank].blobs()] + [
        c.blob for e in m.tensors.values() for c in e.chunks if f"-r{rank:05d}-" in c.blob.file]
    blob = blobs[0]
    path = os.path.join(store.url, names.step_dir_name(step), blob.file)
    with open(path, "r+b") as f:
        f.seek(blob.offset + blob.length // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))


def _store_with_steps(root, steps=(10, 20, 30)) -> ckptstore.Store:
    store = ckptstore.Store(str(root), compression="none")
    for s in steps:
        store.save(s, _state(s)).result()
    return store


def test_an_empty_store_resumes_to_nothing(tmp_path):
    state, info = ckptstore.Store(str(tmp_path / "empty")).resume()
    assert state is None and info.step is None and info.skipped == () and not info.resharded


def test_the_newest_step_resumes_with_its_age_and_metrics(tmp_path):
    store = ckptstore.Store(str(tmp_path / "s"))
    store.save(7, _state(7), metrics={"loss": 1.5}).result()
    state, info = store.resume()
    assert state["step"] == 7 and torch.equal(state["w"], _state(7)["w"])
    assert (info.step, info.saved_world_size, info.world_size, info.metrics) == (7, 1, 1, {"loss": 1.5})
    assert info.age_s is not None and info.age_s >= 0 and info.generation == 1


def test_a_corrupt_newest_step_is_skipped_warned_reported_and_marked(tmp_path):
    store = _store_with_steps(tmp_path / "s")
    _flip_a_byte(store, 30)
    with pytest.warns(ckptstore.CheckpointSkippedWarning, match="step 30"):
        state, info = store.resume()
    assert state["step"] == 20 and torch.equal(state["w"], _state(20)["w"])
    assert [s.step for s in info.skipped] == [30]
    assert "IntegrityError" in info.skipped[0].reason and "rank 0" in info.skipped[0].reason
    # ls shows the note; the JSON carries the reason
    out = CliRunner().invoke(cli, ["ls", store.url, "--json"])
    records = {r["step"]: r for r in json.loads(out.output)}
    assert "IntegrityError" in records[30]["skipped_by_resume"]["reason"]
    assert "skipped_by_resume" not in records[20]
    table = CliRunner().invoke(cli, ["ls", store.url]).output
    assert "SKIPPED BY RESUME" in table


def test_a_skip_mark_goes_with_its_checkpoint_and_does_not_outlive_a_new_generation(tmp_path):
    store = _store_with_steps(tmp_path / "s")
    _flip_a_byte(store, 30)
    with pytest.warns(ckptstore.CheckpointSkippedWarning):
        store.resume()
    store.save(30, _state(30)).result()  # the step saved again: a new, sound generation
    records = {r["step"]: r for r in json.loads(CliRunner().invoke(cli, ["ls", store.url, "--json"]).output)}
    assert "skipped_by_resume" not in records[30]
    _flip_a_byte(store, 20)
    with pytest.warns(ckptstore.CheckpointSkippedWarning):
        _, info = ckptstore.Store(store.url).resume(template=None, validate=lambda s, m: s["step"] != 30)
    assert [s.step for s in info.skipped] == [30, 20] and info.step == 10
    plan = store.gc(ckptstore.checkpoint.retention.Retention(last=1), grace=0)
    assert not plan.foreign
    # retention does not count the skipped steps 30 and 20: it keeps 10, the newest usable
    assert os.listdir(tmp_path / "s") == [names.step_dir_name(10)]  # marks went with their steps


def test_validate_can_reject_a_step_with_a_reason(tmp_path):
    store = _store_with_steps(tmp_path / "s")

    def validate(state, manifest):
        assert manifest.step == state["step"]
        if state["step"] == 30:
            raise ckptstore.CheckpointRejected("loss 9.1 far from the saved 2.0")

    with pytest.warns(ckptstore.CheckpointSkippedWarning, match="far from"):
        state, info = store.resume(validate=validate)
    assert info.step == 20 and "far from the saved" in info.skipped[0].reason


def test_no_loadable_step_raises_listing_every_reason(tmp_path):
    store = _store_with_steps(tmp_path / "s", (1, 2))
    _flip_a_byte(store, 1)
    _flip_a_byte(store, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ckptstore.CheckpointSkippedWarning)
        with pytest.raises(ckptstore.NoLoadableCheckpointError, match=r"step 2: .*step 1: "):
            store.resume()
    assert store.steps() == [1, 2]  # nothing committed is touched by a resume


def test_program_errors_are_raised_not_skipped_over(tmp_path):
    store = _store_with_steps(tmp_path / "s")
    with pytest.raises(ZeroDivisionError):
        store.resume(validate=lambda s, m: 1 / 0)
    import numpy as np

    unsafe = ckptstore.Store(str(tmp_path / "u"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        unsafe.save(1, {"x": torch.ones(1)}).result()
        unsafe.save(2, {"np": np.arange(3)}).result()
    with pytest.raises(UnsafeLoadError):  # every older step could hold the same: no fallback
        unsafe.resume()
    with pytest.raises(ckptstore.TemplateMismatchError, match="shape"):  # the program's state changed
        store.resume(template={"w": torch.zeros(3), "step": 0})
    assert all(not (tmp_path / "s" / names.step_dir_name(st) / names.SKIPPED_NAME).exists() for st in (10, 20, 30))


def test_a_step_written_by_a_newer_ckptstore_is_raised_not_skipped(tmp_path):
    store = _store_with_steps(tmp_path / "s", (1, 2))
    path = tmp_path / "s" / names.step_dir_name(2) / names.manifest_name(1)
    path.write_bytes(path.read_bytes().replace(b'"format_version":%d' % fmt.FORMAT_VERSION, b'"format_version":99'))
    with pytest.raises(ckptstore.errors.UnsupportedVersionError):
        store.resume()
    assert not (tmp_path / "s" / names.step_dir_name(2) / names.SKIPPED_NAME).exists()


def test_resume_from_two_ranks_on_one_warns_and_reshards(tmp_path):
    root = tmp_path / "store"
    sp.run_job(rp.save_steps, 2, tmp_path / "save", str(root), [1, 2])
    with pytest.warns(ckptstore.WorldSizeChangedWarning):
        state, info = ckptstore.Store(str(root)).resume()
    assert (info.step, info.saved_world_size, info.world_size, info.resharded, info.rank_state_of) == (2, 2, 1, True, 0)
    assert state["rank"] == 0 and torch.equal(state["shared"], rp.shared_tensor(2))


# ----------------------------------------------------------------- 2-rank gloo groups
def test_ranks_agree_to_skip_a_step_one_rank_cannot_read(tmp_path):
    root = tmp_path / "store"
    sp.run_job(rp.save_steps, 2, tmp_path / "save", str(root), [50, 60])
    _flip_a_byte(ckptstore.Store(str(root)), 60, rank=1)
    results = sp.run_job(rp.resume_and_report, 2, tmp_path / "resume", str(root))
    for rank, res in enumerate(results):
        assert res["step"] == 50 and res["state_step"] == 50 and res["state_rank"] == rank, (rank, res)
        assert res["skipped"] == [60] and "rank 1: IntegrityError" in res["reasons"][0], (rank, res)


def test_a_program_error_on_one_rank_is_raised_on_every_rank(tmp_path):
    root = tmp_path / "store"
    sp.run_job(rp.save_steps, 2, tmp_path / "save", str(root), [1])
    results = sp.run_job(rp.resume_with_failing_validate, 2, tmp_path / "resume", str(root))
    assert results[1]["raised"] == "RuntimeError" and results[0]["raised"] == "ResumeError"
    assert "rank 1 failed" in results[0]["message"] and "validate blew up" in results[0]["message"]


def test_rank_0_failing_to_start_the_resume_fails_every_rank_without_a_hang(tmp_path):
    root = tmp_path / "store"
    sp.run_job(rp.save_steps, 2, tmp_path / "save", str(root), [1])
    (root / names.EPOCHS_DIR).mkdir()
    (root / names.EPOCHS_DIR / "epoch-9999999999.json").write_text("{}")  # no next epoch fits
    results = sp.run_job(rp.resume_claiming, 2, tmp_path / "resume", str(root))
    assert [r["raised"] for r in results] == ["ResumeError", "ResumeError"]
    assert all("epoch-9999999999.json" in r["message"] for r in results)


def test_skip_warnings_raised_as_errors_fail_every_rank_alike(tmp_path):
    root = tmp_path / "store"
    sp.run_job(rp.save_steps, 2, tmp_path / "save", str(root), [1, 2])
    _flip_a_byte(ckptstore.Store(str(root)), 2, rank=1)
    results = sp.run_job(rp.resume_with_warnings_as_errors, 2, tmp_path / "resume", str(root))
    # rank 0 warns (after the last collective: nothing hangs), rank 1 resumed
    assert results[0]["raised"] == "CheckpointSkippedWarning" and results[1]["step"] == 1


def test_one_rank_growing_to_two_rederives_the_second_ranks_rng(tmp_path):
    root = tmp_path / "store"
    store = ckptstore.Store(str(root))
    torch.manual_seed(1234)
    store.save(3, {"rng": ckptstore.rng_state(), "w": torch.ones(3)}).result()
    torch.manual_seed(1234)
    uninterrupted = torch.rand(4)
    results = sp.run_job(rp.resume_and_draw, 2, tmp_path / "resume", str(root))
    assert [r["rank_state_of"] for r in results] == [0, 0]
    assert [r["rng_rederived"] for r in results] == [False, True]
    assert all(r["warned"] for r in results)
    assert torch.equal(results[0]["draw"], uninterrupted)  # rank 0 continues the saved stream
    assert not torch.equal(results[1]["draw"], results[0]["draw"])  # rank 1 gets its own
    again = sp.run_job(rp.resume_and_draw, 2, tmp_path / "again", str(root))
    assert torch.equal(again[1]["draw"], results[1]["draw"])  # and deterministically so


def test_retention_and_gc_do_not_count_a_skipped_step_as_the_newest(tmp_path):
    store = _store_with_steps(tmp_path / "s")
    _flip_a_byte(store, 30)
    with pytest.warns(ckptstore.CheckpointSkippedWarning):
        _, info = store.resume()
    assert info.step == 20
    kept = ckptstore.Store(store.url, keep=ckptstore.checkpoint.retention.Retention(last=1), grace=0)
    kept.save(25, _state(25)).result()  # the resumed run saves; retention runs after the commit
    assert store.steps() == [25]  # not [30]: the corrupt step 30 would have been "the newest"
    # and the CLI's gc keeps the newest usable step too
    _flip_a_byte(store, 25)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ckptstore.CheckpointSkippedWarning)
        with pytest.raises(ckptstore.NoLoadableCheckpointError):
            store.resume()
    out = CliRunner().invoke(cli, ["gc", store.url, "--keep-last", "1", "--grace", "0s", "--json"])
    assert out.exit_code == 0, out.output
    assert store.steps() == [25]  # never everything: when every step was skipped, the newest stays


def test_rng_states_in_tuples_are_rederived_and_hostile_skip_reasons_print_escaped(tmp_path):
    from ckptstore.resume import _rederive_rng

    state = {"pair": (ckptstore.rng_state(), 3)}
    out, found = _rederive_rng(state, rank=5)
    assert found and out["pair"][0]["rank"] == 5 and out["pair"][1] == 3
    store = _store_with_steps(tmp_path / "s", (1, 2))
    from ckptstore.checkpoint.catalog import skip_mark

    mark = skip_mark(store.location(2), 2, "bad\x1b[2J\rbyte", "x")  # bound to step 2's manifest
    (tmp_path / "s" / names.step_dir_name(2) / names.SKIPPED_NAME).write_text(json.dumps(mark))
    table = CliRunner().invoke(cli, ["ls", store.url]).output
    assert "\x1b" not in table and "\r" not in table and "bad\\x1b[2J\\rbyte" in table


# ---------------------------------------------------------------------------- issue 34
@pytest.mark.parametrize("verdict", ["tensor", "numpy", "zero", "empty"])
def test_validate_is_judged_by_truth_value(tmp_path, verdict):
    """``validate`` returning ``torch.tensor(False)``, ``numpy.False_`` or ``0`` was taken
    for acceptance (``is False``): the step it rejected was loaded."""
    import numpy

    rejected = {"tensor": torch.tensor(False), "numpy": numpy.False_, "zero": 0, "empty": ""}[verdict]
    store = _store_with_steps(tmp_path / "s")
    with pytest.warns(ckptstore.CheckpointSkippedWarning, match="rejected by validate"):
        state, info = store.resume(validate=lambda s, m: rejected if s["step"] == 30 else torch.tensor(True))
    assert state["step"] == 20 and info.step == 20 and [s.step for s in info.skipped] == [30]
    assert "rejected by validate()" in info.skipped[0].reason
    # None (no return value) still accepts, as documented
    assert store.resume(validate=lambda s, m: None)[1].step == 30


def test_validate_without_a_single_truth_value_is_an_error_not_a_guess(tmp_path):
    import numpy

    store = _store_with_steps(tmp_path / "s")
    for ambiguous in (torch.tensor([True, False]), numpy.array([True, True])):
        with pytest.raises(TypeError, match="no single truth value.*CheckpointRejected"):
            store.resume(validate=lambda s, m: ambiguous)
    assert store.steps() == [10, 20, 30]  # nothing skipped, nothing marked
    assert not any((tmp_path / "s" / names.step_dir_name(s) / names.SKIPPED_NAME).exists() for s in (10, 20, 30))


def _mark(store, step: int, **fields) -> None:
    mark = {"step": step, "generation": 1, "reason": "forged", "at": "x", **fields}
    (Path(store.url) / names.step_dir_name(step) / names.SKIPPED_NAME).write_text(json.dumps(mark))


def test_a_skip_mark_not_bound_to_its_manifest_never_makes_gc_delete_the_newest_step(tmp_path):
    """A forged or stale ``resume-skipped.json`` on the newest good step (right step and
    generation) made ``gc --keep-last 1`` delete that step, which resume would load."""
    store = _store_with_steps(tmp_path / "s", (10, 20))
    _mark(store, 20)  # forged, as an older ckptstore wrote them: no attempt, no hash
    out = CliRunner().invoke(cli, ["gc", store.url, "--keep-last", "1", "--grace", "0s", "--json"])
    assert out.exit_code == 0, out.output
    assert store.steps() == [20] and store.resume()[1].step == 20
    records = {r["step"]: r for r in json.loads(CliRunner().invoke(cli, ["ls", store.url, "--json"]).output)}
    assert "skipped_by_resume" not in records[20] and "ignored" in records[20]["skip_mark"]
    assert "skip mark ignored" in CliRunner().invoke(cli, ["ls", store.url]).output

    from ckptstore.checkpoint.catalog import SKIP_MARK_DIGEST, skip_mark


    # stale: a mark left of an earlier step 30 (a gc killed between its manifest and its
    # mark), then step 30 saved again as generation 1 under a new attempt
    store.save(30, _state(30)).result()
    old = skip_mark(store.location(30), 30, "corrupt, long ago", "x")
    store.save(40, _state(40)).result()
    shutil.rmtree(Path(store.url) / names.step_dir_name(30))
    store.save(30, _state(30)).result()
    (Path(store.url) / names.step_dir_name(30) / names.SKIPPED_NAME).write_text(json.dumps(old))
    shutil.rmtree(Path(store.url) / names.step_dir_name(40))
    assert old["generation"] == store.manifest(30).generation and old["attempt"] != store.manifest(30).attempt
    records = {r["step"]: r for r in json.loads(CliRunner().invoke(cli, ["ls", store.url, "--json"]).output)}
    assert "attempt" in records[30]["skip_mark"]
    out = CliRunner().invoke(cli, ["gc", store.url, "--keep-last", "1", "--grace", "0s", "--json"])
    assert out.exit_code == 0, out.output
    assert store.steps() == [30] and store.resume()[1].step == 30
    # forged with the step, generation and attempt right, the bytes' hash wrong
    _mark(store, 30, attempt=store.manifest(30).attempt, **{SKIP_MARK_DIGEST: "0" * 32})
    records = {r["step"]: r for r in json.loads(CliRunner().invoke(cli, ["ls", store.url, "--json"]).output)}
    assert "xxh3-128 differs" in records[30]["skip_mark"] and "skipped_by_resume" not in records[30]


def test_a_mark_bound_to_its_manifest_still_counts(tmp_path):
    """The mark a resume writes names the step, generation, attempt and manifest hash it
    judged; gc keeps honouring it (and status passes over the step) while they match."""
    from ckptstore.checkpoint.catalog import SKIP_MARK_DIGEST, manifest_digest
    from ckptstore.storage import open_storage
    from ckptstore.supervisor.status import newest_checkpoint

    store = _store_with_steps(tmp_path / "s")
    with pytest.warns(ckptstore.CheckpointSkippedWarning):
        store.resume(validate=lambda s, m: s["step"] != 30)
    mark = json.loads((Path(store.url) / names.step_dir_name(30) / names.SKIPPED_NAME).read_text())
    m = store.manifest(30)
    assert (mark["step"], mark["generation"], mark["attempt"]) == (30, m.generation, m.attempt)
    assert mark[SKIP_MARK_DIGEST] == manifest_digest(store.location(30), m.generation)
    assert newest_checkpoint(open_storage(store.url))["step"] == 20
    store.gc(ckptstore.checkpoint.retention.Retention(last=1), grace=0)
    assert store.steps() == [20]


def test_status_reports_the_step_saved_again_after_a_skip(tmp_path):
    """Resume skipped step 30, the job went on and saved step 30 again (a new
    generation): status still reported step 20, though resume uses the new 30."""
    from ckptstore.storage import open_storage
    from ckptstore.supervisor.journal import Journal
    from ckptstore.supervisor.status import status

    store = _store_with_steps(tmp_path / "s")
    _flip_a_byte(store, 30)
    with pytest.warns(ckptstore.CheckpointSkippedWarning):
        assert store.resume()[1].step == 20
    store.save(30, _state(30)).result()  # the resumed job reaches step 30 again
    Journal(store.storage, "run-1").append("run_start")
    assert store.resume()[1].step == 30
    assert status(open_storage(store.url))["checkpoint_step"] == 30
    r = CliRunner().invoke(cli, ["status", store.url, "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["checkpoint_step"] == 30


def _legacy_mark(store, step: int, at: str) -> None:
    """The skip mark the previous release's resume wrote: {step, generation, reason, at}."""
    mark = {"step": step, "generation": store.manifest(step).generation, "reason": "IntegrityError: old", "at": at}
    (Path(store.url) / names.step_dir_name(step) / names.SKIPPED_NAME).write_text(json.dumps(mark))


def test_a_previous_release_skip_mark_is_honoured_and_gc_keeps_the_newest_loadable_step(tmp_path):
    """Review of issue 34: a mark without ``attempt`` and hash (every mark the previous
    release wrote) was ignored, so ``gc --keep-last 1`` kept the corrupt step 3 and
    deleted step 2, and resume found nothing loadable."""
    store = _store_with_steps(tmp_path / "s", (1, 2, 3))
    _flip_a_byte(store, 3)
    _legacy_mark(store, 3, fmt.utc_now())  # written by a resume after step 3's commit
    records = {r["step"]: r for r in json.loads(CliRunner().invoke(cli, ["ls", store.url, "--json"]).output)}
    assert records[3]["skipped_by_resume"]["reason"] == "IntegrityError: old" and "skip_mark" not in records[3]
    out = CliRunner().invoke(cli, ["gc", store.url, "--keep-last", "1", "--grace", "0s", "--json"])
    assert out.exit_code == 0, out.output
    # step 2 is the newest usable one; step 3 stays too: a mark not bound to the
    # manifest's bytes may only ever make gc keep more
    assert store.steps() == [2, 3]
    with pytest.warns(ckptstore.CheckpointSkippedWarning):
        assert store.resume()[1].step == 2


def test_an_unbound_skip_mark_never_makes_gc_keep_less(tmp_path):
    """An old-format mark that matches step, generation and time but is wrong (forged,
    or about bytes that were since repaired) on the newest good step: gc keeps it, as it
    would with no mark, and the newest usable step below it as the mark asks."""
    store = _store_with_steps(tmp_path / "s", (10, 20, 30))
    _legacy_mark(store, 30, fmt.utc_now())
    store.gc(ckptstore.checkpoint.retention.Retention(last=1), grace=0)
    assert store.steps() == [20, 30] and store.resume()[1].step == 30
    from ckptstore.checkpoint.retention import UNBOUND, Candidate, KeepBest, Retention, select_kept

    cands = [Candidate("a", 1, 1.0, {"loss": 1.0}, False), Candidate("b", 2, 2.0, {"loss": 0.5}, False, UNBOUND)]
    for policy in (Retention(last=1), Retention(best=KeepBest("loss", "min", 1)), Retention(last=2)):
        without = select_kept([Candidate(c.name, c.step, c.committed_at, c.metrics, False) for c in cands], policy, 9)
        assert set(without) <= set(select_kept(cands, policy, 9)), policy


def test_a_previous_release_mark_older_than_the_manifest_is_ignored(tmp_path):
    """A stale old-format mark (written for an earlier checkpoint of the step, before
    the manifest now there was committed) is not acted on; a mark missing a field says
    which, not that it names the placeholder 'nothing'."""
    from ckptstore.checkpoint.catalog import SKIP_MARK_DIGEST, manifest_digest

    store = _store_with_steps(tmp_path / "s", (10, 20))
    _legacy_mark(store, 20, "2000-01-01T00:00:00+00:00")
    records = {r["step"]: r for r in json.loads(CliRunner().invoke(cli, ["ls", store.url, "--json"]).output)}
    assert "skipped_by_resume" not in records[20] and "before the manifest was committed" in records[20]["skip_mark"]
    store.gc(ckptstore.checkpoint.retention.Retention(last=1), grace=0)
    assert store.steps() == [20]
    m = store.manifest(20)
    _mark(store, 20, **{SKIP_MARK_DIGEST: manifest_digest(store.location(20), m.generation)})  # no attempt
    records = {r["step"]: r for r in json.loads(CliRunner().invoke(cli, ["ls", store.url, "--json"]).output)}
    assert records[20]["skip_mark"] == "ignored: it has no attempt field"
