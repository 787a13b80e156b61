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
