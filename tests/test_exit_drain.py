"""The exit drain (SIGTERM, interpreter exit) with a collective save in flight (issue 12,
item 2): it must notice a commit that can no longer succeed (a peer that stopped
beating, the attempt's abort) and stop at once, must not abort a commit that can still
succeed, and by default ends well inside a launcher's 30 s grace.

Real processes (2-rank gloo groups), real disk. The launcher is played by the test: it
SIGKILLs or loses one rank and SIGTERMs the others. CKPTSTORE_EXIT_TIMEOUT=300 in the
children, so a drain that waits for the vote of a dead rank fails the hang guard
instead of ending by its timeout. No outcome depends on timing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import pytest
import torch

import ckptstore
import ckptstore.checkpoint.save as save_mod
from ckptstore import lifecycle, names
from ckptstore.checkpoint import exiting
from ckptstore.checkpoint.votes import abort
from ckptstore.checkpoint.save import SaveOptions, start_save
from ckptstore.config import Config, ConfigError
from ckptstore.runtime import runtime
from ckptstore.storage import LocalStorage

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from procs.harness import Child, child_env, free_port  # noqa: E402
from procs.states import equal_bitwise, rank_state  # noqa: E402

pytestmark = pytest.mark.filterwarnings(r"ignore:.*saved by \d+ ranks, loading on")

# Hang guard only: a drain that waits for a dead peer's vote runs into the 300 s exit timeout.
HANG_GUARD = 120.0
STEP_DIR = names.step_dir_name(1)


def start_group(scenario: str, root: str, **env) -> dict[int, Child]:
    port = free_port()
    return {rank: Child("exit_drain_child.py", scenario, root, stdin=subprocess.PIPE, env=child_env(
        RANK=rank, WORLD_SIZE=2, LOCAL_RANK=rank, MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
        GLOO_SOCKET_IFNAME="lo", CKPTSTORE_EXIT_TIMEOUT=300, **env)) for rank in range(2)}


def kill_all(children: dict[int, Child]) -> None:
    for c in children.values():
        c.kill()


def attempt_dir(root, attempt: str):
    return os.path.join(root, STEP_DIR, names.attempt_dir(attempt))


def manifests(root) -> list[str]:
    loc = os.path.join(root, STEP_DIR)
    return sorted(n for n in os.listdir(loc) if names.parse_manifest_name(n) is not None)


def abort_reason(root, attempt: str) -> str:
    with open(os.path.join(root, STEP_DIR, names.abort_name(attempt))) as f:
        marker = json.load(f)
    assert marker["attempt"] == attempt
    return marker["reason"]


def report(children: dict[int, Child]) -> str:
    return "\n".join(f"--- rank {r} stdout {c.out.lines}\nstderr:\n{c.stderr_tail()}" for r, c in children.items())


# ---------------------------------------------------------------- a peer died: stop at once

def test_sigterm_with_a_dead_voter_aborts_naming_it_and_exits_by_sigterm(tmp_path):
    """Rank 1 dies where it would vote; rank 0, waiting for that vote in its commit, is
    SIGTERMed: it presumes rank 1 dead, aborts naming it, and dies by SIGTERM, long
    before its 300 s exit timeout."""
    root = str(tmp_path / "run")
    kids = start_group("voter_dies", root)
    try:
        attempt = kids[0].expect("staged").split()[1]
        code1, _ = kids[1].finish(HANG_GUARD)
        assert code1 == -signal.SIGKILL, report(kids)
        os.kill(kids[0].pid, signal.SIGTERM)
        code0, rest = kids[0].finish(HANG_GUARD)
    finally:
        kill_all(kids)
    assert code0 == -signal.SIGTERM, report(kids)
    # The drain ends when the save failed, or as soon as this rank's heartbeat thread saw
    # the abort marker (written by its own commit thread): either way it cannot commit.
    assert rest in (["after_drain failed CommitError"], ["after_drain aborted"]), report(kids)
    reason = abort_reason(root, attempt)
    assert "ranks [1] presumed dead by rank 0" in reason, reason
    assert manifests(root) == []
    assert ckptstore.Store(root).steps() == []
    files = set(os.listdir(attempt_dir(root, attempt)))
    assert {"abort.json", "heartbeat-r00000", "vote-r00000.json"} <= files, files  # it beat while exiting
    assert "vote-r00001.json" not in files


def test_sigterm_with_a_dead_committer_aborts_naming_it_and_exits_by_sigterm(tmp_path):
    """The mirror: rank 0 dies after its vote, where it would commit; rank 1, voted and
    waiting for the outcome, is SIGTERMed: it presumes rank 0 dead (rank 0 voted, so it
    promised a heartbeat every SAVE_BEAT_EVERY s), aborts naming it and dies by SIGTERM."""
    root = str(tmp_path / "run")
    kids = start_group("committer_dies", root)
    try:
        attempt = kids[1].expect("staged").split()[1]
        code0, _ = kids[0].finish(HANG_GUARD)
        assert code0 == -signal.SIGKILL, report(kids)
        os.kill(kids[1].pid, signal.SIGTERM)
        code1, rest = kids[1].finish(HANG_GUARD)
    finally:
        kill_all(kids)
    assert code1 == -signal.SIGTERM, report(kids)
    # The drain ends when the save failed, or as soon as this rank's heartbeat thread saw
    # the abort marker (written by its own commit thread): either way it cannot commit.
    assert rest in (["after_drain failed CommitError"], ["after_drain aborted"]), report(kids)
    reason = abort_reason(root, attempt)
    assert "ranks [0] presumed dead by rank 1" in reason, reason
    assert manifests(root) == []
    assert ckptstore.Store(root).steps() == []


# ---------------------------------------------------------------- preemption: everyone alive

def test_preemption_of_every_rank_mid_save_still_commits(tmp_path):
    """Both ranks are SIGTERMed with the save in flight, both alive: exit mode must not
    abort a commit that can still succeed. Rank 1's vote is held until rank 0 has
    waited for it, in exit mode, for three liveness windows (rank 1 beating meanwhile)."""
    root = str(tmp_path / "run")
    kids = start_group("preempted", root)
    try:
        attempts = {kids[r].expect("staged").split()[1] for r in (0, 1)}
        assert len(attempts) == 1
        for r in (0, 1):
            os.kill(kids[r].pid, signal.SIGTERM)
        results = {r: kids[r].finish(HANG_GUARD) for r in (0, 1)}
    finally:
        kill_all(kids)
    for r, (code, rest) in results.items():
        assert code == -signal.SIGTERM, f"rank {r}\n{report(kids)}"
        assert rest == ["after_drain committed"], f"rank {r}\n{report(kids)}"
    (attempt,) = attempts
    store = ckptstore.Store(root)
    assert store.steps() == [1]
    manifest = store.manifest(1)
    assert (manifest.attempt, manifest.world_size) == (attempt, 2)
    assert not os.path.exists(os.path.join(root, STEP_DIR, names.abort_name(attempt)))
    assert ckptstore.verify(store.location(1)) == []
    for rank in range(2):
        assert equal_bitwise(store.load(1, rank=rank), rank_state(rank, 1)), f"rank {rank} differs"


# ---------------------------------------------------------------- in-process pieces

@pytest.fixture
def exit_mode(monkeypatch):
    """Exit mode for this test only (it is sticky for a process), liveness 1 s."""
    monkeypatch.setattr(exiting, "_active", threading.Event())
    ckptstore.configure(exit_liveness=1)
    try:
        yield
    finally:
        ckptstore.configure()


def _rank_save(storage, attempt: str, rank: int, timeout: float = HANG_GUARD):
    state = {"x": torch.arange(1000, dtype=torch.float32) + rank}
    return start_save(state, storage, rt=runtime(), attempt=attempt, step=1, rank=rank, world_size=2,
                      metrics=None, options=SaveOptions(commit_timeout=timeout))


def test_drain_presumes_a_silent_voter_dead_and_returns(tmp_path, exit_mode):
    """The drain itself (no signal): rank 0 of a 2-rank save whose rank 1 never shows up."""
    storage = LocalStorage(tmp_path / "loc")
    attempt = names.new_attempt_id()
    fut = lifecycle.track(_rank_save(storage, attempt, 0))
    assert lifecycle.drain(HANG_GUARD) is True
    exc = fut.exception()  # observed: the next save must not report it
    assert isinstance(exc, ckptstore.CommitError) and not isinstance(exc, ckptstore.CommitTimeoutError), exc
    assert "ranks [1] presumed dead by rank 0" in str(exc)
    assert exiting.active()
    beat = storage.read(names.heartbeat_name(attempt, 0))
    assert exiting.says_exiting(beat), beat  # it beat in exit mode
    assert not any(names.parse_manifest_name(n) for n in storage.list(""))


def test_drain_stops_waiting_for_a_save_whose_attempt_another_rank_aborted(tmp_path, exit_mode, monkeypatch):
    """Rank 1 still busy before its vote; rank 0 aborts the attempt: rank 1's drain
    returns at once (the save cannot commit), without waiting for its writes."""
    storage = LocalStorage(tmp_path / "loc")
    attempt = names.new_attempt_id()
    release = threading.Event()
    real = save_mod.write_vote

    def held_vote(storage_, vote):
        assert release.wait(HANG_GUARD)
        real(storage_, vote)

    monkeypatch.setattr(save_mod, "write_vote", held_vote)
    fut = lifecycle.track(_rank_save(storage, attempt, 1))
    abort(storage, attempt, "rank 0 gave up")
    try:
        assert lifecycle.drain(HANG_GUARD) is True
        assert fut.aborted and not fut.done()
    finally:
        release.set()
    exc = fut.exception(HANG_GUARD)
    assert isinstance(exc, ckptstore.CommitError) and "rank 0 gave up" in str(exc), exc


def test_commit_stops_at_an_abort_marker_without_exit_mode(tmp_path):
    """Rank 0's wait for votes ends when another rank aborted the attempt (normal mode
    too): a CommitError naming the reason, not the commit timeout."""
    assert not exiting.active()
    storage = LocalStorage(tmp_path / "loc")
    attempt = names.new_attempt_id()
    fut = _rank_save(storage, attempt, 0)
    abort(storage, attempt, "rank 1 presumed rank 0 dead")
    exc = fut.exception(HANG_GUARD)
    assert isinstance(exc, ckptstore.CommitError) and not isinstance(exc, ckptstore.CommitTimeoutError), exc
    assert "rank 1 presumed rank 0 dead" in str(exc)
    assert not any(names.parse_manifest_name(n) for n in storage.list(""))


def test_heartbeat_says_exiting_only_in_exit_mode(monkeypatch):
    monkeypatch.setattr(exiting, "_active", threading.Event())
    normal = exiting.heartbeat_bytes()
    assert not exiting.says_exiting(normal)
    exiting.enter()
    fast = exiting.heartbeat_bytes()
    assert exiting.says_exiting(fast)
    assert not exiting.says_exiting(None)
    assert not exiting.says_exiting(b"2026-01-01T00:00:00.000000+00:00 exitingX")


def test_exit_defaults_fit_a_launchers_grace_and_liveness_is_a_knob():
    cfg = Config()
    assert cfg.exit_timeout == 20.0
    assert cfg.exit_liveness == 5.0
    assert exiting.MAX_BEAT_EVERY * 3 <= cfg.exit_liveness
    env = Config.from_env({"CKPTSTORE_EXIT_TIMEOUT": "600", "CKPTSTORE_EXIT_LIVENESS": "12.5"})
    assert (env.exit_timeout, env.exit_liveness) == (600.0, 12.5)
    with pytest.raises(ConfigError, match="CKPTSTORE_EXIT_LIVENESS"):
        Config.from_env({"CKPTSTORE_EXIT_LIVENESS": "0.5"})
    with pytest.raises(ConfigError, match="exit_liveness"):
        Config(exit_liveness=0)
