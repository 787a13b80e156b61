"""Format version 4 (issue 18): the root manifest names one index per rank; the
committer builds it from the votes alone and checks I5 by fingerprints; a loading rank
reads the root and the indexes its state needs, verify reads them all.

Several ranks are simulated in one process: ranks 1.. run their writer and seal their
index as their own process would, then vote; rank 0 saves through ``start_save`` and
commits (docs/format.md, "Version 4")."""

from __future__ import annotations

import dataclasses
import functools
import json

import pytest
import torch

from ckptstore import Store
from ckptstore import format as fmt
from ckptstore import names
from ckptstore.checkpoint import fingerprint
from ckptstore.checkpoint.manifests import latest_manifest, read_manifest
from ckptstore.checkpoint.votes import write_vote
from ckptstore.checkpoint.indexes import covered, expand, seal
from ckptstore.checkpoint.save import SaveOptions, start_save
from ckptstore.checkpoint.snapshot import snapshot
from ckptstore.checkpoint.verify import verify
from ckptstore.codecs import CompressionPolicy
from ckptstore.errors import CommitError, FormatError, IntegrityError
from ckptstore.format_index import Index, rank_ranges
from ckptstore.pipeline import RankWriter
from ckptstore.runtime import runtime
from ckptstore.storage import LocalStorage

TIMEOUT = 120
STEP = 7


def rank_state(rank: int) -> dict:
    g = torch.Generator().manual_seed(rank)
    return {"model": {"w": torch.arange(64.0).reshape(8, 8), "b": torch.ones(8)},
            "rng": torch.randn(5, generator=g), "pos": 100 + rank, f"only{rank}": torch.full((3,), float(rank))}


def other_rank(where, attempt: str, rank: int, world: int, obj, replicated=(), chunk_bytes=1 << 20,
               step=STEP, references=None) -> Index:
    """What rank ``rank``'s process leaves: its data file with its table and index, and
    its version 4 vote."""
    rt = runtime()
    writer = RankWriter(where, attempt, rank, CompressionPolicy("none"), rt, references=references)
    staged = snapshot(obj, writer, rt.pool, chunk_bytes, rank=rank, world_size=world, replicated=replicated)
    vote, index = writer.finish(functools.partial(seal, writer, staged=staged, step=step, world_size=world))
    write_vote(where, vote)
    return index


def save_world(root, world: int, states=None, replicated=(), chunk_bytes=1 << 20, step=STEP, references=None,
               **options) -> fmt.Manifest:
    """A checkpoint of ``world`` simulated ranks at ``root``/step-7; returns rank 0's
    manifest. ``references``: {rank: what it may reference} (incremental saves)."""
    where = LocalStorage(str(root / names.step_dir_name(step)))
    attempt = names.new_attempt_id()
    states = states or [rank_state(r) for r in range(world)]
    references = references or {}
    for r in range(1, world):
        other_rank(where, attempt, r, world, states[r], replicated, chunk_bytes, step, references.get(r))
    if 0 in references:
        options["references"] = references[0]
    future = start_save(states[0], where, rt=runtime(), attempt=attempt, step=step, rank=0, world_size=world,
                        metrics={"loss": 1.5}, options=SaveOptions(commit_timeout=TIMEOUT, replicated=tuple(replicated),
                                                                   compression=CompressionPolicy("none"), chunk_bytes=chunk_bytes,
                                                                   **options))
    return future.result(timeout=TIMEOUT)


def location(root) -> LocalStorage:
    return LocalStorage(str(root / names.step_dir_name(STEP)))


def stored_root(root) -> dict:
    return json.loads((root / names.step_dir_name(STEP) / names.manifest_name(1)).read_bytes())


def rewrite_root(root, edit) -> None:
    path = root / names.step_dir_name(STEP) / names.manifest_name(1)
    doc = json.loads(path.read_bytes())
    edit(doc)
    path.write_bytes(json.dumps(doc).encode())


def data_file(root, doc: dict, rank: int):
    return root / names.step_dir_name(STEP) / names.data_file_name(doc["attempt"], rank, 0)


