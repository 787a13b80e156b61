"""The storage contract (ckptstore/storage/base.py docstring), run against every backend
the ``storage`` fixture of conftest.py provides. Storage only: checkpoints over each
backend (save, restore, verify, coalesced reads) are tests/test_backends_checkpoint.py."""

from __future__ import annotations

import os
import threading
import time

import pytest

from ckptstore.errors import (
    AlreadyExistsError,
    CkptStoreError,
    FormatError,
    ObjectNotFoundError,
    StorageError,
)
from ckptstore.storage import LocalStorage, ObjectInfo, ReadHints, Storage

N_THREADS = 8


@pytest.fixture(params=sorted(__import__("conftest").STORAGE_BACKENDS) + ["c10d-hash", "c10d-tcp"])
def storage(request, tmp_path):
    """conftest's backends, and the storage over a torch.distributed store that holds a
    memory tier's commit records (storage/c10d.py; objects of at most 1 MiB, so not a
    backend of whole checkpoints: tests/test_backends_checkpoint.py leaves it out)."""
    if not request.param.startswith("c10d"):
        yield __import__("conftest").STORAGE_BACKENDS[request.param](request, tmp_path)
        return
    from datetime import timedelta

    import torch.distributed as dist

    from ckptstore.storage.c10d import C10dStorage

    if request.param == "c10d-hash":
        yield C10dStorage(dist.HashStore(), "mem/", "hash")
        return
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30))
    yield C10dStorage(dist.PrefixStore("ckptstore/run/0", client), "mem/", f"127.0.0.1:{server.port}")
    del client, server


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


def test_readinto_scatter_fills_each_buffer_in_turn(storage):
    data = os.urandom(10_000)
    storage.put("k", data)
    # more buffers than one preadv takes (IOV_MAX: 1,024 on Linux), some of them empty
    sizes = [i % 7 for i in range(3_000)]
    outs = [memoryview(bytearray(n)) for n in sizes]
    storage.readinto_scatter("k", 100, outs)
    assert b"".join(bytes(o) for o in outs) == data[100:100 + sum(sizes)]


def test_readinto_scatter_short_read_raises_naming_the_key(storage):
    storage.put("k", b"0123456789")
    outs = [memoryview(bytearray(4)), memoryview(bytearray(4))]
    with pytest.raises(StorageError) as ei:
        storage.readinto_scatter("k", 4, outs)
    assert "k" in str(ei.value)
    with pytest.raises(ObjectNotFoundError):
        storage.readinto_scatter("missing", 0, outs)


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


def test_list_of_a_missing_prefix_is_empty_never_an_error(storage):
    # Any exception fails the test: a missing prefix has no children, nothing else.
    assert storage.list("") == []  # a root never written to (on disk: no directory yet)
    assert storage.list("nothing/here") == []
    _populate(storage)
    assert storage.list("nothing/here") == storage.list("nothing/here/") == []
    assert storage.list("a/nothing") == []  # below an existing prefix
    assert storage.list("top.json") == storage.list("a/one/") == []  # an object is no prefix
    assert storage.list("a/one/deeper") == []  # below an object
    assert storage.child("nothing").list() == storage.child("a/one").list("") == []
    assert storage.list("a") == ["deep/", "one", "two"]  # and the rest is still there


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


def test_is_dir_tells_an_existing_root_from_nothing(storage):
    assert storage.is_dir() is False  # a fresh store: nothing written, nothing created
    storage.put("a/k", b"x")
    assert storage.is_dir() is True
    assert storage.child("a").is_dir() is True
    assert storage.child("missing").is_dir() is False
    assert storage.child("a/k").is_dir() is False  # an object is no container


# ---------------------------------------------------------------------------- read hints
def test_read_hints_are_a_frozen_value_and_sane(storage):
    hints = storage.read_hints
    assert isinstance(hints, ReadHints)
    with pytest.raises(AttributeError):
        hints.limit = 0  # frozen
    assert 0 <= hints.blob <= hints.limit
    assert 0 <= hints.gap < hints.limit
    # Small blobs merged, a big chunk (the default 16 MiB) always streams on its own.
    assert 4 <= hints.blob < 16 << 20


def test_read_hints_default_is_no_coalescing():
    assert Storage.read_hints == ReadHints() == ReadHints(blob=0, gap=0, limit=0)
    with pytest.raises(ValueError):
        ReadHints(blob=-1)


