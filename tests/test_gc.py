"""Retention and garbage collection: policy tables, ``ckptstore gc`` with each flag,
``--dry-run``, debris and superseded generations against the grace period, retention and
pins on ``Store``, gc beside a running writer and reader, and gc SIGKILLed at random
moments (I7: a manifest goes before its files, the newest committed checkpoint is never
deleted, nothing a retained checkpoint or a young attempt needs is touched).

This file is also the child program of its process tests: ``python test_gc.py ROLE ...``
(writer, reader, gc-loop, gc-kill, rank1); see the bottom of the file.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from cliutil import age_files, cli, failed_attempt, files_below, tree

import ckptstore
from ckptstore import format as fmt
from ckptstore import names
from ckptstore.checkpoint import gc as gc_mod
from ckptstore.checkpoint.catalog import scan_store
from ckptstore.checkpoint.manifests import read_manifest
from ckptstore.checkpoint.retention import (
    Candidate,
    KeepBest,
    Retention,
    parse_duration,
    select_kept,
)
from ckptstore.checkpoint.save import SaveOptions, start_save
from ckptstore.checkpoint.verify import verify_manifest
from ckptstore.cli import main
from ckptstore.errors import NotCommittedError
from ckptstore.runtime import runtime
from ckptstore.storage import LocalStorage

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from procs.harness import HANG_GUARD_S, Zygote, child_env  # noqa: E402
from procs.states import single_value, uniform_state  # noqa: E402

THIS = os.path.abspath(__file__)
SEED = int(os.environ.get("CKPTSTORE_GC_SEED", "7007"))
HOUR = 3600.0

if __name__ != "__main__":
    pytestmark = pytest.mark.usefixtures("observe_earlier_failures")


# ---------------------------------------------------------------------------- helpers
def state(step: int) -> dict:
    return {"w": torch.full((256,), float(step)), "b": torch.arange(32) + step, "step": step}


LOSS = {0: 5.0, 10: 1.0, 20: 4.0, 30: 2.0, 40: 6.0, 50: 3.0}


def build_store(root, steps=tuple(LOSS)) -> ckptstore.Store:
    store = ckptstore.Store(root)
    for s in steps:
        store.save(s, state(s), metrics={"loss": LOSS.get(s, float(s)), "acc": s / 100})
    ckptstore.wait()
    return store


def add_superseded_generation(location_path: str, resave) -> None:
    """Leave an older generation beside the visible one, as a crash between a commit and
    the retirement of the previous generation does: keep a copy of the current
    generation's files, re-save (which commits generation g+1 and retires g), put the
    copy back."""
    keep = location_path + ".keep"
    shutil.copytree(location_path, keep)
    resave()
    shutil.copytree(keep, location_path, dirs_exist_ok=True)
    shutil.rmtree(keep)


def assert_visible_whole(root) -> list[int]:
    """Every listed checkpoint verifies and loads the state of its step (I7). Returns
    the committed steps."""
    store = ckptstore.Store(root)
    for loc in scan_store(LocalStorage(root)):
        assert loc.manifest_error is None, loc.manifest_error
        if loc.manifest is None:
            continue
        assert verify_manifest(loc.storage, loc.manifest) == [], loc.name
        got = store.load(loc.step)
        assert got["step"] == loc.step and torch.equal(got["w"], state(loc.step)["w"])
    return store.steps()


# ---------------------------------------------------------------------------- retention tables
NOW = 1_000_000.0


def cand(step, age=100.0, pinned=False, **metrics) -> Candidate:
    return Candidate(fmt.step_dir_name(step), step, NOW - age, metrics, pinned)


def steps_kept(cands, policy) -> set[int]:
    return {int(name.split("-")[1]) for name in select_kept(cands, policy, NOW)}


RETENTION_TABLE = [
    # (id, candidates, policy, kept steps)
    ("no-policy-keeps-all", [cand(s) for s in (1, 2, 3, 4)], Retention(), {1, 2, 3, 4}),
    ("empty-store", [], Retention(last=1), set()),
    ("last-2", [cand(s) for s in range(1, 6)], Retention(last=2), {4, 5}),
    ("last-more-than-there-are", [cand(s) for s in (1, 2, 3)], Retention(last=10), {1, 2, 3}),
    ("last-1-by-step-not-list-order", [cand(s) for s in (7, 3, 9, 1)], Retention(last=1), {9}),
    ("every-10", [cand(s) for s in (0, 5, 10, 15, 20, 25)], Retention(every=10), {0, 10, 20, 25}),
    ("within-1h-boundary-inclusive", [cand(1, age=7200), cand(2, age=3601), cand(3, age=3600), cand(4, age=10)],
     Retention(within=HOUR), {3, 4}),
    ("within-string-duration", [cand(1, age=3 * 86400), cand(2, age=86400), cand(3, age=1)],
     Retention(within="2d"), {2, 3}),
    ("best-min", [cand(s, loss=l) for s, l in ((1, 0.5), (2, 0.1), (3, 0.9), (4, 0.3), (5, 0.8))],
     Retention(best=(KeepBest("loss", "min", 2),)), {2, 4, 5}),
    ("best-max", [cand(s, acc=a) for s, a in ((1, 0.5), (2, 0.9), (3, 0.7), (4, 0.1))],
     Retention(best=(KeepBest("acc", "max", 1),)), {2, 4}),
    ("best-ignores-missing-bool-and-text", [cand(1, loss=True), cand(2, loss="low"), cand(3), cand(4, loss=0.5),
                                            cand(5, loss=9.0)],
     Retention(best=KeepBest("loss", "min", 1)), {4, 5}),
    ("two-best-policies", [cand(s, loss=10 - s, acc=s % 3) for s in range(1, 7)],
     Retention(best=(KeepBest("loss", "max", 1), KeepBest("acc", "max", 1))), {1, 2, 6}),
    ("combo-any-policy-keeps", [cand(s, age=s * 1000.0, loss=abs(s - 3)) for s in (0, 1, 2, 3, 4, 5, 6, 7, 8)],
     Retention(last=1, every=4, within=1500, best=(KeepBest("loss", "min", 1),)), {0, 1, 3, 4, 8}),
    ("pinned-always-kept", [cand(1, pinned=True), cand(2), cand(3), cand(4)], Retention(last=1), {1, 4}),
    ("pinned-with-no-policy", [cand(1, pinned=True), cand(2)], Retention(), {1, 2}),
    ("newest-kept-when-no-policy-would", [cand(s, loss=float(s)) for s in (1, 2, 3)],
     Retention(best=(KeepBest("loss", "min", 1),)), {1, 3}),
    ("newest-is-highest-step-not-latest-commit", [cand(5, age=9999.0), cand(3, age=1.0), cand(1, age=9000.0)],
     Retention(within=60), {3, 5}),
]


@pytest.mark.parametrize("cands, policy, expected", [r[1:] for r in RETENTION_TABLE],
                         ids=[r[0] for r in RETENTION_TABLE])
def test_select_kept_table(cands, policy, expected):
    assert steps_kept(cands, policy) == expected


def test_select_kept_reasons():
    kept = select_kept([cand(1, pinned=True), cand(2, loss=0.1), cand(3), cand(4)],
                       Retention(last=1, best=(KeepBest("loss", "min", 1),)), NOW)
    assert set(kept["step-000000000001"]) == {"pinned"}
    assert set(kept["step-000000000002"]) == {"best 1 loss min"}
    assert set(kept["step-000000000004"]) == {"newest", "last 1"}
    assert "step-000000000003" not in kept


@pytest.mark.parametrize("text, seconds", [("90s", 90), ("30m", 1800), ("12h", 43200), ("7d", 604800),
                                           ("2w", 1209600), ("1.5h", 5400), ("45", 45), (" 5 m ", 300),
                                           (0, 0.0), (2.5, 2.5)])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "h", "5y", "-1", "1e3", "5 days", -1, float("nan"), float("inf"), True])
def test_parse_duration_rejects(text):
    with pytest.raises(ValueError):
        parse_duration(text)


@pytest.mark.parametrize("text, expected", [("loss:min:3", KeepBest("loss", "min", 3)),
                                            ("val/acc:max:1", KeepBest("val/acc", "max", 1))])
def test_keep_best_parse(text, expected):
    assert KeepBest.parse(text) == expected


@pytest.mark.parametrize("text", ["loss", "loss:min", "loss:avg:3", "loss:min:x", "loss:min:-1", "a:b:min:3"])
def test_keep_best_parse_rejects(text):
    with pytest.raises(ValueError):
        KeepBest.parse(text)


def test_retention_validates_and_normalises():
    for bad in (dict(last=0), dict(every=-1), dict(last=1.5), dict(last="3")):
        with pytest.raises(ValueError):
            Retention(**bad)
    assert Retention(within="7d").within == 604800.0
    assert Retention(best=KeepBest("loss", "min", 1)).best == (KeepBest("loss", "min", 1),)
    assert Retention().empty and not Retention(every=5).empty


# ---------------------------------------------------------------------------- ckptstore gc flags
GC_FLAGS = [
    ("keep-last", ["--keep-last", "2"], {40, 50}),
    ("keep-every", ["--keep-every", "20"], {0, 20, 40, 50}),
    ("keep-best-min", ["--keep-best", "loss:min:2"], {10, 30, 50}),
    ("keep-best-repeated", ["--keep-best", "loss:max:1", "--keep-best", "acc:min:1"], {0, 40, 50}),
    ("combo", ["--keep-last", "1", "--keep-every", "30"], {0, 30, 50}),
    ("no-policy", [], set(LOSS)),
]


@pytest.mark.parametrize("flags, expected", [r[1:] for r in GC_FLAGS], ids=[r[0] for r in GC_FLAGS])
def test_cli_gc_flags(tmp_path, flags, expected):
    root = str(tmp_path / "store")
    build_store(root)
    r = cli("gc", root, *flags, "--json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert {k["name"] for k in report["kept"]} == {fmt.step_dir_name(s) for s in expected}
    gone = set(LOSS) - expected
    assert sorted(d["location"] for d in report["deleted"]) == [fmt.step_dir_name(s) for s in sorted(gone)]
    # The manifests go; their data files are released (a save in flight may reference them).
    assert all(d["kind"] == "checkpoint" and d["objects"] == 1 and d["bytes"] == 0 for d in report["deleted"])
    assert report["bytes"] == 0 and report["dry_run"] is False
    assert report["released_bytes"] > 0 if gone else report["released_bytes"] == 0
    assert assert_visible_whole(root) == sorted(expected)
    for s in gone:
        left = files_below(os.path.join(root, fmt.step_dir_name(s)))
        assert any(k.endswith("/" + names.RELEASED_LEAF) for k in left) and any(k.endswith(".bin") for k in left), \
            (s, left)
    # Within the grace nothing more goes; with none (nothing writes), the released files do.
    again = json.loads(cli("gc", root, *flags, "--json").stdout)
    assert again["deleted"] == [] and again["released_bytes"] == 0
    r = cli("gc", root, *flags, "--grace", "0", "--json")
    assert r.exit_code == 0, r.output
    swept = json.loads(r.stdout)
    assert sorted({d["kind"] for d in swept["deleted"]}) == (["attempt"] if gone else [])
    assert swept["bytes"] >= report["released_bytes"]
    assert assert_visible_whole(root) == sorted(expected)
    for s in gone:
        assert files_below(os.path.join(root, fmt.step_dir_name(s))) == {}, s


def time_iso(t: float) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat()


def test_cli_gc_keep_within(tmp_path):
    """Steps 0..30 committed two days ago (their manifests say so), 40 and 50 now."""
    root = str(tmp_path / "store")
    build_store(root)
    for s in (0, 10, 20, 30):
        path = os.path.join(root, fmt.step_dir_name(s), fmt.manifest_name(1))
        doc = json.loads(open(path, "rb").read())
        doc["committed_at"] = "2000-01-01T00:00:00+00:00" if s == 0 else time_iso(time.time() - 2 * 86400)
        with open(path, "w") as f:
            json.dump(doc, f)
    assert cli("gc", root, "--keep-within", "3d", "--dry-run", "--json").exit_code == 0
    r = cli("gc", root, "--keep-within", "1d", "--json")
    assert r.exit_code == 0, r.output
    assert {k["name"]: k["reasons"] for k in json.loads(r.stdout)["kept"]} == {
        "step-000000000040": ["within 86400s"], "step-000000000050": ["newest", "within 86400s"]}
    assert assert_visible_whole(root) == [40, 50]
    r = cli("gc", root, "--keep-within", "3d", "--json")
    assert json.loads(r.stdout)["deleted"] == []


def test_cli_gc_never_deletes_the_newest_checkpoint(tmp_path):
    root = str(tmp_path / "store")
    build_store(root)  # step 50 has neither the best loss nor a multiple of 20
    r = cli("gc", root, "--keep-best", "loss:min:1", "--keep-every", "20", "--json")
    assert r.exit_code == 0
    assert assert_visible_whole(root) == [0, 10, 20, 40, 50]
    reasons = {k["name"]: k["reasons"] for k in json.loads(r.stdout)["kept"]}
    assert reasons["step-000000000050"] == ["newest"]


@pytest.mark.parametrize("copy_name", ["step-000000000200.bak", "zz-copy", "step-000000000300-old"])
def test_a_copy_of_the_newest_step_under_another_name_never_outranks_it(tmp_path, copy_name):
    """`cp -r step-N step-N.bak`: the copy's manifest says step N too, and once won the tie
    on its name: gc --keep-last 1 kept the copy as the newest and deleted every step
    directory, so Store.load found nothing. A manifest edited to claim the largest
    step must not outrank them either."""
    root = tmp_path / "store"
    store = ckptstore.Store(root)
    for step in (100, 200):
        store.save(step, {"w": torch.full((4,), float(step))}).result(timeout=60)
    shutil.copytree(root / "step-000000000200", root / copy_name)
    forged = root / "forged"
    shutil.copytree(root / "step-000000000100", forged)
    for m in forged.glob("manifest-*.json"):
        doc = json.loads(m.read_text())
        doc["step"] = 999_999_999_999  # the largest step a manifest may hold
        m.write_text(json.dumps(doc))
    r = cli("gc", str(root), "--keep-last", "1", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert [k["name"] for k in out["kept"]] == ["step-000000000200"]
    assert {d["location"] for d in out["deleted"] if d["kind"] == "checkpoint"} == {
        "step-000000000100", copy_name, "forged"}
    assert ckptstore.Store(root).steps() == [200]
    assert torch.equal(ckptstore.Store(root).load()["w"], torch.full((4,), 200.0))


def test_cli_gc_usage_errors(tmp_path):
    root = str(tmp_path / "store")
    build_store(root, steps=(0, 10))
    before = tree(root)
    for args in (["--keep-last", "0"], ["--keep-every", "-2"], ["--keep-best", "loss:min"],
                 ["--keep-within", "soon"], ["--grace", "5y"], ["--keep-last", "x"]):
        r = cli("gc", root, *args)
        assert r.exit_code == 2 and "Error: Invalid value" in r.stderr, (args, r.output)
    r = cli("gc", str(tmp_path / "missing"), "--keep-last", "1")
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and "missing" in r.stderr
    assert tree(root) == before


# ---------------------------------------------------------------------------- dry run, debris, generations
def debris_store(root) -> dict:
    """Steps 0..3 committed; step 3 with a superseded generation; old (2 h idle) and young
    debris beside step 3 and in an uncommitted step 7; old and young temp files."""
    store = build_store(root, steps=(0, 1, 2, 3))
    add_superseded_generation(os.path.join(root, fmt.step_dir_name(3)),
                              lambda: store.save(3, state(3), metrics={"loss": 3.0}).result())
    s3, s7 = store.location(3), store.location(7)
    old = {"s3": failed_attempt(s3, state(3), rank=1, step=3),
           "s7-0": failed_attempt(s7, state(7), rank=0, step=7),
           "s7-1": failed_attempt(s7, state(7), rank=1, step=7)}
    for where, a in old.items():
        age_files(os.path.join(root, fmt.step_dir_name(3 if where == "s3" else 7), "attempts", a), 2 * HOUR)
    young = {"s3": failed_attempt(s3, state(3), rank=0, step=3),
             "s7": failed_attempt(s7, state(7), rank=1, step=7)}
    tmp_old = os.path.join(root, fmt.step_dir_name(2), fmt.manifest_name(2) + ".tmp-0badf00d")
    tmp_young = os.path.join(root, fmt.step_dir_name(1), fmt.manifest_name(2) + ".tmp-0cafe000")
    for p in (tmp_old, tmp_young):
        with open(p, "wb") as f:
            f.write(b"{")
    age_files(os.path.dirname(tmp_old), 2 * HOUR)  # (step 2's own files too: age is no reason to delete them)
    return {"old": old, "young": young, "tmp_old": tmp_old, "tmp_young": tmp_young,
            "gen1_attempt": read_manifest(s3, 1).attempt}


def test_I7_dry_run_prints_exactly_what_gc_then_deletes_and_changes_nothing(tmp_path):
    root = str(tmp_path / "store")
    debris_store(root)
    before = tree(root)
    text = cli("gc", root, "--keep-last", "2", "--grace", "1h", "--dry-run")
    assert text.exit_code == 0
    dry = cli("gc", root, "--keep-last", "2", "--grace", "1h", "--dry-run", "--json")
    assert dry.exit_code == 0
    assert tree(root) == before, "--dry-run changed the store"
    planned = json.loads(dry.stdout)
    assert planned["dry_run"] is True
    lines = [line for line in text.stdout.splitlines() if not line.startswith("pending ")]  # (young debris)
    assert len(lines) == len(planned["deleted"]) + 1
    assert all(line.startswith("would delete ") for line in lines)
    assert lines[-1].startswith(f"would delete {len(planned['deleted'])} item(s)")
    assert sorted((d["kind"], d["location"]) for d in planned["deleted"]) == [
        ("attempt", "step-000000000003"), ("attempt", "step-000000000007"), ("attempt", "step-000000000007"),
        ("checkpoint", "step-000000000000"), ("checkpoint", "step-000000000001"),
        ("generation", "step-000000000003"), ("temp", "step-000000000002")]

    done = cli("gc", root, "--keep-last", "2", "--grace", "1h", "--json")
    assert done.exit_code == 0
    deleted = json.loads(done.stdout)
    assert deleted["dry_run"] is False

    def key(d):
        return d["kind"], d["location"], d["bytes"], d["objects"]

    assert sorted(map(key, deleted["deleted"])) == sorted(map(key, planned["deleted"]))
    assert deleted["released_bytes"] == planned["released_bytes"] > 0
    after = files_below(root)
    marks = set(after) - set(before)  # in the attempts of dropped steps 0 and 1, and of step 3's generation 1
    assert sorted(m.split("/")[0] for m in marks) == [fmt.step_dir_name(s) for s in (0, 1, 3)]
    assert all(m.endswith("/" + names.RELEASED_LEAF) for m in marks)
    assert len(set(f for f in before if not f.endswith("/")) - set(after)) == sum(
        d["objects"] for d in planned["deleted"])
    assert json.loads(cli("gc", root, "--keep-last", "2", "--grace", "1h", "--json").stdout)["deleted"] == []
    # After the grace the released files go, marks and all (and the young debris, old by then).
    storage = LocalStorage(root)
    later = gc_mod.plan(storage, Retention(last=2), HOUR, now=time.time() + HOUR + 60)
    assert sorted((d.kind, d.location) for d in later.deletions) == [
        ("attempt", "step-000000000000"), ("attempt", "step-000000000001"), ("attempt", "step-000000000003"),
        ("attempt", "step-000000000003"), ("attempt", "step-000000000007"), ("temp", "step-000000000001")]
    gc_mod.execute(storage, later)
    assert sorted(os.listdir(root)) == [fmt.step_dir_name(s) for s in (2, 3)]
    assert assert_visible_whole(root) == [2, 3]


def test_I7_gc_deletes_superseded_generations_and_old_debris_keeps_young(tmp_path):
    root = str(tmp_path / "store")
    d = debris_store(root)
    s3 = os.path.join(root, fmt.step_dir_name(3))
    assert sorted(n for n in os.listdir(s3) if n.startswith("manifest")) == [fmt.manifest_name(1), fmt.manifest_name(2)]
    r = cli("gc", root, "--grace", "1h", "--json")  # no --keep: every checkpoint stays
    assert r.exit_code == 0
    report = json.loads(r.stdout)
    assert {k["name"] for k in report["kept"]} == {fmt.step_dir_name(s) for s in (0, 1, 2, 3)}
    kinds = sorted(x["kind"] for x in report["deleted"])
    assert kinds == ["attempt", "attempt", "attempt", "generation", "temp"]
    left = files_below(root)
    for where, a in d["old"].items():
        assert not any(f"/{a}/" in f for f in left), f"old debris {where} kept"
    for where, a in d["young"].items():
        assert any(f"/{a}/" in f for f in left), f"young attempt {where} deleted"
    assert not os.path.exists(d["tmp_old"]) and os.path.exists(d["tmp_young"])
    assert sorted(n for n in os.listdir(s3) if n.startswith("manifest")) == [fmt.manifest_name(2)]
    assert any(f"/{d['gen1_attempt']}/" in f for f in left)  # released: it goes after the grace
    assert report["released_bytes"] > 0
    assert assert_visible_whole(root) == [0, 1, 2, 3]
    assert ckptstore.Store(root).manifest(3).generation == 2
    # Once the grace period is over (here: 0), the rest of the debris goes too.
    r = cli("gc", root, "--grace", "0", "--json")
    assert sorted(x["kind"] for x in json.loads(r.stdout)["deleted"]) == ["attempt", "attempt", "attempt", "temp"]
    assert not any(f"/{d['gen1_attempt']}/" in f for f in files_below(root))
    assert files_below(os.path.join(root, fmt.step_dir_name(7))) == {}
    assert assert_visible_whole(root) == [0, 1, 2, 3]


def test_I6_I7_gc_on_a_single_checkpoint_path(tmp_path):
    path = str(tmp_path / "latest.pt")
    ckptstore.save(state(1), path).result()
    add_superseded_generation(path, lambda: ckptstore.save(state(2), path).result())
    assert sorted(n for n in os.listdir(path) if n.startswith("manifest")) == [fmt.manifest_name(1), fmt.manifest_name(2)]
    r = cli("gc", path, "--keep-last", "1", "--json")
    assert r.exit_code == 0
    report = json.loads(r.stdout)
    assert [(x["kind"], x["location"]) for x in report["deleted"]] == [("generation", ".")]
    assert [k["name"] for k in report["kept"]] == ["."]
    assert sorted(n for n in os.listdir(path) if n.startswith("manifest")) == [fmt.manifest_name(2)]
    assert ckptstore.load(path)["step"] == 2 and ckptstore.verify(path) == []


def test_I7_plan_deletes_manifests_before_their_files(tmp_path):
    root = str(tmp_path / "store")
    debris_store(root)
    plan = gc_mod.plan(LocalStorage(root), Retention(last=1), grace=HOUR)
    assert {d.kind for d in plan.deletions} == {"checkpoint", "generation", "attempt", "temp"}
    for d in plan.deletions:
        is_manifest = [fmt.parse_manifest_name(k) is not None for k in d.keys]
        assert is_manifest == sorted(is_manifest, reverse=True), d.keys
        if d.kind in ("checkpoint", "generation"):
            assert is_manifest[0], d


def test_gc_leaves_no_empty_directories(tmp_path):
    """Deleting a whole checkpoint (or all debris of a step) removes its directory too,
    so a long run's root does not fill with empty step directories."""
    root = str(tmp_path / "store")
    debris_store(root)
    assert cli("gc", root, "--keep-last", "1", "--grace", "0").exit_code == 0
    assert sorted(os.listdir(root)) == [fmt.step_dir_name(3)]


