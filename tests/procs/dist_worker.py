"""One rank of a real gloo process group, for tests/test_distributed.py.

argv: scenario, root, commit timeout (s). Rank, world size and the rendezvous come
from the environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT: env://).
Prints one line per event; the parent asserts on them.

Scenarios
  roundtrip   every rank saves step 7 with its own state; "committed <step> <world> <gen>",
              then loads its own state back without rank= ("selfload ok|bad").
  victim      every rank saves step 1 and commits; then step 2, where rank $VICTIM
              SIGKILLs itself in the middle of save() (after some tensors were staged,
              before it can vote). Survivors print "failed <ExceptionType>".
  mismatch    rank 0 saves step 5, the others step 6.
  unpicklable rank 1's state holds an object that cannot be pickled.
  write_fails rank 1's background write of its data file fails (RLIMIT_FSIZE).
  tiers       a two-tier store (durable: root, local: root + "-local", durable_every=2) saves
              steps 1-3 with rank-local and replicated state; "tiers <local steps> <durable
              steps> <records equal>"; rank 0 then deletes the local tier (node loss) and
              every rank resumes: "resumed <step> <tier> ok|bad".
  tiers_nodes each rank on a node of its own (LOCAL_WORLD_SIZE=1; local tier root-node<rank>, its
              commit records in root-shared), durable_every=3, local_keep last 2, steps 1-4:
              "files <steps holding this rank's data on its node> <files of other ranks there>
              <local steps> <durable steps>", "resumed <step> <tier> ok|bad"; then rank 1's node
              is lost: "lost <step> <tier> ok|bad".
  tiers_hosts a two-tier store without local_shared on ranks that report different host names:
              "refused <message>" from every rank.
  incremental every rank saves the same whole model (DDP without replicated=) at steps 1 and 2
              of an incremental store: "incremental <referenced chunks of this rank> ok|bad".
"""

import os
import resource
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch.distributed as dist  # noqa: E402

import ckptstore  # noqa: E402
from ckptstore.supervisor.quick_exit import skip_final_collections  # noqa: E402
from states import equal_bitwise, rank_state  # noqa: E402

scenario, root, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
dist.init_process_group("gloo", init_method="env://")
rank, world = dist.get_rank(), dist.get_world_size()
store = ckptstore.Store(root, commit_timeout=timeout, chunk_bytes=64 << 10)


def say(*words):
    print(*words, flush=True)


def report_failure(fut):
    exc = fut.exception()
    say("failed", "none" if exc is None else type(exc).__name__,
        int(isinstance(exc, ckptstore.CommitError)), int(isinstance(exc, ckptstore.CommitTimeoutError)))


class KillMeWhenPickled:
    """Pickled inside save(): the rank dies after earlier tensors were staged, before voting."""

    def __reduce__(self):
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable")


if scenario == "roundtrip":
    m = store.save(7, rank_state(rank, 7)).result()
    say("committed", m.step, m.world_size, m.generation)
    dist.barrier()  # every rank's result() returned: safe to load
    say("selfload", "ok" if equal_bitwise(store.load(7), rank_state(rank, 7)) else "bad")
elif scenario == "victim":
    victim = int(os.environ["VICTIM"])
    m = store.save(1, rank_state(rank, 1)).result()
    say("committed", m.step, m.world_size, m.generation)
    state = rank_state(rank, 2, numel=1_000_000)
    if rank == victim:
        state["zz_killer"] = KillMeWhenPickled()  # after the big tensors (dict order)
    fut = store.save(2, state)
    say("staged", 2)
    report_failure(fut)
    os._exit(0)  # a peer is dead: skip tearing the process group down
elif scenario == "mismatch":
    step = 5 if rank == 0 else 6
    try:
        fut = store.save(step, rank_state(rank, step))
    except Exception as e:  # noqa: BLE001 - reported to the parent
        say("save_raised", type(e).__name__, int(isinstance(e, ckptstore.CommitError)))
    else:
        say("staged", step)
        report_failure(fut)
elif scenario == "unpicklable":
    state = rank_state(rank, 3)
    if rank == 1:
        state["bad"] = lambda: None  # pickling a lambda fails
    try:
        fut = store.save(3, state)
    except Exception as e:  # noqa: BLE001 - reported to the parent
        say("save_raised", type(e).__name__, int(isinstance(e, ckptstore.CommitError)))
    else:
        say("staged", 3)
        report_failure(fut)
elif scenario == "write_fails":
    state = rank_state(rank, 4, numel=300_000)
    if rank == 1:
        # A real I/O failure in the background: files of this process may not grow past
        # 64 KiB (EFBIG instead of SIGXFSZ), so writing the data file fails after save()
        # returned, while the small vote files still fit.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))
    fut = ckptstore.Store(root, commit_timeout=timeout, compression="none", chunk_bytes=64 << 10).save(4, state)
    say("staged", 4)
    report_failure(fut)
