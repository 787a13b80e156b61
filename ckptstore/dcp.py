"""torch.distributed.checkpoint through ckptstore: a ``StorageWriter`` / ``StorageReader``
pair, so that ``dcp.save``, ``dcp.async_save`` and ``dcp.load`` (torchtitan, torchtune,
any FSDP2 code) store checkpoints with ckptstore's two-phase commit, compression,
per-chunk xxh3-128 checked on every read, S3, and ``ckptstore ls / verify / gc``.

How DCP's steps map (docs/dcp.md):

- ``prepare_global_plan`` (coordinator) names one attempt for the save and each plan's
  rank, and the plans carry them to every rank;
- ``write_data`` (every rank): each item DCP planned for this rank (a chunk of a global
  tensor, or a pickled object) becomes one blob in the rank's data file, hashed and
  compressed as any ckptstore chunk; the file is made durable, then ranks other than 0
  write their vote (phase one);
- ``finish`` (coordinator, after DCP gathered every rank's results): writes a skeleton
  naming every item as a global tensor, then runs ckptstore's own commit: it reads the
  votes, checks that the chunks cover every tensor exactly once and that every file is
  there, and writes the create-only manifest. Nothing is visible before that.

A DCP checkpoint is an ordinary ckptstore checkpoint: each tensor is a global tensor of
the manifest (its DCP chunks are its chunks), each non-tensor item a uint8 tensor of its
``torch.save`` bytes, listed in the manifest's metrics under ``"dcp.bytes"``. So
``ckptstore.load`` of one gives a flat ``{fqn: tensor}`` of full tensors, and
``consolidate`` and ``export`` work on it too.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import threading
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from . import format as fmt
from . import names
from .checkpoint.commit import commit
from .checkpoint.flatten import global_skeleton
from .checkpoint.references import resolve
from .checkpoint.reshard import READ_BATCH_BYTES
from .checkpoint.indexes import expand
from .checkpoint.manifests import latest_manifest
from .checkpoint.restore import read_regions
from .checkpoint.votes import write_vote
from .codecs import CompressionPolicy
from .errors import CkptStoreError, FormatError
from .pipeline import RankWriter
from .runtime import runtime
from .storage import Storage, open_storage

BYTES_METRIC = "dcp.bytes"  # the manifest metric listing the keys that hold pickled objects
# Items hashed and encoded ahead of the file at most: a save of GPU state holds no more
# host copies than this at once (DCP's own writer streams too).
WRITE_AHEAD_BYTES = 256 << 20

# Attempts this process has written: DCP's plan caching (DefaultSavePlanner(
# enable_plan_caching=True)) hands a rank its earlier plan back, slot and all; writing
# that attempt again would overwrite a committed checkpoint's files.
_written_attempts: set[str] = set()
_written_lock = threading.Lock()


@dataclass(frozen=True)
class _Slot:
    """What the coordinator's global plan tells each rank (``SavePlan.storage_data``)."""

    attempt: str
    rank: int
    world_size: int


@dataclass(frozen=True)
class StoredItem:
    """A ``WriteResult.storage_data``: where the item's blob went (informational; the
    manifest is what a load reads)."""

    file: str
    offset: int
    length: int
    raw_length: int


def _location(url, step: int | None, storage_options: dict | None) -> Storage:
    if url is None:
        raise ValueError("ckptstore.dcp needs a location: Writer(url) or dcp.save(..., checkpoint_id=url)")
    storage = open_storage(os.fspath(url), **(storage_options or {}))
    return storage if step is None else storage.child(names.step_dir_name(step))


