"""Workers for tests/test_sharded.py: ranks of real gloo process groups on CPU.

The parent (pytest) starts ``world`` processes from a forkserver that has already
imported torch, FSDP and ckptstore (so a 4-rank job starts in well under a second on
2 cores), rendezvous through a TCPStore the parent holds (port 0: no port race).
Each worker runs one scenario function and returns a dict, which the wrapper writes to
``result-r<rank>.pt``; an exception is written to ``error-r<rank>.txt``. The parent
asserts on those results. Workers synchronise with collectives, futures and queues,
never with sleeps. Every wait of the parent is bounded by ``HANG_GUARD_S``, which only
turns a hang into a failure.
"""

from __future__ import annotations

import datetime
import os
import re
import threading
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

warnings.filterwarnings("ignore", message=r"ckptstore\.native", category=RuntimeWarning)
import ckptstore  # noqa: E402
from ckptstore.errors import CommitError, CommitTimeoutError, SerializationError  # noqa: E402

HANG_GUARD_S = 180.0
BIG_SHAPE = (64, 1024)  # float32, 256 KiB: many chunks at CHUNK_BYTES
CHUNK_BYTES = 16 << 10  # 4 rows of BIG per chunk

PRELOAD = ["torch", "torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed.checkpoint.state_dict",
           "torch.distributed.tensor.parallel", "torch.nn.parallel", "ckptstore"]
_ctx = None


def context():
    """A forkserver context whose server preloads torch, FSDP and ckptstore once."""
    global _ctx
    if _ctx is None:
        _ctx = mp.get_context("forkserver")
        # The server is started with the parent's environment but (Python 3.11) not its
        # sys.path: preload what is importable from there; this module itself then
        # imports in a moment in each child.
        _ctx.set_forkserver_preload(PRELOAD)
    return _ctx


# --------------------------------------------------------------------- launcher
class Job:
    """``world`` ranks of one scenario; ``events`` is a queue the ranks may post to."""

    def __init__(self, fn, world: int, out_dir, *args):
        ctx = context()
        self.world = world
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=HANG_GUARD_S),
                                   wait_for_workers=False)
        self.events = ctx.Queue()
        self.procs = [ctx.Process(target=_entry, args=(fn, r, world, self.store.port, str(self.out), self.events, args))
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def next_event(self, timeout: float = HANG_GUARD_S):
        return self.events.get(timeout=timeout)

    def join(self, timeout: float = HANG_GUARD_S) -> list[dict | None]:
        """Wait for every rank; fail on a hang or a worker error. Results by rank
        (None for a rank that left no result, e.g. one killed on purpose)."""
        import time

        end = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, end - time.monotonic()))
        hung = [r for r, p in enumerate(self.procs) if p.is_alive()]
        for r in hung:
            self.procs[r].kill()
            self.procs[r].join()
        errors = {r: (self.out / f"error-r{r}.txt").read_text() for r in range(self.world)
                  if (self.out / f"error-r{r}.txt").exists()}
        assert not hung, f"ranks {hung} still running after {timeout}s (hang); errors: {errors}"
        assert not errors, "worker errors:\n" + "\n".join(f"--- rank {r}\n{t}" for r, t in errors.items())
        results = []
        for r in range(self.world):
            path = self.out / f"result-r{r}.pt"
            results.append(torch.load(path, weights_only=False) if path.exists() else None)
        return results

    @property
    def exitcodes(self) -> list[int | None]:
        return [p.exitcode for p in self.procs]


def run_job(fn, world: int, out_dir, *args, timeout: float = HANG_GUARD_S) -> list[dict]:
    job = Job(fn, world, out_dir, *args)
    results = job.join(timeout)
    assert job.exitcodes == [0] * world, f"exit codes {job.exitcodes}"
    return results