elif scenario == "tiers":
    import shutil

    import torch
    from ckptstore.checkpoint.manifests import latest_manifest

    tiered = ckptstore.Store(root, local=root + "-local", durable_every=2, commit_timeout=timeout,
                             chunk_bytes=64 << 10)

    def state(step):  # "shared" is replicated: written once, its chunks spread over the ranks
        return {**rank_state(rank, step), "shared": torch.arange(100_000, dtype=torch.float64) * step}

    for step in (1, 2, 3):
        tiered.save(step, state(step), replicated=["shared"])
    ckptstore.wait()  # the saves and the promotion of step 2
    dist.barrier()
    local, durable = tiered.local.location(2), tiered.location(2)
    same = latest_manifest(local).to_json(), latest_manifest(durable).to_json()
    # (a version 4 root: the promotion names the same indexes, copied byte for byte)
    same = all(same[0][k] == same[1][k] for k in ("attempt", "indexes", "globals", "created_at", "metrics"))
    say("tiers", ",".join(map(str, tiered.local.steps())), ",".join(map(str, tiered.committed_steps())), int(same))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root + "-local")  # the node is lost: every rank of it loses its local tier
    dist.barrier()
    got, info = tiered.resume()
    say("resumed", info.step, info.tier, "ok" if equal_bitwise(got, state(2)) else "bad")
elif scenario == "tiers_nodes":
    import shutil
    from pathlib import Path

    from ckptstore.checkpoint.retention import Retention

    node = Path(f"{root}-node{rank}")

    def tiered():
        return ckptstore.Store(root, local=node, local_shared=root + "-shared", durable_every=3,
                               local_keep=Retention(last=2), commit_timeout=timeout, chunk_bytes=64 << 10)

    store = tiered()
    for step in (1, 2, 3, 4):
        store.save(step, rank_state(rank, step))
    ckptstore.wait()
    dist.barrier()  # rank 0's retention after the last commit is done (its wait() covers it)
    # A rank's own sweep after a commit may run before rank 0's retention of that commit
    # (it lags one save on other nodes); once more now, as its next save would:
    from ckptstore.tiers import sweep_own_data

    sweep = store._tiers.sweeps["local"]
    with sweep._sweeping:  # (after the sweep its last commit started, if it still runs)
        sweep_own_data(store.local, rank, set(sweep.committed_here), set())
    mine = sorted({int(p.parts[-4][len("step-"):]) for p in node.rglob(f"data-r{rank:05d}-*.bin")})
    others = [p for p in node.rglob("data-*.bin") if f"data-r{rank:05d}-" not in p.name]
    say("files", ",".join(map(str, mine)), len(others), ",".join(map(str, store.local.steps())),
        ",".join(map(str, store.committed_steps())))
    got, info = tiered().resume()
    say("resumed", info.step, info.tier, "ok" if equal_bitwise(got, rank_state(rank, info.step)) else "bad")
    dist.barrier()
    if rank == 1:
        shutil.rmtree(node)  # this node is lost; step 4 is only in the local tier
    dist.barrier()
    got, info = tiered().resume()
    say("lost", info.step, info.tier, "ok" if equal_bitwise(got, rank_state(rank, info.step)) else "bad")
elif scenario == "tiers_hosts":
    import socket

    socket.gethostname = lambda: f"node{rank}"  # as if each rank ran on a host of its own
    try:
        ckptstore.Store(root, local=root + "-local", commit_timeout=timeout).save(1, rank_state(rank, 1))
        say("saved")
    except ValueError as e:
        say("refused", str(e))
elif scenario == "incremental":
    import torch

    store = ckptstore.Store(root, commit_timeout=timeout, compression="none")
    model = {f"w{i}": torch.randn(256, 256, generator=torch.Generator().manual_seed(i)) for i in range(4)}
    for step in (1, 2):  # equal on every rank, unchanged between the steps
        store.save(step, {"model": model, "step": step}).result()
    m = store.manifest(2)
    mine = [b for _, _, b in m.blobs() if b.step is not None and f"data-r{rank:05d}" in b.file]
    got = store.load(2, rank=rank)
    ok = got["step"] == 2 and all(torch.equal(got["model"][k], v) for k, v in model.items())
    say("incremental", len(mine), "ok" if ok else "bad")
else:
    raise SystemExit(f"unknown scenario {scenario}")
say("done")
dist.destroy_process_group()
skip_final_collections()  # its exit a second sooner (ckptstore/supervisor/quick_exit.py)