def set_index(doc: dict, rank: int, **fields) -> None:
    """Change rank ``rank``'s index record in a root's columns."""
    for name, value in fields.items():
        doc["indexes"][name][rank] = value


# ---------------------------------------------------------------------------- the root
def test_a_multi_rank_save_commits_a_root_naming_one_index_per_rank(tmp_path):
    m = save_world(tmp_path, 4)
    doc = stored_root(tmp_path)
    assert doc["format_version"] == 4 and "ranks" not in doc and "tensors" not in doc
    assert sorted(doc["indexes"]) == ["length", "offset", "raw_length", "xxh3_128"]
    assert all(len(column) == 4 for column in doc["indexes"].values())
    assert doc["globals"] == {} and doc["metrics"] == {"loss": 1.5}
    # the totals a tool reads without any index: every blob of every rank, indexes included
    full = expand(location(tmp_path), read_manifest(location(tmp_path), 1))
    assert full.complete and doc["stored_bytes"] == sum(b.length for _, _, b in full.blobs())
    files = location(tmp_path).walk(names.ATTEMPTS_DIR + "/")
    assert sum(i.size for i in files if names.parse_data_file(i.key)) == doc["stored_bytes"]
    # rank 0 gets the root with its own records read in, not the others'
    assert [r.rank for r in m.ranks] == [0] and not m.complete
    with pytest.raises(fmt.IncompleteManifestError):
        list(m.blobs())


def test_root_vote_and_index_round_trip_exactly(tmp_path):
    save_world(tmp_path, 3)
    data = (tmp_path / names.step_dir_name(STEP) / names.manifest_name(1)).read_bytes()
    root = fmt.Manifest.from_bytes(data)
    assert root.to_bytes() == data and root.indexed and root.format_version == 4
    attempt = root.attempt
    vote_bytes = location(tmp_path).read(names.vote_name(attempt, 2))
    vote = fmt.Vote.from_bytes(vote_bytes)
    assert vote.to_bytes() == vote_bytes and vote.index == root.indexes[2]
    raw = location(tmp_path).read(vote.index.file, vote.index.offset, vote.index.length)
    import zstandard
    index = Index.from_bytes(zstandard.ZstdDecompressor().decompress(raw), "index")
    assert index.rank == 2 and index.summary == vote.summary


def test_each_rank_loads_its_own_state_reading_only_its_own_index(tmp_path):
    states = [rank_state(r) for r in range(4)]
    save_world(tmp_path, 4, states)
    doc = stored_root(tmp_path)
    # Ranks 1 and 3's files gone: rank 2 still loads, since it reads only its own index
    for r in (1, 3):
        data_file(tmp_path, doc, r).unlink()
    store = Store(str(tmp_path))
    out = store.load(STEP, rank=2)
    assert out["pos"] == 102 and torch.equal(out["rng"], states[2]["rng"]) and torch.equal(out["only2"], states[2]["only2"])
    with pytest.raises(IntegrityError, match="index of rank 1"):
        store.load(STEP, rank=1)
    problems = verify(str(tmp_path / names.step_dir_name(STEP)))
    assert problems and "index of rank 1" in str(problems[0])


def test_a_replicated_tensor_is_written_once_and_loads_whole_on_any_rank(tmp_path):
    states = [rank_state(r) for r in range(4)]
    big = torch.arange(4096.0).reshape(64, 64)
    for s in states:
        s["model"]["big"] = big.clone()
    save_world(tmp_path, 4, states, replicated=["model.*"], chunk_bytes=2048)
    doc = stored_root(tmp_path)
    assert doc["globals"]["model.big"] == {"dtype": "float32", "shape": [64, 64], "ranks": [[0, 3]]}
    full = Store(str(tmp_path)).manifest(STEP)
    writers = {names.parse_data_file(c.blob.file)[1] for c in full.tensors["model.big"].chunks}
    assert len(full.tensors["model.big"].chunks) == 8 and writers == {0, 1, 2, 3}
    for rank in range(4):
        out = Store(str(tmp_path)).load(STEP, rank=rank)
        assert torch.equal(out["model"]["big"], big) and out["pos"] == 100 + rank


