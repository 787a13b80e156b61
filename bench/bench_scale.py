#!/usr/bin/env python
"""Thousands of ranks, by simulation (issue 18): what the commit, a rank's load, verify,
``ls`` and gc cost as the number of ranks N grows, in format version 3 (one manifest
holding every chunk record) and version 4 (a root naming one index per rank).

Each simulated rank is metadata mostly: its own data file, naming ``--chunks`` tiny
tensors of 64 bytes each (the case that stresses metadata: many chunks, few bytes;
each chunk's bytes differ, so its hash does, as in a real checkpoint), and its vote
(version 3: every record; version 4: its index, appended to its data file as a real
rank appends it, named by the vote). Then rank 0's real ``commit`` runs (timed from the
last vote: list, read and validate the votes, check every file, write the manifest or
root), and the other figures are taken on the committed store: one rank's load
metadata (version 3: the manifest; version 4: the root and its own index), verify,
``ls``, gc's plan, and what ``ckptstore status`` reads of the store (its newest
checkpoint). Where a figure would not fit this machine's time (``--max-records`` for
one manifest, ``--max-verify-records`` for verify, which reads every chunk), it is
extrapolated linearly from the largest measured N and marked so.

Usage::

    PYTHONPATH=. python bench/bench_scale.py [--ranks 16 256 1024 10000] [--chunks 1000]
        [--formats 3 4] [--s3-ranks 16 256] [--out bench/results/scale.json]
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


def simulate(storage, ranks: int, chunks: int, version: int, verify: bool) -> dict:
    """Write ``ranks`` ranks' data files and votes into ``storage``, commit, and measure."""
    import numpy as np

    from ckptstore import format as fmt
    from ckptstore import names
    from ckptstore.checkpoint.catalog import scan_store
    from ckptstore.checkpoint.commit import commit
    from ckptstore.checkpoint.manifests import read_manifest
    from ckptstore.checkpoint.votes import write_vote
    from ckptstore.checkpoint.gc import plan
    from ckptstore.checkpoint.indexes import read_indexes
    from ckptstore.checkpoint.retention import Retention
    from ckptstore.checkpoint.verify import verify_manifest
    from ckptstore.format_index import Index, Reads, Summary
    from ckptstore.hashing import digest
    from ckptstore.codecs import zstd_frame
    from ckptstore.pipeline import METADATA_ZSTD_LEVEL
    from ckptstore.supervisor.status import newest_checkpoint

    location = storage.child(names.step_dir_name(1))
    attempt = names.new_attempt_id()

    def rank_data(rank: int) -> bytes:
        """Each 64-byte chunk names its rank and number: every chunk's hash differs."""
        rows = np.zeros((chunks + 1, CHUNK // 8), dtype=np.int64)
        rows[:, 0] = rank
        rows[:, 1] = np.arange(chunks + 1)
        return rows.tobytes()

    def vote(rank: int) -> fmt.Vote:
        file = names.data_file_name(attempt, rank, 0)
        data = rank_data(rank)
        blobs = [fmt.Blob(file, j * CHUNK, CHUNK, CHUNK, (), digest(data[j * CHUNK:(j + 1) * CHUNK]))
                 for j in range(chunks + 1)]
        tensors = {f"t{j}": fmt.TensorEntry("float32", (CHUNK // 4,), (fmt.Chunk((0,), (CHUNK // 4,), blobs[j]),))
                   for j in range(chunks)}
        state = fmt.RankState(rank, blobs[chunks], tensors)
        writer = location.open_append(file)
        writer.append(data)
        if version == 3:
            writer.close()
            return fmt.Vote(attempt, 1, ranks, rank, ok=True, state=state)
        summary = Summary(None, 0, 0, Reads.of_blobs(blobs))  # (no global tensors: fingerprints 0)
        raw = Index(attempt, rank, state, {}, (), summary).to_bytes()
        chain, stored = zstd_frame(raw, METADATA_ZSTD_LEVEL)
        writer.append(stored)
        writer.close()
        index = fmt.Blob(file, len(data), len(stored), len(raw), tuple(chain), digest(raw))
        return fmt.Vote(attempt, 1, ranks, rank, ok=True, index=index, summary=summary)

    t0 = time.perf_counter()
    for rank in range(1, ranks):
        write_vote(location, vote(rank))
    own = vote(0)
    ranks_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    manifest = commit(location, own, ranks, fmt.utc_now(), {}, timeout=600)
    commit_s = time.perf_counter() - t0
    manifest_bytes = location.stat(names.manifest_name(manifest.generation)).size
    vote_bytes = len(own.to_bytes())
    t0 = time.perf_counter()
    root = read_manifest(location, manifest.generation)  # what every loading rank does first
    load_bytes = manifest_bytes
    index_bytes = 0
    if version == 4:  # and then its own index (a rank in the middle of the job)
        rank = ranks // 2
        read_indexes(location, root, [rank], None)
        load_bytes += root.indexes[rank].length
        index_bytes = sum(b.length for b in root.indexes)
    load_meta_s = time.perf_counter() - t0
    verify_s = None
    if verify:
        t0 = time.perf_counter()
        problems = verify_manifest(location, root)
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
    return {"format_version": version, "ranks": ranks, "chunks_per_rank": chunks, "records": ranks * (chunks + 1),
            "measured": True, "simulate_ranks_s": round(ranks_s, 3), "commit_after_last_vote_s": round(commit_s, 3),
            "manifest_bytes": manifest_bytes, "index_bytes": index_bytes, "vote_bytes": vote_bytes,
            "one_rank_load_metadata_bytes": load_bytes, "one_rank_load_metadata_s": round(load_meta_s, 3),
            "verify_s": None if verify_s is None else round(verify_s, 3), "verify_measured": verify_s is not None,
            "ls_s": round(ls_s, 3), "gc_plan_s": round(gc_s, 3), "status_s": round(status_s, 3)}


SCALED = ("simulate_ranks_s", "commit_after_last_vote_s", "manifest_bytes", "index_bytes",
          "one_rank_load_metadata_bytes", "one_rank_load_metadata_s", "verify_s", "ls_s", "gc_plan_s", "status_s")


def extrapolate(row: dict, ranks: int, keys=SCALED) -> dict:
    """``row``'s figures ``keys`` scaled linearly to ``ranks`` (each grows at most
    linearly with the records)."""
    k = ranks / row["ranks"]
    out = {**row, "ranks": ranks, "records": ranks * (row["chunks_per_rank"] + 1)}
    if keys is SCALED:
        out["measured"] = False
    for key in keys:
        out[key] = round(row[key] * k, 3) if isinstance(row[key], float) else int(row[key] * k)
    return out


def run(backend: str, version: int, ranks_list: list[int], chunks: int, max_records: int, max_verify: int,
        work: Path) -> list[dict]:
    from ckptstore.storage import LocalStorage

    rows: list[dict] = []
    for ranks in ranks_list:
        records = ranks * (chunks + 1)
        if version == 3 and records > max_records and rows:
            base = next(r for r in reversed(rows) if r["measured"])
            rows.append(extrapolate(base, ranks))
            continue
        if backend == "local":
            root = work / f"local-{version}-{ranks}"
            storage = LocalStorage(str(root))
        else:
            import s3util

            bucket = s3util.new_bucket(s3util.moto_endpoint())
            storage = s3util.s3_storage(bucket, f"scale-{version}-{ranks}")
        row = {**simulate(storage, ranks, chunks, version, verify=records <= max_verify or not rows),
               "backend": backend}
        if not row["verify_measured"]:
            base = next(r for r in reversed(rows) if r["verify_measured"])
            row["verify_s"] = extrapolate(base, ranks, ("verify_s",))["verify_s"]
        rows.append(row)
        print(f"{backend:>5} v{version} N={ranks:>6}: commit {row['commit_after_last_vote_s']:.2f} s, manifest "
              f"{row['manifest_bytes'] / 1e6:.2f} MB, load metadata {row['one_rank_load_metadata_bytes'] / 1e6:.2f} MB "
              f"{row['one_rank_load_metadata_s']:.2f} s, verify {row['verify_s']:.2f} s, ls {row['ls_s']:.2f} s, "
              f"gc plan {row['gc_plan_s']:.2f} s, status {row['status_s']:.2f} s", flush=True)
        if backend == "local":
            shutil.rmtree(root, ignore_errors=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[16, 256, 1024, 10000])
    ap.add_argument("--s3-ranks", type=int, nargs="*", default=[16, 256])
    ap.add_argument("--chunks", type=int, default=1000, help="chunk records per rank")
    ap.add_argument("--formats", type=int, nargs="+", default=[3, 4], choices=[3, 4])
    ap.add_argument("--max-records", type=int, default=1_100_000,
                    help="above this many records one (version 3) manifest is extrapolated, not written")
    ap.add_argument("--max-verify-records", type=int, default=1_100_000,
                    help="above this many records verify (which reads every chunk) is extrapolated")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "scale.json"))
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-scale-", dir=args.dir))
    machine = machine_info(str(work))
    try:
        rows = []
        for version in args.formats:
            rows += run("local", version, args.ranks, args.chunks, args.max_records, args.max_verify_records, work)
        if args.s3_ranks:  # the moto server of the tests (tests/s3util.py), over real HTTP
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
            for version in args.formats:
                rows += run("s3", version, args.s3_ranks, args.chunks, args.max_records, args.max_verify_records,
                            work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print()
    print(f"{'backend':>7} {'v':>2} {'N':>6} {'records':>10} {'manifest MB':>11} {'indexes MB':>10} {'commit s':>9} "
          f"{'load MB':>8} {'load s':>7} {'verify s':>9} {'ls s':>7} {'gc s':>7} {'status s':>8}")
    for r in rows:
        mark = "" if r["measured"] else "  (extrapolated)"
        mark += "" if r["verify_measured"] or not r["measured"] else "  (verify extrapolated)"
        print(f"{r['backend']:>7} {r['format_version']:>2} {r['ranks']:>6} {r['records']:>10} "
              f"{r['manifest_bytes'] / 1e6:>11.2f} {r['index_bytes'] / 1e6:>10.1f} "
              f"{r['commit_after_last_vote_s']:>9.2f} {r['one_rank_load_metadata_bytes'] / 1e6:>8.2f} "
              f"{r['one_rank_load_metadata_s']:>7.2f} {r['verify_s']:>9.2f} "
              f"{r['ls_s']:>7.2f} {r['gc_plan_s']:>7.2f} {r['status_s']:>8.2f}{mark}")
    write_json(args.out, {"machine": machine, "formats": "3: one manifest; 4: a root naming one index per rank",
                          "chunk_bytes": CHUNK, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
