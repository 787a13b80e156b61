"""Tiers: every save commits to a fast upper tier (the memory tier, else a local disk
tier); with both, every ``local_every``-th save is promoted to the local tier, and every
``durable_every``-th to the durable store, in the background (checkpoint/promote.py),
one at a time per target tier, in order. Both promotions read the tier the save
committed to (memory): the faster source, and durability never waits for the disk copy.

Everything about a Store of more than one tier lives here: the chain of tiers and
their save (:class:`Tiers`), the role of a Store serving as an upper tier
(:class:`UpperTier`: its fence, the steps it keeps), the load that falls back from one
tier's copy to the next (:func:`load_first`), the promotions to one tier
(:class:`Promoter`), the sweep of a node's own files (:class:`NodeSweep`,
:func:`sweep_own_data`) and the binding of the upper places to their durable store
(:func:`check_places`).

The interface with store.py is explicit and public on both sides. A Store builds
``Tiers(durable, memory=, local=, ...)`` (after :func:`memory_place`,
:func:`memory_budget_of`, :func:`check_every`), calls its ``save``,
``promote_newest``, ``steps``, ``holders``, ``load_order``, ``tier_of_copy`` and
``tier(name)``, reads its ``durable_every``, ``local_every`` and ``full``, calls
:func:`load_first`, and asks its ``UpperTier`` role (when it is a tier)
``commit_fence``, ``fence`` and ``kept``. Of a Store this module uses ``url``,
``storage``, ``keep``, ``grace``, ``epoch``, ``process_group``, ``location``, ``save``,
``save_here``, ``steps``, ``committed_steps``, ``apply_retention`` and ``upper_tier``
(which builds a Store serving as a tier), and nothing private. The memory tier
(docs/tiers.md, "The memory tier") is an upper tier in a tmpfs directory with a budget
and the in-job round as its fence (:class:`RoundFence`); docs/tiers.md "Three tiers"
describes the chain memory -> local -> durable.

A promotion is a :class:`~ckptstore.SaveFuture` of the target's location, tracked like
a save: ``ckptstore.wait()`` waits for it and raises its error, the exit drain waits
for it (bounded) and beats its heartbeat, so gc in the durable store never takes a
promotion in flight for debris. A failed promotion does not fail the next save (the
upper tier still works): it warns, the next ``wait()`` raises it, and the next due one
tries again.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import itertools
import json
import os
import secrets
import socket
import threading
import time
import warnings
import weakref
from collections import deque
from typing import Callable

from . import format as fmt
from . import durable_cadence, lifecycle, names, peers
from .checkpoint.fencing import check_fence, check_round_fence
from .checkpoint.flatten import _is_dtensor
from .checkpoint.walk import tensors_in
from .checkpoint.gc import attempts_named
from .checkpoint.group import gather, rank_and_world
from .checkpoint.manifests import generations, read_capped, read_manifest
from .checkpoint.promote import Throttle, promote
from .checkpoint.retention import Retention
from .checkpoint.save import SaveFuture, refuse
from .errors import (
    AlreadyExistsError,
    CheckpointNotFoundError,
    CkptStoreError,
    CommitError,
    FencedError,
    FormatError,
    IntegrityError,
    NotCommittedError,
    ObjectNotFoundError,
    StorageError,
    TemplateMismatchError,
    TransientStorageError,
    UnsupportedVersionError,
)
from .storage import LocalStorage, Storage, open_storage
from .storage.split import SplitStorage
from .storage.urls import parse_location
from .supervisor import injob  # (the in-job protocol's names; it imports nothing of the package)

# A memory tier may take a save every step: promoting each to the durable store would
# put the durable tier's cost back on every step. Every 10th is promoted by default;
# memory is lost with the node, so a cold restart loses at most this many saves.
MEMORY_DURABLE_EVERY = 10


class PromotionWarning(RuntimeWarning):
    """A promotion (to the durable tier, or to the local tier below a memory tier) failed
    or falls behind; the tier the save committed to holds the step."""


class TierFallbackWarning(UserWarning):
    """A step's copy in one tier (memory, local) could not be loaded; the next tier's was."""


class MemoryFullWarning(RuntimeWarning):
    """A save would pass the memory tier's budget: it went to the next tier below (local,
    else durable) instead."""


def memory_place(memory, local, local_shared) -> tuple[str | None, object]:
    """Where a Store's memory tier lies, and where its commit records go: ``memory="auto"``
    is ``$CKPTSTORE_MEMORY_DIR`` when ``ckptstore run --in-job`` set it, else none (the
    same program under torchrun); a path is itself; None is none (then ``(None, None)``).
    The records: ``local_shared`` when there is no local tier (with one, ``local_shared``
    is the local tier's), else, for ``"auto"`` on several nodes, the in-job store
    (:func:`in_job_records`), else None (the memory directory itself)."""
    if memory is None:
        return None, None
    shared = local_shared if local is None else None
    if isinstance(memory, str) and memory == "auto":
        memory = os.environ.get(injob.ENV_MEMORY_DIR) or None
        if memory is None:
            return None, None
        world, local_world = os.environ.get("WORLD_SIZE"), os.environ.get("LOCAL_WORLD_SIZE")
        # (several nodes: a spare that took a lost node's rank holds WORLD_SIZE ranks on
        # one node of several; GROUP_WORLD_SIZE, the node count, still says so)
        nodes = os.environ.get("GROUP_WORLD_SIZE", "")
        several = bool(world and local_world and world != local_world) or (nodes.isdigit() and int(nodes) > 1)
        if shared is None and world and local_world and several:
            shared = in_job_records(world, local_world)
    return (os.fspath(memory) if not isinstance(memory, str) else memory), shared


def in_job_records(world: str, local_world: str) -> Storage:
    """Where a memory tier on several nodes keeps its commit records when the program
    named no ``local_shared``: the in-job store (storage/c10d.py), which every rank of
    the attempt reaches. ValueError outside in-job mode."""
    address, prefix = os.environ.get(injob.ENV_STORE), os.environ.get(injob.ENV_PREFIX)
    if not (address and prefix):
        raise ValueError(f"memory=\"auto\" on several nodes (WORLD_SIZE={world}, LOCAL_WORLD_SIZE={local_world}) "
                         f"without the in-job store ({injob.ENV_STORE}) needs local_shared=, a location every "
                         "rank shares, for the memory tier's commit records (each node's tmpfs holds only its "
                         "own ranks' files; with local= too, local_shared= is the local tier's, and the memory "
                         "tier's records need the in-job store: run under ckptstore run --in-job, or leave "
                         "memory= out); see docs/tiers.md")
    from .storage.c10d import C10dStorage

    try:
        client = injob.attempt_store(injob.connect(address, RoundFence.CONNECT_TIMEOUT_S), prefix)
    except Exception as e:
        raise StorageError(f"the in-job store at {address}, where a memory tier on several nodes keeps its commit "
                           f"records, cannot be reached ({type(e).__name__}: {e})") from e
    return C10dStorage(client, "mem/", f"{address}/{prefix}")


def memory_budget_of(budget) -> int | None:
    """The memory tier's byte budget: ``budget``, else ``$CKPTSTORE_MEMORY_BUDGET``, else none."""
    if budget is None:
        text = os.environ.get(injob.ENV_MEMORY_BUDGET, "").strip()
        if not text:
            return None
        try:
            budget = int(text)
        except ValueError:
            raise ValueError(f"{injob.ENV_MEMORY_BUDGET}={text!r} is not a number of bytes") from None
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise ValueError(f"memory_budget must be an int of bytes >= 0, got {budget!r}")
    return budget


def directory_usage(root: str) -> int:
    """The bytes the files under ``root`` hold (allocated blocks: tmpfs's own measure)."""
    total = 0
    for base, _, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(base, name)).st_blocks * 512
            except OSError:
                pass  # (a file retired meanwhile)
    return total


