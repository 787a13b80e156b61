"""Pause the cyclic garbage collector around work that makes many short-lived objects."""

from __future__ import annotations

import gc
import threading

__all__ = ["gc_paused"]


class gc_paused:
    """Pause the cyclic garbage collector while a large document is parsed or a large
    state walked: their hundreds of thousands of new, acyclic objects otherwise trigger
    collections of the whole heap (measured: half of a 10,000-tensor manifest's parse
    time in a process holding torch, and a fifth of a 10,000-tensor save's blocking
    time). Nested and concurrent uses are counted; the collector's previous state comes
    back when the last one ends."""

    _lock = threading.Lock()
    _depth = 0
    _was_enabled = False

    def __enter__(self):
        with gc_paused._lock:
            if gc_paused._depth == 0:
                gc_paused._was_enabled = gc.isenabled()
                gc.disable()
            gc_paused._depth += 1

    def __exit__(self, *exc):
        with gc_paused._lock:
            gc_paused._depth -= 1
            if gc_paused._depth == 0 and gc_paused._was_enabled:
                gc.enable()
