"""Checkpoints over every backend the ``storage`` fixture of conftest.py provides: the
load path's coalesced reads (many small blobs, one read; ``plan_reads`` in
ckptstore/checkpoint/reader.py) through save, restore, verify and partial reads, with
the same checks on each backend. The storage contract itself is checked by
tests/test_storage_conformance.py."""

from __future__ import annotations

from dataclasses import replace
import threading
from types import SimpleNamespace

import pytest
import torch

from ckptstore import format as fmt
from ckptstore.checkpoint.reader import BlobRead, plan_reads
from ckptstore.checkpoint import restore as restore_mod
from ckptstore.checkpoint.reader import read_blobs
from ckptstore.checkpoint.restore import read_regions, restore
from ckptstore.checkpoint.save import SaveOptions, start_save
from ckptstore.checkpoint.verify import verify_manifest
from ckptstore.codecs import CompressionPolicy
from ckptstore.errors import IntegrityError
from ckptstore.runtime import runtime
from ckptstore.storage import ReadHints


# ---------------------------------------------------------------------------- coalesced loads
# The load path (ckptstore/checkpoint/reader.py) merges the reads of small neighbouring
# blobs into one readinto per the backend's read_hints (storage/base.py).
# Requests are counted by wrapping the store's readinto: every backend, same checks.
def _save_on(storage, obj, chunk_bytes: int = 4 << 20, compression: str = "none") -> fmt.Manifest:
    return start_save(obj, storage, rt=runtime(), attempt=fmt.new_attempt_id(), step=None, rank=0, world_size=1,
                      metrics=None, options=SaveOptions(compression=CompressionPolicy(mode=compression),
                                                        chunk_bytes=chunk_bytes)).result(timeout=120)


def read_tensors(storage, tensors, where, pool):
    """Some of a rank's tensors, read the way restore reads them (what a load of only
    those would get)."""
    reads = []
    out = restore_mod._tensor_reads(tensors, where, reads, storage)
    read_blobs(storage, reads, pool)
    return out


def _many_tiny(n: int = 300) -> dict:
    """Optimizer-like state: per parameter a 4-byte step counter and a small bias, and
    now and then a 2 MiB weight (above every backend's read_hints.blob)."""
    g = torch.Generator().manual_seed(5)
    state = {}
    for i in range(n):
        state[f"p{i}.step"] = torch.tensor(float(i))
        state[f"p{i}.bias"] = torch.randn(1 + i % 64, generator=g)
        if i % 100 == 50:
            state[f"w{i}"] = torch.randn(512 * 1024, generator=g)
    return state


def _count_reads(storage, monkeypatch) -> list[tuple[str, int, int]]:
    """(key, offset, length) of every read of a data file from now on: each readinto,
    and each readinto_scatter as one read of the range it fills (a backend's default
    scatter reads through readinto, which then does not count again)."""
    calls: list[tuple[str, int, int]] = []
    real, real_scatter = storage.readinto, storage.readinto_scatter
    inside = threading.local()

    def counting(key, offset, out, on_piece=None):
        if key.endswith(".bin") and not getattr(inside, "scatter", False):
            calls.append((key, offset, memoryview(out).nbytes))
        return real(key, offset, out, on_piece=on_piece)

    def counting_scatter(key, offset, outs):
        if key.endswith(".bin"):
            calls.append((key, offset, sum(memoryview(o).nbytes for o in outs)))
        inside.scatter = True
        try:
            return real_scatter(key, offset, outs)
        finally:
            inside.scatter = False

    monkeypatch.setattr(storage, "readinto", counting)
    monkeypatch.setattr(storage, "readinto_scatter", counting_scatter)
    return calls


def _blobs(manifest: fmt.Manifest) -> dict[str | None, fmt.Blob]:
    (rank,) = manifest.ranks
    out = {key: blob for key, blob in rank.blobs()}
    assert all(len(e.chunks) == 1 for e in rank.tensors.values())
    return out


