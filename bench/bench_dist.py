#!/usr/bin/env python
"""Distributed benchmark: 4-rank CPU (gloo) sharded save and 2-rank resharding load,
ckptstore beside torch.distributed.checkpoint (DCP).

The state is an FSDP2-like training state: a GPT-like fp32 model of ``--model-mib``
(default 256 MiB) whose every tensor is a DTensor sharded Shard(0) over 4 ranks, plus
AdamW's two moments sharded the same way (3x the model in total) and per-tensor ``step``
scalars. Every tool writes the same state into its own directory on the same disk.

Save (4 ranks; each figure is, per repeat, the slowest rank, then the median over the
repeats; the first save of each tool is a warm-up, reported apart):

* ``ckptstore Store.save``: blocking = until ``save`` returns (tensors staged);
  commit = until ``result()`` returns on rank 0, i.e. the manifest is written
  create-only after every rank's data and vote are durable (fsync);
* ``dcp.save`` (FileSystemWriter defaults: one thread per rank, fsync): blocking = commit;
* ``dcp.async_save`` (default thread checkpointer and stager): blocking = until it
  returns, commit = until its future's ``result()`` returns on rank 0.

Load (2 ranks: every rank needs half of each tensor, from two of the four saved
shards), page cache warm (the checkpoints were just written), into preallocated
DTensor templates: ``Store.load(template=...)`` (checks the xxh3 of every chunk read)
vs ``dcp.load``. Both loads are compared bit for bit with each other and with the
saved values of one tensor regenerated from its seeds.

Usage::

    python bench/bench_dist.py [--model-mib 256] [--repeats 5] [--dir /tmp] \
        [--out bench/results/dist.json] [--doc docs/performance.md | --no-doc]

With ``--doc`` (the default) the section "## Distributed (4-rank CPU)" at the end of
docs/performance.md is replaced (or appended when absent); nothing else there changes.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import warnings

import torch

warnings.filterwarnings("ignore", message=".*using the slower pure-Python/torch fallback.*")

from _common import cpu_model, mount_of, write_json  # noqa: E402

MiB = 1 << 20
SAVE_WORLD, LOAD_WORLD = 4, 2
SECTION = "## Distributed (4-rank CPU)"
D = 1024  # model width


# ---------------------------------------------------------------------------- the state
def model_shapes(model_bytes: int) -> list[tuple[str, tuple[int, ...]]]:
    """GPT-like fp32 tensors adding up to about ``model_bytes``; every first dim divides by 4."""
    per_layer = [("attn.qkv.weight", (3 * D, D)), ("attn.qkv.bias", (3 * D,)), ("attn.proj.weight", (D, D)),
                 ("attn.proj.bias", (D,)), ("ln1.weight", (D,)), ("ln2.weight", (D,)),
                 ("mlp.up.weight", (4 * D, D)), ("mlp.up.bias", (4 * D,)), ("mlp.down.weight", (D, 4 * D)),
                 ("mlp.down.bias", (D,))]
    layer_bytes = sum(math.prod(s) for _, s in per_layer) * 4
    embed_rows = 4096
    n_layers = max(1, round((model_bytes - embed_rows * D * 4) / layer_bytes))
    shapes = [("embed.weight", (embed_rows, D))]
    for i in range(n_layers):
        shapes += [(f"layers.{i}.{n}", s) for n, s in per_layer]
    shapes.append(("norm.weight", (D,)))
    return shapes


def local_shard(index: int, kind: int, rank: int, shape) -> torch.Tensor:
    """Rank ``rank``'s Shard(0) piece (of 4) of tensor ``index``; kind 0 param, 1 exp_avg, 2 exp_avg_sq."""
    rows = shape[0] // SAVE_WORLD
    g = torch.Generator().manual_seed(((index * 3 + kind) << 4) + rank)
    t = torch.randn((rows,) + tuple(shape[1:]), generator=g)
    if kind == 0:
        return t.mul_(0.02)
    scale = 10 ** (-5 + 2 * ((index * 0.618) % 1.0))
    return t.mul_(scale) if kind == 1 else t.mul_(scale).square_().add_(1e-12)


