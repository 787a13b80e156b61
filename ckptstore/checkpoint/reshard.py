"""Loading into a template: fill a state dict of DTensors (or plain tensors) on any
world size, each rank reading only the chunks that overlap its own shards.

The template decides the layout: its DTensors say which region each rank needs, its
plain tensors need the whole tensor. Values that are not tensors come from the
checkpoint (the saving rank's own object), as ``torch.distributed.checkpoint.load``
does for its state dicts.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, MutableSequence

import torch

from .. import format as fmt
from ..errors import TemplateMismatchError
from ..storage import Storage
from .flatten import _is_dtensor, dtensor_boxes
from .restore import read_regions

# Template reads are issued in batches of about this many bytes: one batch's chunks are
# read in parallel and small neighbours coalesced, while the temporary region tensors
# held at once stay bounded (a whole rank's state at once would double its memory).
READ_BATCH_BYTES = 256 << 20


def fill_template(template, loaded, manifest: fmt.Manifest, storage: Storage, pool):
    """Fill ``template``'s tensors in place from the checkpoint and return it, with its
    non-tensor values replaced by the loaded ones. ``loaded`` is the rank's object as
    restored with its global tensors as meta placeholders."""
    where = storage.describe()
    batch: list[tuple] = []  # (entry, what, offsets, sizes, destination view, key)
    batch_bytes = 0
    ensure = getattr(manifest.tensors, "ensure", None)  # a version 4 root's: reads the indexes holding them

    def read_batch() -> None:
        nonlocal batch, batch_bytes
        pending, batch, batch_bytes = batch, [], 0
        if ensure is not None:
            ensure([(key, offsets, sizes) for _, _, offsets, sizes, _, key in pending])
            pending = [(manifest.tensors[key], *rest) for _, *rest, key in pending]
        regions = read_regions(storage, [r[:4] for r in pending], pool)
        with torch.no_grad():
            for (_, _, _, _, dst, *_), region in zip(pending, regions):
                dst.copy_(region.reshape(dst.shape).to(dst.dtype))

    def fill(dst: torch.Tensor, entry: fmt.TensorEntry, what: str, offsets, sizes, key: str) -> None:
        nonlocal batch_bytes
        batch.append((entry, what, tuple(offsets), tuple(sizes), dst, key))
        batch_bytes += dst.numel() * dst.element_size()
        if batch_bytes >= READ_BATCH_BYTES:
            read_batch()

    def fill_tensor(t: torch.Tensor, path: str, old):
        entry = manifest.tensors.get(path)
        if entry is None:
            if not isinstance(old, torch.Tensor) or old.is_meta:
                raise TemplateMismatchError(f"{where}: the checkpoint holds no tensor {path!r} for the template")
            if tuple(old.shape) != tuple(t.shape):
                raise TemplateMismatchError(f"{where}: tensor {path!r} has shape {list(old.shape)} in the checkpoint, "
                                  f"{list(t.shape)} in the template")
            with torch.no_grad():
                if _is_dtensor(t):  # a rank-local tensor saved whole: each box takes its region of it
                    local = t.to_local()
                    for box in dtensor_boxes(t, f"{where}: cannot load into DTensor {path!r} of the template"):
                        local[box.index].copy_(old[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))])
                else:
                    t.copy_(old)
            return t
        if tuple(entry.shape) != tuple(t.shape):
            raise TemplateMismatchError(f"{where}: tensor {path!r} has shape {list(entry.shape)} in the checkpoint, "
                              f"{list(t.shape)} in the template")
        what = f"{where}: tensor {path!r}"
        if _is_dtensor(t):
            local = t.to_local()
            boxes = dtensor_boxes(t, f"{where}: cannot load into DTensor {path!r} of the template")
            for box in boxes:  # several for a _StridedShard layout scattered over the tensor
                fill(local[box.index], entry, what, box.offsets, box.sizes, path)
        else:
            fill(t, entry, what, (0,) * len(entry.shape), tuple(entry.shape), path)
        return t

    def visit(t, old, path: str):
        if isinstance(t, torch.Tensor):
            return fill_tensor(t, path, old)
        if isinstance(t, Mapping):
            if not isinstance(old, Mapping):
                raise TemplateMismatchError(f"{where}: {path or 'the state'} is a mapping in the template, "
                                  f"{type(old).__name__} in the checkpoint")
            missing = [k for k in t if k not in old and not _holds_global(manifest, _join(path, k))]
            if missing:
                raise TemplateMismatchError(f"{where}: the checkpoint lacks {[_join(path, k) for k in missing]}")
            result = {k: visit(v, old.get(k), _join(path, k)) for k, v in t.items()}
            if isinstance(t, MutableMapping):
                for k, v in result.items():
                    t[k] = v
                for k, v in old.items():  # values the template did not know of
                    if k not in t:
                        t[k] = v
                return t
            return type(t)(result)
        if isinstance(t, (list, tuple)) and isinstance(old, (list, tuple)) and len(t) == len(old):
            items = [visit(v, o, _join(path, i)) for i, (v, o) in enumerate(zip(t, old))]
            if isinstance(t, MutableSequence):
                t[:] = items
                return t
            return type(t)(items) if not hasattr(t, "_fields") else type(t)(*items)
        return old  # not a tensor: the checkpoint's value

    result = visit(template, loaded, "")
    if batch:
        read_batch()
    return result


def _join(path: str, key) -> str:
    return f"{path}.{key}" if path else str(key)


def _holds_global(manifest: fmt.Manifest, path: str) -> bool:
    return path in manifest.tensors
