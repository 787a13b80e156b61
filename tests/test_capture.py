"""The fast path for plain states (checkpoint/capture.py) and small-tensor packs.

A plain state (containers of plain CPU tensors and plain values) is captured on the
caller's thread and pickled on a worker; everything else goes through ``flatten``.
These tests hold the fast path to ``flatten``'s output, check that a captured state is
a snapshot (the caller may change it as soon as ``save`` returns), and that whatever
the fast path cannot pickle faithfully goes the slow way.
"""

from __future__ import annotations

import io
import math
import pickle
from collections import OrderedDict, defaultdict

import pytest
import torch

import ckptstore
from ckptstore.checkpoint import snapshot as snapshot_mod
from ckptstore.checkpoint.capture import capture, pickle_captured
from ckptstore.checkpoint.flatten import flatten
from ckptstore.codecs import CompressionPolicy
from ckptstore.names import new_attempt_id
from ckptstore.pipeline import RankWriter, runtime
from ckptstore.runtime import Runtime
from ckptstore.storage import LocalStorage


class _Echo:
    """What a rebuild call was given, instead of its result: two skeletons that echo
    equal ask torch for the same tensors."""

    def __init__(self, name, args):
        if name == "_rebuild_tensor":  # capture's call for a tensor without grad: what v2 would set
            name, args = "_rebuild_tensor_v2", (*args, False, OrderedDict())
        if name in ("_rebuild_tensor_v2", "_rebuild_tensor_v3") and args[5] is None:
            args = (*args[:5], OrderedDict(), *args[6:])  # capture pickles the empty hook table as None
        if name == "_rebuild_parameter" and args[2] is None:
            args = (*args[:2], OrderedDict())
        self.name, self.args = name, args

    def __eq__(self, other):
        return isinstance(other, _Echo) and (self.name, self.args) == (other.name, other.args)

    def __repr__(self):
        return f"{self.name}{self.args!r}"


class _EchoUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if module == "torch._utils":
            return lambda *args: _Echo(name, args)
        if module == "collections" and name == "OrderedDict":
            return OrderedDict
        if module in ("torch", "torch.storage"):  # storage classes and dtypes in persistent ids
            return f"torch.{name}"
        raise AssertionError(f"unexpected global {module}.{name}")

    def persistent_load(self, pid):
        return ("pid",) + tuple(pid)


def _echo(skeleton: bytes):
    return _EchoUnpickler(io.BytesIO(skeleton)).load()


def _slow(obj):
    refs = []
    skeleton = flatten(obj, refs.append)
    return skeleton, refs


def _model_state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    return {"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict(),
            "step": 7, "loss": 0.25, "name": "run", "flag": None, "rng": torch.get_rng_state()}


def _unallocated_views():
    t = torch.empty(0)
    return {"a": t, "b": t.view(torch.int32)}  # one unallocated storage, two dtypes: two entries


def _recursive_tuple():
    inner: list = []
    t = (inner, torch.ones(1))
    inner.append(t)
    return {"x": t}


def _plain_states():
    base = torch.arange(24, dtype=torch.float32)
    shared = torch.randn(6)
    same = torch.ones(3)
    param = torch.nn.Parameter(torch.randn(2, 3))
    frozen = torch.nn.Parameter(torch.randn(3), requires_grad=False)
    return {
        "model": _model_state(),
        "views": {"whole": base, "rows": base.view(4, 6)[1:3], "t": base.view(4, 6).t(), "tail": base[20:]},
        "tied": {"a": shared, "b": shared.view(2, 3), "same1": same, "same2": same, "pair": (same, same)},
        "params": [param, frozen, param],
        "dtypes": {str(d): torch.ones(5, dtype=d) for d in (torch.float16, torch.bfloat16, torch.int64, torch.bool,
                                                            torch.uint8, torch.complex64, torch.uint16,
                                                            torch.float8_e4m3fn)},
        "odd": {"scalar": torch.tensor(3.5), "empty": torch.empty(0), "zero_rows": torch.empty(0, 4),
                "grad": torch.randn(2, requires_grad=True) * 2, 1: "int key", None: [1, 2.0, (3, "x")]},
        "nested": [[{"x": [torch.zeros(2)]}]],
        "unallocated views": _unallocated_views(),
        "tensor": torch.randn(3),
        "attributes reach a tensor met before": _attributes_reaching_tensors(),
    }