def test_a_template_load_reads_other_indexes_only_where_its_own_lacks_the_chunks(tmp_path):
    states = [rank_state(r) for r in range(4)]
    for s in states:
        s["model"]["big"] = torch.arange(4096.0).reshape(64, 64)
    save_world(tmp_path, 4, states, replicated=["model.big"], chunk_bytes=2048)
    doc = stored_root(tmp_path)
    full = Store(str(tmp_path)).manifest(STEP)
    # a template asking only for rank-local values reads no other index: with the
    # other ranks' files gone it still loads
    moved = {}
    for r in (1, 2, 3):
        moved[r] = data_file(tmp_path, doc, r).read_bytes()
        data_file(tmp_path, doc, r).unlink()
    out = Store(str(tmp_path)).load(STEP, rank=0, template={"pos": 0})
    assert out["pos"] == 100
    with pytest.raises(IntegrityError, match="index of rank"):  # "big" lies partly in their files
        Store(str(tmp_path)).load(STEP, rank=0, template={"model": {"big": torch.zeros(64, 64)}})
    for r, data in moved.items():
        data_file(tmp_path, doc, r).write_bytes(data)
    out = Store(str(tmp_path)).load(STEP, rank=0, template={"model": {"big": torch.zeros(64, 64)}})
    assert torch.equal(out["model"]["big"], states[0]["model"]["big"])
    assert len(full.tensors["model.big"].chunks) == 8


# ---------------------------------------------------------------------------- the commit's checks
def test_replicas_that_differ_are_refused_with_the_chunk_named(tmp_path):
    states = [rank_state(r) for r in range(3)]
    for r, s in enumerate(states):
        s["model"]["w"] = torch.arange(64.0).reshape(8, 8) + (r == 2)  # rank 2's copy differs
    with pytest.raises(CommitError, match="differs between ranks"):
        save_world(tmp_path, 3, states, replicated=["model.*"])
    assert not list((tmp_path / names.step_dir_name(STEP)).glob("manifest-*"))


def test_global_tensors_of_another_shape_are_refused_naming_both_ranks(tmp_path):
    states = [rank_state(r) for r in range(3)]
    states[1]["model"]["w"] = torch.zeros(4, 16)
    with pytest.raises(CommitError, match=r"global tensor 'model.w': rank 0 saved float32\[8, 8\], rank 1 saved"):
        save_world(tmp_path, 3, states, replicated=["model.*"])


def test_a_fingerprint_that_does_not_add_up_falls_back_to_the_exact_check(tmp_path, monkeypatch):
    """The fingerprints only decide whether the committer may skip the records: when
    they disagree with a sound checkpoint, the exact check over every index commits it."""
    checked = []
    import ckptstore.checkpoint.indexes as indexes

    real = indexes.exact_check
    monkeypatch.setattr(indexes, "exact_check", lambda *a: (checked.append(1), real(*a))[1])
    monkeypatch.setattr(fingerprint, "whole", lambda tensors: 12345)
    states = [rank_state(r) for r in range(3)]
    save_world(tmp_path, 3, states, replicated=["model.*"])
    assert checked == [1]
    assert torch.equal(Store(str(tmp_path)).load(STEP, rank=1)["model"]["w"], states[0]["model"]["w"])


def test_coverage_fingerprint_tells_an_exact_cover_from_an_overlap_and_a_gap_of_equal_size():
    whole = fingerprint.whole({"t": (4, 3)})
    assert fingerprint.coverage({"t": [((0, 0), (2, 3)), ((2, 0), (2, 3))]}) == whole
    assert fingerprint.coverage({"t": [((0, 0), (3, 3)), ((2, 0), (1, 3))]}) != whole  # overlap row 2, gap row 3
    assert fingerprint.coverage({"t": [((0, 0), (4, 3))]}) == whole
    assert fingerprint.coverage({"u": [((0, 0), (4, 3))]}) != whole  # another tensor's weights
    one = [("t", (0,), (4,), "a" * 32)]
    assert fingerprint.replicas(one, [], lambda k: 3) == (-2 * fingerprint.replicas([], one, lambda k: 3)) % fingerprint.P
    assert (fingerprint.replicas(one, [], lambda k: 2) + fingerprint.replicas([], one, lambda k: 2)) % fingerprint.P == 0
    other = [("t", (0,), (4,), "b" * 32)]
    assert (fingerprint.replicas(one, [], lambda k: 2) + fingerprint.replicas([], other, lambda k: 2)) % fingerprint.P