def test_gc_removes_the_empty_directories_of_a_save_killed_before_its_first_file(tmp_path):
    """A SIGKILL after the writer made attempts/<id>/ but before its first file: no file,
    so no attempt, so gc never deleted it and ls listed an uncommitted 0 B step forever.
    Once idle for the grace they go; a young one, a user's empty directory and what a
    symlink points at stay."""
    root = tmp_path / "store"
    ckptstore.Store(root).save(1, {"w": torch.ones(2)}).result()
    killed = [root / fmt.step_dir_name(2) / "attempts" / "20261204T164816-de84fe25617f",
              root / fmt.step_dir_name(3) / "attempts", root / fmt.step_dir_name(4),
              root / fmt.step_dir_name(1) / "attempts" / "20261204T164817-0123456789ab"]
    young = root / fmt.step_dir_name(5) / "attempts" / "20261204T164818-0123456789ab"
    users = root / fmt.step_dir_name(6) / "attempts" / "notes"
    nested = [root / "users_data" / fmt.step_dir_name(8), root / "users_data" / "attempts"]  # not where saves write
    outside = tmp_path / "outside" / "attempts" / "20261204T164819-0123456789ab"
    for d in (*killed, young, users, outside, *nested):
        d.mkdir(parents=True)
    (root / fmt.step_dir_name(7)).symlink_to(tmp_path / "outside", target_is_directory=True)
    old = time.time() - 2 * 3600
    for d in [*killed, users, outside, outside.parent, outside.parent.parent, *nested]:
        for p in (d, *[q for q in d.parents if root in q.parents]):
            os.utime(p, (old, old), follow_symlinks=False)
    assert fmt.step_dir_name(2) in {loc.name for loc in scan_store(LocalStorage(str(root)))}  # "uncommitted 0 B"

    dry = cli("gc", str(root), "--grace", "1h", "--dry-run")
    assert dry.exit_code == 0 and f"would delete empty dir  {fmt.step_dir_name(2)}/attempts/" in dry.output
    assert killed[0].exists()
    out = cli("gc", str(root), "--grace", "1h", "--json")
    assert out.exit_code == 0, out.output
    removed = set(json.loads(out.output)["empty_dirs"])
    assert {fmt.step_dir_name(2), fmt.step_dir_name(3), fmt.step_dir_name(4),
            f"{fmt.step_dir_name(1)}/attempts/20261204T164817-0123456789ab"} <= removed
    assert sorted(os.listdir(root)) == [fmt.step_dir_name(1), fmt.step_dir_name(5), fmt.step_dir_name(6),
                                        fmt.step_dir_name(7), "users_data"]
    assert young.exists() and users.exists() and outside.exists()  # young, not ours, outside the store
    assert all(d.exists() for d in nested)
    # grace 0 (a Store's own retention): a directory a save made minutes ago stays
    fresh = root / fmt.step_dir_name(9) / "attempts" / "20261204T164820-0123456789ab"
    fresh.mkdir(parents=True)
    for age, listed in ((300, []), (1200, [str(fresh.relative_to(root)), str(fresh.parent.relative_to(root)),
                                           fmt.step_dir_name(9)])):
        for p in (fresh, fresh.parent, fresh.parent.parent):
            os.utime(p, (time.time() - age,) * 2)
        assert gc_mod.empty_dirs(LocalStorage(str(root)), 0, dry_run=True) == listed
    assert ckptstore.Store(root).steps() == [1]
    torch.testing.assert_close(ckptstore.Store(root).load(1)["w"], torch.ones(2))


