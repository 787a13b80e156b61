"""The storage contract (ckptstore/storage/base.py docstring), run against every backend
the ``storage`` fixture of conftest.py provides; and the load path's coalesced reads
(many small blobs, one read) on each of them."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from ckptstore import format as fmt
from ckptstore.checkpoint.reader import BlobRead, plan_reads
from ckptstore.checkpoint.restore import read_regions, read_tensors, restore
from ckptstore.checkpoint.save import SaveOptions, start_save
from ckptstore.checkpoint.verify import verify_manifest
from ckptstore.codecs import CompressionPolicy
from ckptstore.errors import (
    AlreadyExistsError,
    CkptStoreError,
    FormatError,
    IntegrityError,
    ObjectNotFoundError,
    StorageError,
)
from ckptstore.pipeline import runtime
from ckptstore.storage import LocalStorage, ObjectInfo

N_THREADS = 8


def run_threads(n: int, target) -> list:
    """Run target(i) on n threads released together; returns results (or exceptions)."""
    barrier = threading.Barrier(n)
    results: list = [None] * n

    def body(i):
        barrier.wait()
        try:
            results[i] = target(i)
        except BaseException as e:  # noqa: BLE001 - collected for the assertions
            results[i] = e

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


# ---------------------------------------------------------------------------- put / read
@pytest.mark.parametrize("kind", ["bytes", "bytearray", "memoryview", "empty"])
def test_put_then_read_round_trip(storage, kind):
    payload = os.urandom(10_000)
    data = {"bytes": payload, "bytearray": bytearray(payload), "memoryview": memoryview(payload),
            "empty": b""}[kind]
    storage.put("dir/obj.bin", data)
    assert storage.read("dir/obj.bin") == bytes(data)
    assert storage.stat("dir/obj.bin").size == len(data)


def test_read_ranges(storage):
    payload = bytes(range(256)) * 4
    storage.put("k", payload)
    assert storage.read("k", 10, 5) == payload[10:15]
    assert storage.read("k", 1000) == payload[1000:]
    buf = bytearray(7)
    storage.readinto("k", 250, memoryview(buf))
    assert bytes(buf) == payload[250:257]
    empty = bytearray()
    storage.readinto("k", len(payload), memoryview(empty))  # zero bytes at the end: fine
    assert empty == bytearray()


def test_read_with_a_limit_refuses_larger_objects_unread(storage):
    from ckptstore.errors import ObjectTooLargeError

    storage.put("k", b"x" * 100)
    assert storage.read("k", limit=100) == b"x" * 100
    assert storage.read("k", 10, limit=90) == b"x" * 90
    with pytest.raises(ObjectTooLargeError) as ei:
        storage.read("k", limit=99)
    assert "'k'" in str(ei.value) or "/k" in str(ei.value)
    with pytest.raises(ObjectTooLargeError):
        storage.read("k", 1, limit=98)
    storage.put("empty", b"")
    assert storage.read("empty", limit=0) == b""


def test_put_replaces(storage):
    storage.put("k", b"first version, longer")
    storage.put("k", b"second")
    assert storage.read("k") == b"second"
    assert storage.stat("k").size == 6


def test_put_if_absent_creates_new_key(storage):
    storage.put("m/manifest", b"v1", if_absent=True)
    assert storage.read("m/manifest") == b"v1"


def test_put_if_absent_refuses_existing_and_keeps_old_bytes(storage):
    storage.put("m/manifest", b"committed", if_absent=True)
    with pytest.raises(AlreadyExistsError) as ei:
        storage.put("m/manifest", b"intruder", if_absent=True)
    assert isinstance(ei.value, FileExistsError)
    assert "m/manifest" in str(ei.value)
    assert storage.read("m/manifest") == b"committed"


def test_put_if_absent_race_exactly_one_wins(storage):
    payloads = [f"writer {i}".encode() * (i + 1) for i in range(N_THREADS)]
    results = run_threads(N_THREADS, lambda i: storage.put("race/manifest", payloads[i], if_absent=True))
    winners = [i for i, r in enumerate(results) if r is None]
    losers = [r for r in results if r is not None]
    assert len(winners) == 1
    assert all(isinstance(r, AlreadyExistsError) for r in losers)
    assert storage.read("race/manifest") == payloads[winners[0]]


def test_put_is_atomic_for_concurrent_readers(storage):
    a, b = b"A" * (1 << 20), b"B" * (1 << 20)
    storage.put("k", a)
    seen = []

    def writer():
        for i in range(20):
            storage.put("k", b if i % 2 == 0 else a)

    def reader():
        for _ in range(40):
            seen.append(storage.read("k"))

    results = run_threads(2, lambda i: writer() if i == 0 else reader())
    assert results == [None, None]
    assert len(seen) == 40
    assert all(s == a or s == b for s in seen)


# ---------------------------------------------------------------------------- append
def test_append_writer_round_trip(storage):
    w = storage.open_append("attempts/x/data.bin")
    assert w.append(b"hello ") == 0
    assert w.append(memoryview(b"world")) == 6
    assert w.append(b"") == 11
    assert w.close() == 11
    assert storage.read("attempts/x/data.bin") == b"hello world"


def test_append_from_threads_offsets_tile_the_file(storage):
    w = storage.open_append("data.bin")
    per_thread = 40

    def body(i):
        out = []
        for j in range(per_thread):
            chunk = bytes([i]) * (1 + (i * 37 + j * 11) % 900)
            out.append((w.append(chunk), chunk))
        return out

    results = run_threads(N_THREADS, body)
    assert not any(isinstance(r, BaseException) for r in results)
    pieces = sorted(p for r in results for p in r)
    size = w.close()
    pos = 0
    for offset, chunk in pieces:
        assert offset == pos
        pos += len(chunk)
    assert size == pos
    content = storage.read("data.bin")
    assert len(content) == size
    for offset, chunk in pieces:
        assert content[offset:offset + len(chunk)] == chunk


def test_open_append_never_opens_an_existing_key(storage):
    storage.put("data.bin", b"old")
    with pytest.raises(AlreadyExistsError):
        storage.open_append("data.bin")
    assert storage.read("data.bin") == b"old"


def test_append_abort_removes_the_object_and_never_raises(storage):
    w = storage.open_append("a/data.bin")
    w.append(b"partial")
    w.abort()
    w.abort()  # twice: still no error
    assert not storage.exists("a/data.bin")
    with pytest.raises(ObjectNotFoundError):
        storage.read("a/data.bin")


# ---------------------------------------------------------------------------- missing, short
def test_readinto_short_read_raises(storage):
    storage.put("k", b"0123456789")
    buf = bytearray(8)
    with pytest.raises(StorageError) as ei:
        storage.readinto("k", 5, memoryview(buf))
    assert "k" in str(ei.value)
    with pytest.raises(StorageError):
        storage.read("k", 8, 5)
    with pytest.raises(StorageError):
        storage.read("k", 20, 1)


@pytest.mark.parametrize("op", ["read", "readinto", "stat"])
def test_missing_key_raises_object_not_found(storage, op):
    storage.put("present", b"x")
    call = {
        "read": lambda: storage.read("absent/key"),
        "readinto": lambda: storage.readinto("absent/key", 0, memoryview(bytearray(1))),
        "stat": lambda: storage.stat("absent/key"),
    }[op]
    with pytest.raises(ObjectNotFoundError) as ei:
        call()
    assert isinstance(ei.value, FileNotFoundError)
    assert isinstance(ei.value, CkptStoreError)
    assert "absent/key" in str(ei.value)
    assert storage.exists("absent/key") is False
    assert storage.exists("present") is True


# ---------------------------------------------------------------------------- list / walk / stat
def _populate(storage) -> dict[str, bytes]:
    objs = {
        "top.json": b"{}",
        "a/one": b"1",
        "a/two": b"22",
        "a/deep/three": b"333",
        "b/four": b"4444",
        "ab": b"55555",
    }
    for k, v in objs.items():
        storage.put(k, v)
    return objs


def test_list_immediate_children_with_dir_suffix(storage):
    _populate(storage)
    assert storage.list("") == ["a/", "ab", "b/", "top.json"]
    assert storage.list("a") == ["deep/", "one", "two"]
    assert storage.list("a/") == ["deep/", "one", "two"]
    assert storage.list("a/deep") == ["three"]


def test_list_of_missing_prefix_is_empty_or_not_found(storage):
    _populate(storage)
    try:
        assert storage.list("nothing/here") == []
    except ObjectNotFoundError:
        pass


def test_walk_is_recursive_with_sizes(storage):
    objs = _populate(storage)
    found = {i.key: i.size for i in storage.walk("")}
    assert found == {k: len(v) for k, v in objs.items()}
    assert {i.key: i.size for i in storage.walk("a")} == {"a/one": 1, "a/two": 2, "a/deep/three": 3}
    assert {i.key for i in storage.walk("a/")} == {"a/one", "a/two", "a/deep/three"}
    assert list(storage.walk("missing")) == []
    assert all(isinstance(i, ObjectInfo) and isinstance(i.mtime, float) and i.mtime > 0
               for i in storage.walk(""))


def test_stat(storage):
    storage.put("x/y.bin", b"abcdef")
    info = storage.stat("x/y.bin")
    assert (info.key, info.size) == ("x/y.bin", 6)
    assert isinstance(info.mtime, float) and info.mtime > 0
    with pytest.raises(ObjectNotFoundError):
        storage.stat("x")  # a prefix is not an object


# ---------------------------------------------------------------------------- delete
def test_delete_and_delete_missing(storage):
    storage.put("d/k", b"x")
    storage.delete("d/k")
    assert not storage.exists("d/k")
    with pytest.raises(ObjectNotFoundError):
        storage.read("d/k")
    storage.delete("d/k")  # missing: not an error
    storage.delete("never/was")
    assert list(storage.walk("")) == []


def test_delete_prefix_removes_only_that_prefix(storage):
    _populate(storage)
    storage.delete_prefix("a/")
    assert {i.key for i in storage.walk("")} == {"top.json", "b/four", "ab"}
    assert storage.read("ab") == b"55555"
    storage.delete_prefix("missing/")  # nothing there: fine
    assert {i.key for i in storage.walk("")} == {"top.json", "b/four", "ab"}


# ---------------------------------------------------------------------------- child views
def test_child_view_sees_the_same_objects(storage):
    sub = storage.child("runs/exp1")
    sub.put("step/data", b"payload")
    assert storage.read("runs/exp1/step/data") == b"payload"
    storage.put("runs/exp1/other", b"o")
    assert sub.read("other") == b"o"
    assert sub.list("") == ["other", "step/"]
    assert sub.list() == ["other", "step/"]
    assert {i.key: i.size for i in sub.walk("")} == {"step/data": 7, "other": 1}
    assert {i.key for i in sub.walk("step")} == {"step/data"}
    assert sub.stat("step/data").size == 7
    assert sub.exists("other") and not sub.exists("runs/exp1/other")
    assert "runs/exp1" in sub.describe()
    assert "runs/exp1/other" in sub.describe("other")
    with pytest.raises(ObjectNotFoundError) as ei:
        sub.read("missing")
    assert "runs/exp1/missing" in str(ei.value)


def test_child_of_child_and_trailing_slashes(storage):
    leaf = storage.child("a/").child("b/")  # one trailing '/': fine; a leading one is absolute
    with pytest.raises(FormatError):
        storage.child("a/").child("/b")
    leaf.put("k", b"v")
    assert storage.read("a/b/k") == b"v"
    assert storage.child("a").list("") == ["b/"]
    assert leaf.list("") == ["k"]


def test_child_put_if_absent_and_append_and_delete_prefix(storage):
    sub = storage.child("ck")
    sub.put("manifest", b"1", if_absent=True)
    with pytest.raises(AlreadyExistsError):
        sub.put("manifest", b"2", if_absent=True)
    w = sub.open_append("attempts/a/data")
    w.append(b"xyz")
    w.close()
    storage.put("keep", b"k")
    sub.delete_prefix("attempts/")
    assert {i.key for i in storage.walk("")} == {"ck/manifest", "keep"}
    sub.delete("manifest")
    assert {i.key for i in storage.walk("")} == {"keep"}


# ---------------------------------------------------------------------------- key grammar
# Keys and prefixes are untrusted (storage/base.py, check_key): every method refuses a
# key that is not a relative, normalised '/'-separated name with FormatError (a
# ValueError) naming the store and the key, before it touches anything.
BAD_KEYS = ["", "/abs", "/", "../escape", "a/../../escape", "a/..", "..", ".", "./a", "a/./b", "a//b", "a/",
            "a\\b", "\\", "a\x00b", "\x00"]
BAD_PREFIXES = ["/", "/abs", "//", "..", "../", "../escape/", "a/../b", ".", "./", "a/./", "a//", "a//b",
                "a\\b", "a\x00"]
KEY_CALLS = {
    "put": lambda s, k: s.put(k, b"x"),
    "put_if_absent": lambda s, k: s.put(k, b"x", if_absent=True),
    "open_append": lambda s, k: s.open_append(k),
    "readinto": lambda s, k: s.readinto(k, 0, memoryview(bytearray(1))),
    "read": lambda s, k: s.read(k),
    "read_range": lambda s, k: s.read(k, 0, 1),
    "stat": lambda s, k: s.stat(k),
    "exists": lambda s, k: s.exists(k),
    "delete": lambda s, k: s.delete(k),
}
PREFIX_CALLS = {
    "list": lambda s, p: s.list(p),
    "walk": lambda s, p: s.walk(p),  # refused at the call, not at the first next()
    "delete_prefix": lambda s, p: s.delete_prefix(p),
    "child": lambda s, p: s.child(p),
}


def _assert_refused(storage, call, key):
    with pytest.raises(FormatError) as ei:
        call()
    assert isinstance(ei.value, ValueError) and isinstance(ei.value, CkptStoreError)
    msg = str(ei.value)
    assert storage.describe() in msg and repr(key) in msg, msg


def test_every_method_refuses_invalid_keys_naming_store_and_key(storage):
    storage.put("sub/keep", b"keep")
    sub = storage.child("sub")
    for name, call in KEY_CALLS.items():
        for key in BAD_KEYS:
            _assert_refused(storage, lambda: call(storage, key), key)
            _assert_refused(sub, lambda: call(sub, key), key)
    assert [(i.key, i.size) for i in storage.walk("")] == [("sub/keep", 4)]  # nothing written or deleted
    assert storage.read("sub/keep") == b"keep"


def test_every_method_refuses_invalid_prefixes_naming_store_and_prefix(storage):
    storage.put("sub/keep", b"keep")
    sub = storage.child("sub")
    for name, call in PREFIX_CALLS.items():
        for prefix in BAD_PREFIXES:
            _assert_refused(storage, lambda: call(storage, prefix), prefix)
            _assert_refused(sub, lambda: call(sub, prefix), prefix)
    assert [i.key for i in storage.walk("")] == ["sub/keep"]


def test_a_child_view_cannot_reach_outside_its_prefix(storage):
    storage.put("secret", b"outside the child")
    storage.put("run/a/k", b"inside")
    sub = storage.child("run/a")
    for key in ("../../secret", "../a/k", "/secret", "x/../../../secret"):
        for call in KEY_CALLS.values():
            with pytest.raises(FormatError):
                call(sub, key)
    for prefix in ("../", "../..", "../../"):
        for call in PREFIX_CALLS.values():
            with pytest.raises(FormatError):
                call(sub, prefix)
    assert storage.read("secret") == b"outside the child"
    assert {i.key for i in storage.walk("")} == {"secret", "run/a/k"}


def test_valid_keys_and_prefixes_are_accepted(storage):
    for key in ("k", "a/b/c", "a/c..", "x.y", "..a", "a..", "a/.b/...", ".hidden", "sp ace/ü-ñ", "a:b@c"):
        storage.put(key, key.encode())
        assert storage.read(key) == key.encode() and storage.exists(key)
    assert storage.list("") == sorted(storage.list(""))
    assert storage.list("a") == storage.list("a/") == [".b/", "b/", "c.."]
    assert {i.key for i in storage.walk("a/")} == {"a/b/c", "a/c..", "a/.b/..."}
    assert storage.child("a/").list() == storage.child("a").list("") == [".b/", "b/", "c.."]
    storage.delete_prefix("a/")
    assert not storage.exists("a/b/c")


def test_walk_reports_regular_objects_as_kind_file(storage):
    _populate(storage)
    infos = list(storage.walk(""))
    assert infos and all(i.kind == "file" for i in infos)
    assert ObjectInfo("k", 1, 2.0) == ObjectInfo("k", 1, 2.0, "file")  # positional construction still works


# ---------------------------------------------------------------------------- coalesced loads
# The load path (ckptstore/checkpoint/restore.py) merges the reads of small neighbouring
# blobs into one readinto per the backend's read_coalesce_* hints (storage/base.py).
# Requests are counted by wrapping the store's readinto: every backend, same checks.
def _save_on(storage, obj, chunk_bytes: int = 4 << 20) -> fmt.Manifest:
    return start_save(obj, storage, rt=runtime(), attempt=fmt.new_attempt_id(), step=None, rank=0, world_size=1,
                      metrics=None, options=SaveOptions(compression=CompressionPolicy(mode="none"),
                                                        chunk_bytes=chunk_bytes)).result(timeout=120)


def _many_tiny(n: int = 300) -> dict:
    """Optimizer-like state: per parameter a 4-byte step counter and a small bias, and
    now and then a 2 MiB weight (above every backend's read_coalesce_blob)."""
    g = torch.Generator().manual_seed(5)
    state = {}
    for i in range(n):
        state[f"p{i}.step"] = torch.tensor(float(i))
        state[f"p{i}.bias"] = torch.randn(1 + i % 64, generator=g)
        if i % 100 == 50:
            state[f"w{i}"] = torch.randn(512 * 1024, generator=g)
    return state


def _count_reads(storage, monkeypatch) -> list[tuple[str, int, int]]:
    """(key, offset, length) of every readinto of a data file from now on."""
    calls: list[tuple[str, int, int]] = []
    real = storage.readinto

    def counting(key, offset, out, on_piece=None):
        if key.endswith(".bin"):
            calls.append((key, offset, memoryview(out).nbytes))
        return real(key, offset, out, on_piece=on_piece)

    monkeypatch.setattr(storage, "readinto", counting)
    return calls


def _blobs(manifest: fmt.Manifest) -> dict[str | None, fmt.Blob]:
    (rank,) = manifest.ranks
    out = {key: blob for key, blob in rank.blobs()}
    assert all(len(e.chunks) == 1 for e in rank.tensors.values())
    return out


def test_coalescing_hints_are_sane(storage):
    assert 0 <= storage.read_coalesce_blob <= storage.read_coalesce_limit
    assert 0 <= storage.read_coalesce_gap < storage.read_coalesce_limit
    # Small blobs merged, a big chunk (the default 16 MiB) always streams on its own.
    assert 4 <= storage.read_coalesce_blob < 16 << 20


def test_plan_merges_small_neighbours_and_leaves_big_blobs_alone():
    class Hints:
        read_coalesce_blob, read_coalesce_gap, read_coalesce_limit = 100, 10, 200

    def blob(file, offset, length):
        return BlobRead(fmt.Blob(file, offset, length, length, (), "0" * 32), "t")

    reads = [blob("f", 0, 50), blob("f", 50, 50), blob("f", 100, 101),  # big: alone, ends the run
             blob("f", 201, 10), blob("f", 215, 10),  # gap 4: merged
             blob("f", 236, 10),  # gap 11: a new run
             blob("g", 246, 10),  # another file
             blob("f", 246, 100), blob("f", 346, 100), blob("f", 446, 30)]  # the limit splits the run
    groups = plan_reads(Hints(), reads)
    assert sorted(groups) == [[0, 1], [2], [3, 4], [5, 7], [6], [8, 9]]
    assert groups == sorted(groups, key=min)  # the caller's order
    Hints.read_coalesce_limit = 0  # off: one read per blob
    assert plan_reads(Hints(), reads) == [[i] for i in range(len(reads))]


def test_load_of_many_tiny_tensors_coalesces_reads_bit_exact(storage, monkeypatch):
    state = _many_tiny()
    manifest = _save_on(storage, state)
    blobs = _blobs(manifest)
    big = [b for b in blobs.values() if b.length > storage.read_coalesce_blob]
    assert len(big) == 3 and len(blobs) == 2 * 300 + 3 + 1
    calls = _count_reads(storage, monkeypatch)
    loaded = restore(storage, manifest, 0)
    assert sorted(loaded) == sorted(state)
    for k, v in state.items():
        assert loaded[k].dtype == v.dtype and torch.equal(loaded[k], v), k
    # One data file, tiled by its blobs: each big one is a read of its own, the small
    # ones between two big ones (well under the limit) one read per run.
    assert len(calls) <= 2 * len(big) + 1, calls
    assert sorted((o, n) for _, o, n in calls if n > storage.read_coalesce_blob) == sorted(
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
    assert bad.length <= storage.read_coalesce_blob
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


def test_truncated_file_inside_a_merged_read_reports_the_blobs_cut(storage):
    state = _many_tiny()
    manifest = _save_on(storage, state)
    blobs = _blobs(manifest)
    (rank,) = manifest.ranks
    small = sorted((b for b in blobs.values() if b.length <= storage.read_coalesce_blob), key=lambda b: b.offset)
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
    assert len(entry.chunks) == 32 and all(c.blob.length > storage.read_coalesce_gap for c in entry.chunks)
    requests = [(entry, "a", (2, 0), (3, 32768)), (entry, "a", (20, 100), (2, 50)), (entry, "a", (3, 0), (1, 8))]
    calls = _count_reads(storage, monkeypatch)
    out = read_regions(storage, requests, runtime().readers)
    assert torch.equal(out[0], a[2:5]) and torch.equal(out[1], a[20:22, 100:150]) and torch.equal(out[2], a[3:4, :8])
    needed = [c.blob for c in entry.chunks if c.offsets[0] in (2, 3, 4, 20, 21)]
    spans = sorted((o, o + n) for _, o, n in calls)
    assert sum(hi - lo for lo, hi in spans) <= sum(b.length for b in needed) + storage.read_coalesce_gap * len(spans)
    for b in (c.blob for c in entry.chunks if c.blob not in needed):  # no unneeded chunk was fetched
        assert all(b.offset + b.length <= lo or hi <= b.offset for lo, hi in spans), (b, spans)
    assert len(calls) <= len(needed)  # chunk 3 once, though two regions need it


# ---------------------------------------------------------------------------- local disk only
def _tmp_leftovers(root) -> list[str]:
    return [os.path.join(d, n) for d, _, files in os.walk(root) for n in files if ".tmp-" in n]


def test_local_put_leaves_no_temp_files(tmp_path):
    s = LocalStorage(tmp_path / "store")
    s.put("a/b", b"x" * 1000)
    s.put("a/b", b"y")
    s.put("a/c", b"z", if_absent=True)
    with pytest.raises(AlreadyExistsError):
        s.put("a/c", b"again", if_absent=True)
    assert _tmp_leftovers(tmp_path) == []
    assert sorted(os.listdir(tmp_path / "store" / "a")) == ["b", "c"]


def test_local_create_only_put_race_never_replaces(tmp_path):
    s = LocalStorage(tmp_path / "store")
    s.put("manifest-0000000001.json", b"committed", if_absent=True)
    results = run_threads(N_THREADS, lambda i: s.put("manifest-0000000001.json", b"x%d" % i, if_absent=True))
    assert all(isinstance(r, AlreadyExistsError) for r in results)
    assert s.read("manifest-0000000001.json") == b"committed"
    results = run_threads(N_THREADS, lambda i: s.put("manifest-0000000002.json", b"w%d" % i, if_absent=True))
    winners = [i for i, r in enumerate(results) if r is None]
    assert len(winners) == 1
    assert s.read("manifest-0000000002.json") == b"w%d" % winners[0]
    assert _tmp_leftovers(tmp_path) == []


def test_local_list_hides_temp_files(tmp_path):
    s = LocalStorage(tmp_path / "store")
    s.put("k", b"v")
    (tmp_path / "store" / "k.tmp-deadbeef").write_bytes(b"half")
    assert s.list("") == ["k"]
