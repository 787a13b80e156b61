"""The blocking part of a save: walk the object and copy every tensor's bytes into
staging buffers, handing each filled buffer to the background writer.

Rank-local tensors are written by their rank. Global tensors are written once in
total: a DTensor shard by one of the ranks holding it (chosen by a hash of the chunk
among the replicas, i.e. the ranks that differ only along Replicate mesh dimensions),
a tensor declared replicated by the rank a greedy, size-balanced assignment picks.
Every rank computes the same choice from what it already knows: no communication.
Replicas that do not write still hash their copy, so the commit can check that the
copies agree.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import math
import pickle
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch
import xxhash

from .. import format as fmt
from ..pipeline import RankWriter
from .._gc import gc_paused
from ..staging import StagingCopier, StagingPool
from .capture import Captured, capture, pickle_captured
from .dtype_record import dtype_record
from .flatten import (
    GLOBAL,
    LOCAL,
    DTensorRef,
    StorageRef,
    dtensor_boxes,
    local_tensor,
    entry_shape,
    flatten,
    plan_chunks,
    tensor_paths,
)

DEFAULT_CHUNK_BYTES = 16 << 20


@dataclass
class Snapshot:
    """Shapes and dtypes of what was staged, for the vote."""

    local: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    shards: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    holders: dict[str, int] = field(default_factory=dict)  # global key -> ranks holding each of its chunks


def snapshot(obj, writer: RankWriter, pool: StagingPool | Callable[[frozenset], StagingPool],
             chunk_bytes: int = DEFAULT_CHUNK_BYTES, pickle_protocol: int = 2, *, rank: int = 0,
             world_size: int = 1, replicated: list[str] | tuple[str, ...] = (), pickle_module=pickle,
             stream=None, warn_unsafe: bool = True) -> Snapshot:
    """Stage ``obj``. When this returns, every byte the checkpoint will hold sits in
    staging memory (or is already written), so the caller may modify its tensors.
    ``pickle_module`` pickles the skeleton, as in torch.save; ``warn_unsafe``: flatten's.

    ``pool``: the staging pool, or a function of the set of CUDA device indexes the
    state's tensors live on that returns it (``Runtime.staging_pool``: pinned only for
    CUDA states). CUDA is touched only when that set is not empty, and then with its
    lowest device current (restored after), so no call makes a context on another
    GPU. ``stream``: what the device copies wait for (``check_stream``'s forms; None:
    each device's current stream)."""
    out = Snapshot()
    patterns = tuple(replicated)
    is_replicated = (lambda path: any(fnmatch.fnmatchcase(path, p) for p in patterns)) if patterns else None

    def stage(key: str, shape, offset0, itemsize: int, scope: str, writes, copy) -> None:
        """Stage a tensor chunk by chunk; ``copy(offsets, sizes, byte offset, nbytes,
        then)`` copies one chunk into a buffer and hands it to ``then``."""
        for offsets, sizes, byte_off, nbytes in plan_chunks(tuple(shape), itemsize, limit):
            _before_staging(writer, pool, nbytes)
            goff = tuple(o + d for o, d in zip(offsets, offset0))
            write = writes(goff, nbytes)
            copy(offsets, sizes, byte_off, nbytes, lambda buf, goff=goff, sizes=sizes, write=write:
                 writer.submit_chunk(key, goff, sizes, itemsize, buf, scope, write))

    def from_storage(storage, base: int):
        """``stage``'s copy for a contiguous tensor: byte ranges of its storage."""
        return lambda _offsets, _sizes, byte_off, nbytes, then: copier.copy(storage, base + byte_off, nbytes, then)

    def by_strides(part):
        """``stage``'s copy for a non-contiguous tensor: each chunk copied by strides (no
        .contiguous() of the whole: on a full GPU it may not fit)."""
        return lambda offsets, sizes, _byte_off, _nbytes, then: copier.copy_strided(
            part[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))], then)

    hidden: set[int] = set()  # CUDA devices of storages only the pickling found

    def on_storage(ref: StorageRef) -> None:
        if not devices and ref.storage.device.type == "cuda":
            hidden.add(ref.storage.device.index)
        entry = (fmt.dtype_name(ref.dtype), ref.shape)
        zero = (0,) * len(ref.shape)
        if ref.scope == LOCAL:
            out.local[ref.key] = entry
            stage(ref.key, ref.shape, zero, ref.dtype.itemsize, LOCAL, _writes_all, from_storage(ref.storage, 0))
        else:
            out.shards[ref.key] = entry
            out.holders[ref.key] = world_size

            def writes(offsets, nbytes, key=ref.key):
                owner = assignment.get((key, offsets))
                if owner is None:
                    owner = _stable_hash(key, offsets) % world_size
                return owner == rank

            stage(ref.key, ref.shape, zero, ref.dtype.itemsize, GLOBAL, writes, from_storage(ref.storage, 0))

    meshes: dict = {}  # id(mesh) -> its coordinate and shape (dtensor_boxes)
    writers: dict = {}  # (id(mesh), placements) -> _writes_dtensor_replica's answer

    def writes_of(dt):
        memo_key = (id(dt.device_mesh), dt.placements)
        try:
            found = writers.get(memo_key)
        except TypeError:  # a placement that cannot be hashed
            return _writes_dtensor_replica(dt)
        if found is None:
            found = writers[memo_key] = _writes_dtensor_replica(dt)
        return found

    def on_dtensor(ref: DTensorRef, pack=None) -> None:
        """Stage a DTensor's local boxes; ``pack(key, local, box, itemsize, writes)``,
        when given, may take a DTensor of one small box into a pack instead (True)."""
        dt = ref.dtensor
        out.shards[ref.key] = (fmt.dtype_name(dt.dtype), tuple(dt.shape))
        # Where the local tensor's elements lie in the global tensor, from the placements
        # (a _StridedShard layout may scatter them over several boxes).
        boxes = dtensor_boxes(dt, f"cannot save DTensor {ref.key!r}", meshes)
        if not boxes:
            return
        local = local_tensor(dt)
        mine, out.holders[ref.key] = writes_of(dt)
        itemsize = dt.dtype.itemsize
        if pack is not None and len(boxes) == 1 and pack(ref.key, local, boxes[0], itemsize, mine):
            return
        for box in boxes:
            part = local[box.index]
            copy = from_storage(part.untyped_storage(), part.storage_offset() * itemsize) if part.is_contiguous() \
                else by_strides(part)
            stage(ref.key, box.sizes, box.offsets, itemsize, GLOBAL, lambda o, n: mine(ref.key, o), copy)

    # The walks make many new objects: one pause of the collector from the walk to the
    # hand-over, so no collection walks them meanwhile. The pause is process-wide: while
    # the caller waits here for a pool buffer, other threads allocate with the collector
    # off until a worker frees one (a pack's write).
    plain_pickle = pickle_module is pickle and pickle_protocol == 2
    with gc_paused(), contextlib.ExitStack() as stack:
        captured = capture(obj) if plain_pickle and not patterns else None  # None for any CUDA tensor
        paths = tensor_paths(obj) if captured is None else None
        devices = cuda_devices(*paths) if paths is not None else frozenset()
        if devices:  # pinning and the copies then run under a device the state is on
            stack.enter_context(torch.cuda.device(min(devices)))
            if isinstance(stream, torch.cuda.Stream) and devices != {stream.device.index}:
                raise ValueError(f"save: stream= is a stream of cuda:{stream.device.index}, but the state holds "
                                 f"tensors on cuda:{sorted(devices)}: pass {{device index: stream}}")
        pool_for = pool if callable(pool) else None
        if pool_for is not None:
            pool = pool_for(devices)
        if not devices and pool.pin_memory and pool.device is not None:
            # CPU tensors into a pinned pool (the process saved CUDA tensors before): a
            # slab it adds is page-locked under the pool's device, not under GPU 0.
            stack.enter_context(torch.cuda.device(pool.device))
        writer.pool = pool  # where the writer returns the buffers
        limit = max(1, min(chunk_bytes, pool.capacity))
        assignment = _assign_replicated(paths[0], is_replicated, limit, world_size) if patterns else {}
        # The copier batches the copies (CPU: one parallel memcpy per batch; CUDA: one
        # device-to-host transfer per batch on a staging stream). ``before_wait`` starts
        # the workers before it waits for the pool, since only they free buffers.
        # On a clean exit every byte has landed and every buffer is with the writer.
        copier = stack.enter_context(StagingCopier(pool, before_wait=writer.flush, stream=stream))
        if captured is None:
            skeleton = flatten(obj, on_storage, pickle_protocol, on_dtensor=on_dtensor, replicated=is_replicated,
                               pickle_module=pickle_module, paths=paths, on_paths=lambda found, dtensors: _hint_size(
                                   writer, functools.partial(_tensor_bytes, found, dtensors)), warn_unsafe=warn_unsafe)
        else:
            _hint_size(writer, functools.partial(_captured_bytes, captured))
            _stage_captured(captured, out, writer, copier, on_storage, on_dtensor, limit)
            frozen, n = captured.frozen, len(captured.storages)  # not the storages: the worker needs none
            skeleton = lambda: pickle_captured(frozen, n)  # noqa: E731 (a worker calls it)
    # The skeleton ends with the dtypes of the rank's tensors (dtype_record.py): the
    # manifest's alone are not covered by any hash. (On the worker: out.local is whole.)
    writer.submit_skeleton(lambda: (skeleton() if callable(skeleton) else skeleton) + dtype_record(out.local))
    if hidden and pool_for is not None and not pool.pin_memory:
        _pin_for_next_saves(pool_for, frozenset(hidden))
    return out


