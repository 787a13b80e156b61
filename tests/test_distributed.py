"""Store.save across a real gloo process group (separate processes forked from pre-warmed
factories, env:// rendezvous on 127.0.0.1).

Votes travel through storage and rank 0 commits only a complete, agreeing set (I5):
a dead rank, ranks that disagree on the step, or a rank that fails mid-save must leave
nothing committed, fail the other ranks' futures (never hang them), and harm no
earlier step.
"""

from __future__ import annotations

import os
import signal
import sys

import pytest

import ckptstore

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from procs.harness import close_zygotes, free_port, start_zygotes  # noqa: E402
from procs.states import equal_bitwise, rank_state  # noqa: E402

# Loading one saved rank's state with rank= in a single process is what these tests do.
pytestmark = pytest.mark.filterwarnings(r"ignore:.*saved by \d+ ranks, loading on")

# Small, so that the timeout paths are quick; large enough for a loaded 2-core machine.
SHORT_TIMEOUT = 8.0
# Long: a failure that the library should report at once must not wait for this.
LONG_TIMEOUT = 60.0


@pytest.fixture(scope="module")
def zygotes():
    """Three pre-warmed process factories: each rank is a process forked from one."""
    zs = start_zygotes(3)
    yield zs
    close_zygotes(zs)


def run_group(zygotes, scenario: str, root, world: int, timeout: float, **env) -> dict[int, tuple[int, list[str]]]:
    """Start ``world`` ranks (env:// rendezvous), wait for all; {rank: (exit code, stdout lines)}."""
    port = free_port()
    children = {}
    try:
        for rank in range(world):
            children[rank] = zygotes[rank].run(
                "dist_worker.py", scenario, root, timeout, RANK=rank, WORLD_SIZE=world, LOCAL_RANK=rank,
                MASTER_ADDR="127.0.0.1", MASTER_PORT=port, GLOO_SOCKET_IFNAME="lo", **env)
        results = {}
        for rank, child in children.items():
            code = child.finish()  # reads to the child's end: no rank may hang
            results[rank] = (code, child.lines)
            print(f"rank {rank} exit {code}: {child.lines}")
            if code not in (0, -signal.SIGKILL):
                print(f"stderr of rank {rank}'s factory:\n{zygotes[rank].stderr_tail()}")
        return results
    finally:
        for rank, child in children.items():
            if child.code is None:  # the test failed before this rank was reaped
                print(f"rank {rank} stderr:\n{zygotes[rank].stderr_tail()}")
                try:
                    child.kill()
                except ProcessLookupError:
                    pass
                child.finish()  # keeps the zygote usable by the next test


def _line(lines: list[str], word: str) -> list[str]:
    found = [line.split() for line in lines if line.split()[0] == word]
    assert len(found) == 1, f"expected one {word!r} line in {lines}"
    return found[0]


@pytest.mark.parametrize("world", [2, 3])
def test_I5_all_ranks_commit_one_manifest_and_load_back_bit_exact(zygotes, tmp_path, world):
    root = str(tmp_path / "run")
    results = run_group(zygotes, "roundtrip", root, world, LONG_TIMEOUT)
    for rank, (code, lines) in results.items():
        assert code == 0, f"rank {rank} exited {code}"
        assert _line(lines, "committed") == ["committed", "7", str(world), "1"]
        assert _line(lines, "selfload") == ["selfload", "ok"]
    store = ckptstore.Store(root)
    assert store.steps() == [7]
    manifest = store.manifest(7)
    assert (manifest.step, manifest.world_size, manifest.generation) == (7, world, 1)
    assert [r.rank for r in manifest.ranks] == list(range(world))
    step_dir = tmp_path / "run" / "step-000000000007"
    assert sorted(p.name for p in step_dir.glob("manifest-*.json")) == ["manifest-0000000001.json"]
    assert ckptstore.verify(store.location(7)) == []
    for rank in range(world):
        assert equal_bitwise(store.load(7, rank=rank), rank_state(rank, 7)), f"rank {rank} differs"
    # The ranks really saved different states: loading the wrong rank gives other data.
    assert not equal_bitwise(store.load(7, rank=1), rank_state(0, 7))


@pytest.mark.parametrize("victim", [1, 0])
def test_I5_rank_killed_mid_save_commits_nothing_and_fails_the_others(zygotes, tmp_path, victim):
    root = str(tmp_path / "run")
    results = run_group(zygotes, "victim", root, 2, SHORT_TIMEOUT, VICTIM=victim)
    survivor = 1 - victim
    code, lines = results[victim]
    assert code == -signal.SIGKILL, f"victim rank {victim} exited {code}: {lines}"
    assert _line(lines, "committed") == ["committed", "1", "2", "1"]
    assert not any(line.startswith("staged") for line in lines), "the victim should die inside save()"
    code, lines = results[survivor]
    assert code == 0, f"survivor rank {survivor} exited {code}: {lines}"
    failed = _line(lines, "failed")
    assert failed[1] in ("CommitTimeoutError", "CommitError") and failed[2] == "1", failed

    store = ckptstore.Store(root)
    assert store.steps() == [1]
    assert list((tmp_path / "run" / "step-000000000002").glob("manifest-*")) == []
    assert ckptstore.verify(store.location(1)) == []
    for rank in range(2):
        assert equal_bitwise(store.load(1, rank=rank), rank_state(rank, 1))


@pytest.fixture(scope="module")
def mismatch_run(zygotes, tmp_path_factory):
    """One group where rank 0 saves step 5 and rank 1 step 6 (shared by two tests)."""
    root = str(tmp_path_factory.mktemp("mismatch") / "run")
    return root, run_group(zygotes, "mismatch", root, 2, SHORT_TIMEOUT)


