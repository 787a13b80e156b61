"""The S3 backend against a real S3 server over HTTP: moto in server mode on 127.0.0.1,
started by fixtures, and a fault-injecting proxy (tests/s3util.py) between boto3 and it.

What is checked: URL routing and boto3's standard configuration; the storage contract
(create-only put, streaming multipart appends with arrival-order offsets, bounded
memory, growing parts, abort; ranged and concurrent reads, short reads); error classes
(permanent errors fail at once naming the URL, with no retries on the wire; transient
ones are retried by botocore, then surface); ckptstore.save/load, Store and the CLI on
s3:// URLs; saves through a faulty network commit bit-exact data or fail cleanly; two
processes racing for one create-only key: exactly one wins.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import accumulate
from pathlib import Path

import pytest

pytest.importorskip("boto3")
pytest.importorskip("moto.server")

import torch  # noqa: E402

import ckptstore  # noqa: E402
import s3util  # noqa: E402
from ckptstore import format as fmt  # noqa: E402
from ckptstore.checkpoint.indexes import expand  # noqa: E402
from ckptstore.checkpoint.manifests import latest_manifest  # noqa: E402
from ckptstore.checkpoint.restore import restore  # noqa: E402
from ckptstore.checkpoint.save import SaveOptions, start_save  # noqa: E402
from ckptstore.codecs import CompressionPolicy  # noqa: E402
from ckptstore.errors import (  # noqa: E402
    AlreadyExistsError,
    CheckpointNotFoundError,
    CkptStoreError,
    IntegrityError,
    NotCommittedError,
    ObjectNotFoundError,
    StorageError,
    StoragePermissionError,
    TransientStorageError,
    TruncatedObjectError,
)
from ckptstore.runtime import Runtime, runtime  # noqa: E402
from ckptstore.storage import open_storage  # noqa: E402
from ckptstore.storage.s3 import DEFAULT_COALESCE_BLOB, DEFAULT_COALESCE_GAP, S3Storage  # noqa: E402

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------- fixtures
from s3util import bucket, endpoint, proxy  # noqa: E402, F401 (fixtures)


@pytest.fixture
def s3env(endpoint, monkeypatch):
    """boto3's standard configuration (environment) points at the moto server."""
    s3util.point_boto3_at(endpoint, monkeypatch)
    return endpoint


@pytest.fixture
def admin(endpoint):
    return s3util.admin_client(endpoint)


