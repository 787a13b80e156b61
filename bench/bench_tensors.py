#!/usr/bin/env python
"""Cost per tensor: many small tensors, ckptstore beside its peers in the same run.

For each count N (``--counts``, default 1,000 and 10,000; add 100000 for the
mixture-of-experts scale) a state of N fp32 tensors of ``--numel`` elements (default
1024: 4 KiB each) is saved and loaded, the peers interleaved with ckptstore in every
repeat (the machine is shared: ratios of the same run are what count):

- **blocking**: ``ckptstore.save`` until it returns (staged) against
  ``dcp.async_save`` until it returns and a bare ``copy_`` of every tensor into
  preallocated ones; ``per tensor`` is (blocking - copy) / N;
- **committed and durable**: ``ckptstore.save(...).result()`` against ``torch.save`` +
  flush + fsync;
- **load**: ``ckptstore.load`` against ``torch.load(weights_only=True)``, page cache warm,
  wall-clock and CPU seconds of the process
  (each file read through once first: ckptstore's writer drops what it wrote from the
  page cache, torch.save's stays; bench_core.py measures cold loads).

Steady state: one untimed save of each first (the staging pool is sized and faulted).
Prints a table of medians and writes JSON (``--out``).

Usage::

    python bench/bench_tensors.py [--counts 1000,10000] [--numel 1024] [--repeats 3] [--out ...]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import shutil
import statistics
import tempfile
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from _common import cpu_model, read_through, write_json

warnings.simplefilter("ignore")
import ckptstore  # noqa: E402
from ckptstore import names  # noqa: E402
from ckptstore.checkpoint.manifests import generations, read_manifest  # noqa: E402
from ckptstore.storage import LocalStorage  # noqa: E402


def fsync_torch_save(state, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def measure(n: int, numel: int, repeats: int, root: str) -> dict:
    g = torch.Generator().manual_seed(n)
    state = {f"layers.{i}.weight": torch.randn(numel, generator=g) for i in range(n)}
    copies = {k: torch.empty_like(v) for k, v in state.items()}
    times: dict[str, list[float]] = {k: [] for k in (
        "copy_", "ckptstore blocking", "dcp.async_save blocking", "ckptstore committed", "torch.save+fsync",
        "ckptstore.load", "torch.load", "ckptstore.load CPU", "torch.load CPU")}

    def fresh(name: str) -> str:
        path = os.path.join(root, f"{name}-{time.monotonic_ns()}")
        return path

    # warm-up: pools sized and faulted, code paths imported
    ckptstore.save(state, fresh("warm")).result()
    dcp.async_save(state, storage_writer=FileSystemWriter(fresh("warm-dcp")), no_dist=True).result()
    last_ck = last_torch = None
    for _ in range(repeats):
        t = time.perf_counter()
        for k, v in state.items():
            copies[k].copy_(v)
        times["copy_"].append(time.perf_counter() - t)

        path = fresh("ck")
        t = time.perf_counter()
        fut = ckptstore.save(state, path)
        times["ckptstore blocking"].append(time.perf_counter() - t)
        fut.result()
        times["ckptstore committed"].append(time.perf_counter() - t)
        last_ck = path

        t = time.perf_counter()
        dfut = dcp.async_save(state, storage_writer=FileSystemWriter(fresh("dcp")), no_dist=True)
        times["dcp.async_save blocking"].append(time.perf_counter() - t)
        dfut.result()

        path = fresh("torch") + ".pt"
        t = time.perf_counter()
        fsync_torch_save(state, path)
        times["torch.save+fsync"].append(time.perf_counter() - t)
        last_torch = path

        read_through(last_ck)
        read_through(last_torch)
        # CPU seconds too: a load is CPU-bound here, and the VM's stolen time, which
        # swings the wall-clock figures by 2x, is not charged to the process.
        t, c = time.perf_counter(), time.process_time()
        ckptstore.load(last_ck)
        times["ckptstore.load"].append(time.perf_counter() - t)
        times["ckptstore.load CPU"].append(time.process_time() - c)
        t, c = time.perf_counter(), time.process_time()
        torch.load(last_torch, weights_only=True)
        times["torch.load"].append(time.perf_counter() - t)
        times["torch.load CPU"].append(time.process_time() - c)
    med = {k: statistics.median(v) for k, v in times.items()}
    # Manifest size and parse time (one chunk per tensor here), per 100,000 chunks.
    storage = LocalStorage(last_ck)
    gen = generations(storage)[-1]
    size = storage.stat(names.manifest_name(gen)).size
    parse = []
    for _ in range(repeats):
        t = time.perf_counter()
        read_manifest(storage, gen)
        parse.append(time.perf_counter() - t)
    med["manifest MB per 100k chunks"] = size / n * 100_000 / 1e6
    med["manifest read+parse s per 100k chunks"] = statistics.median(parse) / n * 100_000
    med["per tensor beyond copy_ (us)"] = (med["ckptstore blocking"] - med["copy_"]) / n * 1e6
    return {"n": n, "numel": numel, "median_s": med, "all_s": times}


def measure_dtensors(n: int, numel: int, repeats: int, root: str) -> dict:
    """Blocking and committed time of a state of N DTensors (FSDP2's kind: Shard(0) on a
    CPU mesh of this one process) through ``Store.save``, beside ``dcp.async_save`` of
    the same state (its files fsynced, as ckptstore's) and a bare ``copy_`` of the local
    tensors."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29561")
        dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    g = torch.Generator().manual_seed(n)
    state = {f"layers.{i}.weight": distribute_tensor(torch.randn(numel, generator=g), mesh, [Shard(0)])
             for i in range(n)}
    locals_ = [v.to_local() for v in state.values()]
    copies = [torch.empty_like(t) for t in locals_]
    store = ckptstore.Store(os.path.join(root, "store"), compression="none")
    times: dict[str, list[float]] = {"copy_": [], "ckptstore blocking": [], "dcp.async_save blocking": [],
                                     "ckptstore committed": [], "dcp.async_save committed": []}
    store.save(0, state).result()  # warm-up
    dcp.async_save(state, checkpoint_id=os.path.join(root, "warm-dcp")).result()
    for step in range(1, repeats + 1):
        t = time.perf_counter()
        for dst, src in zip(copies, locals_):
            dst.copy_(src)
        times["copy_"].append(time.perf_counter() - t)
        t = time.perf_counter()
        fut = store.save(step, state)
        times["ckptstore blocking"].append(time.perf_counter() - t)
        fut.result()
        times["ckptstore committed"].append(time.perf_counter() - t)
        t = time.perf_counter()
        dfut = dcp.async_save(state, checkpoint_id=os.path.join(root, f"dcp-{step}"))
        times["dcp.async_save blocking"].append(time.perf_counter() - t)
        dfut.result()
        times["dcp.async_save committed"].append(time.perf_counter() - t)

    med = {k: statistics.median(v) for k, v in times.items()}
    med["per tensor beyond copy_ (us)"] = (med["ckptstore blocking"] - med["copy_"]) / n * 1e6
    return {"n": n, "numel": numel, "dtensors": True, "median_s": med, "all_s": times}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--counts", default="1000,10000")
    ap.add_argument("--numel", type=int, default=1024, help="elements per tensor (16384: 64 KiB)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="parent directory (a disk, not tmpfs)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--dtensors", action="store_true",
                    help="also time the blocking save of the same counts as DTensors (Store.save, a 1-rank mesh)")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="bench-tensors-", dir=args.dir)
    rows = []
    try:
        for n in (int(c) for c in args.counts.split(",")):
            rows.append(measure(n, args.numel, args.repeats, root))
            shutil.rmtree(root, ignore_errors=True)
            os.makedirs(root, exist_ok=True)
            if args.dtensors:
                rows.append(measure_dtensors(n, args.numel, args.repeats, root))
                shutil.rmtree(root, ignore_errors=True)
                os.makedirs(root, exist_ok=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{'tensors':>8} {'measure':<24} {'ckptstore s':>11} {'peer':<24} {'peer s':>8} {'ratio':>6}")
    for r in rows:
        m = r["median_s"]
        if r.get("dtensors"):
            for what, ours, peer in (("DTensor blocking", "ckptstore blocking", "dcp.async_save blocking"),
                                     ("DTensor blocking", "ckptstore blocking", "copy_"),
                                     ("DTensor committed", "ckptstore committed", "dcp.async_save committed")):
                print(f"{r['n']:>8} {what:<24} {m[ours]:>11.3f} {peer:<24} {m[peer]:>8.3f} {m[ours] / m[peer]:>5.2f}x")
            print(f"{r['n']:>8} {'DTensor per tensor':<24} {m['per tensor beyond copy_ (us)']:>9.0f}us")
            continue
        for what, ours, peer in (("blocking", "ckptstore blocking", "dcp.async_save blocking"),
                                 ("blocking", "ckptstore blocking", "copy_"),
                                 ("committed and durable", "ckptstore committed", "torch.save+fsync"),
                                 ("load (warm)", "ckptstore.load", "torch.load"),
                                 ("load (warm), CPU s", "ckptstore.load CPU", "torch.load CPU")):
            print(f"{r['n']:>8} {what:<24} {m[ours]:>11.3f} {peer:<24} {m[peer]:>8.3f} {m[ours] / m[peer]:>5.2f}x")
        print(f"{r['n']:>8} {'per tensor beyond copy_':<24} {m['per tensor beyond copy_ (us)']:>9.0f}us")
        print(f"{r['n']:>8} {'manifest per 100k chunks':<24} {m['manifest MB per 100k chunks']:>9.1f}MB "
              f"read+parse {m['manifest read+parse s per 100k chunks']:.2f}s")
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    write_json(args.out or os.path.join(os.path.dirname(__file__), "results", f"tensors-{stamp}.json"),
               {"bench": "tensors", "cpu": cpu_model(), "cores": os.cpu_count(), "rows": rows,
                "at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                "args": vars(args)})


if __name__ == "__main__":
    main()
