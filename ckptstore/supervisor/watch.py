"""The node's health during a run (docs/runbook.md, "Health during the run").

Every ``health_interval_s`` (60 s; ``--health-interval``, 0: off) the supervisor runs
the run-time subset of health.py's checks in a thread of its own (its monitor loop never
waits for one; each group of checks is bounded by ``probe_timeout_s`` as before):

- per GPU (NVML): ``visible`` (a GPU fallen off the bus, Xid 79, is lost to NVML),
  ``temperature``, ``ecc`` (uncorrected errors since the driver loaded: Xid 48),
  ``retired_pages`` (a retirement pending), ``remapped_rows`` (a remap failed or
  pending: Xid 63/64). The memory, power, PCIe and clock rules are left out: under load
  they measure the job, not a fault.
- ``disk.free:<dir>`` where a tier writes: each ``--staging-dir`` and a local store's
  path (statvfs only: no probe file is written during the run).

A failing GPU check (``temperature`` only when it failed on :data:`CONFIRM` checks in a
row: a reading at the limit under load is not yet a dying GPU; an NVML group with no
answer counts as a failing GPU) makes the finding ``unhealthy``: the runner sends
SIGTERM to the job (the Checkpointer's preemption save, to the durable tier) and then
exits 13. A failing disk is a warning: journaled and alerted once per episode (until
the check passes again); the job goes on.

Without GPUs (no pynvml, no NVML, no device) and without a directory to watch, the
first check finds nothing to watch and the watch stops: no thread, no line, no event
after that. The check, the clock and the way a check is started are injected in the
tests.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from .health import (Check, HealthLimits, _disk_free, _gpu_ecc, _gpu_remapped_rows, _gpu_retired_pages,
                     _gpu_temperature, _gpu_visible, _nearest_existing, _run_bounded, gpu_checks)

RUN_GPU_RULES = (_gpu_visible, _gpu_temperature, _gpu_ecc, _gpu_retired_pages, _gpu_remapped_rows)
CONFIRM = {"temperature": 2}  # failing checks in a row before a rule of these counts (else 1)


def run_checks(staging_dirs, store_path: str | None, limits: HealthLimits) -> list[Check]:
    """The run-time checks (see the module docstring), bounded as check_node's are."""
    def disks() -> list[Check]:
        out, seen = [], set()
        for d in [*staging_dirs, *([store_path] if store_path else [])]:
            p = _nearest_existing(str(d))
            if p in seen:
                continue
            seen.add(p)
            out.append(_disk_free(p, p, limits))
        return out

    return _run_bounded([("gpus", lambda: gpu_checks(limits, RUN_GPU_RULES)), ("disks", disks)],
                        limits.probe_timeout_s)


@dataclass
class Finding:
    """What a finished check found that the runner acts on."""

    unhealthy: list[Check] = field(default_factory=list)  # confirmed failing GPU checks: preempt, exit 13
    warnings: list[Check] = field(default_factory=list)  # newly failing other checks: journal, alert


def _is_gpu(c: Check) -> bool:
    return c.name == "gpus" or c.name.startswith("gpu")


def _rule(c: Check) -> str:
    return c.name.split(".", 1)[1] if "." in c.name and c.name.startswith("gpu") else c.name


def _nothing_to_watch(checks: list[Check]) -> bool:
    """Only the ``gpus`` check, passing with no device: no GPU and no directory."""
    return all(c.name == "gpus" and c.ok and (c.value or {}).get("count") == 0 for c in checks)


class NodeWatch:
    def __init__(self, check, interval_s: float, *, clock=time.monotonic, spawn=None):
        self.check, self.interval_s, self.clock = check, interval_s, clock
        self.spawn = spawn or _spawn
        self.next_due = clock() + interval_s  # the gate checked the node just before the launch
        self.stopped = not interval_s > 0
        self._lock = threading.Lock()
        self._running = False
        self._done: list[Check] | None = None
        self.streak: dict[str, int] = {}  # failing checks in a row, by check name
        self.warned: set[str] = set()  # warnings journaled in the current episode

    def poll(self) -> Finding | None:
        """Start a check when one is due and none runs; return the finding of a check
        that has finished since the last poll (None: nothing new to act on)."""
        if self.stopped:
            return None
        with self._lock:
            done, self._done = self._done, None
            running = self._running
        finding = self._judge(done) if done is not None else None
        now = self.clock()
        if not self.stopped and not running and now >= self.next_due:
            self.next_due = now + self.interval_s
            with self._lock:
                self._running = True
            self.spawn(self._run)
        return finding

    def _run(self) -> None:
        try:
            checks = self.check()
        except Exception as e:  # noqa: BLE001 - a bug in a check is a failed check, never a crash
            checks = [Check("watch", False, f"check crashed: {type(e).__name__}: {e}")]
        with self._lock:
            self._done, self._running = checks, False

    def _judge(self, checks: list[Check]) -> Finding | None:
        if _nothing_to_watch(checks):
            self.stopped = True  # no GPU, no directory: quiet and free from now on
            return None
        out = Finding()
        for c in checks:
            if c.ok:
                self.streak.pop(c.name, None)
                self.warned.discard(c.name)
                continue
            n = self.streak[c.name] = self.streak.get(c.name, 0) + 1
            if _is_gpu(c):
                if n >= CONFIRM.get(_rule(c), 1):
                    out.unhealthy.append(c)
            elif c.name not in self.warned:
                self.warned.add(c.name)
                out.warnings.append(c)
        return out if (out.unhealthy or out.warnings) else None


def _spawn(fn) -> None:
    threading.Thread(target=fn, name="ckptstore-run-health", daemon=True).start()
