"""gc beside saves that commit while it runs, even with ``--grace 0`` (issue 34): the
commit mark and gc's claim (ckptstore/checkpoint/claims.py, docs/format.md "Commits
beside gc"), forced into each interleaving at the exact point, in one process; and
what gc tells of the data it leaves for a later run (pending, released).

Rank 1 of the two-rank saves here is simulated in-process (test_indexes.other_rank
writes its data file and vote), so each test runs in a second or two."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import threading
import time

import torch
from cliutil import age_files, cli, failed_attempt
from test_incremental import hooked, model_state, rolled_back_to_step_1, same, verified
from test_indexes import other_rank, rank_state

import ckptstore
from ckptstore import names
from ckptstore.checkpoint import gc as gc_mod
from ckptstore.checkpoint.retention import Retention
from ckptstore.checkpoint.save import SaveOptions, start_save
from ckptstore.errors import CommitError
from ckptstore.runtime import runtime
from ckptstore.storage import LocalStorage

TIMEOUT = 120
STEP1 = names.step_dir_name(1)


def state(step: int) -> dict:
    return {"w": torch.full((256,), float(step)), "step": step}


class Rank0:
    """Rank 0 of a two-rank save of ``state(1)`` to step 1, waiting for rank 1's vote
    once its data and vote are written; with ``gated``, its manifest write then waits
    for ``go`` (``at`` is set when it got there: every check before it done)."""

    def __init__(self, root, gated: bool = False):
        self.where = os.path.join(root, STEP1)
        self.attempt = names.new_attempt_id()
        self.at, self.go = threading.Event(), threading.Event()
        voted = threading.Event()
        outer = self

        class Observed(LocalStorage):
            def put(self, key, data, *, if_absent=False):
                if gated and names.parse_manifest_name(key) is not None:
                    outer.at.set()
                    assert outer.go.wait(TIMEOUT)
                super().put(key, data, if_absent=if_absent)
                if key.endswith("/vote-r00000.json"):
                    voted.set()

        self.future = start_save(state(1), Observed(self.where), rt=runtime(), attempt=self.attempt, step=1, rank=0,
                                 world_size=2, metrics=None, options=SaveOptions(commit_timeout=TIMEOUT))
        assert voted.wait(TIMEOUT)

    def rank1_votes(self) -> None:
        other_rank(LocalStorage(self.where), self.attempt, 1, 2, rank_state(1), step=1)


def store_with_step_0(tmp_path) -> str:
    root = str(tmp_path / "store")
    ckptstore.Store(root).save(0, state(0)).result()
    return root


def planned_with_grace_0(root, rank0: Rank0) -> gc_mod.GcPlan:
    """gc --grace 0's plan while rank 0 waits for its peer: the attempt looks like debris."""
    plan = gc_mod.plan(LocalStorage(root), Retention(), grace=0)
    assert [(d.kind, d.location, d.attempts) for d in plan.deletions] == [("attempt", STEP1, (rank0.attempt,))]
    return plan


def assert_committed_whole(root) -> None:
    assert ckptstore.verify(os.path.join(root, STEP1)) == []
    assert torch.equal(ckptstore.Store(root).load(1, rank=0)["w"], state(1)["w"])


def test_I7_a_commit_that_checked_its_files_before_gc_looked_keeps_them_with_grace_0(tmp_path):
    """gc (--grace 0) planned while the save waited for a vote; right as gc looks at the
    location again, the vote comes and the committer gets through every check to its
    manifest write. gc deleted the files it had planned to (its re-check saw no
    manifest yet), and the manifest then named them: a committed step that could not
    load. The committer's fresh commit mark now keeps the attempt whole."""
    root = store_with_step_0(tmp_path)
    rank0 = Rank0(root, gated=True)
    plan = planned_with_grace_0(root, rank0)
    fired = []

    class AtTheRecheck(LocalStorage):  # gc's first look at step 1 again, before it deletes
        def list(self, prefix=""):
            if not fired and self.describe().endswith(STEP1) and prefix == "":
                fired.append(prefix)
                rank0.rank1_votes()
                assert rank0.at.wait(TIMEOUT)  # its checks are done; the manifest is next
            return super().list(prefix)

    gc_mod.execute(AtTheRecheck(root), plan)
    rank0.go.set()
    assert fired and rank0.future.result(TIMEOUT).attempt == rank0.attempt
    assert_committed_whole(root)
    [d] = plan.deletions
    assert d.skipped is not None and "being committed" in d.skipped, d