# ---------------------------------------------------------------------------- Store retention, pins
def test_store_keep_applies_retention_after_each_commit(tmp_path):
    root = str(tmp_path / "store")
    store = ckptstore.Store(root, keep=Retention(last=2))
    for s in range(5):
        store.save(s, state(s)).result()  # retention ran before the future resolved
        assert store.steps() == list(range(max(0, s - 1), s + 1))
    # Many saves in flight: each retention pass leaves the younger in-flight attempts alone.
    futures = [store.save(s, state(s)) for s in range(5, 12)]
    ckptstore.wait()
    assert all(f.result().step == s for f, s in zip(futures, range(5, 12)))
    assert assert_visible_whole(root) == [10, 11]
    stray = [f for f in files_below(root) if not f.startswith(("step-000000000010/", "step-000000000011/"))]
    assert stray == []


def test_store_keep_best_and_every(tmp_path):
    root = str(tmp_path / "store")
    store = ckptstore.Store(root, keep=Retention(every=20, best=(KeepBest("loss", "min", 1),)))
    for s, loss in LOSS.items():
        store.save(s, state(s), metrics={"loss": loss}).result()
    assert assert_visible_whole(root) == [0, 10, 20, 40, 50]


def test_store_pin_protects_from_retention_and_gc(tmp_path):
    root = str(tmp_path / "store")
    store = ckptstore.Store(root, keep=Retention(last=1))
    store.save(0, state(0)).result()
    store.save(1, state(1)).result()
    store.pin(1, note="paper")
    for s in range(2, 5):
        store.save(s, state(s)).result()
    assert store.steps() == [1, 4] and store.pinned() == [1]
    pin = json.loads(open(os.path.join(root, fmt.step_dir_name(1), "pin.json")).read())
    assert (pin["step"], pin["note"]) == (1, "paper")
    assert [r["pinned"] for r in json.loads(cli("ls", "--json", root).stdout)] == [True, False]
    assert cli("gc", root, "--keep-last", "1").exit_code == 0
    assert store.steps() == [1, 4]
    assert store.gc().kept["step-000000000001"] == ["pinned"]
    store.unpin(1)
    assert store.pinned() == []
    plan = store.gc(dry_run=True)
    assert [d.location for d in plan.deletions] == ["step-000000000001"] and store.steps() == [1, 4]
    store.gc()
    assert assert_visible_whole(root) == [4]