def _entry(fn, rank, world, port, out_dir, events, args):
    out = Path(out_dir)
    try:
        torch.set_num_threads(1)
        warnings.filterwarnings("ignore", message=r"ckptstore\.native", category=RuntimeWarning)
        store = dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=HANG_GUARD_S))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=HANG_GUARD_S))
        result = fn(rank, world, events, *args)
        ckptstore.wait(timeout=HANG_GUARD_S)
        torch.save(result, out / f"result-r{rank}.pt")
        dist.destroy_process_group()
    except BaseException:
        (out / f"error-r{rank}.txt").write_text(traceback.format_exc())
        os._exit(1)


# --------------------------------------------------------------------- helpers
def chunk_rows(n: int, parts: int, index: int) -> tuple[int, int]:
    """(start, length) of part ``index`` when torch.chunk splits ``n`` rows into ``parts``
    (the rule of Shard placements and FSDP2, uneven last shards and empty ones included)."""
    size = -(-n // parts) if n else 0
    start = min(index * size, n)
    return start, min(size, n - start)


def shard_region(global_shape, placements, coord, mesh_sizes) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The (offsets, sizes) a rank holds, computed from the placements (independently of
    the DTensor internals that ckptstore uses)."""
    offsets = [0] * len(global_shape)
    sizes = list(global_shape)
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Shard):
            d = p.dim
            start, length = chunk_rows(sizes[d], mesh_sizes[mesh_dim], coord[mesh_dim])
            offsets[d] += start
            sizes[d] = length
    return tuple(offsets), tuple(sizes)


def dtensor_regions(state, prefix: str = "") -> dict[str, dict]:
    """Every DTensor of a nested state, by ckptstore's path name: global shape and the
    region this rank holds (checked against its local tensor)."""
    out = {}
    if isinstance(state, DTensor):
        mesh = state.device_mesh
        coord = mesh.get_coordinate()
        offsets, sizes = shard_region(tuple(state.shape), state.placements, coord, tuple(mesh.shape))
        assert tuple(state.to_local().shape) == sizes, (prefix, state.to_local().shape, sizes)
        out[prefix] = {"shape": tuple(state.shape), "offsets": offsets, "sizes": sizes,
                       "replicate_dims": [i for i, p in enumerate(state.placements) if p.is_replicate()],
                       "coord": tuple(coord)}
    elif isinstance(state, dict):
        for k, v in state.items():
            out.update(dtensor_regions(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            out.update(dtensor_regions(v, f"{prefix}.{i}" if prefix else str(i)))
    return out


def full_copy(state):
    """The same nested state with every DTensor gathered (collective) and every tensor cloned."""
    if isinstance(state, DTensor):
        return state.full_tensor().clone()
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: full_copy(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(full_copy(v) for v in state)
    return state


def rchar() -> int:
    """Bytes this process (all threads) received from read syscalls, page-cache hits included."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no rchar")


def file_rank(name: str) -> int:
    m = re.search(r"data-r(\d+)-s\d+\.bin$", name)
    assert m, name
    return int(m.group(1))


def overlapping_stored_bytes(entry, offsets, sizes) -> int:
    """Stored bytes of the chunks of a manifest entry that overlap a region."""
    total = 0
    for c in entry.chunks:
        if all(max(a, b) < min(a + n, b + m) for a, n, b, m in zip(offsets, sizes, c.offsets, c.sizes)):
            total += c.blob.length
    return total


