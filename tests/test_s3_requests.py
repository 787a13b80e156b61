"""Requests per checkpoint on S3, counted on the wire (issue 19, item 5): what one save
of N ranks costs, and that the ranks waiting for the commit poll one small object
instead of listing the location (docs/s3.md, "Request counts").

N ranks are simulated in one process against the moto server: ranks 1.. write their
data file and vote as their own process would (tests/test_indexes.py's ``other_rank``),
rank 0 saves through ``start_save`` and commits, then each other rank waits for the
outcome as its save would. Every HTTP request the store's client sends is counted by a
botocore hook, by method, operation and kind of object."""

from __future__ import annotations

import collections
import threading
from urllib.parse import parse_qs, unquote, urlsplit

import pytest

from ckptstore import names
from ckptstore.checkpoint.follower import FULL_LOOK_EVERY, await_outcome
from ckptstore.checkpoint.heartbeat import committer_cadence, follower_cadence
from ckptstore.checkpoint.save import SaveOptions, start_save
from ckptstore.codecs import CompressionPolicy
from ckptstore.runtime import runtime
from s3util import bucket, endpoint, s3_storage  # noqa: F401 - fixtures
from test_indexes import other_rank, rank_state

TIMEOUT = 120
STEP = 7


class Requests:
    """Counts the requests a client sends: (method, what) -> n, where ``what`` is the
    kind of object (vote, outcome, manifest, data, ...) or the listing."""

    def __init__(self, client):
        self.counts: collections.Counter = collections.Counter()
        self.lock = threading.Lock()
        self.on_request = None  # called with (method, what) after counting
        client.meta.events.register("before-send.s3", self._count, unique_id=f"count-{id(self)}")

    def _count(self, request, **_kwargs):
        parts = urlsplit(request.url)
        query = parse_qs(parts.query, keep_blank_values=True)
        leaf = unquote(parts.path).rsplit("/", 1)[-1]
        if "list-type" in query:
            what = "list"
        elif "delete" in query:
            what = "batch-delete"
        elif names.parse_manifest_name(leaf) is not None:
            what = "manifest"
        else:
            what = names.attempt_leaf_kind(leaf) or leaf
        if what in ("heartbeat", "abort"):
            return  # a save's heartbeat thread (a save that lasts past save_beat_every()), not counted here
        key = (request.method, what)
        with self.lock:
            self.counts[key] += 1
        if self.on_request is not None:
            self.on_request(*key)

    def take(self) -> collections.Counter:
        with self.lock:
            out, self.counts = self.counts, collections.Counter()
        return out


def simulate(store, world: int, counter: Requests) -> dict[str, collections.Counter]:
    """One version 4 checkpoint of ``world`` simulated ranks: the requests of the other
    ranks' writes, of rank 0's save and commit, and of the others' waits."""
    where = store.child(names.step_dir_name(STEP))
    attempt = names.new_attempt_id()
    for r in range(1, world):
        other_rank(where, attempt, r, world, rank_state(r))
    writes = counter.take()
    future = start_save(rank_state(0), where, rt=runtime(), attempt=attempt, step=STEP, rank=0, world_size=world,
                        metrics=None, options=SaveOptions(commit_timeout=TIMEOUT,
                                                          compression=CompressionPolicy("none")))
    manifest = future.result(timeout=TIMEOUT)
    commit = counter.take()
    for r in range(1, world):
        assert await_outcome(where, attempt, TIMEOUT, r, world).generation == manifest.generation
    waits = counter.take()
    return {"writes": writes, "commit": commit, "waits": waits}


@pytest.mark.parametrize("world", [2, 16, 64])
def test_requests_per_checkpoint_grow_by_a_constant_per_rank(bucket, world):  # noqa: F811
    store = s3_storage(bucket)
    counter = Requests(store.client)
    got = simulate(store, world, counter)
    others = world - 1
    print(f"\nN={world}: " + "; ".join(f"{phase}: {dict(sorted(c.items()))}" for phase, c in got.items()))

    # Each other rank: its data file (one PutObject: small) and its vote
    # (the HEAD: open_append refuses to replace an object that exists, I2)
    assert got["writes"] == {("HEAD", "data"): others, ("PUT", "data"): others, ("PUT", "vote"): others}

    # Rank 0 writes as they did, then commits: it reads each vote once and lists three
    # times: the attempt (every vote was there at once), the generations, and the attempt
    # once more after its commit mark (claims.py: gc's claim, and the files' sizes: no
    # HEAD per file), deleted once the manifest landed. Generation 1 has nothing older to
    # retire, so no listing after the manifest.
    assert got["commit"] == {("HEAD", "data"): 1, ("PUT", "data"): 1, ("PUT", "vote"): 1,
                             ("GET", "vote"): others, ("GET", "list"): 3, ("PUT", "committing"): 1,
                             ("PUT", "manifest"): 1, ("PUT", "outcome"): 1, ("DELETE", "committing"): 1}

    # A waiting rank whose commit is done: its outcome and its root, nothing else.
    assert got["waits"] == {("GET", "outcome"): others, ("GET", "manifest"): others}
    assert sum(sum(c.values()) for c in got.values()) == 6 * world + 4  # docs/s3.md's table


