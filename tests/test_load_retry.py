"""The one retry rule of a load (docs/format.md, read order step 5; checkpoint/load.py,
``with_reloads``): a load whose manifest is retired under it starts again from the
listing, at most RELOADS tries in all, whichever layer (drop-in, Store, tiers) it went
through; a copy retired under the load is not a bad copy, so no tier fallback warns."""

from __future__ import annotations

import shutil
import warnings

import pytest
import torch

import ckptstore
from ckptstore import store as store_mod
from ckptstore.checkpoint import load as load_mod
from ckptstore.checkpoint.load import RELOADS, with_reloads
from ckptstore.errors import IntegrityError
from ckptstore.tiers import TierFallbackWarning


def test_with_reloads_tries_again_only_while_what_it_read_is_retired(tmp_path):
    store = ckptstore.Store(tmp_path / "s")
    store.save(1, {"x": torch.ones(3)}).result()
    manifest = ckptstore.api.latest_manifest(store.location(1))
    calls = []

    def retired_each_time(reading):  # reads a generation that is not there
        calls.append(1)
        reading.note(store.location(1), manifest)
        reading.generation = 99
        raise IntegrityError("bad bytes")

    with pytest.raises(IntegrityError):
        with_reloads(retired_each_time)
    assert len(calls) == RELOADS

    calls.clear()

    def still_there(reading):  # its own fault: raised at once
        calls.append(1)
        reading.note(store.location(1), manifest)
        raise IntegrityError("bad bytes")

    with pytest.raises(IntegrityError):
        with_reloads(still_there)
    assert len(calls) == 1


def test_a_store_load_retries_at_one_level_only(tmp_path, monkeypatch):
    """Store.load and the load of a location each retried RELOADS times: RELOADS**2 tries
    of a load whose every manifest was retired under it. Now RELOADS in all."""
    store = ckptstore.Store(tmp_path / "s")
    store.save(1, {"x": torch.ones(3)}).result()
    real, calls = load_mod.load_once, []

    def retired(storage, *args, reading=None, **kw):
        calls.append(1)
        obj, info = real(storage, *args, reading=reading, **kw)
        reading.generation += 1000  # as if a newer generation retired what was read
        raise IntegrityError(f"{storage.describe()}: bad bytes")

    monkeypatch.setattr(store_mod, "load_once", retired)
    with pytest.raises(IntegrityError):
        store.load()
    assert len(calls) == RELOADS


def test_a_local_copy_retired_under_the_load_is_not_a_bad_copy(tmp_path, monkeypatch):
    """The local tier's retention removes the step while a load reads it: the load starts
    again from the listing and reads the durable copy, with no TierFallbackWarning."""
    store = ckptstore.Store(tmp_path / "durable", local=tmp_path / "local")
    state = {"x": torch.arange(10.0)}
    store.save(1, state).result()
    ckptstore.wait()
    assert [name for name, _ in store.tiers_of(1)] == ["local", "durable"]
    real = load_mod.load_once

    def local_retired(storage, *args, reading=None, **kw):
        obj, info = real(storage, *args, reading=reading, **kw)
        if str(tmp_path / "local") in storage.describe():
            shutil.rmtree(tmp_path / "local" / "step-000000000001")  # retention, meanwhile
            raise IntegrityError(f"{storage.describe()}: a data file vanished")
        return obj, info

    monkeypatch.setattr(store_mod, "load_once", local_retired)
    with warnings.catch_warnings():
        warnings.simplefilter("error", TierFallbackWarning)
        got, info = store.load(1, return_info=True)
    assert info.tier == "durable" and torch.equal(got["x"], state["x"])