# ---------------------------------------------------------------------------- helpers
def make_state(nbytes: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    n = nbytes // 4
    return {
        "model": {"w": torch.randn(n - n // 8, generator=g), "b": torch.randn(n // 8, generator=g).to(torch.bfloat16)},
        "ids": torch.randint(0, 1 << 30, (257,), generator=g),
        "step": seed,
        "note": f"state {seed}",
    }


def assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert sorted(a) == sorted(b)
        for k in a:
            assert_same(a[k], b[k])
    else:
        assert a == b


def save_via(storage, obj, *, chunk_bytes: int = 4 * MiB, rank: int = 0, world_size: int = 1,
             attempt: str | None = None, rt=None):
    """The save path of ckptstore.save / Store.save, on a given Storage object (so a test
    can choose its endpoint, part size and retry settings)."""
    return start_save(obj, storage, rt=rt or runtime(), attempt=attempt or fmt.new_attempt_id(), step=None,
                      rank=rank, world_size=world_size, metrics=None,
                      options=SaveOptions(compression=CompressionPolicy(mode="none"), chunk_bytes=chunk_bytes))


def keys(admin, bucket: str, prefix: str = "") -> list[str]:
    out = []
    for page in admin.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        out += [o["Key"] for o in page.get("Contents", ())]
    return sorted(out)


def uploads(admin, bucket: str) -> list[str]:
    return sorted(u["Key"] for u in admin.list_multipart_uploads(Bucket=bucket).get("Uploads", ()))


def start_cli(endpoint: str, *args: str) -> subprocess.Popen:
    env = s3util.subprocess_env(endpoint, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, "-m", "ckptstore.cli", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def cli_result(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_cli(endpoint: str, *args: str) -> subprocess.CompletedProcess:
    return cli_result(start_cli(endpoint, *args))


# ---------------------------------------------------------------------------- configuration
def test_open_storage_routes_s3_urls_and_passes_options(tmp_path):
    st = open_storage("s3://some-bucket/runs/exp1/", part_size=8 * MiB, max_concurrency=3,
                      endpoint_url="http://127.0.0.1:9")
    assert isinstance(st, S3Storage)
    assert (st.bucket, st.prefix, st.url) == ("some-bucket", "runs/exp1", "s3://some-bucket/runs/exp1")
    assert st.describe("step-1/manifest.json") == "s3://some-bucket/runs/exp1/step-1/manifest.json"
    assert st.child("step-1/").describe("x") == "s3://some-bucket/runs/exp1/step-1/x"
    assert st.part_size == 8 * MiB
    root = open_storage("s3://some-bucket", endpoint_url="http://127.0.0.1:9")
    assert (root.url, root.describe("k")) == ("s3://some-bucket", "s3://some-bucket/k")
    with pytest.raises(ValueError, match="no bucket"):
        open_storage("s3:///prefix")
    with pytest.raises(ValueError, match="5 MiB"):
        open_storage("s3://b-x/p", part_size=MiB, endpoint_url="http://127.0.0.1:9")
    with pytest.raises(TypeError, match="s3:// URLs only"):
        open_storage(str(tmp_path), part_size=8 * MiB)


def test_client_settings_come_from_boto3_configuration_and_kwargs_override(s3env, monkeypatch):
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "4")
    monkeypatch.setenv("AWS_RETRY_MODE", "adaptive")
    ckptstore.configure()  # the process config reads the environment (docs/configuration.md)
    st = S3Storage("cfg-bucket")
    assert st.client.meta.endpoint_url == s3env  # AWS_ENDPOINT_URL, no ckptstore setting
    assert st.client.meta.config.retries == {"mode": "adaptive", "total_max_attempts": 4}
    st = S3Storage("cfg-bucket", endpoint_url="http://127.0.0.1:9", max_attempts=2, retry_mode="standard",
                   connect_timeout=3, read_timeout=7)
    assert st.client.meta.endpoint_url == "http://127.0.0.1:9"
    assert st.client.meta.config.retries == {"mode": "standard", "total_max_attempts": 2}
    assert (st.client.meta.config.connect_timeout, st.client.meta.config.read_timeout) == (3, 7)
    monkeypatch.delenv("AWS_MAX_ATTEMPTS")
    monkeypatch.delenv("AWS_RETRY_MODE")
    ckptstore.configure()
    assert S3Storage("cfg-bucket").client.meta.config.retries == {"mode": "standard", "total_max_attempts": 10}


def test_conftest_factory_gives_a_fresh_empty_store(request, tmp_path):
    st = s3util.s3_storage_factory(request, tmp_path)
    assert isinstance(st, S3Storage)
    assert st.list("") == [] and list(st.walk()) == []
    st.put("x/y", b"1")
    assert st.read("x/y") == b"1"
    assert s3util.s3_storage_factory(request, tmp_path).list("") == []


# ---------------------------------------------------------------------------- basic operations
def test_put_read_list_walk_stat_delete(bucket, admin):
    st = s3util.s3_storage(bucket, "root")
    st.put("a/b/c.bin", b"xyz")
    st.put("a/d", memoryview(b"12345"))
    st.put("top", bytearray(b"t"))
    admin.put_object(Bucket=bucket, Key="root/a/e/", Body=b"")  # a console-made "folder" marker
    admin.put_object(Bucket=bucket, Key="rootless", Body=b"x")  # shares the prefix string only
    assert st.list("") == ["a/", "top"]
    assert st.list("a/") == ["b/", "d", "e/"]
    assert st.list("nothing-here") == []
    assert sorted(i.key for i in st.walk()) == ["a/b/c.bin", "a/d", "top"]
    assert [i.key for i in st.walk("a/b")] == ["a/b/c.bin"]
    info = st.stat("a/d")
    assert (info.key, info.size) == ("a/d", 5) and info.mtime > 1e9
    assert st.read("a/d") == b"12345" and st.read("a/d", 1, 3) == b"234" and st.read("a/d", 2) == b"345"
    assert st.child("a").read("d") == b"12345" and st.child("a").list("") == ["b/", "d", "e/"]
    assert st.exists("a/d") and not st.exists("a/zz")
    st.delete("a/d")
    st.delete("a/d")  # missing: not an error
    with pytest.raises(ObjectNotFoundError) as ei:
        st.stat("a/d")
    assert f"s3://{bucket}/root/a/d" in str(ei.value)
    with pytest.raises(FileNotFoundError):
        st.read("never")
    st.delete_prefix("a/")
    assert [i.key for i in st.walk()] == ["top"]
    assert keys(admin, bucket) == ["root/top", "rootless"]


def test_walk_pages_and_delete_prefix_batches_past_1000_keys(bucket, admin, proxy):
    names = [f"many/k{i:05d}" for i in range(1003)]
    with ThreadPoolExecutor(8) as ex:
        list(ex.map(lambda k: admin.put_object(Bucket=bucket, Key=k, Body=b"."), names))
    st = s3util.s3_storage(bucket, "", proxy.url)
    assert [i.key for i in st.walk("many/")] == names
    assert len(st.list("many")) == 1003
    proxy.clear()
    st.delete_prefix("many/")
    assert keys(admin, bucket) == []
    assert [r.op for r in proxy.requests() if r.op == "DeleteObjects"] == ["DeleteObjects"] * 2


def test_I1_put_if_absent_is_create_only(bucket, proxy):
    st = s3util.s3_storage(bucket, "c", proxy.url)
    st.put("manifest-0000000001.json", b"first", if_absent=True)
    with pytest.raises(AlreadyExistsError) as ei:
        st.put("manifest-0000000001.json", b"second", if_absent=True)
    assert f"s3://{bucket}/c/manifest-0000000001.json" in str(ei.value)
    assert st.read("manifest-0000000001.json") == b"first"
    assert [r.status for r in proxy.requests("PutObject")] == [200, 412]
    st.put("pin.json", b"1")
    st.put("pin.json", b"2")  # a plain put replaces
    assert st.read("pin.json") == b"2"
    # S3's 409 ConditionalRequestConflict (a concurrent conditional write of the key) is
    # retried, as AWS says, not taken for a lost race (tests/test_s3_conditional.py)
    proxy.clear()
    proxy.script(("PutObject", "canned:409:ConditionalRequestConflict"))
    st.put("manifest-0000000002.json", b"x", if_absent=True)
    assert [r.status for r in proxy.requests("PutObject")] == [409, 200]
    assert st.read("manifest-0000000002.json") == b"x"


def test_I1_create_only_put_whose_lost_first_attempt_landed_succeeds(bucket, proxy):
    st = s3util.s3_storage(bucket, "c", proxy.url)
    proxy.script(("PutObject", "reset-after"))  # moto stored it; the client saw a reset
    st.put("vote-r00000.json", b"mine", if_absent=True)
    assert [(r.attempt, r.status) for r in proxy.requests("PutObject")] == [(1, None), (2, 412)]
    assert st.read("vote-r00000.json") == b"mine"
    # Other bytes under the key stay a conflict, retried or not.
    proxy.clear()
    proxy.script(("PutObject", "error500-before"))
    with pytest.raises(AlreadyExistsError):
        st.put("vote-r00000.json", b"theirs", if_absent=True)
    assert [(r.attempt, r.status) for r in proxy.requests("PutObject")] == [(1, 500), (2, 412)]
    assert st.read("vote-r00000.json") == b"mine"
    # Every attempt fails, the first after moto stored it: read back, it landed.
    proxy.clear()
    proxy.script(("PutObject", "reset-after"), ("PutObject", "error500-before"), ("PutObject", "slowdown"))
    st.put("manifest-0000000001.json", b"ours", if_absent=True)
    assert [r.status for r in proxy.requests("PutObject")] == [None, 500, 503]
    assert st.read("manifest-0000000001.json") == b"ours"
    # Every attempt fails before reaching moto: a transient error, and nothing stored.
    proxy.script(*[("PutObject", "slowdown")] * 3)
    with pytest.raises(TransientStorageError, match="SlowDown"):
        st.put("manifest-0000000002.json", b"ours", if_absent=True)
    assert not st.exists("manifest-0000000002.json")


# ---------------------------------------------------------------------------- appends
def test_append_offsets_follow_arrival_order_from_many_threads(bucket):
    st = s3util.s3_storage(bucket, "ap", max_concurrency=3)
    rng = random.Random(7)
    pieces = [rng.randbytes(rng.randrange(1, 700_000)) for _ in range(40)]
    w = st.open_append("data.bin")
    with ThreadPoolExecutor(8) as ex:
        offsets = list(ex.map(w.append, pieces))
    total = sum(map(len, pieces))
    assert w.close() == total
    order = sorted(range(len(pieces)), key=lambda i: offsets[i])
    assert [offsets[i] for i in order] == list(accumulate([0] + [len(pieces[i]) for i in order[:-1]]))
    data = st.read("data.bin")
    assert len(data) == total
    for i, off in enumerate(offsets):
        assert data[off:off + len(pieces[i])] == pieces[i]


def test_the_append_writer_needs_of_its_store_only_an_upload_target(bucket):
    """writer.py reaches the store that opens it only through an UploadTarget (client,
    bucket, keys, the name its messages use, the store's translate, put and delete):
    a target made by hand uploads, names its object, and uses its put and delete."""
    from ckptstore.storage.s3.writer import UploadTarget, _S3AppendWriter

    st = s3util.s3_storage(bucket, "tg")
    calls = []

    def target(key: str) -> UploadTarget:
        return UploadTarget(client=st.client, bucket=st.bucket, key=key, full_key=f"tg/{key}", where=f"<{key}>",
                            translate=lambda e: StorageError(f"<{key}> failed: {e}"),
                            put=lambda data: calls.append(("put", key, bytes(data))),
                            delete=lambda: calls.append(("delete", key)))

    w = _S3AppendWriter(target("x.bin"), st.part_plan())
    assert w.key == "x.bin" and w.append(b"abc") == 0 and w.append(b"de") == 3 and w.close() == 5
    assert st.read("x.bin") == b"abcde"
    with pytest.raises(StorageError, match="^<x.bin>: append after close or abort$"):
        w.append(b"f")
    w.abort()  # after it completed: the target's delete
    hint = 4 * st.part_size
    w = _S3AppendWriter(target("empty.bin"), st.part_plan(size_hint=hint), size_hint=hint)
    assert w.close() == 0  # multipart from the start, nothing appended: the target's put
    assert calls == [("delete", "x.bin"), ("put", "empty.bin", b"")]
    assert not st.exists("empty.bin")

def test_append_streams_a_multipart_upload_in_part_size_parts(bucket, proxy):
    st = s3util.s3_storage(bucket, "mp", proxy.url)
    data = random.Random(1).randbytes(20_000_000)
    w = st.open_append("big.bin")
    for i in range(0, len(data), MiB):
        w.append(data[i:i + MiB])
    assert w.close() == len(data)
    ops = [r.op for r in proxy.requests()]
    assert (ops[0], ops.count("CreateMultipartUpload"), ops[-1]) == ("HeadObject", 1, "CompleteMultipartUpload")
    parts = sorted(proxy.requests("UploadPart"), key=lambda r: r.part_number)
    assert [r.sent for r in parts] == [5 * MiB] * 3 + [20_000_000 - 15 * MiB]
    assert st.read("big.bin") == data
    # An object under one part goes up as one PutObject.
    proxy.clear()
    w = st.open_append("small.bin")
    assert (w.append(b"abc"), w.append(b""), w.append(b"de")) == (0, 3, 3)
    assert w.close() == 5
    assert [r.op for r in proxy.requests()] == ["HeadObject", "PutObject"]
    assert st.read("small.bin") == b"abcde"


def test_part_sizes_grow_so_no_object_needs_more_than_10000_parts(bucket, proxy):
    default = S3Storage("b-parts", endpoint_url="http://127.0.0.1:9")  # 16 MiB parts
    assert default.part_size_for(1000) == 16 * MiB and default.part_size_for(1001) == 32 * MiB
    assert sum(default.part_size_for(n) for n in range(1, 10_001)) > 12 * 2**40  # 12.7 TiB unhinted at 16 MiB
    assert max(default.part_size_for(n) for n in range(1, 10_001)) == 5 * 2**30  # S3's largest part
    st = s3util.s3_storage(bucket, "grow", proxy.url, _parts_per_tier=2)
    assert [st.part_size_for(n) // MiB for n in range(1, 8)] == [5, 5, 10, 10, 20, 20, 40]
    data = random.Random(2).randbytes(38 * MiB)
    w = st.open_append("g.bin")
    for i in range(0, len(data), 3 * MiB):
        w.append(data[i:i + 3 * MiB])
    assert w.close() == len(data)
    parts = sorted(proxy.requests("UploadPart"), key=lambda r: r.part_number)
    assert [r.sent // MiB for r in parts] == [5, 5, 10, 10, 8]
    assert st.read("g.bin") == data


def test_an_object_of_exactly_the_part_limit_uploads_and_one_more_part_fails(bucket, proxy, monkeypatch):
    """S3 takes at most MAX_PARTS parts (lowered to 3 here): an object of exactly that
    many uploads (the read that finds the end of the stream is no part); one more byte
    fails the upload naming the limit."""
    from ckptstore.storage.s3 import writer as writer_module

    monkeypatch.setattr(writer_module, "MAX_PARTS", 3)
    st = s3util.s3_storage(bucket, "lim", proxy.url)  # 5 MiB parts
    data = random.Random(9).randbytes(15 * MiB)
    w = st.open_append("three.bin")
    for i in range(0, len(data), MiB):
        w.append(data[i:i + MiB])
    assert w.close() == len(data)
    assert st.read("three.bin") == data
    w = st.open_append("four.bin")
    with pytest.raises(StorageError, match="3 parts"):
        for i in range(0, len(data), MiB):
            w.append(data[i:i + MiB])
        w.append(b"x")
        w.close()
    w.abort()
    assert not st.exists("four.bin")


def test_append_memory_is_bounded_by_back_pressure(bucket, proxy):
    st = s3util.s3_storage(bucket, "bp", proxy.url, max_concurrency=2)
    w = st.open_append("bp.bin")
    piece, count = random.Random(3).randbytes(MiB), 64
    errors: list[BaseException] = []
    proxy.hold("UploadPart")  # nothing drains until released

    def produce():
        try:
            for _ in range(count):
                w.append(piece)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    t = threading.Thread(target=produce)
    t.start()
    try:
        assert proxy.wait_for(lambda p: p.held == 2)  # both request threads sit in UploadPart
        with w._cv:
            assert w._cv.wait_for(lambda: w._queued >= w._limit(), timeout=60)  # queue full: appends wait
            accepted = w._size
        # in flight (2) + read and waiting for a slot (1) + the queue (2 parts) + one append
        assert accepted <= 3 * 5 * MiB + 2 * 5 * MiB + MiB < count * MiB
    finally:
        proxy.release()
        t.join()
    assert errors == []
    assert w.close() == count * MiB
    assert st.read("bp.bin") == piece * count


def test_abort_aborts_the_multipart_upload_and_never_raises(bucket, proxy, admin):
    st = s3util.s3_storage(bucket, "ab", proxy.url)
    w = st.open_append("a.bin")
    w.append(random.Random(4).randbytes(11 * MiB))
    assert proxy.wait_for(lambda p: any(r.op == "UploadPart" and r.status == 200 for r in p.log))
    assert uploads(admin, bucket) == ["ab/a.bin"]
    w.abort()
    w.abort()
    assert uploads(admin, bucket) == []
    assert [r.status for r in proxy.requests("AbortMultipartUpload")] == [204]
    assert not st.exists("a.bin")
    with pytest.raises(StorageError):
        w.append(b"more")
    # Abort after a failed upload: nothing to raise either.
    w = st.open_append("b.bin")
    proxy.configure(deny=1.0, ops={"CreateMultipartUpload"})
    with pytest.raises(StoragePermissionError, match=f"s3://{bucket}/ab/b.bin"):
        for _ in range(1000):  # appends fail once the upload has (the queue is bounded)
            w.append(bytes(MiB))
    w.abort()
    assert uploads(admin, bucket) == [] and not st.exists("b.bin")


def test_open_append_empty_object_and_existing_key(bucket):
    st = s3util.s3_storage(bucket, "e")
    w = st.open_append("empty.bin")
    assert w.close() == 0
    assert st.read("empty.bin") == b"" and st.stat("empty.bin").size == 0
    with pytest.raises(AlreadyExistsError):
        st.open_append("empty.bin")


def test_a_hint_of_two_parts_or_more_starts_the_multipart_upload_before_any_append(bucket, proxy, admin):
    """With a size hint of at least two parts, CreateMultipartUpload goes out at open, not
    after a whole part was read: its round trip overlaps the first part's encoding. A
    hint that overestimates still gives the exact object, one part or none."""
    st = s3util.s3_storage(bucket, "early", proxy.url)  # 5 MiB parts
    w = st.open_append("h.bin", size_hint=12 * MiB)
    assert proxy.wait_for(lambda p: any(r.op == "CreateMultipartUpload" and r.status == 200 for r in p.log))
    assert uploads(admin, bucket) == ["early/h.bin"]  # and not a byte appended yet
    data = random.Random(8).randbytes(12 * MiB)
    for i in range(0, len(data), MiB):
        w.append(data[i:i + MiB])
    assert w.close() == len(data)
    assert st.read("h.bin") == data
    # Less than a part after all: a multipart upload of one part.
    proxy.clear()
    w = st.open_append("small.bin", size_hint=12 * MiB)
    w.append(b"abc")
    assert w.close() == 3
    ops = [r.op for r in proxy.requests()]
    assert (ops.count("UploadPart"), ops[-1]) == (1, "CompleteMultipartUpload")
    assert st.read("small.bin") == b"abc"
    # Nothing at all: the multipart upload (which cannot complete without a part) is
    # aborted, and the empty object stored with one PutObject.
    proxy.clear()
    w = st.open_append("none.bin", size_hint=12 * MiB)
    assert w.close() == 0
    assert st.read("none.bin") == b"" and uploads(admin, bucket) == []
    assert "CompleteMultipartUpload" not in [r.op for r in proxy.requests()]
    # Under two parts: s3transfer still reads the first part to choose, as before.
    proxy.clear()
    w = st.open_append("tiny.bin", size_hint=8 * MiB)
    w.append(b"xyz")
    assert w.close() == 3
    assert [r.op for r in proxy.requests()] == ["HeadObject", "PutObject"]


def test_a_save_opens_its_s3_data_file_beside_staging_and_drops_it_if_nothing_is_written(bucket, proxy, admin):
    """RankWriter.open_soon opens the data file on an I/O thread (HEAD and
    CreateMultipartUpload while the caller stages); a writer that then appends
    nothing leaves no object and no upload behind, as if it never opened."""
    from ckptstore.pipeline import RankWriter

    st = s3util.s3_storage(bucket, "soon", proxy.url)
    w = RankWriter(st, fmt.new_attempt_id(), 0, CompressionPolicy(mode="none"))
    w.size_hint = lambda: 64 * MiB  # counted on the I/O thread
    w.open_soon()
    w.open_soon()  # once
    assert proxy.wait_for(lambda p: any(r.op == "CreateMultipartUpload" and r.status == 200 for r in p.log))
    w.close()
    ops = [r.op for r in proxy.requests()]
    assert (ops.count("HeadObject"), ops.count("CreateMultipartUpload"), ops.count("AbortMultipartUpload")) == (1, 1, 1)
    assert uploads(admin, bucket) == [] and keys(admin, bucket, "soon/") == []
    # A whole save: the data file's upload starts at once, and the checkpoint is exact.
    state = {"w": torch.arange(3 * MiB, dtype=torch.float32)}  # 12 MiB: more than a 5 MiB part
    proxy.clear()
    save_via(st.child("full"), state).result(timeout=120)
    full = st.child("full")
    assert_same(restore(full, latest_manifest(full), 0), state)


def test_a_save_failing_while_staging_does_not_wait_for_its_data_files_open(bucket, proxy, admin):
    """The data file opens on an I/O thread beside staging; a save that fails in staging
    raises at once, without waiting for that open's round trips (held here), and the
    open, once it ends, drops its upload itself."""
    st = s3util.s3_storage(bucket, "fail", proxy.url)
    proxy.hold("HeadObject")
    outcome = {}
    done = threading.Event()

    class RefusedOnceTheOpenWaits:
        """Refused by the pickler, but only once the open sits in its HeadObject (a
        failure before the open began would prove nothing, and a loaded machine could
        get there first)."""

        def __reduce__(self):
            proxy.wait_for(lambda p: p.held == 1)
            raise pickle.PicklingError("this object refuses to be pickled")

    def save():
        try:  # 24 MiB of tensors (the open starts), then something pickle refuses
            save_via(st, {"w": torch.zeros(6 * MiB), "bad": RefusedOnceTheOpenWaits()}).result(timeout=120)
        except BaseException as e:
            outcome["error"] = e
        finally:
            done.set()

    t = threading.Thread(target=save)
    t.start()
    try:
        assert proxy.wait_for(lambda p: p.held == 1)  # the open sits in its HeadObject
        assert done.wait(60), "the failed save waited for the data file's open"
    finally:
        proxy.release()
        t.join()
    assert "refuses to be pickled" in str(outcome["error"]), outcome
    assert proxy.wait_for(lambda p: not uploads(admin, bucket))
    assert keys(admin, bucket, "fail/") == []


# ---------------------------------------------------------------------------- reads
def test_readinto_splits_large_ranges_into_concurrent_ranged_gets(bucket, proxy, admin):
    data = random.Random(5).randbytes(23 * MiB)
    admin.put_object(Bucket=bucket, Key="rd/obj", Body=data)
    st = s3util.s3_storage(bucket, "rd", proxy.url)  # 5 MiB ranges, 4 in parallel
    buf = bytearray(21 * MiB)
    pieces: list[bytes] = []
    proxy.hold("GetObject")
    reader = threading.Thread(target=st.readinto, args=("obj", 1000, memoryview(buf)),
                              kwargs={"on_piece": lambda mv: pieces.append(bytes(mv))})
    reader.start()
    try:
        assert proxy.wait_for(lambda p: p.held >= 4)  # several GETs in flight at once
    finally:
        proxy.release()
        reader.join()
    assert buf == data[1000:1000 + 21 * MiB]
    assert b"".join(pieces) == buf and max(map(len, pieces)) <= 5 * MiB  # every byte once, in order
    gets = proxy.requests("GetObject")
    starts = [1000 + i * 5 * MiB for i in range(5)]
    assert sorted(r.byte_range for r in gets) == [(s, min(s + 5 * MiB, 1000 + 21 * MiB) - 1) for s in starts]
    assert sum(r.received for r in gets) == 21 * MiB
    proxy.clear()
    small = bytearray(100)
    st.readinto("obj", 7, small)
    assert small == data[7:107] and [r.byte_range for r in proxy.requests()] == [(7, 106)]


def test_short_reads_raise_truncated_object_error_naming_the_url(bucket, admin):
    admin.put_object(Bucket=bucket, Key="sr/obj", Body=b"0123456789")
    st = s3util.s3_storage(bucket, "sr")
    with pytest.raises(TruncatedObjectError, match="short read") as ei:
        st.readinto("obj", 5, memoryview(bytearray(10)))  # runs past the end
    assert f"s3://{bucket}/sr/obj" in str(ei.value)
    with pytest.raises(TruncatedObjectError, match="short read"):
        st.readinto("obj", 10, memoryview(bytearray(1)))  # starts past the end (416)
    with pytest.raises(TruncatedObjectError, match="short read"):
        st.readinto("obj", 0, memoryview(bytearray(12 * MiB)))  # split into several ranges
    with pytest.raises(ObjectNotFoundError):
        st.readinto("missing", 0, memoryview(bytearray(0)))


def test_readinto_resumes_after_a_body_cut_mid_stream(bucket, proxy, admin):
    data = random.Random(6).randbytes(3 * MiB)
    admin.put_object(Bucket=bucket, Key="mb/obj", Body=data)
    st = s3util.s3_storage(bucket, "mb", proxy.url)
    proxy.script(("GetObject", "truncate"))  # headers, half the body, then a reset
    buf = bytearray(3 * MiB - 7)
    pieces: list[bytes] = []
    st.readinto("obj", 7, buf, on_piece=lambda mv: pieces.append(bytes(mv)))
    assert buf == data[7:] and b"".join(pieces) == buf  # no piece handed over twice
    first, second = proxy.requests("GetObject")
    assert first.fault == "truncate" and first.byte_range == (7, 3 * MiB - 1)
    assert 7 <= second.byte_range[0] <= 7 + first.received and second.byte_range[1] == 3 * MiB - 1
    proxy.clear()
    proxy.script(("GetObject", "truncate"))
    assert st.read("obj") == data  # whole-object reads recover too
    assert [r.fault for r in proxy.requests("GetObject")] == ["truncate", None]


def test_I3_truncated_data_object_is_an_integrity_error_on_load(s3env, bucket, admin):
    url = f"s3://{bucket}/ck"
    ckptstore.save(make_state(300_000), url).result()
    data_key = next(k for k in keys(admin, bucket) if k.endswith(".bin"))
    body = admin.get_object(Bucket=bucket, Key=data_key)["Body"].read()
    admin.put_object(Bucket=bucket, Key=data_key, Body=body[: len(body) // 2])
    with pytest.raises(IntegrityError, match="truncated"):
        ckptstore.load(url)
    problems = ckptstore.verify(url)
    assert problems and all("truncated" in p.message for p in problems)


# ---------------------------------------------------------------------------- error classes
@pytest.mark.parametrize("code", ["AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"])
def test_permission_errors_fail_at_once_naming_the_url(bucket, proxy, code):
    st = s3util.s3_storage(bucket, "perm", proxy.url, max_attempts=5)
    proxy.deny_code = (code, "denied by the test")
    proxy.configure(deny=1.0)
    with pytest.raises(StoragePermissionError) as ei:
        st.put("k", b"v")
    assert f"s3://{bucket}/perm/k" in str(ei.value) and code in str(ei.value)
    with pytest.raises(PermissionError):
        st.read("k")
    with pytest.raises(StoragePermissionError):
        st.stat("k")  # HEAD: a bare 403
    with pytest.raises(StoragePermissionError, match=f"s3://{bucket}/perm"):
        st.list("")
    assert [r.attempt for r in proxy.requests()] == [1, 1, 1, 1]  # no retries


def test_missing_bucket_is_a_permanent_error_naming_the_url(proxy):
    st = s3util.s3_storage("ckpt-no-such-bucket", "p", proxy.url, max_attempts=5)
    for call in (lambda: st.put("k", b"1"), lambda: st.list(""), lambda: st.read("k", 0, 4)):
        with pytest.raises(StorageError, match="bucket 'ckpt-no-such-bucket' does not exist") as ei:
            call()
        assert "s3://ckpt-no-such-bucket/p" in str(ei.value)
        assert not isinstance(ei.value, TransientStorageError)
    assert [r.attempt for r in proxy.requests()] == [1, 1, 1]


def test_transient_faults_are_retried_by_botocore(bucket, proxy):
    st = s3util.s3_storage(bucket, "tr", proxy.url, max_attempts=4, read_timeout=1.0)
    proxy.script(("PutObject", "slowdown"), ("PutObject", "error500-before"), ("PutObject", "reset-before"))
    st.put("k", b"v")
    assert [(r.attempt, r.status) for r in proxy.requests("PutObject")] == [(1, 503), (2, 500), (3, None), (4, 200)]
    proxy.clear()
    proxy.script(("HeadObject", "stall-before"))  # longer than the read timeout
    assert st.stat("k").size == 1
    assert [r.attempt for r in proxy.requests("HeadObject")] == [1, 2]
    proxy.clear()
    proxy.configure(slowdown=1.0)
    with pytest.raises(TransientStorageError) as ei:
        st.put("k2", b"v")
    assert f"s3://{bucket}/tr/k2" in str(ei.value) and "SlowDown" in str(ei.value) and "4 attempt" in str(ei.value)
    assert [r.attempt for r in proxy.requests()] == [1, 2, 3, 4]


# ---------------------------------------------------------------------------- the API on s3:// URLs
def test_save_load_roundtrip_and_generations_through_s3_urls(s3env, bucket, admin):
    url = f"s3://{bucket}/runs/latest.pt"
    state = make_state(20_000_000, seed=1)  # above the 16 MiB default part: multipart
    m1 = ckptstore.save(state, url).result()
    assert m1.generation == 1
    assert_same(ckptstore.load(url), state)
    assert ckptstore.verify(url) == []
    data_key = f"runs/latest.pt/{fmt.data_file_name(m1.attempt, 0, 0)}"
    assert admin.head_object(Bucket=bucket, Key=data_key)["ETag"].endswith('-2"')  # two parts
    state2 = make_state(1_000_000, seed=2)
    m2 = ckptstore.save(state2, url).result()  # I6: a new generation, the old one retired after
    assert m2.generation == 2
    assert keys(admin, bucket, "runs/latest.pt/manifest") == ["runs/latest.pt/manifest-0000000002.json"]
    assert keys(admin, bucket, f"runs/latest.pt/attempts/{m1.attempt}/") == []
    assert_same(ckptstore.load(url), state2)
    with pytest.raises(CheckpointNotFoundError):
        ckptstore.load(f"s3://{bucket}/runs/nothing")


def test_store_save_steps_load_verify_on_s3(s3env, bucket):
    store = ckptstore.Store(f"s3://{bucket}/run")
    for step in (10, 20, 30):
        store.save(step, {"w": torch.full((1000,), float(step)), "step": step}, metrics={"loss": 1 / step}).result()
    assert store.steps() == [10, 20, 30] and store.latest() == 30
    out = store.load(20)
    assert out["step"] == 20 and torch.equal(out["w"], torch.full((1000,), 20.0))
    assert store.load()["step"] == 30
    assert store.manifest(30).metrics == {"loss": 1 / 30}
    assert ckptstore.verify(store.location(30)) == []
    assert ckptstore.verify(f"s3://{bucket}/run/step-000000000010") == []


def test_save_with_5mib_parts_streams_a_multipart_upload(s3env, bucket, proxy):
    st = s3util.s3_storage(bucket, "mp", proxy.url)
    state = make_state(20_000_000, seed=3)
    m = save_via(st, state).result()
    parts = proxy.requests("UploadPart")
    assert len(parts) == 4 and {r.status for r in parts} == {200}
    assert sum(r.sent for r in parts) == st.stat(fmt.data_file_name(m.attempt, 0, 0)).size
    assert_same(ckptstore.load(f"s3://{bucket}/mp"), state)


def test_load_reads_only_the_byte_ranges_it_needs(s3env, bucket, proxy, monkeypatch):
    st = s3util.s3_storage(bucket, "two", proxy.url)
    states = [make_state(2_000_000, seed=10), make_state(3_000_000, seed=11)]
    attempt = fmt.new_attempt_id()
    rt1 = Runtime(workers=2)  # rank 1 commits on its own thread, as in its own process
    try:
        futures = [save_via(st, states[0], chunk_bytes=MiB, world_size=2, attempt=attempt),
                   save_via(st, states[1], chunk_bytes=MiB, rank=1, world_size=2, attempt=attempt, rt=rt1)]
        manifest = futures[0].result(timeout=120)
        assert futures[1].result(timeout=120).generation == manifest.generation
    finally:
        rt1.shutdown()
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.url)
    proxy.clear()
    assert_same(ckptstore.load(f"s3://{bucket}/two", rank=1), states[1])
    data_gets = [r for r in proxy.requests("GetObject") if r.key.endswith(".bin")]
    assert {r.key for r in data_gets} == {f"two/{fmt.data_file_name(attempt, 1, 0)}"}  # not rank 0's file
    assert all(r.byte_range is not None for r in data_gets)
    # rank 1's blobs and, in format version 4, its index (no other rank's)
    full = expand(st, manifest)
    assert sum(r.received for r in data_gets) == sum(b.length for rank, _k, b in full.blobs() if rank == 1)


def _tiny_tensors_state(n: int = 400) -> dict:
    """A state of many tiny tensors (biases, Adam step counters) and two 3 MiB ones."""
    g = torch.Generator().manual_seed(21)
    model, optim = {}, {}
    for i in range(n):
        model[f"l{i}.bias"] = torch.randn(1 + i % 200, generator=g)
        optim[f"l{i}.step"] = torch.tensor(float(i))
    model["embed"] = torch.randn(3 * MiB // 4, generator=g)
    model["head"] = torch.randn(3 * MiB // 4, generator=g)
    return {"model": model, "optim": optim}


def _via_proxy(monkeypatch, proxy) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.url)
    proxy.clear()


def test_load_of_many_tiny_tensors_coalesces_gets(s3env, bucket, proxy, monkeypatch):
    url = f"s3://{bucket}/tiny"
    state = _tiny_tensors_state()
    manifest = ckptstore.save(state, url, compression="none").result()
    blobs = [b for _, _, b in manifest.blobs()]
    big = [b for b in blobs if b.length > DEFAULT_COALESCE_BLOB]
    assert len(blobs) == 803 and len(big) == 2 and len(manifest.files()) == 1
    _via_proxy(monkeypatch, proxy)
    assert_same(ckptstore.load(url), state)
    gets = proxy.requests("GetObject")
    data_gets = [r for r in gets if r.key.endswith(".bin")]
    # Default settings: each big blob is one GET (under read_part_size) straight into its
    # tensor; the small blobs around and between them are one GET per run (the data
    # file is tiled by blobs, so no gaps): at most len(big) + 1 runs in one file.
    assert len(data_gets) <= len(big) + (len(big) + 1), [r.byte_range for r in data_gets]
    assert sorted(r.byte_range for r in data_gets if r.received > DEFAULT_COALESCE_BLOB) == sorted(
        (b.offset, b.offset + b.length - 1) for b in big)
    assert sum(r.received for r in data_gets) == sum(b.length for b in blobs)  # every byte once
    assert [r.op for r in proxy.requests()].count("GetObject") == len(data_gets) + 1  # + the manifest
    # One HEAD per data file (its size bounds every blob extent before anything is
    # allocated), none per blob, none for the manifest (its size cap rides on its GET).
    heads = proxy.requests("HeadObject")
    assert sorted(r.key.rsplit("/", 1)[-1] for r in heads) == sorted(f.rsplit("/", 1)[-1] for f in manifest.files())
    assert {r.op for r in proxy.requests()} == {"ListObjectsV2", "GetObject", "HeadObject"}


def test_corrupt_small_blob_in_a_coalesced_get_is_reported_naming_its_tensor(s3env, bucket, proxy, admin, monkeypatch):
    url = f"s3://{bucket}/bad"
    state = _tiny_tensors_state()
    manifest = ckptstore.save(state, url, compression="none").result()
    key = "model.l200.bias"
    blob = manifest.ranks[0].tensors[key].chunks[0].blob
    obj = f"bad/{blob.file}"
    body = bytearray(admin.get_object(Bucket=bucket, Key=obj)["Body"].read())
    body[blob.offset + 3] ^= 0x01
    admin.put_object(Bucket=bucket, Key=obj, Body=bytes(body))
    _via_proxy(monkeypatch, proxy)
    with pytest.raises(IntegrityError) as ei:
        ckptstore.load(url)
    msg = str(ei.value)
    assert f"tensor {key!r}" in msg and blob.file in msg and f"offset {blob.offset}," in msg and "xxh3" in msg
    assert len([r for r in proxy.requests("GetObject") if r.key.endswith(".bin")]) <= 5  # still coalesced
    proxy.clear()
    problems = ckptstore.verify(url)  # verify (and the CLI's) reads the same way, checks every blob
    assert [(p.key, p.offset) for p in problems] == [(key, blob.offset)]
    gets = [r for r in proxy.requests("GetObject") if r.key.endswith(".bin")]
    assert len(gets) <= 5, [(r.range, r.attempt, r.status, r.fault, r.received) for r in gets]


def test_template_load_fetches_only_the_chunks_it_needs(s3env, bucket, proxy, monkeypatch):
    url = f"s3://{bucket}/tmpl"
    g = torch.Generator().manual_seed(22)
    state = {"model": {"a": torch.randn(64, 4096, generator=g), "skip": torch.randn(64, 4096, generator=g),
                       "tiny": torch.ones(3)},
             "optim": {"step": torch.tensor(7.0)}}
    store = ckptstore.Store(url, chunk_bytes=128 * 1024, compression="none")  # 128 KiB > the 64 KiB gap
    store.save(1, state, replicated=["model.*"]).result()
    manifest = store.manifest(1)
    a_blobs = [c.blob for c in manifest.tensors["model.a"].chunks]
    needed = a_blobs + [b for _, b in manifest.ranks[0].blobs()]  # the rank's own: skeleton, step
    _via_proxy(monkeypatch, proxy)
    out = ckptstore.Store(url).load(1, template={"model": {"a": torch.zeros(64, 4096)}})
    assert torch.equal(out["model"]["a"], state["model"]["a"]) and out["optim"]["step"] == 7.0
    ranges = [r.byte_range for r in proxy.requests("GetObject") if r.key.endswith(".bin")]
    fetched = [b for _, _, b in manifest.blobs() if any(b.offset <= hi and lo < b.offset + b.length for lo, hi in ranges)]
    # Only needed blobs, and at most small ones bridged in a gap; none of "skip".
    assert all(b in needed or b.length <= DEFAULT_COALESCE_GAP for b in fetched), fetched
    assert not any(c.blob in fetched for c in manifest.tensors["model.skip"].chunks)
    assert sum(hi - lo + 1 for lo, hi in ranges) <= sum(b.length for b in needed) + DEFAULT_COALESCE_GAP * len(ranges)
    # At most one GET per run of neighbours in the file: the template's chunks (read by
    # fill_template) and the rank's own blobs (read by restore) each.
    in_file = sorted((b for _, _, b in manifest.blobs()), key=lambda b: b.offset)

    def runs(group: list) -> int:
        return sum(1 for i, b in enumerate(in_file) if b in group and (i == 0 or in_file[i - 1] not in group))

    own = [b for _, b in manifest.ranks[0].blobs()]
    assert len(ranges) <= runs(a_blobs) + runs(own) < len(needed), ranges


# ---------------------------------------------------------------------------- CLI
def test_cli_ls_and_verify_on_an_s3_url(s3env, bucket, admin):
    url = f"s3://{bucket}/run"
    store = ckptstore.Store(url)
    for step in (1, 2):
        store.save(step, {"w": torch.full((2000,), float(step))}, metrics={"loss": 0.5 / step}).result()
    listing, verifying = start_cli(s3env, "ls", url, "--json"), start_cli(s3env, "verify", url, "--json")  # at once
    r = cli_result(listing)
    assert r.returncode == 0, r.stderr
    recs = json.loads(r.stdout)
    assert [(x["step"], x["committed"], x["url"]) for x in recs] == [
        (1, True, f"{url}/step-000000000001"), (2, True, f"{url}/step-000000000002")]
    r = cli_result(verifying)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["ok"] is True and len(report["checkpoints"]) == 2
    # Same length, other bytes: only a full verify (hashes) can tell.
    m = store.manifest(2)
    key = f"run/step-000000000002/{fmt.data_file_name(m.attempt, 0, 0)}"
    size = admin.head_object(Bucket=bucket, Key=key)["ContentLength"]
    admin.put_object(Bucket=bucket, Key=key, Body=b"\xa5" * size)
    verifying, missing = start_cli(s3env, "verify", url, "--json"), start_cli(s3env, "ls", f"s3://{bucket}-missing/run")
    r = cli_result(verifying)
    assert r.returncode == 1, r.stderr
    report = json.loads(r.stdout)
    assert [c["ok"] for c in report["checkpoints"]] == [True, False]
    assert "xxh3" in report["checkpoints"][1]["problems"][0]["message"]
    r = cli_result(missing)
    assert r.returncode == 2 and f"s3://{bucket}-missing/run" in r.stderr and "Traceback" not in r.stderr


def test_cli_gc_keeps_last_on_an_s3_url(s3env, bucket):
    url = f"s3://{bucket}/run"
    store = ckptstore.Store(url)
    for step in (1, 2, 3):
        store.save(step, {"w": torch.full((100,), float(step))}).result()
    r = run_cli(s3env, "gc", url, "--keep-last", "1", "--json")
    assert r.returncode == 0, r.stderr
    assert store.steps() == [3]
    # The dropped steps' files are released (a save in flight may reference them) ...
    assert json.loads(r.stdout)["released_bytes"] > 0
    attempt = store.storage.child("step-000000000001").list("attempts/")[0]
    assert store.storage.child("step-000000000001").exists(f"attempts/{attempt}released.json")
    # ... and go in a run after the grace (its mark's age comes from S3's LastModified).
    from ckptstore.checkpoint import gc as gc_mod
    from ckptstore.checkpoint.retention import Retention

    assert gc_mod.plan(store.storage, Retention(last=1)).deletions == []
    gc_mod.execute(store.storage, gc_mod.plan(store.storage, Retention(last=1), now=time.time() + 7 * 3600))
    assert store.storage.list("") == ["step-000000000003/"]


def test_cli_gc_aborts_stale_multipart_uploads_under_the_store(s3env, bucket, admin):
    url = f"s3://{bucket}/run"
    ckptstore.Store(url).save(1, {"w": torch.zeros(10)}).result()
    admin.create_multipart_upload(Bucket=bucket, Key="run/step-000000000002/attempts/x/data-r00000-s00.bin")
    admin.create_multipart_upload(Bucket=bucket, Key="elsewhere/data.bin")
    key = "step-000000000002/attempts/x/data-r00000-s00.bin"
    r = run_cli(s3env, "gc", url, "--grace", "1h", "--dry-run")  # moto dates uploads in 2010: stale
    assert r.returncode == 0, r.stderr
    assert f"would abort upload {key}" in r.stdout  # (the dry run listed none)
    r = run_cli(s3env, "gc", url, "--grace", "1h", "--dry-run", "--json")
    assert json.loads(r.stdout)["stale_uploads"] == [key] and len(uploads(admin, bucket)) == 2
    r = run_cli(s3env, "gc", url, "--grace", "1h", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["stale_uploads"] == [key]
    assert uploads(admin, bucket) == ["elsewhere/data.bin"]


def test_abort_stale_uploads_under_the_prefix_only(bucket, admin):
    st = s3util.s3_storage(bucket, "run")
    admin.create_multipart_upload(Bucket=bucket, Key="run/a/data.bin")
    admin.create_multipart_upload(Bucket=bucket, Key="runner/data.bin")
    assert st.abort_stale_uploads(older_than=100 * 365 * 86400.0) == []  # none that old
    assert st.abort_stale_uploads(older_than=0, dry_run=True) == ["a/data.bin"]
    assert uploads(admin, bucket) == ["run/a/data.bin", "runner/data.bin"]
    assert st.abort_stale_uploads(older_than=0) == ["a/data.bin"]
    assert uploads(admin, bucket) == ["runner/data.bin"]


# ---------------------------------------------------------------------------- faults end to end
@pytest.mark.parametrize("seed", range(5))
def test_faulty_network_saves_commit_bit_exact_or_fail_cleanly(s3env, bucket, proxy, admin, seed):
    st = s3util.s3_storage(bucket, f"f{seed}", proxy.url, max_attempts=5, read_timeout=1.0, connect_timeout=1.0)
    state = make_state(12_000_000, seed=seed)
    proxy.configure(seed=seed, slowdown=0.08, error500=0.08, reset=0.08, stall=0.03, truncate=0.06)
    future = save_via(st, state, chunk_bytes=4 * MiB)
    try:
        manifest, error = future.result(timeout=300), None
    except CkptStoreError as e:
        manifest, error = None, e
    # ...and a load through the same faulty network: bit-exact or a clean error.
    if manifest is not None:
        try:
            loaded = restore(st, latest_manifest(st), 0)
        except CkptStoreError:
            loaded = None
        if loaded is not None:
            assert_same(loaded, state)
    faults = [r.fault for r in proxy.requests() if r.fault]
    proxy.configure()  # faults off: inspect the outcome on a clean line
    url = f"s3://{bucket}/f{seed}"
    manifests = [k for k in keys(admin, bucket, f"f{seed}/") if "/manifest-" in k]
    assert faults, "the proxy injected no fault: raise the rates"
    if manifest is not None:
        assert manifests == [f"f{seed}/manifest-0000000001.json"]
        assert_same(ckptstore.load(url), state)
        assert ckptstore.verify(url) == []
    else:
        assert manifests == []  # nothing partial is visible
        assert url in str(error)
        with pytest.raises((NotCommittedError, CheckpointNotFoundError)):
            ckptstore.load(url)


def test_I1_a_save_whose_manifest_landed_is_committed_even_if_retiring_fails(s3env, bucket, proxy):
    """Once the manifest exists the checkpoint is visible (I1), so the save succeeded:
    a failure while retiring the previous generation afterwards must not fail it."""
    st = s3util.s3_storage(bucket, "ret", proxy.url, max_attempts=2)
    save_via(st, make_state(100_000, seed=1)).result()
    state = make_state(100_000, seed=2)

    def manifest_2_written(p):
        return any(r.op == "PutObject" and r.key.endswith(fmt.manifest_name(2)) and r.status == 200 for r in p.log)

    proxy.script(*[("ListObjectsV2", "slowdown", manifest_2_written)] * 2)  # the retire step's listing
    future = save_via(st, state)
    assert future.exception(timeout=120) is None
    assert future.result().generation == 2
    assert_same(ckptstore.load(f"s3://{bucket}/ret"), state)


def test_save_that_runs_out_of_retries_fails_its_future_and_commits_nothing(bucket, proxy, admin):
    st = s3util.s3_storage(bucket, "oor", proxy.url, max_attempts=3)
    proxy.configure(slowdown=1.0)
    future = save_via(st, make_state(1_000_000))
    with pytest.raises(TransientStorageError) as ei:
        future.result(timeout=120)
    assert f"s3://{bucket}/oor" in str(ei.value) and "HTTP 503, 3 attempts" in str(ei.value)
    reqs = proxy.requests()
    assert {r.status for r in reqs} == {503} and max(r.attempt for r in reqs) == 3
    assert len(reqs) <= 3 * 3  # a few operations, each tried 3 times: no storm
    assert keys(admin, bucket) == [] and uploads(admin, bucket) == []


def test_save_to_a_missing_bucket_fails_at_once_naming_the_url(s3env, proxy, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.url)
    url = "s3://ckpt-missing-bucket/run/latest.pt"
    future = ckptstore.save(make_state(100_000), url)  # default settings: 10 attempts
    with pytest.raises(StorageError, match="does not exist") as ei:
        future.result(timeout=60)
    assert url in str(ei.value) and not isinstance(ei.value, TransientStorageError)
    reqs = proxy.requests()
    assert reqs and [r.attempt for r in reqs] == [1] * len(reqs) and len(reqs) <= 6


def test_save_with_access_denied_fails_at_once_naming_the_url(s3env, bucket, proxy, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.url)
    proxy.configure(deny=1.0)
    url = f"s3://{bucket}/denied"
    future = ckptstore.save(make_state(100_000), url)
    with pytest.raises(StoragePermissionError) as ei:
        future.result(timeout=60)
    assert url in str(ei.value)
    reqs = proxy.requests()
    assert reqs and [r.attempt for r in reqs] == [1] * len(reqs) and len(reqs) <= 6


# ---------------------------------------------------------------------------- two writers
def test_I1_two_processes_racing_for_one_manifest_key_exactly_one_wins(s3env, bucket, admin):
    env = s3util.subprocess_env(s3env, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    names = ("alpha", "beta")
    procs = [subprocess.Popen([sys.executable, str(Path(s3util.__file__)), "race", bucket, "race", name],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env) for name in names]
    try:
        assert [p.stdout.readline().strip() for p in procs] == ["ready", "ready"]
        for i in range(1, 9):
            key = fmt.manifest_name(i)
            for p in procs:
                p.stdin.write(f"go {key}\n")
                p.stdin.flush()
            results = [p.stdout.readline().split() for p in procs]
            assert sorted(r[0] for r in results) == ["lost", "won"] and {r[1] for r in results} == {key}
            winner = names[[r[0] for r in results].index("won")]
            assert admin.get_object(Bucket=bucket, Key=f"race/{key}")["Body"].read() == f"{winner}:{key}".encode()
        # The whole commit path: both save the same checkpoint at once.
        url = f"s3://{bucket}/race/ckpt"
        for p in procs:
            p.stdin.write(f"save {url}\n")
            p.stdin.flush()
        outcomes = [p.stdout.readline().split() for p in procs]
        committed = [int(o[1]) for o in outcomes if o[0] == "committed"]
        assert all(o[0] in ("committed", "conflict") for o in outcomes) and committed
        assert len(set(committed)) == len(committed)  # never two commits of one generation
        assert latest_manifest(open_storage(url)).generation == max(committed)
        assert ckptstore.load(url)["who"] in names
        for p in procs:
            p.stdin.write("quit\n")
            p.stdin.flush()
        assert [p.wait(timeout=60) for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