def test_plan_merges_small_neighbours_and_leaves_big_blobs_alone():
    store = SimpleNamespace(read_hints=ReadHints(blob=100, gap=10, limit=200))  # all plan_reads looks at

    def blob(file, offset, length):
        return BlobRead(fmt.Blob(file, offset, length, length, (), "0" * 32), "t")

    reads = [blob("f", 0, 50), blob("f", 50, 50), blob("f", 100, 101),  # big: alone, ends the run
             blob("f", 201, 10), blob("f", 215, 10),  # gap 4: merged
             blob("f", 236, 10),  # gap 11: a new run
             blob("g", 246, 10),  # another file
             blob("f", 246, 100), blob("f", 346, 100), blob("f", 446, 30)]  # the limit splits the run
    groups = plan_reads(store, reads)
    assert sorted(groups) == [[0, 1], [2], [3, 4], [5, 7], [6], [8, 9]]
    assert groups == sorted(groups, key=min)  # the caller's order
    store.read_hints = replace(store.read_hints, limit=0)  # off: one read per blob
    assert plan_reads(store, reads) == [[i] for i in range(len(reads))]


def test_load_of_many_tiny_tensors_coalesces_reads_bit_exact(storage, monkeypatch):
    state = _many_tiny()
    manifest = _save_on(storage, state)
    blobs = _blobs(manifest)
    big = [b for b in blobs.values() if b.length > storage.read_hints.blob]
    assert len(big) == 3 and len(blobs) == 2 * 300 + 3 + 1
    calls = _count_reads(storage, monkeypatch)
    loaded = restore(storage, manifest, 0)
    assert sorted(loaded) == sorted(state)
    for k, v in state.items():
        assert loaded[k].dtype == v.dtype and torch.equal(loaded[k], v), k
    # One data file, tiled by its blobs: each big one is a read of its own, the small
    # ones between two big ones (well under the limit) one read per run.
    assert len(calls) <= 2 * len(big) + 1, calls
    assert sorted((o, n) for _, o, n in calls if n > storage.read_hints.blob) == sorted(
        (b.offset, b.length) for b in big)  # big chunks straight into their tensor, unmerged
    assert sum(n for _, _, n in calls) == sum(b.length for b in blobs.values())  # every byte once


