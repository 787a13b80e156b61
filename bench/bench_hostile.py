#!/usr/bin/env python
"""Hostile and large manifests: what a 100,000-chunk manifest costs to read, load,
verify and plan gc over, and that a lying chunk costs no memory.

Every measurement runs in a **fresh subprocess** (``--child``), so its peak RSS holds
nothing an earlier phase left behind. Peak RSS is the child's ``VmHWM`` (Linux), not its
``ru_maxrss``, which Linux carries over from the parent through fork and exec (see
``_peak_mib``); the JSON records both. Every child imports the same modules (torch,
ckptstore, json, zstandard) before it starts the clock; the ``import only`` child
measures that floor.

1. **Large manifest.** A real checkpoint of 1,000 fp32 tensors of shape (100, 16) saved
   with ``ckptstore.save(state, path, compression="none", chunk_bytes=64)``: 100 row
   chunks per tensor, 100,000 chunk records (plus the skeleton blob) in one ~20 MB
   manifest. Timed, each in its own child: ``json.loads`` of the manifest bytes (read
   included: the floor for parsing), ``read_manifest`` (parse and validate: strict JSON,
   bounds, names, exact cover of every tensor), ``ckptstore.load``, ``ckptstore.verify``
   (full), ``gc.plan`` over the checkpoint directory; peers in the same run:
   ``torch.load(weights_only=True)`` of the same state saved with ``torch.save``, and
   ``ckptstore.load`` of the same state saved with the default ``chunk_bytes`` (1,000
   chunks), which isolates the per-chunk cost. Page cache warm (all files just written).
2. **Lying lengths.** (a) a small zstd checkpoint whose one chunk's stored bytes are
   replaced by a ~32 KiB zstd frame that decodes to 1 GiB of zeros (appended to the data
   file, the chunk's offset and length pointed at it, raw_length left honest);
   (b) an uncompressed checkpoint whose manifest claims a 1 TiB chunk (``length`` =
   ``raw_length`` = 2**40, shape and sizes to match) in a 4 KB file. ``ckptstore.load``
   and ``ckptstore.verify`` of each: the outcome (exception type, or verify's problem),
   wall time and peak RSS, which should stay at the import floor.
3. **Exact-cover check.** ``ckptstore.format.validate_coverage`` on a ``TensorEntry``
   built in memory: 8,000 and 100,000 column chunks ((4, n), chunks (4, 1): one split
   dimension) and a 250 x 400 grid of (1, 1) chunks (100,000 chunks, two split
   dimensions). Best and median of ``--cover-repeats`` calls in one child.

Stages 1 and 2 run ``--repeats`` times, interleaved; the table shows the median wall
time, the best, and the largest peak RSS of the repeats; ``+import`` is a child's peak
minus its own peak right after the imports (the largest of the repeats). Ratios are of
medians.
``--many-tensors`` adds a variant with 100,000 one-chunk tensors, where ``torch.load``
has as many tensors to unpickle as ckptstore has chunks (slow: ~25 s more fixtures and
~35 s per repeat on 2 cores).

Usage::

    python bench/bench_hostile.py [--repeats 3] [--cover-repeats 5] [--many-tensors]
                                  [--out bench/results/hostile-<timestamp>.json] [--dir DIR]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore", message=".*using the slower pure-Python/torch fallback.*")

import torch  # noqa: E402
import zstandard  # noqa: E402
from _common import Contention, machine_info, write_json  # noqa: E402

import ckptstore  # noqa: E402
from ckptstore import format as fmt  # noqa: E402
from ckptstore import names  # noqa: E402
from ckptstore.checkpoint import gc  # noqa: E402
from ckptstore.checkpoint.manifests import latest_manifest, read_manifest  # noqa: E402
from ckptstore.storage import LocalStorage  # noqa: E402

MiB, GiB, TiB = 1 << 20, 1 << 30, 1 << 40
HERE = os.path.dirname(os.path.abspath(__file__))


# ---------------------------------------------------------------------------- children
def _peak_mib() -> float:
    """This process's peak RSS in MiB: ``VmHWM`` of /proc/self/status, else ``ru_maxrss``.

    Not ``ru_maxrss`` first: at exec Linux folds the RSS of the memory map being replaced
    (the child's forked copy of the parent's, or with vfork the parent's own) into it,
    so a child's ``ru_maxrss`` is at least the parent's RSS at spawn time (~600 MiB
    here, after building the fixtures), whatever the child itself allocates. ``VmHWM``
    belongs to the memory map the exec created."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _outcome_of_problems(problems) -> str:
    if not problems:
        return "ok"
    return f"{len(problems)} problem(s): {problems[0].message}"


def _cover_entry(shape, chunk) -> fmt.TensorEntry:
    """A uint8 TensorEntry of ``shape`` tiled by boxes of size ``chunk``, built in memory
    (as tests/test_hostile_manifests.py's ``_entry``)."""
    import itertools

    file = names.data_file_name(names.new_attempt_id(), 0, 0)
    n = 1
    for s in chunk:
        n *= s
    blob = fmt.Blob(file, 0, n, n, (), "0" * 32)
    ranges = [range(0, d, c) for d, c in zip(shape, chunk)]
    return fmt.TensorEntry("uint8", tuple(shape),
                           tuple(fmt.Chunk(tuple(off), tuple(chunk), blob) for off in itertools.product(*ranges)))


def child(spec: dict) -> dict:
    """Run one measurement in this (fresh) process; the result as a dict."""
    kind, path = spec["kind"], spec.get("path")
    peak_import = _peak_mib()
    out: dict = {"kind": kind, "import_peak_mib": peak_import, "import_ru_maxrss_mib": _maxrss_mib()}
    if kind == "cover":
        entry = _cover_entry(spec["shape"], spec["chunk"])
        out["chunks"] = len(entry.chunks)
        times = []
        for _ in range(spec["repeats"]):
            t0 = time.perf_counter()
            fmt.validate_coverage(entry, "bench")
            times.append(time.perf_counter() - t0)
        out.update(samples_s=times, wall_s=min(times), median_s=statistics.median(times),
                   outcome="ok", peak_mib=_peak_mib(), ru_maxrss_mib=_maxrss_mib())
        return out
    c0, t0 = _cpu_s(), time.perf_counter()
    outcome = "ok"
    try:
        if kind == "import":
            pass
        elif kind == "json":
            with open(path, "rb") as f:
                d = json.loads(f.read())
            outcome = f"{len(d['ranks'][0]['tensors'])} tensors"
        elif kind == "parse":
            m = read_manifest(LocalStorage(path), spec["generation"])
            outcome = f"{sum(1 for _ in m.blobs())} blobs"
        elif kind == "load":
            obj = ckptstore.load(path)
            outcome = f"{len(obj)} keys"
        elif kind == "torch.load":
            obj = torch.load(path, weights_only=True)
            outcome = f"{len(obj)} keys"
        elif kind == "verify":
            outcome = _outcome_of_problems(ckptstore.verify(path))
        elif kind == "gc.plan":
            p = gc.plan(LocalStorage(path))
            outcome = f"{len(p.deletions)} deletions"
        else:
            raise SystemExit(f"unknown child kind {kind!r}")
    except Exception as e:  # the outcome is what the hostile rows report
        outcome = f"{type(e).__name__}: {str(e)}"
    out.update(wall_s=time.perf_counter() - t0, cpu_s=_cpu_s() - c0, peak_mib=_peak_mib(), ru_maxrss_mib=_maxrss_mib(),
               outcome=outcome.replace("\n", " ")[:400])
    return out


def run_child(spec: dict, timeout: float = 300) -> dict:
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)],
                          capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"child {spec} failed (rc {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1])