def test_store_pin_refuses_what_is_not_committed(tmp_path):
    root = str(tmp_path / "store")
    store = build_store(root, steps=(0,))
    with pytest.raises(FileNotFoundError):
        store.pin(5)
    failed_attempt(store.location(6), state(6), rank=1, step=6)
    with pytest.raises(NotCommittedError):
        store.pin(6)
    assert store.pinned() == []


def test_store_gc_explicit_policy_and_dry_run(tmp_path):
    root = str(tmp_path / "store")
    store = build_store(root)
    before = tree(root)
    plan = store.gc(keep=Retention(last=3), dry_run=True)
    assert tree(root) == before
    assert sorted(d.location for d in plan.deletions) == [fmt.step_dir_name(s) for s in (0, 10, 20)]
    assert sorted(plan.kept) == [fmt.step_dir_name(s) for s in (30, 40, 50)]
    store.gc(keep=Retention(last=3))
    assert store.steps() == [30, 40, 50]
    assert store.gc().deletions == []  # no policy on the store: keep everything


# ---------------------------------------------------------------------------- library holes (I4, I7)
def test_I4_I7_gc_never_deletes_the_data_of_a_manifest_it_cannot_read(tmp_path):
    """A checkpoint whose manifest this version cannot read (a newer format version, say)
    is not debris: gc must leave its files alone, however old."""
    root = str(tmp_path / "store")
    build_store(root, steps=(0, 10, 20))
    loc = os.path.join(root, fmt.step_dir_name(10))
    path = os.path.join(loc, fmt.manifest_name(1))
    doc = json.loads(open(path, "rb").read())
    doc["format_version"] = max(fmt.READ_VERSIONS) + 1
    with open(path, "w") as f:
        json.dump(doc, f)
    age_files(root, 30 * 86400)
    before = files_below(loc)
    r = cli("gc", root, "--keep-last", "1", "--json")
    # (a manifest this version cannot read is not an error for gc: it keeps that step and goes on)
    assert r.exit_code == 0, r.output
    assert files_below(loc) == before, "gc deleted files a manifest names"


