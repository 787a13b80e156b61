"""Lifecycle of saves: SIGTERM and normal exit wait for commits, back-pressure, many
saves in flight, the future API, generations (I6), unique attempts (I2), and two
processes racing to commit the same checkpoint (I1)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

import ckptstore
from ckptstore.format import Manifest
from ckptstore.runtime import runtime

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from procs.harness import Child, close_zygotes, release_fifos, start_zygotes  # noqa: E402
from procs.states import big_state, equal_bitwise, rank_state, single_value, uniform_state  # noqa: E402


def listing(path) -> list[str]:
    """The entries of a checkpoint directory: manifests and attempts/<attempt>."""
    out = sorted(n for n in os.listdir(path) if n != "attempts")
    attempts = os.path.join(path, "attempts")
    if os.path.isdir(attempts):
        out += sorted(f"attempts/{a}" for a in os.listdir(attempts))
    return out


# ---------------------------------------------------------------- exit and SIGTERM

def test_sigterm_waits_for_the_staged_save_to_commit_then_dies_by_sigterm(tmp_path):
    path = str(tmp_path / "ckpt")
    child = Child("lifecycle_child.py", "sigterm", path, stdin=subprocess.PIPE)
    try:
        child.expect("staged")
        os.kill(child.pid, signal.SIGTERM)
        code, rest = child.finish()
    finally:
        child.kill()
    assert code == -signal.SIGTERM, f"exit {code}, stdout {rest}\n{child.stderr_tail()}"
    assert rest == [], "the process went on after SIGTERM"
    assert ckptstore.verify(path) == []
    assert equal_bitwise(ckptstore.load(path), big_state())


def test_normal_exit_right_after_save_commits_it(tmp_path):
    path = str(tmp_path / "ckpt")
    child = Child("lifecycle_child.py", "exit", path)
    child.expect("staged")
    code, _ = child.finish()
    assert code == 0, child.stderr_tail()
    assert listing(path)[0] == "manifest-0000000001.json"
    assert ckptstore.verify(path) == []
    assert equal_bitwise(ckptstore.load(path), big_state())


# ---------------------------------------------------------------- in-process pipeline

@pytest.fixture
def tiny_pool():
    ckptstore.configure(staging_bytes=1 << 20)
    try:
        yield runtime().pool
    finally:
        ckptstore.configure()


def test_back_pressure_small_pool_saves_a_larger_state_bit_exact(tmp_path, tiny_pool):
    g = torch.Generator().manual_seed(7)
    state = {"a": torch.randn(3_000_000, generator=g),  # 12 MB
             "b": torch.randint(-100, 100, (1_000_000,), generator=g),  # 8 MB
             "step": 1}
    path = str(tmp_path / "ckpt")
    manifest = ckptstore.save(state, path, chunk_bytes=256 << 10).result()
    assert manifest.raw_bytes > 19 * tiny_pool.capacity
    assert equal_bitwise(ckptstore.load(path), state)
    stats = tiny_pool.stats()
    assert stats["capacity"] == 1 << 20
    assert 0 < stats["peak"] <= stats["capacity"], stats
    assert stats["in_use"] == 0, stats


def test_several_saves_in_flight_all_commit_after_wait(tmp_path):
    states = [rank_state(i, 100 + i, numel=200_000) for i in range(6)]
    futures = [ckptstore.save(s, str(tmp_path / f"c{i}")) for i, s in enumerate(states)]
    ckptstore.wait()
    assert [f.done() for f in futures] == [True] * len(futures)
    assert [f.exception() for f in futures] == [None] * len(futures)
    for i, s in enumerate(states):
        assert equal_bitwise(ckptstore.load(str(tmp_path / f"c{i}")), s), f"save {i} differs"


def test_future_api_staged_result_done(tmp_path):
    store = ckptstore.Store(str(tmp_path / "run"))
    fut = store.save(3, rank_state(0, 3))
    assert fut.staged() is True
    assert fut.wait_staged(0) is True
    assert fut.step == 3
    manifest = fut.result()
    assert isinstance(manifest, Manifest)
    assert (manifest.step, manifest.world_size, manifest.generation) == (3, 1, 1)
    assert manifest.attempt == fut.attempt
    assert fut.done() is True
    assert fut.exception() is None

    fut = ckptstore.save({"x": torch.arange(10)}, str(tmp_path / "plain"))
    assert fut.staged() is True
    manifest = fut.result()
    assert (manifest.step, manifest.world_size) == (None, 1)
    assert fut.done() is True


# ---------------------------------------------------------------- generations, attempts

def test_I6_resave_makes_new_generations_and_retires_the_old(tmp_path):
    path = str(tmp_path / "latest.pt")
    first = ckptstore.save(uniform_state(1, 4 << 20), path, compression="none").result()
    assert first.generation == 1
    loader = Child("lifecycle_child.py", "loader", path, stdin=subprocess.PIPE)
    try:
        assert loader.expect("first").split() == ["first", "1"]
        manifests = [first]
        for gen in range(2, 7):
            m = ckptstore.save(uniform_state(gen, 4 << 20), path, compression="none").result()
            manifests.append(m)
            assert m.generation == gen
            assert listing(path) == [f"manifest-{gen:010d}.json", f"attempts/{m.attempt}"]
            assert single_value(ckptstore.load(path)) == gen
        loader.proc.stdin.close()
        code, lines = loader.finish()
    finally:
        loader.kill()
    assert code == 0, loader.stderr_tail()
    summary = lines[0].split()
    assert summary[0] == "summary" and summary[2] == "0", f"a loader saw an incomplete checkpoint: {lines}"
    seen = [int(v) for v in summary[3].split(",")]
    assert seen == sorted(seen) and set(seen) <= set(range(1, 7)), f"loads went back in time: {seen}"
    assert len({m.attempt for m in manifests}) == len(manifests)


def test_I2_same_step_saved_twice_gets_new_attempt_and_file_names(tmp_path):
    store = ckptstore.Store(str(tmp_path / "run"))
    m1 = store.save(5, rank_state(0, 5)).result()
    m2 = store.save(5, rank_state(1, 5)).result()
    assert m1.attempt != m2.attempt
    assert m1.files() and m2.files()
    assert m1.files().isdisjoint(m2.files()), (m1.files(), m2.files())
    assert m2.generation == m1.generation + 1
    assert equal_bitwise(store.load(5), rank_state(1, 5))

    path = str(tmp_path / "latest.pt")
    a = ckptstore.save({"x": torch.ones(4)}, path).result()
    b = ckptstore.save({"x": torch.ones(4)}, path).result()
    assert a.attempt != b.attempt
    assert a.files().isdisjoint(b.files())


# ---------------------------------------------------------------- racing committers

@pytest.fixture(scope="module")
def zygotes():
    zs = start_zygotes(2)
    yield zs
    close_zygotes(zs)


@pytest.mark.slow
def test_I1_two_processes_racing_to_commit_one_path_leave_exactly_one_whole_save(tmp_path, zygotes):
    path = str(tmp_path / "latest.pt")
    outcomes = []
    newest = 0  # the generation visible after the previous trial
    for trial in range(10):
        values = (2 * trial + 1, 2 * trial + 2)
        fifos = [str(tmp_path / f"go-{trial}-{i}") for i in range(2)]
        for f in fifos:
            os.mkfifo(f)
        racers = [z.run("lifecycle_child.py", "racer", path, v, f) for z, v, f in zip(zygotes, values, fifos)]
        for r in racers:
            assert r.next() == "waiting"
        release_fifos(fifos)  # both start saving together
        results = []
        for z, r in zip(zygotes, racers):
            line = r.next()
            code = r.finish()
            assert code == 0 and line is not None, f"trial {trial}: racer exit {code}, {line!r}\n{z.stderr_tail()}"
            results.append(line.split())
        outcomes.append([w[0] for w in results])
        committed = {int(w[1]): v for w, v in zip(results, values) if w[0] == "committed"}
        assert all(w[0] in ("committed", "conflict") for w in results), results
        assert committed, f"trial {trial}: neither racer committed: {results}"
        assert len(committed) == len([w for w in results if w[0] == "committed"]), (
            f"trial {trial}: two commits claim one generation: {results}")
        assert sorted(committed) == list(range(newest + 1, newest + 1 + len(committed))), (
            f"trial {trial}: commits are not the successive generations after {newest}: {results}")
        newest = max(committed)
        obj = ckptstore.load(path)
        assert single_value(obj) == committed[max(committed)], (
            f"trial {trial}: the visible checkpoint is not the newest committed save: {results}")
        assert ckptstore.verify(path) == []
        assert [n for n in listing(path) if n.startswith("manifest-")] == [f"manifest-{max(committed):010d}.json"]
    print("race outcomes:", outcomes)
