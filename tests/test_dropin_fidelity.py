"""Drop-in fidelity: where PyTorch's own test_serialization.py, ported to call
ckptstore, found ckptstore behaving unlike torch.save / torch.load.

Each test first asks torch 2.13 what it does, then checks that ckptstore does the same:
the same objects back, the same refusals, the same builtin exception types (so an
``except`` clause written for torch keeps working).
"""

from __future__ import annotations

import io
import os
import pickle
import stat

import pytest
import torch

import ckptstore
from ckptstore.checkpoint import container
from ckptstore.checkpoint.container import MAGIC
from ckptstore.errors import CkptStoreError, SerializationError

pytestmark = pytest.mark.usefixtures("observe_earlier_failures")


def torch_roundtrip(obj, **load_kw):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, **load_kw)


def ckpt_roundtrip(obj, target: str, tmp_path, save_kw=None, **load_kw):
    """Save then load through ckptstore: a checkpoint directory or a BytesIO."""
    if target == "path":
        path = tmp_path / "ckpt"
        ckptstore.save(obj, path, **(save_kw or {})).result(timeout=60)
        return ckptstore.load(path, **load_kw)
    buf = io.BytesIO()
    ckptstore.save(obj, buf, **(save_kw or {}))
    buf.seek(0)
    return ckptstore.load(buf, **load_kw)


def caught(builtin, fn, *args, **kw) -> BaseException:
    """The exception ``fn`` raises, caught by ``except builtin`` as caller code would."""
    try:
        fn(*args, **kw)
    except builtin as e:
        return e
    raise AssertionError(f"{fn.__name__} raised nothing")


TARGETS = ["path", "bytesio"]


# ---------------------------------------------------------------------------- 1. unallocated storage
@pytest.mark.parametrize("target", TARGETS)
def test_unallocated_storage_viewed_as_two_dtypes_saves_like_torch(tmp_path, target):
    t = torch.empty(0)
    obj = [t, t.view(torch.int32), t.view(torch.int32)]
    expected = torch_roundtrip(obj)
    loaded = ckpt_roundtrip(obj, target, tmp_path)
    assert [(x.dtype, tuple(x.shape)) for x in loaded] == [(x.dtype, tuple(x.shape)) for x in expected]
    assert [x.dtype for x in loaded] == [torch.float32, torch.int32, torch.int32]


# ---------------------------------------------------------------------------- 2. nested tensors
def _nested(layout):
    g = torch.Generator().manual_seed(0)
    return torch.nested.nested_tensor([torch.randn(2, 3, generator=g), torch.randn(4, 3, generator=g)],
                                      layout=layout)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("weights_only", [True, False])
@pytest.mark.parametrize("layout", [torch.strided, torch.jagged], ids=["strided", "jagged"])
def test_nested_tensor_round_trips_as_torch_does(tmp_path, target, weights_only, layout):
    nt = _nested(layout)
    obj = {"nt": nt, "plain": torch.arange(3)}
    try:
        expected = torch_roundtrip(obj, weights_only=weights_only)
    except Exception as e:  # torch refuses it: ckptstore must refuse it the same way
        with pytest.raises(type(e)):
            ckpt_roundtrip(obj, target, tmp_path, weights_only=weights_only)
        return
    loaded = ckpt_roundtrip(obj, target, tmp_path, weights_only=weights_only)
    got, want = loaded["nt"], expected["nt"]
    assert type(got) is type(want) and got.is_nested and got.layout == want.layout == layout
    assert got.dtype == want.dtype
    assert [tuple(c.shape) for c in got.unbind()] == [(2, 3), (4, 3)]
    for a, b in zip(got.unbind(), nt.unbind()):
        assert torch.equal(a, b)
    assert torch.equal(loaded["plain"], torch.arange(3))