def test_rank_ranges_and_coverage_counting():
    assert rank_ranges([3, 0, 1, 2, 7, 9, 8]) == ((0, 3), (7, 9))
    chunk = fmt.Chunk((0, 0), (2, 2), fmt.Blob("f", 0, 0, 0, (), "0" * 32))
    assert covered([chunk], (1, 1), (2, 2)) == 1


# ---------------------------------------------------------------------------- hostile roots and indexes
@pytest.fixture
def saved(tmp_path):
    save_world(tmp_path, 3)
    return tmp_path


def load_error(root, rank=1):
    with pytest.raises((FormatError, IntegrityError)) as ei:
        Store(str(root)).load(STEP, rank=rank)
    return str(ei.value)


def test_a_vote_whose_index_lies_in_another_ranks_file_is_refused(saved):
    where = location(saved)
    attempt = stored_root(saved)["attempt"]
    vote = json.loads(where.read(names.vote_name(attempt, 1)))
    vote["index"]["file"] = names.data_file_name(attempt, 2, 0)
    with pytest.raises(FormatError, match="rank 1's index lies in .*data-r00002"):
        fmt.Vote.from_json(vote)


def test_a_root_claiming_more_indexes_than_ranks_is_refused_before_parsing_them(saved):
    rewrite_root(saved, lambda d: d["indexes"]["offset"].append(0))
    assert "indexes.offset holds 4 entries, world_size is 3" in load_error(saved)
    rewrite_root(saved, lambda d: (d["indexes"]["offset"].pop(), d["indexes"]["xxh3_128"].__setitem__(1, "x")))
    assert "not a 32-digit hex digest" in load_error(saved)


def test_an_index_claiming_more_than_the_manifest_cap_is_refused_before_it_is_read(saved):
    import ckptstore

    rewrite_root(saved, lambda d: set_index(d, 1, raw_length=1 << 20))
    ckptstore.configure(max_manifest_bytes=64 << 10)
    try:
        assert "more than the cap" in load_error(saved)
    finally:
        ckptstore.configure()


def test_an_index_whose_bytes_changed_is_an_integrity_error_naming_it(saved):
    doc = stored_root(saved)
    path = data_file(saved, doc, 1)
    data = bytearray(path.read_bytes())
    data[doc["indexes"]["offset"][1] + 3] ^= 0xFF
    path.write_bytes(bytes(data))
    assert "index of rank 1" in load_error(saved)
    assert Store(str(saved)).load(STEP, rank=2)["pos"] == 102


def test_an_index_holding_a_global_tensor_the_root_does_not_name_is_refused(tmp_path):
    states = [rank_state(r) for r in range(3)]
    save_world(tmp_path, 3, states, replicated=["model.*"])
    rewrite_root(tmp_path, lambda d: d["globals"].pop("model.b"))
    assert "is not the manifest's" in load_error(tmp_path)


def test_an_index_referring_to_files_the_root_does_not_declare_is_refused(saved):
    """gc trusts a root's declared references; an index that reads more is refused."""
    index_doc, put = _rewrite_index(saved, 1)
    chunk = index_doc["state"]["tensors"]["model.w"]["chunks"][0]
    chunk.update(step=3, file=names.data_file_name(names.new_attempt_id(), 1, 0))  # its summary left as it was
    put(index_doc)
    assert "does not declare" in load_error(saved)


def test_an_index_of_another_rank_in_its_place_is_refused(saved):
    index_doc, put = _rewrite_index(saved, 1)
    index_doc["rank"] = 2
    put(index_doc)
    assert "holds the index of rank 2" in load_error(saved)


