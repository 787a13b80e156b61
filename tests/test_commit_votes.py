"""The committer's gathering of votes: each vote is read once, however many times the
committer polls for the last ones, and a bad vote is reported in rank order (issue 18:
a commit whose cost does not grow with the polls times the ranks)."""

from __future__ import annotations

import pickle
import threading

import pytest
import torch

from ckptstore import format as fmt
from ckptstore import names
from ckptstore.checkpoint.follower import await_outcome
from ckptstore.checkpoint.retire import attempt_files
from ckptstore.checkpoint.votes import abort, read_outcome, read_votes
from ckptstore.errors import CommitError
from ckptstore.checkpoint.save import SaveOptions, start_save
from ckptstore.hashing import digest
from ckptstore.runtime import runtime
from ckptstore.storage import LocalStorage

HANG_GUARD_S = 120


def test_a_committer_waiting_for_the_last_vote_reads_every_vote_once(tmp_path):
    reads: dict[str, int] = {}
    lists = threading.Semaphore(0)

    class Counting(LocalStorage):
        def read(self, key, *args, **kwargs):
            if names.parse_vote_leaf(key.rsplit("/", 1)[-1]) is not None:
                reads[key] = reads.get(key, 0) + 1
            return super().read(key, *args, **kwargs)

        def walk(self, prefix=""):
            if prefix.startswith(names.ATTEMPTS_DIR):
                lists.release()  # one poll of the attempt directory
            return super().walk(prefix)

    where = Counting(str(tmp_path / "ckpt"))
    attempt = names.new_attempt_id()
    other_rank(where, attempt, 1, 3)
    committer = start_save({"w": torch.zeros(4)}, where, rt=runtime(), attempt=attempt, step=None, rank=0,
                           world_size=3, metrics=None, options=SaveOptions(commit_timeout=HANG_GUARD_S, indexed=False))  # (other_rank: version 3 votes)
    for _ in range(3):  # the committer has polled three times: rank 1's vote is there, rank 2's is not
        assert lists.acquire(timeout=HANG_GUARD_S)
    other_rank(where, attempt, 2, 3)
    manifest = committer.result(timeout=HANG_GUARD_S)
    assert manifest.world_size == 3
    assert sorted(reads.values()) == [1, 1], reads  # ranks 1 and 2: once each


def other_rank(where, attempt: str, rank: int, world: int) -> None:
    """What another rank's process leaves: its data file (a skeleton) and its vote."""
    data = pickle.dumps({"rank": rank})
    file = names.data_file_name(attempt, rank, 0)
    where.put(file, data)
    skeleton = fmt.Blob(file, 0, len(data), len(data), (), digest(data))
    where.put(names.vote_name(attempt, rank),
              fmt.Vote(attempt, None, world, rank, ok=True, state=fmt.RankState(rank, skeleton, {})).to_bytes())


def test_votes_read_in_parallel_report_the_first_bad_one_in_rank_order(tmp_path):
    where = LocalStorage(str(tmp_path / "ckpt"))
    attempt = names.new_attempt_id()
    for rank in range(1, 9):
        vote = fmt.Vote(attempt, None, 9, rank, ok=False, error="no")
        where.put(names.vote_name(attempt, rank), b"not json" if rank in (3, 6) else vote.to_bytes())
    try:
        read_votes(where, attempt, pool=runtime().readers)
    except fmt.FormatError as e:
        assert "vote-r00003" in str(e)
    else:
        raise AssertionError("a bad vote was not reported")
    votes = read_votes(where, attempt, have={3, 6}, pool=runtime().readers)
    assert sorted(votes) == [1, 2, 4, 5, 7, 8] and not any(v.ok for v in votes.values())


def test_a_listing_that_lags_the_manifest_write_is_given_a_moment_before_retiring(tmp_path, recwarn):
    """Some S3-compatible stores list a key a moment after it was written: the
    committer looks again (bounded) before it gives up retiring the older generation."""

    class Lagging(LocalStorage):
        lag = 0  # listings that do not show the newest manifest yet

        def list(self, prefix=""):
            names_ = super().list(prefix)
            if prefix == "" and self.lag and names.manifest_name(2) in names_:
                self.lag -= 1
                names_ = [n for n in names_ if n != names.manifest_name(2)]
            return names_

    where = Lagging(str(tmp_path / "ckpt"))

    def save(value: float):
        return start_save({"w": torch.full((4,), value)}, where, rt=runtime(), attempt=names.new_attempt_id(),
                          step=None, rank=0, world_size=1, metrics=None,
                          options=SaveOptions(commit_timeout=HANG_GUARD_S)).result(timeout=HANG_GUARD_S)

    save(1.0)
    where.lag = 2
    assert save(2.0).generation == 2
    assert where.lag == 0  # the lag was met ...
    assert not where.exists(names.manifest_name(1))  # ... and generation 1 retired all the same
    assert not [w for w in recwarn if "retiring older ones failed" in str(w.message)]


