"""Goodput under failures (issue 36, docs/design/in-job-restart.md section 13): the
project's example (docs/examples/fault_tolerant_training.py, 2 CPU ranks, gloo, FSDP2,
``--step-delay 0.1``) under each launcher, on the same seeded fault schedule, side by
side in one run.

Modes (``--modes``, a comma list; each mode's command is one entry of ``MODES``):

1. ``torchrun``: ``torchrun --max-restarts 50`` (torch's in-place restarts), ``--every 10``;
2. ``relaunch``: ``ckptstore run --no-in-job`` (the cold relaunch), ``--every 10``;
3. ``in-job``: ``ckptstore run`` (its default for the example, which calls
   ``ckptstore.inprocess.run``: in-job recovery, one warm spare), ``--every 1``;
4. ``in-job-auto``: the same with ``--every auto``.

A mode whose launcher does not know its options (``--help`` does not name them), or
whose example does not accept its ``--every``, is reported "unavailable" and skipped;
so is one whose run dies of "unrecognized arguments" or "invalid ... value", and, in that
layout only, one refused before any step (exit 2: ``--in-job`` on two nodes).

Each mode also runs once per repeat without faults (its baseline, same command): the
baseline's wall time / steps is the mode's seconds per step, the steady interval
between two steps of rank 0 the step interval.

Fault schedules (``--schedule``, a comma list):

- ``kill``: from the first step on, every ``--kill-every`` seconds (a fixed grid from
  the first step), SIGKILL one rank drawn by ``random.Random(--seed)``: the pid is the
  one on that rank's newest ``rank R: step N pid P`` line (a spare prints none, so a
  spare is never hit). A tick that comes while the job is still down from the previous
  fault (a rank it hit has not yet reported, from a new pid, a step past its last one;
  a survivor of a failed attempt may still be alive, and hitting it counts the same
  outage twice) is skipped, not deferred: a deferred kill lands at the first step after
  every cold relaunch and the job never advances.
- ``hang``: at the first tick, SIGSTOP the drawn rank, once; the mode's hang detection
  must act (``ckptstore run --hang-timeout`` gets the bench's ``--hang-timeout``, default
  5 s; torchrun has no hang detection and is expected to run into ``--timeout``).
- ``node``: two launchers as two simulated nodes on this machine (``--nnodes 2
  --node-rank K --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint
  127.0.0.1:PORT``, one store, one ``--run-id``), as tests/test_supervisor_nodes.py
  does; at each tick node 1's launcher and every process below it are SIGKILLed (node
  0 hosts the rendezvous store: its loss is a cold restart by design), and with
  ``--node-restart`` (default) a new launcher for node 1 starts at once (a replacement
  node). The baseline of this schedule is the mode's own two-node run without faults.

No fault is delivered once a rank has reported the last step: a fault then tests the exit
path (the final gather and save, the teardown), not a recovery, and a replacement node
started then waits for a job that is over.

Per run: wall time (the command's start to the exit of every launcher), steps, faults
delivered (``failures``); ``goodput = steps x baseline s/step / wall`` (= the
baseline's wall / this wall when the run finishes), and against the torchrun baseline
too; ``lost per failure = (wall - steps x baseline s/step) / failures``; per fault, the
bench's own figure: when the hit rank, from a new pid, reported a step above S (its
newest step before the fault) minus when step S+1 was due (step S's line plus the
baseline's step interval), cut at the next fault; for ``ckptstore run`` modes the journal's summary (``ckptstore status --json``:
failures, lost steps, in-job ``recovery`` events' detect_s, teardown_s, reform_s,
restore_s, first_step_s, restore_from where present); whether ``--final`` equals the
mode's baseline bit for bit; load average at start and end. A run that does not end
within ``--timeout`` is killed (every descendant by pid, then its process group) and
scores goodput 0, "hung"; one that exits non-zero scores 0 too.

    PYTHONPATH=/path/to/repo python bench/bench_goodput.py [--modes torchrun,relaunch,in-job,in-job-auto]
        [--schedule kill,hang,node] [--steps 400] [--kill-every 12] [--repeat 1] [--seed 0]
        [--timeout 600] [--hang-timeout 5] [--quick] [--out bench/results/goodput-<ts>.json]
        [--nproc 2] [--backend gloo|nccl] [--device cpu|cuda]

On a GPU (bench/gpu_check.sh's step 6): ``--backend nccl --nproc 1`` (NCCL refuses two
ranks of one communicator on one GPU, so one GPU runs a one-rank NCCL job: a kill is
replaced by the warm spare, whose state comes from the memory tier to the GPU; there is
no survivor, so the abort itself is not exercised) and ``--backend gloo --device cuda``
(two ranks sharing the GPU, CUDA tensors over gloo: survivors and the gloo abort shim,
with the model on the GPU).

``--repeat`` defaults to 1 (one faulted run per mode and schedule: ~40 s of compute
each, minutes once the faults and cold restarts are added); the table shows medians
when it is larger. ``--quick``: 60 steps, a fault every 4 s, 180 s timeout (a smoke
run, not figures). ``--dir`` is the parent of the temporary stores (removed at the end).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, "docs", "examples", "fault_tolerant_training.py")
STEP = re.compile(r"^rank (\d+): step (\d+) pid (\d+)$")
# What an option or a value unknown to the launcher or to the example says (argparse, click)
UNKNOWN = re.compile(r"unrecognized arguments|no such option|invalid int value: 'auto'|invalid choice|"
                     r"unknown option|invalid .* value")
NRANKS = 2
POLL_S = 0.05


@dataclasses.dataclass(frozen=True)
class Mode:
    """One way of running the job: its launcher, its options and the example's ``--every``."""
    name: str
    launcher: str  # "torchrun" or "ckptstore"
    every: str
    options: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()  # options the launcher's --help must name

    @property
    def supervised(self) -> bool:
        return self.launcher == "ckptstore"


