#!/usr/bin/env python
"""Saves while a forked child lives (a DataLoader worker, a multiprocessing helper).

A state of ``--size-gib`` in 32 fp32 tensors is saved by a ``Store`` a few times (the
staging pool sized and faulted), then a child is forked and left waiting, and the next
saves are timed (blocking part, until ``save`` returns) beside the same number of saves
with no child. Without MADV_DONTFORK on the staging slabs, every page the first save
after the fork writes is copied (copy-on-write: the child shares it), so that save
blocks like a first save; with it, the child has no slab and nothing changes. A torch
``copy_`` of the same bytes into preallocated tensors is the yardstick, timed in the
same phases (it pays the same copy-on-write on its destinations while the child lives).

Prints a table of the first save after the fork and the medians, and writes JSON (``--out``).

Usage::

    python bench/bench_fork.py [--size-gib 0.5] [--repeats 3] [--out ...]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import time

import torch

import ckptstore
from _common import machine_info, write_json  # noqa: E402


def _phase(store, state, copies, steps, child: bool) -> dict:
    """Blocking seconds of each save and each copy_ of ``steps`` saves, with a forked
    child waiting meanwhile when ``child``."""
    ctx = mp.get_context("fork")
    gate = ctx.Event()
    proc = ctx.Process(target=gate.wait) if child else None
    if proc is not None:
        proc.start()
    saves, copy_s = [], []
    try:
        for step in steps:
            for t in state.values():
                t.add_(1)  # every tensor changes: the save copies every byte
            t0 = time.perf_counter()
            future = store.save(step, state)
            saves.append(time.perf_counter() - t0)
            future.result()
            t0 = time.perf_counter()
            for dst, src in zip(copies, state.values()):
                dst.copy_(src)
            copy_s.append(time.perf_counter() - t0)
    finally:
        if proc is not None:
            gate.set()
            proc.join()
    return {"save_s": saves, "copy_s": copy_s}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=3, help="saves timed per phase")
    ap.add_argument("--dir", default=None, help="where the store goes (default: a temporary directory)")
    ap.add_argument("--out", default="bench/results/fork.json")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="ckpt-bench-fork-", dir=args.dir)
    try:
        numel = int(args.size_gib * (1 << 30)) // 4 // 32
        state = {f"t{i}": torch.randn(numel) for i in range(32)}
        copies = [torch.empty_like(t) for t in state.values()]
        store = ckptstore.Store(os.path.join(work, "store"), compression="none", incremental=False,
                                keep=ckptstore.Retention(last=1))
        _phase(store, state, copies, range(3), child=False)  # warm: the pool sized and faulted
        r = args.repeats
        phases = {"no child": _phase(store, state, copies, range(10, 10 + r), child=False),
                  "child forked": _phase(store, state, copies, range(20, 20 + r), child=True)}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{args.size_gib:g} GiB in 32 tensors, {r} saves a phase (blocking seconds)")
    print(f"{'phase':<14} {'first save':>11} {'median save':>12} {'first copy_':>12} {'median copy_':>13}")
    for name, p in phases.items():
        print(f"{name:<14} {p['save_s'][0]:>11.3f} {statistics.median(p['save_s']):>12.3f} "
              f"{p['copy_s'][0]:>12.3f} {statistics.median(p['copy_s']):>13.3f}")
    write_json(args.out, {"machine": machine_info(work), "size_gib": args.size_gib, "phases": phases})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
