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
from ..errors import FormatError
from ..storage import Storage
from .flatten import _is_dtensor
from .restore import read_region


def fill_template(template, loaded, manifest: fmt.Manifest, storage: Storage, pool):
    """Fill ``template``'s tensors in place from the checkpoint and return it, with its
    non-tensor values replaced by the loaded ones. ``loaded`` is the rank's object as
    restored with its global tensors as meta placeholders."""
    where = storage.describe()

    def fill_tensor(t: torch.Tensor, path: str, old):
        entry = manifest.tensors.get(path)
        if entry is None:
            if not isinstance(old, torch.Tensor) or old.is_meta:
                raise FormatError(f"{where}: the checkpoint holds no tensor {path!r} for the template")
            if tuple(old.shape) != tuple(t.shape):
                raise FormatError(f"{where}: tensor {path!r} has shape {list(old.shape)} in the checkpoint, "
                                  f"{list(t.shape)} in the template")
            with torch.no_grad():
                (t.to_local() if _is_dtensor(t) else t).copy_(old)
            return t
        if tuple(entry.shape) != tuple(t.shape):
            raise FormatError(f"{where}: tensor {path!r} has shape {list(entry.shape)} in the checkpoint, "
                              f"{list(t.shape)} in the template")
        what = f"{where}: tensor {path!r}"
        if _is_dtensor(t):
            chunks = t.__create_chunk_list__()
            local = t.to_local()
            for c in chunks:
                region = read_region(storage, entry, what, tuple(c.offsets), tuple(c.sizes), pool)
                with torch.no_grad():
                    local.copy_(region.reshape(local.shape).to(local.dtype))
        else:
            region = read_region(storage, entry, what, (0,) * len(entry.shape), tuple(entry.shape), pool)
            with torch.no_grad():
                t.copy_(region.to(t.dtype))
        return t

    def visit(t, old, path: str):
        if isinstance(t, torch.Tensor):
            return fill_tensor(t, path, old)
        if isinstance(t, Mapping):
            if not isinstance(old, Mapping):
                raise FormatError(f"{where}: {path or 'the state'} is a mapping in the template, "
                                  f"{type(old).__name__} in the checkpoint")
            missing = [k for k in t if k not in old and not _holds_global(manifest, _join(path, k))]
            if missing:
                raise FormatError(f"{where}: the checkpoint lacks {[_join(path, k) for k in missing]}")
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

    return visit(template, loaded, "")


def _join(path: str, key) -> str:
    return f"{path}.{key}" if path else str(key)


def _holds_global(manifest: fmt.Manifest, path: str) -> bool:
    return path in manifest.tensors