def _attributes_reaching_tensors() -> dict:
    """An OrderedDict whose attributes reach a tensor, a Parameter and a tuple already
    met in the items: the memo hands their records back there too."""
    w, p = torch.ones(3), torch.nn.Parameter(torch.ones(2))
    pair = (w, 1)
    od = OrderedDict(w=w, p=p, pair=pair)
    od._metadata = {"x": w}
    od.extra = [p, pair]
    return {"a": w, "sd": od}


@pytest.mark.parametrize("name", sorted(_plain_states()))
def test_captured_skeleton_asks_for_what_flatten_asks_for(name):
    obj = _plain_states()[name]
    captured = capture(obj)
    assert captured is not None, f"{name} should take the fast path"
    skeleton, refs = _slow(obj)
    assert _echo(pickle_captured(captured.frozen, len(captured.storages))) == _echo(skeleton)
    refs_fast = [captured.ref(i) for i in range(len(captured.storages))]
    assert [entry[1] for entry in captured.storages] == [r.storage.data_ptr() for r in refs_fast]
    fast = [(r.key, r.dtype, r.shape, r.location, r.scope, r.storage._cdata) for r in refs_fast]
    slow = [(r.key, r.dtype, r.shape, r.location, r.scope, r.storage._cdata) for r in refs]
    assert fast == slow


def test_module_state_dict_keeps_its_metadata(tmp_path):
    sd = torch.nn.Linear(2, 2).state_dict()
    assert capture(sd) is not None
    ckptstore.save(sd, str(tmp_path / "c")).result()
    back = ckptstore.load(str(tmp_path / "c"))
    assert type(back) is OrderedDict and back._metadata == sd._metadata
    torch.nn.Linear(2, 2).load_state_dict(back)


class _User:
    def __init__(self):
        self.t = torch.ones(2)


def _with_attribute():
    t = torch.ones(2)
    t.note = "x"
    return {"t": t}


def _with_hook():
    t = torch.ones(2, requires_grad=True)
    t.register_hook(lambda g: g)
    return {"t": t}


def _two_dtypes():
    t = torch.zeros(4)
    return [t, t.view(torch.int32)]


def _meta_in_metadata():
    sd = OrderedDict(w=torch.ones(1))
    sd.__dict__["extra"] = {"t": torch.ones(1)}
    return sd


NOT_PLAIN = {
    "user class": lambda: {"u": _User()},
    "tensor subclass": lambda: {"t": torch.ones(2).as_subclass(type("Sub", (torch.Tensor,), {}))},
    "conjugate view": lambda: {"t": torch.ones(2, dtype=torch.complex64).conj()},
    "negative view": lambda: {"t": torch.ones(2, dtype=torch.complex64).conj().imag},
    "python attribute": _with_attribute,
    "backward hook": _with_hook,
    "bytes": lambda: {"b": b"abc"},
    "defaultdict": lambda: defaultdict(list, a=[torch.ones(1)]),
    "tensor in OrderedDict attributes": _meta_in_metadata,
    "meta tensor": lambda: {"t": torch.empty(2, device="meta")},
    "sparse": lambda: {"t": torch.eye(2).to_sparse()},
    "quantized": lambda: {"t": torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)},
    "nested tensor": lambda: {"t": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])},
    "one buffer, two dtypes": _two_dtypes,
    "tuple key": lambda: {(1, 2): torch.ones(1)},
    "set": lambda: {"s": {1, 2}},
    "deep nesting": lambda: _deep(300),
    "tuple reached through its own items": _recursive_tuple,
    "dtype without a storage class": lambda: {"t": torch.empty(2, dtype=torch.uint4)},
}


