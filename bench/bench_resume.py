#!/usr/bin/env python
"""Resume after a failure: time from process start to the first training step, and the
work lost per failure, for docs/examples/fault_tolerant_training.py under torchrun.

1. A fresh start (empty store) runs a few steps: its time to first step is the floor
   (interpreter, imports, process group, model), measured in the same run.
2. ``--failures`` times: the job is SIGKILLed (a random rank, at a random step), then
   relaunched with the same command. For each relaunch: time to its first step (each
   rank prints it, measured from its own process start) and the lost work: the last
   step any rank finished before the kill minus the step it resumed from, in steps and
   in seconds of training (steps x the measured step time).
3. The supervisor's own overhead: wall time from starting the command to the first
   training step, ``ckptstore run`` against plain torchrun, fresh stores, interleaved.

The model is an FSDP2 MLP of ``--hidden`` width (16 -> hidden -> 4, AdamW: three
copies of the parameters in the checkpoint). Saves every ``--every`` steps.

Usage::

    python bench/bench_resume.py [--failures 5] [--hidden 4096] [--every 5] [--out bench/results/resume-<ts>.json]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from _common import cpu_model, write_json

EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "examples",
                       "fault_tolerant_training.py")


def launch(store: str, args, steps: int, supervised: bool = False) -> subprocess.Popen:
    launcher = ([sys.executable, "-m", "ckptstore.cli", "run", "--no-in-job", "--store", store] if supervised
                else [sys.executable, "-m", "torch.distributed.run"])
    cmd = [*launcher, "--standalone", "--nproc-per-node", str(args.nproc),
           EXAMPLE, store, "--steps", str(steps), "--every", str(args.every), "--hidden", str(args.hidden)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
                            start_new_session=True)
    proc.launched = time.monotonic()
    return proc


def launch_to_first_step(store: str, args, supervised: bool) -> float:
    """Wall seconds from starting the command to the first training step's line."""
    proc = launch(store, args, 3, supervised)
    first = None
    for line in proc.stdout:
        if first is None and re.match(r"rank \d+: step \d+ pid", line):
            first = time.monotonic() - proc.launched
    proc.wait()
    return first


def watch(proc: subprocess.Popen, kill_at: int | None):
    """Read the job's lines; SIGKILL one rank once any rank reports step ``kill_at``.
    Returns (first-step seconds per rank, resumed step, last finished step, step times)."""
    first, resumed, last, pids, stamps = {}, None, -1, {}, []
    for line in proc.stdout:
        if m := re.match(r"rank (\d+): first step ([\d.]+)s after start", line):
            first[int(m[1])] = float(m[2])
        elif m := re.match(r"rank \d+: resumed at step (\d+)", line):
            resumed = int(m[1])
        elif m := re.match(r"rank (\d+): step (\d+) pid (\d+)", line):
            pids[int(m[1])] = int(m[3])
            step = int(m[2])
            if step > last:
                last = step
                stamps.append(time.monotonic())
            if kill_at is not None and step >= kill_at:
                os.kill(pids[random.choice(sorted(pids))], signal.SIGKILL)
                kill_at = None
    proc.wait()
    for pid in pids.values():  # the survivor dies on its broken collective; make sure
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return first, resumed, last, gaps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--failures", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--launch-repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    random.seed(seed)
    store = tempfile.mkdtemp(prefix="bench-resume-")
    fresh_first, _, _, gaps = watch(launch(tempfile.mkdtemp(prefix="bench-fresh-"), args, 12), None)
    step_s = statistics.median(gaps) if gaps else float("nan")
    total = 10_000
    rows, at = [], 3
    proc = launch(store, args, total)
    _, _, last, _ = watch(proc, at)
    for i in range(args.failures):
        at = last + random.randint(3, 3 + 2 * args.every)
        first, resumed, new_last, _ = watch(launch(store, args, total), at)
        lost = last - resumed
        rows.append({"failure": i + 1, "killed_after_step": last, "resumed_at": resumed, "lost_steps": lost,
                     "lost_s": lost * step_s, "first_step_s": max(first.values()) if first else None})
        last = new_last
    fresh = max(fresh_first.values())
    overhead = {"torchrun": [], "ckptstore run": []}
    for _ in range(args.launch_repeats):  # interleaved: the machine's noise hits both alike
        overhead["torchrun"].append(launch_to_first_step(tempfile.mkdtemp(prefix="bench-tr-"), args, False))
        overhead["ckptstore run"].append(launch_to_first_step(tempfile.mkdtemp(prefix="bench-sup-"), args, True))
    print(f"fresh start: first step {fresh:.2f}s after process start; step time {step_s * 1000:.1f} ms")
    print(f"{'failure':>7} {'killed after':>12} {'resumed at':>10} {'lost steps':>10} {'lost s':>7} "
          f"{'first step s':>12} {'vs fresh':>8}")
    for r in rows:
        print(f"{r['failure']:>7} {r['killed_after_step']:>12} {r['resumed_at']:>10} {r['lost_steps']:>10} "
              f"{r['lost_s']:>7.2f} {r['first_step_s']:>12.2f} {r['first_step_s'] / fresh:>7.2f}x")
    med = statistics.median(r["first_step_s"] for r in rows)
    lost = statistics.mean(r["lost_steps"] for r in rows)
    print(f"median first step after resume {med:.2f}s ({med / fresh:.2f}x a fresh start, +{med - fresh:.2f}s); "
          f"mean lost work {lost:.1f} steps ({lost * step_s:.2f}s) with saves every {args.every} steps")
    tr, sup = (statistics.median(overhead[k]) for k in ("torchrun", "ckptstore run"))
    print(f"launch to first step, fresh store, median of {args.launch_repeats}: torchrun {tr:.2f}s, "
          f"ckptstore run {sup:.2f}s ({sup / tr:.2f}x, +{sup - tr:.2f}s: health checks, journal, launcher wrapper)")
    result = {
        "bench": "resume", "seed": seed, "args": vars(args), "cpu": cpu_model(), "cores": os.cpu_count(),
        "at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "fresh_first_step_s": fresh, "step_s": step_s, "failures": rows,
        "median_first_step_after_resume_s": med, "mean_lost_steps": lost,
        "launch_to_first_step_s": overhead,
    }
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    write_json(args.out or os.path.join(os.path.dirname(__file__), "results", f"resume-{stamp}.json"), result)


if __name__ == "__main__":
    main()
