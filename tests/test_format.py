"""The storage format (ckptstore.format): manifest and vote JSON, coverage validation (I5),
file-name rules (I4), versioning and unknown fields (I4), unknown codecs, names (I2)."""

from __future__ import annotations

import dataclasses

import copy
import json
import os

import pytest
import torch

import ckptstore
from ckptstore import format as fmt
from ckptstore.errors import CkptStoreError, FormatError, IntegrityError, UnsupportedVersionError

pytestmark = pytest.mark.usefixtures("observe_earlier_failures")

DIGEST = "0123456789abcdef0123456789abcdef"
ATTEMPT = "20240101T000000-0123456789ab"


# ---------------------------------------------------------------------------- builders
def blob(raw_length: int, offset: int = 0, codec=(), file: str | None = None) -> fmt.Blob:
    return fmt.Blob(file or fmt.data_file_name(ATTEMPT, 0, 0), offset, raw_length, raw_length, tuple(codec), DIGEST)


def chunk(offsets, sizes, itemsize: int = 4, raw_length: int | None = None) -> fmt.Chunk:
    n = 1
    for s in sizes:
        n *= s
    return fmt.Chunk(tuple(offsets), tuple(sizes), blob(n * itemsize if raw_length is None else raw_length))


def entry(shape, chunks, dtype: str = "float32") -> fmt.TensorEntry:
    return fmt.TensorEntry(dtype, tuple(shape), tuple(chunks))


def laid_out(state: fmt.RankState, file: str) -> fmt.RankState:
    """``state`` with its blobs back to back in ``file``, as a writer lays them out (blobs
    never share stored bytes)."""
    at = 0

    def place(b: fmt.Blob) -> fmt.Blob:
        nonlocal at
        b = dataclasses.replace(b, file=file, offset=at)
        at += b.length
        return b

    tensors = {k: dataclasses.replace(e, chunks=tuple(dataclasses.replace(c, blob=place(c.blob)) for c in e.chunks))
               for k, e in state.tensors.items()}
    return fmt.RankState(state.rank, place(state.skeleton), tensors)


def sample_manifest() -> fmt.Manifest:
    ranks = []
    for r in range(2):
        tensors = {
            "model.weight": entry((4, 6), [chunk((0, 0), (2, 6)), chunk((2, 0), (2, 6))]),
            "scalar": entry((), [chunk((), (), itemsize=8)], dtype="int64"),
            "empty": entry((0, 3), []),
        }
        zstd = ({"id": "shuffle", "elementsize": 4}, {"id": "zstd", "level": 1})
        skel = fmt.Blob(fmt.data_file_name(ATTEMPT, r, 0), 0, 77, 300, zstd, DIGEST)
        ranks.append(laid_out(fmt.RankState(r, skel, tensors), fmt.data_file_name(ATTEMPT, r, 0)))
    return fmt.Manifest(
        generation=3, attempt=ATTEMPT, step=1200, world_size=2, created_at=fmt.utc_now(),
        committed_at=fmt.utc_now(), ranks=tuple(ranks), metrics={"loss": 0.25, "tokens": 10**12},
        library="ckptstore test",
    )


# ---------------------------------------------------------------------------- JSON round trips
def test_I4_manifest_json_round_trip():
    m = sample_manifest()
    data = m.to_bytes()
    d = json.loads(data)  # plain JSON
    assert d["format"] == "ckptstore" and d["format_version"] == fmt.FORMAT_VERSION and d["kind"] == "manifest"
    back = fmt.Manifest.from_bytes(data)
    assert back == m
    assert back.to_bytes() == data
    assert fmt.Manifest.from_json(json.loads(json.dumps(m.to_json()))) == m


