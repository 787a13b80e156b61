#!/usr/bin/env python
"""Thousands of ranks, by simulation (issue 18): what the commit, a rank's load, verify,
``ls`` and gc cost as the number of ranks N grows, with today's format (one manifest
holding every chunk record, written by rank 0 after it reads every vote).

Each simulated rank is metadata only: its own data file (zeros, as a sparse file) and
its vote, naming ``--chunks`` tiny tensors of 64 bytes each (the case that stresses
metadata: many chunks, few bytes). The votes are written as real ranks write them;
then rank 0's real ``commit`` runs (timed from the last vote: list, read and validate
the votes, check every file, write the manifest), and the other figures are taken on
the committed store (``ls``, gc's plan, and what ``ckptstore status`` reads of the
store: its newest checkpoint). Where one manifest would not fit this machine (``--max-records``),
the figures are extrapolated linearly from the largest measured N and marked so.

Usage::

    PYTHONPATH=. python bench/bench_scale.py [--ranks 16 256 1024 10000] [--chunks 1000]
        [--s3-ranks 16 256] [--out bench/results/scale.json]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import machine_info, write_json  # noqa: E402

CHUNK = 64  # bytes per simulated chunk


def simulate(storage, ranks: int, chunks: int) -> dict:
    """Write ``ranks`` ranks' data files and votes into ``storage``, commit, and measure."""
    from ckptstore import format as fmt
    from ckptstore import names
    from ckptstore.checkpoint.catalog import scan_store
    from ckptstore.checkpoint.commit import commit, read_manifest, write_vote
    from ckptstore.checkpoint.gc import plan
    from ckptstore.checkpoint.retention import Retention
    from ckptstore.checkpoint.verify import verify_manifest
    from ckptstore.hashing import digest
    from ckptstore.supervisor.status import newest_checkpoint

    location = storage.child(names.step_dir_name(1))
    attempt = names.new_attempt_id()
    zero_hash = digest(bytes(CHUNK))

    def vote(rank: int) -> fmt.Vote:
        file = names.data_file_name(attempt, rank, 0)
        tensors = {f"t{j}": fmt.TensorEntry("float32", (CHUNK // 4,), (
            fmt.Chunk((0,), (CHUNK // 4,), fmt.Blob(file, j * CHUNK, CHUNK, CHUNK, (), zero_hash)),))
            for j in range(chunks)}
        skeleton = fmt.Blob(file, chunks * CHUNK, CHUNK, CHUNK, (), zero_hash)
        return fmt.Vote(attempt, 1, ranks, rank, ok=True, state=fmt.RankState(rank, skeleton, tensors))

    t0 = time.perf_counter()
    for rank in range(ranks):
        writer = location.open_append(names.data_file_name(attempt, rank, 0))
        writer.append(bytes((chunks + 1) * CHUNK))
        writer.close()
        if rank:
            write_vote(location, vote(rank))
    ranks_s = time.perf_counter() - t0
    own = vote(0)
    t0 = time.perf_counter()
    manifest = commit(location, own, ranks, fmt.utc_now(), {}, timeout=600)
    commit_s = time.perf_counter() - t0
    manifest_bytes = location.stat(names.manifest_name(manifest.generation)).size
    vote_bytes = len(own.to_bytes())
    t0 = time.perf_counter()
    read_manifest(location, manifest.generation)  # what every loading rank does first
    load_meta_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    problems = verify_manifest(location, manifest)
    verify_s = time.perf_counter() - t0
    assert problems == [], problems[:3]
    t0 = time.perf_counter()
    scan_store(storage)  # what ls (and status) read
    ls_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    plan(storage, Retention(last=1))
    gc_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    newest_checkpoint(storage)  # what ckptstore status reads of the store (its journal aside)
    status_s = time.perf_counter() - t0
    return {"ranks": ranks, "chunks_per_rank": chunks, "records": ranks * (chunks + 1), "measured": True,
            "simulate_ranks_s": round(ranks_s, 3), "commit_after_last_vote_s": round(commit_s, 3),
            "manifest_bytes": manifest_bytes, "vote_bytes": vote_bytes,
            "one_rank_load_metadata_bytes": manifest_bytes, "one_rank_load_metadata_s": round(load_meta_s, 3),
            "verify_s": round(verify_s, 3), "ls_s": round(ls_s, 3), "gc_plan_s": round(gc_s, 3),
            "status_s": round(status_s, 3)}


def extrapolate(row: dict, ranks: int) -> dict:
    """``row`` scaled linearly to ``ranks`` (every figure here grows with the records)."""
    k = ranks / row["ranks"]
    out = {"ranks": ranks, "chunks_per_rank": row["chunks_per_rank"], "records": ranks * (row["chunks_per_rank"] + 1),
           "measured": False, "vote_bytes": row["vote_bytes"]}
    for key in ("simulate_ranks_s", "commit_after_last_vote_s", "manifest_bytes", "one_rank_load_metadata_bytes",
                "one_rank_load_metadata_s", "verify_s", "ls_s", "gc_plan_s", "status_s"):
        out[key] = round(row[key] * k, 3) if isinstance(row[key], float) else int(row[key] * k)
    return out


def run(backend: str, ranks_list: list[int], chunks: int, max_records: int, work: Path) -> list[dict]:
    from ckptstore.storage import LocalStorage

    rows: list[dict] = []
    for ranks in ranks_list:
        if ranks * (chunks + 1) > max_records and rows:
            rows.append({**extrapolate(rows[-1] if rows[-1]["measured"] else
                                       next(r for r in reversed(rows) if r["measured"]), ranks), "backend": backend})
            continue
        if backend == "local":
            root = work / f"local-{ranks}"
            storage = LocalStorage(str(root))
        else:
            import s3util

            bucket = s3util.new_bucket(s3util.moto_endpoint())
            storage = s3util.s3_storage(bucket, f"scale-{ranks}")
        row = {**simulate(storage, ranks, chunks), "backend": backend}
        rows.append(row)
        print(f"{backend:>5} N={ranks:>6}: commit {row['commit_after_last_vote_s']:.2f} s, manifest "
              f"{row['manifest_bytes'] / 1e6:.1f} MB, load metadata {row['one_rank_load_metadata_s']:.2f} s, "
              f"verify {row['verify_s']:.2f} s, ls {row['ls_s']:.2f} s, gc plan {row['gc_plan_s']:.2f} s, "
              f"status {row['status_s']:.2f} s", flush=True)
        if backend == "local":
            shutil.rmtree(work / f"local-{ranks}", ignore_errors=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[16, 256, 1024, 10000])
    ap.add_argument("--s3-ranks", type=int, nargs="*", default=[16, 256])
    ap.add_argument("--chunks", type=int, default=1000, help="chunk records per rank")
    ap.add_argument("--max-records", type=int, default=1_100_000,
                    help="above this many records one manifest is extrapolated, not written")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "scale.json"))
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-scale-", dir=args.dir))
    machine = machine_info(str(work))
    try:
        rows = run("local", args.ranks, args.chunks, args.max_records, work)
        if args.s3_ranks:  # the moto server of the tests (tests/s3util.py), over real HTTP
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
            rows += run("s3", args.s3_ranks, args.chunks, args.max_records, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print()
    print(f"{'backend':>7} {'N':>6} {'records':>10} {'manifest MB':>11} {'commit s':>9} {'load meta s':>11} "
          f"{'verify s':>9} {'ls s':>7} {'gc s':>7} {'status s':>8}")
    for r in rows:
        mark = "" if r["measured"] else "  (extrapolated)"
        print(f"{r['backend']:>7} {r['ranks']:>6} {r['records']:>10} {r['manifest_bytes'] / 1e6:>11.1f} "
              f"{r['commit_after_last_vote_s']:>9.2f} {r['one_rank_load_metadata_s']:>11.2f} {r['verify_s']:>9.2f} "
              f"{r['ls_s']:>7.2f} {r['gc_plan_s']:>7.2f} {r['status_s']:>8.2f}{mark}")
    write_json(args.out, {"machine": machine, "format": "single manifest (format version 3)",
                          "chunk_bytes": CHUNK, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