def state_bytes(state) -> int:
    """What a save of ``state`` writes on this rank, about: its tensors' bytes (a
    DTensor's local shard), before compression."""
    total = 0
    for t in tensors_in(state):
        t = t._local_tensor if _is_dtensor(t) else t
        total += t.numel() * t.element_size()
    return total


class RoundFence:
    """The in-job round fence of a memory tier (docs/design/in-job-restart.md 7.3): its
    committer checks that the in-job store's ``fence`` is the round its save began in.
    The client of the in-job store is connected on first use, one per process."""

    CONNECT_TIMEOUT_S = 30.0

    def __init__(self, address: str, prefix: str):
        self.address, self.prefix = address, prefix
        self._store = None
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls) -> "RoundFence | None":
        address, prefix = os.environ.get(injob.ENV_STORE), os.environ.get(injob.ENV_PREFIX)
        return cls(address, prefix) if address and prefix else None

    @staticmethod
    def current_round() -> int:
        try:
            return int(os.environ.get(injob.ENV_ROUND) or 0)
        except ValueError:
            return 0

    def check(self, round_: int) -> None:
        with self._lock:  # (one client serialises its requests anyway)
            try:
                if self._store is None:
                    self._store = injob.attempt_store(injob.connect(self.address, self.CONNECT_TIMEOUT_S),
                                                      self.prefix)
                check_round_fence(self._store, round_)
            except CommitError:
                raise
            except Exception as e:  # (torch's DistStoreError, a refused connection)
                raise CommitError(f"the in-job store at {self.address}, which holds the round fence, cannot be "
                                  f"read ({type(e).__name__}: {e}): the job is ending or its agent is gone; this "
                                  "memory-tier save was not committed") from e


# What makes one tier's copy of a step unusable while another's may be sound: its bytes
# or files. (A template that does not fit, or a newer format, fails every copy alike.)
_COPY_FAULTS = (IntegrityError, FormatError, CheckpointNotFoundError, StorageError, NotCommittedError)
# (a transient storage error is an outage, not the copy's fault: it is raised, to be retried)
_NOT_COPY_FAULTS = (TemplateMismatchError, UnsupportedVersionError, TransientStorageError)


class UpperTier:
    """The role of a Store serving as a tier above the durable one: the Store asks it
    for the fence of its commits and retention, and for the steps its retention must
    keep for the tiers below it. ``name``: the tier's name in ``LoadInfo.tier`` and
    ``Store.tiers_of`` ("memory", "local"). ``rounds``: a memory tier's in-job round
    fence, which its commits check instead of the durable tier's epochs."""

    def __init__(self, name: str, durable: Storage, kept: Callable[[], set[int]],
                 rounds: RoundFence | None = None, also_kept: Callable[[], dict[int, str]] | None = None):
        self.name = name
        self.durable = durable  # where the run's epochs are claimed
        self._kept = kept
        self._also_kept = also_kept  # (a memory tier's peer replicas: peers.kept_steps)
        self.rounds = rounds

    def commit_fence(self, url: str, epoch: int | None):
        """What a save's committer calls before the manifest (None: nothing): under
        in-job recovery the round fence of the round the save begins in (no durable-store
        read on every memory commit), else the durable tier's epochs."""
        if self.rounds is not None:
            return functools.partial(self.rounds.check, self.rounds.current_round())
        return None if epoch is None else functools.partial(self.fence, url, epoch)

    def fence(self, url: str, epoch: int) -> bool:
        """FencedError when a newer run claimed the store. An upper tier's runs are
        claimed on the durable tier: when that cannot be read (an S3 outage) the tier's
        commit goes on, with a warning (False), since the tier is what keeps training
        checkpointed through the outage; its promotion checks again on the durable tier.
        A memory tier under in-job recovery checks its round instead (no durable-store
        request after every memory commit)."""
        if self.rounds is not None:
            self.rounds.check(self.rounds.current_round())
            return True
        try:
            check_fence(self.durable, epoch)
        except FencedError:
            raise
        except CkptStoreError as e:
            warnings.warn(f"{url}: the durable tier, where runs are claimed, cannot be read ({e}); this "
                          f"{self.name} tier's commit goes on without that check", RuntimeWarning, stacklevel=3)
            return False
        return True

    def kept(self) -> dict[int, str]:
        """Steps this tier's retention keeps whatever its policy says, and why."""
        kept = self._also_kept() if self._also_kept is not None else {}
        kept.update({step: "promotion in flight" for step in self._kept()})
        return kept