# --------------------------------------------------------------------- FSDP2
def build_fsdp(mesh, seed: int = 0):
    """Linear(13, 8): even over 4 ranks, uneven over 3; Linear(8, 7): uneven over 4;
    Linear(7, 3): fewer rows than 4 ranks, so one rank holds an empty shard."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(13, 8), nn.ReLU(), nn.Linear(8, 7), nn.ReLU(), nn.Linear(7, 3))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    return model, opt


def batch(step: int, rank: int, n_in: int = 13, n_out: int = 3, rows: int = 6):
    g = torch.Generator().manual_seed(10_000 * rank + step)
    return torch.randn(rows, n_in, generator=g), torch.randn(rows, n_out, generator=g)


def mesh_for(shape: tuple[int, ...]):
    if len(shape) == 1:
        return init_device_mesh("cpu", shape), [Shard(0)]
    return init_device_mesh("cpu", shape, mesh_dim_names=("rep", "shard")), [Replicate(), Shard(0)]


def big_full() -> torch.Tensor:
    return torch.randn(*BIG_SHAPE, generator=torch.Generator().manual_seed(42))


def trained_fsdp(rank: int, world: int):
    """(mesh, model state dict, optimizer state dict, big sharded tensor) after 3 steps
    of FSDP2 training on ``world`` ranks (the same on every run)."""
    mesh, placements = mesh_for((world,))
    model, opt = build_fsdp(mesh)
    for step in range(3):
        x, y = batch(step, rank)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    msd, osd = get_state_dict(model, opt)
    return mesh, msd, osd, distribute_tensor(big_full(), mesh, placements)


def fsdp_save(rank, world, events, root, ref_path):
    """Train 3 steps on ``world`` ranks and save step 1: model, AdamW state, a big
    sharded tensor, and rank-local values. Rank 0 writes the gathered reference."""
    _, msd, osd, big = trained_fsdp(rank, world)
    torch.manual_seed(1000 + rank)
    rank_local = {"rank": rank, "rng": torch.get_rng_state(), "loader_pos": 1000 + 17 * rank}
    state = {"model": msd, "optim": osd, "big": big, "meta": rank_local}
    store = ckptstore.Store(root, commit_timeout=60, chunk_bytes=CHUNK_BYTES)
    manifest = store.save(1, state).result()
    ref = full_copy({"model": msd, "optim": osd, "big": big})
    if rank == 0:
        torch.save(ref, ref_path)
    return {"regions": dtensor_regions(state), "meta": rank_local, "generation": manifest.generation}


def fsdp_load(rank, world, events, root, mesh_shape):
    """Fill a freshly initialised FSDP2 model + AdamW (another seed) from the checkpoint
    through a template, then gather what the model and optimizer hold."""
    mesh, placements = mesh_for(tuple(mesh_shape))
    model, opt = build_fsdp(mesh, seed=123)
    msd, osd = get_state_dict(model, opt)  # initialises the AdamW state (zeros)
    big = distribute_tensor(torch.zeros(BIG_SHAPE), mesh, placements)
    template = {"model": msd, "optim": osd, "big": big}
    before = full_copy(msd)  # the freshly initialised weights the load must replace
    store = ckptstore.Store(root, commit_timeout=60)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, info = store.load(template=template, return_info=True)
    set_state_dict(model, opt, model_state_dict=out["model"], optim_state_dict=out["optim"])
    msd2, osd2 = get_state_dict(model, opt)
    gathered = full_copy({"model": msd2, "optim": osd2, "big": out["big"]})

    # Bytes read for "big" alone: a load with only "big" in the template minus one with
    # an empty template (both read the manifest, the skeleton and rank-local tensors).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        store.load(template={})  # warm: nothing lazily imported or cached below
        r0 = rchar()
        store.load(template={})
        r1 = rchar()
        store.load(template={"big": distribute_tensor(torch.zeros(BIG_SHAPE), mesh, placements)})
        r2 = rchar()
    entry = store.manifest().tensors["big"]
    region = dtensor_regions({"big": big})["big"]
    return {
        "gathered": gathered if rank == 0 else None,
        "before": before if rank == 0 else None,
        "meta": out["meta"],
        "info": {"saved_world_size": info.saved_world_size, "world_size": info.world_size,
                 "resharded": info.resharded, "rank_state_of": info.rank_state_of},
        "warnings": [w.category.__name__ for w in caught],
        "big_read": (r2 - r1) - (r1 - r0),
        "big_needed": overlapping_stored_bytes(entry, region["offsets"], region["sizes"]),
        "big_stored": sum(c.blob.length for c in entry.chunks),
        "big_region": (region["offsets"], region["sizes"]),
        # format version 4: the other ranks' indexes a load may read to find big's chunks
        "other_indexes": sum(b.length for r, b in enumerate(store.manifest(records=False).indexes or ())
                             if r != info.rank_state_of),
    }


# --------------------------------------------------------------------- DDP + HSDP
N_LAYERS, WIDTH = 6, 128


def ddp_and_hsdp(rank, world, events, root):
    from torch.nn.parallel import DistributedDataParallel as DDP

    res = {}
    # ---- DDP: the model is replicated, RNG and loader position are rank-local
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(N_LAYERS)])
    ddp = DDP(model)
    g = torch.Generator().manual_seed(rank)
    ddp(torch.randn(8, WIDTH, generator=g)).square().mean().backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    torch.manual_seed(500 + rank)
    torch.rand(rank + 1)  # each rank's generator at its own position
    state = {"model": model.state_dict(), "rng": torch.get_rng_state(), "loader": {"pos": 7 + 100 * rank, "epoch": 3}}
    store = ckptstore.Store(f"{root}/ddp", compression="none", commit_timeout=60)
    store.save(1, state, replicated=["model.*"]).result()
    res["ddp_saved"] = {"model": {k: v.clone() for k, v in state["model"].items()}, "rng": state["rng"].clone(),
                        "pos": state["loader"]["pos"]}
    dist.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, info = store.load(return_info=True)
    res["ddp_loaded"] = {"model": out["model"], "rng": out["rng"], "pos": out["loader"]["pos"],
                         "epoch": out["loader"]["epoch"]}
    res["ddp_info"] = {"resharded": info.resharded, "rank_state_of": info.rank_state_of,
                       "saved_world_size": info.saved_world_size, "world_size": info.world_size}
    res["ddp_warnings"] = [w.category.__name__ for w in caught]

    # ---- replicated data that differs on one rank: nothing may commit
    bad = {k: v.clone() for k, v in state["model"].items()}
    if rank == 2:
        bad["4.weight"][3, 5] += 1.0
    exc = store.save(2, {"model": bad, "rng": state["rng"]}, replicated=["model.*"]).exception(HANG_GUARD_S)
    res["ddp_diverged"] = _describe(exc)
    dist.barrier()  # every rank's save 2 has ended
    res["ddp_steps"] = store.steps()

    # ---- HSDP: 2x2 mesh, Replicate over "rep", Shard over "shard"
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
    g = torch.Generator().manual_seed(9)
    fulls = {"a": torch.randn(64, 32, generator=g), "b": torch.randn(33, 8, generator=g),
             "c": torch.randn(16, 40, generator=g), "d": torch.randn(20, 20, generator=g),
             "e": torch.randn(3, 1, generator=g)}
    dims = {"a": 0, "b": 0, "c": 1, "d": 1, "e": 0}
    hsdp = {k: distribute_tensor(v, mesh, [Replicate(), Shard(dims[k])]) for k, v in fulls.items()}
    hstore = ckptstore.Store(f"{root}/hsdp", compression="none", commit_timeout=60, chunk_bytes=2048)
    hstore.save(1, {"hsdp": hsdp, "rank": rank}).result()
    res["hsdp_regions"] = dtensor_regions({"hsdp": hsdp})
    res["hsdp_fulls"] = fulls
    dist.barrier()
    # ... loaded through a template on a 1-D mesh of 4, every tensor Shard(0)
    flat = init_device_mesh("cpu", (4,))
    template = {"hsdp": {k: distribute_tensor(torch.zeros_like(v), flat, [Shard(0)]) for k, v in fulls.items()}}
    out = hstore.load(1, template=template)
    res["hsdp_resharded"] = full_copy(out["hsdp"])

    # ---- a Replicate copy that differs on one replica: nothing may commit
    local = hsdp["a"].to_local().clone()
    if tuple(mesh.get_coordinate()) == (1, 0):
        local[0, 0] += 1.0
    skewed = DTensor.from_local(local, mesh, [Replicate(), Shard(0)], run_check=False,
                                shape=hsdp["a"].shape, stride=hsdp["a"].stride())
    exc = hstore.save(2, {"hsdp": {"a": skewed}}).exception(HANG_GUARD_S)
    res["hsdp_diverged"] = _describe(exc)
    dist.barrier()
    res["hsdp_steps"] = hstore.steps()

    # ---- the same with a box small enough to travel in a pack (replica hashes in packs)
    pstore = ckptstore.Store(f"{root}/hsdp_packed", compression="none", commit_timeout=60, chunk_bytes=2048)
    pstore.save(1, {"e": hsdp["e"]}).result()
    local = hsdp["e"].to_local().clone()
    if tuple(mesh.get_coordinate()) == (1, 0):
        local.add_(1.0)
    skewed = DTensor.from_local(local, mesh, [Replicate(), Shard(0)], run_check=False,
                                shape=hsdp["e"].shape, stride=hsdp["e"].stride())
    res["hsdp_packed_diverged"] = _describe(pstore.save(2, {"e": skewed}).exception(HANG_GUARD_S))
    dist.barrier()
    res["hsdp_packed_steps"] = pstore.steps()

    # ---- tensor parallel inside a data-parallel group: a DTensor on the 1-D "shard"
    # submesh (ranks {0,1} and {2,3} each hold a complete copy), as TP + DDP states are
    tp = distribute_tensor(fulls["a"], mesh["shard"], [Shard(0)])
    sstore = ckptstore.Store(f"{root}/submesh", compression="none", commit_timeout=60)
    res["submesh_save"] = _describe(sstore.save(1, {"tp": tp}).exception(HANG_GUARD_S))
    res["submesh_regions"] = dtensor_regions({"tp": tp})
    return res


def _describe(exc):
    return None if exc is None else {"type": type(exc).__name__, "message": str(exc),
                                     "commit_error": isinstance(exc, CommitError),
                                     "timeout": isinstance(exc, CommitTimeoutError)}


# --------------------------------------------------------------------- SIGKILL mid-save
VICTIM_SHAPE = (256, 64)


def victim_full(step: int) -> torch.Tensor:
    return torch.randn(*VICTIM_SHAPE, generator=torch.Generator().manual_seed(step))


class PauseMidSave:
    """Pickled inside ``save`` after the tensors before it were staged: tells the parent
    this rank is mid-save, then waits for the parent's SIGKILL."""

    def __init__(self, events):
        self.events = events

    def __reduce__(self):
        self.events.put(("mid-save", dist.get_rank(), os.getpid()))
        threading.Event().wait()  # never set: the parent kills this process
        raise AssertionError("unreachable")


