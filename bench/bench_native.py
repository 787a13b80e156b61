#!/usr/bin/env python
"""Native extension benchmark: staging (blocking part of save), shuffle, GPU staging.

CPU (always):

* blocking time of ``ckptstore.save`` (steady state: the pool already holds the
  memory) with the native extension, and without it (``CKPTSTORE_DISABLE_NATIVE=1``,
  in a subprocess), against one parallel memcpy of the same number of bytes into
  preallocated memory and against ``copy_`` of every tensor into preallocated
  tensors. Target: native <= 1.2x the memcpy.
* byte-shuffle and unshuffle throughput on one core for item sizes 2, 4, 8.
  Target: >= 4 GB/s.

GPU (when ``torch.cuda.is_available()``):

* pinned device-to-host bandwidth of one large copy (the reference);
* staging bandwidth of >= 4 GiB of mixed-size tensors (5,000 below 64 KiB, the rest
  up to 512 MiB) through ``StagingCopier`` into the pinned pool, native and torch
  paths. Target: native >= 80% of the reference;
* a state of 10,000 small tensors: staging time (native, torch) and the blocking
  time of ``ckptstore.save``.

Prints a table and writes JSON (default bench/results/native.json).

    python bench/bench_native.py [--size-gib 0.5] [--repeats 5] [--gpu-gib 4]
        [--out bench/results/native.json] [--dir DIR] [--no-cpu] [--no-gpu]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore", message=".*using the slower pure-Python/torch fallback.*")
# The default pool is "auto" already; set it explicitly so that an inherited override
# (CKPTSTORE_STAGING_POOL=torch) is the only way to measure the other one.
os.environ.setdefault("CKPTSTORE_STAGING_POOL", "auto")

import torch  # noqa: E402
from _common import cpu_model, write_json  # noqa: E402

import ckptstore  # noqa: E402
from ckptstore import native  # noqa: E402
from ckptstore.runtime import runtime  # noqa: E402
from ckptstore.staging import StagingCopier, StagingPool  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30


# ---- helpers ----------------------------------------------------------------------


def median_time(fn, repeats: int) -> tuple[float, list[float]]:
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples), samples


def machine_info() -> dict:
    info = {
        "cpu": cpu_model(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "native": native.NATIVE,
        "cuda_info": native.cuda_info(),
        "loadavg_start": os.getloadavg(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["torch_cuda"] = torch.version.cuda
    return info


def cpu_state(total: int, seed: int = 0) -> dict:
    """Transformer-like fp32 state: square-ish matrices plus small vectors."""
    g = torch.Generator().manual_seed(seed)
    state, acc, i = {}, 0, 0
    while acc < total:
        n = min(4 * MiB if i % 4 else 16 * MiB, (total - acc) // 4) or 1
        state[f"layer{i}.weight"] = torch.randn(n, generator=g)
        state[f"layer{i}.bias"] = torch.randn(1024, generator=g)
        acc += 4 * n + 4096
        i += 1
    return state


def state_bytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


# ---- CPU: blocking time of save -----------------------------------------------------


def save_blocking(size: int, repeats: int, directory: str) -> dict:
    """Measures in this process (native or fallback, whatever is active)."""
    state = cpu_state(size)
    nbytes = state_bytes(state)
    tensors = list(state.values())
    # One memcpy of the same bytes into preallocated memory (pages already touched).
    src = torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    dst.fill_(0)
    pre = [torch.empty_like(t) for t in tensors]
    for p in pre:
        p.zero_()
    pool = StagingPool(nbytes + 64 * MiB)

    def memcpy():
        native.copy_bytes(dst.data_ptr(), src.data_ptr(), nbytes)

    def bare():
        for p, t in zip(pre, tensors):
            p.copy_(t)

    def stage():
        """What snapshot does, without pickling and background work: 16 MiB chunks
        from the pool, filled by the StagingCopier."""
        bufs = []
        with StagingCopier(pool) as copier:
            for t in tensors:
                s = t.untyped_storage()
                for off in range(0, s.nbytes(), 16 * MiB):
                    copier.copy(s, off, min(16 * MiB, s.nbytes() - off), bufs.append)
        return bufs

    for b in stage():  # warm: the pool holds the memory
        pool.release(b)
    times = {"memcpy": [], "bare": [], "stage": []}
    for _ in range(repeats):  # interleaved, so background load hits all alike
        # memcpy and staging each come right after another 0.5 GiB copy (bare, memcpy),
        # so both start with caches full of dirty lines, as in a training loop.
        for name, fn in (("bare", bare), ("memcpy", memcpy), ("stage", stage)):
            t0 = time.perf_counter()
            r = fn()
            times[name].append(time.perf_counter() - t0)
            for b in r or ():
                pool.release(b)
    pool_backend = pool.backend
    del pre, pool
    memcpy_t = statistics.median(times["memcpy"])
    stage_t = statistics.median(times["stage"])
    ckptstore.configure(staging_bytes=2 * nbytes + 64 * MiB)
    path = os.path.join(directory, f"ck-{os.getpid()}")
    ckptstore.save(state, path, compression="none").result()  # warm: the pool holds the memory
    samples, paired_memcpy = [], []
    for _ in range(repeats):
        # A memcpy just before each save, so both meet the caches and the machine alike
        # (the previous save's background work has just run through memory).
        t0 = time.perf_counter()
        memcpy()
        paired_memcpy.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        fut = ckptstore.save(state, path, compression="none")
        samples.append(time.perf_counter() - t0)
        fut.result()
    del src, dst
    pool = runtime().pool.stats()
    ckptstore.configure()
    shutil.rmtree(path, ignore_errors=True)
    blocking = statistics.median(samples)
    return {
        "native": native.NATIVE,
        "pool_backend": pool.get("backend"),
        "copier_pool_backend": pool_backend,
        "bytes": nbytes,
        "tensors": len(tensors),
        "memcpy_s": memcpy_t,
        "memcpy_samples": times["memcpy"],
        "memcpy_gbps": nbytes / memcpy_t / 1e9,
        "bare_copy_s": statistics.median(times["bare"]),
        "bare_copy_samples": times["bare"],
        "staging_s": stage_t,
        "staging_samples": times["stage"],
        "staging_ratio_to_memcpy": stage_t / memcpy_t,
        "save_blocking_s": blocking,
        "save_blocking_samples": samples,
        "paired_memcpy_samples": paired_memcpy,
        "ratio_to_memcpy": blocking / statistics.median(paired_memcpy),
    }


def fallback_in_subprocess(args) -> dict:
    env = dict(os.environ, CKPTSTORE_DISABLE_NATIVE="1")
    cmd = [sys.executable, os.path.abspath(__file__), "--child-save", "--size-gib", str(args.size_gib),
           "--repeats", str(args.repeats), "--dir", args.dir or tempfile.gettempdir()]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"fallback child failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- CPU: shuffle ----------------------------------------------------------------------


def shuffle_throughput(repeats: int) -> dict:
    n = 64 * MiB
    src = torch.randn(n // 4).view(torch.uint8)
    dst = torch.empty_like(src)
    back = torch.empty_like(src)
    out = {"bytes": n}
    for itemsize in (2, 4, 8):
        native.shuffle_into(dst, src, itemsize)  # warm
        t_s, _ = median_time(lambda: native.shuffle_into(dst, src, itemsize), repeats)
        t_u, _ = median_time(lambda: native.unshuffle_into(back, dst, itemsize), repeats)
        assert torch.equal(back, src)
        out[f"shuffle_{itemsize}_gbps"] = n / t_s / 1e9
        out[f"unshuffle_{itemsize}_gbps"] = n / t_u / 1e9
    return out


# ---- GPU ------------------------------------------------------------------------------------


def gpu_sources(total: int, small: int, seed: int):
    rng = random.Random(seed)
    out, acc = [], 0
    for _ in range(small):
        n = rng.randrange(1, 64 << 10)
        out.append(torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda"))
        acc += n
    while acc < total:
        n = min(rng.choice([rng.randrange(64 << 10, 16 * MiB), rng.randrange(16 * MiB, 512 * MiB)]), total - acc)
        out.append(torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda"))
        acc += n
    return out, acc


def stage_once(tensors, pool, backend, batch_bytes=None):
    bufs = []
    with StagingCopier(pool, backend=backend, batch_bytes=batch_bytes) as copier:
        for t in tensors:
            s = t.untyped_storage()
            copier.copy(s, 0, s.nbytes(), bufs.append)
    return bufs, copier


def timed_staging(tensors, pool, backend, repeats, batch_bytes=None) -> dict:
    samples, gathered = [], 0
    for k in range(repeats + 1):  # the first run warms the pool (page-locking)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        bufs, copier = stage_once(tensors, pool, backend, batch_bytes)
        dt = time.perf_counter() - t0
        if k:
            samples.append(dt)
        gathered = copier.gathered
        for b in bufs:
            pool.release(b)
    return {"s": statistics.median(samples), "samples": samples, "gathered": gathered}


def gpu_bench(args) -> dict:
    out = {}
    # Reference: one large pinned device-to-host copy.
    n = 1 * GiB
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.empty(n, dtype=torch.uint8, pin_memory=True)

    def one_copy():
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()

    one_copy()
    ref, ref_s = median_time(one_copy, args.repeats)
    out["pinned_d2h_gbps"] = n / ref / 1e9
    out["pinned_d2h_samples"] = ref_s
    del src, dst

    tensors, total = gpu_sources(int(args.gpu_gib * GiB), 5000, seed=1)
    out["mixed_bytes"] = total
    out["mixed_tensors"] = len(tensors)
    backends = (["native"] if native.cuda_available() else []) + ["torch"]
    for backend in backends:
        pool = StagingPool(total + 1 * GiB, pin_memory=True)
        r = timed_staging(tensors, pool, backend, args.repeats)
        out[f"mixed_{backend}_gbps"] = total / r["s"] / 1e9
        out[f"mixed_{backend}_ratio_to_pinned"] = out[f"mixed_{backend}_gbps"] / out["pinned_d2h_gbps"]
        out[f"mixed_{backend}_samples"] = r["samples"]
        out[f"mixed_{backend}_gathered"] = r["gathered"]
        pool.trim()
        del pool
    del tensors
    torch.cuda.empty_cache()

    # 10,000 small tensors.
    rng = random.Random(2)
    small = {f"p{i}": torch.randn(rng.randrange(64, 16 << 10), device="cuda") for i in range(10_000)}
    small_bytes = sum(t.numel() * 4 for t in small.values())
    out["small_tensors"] = len(small)
    out["small_bytes"] = small_bytes
    for backend in backends:
        pool = StagingPool(small_bytes + 256 * MiB, pin_memory=True)
        r = timed_staging(list(small.values()), pool, backend, args.repeats, batch_bytes=small_bytes + 1)
        out[f"small_{backend}_stage_s"] = r["s"]
        out[f"small_{backend}_samples"] = r["samples"]
        out[f"small_{backend}_gathered"] = r["gathered"]
        pool.trim()
    ckptstore.configure(staging_bytes=small_bytes + 256 * MiB)
    path = os.path.join(args.dir or tempfile.gettempdir(), f"gpu-small-{os.getpid()}")
    ckptstore.save(small, path, compression="none").result()
    samples = []
    for _ in range(args.repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fut = ckptstore.save(small, path, compression="none")
        samples.append(time.perf_counter() - t0)
        fut.result()
    ckptstore.configure()
    shutil.rmtree(path, ignore_errors=True)
    out["small_save_blocking_s"] = statistics.median(samples)
    out["small_save_blocking_samples"] = samples
    return out


# ---- main --------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=0.5, help="CPU state size")
    ap.add_argument("--gpu-gib", type=float, default=4.0, help="mixed-size GPU state size")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "native.json"))
    ap.add_argument("--dir", default=None, help="parent directory for checkpoints (default: temp dir)")
    ap.add_argument("--no-cpu", action="store_true")
    ap.add_argument("--no-gpu", action="store_true")
    ap.add_argument("--child-save", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    directory = args.dir or tempfile.gettempdir()

    if args.child_save:
        print(json.dumps(save_blocking(int(args.size_gib * GiB), args.repeats, directory)))
        return 0

    result = {"time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine_info(), "args": vars(args)}
    rows = []
    if not args.no_cpu:
        nat = save_blocking(int(args.size_gib * GiB), args.repeats, directory)
        fb = fallback_in_subprocess(args)
        sh = shuffle_throughput(args.repeats)
        result["cpu"] = {"save_native": nat, "save_fallback": fb, "shuffle": sh}
        size = f"{nat['bytes'] / GiB:.2f} GiB"
        rows += [
            (f"memcpy, {size} (one call, all threads)", f"{nat['memcpy_s'] * 1e3:.1f} ms", f"{nat['memcpy_gbps']:.1f} GB/s"),
            ("copy_ per tensor into preallocated", f"{nat['bare_copy_s'] * 1e3:.1f} ms", ""),
            ("staging (pool + StagingCopier, 16 MiB chunks), native", f"{nat['staging_s'] * 1e3:.1f} ms",
             f"{nat['staging_ratio_to_memcpy']:.2f}x memcpy (target <= 1.2x)"),
            ("staging, fallback", f"{fb['staging_s'] * 1e3:.1f} ms", f"{fb['staging_ratio_to_memcpy']:.2f}x its memcpy"),
            (f"save blocking, native ({nat['pool_backend']} pool)", f"{nat['save_blocking_s'] * 1e3:.1f} ms",
             f"{nat['ratio_to_memcpy']:.2f}x memcpy"),
            (f"save blocking, fallback ({fb['pool_backend']} pool)", f"{fb['save_blocking_s'] * 1e3:.1f} ms",
             f"{fb['ratio_to_memcpy']:.2f}x its memcpy"),
        ]
        for k in (2, 4, 8):
            rows.append((f"shuffle / unshuffle itemsize {k}, one core", "",
                         f"{sh[f'shuffle_{k}_gbps']:.1f} / {sh[f'unshuffle_{k}_gbps']:.1f} GB/s (target >= 4)"))
    if not args.no_gpu and torch.cuda.is_available():
        g = gpu_bench(args)
        result["gpu"] = g
        rows.append(("pinned D2H, one 1 GiB copy", "", f"{g['pinned_d2h_gbps']:.1f} GB/s"))
        for b in ("native", "torch"):
            if f"mixed_{b}_gbps" in g:
                rows.append((f"staging {g['mixed_bytes'] / GiB:.1f} GiB mixed ({g['mixed_tensors']} tensors), {b}", "",
                             f"{g[f'mixed_{b}_gbps']:.1f} GB/s = {g[f'mixed_{b}_ratio_to_pinned']:.0%} of pinned"
                             + (" (target >= 80%)" if b == "native" else "")))
        for b in ("native", "torch"):
            if f"small_{b}_stage_s" in g:
                rows.append((f"staging 10,000 small tensors, {b}", f"{g[f'small_{b}_stage_s'] * 1e3:.1f} ms", ""))
        rows.append(("save blocking, 10,000 small CUDA tensors", f"{g['small_save_blocking_s'] * 1e3:.1f} ms", ""))
    elif not args.no_gpu:
        result["gpu"] = {"skipped": "no CUDA device"}
    result["machine"]["loadavg_end"] = os.getloadavg()

    w = max(len(r[0]) for r in rows) if rows else 10
    print(f"native={native.NATIVE} cuda={native.cuda_info()['available']} "
          f"cpu={result['machine']['cpu']} cores={result['machine']['cores']} "
          f"load={result['machine']['loadavg_start'][0]:.1f}")
    for name, t, extra in rows:
        print(f"{name:<{w}}  {t:>10}  {extra}")
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
