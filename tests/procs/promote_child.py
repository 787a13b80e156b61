"""A two-tier save killed in the middle of its promotion, for tests/test_tiers.py.

argv: durable root, local root. Saves step 1 (local only) and step 2 (promoted, its
copy stopped after STOP_AFTER blobs (environment, default 1): "mid-promotion" is printed
and the process blocks until the parent SIGKILLs it). NUMEL (default 50,000): float32
elements per tensor, four tensors, in blobs of 64 KiB."""

import os
import sys
import threading

import torch

import ckptstore
import ckptstore.checkpoint.promote as promote

durable, local = sys.argv[1], sys.argv[2]
taken = []
original = promote.Throttle.take


def take(self, n):
    if len(taken) == int(os.environ.get("STOP_AFTER", "1")):  # in the durable tier's data file: stop
        print("mid-promotion", flush=True)
        threading.Event().wait()
    taken.append(n)
    original(self, n)


promote.Throttle.take = take
store = ckptstore.Store(durable, local=local, durable_every=2, chunk_bytes=64 << 10, compression="none")
for step in (1, 2):
    state = {f"t{i}": torch.full((int(os.environ.get("NUMEL", "50000")),), float(step * 100 + i)) for i in range(4)}
    store.save(step, state).result()  # the local commit
    print(f"committed {step}", flush=True)
ckptstore.wait()
print("unreachable", flush=True)