_warned_hidden = False


def _pin_for_next_saves(pool_for, devices: frozenset) -> None:
    """CUDA tensors that only pickling found (inside a custom object or a module) were
    staged through pageable memory, by synchronous copies: get the pinned pool ready for
    the next saves, and say so once."""
    global _warned_hidden
    with torch.cuda.device(min(devices)):
        pool_for(devices)
    if not _warned_hidden:
        _warned_hidden = True
        warnings.warn("ckptstore: this save's CUDA tensors sit inside objects that only pickling looks into (a "
                      "module, a custom class), so it staged them through pageable memory, by synchronous "
                      "copies; later saves use pinned memory. Saving state_dict()s finds them up front.",
                      RuntimeWarning, stacklevel=4)


def cuda_devices(found: dict, dtensors: dict) -> frozenset:
    """The CUDA device indexes of ``tensor_paths``' tensors and DTensors' local tensors."""
    devices = {t.device.index for _path, t in found.values() if t.device.type == "cuda"}
    for _path, dt in dtensors.values():
        device = local_tensor(dt).device
        if device.type == "cuda":
            devices.add(device.index)
    return frozenset(devices)


def _hint_size(writer: RankWriter, raw_bytes) -> None:
    """Tell the writer how large its data file will be, then have it open the file on
    an I/O thread while the caller stages (RankWriter.open_soon): ``raw_bytes()``, the
    raw bytes staged (the S3 store picks its part size from it), counted by the thread
    that opens the file, not the training thread (about 0.6 us a tensor). An upper
    bound but for the skeleton and indexes (small, and the store adds a margin):
    compression only shrinks, references and other ranks' shares of global tensors are
    not written. Tensors that only pickling finds (inside custom objects) are missed:
    the store then grows its parts past the estimate."""
    writer.size_hint = raw_bytes
    writer.open_soon()