def killed_mid_save(rank, world, events, root, victim, timeout):
    mesh = init_device_mesh("cpu", (world,))
    store = ckptstore.Store(root, commit_timeout=60, chunk_bytes=4096)
    w1 = distribute_tensor(victim_full(1), mesh, [Shard(0)])
    store.save(1, {"w": w1, "rank": torch.tensor([rank])}).result()
    dist.barrier()
    fast = ckptstore.Store(root, commit_timeout=timeout, chunk_bytes=4096)
    w2 = distribute_tensor(victim_full(2), mesh, [Shard(0)])
    state = {"w": w2, "rank": torch.tensor([rank])}
    if rank == victim:
        state["pause"] = PauseMidSave(events)
    exc = fast.save(2, state).exception(HANG_GUARD_S)
    res = _describe(exc)
    res["steps"] = store.steps()
    return res


# --------------------------------------------------------------------- training, resumed
def _train_model(mesh):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 30), nn.ReLU(), nn.Dropout(0.25), nn.Linear(30, 5))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.02)


def train(rank, world, events, root, total, every, stop_after, resume):
    """FSDP2 training with dropout (rank-local RNG) and a deterministic data position;
    saves every ``every`` steps without waiting, stops after ``stop_after`` (None: at
    ``total``), or resumes from the latest checkpoint."""
    mesh = init_device_mesh("cpu", (world,))
    model, opt = _train_model(mesh)
    torch.manual_seed(100 + rank)
    store = ckptstore.Store(root, commit_timeout=60)
    step, pos, resumed_from = 0, 0, None
    if resume:
        msd, osd = get_state_dict(model, opt)
        out = store.load(template={"model": msd, "optim": osd})
        set_state_dict(model, opt, model_state_dict=out["model"], optim_state_dict=out["optim"])
        torch.set_rng_state(out["rng"])
        pos, step = out["loader"]["pos"], out["step"]
        resumed_from = step
    initial = full_copy(get_state_dict(model, opt)[0]) if not resume else None
    while step < total:
        step += 1
        x, y = batch(pos, rank, n_in=16, n_out=5, rows=8)
        pos += 1
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        if step % every == 0:
            msd, osd = get_state_dict(model, opt)
            store.save(step, {"model": msd, "optim": osd, "rng": torch.get_rng_state(),
                              "loader": {"pos": pos}, "step": step})
        if step == stop_after:
            break
    ckptstore.wait(HANG_GUARD_S)
    msd, osd = get_state_dict(model, opt)
    final = full_copy({"model": msd, "optim": osd["state"]})
    return {"final": final if rank == 0 else None, "initial": initial if rank == 0 else None,
            "resumed_from": resumed_from, "steps": store.steps(), "last_step": step}