class Tiers:
    """The tiers of one Store above its own storage (the durable tier), in this
    process: every save commits to the top tier (memory, else local); with a local tier
    below a memory tier every ``local_every``-th save is promoted to it, and every
    ``durable_every``-th (or one asked for ``durable``) to the durable tier, each in the
    background (one :class:`Promoter` per target tier). Both promotions read the tier
    the save committed to: see :meth:`save`. ``chain``: ``(name, Store)`` in the order
    a load tries them ("memory", "local", "durable"), the durable Store last."""

    def __init__(self, durable, *, memory=None, local=None, durable_every: int | str, local_every: int | None = None,
                 memory_keep: Retention | None = None, local_keep: Retention | None = None,
                 promote_bandwidth: float | None, commit_timeout: float, memory_shared=None, local_shared=None,
                 storage_options: dict | None = None, budget: int | None = None):
        if memory is None and local is None:
            raise ValueError("Tiers needs a tier above the durable one: memory= or local=")
        auto = isinstance(durable_every, str) and durable_every == "auto"
        if not auto:
            check_every("durable_every", durable_every, "or \"auto\"")
        # "auto": promote by the failure rate that loses the upper tiers (durable_cadence.py)
        self.cadence = durable_cadence.for_store(durable.url) if auto else None
        if local_every is None:
            local_every = MEMORY_DURABLE_EVERY if auto else durable_every
        check_every("local_every", local_every)
        places = {"the durable store": durable.storage}
        specs = []  # (name, url, the place key of its shared records or None, keep)
        for name, url, shared, keep in (("memory", memory, memory_shared, memory_keep),
                                        ("local", local, local_shared, local_keep)):
            if url is None:
                continue
            url = os.fspath(url) if not isinstance(url, str) else url
            if name == "memory" and parse_location(url)[0] is None:
                os.makedirs(url, mode=0o700, exist_ok=True)  # (the agent made it; an explicit path may not exist)
            places[f"the {name} tier"] = open_storage(url)
            key = None
            if isinstance(shared, Storage):  # (a memory tier's records in the in-job store)
                key = f"the {name} tier's commit records"
                places[key] = shared
            elif shared is not None:
                key = "local_shared"
                s3 = parse_location(shared)[0] == "s3"  # storage_options are S3's (the URL rule: urls.py)
                places[key] = open_storage(shared, **((storage_options or {}) if s3 else {}))
            specs.append((name, url, key, keep))
        if memory is not None and RoundFence.current_round() > 0 and bound_before(places, durable.storage):
            refuse_overlaps(places)  # (round 0 bound them: no durable-store read on a recovery's path)
        else:
            check_places(places, durable.process_group)  # no two overlap; each upper place bound to this durable store
        self.durable, self.durable_every, self.local_every, self.budget = durable, durable_every, local_every, budget
        self.chain: list[tuple[str, object]] = []
        self._roles: dict[str, UpperTier] = {}
        self.sweeps: dict[str, NodeSweep] = {}  # the split tiers' sweeps of this rank's node files
        self.replicator = None
        for name, url, key, keep in specs:
            storage = places[f"the {name} tier"]
            if key is not None:
                storage = SplitStorage(places[key], storage)
            # Peer replicas (peers.py): a memory tier on several nodes (records every node
            # reads), when the agent named the partner node's replica server. Retention
            # keeps the newest replicated step whatever this process does (rank 0 may be
            # a spare without a partner while the other nodes' replicas still count).
            several = name == "memory" and key is not None
            role = UpperTier(name, durable.storage, functools.partial(self._read_by_promotions, name),
                             rounds=RoundFence.from_env() if name == "memory" else None,
                             also_kept=self._peer_kept if several else None)
            default_keep = Retention(last=1) if name == "memory" else Retention(last=2)
            tier = durable.upper_tier(url, storage, role, keep=keep if keep is not None else default_keep)
            self.chain.append((name, tier))
            self._roles[name] = role
            if key is not None:
                self.sweeps[name] = NodeSweep(tier, self._promoting_attempts)
            address = peers.enabled() if several else None
            if address:
                self.replicator = peers.PeerReplicator(tier, url, address)
        self.chain.append(("durable", durable))
        self.name = self.chain[0][0]  # the top tier's: every save commits there
        self.data_root = dict((n, u) for n, u, _, _ in specs)[self.name]  # (the memory tier's budget counts it)
        # One Promoter per target tier: local (below a memory tier), durable.
        self.promoters = {name: Promoter(tier, promote_bandwidth, commit_timeout, name=name,
                                         on_commit=self._after_promotion)
                          for name, tier in self.chain[1:]}
        self.promoter = self.promoters["durable"]
        self.full = False  # the last save skipped the memory tier (over its budget)
        self._warned_full = False
        self._counted = False  # the counts below start from the listings at this process's first save
        self._saves = 0  # saves counted toward the durable tier's cadence, on from the run's (saves_since_durable)
        self._local_saves = 0  # the same toward the local tier's (below a memory tier)
        self._unpromoted: dict[str, tuple] = {}  # target -> the newest save no promotion to it covers
        self._one_node = False  # every rank of the group runs on one host (checked at the first save)

    def tier(self, name: str):
        """The Store of the tier ``name`` ("memory", "local", "durable"), or None."""
        return dict(self.chain).get(name)

    @property
    def top(self):
        """The tier every save commits to (memory, else local)."""
        return self.chain[0][1]

    def _read_by_promotions(self, name: str) -> set[int]:
        """Steps of tier ``name`` that promotions queued or running still read."""
        return set().union(*(p.pending_steps(name) for p in self.promoters.values()))

    def _promoting_attempts(self) -> set[str]:
        return set().union(*(p.pending_attempts() for p in self.promoters.values()))

    def _peer_kept(self) -> dict[int, str]:
        return peers.kept_steps(self.tier("memory"), rank_and_world(self.durable.process_group)[1])

    def tier_of_copy(self, tier: str | None, step: int, info) -> str | None:
        """``tier`` of a load's LoadInfo, or ``"peer"`` when the memory tier served it
        from a replica of the loading rank's files that this node's replica server wrote
        (a spare on the partner node restoring a lost node's rank)."""
        if tier != "memory" or info.manifest is None or self.name != "memory":
            return tier
        if peers.is_replica(self.data_root, step, info.rank_state_of, info.manifest.attempt):
            return "peer"
        return tier

    def upper_steps(self) -> set[int]:
        """The steps committed in the tiers above the durable one."""
        return {step for _, tier in self.chain[:-1] for step in tier.steps()}

    def steps(self) -> list[int]:
        """The steps any tier holds committed. While the durable tier cannot be listed
        (an outage, a store made unreadable) the upper tiers' steps are those, with a
        warning: the upper tiers are what restores without the durable store."""
        upper = self.upper_steps()
        try:
            durable = self.durable.committed_steps()
        except CkptStoreError as e:
            if not upper:
                raise
            names_ = " and ".join(name for name, _ in self.chain[:-1])
            warnings.warn(f"{self.durable.url}: the durable tier cannot be listed ({e}); the steps of the "
                          f"{names_} tier{'s' * (len(self.chain) > 2)} alone are listed", RuntimeWarning,
                          stacklevel=3)
            durable = []
        return sorted(set(durable) | upper)

    def holders(self, step: int) -> list[tuple[str, object]]:
        """``(name, Store)`` of the tiers holding ``step`` committed, in load order (a
        tier that cannot be listed is left out when another holds the step)."""
        found, error = [], None
        for name, tier in self.chain:
            try:
                if generations(tier.location(step)):
                    found.append((name, tier))
            except CkptStoreError as e:
                error = e
        if error is not None and not found:
            raise error
        return found

    def load_order(self, step: int) -> list[tuple[str, object]]:
        """Where a load of ``step`` looks, in order: the upper tiers holding it
        committed (memory, local), then the durable tier without listing it (its load
        lists the location itself, as a one-tier store's does). So a load that an upper
        tier serves never touches the durable store: an in-job recovery restores from
        memory without a request to S3."""
        found = []
        for name, tier in self.chain[:-1]:
            try:
                if generations(tier.location(step)):
                    found.append((name, tier))
            except CkptStoreError:
                pass  # (that tier cannot be listed: the next one is tried)
        return found + [self.chain[-1]]

    def save(self, step: int, state, metrics, replicated, durable: bool, stream,
             durable_due: bool | None = None) -> SaveFuture:
        """``Store.save`` of a store with tiers: the save to the top tier (its future),
        or to the next one below memory when it is over its budget, and its promotions
        to the tiers below that are due.

        Both promotions read the tier the save committed to (memory), not each other:
        memory is the faster source, and the durable copy never waits for the disk copy
        (nor fails with it). The memory tier keeps the step until both are done (its
        retention keeps what a promotion still reads: UpperTier.kept). A step
        promoted to the durable tier but not the local one is simply not on disk.

        ``durable_due``: with ``durable_every="auto"``, the caller's decision, already the
        same on every rank (the Checkpointer's); None: decided here (:meth:`_durable_due`,
        a collective when world > 1)."""
        group = self.durable.process_group
        rank, world = rank_and_world(group)
        self._check_hosts(group, world)
        landed = 0  # where in chain this save goes
        if self.budget is not None and not self._fits(state, group, world):
            landed = 1
        else:
            self.full = False
        name, tier = self.chain[landed]
        below = [target for target, _ in self.chain[landed + 1:]]
        # Counted first: a save that raises on one rank only must not skew the ranks' counts.
        # (Every rank counts the same saves: a tier's commit needs every rank's vote.)
        due = {"local": self._local_due() if "local" in below else False,
               "durable": self._durable_due(durable, durable_due, group) if "durable" in below else False}
        epoch = self.durable.epoch
        for _, upper in self.chain[:-1]:
            upper.epoch = epoch
        if landed:
            future = self._skip_memory(step, state, metrics, replicated, stream)
        else:
            future = tier.save(step, state, metrics, replicated=replicated, stream=stream)
        if name in self.sweeps or (name == "memory" and self.replicator is not None):
            future.add_done_callback(lambda f, n=name, r=rank, w=world: self._after_commit(n, f, r, w))
        for target in ("local", "durable"):
            if target not in below:
                self._unpromoted.pop(target, None)  # this save lies in that tier itself, or above none
                continue
            fence = self._promotion_fence(target, epoch)
            if due[target]:
                scheduled = self.promoters[target].schedule(name, tier, future, rank, world, fence,
                                                            first=durable and target == "durable")
                if target == "durable" and self.cadence is not None:
                    self.cadence.note_promotion(step, scheduled)
                self._unpromoted.pop(target, None)
            else:
                self._unpromoted[target] = (name, tier, future, rank, world, fence)
        return future

    def _durable_due(self, forced: bool, agreed: bool | None, group) -> bool:
        """Whether this save is promoted to the durable tier: asked for (``durable=True``,
        a preemption's save) or the ``durable_every``-th since the durable tier's newest
        step; with ``"auto"``, ``agreed`` when the caller combined the ranks' flags, else
        the cadence's decision here (a collective when world > 1: asked even when forced,
        so that every rank makes it). Counts the save; every rank calls it for the same saves."""
        if self.cadence is not None:
            due = self.cadence.decide(group) if agreed is None else bool(agreed)
            return forced or due
        self._start_counts()
        self._saves += 1
        return forced or self._saves % self.durable_every == 0

    def _local_due(self) -> bool:
        """Whether this memory save is promoted to the local tier: the ``local_every``-th
        since the local tier's newest step. Counts the save, as :meth:`_durable_due`."""
        self._start_counts()
        self._local_saves += 1
        return self._local_saves % self.local_every == 0

    def _start_counts(self) -> None:
        if not self._counted:  # this process's first: count on from where the run's saves stand
            self._counted = True
            self._local_saves = self.saves_since_local()
            self._saves = self.saves_since_durable() if self.cadence is None else 0  # ("auto": no count)

    def _promotion_fence(self, target: str, epoch: int | None):
        """What a promotion's commit to ``target`` checks before its manifest: the run's
        durable epoch; into the local tier, as the local tier's own commits do (an
        outage of the durable tier lets it go on, with a warning: UpperTier.fence)."""
        if target == "local":
            return self._roles["local"].commit_fence(self.tier("local").url, epoch)
        return None if epoch is None else functools.partial(check_fence, self.durable.storage, epoch)

    def _check_hosts(self, group, world: int) -> None:
        """Votes and the manifest of an upper tier that is not split travel through its
        directory, which only the ranks of one node share (docs/tiers.md, "Across
        nodes"). Asked once, of every rank alike (a collective in the blocking part, as
        the save's own)."""
        if world <= 1 or self._one_node:  # (first: this runs at every save)
            return
        unsplit = [name for name, tier in self.chain[:-1] if tier.storage.sees_all_data]
        if not unsplit:
            return
        hosts = sorted(set(gather(socket.gethostname(), group)))
        if len(hosts) > 1:
            what = "local_shared=, a location every rank shares" if unsplit[0] == "local" else (
                "a place every rank shares for its commit records (memory=\"auto\" under ckptstore run --in-job "
                "keeps them in the in-job store; without a local tier, local_shared= may name one)")
            raise ValueError(f"{self.durable.url}: a {unsplit[0]} tier on several nodes ({', '.join(hosts[:4])}"
                             f"{', ...' if len(hosts) > 4 else ''}) needs {what}; see docs/tiers.md")
        self._one_node = True

    def promote_newest(self) -> SaveFuture | None:
        """Promote the newest save of this process to each tier below the one it
        committed to that no promotion covers (local, then durable); the last promotion
        scheduled (the durable one when there is one), or None. For a memory tier at the
        end of training: it is removed with the job, so the last steps would be gone with
        it. Every rank calls it alike (the same newest save), and its promotions are
        waited for as any (``ckptstore.wait()``, exit)."""
        last = None
        for target in ("local", "durable"):
            pending = self._unpromoted.pop(target, None)
            if pending is not None:
                name, tier, future, rank, world, fence = pending
                last = self.promoters[target].schedule(name, tier, future, rank, world, fence, first=True)
        return last

    def _fits(self, state, group, world: int) -> bool:
        """Whether this save fits the memory tier's budget on every rank: the node
        directory's usage plus the node's saves, about (this rank's times the ranks on
        the node, ``LOCAL_WORLD_SIZE``: they check at once, before any of them writes);
        any rank over it: all skip alike, as the tier's commit needs every rank's vote.
        A collective when world > 1."""
        try:
            on_node = max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))
            over = directory_usage(self.data_root) + on_node * state_bytes(state) > self.budget
        except Exception:  # (judging the budget must never fail the step)
            over = False
        return not (any(gather(over, group)) if world > 1 else over)

    def _skip_memory(self, step: int, state, metrics, replicated, stream) -> SaveFuture:
        """A save over the memory tier's budget: to the next tier below memory directly
        (the local tier, else the durable one; the training step goes on), one warning
        per process."""
        self.full = True
        name, tier = self.chain[1]
        if not self._warned_full:
            self._warned_full = True
            warnings.warn(f"{self.top.url}: the memory tier's budget ({self.budget} bytes) would be passed by the "
                          f"save of step {step}; it goes to the {name} tier ({tier.url}) instead, as do "
                          "later saves while the budget is passed (raise ckptstore run --memory-budget, CKPTSTORE_MEMORY_BUDGET "
                          "or memory_budget=, "
                          "or make the state smaller)", MemoryFullWarning, stacklevel=4)
        return tier.save_here(step, state, metrics, replicated=replicated, stream=stream)

    def saves_since_durable(self) -> int:
        """Upper tiers' steps newer than the durable tier's newest, at most
        ``durable_every`` - 1: where the count of saves stood when an earlier process of
        the run stopped. Counted per process from 0, a job restarted more often than
        every ``durable_every`` saves promoted nothing, and losing the node lost every
        step. (Every rank reads the same listings before its first save: the counts agree.)"""
        return _saves_since(self.durable.committed_steps, [t for _, t in self.chain[:-1]], self.durable_every)

    def saves_since_local(self) -> int:
        """The same for the local tier below a memory tier: memory steps newer than the
        local tier's newest, at most ``local_every`` - 1 (0 without both tiers)."""
        memory, local = self.tier("memory"), self.tier("local")
        if memory is None or local is None:
            return 0
        return _saves_since(local.steps, [memory], self.local_every)

    def _after_commit(self, name: str, future: SaveFuture, rank: int, world: int) -> None:
        """A save to a split tier (several nodes) committed: sweep this rank's files that
        no checkpoint of the tier needs any more, on its own node (NodeSweep). A memory
        tier's commit also queues its peer replication (peers.py; never waits for it)."""
        if future._future.exception() is not None:
            return  # only after a commit: a failed save's files are gc's rule (grace) to judge
        if name == "memory" and self.replicator is not None:
            self.replicator.submit(future.step, rank, world)
        if name in self.sweeps:
            self.sweeps[name].committed(future.attempt, rank)

    def _after_promotion(self, target: str, attempt: str, rank: int) -> None:
        """A promotion into ``target`` committed: a split local tier sweeps as after its saves."""
        if target in self.sweeps:
            self.sweeps[target].committed(attempt, rank)