# ---------------------------------------------------------------------------- fixtures
def _manifest_file(loc: str) -> tuple[str, int]:
    (name,) = [n for n in os.listdir(loc) if names.parse_manifest_name(n)]
    return os.path.join(loc, name), names.parse_manifest_name(name)


def build_large(work: str, tensors: int, rows: int, cols: int, chunk_bytes: int) -> dict:
    """The large-manifest checkpoint, its default-chunk twin and its torch.save file."""
    g = torch.Generator().manual_seed(0)
    state = {f"layer{i:06d}.weight": torch.randn(rows, cols, generator=g) for i in range(tensors)}
    big, small, pt = (os.path.join(work, n) for n in ("many-chunks", "default-chunks", "state.pt"))
    t0 = time.perf_counter()
    ckptstore.save(state, big, compression="none", chunk_bytes=chunk_bytes).result()
    save_s = time.perf_counter() - t0
    ckptstore.save(state, small, compression="none").result()
    torch.save(state, pt)
    man_path, gen = _manifest_file(big)
    blobs = sum(1 for _ in latest_manifest(LocalStorage(big)).blobs())
    return {"dir": big, "default_dir": small, "pt": pt, "manifest": man_path, "generation": gen,
            "blobs": blobs, "chunks": blobs - 1, "tensors": tensors, "manifest_bytes": os.path.getsize(man_path),
            "default_blobs": sum(1 for _ in latest_manifest(LocalStorage(small)).blobs()),
            "pt_bytes": os.path.getsize(pt), "raw_bytes": tensors * rows * cols * 4, "save_s": save_s}


