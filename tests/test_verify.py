"""``ckptstore verify`` and ``ckptstore.verify``: every damaged byte is found and named.

A randomised test flips one byte, truncates or deletes one manifest-referenced file per
trial; every trial must be detected (exit 1) and the problem must name the checkpoint,
the tensor key (or the skeleton), the file and the byte offset of the damaged blob (I3).
Also: ``--quick`` (sizes only, no chunk reads), the ``--json`` shape, exit codes of a
real ``python -m ckptstore.cli`` process, and that verify never changes the store.
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
from cliutil import cli, run_cli_processes, tree

import ckptstore
from ckptstore import format as fmt
from ckptstore.checkpoint.catalog import scan_store
from ckptstore.storage import LocalStorage

pytestmark = pytest.mark.usefixtures("observe_earlier_failures")

SEED = int(os.environ.get("CKPTSTORE_VERIFY_SEED", "6061"))
TRIALS_PER_KIND = 20


# ---------------------------------------------------------------------------- helpers
def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {
            "w": torch.randn(64, 64, generator=g),  # incompressible: stored raw
            "emb": torch.arange(4096, dtype=torch.int64) * (step + 1),  # compressible: shuffle+zstd
            "z": torch.zeros(1000, dtype=torch.bfloat16),
        },
        "step": step,
        "note": f"checkpoint {step}",
    }


def build_store(root) -> str:
    """Four committed checkpoints under ``root``: three Store steps (compression auto,
    auto, none) and one drop-in checkpoint ``plain`` saved twice (generation 2); small
    chunks, so each tensor spans several blobs."""
    auto = ckptstore.Store(root, compression="auto", chunk_bytes=8192)
    auto.save(0, _state(0), metrics={"loss": 3.0}).result()
    auto.save(1, _state(1), metrics={"loss": 2.0}).result()
    ckptstore.Store(root, compression="none", chunk_bytes=8192).save(2, _state(2)).result()
    ckptstore.save(_state(7), os.path.join(root, "plain"), chunk_bytes=8192).result()
    ckptstore.save(_state(8), os.path.join(root, "plain"), chunk_bytes=8192).result()
    return str(root)


def referenced(root) -> list[tuple[str, str, fmt.Manifest]]:
    """(checkpoint url, file name, manifest) for every file a visible manifest names."""
    out = []
    for loc in scan_store(LocalStorage(root)):
        assert loc.manifest is not None, loc.manifest_error
        for name in sorted(loc.manifest.files()):
            out.append((loc.storage.describe(), name, loc.manifest))
    return out


def blobs_in(manifest: fmt.Manifest, name: str) -> list[tuple[str | None, fmt.Blob]]:
    return [(key, b) for _, key, b in manifest.blobs() if b.file == name]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = build_store(tmp_path_factory.mktemp("verify") / "store")
    return root, tree(root)


# ---------------------------------------------------------------------------- randomised damage
def _damage(rng: random.Random, kind: str, path: str, manifest: fmt.Manifest, name: str):
    """Damage one file; returns {(key, blob offset)} of the blobs that must be reported
    (None for a deleted file: the file itself must be)."""
    size = os.path.getsize(path)
    if kind == "flip":
        at = rng.randrange(size)
        with open(path, "r+b") as f:
            f.seek(at)
            old = f.read(1)[0]
            f.seek(at)
            f.write(bytes([old ^ rng.randint(1, 255)]))
        hit = [(k, b.offset) for k, b in blobs_in(manifest, name) if b.offset <= at < b.offset + b.length]
        assert len(hit) == 1, f"byte {at} of {name} belongs to {len(hit)} blobs (I3: every stored byte is hashed once)"
        return set(hit), f"flip byte {at}"
    if kind == "truncate":
        keep = rng.randrange(size)
        os.truncate(path, keep)
        return {(k, b.offset) for k, b in blobs_in(manifest, name) if b.offset + b.length > keep}, f"truncate to {keep}"
    os.unlink(path)
    return None, "delete"


def test_I3_verify_detects_every_random_flip_truncation_and_deletion(pristine, tmp_path):
    root, before = pristine
    files = referenced(root)
    assert len({url for url, _, _ in files}) == 4
    originals = {os.path.join(url, name): open(os.path.join(url, name), "rb").read() for url, name, _ in files}
    rng = random.Random(SEED)
    assert cli("verify", root).exit_code == 0
    kinds = ["flip", "truncate", "delete"] * TRIALS_PER_KIND
    rng.shuffle(kinds)
    for trial, kind in enumerate(kinds):
        url, name, manifest = rng.choice(files)
        path = os.path.join(url, name)
        expected, what = _damage(rng, kind, path, manifest, name)
        label = f"seed {SEED} trial {trial}: {what} of {path}"
        try:
            res = cli("verify", "--json", root)
            assert res.exit_code == 1, f"{label}: not detected\n{res.output}"
            report = json.loads(res.stdout)
            assert report["ok"] is False
            bad = [c for c in report["checkpoints"] if not c["ok"]]
            assert [c["url"] for c in bad] == [url], f"{label}: {report}"
            problems = bad[0]["problems"]
            assert problems and all(p["file"] == name for p in problems), f"{label}: {problems}"
            assert all(p["text"].startswith(url + ":") for p in problems), f"{label}: {problems}"
            if expected is not None:
                assert {(p["key"], p["offset"]) for p in problems} == expected, f"{label}: {problems}"
                for p in problems:
                    assert (f"tensor {p['key']!r}" if p["key"] else "skeleton") in p["text"], p["text"]
                    assert f"at byte {p['offset']}" in p["text"], p["text"]
            # The library call on the one checkpoint agrees.
            assert ckptstore.verify(url) != [], label
            text = cli("verify", root)
            assert text.exit_code == 1 and f"FAIL  {url}\n" in text.stdout, f"{label}\n{text.output}"
            assert name in text.stdout, f"{label}\n{text.output}"
        finally:
            with open(path, "wb") as f:
                f.write(originals[path])
    assert cli("verify", root).exit_code == 0
    assert tree(root) == before


def test_I3_every_stored_byte_belongs_to_exactly_one_hashed_blob(pristine):
    """No byte of a data file escapes verification (so every single-byte flip is found)."""
    root, _ = pristine
    for url, name, manifest in referenced(root):
        spans = sorted((b.offset, b.offset + b.length) for _, b in blobs_in(manifest, name))
        size = os.path.getsize(os.path.join(url, name))
        pos = 0
        for lo, hi in spans:
            assert lo == pos, f"{url}/{name}: bytes {pos}..{lo} are in no blob, or blobs overlap"
            pos = hi
        assert pos == size, f"{url}/{name}: bytes {pos}..{size} are in no blob"


def test_verify_missing_file_names_each_tensor_key_and_offset(pristine, tmp_path):
    """A deleted data file: every tensor (and the skeleton) it held is named with its byte
    offset, and the text reads sensibly (no 'rank None' / 'byte None')."""
    root, _ = pristine
    url, name, manifest = next(f for f in referenced(root) if f[0].endswith("step-000000000001"))
    path = os.path.join(url, name)
    data = open(path, "rb").read()
    os.unlink(path)
    try:
        res = cli("verify", "--json", url)
        assert res.exit_code == 1
        problems = json.loads(res.stdout)["checkpoints"][0]["problems"]
        named = {(p["key"], p["offset"]) for p in problems if p["file"] == name}
        assert named >= {(k, b.offset) for k, b in blobs_in(manifest, name)}, problems
        assert all("None" not in p["text"] for p in problems), [p["text"] for p in problems]
    finally:
        with open(path, "wb") as f:
            f.write(data)


# ---------------------------------------------------------------------------- --quick, --json
def test_verify_quick_catches_missing_and_truncated_files_without_reading_chunks(pristine):
    root, before = pristine
    url, name, manifest = next(f for f in referenced(root) if f[0].endswith("step-000000000000"))
    path = os.path.join(url, name)
    data = open(path, "rb").read()
    try:
        # A flipped byte inside a blob: only full mode reads chunks, so only it notices.
        key, blob = blobs_in(manifest, name)[0]
        with open(path, "r+b") as f:
            f.seek(blob.offset)
            f.write(bytes([data[blob.offset] ^ 0xFF]))
        assert cli("verify", "--quick", root).exit_code == 0
        assert cli("verify", root).exit_code == 1
        os.truncate(path, len(data) - 1)
        res = cli("verify", "--quick", "--json", root)
        assert res.exit_code == 1
        report = json.loads(res.stdout)
        assert report["quick"] is True
        (bad,) = [c for c in report["checkpoints"] if not c["ok"]]
        assert bad["url"] == url and "truncated" in bad["problems"][0]["message"]
        os.unlink(path)
        res = cli("verify", "--quick", "--json", root)
        assert res.exit_code == 1
        (bad,) = [c for c in json.loads(res.stdout)["checkpoints"] if not c["ok"]]
        # One problem per blob the missing file held, each naming the file.
        assert {p["file"] for p in bad["problems"]} == {name}
        assert all("missing" in p["message"] for p in bad["problems"])
    finally:
        with open(path, "wb") as f:
            f.write(data)
    assert tree(root) == before


def test_verify_json_shape(pristine):
    root, _ = pristine
    res = cli("verify", "--json", root)
    assert res.exit_code == 0
    report = json.loads(res.stdout)
    assert set(report) == {"ok", "quick", "checkpoints"}
    assert report["ok"] is True and report["quick"] is False
    names = [c["name"] for c in report["checkpoints"]]
    assert names == ["step-000000000000", "step-000000000001", "step-000000000002", "plain"]
    for c in report["checkpoints"]:
        assert set(c) == {"name", "url", "step", "ok", "problems"}
        assert c["ok"] is True and c["problems"] == []
        assert c["url"] == os.path.join(root, c["name"])
    assert [c["step"] for c in report["checkpoints"]] == [0, 1, 2, None]
    # One checkpoint path: that checkpoint only, named ".".
    one = json.loads(cli("verify", "--json", os.path.join(root, "plain")).stdout)
    assert [(c["name"], c["ok"]) for c in one["checkpoints"]] == [(".", True)]


def test_verify_problem_record_fields(pristine):
    root, _ = pristine
    url, name, manifest = next(f for f in referenced(root) if f[0].endswith("step-000000000002"))
    path = os.path.join(url, name)
    data = open(path, "rb").read()
    key, blob = next((k, b) for k, b in blobs_in(manifest, name) if k == "model.emb")
    try:
        with open(path, "r+b") as f:
            f.seek(blob.offset + 3)
            f.write(bytes([data[blob.offset + 3] ^ 1]))
        res = cli("verify", "--json", url)
        assert res.exit_code == 1
        (p,) = json.loads(res.stdout)["checkpoints"][0]["problems"]
        assert set(p) == {"rank", "key", "file", "offset", "message", "text"}
        assert (p["rank"], p["key"], p["file"], p["offset"]) == (0, "model.emb", name, blob.offset)
        assert "xxh3-128 mismatch" in p["message"]
    finally:
        with open(path, "wb") as f:
            f.write(data)


@pytest.mark.parametrize("change", ["unknown_field", "unknown_version", "not_json"])
def test_I4_verify_reports_an_unreadable_manifest(tmp_path, change):
    root = build_store(tmp_path / "store")
    mpath = os.path.join(root, "step-000000000001", fmt.manifest_name(1))
    doc = json.loads(open(mpath, "rb").read())
    if change == "unknown_field":
        doc["surprise"] = 1
    elif change == "unknown_version":
        doc["format_version"] = max(fmt.READ_VERSIONS) + 1
    data = b"{not json" if change == "not_json" else json.dumps(doc).encode()
    with open(mpath, "wb") as f:
        f.write(data)
    res = cli("verify", "--json", root)
    assert res.exit_code == 1
    report = json.loads(res.stdout)
    bad = [c for c in report["checkpoints"] if not c["ok"]]
    assert [c["name"] for c in bad] == ["step-000000000001"]
    assert fmt.manifest_name(1) in bad[0]["problems"][0]["text"], bad
    assert [c["ok"] for c in report["checkpoints"] if c["name"] != "step-000000000001"] == [True, True, True]


def test_verify_library_call_on_store_and_single_checkpoint(pristine):
    root, _ = pristine
    assert ckptstore.verify(os.path.join(root, "step-000000000001")) == []
    assert ckptstore.verify(os.path.join(root, "plain"), quick=True) == []
    assert ckptstore.verify(LocalStorage(os.path.join(root, "plain"))) == []
    empty = os.path.join(root, "..", "nothing-here")
    problems = ckptstore.verify(empty)
    assert len(problems) == 1 and "no checkpoint" in problems[0].message


# ---------------------------------------------------------------------------- real processes
def test_verify_exit_codes_and_never_changes_the_store(tmp_path):
    """0 sound, 1 damaged (named), 2 unreachable; a hash of every file is unchanged."""
    good = build_store(tmp_path / "good")
    bad = build_store(tmp_path / "bad")
    url, name, manifest = next(f for f in referenced(bad) if f[0].endswith("step-000000000001"))
    key, blob = next((k, b) for k, b in blobs_in(manifest, name) if k == "model.w")
    with open(os.path.join(url, name), "r+b") as f:
        f.seek(blob.offset + 100)
        b = f.read(1)
        f.seek(blob.offset + 100)
        f.write(bytes([b[0] ^ 0x10]))
    os.makedirs(tmp_path / "empty")
    trees = {good: tree(good), bad: tree(bad)}
    r_good, r_good_quick, r_bad, r_bad_json, r_missing, r_empty = run_cli_processes(
        ["verify", good], ["verify", "--quick", good], ["verify", bad], ["verify", "--json", bad],
        ["verify", str(tmp_path / "no-such-store")], ["verify", str(tmp_path / "empty")])
    assert (r_good.returncode, r_good_quick.returncode) == (0, 0), (
        r_good.stdout + r_good.stderr + r_good_quick.stdout + r_good_quick.stderr)
    assert r_good.stdout.splitlines()[-1] == "4 checkpoint(s) checked, 0 with problems"
    assert r_bad.returncode == 1, r_bad.stdout + r_bad.stderr
    assert f"FAIL  {url}" in r_bad.stdout
    assert f"tensor 'model.w' in {name} at byte {blob.offset}" in r_bad.stdout
    assert r_bad.stdout.splitlines()[-1] == "4 checkpoint(s) checked, 1 with problems"
    assert r_bad_json.returncode == 1 and json.loads(r_bad_json.stdout)["ok"] is False
    assert r_missing.returncode == 2 and r_missing.stdout == ""
    assert len(r_missing.stderr.strip().splitlines()) == 1, r_missing.stderr
    assert r_missing.stderr.startswith("ckptstore: ") and "no-such-store" in r_missing.stderr
    assert r_empty.returncode == 1 and "Traceback" not in r_empty.stderr
    assert len(r_empty.stderr.strip().splitlines()) == 1, r_empty.stderr
    for root, before in trees.items():
        assert tree(root) == before, f"verify changed {root}"


class _NotAllowListed:  # a weights-only load refuses it: its loader opts in
    def __init__(self):
        self.t = torch.ones(3)


def test_verify_rebuilds_every_kind_of_tensor_a_save_holds_without_a_false_alarm(tmp_path):
    """verify rebuilds each skeleton over meta storages: every layout, dtype and view a
    save holds must pass, including those torch has no meta rebuild for (quantized,
    nested) and objects a weights-only load refuses, which verify leaves to the load."""
    import warnings

    lin = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(lin.parameters())
    lin(torch.randn(2, 4)).sum().backward()
    opt.step()
    base = torch.randn(10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # beta and deprecated layouts say so
        zoo = {
            "coo": torch.eye(4).to_sparse(), "csr": torch.eye(4).to_sparse_csr(),
            "quantized": torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8),
            "nested": torch.nested.nested_tensor([torch.randn(2), torch.randn(3)]),
            "base": base, "view": base[2:5], "transposed": torch.randn(4, 6).t(),
            "expanded": torch.randn(1, 3).expand(4, 3), "empty": torch.empty(0, 3), "scalar": torch.tensor(3.0),
            "bf16": torch.randn(3, dtype=torch.bfloat16), "fp8": torch.randn(3).to(torch.float8_e4m3fn),
            "complex": torch.randn(3, dtype=torch.complex64), "bool": torch.tensor([True, False]),
            "param": torch.nn.Parameter(torch.randn(3)), "model": lin.state_dict(), "optim": opt.state_dict(),
            "large": torch.randn(300_000), "misc": [1, "x", 2.5, None, (3, 4), {"k": b"b"}],
        }
        for name, state in [("zoo", zoo), ("custom", {"obj": _NotAllowListed(), "w": torch.ones(2)})]:
            loc = str(tmp_path / name)
            ckptstore.save(state, loc, compression="auto").result()
            assert ckptstore.verify(loc) == [], name
        assert isinstance(ckptstore.load(str(tmp_path / "custom"), weights_only=False)["obj"], _NotAllowListed)
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode():  # (torch.compile's): verify's meta rebuild is not made fake
            assert ckptstore.verify(str(tmp_path / "zoo")) == []
        # No meta kernel for a quantized rebuild: torch.load's NotImplementedError, not a
        # malformed checkpoint (resume would pass over it).
        with pytest.raises(NotImplementedError):
            ckptstore.load(str(tmp_path / "zoo"), map_location="meta")