def check_every(what: str, every, alternative: str = "") -> None:
    """ValueError unless ``every`` (``durable_every``, ``local_every``) is an int >= 1
    (``alternative``: what else the caller accepts, for the message)."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"{what} must be an int >= 1{' ' + alternative if alternative else ''}, got {every!r}")


def _saves_since(steps_below, above: list, every: int) -> int:
    """How many steps of the tiers ``above`` are newer than the newest of
    ``steps_below()``, at most ``every`` - 1 (0 while a listing fails)."""
    try:
        below = steps_below()
        newest = below[-1] if below else -1
        since = len({s for tier in above for s in tier.steps() if s > newest})
    except CkptStoreError:
        return 0  # (a tier unreadable: count from here)
    return min(since, every - 1)


class NodeSweep:
    """The sweeps of one split tier (several nodes: storage/split.py) of this rank's
    files on its own node (:func:`sweep_own_data`), after each commit of the tier (a
    save's or a promotion's), off the commit thread, one at a time. ``pending``: the
    attempts promotions still read or write (kept)."""

    def __init__(self, tier, pending: Callable[[], set[str]]):
        self.tier, self.pending = tier, pending
        self.committed_here: set[str] = set()  # attempts this process saw commit in the tier
        self._sweeping = threading.Lock()

    def committed(self, attempt: str, rank: int) -> None:
        self.committed_here.add(attempt)
        if self._sweeping.acquire(blocking=False):
            with _SWEEPS_LOCK:
                if _EXITING:  # (the interpreter is ending: the next start sweeps)
                    self._sweeping.release()
                    return
                sweeper = threading.Thread(target=self._sweep, args=(rank,), name="ckptstore-sweep", daemon=True)
                sweeper.start()
                _SWEEPS.add(sweeper)

    def _sweep(self, rank: int) -> None:
        try:
            for key in sweep_own_data(self.tier, rank, set(self.committed_here), self.pending()):
                self.committed_here.discard(names.parse_data_file(key.split("/", 1)[1])[0])
        except Exception as e:  # only disk space: the next save sweeps again
            warnings.warn(f"{self.tier.url}: sweeping this node's old data files failed: {e}", RuntimeWarning,
                          stacklevel=1)
        finally:
            self._sweeping.release()


# The sweeps running now. At exit each is given a moment to end: a daemon thread still
# inside a call to a TCPStore (a memory tier's records in the in-job store) when the
# interpreter ends aborts the process (std::terminate), and the supervisor would take
# a finished worker for a crashed one.
# No sweep starts once the exit has begun.
_SWEEPS: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()
_SWEEPS_LOCK = threading.Lock()
_EXITING = False
SWEEP_EXIT_WAIT_S = 10.0


@atexit.register
def _let_sweeps_end() -> None:
    global _EXITING
    with _SWEEPS_LOCK:
        _EXITING = True
        sweeps = list(_SWEEPS)
    deadline = time.monotonic() + SWEEP_EXIT_WAIT_S
    for sweeper in sweeps:
        sweeper.join(max(0.0, deadline - time.monotonic()))


def load_first(holders: list, step: int, reading, load_copy):
    """(object, LoadInfo) of ``step`` from the first of ``holders`` (``(tier name,
    Store)`` in load order) whose copy ``load_copy(location)`` loads, with the tier
    named in the LoadInfo. A copy with bad bytes or files falls back to the next tier,
    with a warning; one whose manifest was retired under the load (``reading``, a
    checkpoint.load.Reading) is not a bad copy: its error is raised, and the load
    starts again from the listing (checkpoint.load.with_reloads)."""
    first_fault = None
    for i, (tier, store) in enumerate(holders):
        try:
            obj, info = load_copy(store.location(step))
        except _NOT_COPY_FAULTS:
            raise
        except _COPY_FAULTS as e:
            last = i == len(holders) - 1
            if (last and first_fault is not None and isinstance(e, (CheckpointNotFoundError, NotCommittedError))
                    and not reading.retired()):
                # The durable tier is tried unlisted (Tiers.load_order): when it holds no
                # copy, the bad upper copy's fault is the one to report.
                raise first_fault from None
            if last or reading.retired():
                raise
            first_fault = first_fault or e
            warnings.warn(f"{store.location(step).describe()}: the {tier} copy of step {step} cannot be "
                          f"loaded ({type(e).__name__}: {e}); trying the {holders[i + 1][0]} copy",
                          TierFallbackWarning, stacklevel=5)
            continue
        return obj, dataclasses.replace(info, tier=tier)
    raise AssertionError("no holders")  # (Store.load refuses an empty list before)


class Promoter:
    """The background promotions of one :class:`~ckptstore.Store` in this process to one
    tier below the one a save committed to (``target``, a Store named ``name``: the
    durable tier, or the local tier below a memory tier): one at a time, in order, each
    reading its own source tier (the tier its save committed to). ``on_commit(name,
    attempt, rank)``: after each promotion committed here."""

    BACKLOG_WARN = 2  # promotions queued behind the running one before it warns

    def __init__(self, target, bandwidth: float | None, timeout: float, name: str = "durable",
                 on_commit: Callable[[str, str, int], None] | None = None):
        self.target, self.name, self.on_commit = target, name, on_commit
        self.throttle = Throttle(bandwidth)
        self.timeout = timeout
        self._lock = threading.Lock()
        self._queue: deque = deque()  # (future, source name, source Store, its SaveFuture, rank, fence)
        self._pending: dict[tuple[str, int], int] = {}  # (source, step) -> promotions queued or running
        self._attempts: dict[str, int] = {}  # their attempts (a node's sweep keeps their files)
        self._worker: threading.Thread | None = None

    def pending_steps(self, source: str | None = None) -> set[int]:
        """The steps promotions queued or running read (of tier ``source``; None: any)."""
        with self._lock:
            return {step for name, step in self._pending if source is None or name == source}

    def pending_attempts(self) -> set[str]:
        with self._lock:
            return set(self._attempts)

    def schedule(self, source_name: str, source, save: SaveFuture, rank: int, world: int, fence,
                 first: bool = False) -> SaveFuture:
        """A promotion of ``save``'s checkpoint once it is committed in ``source`` (tracked
        now, so that a ``wait()`` right after the save already covers it). ``first``:
        ahead of the promotions still queued (a preemption's save, ``durable=True``: the
        exit deadline must not go to older steps first; every rank queues it alike)."""
        future = SaveFuture(self.target.location(save.step).describe(), save.step, save.attempt,
                            storage=self.target.location(save.step), rank=rank, world_size=world)
        future._staged.set()
        future.promotion = True  # lifecycle: its failure is raised by wait(), not by the next save
        lifecycle.track(future)
        key = (source_name, save.step)
        with self._lock:
            self._pending[key] = self._pending.get(key, 0) + 1
            self._attempts[save.attempt] = self._attempts.get(save.attempt, 0) + 1
            item = (future, source_name, source, save, rank, fence)
            (self._queue.appendleft if first else self._queue.append)(item)
            backlog = len(self._queue)
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(target=self._run, name=f"ckptstore-promote-{self.name}",
                                                daemon=True)
                self._worker.start()
        if backlog > self.BACKLOG_WARN + 1:
            warnings.warn(f"{self.target.url}: {backlog} promotions wait for the {self.name} tier; the "
                          f"{source_name} tier keeps their steps until they are done (raise "
                          f"{self.name}_every or promote_bandwidth)", PromotionWarning, stacklevel=4)  # (the caller of Store.save)
        return future

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._worker = None
                    return
                future, source_name, source, save, rank, fence = self._queue.popleft()
            key = (source_name, save.step)
            try:
                manifest = save._future.result()  # the source's commit (not .result(): the save's own
            except BaseException as e:               # failure stays unobserved, for the next save)
                # Tell rank 0 of the target's attempt at once (it would wait for this vote).
                refuse(self.target.location(save.step), save.attempt, save.step, save.world_size, rank, e)
                future.observed = True  # the save's own error, reported as the save's
                self._finish(future, key, source, error=e, quiet=True)
                continue
            began = time.monotonic()  # P of durable_every="auto" (durable_cadence.py): promote() itself
            try:
                result = promote(source.location(save.step), self.target.location(save.step), manifest,
                                 rank, timeout=self.timeout, fence=fence, throttle=self.throttle)
            except BaseException as e:
                future.promotion_s = time.monotonic() - began
                self._finish(future, key, source, error=e, retain=rank == 0)
            else:
                future.promotion_s = time.monotonic() - began
                if self.on_commit is not None:
                    self.on_commit(self.name, save.attempt, rank)
                self._finish(future, key, source, result=result, retain=rank == 0)

    def _retain(self, source, committed: bool) -> None:
        """Rank 0, after a promotion: the source tier's retention, now that the promotion
        no longer holds its step (the commit's own run kept it), and after a committed
        one the target tier's (``keep``)."""
        stores = [source] + ([self.target] if committed and self.target.keep is not None else [])
        for store in stores:
            try:
                store.apply_retention()
            except Exception as e:  # the promotion is done either way; the next one retries
                warnings.warn(f"{store.url}: retention after a promotion failed: {e}", RuntimeWarning,
                              stacklevel=1)

    def _finish(self, future: SaveFuture, key: tuple[str, int], source, result=None, error=None, quiet=False,
                retain=False) -> None:
        with self._lock:
            _count_down(self._pending, key)
            _count_down(self._attempts, future.attempt)
        if retain:  # before the future resolves: wait() covers it, as it covers a save's
            self._retain(source, committed=error is None)
        if error is None:
            future._future.set_result(result)
            return
        if not quiet:  # before the future resolves, so that whoever waits for it has seen it
            warnings.warn(f"{future.where}: promotion of step {key[1]} to the {self.name} tier failed: "
                          f"{type(error).__name__}: {error}", PromotionWarning, stacklevel=1)
        future._future.set_exception(error)


def _count_down(counts: dict, key) -> None:
    left = counts.get(key, 0) - 1
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)


