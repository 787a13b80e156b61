"""Round trips: what ckptstore.save / Store.save write, ckptstore.load / Store.load give
back, bit for bit, through every way of naming the destination.

Modes (the ``roundtrip`` fixture): a local path (checkpoint directory), a BytesIO, a
real file opened 'wb' and loaded back by path, and Store.save/load on a local root.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import random
import uuid
from collections import OrderedDict

import pytest
import torch

import ckptstore
from ckptstore import format as fmt
from ckptstore.errors import UnsafeLoadError

# memory:// URLs have their own tests below (test_memory_url_*), not a mode of the matrix.
MODES = ["path", "bytesio", "file", "store"]

pytestmark = pytest.mark.usefixtures("observe_earlier_failures")


# ---------------------------------------------------------------------------- helpers
class Roundtrip:
    """Save then load one object in one mode; keeps the committed manifest."""

    def __init__(self, mode: str, tmp_path):
        self.mode = mode
        self.tmp_path = tmp_path
        self.n = 0

    def save(self, obj, **save_kw):
        """Save; returns (future, loader) where loader(**load_kw) loads what was saved."""
        self.n += 1
        mode, base = self.mode, self.tmp_path / f"rt{self.n}"
        if mode == "path":
            fut = ckptstore.save(obj, str(base), **save_kw)
            return fut, lambda **kw: ckptstore.load(str(base), **kw)
        if mode == "bytesio":
            buf = io.BytesIO()
            fut = ckptstore.save(obj, buf, **save_kw)
            data = buf.getvalue()
            return fut, lambda **kw: ckptstore.load(io.BytesIO(data), **kw)
        if mode == "file":
            path = f"{base}.pt"
            with open(path, "wb") as fh:
                fut = ckptstore.save(obj, fh, **save_kw)
            return fut, lambda **kw: ckptstore.load(path, **kw)
        if mode == "memory_url":
            url = f"memory://rt-{uuid.uuid4().hex[:12]}/ckpt"
            fut = ckptstore.save(obj, url, **save_kw)
            return fut, lambda **kw: ckptstore.load(url, **kw)
        if mode == "store":
            store = ckptstore.Store(str(base), **save_kw)
            fut = store.save(7, obj)
            return fut, lambda **kw: ckptstore.Store(str(base)).load(7, **kw)
        raise AssertionError(mode)

    def __call__(self, obj, save_kw=None, load_kw=None):
        """Save, wait for the commit, load; returns (loaded object, manifest)."""
        fut, loader = self.save(obj, **(save_kw or {}))
        manifest = fut.result(timeout=60)
        return loader(**(load_kw or {})), manifest


@pytest.fixture(params=MODES)
def roundtrip(request, tmp_path):
    return Roundtrip(request.param, tmp_path)


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """Every byte of the tensor's storage, as a uint8 tensor."""
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())


def assert_tensor_identical(a: torch.Tensor, b: torch.Tensor, where: str = "tensor") -> None:
    assert type(b) is type(a), where
    assert b.dtype == a.dtype, where
    assert b.device == a.device, where
    assert tuple(b.shape) == tuple(a.shape), where
    assert b.stride() == a.stride(), where
    assert b.storage_offset() == a.storage_offset(), where
    assert b.requires_grad == a.requires_grad, where
    assert torch.equal(storage_bytes(b), storage_bytes(a)), f"{where}: storage bytes differ"
    if a.numel():
        assert torch.equal(b.detach().contiguous().reshape(-1).view(torch.uint8),
                           a.detach().contiguous().reshape(-1).view(torch.uint8)), f"{where}: values differ"


