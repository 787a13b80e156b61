#!/usr/bin/env python
"""Where the time of a ckptstore save goes (diagnostic companion of bench_core.py).

Usage::

    python bench/profile_save.py [--size-gib 0.75] [--repeats 3] [--dir DIR] [--out bench/results/profile.json]

It saves the same state as bench_core.py several times (steady state: the staging pool is
warm) and reports:

1. per-phase CPU time of the background pipeline (hash, encode = trial compression,
   pwrite into the page cache, fsync of the data file, vote, commit), measured with
   ``time.thread_time`` inside wrappers around the library's functions, so that other
   processes on a shared machine inflate the figures less than wall time would;
2. the blocking and commit time of ``save()``, each next to a bare ``copy_`` of the same
   tensors measured just before it, with ``torch.save`` + flush + fsync of the same state
   in each round as the reference for the commit time. (Earlier variants, deferring
   the background work and early writeback, gave the evidence for both and are now
   how the library works.)
3. a cProfile of one ``save()`` call (the blocking part only);
4. loads, warm page cache, ``ckptstore.load`` and ``torch.load`` alternating: wall time and
   the CPU seconds of ckptstore's read phases (preadv into the new tensors, xxh3 check).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import ckptstore  # noqa: E402
from _common import tensors_of, write_json  # noqa: E402
from bench_core import GiB, build_state, ckptstore_native, machine_info  # noqa: E402
from ckptstore import pipeline  # noqa: E402
from ckptstore.checkpoint import restore as restoremod  # noqa: E402
from ckptstore.checkpoint import save as savemod  # noqa: E402
from ckptstore.checkpoint import snapshot as snapmod  # noqa: E402
from ckptstore.storage import local  # noqa: E402

_acc = collections.defaultdict(float)
_cnt = collections.Counter()
_lock = threading.Lock()


def _wrap(owner, name: str, label: str) -> None:
    fn = getattr(owner, name)

    def wrapper(*a, **k):
        t = time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            dt = time.thread_time() - t
            with _lock:
                _acc[label] += dt
                _cnt[label] += 1

    setattr(owner, name, wrapper)


def _busy() -> tuple[int, int]:
    v = list(map(int, open("/proc/stat").readline().split()[1:]))
    return sum(v) - v[3] - v[4], sum(v)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-gib", type=float, default=0.75)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "profile.json"))
    args = ap.parse_args()

    bench_dir = tempfile.mkdtemp(prefix="ckptprof-", dir=args.dir)
    info = machine_info(bench_dir)
    state = build_state(int(args.size_gib * GiB))
    tensors = tensors_of(state)
    dst = [torch.empty_like(t) for t in tensors]

    def bare():
        t0 = time.perf_counter()
        for d, s in zip(dst, tensors):
            d.copy_(s)
        return time.perf_counter() - t0

    for owner, name, label in [
        (pipeline, "digest", "hash (xxh3)"),
        (pipeline, "encode", "encode (trial compression)"),
        (local._LocalAppendWriter, "append", "pwrite into page cache"),
        (local._LocalAppendWriter, "close", "fsync data file + dir"),
        (savemod, "write_vote", "vote (put, fsyncs)"),
        (savemod, "commit", "commit (manifest, fsyncs)"),
        (snapmod, "flatten", "[blocking] flatten+stage (main thread)"),
        (restoremod, "digest", "[load] hash check (xxh3)"),
        (local.LocalStorage, "readinto", "[load] preadv into tensors"),
        (restoremod, "read_blobs", "[load] read_blobs (caller thread, incl. waiting)"),
    ]:
        _wrap(owner, name, label)

    out = {"machine": info, "native": ckptstore_native(), "variants": {}, "phases_cpu_s": {}}
    variants = ["as shipped"]
    try:
        bare()
        ckptstore.configure()
        ckptstore.save(state, os.path.join(bench_dir, "warm")).result()  # fill the pool
        shutil.rmtree(os.path.join(bench_dir, "warm"))
        phases = []
        for r in range(args.repeats):
            tp = os.path.join(bench_dir, f"{r}-torch.pt")
            os.sync()
            t0 = time.perf_counter()
            with open(tp, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            out.setdefault("torch.save+fsync_s", []).append(time.perf_counter() - t0)
            os.unlink(tp)
            for name in variants:
                path = os.path.join(bench_dir, f"{r}-{name.replace(' ', '_')}")
                os.sync()
                b = bare()
                _acc.clear()
                _cnt.clear()
                busy0, c0 = _busy(), os.times()
                t0 = time.perf_counter()
                fut = ckptstore.save(state, path)
                t1 = time.perf_counter()
                fut.result()
                t2 = time.perf_counter()
                busy1, c1 = _busy(), os.times()
                ours = (c1.user + c1.system - c0.user - c0.system) * os.sysconf("SC_CLK_TCK")
                machine = (busy1[0] - busy0[0])
                ncpu = os.cpu_count() or 1
                others = max(0.0, (machine - ours) / max(1, busy1[1] - busy0[1]) * ncpu)
                v = out["variants"].setdefault(name, {"bare_copy_s": [], "blocking_s": [], "commit_s": [],
                                                      "others_cores": []})
                v["bare_copy_s"].append(b)
                v["blocking_s"].append(t1 - t0)
                v["commit_s"].append(t2 - t0)
                v["others_cores"].append(others)
                if name == "as shipped":
                    phases.append(dict(_acc))
                shutil.rmtree(path, ignore_errors=True)
        out["phases_cpu_s"] = {k: statistics.median(p.get(k, 0.0) for p in phases) for k in phases[0]}

        # cProfile of the blocking part, steady state
        os.sync()
        prof = cProfile.Profile()
        prof.enable()
        fut = ckptstore.save(state, os.path.join(bench_dir, "prof"))
        prof.disable()
        fut.result()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(12)
        out["cprofile_blocking"] = s.getvalue()

        # loads, warm cache, alternating
        ck = os.path.join(bench_dir, "prof")
        tp = os.path.join(bench_dir, "t.pt")
        with open(tp, "wb") as f:
            torch.save(state, f)
        loads = {"ckptstore.load": [], "torch.load": []}
        lphases = []
        for fn in (lambda: ckptstore.load(ck), lambda: torch.load(tp, weights_only=True)):
            fn()  # warm the page cache
        for r in range(max(5, args.repeats)):
            _acc.clear()
            t0 = time.perf_counter()
            obj = ckptstore.load(ck)
            loads["ckptstore.load"].append(time.perf_counter() - t0)
            lphases.append({k: v for k, v in _acc.items() if k.startswith("[load]")})
            del obj
            t0 = time.perf_counter()
            obj = torch.load(tp, weights_only=True)
            loads["torch.load"].append(time.perf_counter() - t0)
            del obj
        out["loads_warm_s"] = loads
        out["load_phases_cpu_s"] = {k: statistics.median(p.get(k, 0.0) for p in lphases) for k in lphases[0]}
    finally:
        shutil.rmtree(bench_dir, ignore_errors=True)

    print(f"native extension: {out['native']}; state {sum(t.nbytes for t in tensors) / GiB:.3f} GiB, "
          f"{len(tensors)} tensors; medians of {args.repeats}")
    print("\nbackground pipeline, CPU seconds per save (thread_time, as shipped):")
    for k, v in out["phases_cpu_s"].items():
        print(f"  {k:40s} {v:7.3f}")
    print(f"\n{'variant':26s} {'bare copy_':>10s} {'blocking':>9s} {'ratio':>6s} {'commit':>8s} {'others':>7s}")
    for name, v in out["variants"].items():
        med = {k: statistics.median(x) for k, x in v.items()}
        ratios = [b / c for b, c in zip(v["blocking_s"], v["bare_copy_s"])]
        med["ratio"] = statistics.median(ratios)
        v["median"] = med
        print(f"{name:26s} {med['bare_copy_s']:10.3f} {med['blocking_s']:9.3f} {med['ratio']:5.2f}x "
              f"{med['commit_s']:8.3f} {med['others_cores']:6.2f}c")
    print(f"{'torch.save+fsync':26s} {'':10s} {'':9s} {'':6s} {statistics.median(out['torch.save+fsync_s']):8.3f}")
    print("  (ratio: median over repeats of blocking / the bare copy_ measured just before it; "
          "others: cores used by other processes meanwhile)")
    print("\nwarm loads, alternating (median wall s):",
          {k: round(statistics.median(v), 3) for k, v in out["loads_warm_s"].items()},
          "ratio %.2fx" % (statistics.median(out["loads_warm_s"]["ckptstore.load"])
                           / statistics.median(out["loads_warm_s"]["torch.load"])))
    for k, v in out["load_phases_cpu_s"].items():
        print(f"  {k:50s} {v:7.3f} CPU s (thread_time)")
    print("\ncProfile of one save() call (blocking part), by own time:")
    print("\n".join(out["cprofile_blocking"].splitlines()[:24]))
    write_json(args.out, out, indent=1)


if __name__ == "__main__":
    main()
