#!/usr/bin/env python
"""Verify throughput: ``ckptstore.verify`` vs reading and hashing the same files by hand.

One ~0.75 GiB transformer-like fp32 training state (weights plus two Adam moments) is
saved twice, with ``compression="none"`` and ``compression="auto"``. For each checkpoint
the bench times:

* ``verify``: ``ckptstore.verify(path)`` (full mode: every blob read, decoded, its
  xxh3-128 compared with the manifest), the call behind ``ckptstore verify``;
* ``verify --quick``: the same with ``quick=True`` (manifest, file presence and sizes);
* ``baseline``: plain Python without ckptstore: the data files read with ``os.preadv``
  in pieces of the checkpoint's chunk size into one reused buffer per thread, each piece
  hashed with ``xxhash.xxh3_128``, in as many threads as ckptstore's reader pool has;
* ``baseline, fresh buffers``: the same with a new ``bytearray`` per piece (what verify
  does per blob), to show what allocating and first-touching the buffers costs.

Every contender runs ``--repeats`` times, interleaved; the table shows the best run
(the least disturbed on a shared machine), the JSON every sample, the medians and the CPU
seconds (all threads) of each run, which other processes disturb far less than wall time.
Throughput is bytes per second in GB/s (10^9): ``raw`` counts the tensor bytes the
checkpoint holds (what verify checks), ``stored`` the bytes read from disk. The page cache
is warm (the files were just written and read once) unless ``--cold`` is given and the
process may write ``/proc/sys/vm/drop_caches`` (root): then caches are dropped before each
timed run (this disturbs every other process's cache: do it on a quiet machine).

Usage::

    python bench/bench_verify.py [--size-gib 0.75] [--repeats 3] [--out bench/results/verify.json]
                                 [--dir DIR] [--cold]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import torch
import xxhash

warnings.filterwarnings("ignore", message=".*using the slower pure-Python/torch fallback.*")

from _common import Contention, drop_caches, machine_info, write_json  # noqa: E402

import ckptstore  # noqa: E402
from ckptstore.checkpoint.manifests import latest_manifest  # noqa: E402
from ckptstore.checkpoint.snapshot import DEFAULT_CHUNK_BYTES  # noqa: E402
from ckptstore.runtime import runtime  # noqa: E402
from ckptstore.storage import LocalStorage  # noqa: E402

GB = 1e9
GiB = 1 << 30
MiB = 1 << 20


# ---------------------------------------------------------------------------- the state
def build_state(size_bytes: int, seed: int = 0) -> dict:
    """GPT-like fp32 weights (d=768) plus AdamW moments, about ``size_bytes`` in all.
    Every third layer is frozen (its moments are zero), so ``compression="auto"`` finds
    something to compress; random fp32 elsewhere stays raw."""
    g = torch.Generator().manual_seed(seed)
    d, ff = 768, 3072
    per_layer = 4 * d * d + 2 * d * ff
    n_layers = max(1, (size_bytes // 12) // per_layer)
    shapes = [("embed.weight", (max(1000, (size_bytes // 12 - n_layers * per_layer) // d), d))]
    for i in range(n_layers):
        shapes += [(f"layers.{i}.attn.qkv.weight", (3 * d, d)), (f"layers.{i}.attn.proj.weight", (d, d)),
                   (f"layers.{i}.mlp.up.weight", (ff, d)), (f"layers.{i}.mlp.down.weight", (d, ff)),
                   (f"layers.{i}.ln.weight", (d,))]
    model, optim = {}, {}
    for k, (name, shape) in enumerate(shapes):
        model[name] = torch.randn(shape, generator=g).mul_(0.02)
        scale = 10 ** (-5 + 2 * ((k * 0.618) % 1.0))
        frozen = name.startswith("layers.") and int(name.split(".")[1]) % 3 == 2
        optim[name] = {"step": torch.tensor(1000.0),
                       "exp_avg": torch.zeros(shape) if frozen else torch.randn(shape, generator=g).mul_(scale),
                       "exp_avg_sq": torch.zeros(shape) if frozen else
                       torch.randn(shape, generator=g).mul_(scale).square_().add_(1e-12)}
    return {"model": model, "optim": {"state": optim, "param_groups": [{"lr": 3e-4, "params": list(model)}]}}


# ---------------------------------------------------------------------------- the contenders
def baseline(paths: list[str], piece: int, threads: int, fresh: bool = False) -> int:
    """Read every file in ``piece``-sized ranges and xxh3-128 each, in ``threads`` threads,
    one reused buffer per thread (``fresh``: a new ``bytearray`` per piece, as verify
    allocates one per blob). Returns the bytes hashed."""
    jobs = [(p, off, min(piece, size - off)) for p in paths for size in [os.path.getsize(p)]
            for off in range(0, size, piece)]
    local = threading.local()

    def work(job) -> int:
        path, off, n = job
        buf = None if fresh else getattr(local, "buf", None)
        if buf is None or len(buf) < n:
            buf = local.buf = bytearray(piece)
        view = memoryview(buf)[:n]
        fd = os.open(path, os.O_RDONLY)
        try:
            done = 0
            while done < n:
                got = os.preadv(fd, [view[done:]], off + done)
                if got == 0:
                    raise OSError(f"{path}: short read")
                done += got
        finally:
            os.close(fd)
        xxhash.xxh3_128(view).hexdigest()
        return n

    with ThreadPoolExecutor(threads) as ex:
        return sum(ex.map(work, jobs))


def timed(fn) -> tuple[float, float, object]:
    """(wall seconds, CPU seconds of this process, all threads, result)."""
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, time.process_time() - c0, out


# ---------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gib", type=float, default=0.75)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "verify.json"))
    ap.add_argument("--dir", default=None, help="parent of the temporary directory the checkpoints go to")
    ap.add_argument("--cold", action="store_true", help="drop the page cache before each timed run (root)")
    args = ap.parse_args(argv)

    threads = runtime().readers.max_workers
    work = tempfile.mkdtemp(prefix="ckptstore-bench-verify-", dir=args.dir)
    info = machine_info(work, xxhash=xxhash.VERSION, reader_threads=threads)
    contention = Contention()
    results: dict = {"machine": info, "size_gib": args.size_gib, "repeats": args.repeats, "cold": False,
                     "chunk_bytes": DEFAULT_CHUNK_BYTES, "checkpoints": {}}
    try:
        state = build_state(int(args.size_gib * GiB))
        for mode in ("none", "auto"):
            path = os.path.join(work, f"ckpt-{mode}")
            t_save, _, manifest = timed(lambda: ckptstore.save(state, path, compression=mode).result())
            storage = LocalStorage(path)
            files = [os.path.join(path, f) for f in sorted(latest_manifest(storage).files())]
            raw, stored = manifest.raw_bytes, manifest.stored_bytes
            on_disk = sum(os.path.getsize(f) for f in files)
            assert ckptstore.verify(path) == [], "the fresh checkpoint does not verify"  # also warms the cache
            samples: dict[str, list[float]] = {"verify": [], "verify_quick": [], "baseline": [], "baseline_fresh": []}
            cpu: dict[str, list[float]] = {k: [] for k in samples}
            cold = False
            for _ in range(args.repeats):
                for name in ("verify", "baseline", "baseline_fresh", "verify_quick"):
                    if args.cold and name != "verify_quick":
                        cold = drop_caches()
                    if name == "verify":
                        t, c, problems = timed(lambda: ckptstore.verify(path))
                        assert problems == [], problems
                    elif name == "verify_quick":
                        t, c, problems = timed(lambda: ckptstore.verify(path, quick=True))
                        assert problems == [], problems
                    else:
                        fresh = name == "baseline_fresh"
                        t, c, n = timed(lambda: baseline(files, DEFAULT_CHUNK_BYTES, threads, fresh))
                        assert n == on_disk
                    samples[name].append(t)
                    cpu[name].append(c)
            results["cold"] = cold
            med = {k: statistics.median(v) for k, v in samples.items()}
            best = {k: min(v) for k, v in samples.items()}
            results["checkpoints"][mode] = {
                "raw_bytes": raw, "stored_bytes": stored, "file_bytes": on_disk, "files": len(files),
                "blobs": sum(1 for _ in manifest.blobs()), "save_s": t_save, "samples_s": samples,
                "cpu_samples_s": cpu, "median_cpu_s": {k: statistics.median(v) for k, v in cpu.items()},
                "median_s": med, "best_s": best,
                "verify_raw_gbps": raw / best["verify"] / GB,
                "verify_stored_gbps": stored / best["verify"] / GB,
                "baseline_gbps": on_disk / best["baseline"] / GB,
                "baseline_fresh_gbps": on_disk / best["baseline_fresh"] / GB,
                "verify_vs_baseline": best["baseline"] / best["verify"],
                "median_verify_raw_gbps": raw / med["verify"] / GB,
                "median_baseline_gbps": on_disk / med["baseline"] / GB,
                "median_verify_vs_baseline": med["baseline"] / med["verify"],
                "quick_s": best["verify_quick"],
                "cpu_s_per_gb_raw": {k: statistics.median(v) / (raw / GB) for k, v in cpu.items()},
            }
        del state
    finally:
        shutil.rmtree(work, ignore_errors=True)
    others = contention.others_cores()
    results["other_processes_cores"] = others

    print(f"ckptstore verify throughput, {args.size_gib} GiB fp32 state, {threads} reader threads, "
          f"{'cold' if results['cold'] else 'warm'} page cache, best of {args.repeats}")
    print(f"{info['cpu_model']}, {info['affinity_cores']} cores, native={info['ckptstore_native']}, "
          f"{info['disk']['fstype']} at {info['disk']['mountpoint']}")
    print(f"{'compression':<12}{'raw GiB':>8}{'stored GiB':>11}{'verify s':>9}{'GB/s raw':>9}{'GB/s disk':>10}"
          f"{'baseline s':>11}{'GB/s':>7}{'verify/baseline':>16}{'(median)':>9}{'fresh GB/s':>11}{'quick s':>9}")
    for mode, r in results["checkpoints"].items():
        print(f"{mode:<12}{r['raw_bytes'] / GiB:>8.3f}{r['stored_bytes'] / GiB:>11.3f}{r['best_s']['verify']:>9.3f}"
              f"{r['verify_raw_gbps']:>9.2f}{r['verify_stored_gbps']:>10.2f}{r['best_s']['baseline']:>11.3f}"
              f"{r['baseline_gbps']:>7.2f}{r['verify_vs_baseline']:>16.2f}{r['median_verify_vs_baseline']:>9.2f}"
              f"{r['baseline_fresh_gbps']:>11.2f}{r['quick_s']:>9.4f}")
    print("CPU seconds per GB of raw data (median; all threads): "
          + "; ".join(f"{m}: verify {r['cpu_s_per_gb_raw']['verify']:.3f}, baseline {r['cpu_s_per_gb_raw']['baseline']:.3f}, "
                      f"fresh {r['cpu_s_per_gb_raw']['baseline_fresh']:.3f}" for m, r in results["checkpoints"].items()))
    if others is not None and others > 0.25:
        print(f"warning: other processes used {others:.2f} cores on average during the run; figures are noisy")
    write_json(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