def sweep_own_data(tier, rank: int, retired_here: set[str], keep: set[str], now: float | None = None) -> list[str]:
    """A multi-node local tier (storage/split.py): delete this rank's data files, on its
    own node, of attempts that no manifest of the tier references any more and that
    either committed in this process (``retired_here``: retention or a newer generation
    retired them since) or have been idle for the tier's grace (gc's rule for debris: a
    failed save, an earlier incarnation's files). ``keep``: promotions in flight. Rank
    0's retention deletes the files it sees, its own node's; every other node's go this
    way. Nothing is deleted while the shared place lists no checkpoint at all (it may be
    unreachable or replaced). Returns the keys deleted."""
    now = time.time() if now is None else now
    shared_root, data = tier.storage.shared, tier.storage.data
    if not any(names.parse_step_dir_name(n.rstrip("/")) is not None for n in shared_root.list("")):
        return []
    deleted = []
    for entry in data.list(""):
        step = names.parse_step_dir_name(entry.rstrip("/"))
        if step is None or not entry.endswith("/"):
            continue
        shared = shared_root.child(entry.rstrip("/"))
        referenced = set()
        for gen in generations(shared):
            try:
                referenced |= attempts_named(read_manifest(shared, gen))
            except Exception:
                referenced = None  # unreadable: keep everything of the step
                break
        if referenced is None:
            continue
        loc = data.child(entry.rstrip("/"))
        for info in list(loc.walk(names.ATTEMPTS_DIR + "/")):
            parsed = names.parse_data_file(info.key)
            if not parsed or parsed[1] != rank or parsed[0] in referenced or parsed[0] in keep:
                continue
            if parsed[0] in retired_here or now - info.mtime >= tier.grace:
                loc.delete(info.key)
                deleted.append(f"{entry}{info.key}")
    return deleted