def _deep(n):
    obj = torch.ones(1)
    for _ in range(n):
        obj = [obj]
    return obj


@pytest.mark.parametrize("case", sorted(NOT_PLAIN))
def test_what_the_fast_path_cannot_pickle_faithfully_goes_the_slow_way(case):
    assert capture(NOT_PLAIN[case]()) is None


def test_a_buffer_viewed_as_two_dtypes_still_raises_torchs_error(tmp_path):
    with pytest.raises(RuntimeError, match="different types"):
        ckptstore.save(_two_dtypes(), str(tmp_path / "c"))


def test_the_caller_may_change_a_captured_state_as_soon_as_save_returns(tmp_path):
    lst = [torch.full((3,), 1.0), 5]
    inner = {"w": torch.full((1000,), 2.0), "lst": lst}
    state = {"inner": inner, "big": torch.full((300_000,), 3.0), "count": 1}
    fut = ckptstore.save(state, str(tmp_path / "c"))
    # Everything changes before the background pickles the skeleton.
    inner["w"].fill_(-1)
    inner["new"] = torch.ones(1)
    del inner["lst"]
    lst.append("late")
    lst[0] = "replaced"
    state["big"].zero_()
    state["count"] = 2
    fut.result()
    back = ckptstore.load(str(tmp_path / "c"))
    assert back.keys() == {"inner", "big", "count"} and back["count"] == 1
    assert back["inner"].keys() == {"w", "lst"}
    assert torch.equal(back["inner"]["w"], torch.full((1000,), 2.0))
    assert len(back["inner"]["lst"]) == 2 and torch.equal(back["inner"]["lst"][0], torch.full((3,), 1.0))
    assert torch.equal(back["big"], torch.full((300_000,), 3.0))


def test_identity_and_sharing_come_back_as_torch_load_gives_them(tmp_path):
    state = _plain_states()
    ckptstore.save(state, str(tmp_path / "c")).result()
    back = ckptstore.load(str(tmp_path / "c"))
    buf = io.BytesIO()
    torch.save(state, buf)
    ref = torch.load(io.BytesIO(buf.getvalue()))
    for obj in (back, ref):
        tied = obj["tied"]
        assert tied["same1"] is tied["same2"] and tied["pair"][0] is tied["same1"]
        assert tied["a"].untyped_storage().data_ptr() == tied["b"].untyped_storage().data_ptr()
        assert obj["params"][0] is obj["params"][2] and type(obj["params"][0]) is torch.nn.Parameter
        assert not obj["params"][1].requires_grad and obj["odd"]["grad"].requires_grad
        views = obj["views"]
        assert views["t"].stride() == (1, 6) and views["rows"].storage_offset() == 6
    _assert_same(back, ref)


def test_tensors_without_grad_are_rebuilt_by_the_plain_call():
    """A tensor that needs no gradient is pickled for ``_rebuild_tensor`` (the cheaper
    call, without v2's fake-mode look-up), one that needs it for v2, which sets the flag."""
    state = {"plain": torch.ones(2), "grad": torch.ones(2, requires_grad=True), "u16": torch.ones(2, dtype=torch.uint16)}
    captured = capture(state)
    echoed = _RawEcho(io.BytesIO(pickle_captured(captured.frozen, len(captured.storages)))).load()
    assert echoed["plain"][0] == "_rebuild_tensor" and len(echoed["plain"][1]) == 4
    assert echoed["grad"][0] == "_rebuild_tensor_v2" and echoed["grad"][1][4] is True
    assert echoed["u16"][0] == "_rebuild_tensor_v3"


class _RawEcho(_EchoUnpickler):
    """The rebuild call's name and arguments, as written."""

    def find_class(self, module, name):
        if module == "torch._utils":
            return lambda *args: (name, args)
        return super().find_class(module, name)