# --------------------------------------------------------------------- FSDP2 over tensor parallelism
# fully_shard over "dp" of a module that parallelize_module sharded over "tp" gives the
# parameters TP sharded on dim 0 the placements (_StridedShard(0, split_factor=2), Shard(0)):
# FSDP shards the TP shard, so "dp" splits each TP shard, not the whole tensor.
def _tp_model(seed: int) -> nn.Module:
    """0: Linear(16, 32) colwise, weight 32 rows (even); 2: Linear(32, 9) rowwise, weight
    Shard(1) by TP and 9 rows split 5/4 by FSDP; 4: Linear(9, 7) colwise, 7 rows split 4/3
    by TP and 2/2, 2/1 by FSDP (uneven _StridedShard)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 9), nn.ReLU(), nn.Linear(9, 7))


def build_fsdp_tp(mesh, seed: int = 0):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = _tp_model(seed)
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel(),
                                           "4": ColwiseParallel(output_layouts=Replicate())})
    for i in (0, 2, 4):
        fully_shard(model[i], mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)


def build_fsdp_plain(mesh, seed: int = 0):
    model = _tp_model(seed)
    for i in (0, 2, 4):
        fully_shard(model[i], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)


STRIDED_SHAPES = {"flat_cols": (48,), "rows_after_rows": (11, 6), "cols": (5, 12)}


def strided_full(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(*STRIDED_SHAPES[name], generator=g)


def strided_extras(mesh, fill=None) -> dict:
    """DTensors on the 2x2 mesh whose local elements are NOT one box of the global tensor:
    the flattened view of a column shard (torch gives it (Replicate, _StridedShard(0, 6))),
    a strided shard after a plain one on the same dim, a strided column shard. Built with
    torch's own sharding (``src_data_rank=None``: each rank slices its part locally)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    def full(name):
        return strided_full(name) if fill is None else torch.full(STRIDED_SHAPES[name], fill)

    cols = distribute_tensor(full("flat_cols").reshape(6, 8), mesh, [Replicate(), Shard(1)], src_data_rank=None)
    return {
        "flat_cols": cols.view(-1),
        "rows_after_rows": distribute_tensor(full("rows_after_rows"), mesh,
                                             [Shard(0), _StridedShard(0, split_factor=2)], src_data_rank=None),
        "cols": distribute_tensor(full("cols"), mesh, [Replicate(), _StridedShard(1, split_factor=3)],
                                  src_data_rank=None),
    }


