"""A minimal worker of the in-job protocol (ckptstore/supervisor/injob.py), for
tests/test_supervisor_injob.py, written directly against injob's functions (the rank
side proper is ckptstore.inprocess).

    injob_fake_worker.py DIR --steps N [--step-delay S] [--final PATH]

Training: each step all-reduces ``step + 1`` and adds it to ``total``; rank 0 keeps
``DIR/ckpt.json`` ({step, total}) after every step (the "checkpoint"), every round
restores from it, and at the end writes ``total`` to ``--final`` (a step counted twice
or lost shows there) with the memory directory and budget the agent exported. Prints ``rank R: step S pid P`` (tests/jobutil.py).

FAULT (environment) = KIND:STEP[:ROUND], several joined by commas, on rank 1 when it is
about to train STEP (in round ROUND only, when given):
  raise          ValueError with the same message every time (the program's own error)
  deterministic  a DeterministicError
  hang           stops training until the round's fault notice, then leaves the round
                 (as the rank side aborts a rank hung in Python code)
  exit           exits with code 3 at once, once per (step, round) in the job
  stuck          stops for good (no notice wakes it; its peer waits in the all-reduce)
  notice         leaves the round as on a collective error, alive: the round fails with
                 no process lost
  hold           waits (in Python) until the round's fault notice or DIR/release exists
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ckptstore.supervisor import injob
from ckptstore.supervisor.progress import ProgressReporter
from ckptstore.supervisor.quick_exit import exit_with


class RoundFailed(Exception):
    pass


class DeterministicError(Exception):  # classify.py knows the name
    pass


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--step-delay", type=float, default=0.05)
    p.add_argument("--final", default=None)
    a = p.parse_args()
    env = os.environ
    faults = {}  # (step, round or None: every round) -> kind
    for fault in env.get("FAULT", "none:-1").split(","):
        kind, step, *in_round = fault.split(":")
        faults[int(step), int(in_round[0]) if in_round else None] = kind
    base = injob.connect(env[injob.ENV_STORE])
    store = injob.attempt_store(base, env[injob.ENV_PREFIX])
    wid, node, timeout = env[injob.ENV_WORKER], int(env[injob.ENV_NODE]), float(env[injob.ENV_TIMEOUT])
    if env.get(injob.ENV_SPARE) == "1":
        injob.say_hello(store, wid, spare=True, node=node)
        while True:
            assigned = injob.get(store, injob.assign_key(wid))
            if assigned is not None:
                break
            if injob.ended(store) is not None:
                return 0
            time.sleep(0.005)
        round_, rank, world = assigned["round"], assigned["rank"], assigned["world"]
    else:
        injob.say_hello(store, wid, spare=False, node=node)
        round_, rank, world = 0, int(env["RANK"]), int(env["WORLD_SIZE"])
    reporter = ProgressReporter.from_env(rank)
    ckpt = os.path.join(a.dir, "ckpt.json")
    while True:
        t0 = time.monotonic()
        step = -1
        try:
            dist.init_process_group("gloo", store=injob.round_pg_store(store, round_), rank=rank, world_size=world,
                                    timeout=timedelta(seconds=timeout))
            state = json.load(open(ckpt)) if os.path.exists(ckpt) else {"step": -1, "total": 0.0}
            injob.post_mark(store, round_, "restored", rank, step=state["step"], tier="local",
                            seconds=time.monotonic() - t0)
            total, first = state["total"], True
            for step in range(state["step"] + 1, a.steps):
                if store.check([injob.round_key(round_, "fault")]):
                    raise RoundFailed("fault notice")
                kind = faults.get((step, round_)) or faults.get((step, None))
                if rank == 1 and kind is not None:
                    if kind == "raise":
                        raise ValueError(f"bad data shard at step {step}")  # (not caught below)
                    if kind == "deterministic":
                        raise DeterministicError(f"non-finite loss at step {step}")
                    if kind == "hang":  # hung in Python code until the round fails
                        while not store.check([injob.round_key(round_, "fault")]):
                            time.sleep(0.01)
                        raise RoundFailed("aborted by the fault notice")
                    if kind == "exit" and _once(os.path.join(a.dir, f"exit-{step}-{round_}")):
                        os._exit(3)  # no error file: nothing to tell one such death from the next
                    if kind == "stuck":  # hung where no notice reaches it (a C call holding on)
                        while True:
                            time.sleep(1)
                    if kind == "hold":  # the test acts meanwhile (kills this rank, say)
                        while not (store.check([injob.round_key(round_, "fault")]) or
                                   os.path.exists(os.path.join(a.dir, "release"))):
                            time.sleep(0.01)
                    if kind == "notice":  # a collective error with every process alive
                        raise RoundFailed(f"simulated collective error at step {step}")
                t = torch.tensor([float(step + 1)])
                dist.all_reduce(t)
                total += t.item()
                if rank == 0:
                    _write(ckpt, {"step": step, "total": total})
                if reporter is not None:
                    reporter.report("train", step=step, force=True, first_step_t=time.time())
                print(f"rank {rank}: step {step} pid {os.getpid()}", flush=True)
                if first:
                    injob.post_mark(store, round_, "first", rank)
                    first = False
                time.sleep(a.step_delay)
            dist.barrier()
        except (RuntimeError, RoundFailed) as e:  # the machinery's: the round failed
            injob.post_fault(store, round_, ranks=[], cause=str(e)[:500], detected_by="rank:collective")
            t1 = time.monotonic()
            if dist.is_initialized():
                dist.destroy_process_group()
            injob.post_left(store, round_, rank, step=step, teardown_s=time.monotonic() - t1, abandoned=[])
            verdict = _wait_verdict(store, round_, timeout)
            if verdict is None:
                return 0 if injob.ended(store) is not None else 1
            if verdict["action"] != "continue":
                return 1
            round_ = int(verdict["next_round"])
            continue
        dist.destroy_process_group()
        if rank == 0 and a.final:
            _write(a.final, {"total": total, "memory_dir": env.get(injob.ENV_MEMORY_DIR),
                             "memory_budget": env.get(injob.ENV_MEMORY_BUDGET)})
        return 0


def _once(marker: str) -> bool:
    """True the first time for ``marker`` in this job (a relaunch does not repeat it)."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def _wait_verdict(store, round_: int, timeout: float) -> dict | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = injob.verdict(store, round_)
        if v is not None:
            return v
        if injob.ended(store) is not None:
            return None
        time.sleep(0.005)
    return None


def _write(path: str, data: dict) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


if __name__ == "__main__":
    exit_with(main)  # sys.exit(main()), its exit a second sooner (ckptstore/supervisor/quick_exit.py)
