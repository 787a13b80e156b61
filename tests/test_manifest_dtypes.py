"""A manifest whose tensor dtype was changed to another of the same size (issue 34):
every length and hash still agrees, so the saved bytes loaded as the other dtype. The
skeleton now records the dtypes it was saved with (ckptstore/checkpoint/dtype_record.py,
docs/format.md "The dtype record"), and load and verify refuse a manifest that
disagrees, naming the checkpoint and the tensor."""

from __future__ import annotations

import json
import os

import pytest
import torch
from cliutil import cli

import ckptstore
from ckptstore import names
from ckptstore.errors import FormatError

SWAPS = [  # (saved, the manifest's edit): same itemsize each
    ("float32", "int32"), ("int32", "float32"), ("bfloat16", "float16"), ("float16", "bfloat16"),
    ("int16", "float16"), ("int64", "float64"), ("float64", "int64"), ("complex64", "float64"),
    ("uint8", "bool"), ("bool", "uint8"), ("uint8", "int8"), ("int8", "uint8"),
    ("uint16", "int16"), ("int16", "uint16"), ("float8_e4m3fn", "float8_e5m2"),
]


def tensor_of(dtype: str) -> torch.Tensor:
    t = torch.arange(1, 13, dtype=torch.float64).reshape(3, 4)
    return (t > 6) if dtype == "bool" else t.to(getattr(torch, dtype))


def edit_entries(location, edit) -> str:
    """Apply ``edit(entry)`` to every tensor entry of the visible manifest; its path."""
    name = max(n for n in os.listdir(location) if names.parse_manifest_name(n))
    path = os.path.join(location, name)
    doc = json.loads(open(path, "rb").read())
    for entries in [doc.get("tensors", {})] + [r["tensors"] for r in doc.get("ranks", [])]:
        for entry in entries.values():
            edit(entry)
    with open(path, "w") as f:
        json.dump(doc, f)
    return path


def retyped(saved: str, edited: str):
    def edit(entry):
        assert entry["dtype"] == saved
        entry["dtype"] = edited
    return edit


@pytest.mark.parametrize("saved, edited", SWAPS, ids=[f"{a}-as-{b}" for a, b in SWAPS])
def test_I4_a_same_size_dtype_edit_of_a_manifest_is_refused_naming_the_tensor(tmp_path, saved, edited):
    location = str(tmp_path / "ckpt")
    ckptstore.save({"w": tensor_of(saved), "n": 3}, location).result()
    got = ckptstore.load(location)["w"]  # as saved, the record agreeing
    want = tensor_of(saved)
    assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    edit_entries(location, retyped(saved, edited))
    with pytest.raises(FormatError) as e:
        ckptstore.load(location)
    message = str(e.value)
    assert location in message and "'w'" in message and edited in message and saved in message, message
    problems = ckptstore.verify(location)
    assert len(problems) == 1 and "'w'" in problems[0].message and saved in problems[0].message, problems
    report = cli("verify", location, "--json")
    assert report.exit_code == 1 and "'w'" in json.loads(report.stdout)["checkpoints"][0]["problems"][0]["message"]


def test_I4_a_dtype_edit_of_a_global_tensor_is_refused(tmp_path):
    """A tensor saved as global (a declared replica: its persistent id names its typed
    storage) edited in a version 3 manifest."""
    root = str(tmp_path / "run")
    ckptstore.Store(root).save(1, {"model": {"w": tensor_of("float32")}, "n": 1}, replicated=["model.*"]).result()
    location = os.path.join(root, names.step_dir_name(1))
    path = edit_entries(location, retyped("float32", "int32"))
    assert '"int32"' in open(path).read()
    with pytest.raises(FormatError, match="'model.w'.*int32.*float32"):
        ckptstore.Store(root).load(1)
    assert "'model.w'" in str(ckptstore.verify(location))


# ---------------------------------------------------------------------------- keys and order (review of issue 34)
def rewrite_sorted(location) -> str:
    """Rewrite the visible manifest as ``jq -S`` does: the same JSON, every object's keys sorted."""
    name = max(n for n in os.listdir(location) if names.parse_manifest_name(n))
    path = os.path.join(location, name)
    doc = json.loads(open(path, "rb").read())
    with open(path, "w") as f:
        json.dump(doc, f, sort_keys=True, indent=1)
    return path


