#!/usr/bin/env python
"""Core performance benchmark: ckptstore vs a bare copy, torch.save and torch.distributed.checkpoint.

One run, one disk directory, one transformer-like fp32 training state (weights plus two
Adam moments). It measures:

* blocking time of ``ckptstore.save`` (until it returns) vs a bare ``copy_`` of every tensor
  into preallocated buffers vs ``dcp.async_save`` (until it returns);
* time until committed and durable: ``ckptstore.save(...).result()`` vs ``torch.save`` into a
  file + flush + fsync vs ``dcp.save``;
* load time (ckptstore checks the xxh3 of every chunk): ``ckptstore.load`` vs ``torch.load``
  (weights_only=True, mmap=False) vs ``dcp.load`` into a preallocated state dict, with a cold
  page cache when the process may drop it, and again warm;
* peak extra memory of an asynchronous save (VmHWM after resetting it via
  /proc/self/clear_refs, in a fresh subprocess per tool so freed-but-resident heap from other
  phases cannot hide allocations), with the default staging pool and with a 128 MiB pool.

Usage::

    python bench/bench_core.py [--size-gib 0.75] [--repeats 3] [--out bench/results/core.json] [--dir DIR]

See bench/README.md and docs/performance.md.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings

import torch

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
warnings.filterwarnings("ignore", message=".*using the slower pure-Python/torch fallback.*")

import ckptstore  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from _common import Contention, cpu_model, drop_caches, mount_of, same, tensors_of, write_json  # noqa: E402
from torch.distributed.checkpoint import FileSystemWriter  # noqa: E402
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
SMALL_POOL = 128 * MiB
# "pool + small": what a bounded save may hold beyond its pool (per-worker encode scratch,
# the pickled skeleton, thread stacks, allocator slack).
SMALL_POOL_SLACK = 64 * MiB


# ---------------------------------------------------------------------------- the state

def build_state(size_bytes: int, seed: int = 0) -> dict:
    """A GPT-like model state dict plus an AdamW state with FQN keys (as DCP's
    get_optimizer_state_dict produces), about ``size_bytes`` of fp32 in total:
    params : exp_avg : exp_avg_sq = 1 : 1 : 1."""
    g = torch.Generator().manual_seed(seed)
    d, ff = 768, 3072
    target = size_bytes // 12  # parameter count (fp32, three copies)
    per_layer = (3 * d * d + 3 * d) + (d * d + d) + (d * ff + ff) + (ff * d + d) + 4 * d
    n_layers = max(1, round((target - 32000 * d - 2 * d) / per_layer))
    vocab = max(1000, (target - n_layers * per_layer - 2 * d) // d)

    shapes: list[tuple[str, tuple[int, ...], str]] = [("embed.weight", (vocab, d), "w")]
    for i in range(n_layers):
        p = f"layers.{i}."
        shapes += [
            (p + "ln1.weight", (d,), "ln"), (p + "ln1.bias", (d,), "b"),
            (p + "attn.qkv.weight", (3 * d, d), "w"), (p + "attn.qkv.bias", (3 * d,), "b"),
            (p + "attn.proj.weight", (d, d), "w"), (p + "attn.proj.bias", (d,), "b"),
            (p + "ln2.weight", (d,), "ln"), (p + "ln2.bias", (d,), "b"),
            (p + "mlp.up.weight", (ff, d), "w"), (p + "mlp.up.bias", (ff,), "b"),
            (p + "mlp.down.weight", (d, ff), "w"), (p + "mlp.down.bias", (d,), "b"),
        ]
    shapes += [("norm.weight", (d,), "ln"), ("norm.bias", (d,), "b")]

    def randn(shape, scale):
        t = torch.randn(shape, generator=g, dtype=torch.float32)
        return t.mul_(scale)

    model, optim_state = {}, {}
    for k, (name, shape, kind) in enumerate(shapes):
        if kind == "w":
            p = randn(shape, 0.02)
        elif kind == "b":
            p = randn(shape, 0.01)
        else:
            p = randn(shape, 0.02).add_(1.0)
        model[name] = p
        # Adam moments: per-tensor scales spread over two decades, like real runs.
        scale = 10 ** (-5 + 2 * ((k * 0.618) % 1.0))
        exp_avg = randn(shape, scale)
        exp_avg_sq = randn(shape, scale).square_().add_(1e-12)
        optim_state[name] = {"step": torch.tensor(1000.0), "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    param_groups = [{"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
                     "amsgrad": False, "params": [n for n, _, _ in shapes]}]
    return {"model": model, "optim": {"state": optim_state, "param_groups": param_groups}}


def state_bytes(obj) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(obj))


def empty_like_state(obj):
    """A preallocated (and touched) copy of the state's structure, for dcp.load."""
    if isinstance(obj, torch.Tensor):
        return torch.zeros_like(obj)
    if isinstance(obj, dict):
        return {k: empty_like_state(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [empty_like_state(v) for v in obj]
    return obj


# ---------------------------------------------------------------------------- machine, fs, caches

def machine_info(bench_dir: str) -> dict:
    import psutil

    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "cpu_model": cpu_model(),
        "logical_cores": os.cpu_count(),
        "affinity_cores": len(os.sched_getaffinity(0)),
        "ram_bytes": psutil.virtual_memory().total,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "ckptstore": ckptstore.__version__,
        "ckptstore_native": ckptstore_native(),
        "kernel": platform.release(),
        "disk": {"dir": bench_dir, **mount_of(bench_dir)},
    }


def ckptstore_native() -> bool:
    from ckptstore import native

    return bool(native.NATIVE)


def rm(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.unlink(path)


# ---------------------------------------------------------------------------- memory

def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


class PeakMemory:
    """Peak RSS above the RSS at ``start()``.

    Method "vmhwm": write 5 to /proc/self/clear_refs (resets VmHWM to the current RSS), read
    VmHWM at the end: exact, and costs nothing while the save runs. Fallback "psutil-1ms":
    a thread samples RSS every millisecond (can miss spikes shorter than that).
    """

    def __init__(self):
        self.method = "vmhwm" if self._can_reset_hwm() else "psutil-1ms"
        self._stop = threading.Event()
        self._thread = None
        self._peak = 0

    @staticmethod
    def _can_reset_hwm() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return _status("VmHWM") <= _status("VmRSS") + 4 * MiB
        except (OSError, KeyError):
            return False

    def start(self) -> None:
        gc.collect()
        self.base = _status("VmRSS") if self.method == "vmhwm" else self._rss()
        if self.method == "vmhwm":
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        else:
            self._peak = self.base
            self._stop.clear()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()

    @staticmethod
    def _rss() -> int:
        import psutil

        return psutil.Process().memory_info().rss

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self._peak = max(self._peak, self._rss())

    def peak_extra(self) -> int:
        if self.method == "vmhwm":
            return _status("VmHWM") - self.base
        return max(self._peak, self._rss()) - self.base

    def stop(self) -> int:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        return self.peak_extra()

    def rss_extra(self) -> int:
        gc.collect()
        return (_status("VmRSS") if self.method == "vmhwm" else self._rss()) - self.base


# ---------------------------------------------------------------------------- probes (subprocesses)

def run_probe(name: str, size_bytes: int, bench_dir: str) -> dict:
    """Fresh process: build the state, then two saves with one tool. Reports the first
    save's blocking/commit time and the peak extra memory of the first save and of both."""
    state = build_state(size_bytes)
    nbytes = state_bytes(state)
    mem = PeakMemory()
    out = {"probe": name, "state_bytes": nbytes, "method": mem.method, "saves": []}
    stager = None
    if name in ("ckptstore-default", "ckptstore-prepared"):
        ckptstore.configure()
    elif name == "ckptstore-128MiB":
        ckptstore.configure(staging_bytes=SMALL_POOL)
    elif name == "dcp.async_save-reused-stager":
        stager = DefaultStager(StagingOptions(False, False, False, False))
    mem.start()
    if name == "ckptstore-prepared":  # as a Checkpointer does after the first step, well before the save
        ckptstore.prepare(state).result()
    for i in range(2):
        path = os.path.join(bench_dir, f"probe-{name}-{i}")
        t0 = time.perf_counter()
        if name.startswith("ckptstore"):
            fut = ckptstore.save(state, path)
            t1 = time.perf_counter()
            fut.result()
        elif name.startswith("dcp.async_save"):
            kw = {"async_stager": stager} if stager is not None else {}
            fut = dcp.async_save(state, storage_writer=FileSystemWriter(path), no_dist=True, **kw)
            t1 = time.perf_counter()
            fut.result()
        elif name == "torch.save+fsync":
            with open(path, "wb") as f:
                torch.save(state, f)
                f.flush()
                t1 = time.perf_counter()
                os.fsync(f.fileno())
        else:
            raise ValueError(name)
        t2 = time.perf_counter()
        out["saves"].append({"blocking_s": t1 - t0, "commit_s": t2 - t0, "peak_extra_bytes": mem.peak_extra()})
        rm(path)
    out["peak_extra_bytes"] = mem.stop()
    out["retained_after_bytes"] = mem.rss_extra()
    if name.startswith("ckptstore"):
        from ckptstore.runtime import runtime

        out["pool_stats"] = runtime().pool.stats()
    return out


def probe(name: str, size_gib: float, bench_dir: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--probe", name, "--size-gib", str(size_gib), "--dir", bench_dir]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        raise RuntimeError(f"probe {name} failed ({res.returncode}):\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------- main measurements

def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(args) -> dict:
    size_bytes = int(args.size_gib * GiB)
    base = args.dir or tempfile.gettempdir()
    os.makedirs(base, exist_ok=True)
    bench_dir = tempfile.mkdtemp(prefix="ckptbench-", dir=base)
    info = machine_info(bench_dir)
    if info["disk"]["fstype"] in ("tmpfs", "ramfs"):
        log(f"WARNING: {bench_dir} is on {info['disk']['fstype']}: disk figures will be meaningless")
    R = args.repeats
    samples: dict[str, list[float]] = {}
    notes: list[str] = []
    if not info["ckptstore_native"]:
        notes.append("ckptstore._C is not installed: ckptstore ran its pure-torch fallback "
                     "(single-threaded ctypes.memmove for staging copies, torch-view shuffle).")

    cpu: dict[str, list[float]] = {}

    def add(key: str, value: float, cpu_s: float | None = None) -> None:
        samples.setdefault(key, []).append(value)
        if cpu_s is not None:
            cpu.setdefault(key, []).append(cpu_s)

    t_start = time.perf_counter()
    contention = Contention()
    try:
        # -- memory + first-save probes, each in a fresh process
        probes = {}
        for name in ("ckptstore-default", "ckptstore-prepared", "ckptstore-128MiB", "dcp.async_save",
                     "dcp.async_save-reused-stager",
                     "torch.save+fsync"):
            log(f"[probe] {name}")
            probes[name] = probe(name, args.size_gib, bench_dir)

        log("[state] building")
        state = build_state(size_bytes)
        nbytes = state_bytes(state)
        tensors = tensors_of(state)
        info["state"] = {"bytes": nbytes, "tensors": len(tensors),
                         "largest_tensor_bytes": max(t.numel() * t.element_size() for t in tensors)}

        # -- bare copy baseline (preallocated, pre-touched buffers)
        log("[bare copy]")
        dst = [torch.empty_like(t) for t in tensors]

        def bare_copy():
            for d, s in zip(dst, tensors):
                d.copy_(s)

        import ctypes

        def bare_memmove():
            for d, s in zip(dst, tensors):
                ctypes.memmove(d.data_ptr(), s.data_ptr(), s.numel() * s.element_size())

        bare_copy()  # touch the destination pages once; every timed copy is steady state
        bare_memmove()

        # -- saves
        ckptstore.configure()
        warm = os.path.join(bench_dir, "ckpt-warm")
        ckptstore.save(state, warm).result()  # warm-up: fills the staging pool
        rm(warm)
        stager = DefaultStager(StagingOptions(False, False, False, False))
        warm = os.path.join(bench_dir, "dcp-warm")
        dcp.async_save(state, storage_writer=FileSystemWriter(warm), async_stager=stager, no_dist=True).result()
        rm(warm)

        def save_run(key: str, path: str, start, is_async: bool) -> None:
            """Time one save; an async tool's ``start`` returns a future."""
            os.sync()
            w0, c0 = time.perf_counter(), time.process_time()
            fut = start(path)
            w1 = time.perf_counter()
            if is_async:
                fut.result()
                add(f"{key}/blocking", w1 - w0)
            add(f"{key}/commit", time.perf_counter() - w0, time.process_time() - c0)

        def torch_save_fsync(path):
            with open(path, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())

        tools = [
            ("ckptstore.save", lambda p: ckptstore.save(state, p), True),
            ("dcp.async_save", lambda p: dcp.async_save(state, storage_writer=FileSystemWriter(p), no_dist=True),
             True),
            ("dcp.async_save reused stager", lambda p: dcp.async_save(
                state, storage_writer=FileSystemWriter(p), async_stager=stager, no_dist=True), True),
            ("torch.save+fsync", torch_save_fsync, False),
            ("dcp.save", lambda p: dcp.save(state, checkpoint_id=p, no_dist=True), False),
        ]
        last: dict[str, str] = {}
        for r in range(R):
            log(f"[saves] repeat {r + 1}/{R}")
            # the bare copy baselines, measured just before the save they are compared with
            os.sync()
            for key, fn in (("bare copy_/blocking", bare_copy), ("bare memmove/blocking", bare_memmove)):
                w0, c0 = time.perf_counter(), time.process_time()
                fn()
                add(key, time.perf_counter() - w0, time.process_time() - c0)
            for key, start, is_async in tools:
                path = os.path.join(bench_dir, f"{key.replace(' ', '_')}-{r}")
                save_run(key, path, start, is_async)
                if key in last:
                    rm(last[key])
                last[key] = path
        stager.close()
        del dst
        gc.collect()

        # -- stored sizes
        def du(p):
            if os.path.isfile(p):
                return os.path.getsize(p)
            return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(p) for f in fs)

        info["stored_bytes"] = {k: du(v) for k, v in last.items()}
        for key in ("dcp.async_save", "dcp.async_save reused stager"):
            rm(last.pop(key))
        last = {"ckptstore": last["ckptstore.save"], "torch": last["torch.save+fsync"], "dcp": last["dcp.save"]}

        # -- loads, each checked once for bit-exactness (untimed)
        log("[loads] correctness")
        pre = empty_like_state(state)
        correct = {
            "ckptstore": same(state, ckptstore.load(last["ckptstore"])),
            "torch": same(state, torch.load(last["torch"], weights_only=True)),
        }
        dcp.load(pre, checkpoint_id=last["dcp"], no_dist=True)
        correct["dcp"] = same(state, pre)
        gc.collect()

        loaders = {
            "ckptstore.load": lambda: ckptstore.load(last["ckptstore"]),
            "torch.load": lambda: torch.load(last["torch"], weights_only=True),
            "dcp.load": lambda: dcp.load(pre, checkpoint_id=last["dcp"], no_dist=True),
        }
        cold = drop_caches()
        if not cold:
            notes.append("could not drop the page cache (no permission): all loads are warm-cache, for every tool alike")
        for r in range(R):
            log(f"[loads] repeat {r + 1}/{R}")
            for name, fn in loaders.items():
                for kind in ("cold", "warm") if cold else ("warm",):
                    if kind == "cold":
                        drop_caches()
                    w0, c0 = time.perf_counter(), time.process_time()
                    obj = fn()
                    add(f"{name}/load {kind}", time.perf_counter() - w0, time.process_time() - c0)
                    del obj
                    gc.collect()
    finally:
        shutil.rmtree(bench_dir, ignore_errors=True)

    others = contention.others_cores()
    if others is not None and others > 0.25:
        notes.append(f"other processes used {others:.2f} of {os.cpu_count()} cores on average during the run: "
                     "figures are noisy; compare ratios from one run, and rerun on a quiet machine")
    med = {k: statistics.median(v) for k, v in samples.items()}
    mins = {k: min(v) for k, v in samples.items()}
    for name, p in probes.items():
        med[f"{name}/first blocking"] = p["saves"][0]["blocking_s"]
        med[f"{name}/first commit"] = p["saves"][0]["commit_s"]

    return {
        "machine": info,
        "args": {"size_gib": args.size_gib, "repeats": R},
        "page_cache_dropped_for_cold_loads": bool(cold),
        "memory_method": probes["ckptstore-default"]["method"],
        "samples_s": samples,
        "median_s": med,
        "min_s": mins,
        "cpu_s": cpu,
        "median_cpu_s": {k: statistics.median(v) for k, v in cpu.items()},
        "other_processes_cores": others,
        "loadavg_end": open("/proc/loadavg").read().split()[:3],
        "probes": probes,
        "loads_bit_exact": correct,
        "notes": notes,
        "bench_wall_s": time.perf_counter() - t_start,
    }


# ---------------------------------------------------------------------------- targets, table

def evaluate(res: dict) -> list[dict]:
    """Rows of the report: (tool, metric, median, best, ratio vs peer, target, pass)."""
    m, mins = res["median_s"], res["min_s"]
    st = res["machine"]["state"]["bytes"]
    pr = res["probes"]
    rows = []

    def row(tool, metric, key=None, value=None, peer=None, peer_key=None, peer_value=None, target=None,
            limit=None, unit="s"):
        value = m[key] if value is None else value
        peer_value = m[peer_key] if peer_value is None and peer_key else peer_value
        ratio = (value / peer_value) if peer_value else None
        ok = None if limit is None else (ratio <= limit if target.startswith("<=") else ratio < limit)
        rows.append({"tool": tool, "metric": metric, "value": value, "min": mins.get(key) if key else None,
                     "cpu": res["median_cpu_s"].get(key) if key else None,
                     "unit": unit, "peer": peer, "ratio": ratio, "target": target, "pass": ok})

    bare = "bare copy_/blocking"
    blk = "ckptstore.save/blocking"
    row("bare copy_ (prealloc)", "blocking", bare)
    row("bare memmove (prealloc)", "blocking", "bare memmove/blocking", peer="bare copy_", peer_key=bare)
    row("ckptstore.save", "blocking (steady)", blk, peer="bare copy_", peer_key=bare, target="<= 1.2x", limit=1.2)
    row("ckptstore.save", "blocking (steady)", blk, peer="dcp.async_save", peer_key="dcp.async_save/blocking",
        target="< 1.0x", limit=1.0)
    row("ckptstore.save", "blocking (steady)", blk, peer="dcp.async_save reused stager",
        peer_key="dcp.async_save reused stager/blocking")
    row("ckptstore.save", "blocking (first save)", value=m["ckptstore-default/first blocking"],
        peer="bare copy_", peer_key=bare)
    row("ckptstore.save", "blocking (first, prepared)", value=m["ckptstore-prepared/first blocking"],
        peer="bare copy_", peer_key=bare, target="<= 1.5x", limit=1.5)
    row("dcp.async_save", "blocking", "dcp.async_save/blocking", peer="bare copy_", peer_key=bare)
    row("dcp.async_save reused stager", "blocking (steady)", "dcp.async_save reused stager/blocking",
        peer="bare copy_", peer_key=bare)
    row("dcp.async_save", "blocking (first save)", value=m["dcp.async_save/first blocking"],
        peer="bare copy_", peer_key=bare)
    tsave = "torch.save+fsync/commit"
    row("ckptstore.save+result", "commit (durable)", "ckptstore.save/commit", peer="torch.save+fsync",
        peer_key=tsave, target="<= 1.0x", limit=1.0)
    row("torch.save+fsync", "commit (durable)", tsave)
    row("dcp.save", "commit (durable)", "dcp.save/commit", peer="torch.save+fsync", peer_key=tsave)
    row("dcp.async_save+result", "commit (durable)", "dcp.async_save/commit", peer="torch.save+fsync",
        peer_key=tsave)
    for kind in ("cold", "warm"):
        tl = f"torch.load/load {kind}"
        if tl not in m:
            continue
        row("ckptstore.load", f"load {kind}", f"ckptstore.load/load {kind}", peer="torch.load", peer_key=tl,
            target="<= 1.2x", limit=1.2)
        row("torch.load", f"load {kind}", tl)
        row("dcp.load (prealloc)", f"load {kind}", f"dcp.load/load {kind}", peer="torch.load", peer_key=tl)
    d = pr["ckptstore-default"]
    row("ckptstore default pool", "peak extra mem (1st save)", value=d["saves"][0]["peak_extra_bytes"],
        peer="state", peer_value=st, target="<= 1.1x", limit=1.1, unit="B")
    row("ckptstore default pool", "peak extra mem (2 saves)", value=d["peak_extra_bytes"], peer="state",
        peer_value=st, target="<= 1.1x", limit=1.1, unit="B")
    row("ckptstore default pool", "RSS kept after saves", value=d["retained_after_bytes"], peer="state",
        peer_value=st, unit="B")
    s = pr["ckptstore-128MiB"]
    row("ckptstore 128 MiB pool", "peak extra mem (2 saves)", value=s["peak_extra_bytes"], peer="pool+64MiB",
        peer_value=SMALL_POOL + SMALL_POOL_SLACK, target="<= 1.0x", limit=1.0, unit="B")
    row("ckptstore 128 MiB pool", "blocking (first save)", value=s["saves"][0]["blocking_s"], peer="bare copy_",
        peer_key=bare)
    for name in ("dcp.async_save", "dcp.async_save-reused-stager", "torch.save+fsync"):
        row(name, "peak extra mem (2 saves)", value=pr[name]["peak_extra_bytes"], peer="state", peer_value=st,
            unit="B")
    return rows


def fmt_value(v: float | None, unit: str) -> str:
    if v is None:
        return ""
    return f"{v:7.3f} s" if unit == "s" else f"{v / MiB:6.0f} MiB"


def table(rows: list[dict]) -> str:
    lines = [f"{'tool':29s} {'metric':26s} {'median':>10s} {'best':>10s} {'CPU':>9s} {'ratio':>6s}  {'vs':29s} "
             f"{'target':8s} result", "-" * 142]
    for r in rows:
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] is not None else ""
        res = "" if r["pass"] is None else ("PASS" if r["pass"] else "MISS")
        lines.append(f"{r['tool']:29s} {r['metric']:26s} {fmt_value(r['value'], r['unit']):>10s} "
                     f"{fmt_value(r['min'], r['unit']):>10s} {fmt_value(r['cpu'], 's'):>9s} {ratio:>6s}  "
                     f"{r['peer'] or '':29s} "
                     f"{r['target'] or '':8s} {res}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gib", type=float, default=0.75, help="total fp32 state size (params + 2 Adam moments)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "core.json"))
    ap.add_argument("--dir", default=None, help="parent directory for the checkpoints (a disk, not tmpfs)")
    ap.add_argument("--probe", default=None, metavar="NAME",
                    help="only run one fresh-process probe (ckptstore-default, ckptstore-128MiB, dcp.async_save, "
                         "dcp.async_save-reused-stager, torch.save+fsync): two saves, first-save times and peak "
                         "extra memory as JSON on stdout; --dir is then used as is")
    args = ap.parse_args()

    if args.probe:
        print(json.dumps(run_probe(args.probe, int(args.size_gib * GiB), args.dir)))
        return

    res = run(args)
    rows = evaluate(res)
    res["rows"] = rows
    info = res["machine"]
    print(f"ckptstore {info['ckptstore']} (native extension: {'yes' if info['ckptstore_native'] else 'NO, fallback'}), "
          f"torch {info['torch']}, {info['cpu_model']}, {info['affinity_cores']} cores, "
          f"{info['ram_bytes'] / GiB:.0f} GiB RAM, {info['disk']['fstype']} on {info['disk']['device']}")
    print(f"state: {info['state']['bytes'] / GiB:.3f} GiB in {info['state']['tensors']} tensors; "
          f"median of {res['args']['repeats']}; loads cold = page cache dropped: {res['page_cache_dropped_for_cold_loads']}; "
          f"memory method: {res['memory_method']}; loads bit-exact: {res['loads_bit_exact']}")
    for n in res["notes"]:
        print("NOTE:", n)
    print("(median and best of the repeats; CPU = median process CPU seconds, all threads; ratio = median / "
          "median of the peer; first-save figures and memory come from one fresh subprocess per tool)")
    print(table(rows))
    print(f"bench wall time {res['bench_wall_s']:.0f} s")
    write_json(args.out, res, indent=1)


if __name__ == "__main__":
    main()
