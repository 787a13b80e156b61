"""ckptstore.inprocess's NCCL path, the parts that run without a GPU: the refusals (a
torch without the group abort, without NCCL, without a CUDA device; a local rank with no
GPU of its own), the NCCL settings, the group-abort call against a real (gloo) group,
and what a rank does when the abort does not return. The path itself, on a GPU with a
real NCCL group: tests/test_gpu_injob.py."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ckptstore import inprocess
from ckptstore.supervisor import injob


@pytest.fixture
def in_job(monkeypatch):
    """run() takes the in-job path (refused before it connects to this address)."""
    monkeypatch.setenv(injob.ENV_STORE, "127.0.0.1:1")
    for name in inprocess.NCCL_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("fn, warmup, what", [(42, None, "fn must be a callable"),
                                              (None, None, "fn must be a callable"),
                                              (print, 3, "warmup must be a callable")])
def test_what_is_not_a_function_is_refused_at_once(fn, warmup, what):
    with pytest.raises(TypeError, match=what):
        inprocess.run(fn, warmup=warmup)


def test_a_torch_without_the_group_abort_is_refused(in_job, monkeypatch):
    monkeypatch.delattr(c10d, "_abort_process_group")
    with pytest.raises(inprocess.InJobUnsupportedError,
                       match=r"needs torch's process-group abort \(_abort_process_group\).*torch 2\.5 or later"):
        inprocess.run(lambda: None, backend="nccl")


@pytest.mark.skipif(dist.is_nccl_available(), reason="this torch has NCCL: nothing to refuse")
def test_a_torch_without_nccl_is_refused(in_job):
    with pytest.raises(inprocess.InJobUnsupportedError, match="built without NCCL.*backend='gloo'"):
        inprocess.run(lambda: None, backend="nccl")


def test_no_cuda_device_is_refused(in_job, monkeypatch):
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(inprocess.InJobUnsupportedError, match="no CUDA device is visible.*CUDA_VISIBLE_DEVICES="):
        inprocess.run(lambda: None, backend="nccl")


def test_a_local_rank_without_its_own_gpu_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    inprocess._set_cuda_device(0)
    assert chosen == [0]
    with pytest.raises(inprocess.InJobUnsupportedError, match=r"local rank 1 has no GPU.*shows 1.*--nproc-per-node"):
        inprocess._set_cuda_device(1)
    assert chosen == [0]


def test_nccl_settings_are_defaults_the_environment_overrides(in_job, monkeypatch):
    monkeypatch.setattr(inprocess, "_check_nccl", lambda: None)
    monkeypatch.setenv("TORCH_NCCL_RETHROW_CUDA_ERRORS", "1")  # the user's choice stands
    job = inprocess._InJob("nccl", None, None)
    assert job.backend == "nccl"
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    assert os.environ["TORCH_NCCL_RETHROW_CUDA_ERRORS"] == "1"
    assert "TORCH_NCCL_BLOCKING_WAIT" not in inprocess.NCCL_ENV


def test_the_group_abort_ends_every_group_and_tolerates_none():
    """torch 2.13's group abort runs on any backend: the NCCL path's call, against a
    real gloo group with a subgroup; then again with no group left (the watchdog may
    have aborted it first)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        sub = dist.new_group([0])
        assert inprocess._abort_group(None, "nccl", 30.0)
        assert not dist.is_initialized() and c10d.GroupMember.WORLD is None
        assert sub not in c10d._world.pg_map
        assert inprocess._abort_group(None, "nccl", 30.0)  # nothing to abort: no error
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_an_abort_that_does_not_return_kills_the_rank(monkeypatch):
    release = threading.Event()
    monkeypatch.setattr(c10d, "_abort_process_group", lambda group=None: release.wait(30))
    killed = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: killed.append((pid, sig)))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # a group to abort
    try:
        assert not inprocess._abort_group(None, "nccl", 0.2)
        inprocess._abort_or_die(None, "nccl", 0.2, 3, 1)
        assert killed == [(os.getpid(), signal.SIGKILL)]
        release.set()
        killed.clear()
        inprocess._abort_or_die(None, "nccl", 30.0, 3, 1)  # it returns: the rank lives
        assert killed == []
    finally:
        release.set()
        dist.destroy_process_group()


def test_a_refusal_stops_the_job_instead_of_being_retried():
    """A refused rank (NCCL on a CPU build, here) died before its first step; a spare
    refuses the same way. Retrying cannot help: the leader's verdict is deterministic
    (exit 10 at once), not transient (a relaunch, a wait for spares that die too)."""
    from ckptstore.supervisor.classify import classify_one

    message = ("ckptstore.inprocess.InJobUnsupportedError: inprocess.run: backend 'nccl', but this torch "
               "(2.13.0+cpu) is built without NCCL; install a CUDA build of torch, or use backend='gloo'")
    v = classify_one({"exitcode": 1, "signal": None, "error": message, "traceback": None}, 0, None)
    assert v.klass == "deterministic" and "built without NCCL" in v.reason