def _assert_same(a, b):
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.stride(), a.storage_offset(), a.requires_grad) == (
            b.dtype, b.shape, b.stride(), b.storage_offset(), b.requires_grad)
        assert torch.equal(a.detach().view(torch.uint8) if a.dtype.is_floating_point and a.dtype.itemsize == 1
                           else a.detach(), b.detach().view(torch.uint8) if b.dtype.is_floating_point
                           and b.dtype.itemsize == 1 else b.detach())
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


def _manifest(path):
    from ckptstore.storage import LocalStorage as _LS
    from ckptstore.checkpoint.manifests import latest_manifest

    return latest_manifest(_LS(str(path)))


@pytest.mark.parametrize("compression", ["none", "auto", "zstd"])
def test_packs_of_small_tensors_keep_one_chunk_per_tensor(tmp_path, compression):
    g = torch.Generator().manual_seed(1)
    state = {f"t{i}": (torch.zeros(300) if i % 3 == 0 else torch.randn(300 + i, generator=g)) for i in range(600)}
    state["large"] = torch.randn(600_000, generator=g)  # 2.4 MB: chunked, not packed
    fut = ckptstore.save(state, str(tmp_path / "c"), compression=compression)
    manifest = fut.result()
    tensors = manifest.ranks[0].tensors
    assert all(len(tensors[f"t{i}"].chunks) == 1 for i in range(600))
    blobs = sorted((c.blob.offset, c.blob.length) for e in tensors.values() for c in e.chunks)
    assert all(a[0] + a[1] <= b[0] for a, b in zip(blobs, blobs[1:]))  # no two blobs share bytes
    if compression != "none":
        assert tensors["t0"].chunks[0].blob.codec  # zeros compress
    if compression == "auto":
        assert not tensors["t1"].chunks[0].blob.codec  # random floats do not pay for it
    back = ckptstore.load(str(tmp_path / "c"))
    assert all(torch.equal(back[k], v) for k, v in state.items())


def test_packs_wait_for_a_pool_smaller_than_the_state(tmp_path):
    rt = Runtime(workers=2, staging_bytes=256 << 10)
    storage = LocalStorage(str(tmp_path / "s"))
    state = {f"t{i}": torch.full((1000,), float(i)) for i in range(2000)}  # 8 MB through a 256 KiB pool
    writer = RankWriter(storage, new_attempt_id(), 0, CompressionPolicy("none"), rt)
    out = snapshot_mod.snapshot(state, writer, rt.pool)
    written = writer.finish()
    assert rt.pool.in_use == 0 and rt.pool.peak <= 256 << 10
    assert set(out.local) == set(state) and len(written.local) == 2000
    rt.shutdown()


def test_a_failing_pack_names_its_first_tensor(tmp_path, monkeypatch):
    from ckptstore import pipeline

    def broken(*a, **k):
        raise OSError("disk on fire")

    monkeypatch.setattr(pipeline, "digest", broken)
    with pytest.raises(ckptstore.errors.StorageError, match=r"tensor 't0' \(or one of the \d+ packed after it\)"):
        ckptstore.save({f"t{i}": torch.ones(10) for i in range(5)}, str(tmp_path / "c")).result()
    assert runtime().pool.in_use == 0


def test_fast_path_blocking_work_is_independent_of_pickling(tmp_path, monkeypatch):
    """The skeleton of a captured state is pickled by a worker, not the caller."""
    import threading

    from ckptstore.checkpoint import capture as capture_mod

    callers = []
    real = capture_mod.pickle_captured

    def spy(frozen, n_storages):
        callers.append(threading.current_thread() is threading.main_thread())
        return real(frozen, n_storages)

    monkeypatch.setattr(snapshot_mod, "pickle_captured", spy)
    ckptstore.save({"w": torch.ones(4)}, str(tmp_path / "c")).result()
    assert callers == [False]


def test_other_pickle_protocols_take_the_slow_path_and_its_warning(tmp_path):
    with pytest.warns(ckptstore.UnsafeForWeightsOnlyWarning, match="FRAME"):
        ckptstore.save({"w": torch.ones(2)}, str(tmp_path / "c"), pickle_protocol=4, warn_unsafe=True).result()