# ---------------------------------------------------------------------------- 3. pickle_module
class Recorder:
    """A pickle module, as torch.save / torch.load accept, that counts its use."""

    pickled = 0
    unpickled = 0

    class Pickler(pickle.Pickler):
        def dump(self, obj):
            Recorder.pickled += 1
            return super().dump(obj)

    class Unpickler(pickle.Unpickler):
        def load(self):
            Recorder.unpickled += 1
            return super().load()


@pytest.fixture
def recorder():
    Recorder.pickled = Recorder.unpickled = 0
    return Recorder


@pytest.mark.parametrize("target", TARGETS)
def test_pickle_module_and_protocol_positional_as_torch(tmp_path, target):
    obj = {"w": torch.randn(3, 2), "n": 7}
    torch.save(obj, io.BytesIO(), pickle, 2)  # torch's positional order: pickle_module, pickle_protocol
    loaded = ckpt_roundtrip(obj, target, tmp_path, save_kw={"pickle_module": pickle, "pickle_protocol": 2})
    assert torch.equal(loaded["w"], obj["w"]) and loaded["n"] == 7
    path = tmp_path / "positional"
    ckptstore.save(obj, path, pickle, 2).result(timeout=60)
    assert ckptstore.load(path, None, pickle, weights_only=False)["n"] == 7


@pytest.mark.parametrize("target", TARGETS)
def test_pickle_module_pickles_and_unpickles_the_skeleton(tmp_path, target, recorder):
    obj = {"w": torch.ones(2)}
    loaded = ckpt_roundtrip(obj, target, tmp_path, save_kw={"pickle_module": recorder},
                            pickle_module=recorder, weights_only=False)
    assert torch.equal(loaded["w"], obj["w"])
    assert (recorder.pickled, recorder.unpickled) == (1, 1)


def test_pickle_module_alone_turns_weights_only_off_as_torch(tmp_path, recorder):
    """torch.load(f, pickle_module=m) loads with weights_only=False (torch's default rule)."""
    path = tmp_path / "ckpt"
    ckptstore.save({"w": torch.ones(2)}, path).result(timeout=60)
    assert torch.equal(ckptstore.load(path, pickle_module=recorder)["w"], torch.ones(2))
    assert recorder.unpickled == 1
    torch_file = tmp_path / "torch.pt"
    torch.save({"w": torch.ones(2)}, torch_file)
    assert torch.equal(ckptstore.load(torch_file, pickle_module=recorder)["w"], torch.ones(2))
    assert recorder.unpickled == 2  # handed on to torch.load


def test_pickle_module_with_weights_only_refused_as_torch(tmp_path):
    buf = io.BytesIO()
    torch.save({"w": torch.ones(2)}, buf)
    want = caught(RuntimeError, torch.load, io.BytesIO(buf.getvalue()), pickle_module=pickle, weights_only=True)
    path = tmp_path / "ckpt"
    ckptstore.save({"w": torch.ones(2)}, path).result(timeout=60)
    for source in (path, io.BytesIO(buf.getvalue())):
        got = caught(RuntimeError, ckptstore.load, source, pickle_module=pickle, weights_only=True)
        assert type(got) is type(want) and str(got) == str(want)


# ---------------------------------------------------------------------------- 4. existing plain file
def _debris(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.endswith(".tmp"))


@pytest.mark.parametrize("existing", ["empty", "torch_save"])
def test_save_over_a_plain_file_replaces_it_like_torch(tmp_path, existing):
    path = tmp_path / "model.pt"
    if existing == "empty":
        path.write_bytes(b"")
    else:
        torch.save({"old": torch.zeros(3)}, path)
    os.chmod(path, 0o640)
    torch.save({"x": 1}, tmp_path / "probe.pt")  # torch.save replaces a file too
    obj = {"w": torch.randn(4, 3), "n": 2**70}
    fut = ckptstore.save(obj, path)
    assert fut.done() and fut.result(timeout=0) is not None  # written before save returned
    assert path.is_file() and path.read_bytes()[:len(MAGIC)] == MAGIC  # the single-file container
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    loaded = ckptstore.load(path)
    assert list(loaded) == ["w", "n"] and torch.equal(loaded["w"], obj["w"]) and loaded["n"] == 2**70
    assert _debris(tmp_path) == []
    # saving again replaces it again, and a path that does not exist still becomes a directory
    ckptstore.save({"w": torch.ones(1)}, path)
    assert torch.equal(ckptstore.load(path)["w"], torch.ones(1))
    ckptstore.save(obj, tmp_path / "new").result(timeout=60)
    assert (tmp_path / "new").is_dir()


