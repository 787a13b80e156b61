"""RNG state (ckptstore.rng): exact round trips, weights-only loading through torch and
ckptstore, re-derivation for another rank, hostile input refused with nothing restored,
and CUDA never initialised by a capture. GPU-only cases skip without a CUDA device.
"""

from __future__ import annotations

import io
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

import ckptstore
from ckptstore import rng
from ckptstore.rng import is_rng_state, rederive, rng_state, set_rng_state

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def draws() -> tuple:
    """A few numbers from every generator, gaussians included (they have cached halves)."""
    return ([random.random() for _ in range(4)] + [random.gauss(0, 1)],
            np.random.rand(4).tolist() + [np.random.randn()],
            torch.rand(4).tolist() + torch.randn(3).tolist())


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def captured(seed: int = 1234) -> dict:
    """A state whose gaussian caches are filled (odd number of gaussians drawn)."""
    seed_all(seed)
    random.gauss(0, 1)
    np.random.randn()
    return rng_state()


def snapshot(obj):
    """A deep copy that compares by value (tensors as lists)."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", str(obj.dtype), obj.tolist())
    if isinstance(obj, dict):
        return {k: snapshot(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [snapshot(v) for v in obj]
    return obj


def fake_cuda(state: dict, n: int = 2) -> dict:
    """``state`` as if saved by a process with ``n`` initialised CUDA devices."""
    return {**state, "cuda": [torch.arange(16, dtype=torch.uint8) + i for i in range(n)]}


# ------------------------------------------------------------------ capture and restore
def test_round_trip_is_exact():
    state = captured()
    expected = draws()
    draws()  # move every generator on
    assert set_rng_state(state) is False
    assert draws() == expected


def test_layout_is_plain_data():
    state = captured()
    assert state["ckptstore_rng"] == 1 and state["rank"] == 0
    assert state["python"]["version"] == 3
    assert state["python"]["state"].dtype == torch.int64 and state["python"]["state"].shape == (625,)
    assert isinstance(state["python"]["gauss_next"], float)  # one gaussian drawn: a cached half
    assert state["numpy"]["keys"].dtype == torch.int64 and state["numpy"]["keys"].shape == (624,)
    assert state["numpy"]["has_gauss"] == 1
    assert state["torch"].dtype == torch.uint8
    assert not torch.cuda.is_initialized() or state["cuda"] is not None
    assert is_rng_state(state)


@pytest.mark.parametrize("obj", [{}, None, [], {"rank": 0}, "ckptstore_rng"])
def test_is_rng_state_false(obj):
    assert not is_rng_state(obj)


def test_torch_load_weights_only():
    state = captured()
    expected = draws()
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert snapshot(loaded) == snapshot(state)
    assert set_rng_state(loaded) is False
    assert draws() == expected


def test_derived_state_loads_weights_only():
    derived = rederive(fake_cuda(captured()), 1)  # 64-bit CUDA seeds, derived_from_rank
    buf = io.BytesIO()
    torch.save(derived, buf)
    buf.seek(0)
    assert snapshot(torch.load(buf, weights_only=True)) == snapshot(derived)


@pytest.mark.usefixtures("observe_earlier_failures")
def test_ckptstore_save_load(tmp_path):
    state = captured()
    expected = draws()
    ckptstore.save(state, tmp_path / "rng.pt").result()
    loaded = ckptstore.load(tmp_path / "rng.pt")  # weights_only=True by default
    assert snapshot(loaded) == snapshot(state)
    set_rng_state(loaded)
    assert draws() == expected


@pytest.mark.usefixtures("observe_earlier_failures")
def test_store_save_load(tmp_path):
    state = captured()
    expected = draws()
    ckptstore.Store(tmp_path / "run").save(1, {"rng": state, "step": 1}).result()
    loaded = ckptstore.Store(tmp_path / "run").load()
    assert snapshot(loaded["rng"]) == snapshot(state)
    set_rng_state(loaded["rng"])
    assert draws() == expected


def test_without_numpy_state_numpy_is_left_alone(monkeypatch):
    monkeypatch.setattr(rng, "_np", None)  # as if NumPy were not installed
    state = captured()
    assert state["numpy"] is None
    expected = draws()
    np.random.seed(7)
    numpy_next = np.random.rand(3).tolist()
    np.random.seed(7)
    set_rng_state(state)
    assert np.random.rand(3).tolist() == numpy_next  # untouched by the restore
    py, _, pt = draws()
    assert (py, pt) == (expected[0], expected[2])


def test_numpy_state_skipped_when_numpy_missing(monkeypatch):
    state = captured()
    expected = draws()
    monkeypatch.setattr(rng, "_np", None)
    np.random.seed(7)
    numpy_next = np.random.rand(3).tolist()
    np.random.seed(7)
    set_rng_state(state)
    assert np.random.rand(3).tolist() == numpy_next
    assert [random.random() for _ in range(4)] == expected[0][:4]


# ------------------------------------------------------------------ re-derivation
def restored_draws(state: dict, rank: int) -> tuple:
    set_rng_state(state, rank=rank)
    return draws()


def test_rederive_is_deterministic():
    state = captured()
    a, b = rederive(state, 3), rederive(state, 3)
    assert snapshot(a) == snapshot(b)
    assert restored_draws(a, 3) == restored_draws(b, 3)


def test_rederive_differs_per_rank_and_from_original():
    state = captured()
    original = restored_draws(state, 0)
    per_rank = [restored_draws(rederive(state, r), r) for r in (1, 2, 3)]
    for gen in range(3):  # python, numpy, torch each differ
        streams = [original[gen]] + [d[gen] for d in per_rank]
        assert len({tuple(s) for s in streams}) == 4


def test_rederive_marks_and_does_not_mutate():
    state = fake_cuda(captured(), 2)
    before = snapshot(state)
    derived = rederive(state, 5)
    assert snapshot(state) == before
    assert derived["rank"] == 5 and derived["derived_from_rank"] == 0
    assert derived["cuda"] is None and len(derived["cuda_seeds"]) == 2
    assert len(set(derived["cuda_seeds"])) == 2
    assert is_rng_state(derived)
    set_rng_state(state, rank=4)  # re-derives on the way; still no change to the input
    assert snapshot(state) == before


def test_rederive_depends_on_saved_state():
    assert snapshot(rederive(captured(1), 1)) != snapshot(rederive(captured(2), 1))


def test_mismatched_rank_restores_derived_sequence():
    state = captured()
    assert set_rng_state(rederive(state, 2), rank=2) is False  # the derived state is rank 2's own
    expected = draws()
    assert set_rng_state(state, rank=2) is True
    assert draws() == expected


def test_default_rank_is_zero_without_distributed():
    state = captured()
    assert set_rng_state(state) is False
    assert set_rng_state({**state, "rank": 3}) is True
    expected = restored_draws(rederive({**state, "rank": 3}, 0), 0)
    set_rng_state({**state, "rank": 3})
    assert draws() == expected


def test_rederived_of_rederived_is_valid():
    twice = rederive(rederive(fake_cuda(captured()), 1), 2)
    assert twice["derived_from_rank"] == 1 and len(twice["cuda_seeds"]) == 2
    assert set_rng_state(twice, rank=2) is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")
def test_cuda_states_skipped_without_cuda():
    state = fake_cuda(captured())
    expected = draws()
    assert set_rng_state(state) is False
    assert draws() == expected
    assert set_rng_state(state, rank=1) is True  # derived CUDA seeds: skipped as well
    assert not torch.cuda.is_initialized()


# ------------------------------------------------------------------ hostile input
def _set(path: str, value):
    def mutate(state):
        *parents, last = path.split(".")
        target = state
        for p in parents:
            target = target[p]
        if value is _DELETE:
            del target[last]
        else:
            target[last] = value(target[last]) if callable(value) else value
    return mutate


_DELETE = object()

HOSTILE = [
    # (id, mutation, error, field named in the message)
    ("marker-missing", _set("ckptstore_rng", _DELETE), ValueError, "ckptstore_rng"),
    ("marker-version", _set("ckptstore_rng", 2), ValueError, "ckptstore_rng"),
    ("marker-bool", _set("ckptstore_rng", True), ValueError, "ckptstore_rng"),
    ("unknown-field", _set("extra", 1), ValueError, "extra"),
    ("missing-field", _set("torch", _DELETE), ValueError, "torch"),
    ("rank-str", _set("rank", "0"), TypeError, "rank"),
    ("rank-negative", _set("rank", -1), ValueError, "rank"),
    ("python-not-dict", _set("python", (3, (), None)), TypeError, "python"),
    ("python-extra-key", _set("python.x", 1), ValueError, "python"),
    ("python-version", _set("python.version", 2), ValueError, "python.version"),
    ("python-short", _set("python.state", lambda t: t[:624]), ValueError, "python.state"),
    ("python-int32", _set("python.state", lambda t: t.to(torch.int32)), TypeError, "python.state"),
    ("python-2d", _set("python.state", lambda t: t.reshape(25, 25)), ValueError, "python.state"),
    ("python-word-range", _set("python.state", lambda t: torch.cat([t[:1] + 2**32, t[1:]])), ValueError,
     "python.state"),
    ("python-position", _set("python.state", lambda t: torch.cat([t[:-1], torch.tensor([625])])), ValueError,
     "python.state"),
    ("python-gauss", _set("python.gauss_next", "x"), TypeError, "python.gauss_next"),
    ("python-list", _set("python.state", lambda t: t.tolist()), TypeError, "python.state"),
    ("numpy-not-dict", _set("numpy", 1), TypeError, "numpy"),
    ("numpy-keys-float", _set("numpy.keys", lambda t: t.double()), TypeError, "numpy.keys"),
    ("numpy-keys-negative", _set("numpy.keys", lambda t: -t - 1), ValueError, "numpy.keys"),
    ("numpy-keys-ndarray", _set("numpy.keys", lambda t: t.numpy()), TypeError, "numpy.keys"),
    ("numpy-pos", _set("numpy.pos", 625), ValueError, "numpy.pos"),
    ("numpy-has-gauss", _set("numpy.has_gauss", 2), ValueError, "numpy.has_gauss"),
    ("numpy-cached-gaussian", _set("numpy.cached_gaussian", None), TypeError, "numpy.cached_gaussian"),
    ("torch-int64", _set("torch", lambda t: t.long()), TypeError, "torch"),
    ("torch-short", _set("torch", lambda t: t[:100]), ValueError, "torch"),
    ("torch-empty", _set("torch", lambda t: t[:0]), ValueError, "torch"),
    ("torch-bytes", _set("torch", lambda t: bytes(t.tolist())), TypeError, "torch"),
    ("cuda-not-list", _set("cuda", torch.zeros(16, dtype=torch.uint8)), TypeError, "cuda"),
    ("cuda-item-type", _set("cuda", [torch.zeros(16, dtype=torch.int32)]), TypeError, "cuda[0]"),
    ("cuda-seeds-and-states", _set("cuda_seeds", [1]), ValueError, "cuda_seeds"),
    ("cuda-seeds-negative", lambda s: s.update(cuda=None, cuda_seeds=[-1]), ValueError, "cuda_seeds[0]"),
    ("cuda-seeds-huge", lambda s: s.update(cuda=None, cuda_seeds=[2**64]), ValueError, "cuda_seeds[0]"),
    ("derived-from-rank", _set("derived_from_rank", "1"), TypeError, "derived_from_rank"),
]


def hostile_state(mutate) -> dict:
    state = fake_cuda(captured(1234), 1)
    state = {**state, "python": dict(state["python"]), "numpy": dict(state["numpy"])}
    mutate(state)
    return state


@pytest.mark.parametrize("mutate, error, field", [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_hostile_state_refused_with_nothing_restored(mutate, error, field):
    bad = hostile_state(mutate)
    seed_all(99)  # a different stream from the one in `bad`: a partial restore would show
    current = rng_state()
    expected = draws()
    set_rng_state(current)
    with pytest.raises(error, match=field.replace("[", r"\[").replace("]", r"\]")):
        set_rng_state(bad)
    assert draws() == expected
    with pytest.raises(error, match=field.replace("[", r"\[").replace("]", r"\]")):
        rederive(bad, 1)


@pytest.mark.parametrize("obj", [None, [1, 2], "state", 3, (1,)])
def test_not_a_dict_refused(obj):
    with pytest.raises(TypeError, match="rng state"):
        set_rng_state(obj)


@pytest.mark.parametrize("rank, error", [(-1, ValueError), ("1", TypeError), (True, TypeError)])
def test_bad_rank_argument_refused(rank, error):
    state = captured()
    seed_all(5)
    expected = draws()
    seed_all(5)
    with pytest.raises(error, match="rank"):
        set_rng_state(state, rank=rank)
    assert draws() == expected
    with pytest.raises(error, match="rank"):
        rederive(state, rank)


# ------------------------------------------------------------------ CUDA
def test_capture_does_not_initialise_cuda():
    # A fresh interpreter: other tests in this process may have started CUDA on a GPU machine.
    code = ("import torch, ckptstore.rng as r; s = r.rng_state(); "
            "print(torch.cuda.is_initialized(), s['cuda'] is None)")
    src = os.path.dirname(os.path.dirname(os.path.abspath(rng.__file__)))  # the tree under test
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=True, env=env)
    assert out.stdout.split() == ["False", "True"]


def test_capture_in_process_leaves_cuda_alone():
    was = torch.cuda.is_initialized()
    rng_state()
    assert torch.cuda.is_initialized() == was


@pytest.mark.gpu
@needs_cuda
def test_cuda_round_trip():
    torch.cuda.init()
    torch.cuda.manual_seed_all(11)
    state = rng_state()
    assert len(state["cuda"]) == torch.cuda.device_count()
    expected = [torch.rand(4, device=f"cuda:{i}").tolist() for i in range(torch.cuda.device_count())]
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    assert set_rng_state(torch.load(buf, weights_only=True)) is False
    assert [torch.rand(4, device=f"cuda:{i}").tolist() for i in range(torch.cuda.device_count())] == expected


@pytest.mark.gpu
@needs_cuda
def test_cuda_rederived_is_deterministic_and_per_rank():
    torch.cuda.init()
    state = rng_state()

    def cuda_draws(rank):
        set_rng_state(state, rank=rank)
        return torch.rand(4, device="cuda:0").tolist()

    assert cuda_draws(1) == cuda_draws(1)
    assert cuda_draws(1) != cuda_draws(2)


def test_ckptstores_waits_draw_nothing_from_the_programs_random_stream():
    """The commit's polls (every rank of a multi-rank save, on background threads) and
    the S3 retry backoff jittered their sleeps with the global generator: a resumed run
    then drew other numbers than an uninterrupted one."""
    from ckptstore.checkpoint.heartbeat import Deadline

    random.seed(1234)
    expected = random.Random(1234).random()
    deadline = Deadline(60.0, start=1e-6, cap=1e-6)
    for _ in range(3):
        assert deadline.sleep_or_expire()
    assert random.random() == expected


def test_the_s3_retry_backoff_draws_nothing_from_the_programs_random_stream(monkeypatch):
    import time

    from ckptstore.storage.s3 import errors as s3_errors

    monkeypatch.setattr(time, "sleep", lambda s: None)
    random.seed(99)
    expected = random.Random(99).random()
    s3_errors._backoff(3)
    assert random.random() == expected