def test_a_root_with_unknown_fields_or_a_bad_rank_range_is_refused(tmp_path):
    states = [rank_state(r) for r in range(3)]
    save_world(tmp_path, 3, states, replicated=["model.*"])
    rewrite_root(tmp_path, lambda d: d.update(surprise=1))
    assert "unknown field" in load_error(tmp_path)
    rewrite_root(tmp_path, lambda d: (d.pop("surprise"), d["globals"]["model.w"].update(ranks=[[2, 1]])))
    assert "rank range" in load_error(tmp_path)
    rewrite_root(tmp_path, lambda d: d["globals"]["model.w"].update(ranks=[[0, 1], [1, 2]]))
    assert "rank range" in load_error(tmp_path)
    for bad in ([[1]], [[]], [0], [[0, "2"]]):  # a pair of the wrong length or type: a FormatError, not a crash
        rewrite_root(tmp_path, lambda d: d["globals"]["model.w"].update(ranks=bad))
        assert "rank range" in load_error(tmp_path) or "model.w" in load_error(tmp_path)


def _rewrite_index(root, rank: int):
    """(rank's index as JSON, a function that stores an edited one in its place and
    points the root at it with its new hash)."""
    import zstandard

    from ckptstore.hashing import digest

    doc = stored_root(root)
    offset, length = doc["indexes"]["offset"][rank], doc["indexes"]["length"][rank]
    path = data_file(root, doc, rank)
    raw = zstandard.ZstdDecompressor().decompress(path.read_bytes()[offset:offset + length])

    def put(index_doc) -> None:
        data = json.dumps(index_doc).encode()
        stored = zstandard.ZstdCompressor(level=3, write_content_size=True).compress(data)
        with open(path, "ab") as f:
            at = f.tell()
            f.write(stored)
        rewrite_root(root, lambda d: set_index(d, rank, offset=at, length=len(stored), raw_length=len(data),
                                               xxh3_128=digest(data)))

    return json.loads(raw), put


# ---------------------------------------------------------------------------- tools on a root
def test_ls_and_gc_read_the_root_only(tmp_path):
    save_world(tmp_path, 3)
    doc = stored_root(tmp_path)
    for r in range(3):  # every index gone: the tools that need none still work
        data_file(tmp_path, doc, r).unlink()
    from ckptstore.checkpoint.gc import plan
    from ckptstore.checkpoint.retention import Retention
    from ckptstore.cli import _locations

    gc_plan = plan(LocalStorage(str(tmp_path)), Retention(last=1))
    assert gc_plan.held_back is None and gc_plan.kept and not gc_plan.deletions
    (loc,) = [loc for loc in _locations(LocalStorage(str(tmp_path))) if loc.committed]
    assert loc.manifest.stored_bytes == doc["stored_bytes"] > 0


def test_a_one_rank_save_still_writes_version_3_and_reads_back(tmp_path):
    store = Store(str(tmp_path))
    store.save(1, {"w": torch.ones(3)}).result()
    doc = json.loads((tmp_path / names.step_dir_name(1) / names.manifest_name(1)).read_bytes())
    assert doc["format_version"] == 3 and "ranks" in doc


def test_a_one_rank_save_may_ask_for_version_4(tmp_path):
    store = Store(str(tmp_path))
    store.options = dataclasses.replace(store.options, indexed=True)
    m = store.save(1, {"w": torch.ones(3), "n": 4}).result()
    assert m.format_version == 4 and m.complete
    assert store.load(1)["n"] == 4 and not verify(str(tmp_path / names.step_dir_name(1)))
    assert latest_manifest(store.location(1)).indexed


def test_gc_reads_an_unreadable_roots_references_leniently(tmp_path):
    """A root that does not validate may still reference other steps' files: gc reads
    its declared references leniently and keeps those attempts (I7)."""
    from ckptstore.checkpoint.liveness import _references_of_unreadable

    save_world(tmp_path, 2)
    other = names.new_attempt_id()
    rewrite_root(tmp_path, lambda d: d.update(references=[{"step": 3, "attempt": other}], surprise=True))
    with pytest.raises(FormatError):
        read_manifest(location(tmp_path), 1)
    assert _references_of_unreadable(location(tmp_path), 1) == {names.step_dir_name(3): {other}}
    rewrite_root(tmp_path, lambda d: d.update(references=[{"step": 3, "attempt": "../x"}]))
    assert _references_of_unreadable(location(tmp_path), 1) is None  # cannot be told: gc deletes no data
    rewrite_root(tmp_path, lambda d: d.pop("references"))
    assert _references_of_unreadable(location(tmp_path), 1) is None  # a root without its declaration