def assert_same(a, b, where: str = "obj") -> None:
    """Deep equality that also checks exact types, key order and float bit patterns."""
    assert type(b) is type(a), f"{where}: {type(b)} is not {type(a)}"
    if isinstance(a, torch.Tensor):
        assert_tensor_identical(a, b, where)
    elif isinstance(a, dict):
        assert list(b.keys()) == list(a.keys()), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(b) == len(a), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, float):
        if math.isnan(a):
            assert math.isnan(b), where
        else:
            assert b == a and math.copysign(1.0, b) == math.copysign(1.0, a), where
    else:
        assert b == a, where


def random_tensor(dtype: torch.dtype, shape, seed: int = 0) -> torch.Tensor:
    """Random bytes of the given dtype (any bit pattern; bool only 0/1)."""
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g, dtype=torch.uint8).bool().reshape(shape)
    raw = torch.randint(0, 256, (max(n, 1) * dtype.itemsize,), generator=g, dtype=torch.uint8)
    return raw.view(dtype)[:n].reshape(shape)


def tensor_entries(manifest) -> dict:
    (rank,) = manifest.ranks
    return dict(rank.tensors)


# Every dtype torch exposes that torch.save can store. Left out: quantized dtypes (they
# need a quantizer, not raw bytes) and the sub-byte uint1..7 / int1..7, which torch.save
# itself refuses ("dtype torch.uint1 is not recognized").
def _all_dtypes() -> list[torch.dtype]:
    seen = {}
    for name in dir(torch):
        dt = getattr(torch, name)
        if isinstance(dt, torch.dtype) and dt not in seen:
            seen[dt] = str(dt).removeprefix("torch.")
    out = []
    for dt, name in seen.items():
        if name.startswith(("qint", "quint")):
            continue
        if name[:-1] in ("uint", "int") and name[-1] in "1234567":
            continue
        out.append(dt)
    return sorted(out, key=str)


ALL_DTYPES = _all_dtypes()
REQUIRED_DTYPES = [
    "bool", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64", "float16",
    "bfloat16", "float32", "float64", "complex64", "complex128",
] + [n for n in dir(torch) if n.startswith("float8_")]


def test_dtype_list_covers_the_required_ones():
    names = {str(d).removeprefix("torch.") for d in ALL_DTYPES}
    assert set(REQUIRED_DTYPES) <= names
    assert any(n.startswith("float8_") for n in names)


# ---------------------------------------------------------------------------- containers
def test_nested_containers_keep_types_and_order(roundtrip):
    od = OrderedDict()
    for k in ["zeta", "alpha", "mid", "beta"]:  # deliberately not sorted
        od[k] = torch.full((2,), float(len(k)))
    obj = {
        "z_first": 1,
        "a_second": {"inner": [torch.arange(3), (torch.ones(2, 2), "s")], "empty": {}},
        "od": od,
        "list": [1, [2, [3, []]], ()],
        "tuple": (torch.zeros(1), (), ("x", (None,))),
        3: "int key",
        (1, 2): "tuple key",
    }
    loaded, _ = roundtrip(obj)
    assert_same(obj, loaded)
    assert type(loaded["od"]) is OrderedDict
    assert list(loaded["od"]) == ["zeta", "alpha", "mid", "beta"]
    assert list(loaded) == list(obj)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_every_dtype_bit_exact(roundtrip, dtype):
    base = random_tensor(dtype, (6, 10), seed=1)
    obj = {
        "plain": random_tensor(dtype, (37,), seed=2),
        "zero_dim": random_tensor(dtype, (), seed=3),
        "zero_size": random_tensor(dtype, (0,), seed=4),
        "zero_size_2d": random_tensor(dtype, (3, 0), seed=5),
        "transposed": base.t(),
        "stepped": base[1::2, ::3],
    }
    loaded, _ = roundtrip(obj)
    assert_same(obj, loaded)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_I3_manifest_records_each_tensors_dtype_and_shape(tmp_ckpt):
    """I3: the manifest names every tensor's dtype and global shape, for every dtype
    (also those torch pickles over an untyped byte storage)."""
    obj = {fmt.dtype_name(dt): random_tensor(dt, (3, 4), seed=i) for i, dt in enumerate(ALL_DTYPES)}
    manifest = ckptstore.save(obj, tmp_ckpt).result(timeout=60)
    assert_same(obj, ckptstore.load(tmp_ckpt))
    entries = tensor_entries(manifest)
    wrong = {k: (e.dtype, e.shape) for k, e in entries.items() if (e.dtype, e.shape) != (k, (3, 4))}
    assert wrong == {}