def contiguous_stride(shape) -> tuple[int, ...]:
    out, s = [], 1
    for n in reversed(shape):
        out.append(s)
        s *= n
    return tuple(reversed(out))


def sharded_state(mesh, shapes, rank: int | None, world: int) -> dict:
    """The state as DTensors Shard(0) over ``mesh``: the saved values (rank given, world 4)
    or zeros (rank None: a load template)."""
    from torch.distributed.tensor import DTensor, Shard

    def dt(index, kind, shape):
        if rank is None:
            local = torch.zeros((shape[0] // world,) + tuple(shape[1:]))
        else:
            local = local_shard(index, kind, rank, shape)
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
                                  stride=contiguous_stride(shape))

    model, optim = {}, {}
    for i, (name, shape) in enumerate(shapes):
        model[name] = dt(i, 0, shape)
        optim[name] = {"step": torch.tensor(1000.0 if rank is not None else 0.0),
                       "exp_avg": dt(i, 1, shape), "exp_avg_sq": dt(i, 2, shape)}
    groups = [{"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "params": [n for n, _ in shapes]}]
    return {"model": model, "optim": {"state": optim, "param_groups": groups}}


def dtensors(obj, prefix=""):
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from dtensors(v, f"{prefix}.{k}" if prefix else k)


# ---------------------------------------------------------------------------- ranks
def launch(fn, world: int, *args) -> list[dict]:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned ranks of a gloo group."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=_dt.timedelta(seconds=600), wait_for_workers=False)
    out = tempfile.mkdtemp(prefix="bench-dist-results-")
    procs = [ctx.Process(target=_entry, args=(fn, r, world, store.port, out, args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(900)
    try:
        errors = [open(os.path.join(out, f)).read() for f in sorted(os.listdir(out)) if f.startswith("error")]
        if errors or any(p.exitcode != 0 for p in procs):
            for p in procs:
                if p.is_alive():
                    p.kill()
            raise RuntimeError(f"ranks failed (exit codes {[p.exitcode for p in procs]}):\n" + "\n".join(errors))
        results = []
        for r in range(world):
            with open(os.path.join(out, f"result-{r}.json")) as f:
                results.append(json.load(f))
        return results
    finally:
        shutil.rmtree(out, ignore_errors=True)


def _entry(fn, rank, world, port, out, args):
    import torch.distributed as dist

    try:
        warnings.filterwarnings("ignore")
        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, None, False, timeout=_dt.timedelta(seconds=600))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=_dt.timedelta(seconds=600))
        res = fn(rank, world, *args)
        with open(os.path.join(out, f"result-{rank}.json"), "w") as f:
            json.dump(res, f)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(out, f"error-{rank}.txt"), "w") as f:
            f.write(f"rank {rank}:\n{traceback.format_exc()}")
        os._exit(1)


def _glob(pattern: str) -> list[str]:
    import glob

    return glob.glob(pattern)


def _delete(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def save_worker(rank, world, base, model_bytes, repeats):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.device_mesh import init_device_mesh

    import ckptstore

    mesh = init_device_mesh("cpu", (world,))
    shapes = model_shapes(model_bytes)
    state = sharded_state(mesh, shapes, rank, world)
    local_bytes = sum(t.to_local().numel() * 4 for _, t in dtensors(state))
    store = ckptstore.Store(os.path.join(base, "ckptstore"), commit_timeout=600)
    raw_store = ckptstore.Store(os.path.join(base, "ckptstore_raw"), commit_timeout=600, compression="none")
    times: dict[str, list] = {}

    def record(name, value):
        times.setdefault(name, []).append(value)

    def run_ckptstore(i, st=store, name="ckptstore"):
        dist.barrier()
        t0 = time.perf_counter()
        fut = st.save(i + 1, state)
        t1 = time.perf_counter()
        manifest = fut.result()
        t2 = time.perf_counter()
        dist.barrier()
        record(f"{name}/blocking", t1 - t0)
        record(f"{name}/commit", t2 - t0)
        if rank == 0:
            # How long the committer took to notice the last vote (it polls storage).
            loc = os.path.join(base, name, f"step-{i + 1:012d}")
            votes = [os.stat(p).st_mtime for p in _glob(os.path.join(loc, "attempts", manifest.attempt, "vote-r*.json"))]
            made = os.stat(os.path.join(loc, f"manifest-{manifest.generation:010d}.json")).st_mtime
            record(f"{name}/last vote to manifest", made - max(votes))
            if i > 0:
                _delete(os.path.join(base, name, f"step-{i:012d}"))  # keep the disk use flat

    def run_ckptstore_raw(i):
        run_ckptstore(i, raw_store, "ckptstore_raw")

    def run_dcp(i):
        path = os.path.join(base, "dcp", f"rep{i}")
        dist.barrier()
        t0 = time.perf_counter()
        dcp.save(state, storage_writer=FileSystemWriter(path))
        t1 = time.perf_counter()
        dist.barrier()
        record("dcp.save/blocking", t1 - t0)
        record("dcp.save/commit", t1 - t0)
        if rank == 0 and i > 0:
            _delete(os.path.join(base, "dcp", f"rep{i - 1}"))

    def run_dcp_async(i):
        path = os.path.join(base, "dcp_async", f"rep{i}")
        dist.barrier()
        t0 = time.perf_counter()
        fut = dcp.async_save(state, storage_writer=FileSystemWriter(path))
        t1 = time.perf_counter()
        fut.result()
        t2 = time.perf_counter()
        dist.barrier()
        record("dcp.async_save/blocking", t1 - t0)
        record("dcp.async_save/commit", t2 - t0)
        if rank == 0:
            _delete(os.path.join(base, "dcp_async", f"rep{i - 1}"))

    tools = [run_ckptstore, run_dcp, run_dcp_async, run_ckptstore_raw]
    for i in range(repeats + 1):  # round 0: warm-up (first save of each tool)
        for k in range(len(tools)):
            tools[(i + k) % len(tools)](i)  # rotate the order from round to round
    if rank == 0:
        _delete(os.path.join(base, "dcp_async"))
        _delete(os.path.join(base, "ckptstore_raw"))
    return {"times": times, "local_bytes": local_bytes, "ckptstore_step": repeats + 1,
            "dcp_dir": os.path.join(base, "dcp", f"rep{repeats}")}


def load_worker(rank, world, base, model_bytes, repeats, ckpt_step, dcp_dir):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    import ckptstore

    mesh = init_device_mesh("cpu", (world,))
    shapes = model_shapes(model_bytes)
    ck = sharded_state(mesh, shapes, None, world)
    dc = sharded_state(mesh, shapes, None, world)
    store = ckptstore.Store(os.path.join(base, "ckptstore"))
    times: dict[str, list] = {}
    for i in range(repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ck = store.load(ckpt_step, template=ck)
        t1 = time.perf_counter()
        dist.barrier()
        t2 = time.perf_counter()
        dcp.load(dc, checkpoint_id=dcp_dir)
        t3 = time.perf_counter()
        dist.barrier()
        times.setdefault("ckptstore/load", []).append(t1 - t0)
        times.setdefault("dcp.load/load", []).append(t3 - t2)
    # Both loads agree bit for bit, and match the saved values of one tensor.
    a, b = dict(dtensors(ck)), dict(dtensors(dc))
    equal = a.keys() == b.keys() and all(torch.equal(a[k].to_local(), b[k].to_local()) for k in a)
    rows = shapes[0][1][0] // SAVE_WORLD
    per = SAVE_WORLD // world
    want = torch.cat([local_shard(0, 1, rank * per + j, shapes[0][1]) for j in range(per)])
    matches_saved = torch.equal(a["optim.state.embed.weight.exp_avg"].to_local(), want) and want.shape[0] == rows * per
    return {"times": times, "bit_equal_to_dcp": bool(equal), "matches_saved": bool(matches_saved),
            "local_bytes": sum(t.to_local().numel() * 4 for t in a.values())}


# ---------------------------------------------------------------------------- machine
def machine_info(bench_dir: str) -> dict:
    import ckptstore
    from ckptstore import native

    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "cpu_model": cpu_model(), "logical_cores": os.cpu_count(), "affinity_cores": len(os.sched_getaffinity(0)),
        "ram_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "python": platform.python_version(), "torch": torch.__version__, "ckptstore": ckptstore.__version__,
        "ckptstore_native": bool(native.NATIVE), "kernel": platform.release(), "load_average": os.getloadavg(),
        "disk": {"dir": bench_dir, **mount_of(bench_dir, options=False)},
    }


# ---------------------------------------------------------------------------- figures
def summarise(results: list[dict], key: str, rank: int | None = None) -> dict:
    """Per repeat the slowest rank (or one rank); round 0 is the warm-up."""
    per_round = [results[rank]["times"][key]] if rank is not None else [r["times"][key] for r in results]
    rounds = [max(vals) for vals in zip(*per_round)]
    steady = rounds[1:]
    return {"median": statistics.median(steady), "best": min(steady), "first": rounds[0], "rounds": rounds}


def build_rows(save: list[dict], load: list[dict]) -> list[dict]:
    m = {
        "ckptstore save: blocking": summarise(save, "ckptstore/blocking"),
        "ckptstore save: commit": summarise(save, "ckptstore/commit", rank=0),
        "ckptstore save: last vote -> manifest": summarise(save, "ckptstore/last vote to manifest", rank=0),
        "ckptstore compression=none: blocking": summarise(save, "ckptstore_raw/blocking"),
        "ckptstore compression=none: commit": summarise(save, "ckptstore_raw/commit", rank=0),
        "dcp.save: blocking = commit": summarise(save, "dcp.save/commit"),
        "dcp.async_save: blocking": summarise(save, "dcp.async_save/blocking"),
        "dcp.async_save: commit": summarise(save, "dcp.async_save/commit", rank=0),
        "ckptstore load 4->2 (template)": summarise(load, "ckptstore/load"),
        "dcp.load 4->2": summarise(load, "dcp.load/load"),
    }
    peers = {
        "ckptstore save: blocking": "dcp.async_save: blocking",
        "ckptstore save: commit": "dcp.save: blocking = commit",
        "ckptstore compression=none: blocking": "dcp.async_save: blocking",
        "ckptstore compression=none: commit": "dcp.save: blocking = commit",
        "dcp.async_save: commit": "dcp.save: blocking = commit",
        "ckptstore load 4->2 (template)": "dcp.load 4->2",
    }
    rows = []
    for name, s in m.items():
        peer = peers.get(name)
        rows.append({"what": name, **s, "peer": peer,
                     "ratio": (s["median"] / m[peer]["median"]) if peer else None})
    ck_commit, async_commit = m["ckptstore save: commit"]["median"], m["dcp.async_save: commit"]["median"]
    rows.append({"what": "ckptstore commit vs dcp.async_save commit", "median": ck_commit, "best": None,
                 "first": None, "rounds": [], "peer": "dcp.async_save: commit", "ratio": ck_commit / async_commit})
    return rows


def table(rows: list[dict]) -> str:
    head = f"| {'what':46s} | {'median s':>8s} | {'best s':>7s} | {'first s':>7s} | {'ratio':>6s} | vs |"
    lines = [head, "|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|"]
    for r in rows:
        if r["best"] is None:
            continue
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] is not None else ""
        lines.append(f"| {r['what']:46s} | {r['median']:8.3f} | {r['best']:7.3f} | {r['first']:7.3f} | "
                     f"{ratio:>6s} | {r['peer'] or ''} |")
    return "\n".join(lines)


def doc_section(res: dict, rows: list[dict]) -> str:
    info = res["machine"]
    by = {r["what"]: r for r in rows}
    med = {k: r["median"] for k, r in by.items()}
    ck_b, as_b = med["ckptstore save: blocking"], med["dcp.async_save: blocking"]
    ck_c, ds_c, as_c = med["ckptstore save: commit"], med["dcp.save: blocking = commit"], med["dcp.async_save: commit"]
    raw_b, raw_c = med["ckptstore compression=none: blocking"], med["ckptstore compression=none: commit"]
    poll = by["ckptstore save: last vote -> manifest"]
    ck_l, dc_l = med["ckptstore load 4->2 (template)"], med["dcp.load 4->2"]
    busy = res["other_load_cores"]
    quiet = ("the machine was otherwise quiet" if busy <= 0.25 else
             f"other processes kept {busy:.1f} of its {info['affinity_cores']} cores busy during the run, so the "
             "seconds are noisy: trust the ratios more than the seconds, and re-run on a quiet machine")
    return f"""{SECTION}

`python bench/bench_dist.py` ({info['date']}; {info['cpu_model']}, {info['affinity_cores']} cores,
{info['ram_bytes'] / (1 << 30):.0f} GiB RAM, {info['disk']['fstype']} on {info['disk']['device']}; torch {info['torch']},
ckptstore {info['ckptstore']}, native extension: {'yes' if info['ckptstore_native'] else 'no (torch fallback)'};
{quiet}). Raw figures: `bench/results/dist.json`; runtime {res['bench_wall_s']:.0f} s.

**State.** FSDP2-like: a {res['args']['model_mib']} MiB fp32 GPT-like model, every tensor a DTensor Shard(0)
over 4 gloo ranks on CPU, plus AdamW's two moments sharded the same way and per-tensor `step` scalars:
{res['state']['global_bytes'] / MiB:.0f} MiB in all, {res['state']['per_rank_bytes'] / MiB:.0f} MiB per rank,
{res['state']['tensors']} DTensors.

**Method.** Each tool writes into its own directory on the same disk; a save counts as committed
when it is durable (fsync) and visible. Per repeat the slowest rank counts, except "commit", which
is rank 0's `result()` (rank 0 writes the manifest, or DCP's `.metadata`); median and best of
{res['args']['repeats']} repeats after one warm-up save per tool ("first" is the warm-up), tool order
rotated between repeats. DCP runs with its defaults (FileSystemWriter with one writer thread per
rank and fsync; async_save with the thread checkpointer and default stager); ckptstore with its
defaults (compression "auto", 2 I/O threads per rank here), and once more with compression "none".
"last vote -> manifest" is, on disk, the mtime of the manifest minus that of the last vote: how long
rank 0 took to notice the last vote (it polls storage with backoff up to 0.25 s) and write the
manifest. Loads run on 2 ranks into preallocated DTensor templates (Shard(0) over 2, so each rank
needs two of the four saved shards of every tensor), page cache warm (just written); ckptstore
checks the xxh3-128 of every chunk it reads. The two loads agree bit for bit:
{res['checks']['load_bit_equal_to_dcp']}; they match the saved values: {res['checks']['load_matches_saved']}.

{table(rows)}

- **Blocking time** (training stalls): ckptstore {ck_b:.2f} s vs `dcp.async_save` {as_b:.2f} s
  ({ck_b / as_b:.2f}x); with compression off {raw_b:.2f} s ({raw_b / as_b:.2f}x). `dcp.save` blocks for its
  whole {ds_c:.2f} s.
- **Time to a durable, visible checkpoint**: ckptstore {ck_c:.2f} s, {ck_c / ds_c:.2f}x `dcp.save` ({ds_c:.2f} s)
  and {ck_c / as_c:.2f}x `dcp.async_save` ({as_c:.2f} s); with compression off {raw_c:.2f} s
  ({raw_c / ds_c:.2f}x `dcp.save`). The commit protocol itself (votes through storage, validation,
  create-only manifest) adds {poll['median'] * 1000:.0f} ms median (best {poll['best'] * 1000:.0f} ms) between the
  last vote and the manifest.
- **Resharding load 4 -> 2 ranks**: ckptstore {ck_l:.2f} s vs `dcp.load` {dc_l:.2f} s ({ck_l / dc_l:.2f}x),
  hashes checked, reading only the chunks each rank's shard overlaps.
- Four ranks, their writer threads and DCP's threads share {info['affinity_cores']} cores here, so the
  figures measure CPU contention as much as the disk; "auto" compression's trial encodes cost CPU
  that the ranks compete for (compare the compression=none rows).
"""


def update_doc(path: str, section: str) -> None:
    """Replace this benchmark's section of ``path`` (from its heading to the next "## "
    heading or the end), or append it at the end; nothing else changes."""
    with open(path) as f:
        text = f.read()
    start = text.find(SECTION)
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        end = text.find("\n## ", start + len(SECTION))
        text = text[:start] + section + ("" if end < 0 else "\n" + text[end + 1:])
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def busy_cpu_s() -> float:
    """CPU seconds the whole machine spent busy (all processes), from /proc/stat."""
    with open("/proc/stat") as f:
        vals = [int(v) for v in f.readline().split()[1:9]]
    return (sum(vals) - vals[3] - vals[4]) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """CPU seconds of this process and its (reaped) rank processes."""
    import resource

    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        ru = resource.getrusage(who)
        total += ru.ru_utime + ru.ru_stime
    return total


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-mib", type=int, default=256, help="global fp32 model size (moments add 2x)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default="/tmp", help="parent directory for the checkpoints (a disk, not tmpfs)")
    ap.add_argument("--out", default=os.path.join(here, "results", "dist.json"))
    ap.add_argument("--doc", default=os.path.join(os.path.dirname(here), "docs", "performance.md"))
    ap.add_argument("--no-doc", action="store_true", help="do not touch docs/performance.md")
    args = ap.parse_args()

    start = time.perf_counter()
    busy0, own0 = busy_cpu_s(), own_cpu_s()
    base = tempfile.mkdtemp(prefix="ckptstore-bench-dist-", dir=args.dir)
    try:
        info = machine_info(base)
        model_bytes = args.model_mib * MiB
        shapes = model_shapes(model_bytes)
        global_bytes = 3 * sum(math.prod(s) for _, s in shapes) * 4
        save = launch(save_worker, SAVE_WORLD, base, model_bytes, args.repeats)
        load = launch(load_worker, LOAD_WORLD, base, model_bytes, args.repeats,
                      save[0]["ckptstore_step"], save[0]["dcp_dir"])
    finally:
        shutil.rmtree(base, ignore_errors=True)
    rows = build_rows(save, load)
    res = {
        "machine": info,
        "args": {"model_mib": args.model_mib, "repeats": args.repeats, "save_world": SAVE_WORLD,
                 "load_world": LOAD_WORLD},
        "state": {"global_bytes": global_bytes, "per_rank_bytes": save[0]["local_bytes"],
                  "tensors": 3 * len(shapes), "model_tensors": len(shapes)},
        "checks": {"load_bit_equal_to_dcp": all(r["bit_equal_to_dcp"] for r in load),
                   "load_matches_saved": all(r["matches_saved"] for r in load)},
        "save_ranks": [r["times"] for r in save],
        "load_ranks": [r["times"] for r in load],
        "rows": rows,
    }
    res["bench_wall_s"] = time.perf_counter() - start
    # Cores that *other* processes kept busy during the run: this machine may be shared.
    res["other_load_cores"] = max(0.0, (busy_cpu_s() - busy0) - (own_cpu_s() - own0)) / res["bench_wall_s"]
    print(f"ckptstore {info['ckptstore']} (native: {info['ckptstore_native']}), torch {info['torch']}, "
          f"{info['cpu_model']}, {info['affinity_cores']} cores, {info['disk']['fstype']} on {info['disk']['device']}")
    print(f"state {global_bytes / MiB:.0f} MiB over {SAVE_WORLD} ranks ({res['state']['per_rank_bytes'] / MiB:.0f} MiB "
          f"per rank); median of {args.repeats} after a warm-up; loads bit-equal to dcp: "
          f"{res['checks']['load_bit_equal_to_dcp']}, match saved: {res['checks']['load_matches_saved']}")
    print(table(rows))
    for r in rows:
        if r["best"] is None:
            print(f"{r['what']}: {r['ratio']:.2f}x")
    print(f"bench wall time {res['bench_wall_s']:.0f} s; other processes kept {res['other_load_cores']:.2f} "
          f"cores busy meanwhile")
    if res["other_load_cores"] > 0.25:
        print("WARNING: the machine was busy with other work: run again when it is quiet")
    write_json(args.out, res, indent=1)
    if not args.no_doc:
        update_doc(args.doc, doc_section(res, rows))
        print(f"updated the section {SECTION!r} of {args.doc}")


if __name__ == "__main__":
    sys.exit(main())