def test_sizes_round_up_nothing(tmp_path):
    """An odd-sized v3 storage (bytes not a multiple of the item size) still packs."""
    t = torch.ones(5, dtype=torch.uint16)
    state = {"t": t, "n": math.pi}
    ckptstore.save(state, str(tmp_path / "c")).result()
    back = ckptstore.load(str(tmp_path / "c"))
    assert torch.equal(back["t"], t) and back["n"] == math.pi


# ---------------------------------------------------------------------------- the GC pause
def test_the_gc_pause_is_the_callers_only():
    """ckptstore's background threads never pause the collector: the training thread's
    cyclic garbage would pile up for as long as a save writes."""
    import gc

    from ckptstore._gc import gc_paused
    from ckptstore._threads import DaemonThreadPool

    pool = DaemonThreadPool(1, "test")

    def inside():
        with gc_paused():
            return gc.isenabled()

    assert gc.isenabled() and pool.submit(inside).result() is True
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_collector_the_user_turns_off_during_a_save_stays_off(tmp_path):
    import gc

    fut = ckptstore.save({f"t{i}": torch.randn(1000) for i in range(3000)}, str(tmp_path / "c"), compression="zstd")
    gc.disable()
    try:
        fut.result()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_child_forked_during_a_pause_has_its_collector_back():
    import gc
    import os

    from ckptstore._gc import gc_paused

    with gc_paused():
        pid = os.fork()
        if pid == 0:
            os._exit(0 if gc.isenabled() else 1)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_the_frozen_copy_leaves_the_collector_nothing_to_track():
    """What outlives ``save`` until a worker pickles it (the frozen copy, the storage
    tables) is made of exact tuples of untracked values, apart from the containers: one
    young-generation pass stops tracking them, so 100,000 tensors add nothing to the
    older generations and set off no full collection in the caller's time."""
    import gc

    n = 300
    state = {"model": {f"w{i}": torch.ones(2) for i in range(n)},
             "opt": {"state": {i: {"step": torch.tensor(1.0), "m": torch.zeros(2)} for i in range(n)},
                     "param_groups": [{"params": list(range(n)), "lr": 0.1}]},
             "params": [torch.nn.Parameter(torch.ones(2)) for _ in range(5)],
             "pairs": [(torch.ones(1), 3) for _ in range(5)]}
    def tracked_values(frozen):
        stack, found = [frozen], []
        while stack:
            o = stack.pop()
            if type(o) in (dict, list, OrderedDict):
                stack.extend(o.values() if isinstance(o, dict) else o)
            elif gc.is_tracked(o):
                found.append(o)
            if type(o) is tuple:
                stack.extend(o)
        return found

    gc.disable()  # as save pauses it; and no collection may run before the first look
    try:
        captured = capture(state)
        assert captured is not None
        records = [r for r in tracked_values(captured.frozen) if len(r) > 2]  # tensor and Parameter records
    finally:
        gc.enable()
    assert len(records) == 3 * n + 10
    gc.collect()
    # One pass untracks every record (a user's tuple holding a tensor may take a second).
    assert [v for v in tracked_values(captured.frozen) if len(v) > 2] == []
    assert not any(gc.is_tracked(r) for r in captured.storages)
    gc.collect()
    assert tracked_values(captured.frozen) == []
    # and the thawed copy still pickles as flatten does
    skeleton, _refs = _slow(state)
    assert _echo(pickle_captured(captured.frozen, len(captured.storages))) == _echo(skeleton)


def test_a_record_left_in_the_frozen_copy_fails_the_pickle_loudly():
    """Should the worker ever miss a record, the skeleton is refused, never written
    with a tuple where a tensor should be."""
    from ckptstore.checkpoint import capture as capture_mod

    captured = capture({"w": torch.ones(2)})
    with pytest.raises(pickle.PicklingError, match="record reached the pickler"):
        capture_mod._FrozenPickler(io.BytesIO(), protocol=2).dump(captured.frozen)