MODES = {m.name: m for m in (
    Mode("torchrun", "torchrun", "10", ("--max-restarts", "50")),
    Mode("relaunch", "ckptstore", "10", ("--no-in-job",)),
    # ckptstore run's default for the example (it calls ckptstore.inprocess.run): in-job, 1 spare
    Mode("in-job", "ckptstore", "1", (), needs=("--in-job", "--spares")),
    Mode("in-job-auto", "ckptstore", "auto", (), needs=("--in-job", "--spares")),
)}
SCHEDULES = ("kill", "hang", "node")


# ------------------------------------------------------------------ pure parts (tests/test_bench_goodput.py)
def parse_step(line: str) -> tuple[int, int, int] | None:
    """(rank, step, pid) of a ``rank R: step N pid P`` line, else None."""
    m = STEP.match(line.rstrip("\n"))
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


class Schedule:
    """The fault ticks of one run: ``t0 + k * every`` for k = 1, 2, ... (t0: the first step),
    each with a target drawn from ``random.Random(seed)`` whether the tick is used or
    skipped, so every mode sees the same targets at the same ticks. ``hang`` has one tick;
    ``node`` targets node 1 (of ``nnodes``), the others a rank in ``range(nranks)``."""

    def __init__(self, kind: str, seed: int, every: float, nranks: int = NRANKS, nnodes: int = 2):
        if kind not in SCHEDULES:
            raise ValueError(f"schedule {kind!r}: not one of {', '.join(SCHEDULES)}")
        if every <= 0:
            raise ValueError(f"--kill-every {every}: must be above 0")
        self.kind, self.every, self.nranks, self.nnodes = kind, every, nranks, nnodes
        self.rng = random.Random(seed)
        self.t0: float | None = None
        self.k = 0  # ticks consumed

    def start(self, t0: float) -> None:
        if self.t0 is None:
            self.t0 = t0

    def next_t(self) -> float | None:
        """When the next tick is due; None before the first step or when none is left."""
        if self.t0 is None or (self.kind == "hang" and self.k >= 1):
            return None
        return self.t0 + (self.k + 1) * self.every

    def due(self, now: float) -> int | None:
        """The target of the tick due at ``now`` (consumed), else None."""
        t = self.next_t()
        if t is None or now < t:
            return None
        self.k += 1
        if self.kind == "node":
            return 1 if self.nnodes == 2 else self.rng.randrange(1, self.nnodes)
        return self.rng.randrange(self.nranks)


def fault_losses(faults: list[dict], steps: list[tuple[float, int, int, int]], interval: float) -> list[dict]:
    """Each fault's cost as the bench sees it. ``faults``: {"t", "hit": {rank: (pid, step,
    t_step)}} in time order, ``hit`` the ranks the fault took down with the pid and the
    newest step line each had then; ``steps``: (t, rank, step, pid) of every step line
    in time order (a finished run adds one line per rank, step = the run's steps, pid -1,
    at its end: a fault after the last step is over when the run is). A hit rank is back
    at its first line after the fault from another pid (its replacement: a relaunched
    process, a spare) with a step above the one it had reported; lost = the last hit
    rank's return - (its step line + ``interval``), the delay of the step that would have
    come next in an uninterrupted run (up to one step more when the rank had finished a
    step it had not printed yet); cut at the next fault (``cut``: the job was hit again
    before it was back; ``recovered_t`` None when it never was)."""
    out = []
    for i, f in enumerate(faults):
        back, due = [], []
        for rank, (pid, step, t_step) in f["hit"].items():
            back.append(next((t for t, r, s, p in steps if t > f["t"] and r == rank and p != pid and s > step), None))
            due.append(t_step + interval)
        rec = None if not back or None in back else max(back)
        nxt = faults[i + 1]["t"] if i + 1 < len(faults) else None
        cut = nxt is not None and (rec is None or rec > nxt)
        end = nxt if cut else rec
        out.append({**f, "recovered_t": rec, "cut": cut, "lost_s": None if end is None else max(0.0, end - min(due))})
    return out


def is_back(fault: dict | None, newest: dict) -> bool:
    """The job is up again after ``fault`` ({"hit": {rank: (pid, step, t)}}): every rank it
    hit has reported, from another pid, a step above the one it had reported (``newest``:
    rank -> (pid, step, ...)). A survivor's line proves nothing: it may be the step it had
    finished before the fault, or a rank of an attempt that is being torn down."""
    if fault is None:
        return True
    for rank, (pid, step, _t) in fault["hit"].items():
        now = newest.get(rank)
        if now is None or now[0] == pid or now[1] <= step:
            return False
    return True