# ---------------------------------------------------------------------------- the outcome the waiting ranks poll
def committed_world(tmp_path, world: int = 3):
    """A committed checkpoint of ``world`` simulated ranks: (location, attempt, manifest)."""
    where = LocalStorage(str(tmp_path / "ckpt"))
    attempt = names.new_attempt_id()
    for r in range(1, world):
        other_rank(where, attempt, r, world)
    manifest = start_save({"w": torch.zeros(4)}, where, rt=runtime(), attempt=attempt, step=None, rank=0,
                          world_size=world, metrics=None,
                          options=SaveOptions(commit_timeout=HANG_GUARD_S, indexed=False)).result(HANG_GUARD_S)
    return where, attempt, manifest


def test_the_committer_tells_the_waiting_ranks_its_generation(tmp_path):
    where, attempt, manifest = committed_world(tmp_path)
    assert read_outcome(where, attempt) == {"committed": manifest.generation}
    assert await_outcome(where, attempt, HANG_GUARD_S, 1, 3).attempt == attempt


def test_an_outcome_never_written_delays_a_waiting_rank_but_does_not_fail_it(tmp_path):
    """The committer died between its manifest and its outcome: a full look (every
    FULL_LOOK_EVERY polls) finds the manifest."""
    where, attempt, manifest = committed_world(tmp_path)
    where.delete(names.outcome_name(attempt))
    assert await_outcome(where, attempt, HANG_GUARD_S, 1, 3).generation == manifest.generation


def test_a_commit_that_raced_an_abort_stands_for_the_waiting_ranks(tmp_path):
    """A rank aborted after the committer's last listing and the manifest landed: the
    outcome says aborted, but the manifest names the attempt, so the waiting ranks
    succeed as the committer did."""
    where, attempt, manifest = committed_world(tmp_path)
    where.delete(names.outcome_name(attempt))
    abort(where, attempt, "rank 2 gave up")
    assert read_outcome(where, attempt) == {"aborted": "rank 2 gave up"}
    assert await_outcome(where, attempt, HANG_GUARD_S, 1, 3).generation == manifest.generation


def test_an_aborted_outcome_ends_the_wait_with_its_reason(tmp_path):
    where = LocalStorage(str(tmp_path / "ckpt"))
    attempt = names.new_attempt_id()
    abort(where, attempt, "rank 5 ran out of disk")
    where.delete(names.abort_name(attempt))  # the outcome alone says so
    with pytest.raises(CommitError, match="rank 5 ran out of disk"):
        await_outcome(where, attempt, HANG_GUARD_S, 1, 8)


@pytest.mark.parametrize("planted", [
    b"not json", b"[]", b'{"committed": 1}', b'{"attempt": "%(a)s", "committed": "../manifest"}',
    b'{"attempt": "%(a)s", "committed": true}', b'{"attempt": "%(a)s", "committed": -1}',
    b'{"attempt": "%(a)s", "aborted": 7}', b'{"attempt": "20990101T000000-000000000000", "aborted": "no"}',
    b"x" * 100_000])
def test_a_hostile_outcome_is_no_outcome(tmp_path, planted):
    """An outcome is untrusted input: one that is not the committer's word for this
    attempt is ignored; the abort marker still ends the wait, with its own reason."""
    where = LocalStorage(str(tmp_path / "ckpt"))
    attempt = names.new_attempt_id()
    where.put(names.outcome_name(attempt), planted.replace(b"%(a)s", attempt.encode()))
    assert read_outcome(where, attempt) is None
    where.put(names.abort_name(attempt), b'{"reason": "the marker\'s reason"}')
    with pytest.raises(CommitError, match="the marker's reason"):
        await_outcome(where, attempt, HANG_GUARD_S, 1, 3)


def test_an_outcome_is_an_attempt_file_gc_knows(tmp_path):
    where, attempt, _ = committed_world(tmp_path)
    assert names.attempt_file_of(names.outcome_name(attempt)) == (attempt, "outcome")
    assert names.outcome_name(attempt) in {i.key for i in attempt_files(where, attempt)}


def test_a_waiting_rank_in_exit_mode_finds_the_manifest_before_it_presumes_the_committer_dead(tmp_path, monkeypatch):
    """Rank 0 died after its manifest, before its outcome, and its heartbeat stopped:
    the waiting rank looks at the manifests before it aborts, and the commit stands."""
    from ckptstore.checkpoint import exiting, heartbeat

    where, attempt, manifest = committed_world(tmp_path)
    where.delete(names.outcome_name(attempt))
    monkeypatch.setattr(exiting, "_active", threading.Event())
    exiting.enter()
    monkeypatch.setattr(heartbeat, "patience", lambda content, world_size: 0.0)  # presumed dead at once
    assert await_outcome(where, attempt, HANG_GUARD_S, 1, 3).generation == manifest.generation
    assert not where.exists(names.abort_name(attempt))


def test_the_committer_counts_only_its_attempts_own_files(tmp_path):
    """A file planted below an attempt directory is not a vote (the committer's listing
    is of the directory's own files)."""
    where = LocalStorage(str(tmp_path / "ckpt"))
    attempt = names.new_attempt_id()
    for r in (1, 2):
        other_rank(where, attempt, r, 3)
    where.put(f"{names.attempt_dir(attempt)}/x/vote-r00005.json", b"planted")
    manifest = start_save({"w": torch.zeros(4)}, where, rt=runtime(), attempt=attempt, step=None, rank=0,
                          world_size=3, metrics=None,
                          options=SaveOptions(commit_timeout=HANG_GUARD_S, indexed=False)).result(HANG_GUARD_S)
    assert manifest.world_size == 3
