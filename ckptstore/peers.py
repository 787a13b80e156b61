"""The rank side of peer replicas (docs/tiers.md, "Peer replicas"): after a memory-tier
commit, this rank's own data files of the step are copied to the partner node's
replica server (supervisor/replica.py, ``CKPTSTORE_PEER_REPLICA``), in the background,
one step at a time, a newer step superseding a queued one.

Records, beside the step's commit records in the memory tier's shared store (the
in-job store on several nodes): ``peer/sending-<rank>`` when a rank starts, and
``peer/done-<rank>`` once the server holds all its files of the step (sealed). A step
whose every rank is done is *replicated*; the newest one is S*. The memory tier's
retention (rank 0) keeps S* and the newest :data:`IN_FLIGHT_KEPT` steps above it with
records (:func:`kept_steps`), so a lost node's ranks always find a complete step on
their partner, with its records and the survivors' own files; each rank tells the
server to drop its replicas below S* after each replication (``retire``). A free rank
first joins a kept step in flight that it has not sent (ranks converge on one step),
else takes the newest committed step.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
import warnings
import weakref

from . import names
from .checkpoint.manifests import latest_manifest
from .errors import CkptStoreError
from .supervisor import injob

PEER_DIR = "peer"
IN_FLIGHT_KEPT = 2  # steps above S* with records that retention keeps (replications in flight)


class PeerReplicaWarning(RuntimeWarning):
    """A peer replication failed; the memory tier and the durable tier are unaffected."""


def _record(state: str, rank: int) -> str:
    return f"{PEER_DIR}/{state}-{rank:05d}"


def records_of(tier, step: int) -> dict[str, set[int]]:
    """``{"sending": ranks, "done": ranks}`` of ``step`` in the tier ``tier`` (a Store)."""
    found: dict[str, set[int]] = {"sending": set(), "done": set()}
    for name in tier.location(step).list(f"{PEER_DIR}/"):
        state, _, rank = name.partition("-")
        if state in found and injob.rank_of(rank) is not None:  # (a name of another kind: not a record)
            found[state].add(injob.rank_of(rank))
    return found


def replica_state(tier, world: int) -> tuple[list[int], int | None, list[int], dict[int, dict]]:
    """(committed steps ascending, S* (the newest step every rank of ``world`` holds a
    replica of; None), the steps above S* with records, newest last, and the records)."""
    steps = tier.steps()
    records = {step: records_of(tier, step) for step in steps}
    full = [s for s in steps if records[s]["done"] >= set(range(world))]
    newest = full[-1] if full else None
    above = [s for s in steps if (newest is None or s > newest) and (records[s]["done"] or records[s]["sending"])]
    return steps, newest, above, records


def kept_steps(tier, world: int) -> dict[int, str]:
    """The steps the memory tier's retention keeps for peer replicas: S* and the newest
    :data:`IN_FLIGHT_KEPT` steps above it being replicated."""
    try:
        _, newest, above, _ = replica_state(tier, world)
    except CkptStoreError:
        return {}  # (the records cannot be read: the retention's own listing fails likewise)
    kept = {s: "a peer replication in flight" for s in above[-IN_FLIGHT_KEPT:]}
    if newest is not None:
        kept[newest] = "the newest step replicated on the partner nodes"
    return kept


def enabled() -> str | None:
    """The partner's replica server (host:port) when this process replicates, else None."""
    return os.environ.get(injob.ENV_PEER_REPLICA) or None


