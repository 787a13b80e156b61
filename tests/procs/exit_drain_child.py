"""One rank of a 2-rank gloo group, for tests/test_exit_drain.py: a collective save in
flight when the launcher (played by the test) SIGTERMs the survivors.

argv: scenario, root. Rank, world size and the rendezvous come from the environment
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT: env://). Every rank saves step 1 with
``Store(root).save(1, rank_state(rank, 1))``, prints "staged <attempt>", then idles
(training goes on) until SIGTERM. A SIGTERM handler installed before the first save is
the "previous handler" ckptstore calls after its exit drain: it prints
"after_drain <outcome>" (committed, failed <ExceptionType>, aborted, or in_flight) and
then dies by SIGTERM as the default action would.

Scenarios
  voter_dies      rank 1 SIGKILLs itself where it would write its vote (data written).
  committer_dies  rank 0 SIGKILLs itself where it would start the commit (after its vote).
  preempted       nobody dies. Each rank holds its vote until its own exit mode begins
                  (so the save is surely in flight at SIGTERM); rank 1 holds it further,
                  until it saw rank 0's exit-mode heartbeat change 3 * (liveness window /
                  beat period) times, so rank 0 waits for rank 1's vote, in exit mode,
                  for well over its liveness window while rank 1 is alive and beating.
"""

import os
import select
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch.distributed as dist  # noqa: E402

import ckptstore  # noqa: E402
import ckptstore.checkpoint.save as save_mod  # noqa: E402
from ckptstore import names  # noqa: E402
from ckptstore.checkpoint import exiting  # noqa: E402
from states import rank_state  # noqa: E402

scenario, root = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", init_method="env://")
rank, world = dist.get_rank(), dist.get_world_size()
store = ckptstore.Store(root, commit_timeout=600.0, chunk_bytes=64 << 10)
fut = None


def say(*words):
    print(*words, flush=True)


def outcome(f) -> str:
    if f.done():
        exc = f._future.exception()
        return "committed" if exc is None else f"failed {type(exc).__name__}"
    return "aborted" if f.aborted else "in_flight"


def after_drain(signum, frame):
    say("after_drain", outcome(fut))
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


signal.signal(signal.SIGTERM, after_drain)  # before the first save: ckptstore's drain runs first


def die(*_args, **_kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


real_write_vote = save_mod.write_vote


def vote_in_exit_mode(storage, vote):
    exiting.wait_active()
    if rank == 1:
        # Rank 0's heartbeat must change this often before rank 1 votes: that many exit-mode
        # beats of rank 0 span three liveness windows of rank 0 waiting for this vote.
        need = 3 * int(exiting.liveness() / exiting.beat_every()) + 1
        key, seen = names.heartbeat_name(vote.attempt, 0), set()
        while len(seen) < need:
            try:
                content = storage.read(key)
            except ckptstore.CkptStoreError:
                content = None
            if exiting.says_exiting(content):
                seen.add(content)
            time.sleep(0.05)  # polling for an event, not waiting for a duration
    real_write_vote(storage, vote)


if scenario == "voter_dies" and rank == 1:
    save_mod.write_vote = die
elif scenario == "committer_dies" and rank == 0:
    save_mod.commit = die
elif scenario == "preempted":
    save_mod.write_vote = vote_in_exit_mode
elif scenario not in ("voter_dies", "committer_dies"):
    raise SystemExit(f"unknown scenario {scenario}")

fut = store.save(1, rank_state(rank, 1))
say("staged", fut.attempt)
# Only SIGTERM ends this. Poll rather than block in read(): a signal that lands just
# before a blocking read() would leave its Python handler pending until read returns.
while not select.select([sys.stdin], [], [], 0.2)[0]:
    pass
say("stdin closed")  # not reached: the handler dies by SIGTERM