def rank0_waiting_for_rank1(where: str, attempt: str, step: int):
    """Rank 0 of a 2-rank save of ``state(1)``, returned once its data and vote are
    written and it waits in the commit for rank 1 (the "rank1" child role)."""
    voted = threading.Event()

    class Observed(LocalStorage):
        def put(self, key, data, *, if_absent=False):
            super().put(key, data, if_absent=if_absent)
            if key.endswith("/vote-r00000.json"):
                voted.set()

    fut = start_save(state(1), Observed(where), rt=runtime(), attempt=attempt, step=step, rank=0, world_size=2,
                     metrics=None, options=SaveOptions(commit_timeout=HANG_GUARD_S))
    assert voted.wait(HANG_GUARD_S)
    return fut


def test_I7_commit_never_publishes_files_gc_removed_while_it_waited(tmp_path, zygote):
    """Rank 0 of a 2-rank save has written its data and vote and waits for rank 1. An
    operator's gc with a grace period shorter than that wait removes rank 0's files as
    debris. When rank 1 then votes, the commit must fail, not publish a checkpoint whose
    files are gone (a visible, broken, newest checkpoint)."""
    root = str(tmp_path / "store")
    build_store(root, steps=(0,))
    where = os.path.join(root, fmt.step_dir_name(1))
    attempt = fmt.new_attempt_id()
    fut = rank0_waiting_for_rank1(where, attempt, step=1)
    age_files(where, 2 * HOUR)  # rank 1 is two hours late (within a long commit timeout)
    assert cli("gc", root, "--grace", "1h").exit_code == 0
    child = zygote.run(THIS, "rank1", where, attempt)
    code = child.finish()
    assert code == 0, zygote.stderr_tail()
    error = fut.exception(timeout=HANG_GUARD_S)
    if error is None:
        problems = ckptstore.verify(where)
        assert problems == [], f"committed a checkpoint whose files gc removed: {[str(p) for p in problems]}"


