"""``Store``: the checkpoints of a training run, one per step, under one root.

It owns a store's saves (the attempt agreement, incremental references, retention after
a commit, the fence of its run), its listing (steps, manifests, pins) and its loads (the
step resolved, each copy tried in tier order, one retry rule: checkpoint/load.py). What
it has of tiers is a :class:`~ckptstore.tiers.Tiers` (everything about more than one
tier lives in tiers.py) and, when it is itself a tier above another store, the
:class:`~ckptstore.tiers.UpperTier` role that gives it its fence and the steps it keeps.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import threading
from typing import Any

from . import format as fmt
from . import lifecycle
from . import names
from .checkpoint.fencing import check_fence
from .checkpoint.group import agree_on_attempt, rank_and_world
from .checkpoint.references import index as index_references
from .checkpoint import nearby
from .checkpoint.indexes import expand
from .checkpoint.load import Reading, load_once, with_reloads
from .checkpoint.manifests import generations, latest_manifest
from .checkpoint.save import SaveFuture, SaveOptions, save_options, start_save
from .checkpoint.votes import write_failure_vote
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
from .resume import resume as collective_resume
from .runtime import runtime
from .staging.cuda import check_stream
from .storage import Storage, open_storage
from .tiers import (MEMORY_DURABLE_EVERY, Tiers, UpperTier, check_every, load_first, memory_budget_of,
                    memory_place)


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

    ``memory`` (docs/tiers.md, "The memory tier"): ``"auto"`` is the node's memory
    directory that ``ckptstore run --in-job`` exports (``CKPTSTORE_MEMORY_DIR``: a tmpfs
    directory the node's supervisor owns, which outlives the rank processes), and no
    memory tier elsewhere, so one program runs unchanged under torchrun; a path is a
    memory tier there. Every save commits to memory, every ``durable_every``-th (default
    :data:`~ckptstore.tiers.MEMORY_DURABLE_EVERY` with a memory tier, 1 with a local
    one; ``"auto"``: by the rate of failures that lose the memory tier, below) is
    promoted to the durable tier; with ``local=`` too (three tiers: memory,
    local disk, durable; docs/tiers.md "Three tiers") every ``local_every``-th (default
    ``durable_every``, 10 when that is ``"auto"``) is also promoted to the local tier, each
    promotion reading the memory copy. ``memory_keep`` its retention (default the last step,
    besides the one in flight and those waiting for promotion); ``memory_budget`` the bytes
    it may hold on the node (default ``CKPTSTORE_MEMORY_BUDGET``; None: no limit): a save
    that would pass it goes to the next tier below (local, else durable) instead, with one
    RuntimeWarning. On
    several nodes under ``ckptstore run --in-job`` each memory commit is also copied, in
    the background, to the partner node's memory (``CKPTSTORE_PEER_REPLICA``; docs/tiers.md,
    "Peer replicas"), from which a spare there restores a lost node's ranks
    (``LoadInfo.tier == "peer"``).

    ``durable_every="auto"`` (a memory or local tier): a save is promoted when
    ``sqrt(2 x P x M_cold)`` seconds have passed since the last promotion began (P: the
    last promotion's duration; M_cold: the MTBF of the failures that lose the memory
    tier, ``ckptstore status``'s ``mtbf_cold_s``, a day before any), never while one is
    still in flight, at least every 6 hours, and the first save of a process at once
    (:mod:`ckptstore.durable_cadence`; docs/tiers.md). Every rank promotes the same
    steps: the ranks combine their views at each save (one small collective, or the
    Checkpointer's own).
    """

    def __init__(self, url, *, process_group=None, compression: str | CompressionPolicy = "auto",
                 commit_timeout: float = 600.0, chunk_bytes: int | None = None,
                 keep: Retention | None = None, grace: float | str = gc.DEFAULT_GRACE,
                 storage_options: dict | None = None, local=None, durable_every: int | str | None = None,
                 local_keep: Retention | None = None, promote_bandwidth: float | None = None,
                 local_shared=None, incremental: bool = True, memory=None,
                 memory_keep: Retention | None = None, memory_budget: int | None = None,
                 local_every: int | None = None):
        url = os.fspath(url) if not isinstance(url, str) else url
        if durable_every is not None and not (isinstance(durable_every, str) and durable_every == "auto"):
            check_every("durable_every", durable_every, 'or "auto"')  # (under any launcher alike)
        if local_every is not None:
            check_every("local_every", local_every)
            if local is None:
                raise ValueError(f"local_every={local_every!r} says how often a memory save is promoted to the "
                                 "local tier: it needs local= (and memory=)")
        memory, memory_shared = memory_place(memory, local, local_shared)
        tiered = memory is not None or local is not None
        self._open(url, open_storage(url, **(storage_options or {})), process_group,
                   save_options(compression, commit_timeout, chunk_bytes, 2), keep, parse_duration(grace),
                   incremental=bool(incremental) and not tiered)  # (a tiered store promotes whole files)
        if tiered:
            if durable_every is None:
                durable_every = MEMORY_DURABLE_EVERY if memory is not None else 1
            # (local_every without a memory tier, memory="auto" under torchrun: every save commits
            # to the local tier anyway; the program runs unchanged)
            self._tiers = Tiers(self, memory=memory, local=local, durable_every=durable_every,
                                local_every=local_every if memory is not None else None,
                                memory_keep=memory_keep, local_keep=local_keep,
                                promote_bandwidth=promote_bandwidth, commit_timeout=float(commit_timeout),
                                memory_shared=memory_shared, local_shared=local_shared if local is not None else None,
                                storage_options=storage_options,
                                budget=memory_budget_of(memory_budget) if memory is not None else None)
        elif local_shared is not None:
            raise ValueError("local_shared names where a local tier's commit records go: it needs local= "
                             "(or memory=)")

    def _open(self, url: str, storage: Storage, process_group, options: SaveOptions, keep: Retention | None,
              grace: float, incremental: bool, role: UpperTier | None = None) -> None:
        self.url, self.storage, self.process_group, self.options = url, storage, process_group, options
        self.keep, self.grace, self.incremental = keep, grace, incremental
        # This run's epoch (fencing): claimed by resume(); its saves record it, and their
        # commit is refused once a newer run has claimed the store.
        self.epoch: int | None = None
        self._role = role  # this store as a tier above another (tiers.UpperTier); None: the durable one
        self._tiers: Tiers | None = None  # the tiers above this one (tiers.py); None: one tier
        self._references: dict = {}  # what the next save may reference (references.index)
        self._reference_base: tuple[int, int] | None = None  # (step, generation) of the manifest they came from
        self._bases_in_flight: list[int] = []  # the reference steps of saves not settled yet
        self._base_lock = threading.Lock()

    def upper_tier(self, url: str, storage: Storage, role: UpperTier, keep: Retention) -> "Store":
        """A store over ``storage`` (``url``: how messages name it) serving as a tier above
        this one in ``role`` (its fence, the steps it keeps: tiers.UpperTier): this
        store's process group, save options and grace, retention ``keep``, no incremental
        saves (a promotion copies whole checkpoints: no references). Tiers builds each
        of its upper tiers with it."""
        tier = Store.__new__(Store)
        tier._open(url, storage, self.process_group, self.options, keep, self.grace, incremental=False, role=role)
        return tier

    @property
    def local(self) -> "Store | None":
        """The local tier, a store of its own (None: none)."""
        return self._tiers.tier("local") if self._tiers is not None else None

    @property
    def memory(self) -> "Store | None":
        """The memory tier, a store of its own (None: none)."""
        return self._tiers.tier("memory") if self._tiers is not None else None

    @property
    def memory_full(self) -> bool:
        """Whether this process's last save skipped the memory tier, over its budget."""
        return self._tiers is not None and self._tiers.full

    @property
    def durable_every(self) -> int | str | None:
        """Every how many saves one is promoted to the durable tier, or ``"auto"`` (None: one tier)."""
        return self._tiers.durable_every if self._tiers is not None else None

    @property
    def local_every(self) -> int | None:
        """Every how many saves to a memory tier one is promoted to the local tier below
        it (None: not three tiers)."""
        if self._tiers is None or self.memory is None or self.local is None:
            return None
        return self._tiers.local_every

    @property
    def durable_cadence(self):
        """With ``durable_every="auto"``: this process's :class:`~ckptstore.durable_cadence.Cadence`
        of the durable store (else None)."""
        return self._tiers.cadence if self._tiers is not None else None

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    def location(self, step: int) -> Storage:
        return self.storage.child(names.step_dir_name(step))

    def save(self, step: int, state: Any, metrics: dict | None = None, *,
             replicated: list[str] | tuple[str, ...] = (), durable: bool = False, stream=None,
             durable_due: bool | None = None) -> SaveFuture:
        """Save ``state`` as ``step``; returns once it is staged.

        Under torch.distributed every rank calls this with the same step. DTensors are
        saved by shard (each written once); ``replicated`` lists fnmatch patterns of state
        paths (e.g. ``["model.*"]`` for a DDP model) that are identical on every rank and
        so written once in total, spread over the ranks. Everything else is rank-local.

        With two tiers the future is the local save's; ``durable=True`` (the same on
        every rank: a preemption's last save, say) promotes this step whatever
        ``durable_every`` says, and ``ckptstore.wait()`` waits for promotions too.
        ``durable_due`` (``durable_every="auto"`` only): whether the cadence promotes this
        save, decided by a caller that already combined every rank's
        ``durable_cadence.flags()`` (the Checkpointer, in its per-step all-reduce); it
        must be the same on every rank. None: the store combines them (a collective).

        ``stream``: what the copies of CUDA tensors wait for, as in
        :func:`ckptstore.save` (a ``torch.cuda.Stream`` or ``{device index: stream}``;
        default each device's current stream): pass the stream(s) that last wrote the
        state when it is not the current one (side streams, a save from a helper thread).
        """
        stream = check_stream(stream, "Store.save")
        if self._tiers is not None:
            return self._tiers.save(step, state, metrics, replicated, durable, stream, durable_due)
        return self.save_here(step, state, metrics, replicated=replicated, stream=stream)

    def promote_newest(self) -> SaveFuture | None:
        """With a memory tier: promote the newest save to each tier below it that no
        promotion to it covers (the local tier, then the durable one: the memory tier does
        not outlive the job); the last promotion's future (the durable one's), or None.
        Every rank calls it alike. Other stores: None."""
        if self._tiers is None or self.memory is None:
            return None
        return self._tiers.promote_newest()

    def save_here(self, step: int, state: Any, metrics: dict | None = None, *,
                  replicated: list[str] | tuple[str, ...] = (), stream=None) -> SaveFuture:
        """``save`` to this store's own storage, whatever tiers it has above it (Tiers
        calls it for a save that skips a full memory tier)."""
        lifecycle.raise_earlier_failure()
        where = self.location(step)
        attempt, step0 = agree_on_attempt(step, self.process_group)
        rank, world = rank_and_world(self.process_group)
        if step0 != step:
            error = CommitError(f"{where.describe()}: rank {rank} saves step {step} while rank 0 saves step {step0}")
            # Tell rank 0 where it waits for votes, so it fails now, not at its timeout.
            write_failure_vote(self.location(step0), attempt, step0, world, rank, error)
            raise error
        if self._role is not None:  # an upper tier's: the durable tier's epochs, or the in-job round's
            fence = self._role.commit_fence(self.url, self.epoch)
        else:
            fence = None if self.epoch is None else self._fence
        with self._base_lock:  # (one step with the retention's look at the bases: apply_retention)
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
            after_commit = lambda manifest: (settled(), self.apply_retention(step, manifest))  # noqa: E731
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

    def apply_retention(self, committed: int | None = None, manifest: fmt.Manifest | None = None) -> None:
        """Retention after the commit of step ``committed`` (its ``manifest``), or after
        a promotion (tiers.Promoter calls it). The store's own writer deletes a dropped
        checkpoint's files at once: the only saves that could reference them are its
        own, whose bases it protects. A save starting meanwhile either registered its
        base before the protected steps are taken, or takes the new checkpoint as its
        base (one lock for both)."""
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
            except CommitError:
                return  # (a memory tier's round fence cannot be read: the job is ending)
        gc.collect(self.storage, self.keep, self.grace, protect=protect, immediate=True)

    def _fence(self) -> bool:
        """FencedError when a newer run claimed the store; False when that cannot be
        checked now and the commit goes on (an upper tier's, while the durable tier
        where its runs are claimed cannot be read: UpperTier.fence)."""
        if self._role is not None:
            return self._role.fence(self.url, self.epoch)
        check_fence(self.storage, self.epoch)
        return True

    def _kept_here(self, committed: int | None = None) -> dict[int, str]:
        """Steps this process needs whatever the policy says: an upper tier's steps that
        the tiers below it still need (promotions in flight: UpperTier.kept), the step
        the next incremental save references (``committed``, the step just committed, is
        about to be it; after a rollback it need not be among the newest), and the steps
        that saves still in flight reference."""
        kept = self._role.kept() if self._role is not None else {}
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
        if self._tiers is not None:
            return self._tiers.steps()
        return self.committed_steps()

    def tiers_of(self, step: int) -> list[tuple[str | None, "Store"]]:
        """The tiers holding ``step`` committed, in the order a load tries them:
        ``("memory", store)``, ``("local", store)``, ``("durable", store)``; one tier:
        ``(None, self)``."""
        if self._tiers is None:
            return [(None, self)] if generations(self.location(step)) else []
        return self._tiers.holders(step)

    def _copies(self, step: int) -> list[tuple[str | None, "Store"]]:
        """Where a load of ``step`` looks, in order: with one tier, this store (no
        listing: the load lists the location itself); with more, the upper tiers that
        hold it, then the durable tier unlisted (Tiers.load_order)."""
        return self._tiers.load_order(step) if self._tiers is not None else [(None, self)]

    def committed_steps(self) -> list[int]:
        """The steps committed in this store's own storage, ascending (with two tiers:
        the durable tier's; ``steps()`` adds the local tier's)."""
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
        chosen: list[int | None] = [None]

        def once(reading: Reading):
            chosen[0] = None
            chosen[0] = self._resolve(step)
            holders = self._copies(chosen[0])
            if not holders:
                raise CheckpointNotFoundError(f"{self.location(chosen[0]).describe()}: no committed checkpoint")
            obj, info = load_first(holders, chosen[0], reading, functools.partial(
                load_once, map_location=map_location, weights_only=weights_only, rank=rank, pickle_load_args=None,
                template=template, group=self.process_group, step=chosen[0], reading=reading))
            if self._tiers is not None:  # ("peer": the memory tier's copy came from a replica)
                info = dataclasses.replace(info, tier=self._tiers.tier_of_copy(info.tier, chosen[0], info))
            return obj, info

        def chosen_gone() -> bool:
            # The latest step, retired by retention while we read it: the latest is another now.
            return step is None and chosen[0] is not None and chosen[0] not in self.steps()

        try:
            obj, info = with_reloads(once, chosen_gone)
        except (CheckpointNotFoundError, NotCommittedError) as e:
            if step is not None and step not in self.steps():  # name the steps there are
                raise type(e)(f"{e}; {self._nearest(step)}") from e
            raise
        return (obj, info) if return_info else obj

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

        With ``durable_every="auto"`` it also reads M_cold from the store's journal, once
        per process and only outside an in-job round after the first (durable_cadence.py).
        """
        if self.durable_cadence is not None:
            self.durable_cadence.read_mtbf_cold(self.storage)
        return collective_resume(self, template, map_location=map_location,
                                 weights_only=resolve_weights_only(weights_only, None)[0],
                                 validate=validate, mark_skipped=mark_skipped, claim=claim)


def _check_metrics(metrics: dict | None) -> dict:
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
