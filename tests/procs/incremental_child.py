"""Incremental saves and gc racing, for tests/test_incremental.py: killed at any point.

argv: store, role. "save": steps 1, 2, ... of a model whose base never changes (keep the
last 2: retention runs after each commit), printing "saved N"; after every fourth step it
rolls back one step (a resume from the step before the newest, as after a loss spike),
so its next save references a step that is not the newest. A save refused because
another process's gc dropped its base prints "refused N" and is tried again. "gc":
collects the same store over and over (keep the last 1, which drops such a base; a grace
a save fits in), printing "gc N"."""

import sys
import warnings

import torch

import ckptstore
from ckptstore.checkpoint.retention import Retention
from ckptstore.errors import CommitError
from ckptstore.resume import NoLoadableCheckpointError


def state(step: int) -> dict:
    base = {f"base.{i}": torch.randn(64, 1024, generator=torch.Generator().manual_seed(i)) for i in range(9)}
    return {"model": {**base, "head": torch.full((64, 1024), float(step))}, "step": step}


if __name__ == "__main__":
    warnings.simplefilter("ignore")  # (resume's skip warnings)
    root, role = sys.argv[1], sys.argv[2]
    if role == "save":
        store = ckptstore.Store(root, keep=Retention(last=2), compression="none")
        step = 1
        while step < 10_000:
            try:
                store.save(step, state(step)).result()
            except CommitError as e:
                assert "references come from was deleted" in str(e), e
                print(f"refused {step}", flush=True)
                continue
            print(f"saved {step}", flush=True)
            if step % 4 == 0:
                store = ckptstore.Store(root, keep=Retention(last=2), compression="none")
                try:
                    _, info = store.resume(validate=lambda s, m, back=step - 1: m.step <= back, mark_skipped=False)
                except NoLoadableCheckpointError:  # the gc dropped the step before: go on from the newest
                    _, info = store.resume()
                step = info.step
            step += 1
    else:
        store = ckptstore.Store(root)
        for n in range(10_000_000):
            store.gc(keep=Retention(last=1), grace=60)
            print(f"gc {n}", flush=True)
