"""Pause the cyclic garbage collector around work on the caller's thread that makes
many short-lived objects."""

from __future__ import annotations

import gc
import os
import threading

from ._threads import in_background_thread

__all__ = ["gc_paused"]


class gc_paused:
    """Pause the cyclic garbage collector while the caller's thread walks a large state,
    parses a large document or rebuilds many tensors: their hundreds of thousands of
    new, acyclic objects otherwise trigger collections of the whole heap (measured: a
    fifth of a 10,000-tensor save's blocking time, most of its load's tensor
    allocation, half of a 10,000-tensor manifest's parse in a process holding torch).

    On ckptstore's own background threads it does nothing: a pause there would overlap
    the training thread's work for as long as a save writes, and its cyclic garbage
    would pile up meanwhile. A load pauses it over its reads too (restore): the caller
    waits for them, and their objects (a few per blob, made on the reader threads) set
    off collections of the caller's whole heap otherwise. Nested uses are counted; the
    collector's previous state comes back when the last one ends. A child forked during
    a pause starts with the collector as it was before the pause."""

    _lock = threading.Lock()
    _depth = 0
    _was_enabled = False

    def __enter__(self):
        self._active = not in_background_thread()
        if self._active:
            with gc_paused._lock:
                if gc_paused._depth == 0:
                    gc_paused._was_enabled = gc.isenabled()
                    gc.disable()
                gc_paused._depth += 1
        return self

    def __exit__(self, *exc):
        if self._active:
            with gc_paused._lock:
                gc_paused._depth -= 1
                if gc_paused._depth == 0 and gc_paused._was_enabled:
                    gc.enable()


def _after_fork_in_child() -> None:
    gc_paused._lock = threading.Lock()  # a thread of the parent may have held it
    if gc_paused._depth:
        gc_paused._depth = 0
        if gc_paused._was_enabled:
            gc.enable()


os.register_at_fork(after_in_child=_after_fork_in_child)
