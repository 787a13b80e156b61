"""S3 as real object stores speak it on the wire (issue 19, items 3 and 4): batch deletes
and the stores that refuse botocore's DeleteObjects, botocore's request checksums over
HTTPS and the stores that refuse their trailers, and uniform multipart part sizes from
a size hint (R2 wants every part but the last equal). Against the moto server, through
the fault proxy of tests/s3util.py, which can also speak TLS to boto3 (a self-signed
certificate made per module) and answer in a store's place."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("boto3")
pytest.importorskip("moto.server")

import torch  # noqa: E402

import ckptstore  # noqa: E402
import s3util  # noqa: E402
from ckptstore import format as fmt  # noqa: E402
from ckptstore.checkpoint.promote import Throttle, copy_file  # noqa: E402
from ckptstore.checkpoint.references import ReferencingStorage  # noqa: E402
from ckptstore.checkpoint.restore import restore  # noqa: E402
from ckptstore.checkpoint.save import SaveOptions, start_save  # noqa: E402
from ckptstore.codecs import CompressionPolicy  # noqa: E402
from ckptstore.errors import FormatError, StorageError, StoragePermissionError  # noqa: E402
from ckptstore.runtime import Runtime, runtime  # noqa: E402
from ckptstore.storage import LocalStorage, MemoryStorage, open_storage  # noqa: E402
from ckptstore.storage.s3 import S3Storage  # noqa: E402
from ckptstore.storage.s3 import client as s3client  # noqa: E402
from ckptstore.storage.s3.writer import DEFAULT_UPLOAD_MEMORY, plan_parts  # noqa: E402
from ckptstore.storage.split import SplitStorage  # noqa: E402
from s3util import bucket, endpoint, proxy  # noqa: E402, F401 (fixtures)

MiB, GiB, TiB = 1 << 20, 1 << 30, 1 << 40
DEAD_ENDPOINT = "http://127.0.0.1:9"  # never contacted: client settings only


def _keys(endpoint_url: str, bucket_name: str) -> list[str]:
    resp = s3util.admin_client(endpoint_url).list_objects_v2(Bucket=bucket_name)
    return sorted(o["Key"] for o in resp.get("Contents", ()))


def _put_all(st, names) -> None:
    for name in names:
        st.put(name, name.encode())


def _save(storage, obj, *, rank: int = 0, world_size: int = 1, attempt: str | None = None, rt=None,
          chunk_bytes: int = 4 * MiB):
    return start_save(obj, storage, rt=rt or runtime(), attempt=attempt or fmt.new_attempt_id(), step=None,
                      rank=rank, world_size=world_size, metrics=None,
                      options=SaveOptions(compression=CompressionPolicy(mode="none"), chunk_bytes=chunk_bytes))


# ---------------------------------------------------------------------------- A: delete_many
def test_delete_many_is_deleteobjects_of_1000_keys_after_checking_every_key(bucket, proxy, endpoint):
    st = s3util.s3_storage(bucket, "dm", proxy.url)
    names = [f"a/k{i:04d}" for i in range(1003)]
    admin = s3util.admin_client(endpoint)
    for name in names:
        admin.put_object(Bucket=bucket, Key=f"dm/{name}", Body=b".")
    st.put("keep", b"k")
    with pytest.raises(FormatError, match=r"'\.\./escape'"):
        st.delete_many(["a/k0000", "../escape"])
    assert [r.op for r in proxy.requests()] == ["PutObject"]  # refused before any delete
    proxy.clear()
    st.delete_many(iter(names + ["a/never-written"]))  # any iterable; a missing key is no error
    assert _keys(endpoint, bucket) == ["dm/keep"]
    batches = proxy.requests("DeleteObjects")
    assert [r.status for r in batches] == [200, 200] and [r.op for r in proxy.requests()] == ["DeleteObjects"] * 2
    st.delete_many([])
    assert len(proxy.requests()) == 2


@pytest.mark.parametrize("refusal", ["canned:400:MissingContentMD5:Missing required header for this request: "
                                     "Content-Md5.",
                                     "canned:400:InvalidRequest:Missing required header for this request: "
                                     "Content-MD5"])
def test_a_store_refusing_deleteobjects_without_content_md5_gets_per_key_deletes(bucket, proxy, endpoint, refusal):
    """botocore >= 1.36 sends DeleteObjects with a CRC32 instead of Content-MD5; older
    MinIO answers 400 MissingContentMD5. The store deletes key by key, and remembers."""
    st = s3util.s3_storage(bucket, "md5", proxy.url)
    _put_all(st, [f"k{i}" for i in range(5)])
    proxy.clear()
    proxy.script(("DeleteObjects", refusal))
    st.delete_many([f"k{i}" for i in range(3)] + ["missing"])
    assert _keys(endpoint, bucket) == ["md5/k3", "md5/k4"]
    assert [r.status for r in proxy.requests("DeleteObjects")] == [400]
    assert sorted(r.key for r in proxy.requests("DeleteObject")) == ["md5/k0", "md5/k1", "md5/k2", "md5/missing"]
    proxy.clear()
    st.child("sub").delete_prefix("")  # the verdict is the store's, children included: no DeleteObjects again
    st.delete_many(["k3", "k4"])
    assert _keys(endpoint, bucket) == []
    assert [r.op for r in proxy.requests() if r.op.startswith("Delete")] == ["DeleteObject", "DeleteObject"]


def test_per_key_deletes_that_fail_name_the_first_key_and_the_count(bucket, proxy):
    st = s3util.s3_storage(bucket, "fail", proxy.url)
    _put_all(st, ["a", "b", "c"])
    proxy.script(("DeleteObjects", "canned:400:MissingContentMD5"))
    proxy.configure(deny=1.0, ops=["DeleteObject"])
    with pytest.raises(StorageError) as ei:
        st.delete_many(["a", "b", "c"])
    assert f"s3://{bucket}/fail/a: delete failed" in str(ei.value) and "3 key(s) not deleted" in str(ei.value)
    assert "AccessDenied" in str(ei.value)
    proxy.configure()
    assert st.list("") == ["a", "b", "c"]


def test_a_batch_delete_refused_otherwise_is_an_error_naming_the_url(bucket, proxy):
    st = s3util.s3_storage(bucket, "deny", proxy.url)
    _put_all(st, ["x"])
    proxy.script(("DeleteObjects", "deny"))
    with pytest.raises(StoragePermissionError, match=f"s3://{bucket}/deny/x"):
        st.delete_many(["x"])
    assert st.exists("x") and st._shared.batch_deletes  # no fallback for other errors


class _RecordingMemory(MemoryStorage):
    """A memory store that notes the keys it deletes, in order."""

    def __init__(self, name: str):
        super().__init__(name=name)
        self.deleted: list[str] = []

    def delete(self, key: str) -> None:
        self.deleted.append(key)
        super().delete(key)


def test_split_storage_sends_each_key_to_its_route_in_order():
    shared, data = _RecordingMemory("shared"), _RecordingMemory("data")
    split = SplitStorage(shared, data)
    names = ["attempts/a/data-r00001-s00.bin", "manifest-0000000002.json", "attempts/a/data-r00000-s00.bin",
             "attempts/a/vote-r00000.json", "manifest-0000000001.json"]
    _put_all(split, names)
    assert sorted(data.list("attempts/a/")) == ["data-r00000-s00.bin", "data-r00001-s00.bin"]
    with pytest.raises(FormatError):
        split.delete_many(["manifest-0000000001.json", "a//b"])
    assert shared.deleted == data.deleted == []
    split.delete_many(names)
    assert shared.deleted == ["manifest-0000000002.json", "attempts/a/vote-r00000.json", "manifest-0000000001.json"]
    assert data.deleted == ["attempts/a/data-r00001-s00.bin", "attempts/a/data-r00000-s00.bin"]
    assert list(split.walk("")) == []


def test_a_referencing_store_deletes_from_its_own_location():
    base = _RecordingMemory("refs")
    st = ReferencingStorage(base)
    _put_all(st, ["m", "n"])
    st.delete_many(["n", "m"])
    assert base.deleted == ["n", "m"] and base.list("") == []


# ---------------------------------------------------------------------------- B: checksums
def test_the_checksums_option_goes_into_botocores_config(monkeypatch):
    for k in ("AWS_REQUEST_CHECKSUM_CALCULATION", "AWS_RESPONSE_CHECKSUM_VALIDATION", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    st = open_storage("s3://b-sum/p", endpoint_url=DEAD_ENDPOINT, checksums="when_required")  # storage_options too
    cfg = st.client.meta.config
    assert (cfg.request_checksum_calculation, cfg.response_checksum_validation) == ("when_required",) * 2
    cfg = S3Storage("b-sum", endpoint_url=DEAD_ENDPOINT, checksums="when_supported").client.meta.config
    assert cfg.request_checksum_calculation == "when_supported"
    assert S3Storage("b-sum", endpoint_url=DEAD_ENDPOINT).client.meta.config.request_checksum_calculation \
        == "when_supported"  # botocore's default
    monkeypatch.setenv("AWS_REQUEST_CHECKSUM_CALCULATION", "when_required")  # None: botocore's own settings decide
    assert S3Storage("b-sum", endpoint_url=DEAD_ENDPOINT).client.meta.config.request_checksum_calculation \
        == "when_required"
    with pytest.raises(ValueError, match="checksums must be"):
        S3Storage("b-sum", endpoint_url=DEAD_ENDPOINT, checksums="sometimes")
    with pytest.raises(ValueError, match="ready client"):
        S3Storage("b-sum", client=st.client, checksums="when_required")


def test_the_checksums_option_is_a_no_op_on_a_botocore_without_it(monkeypatch):
    """botocore < 1.36 has no request_checksum_calculation, and only ever sends a
    checksum where an operation requires one: what "when_required" asks for."""
    from botocore.config import Config

    old = {k: v for k, v in Config.OPTION_DEFAULTS.items()
           if k not in ("request_checksum_calculation", "response_checksum_validation")}
    monkeypatch.setattr(Config, "OPTION_DEFAULTS", old)
    assert s3client.checksum_config("when_required") == {}
    assert s3client.checksum_config(None) == {}
    with pytest.raises(ValueError):
        s3client.checksum_config(s3client.check_checksums("always"))


@pytest.fixture(scope="module")
def tls_proxy(endpoint, tmp_path_factory):
    """A fault proxy that speaks HTTPS to boto3 (self-signed, made for this module) and
    HTTP to moto; yields (proxy, CA bundle path)."""
    cert = s3util.self_signed_cert(str(tmp_path_factory.mktemp("tls")))
    with s3util.FaultProxy(endpoint, tls=cert) as p:
        yield p, cert[0]


@pytest.fixture
def https(tls_proxy):
    p, ca = tls_proxy
    p.reset()
    yield p, ca
    p.reset()


def _refuses_trailers(r) -> bool:
    return "x-amz-trailer" in r.headers


R2_REFUSAL = "canned:501:NotImplemented:STREAMING-UNSIGNED-PAYLOAD-TRAILER not implemented"


def test_over_https_botocore_sends_checksum_trailers_unless_when_required(bucket, https):
    """The wire format the option controls: by default (botocore >= 1.36) every
    PutObject and UploadPart goes aws-chunked with a trailing CRC32; "when_required"
    sends plain bodies."""
    p, ca = https
    data = random.Random(4).randbytes(12 * MiB)  # a multipart data file: 3 parts
    for checksums, chunked in ((None, True), ("when_required", False)):
        p.clear()
        st = s3util.s3_storage(bucket, f"wire-{checksums}", p.url, verify=ca, checksums=checksums)
        w = st.open_append("data.bin")
        w.append(data)
        assert w.close() == len(data)
        st.put("vote.json", b"{}")
        bodies = p.requests("UploadPart") + p.requests("PutObject")
        assert len(bodies) == 4 and sorted(r.sent for r in bodies) == [2, 2 * MiB, 5 * MiB, 5 * MiB]
        for r in bodies:
            assert ("aws-chunked" in r.headers.get("content-encoding", "")) == chunked, (checksums, r.headers)
            assert (r.headers.get("x-amz-trailer") == "x-amz-checksum-crc32") == chunked, (checksums, r.headers)
            signed = r.headers["x-amz-content-sha256"]  # without a checksum SigV4 signs the payload's hash
            assert signed == "STREAMING-UNSIGNED-PAYLOAD-TRAILER" if chunked else len(signed) == 64, signed
        assert st.read("data.bin") == data


@pytest.mark.parametrize("refusal", [R2_REFUSAL, "canned:400:InvalidArgument:Invalid argument"])
def test_a_store_that_refuses_checksum_trailers_needs_when_required(bucket, https, monkeypatch, refusal):
    """A save over HTTPS to a store that refuses checksum trailers (R2's 501, or a 400
    that names nothing) fails naming the URL and the option; with it, it round-trips."""
    p, ca = https
    s3util.point_boto3_at(p.url, monkeypatch)
    monkeypatch.setenv("AWS_CA_BUNDLE", ca)
    p.answer(_refuses_trailers, refusal)
    state = {"w": torch.randn(3 * MiB // 4 + 5), "step": 7}  # ~3 MiB: one PutObject of the data file
    url = f"s3://{bucket}/run"
    with pytest.raises(StorageError) as ei:
        ckptstore.save(state, url).result(timeout=60)
    msg = str(ei.value)
    assert f"s3://{bucket}/run/" in msg and "'checksums': 'when_required'" in msg, msg
    assert p.requests() and all(r.status != 200 for r in p.requests() if _refuses_trailers(r))
    options = {"checksums": "when_required"}
    ckptstore.save(state, url, storage_options=options).result(timeout=60)
    loaded = ckptstore.load(url, storage_options=options)
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 7
    assert not any(_refuses_trailers(r) for r in p.requests() if r.status == 200)


def test_the_probe_does_not_take_a_trailer_refusal_for_a_verdict_on_if_none_match(bucket, https):
    p, ca = https
    p.answer(_refuses_trailers, R2_REFUSAL)
    st = s3util.s3_storage(bucket, "probe", p.url, verify=ca, conditional_writes="probe")
    with pytest.raises(StorageError, match="when_required") as ei:
        st.put("vote-r00000.json", b"v", if_absent=True)
    assert "If-None-Match" not in str(ei.value)
    ok = s3util.s3_storage(bucket, "probe", p.url, verify=ca, conditional_writes="probe", checksums="when_required")
    ok.put("vote-r00000.json", b"v", if_absent=True)  # nothing was cached: this store probes, and passes
    assert ok.read("vote-r00000.json") == b"v"


def test_the_checksum_hint_only_goes_with_errors_that_may_be_about_checksums(bucket, proxy):
    """Over plain HTTP nothing carries a trailer: a refusal whose text names checksums
    gets the hint, other errors do not."""
    st = s3util.s3_storage(bucket, "hint", proxy.url)
    proxy.script(("PutObject", "canned:400:InvalidRequest:aws-chunked encoding is not supported"))
    with pytest.raises(StorageError, match=f"s3://{bucket}/hint/a.*'checksums': 'when_required'"):
        st.put("a", b"1")
    proxy.script(("PutObject", "canned:400:InvalidArgument:Invalid argument"),
                 ("GetObject", "canned:400:InvalidRequest:bad checksum mode"))
    with pytest.raises(StorageError) as ei:
        st.put("b", b"1")
    assert "checksums" not in str(ei.value)
    st.put("c", b"1")
    with pytest.raises(StorageError) as ei:
        st.read("c")
    assert "when_required" not in str(ei.value)


# ---------------------------------------------------------------------------- C: part sizes
def test_a_size_hint_makes_one_part_size_fit_in_10000_parts():
    default = plan_parts(16 * MiB, 10, 1000)  # no hint: 16 MiB, doubling every 1,000 parts
    assert (default.size, default.uniform_parts, default.in_flight) == (16 * MiB, 1000, 10)
    assert default.part_size(1001) == 32 * MiB
    # 20 GiB (past the ~15.6 GiB R2 refused when parts grew): 16 MiB all the way
    r2 = plan_parts(16 * MiB, 10, 1000, size_hint=20 * GiB)
    assert r2.size == 16 * MiB and r2.uniform_parts * r2.size >= 20 * GiB * 17 // 16
    assert {r2.part_size(n) for n in range(1, r2.uniform_parts + 1)} == {16 * MiB}
    # 1 TiB: the smallest MiB multiple that fits it (and 1/16 more) in 10,000 parts
    big = plan_parts(16 * MiB, 10, 1000, size_hint=TiB)
    assert big.size % MiB == 0 and big.size * 10_000 >= TiB * 17 // 16 > (big.size - MiB) * 10_000
    assert big.uniform_parts <= 10_000 and big.in_flight == 1  # one part in flight: memory stays near the default
    assert plan_parts(16 * MiB, 10, 1000, size_hint=60 * TiB).size == 5 * GiB  # S3's largest part
    # small hints keep part_size, also one that is not a MiB multiple
    assert plan_parts(6_000_000, 4, 1000, size_hint=3 * GiB).size == 6_000_000
    with pytest.raises(ValueError, match="size_hint"):
        plan_parts(16 * MiB, 10, 1000, size_hint=-1)


def test_writers_make_larger_parts_with_fewer_in_flight():
    assert plan_parts(16 * MiB, 10, 1000, writers=4096).size == 256 * MiB  # 4,096 x 64 KiB
    assert plan_parts(16 * MiB, 10, 1000, writers=64).size == 16 * MiB  # 4 MiB: part_size stays
    p = plan_parts(16 * MiB, 10, 1000, writers=512)  # 32 MiB parts
    assert (p.size, p.in_flight) == (32 * MiB, 3) and p.memory <= DEFAULT_UPLOAD_MEMORY == 208 * MiB
    # a user's larger settings are their budget
    mine = plan_parts(64 * MiB, 8, 1000, writers=2048)  # 128 MiB parts, budget (8 + 3) x 64 MiB
    assert (mine.size, mine.in_flight) == (128 * MiB, 2) and mine.memory <= 11 * 64 * MiB
    with pytest.raises(ValueError, match="writers"):
        plan_parts(16 * MiB, 10, 1000, writers=0)


def _append_in_pieces(w, data: bytes, piece: int = 3 * MiB) -> None:
    for i in range(0, len(data), piece):
        w.append(data[i:i + piece])


def _part_sizes_mib(proxy) -> list[float]:
    parts = sorted(proxy.requests("UploadPart"), key=lambda r: r.part_number)
    return [r.sent / MiB for r in parts]


@pytest.mark.parametrize("hint,parts", [(None, [5, 5, 10, 10, 8]),  # no hint: growth every 2 parts (the knob)
                                        (38 * MiB, [5] * 7 + [3]),  # uniform
                                        (10 * MiB, [5, 5, 5, 10, 10, 3])])  # hint too small: growth after it
def test_a_hinted_upload_has_equal_parts_and_one_that_outgrows_its_hint_still_completes(bucket, proxy, hint, parts):
    st = s3util.s3_storage(bucket, "hint", proxy.url, _parts_per_tier=2)
    data = random.Random(5).randbytes(38 * MiB)
    w = st.open_append("h.bin", size_hint=hint)
    _append_in_pieces(w, data)
    assert w.close() == len(data)
    assert _part_sizes_mib(proxy) == parts
    assert st.read("h.bin") == data


def test_writers_give_the_upload_larger_equal_parts(bucket, proxy):
    st = s3util.s3_storage(bucket, "writers", proxy.url)
    data = random.Random(6).randbytes(38 * MiB)
    w = st.open_append("w.bin", size_hint=len(data), writers=160)  # 160 x 64 KiB = 10 MiB parts
    _append_in_pieces(w, data)
    assert w.close() == len(data)
    assert _part_sizes_mib(proxy) == [10, 10, 10, 8]
    assert st.read("w.bin") == data
    proxy.clear()
    w = st.open_append("small.bin", writers=160)  # under one (10 MiB) part: one PutObject
    _append_in_pieces(w, data[:7 * MiB])
    assert w.close() == 7 * MiB
    assert [r.op for r in proxy.requests()] == ["HeadObject", "PutObject"]
    lowered = st.open_append("lowered.bin", writers=640)  # 40 MiB parts: 2 in flight (208 MiB)
    try:
        assert lowered._manager.config.max_concurrency == st.part_plan(writers=640).in_flight == 2
    finally:
        lowered.abort()


def test_a_save_hints_its_data_file_size_so_its_parts_are_equal(bucket, proxy):
    """The save path tells the store the raw bytes it stages before the first append:
    with parts that would otherwise double after every part, a 22 MiB save is cut into
    equal 5 MiB parts (the captured path and the pickling path alike)."""
    st = s3util.s3_storage(bucket, "save", proxy.url, _parts_per_tier=1)
    assert [st.part_size_for(n) // MiB for n in (1, 2, 3)] == [5, 10, 20]  # unhinted
    g = torch.Generator().manual_seed(7)
    state = {"a": torch.randn(3 * MiB, generator=g), "b": torch.randn(5 * MiB // 2, generator=g)}  # 22 MiB
    for pickle_protocol in (2, 3):  # 3: pickled by flatten, not captured
        proxy.clear()
        f = start_save(state, st, rt=runtime(), attempt=fmt.new_attempt_id(), step=None, rank=0, world_size=1,
                       metrics=None, options=SaveOptions(compression=CompressionPolicy(mode="none"),
                                                         pickle_protocol=pickle_protocol))
        manifest = f.result(timeout=120)
        sizes = _part_sizes_mib(proxy)
        assert len(sizes) == 5 and sizes[:4] == [5] * 4, (pickle_protocol, sizes)
        loaded = restore(st, manifest, 0)
        assert torch.equal(loaded["a"], state["a"]) and torch.equal(loaded["b"], state["b"])


class _HintedLocal(LocalStorage):
    """A local store that notes the hints each open_append gets (local disk ignores them)."""

    def __init__(self, root):
        super().__init__(root)
        self.hints: list = []

    def open_append(self, key, **hints):
        self.hints.append((key, hints))
        return super().open_append(key, **hints)


def test_a_save_tells_the_store_its_raw_size_and_world_size(tmp_path):
    st = _HintedLocal(str(tmp_path / "ck"))
    state = {"w": torch.zeros(1 << 18), "b": torch.ones(1000, dtype=torch.float64)}  # 1 MiB + 8,000 bytes
    attempt = fmt.new_attempt_id()
    rt1 = Runtime(workers=2)  # rank 1 commits on its own thread, as in its own process
    try:
        futures = [_save(st, state, world_size=2, attempt=attempt),
                   _save(st, state, rank=1, world_size=2, attempt=attempt, rt=rt1)]
        futures[0].result(timeout=60)
        futures[1].result(timeout=60)
    finally:
        rt1.shutdown()
    assert sorted(key for key, _ in st.hints) == [fmt.data_file_name(attempt, r, 0) for r in (0, 1)]
    assert all(h == {"size_hint": MiB + 8000, "writers": 2} for _, h in st.hints), st.hints


def test_a_promotion_tells_the_store_the_exact_size_of_each_file(tmp_path):
    src = LocalStorage(str(tmp_path / "local"))
    manifest = _save(src, {"w": torch.randn(300_000)}).result(timeout=60)
    (name,) = manifest.files()
    dst = _HintedLocal(str(tmp_path / "durable"))
    blobs = [b for _rank, _key, b in manifest.blobs() if b.file == name]
    size = copy_file(src, dst, name, blobs, Throttle(None), writers=3)
    assert size == src.stat(name).size > 1_200_000
    assert dst.hints == [(name, {"size_hint": size, "writers": 3})]
    assert dst.read(name) == src.read(name)
