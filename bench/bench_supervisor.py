"""The supervisor's own cost (issue 35): ``ckptstore run`` beside plain torchrun, in the
same run, on the project's example (docs/examples/fault_tolerant_training.py, 2 CPU
ranks, gloo).

(a) launch: time from the command's start to the first training step reported by every
    rank, and to a clean finish, for ``torchrun --standalone --nproc-per-node 2`` and
    ``ckptstore run --standalone --nproc-per-node 2 --store DIR``, interleaved,
    ``--repeats`` times; medians and the ratio.
(b) relaunch: the bench SIGKILLs rank 1 once every rank has reported its first step;
    time from the kill to the first step of every relaunched rank. Under ``ckptstore
    run`` (``--backoff`` tiny, so the figure is the supervisor's own) the journal splits
    it: detect (kill -> ``failure`` event), backoff + health gate (-> ``attempt_start``;
    the backoff actually drawn is read from the supervisor's "relaunch in" line), launch
    (-> every rank's first step). Plain ``torchrun --max-restarts 1`` beside it, bounded
    by ``--relaunch-timeout``: "did not recover" is reported as such.
(c) the bootstrap alone: ``python -u EMPTY.py`` through supervisor/bootstrap.py vs
    directly, ``--boot-repeats`` times each, interleaved, medians.

    PYTHONPATH=/path/to/repo python bench/bench_supervisor.py [--repeats 3] [--steps 10]
        [--backoff 0.01] [--relaunch-timeout 30] [--out bench/results/supervisor-<ts>.json]

Every process has a timeout and is killed (its process group, which the bench started)
when it runs over. ~2.5 min on 2 busy cores.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from _common import Contention, machine_info, write_json

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, "docs", "examples", "fault_tolerant_training.py")
STEP = re.compile(r"^rank (\d+): step (\d+) pid (\d+)$")
RELAUNCH_IN = re.compile(r"relaunch in ([0-9.]+)s")


def torchrun(*extra) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *extra]


def supervised(store: str, backoff: float, *extra) -> list[str]:
    return [sys.executable, "-m", "ckptstore.cli", "run", "--no-in-job", "--standalone", "--nproc-per-node", "2",
            "--store", store, "--backoff", f"{backoff:g}", *extra]


def run_job(cmd: list[str], timeout: float, kill_after_first: bool = False, nranks: int = 2) -> dict:
    """Run ``cmd`` (stdout and stderr merged, each line stamped); the time to every rank's
    first step and to the exit; with ``kill_after_first``, SIGKILL rank 1 once every rank
    has reported a step and time every rank's first step after that, from new pids."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True, cwd=REPO)
    lines: list[tuple[float, str]] = []
    first: dict[int, float] = {}
    after: dict[int, float] = {}
    old_pids: set[int] = set()
    killed = {"t": None, "pid": None}

    def reader():
        for raw in proc.stdout:
            now = time.time()
            line = raw.rstrip("\n")
            lines.append((now, line))
            m = STEP.match(line)
            if not m:
                continue
            rank, pid = int(m.group(1)), int(m.group(3))
            if killed["t"] is None:
                first.setdefault(rank, now)
                old_pids.add(pid)
                if kill_after_first and len(first) == nranks and rank == 1:
                    try:
                        os.kill(pid, signal.SIGKILL)
                        killed.update(t=time.time(), pid=pid)
                    except ProcessLookupError:
                        pass
            elif pid not in old_pids:
                after.setdefault(rank, now)

    th = threading.Thread(target=reader, daemon=True)
    th.start()
    timed_out = False
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        # torchrun starts its workers in sessions of their own: kill every descendant by
        # pid (taken before the launcher dies and they are re-parented), then its group
        import psutil

        try:
            kids = psutil.Process(proc.pid).children(recursive=True)
        except psutil.Error:
            kids = []
        for kid in kids:
            try:
                kid.kill()
            except psutil.Error:
                pass
        os.killpg(proc.pid, signal.SIGKILL)  # the group this bench started (start_new_session)
        rc = proc.wait(timeout=10)
    end = time.time()
    th.join(timeout=5)
    out = {"rc": rc, "timed_out": timed_out, "exit_s": end - t0,
           "first_step_all_s": (max(first.values()) - t0) if len(first) == nranks else None,
           "finished": rc == 0 and not timed_out}
    if kill_after_first:
        out["kill_t"] = killed["t"]
        out["relaunch_first_step_all_s"] = (max(after.values()) - killed["t"]) \
            if killed["t"] is not None and len(after) == nranks else None
        out["backoff_drawn_s"] = next((float(m.group(1)) for _, line in lines
                                       if (m := RELAUNCH_IN.search(line))), None)
        out["relaunch_first_step_t"] = max(after.values()) if len(after) == nranks else None
    if not out["finished"]:
        out["tail"] = [line for _, line in lines[-15:]]
    return out