class PeerReplicator:
    """The peer replications of one memory tier in this process: one background thread,
    one step at a time."""

    def __init__(self, tier, data_root: str, address: str):
        self.tier, self.data_root, self.address = tier, data_root, address
        self._lock = threading.Condition()
        self._due: tuple[int, int, int] | None = None  # (step, rank, world) of the newest commit
        self._thread: threading.Thread | None = None
        self._client = None
        self._warned = False
        self._closing = False
        self.replicated: list[int] = []  # steps this process replicated (newest last)

    def submit(self, step: int, rank: int, world: int) -> None:
        """After the memory commit of ``step``: replicate it (or a newer one) soon.
        Never blocks on the network."""
        with self._lock:
            if self._closing:
                return
            if self._due is None or step > self._due[0]:
                self._due = (step, rank, world)
            self._lock.notify()
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="ckptstore-peer-replica", daemon=True)
                self._thread.start()
                _THREADS.add(self)

    def wait_idle(self, timeout: float) -> bool:
        """Whether nothing is due or being sent (tests, the exit), within ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._due is not None or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
        return True

    _busy = False

    def wait_for(self, step: int, timeout: float) -> bool:
        """Whether this process replicated ``step`` or a newer one within ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while not (self.replicated and self.replicated[-1] >= step):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
        return True

    def close(self) -> None:
        with self._lock:
            self._closing = True
            self._due = None
            self._lock.notify_all()

    def _run(self) -> None:
        while True:
            with self._lock:
                while self._due is None and not self._closing:
                    self._lock.wait()
                if self._closing:
                    return
                due, self._due = self._due, None
                self._busy = True
            try:
                done = self._replicate_one(*due)
                if done is not None and done != due[0]:  # (it joined an older step in flight: the due one next)
                    with self._lock:
                        if self._due is None and not self._closing:
                            self._due = due
            except Exception as e:  # never the training's failure: the next commit tries again
                if not self._warned:
                    self._warned = True
                    warnings.warn(f"{self.tier.url}: peer replication to {self.address} failed ({type(e).__name__}: "
                                  f"{e}); the memory and durable tiers are unaffected, a lost node restores from "
                                  "an older replicated step or the durable store", PeerReplicaWarning, stacklevel=1)
            finally:
                with self._lock:
                    self._busy = False
                    self._lock.notify_all()

    def _replicate_one(self, due: int, rank: int, world: int) -> int | None:
        """Replicate one step (a kept one in flight this rank has not sent, else ``due``);
        returns the step sent, None when there was nothing to send."""
        steps, newest, above, records = replica_state(self.tier, world)
        joinable = [s for s in above[-IN_FLIGHT_KEPT:] if rank not in records[s]["done"]]
        step = joinable[0] if joinable else due
        done_here = rank in records.get(step, {}).get("done", ())
        if step not in steps or (newest is not None and step <= newest) or done_here:
            return None  # retired meanwhile, or replicated already
        location = self.tier.location(step)
        try:
            attempt = latest_manifest(location).attempt
            location.put(_record("sending", rank), _stamp(rank, attempt))
            self._send(step, attempt, rank)
            if latest_manifest(location).attempt != attempt:
                return step  # (the step was saved again meanwhile: that save's replication is due)
        except Exception:
            if step not in self.tier.steps():
                return None  # retired under us (a newer step superseded it): nothing lost, no warning
            raise
        location.put(_record("done", rank), _stamp(rank, attempt))
        with self._lock:
            self.replicated.append(step)
            self._lock.notify_all()
        _, newest, _, _ = replica_state(self.tier, world)
        if newest is not None:
            self._client_().retire(rank, newest)
            self._drop_own_records(rank, newest)
        return step

    def _send(self, step: int, attempt: str, rank: int) -> list[str]:
        """This rank's data files of ``step`` (read from its node's memory directory) to
        the partner, then the seal; returns their relative paths."""
        from .supervisor.replica import ReplicaError

        step_dir = names.step_dir_name(step)
        folder = os.path.join(self.data_root, step_dir, names.ATTEMPTS_DIR, attempt)
        files = []
        for leaf in sorted(os.listdir(folder)):
            parsed = names.parse_data_file(f"{names.ATTEMPTS_DIR}/{attempt}/{leaf}")
            if parsed is not None and parsed[1] == rank:
                files.append(f"{step_dir}/{names.ATTEMPTS_DIR}/{attempt}/{leaf}")
        if not files:
            raise ReplicaError(f"{folder}: no data file of rank {rank} (this node does not hold them)")
        client = self._client_()
        for rel in files:
            client.put_file(rel, os.path.join(self.data_root, rel))
        client.seal(step, rank, attempt, files)
        return files

    def _client_(self):
        from .supervisor.replica import ReplicaClient

        if self._client is None:
            self._client = ReplicaClient.from_address(self.address)
        return self._client

    def _drop_own_records(self, rank: int, below: int) -> None:
        """This rank's records of steps below S*: no longer needed by anyone."""
        for name in self.tier.storage.list(""):
            step = names.parse_step_dir_name(name.rstrip("/"))
            if step is None or step >= below:
                continue
            for state in ("sending", "done"):
                try:
                    self.tier.location(step).delete(_record(state, rank))
                except CkptStoreError:
                    pass


def _stamp(rank: int, attempt: str) -> bytes:
    return json.dumps({"rank": rank, "attempt": attempt, "at": time.time(),
                       "partner": os.environ.get(injob.ENV_PEER_REPLICA)}).encode()


def is_replica(data_root: str, step: int, rank: int, attempt: str) -> bool:
    """Whether this node holds ``rank``'s files of ``step`` as a replica its server wrote
    (the marker of supervisor/replica.py names the attempt)."""
    from .supervisor.replica import read_marker

    found = read_marker(data_root, step, rank)
    return found is not None and found.get("sealed") is True and found.get("attempt") == attempt


# The replicators with a thread. At exit each is given a moment to finish the step it
# sends (a daemon thread inside a TCPStore call when the interpreter ends aborts it).
_THREADS: "weakref.WeakSet[PeerReplicator]" = weakref.WeakSet()
EXIT_WAIT_S = 10.0


@atexit.register
def _let_replications_end() -> None:
    deadline = time.monotonic() + EXIT_WAIT_S
    for replicator in list(_THREADS):
        with replicator._lock:
            replicator._due = None  # (what is queued is dropped; what is sending ends)
        replicator.wait_idle(max(0.0, deadline - time.monotonic()))
        replicator.close()
