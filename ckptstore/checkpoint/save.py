"""One save attempt from end to end: snapshot now, write and commit in the background."""

from __future__ import annotations

import functools
import pickle
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

from .. import format as fmt
from ..codecs import CompressionPolicy
from ..errors import CkptStoreError
from ..pipeline import RankWriter
from ..runtime import Runtime
from ..storage import Storage
from .commit import commit
from .follower import await_outcome
from .heartbeat import Heartbeat, save_beat_every
from .indexes import rank_records, seal, with_index
from .snapshot import DEFAULT_CHUNK_BYTES, snapshot
from .votes import abort, write_failure_vote, write_vote


@dataclass(frozen=True)
class SaveOptions:
    compression: CompressionPolicy = CompressionPolicy()
    commit_timeout: float = 600.0
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    pickle_protocol: int = 2
    pickle_module: Any = pickle  # pickles the object skeleton, as torch.save's argument
    replicated: tuple[str, ...] = ()  # fnmatch patterns of state paths replicated on every rank
    epoch: int | None = None  # the run incarnation, recorded in the manifest (fencing.py)
    fence: Any = None  # called by the committer just before the manifest: raises FencedError
    references: Any = None  # incremental: {(raw length, xxh3): committed Blob with step} (references.index)
    reference_base: tuple[int, int] | None = None  # (step, generation) of the manifest ``references`` came from
    # Format version 4 (indexes.py): each rank's records in an index of its own, the
    # manifest a root naming them. None: for a save of more than one rank (one rank's
    # records in one document are one read where a root and an index would be two).
    indexed: bool | None = None
    # What the device copies wait for: None (each device's current stream), a
    # torch.cuda.Stream or {device index: stream}, checked by staging.check_stream.
    stream: Any = None
    # Warn (UnsafeForWeightsOnlyWarning) when the default load will refuse the object:
    # Store.save does; the drop-in save is silent, as torch.save, unless asked.
    warn_unsafe: bool = True


def save_options(compression: str | CompressionPolicy, commit_timeout: float, chunk_bytes: int | None,
             pickle_protocol: int) -> SaveOptions:
    """The options of a save from the public calls' arguments (``ckptstore.save``,
    ``Store``)."""
    policy = compression if isinstance(compression, CompressionPolicy) else CompressionPolicy(mode=compression)
    kw = {} if chunk_bytes is None else {"chunk_bytes": int(chunk_bytes)}
    return SaveOptions(compression=policy, commit_timeout=float(commit_timeout),
                       pickle_protocol=pickle_protocol, **kw)



class Progress(NamedTuple):
    """How far a save in flight is (the exit drain's messages): chunks and raw bytes of
    tensor data written of those staged; ``committing``: the data file is durable and
    the vote and commit run."""

    chunks_written: int
    chunks: int
    bytes_written: int
    nbytes: int
    committing: bool


class SaveFuture:
    """The outcome of one save: committed manifest, or the error that stopped it.

    ``save`` returns once the snapshot is staged, so ``staged()`` is then already true;
    ``result()`` waits for the commit and returns the :class:`~ckptstore.format.Manifest`.

    It knows its storage, attempt, rank and world size, so that in exit mode it can beat
    its heartbeat (:meth:`watch_exit`) whatever stage the save is in.
    """

    def __init__(self, where: str, step: int | None, attempt: str, *, storage: Storage | None = None,
                 rank: int = 0, world_size: int = 1):
        self.where = where
        self.step = step
        self.attempt = attempt
        self.storage = storage
        self.rank = rank
        self.world_size = world_size
        self._future: Future = Future()
        self._staged = threading.Event()
        self._settled = threading.Event()  # done, or its attempt was aborted: nothing left to wait for
        self._future.add_done_callback(lambda _f: self._settle())
        # A multi-rank save beats its heartbeat from start to end (heartbeat.Heartbeat):
        # slowly, and fast once the process exits (watch_exit).
        self._beat: Heartbeat | None = None
        if world_size > 1 and storage is not None:
            self._beat = Heartbeat(storage, attempt, rank, save_beat_every(world_size), self._settled,
                                           self._on_aborted).start()
        self.aborted = False  # exit mode saw the attempt's abort marker: it cannot commit
        self.observed = False  # the caller has seen the outcome
        self._counts: Callable[[], tuple[int, int, int, int]] | None = None  # the writer's, while in flight
        self._committing = False

    def result(self, timeout: float | None = None) -> fmt.Manifest:
        try:
            return self._future.result(timeout)
        finally:
            if self._future.done():
                self.observed = True

    def exception(self, timeout: float | None = None) -> BaseException | None:
        exc = self._future.exception(timeout)
        self.observed = True
        return exc

    def failure(self) -> BaseException | None:
        """The error of a save that is done and failed; None while in flight or once
        committed. Unlike :meth:`exception`, it does not count as the program's look at
        the outcome (``observed``): for ckptstore's own bookkeeping (the exit report,
        callbacks on commit)."""
        return self._future.exception() if self._future.done() else None

    def done(self) -> bool:
        return self._future.done()

    def staged(self) -> bool:
        return self._staged.is_set()

    def wait_staged(self, timeout: float | None = None) -> bool:
        """Wait until every tensor's bytes sit in staging memory."""
        return self._staged.wait(timeout)

    def add_done_callback(self, fn) -> None:
        self._future.add_done_callback(lambda _f: fn(self))

    def settled(self) -> bool:
        """Done, or known not to commit (exit mode saw its attempt's abort marker)."""
        return self._settled.is_set()

    def wait_settled(self, timeout: float | None = None) -> bool:
        return self._settled.wait(timeout)

    def progress(self) -> Progress | None:
        """How far the save is while in flight; None when not known (a promotion) or done."""
        counts = self._counts
        return None if counts is None else Progress(*counts(), self._committing)

    def watch_exit(self) -> None:
        """Exit mode: beat this attempt's heartbeat fast until the save is settled, and
        settle it as soon as the attempt is aborted (by any rank). Idempotent; a
        one-rank save has no peer to tell, so it beats nothing."""
        if self._beat is not None:
            self._beat.hurry()

    def _settle(self) -> None:
        self._settled.set()
        self._counts = None  # (the writer, and what it holds, need not outlive the save)
        if self._beat is not None:
            self._beat.stop()

    def _on_aborted(self) -> None:
        self.aborted = True
        self._settled.set()  # (the beat, which calls this, stops by itself)

    def __repr__(self) -> str:
        state = "in flight" if not self.done() else "failed" if self.failure() is not None else "committed"
        return f"<SaveFuture {self.where} step={self.step} {state}>"