def test_a_global_chunk_outside_its_tensor_is_refused_before_it_is_read(tmp_path):
    states = [rank_state(r) for r in range(3)]
    for s in states:
        s["model"]["big"] = torch.arange(4096.0).reshape(64, 64)
    save_world(tmp_path, 3, states, replicated=["model.big"], chunk_bytes=2048)
    assert stored_root(tmp_path)["globals"]["model.big"]["ranks"] == [[0, 2]]
    index_doc, put = _rewrite_index(tmp_path, 1)
    chunk = index_doc["shards"]["model.big"]["chunks"][0]
    chunk["offsets"][0] = 63  # 4 rows from row 63: past the tensor's end
    put(index_doc)
    assert "lies outside the tensor" in load_error(tmp_path, rank=0)


def test_mixed_format_votes_are_refused_naming_the_ranks(tmp_path):
    where = location(tmp_path)
    attempt = names.new_attempt_id()
    other_rank(where, attempt, 1, 2, rank_state(1))  # a version 4 vote
    future = start_save(rank_state(0), where, rt=runtime(), attempt=attempt, step=STEP, rank=0, world_size=2,
                        metrics=None, options=SaveOptions(commit_timeout=TIMEOUT, indexed=False))
    with pytest.raises(CommitError, match=r"ranks \[1\] voted in format version 4, rank 0 in 3"):
        future.result(timeout=TIMEOUT)


def test_a_referenced_file_gone_fails_the_vote_of_the_rank_that_refers_to_it(tmp_path):
    """What the version 3 committer checked of every reference, each rank checks of its
    own before it votes."""
    from ckptstore.checkpoint.indexes import check_referenced_files

    where = LocalStorage(str(tmp_path / names.step_dir_name(2)))
    gone = fmt.Blob(names.data_file_name(names.new_attempt_id(), 0, 0), 0, 8, 8, (), "0" * 32, step=1)
    with pytest.raises(CommitError, match="refers to vanished"):
        check_referenced_files(where, [gone])


def test_an_incremental_multi_rank_save_declares_its_references_in_the_root(tmp_path):
    """Each rank references its own unchanged chunks of the step before; the root
    declares the (step, attempt) they read, which gc keeps while the new step lives."""
    from ckptstore.checkpoint.gc import execute, plan
    from ckptstore.checkpoint.references import index as references_of_rank
    from ckptstore.checkpoint.retention import Retention

    states = [rank_state(r) for r in range(2)]
    for r, s in enumerate(states):
        s["big"] = torch.arange(65536.0) + r  # 256 KiB: referenced when unchanged
    save_world(tmp_path, 2, states)
    base = Store(str(tmp_path)).manifest(STEP)
    states[1]["pos"] = 1000
    save_world(tmp_path, 2, states, step=STEP + 1, references={r: references_of_rank(base, r) for r in range(2)},
               reference_base=(STEP, 1))
    doc = json.loads((tmp_path / names.step_dir_name(STEP + 1) / names.manifest_name(1)).read_bytes())
    assert doc["references"] == [{"step": STEP, "attempt": base.attempt}]
    assert doc["referenced_bytes"] == 2 * 65536 * 4
    store = Store(str(tmp_path))
    out = store.load(STEP + 1, rank=1)
    assert out["pos"] == 1000 and torch.equal(out["big"], states[1]["big"])
    execute(LocalStorage(str(tmp_path)), plan(LocalStorage(str(tmp_path)), Retention(last=1), grace=0))
    assert store.steps() == [STEP + 1]
    assert torch.equal(store.load(STEP + 1, rank=0)["big"], states[0]["big"])  # step 7's files stayed
    assert not verify(str(tmp_path / names.step_dir_name(STEP + 1)))