@pytest.mark.parametrize("variant", ["sample", "keys", "globals", "epoch", "no step"])
def test_manifest_bytes_are_the_json_of_its_records(variant):
    """to_bytes writes the chunk records as text directly; it must give exactly the
    bytes of json.dumps(to_json()), whatever the keys hold."""
    m = sample_manifest()
    if variant == "keys":
        odd = ['é', '"quoted"', "back\\slash", "tab\t", "\u2028", "日本", "", "\x00", "🙂"]
        r0 = m.ranks[0]
        tensors = {k: r0.tensors["model.weight"] for k in odd}
        m = dataclasses.replace(m, ranks=(laid_out(fmt.RankState(0, r0.skeleton, tensors), r0.skeleton.file),
                                          m.ranks[1]))
    elif variant == "globals":
        m = dataclasses.replace(m, tensors={"g.w": m.ranks[0].tensors["model.weight"], "g.é": entry((0,), [])})
    elif variant == "epoch":
        m = dataclasses.replace(m, epoch=12, metrics={"note": "ü\n", "nested": {"a": [1, 2.5, None, True]}})
    elif variant == "no step":
        m = dataclasses.replace(m, step=None, metrics={})
    assert m.to_bytes() == json.dumps(m.to_json(), separators=(",", ":"), allow_nan=False).encode()
    if variant != "globals":  # (those global records are not a valid layout, only text)
        assert fmt.Manifest.from_bytes(m.to_bytes()) == m


def test_manifest_summaries():
    m = sample_manifest()
    assert m.files() == {fmt.data_file_name(ATTEMPT, 0, 0), fmt.data_file_name(ATTEMPT, 1, 0)}
    per_rank_raw = 300 + 2 * 2 * 6 * 4 + 8
    assert m.raw_bytes == 2 * per_rank_raw
    assert m.stored_bytes == 2 * (77 + 2 * 2 * 6 * 4 + 8)
    assert sorted({(r, k) for r, k, _ in m.blobs()}, key=str) == sorted(
        {(r, k) for r in (0, 1) for k in (None, "model.weight", "scalar")}, key=str)


@pytest.mark.parametrize("ok", [True, False])
def test_vote_json_round_trip(ok):
    m = sample_manifest()
    vote = fmt.Vote(ATTEMPT, 1200, 2, 1, ok=ok, error=None if ok else "RuntimeError: boom",
                    state=m.ranks[1] if ok else None)
    d = json.loads(json.dumps(vote.to_json()))
    assert d["kind"] == "vote"
    assert fmt.Vote.from_json(d) == vote


@pytest.mark.parametrize("ok", [True, False])
def test_vote_bytes_are_the_json_of_its_records(ok):
    """Vote.to_bytes writes the chunk records as text directly, as Manifest.to_bytes."""
    m = sample_manifest()
    shards = {"g.é\"w": m.ranks[0].tensors["model.weight"]} if ok else {}
    replicas = (fmt.ReplicaHash("g.w", (0, 0), (2, 6), DIGEST),) if ok else ()
    vote = fmt.Vote(ATTEMPT, 1200 if ok else None, 2, 1, ok=ok, error=None if ok else "RuntimeError: bööm",
                    state=m.ranks[1] if ok else None, shards=shards, replicas=replicas)
    assert vote.to_bytes() == json.dumps(vote.to_json(), separators=(",", ":"), allow_nan=False).encode()


def test_a_version_4_vote_is_its_json_in_its_own_shape():
    """A version 4 yes-vote names its index and sums it up: to_json gives that shape
    (what to_bytes stores and from_json reads), not version 3's records."""
    index = fmt.Blob(fmt.data_file_name(ATTEMPT, 1, fmt.INDEX_STREAM), 0, 90, 400, fmt.INDEX_CODEC, DIGEST)
    summary = fmt.Summary(None, 5, 7, fmt.Reads(100, 400))
    vote = fmt.Vote(ATTEMPT, 1200, 2, 1, ok=True, index=index, summary=summary)
    d = vote.to_json()
    assert d["format_version"] == 4 and "state" not in d and d["index"] == index.to_json()
    assert vote.to_bytes() == json.dumps(d, separators=(",", ":"), allow_nan=False).encode()
    assert fmt.Vote.from_json(json.loads(json.dumps(d))) == vote