def test_corrupt_small_blob_in_a_merged_read_names_its_tensor_and_neighbours_load(storage, monkeypatch):
    state = _many_tiny()
    manifest = _save_on(storage, state)
    blobs = _blobs(manifest)
    (rank,) = manifest.ranks
    # A tensor in the middle of the longest merged read (where the big blobs land in the
    # file depends on which worker appended first).
    keys = [k for k in blobs if k is not None]
    group = max(plan_reads(storage, [BlobRead(blobs[k], k) for k in keys]), key=len)
    assert len(group) > 20
    key = keys[sorted(group, key=lambda i: blobs[keys[i]].offset)[len(group) // 2]]
    bad = blobs[key]
    assert bad.length <= storage.read_hints.blob
    data = bytearray(storage.read(bad.file))
    data[bad.offset + bad.length // 2] ^= 0x40
    storage.put(bad.file, bytes(data))
    calls = _count_reads(storage, monkeypatch)
    with pytest.raises(IntegrityError) as ei:
        restore(storage, manifest, 0)
    msg = str(ei.value)
    assert f"tensor {key!r}" in msg and bad.file in msg and f"offset {bad.offset}," in msg and "xxh3" in msg
    assert len(calls) <= 2 * 3 + 1  # still coalesced: the damage is found after the merged read
    problems = verify_manifest(storage, manifest)
    assert [(p.key, p.offset) for p in problems] == [(key, bad.offset)]
    assert len(calls) <= 2 * (2 * 3 + 1)
    # Every other tensor, its neighbours in the merged read included, loads bit-exact
    # (leaving the damaged one out may split its run in two where gaps are not bridged).
    others = {k: e for k, e in rank.tensors.items() if k != key}
    got = read_tensors(storage, others, storage.describe(), runtime().readers)
    for k in others:
        assert torch.equal(torch.empty(0, dtype=state[k].dtype).set_(got[k]).reshape(state[k].shape), state[k]), k
    assert len(calls) <= 3 * (2 * 3 + 1) + 1


def test_a_merged_read_of_raw_and_compressed_blobs_and_of_regions_is_bit_exact(storage, monkeypatch):
    """A load's merged read puts raw blobs straight into their tensors, compressed ones
    into a buffer they are decoded from, and a region read's blobs into new tensors
    (reader._scatter_plan); a damaged compressed blob in the run is still named."""
    g = torch.Generator().manual_seed(11)
    state = {}
    for i in range(200):
        state[f"z{i}"] = torch.zeros(1024 + i)  # compresses
        state[f"r{i}"] = torch.randn(7 + i, generator=g)  # does not
    manifest = _save_on(storage, state, compression="auto")
    blobs = _blobs(manifest)
    assert any(b.codec for b in blobs.values()) and any(not b.codec for k, b in blobs.items() if k)
    assert all(b.length <= storage.read_hints.blob for b in blobs.values())
    calls = _count_reads(storage, monkeypatch)
    loaded = restore(storage, manifest, 0)
    for k, v in state.items():
        assert torch.equal(loaded[k], v), k
    assert len(calls) <= 3  # merged
    (rank,) = manifest.ranks
    keys = ("z5", "r5", "z6", "r6")
    out = read_regions(storage, [(rank.tensors[k], k, (1,), (3,)) for k in keys], runtime().readers)
    for k, got in zip(keys, out):
        assert torch.equal(got, state[k][1:4]), k
    bad = blobs["z100"]
    assert bad.codec
    data = bytearray(storage.read(bad.file))
    data[bad.offset + bad.length - 3] ^= 0x40
    storage.put(bad.file, bytes(data))
    with pytest.raises(IntegrityError, match="tensor 'z100'"):
        restore(storage, manifest, 0)


def test_truncated_file_inside_a_merged_read_reports_the_blobs_cut(storage):
    state = _many_tiny()
    manifest = _save_on(storage, state)
    blobs = _blobs(manifest)
    (rank,) = manifest.ranks
    small = sorted((b for b in blobs.values() if b.length <= storage.read_hints.blob), key=lambda b: b.offset)
    cut_in = small[len(small) // 2]
    data = storage.read(cut_in.file)
    storage.put(cut_in.file, data[:cut_in.offset + 1])
    with pytest.raises(IntegrityError, match="truncated") as ei:
        restore(storage, manifest, 0)
    hit = [k for k, b in blobs.items() if k is not None and b.offset + b.length > cut_in.offset + 1]
    assert any(f"tensor {k!r}" in str(ei.value) for k in hit)
    # The tensors before the cut, in the same merged run included, still load.
    before = {k: e for k, e in rank.tensors.items() if k not in hit}
    assert len(before) > 100
    got = read_tensors(storage, before, storage.describe(), runtime().readers)
    for k in before:
        assert torch.equal(torch.empty(0, dtype=state[k].dtype).set_(got[k]).reshape(state[k].shape), state[k]), k
    assert {p.key for p in verify_manifest(storage, manifest)} == set(hit) | {None}  # None: the skeleton


def test_partial_read_fetches_only_the_chunks_it_needs(storage, monkeypatch):
    """A template load reads regions (read_regions): only the chunks overlapping them,
    merged when they are neighbours, and no stretch of unneeded chunks in between."""
    g = torch.Generator().manual_seed(9)
    a = torch.randn(32, 32768, generator=g)  # 128 KiB rows, one row per chunk: more than any gap
    manifest = _save_on(storage, {"a": a, "tiny": torch.ones(3)}, chunk_bytes=128 << 10)
    (rank,) = manifest.ranks
    entry = rank.tensors["a"]
    assert len(entry.chunks) == 32 and all(c.blob.length > storage.read_hints.gap for c in entry.chunks)
    requests = [(entry, "a", (2, 0), (3, 32768)), (entry, "a", (20, 100), (2, 50)), (entry, "a", (3, 0), (1, 8))]
    calls = _count_reads(storage, monkeypatch)
    out = read_regions(storage, requests, runtime().readers)
    assert torch.equal(out[0], a[2:5]) and torch.equal(out[1], a[20:22, 100:150]) and torch.equal(out[2], a[3:4, :8])
    needed = [c.blob for c in entry.chunks if c.offsets[0] in (2, 3, 4, 20, 21)]
    spans = sorted((o, o + n) for _, o, n in calls)
    assert sum(hi - lo for lo, hi in spans) <= sum(b.length for b in needed) + storage.read_hints.gap * len(spans)
    for b in (c.blob for c in entry.chunks if c.blob not in needed):  # no unneeded chunk was fetched
        assert all(b.offset + b.length <= lo or hi <= b.offset for lo, hi in spans), (b, spans)
    assert len(calls) <= len(needed)  # chunk 3 once, though two regions need it