@pytest.mark.parametrize("when", ["attempt", "checkpoint"])
def test_I7_a_checkpoint_committed_between_plan_and_execution_is_never_deleted(tmp_path, zygote, when):
    """gc plans with --grace 0 while a 2-rank save is between its votes; the save then
    commits; gc executes its plan. The committed checkpoint must survive whole: gc
    checks each deletion again against what the location holds now."""
    root = str(tmp_path / "store")
    build_store(root, steps=(0,) if when == "attempt" else (1, 5))
    step = 1  # the step the "rank1" child saves
    where = os.path.join(root, fmt.step_dir_name(step))
    attempt = fmt.new_attempt_id()
    fut = rank0_waiting_for_rank1(where, attempt, step=step)
    policy = Retention(last=1)
    planned = gc_mod.plan(LocalStorage(root), policy, grace=0)
    doomed = {(d.kind, d.location) for d in planned.deletions}
    if when == "attempt":
        assert ("attempt", fmt.step_dir_name(1)) in doomed  # the in-flight attempt looks like debris
    else:
        assert ("checkpoint", fmt.step_dir_name(1)) in doomed  # an old step, about to be saved again
    child = zygote.run(THIS, "rank1", where, attempt)
    assert child.finish() == 0, zygote.stderr_tail()
    manifest = fut.result(timeout=HANG_GUARD_S)
    gc_mod.execute(LocalStorage(root), planned)
    skipped = [d for d in planned.deletions if d.skipped is not None]
    assert {d.location for d in skipped} == {fmt.step_dir_name(step)}, planned.to_json()
    assert when in {d.kind for d in skipped} and all("since the plan" in d.skipped for d in skipped)
    assert ckptstore.verify(where) == []
    assert ckptstore.Store(root).manifest(step).attempt == manifest.attempt == attempt
    assert ckptstore.Store(root).load(step)["step"] == 1


# ---------------------------------------------------------------------------- processes
@pytest.fixture(scope="module")
def zygote():
    z = Zygote()
    yield z
    z.close()


class Tail:
    """Lines of a child's stream, read on a thread; waits are on the pipe, bounded by the
    hang guard."""

    def __init__(self, stream):
        self.lines: list[str] = []
        self.eof = False
        self._cv = threading.Condition()
        threading.Thread(target=self._run, args=(stream,), daemon=True).start()

    def _run(self, stream):
        for line in stream:
            with self._cv:
                self.lines.append(line.rstrip("\n"))
                self._cv.notify_all()
        with self._cv:
            self.eof = True
            self._cv.notify_all()

    def wait_for(self, n: int, what: str = "") -> None:
        """Until at least ``n`` lines arrived."""
        with self._cv:
            ok = self._cv.wait_for(lambda: len(self.lines) >= n or self.eof, HANG_GUARD_S)
            assert ok and len(self.lines) >= n, f"{what}: {len(self.lines)} lines, wanted {n}: {self.lines[-5:]}"