# ---------------------------------------------------------------------------- shapes, views
def test_zero_size_and_zero_dim(roundtrip):
    obj = {
        "scalar": torch.tensor(3.25),
        "int_scalar": torch.tensor(-7, dtype=torch.int64),
        "empty": torch.empty(0),
        "empty_2d": torch.empty(4, 0, 3),
        "empty_param": torch.nn.Parameter(torch.empty(0, 5)),
    }
    loaded, _ = roundtrip(obj)
    assert_same(obj, loaded)
    assert loaded["scalar"].dim() == 0 and loaded["scalar"].item() == 3.25


def test_non_contiguous_views_keep_strides_offsets_and_storage(roundtrip):
    base = torch.arange(120, dtype=torch.float32).reshape(10, 12)
    obj = {
        "base": base,
        "transposed": base.t(),
        "stepped": base[1::3, 2::5],
        "offset": base[4:],
        "column": base[:, 7],
        "expanded": torch.arange(3.0).expand(4, 3),
        "strided_flat": base.reshape(-1)[5:50:7],
    }
    loaded, manifest = roundtrip(obj)
    assert_same(obj, loaded)
    assert loaded["offset"].storage_offset() == 48
    assert loaded["stepped"].stride() == (36, 5)
    ptr = loaded["base"].untyped_storage().data_ptr()
    for k in ("transposed", "stepped", "offset", "column", "strided_flat"):
        assert loaded[k].untyped_storage().data_ptr() == ptr, k
    # base's storage and expanded's storage: two stored entries, nothing more
    assert len(tensor_entries(manifest)) == 2


def test_offset_view_alone_stores_its_whole_storage(roundtrip):
    base = torch.arange(100, dtype=torch.int32)
    obj = {"tail": base[90:], "head_step": base[:10:3]}
    loaded, manifest = roundtrip(obj)
    assert_same(obj, loaded)
    (entry,) = tensor_entries(manifest).values()
    assert entry.nbytes == 400  # the storage, like torch.save


# ---------------------------------------------------------------------------- parameters, sharing
@pytest.mark.parametrize("requires_grad", [True, False])
def test_parameter_keeps_type_and_requires_grad(roundtrip, requires_grad):
    p = torch.nn.Parameter(torch.randn(3, 4), requires_grad=requires_grad)
    leaf = torch.randn(2).requires_grad_(requires_grad)
    loaded, _ = roundtrip({"p": p, "leaf": leaf})
    assert type(loaded["p"]) is torch.nn.Parameter
    assert loaded["p"].requires_grad is requires_grad
    assert type(loaded["leaf"]) is torch.Tensor
    assert loaded["leaf"].requires_grad is requires_grad
    assert_same({"p": p, "leaf": leaf}, loaded)


def test_tied_weights_come_back_tied_and_are_stored_once(roundtrip):
    emb = torch.nn.Parameter(torch.randn(50, 8))
    obj = {"embed.weight": emb, "lm_head.weight": emb, "other": torch.ones(3)}
    loaded, manifest = roundtrip(obj)
    assert_same(obj, loaded)
    assert loaded["embed.weight"] is loaded["lm_head.weight"]
    assert (loaded["embed.weight"].untyped_storage().data_ptr()
            == loaded["lm_head.weight"].untyped_storage().data_ptr())
    entries = tensor_entries(manifest)
    assert sorted(entries) == ["embed.weight", "other"]
    skeleton = manifest.ranks[0].skeleton.raw_length
    assert manifest.raw_bytes == skeleton + 50 * 8 * 4 + 3 * 4