def test_manifest_of_a_real_save_reads_back_equal(tmp_ckpt):
    fut = ckptstore.save({"w": torch.randn(3, 4), "b": torch.zeros(4)}, str(tmp_ckpt))
    m = fut.result(timeout=60)
    (name,) = [n for n in os.listdir(tmp_ckpt) if n.startswith("manifest-")]
    assert name == fmt.manifest_name(m.generation)
    assert fmt.Manifest.from_bytes((tmp_ckpt / name).read_bytes()) == m


def test_manifest_refuses_nan_metrics():
    m = sample_manifest()
    bad = fmt.Manifest(**{**{f: getattr(m, f) for f in m.__dataclass_fields__}, "metrics": {"loss": float("nan")}})
    with pytest.raises(ValueError):
        bad.to_bytes()


# ---------------------------------------------------------------------------- unknown fields, versions
def _paths_to_dicts(d: dict):
    """Every JSON object in a manifest, by a label."""
    r = d["ranks"][0]
    return {
        "manifest": d,
        "rank": r,
        "skeleton": r["skeleton"],
        "tensor": r["tensors"]["model.weight"],
        "chunk": r["tensors"]["model.weight"]["chunks"][0],
    }


@pytest.mark.parametrize("where", ["manifest", "rank", "skeleton", "tensor", "chunk"])
def test_I4_manifest_from_json_rejects_unknown_fields(where):
    d = copy.deepcopy(sample_manifest().to_json())
    _paths_to_dicts(d)[where]["x_future"] = True
    with pytest.raises(FormatError) as ei:
        fmt.Manifest.from_json(d)
    assert "x_future" in str(ei.value)


@pytest.mark.parametrize("where", ["manifest", "rank", "skeleton", "tensor", "chunk"])
def test_I4_manifest_from_json_rejects_missing_fields(where):
    d = copy.deepcopy(sample_manifest().to_json())
    target = _paths_to_dicts(d)[where]
    victim = {"manifest": "generation", "rank": "skeleton", "skeleton": "xxh3_128", "tensor": "dtype",
              "chunk": "sizes"}[where]
    del target[victim]
    with pytest.raises(FormatError) as ei:
        fmt.Manifest.from_json(d)
    assert victim in str(ei.value)


@pytest.mark.parametrize("version", [0, 5, 99, "1", "2", None, True])
def test_I4_manifest_from_json_rejects_unknown_version(version):
    d = sample_manifest().to_json()
    d["format_version"] = version
    with pytest.raises(UnsupportedVersionError):
        fmt.Manifest.from_json(d)


def test_I4_manifest_without_version_is_rejected():
    d = sample_manifest().to_json()
    del d["format_version"]
    with pytest.raises(FormatError):
        fmt.Manifest.from_json(d)


@pytest.mark.parametrize("field,value", [("format", "other-tool"), ("kind", "vote"), ("byteorder", "middle"),
                                         ("generation", -1), ("generation", True), ("world_size", 0),
                                         ("ranks", {})])
def test_manifest_from_json_rejects_bad_values(field, value):
    d = sample_manifest().to_json()
    d[field] = value
    with pytest.raises(FormatError):
        fmt.Manifest.from_json(d)


def test_manifest_rejects_ranks_not_matching_world_size():
    d = sample_manifest().to_json()
    d["world_size"] = 3
    with pytest.raises(FormatError):
        fmt.Manifest.from_json(d)
    d = sample_manifest().to_json()
    d["ranks"][1]["rank"] = 0
    with pytest.raises(FormatError):
        fmt.Manifest.from_json(d)


def test_manifest_rejects_bad_digest_and_dtype():
    d = sample_manifest().to_json()
    d["ranks"][0]["skeleton"]["xxh3_128"] = "XYZ"
    with pytest.raises(FormatError):
        fmt.Manifest.from_json(d)
    d = sample_manifest().to_json()
    d["ranks"][0]["tensors"]["model.weight"]["dtype"] = "float128"
    with pytest.raises(FormatError):
        fmt.Manifest.from_json(d)


def test_manifest_from_bytes_rejects_non_json():
    with pytest.raises(FormatError):
        fmt.Manifest.from_bytes(b"\x80not json")
    with pytest.raises(FormatError):
        fmt.Manifest.from_bytes(b"[1, 2]")


