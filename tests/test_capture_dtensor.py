"""DTensors on the fast path (checkpoint/capture.py): a state of DTensors on CPU meshes
(FSDP2's kind) is captured, not pickled on the caller's thread, and small local boxes
go into packs with the rank-local tensors. The skeleton must ask for what ``flatten``'s
asks for, the DTensors must get the keys ``flatten`` gives them, and the stored chunks
must load back to the same values. One gloo rank in this process (multi-rank meshes,
replicas and resharding: tests/test_sharded.py, which now takes this path too).
"""

from __future__ import annotations

import socket
from collections import OrderedDict

import pytest
import torch
import torch.distributed as dist

import ckptstore
from ckptstore.checkpoint import snapshot as snapshot_mod
from ckptstore.checkpoint.capture import capture, pickle_captured
from ckptstore.checkpoint.flatten import flatten

from test_capture import _echo


@pytest.fixture(scope="module")
def mesh():
    from torch.distributed.device_mesh import init_device_mesh

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _state(mesh):
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    g = torch.Generator().manual_seed(5)
    shared = distribute_tensor(torch.randn(6, 4, generator=g), mesh, [Shard(0)])
    param = torch.nn.Parameter(distribute_tensor(torch.randn(5, generator=g), mesh, [Shard(0)]))  # FSDP2's kind
    return {
        "model": OrderedDict(w=shared, b=distribute_tensor(torch.randn(3, generator=g), mesh, [Replicate()]),
                             p=param),
        "bf16": distribute_tensor(torch.randn(4, 2, generator=g).to(torch.bfloat16), mesh, [Shard(1)]),
        "u16": DTensor.from_local(torch.arange(7).to(torch.uint16), mesh, [Shard(0)], run_check=False),  # no typed storage
        "grad": distribute_tensor(torch.randn(3, generator=g), mesh, [Shard(0)]).requires_grad_(),
        "again": [shared, (shared, 1)],  # one DTensor reached three times: one key, one stand-in
        "x": {"y": distribute_tensor(torch.ones(2), mesh, [Shard(0)])},
        "x.y": distribute_tensor(torch.zeros(2), mesh, [Shard(0)]),  # the same path: a unique key
        "empty": distribute_tensor(torch.empty(0, 3), mesh, [Shard(0)]),
        "plain": torch.randn(4, generator=g),
        "scalar": DTensor.from_local(torch.tensor(2.5), mesh, [Replicate()]),
        "step": 9,
    }


def test_captured_dtensors_ask_for_what_flatten_asks_for_under_the_same_keys(mesh):
    state = _state(mesh)
    captured = capture(state)
    assert captured is not None
    slow_refs, slow_dtensors = [], []
    skeleton = flatten(state, slow_refs.append, on_dtensor=slow_dtensors.append)
    assert _echo(pickle_captured(captured.frozen, len(captured.storages))) == _echo(skeleton)
    assert [(r.key, id(r.dtensor)) for r in captured.dtensors] == [(r.key, id(r.dtensor)) for r in slow_dtensors]
    assert len({r.key for r in captured.dtensors}) == len(captured.dtensors) == 10
    assert [r.key for r in (captured.ref(i) for i in range(len(captured.storages)))] == [r.key for r in slow_refs]


def test_a_dtensor_where_only_pickling_reaches_goes_the_slow_way(mesh):
    from torch.distributed.tensor import Shard, distribute_tensor

    od = OrderedDict(a=torch.ones(1))
    od._metadata = {"d": distribute_tensor(torch.ones(2), mesh, [Shard(0)])}  # attributes: no tensors there
    assert capture({"sd": od}) is None