def _zero_frame(nbytes: int) -> bytes:
    """A zstd frame stating (and decoding to) ``nbytes`` zeros, compressed in 1 MiB steps."""
    cobj = zstandard.ZstdCompressor(level=3, write_content_size=True).compressobj(size=nbytes)
    zeros = bytes(MiB)
    parts = [cobj.compress(zeros) for _ in range(nbytes // MiB)]
    parts.append(cobj.flush())
    frame = b"".join(parts)
    assert zstandard.frame_content_size(frame) == nbytes
    return frame


def _edit_manifest(loc: str, change) -> None:
    path, _ = _manifest_file(loc)
    with open(path) as f:
        d = json.load(f)
    change(d)
    with open(path, "w") as f:
        json.dump(d, f)


def build_lying_frame(work: str) -> dict:
    loc = os.path.join(work, "lying-frame")
    ckptstore.save({"w": torch.zeros(4096)}, loc, compression="zstd").result()
    frame = _zero_frame(GiB)
    info = {}

    def change(d):
        chunk = d["ranks"][0]["tensors"]["w"]["chunks"][0]
        assert chunk["codec"] and chunk["codec"][-1]["id"] == "zstd", chunk["codec"]
        with open(os.path.join(loc, chunk["file"]), "r+b") as f:
            f.seek(0, 2)
            offset = f.tell()
            f.write(frame)
        chunk.update(offset=offset, length=len(frame))  # raw_length stays 16384: honest
        info.update(frame_bytes=len(frame), frame_states=GiB, raw_length=chunk["raw_length"])

    _edit_manifest(loc, change)
    return {"dir": loc, **info}


def build_tib_claim(work: str) -> dict:
    loc = os.path.join(work, "tib-claim")
    ckptstore.save({"w": torch.arange(1000.0)}, loc, compression="none").result()
    info = {}

    def change(d):
        e = d["ranks"][0]["tensors"]["w"]
        e["shape"] = [TiB // 4]
        e["chunks"][0].update(sizes=[TiB // 4], length=TiB, raw_length=TiB)
        info["file"] = e["chunks"][0]["file"]

    _edit_manifest(loc, change)
    return {"dir": loc, "claimed_bytes": TiB, "file_bytes": os.path.getsize(os.path.join(loc, info["file"]))}


# ---------------------------------------------------------------------------- main
def _short(outcome: str) -> str:
    """The outcome without the location and blob prefix of ckptstore's messages."""
    head, _, rest = outcome.partition(": ")
    if "): " in rest:
        rest = rest.rsplit("): ", 1)[1]
    return f"{head}: {rest}"[:80] if rest else head


def _summary(samples: list[dict]) -> dict:
    walls = [s["wall_s"] for s in samples]
    return {"median_s": statistics.median(walls), "best_s": min(walls),
            "median_cpu_s": statistics.median(s.get("cpu_s", s["wall_s"]) for s in samples),
            "peak_mib": max(s["peak_mib"] for s in samples), "outcome": samples[-1]["outcome"],
            "samples": samples}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cover-repeats", type=int, default=5)
    ap.add_argument("--tensors", type=int, default=1000, help="tensors in the large-manifest state")
    ap.add_argument("--chunks-per-tensor", type=int, default=100)
    ap.add_argument("--many-tensors", action="store_true", help="add 100,000 one-chunk tensors (slow)")
    ap.add_argument("--out", default=None, help="default bench/results/hostile-<UTC timestamp>.json")
    ap.add_argument("--dir", default=None, help="parent of the temporary directory the checkpoints go to")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(json.loads(args.child))))
        return 0

    started = time.perf_counter()
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out_path = args.out or os.path.join(HERE, "results", f"hostile-{stamp}.json")
    work = tempfile.mkdtemp(prefix="ckptstore-bench-hostile-", dir=args.dir)
    info = machine_info(work, zstandard=zstandard.__version__)
    contention = Contention()
    results: dict = {"machine": info, "repeats": args.repeats, "cover_repeats": args.cover_repeats}
    rows: list[dict] = []
    try:
        cols = 16
        large = build_large(work, args.tensors, args.chunks_per_tensor, cols, chunk_bytes=cols * 4)
        lying = build_lying_frame(work)
        tib = build_tib_claim(work)
        results["fixtures"] = {"large": {k: v for k, v in large.items() if not k.endswith("dir")},
                               "lying_frame": lying, "tib_claim": tib}
        many = None
        if args.many_tensors:
            g = torch.Generator().manual_seed(1)
            state = {f"t{i:06d}": torch.randn(cols, generator=g) for i in range(100_000)}
            many = {"dir": os.path.join(work, "many-tensors"), "pt": os.path.join(work, "many-tensors.pt")}
            ckptstore.save(state, many["dir"], compression="none").result()
            torch.save(state, many["pt"])
            many["manifest"], many["generation"] = _manifest_file(many["dir"])
            del state
            results["fixtures"]["many_tensors"] = {"tensors": 100_000,
                                                   "manifest_bytes": os.path.getsize(many["manifest"])}

        results["fixtures_s"] = time.perf_counter() - started
        n = f"{large['chunks']:,}"
        specs = [  # (section, row label, child spec)
            ("baseline", "import only (torch, ckptstore)", {"kind": "import"}),
            ("large", f"json.loads, {n}-chunk manifest", {"kind": "json", "path": large["manifest"]}),
            ("large", "read_manifest (parse+validate)", {"kind": "parse", "path": large["dir"],
                                                         "generation": large["generation"]}),
            ("large", f"ckptstore.load, {n} chunks", {"kind": "load", "path": large["dir"]}),
            ("large", f"ckptstore.load, {large['default_blobs'] - 1:,} chunks", {"kind": "load",
                                                                                  "path": large["default_dir"]}),
            ("large", "torch.load, same state", {"kind": "torch.load", "path": large["pt"]}),
            ("large", f"ckptstore.verify, {n} chunks", {"kind": "verify", "path": large["dir"]}),
            ("large", f"gc.plan, {n} chunks", {"kind": "gc.plan", "path": large["dir"]}),
            ("lying", "load, 32 KiB frame -> 1 GiB", {"kind": "load", "path": lying["dir"]}),
            ("lying", "verify, 32 KiB frame -> 1 GiB", {"kind": "verify", "path": lying["dir"]}),
            ("lying", "load, 1 TiB claimed, 4 KB file", {"kind": "load", "path": tib["dir"]}),
            ("lying", "verify, 1 TiB claimed, 4 KB file", {"kind": "verify", "path": tib["dir"]}),
        ]
        if many:
            specs += [
                ("many", "json.loads, 100,000-tensor manifest", {"kind": "json", "path": many["manifest"]}),
                ("many", "read_manifest, 100,000 tensors", {"kind": "parse", "path": many["dir"],
                                                            "generation": many["generation"]}),
                ("many", "ckptstore.load, 100,000 tensors", {"kind": "load", "path": many["dir"]}),
                ("many", "torch.load, 100,000 tensors", {"kind": "torch.load", "path": many["pt"]}),
            ]
        samples: list[list[dict]] = [[] for _ in specs]
        for r in range(args.repeats):
            for i, (_, label, spec) in enumerate(specs):
                samples[i].append(run_child(spec))
                print(f"  round {r + 1}/{args.repeats}: {label}: {samples[i][-1]['wall_s']:.3f} s", flush=True)
        for (section, label, spec), s in zip(specs, samples):
            rows.append({"section": section, "row": label, "kind": spec["kind"], **_summary(s)})

        for label, shape, chunk in (("validate_coverage, 8,000 columns", (4, 8000), (4, 1)),
                                    ("validate_coverage, 100,000 columns", (4, 100_000), (4, 1)),
                                    ("validate_coverage, 250x400 grid", (250, 400), (1, 1))):
            s = run_child({"kind": "cover", "shape": shape, "chunk": chunk, "repeats": args.cover_repeats})
            rows.append({"section": "cover", "row": label, "kind": "cover", "median_s": s["median_s"],
                         "best_s": s["wall_s"], "peak_mib": s["peak_mib"],
                         "outcome": f"ok, {s['chunks']:,} chunks", "samples": [s]})
    finally:
        shutil.rmtree(work, ignore_errors=True)

    by = {r["row"]: r for r in rows}
    floor = by["import only (torch, ckptstore)"]["peak_mib"]
    for r in rows:  # growth over the same child's peak after its imports, the largest of the repeats
        r["over_import_mib"] = max(s["peak_mib"] - s["import_peak_mib"] for s in r["samples"])

    def ratio(row: str, vs: str) -> None:
        if row in by and vs in by:
            by[row]["ratio"] = by[row]["median_s"] / by[vs]["median_s"]
            by[row]["vs"] = vs

    big_load = f"ckptstore.load, {large['chunks']:,} chunks"
    small_load = f"ckptstore.load, {large['default_blobs'] - 1:,} chunks"
    ratio("read_manifest (parse+validate)", f"json.loads, {large['chunks']:,}-chunk manifest")
    ratio(big_load, "torch.load, same state")
    ratio(small_load, "torch.load, same state")
    ratio(f"ckptstore.verify, {large['chunks']:,} chunks", "read_manifest (parse+validate)")
    ratio(f"gc.plan, {large['chunks']:,} chunks", "read_manifest (parse+validate)")
    ratio("read_manifest, 100,000 tensors", "json.loads, 100,000-tensor manifest")
    ratio("ckptstore.load, 100,000 tensors", "torch.load, 100,000 tensors")
    extra_chunks = large["chunks"] - (large["default_blobs"] - 1)
    per_chunk = (by[big_load]["median_s"] - by[small_load]["median_s"]) / extra_chunks
    others = contention.others_cores()
    results.update(rows=rows, import_floor_mib=floor, load_s_per_extra_chunk=per_chunk,
                   other_processes_cores=others, bench_wall_s=time.perf_counter() - started)

    print(f"\nhostile and large manifests: {large['chunks']:,} chunks in {large['tensors']:,} tensors "
          f"({large['manifest_bytes'] / MiB:.1f} MiB manifest); lying frame {lying['frame_bytes']:,} B -> 1 GiB; "
          f"median of {args.repeats} fresh children, page cache warm")
    print(f"{info['cpu_model']}, {info['affinity_cores']} cores, python {info['python']}, torch {info['torch']}, "
          f"ckptstore {info['ckptstore']} native={info['ckptstore_native']}, {info['disk']['fstype']}")
    head = f"{'row':<38}{'median s':>10}{'best s':>9}{'peak MiB':>9}{'+import':>8}{'ratio':>8}  {'vs':<36}outcome"
    print(head)
    print("-" * len(head))
    for r in rows:
        ratio_s = f"{r['ratio']:.2f}x" if "ratio" in r else ""
        print(f"{r['row']:<38}{r['median_s']:>10.4f}{r['best_s']:>9.4f}{r['peak_mib']:>9.0f}"
              f"{r['over_import_mib']:>8.0f}{ratio_s:>8}  {r.get('vs', ''):<36}{_short(r['outcome'])}")
    print(f"ckptstore.load: {per_chunk * 1e6:.1f} us per extra chunk (many-chunks minus default-chunks, same bytes)")
    if others is not None and others > 0.25:
        print(f"warning: other processes used {others:.2f} cores on average during the run; figures are noisy")
    print(f"runtime {results['bench_wall_s']:.0f} s (fixtures {results['fixtures_s']:.0f} s)")
    write_json(out_path, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