def test_two_views_of_one_storage_share_it_after_load(roundtrip):
    base = torch.randn(64)
    a, b = base[:32].view(4, 8), base[16:]
    loaded, manifest = roundtrip({"a": a, "b": b})
    assert_same({"a": a, "b": b}, loaded)
    assert loaded["a"].untyped_storage().data_ptr() == loaded["b"].untyped_storage().data_ptr()
    loaded["a"][3, 0] = 1234.5  # element 24: also b[8]
    assert loaded["b"][8].item() == 1234.5
    entries = tensor_entries(manifest)
    assert len(entries) == 1
    assert manifest.raw_bytes == manifest.ranks[0].skeleton.raw_length + 64 * 4


# ---------------------------------------------------------------------------- python values
def test_python_scalars(roundtrip):
    obj = {
        "big": 2**200, "neg_big": -(2**200) + 1, "small": -3, "zero": 0,
        "str": "héllo ✓", "empty_str": "", "bytes": b"\x00\xffbytes", "none": None,
        "nan": float("nan"), "inf": float("inf"), "ninf": float("-inf"), "negzero": -0.0,
        "pi": math.pi, "true": True, "false": False,
    }
    loaded, _ = roundtrip(obj)
    assert_same(obj, loaded)
    assert loaded["big"] == 2**200
    assert math.isnan(loaded["nan"])
    assert loaded["inf"] == math.inf and loaded["ninf"] == -math.inf
    assert loaded["true"] is True and loaded["false"] is False and loaded["none"] is None


