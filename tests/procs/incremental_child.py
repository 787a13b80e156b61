"""Incremental saves and gc racing, for tests/test_incremental.py: killed at any point.

argv: store, role. "save": steps 1, 2, ... of a model whose base never changes (keep the
last 2: retention runs after each commit), printing "saved N". "gc": collects the same
store over and over (keep the last 2, a grace a save fits in), printing "gc N"."""

import sys

import torch

import ckptstore
from ckptstore.checkpoint.retention import Retention


def state(step: int) -> dict:
    base = {f"base.{i}": torch.randn(64, 1024, generator=torch.Generator().manual_seed(i)) for i in range(9)}
    return {"model": {**base, "head": torch.full((64, 1024), float(step))}, "step": step}


if __name__ == "__main__":
    root, role = sys.argv[1], sys.argv[2]
    if role == "save":
        store = ckptstore.Store(root, keep=Retention(last=2), compression="none")
        for step in range(1, 10_000):
            store.save(step, state(step)).result()
            print(f"saved {step}", flush=True)
    else:
        store = ckptstore.Store(root)
        for n in range(10_000_000):
            store.gc(keep=Retention(last=2), grace=60)
            print(f"gc {n}", flush=True)