def _spawn(role: str, *args, stdin=subprocess.DEVNULL):
    p = subprocess.Popen([sys.executable, THIS, role, *map(str, args)], stdin=stdin, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=child_env())
    return p, Tail(p.stdout), Tail(p.stderr)


STRESS_ROUNDS = 20


@pytest.mark.slow
def test_I7_gc_loop_beside_a_writer_and_a_reader(tmp_path):
    """A writer saves steps 0..N-1, a reader loads the latest over and over, and
    ``ckptstore gc --keep-last 2 --grace 60`` runs in a loop, all at once. Lock-step only
    in that at least two gc passes and two loads complete between consecutive saves."""
    root = str(tmp_path / "store")
    os.makedirs(root)
    stop = str(tmp_path / "stop")
    gc_p, gc_out, gc_err = _spawn("gc-loop", root, stop)
    rd_p, rd_out, rd_err = _spawn("reader", root, stop)
    wr_p, wr_out, wr_err = _spawn("writer", root, stdin=subprocess.PIPE)
    try:
        for tail, name in ((gc_out, "gc"), (rd_out, "reader"), (wr_out, "writer")):
            tail.wait_for(1, name)
            assert tail.lines[0] == "ready", (name, tail.lines)
        for step in range(STRESS_ROUNDS):
            n_gc, n_rd = len(gc_out.lines), len(rd_out.lines)
            gc_out.wait_for(n_gc + 2, "gc passes")
            rd_out.wait_for(n_rd + 2, "reader loads")
            wr_p.stdin.write(f"{step}\n")
            wr_p.stdin.flush()
            wr_out.wait_for(1 + 2 * (step + 1), f"writer step {step}")
    finally:
        with open(stop, "w"):
            pass
        if wr_p.stdin:
            wr_p.stdin.close()
        codes = [p.wait(HANG_GUARD_S) for p in (wr_p, rd_p, gc_p)]
    errs = "\n".join(t.lines[-1] if t.lines else "" for t in (wr_err, rd_err, gc_err))
    assert codes == [0, 0, 0], errs
    assert wr_out.lines[1:] == [f"{w} {s}" for s in range(STRESS_ROUNDS) for w in ("staged", "committed")]
    failures = [line for line in rd_out.lines if line.startswith("fail")]
    assert failures == [], failures
    loaded = [int(line.split()[1]) for line in rd_out.lines if line.startswith("loaded")]
    assert loaded == sorted(loaded) and set(loaded) <= set(range(STRESS_ROUNDS)), loaded
    assert len(loaded) >= 2 * (STRESS_ROUNDS - 1)
    passes = [line for line in gc_out.lines[1:]]
    assert all(p.startswith("pass ") for p in passes), [p for p in passes if not p.startswith("pass ")]
    assert len(passes) >= 2 * STRESS_ROUNDS
    assert sum(int(p.split()[3]) for p in passes) > 0, "gc never deleted anything: no overlap exercised"
    # Nothing retained was lost: the last two steps are there, whole; one more pass tidies.
    steps = ckptstore.Store(root).steps()
    assert steps[-2:] == [STRESS_ROUNDS - 2, STRESS_ROUNDS - 1]
    for s in steps:
        assert single_value(ckptstore.Store(root).load(s)) == s
    assert cli("gc", root, "--keep-last", "2", "--grace", "60").exit_code == 0
    storage = LocalStorage(root)  # and once more when the released files' grace is over
    gc_mod.execute(storage, gc_mod.plan(storage, Retention(last=2), 60, now=time.time() + 120))
    assert ckptstore.Store(root).steps() == [STRESS_ROUNDS - 2, STRESS_ROUNDS - 1]
    assert cli("verify", root).exit_code == 0
    listing = json.loads(cli("ls", "--all", "--json", root).stdout)
    assert [(r["step"], [a["committed"] for a in r["attempts"]]) for r in listing] == [
        (STRESS_ROUNDS - 2, [True]), (STRESS_ROUNDS - 1, [True])]


KILL_TRIALS = 12
KILL_STEPS = tuple(range(10))


@pytest.fixture(scope="module")
def kill_template(tmp_path_factory):
    """Steps 0..9 (step 4 and step 9 each with a superseded generation) and old debris
    in step 10, everything 2 h old; then a young attempt in step 11."""
    root = str(tmp_path_factory.mktemp("gc-kill") / "template")
    store = build_store(root, steps=KILL_STEPS)
    for s in (4, 9):
        add_superseded_generation(os.path.join(root, fmt.step_dir_name(s)),
                                  lambda s=s: store.save(s, state(s)).result())
    failed_attempt(store.location(10), state(10), rank=0, step=10)
    failed_attempt(store.location(10), state(10), rank=1, step=10)
    age_files(root, 2 * HOUR)
    young = failed_attempt(store.location(11), state(11), rank=1, step=11)
    return root, young


@pytest.fixture(scope="module")
def released_template(kill_template, tmp_path_factory):
    """The kill template after one gc run: the manifests of steps 0..7 and of the
    superseded generations gone, their files released (a release mark in each attempt)."""
    template, young = kill_template
    root = str(tmp_path_factory.mktemp("gc-kill-released") / "template")
    shutil.copytree(template, root)
    p = gc_mod.collect(LocalStorage(root), Retention(last=2), HOUR)
    assert p.released_bytes > 0 and {d.kind for d in p.deletions} == {"checkpoint", "generation", "attempt"}
    assert sum(os.path.basename(f) == names.RELEASED_LEAF for f in files_below(root)) == 10  # 0..7, 4 and 9 twice
    return root, young


