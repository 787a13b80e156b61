"""In-job restart on a GPU (issue 36): the docs example (tests/procs/supervised_train.py,
faults injected) under ``ckptstore run`` (in-job, one warm spare) with the model on
``cuda:LOCAL_RANK``. Marker ``gpu``; skipped without a CUDA device and an NCCL build.

What one GPU can run (NCCL refuses two ranks of one communicator on one device):

- one NCCL rank, hung in Python: the agent's hang watch posts the notice, the rank's
  monitor runs the NCCL group abort on its live communicator, the rank leaves the
  round and re-forms an NCCL group in the same process (pid unchanged), restores from
  the node's memory tier to the GPU, and ends bit-identical;
- one NCCL rank, SIGKILLed: the warm spare takes rank 0 and restores to the GPU;
- the group abort and re-form, three times in one process, without a supervisor;
- two ranks sharing the GPU over gloo (CUDA tensors): a SIGKILLed rank is replaced,
  the survivor keeps its process.

An abort that interrupts a collective blocked on a dead NCCL peer needs two GPUs: not
here. ``CKPTSTORE_INJOB_TEST_DEVICE=cpu`` runs the same jobs on the CPU over gloo (no
skip): how the flow was checked on a machine without a GPU.
Run: ``python -m pytest tests/test_gpu_injob.py -rs`` (bench/gpu_check.sh step 6 does it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from jobutil import Job, assert_bit_identical  # noqa: E402
from test_supervisor import journal, kinds  # noqa: E402

DEVICE = os.environ.get("CKPTSTORE_INJOB_TEST_DEVICE", "cuda")
BACKEND = "nccl" if DEVICE == "cuda" else "gloo"
_why = None
if DEVICE == "cuda" and not torch.cuda.is_available():
    _why = "needs a CUDA device (this machine has none; CKPTSTORE_INJOB_TEST_DEVICE=cpu runs the flow over gloo)"
elif DEVICE == "cuda" and not dist.is_nccl_available():
    _why = f"needs a torch built with NCCL (torch {torch.__version__} is not)"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_why is not None, reason=_why or "")]

SCRIPT = Path(__file__).resolve().parent / "procs" / "supervised_train.py"
STEPS = 30


def _job(tmp_path: Path, name: str, *policy: str, nproc: int = 1, backend: str = BACKEND, fault="none:-1") -> Job:
    store, final = tmp_path / f"store-{name}", tmp_path / f"final-{name}.pt"
    job = Job([sys.executable, "-m", "ckptstore.cli", "run", "--standalone", f"--nproc-per-node={nproc}",
               "--store", str(store), "--backoff", "0.1", "--memory-dir", str(tmp_path / f"shm-{name}"), *policy,
               str(SCRIPT), str(store), "--steps", str(STEPS), "--every", "5", "--final", str(final),
               "--device", DEVICE, "--backend", backend],
              env={"FAULT": fault, "FAULT_ANY_RANK": "1" if nproc == 1 else "0"})
    job.store, job.final = store, final
    return job


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The one-rank job's final state without a fault, on this device and backend."""
    tmp = tmp_path_factory.mktemp("injob-reference")
    job = _job(tmp, "reference")
    assert job.finish() == 0, job.output()[-3000:]
    return torch.load(job.final)


def _one_recovery(store: Path, detected_by: str) -> dict:
    events = journal(store)
    [rec] = kinds(events, "recovery")
    assert rec["detected_by"] == detected_by, rec
    assert rec["restore_from"].get("memory") and not rec["restore_from"].get("durable"), rec
    assert len(kinds(events, "attempt_start")) == 1 and not kinds(events, "failure"), events
    return rec


def test_a_hung_rank_aborts_its_group_and_reforms_it_in_its_process(tmp_path, reference):
    job = _job(tmp_path, "hang", "--hang-timeout", "3", fault=f"hang:8:{tmp_path / 'hung-once'}")
    job.expect(lambda line: line == "rank 1: stopped at step 8", "rank 0 hanging (the fault says rank 1)")
    pid = job.pids[0]
    assert job.finish() == 0, job.output()[-3000:]
    assert_bit_identical(job.final, reference)
    rec = _one_recovery(job.store, "agent:hang")
    assert job.pids[0] == pid, f"rank 0 went to another process ({job.pids[0]}, was {pid}): {rec}"
    print(f"\n{BACKEND} hang recovery: {({k: rec.get(k) for k in rec if k.endswith('_s')})}")


def test_a_killed_rank_is_replaced_by_the_warm_spare(tmp_path, reference):
    job = _job(tmp_path, "kill")
    job.at_step(0, 11)
    victim = job.pids[0]
    os.kill(victim, signal.SIGKILL)
    job.expect(lambda line: line.startswith("rank 0: step ") and not line.endswith(f"pid {victim}"),
               "rank 0 from the spare")
    assert job.finish() == 0, job.output()[-3000:]
    assert_bit_identical(job.final, reference)
    rec = _one_recovery(job.store, "agent:exit")
    print(f"\n{BACKEND} kill recovery: {({k: rec.get(k) for k in rec if k.endswith('_s')})}")


ABORT_REFORM = textwrap.dedent("""
    import sys, time, torch, torch.distributed as dist
    from ckptstore import inprocess
    device, backend = sys.argv[1], sys.argv[2]
    if device == "cuda":
        inprocess._set_cuda_device(0)
    store = dist.HashStore()
    for r in range(3):
        dist.init_process_group(backend, store=dist.PrefixStore(f"round{r}", store), rank=0, world_size=1)
        t = torch.full((1024,), float(r + 1), device=device)
        dist.all_reduce(t)  # (creates the round's communicator)
        assert t[0].item() == r + 1
        began = time.monotonic()
        # the NCCL path's group abort (on gloo too: torch 2.13's runs on any backend)
        assert inprocess._abort_group(None, "nccl", 30.0), "the group abort did not return"
        assert not dist.is_initialized()
        print(f"round {r}: abort {time.monotonic() - began:.3f}s", flush=True)
    print("ok", flush=True)
""")


def test_the_group_abort_and_a_new_group_three_times_in_one_process():
    env = dict(os.environ, **{k: v for k, v in __import__("ckptstore.inprocess").inprocess.NCCL_ENV.items()
                              if k not in os.environ})
    r = subprocess.run([sys.executable, "-c", ABORT_REFORM, DEVICE, BACKEND], capture_output=True, text=True,
                       timeout=180, env=env)
    assert r.returncode == 0 and r.stdout.rstrip().endswith("ok"), r.stdout + r.stderr
    print("\n" + r.stdout)


def test_two_ranks_sharing_the_gpu_over_gloo_a_killed_rank_is_replaced(tmp_path):
    ref = _job(tmp_path, "gloo-reference", nproc=2, backend="gloo")
    assert ref.finish() == 0, ref.output()[-3000:]
    job = _job(tmp_path, "gloo-kill", nproc=2, backend="gloo")
    job.at_step(1, 9)
    victim, survivor = job.pids[1], job.pids[0]
    os.kill(victim, signal.SIGKILL)
    job.expect(lambda line: line.startswith("rank 0: step ") and line.endswith(f"pid {survivor}")
               and job.pids.get(1) not in (None, victim), "rank 1 replaced, rank 0 kept")
    assert job.finish() == 0, job.output()[-3000:]
    assert_bit_identical(job.final, torch.load(ref.final))
    _one_recovery(job.store, "agent:exit")