# ---------------------------------------------------------------------------- training state
def _trained(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    for _ in range(3):
        opt.zero_grad()
        loss = model(torch.randn(4, 6)).pow(2).sum()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
    return model, opt, sched, scaler


def _fresh():
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    return model, opt, sched, scaler


def test_training_state_loads_into_fresh_objects(roundtrip):
    model, opt, sched, scaler = _trained(0)
    state = {
        "model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict(),
        "scaler": scaler.state_dict(), "torch_rng": torch.get_rng_state(), "py_rng": random.getstate(),
    }
    loaded, _ = roundtrip(state)
    assert_same(state, loaded)

    m2, o2, s2, sc2 = _fresh()
    m2.load_state_dict(loaded["model"])
    o2.load_state_dict(loaded["optim"])
    s2.load_state_dict(loaded["sched"])
    sc2.load_state_dict(loaded["scaler"])
    assert s2.get_last_lr() == sched.get_last_lr()
    assert sc2.state_dict() == scaler.state_dict()
    assert sc2.get_scale() == scaler.get_scale()
    assert_same(opt.state_dict()["state"], o2.state_dict()["state"])

    # One more identical step on both: bit-identical parameters afterwards.
    x = torch.randn(4, 6)
    for m, o in ((model, opt), (m2, o2)):
        o.zero_grad()
        m(x).pow(2).sum().backward()
        o.step()
    for (k, p), (_, q) in zip(model.state_dict().items(), m2.state_dict().items()):
        assert torch.equal(p, q), k

    torch.set_rng_state(state["torch_rng"])
    expected = torch.rand(8)
    torch.set_rng_state(loaded["torch_rng"])
    assert torch.equal(torch.rand(8), expected)
    random.setstate(state["py_rng"])
    expected_py = [random.random() for _ in range(8)]
    random.setstate(loaded["py_rng"])
    assert [random.random() for _ in range(8)] == expected_py


# ---------------------------------------------------------------------------- snapshot, chunks
def test_snapshot_semantics_mutation_after_save_is_not_saved(roundtrip):
    w = torch.arange(4096, dtype=torch.float32)
    p = torch.nn.Parameter(torch.ones(64, 64))
    expected = {"w": w.clone(), "p": torch.nn.Parameter(p.detach().clone())}
    fut, loader = roundtrip.save({"w": w, "p": p})
    # save() returned: change everything in place before the background work is done.
    w.mul_(-1).add_(17)
    with torch.no_grad():
        p.zero_()
    fut.result(timeout=60)
    loaded = loader()
    assert_same(expected, loaded)
    assert loaded["w"][5].item() == 5.0


def test_state_larger_than_chunk_size(roundtrip):
    g = torch.Generator().manual_seed(3)
    obj = {
        "two_d": torch.randn(100, 256, generator=g),     # 100 KB, rows of 1 KB
        "one_d": torch.randn(25_600, generator=g),        # 100 KB
        "wide": torch.randn(5, 5_000, generator=g),       # rows of 20 KB > chunk
        "deep": torch.randn(2, 3, 2_000, generator=g),    # each dim-1 row of 8 KB > chunk
        "small": torch.randn(3, generator=g),
    }
    loaded, manifest = roundtrip(obj, save_kw={"chunk_bytes": 4096, "compression": "none"})
    assert_same(obj, loaded)
    entries = tensor_entries(manifest)
    for key in ("two_d", "one_d", "wide", "deep"):
        entry = entries[key]
        assert len(entry.chunks) >= entry.nbytes // 4096, key
        assert max(c.blob.raw_length for c in entry.chunks) <= 4096, key
        fmt.validate_coverage(entry, key)
    assert len(entries["small"].chunks) == 1


@pytest.mark.parametrize("compression", ["none", "zstd", "auto"])
def test_compression_modes_round_trip(roundtrip, compression):
    g = torch.Generator().manual_seed(4)
    zeros = torch.zeros(256, 64)  # 64 KB of zeros
    noise = torch.randint(0, 256, (65_536,), dtype=torch.uint8, generator=g)  # incompressible
    noise_f = torch.randint(-(2**31), 2**31 - 1, (16_384,), dtype=torch.int32, generator=g).view(torch.float32)
    obj = {"zeros": zeros, "noise": noise, "noise_f": noise_f}
    loaded, manifest = roundtrip(obj, save_kw={"compression": compression})
    assert_same(obj, loaded)
    entries = tensor_entries(manifest)

    def ids(key):
        return [[c["id"] for c in ch.blob.codec] for ch in entries[key].chunks]

    if compression == "none":
        assert all(ch.blob.codec == () for e in entries.values() for ch in e.chunks)
        assert all(ch.blob.length == ch.blob.raw_length for e in entries.values() for ch in e.chunks)
    else:
        assert all(chain and chain[-1] == "zstd" for chain in ids("zeros"))
        assert sum(ch.blob.length for ch in entries["zeros"].chunks) < zeros.nbytes // 10
    if compression == "auto":
        assert ids("noise") == [[]] and ids("noise_f") == [[]]
        assert entries["noise"].chunks[0].blob.length == noise.nbytes


# ---------------------------------------------------------------------------- load options
MAP_LOCATIONS = {
    "str": "cpu",
    "device": torch.device("cpu"),
    "dict": {"cpu": "cpu"},
    "callable": lambda storage, location: storage,
}


@pytest.mark.parametrize("form", sorted(MAP_LOCATIONS))
def test_map_location_forms(roundtrip, form):
    obj = {"w": torch.randn(3, 3), "p": torch.nn.Parameter(torch.randn(2))}
    loaded, _ = roundtrip(obj, load_kw={"map_location": MAP_LOCATIONS[form]})
    assert_same(obj, loaded)
    assert loaded["w"].device.type == "cpu"


@pytest.mark.parametrize("zipfile", [True, False], ids=["zip", "legacy"])
def test_torch_save_file_loads_through_ckptstore(tmp_path, zipfile):
    obj = {"w": torch.randn(4, 5), "tied": [torch.arange(3)] * 2, "n": 2**70, "od": OrderedDict(b=1, a=2)}
    path = tmp_path / "model.pt"
    torch.save(obj, path, _use_new_zipfile_serialization=zipfile)
    assert_same(obj, ckptstore.load(path))
    assert_same(obj, ckptstore.load(str(path)))
    with open(path, "rb") as fh:
        assert_same(obj, ckptstore.load(fh))
    buf = io.BytesIO(path.read_bytes())
    assert_same(obj, ckptstore.load(buf))


# ---------------------------------------------------------------------------- weights_only
SIDE_EFFECTS: list[str] = []


class Custom:
    """An arbitrary picklable class whose unpickling has a visible side effect."""

    def __init__(self, value, marker: str):
        self.value = value
        self.marker = marker

    def __setstate__(self, state):
        SIDE_EFFECTS.append(state["marker"])
        with open(state["marker"], "w") as fh:
            fh.write("unpickled")
        self.__dict__.update(state)


class RunsShell:
    """A payload that would run a shell command when unpickled."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.filterwarnings("ignore::ckptstore.errors.UnsafeForWeightsOnlyWarning")  # saved unsafe on purpose
def test_custom_class_refused_by_default_without_running_its_code(roundtrip, tmp_path):
    marker = str(tmp_path / f"unpickled-{roundtrip.mode}")
    obj = {"w": torch.ones(2), "custom": Custom(41, marker)}
    fut, loader = roundtrip.save(obj)
    fut.result(timeout=60)  # saving an arbitrary picklable object is fine
    SIDE_EFFECTS.clear()

    with pytest.raises(UnsafeLoadError) as ei:
        loader()
    assert isinstance(ei.value, pickle.UnpicklingError)
    assert "Custom" in str(ei.value)
    assert SIDE_EFFECTS == []
    assert not os.path.exists(marker)

    with pytest.raises(UnsafeLoadError):
        loader(weights_only=True)
    assert not os.path.exists(marker)

    full = loader(weights_only=False)
    assert type(full["custom"]) is Custom and full["custom"].value == 41
    assert SIDE_EFFECTS == [marker]  # opting in runs the class's own code, as pickle does
    os.unlink(marker)

    with torch.serialization.safe_globals([Custom]):
        allowed = loader()
    assert type(allowed["custom"]) is Custom and allowed["custom"].value == 41
    assert torch.equal(allowed["w"], torch.ones(2))


@pytest.mark.filterwarnings("ignore::ckptstore.errors.UnsafeForWeightsOnlyWarning")  # saved unsafe on purpose
def test_os_system_payload_refused_and_not_run(roundtrip, tmp_path):
    marker = tmp_path / f"pwned-{roundtrip.mode}"
    fut, loader = roundtrip.save({"w": torch.zeros(1), "evil": RunsShell(str(marker))})
    fut.result(timeout=60)
    with pytest.raises(UnsafeLoadError) as ei:
        loader()
    assert isinstance(ei.value, pickle.UnpicklingError)
    assert "system" in str(ei.value)
    assert not marker.exists()


def test_os_system_payload_in_a_torch_save_file_refused(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save({"evil": RunsShell(str(marker))}, path)
    with pytest.raises(pickle.UnpicklingError):
        ckptstore.load(path)
    with open(path, "rb") as fh, pytest.raises(pickle.UnpicklingError):
        ckptstore.load(fh)
    assert not marker.exists()


# ---------------------------------------------------------------------------- memory:// URLs
def test_memory_url_round_trip(memory_url):
    obj = {"w": torch.randn(5, 3), "n": 2**80, "od": OrderedDict(z=1, a=2)}
    manifest = ckptstore.save(obj, memory_url).result(timeout=60)
    assert manifest.generation == 1
    assert_same(obj, ckptstore.load(memory_url))


def test_memory_url_store_round_trip(memory_url):
    store = ckptstore.Store(memory_url)
    obj = {"w": torch.randn(5, 3)}
    store.save(3, obj).result(timeout=60)
    assert store.steps() == [3]
    assert_same(obj, store.load())