def _raw(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor, row-major."""
    t = t.detach().contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


class Writer(StorageWriter):
    """``dcp.save(state, storage_writer=ckptstore.dcp.Writer(url))``.

    ``url``: the checkpoint's location (a path or ``s3://`` URL; or ``checkpoint_id``
    given to ``dcp.save``); with ``step`` it is a store and the checkpoint goes to its
    ``step-N`` directory, so retention (``ckptstore gc --keep-...``) orders it by step.
    ``compression`` as for ``ckptstore.save``.
    """

    def __init__(self, url: str | os.PathLike | None = None, *, step: int | None = None,
                 compression: str | CompressionPolicy = "auto", storage_options: dict | None = None,
                 commit_timeout: float = 600.0):
        super().__init__()
        self.url = url
        self.step = step
        self.policy = compression if isinstance(compression, CompressionPolicy) else CompressionPolicy(compression)
        self.storage_options = storage_options
        self.commit_timeout = commit_timeout
        self._slot: _Slot | None = None
        self._shards: dict[str, fmt.TensorEntry] = {}
        self._created_at = ""

    # -- DCP's StorageWriter
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.url = checkpoint_id
        self._slot, self._shards = None, {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        if kwargs.get("use_collectives") is False and (kwargs.get("rank") or 0) != 0:
            raise ValueError("ckptstore.dcp.Writer needs DCP's collectives (use_collectives=True) on more than one rank")
        self._created_at = fmt.utc_now()

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        attempt = names.new_attempt_id()
        return [dataclasses.replace(p, storage_data=_Slot(attempt, i, len(plans))) for i, p in enumerate(plans)]

    def write_data(self, plan, planner) -> Future:
        slot = plan.storage_data
        if not isinstance(slot, _Slot):
            raise CkptStoreError("ckptstore.dcp.Writer: the plan carries no slot (was prepare_global_plan skipped?)")
        with _written_lock:
            if slot.attempt in _written_attempts:
                raise CkptStoreError("ckptstore.dcp.Writer: this rank's plan names an attempt it already wrote "
                                     "(DCP's plan caching, enable_plan_caching=True, reuses plans); use a planner "
                                     "without plan caching")
            _written_attempts.add(slot.attempt)
        self._slot = slot
        storage = self._storage()
        rt = runtime()
        writer = RankWriter(storage, slot.attempt, slot.rank, self.policy, rt, writers=slot.world_size)
        writer.size_hint = _planned_bytes(plan.items)
        chunks: dict[str, list[fmt.Chunk]] = {}
        shapes: dict[str, tuple[str, tuple[int, ...]]] = {}
        results = []
        pending = []  # (item, offsets, sizes, raw bytes, future blob): hashed and encoded on the workers
        ahead = done = 0

        def collect(entry) -> int:
            item, offsets, sizes, nbytes, future = entry
            blob = future.result()
            chunks.setdefault(item.index.fqn, []).append(fmt.Chunk(offsets, sizes, blob))
            results.append(WriteResult(index=item.index, size_in_bytes=blob.length,
                                       storage_data=StoredItem(blob.file, blob.offset, blob.length, blob.raw_length)))
            return nbytes

        try:
            for item in plan.items:
                fqn = item.index.fqn
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    raw = memoryview(data.getbuffer() if isinstance(data, io.BytesIO) else bytes(data))
                    offsets, sizes, shape, dtype, itemsize = (0,), (len(raw),), (len(raw),), torch.uint8, 1
                else:
                    t = data.detach()
                    t = t if t.device.type == "cpu" else t.to("cpu")
                    chunk = item.tensor_data.chunk
                    offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
                    shape, dtype, itemsize = tuple(item.tensor_data.size), t.dtype, t.element_size()
                    if tuple(t.shape) != sizes:
                        raise FormatError(f"DCP item {fqn!r}: data of shape {list(t.shape)} for a chunk of {list(sizes)}")
                    raw = _raw(t)
                shapes[fqn] = (fmt.dtype_name(dtype), shape)
                pending.append((item, offsets, sizes, len(raw),
                                rt.workers.submit(writer.store_blob, raw, itemsize, ("dcp", fqn, offsets))))
                ahead += len(raw)
                while ahead > WRITE_AHEAD_BYTES and done < len(pending):
                    ahead -= collect(pending[done])
                    done += 1
            while done < len(pending):
                collect(pending[done])
                done += 1
            # Every rank but the committer votes; the committer's skeleton, naming every
            # item, waits for finish, where the global metadata is known.
            skeleton = None if slot.rank == 0 else writer.store_blob(memoryview(global_skeleton({})), 1)
            writer.close()
        except BaseException:
            for *_, future in pending:  # none may still append once the file is aborted
                future.cancel() or future.exception()
            writer.abort()
            raise
        self._shards = {k: fmt.TensorEntry(shapes[k][0], shapes[k][1], tuple(sorted(v, key=lambda c: c.offsets)))
                        for k, v in chunks.items()}
        if slot.rank != 0:
            write_vote(storage, fmt.Vote(slot.attempt, self.step, slot.world_size, slot.rank, ok=True,
                                         state=fmt.RankState(slot.rank, skeleton, {}), shards=self._shards))
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results) -> None:
        slot = self._slot
        if slot is None or slot.rank != 0:
            raise CkptStoreError("ckptstore.dcp.Writer: finish must run on rank 0 (DCP's coordinator_rank=0)")
        storage = self._storage()
        entries, pickled = {}, []
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, BytesStorageMetadata):
                stored = [r.storage_data for rank in results for r in rank if r.index.fqn == fqn]
                if len(stored) != 1:
                    raise CkptStoreError(f"DCP item {fqn!r} was written {len(stored)} times, not once")
                entries[fqn] = (torch.uint8, (stored[0].raw_length,))
                pickled.append(fqn)
            else:
                entries[fqn] = (md.properties.dtype, tuple(md.size))
        skeleton_writer = RankWriter(storage, slot.attempt, 0, CompressionPolicy("none"), runtime(), stream=1)
        skeleton = skeleton_writer.store_blob(memoryview(global_skeleton(entries)), 1)
        skeleton_writer.close()
        own = fmt.Vote(slot.attempt, self.step, slot.world_size, 0, ok=True,
                       state=fmt.RankState(0, skeleton, {}), shards=self._shards)
        commit(storage, own, slot.world_size, self._created_at, {BYTES_METRIC: sorted(pickled)},
               self.commit_timeout, retire_files=self.step is None)  # (a store's step: gc judges old files)

    def storage_meta(self):
        return None

    def _storage(self) -> Storage:
        return _location(self.url, self.step, self.storage_options)


def _planned_bytes(items) -> int:
    """The raw bytes of a plan's tensor items (the data file's size hint; byte items,
    small, are left to the store's margin)."""
    total = 0
    for item in items:
        data = getattr(item, "tensor_data", None)
        if data is not None:
            total += math.prod(data.chunk.sizes) * data.properties.dtype.itemsize
    return total


