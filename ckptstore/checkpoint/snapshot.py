"""The blocking part of a save: walk the object and copy every tensor's bytes into
staging buffers, handing each filled buffer to the background writer."""

from __future__ import annotations

import torch

from .. import format as fmt
from ..pipeline import RankWriter
from ..staging import StagingPool, copy_into
from .flatten import StorageRef, flatten, plan_chunks

DEFAULT_CHUNK_BYTES = 16 << 20


def snapshot(obj, writer: RankWriter, pool: StagingPool, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
             pickle_protocol: int = 2) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Stage ``obj``; returns {tensor key: (dtype name, shape)} for the manifest.

    When this returns, every byte the checkpoint will hold sits in staging memory (or
    is already written), so the caller may modify its tensors.
    """
    limit = max(1, min(chunk_bytes, pool.capacity))
    entries: dict[str, tuple[str, tuple[int, ...]]] = {}

    def on_storage(ref: StorageRef) -> None:
        entries[ref.key] = (fmt.dtype_name(ref.dtype), ref.shape)
        itemsize = ref.dtype.itemsize
        for offsets, sizes, byte_off, nbytes in plan_chunks(ref.shape, itemsize, limit):
            if writer.failed is not None:
                raise writer.failed  # stop staging a save that cannot commit
            buf = pool.acquire(nbytes)
            try:
                _copy_storage_bytes(buf, ref.storage, byte_off, nbytes)
            except BaseException:
                pool.release(buf)
                raise
            writer.submit_chunk(ref.key, offsets, sizes, itemsize, buf)

    skeleton = flatten(obj, on_storage, pickle_protocol)
    writer.submit_skeleton(skeleton)
    return entries


def _copy_storage_bytes(buf, storage: torch.UntypedStorage, byte_off: int, nbytes: int) -> None:
    if storage.device.type == "cpu":
        copy_into(buf, storage.data_ptr() + byte_off, nbytes)
        return
    # Device memory: a byte view of the storage region, copied by the device runtime.
    src = torch.empty(0, dtype=torch.uint8, device=storage.device)
    src.set_(storage, byte_off, (nbytes,), (1,))
    buf.tensor.copy_(src, non_blocking=False)
