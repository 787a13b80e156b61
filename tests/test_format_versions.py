"""Format versions: version 1 checkpoints still load; version 2 names rank-local
storages by index, and a skeleton that does so where its manifest does not allow it, or
names an index its rank did not store, is refused."""

from __future__ import annotations

import io
import json
import pickle
import shutil
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
import zstandard

import ckptstore
from ckptstore import format as fmt, names
from ckptstore.checkpoint.capture import capture
from ckptstore.checkpoint.manifests import latest_manifest
from ckptstore.checkpoint.verify import verify
from ckptstore.errors import FormatError
from ckptstore.storage import LocalStorage

DATA = Path(__file__).parent / "data"


def _manifest_file(path: Path) -> Path:
    (found,) = [p for p in path.iterdir() if fmt.parse_manifest_name(p.name) is not None]
    return found


def _rewrite(path: Path, change) -> None:
    mf = _manifest_file(path)
    d = json.loads(mf.read_bytes())
    change(d)
    mf.write_bytes(json.dumps(d).encode())


class _PidRecorder(pickle.Unpickler):
    """Unpickles a skeleton only far enough to see its persistent ids."""

    def __init__(self, data: bytes):
        super().__init__(io.BytesIO(data))
        self.pids: list = []

    def find_class(self, module, name):
        if "Storage" in name:
            return f"{module}.{name}"
        if module.startswith("torch") or module == "collections":
            return lambda *args: None
        return super().find_class(module, name)  # the test's own class

    def persistent_load(self, pid):
        self.pids.append(pid)
        return None


def _skeleton_pids(path: Path) -> list:
    storage = LocalStorage(str(path))
    blob = latest_manifest(storage).ranks[0].skeleton
    data = (path / blob.file).read_bytes()[blob.offset:blob.offset + blob.length]
    if blob.codec:
        assert [c["id"] for c in blob.codec] == ["zstd"]
        data = zstandard.ZstdDecompressor().decompress(data)
    recorder = _PidRecorder(data)
    recorder.load()
    return recorder.pids


def test_a_version_1_checkpoint_written_by_the_previous_release_still_loads(tmp_path):
    # tests/data/format_v1: saved by ckptstore at format version 1 (tuple persistent
    # ids, empty OrderedDict hook tables); format_v1.expected.pt: torch.save of the state.
    ckpt = tmp_path / "v1"
    shutil.copytree(DATA / "format_v1", ckpt)
    assert latest_manifest(LocalStorage(str(ckpt))).format_version == 1
    assert all(type(p) is tuple for p in _skeleton_pids(ckpt))
    expected = torch.load(DATA / "format_v1.expected.pt", weights_only=True)
    got = ckptstore.load(str(ckpt))
    assert got.keys() == expected.keys()
    for key, want in expected.items():
        if isinstance(want, torch.Tensor):
            assert type(got[key]) is type(want) and got[key].dtype == want.dtype, key
            assert torch.equal(got[key].view(torch.uint8), want.view(torch.uint8)), key
        else:
            assert got[key] == want, key
    assert got["param"] is got["param_again"]
    assert got["view"].untyped_storage().data_ptr() == got["base"].untyped_storage().data_ptr()
    assert verify(str(ckpt)) == []


def test_new_saves_name_cpu_storages_by_index(tmp_path):
    shared = torch.arange(6.0)
    state = {"a": torch.randn(3), "b": shared, "b_view": shared[2:], "u16": torch.zeros(4, dtype=torch.uint16),
             "p": torch.nn.Parameter(torch.ones(2)), "n": 3}
    # capture takes the plain state; a torch.Size sends the other through flatten
    for name, obj in (("plain", state), ("flatten", {**state, "size": torch.Size([2, 3])})):
        assert (capture(obj) is None) == (name == "flatten")
        path = tmp_path / name
        ckptstore.save(obj, str(path)).result()
        manifest = latest_manifest(LocalStorage(str(path)))
        assert manifest.format_version == fmt.FORMAT_VERSION == 3  # (version 3 adds references only)
        # a, b (shared by b_view), u16, p: four storages, named 0..3 in manifest order,
        # as pairs: torch's weights-only unpickler refuses a bare int id before 2.9
        assert _skeleton_pids(path) == [("storage", i) for i in (0, 1, 1, 2, 3)]
        assert list(manifest.ranks[0].tensors) == ["a", "b", "u16", "p"]
        back = ckptstore.load(str(path))
        assert back["b_view"].untyped_storage().data_ptr() == back["b"].untyped_storage().data_ptr()
        assert back["u16"].dtype == torch.uint16 and type(back["p"]) is torch.nn.Parameter


def test_global_storages_keep_the_tuple_id(tmp_path):
    state = {"emb": torch.arange(8.0), "head": torch.ones(2)}
    store = ckptstore.Store(str(tmp_path / "s"))
    store.save(1, state, replicated=["emb"]).result()
    path = tmp_path / "s" / names.step_dir_name(1)
    pids = _skeleton_pids(path)
    assert pids[0] == ("storage", "torch.FloatStorage", "g:emb", "cpu", 8) and pids[1] == ("storage", 0)
    back = store.load(1)
    assert torch.equal(back["emb"], state["emb"]) and torch.equal(back["head"], state["head"])


def test_an_index_id_in_a_version_1_manifest_is_refused(tmp_path):
    path = tmp_path / "c"
    ckptstore.save({"w": torch.ones(3)}, str(path)).result()
    _rewrite(path, lambda d: d.update(format_version=1))
    with pytest.raises(FormatError, match="by index .*format version 1"):
        ckptstore.load(str(path))


def test_an_index_beyond_the_rank_s_tensors_is_refused(tmp_path):
    path = tmp_path / "c"
    ckptstore.save(OrderedDict(w=torch.ones(3), v=torch.zeros(2)), str(path)).result()

    def drop_last(d):
        tensors = d["ranks"][0]["tensors"]
        del tensors[list(tensors)[-1]]

    _rewrite(path, drop_last)
    with pytest.raises(FormatError, match="tensor index 1; rank 0 stored 1 tensors"):
        ckptstore.load(str(path))


def test_the_format_s_typed_storage_dtypes_are_torch_s():
    # An index id's storage type follows the format's fixed list, not the running
    # torch's table: if a torch release changes its table, this says so.
    assert {getattr(torch, name) for name in fmt.TYPED_STORAGE_DTYPES} == set(torch.storage._dtype_to_storage_type_map())