# ---------------------------------------------------------------------------- which store a local tier is
def check_places(places: dict[str, Storage], group=None) -> None:
    """A two-tier store's places (``"the durable store"``, ``"the local tier"`` and,
    on several nodes, ``"local_shared"``): refuse any two that overlap, then bind each
    local place to the durable store (:func:`bind_local_tier`).

    Every rank of ``group`` opens the store, but only rank 0 creates the durable store's
    ``store-id.json``: on a store without atomic create-only puts
    (``conditional_writes="single-writer"``) ranks creating it at once would each take
    their own id while the last put wins, and a local place bound to a lost id is
    refused ever after. A rank that finds none yet leaves its places unbound until the
    next start (:func:`bind_local_tier`)."""
    refuse_overlaps(places)
    durable = places["the durable store"]
    create = rank_and_world(group)[0] == 0
    for what, place in places.items():
        if place is not durable:
            bind_local_tier(place, durable, what, create=create)


def bound_before(places: dict[str, Storage], durable: Storage) -> bool:
    """Whether every place but ``durable`` holds a binding that names ``durable`` (by
    its location; the ids were compared when it was made). An in-job round after the
    first opens the memory tier its round 0 bound, and need not read the durable
    store's id again on the way to its restore."""
    for place in places.values():
        if place is durable:
            continue
        try:
            found = _create_or_read(place, names.TIER_BINDING_NAME, None, "tier binding")
        except (CkptStoreError, OSError):
            return False
        if not found or found.get("durable") != durable.describe():
            return False
    return True


