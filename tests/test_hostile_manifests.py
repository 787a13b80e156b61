"""Hostile and damaged metadata: every stored name, length and document is untrusted.

Each case plants what an attacker or a bad disk could leave in a store (a manifest whose
``attempt`` climbs out of the store, a zstd frame that lies about its size, a JSON bomb,
a FIFO where a data file belongs, a generation beyond the names' width) and checks the
outcome the issue demands: a FormatError or IntegrityError naming what failed, bounded
memory, the store's tools going on with the rest, and nothing committed lost.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
import zstandard
from cliutil import cli, cli_env, files_below

import ckptstore
from ckptstore import format as fmt
from ckptstore import names
from ckptstore.checkpoint.manifests import read_manifest
from ckptstore.errors import CommitError, FormatError, IntegrityError
from ckptstore.resume import CheckpointSkippedWarning
from ckptstore.storage import LocalStorage

pytestmark = pytest.mark.usefixtures("observe_earlier_failures")


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 64, generator=g), "z": torch.zeros(4096), "step": step}


def _store(root, steps=(1, 2, 3)) -> ckptstore.Store:
    store = ckptstore.Store(root)
    for s in steps:
        store.save(s, _state(s)).result()
    return store


def _manifest_path(location: str) -> str:
    (name,) = [n for n in os.listdir(location) if names.parse_manifest_name(n)]
    return os.path.join(location, name)


def _edit(location: str, change) -> None:
    """Rewrite the visible manifest of ``location`` through ``change(dict)`` (in place)."""
    path = _manifest_path(location)
    with open(path) as f:
        d = json.load(f)
    change(d)
    with open(path, "w") as f:
        json.dump(d, f)


def _files_of(d: dict):
    for r in d["ranks"]:
        yield r["skeleton"]
        for e in r["tensors"].values():
            yield from e["chunks"]


# ---------------------------------------------------------------------------- names (1)
@pytest.mark.parametrize("attempt", ["../../../victim", "../../step-000000000003", "..", "a/b",
                                     "20261130T041729-50678b3e979b/../../x", ""])
def test_I4_I7_gc_never_deletes_outside_the_store_through_a_manifest_attempt(tmp_path, attempt):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep me")
    root = tmp_path / "a" / "b" / "store"
    store = _store(str(root))
    loc = str(root / names.step_dir_name(1))

    def change(d):
        old = d["attempt"]
        d["attempt"] = attempt
        for b in _files_of(d):
            b["file"] = b["file"].replace(old, attempt)

    _edit(loc, change)
    with pytest.raises(FormatError) as ei:
        store.load(1)
    assert names.manifest_name(1) in str(ei.value)
    before = files_below(tmp_path)
    result = cli("gc", str(root), "--keep-last", "1", "--grace", "0")
    assert result.exit_code == 0, result.output
    assert (victim / "precious.txt").read_text() == "keep me"
    after = files_below(tmp_path)
    # Only the unreferenced step 2 went; the unreadable step 1 is kept whole, step 3 loads.
    assert {k for k in before if k not in after} == {k for k in before if f"{names.step_dir_name(2)}/" in k}
    assert store.steps() == [1, 3] and store.load(3)["step"] == 3


def test_I4_manifest_naming_another_attempts_file_is_refused(tmp_path):
    """A checkpoint may only name its own attempt's data files, so gc's liveness rule
    (an attempt lives iff a retained manifest names it) covers every byte a load reads."""
    store = _store(str(tmp_path / "s"), steps=(1, 2))
    other = store.manifest(2).attempt

    def change(d):
        d["ranks"][0]["skeleton"]["file"] = names.data_file_name(other, 0, 0)

    _edit(str(tmp_path / "s" / names.step_dir_name(1)), change)
    with pytest.raises(FormatError, match="another attempt"):
        store.load(1)
    assert cli("verify", str(tmp_path / "s")).exit_code == 1


@pytest.mark.parametrize("bad", ["/etc/passwd", "attempts/../../x", "data.bin", "attempts/x/data-r00000-s00.bin",
                                 [], {}, None, 7])
def test_I4_blob_file_outside_the_grammar_is_refused(tmp_path, bad):
    store = _store(str(tmp_path / "s"), steps=(1,))
    _edit(str(tmp_path / "s" / names.step_dir_name(1)), lambda d: d["ranks"][0]["skeleton"].update(file=bad))
    with pytest.raises(FormatError):
        store.load(1)


def test_names_round_trip_and_refuse_what_does_not_fit():
    a = names.new_attempt_id()
    assert names.parse_data_file(names.data_file_name(a, 7, 1)) == (a, 7, 1)
    assert names.parse_vote_leaf(names.vote_name(a, 3).rsplit("/", 1)[1]) == 3
    assert names.attempt_leaf_kind(names.heartbeat_name(a, 2).rsplit("/", 1)[1]) == "heartbeat"
    assert names.attempt_leaf_kind("abort.json") == "abort"
    assert names.attempt_leaf_kind("manifest-0000000001.json.tmp-0a1b2c3d") == "temp"
    assert names.attempt_leaf_kind("evil") is None
    assert names.parse_manifest_name(names.manifest_name(names.MAX_GENERATION)) == names.MAX_GENERATION
    for bad_gen in (0, names.MAX_GENERATION + 1, -1, True):
        with pytest.raises(FormatError):
            names.manifest_name(bad_gen)
    for bad_name in ("manifest-10000000000.json", "manifest-0000000000.json", "manifest-000000001a.json",
                     " manifest-0000000001.json", "manifest-0000000001.json\n"):
        assert names.parse_manifest_name(bad_name) is None
    for bad_attempt in ("../x", "20261130T041729-50678B3E979B", "20261130T041729-50678b3e979b\n", None):
        assert not names.is_attempt_id(bad_attempt)
        with pytest.raises(FormatError):
            names.attempt_dir(bad_attempt)
    with pytest.raises(FormatError):
        names.data_file_name(a, names.MAX_WORLD_SIZE, 0)


# ---------------------------------------------------------------------------- generations (2)
def test_I6_planted_last_generation_never_makes_a_save_retire_the_older_ones(tmp_path):
    loc = str(tmp_path / "latest.pt")
    ckptstore.save(_state(1), loc).result()
    with open(_manifest_path(loc)) as f:
        d = json.load(f)
    d["generation"] = names.MAX_GENERATION
    with open(os.path.join(loc, names.manifest_name(names.MAX_GENERATION)), "w") as f:
        json.dump(d, f)
    with pytest.raises(CommitError, match="highest a manifest name can hold"):
        ckptstore.save(_state(2), loc).result()
    # Nothing retired: both manifests stay, and what is visible still loads.
    assert sorted(n for n in os.listdir(loc) if names.parse_manifest_name(n)) == [
        names.manifest_name(1), names.manifest_name(names.MAX_GENERATION)]
    assert ckptstore.load(loc)["step"] == 1


def test_I4_generation_differing_from_its_file_name_is_refused(tmp_path):
    loc = str(tmp_path / "c")
    ckptstore.save(_state(1), loc).result()
    _edit(loc, lambda d: d.update(generation=5))
    with pytest.raises(FormatError, match="generation 5"):
        ckptstore.load(loc)


# ---------------------------------------------------------------------------- parsing (4)
def _bad_json_cases(d: dict) -> dict[str, bytes]:
    body = json.dumps(d)
    nested = body.replace('"metrics": {}', '"metrics": {"x": ' + "[" * 100000 + "]" * 100000 + "}")
    assert nested != body
    return {
        "deep nesting": nested.encode(),
        "yesterday": json.dumps({**d, "committed_at": "yesterday"}).encode(),
        "duplicate key": body.replace('"step": ', '"step": 1, "step": ', 1).encode(),
        "NaN": body.replace('"metrics": {}', '"metrics": {"loss": NaN}').encode(),
        "huge int": body.replace('"world_size": 1', '"world_size": 1' + "0" * 5000).encode(),
        "not utf-8": b"\xff\xfe" + body.encode(),
        "codec param": body.replace('"codec": [', '"codec": [{"id": "zstd", "level": 1, "dict": "x"}, ', 1).encode()
        if '"codec": [' in body else b"",
        "world size 4e7": json.dumps({**d, "world_size": 40_000_000}).encode(),
        "ndim 65": json.dumps(_with_chunk(d, shape=[1] * 65)).encode(),
        "2**62 bytes": json.dumps(_with_chunk(d, shape=[1 << 40, 1 << 40])).encode(),
        "offset 2**63": json.dumps(_with_blob(d, offset=1 << 63)).encode(),
        "raw blob lengths differ": json.dumps(_with_blob(d, length=3)).encode(),
        "zstd beyond its ratio": json.dumps(_with_blob(d, codec=[{"id": "zstd", "level": 1}],
                                                       raw_length=1 << 40, length=16)).encode(),
    }


def _with_chunk(d: dict, **entry) -> dict:
    d = json.loads(json.dumps(d))
    next(iter(d["ranks"][0]["tensors"].values())).update(entry)
    return d


def _with_blob(d: dict, **fields) -> dict:
    d = json.loads(json.dumps(d))
    next(iter(d["ranks"][0]["tensors"].values()))["chunks"][0].update(fields)
    return d


def test_I4_every_malformed_manifest_is_a_format_error_naming_the_file(tmp_path):
    loc = str(tmp_path / "c")
    ckptstore.save({"w": torch.arange(100.0)}, loc, compression="none").result()
    path = _manifest_path(loc)
    with open(path) as f:
        good = json.load(f)
    cases = {k: v for k, v in _bad_json_cases(good).items() if v}
    assert len(cases) >= 12
    for what, data in cases.items():
        with open(path, "wb") as f:
            f.write(data)
        with pytest.raises(FormatError) as ei:
            read_manifest(LocalStorage(loc), 1)
        assert names.manifest_name(1) in str(ei.value), what


def test_I4_one_bad_manifest_never_takes_ls_verify_gc_down(tmp_path):
    root = str(tmp_path / "s")
    store = _store(root)
    path = _manifest_path(os.path.join(root, names.step_dir_name(2)))
    with open(path, "w") as f:
        f.write('{"a":' * 50000 + "1" + "}" * 50000)
    ls = json.loads(cli("ls", "--json", root).stdout)
    assert [r["step"] for r in ls] == [1, 3, 2] or sorted(r["step"] for r in ls) == [1, 2, 3]
    assert [("error" in r) for r in ls if r["step"] == 2] == [True]
    v = cli("verify", "--json", root)
    assert v.exit_code == 1
    report = {c["step"]: c["ok"] for c in json.loads(v.stdout)["checkpoints"]}
    assert report == {1: True, 2: False, 3: True}
    g = cli("gc", root, "--keep-last", "1", "--grace", "0")
    assert g.exit_code == 0, g.output
    assert os.path.exists(path)  # kept: gc keeps what it cannot parse
    assert store.steps() == [2, 3] and store.load(3)["step"] == 3


def test_I4_vote_of_another_rank_or_attempt_is_refused_at_commit(tmp_path):
    from cliutil import failed_attempt

    where = LocalStorage(tmp_path / "loc")
    attempt = failed_attempt(where, _state(1), rank=1, step=1)
    vote = tmp_path / "loc" / names.vote_name(attempt, 1)
    d = json.loads(vote.read_bytes())
    d["rank"] = 0
    vote.write_text(json.dumps(d))
    from ckptstore.checkpoint.votes import read_votes

    # (version 4: the vote names an index in rank 1's file, which rank 0's cannot)
    with pytest.raises(FormatError, match="holds the vote of rank 0|rank 0's index lies in .*data-r00001"):
        read_votes(where, attempt)


# ---------------------------------------------------------------------------- coverage (3)
def _brute_force_exact(shape, boxes) -> bool:
    count = np.zeros(shape, dtype=np.int64)
    for off, size in boxes:
        count[tuple(slice(o, o + s) for o, s in zip(off, size))] += 1
    return bool((count == 1).all())


def _entry(shape, boxes) -> fmt.TensorEntry:
    blob = lambda n: fmt.Blob(names.data_file_name(names.new_attempt_id(), 0, 0), 0, n, n, (), "0" * 32)  # noqa: E731
    return fmt.TensorEntry("uint8", tuple(shape),
                           tuple(fmt.Chunk(tuple(o), tuple(s), blob(int(np.prod(s)))) for o, s in boxes))


def test_I5_corner_cover_check_agrees_with_brute_force_on_random_boxes():
    rng = random.Random(1234)
    verdicts = set()
    for trial in range(600):
        nd = rng.randint(1, 3)
        shape = [rng.randint(1, 5) for _ in range(nd)]
        if rng.random() < 0.5:  # a grid tiling, perturbed now and then
            cuts = [sorted({0, dim, *(rng.randint(0, dim) for _ in range(2))}) for dim in shape]
            boxes = [([c[i] for c, i in zip(cuts, idx)], [c[i + 1] - c[i] for c, i in zip(cuts, idx)])
                     for idx in np.ndindex(*[len(c) - 1 for c in cuts])]
            if rng.random() < 0.5 and len(boxes) > 1:
                boxes[rng.randrange(len(boxes))] = boxes[rng.randrange(len(boxes))]
        else:
            boxes = []
            for _ in range(rng.randint(1, 5)):
                off = [rng.randint(0, d - 1) for d in shape]
                boxes.append((off, [rng.randint(1, d - o) for d, o in zip(shape, off)]))
        want = _brute_force_exact(shape, boxes)
        try:
            fmt.validate_coverage(_entry(shape, boxes), "t")
            got = True
        except FormatError:
            got = False
        assert got == want, (shape, boxes)
        verdicts.add(got)
    assert verdicts == {True, False}


def test_I5_many_column_chunks_are_validated_and_an_overlap_among_them_found():
    n = 8000
    shape = (4, n)
    boxes = [((0, i), (4, 1)) for i in range(n)]
    fmt.validate_coverage(_entry(shape, boxes), "columns")
    boxes[5000] = ((0, 4999), (4, 1))
    with pytest.raises(FormatError, match="overlap or leave a gap"):
        fmt.validate_coverage(_entry(shape, boxes), "columns")


# ---------------------------------------------------------------------------- bounded memory (3)
def _lying_frame_store(tmp_path, lie_in_manifest: bool) -> str:
    """A checkpoint whose one chunk's stored bytes are replaced by a 32 KiB zstd frame
    that decodes to 1 GiB of zeros (the manifest's raw_length stays honest unless
    ``lie_in_manifest``)."""
    loc = str(tmp_path / "c")
    ckptstore.save({"w": torch.zeros(4096)}, loc, compression="zstd").result()
    frame = zstandard.ZstdCompressor(level=3, write_content_size=True).compress(b"\0" * (1 << 30))
    assert len(frame) < 64 << 10
    d = json.load(open(_manifest_path(loc)))
    chunk = d["ranks"][0]["tensors"]["w"]["chunks"][0]
    data = os.path.join(loc, chunk["file"])
    with open(data, "r+b") as f:
        f.seek(0, 2)
        offset = f.tell()
        f.write(frame)
    chunk.update(offset=offset, length=len(frame))
    if lie_in_manifest:
        chunk["raw_length"] = 1 << 30
    with open(_manifest_path(loc), "w") as f:
        json.dump(d, f)
    return loc


# Peak RSS of the child's own address space (VmHWM): ru_maxrss survives exec on Linux
# and would start at the pytest parent's size, hiding any growth below it.
_PEAK = """
import sys, ckptstore

