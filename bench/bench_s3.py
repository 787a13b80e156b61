#!/usr/bin/env python
"""S3 benchmark: ckptstore.save / ckptstore.load to an S3 server beside boto3's own
``upload_file`` / ``download_fileobj`` / ``download_file`` of the same bytes, the
requests each makes and the CPU time each costs per GiB.

The server is moto in server mode (``moto.server.ThreadedMotoServer``) on 127.0.0.1, in
its own process so that it does not share the benchmark's GIL; ``--endpoint`` points at
any other S3 endpoint instead (MinIO, a real bucket with ``--bucket``). Both sides use
the same part size and concurrency. Requests are counted with botocore event hooks
(``before-send``: every HTTP attempt, retries included), so nothing sits in the data
path.

* save: ``ckptstore.save(state, "s3://bucket/key").result()`` (staged, encoded, hashed,
  streamed as a multipart upload, voted, committed) vs ``upload_file`` of a local file
  holding the state's tensor bytes (page-cached, written before the clock starts), and
  vs what a user without ckptstore runs: ``torch.save`` to a local file, then
  ``upload_file`` of it;
* load: ``ckptstore.load(url)`` (ranged GETs, small neighbouring blobs coalesced into
  one, every chunk's xxh3 checked, tensors rebuilt) vs ``download_fileobj`` into memory
  (the peer: a load ends in memory too) and ``download_file`` into a local file.

CPU per GiB is this process's user+system time (os.times) over the phase, divided by
the state's GiB; the server's CPU is reported apart (``server_busy_cores``).

Usage::

    PYTHONPATH=. python bench/bench_s3.py [--size-gib 0.75] [--repeats 3] [--compression none] \\
        [--out bench/results/s3.json] [--endpoint URL --bucket NAME]
"""

from __future__ import annotations

import argparse
import collections
import datetime as _dt
import io
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

warnings.filterwarnings("ignore", message=".*using the slower pure-Python/torch fallback.*")

import torch  # noqa: E402
from _common import cpu_model, same, tensors_of, write_json  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30

_SERVER = """
import logging, sys
logging.getLogger("werkzeug").setLevel(logging.ERROR)
from moto.server import ThreadedMotoServer
if sys.argv[1] == "ranged":
    # Stock moto answers a ranged GET by reading and copying the whole object, then
    # slicing (moto/s3/responses.py, _handle_range_header): O(object size) per request,
    # where S3 is O(range). That makes the number of GETs, not the bytes, the cost of a
    # load. This patch serves simple ranges by reading only the range.
    from moto.s3.responses import S3Response
    stock = S3Response.get_object
    def get_object(self):
        rng = self.headers.get("range") or ""
        first, _, last = rng[len("bytes="):].partition("-")
        if not rng.startswith("bytes=") or "," in rng or not first.isdigit() or self._get_int_param("partNumber"):
            return stock(self)
        key, not_modified = self._get_key()
        begin, size = int(first), key.size
        if not_modified or begin >= size:
            return stock(self)
        end = min(int(last), size - 1) if last else size - 1
        with key.lock:
            key._value_buffer.seek(begin)
            data = key._value_buffer.read(end - begin + 1)
        headers = self._get_cors_headers_other()
        headers.update(key.response_dict)
        headers.update(key.metadata)
        headers.update({"Accept-Ranges": "bytes", "content-range": f"bytes {begin}-{end}/{size}",
                        "content-length": str(len(data))})  # ranged GETs carry no checksum (as S3)
        return 206, headers, data
    S3Response.get_object = get_object
s = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
s.start()
print(s.get_host_and_port()[1], flush=True)
sys.stdin.read()
"""


