#!/usr/bin/env python
"""Two-tier benchmark (issue 15): a save to a store with a local tier (node-local disk)
and a durable tier on S3 beside a save straight to S3 of the same state, and restores
from each tier.

Per repeat, interleaved (the order alternates), each a new step:

* direct: ``Store(s3).save(step, state)``: ``blocking`` (until save() returns) and
  ``committed`` (``result()``: uploaded, voted, committed on S3);
* tiered: ``Store(s3, local=DIR, durable_every=1).save(step, state)``: ``blocking``,
  ``committed`` (the local commit: restorable from here on) and ``durable`` (the
  promotion to S3 done, ``ckptstore.wait()``), from the same start;
* restore of the tiered step from the local tier (page-cached, as after a process
  restart on the same node) and from the durable tier (after node loss).

The S3 server is moto in its own process on 127.0.0.1 (bench_s3.py's). Usage::

    PYTHONPATH=. python bench/bench_tiers.py [--size-gib 0.25] [--repeats 3] [--out bench/results/tiers.json]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore", message=".*using the slower pure-Python/torch fallback.*")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import machine_info, same, write_json  # noqa: E402
from bench_s3 import _SERVER, build_state  # noqa: E402

GiB = 1 << 30


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=0.25)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compression", default="none", choices=["none", "auto", "zstd"])
    ap.add_argument("--dir", default=None, help="where the local tier goes (default: a temp dir)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "tiers.json"))
    args = ap.parse_args()
    server = subprocess.Popen([sys.executable, "-c", _SERVER, "ranged"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    endpoint = f"http://127.0.0.1:{int(server.stdout.readline())}"
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint,
                 "AWS_ENDPOINT_URL_S3": endpoint}.items():
        os.environ[k] = v
    workdir = tempfile.mkdtemp(prefix="bench-tiers-", dir=args.dir)
    try:
        return run(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        server.stdin.close()
        server.wait(timeout=60)


def run(args, workdir: str) -> int:
    import boto3

    import ckptstore

    bucket = f"ckptstore-tiers-{os.getpid()}"
    boto3.client("s3").create_bucket(Bucket=bucket)
    state = build_state(int(args.size_gib * GiB))
    nbytes = ckptstore.api.state_nbytes(state)
    direct = ckptstore.Store(f"s3://{bucket}/direct", compression=args.compression)
    tiered = ckptstore.Store(f"s3://{bucket}/tiered", local=os.path.join(workdir, "local"), durable_every=1,
                             compression=args.compression, local_keep=ckptstore.Retention(last=1))
    durable_only = ckptstore.Store(f"s3://{bucket}/tiered")  # what a job on another node sees
    print(f"state: {nbytes / GiB:.3f} GiB, compression {args.compression}, local tier in {workdir}", flush=True)
    samples: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        samples.setdefault(name, []).append(value)

    def save_direct(step: int) -> None:
        t0 = time.perf_counter()
        f = direct.save(step, state)
        add("direct.blocking", time.perf_counter() - t0)
        f.result()
        add("direct.committed", time.perf_counter() - t0)

    def save_tiered(step: int) -> None:
        t0 = time.perf_counter()
        f = tiered.save(step, state)
        add("tiered.blocking", time.perf_counter() - t0)
        f.result()
        add("tiered.committed", time.perf_counter() - t0)
        ckptstore.wait()
        add("tiered.durable", time.perf_counter() - t0)

    save_direct(0)  # warm-up: the staging pool, the S3 connections
    save_tiered(0)
    samples.clear()
    for rep in range(1, args.repeats + 1):
        for fn in ((save_direct, save_tiered) if rep % 2 else (save_tiered, save_direct)):
            fn(rep)
        t0 = time.perf_counter()
        got = tiered.local.load(rep)
        add("restore.local", time.perf_counter() - t0)
        assert same(got, state)
        del got
        t0 = time.perf_counter()
        got = durable_only.load(rep)
        add("restore.durable", time.perf_counter() - t0)
        assert same(got, state)
        del got
    med = {k: statistics.median(v) for k, v in samples.items()}
    rows = [
        ("blocking", med["tiered.blocking"], med["direct.blocking"]),
        ("committed (restorable)", med["tiered.committed"], med["direct.committed"]),
        ("durable on S3", med["tiered.durable"], med["direct.committed"]),
        ("restore", med["restore.local"], med["restore.durable"]),
    ]
    print(f"\n{'phase':<24}{'two tiers':>12}{'S3 only':>12}{'ratio':>8}   (median of {args.repeats}, seconds; "
          "restore: local tier vs durable tier)")
    for name, a, b in rows:
        print(f"{name:<24}{a:>12.3f}{b:>12.3f}{a / b:>8.2f}x")
    write_json(args.out, {"machine": machine_info(workdir), "size_bytes": nbytes, "compression": args.compression,
                          "repeats": args.repeats, "samples": samples, "median_s": med,
                          "ratios": {name: a / b for name, a, b in rows}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