def test_I5_ranks_saving_different_steps_commit_nothing(mismatch_run):
    root, results = mismatch_run
    for rank, (code, _lines) in results.items():
        assert code == 0, f"rank {rank} exited {code}"
    # Rank 1 learns of the disagreement in save(); rank 0 through its future.
    assert _line(results[1][1], "save_raised")[1:] == ["CommitError", "1"]
    failed = _line(results[0][1], "failed")
    assert failed[2] == "1", f"rank 0's future should fail with a CommitError: {failed}"
    assert ckptstore.Store(root).steps() == []


def test_I5_ranks_saving_different_steps_tell_rank0_without_waiting_for_the_timeout(mismatch_run):
    """Rank 1 knows rank 0's step and attempt (the agreement broadcast them): like any
    rank that fails in save() it should leave a no-vote, so rank 0 fails with a plain
    CommitError instead of waiting for the commit timeout."""
    _root, results = mismatch_run
    failed = _line(results[0][1], "failed")
    assert failed[1:] == ["CommitError", "1", "0"], f"rank 0: {failed}"


def test_I5_rank_failing_in_snapshot_fails_the_others_promptly(zygotes, tmp_path):
    root = str(tmp_path / "run")
    results = run_group(zygotes, "unpicklable", root, 2, LONG_TIMEOUT)
    for rank, (code, _lines) in results.items():
        assert code == 0, f"rank {rank} exited {code}"
    raised = _line(results[1][1], "save_raised")
    assert raised[1] in ("SerializationError", "TypeError", "PicklingError", "AttributeError"), raised
    failed = _line(results[0][1], "failed")
    # CommitError from rank 1's no-vote, not CommitTimeoutError after the full timeout.
    assert failed[1:] == ["CommitError", "1", "0"], f"rank 0: {failed}"
    assert ckptstore.Store(root).steps() == []


def test_I5_rank_whose_background_write_fails_fails_the_others_promptly(zygotes, tmp_path):
    root = str(tmp_path / "run")
    results = run_group(zygotes, "write_fails", root, 2, LONG_TIMEOUT)
    for rank, (code, _lines) in results.items():
        assert code == 0, f"rank {rank} exited {code}"
        assert _line(results[rank][1], "staged") == ["staged", "4"], "save() itself should succeed"
    own = _line(results[1][1], "failed")
    assert own[1] not in ("none", "CommitTimeoutError"), f"rank 1's own future: {own}"
    failed = _line(results[0][1], "failed")
    assert failed[1:] == ["CommitError", "1", "0"], f"rank 0: {failed}"
    assert ckptstore.Store(root).steps() == []


def test_two_tiers_promote_each_ranks_files_and_resume_from_durable_after_node_loss(zygotes, tmp_path):
    """Issue 15 on real ranks: each rank copies its own files to the durable tier, rank 0
    commits the same records there; with the local tier gone every rank resumes from
    the newest durable step, bit-identical."""
    root = str(tmp_path / "durable")
    results = run_group(zygotes, "tiers", root, 2, LONG_TIMEOUT)
    for rank, (code, lines) in results.items():
        assert code == 0, (rank, lines)
        assert _line(lines, "tiers")[1:] == ["2,3", "2", "1"], lines  # local keeps the last 2
        assert _line(lines, "resumed")[1:] == ["2", "durable", "ok"], lines


def test_two_tiers_across_nodes_keep_data_on_each_node_and_agree_after_one_is_lost(zygotes, tmp_path):
    """A local tier on two "nodes" (a directory per rank, LOCAL_WORLD_SIZE=1): its
    commit records go through a shared place, each rank's data stays on its node and
    is swept there once no checkpoint needs it; with one node lost, the ranks agree on
    the newest step every one of them can load, each from its nearest copy."""
    root = str(tmp_path / "durable")
    results = run_group(zygotes, "tiers_nodes", root, 2, LONG_TIMEOUT, LOCAL_WORLD_SIZE=1)
    for rank, (code, lines) in results.items():
        assert code == 0, (rank, lines)
        assert _line(lines, "files")[1:] == ["3,4", "0", "3,4", "3"], lines
        assert _line(lines, "resumed")[1:] == ["4", "local", "ok"], lines
        # step 4 is gone with node 1: both ranks take step 3, rank 0 locally, rank 1 from S3's stand-in
        assert _line(lines, "lost")[1:] == ["3", "local" if rank == 0 else "durable", "ok"], lines


def test_a_local_tier_without_a_shared_place_is_refused_on_several_hosts(zygotes, tmp_path):
    results = run_group(zygotes, "tiers_hosts", str(tmp_path / "durable"), 2, SHORT_TIMEOUT)
    for rank, (code, lines) in results.items():
        assert code == 0, (rank, lines)
        refused = [l for l in lines if l.startswith("refused")]
        assert refused and "node0, node1" in refused[0] and "local_shared" in refused[0], lines
    assert not (tmp_path / "durable-local").exists() or not list((tmp_path / "durable-local").rglob("*.bin"))


def test_incremental_saves_of_equal_ranks_each_reference_their_own_blobs(zygotes, tmp_path):
    """Every rank saves the same model: each references the chunks of its own files, so
    no stored blob is referenced twice and the manifest loads on every rank."""
    results = run_group(zygotes, "incremental", str(tmp_path / "store"), 2, LONG_TIMEOUT)
    for rank, (code, lines) in results.items():
        assert code == 0, (rank, lines)
        assert _line(lines, "incremental")[1:] == ["4", "ok"], lines