def step_interval(steps: list[tuple[float, int]]) -> float | None:
    """The median time between consecutive steps (n, n+1) of one rank's lines ((t, step))."""
    gaps = [t1 - t0 for (t0, s0), (t1, s1) in zip(steps, steps[1:]) if s1 == s0 + 1]
    return statistics.median(gaps) if gaps else None


def scores(run: dict, base: dict | None, reference: dict | None) -> dict:
    """goodput, goodput against ``reference`` (the torchrun baseline) and the seconds lost
    per failure of ``run`` ({"wall_s", "steps", "finished", "failures"}) against ``base``
    (the mode's baseline: {"wall_s", "steps"}); None where a figure is undefined."""
    def per_step(b):
        return b["wall_s"] / b["steps"] if b and b.get("finished") and b.get("steps") else None

    out = {"goodput": None, "goodput_vs_torchrun": None, "lost_per_failure_s": None}
    s, ref = per_step(base), per_step(reference)
    if not run.get("finished"):
        out["goodput"] = 0.0 if s is not None else None
        out["goodput_vs_torchrun"] = 0.0 if ref is not None else None
        return out
    if s is not None:
        out["goodput"] = run["steps"] * s / run["wall_s"]
        if run.get("failures"):
            out["lost_per_failure_s"] = (run["wall_s"] - run["steps"] * s) / run["failures"]
    if ref is not None:
        out["goodput_vs_torchrun"] = run["steps"] * ref / run["wall_s"]
    return out


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (mode, schedule) of the faulted runs, in order of first appearance:
    medians over repeats; per-fault lost seconds pooled over the repeats."""
    rows: dict[tuple, dict] = {}
    for r in runs:
        if r.get("schedule") == "baseline":
            continue
        rows.setdefault((r["mode"], r["schedule"]), []).append(r)

    def med(xs):
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else None

    out = []
    for (mode, sched), rs in rows.items():
        done = [r for r in rs if not r.get("unavailable")]
        per_fault = [f["lost_s"] for r in done for f in r.get("faults", []) if f.get("lost_s") is not None]
        bits = [r["bit_identical"] for r in done if r.get("bit_identical") is not None]  # (finished runs)
        notes = sorted({r["note"] for r in rs if r.get("note")})
        out.append({
            "mode": mode, "schedule": sched, "runs": len(done),
            "goodput": med(r.get("goodput") for r in done),
            "goodput_vs_torchrun": med(r.get("goodput_vs_torchrun") for r in done),
            "lost_per_failure_s": med(r.get("lost_per_failure_s") for r in done),
            "fault_lost_median_s": med(per_fault),
            "fault_lost_max_s": max(per_fault) if per_fault else None,
            "failures": med(r.get("failures") for r in done),
            "bit_identical": all(bits) if bits else None,
            "unavailable": rs[0].get("unavailable") if not done else None,
            "note": "; ".join(notes) or None,
            "journal": _journal_row([r["journal"] for r in done if isinstance(r.get("journal"), dict)
                                     and "error" not in r["journal"]]),
        })
    return out


def _journal_row(journals: list[dict]) -> dict | None:
    """The journals' figures over the repeats: failures and lost steps (medians), each
    in-job recovery duration (median of the runs' medians) and where restores came from
    (summed)."""
    if not journals:
        return None
    out = {"failures": statistics.median(len(j.get("failures") or []) for j in journals),
           "lost_steps": statistics.median(j.get("lost_steps") or 0 for j in journals)}
    keys = ("detect_s", "teardown_s", "reform_s", "restore_s", "first_step_s")
    meds = {k: [j["recovery_medians_s"][k] for j in journals if k in j.get("recovery_medians_s", {})] for k in keys}
    out["recovery_medians_s"] = {k: statistics.median(v) for k, v in meds.items() if v}
    totals: dict[str, int] = {}
    for j in journals:
        for src, n in (j.get("restore_from_totals") or {}).items():
            totals[src] = totals.get(src, 0) + n
    out["restore_from"] = totals
    out["recoveries"] = sum(len(j.get("recovery_events") or []) for j in journals)
    return out


def breakdown(rows: list[dict]) -> str:
    """The journal's view of the ``ckptstore run`` modes as a markdown table."""
    def num(x):
        return "-" if x is None else f"{x:.2f}"

    lines = ["| mode | schedule | journal failures | lost steps | in-job recoveries | detect | teardown | re-form "
             "| restore | first step | restored from |", "|---" * 11 + "|"]
    for r in rows:
        j = r.get("journal")
        if not j:
            continue
        m = j["recovery_medians_s"]
        src = ", ".join(f"{k} {v}" for k, v in sorted(j["restore_from"].items())) or "-"
        lines.append(f"| {r['mode']} | {r['schedule']} | {j['failures']:g} | {j['lost_steps']:g} | {j['recoveries']} | "
                     + " | ".join(num(m.get(k)) for k in ("detect_s", "teardown_s", "reform_s", "restore_s",
                                                          "first_step_s")) + f" | {src} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def table(rows: list[dict]) -> str:
    """The summary as a markdown table, ready for docs/performance.md."""
    def num(x, unit=""):
        return "-" if x is None else f"{x:.2f}{unit}"

    head = ("| mode | schedule | goodput | vs torchrun baseline | lost per failure | per fault median / max "
            "| failures | bit-identical | note |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for r in rows:
        if r.get("unavailable"):
            lines.append(f"| {r['mode']} | {r['schedule']} | - | - | - | - | - | - | unavailable: {r['unavailable']} |")
            continue
        bits = {None: "-", True: "yes", False: "**no**"}[r["bit_identical"]]
        fails = "-" if r["failures"] is None else f"{r['failures']:g}"
        lines.append(f"| {r['mode']} | {r['schedule']} | {num(r['goodput'])} | {num(r['goodput_vs_torchrun'])} "
                     f"| {num(r['lost_per_failure_s'], ' s')} | {num(r['fault_lost_median_s'])} / "
                     f"{num(r['fault_lost_max_s'], ' s')} | {fails} | {bits} | {r['note'] or ''} |")
    return "\n".join(lines)


def unknown_option(output: str) -> str | None:
    """The line of ``output`` that says an option or value was not understood, else None."""
    return next((line.strip() for line in output.splitlines() if UNKNOWN.search(line)), None)


def refusal(output: str, rcs: list, top: int) -> str | None:
    """Why a run that failed could not run at all in this branch: an option or value not
    understood, or a usage refusal (exit 2 before any step, e.g. ``--in-job`` with two
    nodes): its line, else None (a real failure)."""
    why = unknown_option(output)
    if why or top >= 0 or 2 not in rcs:
        return why
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return lines[-1][:300] if lines else "exit 2 before any step"


# ------------------------------------------------------------------ commands
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def layout_args(node_rank: int | None, port: int | None, nproc: int = NRANKS) -> list[str]:
    if node_rank is None:
        return ["--standalone", "--nproc-per-node", str(nproc)]
    return ["--nnodes", "2", "--node-rank", str(node_rank), "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}"]


def command(mode: Mode, args, store: str, final: str, schedule: str, node_rank: int | None = None,
            port: int | None = None, run_id: str | None = None) -> list[str]:
    script = [EXAMPLE, store, "--steps", str(args.steps), "--every", mode.every, "--step-delay",
              f"{args.step_delay:g}", "--final", final, "--hidden", str(args.hidden)]
    device, backend = getattr(args, "device", "cpu"), getattr(args, "backend", "gloo")
    if (device, backend) != ("cpu", "gloo"):  # (the CPU command stays what older examples accept)
        script += ["--device", device, "--backend", backend]
    layout = layout_args(node_rank, port, getattr(args, "nproc", NRANKS))
    if not mode.supervised:
        return [sys.executable, "-m", "torch.distributed.run", *layout, *mode.options, *script]
    policy = ["--store", store]
    if run_id is not None:
        policy += ["--run-id", run_id]
    if schedule == "hang":
        policy += ["--hang-timeout", f"{args.hang_timeout:g}"]
    return [sys.executable, "-m", "ckptstore.cli", "run", *layout, *policy, *shlex.split(args.ckptstore_args),
            *mode.options, *script]


_HELP: dict[str, str] = {}


def _help(cmd: list[str]) -> tuple[int, str]:
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120, cwd=REPO,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    return p.returncode, p.stdout


def availability(mode: Mode) -> str | None:
    """Why ``mode`` cannot run here (its launcher lacks an option, the example rejects its
    ``--every``), else None."""
    if mode.needs:
        if "ckptstore" not in _HELP:
            _HELP["ckptstore"] = _help([sys.executable, "-m", "ckptstore.cli", "run", "--help"])[1]
        missing = [o for o in mode.needs if not re.search(re.escape(o) + r"\b", _HELP["ckptstore"])]
        if missing:
            return f"ckptstore run has no {', '.join(missing)}"
    if not mode.every.isdigit():
        key = f"every={mode.every}"
        if key not in _HELP:
            # argparse converts --every before it reaches --help: exit 0 iff the value is accepted
            rc, out = _help([sys.executable, EXAMPLE, "STORE", "--every", mode.every, "--help"])
            _HELP[key] = "" if rc == 0 else (unknown_option(out) or f"exit {rc}")
        if _HELP[key]:
            return f"the example rejects --every {mode.every} ({_HELP[key]})"
    return None


# ------------------------------------------------------------------ one run
class Launch:
    """One launcher process (one simulated node) and its output; every line stamped and
    fed to the shared ``Watch``."""

    def __init__(self, cmd: list[str], watch: "Watch", node: int):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.cmd, self.node, self.watch = cmd, node, watch
        self.t0 = time.time()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     start_new_session=True, cwd=REPO)
        self.stepped = False  # a rank of this launcher reported a step
        self.thread = threading.Thread(target=self._pump, daemon=True)
        self.thread.start()

    def _pump(self) -> None:
        for raw in self.proc.stdout:
            self.watch.line(self, raw.rstrip("\n"))

    def tree(self) -> list:
        import psutil

        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.Error:
            return []


class Watch:
    """The lines of a run's launchers: the newest pid of each rank, every step, every
    process ever seen below a launcher (to kill what is left at the end)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.lines: list[tuple[float, int, str]] = []
        self.newest: dict[int, tuple[int, int, float, int]] = {}  # rank -> (pid, step, t, launcher node)
        self.steps: list[tuple[float, int, int, int]] = []  # (t, rank, step, pid)
        self.rank0: list[tuple[float, int]] = []
        self.first_step_t: float | None = None
        self.top = -1  # the highest step any rank reported
        self.seen: dict[int, float] = {}  # pid -> create_time

    def line(self, launch: Launch, line: str) -> None:
        now = time.time()
        parsed = parse_step(line)
        with self.lock:
            self.lines.append((now, launch.node, line))
            if parsed:
                rank, step, pid = parsed
                self.newest[rank] = (pid, step, now, launch.node)
                self.steps.append((now, rank, step, pid))
                self.top = max(self.top, step)
                if rank == 0:
                    self.rank0.append((now, step))
                launch.stepped = True
                if self.first_step_t is None:
                    self.first_step_t = now

    def remember(self, launches: list[Launch]) -> None:
        for la in launches:
            for p in la.tree():
                try:
                    self.seen.setdefault(p.pid, p.create_time())
                except Exception:
                    pass

    def text(self, last: int = 40) -> list[str]:
        with self.lock:
            return [f"[{n}] {line}" for _, n, line in self.lines[-last:]]


def _live(pid: int, launches: list[Launch]) -> bool:
    """``pid`` is a running (not zombie, not stopped) process below one of ``launches``."""
    import psutil

    for la in launches:
        for p in la.tree()[1:]:
            if p.pid == pid:
                try:
                    return p.status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_STOPPED, psutil.STATUS_DEAD)
                except psutil.Error:
                    return False
    return False


def kill_tree(launch: Launch, sig=signal.SIGKILL) -> None:
    for p in launch.tree():
        try:
            os.kill(p.pid, sig)
        except ProcessLookupError:
            pass


def cleanup(watch: Watch, launches: list[Launch]) -> None:
    """SIGKILL every process this run started that is still there: each launcher's tree,
    then every pid seen below one (torchrun's workers run in sessions of their own; an
    orphan is re-parented), matched by creation time so a reused pid is never hit."""
    import psutil

    watch.remember(launches)
    for la in launches:
        kill_tree(la)
        try:
            os.killpg(la.proc.pid, signal.SIGKILL)  # the group this bench started (start_new_session)
        except (ProcessLookupError, PermissionError):
            pass
    for pid, created in watch.seen.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == created:
                p.kill()
        except psutil.Error:
            pass
    for la in launches:
        try:
            la.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def run_one(mode: Mode, schedule: str, args, work: str, tag: str, faulted: bool) -> dict:
    """One run of ``mode``: ``schedule`` picks the layout (``node``: two launchers) and,
    with ``faulted``, the faults; returns its record (no scores yet)."""
    store = tempfile.mkdtemp(prefix=f"store-{tag}-", dir=work)
    final = os.path.join(work, f"final-{tag}.pt")
    nodes = schedule == "node"
    port = free_port() if nodes else None
    run_id = f"goodput-{tag}" if nodes else None
    cmds = ([command(mode, args, store, final, schedule, k, port, run_id) for k in range(2)] if nodes
            else [command(mode, args, store, final, schedule)])
    sched = Schedule(schedule, args.seed, args.kill_every, nranks=args.nproc) if faulted else None
    watch = Watch()
    load0 = os.getloadavg()
    t0 = time.time()
    launches = [Launch(c, watch, k) for k, c in enumerate(cmds)]
    current = list(launches)  # the live launcher of each node (a restarted node replaces its entry)
    faults, skipped, hit = [], [], set()
    timed_out = False
    next_scan = 0.0
    try:
        while any(la.proc.poll() is None for la in current):
            now = time.time()
            if now - t0 > args.timeout:
                timed_out = True
                break
            if now >= next_scan:  # the processes below the launchers, for the cleanup
                watch.remember(current)
                next_scan = now + 1.0
            # no fault once the last step was reported: one then tests the exit path (the final
            # gather and save, the teardown), and a replacement node would wait for a job that is over
            if sched is not None and watch.first_step_t is not None and watch.top < args.steps - 1:
                sched.start(watch.first_step_t)
                target = sched.due(now)
                if target is not None:
                    with watch.lock:
                        up = is_back(faults[-1] if faults else None, watch.newest)
                    fault = _deliver(schedule, target, watch, current, hit, args) if up else None
                    if fault is None:
                        skipped.append({"t": now - t0, "target": target})
                    else:
                        faults.append(fault)
                        if schedule == "node" and args.node_restart:
                            current[target] = Launch(cmds[target], watch, target)
                            launches.append(current[target])
            time.sleep(POLL_S)
    except KeyboardInterrupt:  # (the caller's time is up: no process of this run outlives it)
        watch.remember(current)
        cleanup(watch, launches)
        raise
    end = time.time()  # the last launcher's exit (or the timeout), before the cleanup's own time
    cleanup(watch, launches)
    for la in launches:
        la.thread.join(timeout=5)
    rcs = [la.proc.returncode for la in current]
    output = "\n".join(line for _, _, line in watch.lines)
    steps = watch.top + 1
    # A node lost for good (--no-node-restart) ends by its kill: the job finished when the
    # launchers still running (node 0's, which rank 0's --final comes from) exit 0.
    lost = {i for i, la in enumerate(current) if schedule == "node" and not args.node_restart and faults
            and la.proc.returncode is not None and la.proc.returncode < 0}
    finished = not timed_out and all(rc == 0 for i, rc in enumerate(rcs) if i not in lost) and len(lost) < len(rcs)
    ends = [(end, rank, args.steps, -1) for rank in range(args.nproc)] if finished else []
    interval = args._interval.get((mode.name, nodes)) or args.step_delay
    losses = fault_losses(faults, watch.steps + ends, interval)
    rec = {"mode": mode.name, "schedule": schedule if faulted else "baseline",
           "layout": "nodes" if nodes else "standalone",
           "cmd": cmds[0], "wall_s": end - t0, "rcs": rcs, "timed_out": timed_out, "finished": finished,
           "steps": steps, "failures": len(faults),
           "faults": [{**f, "t": f["t"] - t0, "hit": {r: [p, st, ts - t0] for r, (p, st, ts) in f["hit"].items()},
                       "recovered_t": None if f["recovered_t"] is None else f["recovered_t"] - t0} for f in losses],
           "skipped_ticks": skipped, "step_interval_s": step_interval(watch.rank0),
           "first_step_s": None if watch.first_step_t is None else watch.first_step_t - t0,
           "loadavg_start": load0, "loadavg_end": os.getloadavg(), "final": final if os.path.exists(final) else None,
           "store": store}
    if timed_out:
        rec["note"] = f"hung (killed after {args.timeout:g} s)"
    elif not finished:
        why = refusal(output, rcs, watch.top)
        if why:
            rec["unavailable"] = why
        rec["note"] = f"exit {rcs}"
    if not finished:
        rec["tail"] = watch.text()
    if mode.supervised:
        rec["journal"] = journal_summary(store)
    return rec


def _deliver(schedule: str, target: int, watch: Watch, current: list[Launch], hit: set, args) -> dict | None:
    """The fault of a tick on ``target`` (a rank, or a node for ``node``), or None when the
    target has nothing live to hit (the job is down: the tick is skipped)."""
    if schedule == "node":
        la = current[target]
        if la.proc.poll() is not None or not la.stepped:
            return None
        with watch.lock:
            ranks = {r: v[:3] for r, v in watch.newest.items() if v[3] == target}
        kill_tree(la)
        return {"t": time.time(), "kind": "node", "target": target, "pid": la.proc.pid, "hit": ranks}
    with watch.lock:
        pid, step, t_step, _node = watch.newest.get(target, (None, None, None, None))
    if pid is None or pid in hit or not _live(pid, current):
        return None
    sig = signal.SIGSTOP if schedule == "hang" else signal.SIGKILL
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return None
    hit.add(pid)
    return {"t": time.time(), "kind": "SIGSTOP" if schedule == "hang" else "SIGKILL", "target": target, "pid": pid,
            "hit": {target: (pid, step, t_step)}}


REC_FIELDS = ("round", "ranks", "class", "step", "restored_step", "lost_steps", "lost_s", "detect_s", "teardown_s",
              "reform_s", "restore_s", "first_step_s", "restore_from", "node_lost")


def journal_summary(store: str) -> dict:
    """What ``ckptstore status STORE --json`` says of the run (the same function), cut to
    the figures the bench reports, plus the in-job ``recovery`` events where there are."""
    try:
        from ckptstore.storage import open_storage
        from ckptstore.supervisor.journal import Journal, latest_run
        from ckptstore.supervisor.status import status

        storage = open_storage(store)
        s = status(storage, None, time.time())
        out = {k: s.get(k) for k in ("state", "restarts", "failures_by_class", "lost_steps", "lost_s", "startup_s",
                                     "recovery_s", "goodput", "mtbf_s") if k in s}
        out["failures"] = [{k: f.get(k) for k in ("attempt", "class", "signal", "step", "checkpoint_step",
                                                  "lost_steps", "lost_s", "recovered") if k in f}
                           for f in s.get("failures", [])]
        for k, v in s.items():  # in-job figures, whatever the status of this branch calls them
            if "recover" in k and k not in out:
                out[k] = v
        events = Journal(storage, latest_run(storage)).events()
        recs = [{k: e[k] for k in REC_FIELDS if k in e} for e in events if e.get("kind") == "recovery"]
        if recs:
            out["recovery_events"] = recs
            out["recovery_medians_s"] = {
                k: statistics.median(v) for k in ("detect_s", "teardown_s", "reform_s", "restore_s", "first_step_s")
                if (v := [r[k] for r in recs if isinstance(r.get(k), (int, float))])}
            totals: dict[str, int] = {}
            for r in recs:
                for src, ranks in (r.get("restore_from") or {}).items():
                    totals[src] = totals.get(src, 0) + (len(ranks) if isinstance(ranks, list) else 0)
            out["restore_from_totals"] = totals
        return out
    except Exception as e:  # a journal the bench cannot read is a finding, not a crash
        return {"error": f"{type(e).__name__}: {e}"}


def bit_identical(path: str | None, reference: str | None) -> bool | None:
    """Every tensor of the two ``--final`` files equal byte for byte; None without both."""
    import torch

    if not path or not reference:
        return None
    a, b = torch.load(path), torch.load(reference)
    if sorted(a) != sorted(b):
        return False
    return all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k])
               and torch.equal(a[k].contiguous().flatten().view(torch.uint8),
                               b[k].contiguous().flatten().view(torch.uint8)) for k in a)


# ------------------------------------------------------------------ main
def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default=",".join(MODES), help="comma list of " + ", ".join(MODES))
    p.add_argument("--schedule", default="kill", help="comma list of " + ", ".join(SCHEDULES))
    p.add_argument("--steps", type=int, default=None, help="training steps (default 400; --quick 60)")
    p.add_argument("--step-delay", type=float, default=0.1, help="the example's simulated compute per step, s")
    p.add_argument("--hidden", type=int, default=64, help="the example's hidden width")
    p.add_argument("--kill-every", type=float, default=None, help="seconds between faults (default 12; --quick 4)")
    p.add_argument("--repeat", type=int, default=1, help="runs of each mode and schedule (and baseline)")
    p.add_argument("--seed", type=int, default=0, help="the fault targets' RNG seed (the same for every mode)")
    p.add_argument("--timeout", type=float, default=None, help="bound of each run, s (default 600; --quick 180)")
    p.add_argument("--hang-timeout", type=float, default=5.0, help="ckptstore run --hang-timeout in the hang schedule")
    p.add_argument("--node-restart", action=argparse.BooleanOptionalAction, default=True,
                   help="node schedule: start a new launcher for the lost node at once")
    p.add_argument("--ckptstore-args", default="", help="more options for every `ckptstore run` (one string)")
    p.add_argument("--quick", action="store_true", help="60 steps, a fault every 4 s, 180 s per run: a smoke run")
    p.add_argument("--nproc", type=int, default=NRANKS, help="ranks (one node; the node schedule: 1 per node)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="the example's --device (default cpu; cuda with --backend nccl): cuda:LOCAL_RANK")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                   help="the example's --backend (nccl: one GPU per rank, so --nproc at most the GPUs)")
    p.add_argument("--dir", default=None, help="parent of the temporary stores")
    p.add_argument("--out", default=None, help="default: bench/results/goodput-<UTC time>.json")
    p.add_argument("--dry-run", action="store_true", help="check the arguments, print the commands, run nothing")
    args = p.parse_args(argv)
    quick = args.quick
    for name, full, small in (("steps", 400, 60), ("kill_every", 12.0, 4.0), ("timeout", 600.0, 180.0)):
        if getattr(args, name) is None:
            setattr(args, name, small if quick else full)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    args.schedule = [s.strip() for s in args.schedule.split(",") if s.strip()]
    for m in args.modes:
        if m not in MODES:
            p.error(f"--modes: {m!r} is not one of {', '.join(MODES)}")
    for s in args.schedule:
        if s not in SCHEDULES:
            p.error(f"--schedule: {s!r} is not one of {', '.join(SCHEDULES)}")
    if args.steps < 1 or args.repeat < 1 or args.kill_every <= 0 or args.timeout <= 0 or args.nproc < 1:
        p.error("--steps, --repeat and --nproc must be at least 1, --kill-every and --timeout above 0")
    if args.device is None:
        args.device = "cuda" if args.backend == "nccl" else "cpu"
    if args.backend == "nccl" and args.device != "cuda":
        p.error("--backend nccl needs --device cuda")
    if args.backend == "nccl" and "node" in args.schedule:
        p.error("--backend nccl: the node schedule runs two simulated nodes on one machine, one rank each: "
                "two NCCL ranks would share a GPU unless it has two (use --backend gloo --device cuda)")
    return args


def main(argv=None) -> None:
    args = parse(argv)
    if args.dry_run:  # (gpu_check.sh --dry-run: the GPU step's arguments, checked on a CPU)
        args._interval = {}
        for name in args.modes:
            for sched in args.schedule:
                cmds = ([command(MODES[name], args, "STORE", "FINAL", sched, k, 0, "RUN") for k in range(2)]
                        if sched == "node" else [command(MODES[name], args, "STORE", "FINAL", sched)])
                for c in cmds:
                    print(f"would run ({name}, {sched}): {shlex.join(c)}")
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _common import Contention, machine_info, write_json

    if args.out is None:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        args.out = os.path.join(REPO, "bench", "results", f"goodput-{stamp}.json")
    work = tempfile.mkdtemp(prefix="bench-goodput-", dir=args.dir)
    contention = Contention()
    args._interval = {}  # (mode, two nodes) -> its first baseline's step interval (for the per-fault figure)
    result = {"machine": machine_info(work, loadavg_start=os.getloadavg()),
              "args": {k: v for k, v in vars(args).items() if not k.startswith("_")}, "script": EXAMPLE, "runs": []}
    unavailable = {}
    for name in args.modes:
        why = availability(MODES[name])
        if why:
            unavailable[name] = why
            print(f"{name}: unavailable: {why}", flush=True)
    layouts = sorted({"node" if s == "node" else "standalone" for s in args.schedule})
    runs = result["runs"]
    n = 0
    try:
        for rep in range(args.repeat):
            for name in args.modes:
                mode = MODES[name]
                if name in unavailable:
                    continue
                for layout in layouts:  # the baseline of each layout first: the per-fault figure uses its interval
                    if (name, layout) in unavailable:
                        continue
                    n += 1
                    rec = run_one(mode, "node" if layout == "node" else "kill", args, work, f"{n:03d}", faulted=False)
                    rec["repeat"] = rep
                    runs.append(rec)
                    if rec.get("step_interval_s"):
                        args._interval.setdefault((name, layout == "node"), rec["step_interval_s"])
                    print(f"[{rep}] {name} baseline ({rec['layout']}): {rec['wall_s']:.1f} s, {rec['steps']} steps, "
                          f"finished {rec['finished']}{', ' + rec['note'] if rec.get('note') else ''}", flush=True)
                    if rec.get("unavailable"):  # this layout only: --in-job may refuse two nodes and run on one
                        unavailable[(name, layout)] = rec["unavailable"]
                        print(f"{name} ({rec['layout']}): unavailable: {rec['unavailable']}", flush=True)
                for sched in args.schedule:
                    why = unavailable.get((name, "node" if sched == "node" else "standalone"))
                    if why:
                        if rep == 0:
                            runs.append({"mode": name, "schedule": sched, "unavailable": why})
                        continue
                    n += 1
                    rec = run_one(mode, sched, args, work, f"{n:03d}", faulted=True)
                    rec["repeat"] = rep
                    runs.append(rec)
                    print(f"[{rep}] {name} {sched}: {rec['wall_s']:.1f} s, {rec['steps']} steps, "
                          f"{rec['failures']} faults ({len(rec['skipped_ticks'])} ticks skipped), finished "
                          f"{rec['finished']}{', ' + rec['note'] if rec.get('note') else ''}", flush=True)
    except KeyboardInterrupt:  # SIGINT (gpu_check.sh's time bound): what ran so far is scored and written
        result["interrupted"] = f"stopped by SIGINT after {len(runs)} runs"
        print(result["interrupted"], flush=True)
    finally:
        result["others_cores"] = contention.others_cores()
        result["loadavg_end"] = os.getloadavg()
        _score(runs)
        for name, why in unavailable.items():
            if isinstance(name, str) and not any(r["mode"] == name and r["schedule"] != "baseline" for r in runs):
                runs.extend({"mode": name, "schedule": s, "unavailable": why} for s in args.schedule)
        result["summary"] = summarize(runs)
        result["unavailable"] = {k if isinstance(k, str) else f"{k[0]} ({k[1]})": v for k, v in unavailable.items()}
        result["table"] = table(result["summary"])
        result["breakdown"] = breakdown(result["summary"])
        for r in runs:
            r.pop("store", None)
        shutil.rmtree(work, ignore_errors=True)

    m = result["machine"]
    print(f"\nmachine: {m['cpu_model']}, {m['affinity_cores']} cores, torch {m['torch']}; load average "
          f"{m['loadavg_start'][0]:.2f} at start, {result['loadavg_end'][0]:.2f} at end; other processes used "
          f"{'-' if result['others_cores'] is None else format(result['others_cores'], '.2f')} cores")
    print(f"{args.steps} steps, --step-delay {args.step_delay:g}, a fault every {args.kill_every:g} s (seed "
          f"{args.seed}), {args.repeat} repeat(s)\n")
    for r in runs:
        if r.get("schedule") == "baseline":
            gap = "-" if r["step_interval_s"] is None else format(r["step_interval_s"], ".3f")
            same = r.get("bit_identical_to_torchrun")
            print(f"baseline {r['mode']} ({r['layout']}): {r['wall_s']:.1f} s for {r['steps']} steps "
                  f"({r['wall_s'] / max(1, r['steps']):.3f} s/step, step interval {gap} s"
                  f"{'' if same is None else f', final weights = the torchrun baseline: {same}'})")
    print()
    print(result["table"])
    if result["breakdown"]:
        print("\nThe journal (ckptstore status --json), medians over the repeats; in-job durations in seconds:\n")
        print(result["breakdown"])
    write_json(args.out, result)


def _score(runs: list[dict]) -> None:
    """Scores and bit-identity of each faulted run against the median baseline of its mode
    and layout (and the torchrun baseline of the same layout)."""
    def median_base(mode, layout):
        bs = [r for r in runs if r.get("schedule") == "baseline" and r["mode"] == mode and r["layout"] == layout
              and r.get("finished")]
        if not bs:
            return None
        bs.sort(key=lambda r: r["wall_s"])
        return bs[len(bs) // 2]

    for r in runs:
        if r.get("schedule") == "baseline" and r["mode"] != "torchrun":  # the launchers agree without faults?
            ref = median_base("torchrun", r["layout"])
            try:
                r["bit_identical_to_torchrun"] = bit_identical(r.get("final"),
                                                               None if ref is None else ref.get("final"))
            except Exception as e:
                r["bit_identical_to_torchrun"], r["bit_error"] = False, f"{type(e).__name__}: {e}"
        if r.get("schedule") in (None, "baseline") or r.get("unavailable"):
            continue
        base = median_base(r["mode"], r["layout"])
        ref = median_base("torchrun", r["layout"])
        r.update(scores(r, base, ref))
        r["baseline_wall_s"] = None if base is None else base["wall_s"]
        try:
            r["bit_identical"] = bit_identical(r.get("final") if r.get("finished") else None,
                                               None if base is None else base.get("final"))
        except Exception as e:
            r["bit_identical"], r["bit_error"] = False, f"{type(e).__name__}: {e}"


if __name__ == "__main__":
    main()
