"""Before each launch of ``ckptstore run``: wait until the node is fit to run the job,
for a bounded time, and say why when it is not (docs/runbook.md, "Health checks").

1. Before a relaunch, the previous attempt's GPU memory: the supervisor waits until
   every GPU holds no more than it did before the first launch (plus
   :data:`RELEASE_SLACK_BYTES`), at most :data:`GPU_RELEASE_S` seconds (a dying
   process frees its CUDA memory some seconds after its exit; a relaunch that starts
   sooner runs out of memory). Without NVML or GPUs there is nothing to wait for.
2. The health checks (health.py). A node that fails them is checked again, with the
   policy's backoff, until ``health_wait_s`` has passed since the first failure: a hot
   GPU cools down, a slow mount comes back. Then: unhealthy (exit 13).
3. A store that fails its probe while everything else passes is a store outage, not an
   unhealthy node: it is checked again until ``outage_window_s`` has passed, then the
   run stops with :data:`EXIT_STORE_UNREACHABLE` (15), and the node is not blamed.

The check, the GPU readings, the clock and the sleep are the caller's (injected in the
tests); a stop signal ends every wait.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass

from .decide import Policy, backoff
from .health import GiB, Check, gpu_memory_used

EXIT_STORE_UNREACHABLE = 15
RELEASE_SLACK_BYTES = GiB // 2  # a GPU is "released" at most this much above its use before the first launch
GPU_RELEASE_S = 60.0  # the longest wait for a previous attempt's GPU memory
READ_TIMEOUT_S = 30.0  # one NVML reading (a hung driver must not hang the supervisor)
POLL_S = 0.5


@dataclass(frozen=True)
class Fitness:
    state: str  # "ok", "unhealthy" (exit 13), "store" (exit 15), "stopped" (a signal ended the wait)
    checks: list[Check]
    reason: str = ""


def _say(line: str) -> None:
    print(f"ckptstore run: {line}", file=sys.stderr, flush=True)


class Gate:
    def __init__(self, check, policy: Policy, stopped, *, gpu_memory=gpu_memory_used, clock=time.monotonic,
                 sleep=time.sleep, say=_say):
        self.check, self.policy, self.stopped = check, policy, stopped
        self.gpu_memory, self.clock, self.sleep, self.say = gpu_memory, clock, sleep, say
        self.baseline: dict[str, tuple[int, int]] | None = None  # the GPUs' use before the first launch

    def before_launch(self, relaunch: bool) -> Fitness:
        if relaunch:
            self.wait_gpu_release()
        else:
            self.baseline = self._read()
        first_failure = None
        n = 0
        while True:
            checks = self.check()
            failed = [c for c in checks if not c.ok]
            if not failed:
                return Fitness("ok", checks)
            store = all(c.name == "store" for c in failed)
            bound = self.policy.outage_window_s if store else self.policy.health_wait_s
            reason = "; ".join(f"{c.name}: {c.detail}" for c in failed)
            now = self.clock()
            first_failure = now if first_failure is None else first_failure
            waited = now - first_failure
            if self.stopped():
                return Fitness("stopped", checks, reason)
            if waited >= bound:
                return Fitness("store" if store else "unhealthy", checks, reason)
            n += 1
            delay = min(max(backoff(self.policy, n), POLL_S), bound - waited)
            what = "store unreachable" if store else "health check failed"
            self.say(f"{what}: {reason}; checking again in {delay:.1f}s "
                     f"(for up to {bound:g}s, {waited:.0f}s so far)")
            if not self._wait(delay):
                return Fitness("stopped", checks, reason)

    def wait_gpu_release(self) -> None:
        """Until no GPU holds more than before the first launch (plus the slack), at
        most GPU_RELEASE_S seconds; no readings (no NVML, no GPU): no wait."""
        if self.baseline is None:
            return
        deadline = self.clock() + GPU_RELEASE_S
        said = False
        while True:
            held = self._held(self._read())
            if not held:
                return
            text = ", ".join(f"{uuid}: {extra / GiB:.1f} GiB" for uuid, extra in sorted(held.items()))
            if self.clock() >= deadline:
                self.say(f"GPU memory still held {GPU_RELEASE_S:g}s after the last attempt ({text} above its "
                         "use before the first launch): checking the node as it is")
                return
            if not said:
                self.say(f"waiting for the last attempt's GPU memory to be freed ({text} above its use "
                         f"before the first launch; up to {GPU_RELEASE_S:g}s)")
                said = True
            if not self._wait(POLL_S):
                return

    def _held(self, readings) -> dict[str, int]:
        """Bytes above the baseline (and the slack) per device; {} when free or unknown."""
        if readings is None:
            return {}
        out = {}
        for uuid, (used, _total) in readings.items():
            before = self.baseline.get(uuid, (0, 0))[0]
            if used > before + RELEASE_SLACK_BYTES:
                out[uuid] = used - before
        return out

    def _read(self):
        """One reading of the GPUs' memory, or None (none, or no answer in time)."""
        box: list = [None]

        def read():
            box[0] = self.gpu_memory()

        t = threading.Thread(target=read, name="ckptstore-gpu-memory", daemon=True)
        t.start()
        t.join(READ_TIMEOUT_S)
        return None if t.is_alive() else box[0]

    def _wait(self, seconds: float) -> bool:
        """Sleep ``seconds`` unless stopped first; False when stopped."""
        end = self.clock() + seconds
        while not self.stopped():
            left = end - self.clock()
            if left <= 0:
                return True
            self.sleep(min(POLL_S, left))
        return False