def test_I4_vote_from_json_rejects_unknown_field_and_version():
    vote = fmt.Vote(ATTEMPT, 5, 2, 1, ok=True, state=sample_manifest().ranks[1])
    d = vote.to_json()
    d["x_future"] = 1
    with pytest.raises(FormatError):
        fmt.Vote.from_json(d)
    d = vote.to_json()
    d["format_version"] = max(fmt.READ_VERSIONS) + 1
    with pytest.raises(UnsupportedVersionError):
        fmt.Vote.from_json(d)
    d = vote.to_json()
    d["state"] = None  # a yes-vote must carry the state
    with pytest.raises(FormatError):
        fmt.Vote.from_json(d)


# ---------------------------------------------------------------------------- coverage (I5)
ACCEPTED = {
    "1d_single": entry((10,), [chunk((0,), (10,))]),
    "1d_tiled": entry((10,), [chunk((3,), (7,)), chunk((0,), (3,))]),
    "2d_rows": entry((4, 6), [chunk((0, 0), (1, 6)), chunk((1, 0), (3, 6))]),
    "2d_grid": entry((4, 6), [chunk((0, 0), (2, 3)), chunk((0, 3), (2, 3)), chunk((2, 0), (2, 3)),
                               chunk((2, 3), (2, 3))]),
    "2d_uneven": entry((3, 5), [chunk((0, 0), (3, 2)), chunk((0, 2), (1, 3)), chunk((1, 2), (2, 3))]),
    "3d_blocks": entry((2, 2, 2), [chunk((i, 0, 0), (1, 2, 2)) for i in range(2)]),
    "0dim": entry((), [chunk((), ())]),
    "zero_size_no_chunks": entry((0,), []),
    "zero_size_2d_no_chunks": entry((5, 0), []),
    "zero_size_empty_chunk": entry((5, 0), [chunk((0, 0), (5, 0))]),
    "bf16": entry((8,), [chunk((0,), (8,), itemsize=2)], dtype="bfloat16"),
}

REJECTED = {
    "gap_1d": entry((10,), [chunk((0,), (3,)), chunk((5,), (5,))]),
    "overlap_1d": entry((10,), [chunk((0,), (6,)), chunk((4,), (6,))]),
    "overlap_and_gap_same_total": entry((10,), [chunk((0,), (4,)), chunk((2,), (4,)), chunk((8,), (2,))]),
    "duplicate": entry((4,), [chunk((0,), (4,)), chunk((0,), (4,))]),
    "overlap_2d_same_total": entry((4, 4), [chunk((0, 0), (2, 2)), chunk((1, 1), (2, 2)),
                                            chunk((2, 0), (2, 2)), chunk((0, 2), (2, 2))]),
    "gap_2d": entry((4, 6), [chunk((0, 0), (2, 6)), chunk((2, 0), (2, 3))]),
    "out_of_bounds_1d": entry((10,), [chunk((0,), (5,)), chunk((5,), (6,))]),
    "out_of_bounds_offset": entry((10,), [chunk((0,), (10,)), chunk((10,), (1,))]),
    "out_of_bounds_2d": entry((4, 6), [chunk((0, 0), (4, 4)), chunk((0, 4), (4, 3))]),
    "wrong_raw_length": entry((10,), [chunk((0,), (10,), raw_length=39)]),
    "wrong_raw_length_itemsize": entry((10,), [chunk((0,), (10,), itemsize=2)]),
    "wrong_dims": entry((4, 6), [chunk((0,), (24,))]),
    "no_chunks": entry((3,), []),
    "0dim_two_chunks": entry((), [chunk((), ()), chunk((), ())]),
    "0dim_no_chunks": entry((), []),
}


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_I5_validate_coverage_accepts_exact_tilings(name):
    fmt.validate_coverage(ACCEPTED[name], name)


@pytest.mark.parametrize("name", sorted(REJECTED))
def test_I5_validate_coverage_rejects(name):
    with pytest.raises(FormatError) as ei:
        fmt.validate_coverage(REJECTED[name], f"tensor {name!r}")
    assert name in str(ei.value)


