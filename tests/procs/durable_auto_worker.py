"""One rank of a real gloo group, for tests/test_durable_auto.py: a two-tier store with
``durable_every="auto"`` whose ranks see deliberately different due times.

argv: scenario ("checkpointer" or "raw"), durable root, local root, commit timeout (s).
Rank 0's M_cold is made tiny (a promotion is due at every save on its clock), every
other rank keeps the prior of a day (due only at its first save). After each save
every rank waits for it and its promotion (``ckptstore.wait()``), so no promotion is in
flight at the next decision. Prints "promoted <steps>" (this rank's cadence's record)
and "durable <committed durable steps>", or "failed <ExceptionType>".
"""

import sys

import torch
import torch.distributed as dist

import ckptstore

scenario, root, local, timeout = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
STEPS = 4
dist.init_process_group("gloo", init_method="env://")
rank = dist.get_rank()
store = ckptstore.Store(root, local=local, durable_every="auto", commit_timeout=timeout)
counter = {"value": torch.zeros(8) + rank}


def say(*words):
    print(*words, flush=True)


try:
    if scenario == "checkpointer":
        ckpt = ckptstore.Checkpointer(store, state={"counter": counter}, every=1, rng=False, signals=())
        ckpt.resume()
    if rank == 0:  # the ranks' clocks disagree: rank 0 is due at every save, the others are not
        store.durable_cadence.mtbf_cold_s = 1e-9
    for step in range(1, STEPS + 1):
        counter["value"] += 1
        if scenario == "checkpointer":
            ckpt.step(step)
        else:
            store.save(step, {"counter": counter["value"]})
        ckptstore.wait()
    say("promoted", ",".join(map(str, store.durable_cadence.promoted_steps)))
    say("durable", ",".join(map(str, store.committed_steps())))
except Exception as e:
    say("failed", type(e).__name__, str(e).splitlines()[0][:200])
dist.destroy_process_group()