def _before_staging(writer: RankWriter, pool: StagingPool, nbytes: int) -> None:
    """Before staging ``nbytes`` more: stop a save that cannot commit, and start the
    held-back workers once the pool is half full (only they free its buffers)."""
    if writer.failed is not None:
        raise writer.failed
    if pool.in_use + nbytes > pool.capacity // 2:
        writer.flush()


def _captured_bytes(captured: Captured) -> int:
    total = sum(math.prod(dims) * dtype.itemsize for _key, _ptr, dtype, *dims in captured.storages)
    return total + sum(_local_bytes(ref.dtensor) for ref in captured.dtensors)


def _tensor_bytes(found: dict, dtensors: dict) -> int:
    total = sum(tensor.untyped_storage().nbytes() for _path, tensor in found.values())
    return total + sum(_local_bytes(dt) for _path, dt in dtensors.values())


def _local_bytes(dt) -> int:
    """The bytes a DTensor's local tensor stages."""
    local = local_tensor(dt)
    return local.numel() * local.element_size()


PACK_BYTES = 4 << 20  # small tensors are copied and handed over in buffers of about this much
SMALL_TENSOR_BYTES = 1 << 20  # at most this size, a tensor goes into a pack


def _stage_captured(captured: Captured, out: Snapshot, writer: RankWriter, copier: StagingCopier, on_storage,
                    on_dtensor, limit: int) -> None:
    """Stage a captured state's storages and DTensors: the small ones packed into
    shared buffers (one reservation, copy and hand-over per pack, not per tensor), the
    others by ``flatten``'s callbacks ``on_storage`` and ``on_dtensor``, in chunks."""
    pack_limit = min(PACK_BYTES, limit)
    small = min(SMALL_TENSOR_BYTES, pack_limit)
    entries: list[tuple] = []
    pointers: list[int] = []
    sizes: list[int] = []
    packed = 0

    def send() -> None:
        nonlocal entries, pointers, sizes, packed
        _before_staging(writer, copier.pool, packed)
        pack = entries
        copier.gather(pointers, sizes, lambda buf: writer.submit_pack(buf, pack))
        entries, pointers, sizes, packed = [], [], [], 0

    def add(ptr: int, key: str, nbytes: int, itemsize: int, shape: tuple, *box) -> None:
        nonlocal packed
        if packed + nbytes > pack_limit:
            send()
        entries.append((key, packed, nbytes, itemsize, shape, *box))
        pointers.append(ptr)
        sizes.append(nbytes)
        packed += nbytes

    def pack_dtensor(key: str, local, box, itemsize: int, mine) -> bool:
        """A DTensor whose local tensor is one small, contiguous box: packed."""
        nbytes = local.numel() * itemsize
        if nbytes == 0 or nbytes > small or box.sizes != tuple(local.shape) or not local.is_contiguous():
            return False
        add(local.data_ptr(), key, nbytes, itemsize, box.sizes, box.offsets, mine(key, box.offsets))
        return True

    for index, (key, ptr, dtype, *dims) in enumerate(captured.storages):
        shape = tuple(dims)
        itemsize = dtype.itemsize
        nbytes = math.prod(shape) * itemsize
        if nbytes == 0 or nbytes > small:
            on_storage(captured.ref(index))  # (nothing to stage for an empty one)
            continue
        out.local[key] = (fmt.dtype_name(dtype), shape)
        add(ptr, key, nbytes, itemsize, shape)
    for ref in captured.dtensors:
        on_dtensor(ref, pack_dtensor)
    if entries:
        send()