@pytest.mark.parametrize("way", ["captured", "pickled"])
def test_a_dtensor_state_saves_and_loads_back_either_way(mesh, tmp_path, monkeypatch, way):
    """Captured: no pickling on the caller's thread, small boxes packed. Pickled (a
    ``replicated=`` pattern takes the state through ``flatten``): each box by chunks."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    state = _state(mesh)
    g = torch.Generator().manual_seed(6)
    state["large"] = distribute_tensor(torch.randn(3, 400_000, generator=g), mesh, [Shard(0)])  # chunked, not packed
    state["cols"] = DTensor.from_local(torch.randn(30, 40, generator=g)[:, 5:25], mesh, [Shard(0)], run_check=False)
    packs, chunks, pickled = [], [], []
    writer_class, real_flatten = ckptstore.pipeline.RankWriter, snapshot_mod.flatten
    real_pack, real_chunk = writer_class.submit_pack, writer_class.submit_chunk
    monkeypatch.setattr(writer_class, "submit_pack",
                        lambda self, buf, entries: (packs.append(list(entries)), real_pack(self, buf, entries))[1])
    monkeypatch.setattr(writer_class, "submit_chunk",
                        lambda self, key, *a, **k: (chunks.append(key), real_chunk(self, key, *a, **k))[1])
    monkeypatch.setattr(snapshot_mod, "flatten", lambda *a, **k: (pickled.append(1), real_flatten(*a, **k))[1])
    store = ckptstore.Store(str(tmp_path / "s"), compression="none", chunk_bytes=1 << 20)
    store.save(1, state, replicated=["plain"] if way == "pickled" else ()).result()
    packed = {entry[0] for pack in packs for entry in pack}
    if way == "captured":
        assert not pickled
        assert {"model.w", "model.b", "model.p", "bf16", "u16", "grad", "x.y", "plain", "scalar"} <= packed
        assert {"large", "cols", "empty"}.isdisjoint(packed)  # large, strided or empty: staged by chunks
    else:
        assert pickled and not packed
    assert set(chunks) >= {"large", "cols"} and chunks.count("large") > 1
    monkeypatch.undo()

    back = store.load(1)  # without templates: each DTensor whole, as a plain tensor
    for key in ("bf16", "u16", "grad", "plain", "large", "cols", "x.y", "empty", "scalar"):
        want = state[key].full_tensor() if isinstance(state[key], DTensor) else state[key]
        assert back[key].dtype == want.dtype and torch.equal(back[key], want), key
    assert back["grad"].requires_grad
    assert back["again"][0] is back["model"]["w"] is back["again"][1][0]
    assert torch.equal(back["x"]["y"], torch.ones(2)) and torch.equal(back["x.y"], torch.zeros(2))
    assert back["step"] == 9


def test_packed_dtensor_boxes_unchanged_since_the_last_step_are_referenced(mesh, tmp_path):
    """Incremental saves: a packed box (80 KB, above the reference minimum) that did not
    change is recorded as a reference to the step that stored it, not written again."""
    from torch.distributed.tensor import Shard, distribute_tensor

    g = torch.Generator().manual_seed(8)
    state = {f"w{i}": distribute_tensor(torch.randn(20_000, generator=g), mesh, [Shard(0)]) for i in range(3)}
    store = ckptstore.Store(str(tmp_path / "s"), incremental=True, compression="zstd")
    store.save(1, state).result()
    state["w1"].to_local().add_(1)
    store.save(2, state).result()
    chunks = {key: entry.chunks for key, entry in store.manifest(2).tensors.items()}
    assert {key: [c.blob.step for c in cs] for key, cs in chunks.items()} == {"w0": [1], "w1": [None], "w2": [1]}
    back = store.load(2)
    assert all(torch.equal(back[k], v.full_tensor()) for k, v in state.items())


def test_a_quantized_local_dtensor_is_refused_at_save_and_nothing_commits(mesh, tmp_path):
    """Its chunks would hold the int8 bytes without the scale: a checkpoint that saved
    but could not load (torch's internal assert). Refused at save, by either path."""
    import warnings

    from torch.distributed.tensor import DTensor, Replicate

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantize_per_tensor is deprecated
        q = torch.quantize_per_tensor(torch.arange(4.0), 0.1, 0, torch.qint8)
    dt = DTensor.from_local(q, mesh, [Replicate()], run_check=False)
    store = ckptstore.Store(tmp_path / "store")
    store.save(1, {"w": torch.ones(3)}).result(timeout=60)
    with pytest.raises(ckptstore.errors.SerializationError, match=r"DTensor 'q'.*quantized") as info:
        store.save(2, {"q": dt}).result(timeout=60)
    assert isinstance(info.value, RuntimeError)  # torch.save's error type for tensors it cannot save
    with pytest.raises(ckptstore.errors.SerializationError, match="quantized"):
        ckptstore.save({"q": dt}, tmp_path / "one").result(timeout=60)
    assert store.steps() == [1]
    assert torch.equal(store.load(1)["w"], torch.ones(3))