def _placements(state, prefix: str = "") -> dict[str, str]:
    if isinstance(state, DTensor):
        return {prefix: repr(tuple(state.placements))}
    out = {}
    if isinstance(state, dict):
        for k, v in state.items():
            out.update(_placements(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def tp_save(rank, world, events, root, ref_path):
    """FSDP2 + TP on a ("dp", "tp") 2x2 mesh: one AdamW step, then save model, optimizer
    state and the strided extras. Rank 0 writes the gathered ``full_tensor()`` reference
    and, as a check of that reference, the weights FSDP itself all-gathers for a forward
    (TP placements only, captured by a forward pre-hook that runs after FSDP's)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model, opt = build_fsdp_tp(mesh)
    x, y = batch(0, mesh.get_coordinate()[0], n_in=16, n_out=7)  # one batch per dp group
    F.mse_loss(model(x), y).backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    extras = strided_extras(mesh)
    state = {"model": msd, "optim": osd, "extras": extras, "rank": rank}
    store = ckptstore.Store(root, commit_timeout=60, chunk_bytes=256)  # several chunks per box
    store.save(1, state).result()
    ref = full_copy({"model": msd, "optim": osd, "extras": extras})

    unsharded = {}

    def capture(module, args, prefix):
        for name, p in module.named_parameters(recurse=False):
            unsharded[f"{prefix}.{name}"] = (repr(tuple(p.placements)), p.full_tensor().clone())

    hooks = [model[i].register_forward_pre_hook(lambda m, a, i=i: capture(m, a, str(i))) for i in (0, 2, 4)]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()

    # A Partial placement has no region of its own: the save must refuse it by name.
    from torch.distributed.tensor import Partial

    partial = DTensor.from_local(torch.ones(3), mesh, [Replicate(), Partial()])
    try:
        store.save(2, {"ok": extras["cols"], "bad": {"sum": partial}}).result()
        refused = None
    except SerializationError as e:
        refused = str(e)
    if rank == 0:
        torch.save(ref, ref_path)
    return {"placements": _placements(state), "unsharded": unsharded if rank == 0 else None,
            "refused": refused, "steps": store.steps()}


def _load_into(root, model, opt, msd, osd, extras) -> dict:
    """Load ``root`` into the model and optimizer (through their state-dict templates) and
    into ``extras``; returns {"model", "optim", "extras"} as the model and optimizer now
    hold them, and the loaded extras."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ckptstore.WorldSizeChangedWarning)
        out = ckptstore.Store(root, commit_timeout=60).load(template={"model": msd, "optim": osd, "extras": extras})
    set_state_dict(model, opt, model_state_dict=out["model"], optim_state_dict=out["optim"])
    msd2, osd2 = get_state_dict(model, opt)
    return {"model": msd2, "optim": osd2, "extras": out["extras"]}


def tp_load_plain(rank, world, events, src, dst):
    """Load the FSDP2 + TP checkpoint into plain FSDP2 on a 1-D mesh of ``world`` ranks, then
    save what was loaded in that layout (Shard(0) only) for tp_load to read back."""
    mesh = init_device_mesh("cpu", (world,))
    model, opt = build_fsdp_plain(mesh, seed=123)
    msd, osd = get_state_dict(model, opt)
    extras = {k: distribute_tensor(torch.zeros(s), mesh, [Shard(0)]) for k, s in STRIDED_SHAPES.items()}
    loaded = _load_into(src, model, opt, msd, osd, extras)
    gathered = full_copy(loaded)
    ckptstore.Store(dst, commit_timeout=60, chunk_bytes=256).save(1, loaded).result()
    return {"gathered": gathered if rank == 0 else None}


def tp_load(rank, world, events, roots):
    """Load each checkpoint of ``roots`` into a fresh FSDP2 + TP model (another seed) and
    the strided extras on the 2x2 mesh, then gather what the model and optimizer hold."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    res = {}
    for name, root in roots.items():
        model, opt = build_fsdp_tp(mesh, seed=123)
        msd, osd = get_state_dict(model, opt)
        before = full_copy(msd)
        extras = strided_extras(mesh, fill=0.0)
        loaded = _load_into(root, model, opt, msd, osd, extras)
        res[name] = {"gathered": full_copy(loaded), "before": before, "placements": _placements({"model": loaded["model"]})}
    return res if rank == 0 else {}


def load_one_rank_checkpoints(rank, world, events, store_root, dropin_path):
    """Load a 1-rank Store checkpoint (whole, and into a template of DTensors) and a
    1-rank drop-in checkpoint on every rank."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state, info = ckptstore.Store(store_root).load(return_info=True)
    with warnings.catch_warnings(record=True) as caught_dropin:
        warnings.simplefilter("always")
        weights = ckptstore.load(dropin_path)
    # One process's weights into a sharded model (FSDP2's DTensors): each rank its rows.
    mesh, _ = mesh_for((world,))
    template = {"w": distribute_tensor(torch.zeros(6), mesh, [Shard(0)]),
                "r": distribute_tensor(torch.zeros(6), mesh, [Replicate()])}
    sharded = ckptstore.Store(store_root).load(template=template)
    start, length = chunk_rows(6, world, rank)
    rows = slice(start, start + length)
    return {"step": state["step"], "resharded": info.resharded, "rank_state_of": info.rank_state_of,
            "warnings": [w.category.__name__ for w in caught],
            "dropin_warnings": [w.category.__name__ for w in caught_dropin],
            "dropin_ok": bool(torch.equal(weights["w"], torch.arange(6.0))),
            "sharded_ok": bool(torch.equal(sharded["w"].to_local(), torch.arange(6.0)[rows])
                               and torch.equal(sharded["r"].to_local(), torch.arange(6.0) * 2))}


# --------------------------------------------------------------------- torch.distributed.checkpoint


def dcp_save(rank, world, events, url, ref_path, use_async):
    """Train FSDP2 3 steps and save through ``dcp.save`` (or ``dcp.async_save``) into
    ckptstore: model, AdamW state, a big sharded tensor and plain values (DCP pickles
    those). Rank 0 writes the gathered reference."""
    import torch.distributed.checkpoint as dcp

    import ckptstore.dcp

    _, msd, osd, big = trained_fsdp(rank, world)
    state = {"model": msd, "optim": osd, "big": big, "extra": {"epoch": 7, "name": "run-7"}}
    writer = ckptstore.dcp.Writer(url, step=1, compression="none")
    if use_async:
        dcp.async_save(state, storage_writer=writer).result()
    else:
        dcp.save(state, storage_writer=writer)
    ref = full_copy({"model": msd, "optim": osd, "big": big})  # (a collective: every rank)
    if rank == 0:
        torch.save(ref, ref_path)
    return {}


def dcp_load(rank, world, events, url, mesh_shape):
    """A fresh FSDP2 model (another seed) on ``mesh_shape`` filled by ``dcp.load`` from
    ckptstore; what the model and optimizer then hold, gathered; or the load's error."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    import ckptstore.dcp

    mesh, placements = mesh_for(tuple(mesh_shape))
    model, opt = build_fsdp(mesh, seed=123)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "big": distribute_tensor(torch.zeros(BIG_SHAPE), mesh, placements),
             "extra": {"epoch": 0, "name": ""}}
    try:
        dcp.load(state, storage_reader=ckptstore.dcp.Reader(url, step=1))
    except (Exception, CheckpointException) as e:  # damage: every rank must say so (a BaseException)
        return {"error": f"{type(e).__name__}: {e}"}
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    msd2, osd2 = get_state_dict(model, opt)
    gathered = full_copy({"model": msd2, "optim": osd2, "big": state["big"]})
    return {"gathered": gathered if rank == 0 else None, "extra": state["extra"]}
