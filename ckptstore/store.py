"""``Store``: the checkpoints of a training run, one per step, under one root."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import socket
import threading
import warnings
from typing import Any

from . import format as fmt
from . import lifecycle
from . import names
from .checkpoint.commit import generations, write_failure_vote
from .checkpoint.fencing import check_fence
from .checkpoint.group import agree_on_attempt, gather, rank_and_world
from .checkpoint.references import index as index_references
from .checkpoint import nearby
from .checkpoint.indexes import expand
from .checkpoint.load import RELOADS, load_checkpoint
from .checkpoint.restore import latest_manifest
from .checkpoint.save import SaveFuture, save_options, start_save
from .checkpoint.weights_only import resolve_weights_only
from .codecs import CompressionPolicy
from .checkpoint import gc
from .names import PIN_NAME
from .checkpoint.retention import Retention, parse_duration
from .errors import (
    CheckpointNotFoundError,
    CkptStoreError,
    CommitError,
    FencedError,
    NotCommittedError,
)
from .runtime import runtime
from .staging.cuda import check_stream
from .storage import Storage, open_storage
from .tiers import TierFallbackWarning, _COPY_FAULTS, _NOT_COPY_FAULTS


def _if_present(location: Storage, generation: int, references: dict) -> dict:
    """``references`` while the manifest they came from is still there, else none: a
    gc run elsewhere dropped it, and with it the right to its files (gc.py)."""
    return references if location.exists(names.manifest_name(generation)) else {}



class Store:
    """Checkpoints of a training run, one per step, under one root (path or URL).

    ``save`` is collective when torch.distributed is initialised: every rank of
    ``process_group`` calls it with the same step, each saving its own state.

    With ``local`` (a node-local path: NVMe, ``/dev/shm``) the store has two tiers
    (docs/tiers.md): every save commits to ``local`` first, and every
    ``durable_every``-th save is then promoted to ``url`` in the background, its files
    copied with every blob's hash checked, at most ``promote_bandwidth`` bytes/s (None:
    unlimited). ``local_keep`` is the local tier's retention (default: the last 2 steps;
    a step waiting for its promotion is always kept), ``keep`` the durable tier's.
    Loads and resumes take the newest step any tier holds, the local copy first.

    ``incremental=True`` (one tier only): a chunk unchanged since the store's last
    committed save (or the step a resume loaded) is recorded as a reference to the blob
    that holds it instead of being written again (docs/incremental.md). A job
    on several nodes also names ``local_shared``, a location every rank shares (a path
    or URL of its own, not inside ``url``), where the local tier's commit records go
    while its data files stay on each node.
    """

    def __init__(self, url, *, process_group=None, compression: str | CompressionPolicy = "auto",
                 commit_timeout: float = 600.0, chunk_bytes: int | None = None,
                 keep: Retention | None = None, grace: float | str = gc.DEFAULT_GRACE,
                 storage_options: dict | None = None, local=None, durable_every: int = 1,
                 local_keep: Retention | None = None, promote_bandwidth: float | None = None,
                 local_shared=None, incremental: bool = True):
        self.url = os.fspath(url) if not isinstance(url, str) else url
        self.storage = open_storage(self.url, **(storage_options or {}))
        self.process_group = process_group
        self.options = save_options(compression, commit_timeout, chunk_bytes, 2)
        self.keep = keep
        self.grace = parse_duration(grace)
        # This run's epoch (fencing): claimed by resume(); its saves record it, and their
        # commit is refused once a newer run has claimed the store.
        self.epoch: int | None = None
        self._epochs = self.storage  # where epochs are claimed: with two tiers, the durable one
        self._protect = frozenset  # steps retention must keep whatever the policy says
        self.local: Store | None = None
        self._promoter = None
        self._saves = 0
        self._committed_here: set[str] = set()  # local attempts this process saw commit (tiers.sweep_own_data)
        self._sweeping = threading.Lock()
        self._one_node = False  # every rank of the group runs on one host (checked at the first save)
        self.incremental = bool(incremental) and local is None  # (a tiered store promotes whole files)
        self._references: dict = {}  # what the next save may reference (references.index)
        self._reference_base: tuple[int, int] | None = None  # (step, generation) of the manifest they came from
        self._bases_in_flight: list[int] = []  # the reference steps of saves not settled yet
        self._base_lock = threading.Lock()
        if local is not None:
            self._add_local_tier(local, durable_every, local_keep, promote_bandwidth, compression,
                                 commit_timeout, chunk_bytes, local_shared, storage_options)
        elif local_shared is not None:
            raise ValueError("local_shared names where a local tier's commit records go: it needs local=")

    def _add_local_tier(self, local, durable_every, local_keep, promote_bandwidth, compression, commit_timeout,
                        chunk_bytes, local_shared, storage_options) -> None:
        from .storage.split import SplitStorage
        from .tiers import Promoter, check_places

        if isinstance(durable_every, bool) or not isinstance(durable_every, int) or durable_every < 1:
            raise ValueError(f"durable_every must be an int >= 1, got {durable_every!r}")
        tier = Store(local, process_group=self.process_group, compression=compression,
                     commit_timeout=commit_timeout, chunk_bytes=chunk_bytes,
                     keep=local_keep if local_keep is not None else Retention(last=2), grace=self.grace,
                     incremental=False)  # a promotion copies whole checkpoints: no references
        places = {"the local tier": tier.storage, "the durable store": self.storage}
        if local_shared is not None:
            s3 = os.fspath(local_shared).startswith("s3://")  # storage_options are S3's
            places["local_shared"] = open_storage(local_shared, **((storage_options or {}) if s3 else {}))
        check_places(places)  # no two overlap; each local place bound to this durable store
        if local_shared is not None:
            tier.storage = SplitStorage(places["local_shared"], tier.storage)
        self.local, self.durable_every = tier, durable_every
        tier._epochs = self.storage
        self._promoter = Promoter(tier, self, promote_bandwidth, float(commit_timeout))
        tier._protect = self._promoter.pending_steps

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    def location(self, step: int) -> Storage:
        return self.storage.child(names.step_dir_name(step))

    def save(self, step: int, state: Any, metrics: dict | None = None, *,
             replicated: list[str] | tuple[str, ...] = (), durable: bool = False, stream=None) -> SaveFuture:
        """Save ``state`` as ``step``; returns once it is staged.

        Under torch.distributed every rank calls this with the same step. DTensors are
        saved by shard (each written once); ``replicated`` lists fnmatch patterns of state
        paths (e.g. ``["model.*"]`` for a DDP model) that are identical on every rank and
        so written once in total, spread over the ranks. Everything else is rank-local.

        With two tiers the future is the local save's; ``durable=True`` (the same on
        every rank: a preemption's last save, say) promotes this step whatever
        ``durable_every`` says, and ``ckptstore.wait()`` waits for promotions too.

        ``stream``: what the copies of CUDA tensors wait for, as in
        :func:`ckptstore.save` (a ``torch.cuda.Stream`` or ``{device index: stream}``;
        default each device's current stream): pass the stream(s) that last wrote the
        state when it is not the current one (side streams, a save from a helper thread).
        """
        stream = check_stream(stream, "Store.save")
        if self.local is not None:
            return self._save_tiered(step, state, metrics, replicated, durable, stream)
        lifecycle.raise_earlier_failure()
        where = self.location(step)
        attempt, step0 = agree_on_attempt(step, self.process_group)
        rank, world = rank_and_world(self.process_group)
        if step0 != step:
            error = CommitError(f"{where.describe()}: rank {rank} saves step {step} while rank 0 saves step {step0}")
            # Tell rank 0 where it waits for votes, so it fails now, not at its timeout.
            write_failure_vote(self.location(step0), attempt, step0, world, rank, error)
            raise error
        fence = None if self.epoch is None else self._fence
        with self._base_lock:  # (one step with the retention's look at the bases: _apply_retention)
            refs, base = None, self._reference_base if self.incremental and self._references else None
            if self.incremental:
                refs = {k: b for k, b in self._references.items() if b.step != step}
            if base is not None:
                self._bases_in_flight.append(base[0])  # retention keeps it until this save settles
        settled = functools.partial(self._base_settled, [base[0]] if base is not None else [])
        if base is not None:  # read by the writer's first chunk: no base any more, no references
            refs = functools.partial(_if_present, self.location(base[0]), base[1], refs)
        after_commit = None
        if self.keep is not None and rank == 0:  # (once committed, the manifest itself keeps what it reads)
            after_commit = lambda manifest: (settled(), self._apply_retention(step, manifest))  # noqa: E731
        options = dataclasses.replace(self.options, replicated=tuple(replicated), epoch=self.epoch, fence=fence,
                                      references=refs, reference_base=base, stream=stream)
        try:
            future = start_save(state, where, rt=runtime(), attempt=attempt, step=step, rank=rank,
                                world_size=world, metrics=_check_metrics(metrics), options=options,
                                after_commit=after_commit)
        except BaseException:
            settled()
            raise
        if self.incremental:
            future.add_done_callback(lambda f: (settled(), self._note_commit(f)))
        return lifecycle.track(future)

    def _base_settled(self, pending: list[int]) -> None:
        """A save no longer needs its base kept (``pending``: [its base step], emptied
        here, so that a second call does nothing)."""
        if pending:
            self._bases_in_flight.remove(pending.pop())

    def _note_commit(self, future: SaveFuture) -> None:
        """After a commit, the next save may reference what it holds; after a failure
        (a referenced file gone, say) the next one references nothing and writes all."""
        if future._future.exception() is None:
            self.note_committed(future._future.result())
        else:
            self._references = {}

    def note_committed(self, manifest: fmt.Manifest) -> None:
        """Incremental saves: the next one may reference ``manifest``'s chunks (a
        committed checkpoint of this store: the last save's, or the step a resume loaded)."""
        if self.incremental and manifest.step is None:  # a drop-in save over a step's directory:
            self._references, self._reference_base = {}, None  # its references are no step's to take
        elif self.incremental:
            self._references = index_references(manifest, rank_and_world(self.process_group)[0])
            self._reference_base = (manifest.step, manifest.generation)

    def _save_tiered(self, step, state, metrics, replicated, durable: bool, stream) -> SaveFuture:
        rank, world = rank_and_world(self.process_group)
        split = not getattr(self.local.storage, "sees_all_data", True)
        if not split and world > 1 and not self._one_node:
            # Votes and the manifest of the local tier travel through its directory, which
            # only the ranks of one node share (docs/tiers.md, "Across nodes"). Asked once,
            # of every rank alike (a collective in the blocking part, as the save's own).
            hosts = sorted(set(gather(socket.gethostname(), self.process_group)))
            if len(hosts) > 1:
                raise ValueError(f"{self.url}: a local tier on several nodes ({', '.join(hosts[:4])}"
                                 f"{', ...' if len(hosts) > 4 else ''}) needs local_shared=, a location every "
                                 "rank shares; see docs/tiers.md")
            self._one_node = True
        self.local.epoch = self.epoch
        if self._saves == 0:  # this process's first: count on from the saves since the newest durable step
            self._saves = self._local_saves_since_durable()
        self._saves += 1  # first: a save that raises on one rank only must not skew the ranks' counts
        future = self.local.save(step, state, metrics, replicated=replicated, stream=stream)
        if split:
            future.add_done_callback(lambda f, r=rank: self._after_local_commit(f, r))
        if durable or self._saves % self.durable_every == 0:
            fence = None if self.epoch is None else functools.partial(check_fence, self.storage, self.epoch)
            self._promoter.schedule(future, rank, world, fence, first=durable)
        return future

    def _local_saves_since_durable(self) -> int:
        """Local steps newer than the durable tier's newest, at most ``durable_every`` - 1:
        where the count of saves stood when an earlier process of the run stopped. Counted
        per process from 0, a job restarted more often than every ``durable_every`` saves
        promoted nothing, and losing the node lost every step. (Every rank reads the same
        listings before its first save: the counts agree.)"""
        try:
            durable = self._committed_steps()
            newest = durable[-1] if durable else -1
            since = sum(1 for s in self.local.steps() if s > newest)
        except CkptStoreError:
            return 0  # (the durable tier unreadable: count from here)
        return min(since, self.durable_every - 1)

    def _after_local_commit(self, future: SaveFuture, rank: int) -> None:
        """A local save on several nodes committed: sweep this rank's files that no
        checkpoint of the local tier needs any more, on its own node
        (tiers.sweep_own_data), off the commit thread; one sweep at a time."""
        if future._future.exception() is not None:
            return  # only after a commit: a failed save's files are gc's rule (grace) to judge
        self._committed_here.add(future.attempt)
        if self._sweeping.acquire(blocking=False):
            threading.Thread(target=self._sweep, args=(rank,), name="ckptstore-sweep", daemon=True).start()

    def _sweep(self, rank: int) -> None:
        from .tiers import sweep_own_data

        try:
            for key in sweep_own_data(self.local, rank, set(self._committed_here),
                                      self._promoter.pending_attempts()):
                self._committed_here.discard(names.parse_data_file(key.split("/", 1)[1])[0])
        except Exception as e:  # only disk space: the next save sweeps again
            warnings.warn(f"{self.local.url}: sweeping this node's old data files failed: {e}", RuntimeWarning,
                          stacklevel=1)
        finally:
            self._sweeping.release()

    def _apply_retention(self, committed: int | None = None, manifest: fmt.Manifest | None = None) -> None:
        """Retention after the commit of step ``committed`` (its ``manifest``), or after
        a promotion. The store's own writer deletes a dropped checkpoint's files at once:
        the only saves that could reference them are its own, whose bases it protects.
        A save starting meanwhile either registered its base before the protected steps
        are taken, or takes the new checkpoint as its base (one lock for both)."""
        with self._base_lock:
            if manifest is not None:
                self.note_committed(manifest)
            protect = self._kept_here(committed)
        if self.epoch is not None:
            try:
                if not self._fence():
                    return  # (a local tier's: its run cannot be checked now; retention can wait)
            except FencedError:
                return  # a newer run owns the store now, and its retention with it
        gc.collect(self.storage, self.keep, self.grace, protect=protect, immediate=True)

    def _fence(self) -> bool:
        """FencedError when a newer run claimed the store. A local tier's runs are claimed
        on the durable tier: when that cannot be read (an S3 outage) the local commit goes
        on, with a warning (False), since the local tier is what keeps training
        checkpointed through the outage; its promotion checks again on the durable tier."""
        try:
            check_fence(self._epochs, self.epoch)
        except FencedError:
            raise
        except CkptStoreError as e:
            if self._epochs is self.storage:
                raise
            warnings.warn(f"{self.url}: the durable tier, where runs are claimed, cannot be read ({e}); this local "
                          "tier's commit goes on without that check", RuntimeWarning, stacklevel=2)
            return False
        return True

    def _kept_here(self, committed: int | None = None) -> dict[int, str]:
        """Steps this process needs whatever the policy says: a local tier's promotions
        in flight, the step the next incremental save references (``committed``, the
        step just committed, is about to be it; after a rollback it need not be among
        the newest), and the steps that saves still in flight reference."""
        kept = {step: "promotion in flight" for step in self._protect()}
        base = committed if committed is not None else (self._reference_base[0] if self._references else None)
        if self.incremental and base is not None:
            kept.setdefault(base, "the next incremental save's reference")
        for step in list(self._bases_in_flight):
            kept.setdefault(step, "referenced by a save in flight")
        return kept

    def gc(self, keep: Retention | None = None, grace: float | str | None = None, dry_run: bool = False) -> gc.GcPlan:
        """Delete what ``keep`` (default: the store's policy) does not keep, and debris."""
        policy = keep if keep is not None else (self.keep or Retention())
        return gc.collect(self.storage, policy, self.grace if grace is None else parse_duration(grace), dry_run,
                          protect=self._kept_here())

    def pin(self, step: int, note: str = "") -> None:
        """Protect a committed checkpoint from retention and gc."""
        loc = self.location(step)
        latest_manifest(loc)  # must exist and be committed
        loc.put(PIN_NAME, json.dumps({"step": step, "note": note, "at": fmt.utc_now()}).encode())

    def unpin(self, step: int) -> None:
        self.location(step).delete(PIN_NAME)

    def pinned(self) -> list[int]:
        return [s for s in self.steps() if PIN_NAME in self.location(s).list("")]  # as gc and ls see pins

    def steps(self) -> list[int]:
        """Committed steps, ascending (with two tiers: those either tier holds)."""
        if self.local is not None:
            return sorted(set(self._committed_steps()) | set(self.local.steps()))
        return self._committed_steps()

    def tiers_of(self, step: int) -> list[tuple[str | None, "Store"]]:
        """The tiers holding ``step`` committed, in the order a load tries them:
        ``("local", store)`` before ``("durable", store)``; one tier: ``(None, self)``."""
        if self.local is None:
            return [(None, self)] if generations(self.location(step)) else []
        tiers = [("local", self.local), ("durable", self)]
        return [(name, s) for name, s in tiers if generations(s.location(step))]

    def _copies(self, step: int) -> list[tuple[str | None, "Store"]]:
        """Where a load of ``step`` looks, in order: with one tier, this store (no
        listing: the load lists the location itself); with two, ``tiers_of``."""
        return self.tiers_of(step) if self.local is not None else [(None, self)]

    def _committed_steps(self) -> list[int]:
        found = []
        for name in self.storage.list(""):
            step = names.parse_step_dir_name(name.rstrip("/"))
            if step is not None and name.endswith("/") and generations(self.location(step)):
                found.append(step)
        return sorted(found)

    def latest(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def manifest(self, step: int | None = None, *, records: bool = True) -> fmt.Manifest:
        """The committed manifest of ``step`` (default: the latest). A version 4
        checkpoint's records lie in its ranks' indexes: all are read into it unless
        ``records=False`` (then only the root: step, metrics, totals, global shapes)."""
        step = self._resolve(step)
        holders = self._copies(step)
        location = (holders[0][1] if holders else self).location(step)
        try:
            root = latest_manifest(location)
        except (CheckpointNotFoundError, NotCommittedError) as e:
            raise type(e)(f"{e}; {self._nearest(step)}") from e
        return expand(location, root) if records else root

    def _resolve(self, step: int | None) -> int:
        if step is None:
            step = self.latest()
            if step is None:
                raise CheckpointNotFoundError(f"{self.storage.describe()}: the store holds no committed checkpoint"
                                              f"{self._none_here()}")
        return step

    def _nearest(self, step: int) -> str:
        """Which committed steps lie nearest a missing ``step`` (for its error)."""
        try:
            steps = self.steps()
        except CkptStoreError:  # the hint must not hide the error it explains
            return f"step {step} is not committed"
        if not steps:
            return f"step {step} is not committed: the store holds no committed step{self._none_here()}"
        below, above = [s for s in steps if s < step], [s for s in steps if s > step]
        near = ([f"{below[-1]} (below)"] if below else []) + ([f"{above[0]} (above)"] if above else [])
        return (f"step {step} is not committed; nearest committed step{'s' * (len(near) > 1)}: "
                f"{' and '.join(near)}; {len(steps)} in all (Store.steps() lists them)")

    def _none_here(self) -> str:
        """Why a store holds no step, when its URL names something else: one checkpoint
        (a drop-in save's path) or a directory with stores or checkpoints below it."""
        where = self.storage.describe()
        try:
            if generations(self.storage):
                return f"; {where} is one checkpoint, not a store: ckptstore.load({where!r}) reads it"
            found = nearby.search(self.storage)
        except CkptStoreError:
            return ""
        return f"; {nearby.below_message(where, found)}" if found.below() else ""

    def load(self, step: int | None = None, map_location=None, weights_only: bool = True, *,
             rank: int | None = None, template=None, return_info: bool = False) -> Any:
        """The state saved at ``step`` (None: the latest committed step).

        With ``template`` (a state dict of DTensors or plain tensors, on any world size),
        its tensors are filled in place from the checkpoint, each rank reading only the
        chunks overlapping its shards, and the template is returned. Without it, a
        checkpoint's global (sharded) tensors come back whole. ``return_info=True``
        returns ``(state, LoadInfo)``.
        """
        weights_only = resolve_weights_only(weights_only, None)[0]  # (TORCH_FORCE_WEIGHTS_ONLY_LOAD)
        for tries in range(RELOADS):
            chosen = self._resolve(step)
            try:
                obj, info = self._load_nearest(chosen, map_location, weights_only, rank, template)
                return (obj, info) if return_info else obj
            except CkptStoreError as e:
                if step is not None and isinstance(e, (CheckpointNotFoundError, NotCommittedError)) \
                        and step not in self.steps():  # name the steps there are
                    raise type(e)(f"{e}; {self._nearest(step)}") from e
                # The same rule one level up: retention removed the latest step while we
                # read it (its manifest is gone), so the latest is another step now.
                if step is not None or tries == RELOADS - 1 or chosen in self.steps():
                    raise


    def _load_nearest(self, step: int, map_location, weights_only: bool, rank, template):
        """(object, LoadInfo) of ``step`` from the first tier whose copy loads; a copy
        with bad bytes or files falls back to the next tier, with a warning."""
        holders = self._copies(step)
        if not holders:
            raise CheckpointNotFoundError(f"{self.location(step).describe()}: no committed checkpoint")
        for i, (tier, store) in enumerate(holders):
            try:
                obj, info = load_checkpoint(store.location(step), map_location, weights_only, rank, None,
                                          template, self.process_group, step=step)
            except _NOT_COPY_FAULTS:
                raise
            except _COPY_FAULTS as e:
                if i == len(holders) - 1:
                    raise
                warnings.warn(f"{store.location(step).describe()}: the {tier} copy of step {step} cannot be "
                              f"loaded ({type(e).__name__}: {e}); loading the {holders[i + 1][0]} copy",
                              TierFallbackWarning, stacklevel=4)
                continue
            return obj, dataclasses.replace(info, tier=tier)

    def resume(self, template=None, *, map_location=None, weights_only: bool = True,
               validate=None, mark_skipped: bool = True, claim: bool = False):
        """``(state, ResumeInfo)`` from the newest step every rank can use (collective).

        Under torch.distributed every rank of ``process_group`` calls this. Each
        committed step, newest first, is loaded on every rank (every byte's hash
        checked; ``template`` as in :meth:`load`), then passed to ``validate(state,
        manifest)`` when given, which rejects it by returning anything false (judged by
        truth value; None accepts) or raising :class:`~ckptstore.CheckpointRejected`. A step that any rank cannot load or
        that any rank rejects is skipped on all ranks (a warning, a note that ``ckptstore
        ls`` shows, and an entry in ``ResumeInfo.skipped``), and the next older one is
        tried. An empty store gives ``(None, info)`` with ``info.step`` None; a store
        whose every step was skipped raises :class:`~ckptstore.NoLoadableCheckpointError`.
        Failures that are not a step's fault (a template that does not fit, an unsafe
        type, a storage outage) are raised on every rank, never skipped over.
        RNG states (:func:`ckptstore.rng_state`) in a rank-local state read by another
        rank (the world grew) are re-derived for the reading rank.

        A training job that resumes starts a new incarnation of the run: with
        ``claim=True`` (what :class:`~ckptstore.Checkpointer` passes) it claims the next
        epoch of the store (``ResumeInfo.epoch``), and from then on the saves of an
        older incarnation (orphaned workers of a dead launcher) are refused with
        :class:`~ckptstore.FencedError`. The default does not claim: a job that only
        reads (an evaluation) must not fence off the training job writing the store.
        """
        from .resume import resume

        return resume(self, template, map_location=map_location,
                      weights_only=resolve_weights_only(weights_only, None)[0],
                      validate=validate, mark_skipped=mark_skipped, claim=claim)



def _check_metrics(metrics: dict | None) -> dict:
    import math

    metrics = dict(metrics or {})
    for k, v in metrics.items():
        if not isinstance(k, str):
            raise TypeError(f"metric names must be str, got {k!r}")
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"metric {k!r} is {v}: JSON cannot hold it")
    try:
        json.dumps(metrics, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"metrics must be JSON values: {e}") from e
    return metrics
