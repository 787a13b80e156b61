"""zarr v3 interop through tensorstore (``ckptstore export --zarr``, ``ckptstore import``):
what tensorstore writes, zarr-python reads; what zarr-python writes, ckptstore imports."""

from __future__ import annotations

import json
import os

import pytest
import torch
from click.testing import CliRunner

pytest.importorskip("tensorstore")
zarr = pytest.importorskip("zarr")
np = pytest.importorskip("numpy")

import ckptstore  # noqa: E402
from ckptstore import zarr_io  # noqa: E402
from ckptstore.cli import main  # noqa: E402


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {"layer.weight": torch.randn(300, 1000, generator=g), "bias": torch.randn(7, generator=g),
                  "bf16": torch.randn(33, 5, generator=g).to(torch.bfloat16), "scalar": torch.tensor(2.5),
                  "empty": torch.empty(0, 4), "half": torch.randn(9, generator=g).half()},
        "optimizer": [torch.arange(10), torch.tensor([True, False, True]),
                      torch.tensor([1.0, -448.0, 0.001953125, 3.5]).to(torch.float8_e4m3fn),
                      torch.tensor([57344.0, -2.0, 0.5]).to(torch.float8_e5m2)],
        "counters": {"step": 1200, "lr": 3e-4, "name": "run-7", "done": False, "nothing": None},
        "u16": torch.tensor([0, 65535], dtype=torch.uint16),
    }


def assert_same(a, b) -> None:
    assert type(a) is type(b) or (isinstance(a, (list, tuple)) and isinstance(b, list)), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.view(torch.uint8) if a.dtype.is_floating_point and a.element_size() == 1 else a, b.view(
            torch.uint8) if b.dtype.is_floating_point and b.element_size() == 1 else b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


@pytest.fixture
def checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    ckptstore.save(state(), str(path)).result()
    return path


def test_export_is_read_by_zarr_python_with_dtypes_shapes_and_chunks(checkpoint, tmp_path):
    dest = tmp_path / "out.zarr"
    r = cli("export", checkpoint, dest, "--zarr", "--json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.output)
    assert report["values"] == 5 and report["skipped"] == []
    group = zarr.open_group(str(dest), mode="r")
    names = sorted(group.array_keys())
    assert names == sorted(report["arrays"]) and "model.layer.weight" in names and "optimizer.2" in names
    s = state()
    w = group["model.layer.weight"]
    assert w.shape == (300, 1000) and w.dtype == np.float32
    assert w.chunks == (300, 1000)  # 1.2 MB: one chunk, as ckptstore's writer (16 MiB) stores it
    np.testing.assert_array_equal(w[:], s["model"]["layer.weight"].numpy())
    assert group["model.half"].dtype == np.float16 and group["u16"].dtype == np.uint16
    np.testing.assert_array_equal(group["u16"][:], np.array([0, 65535], dtype=np.uint16))
    assert group["optimizer.1"].dtype == np.bool_ and group["model.scalar"].shape == ()
    assert group["model.empty"].shape == (0, 4)
    # bfloat16 and float8 are widened exactly to types zarr-python knows; attributes say what they were
    np.testing.assert_array_equal(group["model.bf16"][:], s["model"]["bf16"].float().numpy())
    np.testing.assert_array_equal(group["optimizer.2"][:], s["optimizer"][2].half().numpy())
    meta = group.attrs["ckptstore"]["arrays"]
    assert meta["model.bf16"]["dtype"] == "bfloat16" and meta["model.bf16"]["stored_as"] == "float32"
    assert meta["model.layer.weight"]["path"] == ["model", "layer.weight"]  # a key holding a dot stays one key
    assert group.attrs["ckptstore"]["values"]["counters.step"]["value"] == 1200


def test_large_tensors_are_chunked_along_the_first_dimension(tmp_path):
    src, dest = tmp_path / "big", tmp_path / "big.zarr"
    ckptstore.save({"w": torch.randn(2048, 4096)}, str(src)).result()  # 32 MiB
    assert cli("export", src, dest, "--zarr").exit_code == 0
    a = zarr.open_array(str(dest / "w"), mode="r")
    assert a.chunks == (1024, 4096)  # 16 MiB a chunk
    np.testing.assert_array_equal(a[:], ckptstore.load(str(src))["w"].numpy())


@pytest.mark.parametrize("extension_types", [False, True], ids=["widened", "extension-types"])
def test_export_then_import_gives_the_state_back_bit_identical(checkpoint, tmp_path, extension_types):
    dest, back = tmp_path / "out.zarr", tmp_path / "back"
    flags = ["--extension-types"] if extension_types else []
    assert cli("export", checkpoint, dest, "--zarr", *flags).exit_code == 0
    stored = json.loads((dest / "model.bf16" / "zarr.json").read_text())["data_type"]
    assert stored == ("bfloat16" if extension_types else "float32")
    r = cli("import", dest, back)
    assert r.exit_code == 0, r.output
    assert_same(state(), ckptstore.load(str(back)))


def test_import_of_a_hierarchy_zarr_python_wrote(tmp_path):
    src, dest = tmp_path / "theirs.zarr", tmp_path / "ckpt"
    root = zarr.open_group(str(src), mode="w")
    enc = root.create_group("encoder")
    a = enc.create_array("weight", shape=(6, 4), chunks=(2, 4), dtype="float32")
    a[:] = np.arange(24, dtype=np.float32).reshape(6, 4)
    b = root.create_array("ids", shape=(5,), dtype="int64")
    b[:] = np.arange(5) * 7
    r = cli("import", src, dest)
    assert r.exit_code == 0, r.output
    got = ckptstore.load(str(dest))
    assert torch.equal(got["encoder"]["weight"], torch.arange(24, dtype=torch.float32).reshape(6, 4))
    assert torch.equal(got["ids"], torch.arange(5) * 7)


@pytest.mark.filterwarnings("ignore:The data type")  # zarr-python: strings have no stable v3 spec
def test_bad_input_gets_a_clear_error_and_writes_nothing(checkpoint, tmp_path):
    dest = tmp_path / "out.zarr"
    dest.mkdir()
    r = cli("export", checkpoint, dest, "--zarr")
    assert r.exit_code == 2 and "already exists" in r.output and os.listdir(dest) == []
    (tmp_path / "plain-dir").mkdir()
    r = cli("import", tmp_path / "plain-dir", tmp_path / "c")
    assert r.exit_code == 1 and "no zarr.json" in r.output and not (tmp_path / "c").exists()
    odd = tmp_path / "odd.zarr"
    root = zarr.open_group(str(odd), mode="w")
    root.create_array("s", shape=(2,), dtype="<U4")  # strings: no torch dtype
    r = cli("import", odd, tmp_path / "c2")
    assert r.exit_code == 1 and "odd.zarr/s" in r.output and not (tmp_path / "c2").exists()
    for i, (name, spec, error) in enumerate([
            ("x", {"path": ["x"], "dtype": "os.system"}, "unsupported torch dtype"),
            ("../outside", {"path": ["x"], "dtype": "float32"}, "not named after its state path"),
            ("x", {"path": "x", "dtype": "float32"}, "not a list of keys"),
            ("x", ["not", "a", "record"], "damaged")]):
        hostile = tmp_path / f"hostile{i}.zarr"
        hostile.mkdir()
        (hostile / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {
            "ckptstore": {"layout_version": 1, "arrays": {name: spec}}}}))
        r = cli("import", hostile, tmp_path / f"c{i + 3}")
        assert r.exit_code == 1 and error in r.output, (name, spec, r.output)