@pytest.mark.slow
def test_I7_gc_sigkilled_at_random_moments_then_rerun(tmp_path, zygote, kill_template, released_template):
    """A gc SIGKILLed at random moments, in both of its phases: the run that deletes
    manifests and releases their files, and a run after the grace that deletes the
    released files. Every retained checkpoint stays whole; running gc again finishes."""
    young = kill_template[1]
    young_dir = os.path.join(fmt.step_dir_name(11), "attempts", young)
    policy, grace, later = Retention(last=2), HOUR, 2 * HOUR + 60
    totals = {phase: sum(len(d.keys) for d in gc_mod.plan(LocalStorage(t[0]), policy, grace,
                                                          now=time.time() + offset).deletions)
              for phase, t, offset in (("release", kill_template, 0), ("sweep", released_template, later))}
    assert totals["release"] > 10 and totals["sweep"] > 20, totals  # manifests; data files and marks
    rng = random.Random(SEED)
    interrupted = {"release": 0, "sweep": 0}  # trials killed with some but not all deletions done
    for trial in range(KILL_TRIALS):
        phase = ("release", "sweep")[trial % 2]
        template, offset = (kill_template[0], 0) if phase == "release" else (released_template[0], later)
        root = str(tmp_path / f"trial-{trial}")
        shutil.copytree(template, root)
        young_files = {k: v for k, v in files_below(root).items() if k.startswith(young_dir)}
        mode = rng.choice(["self", "parent"])
        total = totals[phase]
        k = rng.randint(0, total)
        label = f"seed {SEED} trial {trial} ({phase}): {mode} kill after {k}/{total} deletions"
        child = zygote.run(THIS, "gc-kill", root, mode, k, offset)
        if mode == "parent":
            seen = 0
            while seen < k:
                line = child.next()
                assert line is not None, f"{label}: gc child ended\n{zygote.stderr_tail()}"
                seen += line.startswith("deleted")
            child.kill(signal.SIGKILL)
        code = child.finish()
        deleted = sum(line.startswith("deleted") for line in child.lines)
        if mode == "self":
            assert code == -signal.SIGKILL and deleted == k, f"{label}: exit {code}, {deleted} deletions"
        else:
            assert code in (-signal.SIGKILL, 0) and deleted >= k, f"{label}: exit {code}\n{zygote.stderr_tail()}"
        print(f"{label}: {deleted} deleted before the kill")
        interrupted[phase] += code == -signal.SIGKILL and 0 < deleted < total
        steps = assert_visible_whole(root)
        assert {8, 9} <= set(steps), f"{label}: retained checkpoint lost: {steps}"
        assert set(steps) <= set(KILL_STEPS)
        if phase == "release":
            assert {k: v for k, v in files_below(root).items() if k.startswith(young_dir)} == young_files, label
        # Running gc again finishes the job: now, and once more after the grace.
        gc_mod.collect(LocalStorage(root), policy, grace)
        assert assert_visible_whole(root) == [8, 9], label
        storage = LocalStorage(root)
        gc_mod.execute(storage, gc_mod.plan(storage, policy, grace, now=time.time() + later))
        assert assert_visible_whole(root) == [8, 9], label
        assert gc_mod.plan(storage, policy, grace, now=time.time() + later).deletions == [], label
        left = files_below(root)
        expected = set()
        for s in (8, 9):
            m = ckptstore.Store(root).manifest(s)
            expected |= {f"{fmt.step_dir_name(s)}/{fmt.manifest_name(m.generation)}"}
            expected |= {f for f in left if f.startswith(f"{fmt.step_dir_name(s)}/attempts/{m.attempt}/")}
        assert set(left) == expected, f"{label}: left behind {sorted(set(left) - expected)}"
        shutil.rmtree(root)
    # Not vacuous: in each phase some kill landed mid-run (after a deletion, before the last).
    assert all(interrupted.values()), f"seed {SEED}: no gc run was killed mid-way in a phase: {interrupted}"


# ---------------------------------------------------------------------------- child roles
def _writer(root: str) -> None:
    store = ckptstore.Store(root, chunk_bytes=128 << 10)
    print("ready", flush=True)
    for line in sys.stdin:
        step = int(line)
        fut = store.save(step, uniform_state(step, 1 << 20))
        print(f"staged {step}", flush=True)
        fut.result()
        print(f"committed {step}", flush=True)


def _reader(root: str, stop: str) -> None:
    store = ckptstore.Store(root)
    print("ready", flush=True)
    while not os.path.exists(stop):
        if store.latest() is None:
            print("empty", flush=True)
            continue
        try:
            obj = store.load()
            print(f"loaded {int(single_value(obj))}", flush=True)
        except Exception as e:  # reported to the parent, which fails the test
            print(f"fail {type(e).__name__}: {e}", flush=True)


def _gc_loop(root: str, stop: str) -> None:
    print("ready", flush=True)
    n = 0
    while not os.path.exists(stop):
        buf = io.StringIO()
        code = 0
        with contextlib.redirect_stdout(buf):
            try:
                main(["gc", root, "--keep-last", "2", "--grace", "60", "--json"], standalone_mode=False)
            except SystemExit as e:
                code = e.code
        if code:
            print(f"error {code}: {buf.getvalue()!r}", flush=True)
            continue
        print(f"pass {n} deleted {len(json.loads(buf.getvalue())['deleted'])}", flush=True)
        n += 1


def _gc_kill(root: str, mode: str, k: str, offset: str) -> None:
    """gc with a deletion counter, its clock ``offset`` seconds ahead; in mode 'self' it
    SIGKILLs itself right after the k-th deleted object (k=0: before the first)."""
    k = int(k)
    count = [0]

    def maybe_die():
        if mode == "self" and count[0] == k:
            os.kill(os.getpid(), signal.SIGKILL)

    class Counting(LocalStorage):  # its child views are Countings too
        def delete(self, key):
            super().delete(key)
            count[0] += 1
            print(f"deleted {count[0]} {key}", flush=True)
            maybe_die()

    storage = Counting(root)
    plan = gc_mod.plan(storage, Retention(last=2), HOUR, now=time.time() + float(offset))
    print(f"plan {sum(len(d.keys) for d in plan.deletions)}", flush=True)
    maybe_die()
    gc_mod.execute(storage, plan)
    print("finished", flush=True)


def _rank1(where: str, attempt: str) -> None:
    fut = start_save(state(1), LocalStorage(where), rt=runtime(), attempt=attempt, step=1, rank=1, world_size=2,
                     metrics=None, options=SaveOptions(commit_timeout=HANG_GUARD_S))
    fut.exception()
    print("voted", flush=True)


if __name__ == "__main__":
    import warnings

    warnings.simplefilter("ignore", RuntimeWarning)
    roles = {"writer": _writer, "reader": _reader, "gc-loop": _gc_loop, "gc-kill": _gc_kill, "rank1": _rank1}
    roles[sys.argv[1]](*sys.argv[2:])