# ---------------------------------------------------------------------------- the state
def build_state(size_bytes: int, seed: int = 0) -> dict:
    """A transformer-like fp32 training state: weights plus two Adam moments, ~size_bytes."""
    g = torch.Generator().manual_seed(seed)
    d, ff = 1024, 4096
    per_layer = 4 * d * d + 2 * d * ff + 9 * d + ff
    n_layers = max(1, size_bytes // (12 * per_layer))
    vocab = max(1, (size_bytes - 12 * n_layers * per_layer) // (12 * d))  # the embedding fills up the rest
    model, optim = {}, {}
    shapes = [("embed.weight", (vocab, d))]
    for i in range(n_layers):
        shapes += [(f"layers.{i}.attn.qkv.weight", (3 * d, d)), (f"layers.{i}.attn.proj.weight", (d, d)),
                   (f"layers.{i}.mlp.up.weight", (ff, d)), (f"layers.{i}.mlp.down.weight", (d, ff)),
                   (f"layers.{i}.mlp.up.bias", (ff,)), (f"layers.{i}.ln.weight", (9 * d,))]
    for name, shape in shapes:
        model[name] = torch.randn(shape, generator=g).mul_(0.02)
        optim[name] = {"exp_avg": torch.randn(shape, generator=g).mul_(1e-4),
                       "exp_avg_sq": torch.randn(shape, generator=g).square_().mul_(1e-8),
                       "step": torch.tensor(1000.0)}
    return {"model": model, "optim": {"state": optim, "param_groups": [{"lr": 3e-4, "params": list(model)}]}}


# ---------------------------------------------------------------------------- request counting
class Counter:
    """Counts HTTP attempts per S3 operation through botocore's ``before-send`` event."""

    def __init__(self):
        self.lock = threading.Lock()
        self.ops: collections.Counter = collections.Counter()

    def __call__(self, request, **kwargs):
        op = request.context.get("operation_name") if hasattr(request, "context") else None
        if not op:
            op = kwargs.get("event_name", "before-send.s3.unknown").rsplit(".", 1)[-1]
        with self.lock:
            self.ops[op] += 1

    def take(self) -> dict:
        with self.lock:
            out = dict(sorted(self.ops.items()))
            self.ops.clear()
        return out


# ---------------------------------------------------------------------------- machine
def machine_info() -> dict:
    import boto3
    import botocore
    import s3transfer

    import ckptstore
    from ckptstore import native

    info = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "cpu_model": cpu_model(),
        "logical_cores": os.cpu_count(),
        "affinity_cores": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ckptstore": ckptstore.__version__,
        "ckptstore_native": bool(native.NATIVE),
        "boto3": boto3.__version__,
        "botocore": botocore.__version__,
        "s3transfer": s3transfer.__version__,
        "kernel": platform.release(),
    }
    try:
        import moto

        info["moto"] = moto.__version__
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as f:
            info["ram_bytes"] = int(f.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return info


def _proc_cpu(pid: int | None) -> float:
    if pid is None:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def busy_cores(seconds_fn, server_pid: int | None = None) -> tuple[float, float]:
    """Run ``seconds_fn``; return (cores kept busy by other processes, by the S3 server)."""
    def total():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v) - v[3] - v[4]  # all but idle and iowait
    hz = os.sysconf("SC_CLK_TCK")
    t0, c0, s0, p0 = time.monotonic(), total(), os.times(), _proc_cpu(server_pid)
    seconds_fn()
    t1, c1, s1, p1 = time.monotonic(), total(), os.times(), _proc_cpu(server_pid)
    ours = (s1.user - s0.user) + (s1.system - s0.system)
    wall = max(t1 - t0, 1e-9)
    return max(0.0, ((c1 - c0) / hz - ours - (p1 - p0)) / wall), (p1 - p0) / wall


# ---------------------------------------------------------------------------- the bench
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=0.75)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compression", default="none", choices=["none", "auto", "zstd"])
    ap.add_argument("--stock-moto", action="store_true",
                    help="serve ranged GETs with stock moto (reads the whole object per GET) instead of the "
                         "range-reading patch")
    ap.add_argument("--endpoint", default=None, help="an S3 endpoint to use instead of a local moto server")
    ap.add_argument("--bucket", default=None, help="an existing bucket (default: a new one)")
    ap.add_argument("--dir", default=None, help="where the baseline's local files go (default: temp dir)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "s3.json"))
    ap.add_argument("--pin-server", action="store_true",
                    help="run the moto server on the last CPU and the clients on the others, as a real endpoint "
                         "runs on machines of its own (without it, each client's CPU is taken from the server)")
    args = ap.parse_args()

    server = None
    if args.endpoint is None:
        server = subprocess.Popen([sys.executable, "-c", _SERVER, "stock" if args.stock_moto else "ranged"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        endpoint = f"http://127.0.0.1:{int(server.stdout.readline())}"
        if args.pin_server:
            cpus = sorted(os.sched_getaffinity(0))
            if len(cpus) < 2:
                raise SystemExit("--pin-server needs at least two CPUs")
            os.sched_setaffinity(server.pid, {cpus[-1]})
            for tid in os.listdir("/proc/self/task"):  # every thread of this process, and those it starts later
                os.sched_setaffinity(int(tid), set(cpus[:-1]))
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    else:
        endpoint = args.endpoint
    os.environ["AWS_ENDPOINT_URL"] = endpoint  # ckptstore takes it from boto3's standard config
    os.environ["AWS_ENDPOINT_URL_S3"] = endpoint
    workdir = tempfile.mkdtemp(prefix="bench-s3-", dir=args.dir)
    try:
        return run(args, endpoint, workdir, server)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if server is not None:
            server.stdin.close()
            server.wait(timeout=60)


def run(args, endpoint: str, workdir: str, server) -> int:
    import boto3
    from boto3.s3.transfer import TransferConfig
    from botocore.config import Config

    import ckptstore
    from ckptstore.storage import open_storage
    from ckptstore.storage.s3 import (DEFAULT_CONCURRENCY, DEFAULT_MAX_ATTEMPTS, DEFAULT_PART_SIZE,
                                      DEFAULT_READ_PART_SIZE, boto3_session)
    from ckptstore.storage.s3 import DEFAULT_COALESCE_BLOB, DEFAULT_COALESCE_GAP

    # ckptstore.save / load on s3:// URLs use S3Storage's defaults; boto3 gets the same sizes:
    # upload parts of part_size, download ranges of read_part_size, same concurrency.
    part, read_part, concurrency = DEFAULT_PART_SIZE, DEFAULT_READ_PART_SIZE, DEFAULT_CONCURRENCY
    ours = Counter()
    boto3_session().events.register("before-send.s3", ours)  # every ckptstore client made from now on
    theirs = Counter()
    client = boto3.session.Session().client("s3", config=Config(  # not the shared session: own counter
        retries={"mode": "standard", "total_max_attempts": DEFAULT_MAX_ATTEMPTS},
        max_pool_connections=max(32, 3 * concurrency)))
    client.meta.events.register("before-send.s3", theirs)
    up_config = TransferConfig(multipart_threshold=part, multipart_chunksize=part, max_concurrency=concurrency)
    down_config = TransferConfig(multipart_threshold=read_part, multipart_chunksize=read_part,
                                 max_concurrency=concurrency)
    bucket = args.bucket or f"ckptstore-bench-{os.getpid()}"
    if args.bucket is None:
        client.create_bucket(Bucket=bucket)
    ours.take()
    theirs.take()

    state = build_state(int(args.size_gib * GiB))
    tensors = tensors_of(state)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    src = os.path.join(workdir, "state.bin")
    with open(src, "wb") as f:
        for t in tensors:
            f.write(memoryview(t.numpy()).cast("B"))
    dst = os.path.join(workdir, "download.bin")
    via = os.path.join(workdir, "state.pt")
    print(f"state: {len(tensors)} tensors, {nbytes / GiB:.3f} GiB; endpoint {endpoint}; part {part // MiB} MiB, "
          f"read ranges {read_part // MiB} MiB, concurrency {concurrency}, compression {args.compression}", flush=True)

    samples = collections.defaultdict(list)
    requests: dict[str, dict] = {}
    # Each tool writes a new key every repeat (no overwrite), removed after it was read back.

    def phase(name, fn):
        box = {}

        def timed():
            c0, t0 = os.times(), time.perf_counter()
            box["value"] = fn()
            box["dt"] = time.perf_counter() - t0
            c1 = os.times()
            box["cpu"] = (c1.user - c0.user) + (c1.system - c0.system)
        other, srv = busy_cores(timed, server.pid if server is not None else None)
        samples[name].append(box["dt"])
        samples[f"{name}.cpu_s_per_gib"].append(box["cpu"] / (nbytes / GiB))
        samples[f"{name}.other_busy_cores"].append(other)
        samples[f"{name}.server_busy_cores"].append(srv)
        return box["value"]

    for rep in range(args.repeats):
        key = f"baseline/rep{rep}.bin"
        url = f"s3://{bucket}/ckpt/rep{rep}"
        order = ["boto3", "ckptstore"] if rep % 2 == 0 else ["ckptstore", "boto3"]
        for who in order:
            if who == "boto3":
                phase("boto3.upload_file", lambda: client.upload_file(src, bucket, key, Config=up_config))
                requests["boto3.upload_file"] = theirs.take()
                # What a user without ckptstore runs: torch.save to a local file, then upload it.
                phase("torch.save+upload_file", lambda: (torch.save(state, via), client.upload_file(
                    via, bucket, key + ".pt", Config=up_config)))
                requests["torch.save+upload_file"] = theirs.take()
                client.delete_object(Bucket=bucket, Key=key + ".pt")
                os.unlink(via)
                theirs.take()
                phase("boto3.download_fileobj", lambda: client.download_fileobj(
                    bucket, key, io.BytesIO(), Config=down_config))
                requests["boto3.download_fileobj"] = theirs.take()
                phase("boto3.download_file", lambda: client.download_file(bucket, key, dst, Config=down_config))
                requests["boto3.download_file"] = theirs.take()
                client.delete_object(Bucket=bucket, Key=key)
                os.unlink(dst)
                theirs.take()
            else:
                phase("ckptstore.save", lambda: ckptstore.save(state, url, compression=args.compression).result())
                requests["ckptstore.save"] = ours.take()
                loaded = phase("ckptstore.load", lambda: ckptstore.load(url))
                requests["ckptstore.load"] = ours.take()
                if rep == 0 and not same(loaded, state):
                    print("ERROR: ckptstore.load did not return the saved state", file=sys.stderr)
                    return 1
                del loaded
                open_storage(url).delete_prefix("")
                ours.take()
        print(f"  repeat {rep + 1}/{args.repeats}: " + ", ".join(
            f"{k} {nbytes / MiB / samples[k][-1]:.0f} MiB/s" for k in
            ("boto3.upload_file", "ckptstore.save", "boto3.download_fileobj", "ckptstore.load")), flush=True)
    if args.bucket is None:
        client.delete_bucket(Bucket=bucket)

    med = {k: statistics.median(v) for k, v in samples.items() if not k.endswith(("_busy_cores", "_per_gib"))}
    cpu = {k[:-len(".cpu_s_per_gib")]: statistics.median(v) for k, v in samples.items() if k.endswith(".cpu_s_per_gib")}
    mibps = {k: nbytes / MiB / v for k, v in med.items()}
    ratio_save = mibps["ckptstore.save"] / mibps["boto3.upload_file"]
    ratio_load = mibps["ckptstore.load"] / mibps["boto3.download_fileobj"]
    busy = max(max(v) for k, v in samples.items() if k.endswith("other_busy_cores"))
    # The two tools of a repeat run back to back, so the neighbours' load hits both alike:
    # the median of the repeats' own ratios is steadier than the ratio of the medians.
    pair_ratio = statistics.median(b / a for a, b in zip(samples["ckptstore.save"], samples["boto3.upload_file"]))
    ratio_via = mibps["ckptstore.save"] / mibps["torch.save+upload_file"]

    def row(what, name, ratio=""):
        return (what, name, mibps[name], cpu[name], sum(requests[name].values()), ratio)

    rows = [
        row("save", "boto3.upload_file"),
        row("save", "torch.save+upload_file", f"{ratio_save / ratio_via:.2f}x"),
        row("save", "ckptstore.save", f"{ratio_save:.2f}x"),
        row("load", "boto3.download_fileobj"),
        row("load", "boto3.download_file"),
        row("load", "ckptstore.load", f"{ratio_load:.2f}x"),
    ]
    print()
    print(f"{'':5} {'tool':24} {'MiB/s (median)':>15} {'CPU s/GiB':>10} {'requests':>9} {'vs boto3':>9}")
    for r in rows:
        print(f"{r[0]:5} {r[1]:24} {r[2]:15.1f} {r[3]:10.2f} {r[4]:9d} {r[5]:>9}")
    print(f"\nckptstore.save: {ratio_via:.2f}x torch.save+upload_file; median of the repeats' own ratios to "
          f"upload_file {pair_ratio:.2f}x")
    print()
    for k in ("ckptstore.save", "ckptstore.load", "boto3.upload_file", "boto3.download_fileobj", "boto3.download_file"):
        print(f"requests per {k}: {requests[k]}")
    target = 1.0
    verdict = {"save": ratio_save >= target, "load": ratio_load >= target}
    print(f"\ntarget >= {target}x boto3: save {'PASS' if verdict['save'] else 'FAIL'} ({ratio_save:.2f}x), "
          f"load {'PASS' if verdict['load'] else 'FAIL'} ({ratio_load:.2f}x)")
    if busy > 0.25:
        print(f"warning: other processes kept {busy:.2f} cores busy during a phase; figures are noisy", file=sys.stderr)

    result = {
        "bench": "s3",
        "machine": machine_info(),
        "server": (f"moto {'stock' if args.stock_moto else 'with range-reading GET patch'} "
                   "(ThreadedMotoServer, own process, 127.0.0.1"
                   f"{', pinned to its own CPU' if args.pin_server else ''})") if server is not None else endpoint,
        "params": {"size_gib": args.size_gib, "state_bytes": nbytes, "tensors": len(tensors), "repeats": args.repeats,
                   "part_size": part, "read_part_size": read_part, "concurrency": concurrency, "compression": args.compression,
                   "chunk_bytes": 16 * MiB, "read_coalesce": {"blob": DEFAULT_COALESCE_BLOB, "gap": DEFAULT_COALESCE_GAP,
                                                               "limit": read_part}},
        "samples_s": dict(samples),
        "median_s": med,
        "mib_per_s": mibps,
        "cpu_s_per_gib": cpu,
        "ratio": {"save_vs_upload_file": ratio_save, "save_vs_upload_file_pairwise_median": pair_ratio,
                  "save_vs_torch_save_then_upload_file": ratio_via, "load_vs_download_fileobj": ratio_load},
        "target": target,
        "pass": verdict,
        "requests": requests,
        "max_other_busy_cores": busy,
    }
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