def refuse_overlaps(places: dict[str, Storage]) -> None:
    """ValueError when two places are one, or one lies inside the other, nesting either
    way: as URLs or paths as given, and on local disk as directories (device and inode:
    a symlink, a bind mount; a place that does not exist yet is judged by the nearest
    directory above it that does). Local retention would otherwise delete the durable
    tier's steps as its own."""
    for (a, sa), (b, sb) in itertools.combinations(places.items(), 2):
        why = _overlap(sa, sb)
        if why is not None:
            raise ValueError(f"{a} ({sa.describe()}) and {b} ({sb.describe()}) overlap ({why}): give each a "
                             "location of its own, neither inside the other (a local tier on the node's own "
                             "disk, the durable store elsewhere)")


def _overlap(a: Storage, b: Storage) -> str | None:
    ra, rb = a.describe().rstrip("/") + "/", b.describe().rstrip("/") + "/"
    if ra.startswith(rb) or rb.startswith(ra):
        return "one path lies in the other"
    if isinstance(a, LocalStorage) and isinstance(b, LocalStorage):
        da, db = _directory(a.root), _directory(b.root)
        if _within(da, db) or _within(db, da):
            return "one directory (device and inode) is, or holds, the other"
    return None


def _directory(path) -> tuple[list[tuple[int, int]], tuple[str, ...]]:
    """Where ``path`` is on disk, whatever it spells: the (device, inode) of the nearest
    directory at or above it that exists and of every directory above that one, found
    through ``..`` (the kernel's parent of the directory reached: a symlink's target's,
    a bind mount's), nearest first; and the names below it not created yet."""
    flags = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY
    path, missing = os.path.abspath(path), ()
    while True:
        try:
            fd = os.open(path, flags)
            break
        except OSError:
            parent, name = os.path.split(path)
            if parent == path:
                return [], missing
            path, missing = parent, (name,) + missing
    chain: list[tuple[int, int]] = []
    try:
        while True:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) in chain:  # the root: its parent is itself
                break
            chain.append((st.st_dev, st.st_ino))
            parent = os.open("..", flags, dir_fd=fd)
            os.close(fd)
            fd = parent
    except OSError:
        pass  # a parent we may not open: compare what was found
    finally:
        os.close(fd)
    return chain, missing