# ---------------------------------------------------------------------------- capability flags
def test_every_backend_sees_all_data_and_a_split_store_does_not(storage, tmp_path):
    """``sees_all_data`` is part of the contract (base.py), not probed: every backend
    states it, a split store (a multi-node local tier) is the one that says False."""
    from ckptstore.storage.split import SplitStorage

    assert Storage.sees_all_data is True and storage.sees_all_data is True
    assert SplitStorage(storage, LocalStorage(str(tmp_path / "node"))).sees_all_data is False


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


def test_delete_many_deletes_those_keys_only_and_checks_every_key_first(storage):
    _populate(storage)
    with pytest.raises(FormatError):
        storage.delete_many(["top.json", "a/../b/four"])
    assert storage.exists("top.json")  # a bad key anywhere: nothing deleted
    storage.delete_many(k for k in ["top.json", "a/deep/three", "never/was", "top.json"])  # missing keys: fine
    assert {i.key for i in storage.walk("")} == {"a/one", "a/two", "b/four", "ab"}
    storage.delete_many([])
    storage.child("a").delete_many(["one", "two"])
    assert {i.key for i in storage.walk("")} == {"b/four", "ab"}


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
    "readinto_scatter": lambda s, k: s.readinto_scatter(k, 0, [memoryview(bytearray(1))] * 2),
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
    "remove_empty_dirs": lambda s, p: s.remove_empty_dirs(["ok/", p], 0),  # every prefix, before any removal
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


# ---------------------------------------------------------------------------- empty directories
def test_remove_empty_dirs_never_removes_an_object_or_the_root(storage):
    """Whatever the store, offering objects, missing prefixes and the root removes
    nothing; a store without directories of its own has none to remove."""
    storage.put("a/full/k", b"x")
    storage.put("b", b"y")
    offered = ["a/full/k", "a/full", "a/", "b", "missing/", ""]
    for dry_run in (True, False):
        assert storage.remove_empty_dirs(offered, 0, dry_run=dry_run) == []
    assert sorted(i.key for i in storage.walk("")) == ["a/full/k", "b"]
    assert storage.remove_empty_dirs([], 0) == []
    assert isinstance(storage.keeps_empty_dirs, bool)


def _aged(root, rels, age=3600.0):
    then = time.time() - age
    for rel in rels:
        os.utime(root / rel, (then, then), follow_symlinks=False)


def test_local_remove_empty_dirs_judges_emptiness_and_age_before_removing_any(tmp_path):
    """Children before parents: a parent holding only directories removed in the same
    call counts as empty, judged (with its age) before the children go; one that holds
    a file or a young directory stays, and so does a parent offered before its child."""
    root = tmp_path / "s"
    for rel in ("p/c1", "p/c2", "q/young", "r/c", "x/y"):
        (root / rel).mkdir(parents=True)
    (root / "r" / "file").write_bytes(b"x")
    _aged(root, ["p/c1", "p/c2", "p", "q", "r/c", "r", "x/y", "x"])
    st = LocalStorage(str(root))
    assert st.keeps_empty_dirs
    offered = ["p/c1", "p/c2/", "p", "q/young", "q", "r/c", "r", "x", "x/y"]
    expected = ["p/c1", "p/c2", "p", "r/c", "x/y"]
    assert st.remove_empty_dirs(offered, 600, dry_run=True) == expected
    assert (root / "p" / "c1").is_dir()  # a dry run touches nothing
    assert st.remove_empty_dirs(offered, 600) == expected
    assert sorted(os.listdir(root)) == ["q", "r", "x"]
    assert (root / "q" / "young").is_dir() and (root / "r" / "file").exists() and not (root / "x" / "y").exists()
    assert st.remove_empty_dirs(["x"], 0) == ["x"]  # (older_than 0: any age)


def test_local_remove_empty_dirs_never_through_a_symlink_nor_the_root(tmp_path):
    outside = tmp_path / "outside"
    (outside / "e").mkdir(parents=True)
    root = tmp_path / "s"
    (root / "sub" / "e").mkdir(parents=True)
    (root / "link").symlink_to(outside, target_is_directory=True)
    (root / "sub" / "alias").symlink_to(outside / "e", target_is_directory=True)
    _aged(tmp_path, ["outside/e", "outside", "s/sub/e", "s/sub"])
    st = LocalStorage(str(root))
    assert st.remove_empty_dirs(["link/e", "link", "sub/alias", "sub/e", "sub", ""], 0) == ["sub/e"]
    assert (outside / "e").is_dir() and (root / "link").is_symlink() and (root / "sub" / "alias").is_symlink()
    view = st.child("sub")
    assert view.remove_empty_dirs([""], 0) == [] and (root / "sub").is_dir()  # a view's root neither
