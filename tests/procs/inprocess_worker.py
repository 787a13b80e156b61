"""A worker under ckptstore.inprocess.run, for tests/test_inprocess.py (whose fake agent
gives it the in-job environment and plays the leader).

argv: scenario, final round. Every round starts with one all_reduce of the group (the
line "first <round> <rank> <time> <sum> <fds> <threads> <pid> <teardown s> <gc s> <RANK>
<CKPTSTORE_INJOB_ROUND>"); in the final round the function then returns and the process
exits 0. In earlier rounds the round fails:

  ring      rank $VICTIM prints "ready" and sleeps (the test SIGKILLs or SIGSTOPs it);
            the others print "ready" and block in an all_reduce the victim never joins.
  rounds    round 0: rank 0 waits inside inprocess.atomic() until the abort is deferred
            ("deferred"), then leaves it ("aborted atomic-exit ..."); rank 1 sleeps, keeping
            the group in a module-level object. Later rounds: rank 0 blocks in an all_reduce,
            rank 1 sleeps, until the fault notice. Each prints
            "aborted <rank> <exception>,<exceptions it was raised in handling>". In the final
            round rank 1 raises a ValueError of its own.
"""

import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from ckptstore import inprocess
from ckptstore.supervisor.quick_exit import skip_final_collections

scenario, final_round = sys.argv[1], int(sys.argv[2])
victim = int(os.environ.get("VICTIM", "0"))


def say(line: str) -> None:
    os.write(1, (line + "\n").encode())  # one write: an async RoundAborted cannot split the line


def warmup() -> None:
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 8)).sum().backward()
    opt.step()


def chain(e: BaseException) -> str:
    names = []
    while e is not None:
        names.append(type(e).__name__)
        e = e.__cause__ or e.__context__
    return ",".join(names)


def sleep_forever(rank: int, r: int) -> None:
    say(f"ready {r} {rank}")
    try:
        while True:
            time.sleep(60)
    except inprocess.RoundAborted as e:
        say(f"aborted {rank} {type(e).__name__}")
        raise


def block_in_collective(rank: int, r: int) -> None:
    say(f"ready {r} {rank}")
    try:
        while True:
            dist.all_reduce(torch.ones(4))
    except BaseException as e:  # (RoundAborted may land on the collective's error: both are named)
        say(f"aborted {rank} {chain(e)}")
        raise


def in_atomic(r: int) -> None:
    say(f"ready {r} 0")
    try:
        with inprocess.atomic():
            try:
                deadline = time.monotonic() + 60
                while not inprocess._state.deferred and time.monotonic() < deadline:
                    time.sleep(0.01)
                say("deferred" if inprocess._state.deferred else "not deferred")
            except inprocess.RoundAborted:
                say("aborted inside-atomic RoundAborted")
                raise
        say("after atomic")
    except inprocess.RoundAborted as e:
        say(f"aborted atomic-exit {type(e).__name__}")
        raise


class Holder:
    """What a program's module-level model or mesh would be."""


KEPT = Holder()


def main() -> str:
    r, rank = inprocess.round(), dist.get_rank()
    t = torch.ones(4) * (rank + 1)
    dist.all_reduce(t)
    fds, threads = len(os.listdir("/proc/self/fd")), threading.active_count()
    leave = inprocess.last_leave()
    say(f"first {r} {rank} {time.time():.6f} {t[0].item():g} {fds} {threads} {os.getpid()} "
        f"{leave.get('teardown_s', 0):.4f} {leave.get('gc_s', 0):.4f} {os.environ['RANK']} "
        f"{os.environ['CKPTSTORE_INJOB_ROUND']}")
    if r >= final_round:
        if scenario == "rounds" and rank == 1:
            raise ValueError("a bug of the program")  # not recovered in-process: the process ends with it
        dist.barrier()
        return f"done {rank}"
    if scenario == "ring":
        (sleep_forever if rank == victim else block_in_collective)(rank, r)
    elif scenario == "rounds" and r == 0:
        sub = dist.new_group([0, 1])  # (every rank creates it: a collective)
        if rank == 1:  # a subgroup kept outside the function: the wrapper warns a round later
            KEPT.group = sub
        del sub
        in_atomic(r) if rank == 0 else sleep_forever(rank, r)
    elif scenario == "rounds":
        (block_in_collective if rank == 0 else sleep_forever)(rank, r)
    raise AssertionError("unreachable")


if __name__ == "__main__":
    try:
        say(f"result {inprocess.run(main, warmup=warmup)}")
    finally:  # its exit a second sooner (ckptstore/supervisor/quick_exit.py)
        skip_final_collections()
