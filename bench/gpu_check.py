"""Device check of ckptstore's GPU path (issue 20), with real data, in one call that fits
well inside a 15-minute device lease (no network, no CPU suite).

    python bench/gpu_check.py [--out DIR] [--gib G] [--only a_default,f_roundtrip,...] [--dry-run]

Records the driver, torch's CUDA version and ``native.cuda_info()``, asserts that the
native CUDA path is on, then runs each check in its own subprocess (a CUDA error or a
hang in one cannot take the others down; each has a time limit):

  a  every tensor modified in place right after ``save()`` returns; the checkpoint holds
     the values from before: default stream (a_default), a non-default producer stream
     through ``save(..., stream=s)`` (a_stream), ``backend="torch"`` (a_torch, the
     extension off) and the gather kernel off (a_nogather)
  b  a source freed and its memory reused right after ``save()`` returns
  c  a forced CUDA error (device-side assert) fails the save with the CUDA error text,
     no hang, no staging buffer left in use
  d  five saves of one state make no new pinned slab after the first; first-save and
     steady blocking times
  e  a, b and d under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  f  bit-exact round trips: bf16, both fp8 types, bool, complex64, zero-size, offset and
     non-contiguous views
  g  a CPU-only save from a helper thread leaves no context on GPU 0
  h  save blocking time against a pinned device-to-host copy of the same bytes and
     against torch.distributed.checkpoint.async_save

Each check prints PASS/FAIL with its figures; the results go to ``DIR/gpu_check.json``
and a table to ``DIR/summary.txt``; the exit status is 1 if any check failed.
``--dry-run`` parses the arguments, records the environment and lists the checks
without running them (on a machine without a GPU it reports "no GPU" and exits 0; a
CPU test runs it so that this script cannot rot). ``--worker NAME`` is internal.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

CHECKS = ["a_default", "a_stream", "a_torch", "a_nogather", "b_reuse", "c_error", "d_steady",
          "e_expandable", "f_roundtrip", "g_cpu_thread", "h_blocking"]
# Environment of each check's process (on top of the caller's).
CHECK_ENV = {
    "a_torch": {"CKPTSTORE_DISABLE_NATIVE": "1"},
    "a_nogather": {"CKPTSTORE_CUDA_GATHER": "0"},
    "e_expandable": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
}
CHECK_TIMEOUT = {"h_blocking": 240, "e_expandable": 180, "d_steady": 150}  # seconds; others 90
MiB, GiB = 1 << 20, 1 << 30


class CheckFailed(AssertionError):
    pass


def need(cond: bool, what: str) -> None:
    if not cond:
        raise CheckFailed(what)


# ---------------------------------------------------------------- the environment


def environment() -> dict:
    import torch

    env = {"python": sys.version.split()[0], "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "gpu": torch.cuda.is_available(), "devices": torch.cuda.device_count()}
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
        env["nvidia_smi"] = r.stdout.strip() or r.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        env["nvidia_smi"] = f"unavailable: {exc}"
    try:
        import ckptstore
        from ckptstore import native

        env.update(ckptstore=ckptstore.__version__, ckptstore_file=ckptstore.__file__, native=native.NATIVE,
                   native_file=getattr(native._C, "__file__", None) if native.NATIVE else None,
                   cuda_info=native.cuda_info(), native_off=native.cuda_off_reason())
    except Exception as exc:  # recorded, and the native check fails on it
        env["ckptstore_error"] = f"{type(exc).__name__}: {exc}"
    if env["gpu"]:
        env["device_name"] = torch.cuda.get_device_name(0)
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    return env


def check_native() -> dict:
    """The native CUDA path is on and its kernel loads (run in the main process)."""
    import torch
    from ckptstore import native

    need(native.cuda_available(), f"native CUDA path off: {native.cuda_off_reason()}")
    torch.empty(1, device="cuda")
    got = native.cuda_prepare(0)
    need(got.get("gather") is True, f"gather kernel not loaded: {got}")
    return {"prepare": got, "driver_version": native.cuda_info()["driver_version"]}


# ---------------------------------------------------------------- helpers (workers)


def mixed_state(total: int, seed: int, small: int = 200):
    """A dict of CUDA tensors of about `total` bytes: `small` tensors under 64 KiB (the
    gather kernel's) of several dtypes, then large fp32/bf16 ones."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    state, acc = {}, 0
    for i in range(small):
        n = 1 + (i * 7919) % 8000
        dt = (torch.float32, torch.bfloat16, torch.int64, torch.uint8)[i % 4]
        state[f"small.{i}"] = torch.randint(0, 100, (n,), device="cuda", generator=g).to(dt)
        acc += state[f"small.{i}"].nbytes
    i = 0
    while acc < total:
        n = min(64 * MiB, total - acc) // 4 or 1
        dt = torch.float32 if i % 2 == 0 else torch.bfloat16
        t = torch.randn(n, device="cuda", generator=g).to(dt)
        state[f"large.{i}"] = t
        acc += t.nbytes
        i += 1
    return state


def to_cpu(state: dict) -> dict:
    return {k: v.detach().cpu().clone() for k, v in state.items()}


def same(loaded: dict, expected: dict) -> list[str]:
    """Keys whose bytes differ (compared as raw bytes: NaN-safe, fp8-safe)."""
    import torch

    bad = []
    for k, want in expected.items():
        got = loaded.get(k)
        if got is None or got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
            bad.append(k)
            continue
        g, w = got.detach().cpu().contiguous(), want.contiguous()
        if g.numel() and not torch.equal(g.view(torch.uint8) if g.dim() else g.reshape(1).view(torch.uint8),
                                         w.view(torch.uint8) if w.dim() else w.reshape(1).view(torch.uint8)):
            bad.append(k)
    return bad


def timed_save(obj, path, **kw) -> float:
    import torch
    import ckptstore

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    ckptstore.save(obj, path, **kw)
    return time.perf_counter() - t0


def pool_stats() -> dict:
    from ckptstore.runtime import runtime

    return runtime().pool.stats()


def load_cpu(path):
    import ckptstore

    return ckptstore.load(path, map_location="cpu")


# ---------------------------------------------------------------- the checks (workers)


def run_a(tmp: str, args) -> dict:
    """Modify every tensor in place right after save() returns (no sync in between)."""
    import torch
    import ckptstore
    from ckptstore import native

    from ckptstore.config import config

    variant = args.worker or "a_default"
    if variant == "a_torch":
        need(not native.NATIVE, "CKPTSTORE_DISABLE_NATIVE=1 did not turn the extension off")
    elif variant == "a_nogather":
        need(native.cuda_available() and not config().cuda_gather, "the gather kernel is not off")
    else:
        need(native.cuda_available(), f"native CUDA path off: {native.cuda_off_reason()}")
    state = mixed_state(args.gib_small, seed=1)
    expected = to_cpu(state)
    blocked = timed_save(state, os.path.join(tmp, "a"))
    for t in state.values():
        t.add_(1) if t.dtype != torch.uint8 else t.bitwise_not_()
    ckptstore.wait()
    bad = same(load_cpu(os.path.join(tmp, "a")), expected)
    need(not bad, f"{len(bad)} tensors hold values written after save() returned, e.g. {bad[:3]}")
    return {"tensors": len(state), "bytes": sum(t.nbytes for t in state.values()), "blocking_s": round(blocked, 4),
            "native_cuda": native.cuda_available(), "pool": pool_stats()["backend"]}


def run_a_stream(tmp: str, args) -> dict:
    """Tensors last written on a side stream; save(stream=s) must order after that work."""
    import torch
    import ckptstore

    state = mixed_state(args.gib_small, seed=2)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.cuda._sleep(200_000_000)  # ~0.1 s: the writes below land late
        for t in state.values():
            t.fill_(7)
    expected = {k: torch.full(v.shape, 7, dtype=v.dtype) for k, v in state.items()}
    try:
        ckptstore.save(state, os.path.join(tmp, "a_stream"), stream=s)
    except TypeError as exc:
        raise CheckFailed(f"save() refused stream=: TypeError: {exc}") from None
    with torch.cuda.stream(s):
        for t in state.values():
            t.fill_(9)
    ckptstore.wait()
    bad = same(load_cpu(os.path.join(tmp, "a_stream")), expected)
    need(not bad, f"{len(bad)} tensors are not the side stream's values at save(), e.g. {bad[:3]}")
    return {"tensors": len(state)}


def run_b(tmp: str, args) -> dict:
    """Free the sources right after save() returns and reuse their memory."""
    import torch
    import ckptstore

    state = mixed_state(args.gib_small, seed=3)
    expected = to_cpu(state)
    sizes = [t.nbytes for t in state.values()]
    ckptstore.save(state, os.path.join(tmp, "b"))
    del state
    junk = [torch.full((n,), 0xAB, dtype=torch.uint8, device="cuda") for n in sizes]  # reuses the blocks
    ckptstore.wait()
    bad = same(load_cpu(os.path.join(tmp, "b")), expected)
    need(not bad, f"{len(bad)} tensors changed when their memory was reused, e.g. {bad[:3]}")
    return {"tensors": len(sizes), "reused_bytes": sum(j.nbytes for j in junk)}


def run_c(tmp: str, args) -> dict:
    """A device-side assert on the producer stream fails the save with the CUDA error."""
    import torch
    import ckptstore

    state = mixed_state(64 * MiB, seed=4)
    torch.cuda.synchronize()
    idx = torch.tensor([1 << 20], device="cuda")
    torch.zeros(4, device="cuda")[idx]  # out of bounds: device-side assert, asynchronous
    t0 = time.perf_counter()
    err = None
    try:
        ckptstore.save(state, os.path.join(tmp, "c"))
        ckptstore.wait()
    except Exception as exc:  # what the caller sees
        err = f"{type(exc).__name__}: {exc}"
    took = time.perf_counter() - t0
    need(err is not None, "the save succeeded after a device-side assert")
    text = err.lower()
    need("assert" in text and ("cuda" in text), f"the error does not carry the CUDA error text: {err[:300]}")
    st = pool_stats()
    need(st["in_use"] == 0, f"{st['in_use']} bytes of staging memory still lent after the failure")
    return {"error": err[:300], "seconds": round(took, 3), "pool_in_use": st["in_use"]}


def run_d(tmp: str, args) -> dict:
    """Five saves of one state: no new pinned slab after the first."""
    import torch
    import ckptstore

    state = mixed_state(args.gib_bytes, seed=5)
    times, slabs = [], []
    for k in range(5):
        times.append(timed_save(state, os.path.join(tmp, f"d{k}")))
        ckptstore.wait()
        st = pool_stats()
        slabs.append(st.get("slab_allocs"))
        with torch.no_grad():
            next(iter(state.values())).add_(1)
    st = pool_stats()
    need(st.get("backend") == "native", f"the save path's pool is {st.get('backend')}, not native")
    need(st.get("pinned") is True and st.get("pinned_slabs", 0) > 0, f"slabs are not pinned: {st.get('pin_error')}")
    need(len(set(slabs)) == 1, f"new slabs after the first save: slab_allocs per save {slabs}")
    steady = sorted(times[1:])[len(times[1:]) // 2]
    return {"bytes": sum(t.nbytes for t in state.values()), "first_s": round(times[0], 4),
            "steady_s": round(steady, 4), "times_s": [round(t, 4) for t in times], "slab_allocs": slabs,
            "pinned_slabs": st.get("pinned_slabs")}


def run_e(tmp: str, args) -> dict:
    need(os.environ.get("PYTORCH_CUDA_ALLOC_CONF") == "expandable_segments:True", "allocator setting not applied")
    return {"a": run_a(tmp, args), "b": run_b(tmp, args), "d": run_d(tmp, args)}


def run_f(tmp: str, args) -> dict:
    import torch
    import ckptstore

    g = torch.Generator(device="cuda").manual_seed(6)
    base = torch.randn(1000, 37, device="cuda", generator=g)
    state = {
        "bf16": base.to(torch.bfloat16),
        "fp8_e4m3": base.to(torch.float8_e4m3fn),
        "fp8_e5m2": base.to(torch.float8_e5m2),
        "bool": base > 0,
        "complex64": torch.complex(base, -base),
        "zero": torch.empty(0, 5, device="cuda"),
        "offset": base.reshape(-1)[13:4013],
        "transposed": base.t(),
        "strided": base[::3, 1::2],
        "scalar": base[0, 0].clone(),
    }
    expected = to_cpu(state)
    ckptstore.save(state, os.path.join(tmp, "f"))
    ckptstore.wait()
    loaded = load_cpu(os.path.join(tmp, "f"))
    bad = same(loaded, expected)
    need(not bad, f"not bit-exact: {bad}")
    on_gpu = ckptstore.load(os.path.join(tmp, "f"))
    bad = same(on_gpu, expected)
    need(not bad and all(v.is_cuda for v in on_gpu.values()), f"not bit-exact / not on the GPU when loaded back: {bad}")
    return {"tensors": sorted(state)}


def run_g(tmp: str, args) -> dict:
    """CPU-only state saved from a helper thread: GPU 0's primary context stays inactive."""
    import ctypes

    import torch
    import ckptstore

    state = {"w": torch.randn(1 << 20), "b": torch.arange(1000)}
    errors = []

    def work():
        try:
            ckptstore.save(state, os.path.join(tmp, "g"))
            ckptstore.wait()
        except Exception as exc:
            errors.append(exc)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    need(not errors, f"the save failed: {errors[:1]}")
    cu = ctypes.CDLL("libcuda.so.1")
    need(cu.cuInit(0) == 0, "cuInit failed")
    dev = ctypes.c_int()
    need(cu.cuDeviceGet(ctypes.byref(dev), 0) == 0, "cuDeviceGet failed")
    flags, active = ctypes.c_uint(), ctypes.c_int()
    need(cu.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active)) == 0, "state query failed")
    need(active.value == 0, "a CPU-only save made GPU 0's primary context active (about 0.5 GiB of GPU memory)")
    return {"gpu0_context_active": bool(active.value), "torch_initialized": torch.cuda.is_initialized()}


