"""Store.save (and ckptstore.save with warn_unsafe=True) warns
(UnsafeForWeightsOnlyWarning) when the default load, weights_only=True, will refuse what
it saved; never for ordinary training state; the drop-in save, by default, is as silent
as torch.save. Each warning is checked
against a real load: a warning must be followed by UnsafeLoadError, silence by a load
that works.
"""

from __future__ import annotations

import io
import math
import pickle
import random
import re
import types
import warnings
from collections import Counter, OrderedDict

import numpy as np
import pytest
import torch

import ckptstore
from ckptstore.errors import UnsafeForWeightsOnlyWarning, UnsafeLoadError


class Point:
    def __init__(self, x=1.0, y=2.0):
        self.x, self.y = x, y

    def __eq__(self, other):
        return type(other) is Point and (self.x, self.y) == (other.x, other.y)


class Registry(dict):
    """A dict subclass: even when registered, the unpickler only fills exact dicts."""


def _name(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _save(obj, path, **kw):
    """ckptstore.save, returning the UnsafeForWeightsOnlyWarnings it issued."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ckptstore.save(obj, path, warn_unsafe=True, **kw).result()
    return [w for w in caught if issubclass(w.category, UnsafeForWeightsOnlyWarning)]


def _loads_by_default(path) -> bool:
    try:
        ckptstore.load(path)
    except UnsafeLoadError:
        return False
    return True


def training_state() -> dict:
    """A small but real training state: model, AdamW after a step, SGD with momentum,
    two schedulers (one with a lambda), a GradScaler, RNG states, and the usual extras."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2))
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(5, 4)).sum().backward()
    adamw.step()
    sgd.step()
    warmup = torch.optim.lr_scheduler.LambdaLR(adamw, lambda s: min(1.0, (s + 1) / 10))
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(sgd, T_max=10)
    adamw.step()
    sgd.step()
    warmup.step()
    cosine.step()
    model_state = model.state_dict()
    assert hasattr(model_state, "_metadata")  # the OrderedDict attribute torch.load restores too
    return {
        "model": model_state,
        "adamw": adamw.state_dict(),
        "sgd": sgd.state_dict(),
        "warmup": warmup.state_dict(),
        "cosine": cosine.state_dict(),
        "scaler": torch.amp.GradScaler("cpu").state_dict(),
        "scaler_off": torch.amp.GradScaler("cpu", enabled=False).state_dict(),
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
        "meta": {
            "shape": torch.Size([2, 3]), "dtypes": [torch.float32, torch.bfloat16, torch.uint16],
            "devices": (torch.device("cpu"), torch.device("cuda", 1)), "od": OrderedDict(a=1), "counts": Counter("aab"),
            "nested": [(1, [2.5, {"k": None, "s": {3, 4}}]), ("x", b"raw", bytearray(b"ba"))],
            "complex": 1 + 2j, "inf": math.inf, "big": 2**100, "flag": True,
        },
        "step": 7,
    }


def test_numpy_rng_state_warns_and_the_default_load_indeed_refuses(tmp_path):
    state = {"rng": np.random.get_state(), "w": torch.ones(3)}
    store = ckptstore.Store(tmp_path / "run")
    with pytest.warns(UnsafeForWeightsOnlyWarning) as record:
        store.save(1, state).result()
    assert len(record) == 1, "one warning per save, not one per object"
    warning = record[0].message
    assert "numpy.ndarray" in warning.types and "numpy.ndarray" in str(warning)
    assert any("_reconstruct" in g for g in warning.globals)
    for hint in ("weights_only=True", "add_safe_globals", "weights_only=False", 'simplefilter("error"'):
        assert hint in str(warning)
    assert ckptstore.UnsafeForWeightsOnlyWarning is UnsafeForWeightsOnlyWarning  # the name the hint uses
    with pytest.raises(UnsafeLoadError):
        store.load()
    loaded = store.load(weights_only=False)
    assert loaded["rng"][0] == "MT19937" and np.array_equal(loaded["rng"][1], state["rng"][1])


def test_a_user_class_warns_until_it_is_registered(tmp_path):
    with pytest.warns(UnsafeForWeightsOnlyWarning, match=re.escape(_name(Point))) as record:
        ckptstore.save({"p": Point()}, tmp_path / "a", warn_unsafe=True).result()
    assert record[0].message.types == {_name(Point): 1}
    assert not _loads_by_default(tmp_path / "a")

    with torch.serialization.safe_globals([Point]):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ckptstore.save({"p": Point(3.0)}, tmp_path / "b", warn_unsafe=True).result()
        assert ckptstore.load(tmp_path / "b") == {"p": Point(3.0)}
    # The registration ended with the context: the allow-list is not cached past it.
    assert _save({"p": Point()}, tmp_path / "c")