def _writes_all(offsets, nbytes) -> bool:
    return True


def _stable_hash(key: str, offsets) -> int:
    return xxhash.xxh3_64_intdigest(f"{key}|{tuple(offsets)}".encode())


def _writes_dtensor_replica(dt):
    """A predicate (key, chunk offsets) -> does this rank write that chunk, and the
    number of ranks holding each chunk (the replicas).

    The replicas of a shard are the ranks that differ only along the mesh dimensions
    the DTensor is replicated over: its Replicate placements and, for a DTensor on a
    submesh (say ``mesh["tp"]`` of a ("dp", "tp") mesh), the root mesh's other
    dimensions, whose sibling submeshes hold the same data.
    """
    mesh = dt.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        return (lambda key, offsets: False), 1
    replicated = [(mesh.size(i), coord[i]) for i, p in enumerate(dt.placements) if p.is_replicate()]
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    if root is not mesh and root.mesh_dim_names and mesh.mesh_dim_names:
        root_coord = root.get_coordinate()
        for j, name in enumerate(root.mesh_dim_names):
            if name not in mesh.mesh_dim_names:
                replicated.append((root.size(j), root_coord[j]))
    if not replicated:
        return (lambda key, offsets: True), 1
    index = 0
    for n, c in replicated:
        index = index * n + c
    replicas = math.prod(n for n, _ in replicated)
    return (lambda key, offsets: _stable_hash(key, offsets) % replicas == index), replicas


def _assign_replicated(paths: dict, is_replicated, limit: int, world_size: int) -> dict:
    """(key, chunk offsets) -> writing rank, balancing bytes over ranks, largest first
    (``paths``: ``tensor_paths``' first map)."""
    items = []
    for path, tensor in paths.values():
        if not is_replicated(path):
            continue
        storage = tensor.untyped_storage()
        numel = storage.nbytes() // tensor.dtype.itemsize
        shape = entry_shape(tensor, numel, tensor.dtype)
        for offsets, _sizes, _b, nbytes in plan_chunks(shape, tensor.dtype.itemsize, limit):
            items.append((nbytes, path, offsets))
    items.sort(key=lambda t: (-t[0], t[1], t[2]))
    load = [0] * world_size
    owner = {}
    for nbytes, path, offsets in items:
        r = min(range(world_size), key=lambda i: (load[i], i))
        load[r] += nbytes
        owner[(path, offsets)] = r
    return owner