def test_I7_a_commit_that_looks_after_gc_claimed_its_attempt_refuses(tmp_path):
    """The other order: gc has looked (no manifest, no commit mark) and is about to
    delete the attempt's files when the vote comes and the committer runs its checks,
    on files still all there, and commits; gc then deleted them. The committer now finds
    gc's claim at its last look and commits nothing."""
    root = store_with_step_0(tmp_path)
    rank0 = Rank0(root)
    plan = planned_with_grace_0(root, rank0)
    fired = []

    class AtTheDeletion(LocalStorage):
        def delete_many(self, keys):
            keys = list(keys)
            if not fired and any(f"/{rank0.attempt}/data-" in k for k in keys):
                fired.append(keys)
                rank0.rank1_votes()
                rank0.future.exception(TIMEOUT)  # committed or refused: settled before gc deletes
            return super().delete_many(keys)

    gc_mod.execute(AtTheDeletion(root), plan)
    assert fired
    error = rank0.future.exception(0)
    if error is None:  # committed: then whole
        assert_committed_whole(root)
    assert isinstance(error, CommitError) and "claimed by gc" in str(error), error
    assert ckptstore.Store(root).steps() == [0]
    assert not [n for n in os.listdir(os.path.join(root, STEP1)) if names.parse_manifest_name(n)]
    assert json.loads(cli("gc", root, "--grace", "0", "--json").stdout)["pending"] == []  # its claim went too
    assert not os.path.exists(os.path.join(root, STEP1))


def test_I8_gc_grace_0_keeps_a_dropped_base_that_a_commit_in_flight_references(tmp_path):
    """``ckptstore gc --keep-last 1 --grace 0`` drops the base of an incremental save
    after the save checked it, before its manifest lands: the base's files went with
    their manifest, and the new step referenced missing files. gc now sees the commit
    in flight once the base's manifest is gone and leaves its files; a run after the
    commit deletes them once no manifest reads them."""
    root = tmp_path / "s"
    store = rolled_back_to_step_1(root)
    reports = []
    fired = hooked(store, "put", lambda view, key: names.parse_manifest_name(key) is not None,
                   lambda: reports.append(json.loads(cli("gc", str(root), "--keep-last", "1", "--grace", "0",
                                                         "--json").stdout)))
    store.save(2, model_state(2)).result()
    assert len(fired) == 1 and names.step_dir_name(2) in fired[0]
    assert same(store.load(2), model_state(2)) and verified(root)
    [report] = reports  # (step 2's generation 1 went too: step 3 is the one kept)
    deleted = {d["location"]: d["reason"] for d in report["deleted"] if d["kind"] == "checkpoint"}
    assert sorted(deleted) == [names.step_dir_name(1), names.step_dir_name(2)]
    assert "a save is committing" in deleted[names.step_dir_name(1)], deleted
    assert {b.step for _, _, b in store.manifest(2).blobs() if b.step is not None} == {1}
    # Once no manifest reads them, a later run deletes them.
    cli("gc", str(root), "--keep-last", "1", "--grace", "0")
    assert ckptstore.Store(root).steps() == [3] and not (root / names.step_dir_name(1)).exists()


# ---------------------------------------------------------------------------- what gc leaves for later
def _iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat(timespec="seconds")


def _newest_mtime(directory) -> float:
    return max(os.stat(os.path.join(d, f)).st_mtime for d, _, fs in os.walk(directory) for f in fs)