def run_h(tmp: str, args) -> dict:
    """Blocking time of save vs a pinned D2H copy of the same bytes vs dcp.async_save."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import ckptstore

    state = mixed_state(args.gib_bytes, seed=8)
    nbytes = sum(t.nbytes for t in state.values())
    flat = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def pinned_copy():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        host.copy_(flat, non_blocking=True)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def median(xs):
        return sorted(xs)[len(xs) // 2]

    pinned = median([pinned_copy() for _ in range(3)])
    ours = []
    for k in range(4):  # the first one grows the pool: not counted
        ours.append(timed_save(state, os.path.join(tmp, f"h{k}")))
        ckptstore.wait()
    ours_s = median(ours[1:])
    dcp_s, dcp_err = None, None
    try:
        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
        times = []
        for k in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fut = dcp.async_save(state, checkpoint_id=os.path.join(tmp, f"dcp{k}"))
            times.append(time.perf_counter() - t0)
            fut.result()
        dcp_s = median(times[1:])
    except Exception as exc:
        dcp_err = f"{type(exc).__name__}: {exc}"[:300]
    out = {"bytes": nbytes, "tensors": len(state), "pinned_copy_s": round(pinned, 4),
           "pinned_gbps": round(nbytes / pinned / 1e9, 2), "save_blocking_s": round(ours_s, 4),
           "save_vs_pinned": round(ours_s / pinned, 2), "dcp_async_save_blocking_s": dcp_s and round(dcp_s, 4),
           "dcp_error": dcp_err}
    # The target: within --h-max-ratio (1.5) x the bare pinned copy, no slower than dcp.async_save.
    need(ours_s <= args.h_max_ratio * pinned,
         f"save blocks {ours_s / pinned:.2f}x the pinned copy (target <= {args.h_max_ratio}x)")
    need(dcp_s is None or ours_s <= dcp_s, f"save blocks longer than dcp.async_save ({ours_s:.3f} vs {dcp_s:.3f} s)")
    return out


WORKERS = {"a_default": run_a, "a_torch": run_a, "a_nogather": run_a, "a_stream": run_a_stream,
           "b_reuse": run_b, "c_error": run_c, "d_steady": run_d, "e_expandable": run_e,
           "f_roundtrip": run_f, "g_cpu_thread": run_g, "h_blocking": run_h}


def worker(name: str, args) -> int:
    with tempfile.TemporaryDirectory(prefix=f"gpu_check_{name}_") as tmp:
        try:
            result = {"status": "PASS", "figures": WORKERS[name](tmp, args)}
        except CheckFailed as exc:
            result = {"status": "FAIL", "reason": str(exc)}
        except Exception as exc:
            result = {"status": "FAIL", "reason": f"{type(exc).__name__}: {exc}"[:1000]}
    print("RESULT " + json.dumps(result, default=str), flush=True)
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown: a broken CUDA context (check c) must not hang the exit


# ---------------------------------------------------------------- the orchestration


def run_check(name: str, argv: list[str], left: float | None = None) -> dict:
    env = {**os.environ, **CHECK_ENV.get(name, {})}
    limit = CHECK_TIMEOUT.get(name, 90)
    if left is not None:
        if left < 20:
            return {"status": "FAIL", "reason": "not run: the time budget (--budget) is spent", "seconds": 0}
        limit = min(limit, left)
    t0 = time.perf_counter()
    try:
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", name, *argv],
                           capture_output=True, text=True, env=env, timeout=limit)
    except subprocess.TimeoutExpired as exc:
        def text(b):
            return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
        return {"status": "FAIL", "reason": f"no result within {limit:.0f} s (hang?)",
                "stdout": text(exc.stdout)[-800:], "stderr": text(exc.stderr)[-800:],
                "seconds": round(time.perf_counter() - t0, 1)}
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        res = {"status": "FAIL", "reason": f"the check's process died (rc={r.returncode})"}
    else:
        res = json.loads(lines[-1][len("RESULT "):])
    if res["status"] != "PASS":
        res["stderr"] = r.stderr[-1500:]
    res["seconds"] = round(time.perf_counter() - t0, 1)
    return res


def write_json(out: str, report: dict) -> None:
    with open(os.path.join(out, "gpu_check.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)


def table(results: dict) -> str:
    rows = [f"{'check':<14} {'result':<7} {'s':>6}  figures / reason"]
    for name, res in results.items():
        detail = res.get("reason") or json.dumps(res.get("figures", {}), default=str)
        rows.append(f"{name:<14} {res['status']:<7} {res.get('seconds', 0):>6}  {detail[:400]}")
    return "\n".join(rows)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or "bench/results/gpu", help="results folder")
    p.add_argument("--gib", type=float, default=1.0, help="state size of d, e and h (GiB)")
    p.add_argument("--small-mib", type=float, default=128, help="state size of a, b (MiB)")
    p.add_argument("--h-max-ratio", type=float, default=1.5,
                   help="check h passes when save blocks at most this many times the pinned copy")
    p.add_argument("--only", default="", help="comma-separated checks (default: all): " + ",".join(CHECKS))
    p.add_argument("--budget", type=float, default=0,
                   help="seconds for all checks (0: no limit); a check that would run past it is cut short")
    p.add_argument("--dry-run", action="store_true", help="record the environment, list the checks, run none")
    p.add_argument("--worker", default=None, choices=CHECKS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.gib <= 0 or args.small_mib <= 0:
        p.error("--gib and --small-mib must be positive")
    only = [c for c in args.only.split(",") if c]
    unknown = sorted(set(only) - set(CHECKS))
    if unknown:
        p.error(f"unknown checks {unknown}; known: {CHECKS}")
    args.checks = only or CHECKS
    args.gib_bytes = int(args.gib * GiB)
    args.gib_small = int(args.small_mib * MiB)
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.worker:
        return worker(args.worker, args)
    os.makedirs(args.out, exist_ok=True)
    env = environment()
    report = {"environment": env, "checks": args.checks, "results": {}}
    print(json.dumps(env, indent=1, default=str), flush=True)
    if args.dry_run or not env["gpu"]:
        # A dry run only lists; a real run without a GPU is a failed device check.
        report["status"] = ("dry run" if args.dry_run else "FAIL") + ("" if env["gpu"] else ": no GPU")
        text = f"gpu_check: {report['status']}; would run: native, {', '.join(args.checks)}"
    else:
        fwd = ["--gib", str(args.gib), "--small-mib", str(args.small_mib), "--h-max-ratio", str(args.h_max_ratio)]
        results = report["results"]
        t0 = time.perf_counter()
        try:
            results["native"] = {"status": "PASS", "figures": check_native()}
        except Exception as exc:
            results["native"] = {"status": "FAIL", "reason": f"{type(exc).__name__}: {exc}"}
        results["native"]["seconds"] = round(time.perf_counter() - t0, 1)
        print(f"native         {results['native']['status']}", flush=True)
        for name in args.checks:
            left = args.budget - (time.perf_counter() - t0) if args.budget else None
            res = results[name] = run_check(name, fwd, left)
            print(f"{name:<14} {res['status']:<5} {res.get('reason') or json.dumps(res.get('figures'))[:300]}",
                  flush=True)
            write_json(args.out, report)  # what ran so far survives a kill
        failed = [n for n, r in results.items() if r["status"] != "PASS"]
        report["status"] = "FAIL: " + ", ".join(failed) if failed else "PASS"
        text = table(results) + f"\n\ngpu_check: {report['status']}"
    write_json(args.out, report)
    with open(os.path.join(args.out, "summary.txt"), "a") as f:
        f.write(text + "\n")
    print(text)
    return 0 if report["status"] == "PASS" or report["status"].startswith("dry run") else 1


if __name__ == "__main__":
    sys.exit(main())