def hwm_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))

before = hwm_kib()
try:
    {call}
    print("ok")
except Exception as e:
    print(type(e).__name__, str(e)[:2000].replace(chr(10), " "))
print((hwm_kib() - before) // 1024)
"""


def _peak_mib(call: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", _PEAK.format(call=call)], capture_output=True, text=True,
                         env=cli_env(), timeout=300)
    lines = out.stdout.strip().splitlines()
    assert len(lines) >= 2, out.stderr
    return lines[-2], int(lines[-1])


@pytest.mark.parametrize("call", ["ckptstore.load({loc!r})",
                                  "assert ckptstore.verify({loc!r})"])
def test_lying_zstd_frame_costs_no_memory_on_load_and_verify(tmp_path, call):
    loc = _lying_frame_store(tmp_path, lie_in_manifest=False)
    outcome, grew = _peak_mib(call.format(loc=loc))
    assert outcome.startswith("IntegrityError") or outcome == "ok", outcome
    if outcome.startswith("IntegrityError"):
        assert "zstd frame states 1073741824 bytes" in outcome
    assert grew < 200, f"peak RSS grew by {grew} MiB"


def test_flipped_bit_in_a_frame_header_is_an_integrity_error(tmp_path):
    loc = str(tmp_path / "c")
    ckptstore.save({"w": torch.zeros(1 << 16)}, loc, compression="zstd").result()
    chunk = json.load(open(_manifest_path(loc)))["ranks"][0]["tensors"]["w"]["chunks"][0]
    assert chunk["codec"][-1]["id"] == "zstd"
    path = os.path.join(loc, chunk["file"])
    original = open(path, "rb").read()
    for byte in range(4, 14):  # the frame header after the magic number
        for bit in (0, 3, 7):
            data = bytearray(original)
            data[chunk["offset"] + byte] ^= 1 << bit
            open(path, "wb").write(data)
            try:
                ckptstore.load(loc)
            except IntegrityError as e:
                assert "'w'" in str(e)
            # (a flip that leaves the frame valid and the hash equal cannot happen: the
            # hash covers the decoded bytes, so loading succeeded only with them intact)


def test_claimed_lengths_beyond_the_file_are_refused_before_allocating(tmp_path):
    loc = str(tmp_path / "c")
    ckptstore.save({"w": torch.arange(1000.0)}, loc, compression="none").result()

    def change(d):
        e = d["ranks"][0]["tensors"]["w"]
        end = os.path.getsize(os.path.join(loc, e["chunks"][0]["file"]))
        e["shape"] = [1 << 38]  # its blob now starts where the file ends: no other blob's bytes
        e["chunks"][0].update(sizes=[1 << 38], offset=end, length=1 << 40, raw_length=1 << 40)

    _edit(loc, change)
    outcome, grew = _peak_mib(f"ckptstore.load({loc!r})")
    assert outcome.startswith("IntegrityError") and "file is truncated" in outcome, outcome
    assert grew < 200


def test_manifest_over_the_size_cap_is_refused_unread(tmp_path, monkeypatch):
    loc = str(tmp_path / "c")
    ckptstore.save(_state(1), loc).result()
    ckptstore.configure(max_manifest_bytes=100)
    try:
        with pytest.raises(FormatError, match="larger than the cap"):
            ckptstore.load(loc)
    finally:
        ckptstore.configure()
    assert ckptstore.load(loc)["step"] == 1


# ---------------------------------------------------------------------------- special files (5)
def test_fifo_in_place_of_a_data_file_fails_at_once(tmp_path):
    loc = str(tmp_path / "c")
    ckptstore.save(_state(1), loc).result()
    data = os.path.join(loc, read_manifest(LocalStorage(loc), 1).ranks[0].skeleton.file)
    os.unlink(data)
    os.mkfifo(data)
    outcome = []

    def load():
        try:
            ckptstore.load(loc)
        except Exception as e:  # noqa: BLE001 (recorded and asserted below)
            outcome.append(e)

    t = threading.Thread(target=load, daemon=True)
    t.start()
    t.join(120)  # a safety net only: the load must fail on its own, at once
    assert not t.is_alive(), "load hangs on a FIFO"
    assert len(outcome) == 1 and isinstance(outcome[0], IntegrityError), outcome
    assert "regular" in str(outcome[0]) or "missing" in str(outcome[0])


def test_container_length_that_lies_costs_only_what_the_stream_holds(tmp_path):
    import io
    import struct

    from ckptstore.checkpoint.container import MAGIC

    stream = io.BytesIO(MAGIC + struct.pack("<I", 4) + b"name" + struct.pack("<Q", 1 << 60) + b"x" * 100)
    with pytest.raises(FormatError, match="ends inside object 'name'"):
        ckptstore.load(stream)
    path = tmp_path / "c.bin"
    path.write_bytes(stream.getvalue())
    outcome, grew = _peak_mib(f"ckptstore.load({str(path)!r})")
    assert outcome.startswith("FormatError"), outcome
    assert grew < 200


def test_I6_retiring_never_deletes_the_new_generations_files_an_old_manifest_names(tmp_path):
    """A planted older generation that names the attempt of the save being committed:
    retiring it must drop that manifest, never the new checkpoint's files."""
    from ckptstore.checkpoint.manifests import generations

    loc = str(tmp_path / "c")
    ckptstore.save(_state(1), loc).result()
    real_put = LocalStorage.put

    def planting_put(self, key, data, *, if_absent=False):
        gen = names.parse_manifest_name(key)
        if gen == 2:  # the new generation's manifest: plant a copy of it as generation 1
            os.unlink(os.path.join(loc, names.manifest_name(1)))
            d = json.loads(bytes(data))
            d["generation"] = 1
            real_put(self, names.manifest_name(1), json.dumps(d).encode())
        return real_put(self, key, data, if_absent=if_absent)

    LocalStorage.put = planting_put
    try:
        ckptstore.save(_state(2), loc).result()
    finally:
        LocalStorage.put = real_put
    assert generations(LocalStorage(loc)) == [2]
    assert ckptstore.load(loc)["step"] == 2
    assert ckptstore.verify(loc) == []


def test_I7_temp_file_inside_a_committed_attempt_goes_after_the_grace_the_attempt_stays(tmp_path):
    from cliutil import age_files

    root = str(tmp_path / "s")
    store = _store(root, steps=(1,))
    attempt_dir = os.path.join(root, names.step_dir_name(1), names.attempt_dir(store.manifest(1).attempt))
    debris = os.path.join(attempt_dir, "vote-r00001.json.tmp-0a1b2c3d")
    with open(debris, "wb") as f:
        f.write(b"{")
    assert cli("gc", root, "--grace", "1h").exit_code == 0
    assert os.path.exists(debris)  # young: a put may still be in progress
    age_files(root, 7200)
    assert cli("gc", root, "--grace", "1h").exit_code == 0
    assert not os.path.exists(debris)
    assert ckptstore.verify(os.path.join(root, names.step_dir_name(1))) == [] and store.load(1)["step"] == 1


def test_I4_blobs_sharing_stored_bytes_are_refused(tmp_path):
    """Four tensors pointing at one small zstd frame that honestly holds much more would
    make a load allocate a multiple of what the files hold: refused at parse time."""
    loc = str(tmp_path / "c")
    ckptstore.save({f"t{i}": torch.zeros(4096) for i in range(4)}, loc, compression="zstd").result()

    def change(d):
        chunks = [e["chunks"][0] for e in d["ranks"][0]["tensors"].values()]
        for c in chunks[1:]:
            c.update({k: chunks[0][k] for k in ("offset", "length", "codec", "xxh3_128")})

    _edit(loc, change)
    with pytest.raises(FormatError, match="overlap"):
        ckptstore.load(loc)
    assert cli("verify", loc).exit_code == 1


def test_I5_chunks_splitting_many_dimensions_are_refused_without_building_their_corners():
    """256 chunks of a [2]*16 tensor that together split all 16 dimensions: checking them
    by corners would sort 2**16 rows per chunk (gigabytes): refused by the bound first."""
    shape = [2] * 16
    boxes = []
    for i in range(256):
        low = i < 128  # half the chunks split dims 0-7, half dims 8-15
        off = [((i % 128) >> b) & 1 for b in range(8)]
        offsets = off + [0] * 8 if low else [0] * 8 + off
        sizes = [1] * 8 + [2] * 8 if low else [2] * 8 + [1] * 8
        boxes.append((offsets, sizes))
    with pytest.raises(FormatError, match="split 16 dimensions"):
        fmt.validate_coverage(_entry(shape, boxes), "t")


def test_I7_gc_deletes_only_what_ckptstore_wrote_inside_an_attempt(tmp_path):
    """Foreign entries planted inside an attempt gc removes (a symlink, a FIFO, a
    subdirectory, an unknown name, a user's x.tmp-... file) stay, and are reported."""
    from cliutil import age_files

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_text("keep")
    root = str(tmp_path / "s")
    store = _store(root, steps=(1, 2))
    attempt = os.path.join(root, names.step_dir_name(1), names.attempt_dir(store.manifest(1).attempt))
    os.symlink(outside / "victim", os.path.join(attempt, "link"))
    os.mkfifo(os.path.join(attempt, "fifo"))
    os.makedirs(os.path.join(attempt, "sub"))
    open(os.path.join(attempt, "sub", "keep.txt"), "w").write("mine")
    open(os.path.join(attempt, "notes.txt"), "w").write("mine")
    open(os.path.join(attempt, "y.tmp-0badf00d"), "w").write("mine")
    age_files(root, 7200)
    result = cli("gc", "--json", root, "--keep-last", "1", "--grace", "1h")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert [d["location"] for d in report["deleted"]] == [names.step_dir_name(1)]
    assert "data-r00000-s00.bin" in os.listdir(attempt)  # released: the run after the grace deletes it
    age_files(root, 7200)  # (the release mark too)
    result = cli("gc", "--json", root, "--keep-last", "1", "--grace", "1h")
    assert result.exit_code == 0, result.output
    assert [(d["kind"], d["location"]) for d in json.loads(result.stdout)["deleted"]] == [
        ("attempt", names.step_dir_name(1))]
    left = sorted(os.listdir(attempt))
    assert left == ["fifo", "link", "notes.txt", "sub", "y.tmp-0badf00d"]
    assert open(os.path.join(attempt, "sub", "keep.txt")).read() == "mine"
    assert (outside / "victim").read_text() == "keep"
    assert {k.rsplit("/", 1)[-1] for k in report["foreign"]} >= {"fifo", "link", "notes.txt", "keep.txt",
                                                                  "y.tmp-0badf00d"}
    assert store.steps() == [2] and store.load(2)["step"] == 2


def test_a_deep_directory_tree_costs_neither_stack_nor_the_tools(tmp_path):
    root = str(tmp_path / "s")
    _store(root, steps=(1,))
    top = os.path.join(root, names.step_dir_name(1), "attempts")
    made = []
    for _ in range(1500):  # deeper than Python's recursion limit
        made.append(os.path.join(made[-1] if made else top, "d"))
        os.mkdir(made[-1])
    try:
        for cmd in (["ls", "--all", "--json"], ["verify"], ["gc", "--grace", "0"]):
            result = cli(*cmd, root)
            assert result.exit_code == 0, (cmd, result.output[-500:])
        assert ckptstore.Store(root).load(1)["step"] == 1
    finally:
        for d in reversed(made):  # bottom up: pytest's recursive cleanup could not
            os.rmdir(d)


def test_a_compressed_skeleton_that_lies_about_its_size_costs_no_memory(tmp_path):
    loc = str(tmp_path / "c")
    ckptstore.save({"w": torch.zeros(4096)}, loc, compression="zstd").result()
    d = json.load(open(_manifest_path(loc)))
    skel = d["ranks"][0]["skeleton"]
    with open(os.path.join(loc, skel["file"]), "r+b") as f:
        f.seek(0, 2)
        end = f.tell()
        f.write(os.urandom(32 << 10))
    skel.update(offset=end, length=32 << 10, raw_length=1 << 30, codec=[{"id": "zstd", "level": 1}])
    with open(_manifest_path(loc), "w") as f:
        json.dump(d, f)
    for call in (f"ckptstore.load({loc!r})", f"assert ckptstore.verify({loc!r})"):
        outcome, grew = _peak_mib(call)
        assert outcome.startswith("IntegrityError") or outcome == "ok", outcome
        assert grew < 200, (call, grew)


def _plant_skeleton(loc: str, data: bytes) -> None:
    """Make ``data`` the (raw, correctly hashed) skeleton of the checkpoint at ``loc``."""
    from ckptstore.hashing import digest

    d = json.load(open(_manifest_path(loc)))
    skel = d["ranks"][0]["skeleton"]
    with open(os.path.join(loc, skel["file"]), "r+b") as f:
        f.seek(0, 2)
        end = f.tell()
        f.write(data)
    skel.update(offset=end, length=len(data), raw_length=len(data), codec=[], xxh3_128=digest(data))
    with open(_manifest_path(loc), "w") as f:
        json.dump(d, f)


def _pickled_persistent_id(pid) -> bytes:
    import io
    import pickle

    marker = object()

    class Pickler(pickle.Pickler):
        def persistent_id(self, o):
            return pid if o is marker else None

    buf = io.BytesIO()
    Pickler(buf, protocol=2).dump({"w": marker})
    return buf.getvalue()


@pytest.mark.parametrize("skeleton", [
    _pickled_persistent_id(("storage", 5, "l:w", "cpu", 4096)),
    _pickled_persistent_id(("storage", torch.FloatStorage, ["l:w"], "cpu", 4096)),
    _pickled_persistent_id(("storage", torch.FloatStorage, "l:w", 7, 4096)),
    _pickled_persistent_id(("storage", torch.FloatStorage, "l:w", "cpu", None)),
    _pickled_persistent_id(("storage", torch.FloatStorage, "l:w", "cpu", -1)),
    b"",
    b"\x80\x02}q\x00",
    b"\x80\x02J\x01",
    b"\x80\x02\xff\xfe\xfd.",
], ids=["int type", "list ref", "int location", "no numel", "negative numel", "empty", "truncated",
        "cut integer", "not a pickle"])
def test_hostile_skeletons_are_format_errors(tmp_path, skeleton):
    loc = str(tmp_path / "c")
    ckptstore.save({"w": torch.zeros(1024)}, loc, compression="none").result()
    _plant_skeleton(loc, skeleton)
    with pytest.raises(FormatError) as ei:
        ckptstore.load(loc)
    assert loc in str(ei.value) and "skeleton" in str(ei.value)
    [problem] = ckptstore.verify(loc)  # its hash matches: only the rebuild finds it
    assert (problem.rank, problem.key) == (0, None) and problem.message in str(ei.value)


def _pickled_oversized_rebuild(stored_floats: int = 4096, size=(1 << 20,), stride=(1,), offset=0) -> bytes:
    """Only allow-listed calls: _rebuild_tensor_v2 (2**20 floats) over the floats stored."""
    import io
    import pickle
    from collections import OrderedDict

    storage, tensor = object(), object()

    class Pickler(pickle.Pickler):
        def persistent_id(self, o):
            return ("storage", torch.FloatStorage, "l:w", "cpu", stored_floats) if o is storage else None

        def reducer_override(self, o):
            if o is tensor:
                return torch._utils._rebuild_tensor_v2, (storage, offset, size, stride, False, OrderedDict())
            return NotImplemented

    buf = io.BytesIO()
    Pickler(buf, protocol=2).dump({"w": tensor})
    return buf.getvalue()


def test_a_skeleton_that_rebuilds_past_its_storage_is_a_format_error_and_resume_passes_over_it(tmp_path):
    """torch raises a bare RuntimeError for it ("Trying to resize storage that is not
    resizable"), which load let through as it lets map_location's own errors through."""
    root = str(tmp_path / "s")
    store = _store(root, steps=(1, 2))
    loc = os.path.join(root, names.step_dir_name(2))
    good = store.load(1)
    _plant_skeleton(loc, _pickled_oversized_rebuild())
    with pytest.raises(FormatError, match="malformed object skeleton: RuntimeError") as ei:
        ckptstore.load(loc)
    assert loc in str(ei.value)
    with pytest.warns(CheckpointSkippedWarning, match="step 2"):
        state, info = store.resume()
    assert info.step == 1 and all(torch.equal(state[k], good[k]) for k in good if isinstance(good[k], torch.Tensor))
    with pytest.raises(RuntimeError, match="cuda") as missing:  # map_location's error stays torch's
        store.load(1, map_location="cuda:0")
    assert not isinstance(missing.value, FormatError)


def test_a_rebuild_that_allocates_more_than_its_checkpoint_stored_is_a_format_error(tmp_path):
    """A quantized tensor's rebuild allocates its own tensor, sized by the skeleton. One
    that fails asking for more than the rank stored in all is the skeleton's fault (a
    sound one never asks that): a FormatError, which resume passes over, where a failure
    within what was stored stays the machine's limit (torch's RuntimeError)."""
    import io
    import pickle
    from collections import OrderedDict

    storage, tensor = object(), object()

    class Pickler(pickle.Pickler):
        def persistent_id(self, o):
            return ("storage", torch.QInt8Storage, "l:w", "cpu", 4) if o is storage else None

        def reducer_override(self, o):
            if o is tensor:
                return torch._utils._rebuild_qtensor, (storage, 0, (1 << 50,), (1,),
                                                      (torch.per_tensor_affine, 0.1, 0), False, OrderedDict())
            return NotImplemented

    buf = io.BytesIO()
    Pickler(buf, protocol=2).dump({"w": tensor})
    root = str(tmp_path / "s")
    store = ckptstore.Store(root, compression="none")
    for step in (1, 2):
        store.save(step, {"w": torch.full((4,), step, dtype=torch.int8)}).result()
    loc = os.path.join(root, names.step_dir_name(2))
    _plant_skeleton(loc, buf.getvalue())
    # (the manifest agreeing with the skeleton's storage: a disagreement is refused first)
    _edit(loc, lambda d: d["ranks"][0]["tensors"]["w"].update(dtype="qint8"))
    with pytest.raises(FormatError, match=r"malformed object skeleton: RuntimeError: .*allocate"):
        ckptstore.load(loc)
    with pytest.warns(CheckpointSkippedWarning, match="step 2"):
        state, info = store.resume()
    assert info.step == 1 and torch.equal(state["w"], torch.full((4,), 1, dtype=torch.int8))


@pytest.mark.parametrize("stored", [0, 1024])
def test_a_rebuild_past_its_stored_bytes_is_refused_wherever_the_storage_could_grow(tmp_path, stored):
    """torch grows a resizable storage to fit what a rebuild asks for. A load's storage
    of an empty tensor was resizable (uninitialised memory came back as the tensor), and
    so are the meta storages of map_location="meta", of a FakeTensorMode load and of
    verify's rebuild: each must refuse the skeleton, naming the tensor."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    loc = str(tmp_path / "c")
    ckptstore.save({"w": torch.zeros(stored)}, loc, compression="none").result()
    _plant_skeleton(loc, _pickled_oversized_rebuild(stored))
    with pytest.raises(FormatError, match="malformed object skeleton"):
        ckptstore.load(loc)
    grown = f"rebuilds tensor 'w' over {4 << 20} bytes, {4 * stored} stored"
    with pytest.raises(FormatError, match=grown):
        ckptstore.load(loc, map_location="meta")
    with FakeTensorMode(), pytest.raises(FormatError, match=grown):
        ckptstore.load(loc)
    [problem] = ckptstore.verify(loc)
    assert (problem.rank, problem.key) == (0, None) and grown in problem.message
    assert str(problem).startswith(f"{loc}: rank 0 skeleton in ") and str(problem).count(loc) == 1


def test_verify_finds_a_rebuild_whose_strides_reach_past_its_storage(tmp_path):
    """Meta's set_ checks no bounds (a stride of 2**62 passes it and grows nothing): the
    load refuses such a skeleton, so verify must say so too."""
    loc = str(tmp_path / "c")
    ckptstore.save({"w": torch.zeros(1024)}, loc, compression="none").result()
    _plant_skeleton(loc, _pickled_oversized_rebuild(1024, size=(3,), stride=(1 << 62,), offset=1000))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with pytest.raises(FormatError, match="overflowed"):
        ckptstore.load(loc)
    reach = "rebuilds tensor 'w' (shape [3], strides [4611686018427387904], offset 1000) past the 4096 bytes"
    [problem] = ckptstore.verify(loc)
    assert reach in problem.message
    with pytest.raises(FormatError) as on_meta:  # meta storages, however they came: the same check
        ckptstore.load(loc, map_location="meta")
    with FakeTensorMode(), pytest.raises(FormatError) as fake:
        ckptstore.load(loc)
    assert reach in str(on_meta.value) and reach in str(fake.value)


def test_a_tensor_claiming_more_than_its_frame_states_is_a_format_error_even_where_it_cannot_be_allocated(tmp_path):
    """8 MiB of noise labelled zstd, claiming 32768x that (256 GiB: within the format's
    cap, beyond this machine). The allocation fails before any byte is read; the frame
    header then says whose fault it is: the manifest's (a FormatError), not the
    machine's (MemoryError, kept for a claim the frames state)."""
    loc = str(tmp_path / "c")
    ckptstore.save({"w": torch.zeros(4)}, loc, compression="none").result()
    d = json.load(open(_manifest_path(loc)))
    entry = d["ranks"][0]["tensors"]["w"]
    chunk = entry["chunks"][0]
    stored = 8 << 20
    with open(os.path.join(loc, chunk["file"]), "ab") as f:
        end = f.tell()
        f.write(np.random.default_rng(0).integers(0, 256, stored, dtype=np.uint8).tobytes())
    claim = stored * 32768
    entry["shape"] = [claim // 4]
    chunk.update(sizes=[claim // 4], offset=end, length=stored, raw_length=claim, codec=[{"id": "zstd", "level": 3}])
    with open(_manifest_path(loc), "w") as f:
        json.dump(d, f)
    with pytest.raises(FormatError, match="tensor 'w'.*zstd frame is corrupt"):
        ckptstore.load(loc)


def test_cli_reads_a_single_file_container(tmp_path):
    path = tmp_path / "model.pt"
    path.write_bytes(b"")  # an existing plain file: save replaces it with a container
    ckptstore.save(_state(1), str(path)).result()
    listing = json.loads(cli("ls", "--json", str(path)).stdout)
    assert [(r["committed"], r["url"]) for r in listing] == [(True, str(path))]
    assert cli("verify", str(path)).exit_code == 0
    assert ckptstore.verify(str(path)) == [] and ckptstore.verify(path) == []  # the library, as the CLI
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0xFF
    path.write_bytes(bytes(data))
    assert cli("verify", str(path)).exit_code == 1
    assert ckptstore.verify(str(path))
    torch.save({"w": torch.ones(2)}, path)
    [problem] = ckptstore.verify(str(path))
    assert "not a ckptstore container" in problem.message
    assert cli("gc", str(path)).exit_code == 2


def test_dtype_aliases_and_a_step_that_disagrees_with_its_directory_are_refused(tmp_path):
    root = str(tmp_path / "s")
    store = _store(root, steps=(1, 2))
    _edit(os.path.join(root, names.step_dir_name(1)), lambda d: d.update(step=7))
    with pytest.raises(FormatError, match="says step 7"):
        store.load(1)
    listing = json.loads(cli("ls", "--json", root).stdout)
    assert [("error" in r) for r in listing if r["name"] == names.step_dir_name(1)] == [True]
    _edit(os.path.join(root, names.step_dir_name(2)),
          lambda d: next(iter(d["ranks"][0]["tensors"].values())).update(dtype="float"))
    with pytest.raises(FormatError, match="unknown dtype 'float'"):
        store.load(2)


def test_load_of_a_fifo_path_says_what_it_is(tmp_path):
    from ckptstore.errors import NotACheckpointError

    path = str(tmp_path / "pipe")
    os.mkfifo(path)
    with pytest.raises(NotACheckpointError, match="FIFO"):
        ckptstore.load(path)


def test_s3_root_prefix_obeys_the_key_grammar():
    pytest.importorskip("boto3")
    from ckptstore.storage import open_storage

    for bad in ("s3://bucket/a/../victim", "s3://bucket/a//b", "s3://bucket/./x"):
        with pytest.raises(FormatError):
            open_storage(bad, endpoint_url="http://127.0.0.1:9")


@pytest.mark.parametrize("message, machines", [
    ("DefaultCPUAllocator: can't allocate memory: you tried to allocate 4096 bytes.", True),
    ("DefaultCPUAllocator: can't allocate memory: you tried to allocate 4097000 bytes.", False),
    ("CUDA out of memory. Tried to allocate 1024.00 GiB. GPU 0 has a total capacity of 79 GiB", False),
    ("CUDA out of memory. Tried to allocate 3.00 KiB. GPU 0 has a total capacity of 79 GiB", True),
    ("cannot allocate", True),  # an allocator that does not say how much: the machine's limit
])
def test_an_allocation_failure_is_the_skeletons_fault_only_beyond_what_the_rank_stored(message, machines):
    """4 KiB stored: asking for more (in bytes, or in torch's CUDA units) is a malformed
    skeleton's doing; within it, or unknown, the machine's limit."""
    from types import SimpleNamespace

    from ckptstore.checkpoint.restore import _machines_limit

    entry = SimpleNamespace(nbytes=4096)
    state, manifest = SimpleNamespace(tensors={"w": entry}), SimpleNamespace(tensors={})
    assert _machines_limit(RuntimeError(message), state, manifest) is machines