def test_an_optimizer_state_crosses_with_its_int_keys_and_empty_parts(tmp_path):
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    fresh = {"optimizer": opt.state_dict()}  # "state": {} before the first step
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    stepped = {"optimizer": opt.state_dict(), "odd": {(1, 2): torch.ones(1)}}
    for i, st in enumerate((fresh, stepped)):
        r = zarr_io.export_state(st, str(tmp_path / f"e{i}"))
        back = zarr_io.import_state(str(tmp_path / f"e{i}"))
        assert_same(st["optimizer"], back["optimizer"])
    assert list(back["optimizer"]["state"]) == [0, 1] and r.skipped == ["odd.(1, 2): a dict key of type tuple "
                                                                        "(only str and int)"]
    restored = torch.optim.AdamW(torch.nn.Linear(4, 3).parameters())
    restored.load_state_dict(back["optimizer"])
    assert torch.equal(restored.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def test_an_array_that_states_far_more_than_it_holds_is_refused_and_symlinks_are_not_followed(tmp_path):
    src = tmp_path / "claims.zarr"
    root = zarr.open_group(str(src), mode="w")
    root.create_array("huge", shape=(1 << 40,), chunks=(1 << 20,), dtype="float32")  # 4 TiB, no chunk written
    r = cli("import", src, tmp_path / "c")
    assert r.exit_code == 1 and "huge: states 4398046511104 bytes" in r.output
    elsewhere = tmp_path / "elsewhere.zarr"
    zarr.open_group(str(elsewhere), mode="w").create_array("w", shape=(2,), dtype="float32")
    export = tmp_path / "exp.zarr"
    zarr_io.export_state({"w": torch.ones(2)}, str(export))
    import shutil

    shutil.rmtree(export / "w")
    os.symlink(elsewhere / "w", export / "w")
    r = cli("import", export, tmp_path / "c2")
    assert r.exit_code == 1 and "a symlink is never followed" in r.output


def test_a_failed_export_leaves_nothing(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise ValueError("disk full")

    monkeypatch.setattr(zarr_io, "_numpy", boom)
    with pytest.raises(zarr_io.InteropError, match="disk full"):
        zarr_io.export_state({"w": torch.ones(3)}, str(tmp_path / "x.zarr"))
    assert not (tmp_path / "x.zarr").exists()


def test_names_that_zarr_forbids_are_escaped():
    assert zarr_io.array_name(["a/b", "c%d", 0]) == "a%2Fb.c%25d.0"
    assert zarr_io.array_name([]) == "tensor"
    assert zarr_io.array_name(["__x"]).startswith("%") and zarr_io.array_name(["zarr.json"]).startswith("%")
    assert zarr_io.array_name(["state", {"int": 3}, "exp_avg"]) == "state.3.exp_avg"
