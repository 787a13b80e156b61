"""Child for tests/test_crash.py: save forever until SIGKILLed.

argv: mode ("store" | "path"), root, first step, state bytes, chunk bytes, compression,
depth (1: wait for each commit before the next save; 2: keep two saves in flight).
Prints "staged <i>" when save() returned and "committed <i>" when result() returned.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ckptstore  # noqa: E402
from states import uniform_state  # noqa: E402

mode, root, first, nbytes, chunk, compression, depth = sys.argv[1:8]
first, nbytes, chunk, depth = int(first), int(nbytes), int(chunk), int(depth)

store = ckptstore.Store(root, compression=compression, chunk_bytes=chunk) if mode == "store" else None
pending = []
i = first
while True:
    state = uniform_state(i, nbytes)
    if store is not None:
        fut = store.save(i, state)
    else:
        fut = ckptstore.save(state, root, compression=compression, chunk_bytes=chunk)
    print(f"staged {i}", flush=True)
    pending.append((i, fut))
    while len(pending) >= depth:
        j, f = pending.pop(0)
        m = f.result()
        assert m.step == (j if store is not None else None), m
        print(f"committed {j}", flush=True)
    i += 1