LIST_MISMATCH = "the manifest's tensor list does not match the skeleton's"


def test_I4_a_manifest_rewritten_with_sorted_keys_is_refused_not_loaded_with_tensors_swapped(tmp_path):
    """A manifest rewritten with its keys sorted is the same JSON, but an index persistent
    id names a tensor by its position in the list: q_proj's bytes loaded as k_proj's,
    and verify said ok. The record now binds the keys, their order and shapes."""
    location = str(tmp_path / "ckpt")
    ckptstore.save({"q_proj": torch.zeros(3), "k_proj": torch.ones(3)}, location).result()
    assert torch.equal(ckptstore.load(location)["k_proj"], torch.ones(3))
    rewrite_sorted(location)
    with pytest.raises(FormatError) as e:
        ckptstore.load(location)
    message = str(e.value)
    assert location in message and LIST_MISMATCH in message and "sorted order" in message, message
    [problem] = ckptstore.verify(location)
    assert LIST_MISMATCH in problem.message, problem
    assert cli("verify", location, "--json").exit_code == 1


def test_I4_reordered_tensors_of_other_dtypes_are_reported_as_a_reordered_list_not_a_dtype_edit(tmp_path):
    location = str(tmp_path / "ckpt")
    state = {"q_proj": torch.zeros(3), "k_proj": torch.ones(3), "n": torch.arange(3, dtype=torch.int32)}
    ckptstore.save(state, location).result()
    rewrite_sorted(location)
    with pytest.raises(FormatError) as e:
        ckptstore.load(location)
    assert LIST_MISMATCH in str(e.value) and "edited" not in str(e.value), e.value


def test_I4_a_shape_edit_and_a_renamed_key_are_refused(tmp_path):
    location = str(tmp_path / "ckpt")
    ckptstore.save({"w": torch.zeros(3, 4), "b": torch.ones(4)}, location).result()

    def reshape(entry):  # (the same element count, its one chunk with it: every other check agrees)
        if entry["shape"] == [3, 4]:
            entry["shape"] = [4, 3]
            [chunk] = entry["chunks"]
            chunk["sizes"] = [4, 3]
    edit_entries(location, reshape)
    with pytest.raises(FormatError, match=LIST_MISMATCH):
        ckptstore.load(location)

    other = str(tmp_path / "other")
    ckptstore.save({"w": torch.zeros(3), "b": torch.ones(3)}, other).result()
    path = os.path.join(other, max(n for n in os.listdir(other) if names.parse_manifest_name(n)))
    text = open(path).read()
    assert text.count('"w"') == 1
    with open(path, "w") as f:
        f.write(text.replace('"w"', '"v"'))
    with pytest.raises(FormatError, match=LIST_MISMATCH):
        ckptstore.load(other)


@pytest.mark.parametrize("record", ["dtypes", "none"])
def test_I4_checkpoints_with_the_first_record_or_none_still_load(tmp_path, monkeypatch, record):
    """Skeletons written before the digest (``ckptstore-dtypes:`` and the dtypes alone) or
    before any record: loaded and verified as before, and a dtype edit is still refused
    under the first record. (A regression guard: the code before this change read these too.)"""
    from ckptstore.checkpoint import snapshot

    first = lambda local: b"ckptstore-dtypes:" + ",".join(d for d, _ in local.values()).encode()  # noqa: E731
    monkeypatch.setattr(snapshot, "dtype_record", first if record == "dtypes" else (lambda local: b""))
    location = str(tmp_path / "ckpt")
    ckptstore.save({"w": tensor_of("float32"), "k": torch.arange(3)}, location).result()
    monkeypatch.undo()
    got = ckptstore.load(location)
    assert torch.equal(got["w"], tensor_of("float32")) and torch.equal(got["k"], torch.arange(3))
    assert ckptstore.verify(location) == []
    if record == "dtypes":
        def edit(entry):
            if entry["dtype"] == "float32":
                entry["dtype"] = "int32"
        edit_entries(location, edit)
        with pytest.raises(FormatError, match="'w'.*int32.*float32"):
            ckptstore.load(location)