def journal_breakdown(store: str, kill_t: float | None, first_t: float | None) -> dict:
    from ckptstore.storage import open_storage
    from ckptstore.supervisor.journal import Journal, latest_run

    storage = open_storage(store)
    events = Journal(storage, latest_run(storage)).events()
    fail = next((e for e in events if e["kind"] == "failure"), None)
    start1 = next((e for e in events if e["kind"] == "attempt_start" and e.get("attempt") == 1), None)
    resume1 = next((e for e in events if e["kind"] == "resume" and e.get("attempt") == 1), None)
    out = {"events": [e["kind"] for e in events]}
    if kill_t is not None and fail is not None:
        out["detect_s"] = fail["t"] - kill_t  # the kill -> the failure journaled (decision made)
        out["failure_class"] = fail.get("class")
    if fail is not None and start1 is not None:
        out["backoff_gate_s"] = start1["t"] - fail["t"]  # backoff sleep + health gate + journal write
    if start1 is not None and first_t is not None:
        out["launch_to_first_step_s"] = first_t - start1["t"]  # torchrun, imports, rendezvous, resume
    if resume1 is not None:
        out["resume_first_step_s"] = resume1.get("first_step_s")
    return out


def bootstrap_cost(repeats: int, work: str) -> dict:
    from ckptstore.supervisor.launch import BOOTSTRAP

    empty = os.path.join(work, "empty.py")
    open(empty, "w").close()
    env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_ERROR_FILE"}
    cmds = {"direct": [sys.executable, "-u", empty], "bootstrap": [sys.executable, "-u", BOOTSTRAP, "file", empty]}
    samples = {k: [] for k in cmds}
    for _ in range(repeats):
        for name, cmd in cmds.items():
            t = time.perf_counter()
            subprocess.run(cmd, env=env, check=True, timeout=30, cwd=work)
            samples[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in samples.items()}
    return {"samples_s": samples, "median_s": med, "cost_s": med["bootstrap"] - med["direct"]}