def test_ordinary_training_state_saves_silently_and_loads_by_default(tmp_path):
    state = training_state()
    store = ckptstore.Store(tmp_path / "run")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning, ours included, fails the test
        store.save(1, state).result()
    loaded = store.load()  # weights_only=True
    assert loaded["warmup"]["lr_lambdas"] == [None]  # the lambda itself is not in the state
    assert loaded["meta"] == state["meta"]
    assert loaded["model"]._metadata == state["model"]._metadata
    torch.testing.assert_close(loaded["adamw"]["state"], state["adamw"]["state"])


@pytest.mark.parametrize("name, value", [
    ("numpy scalar", np.float64(1.5)),
    ("frozenset", frozenset({1, 2})),
    ("empty bytes", b""),
    ("range", range(3)),
    ("a function", _name),
    ("a class", Point),
    ("a builtin", len),
    ("a registered dict subclass, filled", Registry(a=1)),
    ("a registered dict subclass, empty", Registry()),
    ("a set", {1, 2}),
    ("bytes", b"ab"),
    ("a Parameter", torch.nn.Parameter(torch.ones(2))),
    ("a tensor with an attribute", (lambda t: (setattr(t, "tag", "x"), t)[1])(torch.ones(2))),
    ("a sparse tensor", torch.eye(2).to_sparse()),
    ("a layout", torch.sparse_coo),
])
def test_warns_exactly_when_the_default_load_refuses(tmp_path, name, value):
    with torch.serialization.safe_globals([Registry]):
        warned = _save({"x": value, "t": torch.ones(1)}, tmp_path / "c")
        refused = not _loads_by_default(tmp_path / "c")
    assert bool(warned) == refused, f"{name}: warned={bool(warned)} but load refused={refused}"


def test_dropin_save_is_silent_as_torch_save(tmp_path):
    """torch.save warns of nothing (PyTorch's test_serialization_save_warnings): nor does
    the drop-in, unless asked; the load still refuses, with torch.load's words."""
    for target in (tmp_path / "dir", io.BytesIO()):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ckptstore.save(torch.nn.Linear(2, 3), target).result()
    with pytest.raises(UnsafeLoadError, match="Weights only load failed"):
        ckptstore.load(tmp_path / "dir")
    assert isinstance(ckptstore.load(tmp_path / "dir", weights_only=False), torch.nn.Linear)


def test_dropin_save_warns_at_the_callers_line(tmp_path):
    unsafe = {"rng": np.random.get_state()}
    (tmp_path / "old.pt").write_bytes(b"not a checkpoint")  # a plain file: replaced by a container
    for target in (tmp_path / "dir", io.BytesIO(), tmp_path / "old.pt"):
        with pytest.warns(UnsafeForWeightsOnlyWarning) as record:
            ckptstore.save(unsafe, target, warn_unsafe=True).result()
        assert len(record) == 1
        assert record[0].filename == __file__, f"{target}: warning points at {record[0].filename}"

    with pytest.warns(UnsafeForWeightsOnlyWarning) as record:
        ckptstore.Store(tmp_path / "run").save(1, unsafe).result()
    assert record[0].filename == __file__


def test_error_filter_refuses_the_save_and_commits_nothing(tmp_path):
    store = ckptstore.Store(tmp_path / "run")
    store.save(1, {"w": torch.ones(2)}).result()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnsafeForWeightsOnlyWarning)
        with pytest.raises(UnsafeForWeightsOnlyWarning, match="numpy.ndarray"):
            store.save(2, {"w": torch.full((2,), 2.0), "rng": np.random.get_state()})
    assert store.steps() == [1]
    torch.testing.assert_close(store.load()["w"], torch.ones(2))
    store.save(2, {"w": torch.full((2,), 2.0)}).result()  # the refused attempt left nothing in the way
    assert store.steps() == [1, 2]


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # torch's own note at load
def test_pickle_protocol_the_unpickler_cannot_read_warns(tmp_path):
    warned = _save({"w": torch.ones(2)}, tmp_path / "p4", pickle_protocol=4)
    assert warned and "pickle_protocol=4" in str(warned[0].message)
    assert not _loads_by_default(tmp_path / "p4")
    # Protocol 3 differs from 2 only for bytes: without them it loads, and save is silent.
    assert not _save({"w": torch.ones(2), "s": "x"}, tmp_path / "p3", pickle_protocol=3)
    assert _loads_by_default(tmp_path / "p3")
    assert _save({"b": b"ab"}, tmp_path / "p3b", pickle_protocol=3)
    assert not _loads_by_default(tmp_path / "p3b")


def test_a_custom_pickle_module_is_checked_too(tmp_path):
    # The pure-Python pickler calls reducer_override for every object, ints and strs too.
    pure = types.SimpleNamespace(Pickler=pickle._Pickler, Unpickler=pickle._Unpickler)
    assert not _save(training_state(), tmp_path / "ok", pickle_module=pure)
    assert _loads_by_default(tmp_path / "ok")
    warned = _save({"p": Point()}, tmp_path / "bad", pickle_module=pure)
    assert warned and warned[0].message.types == {_name(Point): 1}