class Reader(StorageReader):
    """``dcp.load(state, storage_reader=ckptstore.dcp.Reader(url))``: reads the newest
    committed generation at ``url`` (or its ``step-N`` with ``step``), each chunk's
    xxh3-128 checked before any byte reaches the state. Works on any ckptstore
    checkpoint whose tensors are global (saved by ``Writer`` or by ``Store.save`` of
    DTensors)."""

    def __init__(self, url: str | os.PathLike | None = None, *, step: int | None = None,
                 storage_options: dict | None = None):
        super().__init__()
        self.url = url
        self.step = step
        self.storage_options = storage_options
        self._manifest: fmt.Manifest | None = None

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.url = checkpoint_id
        self._manifest = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def _read(self) -> tuple[Storage, fmt.Manifest]:
        storage = _location(self.url, self.step, self.storage_options)
        if self._manifest is None:  # (a version 4 root with every index read: DCP's metadata holds every chunk)
            self._manifest = expand(storage, latest_manifest(storage))
        return resolve(storage, self._manifest)

    def read_metadata(self, *args, **kwargs) -> Metadata:
        self._manifest = None  # each load reads the newest generation afresh
        _, manifest = self._read()
        pickled = set(manifest.metrics.get(BYTES_METRIC, ())) if isinstance(
            manifest.metrics.get(BYTES_METRIC), list) else set()
        sd: dict = {}
        storage_data: dict = {}
        for fqn, entry in manifest.tensors.items():
            if fqn in pickled:
                sd[fqn] = BytesStorageMetadata()
                storage_data[MetadataIndex(fqn)] = fqn
                continue
            sd[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=fmt.dtype_from_name(entry.dtype)),
                size=torch.Size(entry.shape),
                chunks=[ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes))
                        for c in entry.chunks])
            for c in entry.chunks:
                storage_data[MetadataIndex(fqn, torch.Size(c.offsets))] = fqn
        return Metadata(state_dict_metadata=sd, planner_data={k: (k,) for k in sd}, storage_data=storage_data)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        pass

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def read_data(self, plan, planner) -> Future:
        storage, manifest = self._read()
        requests, items, batch_bytes = [], [], 0
        for item in plan.items:
            fqn = item.storage_index.fqn
            entry = manifest.tensors.get(fqn)
            if entry is None:
                raise CkptStoreError(f"{storage.describe()}: the checkpoint holds no item {fqn!r}")
            if item.type == LoadItemType.BYTE_IO:
                offsets, sizes = (0,), tuple(entry.shape)
            else:
                base = tuple(item.storage_index.offset or (0,) * len(entry.shape))
                offsets = tuple(b + o for b, o in zip(base, item.storage_offsets))
                sizes = tuple(item.lengths)
            requests.append((entry, f"{storage.describe()} item {fqn!r}", offsets, sizes))
            items.append(item)
            batch_bytes += math.prod(sizes) * fmt.dtype_from_name(entry.dtype).itemsize
            if batch_bytes >= READ_BATCH_BYTES:  # bounded temporaries: not the rank's whole state at once
                self._deliver(storage, planner, requests, items)
                requests, items, batch_bytes = [], [], 0
        self._deliver(storage, planner, requests, items)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    @staticmethod
    def _deliver(storage: Storage, planner, requests: list, items: list) -> None:
        """Read the regions (chunks in parallel, each hash checked) and hand them to DCP."""
        for item, region in zip(items, read_regions(storage, requests, runtime().readers)):
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(region.numpy().tobytes()))
                continue
            target = planner.resolve_tensor(item).detach()
            with torch.no_grad():
                target.copy_(region.reshape(target.shape))
            planner.commit_tensor(item, target)


__all__ = ["BYTES_METRIC", "Reader", "StoredItem", "Writer"]