@pytest.mark.parametrize("how", ["unpicklable", "replace_fails"])
def test_failed_save_over_a_plain_file_leaves_it_byte_identical(tmp_path, monkeypatch, how):
    path = tmp_path / "model.pt"
    torch.save({"old": torch.arange(5.0)}, path)
    before = path.read_bytes()
    if how == "unpicklable":
        with pytest.raises(SerializationError):
            ckptstore.save({"w": torch.ones(3), "bad": lambda: 0}, path)
    else:
        def boom(src, dst):
            raise OSError(5, "injected failure at rename", dst)
        monkeypatch.setattr(container.os, "replace", boom)
        with pytest.raises(OSError, match="injected"):
            ckptstore.save({"w": torch.ones(3)}, path)
        monkeypatch.undo()
    assert path.read_bytes() == before
    assert _debris(tmp_path) == []
    assert torch.equal(ckptstore.load(path)["old"], torch.arange(5.0))


_KILLED_WHILE_WRITING = """
import sys, torch, ckptstore
from ckptstore.checkpoint import container
def stop_half_way(store, fh):
    fh.write(b"half a checkpoint")
    fh.flush()
    print("writing", flush=True)
    sys.stdin.read()  # SIGKILLed here
container.write_container = stop_half_way
ckptstore.save({"w": torch.full((3,), 2.0)}, sys.argv[1])
"""