def start_save(obj, storage: Storage, *, rt: Runtime, attempt: str, step: int | None, rank: int,
               world_size: int, metrics: dict | None, options: SaveOptions, after_commit=None) -> SaveFuture:
    """Stage ``obj`` (blocking), then write, vote and commit on background threads."""
    created_at = fmt.utc_now()
    future = SaveFuture(storage.describe(), step, attempt, storage=storage, rank=rank, world_size=world_size)
    writer = RankWriter(storage, attempt, rank, options.compression, rt, references=options.references,
                        writers=world_size)
    future._counts = writer.progress
    try:
        staged = snapshot(obj, writer, rt.staging_pool, options.chunk_bytes, options.pickle_protocol,
                          rank=rank, world_size=world_size, replicated=options.replicated,
                          pickle_module=options.pickle_module, stream=options.stream,
                          warn_unsafe=options.warn_unsafe)
    except BaseException as e:
        writer.abort()
        refuse(storage, attempt, step, world_size, rank, e)
        if isinstance(e, CkptStoreError):
            raise type(e)(f"{storage.describe()}: {e}") from e
        raise
    future._staged.set()

    # (a multi-node local tier, whose committer sees only its own node's data files,
    # cannot read the others' tables or indexes: version 3, whose votes hold the records)
    indexed = (world_size > 1 and storage.sees_all_data) if options.indexed is None \
        else options.indexed

    def finish() -> None:
        try:
            own = None
            if indexed:
                vote, own = writer.finish(functools.partial(seal, writer, staged=staged, step=step,
                                                            world_size=world_size))
            else:
                written = writer.finish()
                state, shards = rank_records(rank, written, staged)
                vote = fmt.Vote(attempt, step, world_size, rank, ok=True, state=state, shards=shards,
                                replicas=written.replicas)
            future._committing = True
            if world_size > 1:  # a one-rank save's committer is its only voter: no file to write and fsync
                write_vote(storage, vote)
            if rank == 0:
                manifest = commit(storage, vote, world_size, created_at, dict(metrics or {}), options.commit_timeout,
                                  epoch=options.epoch, fence=options.fence, base=options.reference_base,
                                  # A store's step: its retired generation's files are gc's to judge,
                                  # whether or not this save references: other steps may (an
                                  # incremental run before a non-incremental one).
                                  retire_files=step is None)
            else:
                manifest = await_outcome(storage, attempt, options.commit_timeout, rank, world_size)
            if own is not None:  # a root: with this rank's own records, which it has at hand
                manifest = with_index(storage, manifest, own, rt.readers)
        except BaseException as e:
            refuse(storage, attempt, step, world_size, rank, e)
            future._future.set_exception(e)
        else:
            if after_commit is not None:
                _run_after_commit(functools.partial(after_commit, manifest), storage)  # before the future resolves
            future._future.set_result(manifest)

    try:
        rt.committer.submit(finish)
    except BaseException:  # (a runtime shutting down): stop the chunks and the data file's upload
        writer.abort()
        raise
    return future


def refuse(storage: Storage, attempt: str, step, world_size: int, rank: int, error: BaseException) -> None:
    """A failed rank tells the others at once: a no-vote, and from rank 0 an abort."""
    if world_size > 1:
        write_failure_vote(storage, attempt, step, world_size, rank, error)
        if rank == 0:
            abort(storage, attempt, f"rank 0 failed: {type(error).__name__}: {error}")


def _run_after_commit(hook, storage: Storage) -> None:
    """Retention after a commit: its failure must not fail the (committed) save."""
    import warnings

    try:
        hook()
    except Exception as e:  # the checkpoint is committed; report, do not raise
        warnings.warn(f"{storage.describe()}: retention after commit failed: {e}", RuntimeWarning, stacklevel=1)