def test_gc_dry_run_after_a_failed_save_lists_its_debris_and_when_it_becomes_deletable(tmp_path):
    root = store_with_step_0(tmp_path)
    attempt = failed_attempt(LocalStorage(os.path.join(root, STEP1)), state(1), rank=0, step=1)
    attempt_dir = os.path.join(root, STEP1, names.ATTEMPTS_DIR, attempt)
    when = _newest_mtime(attempt_dir) + 6 * 3600
    files = len(os.listdir(attempt_dir))
    text = cli("gc", root, "--dry-run")
    assert text.exit_code == 0, text.output
    [line] = [line for line in text.stdout.splitlines() if attempt in line]
    stamp = dt.datetime.fromtimestamp(when, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    assert line.startswith(f"pending attempt    {STEP1}: {attempt} aborted; deletable from {stamp} (in ")
    assert f"{files} file(s)" in line
    assert "pending 1 item(s)" in text.stdout.splitlines()[-1]
    report = json.loads(cli("gc", root, "--dry-run", "--json").stdout)
    assert report["deleted"] == [] and report["pending"] == [
        {"kind": "attempt", "location": STEP1, "name": attempt, "reason": "aborted", "files": files,
         "bytes": sum(os.path.getsize(os.path.join(attempt_dir, f)) for f in os.listdir(attempt_dir)),
         "deletable_at": _iso(when)}]
    # idle past the grace, it goes (and is no longer pending)
    age_files(attempt_dir, 6 * 3600 + 60)
    report = json.loads(cli("gc", root, "--json").stdout)
    assert [(d["kind"], d["location"]) for d in report["deleted"]] == [("attempt", STEP1)]
    assert report["pending"] == [] and not os.path.exists(os.path.join(root, STEP1))


def test_gc_says_what_it_released_and_a_later_run_what_is_still_pending(tmp_path):
    """A bare policy run frees nothing at once: the dropped steps' files are released
    for the grace. The report says how much (bytes, files) and from when a run deletes
    it; the next run lists each released attempt as pending, with that time."""
    root = str(tmp_path / "store")
    store = ckptstore.Store(root)
    for step in (0, 1, 2):
        store.save(step, state(step)).result()
    dropped = {s: os.path.join(root, names.step_dir_name(s), names.ATTEMPTS_DIR, store.manifest(s).attempt)
               for s in (0, 1)}
    nbytes = sum(os.path.getsize(os.path.join(p, f)) for p in dropped.values() for f in os.listdir(p))
    nfiles = sum(len(os.listdir(p)) for p in dropped.values())
    before = time.time()
    report = json.loads(cli("gc", root, "--keep-last", "1", "--json").stdout)
    after = time.time()
    assert report["bytes"] == 0 and (report["released_bytes"], report["released_files"]) == (nbytes, nfiles)
    assert _iso(before + 6 * 3600) <= report["released_deletable_at"] <= _iso(after + 6 * 3600)
    text = cli("gc", root, "--dry-run").stdout
    assert "deletable from" in text and "pending 2 item(s)" in text.splitlines()[-1]
    later = json.loads(cli("gc", root, "--json").stdout)
    assert later["deleted"] == [] and later["released_bytes"] == 0
    assert sorted((p["location"], p["name"], p["reason"], p["deletable_at"]) for p in later["pending"]) == [
        (names.step_dir_name(s), os.path.basename(dropped[s]), "released",
         _iso(os.stat(os.path.join(dropped[s], names.RELEASED_LEAF)).st_mtime + 6 * 3600)) for s in (0, 1)]
    assert later["pending_bytes"] == sum(p["bytes"] for p in later["pending"]) > nbytes  # (the marks too)


def test_gc_text_summary_names_the_released_bytes_and_files(tmp_path):
    root = str(tmp_path / "store")
    store = ckptstore.Store(root)
    for step in (0, 1):
        store.save(step, state(step)).result()
    attempt = os.path.join(root, names.step_dir_name(0), names.ATTEMPTS_DIR, store.manifest(0).attempt)
    files = len(os.listdir(attempt))
    last = cli("gc", root, "--keep-last", "1").stdout.splitlines()[-1]
    assert re.fullmatch(rf"deleted 1 item\(s\), 0 B; released [0-9.]+ (B|KiB) in {files} file\(s\): a gc run "
                        r"from \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC \(in [56]h \d+m\) deletes it; "
                        r"kept 1 checkpoint\(s\)", last), last


# ---------------------------------------------------------------------------- review of issue 34
def _plant_mark(root, step: int, generation: int, mtime: float) -> str:
    """An attempt of ``step`` holding a data file and a commit mark naming ``generation``,
    the mark dated ``mtime`` (a hostile file, or one restored with its times)."""
    attempt = names.new_attempt_id()
    d = os.path.join(root, names.step_dir_name(step), names.ATTEMPTS_DIR, attempt)
    os.makedirs(d)
    with open(os.path.join(d, "data-r00000-s00.bin"), "wb") as f:
        f.write(b"x" * 100)
    mark = os.path.join(d, names.COMMITTING_LEAF)
    with open(mark, "w") as f:
        json.dump({"attempt": attempt, "generation": generation, "at": "2030-01-01T00:00:00Z"}, f)
    os.utime(mark, (mtime, mtime))
    return attempt


def test_I8_a_future_dated_commit_mark_does_not_keep_gc_from_deleting_data_anywhere(tmp_path):
    """One commit mark dated years ahead (planted, restored by ``rsync -a``, a clock far
    off) counted as fresh until then: ``gc --keep-last 1 --grace 0`` deleted the dropped
    steps' manifests and kept all their data, "deletable from" that date. A mark dated
    beyond the clock tolerance is no commit in flight."""
    root = str(tmp_path / "store")
    store = ckptstore.Store(root)
    for step in (1, 2, 3, 4):
        store.save(step, state(step)).result()
    _plant_mark(root, 9, 1, time.time() + 4 * 365 * 86400)
    report = json.loads(cli("gc", root, "--keep-last", "1", "--grace", "0", "--json").stdout)
    assert report["skipped"] == [], report["skipped"]
    assert sorted(os.listdir(root)) == [names.step_dir_name(4)]  # the planted attempt went too (idle, grace 0)
    assert report["pending"] == [] and ckptstore.Store(root).steps() == [4]


def test_a_commit_mark_counts_while_dated_within_the_clock_tolerance_of_now(tmp_path):
    """A mark counts for the lease (120 s) after its date, and from up to the clock
    tolerance (60 s) before it; one dated later than that is no commit in flight."""
    from ckptstore.checkpoint import claims

    root = str(tmp_path / "store")
    now = 2_000_000_000.0
    where = LocalStorage(os.path.join(root, names.step_dir_name(9)))

    def check(ahead: float, fresh: bool) -> None:
        attempt = _plant_mark(root, 9, 1, now + ahead)
        assert claims.committing(where, attempt, now + ahead, [], now) is fresh, ahead
        assert claims.committing(where, attempt, now + ahead, [1], now) is False  # generation 1 is there

    for ahead, fresh in [(-119, True), (-120, False), (0, True), (30, True), (600, False), (4 * 365 * 86400, False)]:
        check(ahead, fresh)
    check(claims.MARK_CLOCK_TOLERANCE, True)
    check(claims.MARK_CLOCK_TOLERANCE + 1, False)


def test_a_commit_leaves_no_commit_mark_behind(tmp_path):
    """Every committed attempt kept its ``committing.json`` (which an older ckptstore's gc
    reports as foreign): it goes once the manifest landed."""
    root = store_with_step_0(tmp_path)
    rank0 = Rank0(root)
    rank0.rank1_votes()
    manifest = rank0.future.result(TIMEOUT)
    for step, attempt in [(0, ckptstore.Store(root).manifest(0).attempt), (1, manifest.attempt)]:
        attempt_dir = os.path.join(root, names.step_dir_name(step), names.ATTEMPTS_DIR, attempt)
        assert names.COMMITTING_LEAF not in os.listdir(attempt_dir), os.listdir(attempt_dir)
    assert_committed_whole(root)


class SteppedClock:
    """time.monotonic, moved ahead by ``jump`` whenever a store writes a key ending in
    ``leaf`` (a slow but healthy store: an fsync on loaded Lustre, S3 retrying SlowDown)."""

    def __init__(self, monkeypatch, leaf: str, jumps):
        self.real, self.offset, self.leaf, self.jumps, self.writes = time.monotonic, 0.0, leaf, jumps, 0
        monkeypatch.setattr(time, "monotonic", self)

    def __call__(self) -> float:
        return self.real() + self.offset

    def storage(self, root):
        clock = self

        class Slow(LocalStorage):
            def put(self, key, data, *, if_absent=False):
                super().put(key, data, if_absent=if_absent)
                if key.endswith(clock.leaf):
                    clock.writes += 1
                    clock.offset += clock.jumps(clock.writes)
        return Slow(root)


def _save_step_1(storage, timeout: float):
    return start_save(state(1), storage, rt=runtime(), attempt=names.new_attempt_id(), step=1, rank=0,
                      world_size=1, metrics=None, options=SaveOptions(commit_timeout=timeout))


def test_a_commit_whose_mark_write_takes_longer_than_15s_commits_on_a_slow_healthy_store(tmp_path, monkeypatch):
    """Each write of the commit mark takes 20 s (its fsync): the checks overran the 15 s
    window every time and the third overrun aborted the commit, though every byte was
    durable. The window is half the lease now."""
    clock = SteppedClock(monkeypatch, names.COMMITTING_LEAF, lambda n: 20.0)
    root = store_with_step_0(tmp_path)
    manifest = _save_step_1(clock.storage(os.path.join(root, STEP1)), 3600).result(TIMEOUT)
    assert manifest.step == 1 and clock.writes == 1
    monkeypatch.undo()
    assert_committed_whole(root)


def test_a_commit_marks_and_checks_again_until_its_own_timeout(tmp_path, monkeypatch):
    """Checks that overrun the window run again after a new mark, not three times only:
    as long as the commit's timeout allows (here the fifth try keeps to the window)."""
    clock = SteppedClock(monkeypatch, names.COMMITTING_LEAF, lambda n: 70.0 if n <= 4 else 0.0)
    root = store_with_step_0(tmp_path)
    manifest = _save_step_1(clock.storage(os.path.join(root, STEP1)), 3600).result(TIMEOUT)
    assert manifest.step == 1 and clock.writes == 5
    monkeypatch.undo()
    assert_committed_whole(root)


def test_a_commit_whose_checks_overrun_until_its_timeout_is_refused_and_takes_its_mark_back(tmp_path, monkeypatch):
    clock = SteppedClock(monkeypatch, names.COMMITTING_LEAF, lambda n: 70.0)
    root = store_with_step_0(tmp_path)
    error = _save_step_1(clock.storage(os.path.join(root, STEP1)), 300).exception(TIMEOUT)
    monkeypatch.undo()
    assert isinstance(error, CommitError) and "until the commit's timeout" in str(error), error
    assert clock.writes == 5  # 70 s each: the fifth ended past the 300 s left
    [attempt] = os.listdir(os.path.join(root, STEP1, names.ATTEMPTS_DIR))
    left = os.listdir(os.path.join(root, STEP1, names.ATTEMPTS_DIR, attempt))
    assert names.ABORT_LEAF in left and names.COMMITTING_LEAF not in left, left
    assert ckptstore.Store(root).steps() == [0]


def test_I8_gc_whose_release_marks_overrun_the_window_keeps_that_checkpoint_and_says_so(tmp_path, monkeypatch):
    """Release marks that took longer than the window three times: gc went on and deleted
    the manifest all the same, outside the timing a commit that checked it as its base
    relies on. It now leaves that checkpoint (manifest and files) to a later run, and
    says why."""
    root = str(tmp_path / "store")
    store = ckptstore.Store(root)
    for step in (0, 1):
        store.save(step, state(step)).result()
    plan = gc_mod.plan(LocalStorage(root), Retention(last=1))
    [d] = plan.deletions
    assert (d.kind, d.location, len(d.release)) == ("checkpoint", names.step_dir_name(0), 1)
    clock = SteppedClock(monkeypatch, names.RELEASED_LEAF, lambda n: 70.0)
    gc_mod.execute(clock.storage(root), plan)
    monkeypatch.undo()
    assert clock.writes == 3 and d.skipped is not None and "release marks took longer than" in d.skipped, d
    assert ckptstore.Store(root).steps() == [0, 1]
    assert ckptstore.verify(os.path.join(root, names.step_dir_name(0))) == []  # its files all there