def test_I5_manifest_with_bad_coverage_is_rejected_on_read():
    d = sample_manifest().to_json()
    d["ranks"][0]["tensors"]["model.weight"]["chunks"].pop()
    with pytest.raises(FormatError) as ei:
        fmt.Manifest.from_json(d)
    assert "model.weight" in str(ei.value)


# ---------------------------------------------------------------------------- names (I4, I2)
@pytest.mark.parametrize("name", [
    "/etc/passwd", "/abs", "..", "../x", "a/../b", "a/..", ".", "./a", "a/./b", "a//b", "a/", "",
    "a\\b", "..\\x", "C:\\x", "a\x00b", None, 5, b"bytes",
])
def test_I4_check_relative_name_rejects(name):
    with pytest.raises(FormatError):
        fmt.check_relative_name(name)


@pytest.mark.parametrize("name", ["a", "attempts/x/data-r00000-s00.bin", "manifest-0000000001.json",
                                  "a.b/c..d/...e"])
def test_I4_check_relative_name_accepts(name):
    assert fmt.check_relative_name(name) == name


def test_names():
    assert fmt.manifest_name(1) == "manifest-0000000001.json"
    assert fmt.parse_manifest_name("manifest-0000000042.json") == 42
    assert fmt.parse_manifest_name("manifest-42.json") is None
    assert fmt.parse_manifest_name("manifest-0000000001.json.tmp-1234") is None
    assert fmt.data_file_name(ATTEMPT, 3, 1) == f"attempts/{ATTEMPT}/data-r00003-s01.bin"
    assert fmt.vote_name(ATTEMPT, 2) == f"attempts/{ATTEMPT}/vote-r00002.json"
    assert fmt.abort_name(ATTEMPT) == f"attempts/{ATTEMPT}/abort.json"
    assert fmt.step_dir_name(12) == "step-000000000012"
    assert fmt.parse_step_dir_name("step-000000000012") == 12
    for bad in (-1, True, 1.0, "3"):
        with pytest.raises(ValueError):
            fmt.step_dir_name(bad)


def test_I2_attempt_ids_are_unique_and_well_formed():
    ids = [fmt.new_attempt_id() for _ in range(2000)]
    assert len(set(ids)) == len(ids)
    assert all(fmt.is_attempt_id(a) for a in ids)
    assert all(fmt.check_relative_name(fmt.data_file_name(a, 0, 0)) for a in ids[:10])


# ---------------------------------------------------------------------------- codecs in a manifest
@pytest.mark.parametrize("chain", [
    [{"id": "lz4"}],
    [{"id": "shuffle", "elementsize": 4}],
    [{"id": "zstd", "level": 1}, {"id": "shuffle", "elementsize": 4}],
])
def test_unknown_codec_in_a_chunk_fails_load_clearly(tmp_ckpt, chain):
    ckptstore.save({"layer.w": torch.zeros(4096)}, str(tmp_ckpt), compression="zstd").result(timeout=60)
    (mf,) = [tmp_ckpt / n for n in os.listdir(tmp_ckpt) if n.startswith("manifest-")]
    d = json.loads(mf.read_bytes())
    c = d["ranks"][0]["tensors"]["layer.w"]["chunks"][0]
    assert [x["id"] for x in c["codec"]][-1] == "zstd"
    c["codec"] = chain
    mf.write_bytes(json.dumps(d).encode())
    with pytest.raises((FormatError, IntegrityError)) as ei:
        ckptstore.load(tmp_ckpt)
    msg = str(ei.value)
    assert isinstance(ei.value, CkptStoreError)
    assert str(tmp_ckpt) in msg and "'layer.w'" in msg and "codec" in msg
    assert chain[0]["id"] in msg


def test_codec_record_without_id_is_rejected_by_the_manifest():
    d = sample_manifest().to_json()
    d["ranks"][0]["skeleton"]["codec"] = [{"level": 1}]
    with pytest.raises(FormatError):
        fmt.Manifest.from_json(d)
