"""Create-only puts on S3 stores as they really behave (issue 19, items 1, 2, 6): a
probe that the store honours ``If-None-Match: *``, 501 NotImplemented as a permanent
error, 409 ConditionalRequestConflict retried, and credential fetches that fail for a
moment retried. Against the moto server, through the fault proxy (tests/s3util.py),
which can drop a header (a store or proxy that ignores it) or answer in a store's place."""

from __future__ import annotations

import pytest
import torch

import ckptstore  # noqa: F401 (the package under test, for its storage)
import s3util
from botocore import exceptions as bexc

from ckptstore.errors import AlreadyExistsError, StorageError, TransientStorageError
from ckptstore.storage.s3.errors import translate
from s3util import bucket, endpoint, proxy  # noqa: F401 (fixtures)


def probing(bucket, proxy, **options):
    return s3util.s3_storage(bucket, "loc", proxy.url, **{"conditional_writes": "probe", **options})


def test_the_first_create_only_put_probes_the_store_once_and_leaves_nothing(bucket, proxy, endpoint):
    st = probing(bucket, proxy)
    st.put("vote-r00001.json", b"v", if_absent=True)
    puts = proxy.requests("PutObject")
    assert [r.status for r in puts] == [200, 412, 200]  # probe, its refused second put, the vote
    assert puts[0].key == puts[1].key != puts[2].key and ".ckptstore-probe-" in puts[0].key
    assert [r.key for r in proxy.requests("DeleteObject")] == [puts[0].key]
    proxy.clear()
    st.child("other").put("vote-r00002.json", b"w", if_absent=True)  # the verdict is kept
    assert [r.status for r in proxy.requests("PutObject")] == [200]
    admin = s3util.admin_client(endpoint)
    keys = [o["Key"] for o in admin.list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert sorted(keys) == ["loc/other/vote-r00002.json", "loc/vote-r00001.json"]


def test_a_store_that_ignores_if_none_match_is_refused_naming_the_option(bucket, proxy):
    proxy.strip_headers = {"if-none-match"}
    st = probing(bucket, proxy)
    with pytest.raises(StorageError, match="ignores If-None-Match.*conditional_writes"):
        st.put("manifest-0000000001.json", b"m", if_absent=True)
    assert not st.exists("manifest-0000000001.json")
    st.put("pin.json", b"1")  # plain puts are unaffected


def test_single_writer_mode_makes_create_only_puts_check_then_put(bucket, proxy):
    proxy.strip_headers = {"if-none-match"}
    st = probing(bucket, proxy, conditional_writes="single-writer")
    st.put("manifest-0000000001.json", b"first", if_absent=True)
    with pytest.raises(AlreadyExistsError, match="single-writer"):
        st.put("manifest-0000000001.json", b"second", if_absent=True)
    assert st.read("manifest-0000000001.json") == b"first"
    assert not any(".ckptstore-probe-" in r.key for r in proxy.requests())  # no probe in this mode


def test_a_store_answering_501_to_create_only_puts_is_refused_not_retried(bucket, proxy):
    proxy.script(("PutObject", "canned:501:NotImplemented"))
    st = probing(bucket, proxy)
    with pytest.raises(StorageError, match="501 NotImplemented.*conditional_writes") as ei:
        st.put("vote-r00000.json", b"v", if_absent=True)
    assert not isinstance(ei.value, TransientStorageError)
    assert len(proxy.requests("PutObject")) == 1  # once: no retry changes a 501


def test_501_is_a_permanent_error():
    e = bexc.ClientError({"Error": {"Code": "NotImplemented", "Message": "A header you provided implies "
                                    "functionality that is not implemented"},
                          "ResponseMetadata": {"HTTPStatusCode": 501}}, "PutObject")
    err = translate(e, "s3://b/k", "b", 3)
    assert type(err) is StorageError and "does not implement" in str(err)


def test_409_conditional_request_conflict_is_retried_then_resolved_by_reading_back(bucket, proxy):
    st = s3util.s3_storage(bucket, "loc", proxy.url)
    # twice 409, then the write goes through
    proxy.script(("PutObject", "canned:409:ConditionalRequestConflict"),
                 ("PutObject", "canned:409:ConditionalRequestConflict"))
    st.put("manifest-0000000001.json", b"ours", if_absent=True)
    assert [r.status for r in proxy.requests("PutObject")] == [409, 409, 200]
    # our own write landed while its answer was a 409: the retry meets a 412, and the
    # read-back finds our bytes: committed, not a lost race
    proxy.clear()
    proxy.script(("PutObject", "error500-after"), ("PutObject", "canned:409:ConditionalRequestConflict"))
    st.put("manifest-0000000002.json", b"mine", if_absent=True)
    assert st.read("manifest-0000000002.json") == b"mine"
    # another writer's manifest is still a lost race
    proxy.clear()
    proxy.script(("PutObject", "canned:409:ConditionalRequestConflict"))
    with pytest.raises(AlreadyExistsError):
        st.put("manifest-0000000001.json", b"theirs", if_absent=True)
    assert st.read("manifest-0000000001.json") == b"ours"


def test_409_forever_is_transient_and_leaves_no_key(bucket, proxy):
    st = s3util.s3_storage(bucket, "loc", proxy.url)
    proxy.script(*[("PutObject", "canned:409:ConditionalRequestConflict")] * 6)
    with pytest.raises(TransientStorageError, match="409 ConditionalRequestConflict"):
        st.put("manifest-0000000001.json", b"x", if_absent=True)
    assert not st.exists("manifest-0000000001.json")


def test_a_credential_fetch_that_fails_is_transient_missing_credentials_are_not():
    transient = translate(bexc.CredentialRetrievalError(provider="iam-role", error_msg="throttled"), "s3://b", "b", 3)
    assert isinstance(transient, TransientStorageError)
    missing = translate(bexc.NoCredentialsError(), "s3://b", "b", 3)
    assert not isinstance(missing, TransientStorageError) and "credentials" in str(missing)


def test_a_save_and_load_through_the_probing_default(bucket, endpoint, monkeypatch):
    """The default of an ``s3://`` URL: probe, then commit as always."""
    s3util.point_boto3_at(endpoint, monkeypatch)
    f = ckptstore.save({"w": torch.arange(4.0)}, f"s3://{bucket}/ckpt")
    f.result(timeout=60)
    assert torch.equal(ckptstore.load(f"s3://{bucket}/ckpt")["w"], torch.arange(4.0))


def test_single_writer_mode_reads_back_a_write_whose_answers_were_lost(bucket, proxy):
    st = probing(bucket, proxy, conditional_writes="single-writer", max_attempts=2)
    proxy.script(("PutObject", "error500-after"), ("PutObject", "error500-after"))  # stored, answered 500, twice
    st.put("manifest-0000000001.json", b"ours", if_absent=True)
    assert [r.status for r in proxy.requests("PutObject")] == [500, 500]
    assert st.read("manifest-0000000001.json") == b"ours"
    st.put("manifest-0000000001.json", b"ours", if_absent=True)  # a caller's retry of a landed write: done


def test_a_probe_whose_first_put_is_refused_is_inconclusive_not_a_lost_race(bucket, proxy):
    proxy.script(("PutObject", "canned:412:PreconditionFailed"))
    st = probing(bucket, proxy)
    with pytest.raises(TransientStorageError, match="probe was inconclusive"):
        st.put("vote-r00000.json", b"v", if_absent=True)
    st.put("vote-r00000.json", b"v", if_absent=True)  # nothing was kept: the next put probes again, and passes
    assert st.read("vote-r00000.json") == b"v"


def test_the_default_mode_comes_from_the_environment(bucket, proxy):
    from ckptstore.config import Config, ConfigError

    assert Config.from_env({}).s3_conditional_writes == "probe"
    assert Config.from_env({"CKPTSTORE_S3_CONDITIONAL_WRITES": "single-writer"}).s3_conditional_writes == "single-writer"
    with pytest.raises(ConfigError, match="CKPTSTORE_S3_CONDITIONAL_WRITES"):
        Config.from_env({"CKPTSTORE_S3_CONDITIONAL_WRITES": "maybe"})
    ckptstore.configure(s3_conditional_writes="single-writer")
    try:
        proxy.strip_headers = {"if-none-match"}
        st = s3util.s3_storage(bucket, "loc", proxy.url, conditional_writes=None)  # the process default
        st.put("vote-r00000.json", b"v", if_absent=True)
        with pytest.raises(AlreadyExistsError):
            st.put("vote-r00000.json", b"w", if_absent=True)
    finally:
        ckptstore.configure()


def test_bucket_owner_requester_pays_and_kms_go_with_every_request(bucket, proxy):
    """Through the store's own calls and boto3's transfer layer alike (a multipart data
    file): each request that takes them (issue 19, item 6)."""
    st = s3util.s3_storage(bucket, "loc", proxy.url, expected_bucket_owner="123456789012", request_payer=True,
                           sse_kms_key_id="alias/ckpt")
    from ckptstore import names
    from ckptstore.checkpoint.manifests import latest_manifest
    from ckptstore.checkpoint.restore import restore
    from ckptstore.checkpoint.save import SaveOptions, start_save
    from ckptstore.runtime import runtime

    state = {"w": torch.randn(3 << 20)}  # 12 MiB: a multipart upload
    start_save(state, st, rt=runtime(), attempt=names.new_attempt_id(), step=None, rank=0, world_size=1,
               metrics=None, options=SaveOptions(commit_timeout=60)).result(timeout=60)
    assert torch.equal(restore(st, latest_manifest(st), 0)["w"], state["w"])
    requests = proxy.requests()
    ops = {r.op for r in requests}
    assert {"PutObject", "CreateMultipartUpload", "UploadPart", "CompleteMultipartUpload", "GetObject",
            "ListObjectsV2"} <= ops, ops
    for r in requests:
        assert r.headers.get("x-amz-expected-bucket-owner") == "123456789012", (r.op, r.headers)
        assert r.headers.get("x-amz-request-payer") == "requester", r.op
        creates = r.op in ("PutObject", "CreateMultipartUpload")
        assert (r.headers.get("x-amz-server-side-encryption") == "aws:kms") == creates, r.op
        assert (r.headers.get("x-amz-server-side-encryption-aws-kms-key-id") == "alias/ckpt") == creates, r.op
    with pytest.raises(ValueError, match="12-digit"):
        s3util.s3_storage(bucket, "loc", proxy.url, expected_bucket_owner="me")