def fmt(x, unit="s") -> str:
    return "-" if x is None else f"{x:.2f}{unit}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="training steps of each launch run")
    p.add_argument("--backoff", type=float, default=0.01, help="ckptstore run --backoff for the relaunch run")
    p.add_argument("--relaunch-timeout", type=float, default=30.0, help="bound of each relaunch run, seconds")
    p.add_argument("--timeout", type=float, default=60.0, help="bound of each launch run, seconds")
    p.add_argument("--boot-repeats", type=int, default=10)
    p.add_argument("--dir", default=None)
    p.add_argument("--out", default=None, help="default: bench/results/supervisor-<UTC time>.json")
    args = p.parse_args()
    if args.out is None:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        args.out = os.path.join(REPO, "bench", "results", f"supervisor-{stamp}.json")

    work = tempfile.mkdtemp(prefix="bench-supervisor-", dir=args.dir)
    contention = Contention()
    result = {"machine": machine_info(work), "args": vars(args), "script": EXAMPLE}
    try:
        def store():
            return tempfile.mkdtemp(prefix="store-", dir=work)

        # (a) launch, interleaved
        launch = {"torchrun": [], "ckptstore_run": []}
        script_args = ["--steps", str(args.steps), "--every", "5"]
        for i in range(args.repeats):
            s = store()
            launch["torchrun"].append(run_job(torchrun(EXAMPLE, s, *script_args), args.timeout))
            s = store()
            launch["ckptstore_run"].append(run_job(supervised(s, args.backoff, EXAMPLE, s, *script_args),
                                                   args.timeout))
            print(f"launch {i + 1}/{args.repeats}: torchrun {fmt(launch['torchrun'][-1]['first_step_all_s'])} / "
                  f"{fmt(launch['torchrun'][-1]['exit_s'])}, ckptstore run "
                  f"{fmt(launch['ckptstore_run'][-1]['first_step_all_s'])} / "
                  f"{fmt(launch['ckptstore_run'][-1]['exit_s'])}", flush=True)
        med = {}
        for name, runs in launch.items():
            ok = [r for r in runs if r["finished"]]
            med[name] = {"first_step_all_s": statistics.median(r["first_step_all_s"] for r in ok) if ok else None,
                         "finish_s": statistics.median(r["exit_s"] for r in ok) if ok else None,
                         "finished": f"{len(ok)}/{len(runs)}"}
        ratio = {k: (med["ckptstore_run"][k] / med["torchrun"][k]
                     if med["ckptstore_run"][k] and med["torchrun"][k] else None)
                 for k in ("first_step_all_s", "finish_s")}
        diff = {k: (med["ckptstore_run"][k] - med["torchrun"][k]
                    if med["ckptstore_run"][k] is not None and med["torchrun"][k] is not None else None)
                for k in ("first_step_all_s", "finish_s")}
        result["launch"] = {"runs": launch, "median": med, "ratio": ratio, "overhead_s": diff}

        # (b) one relaunch: SIGKILL rank 1 after every rank's first step
        long_args = ["--steps", "40", "--every", "5", "--step-delay", "0.05"]
        s = store()
        sup = run_job(supervised(s, args.backoff, EXAMPLE, s, *long_args), args.relaunch_timeout + 30,
                      kill_after_first=True)
        sup["journal"] = journal_breakdown(s, sup["kill_t"], sup.pop("relaunch_first_step_t"))
        s = store()
        tr = run_job(torchrun("--max-restarts", "1", EXAMPLE, s, *long_args), args.relaunch_timeout,
                     kill_after_first=True)
        tr.pop("relaunch_first_step_t")
        result["relaunch"] = {"ckptstore_run": sup, "torchrun_max_restarts_1": tr}

        # (c) the bootstrap alone
        result["bootstrap"] = bootstrap_cost(args.boot_repeats, work)
    finally:
        others = contention.others_cores()
        result["others_cores"] = others
        shutil.rmtree(work, ignore_errors=True)

    # the table
    L, R, B = result["launch"], result["relaunch"], result["bootstrap"]
    print(f"\nmachine: {result['machine']['cpu_model']}, {result['machine']['affinity_cores']} cores, "
          f"torch {result['machine']['torch']}; other processes used {fmt(others, ' cores')}")
    print(f"\n{'(a) launch, median of ' + str(args.repeats):34} {'torchrun':>10} {'ckptstore run':>14} "
          f"{'diff':>7} {'ratio':>6}")
    for k, label in (("first_step_all_s", "start -> every rank's first step"), ("finish_s", "start -> clean finish")):
        print(f"{label:34} {fmt(L['median']['torchrun'][k]):>10} {fmt(L['median']['ckptstore_run'][k]):>14} "
              f"{fmt(L['overhead_s'][k]):>7} {fmt(L['ratio'][k], 'x'):>6}")
    print(f"{'runs finished':34} {L['median']['torchrun']['finished']:>10} "
          f"{L['median']['ckptstore_run']['finished']:>14}")
    j = R["ckptstore_run"]["journal"]
    print(f"\n(b) relaunch after SIGKILL of rank 1 (kill -> every relaunched rank's first step)")
    print(f"  ckptstore run --backoff {args.backoff:g}: {fmt(R['ckptstore_run']['relaunch_first_step_all_s'])} "
          f"(finished: {R['ckptstore_run']['finished']})")
    print(f"    detect (kill -> failure journaled, class {j.get('failure_class')}): {fmt(j.get('detect_s'))}")
    print(f"    backoff + health gate (-> attempt_start; backoff drawn {fmt(R['ckptstore_run']['backoff_drawn_s'])}):"
          f" {fmt(j.get('backoff_gate_s'))}")
    print(f"    launch (attempt_start -> every rank's first step): {fmt(j.get('launch_to_first_step_s'))}")
    tr = R["torchrun_max_restarts_1"]
    if tr["relaunch_first_step_all_s"] is not None:
        print(f"  torchrun --max-restarts 1: {fmt(tr['relaunch_first_step_all_s'])} (finished: {tr['finished']})")
    else:
        print(f"  torchrun --max-restarts 1: did not recover within {args.relaunch_timeout:g} s "
              f"(rc {tr['rc']}, timed out: {tr['timed_out']})")
    print(f"\n(c) bootstrap alone, median of {args.boot_repeats}: python -u EMPTY.py {fmt(B['median_s']['direct'])}, "
          f"through bootstrap.py {fmt(B['median_s']['bootstrap'])}: +{B['cost_s'] * 1000:.0f} ms per worker")
    if others is not None and others > 0.25:
        print(f"warning: other processes used {others:.2f} cores during the run; the figures are noisy")
    write_json(args.out, result)


if __name__ == "__main__":
    main()