def test_a_second_generation_retires_the_first_from_the_listing_that_shows_it_visible(bucket):  # noqa: F811
    """A save over a committed checkpoint (the same location again) lists the generations
    once after its manifest, which shows it visible and names the one to retire; the old
    manifest is deleted (a store step's files are gc's to judge: other steps may read
    them), the new one loads."""
    store = s3_storage(bucket)
    counter = Requests(store.client)
    simulate(store, 2, counter)
    got = simulate(store, 2, counter)
    where = store.child(names.step_dir_name(STEP))
    assert [names.parse_manifest_name(k) for k in where.list("") if names.parse_manifest_name(k)] == [2]
    # The attempt, the generations before the commit, the attempt after the commit mark,
    # and the one that shows it visible and names generation 1: four, where a second
    # listing of the generations made five.
    assert got["commit"][("GET", "list")] == 4
    attempts = {info.key.split("/")[1] for info in where.walk(names.ATTEMPTS_DIR + "/") if info.kind == "file"}
    assert len(attempts) == 2  # the old attempt's files stay for gc
    assert ("GET", "manifest") not in got["commit"]  # its files are not retired: it is not read
    assert got["commit"][("DELETE", "manifest")] == 1


def test_a_waiting_rank_polls_only_the_outcome_until_the_commit(bucket):  # noqa: F811
    """While rank 0 has not committed, a waiting rank's polls are one GET of the outcome
    each (a full look, which lists, comes only every FULL_LOOK_EVERY polls)."""
    world = 3
    store = s3_storage(bucket)
    where = store.child(names.step_dir_name(STEP))
    attempt = names.new_attempt_id()
    for r in range(1, world):
        other_rank(where, attempt, r, world, rank_state(r))
    counter = Requests(store.client)
    polled = threading.Semaphore(0)
    counter.on_request = lambda method, what: polled.release() if what == "outcome" else None
    result = {}
    waiter = threading.Thread(target=lambda: result.setdefault("m", await_outcome(where, attempt, TIMEOUT, 1, world)))
    waiter.start()
    for _ in range(FULL_LOOK_EVERY - 2):
        assert polled.acquire(timeout=TIMEOUT)
    before = dict(counter.counts)
    assert set(before) == {("GET", "outcome")}, before  # no listing, no HEAD, no manifest read
    assert before[("GET", "outcome")] < FULL_LOOK_EVERY
    start_save(rank_state(0), where, rt=runtime(), attempt=attempt, step=STEP, rank=0, world_size=world,
               metrics=None, options=SaveOptions(commit_timeout=TIMEOUT)).result(timeout=TIMEOUT)
    waiter.join(TIMEOUT)
    assert result["m"].attempt == attempt


def test_polling_slows_as_the_world_grows_so_a_prefix_is_not_flooded():
    for world in (2, 64, 256, 1024, 4096, 16384):
        first, longest = follower_cadence(world)
        assert world / longest <= 1000 + 1e-9  # the waiting ranks' steady polls, together, per second
        assert world / first <= 8000 + 1e-9  # and at their first poll
        assert longest <= max(0.25, world / 1000)  # no slower than that needs
        _, committer = committer_cadence(world)
        assert 3 * world / 1000 / committer <= 12 + 1e-9  # listing pages per second
    assert follower_cadence(2) == (0.002, 0.25)  # small jobs wait as fast as before


def test_heartbeats_slow_as_the_world_grows():
    from ckptstore.checkpoint.heartbeat import SAVE_BEAT_EVERY, save_beat_every

    assert save_beat_every(2) == save_beat_every(1500) == SAVE_BEAT_EVERY  # as before for most jobs
    for world in (4096, 16384, 99999):
        assert world / save_beat_every(world) <= 500 + 1e-9  # beats per second across the job


def test_gc_deletes_a_checkpoint_in_two_batches_manifests_first(bucket):  # noqa: F811
    """A 64-rank checkpoint's 190-odd files go in one DeleteObjects after the one that
    takes its manifest (I7), not one DeleteObject each."""
    from ckptstore.checkpoint.gc import collect
    from ckptstore.checkpoint.retention import Retention

    store = s3_storage(bucket)
    counter = Requests(store.client)
    simulate(store, 64, counter)
    newer = store.child(names.step_dir_name(STEP + 1))
    start_save(rank_state(0), newer, rt=runtime(), attempt=names.new_attempt_id(), step=STEP + 1, rank=0,
               world_size=1, metrics=None, options=SaveOptions(commit_timeout=TIMEOUT)).result(timeout=TIMEOUT)
    batches = []
    counter.on_request = lambda method, what: batches.append(what) if method in ("POST", "DELETE") else None
    counter.take()
    result = collect(store, Retention(last=1), grace=0)
    assert [d.location for d in result.deletions if d.skipped is None] == [names.step_dir_name(STEP)]
    assert batches == ["batch-delete", "batch-delete"], batches  # the manifest, then every file
    assert not [k for k in store.walk(names.step_dir_name(STEP) + "/")]


def test_a_drop_in_save_to_a_new_location_lists_it_once_for_references(bucket):  # noqa: F811
    """Before a drop-in save writes, it looks for a checkpoint it replaces (whose
    unchanged blobs it may reference): one listing when there is none, not the three
    that finding out why a load would fail takes."""
    from ckptstore.api import _earlier_references
    from ckptstore.checkpoint.held import Hold

    store = s3_storage(bucket, prefix="fresh-dropin")
    counter = Requests(store.client)
    assert _earlier_references(store, Hold(store, names.new_attempt_id())) == {}
    assert counter.take() == {("GET", "list"): 1}
