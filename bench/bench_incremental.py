#!/usr/bin/env python
"""Incremental saves (issue 16): bytes written and time per save, full
(``incremental=False``) against incremental, on a model whose base is frozen (90% of its
bytes never change) and on a fully trained one (every byte changes every step, where
incremental saves must cost nothing measurable). Both tools run interleaved, each in a
store of its own on the same disk; every save after the first is measured.

Usage::

    PYTHONPATH=. python bench/bench_incremental.py [--size-gib 0.25] [--saves 4] [--out bench/results/incremental.json]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", message=".*using the slower pure-Python/torch fallback.*")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _common import machine_info, write_json  # noqa: E402

MiB = 1 << 20


def model(size: int, frozen: float, step: int, base: list[torch.Tensor]) -> dict:
    """``len(base)`` layers; the first ``frozen`` share of them are ``base`` itself."""
    n_frozen = round(frozen * len(base))
    layers = {f"layer.{i}": base[i] if i < n_frozen else base[i] + step for i in range(len(base))}
    return {"model": layers, "step": step}


def written(root: Path, step: int) -> int:
    return sum(p.stat().st_size for p in (root / f"step-{step:012d}").rglob("data-*.bin"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=0.25)
    ap.add_argument("--saves", type=int, default=4, help="saves per store (the first, full one not measured)")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "incremental.json"))
    args = ap.parse_args()

    import ckptstore

    work = Path(tempfile.mkdtemp(prefix="bench-incr-", dir=args.dir))
    layers = 40
    per = int(args.size_gib * (1 << 30)) // layers // 4
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(per, generator=g) for _ in range(layers)]
    results = {}
    try:
        for name, frozen in (("frozen 90%", 0.9), ("fully trained", 0.0)):
            stores = {mode: ckptstore.Store(work / f"{name}-{mode}".replace(" ", "_").replace("%", ""),
                                            compression="none", incremental=(mode == "incremental"))
                      for mode in ("full", "incremental")}
            samples = {mode: {"blocking_s": [], "committed_s": [], "bytes": []} for mode in stores}
            for step in range(args.saves):
                order = list(stores) if step % 2 == 0 else list(reversed(stores))
                for mode in order:
                    store = stores[mode]
                    state = model(per, frozen, step, base)
                    t0 = time.perf_counter()
                    f = store.save(step, state)
                    blocking = time.perf_counter() - t0
                    f.result()
                    committed = time.perf_counter() - t0
                    if step:  # the first save writes everything either way
                        s = samples[mode]
                        s["blocking_s"].append(blocking)
                        s["committed_s"].append(committed)
                        s["bytes"].append(written(Path(store.url), step))
            results[name] = {mode: {k: statistics.median(v) for k, v in s.items()} for mode, s in samples.items()}
            results[name]["samples"] = samples
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"\n{args.size_gib:.2f} GiB in {layers} fp32 tensors, median of {args.saves - 1} saves after the first")
    print(f"{'model':<16}{'mode':<14}{'written MiB':>13}{'blocking s':>12}{'committed s':>13}")
    for name in results:
        for mode in ("full", "incremental"):
            r = results[name][mode]
            print(f"{name:<16}{mode:<14}{r['bytes'] / MiB:>13.1f}{r['blocking_s']:>12.3f}{r['committed_s']:>13.3f}")
        full, inc = results[name]["full"], results[name]["incremental"]
        print(f"{'':<16}{'ratio':<14}{inc['bytes'] / full['bytes']:>12.2f}x{inc['blocking_s'] / full['blocking_s']:>11.2f}x"
              f"{inc['committed_s'] / full['committed_s']:>12.2f}x")
    write_json(args.out, {"machine": machine_info(str(work.parent)), "size_gib": args.size_gib, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