def test_a_temporary_file_a_killed_writer_left_goes_with_the_next_save(tmp_path):
    """A SIGKILL while replacing a plain file leaves the old file whole and a temporary
    beside it (as large as the checkpoint); nothing removed it, and every kill added one.
    The next save removes those of dead writers on this host, never a live one's."""
    import signal
    import socket
    import subprocess
    import sys

    path = tmp_path / "latest.pt"
    path.write_bytes(b"")
    ckptstore.save({"w": torch.ones(3)}, path)
    child = subprocess.Popen([sys.executable, "-c", _KILLED_WHILE_WRITING, str(path)], cwd="/",
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "writing"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    (left,) = _debris(tmp_path)
    space = f"{socket.gethostname()}-{os.stat('/proc/self/ns/pid').st_ino}"
    assert left.startswith(f".latest.pt.{space}.{child.pid}.")
    assert torch.equal(ckptstore.load(path)["w"], torch.ones(3))  # the old file, whole
    live = tmp_path / f".latest.pt.{space}.{os.getpid()}.abcdefgh.tmp"  # a save of ours in flight
    other_host = tmp_path / f".latest.pt.{socket.gethostname()}-1.{child.pid}.abcdefgh.tmp"  # another namespace
    live.write_bytes(b"x")
    other_host.write_bytes(b"x")
    ckptstore.save({"w": torch.zeros(3)}, path)
    assert _debris(tmp_path) == sorted([live.name, other_host.name])
    assert torch.equal(ckptstore.load(path)["w"], torch.zeros(3))


# ---------------------------------------------------------------------------- 5. builtin error types
def test_dtype_views_of_allocated_storage_raise_runtime_error_as_torch(tmp_path):
    t = torch.zeros(4)
    obj = [t, t.view(torch.int32)]
    want = caught(RuntimeError, torch.save, obj, io.BytesIO())
    assert "view the same data as different types" in str(want)
    for save_to in (io.BytesIO(), tmp_path / "ckpt"):
        got = caught(RuntimeError, ckptstore.save, obj, save_to)
        assert isinstance(got, SerializationError) and isinstance(got, TypeError)  # ckptstore's own type too
        assert str(want) in str(got)
    # the same dtype twice, or two dtypes over separate buffers, is fine
    same = torch_roundtrip([t, t[1:]])
    loaded = ckpt_roundtrip([t, t[1:]], "bytesio", tmp_path)
    assert [x.storage_offset() for x in loaded] == [x.storage_offset() for x in same]


def test_zero_tensor_raises_runtime_error_as_torch(tmp_path):
    z = torch._efficientzerotensor(3)
    want = caught(RuntimeError, torch.save, z, io.BytesIO())
    got = caught(RuntimeError, ckptstore.save, {"z": z}, tmp_path / "ckpt")
    assert isinstance(got, SerializationError)
    assert str(want) in str(got)
    assert not (tmp_path / "ckpt").exists() or not any(n.startswith("manifest-") for n in os.listdir(tmp_path / "ckpt"))


@pytest.mark.parametrize("target", [123, 1.5, None, object()], ids=["int", "float", "none", "object"])
def test_target_neither_path_nor_file_raises_attribute_error_as_torch(target):
    want = caught(AttributeError, torch.save, {"w": torch.ones(1)}, target)
    got = caught(AttributeError, ckptstore.save, {"w": torch.ones(1)}, target)
    assert type(got) is type(want)
    assert "file-like object with a 'write' attribute" in str(got)


class NoSeek:
    """A readable stream without seek or tell (a socket's makefile, say)."""

    def __init__(self, data: bytes):
        self._buf = io.BytesIO(data)

    def read(self, n=-1):
        return self._buf.read(n)

    def readline(self):
        return self._buf.readline()


class Unseekable(io.RawIOBase):
    """A stream that says it cannot seek (a pipe)."""

    def __init__(self, data: bytes):
        self._buf = io.BytesIO(data)

    def readable(self):
        return True

    def seekable(self):
        return False

    def readinto(self, out):
        data = self._buf.read(len(out))
        out[:len(data)] = data
        return len(data)


@pytest.mark.parametrize("stream", [NoSeek, Unseekable])
def test_torch_file_from_non_seekable_stream_refused_as_torch(stream):
    buf = io.BytesIO()
    torch.save({"w": torch.ones(2)}, buf)
    data = buf.getvalue()
    want = caught(Exception, torch.load, stream(data))
    assert "seekable" in str(want)
    got = caught(type(want), ckptstore.load, stream(data))
    assert type(got) is type(want)
    assert "seekable" in str(got) and "io.BytesIO" in str(got)


@pytest.mark.parametrize("stream", [NoSeek, Unseekable])
def test_container_loads_from_non_seekable_stream(stream):
    """A ckptstore container reads front to back: it needs no seek (a feature torch lacks)."""
    buf = io.BytesIO()
    ckptstore.save({"w": torch.arange(4)}, buf)
    assert torch.equal(ckptstore.load(stream(buf.getvalue()))["w"], torch.arange(4))


def test_new_error_types_stay_in_the_tree():
    from ckptstore.checkpoint.flatten import UnserializableTensorError

    assert issubclass(UnserializableTensorError, (CkptStoreError,))
    assert issubclass(UnserializableTensorError, RuntimeError)
    assert issubclass(UnserializableTensorError, SerializationError)


# ---------------------------------------------------------------------------- loads under a FakeTensorMode
def _described(o):
    if torch.is_tensor(o):
        return (type(o).__name__, str(o.device), tuple(o.shape), o.dtype, o.requires_grad, o.storage_offset(),
                o.stride())
    if isinstance(o, dict):
        return {k: _described(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return type(o)(_described(v) for v in o)
    return o


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("map_location", [None, "cuda:1", {"cpu": "cuda:0"}], ids=["none", "str", "dict"])
def test_a_load_under_a_fake_tensor_mode_gives_fake_tensors_as_torch(tmp_path, target, map_location):
    """torch.compile, export and meta initialisation load under a FakeTensorMode: like
    torch.load, ckptstore.load then rebuilds fake tensors (shape, dtype, strides, views,
    Parameters, the device map_location names) and reads no tensor bytes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    base = torch.randn(6, 4)
    obj = {"w": base, "rows": base[2:4], "p": torch.nn.Parameter(torch.randn(3)), "step": 7,
           "nested": [torch.arange(3), (torch.ones(2, 5, dtype=torch.bfloat16).t(),)]}
    saved = io.BytesIO()
    torch.save(obj, saved)
    ours_at = tmp_path / "ckpt" if target == "path" else io.BytesIO()
    future = ckptstore.save(obj, ours_at)
    if target == "path":
        future.result(timeout=60)
    else:
        ours_at.seek(0)
    saved.seek(0)
    with FakeTensorMode():  # saved outside it, loaded inside
        theirs = _described(torch.load(saved, map_location=map_location))
        ours = _described(ckptstore.load(ours_at, map_location=map_location))
    assert ours == theirs
    assert ours["w"][0] == "FakeTensor" and ours["step"] == 7


def test_a_load_under_a_fake_tensor_mode_gives_sparse_tensors_as_torch(tmp_path):
    """A sparse fake tensor has no storage to place by: the placement walk passed over
    it and failed ("Cannot access storage of SparseTensorImpl") where torch.load works."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    obj = {"coo": torch.eye(4).to_sparse(), "w": torch.randn(3)}
    saved = io.BytesIO()
    torch.save(obj, saved)
    saved.seek(0)
    ckptstore.save(obj, tmp_path / "ckpt").result(timeout=60)
    with FakeTensorMode():
        theirs = torch.load(saved)
        ours = ckptstore.load(tmp_path / "ckpt")
    assert ours["coo"].layout == theirs["coo"].layout == torch.sparse_coo
    assert tuple(ours["coo"].shape) == (4, 4) and type(ours["w"]).__name__ == "FakeTensor"


def test_a_fake_load_reads_no_tensor_bytes_but_checks_the_skeleton(tmp_path):
    """Tensor bytes are not read under a FakeTensorMode (damage there goes unnoticed, as
    the load touches none of it), but the skeleton is read and its hash checked."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ckptstore.checkpoint.manifests import latest_manifest
    from ckptstore.storage import LocalStorage

    path = tmp_path / "ckpt"
    ckptstore.save({"w": torch.randn(1000), "tag": "x" * 64}, path).result(timeout=60)
    storage = LocalStorage(str(path))
    state = latest_manifest(storage).ranks[0]
    tensor_blob = state.tensors["w"].chunks[0].blob if "w" in state.tensors else \
        next(iter(state.tensors.values())).chunks[0].blob
    data = path / tensor_blob.file
    with open(data, "r+b") as f:  # damage the tensor's bytes: only a real load notices
        f.seek(tensor_blob.offset)
        f.write(bytes(16))
    with FakeTensorMode():
        fake = ckptstore.load(path)
    assert tuple(fake["w"].shape) == (1000,) and fake["tag"] == "x" * 64
    with pytest.raises(CkptStoreError, match="xxh3"):
        ckptstore.load(path)
    with open(data, "r+b") as f:  # now the skeleton's bytes: a fake load reads those
        f.seek(state.skeleton.offset)
        f.write(bytes(8))
    with FakeTensorMode(), pytest.raises(CkptStoreError, match="skeleton"):
        ckptstore.load(path)


def test_placing_fake_tensors_visits_each_object_once():
    """A skeleton may share one list many times (a few hundred bytes for 2**40 paths) or
    hold itself: the walk that finds the tensors a fake load places (and checks) visits
    each object once, so a hostile checkpoint cannot make a fake load hang or overflow
    the stack."""
    from ckptstore.checkpoint.walk import tensors_in

    iterations = []

    class Counting(list):
        def __iter__(self):
            iterations.append(1)
            return super().__iter__()

    shared = Counting([torch.ones(1)])
    for _ in range(40):
        shared = Counting([shared, shared])
    list(tensors_in({"x": shared}, attributes=True))
    assert len(iterations) == 41
    looped: list = [torch.ones(1)]
    looped.append(looped)
    list(tensors_in({"x": looped}, attributes=True))  # no RecursionError


def test_a_fake_load_of_a_list_holding_itself_places_its_tensor(tmp_path):
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    looped: list = [torch.ones(3)]
    looped.append(looped)
    ckptstore.save({"l": looped}, tmp_path / "c").result(timeout=60)
    with FakeTensorMode():
        out = ckptstore.load(tmp_path / "c", map_location="cuda:0")
    assert out["l"][1] is out["l"] and isinstance(out["l"][0], FakeTensor)
    assert str(out["l"][0].device) == "cuda:0" and tuple(out["l"][0].shape) == (3,)


def test_mmap_is_torch_loads_for_its_files_and_warns_for_a_checkpoint_of_ours(tmp_path):
    """torch.load's keyword: it reached the skeleton's unpickler as a pickle argument
    (TypeError), even mmap=False."""
    ours, theirs = tmp_path / "ours", tmp_path / "theirs.pt"
    ckptstore.save({"w": torch.arange(3.0)}, ours).result(timeout=60)
    torch.save({"w": torch.arange(3.0)}, theirs)
    for mmap in (None, False):
        assert torch.equal(ckptstore.load(ours, mmap=mmap)["w"], torch.arange(3.0))
    with pytest.warns(UserWarning, match="mmap=True does not apply"):
        assert torch.equal(ckptstore.load(ours, mmap=True)["w"], torch.arange(3.0))
    assert torch.equal(ckptstore.load(theirs, mmap=True)["w"], torch.arange(3.0))


# ---------------------------------------------------------------------------- session 33


def test_save_takes_torch_saves_private_keywords(tmp_path):
    """PyTorch's TestSerialization passes _use_new_zipfile_serialization on every save."""
    for kw in ({"_use_new_zipfile_serialization": True}, {"_use_new_zipfile_serialization": False},
               {"_disable_byteorder_record": True}):
        buf = io.BytesIO()
        ckptstore.save([torch.arange(3)], buf, **kw).result()
        buf.seek(0)
        assert torch.equal(ckptstore.load(buf)[0], torch.arange(3)), kw
    # positionally too, in torch.save's order
    buf = io.BytesIO()
    ckptstore.save(torch.ones(2), buf, pickle, 2, True, False)
    buf.seek(0)
    assert torch.equal(ckptstore.load(buf), torch.ones(2))


@pytest.mark.parametrize("target", ["path", "buffer"])
def test_the_force_weights_only_environment_variables(tmp_path, monkeypatch, target):
    buf = io.BytesIO()
    ckptstore.save(torch.nn.Linear(2, 3), tmp_path / "ckpt" if target == "path" else buf).result()
    where = tmp_path / "ckpt" if target == "path" else buf

    def load(**kw):
        buf.seek(0)
        return ckptstore.load(where, **kw)

    monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        load(weights_only=False)  # forced: the caller's False does not open the door
    monkeypatch.delenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "true")
    with pytest.warns(UserWarning, match="TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"):
        assert isinstance(load(), torch.nn.Linear)  # weights_only not passed: forced off
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        load(weights_only=True)  # passed: the caller's word stands
    monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(RuntimeError, match="Only one of"):
        load()


@pytest.mark.filterwarnings("ignore::ckptstore.errors.UnsafeForWeightsOnlyWarning")  # saved unsafe on purpose
def test_force_weights_only_reaches_store_loads(tmp_path, monkeypatch):
    store = ckptstore.Store(tmp_path / "run")
    store.save(1, {"m": torch.nn.Linear(2, 2)}).result()
    assert isinstance(store.load(weights_only=False)["m"], torch.nn.Linear)
    monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "yes")
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        store.load(weights_only=False)


def test_weights_only_refusals_keep_torch_loads_words(tmp_path):
    """torch.load's messages, which code and PyTorch's tests match on."""
    from torch.testing._internal.two_tensor import TwoTensor

    for protocol, words in ((2, r"add_safe_globals\(\[torch.testing._internal.two_tensor.TwoTensor\]\)"),
                            (5, "file an issue with the following so that we can make `weights_only=True`")):
        sd = {"t": TwoTensor(torch.randn(2), torch.randn(2))}
        for fn in (torch.save, ckptstore.save):
            buf = io.BytesIO()
            fn(sd, buf, pickle_protocol=protocol)
            buf.seek(0)
            with pytest.warns(UserWarning, match="pickle protocol") if protocol == 5 else _nothing():
                with pytest.raises(pickle.UnpicklingError, match=words):
                    (torch.load if fn is torch.save else ckptstore.load)(buf, weights_only=True)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_map_location_reaches_wrapper_subclasses():
    """torch's _rebuild_wrapper_subclass reads map_location from serialization's
    thread-local, which torch.load sets (PyTorch's test_tensor_subclass_map_location)."""
    from torch.testing._internal.two_tensor import TwoTensor

    buf = io.BytesIO()
    ckptstore.save(TwoTensor(torch.ones(2), torch.zeros(2)), buf)
    with torch.serialization.safe_globals([TwoTensor]):
        buf.seek(0)
        meta = ckptstore.load(buf, map_location="meta")
        assert meta.device.type == "meta" and meta.a.device.type == "meta"
        buf.seek(0)
        with pytest.raises(RuntimeError, match="Callable map_location not supported"):
            ckptstore.load(buf, map_location=lambda s, loc: s)
    assert torch.serialization._serialization_tls.map_location is None  # left as found


def test_map_location_meta_device_with_an_index():
    buf = io.BytesIO()
    ckptstore.save({"w": torch.ones(3)}, buf)
    buf.seek(0)
    assert ckptstore.load(buf, map_location=torch.device("meta", 0))["w"].device.type == "meta"


def test_skip_data_saves_through_torch(tmp_path):
    """skip_data is about torch's zip format (room left for the bytes): inside it the
    drop-in is torch.save, and the load gives what torch.load gives."""
    t = torch.randn(2, 3)
    for target in (io.BytesIO(), tmp_path / "file.pt"):
        with torch.serialization.skip_data():
            future = ckptstore.save(t, target)
        assert future.done() and future.result() is None
        if isinstance(target, io.BytesIO):
            target.seek(0)
        assert torch.equal(ckptstore.load(target), torch.zeros(2, 3))
    (tmp_path / "dir").mkdir()
    with torch.serialization.skip_data(), pytest.raises(ValueError, match="skip_data"):
        ckptstore.save(t, tmp_path / "dir")


def test_pickling_errors_are_the_builtin_types_torch_raises():
    class Local:
        pass

    for obj, builtin in ((Local(), AttributeError), (lambda: 0, AttributeError)):
        with pytest.raises(builtin) as torch_raised:
            torch.save(obj, io.BytesIO())
        with pytest.raises(type(torch_raised.value)) as ours:
            ckptstore.save(obj, io.BytesIO())
        assert isinstance(ours.value, SerializationError) and "Can't pickle" in str(ours.value)
    with pytest.raises(pickle.PicklingError):
        ckptstore.save(_module_lambda, io.BytesIO())


_module_lambda = lambda: 0  # noqa: E731 (pickled by a name that does not find it)


def test_unseekable_stream_error_keeps_torch_loads_advice():
    class NoSeek:
        def __init__(self, data):
            self._b = io.BytesIO(data)

        def read(self, n=-1):
            return self._b.read(n)

    with pytest.raises(AttributeError, match=".*You can only torch.load from a file that is seekable. Please "
                       "pre-load the data into a buffer like io.BytesIO and try to load from it instead."):
        ckptstore.load(NoSeek(b"data"))
