"""The random jitter of ckptstore's own waits (commit polls, retry backoffs, relaunch
delays): from a generator of its own, so the program's `random` stream stays the
program's (a resumed run draws what an uninterrupted one draws; rng.py saves that
stream), reseeded in a forked child so forked ranks do not wait in lockstep."""

from __future__ import annotations

import os
import random

jitter = random.Random()
os.register_at_fork(after_in_child=jitter.seed)

__all__ = ["jitter"]