def _within(a, b) -> bool:
    """Whether the place ``a`` (:func:`_directory`) is ``b`` or lies inside it."""
    (ca, ma), (cb, mb) = a, b
    if not ca or not cb:
        return False
    if not mb:  # b exists: it is a's nearest existing directory or above it
        return cb[0] in ca
    return ca[0] == cb[0] and ma[:len(mb)] == mb  # neither created yet: below one directory


def bind_local_tier(local: Storage, durable: Storage, what: str = "the local tier", create: bool = True) -> None:
    """Bind ``local`` to the durable store ``durable``, or refuse it (ValueError) when it
    is bound to another store.

    The durable store's identity is a random id in ``store-id.json`` at its root,
    created once (create-only, then read back: the stored one is the id) by the first
    two-tier store opened on it, by its rank 0; a local place holds
    ``tier-binding.json`` (create-only) naming that id. So two jobs given one local
    directory, or a local directory reused for a new store at the same URL (the old one
    deleted), are refused: the second would resume the first one's steps, and each
    one's local retention delete the other's only copies. While the durable store
    cannot be read (an outage) the check is left out with a RuntimeWarning: the local
    tier is what keeps a job checkpointed through one. ``create=False`` (a rank other
    than 0): a store with no identity yet is left as it is, and ``local`` unbound."""
    try:
        ident = _store_identity(durable) if create else _read_identity(durable)
    except FormatError:
        raise
    except (CkptStoreError, OSError) as e:
        warnings.warn(f"{durable.describe()}: the durable store cannot be read ({e}); {what} "
                      f"({local.describe()}) is used without checking which store it belongs to",
                      RuntimeWarning, stacklevel=5)
        return
    if ident is None:
        return  # rank 0 creates it; this rank's places are bound at the next start
    binding = {"format": fmt.FORMAT_NAME, "kind": "tier_binding", "store": ident,
               "durable": durable.describe(), "created_at": fmt.utc_now()}
    bound = _create_or_read(local, names.TIER_BINDING_NAME, binding, "tier binding")
    if bound.get("store") != ident:
        raise ValueError(
            f"{what} {local.describe()} belongs to another store: its {names.TIER_BINDING_NAME} names "
            f"{str(bound.get('durable'))[:512]!r} (store id {str(bound.get('store'))[:64]!r}), not "
            f"{durable.describe()} (store id {ident}). Two stores must not share a local directory: the "
            "second would resume the first one's steps and its retention would delete the other's. Give "
            f"this store a local directory of its own; if the other store and its local steps are no longer "
            f"wanted, delete {local.describe()}")


def _store_identity(durable: Storage) -> str:
    """The durable store's id, created when it has none."""
    record = {"format": fmt.FORMAT_NAME, "kind": "store_id", "id": secrets.token_hex(16),
              "created_at": fmt.utc_now()}
    return _valid_identity(durable, _create_or_read(durable, names.STORE_ID_NAME, record, "store id"))


def _read_identity(durable: Storage) -> str | None:
    """The durable store's id, or None while it has none."""
    found = _create_or_read(durable, names.STORE_ID_NAME, None, "store id")
    return None if found is None else _valid_identity(durable, found)


def _valid_identity(durable: Storage, found: dict) -> str:
    ident = found.get("id")
    if not (isinstance(ident, str) and len(ident) == 32 and all(c in "0123456789abcdef" for c in ident)):
        raise FormatError(f"{durable.describe(names.STORE_ID_NAME)}: holds no store id (32 hex digits): "
                          "restore it, or delete it and every local tier's "
                          f"{names.TIER_BINDING_NAME} bound to this store")
    return ident


def _create_or_read(storage: Storage, name: str, record: dict | None, what: str) -> dict | None:
    """The JSON object stored under ``name``, written as ``record`` when there is none
    (None: not written, and None returned). What is returned is always what was read
    from the store, after our own put too: where create-only puts are not atomic
    (``conditional_writes="single-writer"``) another writer's put may have replaced
    ours, and the stored one wins."""
    for _ in range(3):
        try:
            found = fmt.loads_json(read_capped(storage, name, fmt.MAX_MARKER_BYTES, what), what)
        except ObjectNotFoundError:
            if record is None:
                return None
            try:
                storage.put(name, json.dumps(record).encode(), if_absent=True)
            except AlreadyExistsError:
                pass  # another rank or job created it first
            continue  # read back what is stored: ours, or the winner's
        except FormatError as e:
            raise FormatError(f"{storage.describe(name)}: {e}") from None
        if not isinstance(found, dict):
            raise FormatError(f"{storage.describe(name)}: the {what} is not a JSON object")
        return found
    raise FormatError(f"{storage.describe(name)}: the {what} was created and is gone")
