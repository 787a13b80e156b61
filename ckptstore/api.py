"""The drop-in calls: ``save`` / ``load`` / ``wait``, called as torch.save and
torch.load are (a path, URL or file object; torch's own files and streams too).

Thin on purpose: every save goes through :func:`checkpoint.save.start_save` (the
blocking API is ``result()`` on the asynchronous one), every load through
:func:`checkpoint.load.load_checkpoint`. ``Store`` (store.py), ``prepare`` (warmup.py),
``LoadInfo`` and ``WorldSizeChangedWarning`` (checkpoint/load.py) and the other names
code imported from here before they moved are re-exported.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import os
import pickle
import warnings
from typing import Any

import torch

from . import lifecycle
from . import names
from .checkpoint.container import MAGIC, read_container, read_container_file, replace_file, write_container
from .checkpoint.held import Hold, references_lock
from .checkpoint.load import load_checkpoint
from .checkpoint.references import index as index_references
from .checkpoint.manifests import generations, latest_manifest, read_manifest
from .checkpoint.save import SaveFuture, SaveOptions, save_options, start_save
from .checkpoint.weights_only import resolve_weights_only
from .codecs import CompressionPolicy
from .errors import CheckpointNotFoundError, NotACheckpointError
from .runtime import runtime
from .staging.cuda import check_stream
from .storage import MemoryStorage, Storage, is_url, open_storage

# Re-exported: names that lived here, now owned by the modules they come from
from .checkpoint.load import RELOADS, LoadInfo, WorldSizeChangedWarning  # noqa: F401
from .checkpoint.walk import tensors_in  # noqa: F401
from .store import Store
from .tiers import TierFallbackWarning  # noqa: F401
from .warmup import prepare, state_nbytes  # noqa: F401

wait = lifecycle.wait


def _is_stream(f) -> bool:
    return hasattr(f, "write") or hasattr(f, "read")


def save(obj: Any, f, pickle_module: Any = pickle, pickle_protocol: int = 2,
         _use_new_zipfile_serialization: bool = True, _disable_byteorder_record: bool = False, *,
         compression: str | CompressionPolicy = "auto", commit_timeout: float = 600.0,
         chunk_bytes: int | None = None, storage_options: dict | None = None,
         incremental: bool = True, stream=None, warn_unsafe: bool = False) -> SaveFuture:
    """Save ``obj`` like ``torch.save``; returns once its tensors are staged.

    ``f`` is a local path, a ``memory://`` or (with the S3 backend) ``s3://`` URL, or a
    writable binary file object. A path that does not exist becomes a checkpoint
    directory; saving to one that holds a checkpoint makes a new generation: the old one
    stays loadable until the new one is committed. A path that holds a plain file (an
    old ``torch.save`` output, say) is replaced atomically by a single-file container,
    and a file object gets one: both are written before ``save`` returns.
    ``pickle_module`` pickles the object skeleton, as in torch.save.
    This call is not collective: in a distributed job it saves this process's object.
    ``storage_options`` go to the backend (for S3: endpoint_url, part_size, ...).
    Saving again to a checkpoint directory is incremental (``incremental=False``: not):
    a chunk unchanged since the generation it replaces is referenced, not written again.

    ``stream`` (CUDA tensors only): the stream, or ``{device index: stream}``, whose
    work the device-to-host copies wait for; default each device's current stream of
    the calling thread. Pass the stream(s) that last wrote the tensors when that is not
    the caller's current stream: a side stream, or any stream when saving from a helper
    thread (its current stream is the default one, which waits for no other stream).
    See docs/native.md, "Which stream a save waits for". A state without CUDA tensors
    ignores it and makes no CUDA call.

    torch.save's ``_use_new_zipfile_serialization`` and ``_disable_byteorder_record``
    are taken and change nothing (ckptstore writes its own format, whose manifest
    always records the byte order). Inside ``torch.serialization.skip_data()`` the
    object goes to ``torch.save`` itself (a file or stream only), whose format that
    feature is about. ``warn_unsafe=True``: warn (UnsafeForWeightsOnlyWarning) when the
    default load, weights_only=True, will refuse what was saved; torch.save, and so this,
    is silent (``Store.save`` warns).
    """
    stream = check_stream(stream, "ckptstore.save")
    if getattr(getattr(torch.serialization, "_serialization_tls", None), "skip_data", False):  # (torch >= 2.5)
        return _save_with_torch(obj, f, pickle_module, pickle_protocol, _use_new_zipfile_serialization,
                                _disable_byteorder_record)
    lifecycle.raise_earlier_failure()
    options = save_options(compression, commit_timeout, chunk_bytes, pickle_protocol)
    if not warn_unsafe:
        options = dataclasses.replace(options, warn_unsafe=False)
    if stream is not None:
        options = dataclasses.replace(options, stream=stream)
    if pickle_module is not pickle:  # SaveOptions' default is pickle
        options = dataclasses.replace(options, pickle_module=pickle_module)
    rt = runtime()
    if _is_stream(f):
        future, store = _save_in_memory(obj, rt, options)
        write_container(store, f)
        return future
    if not isinstance(f, (str, os.PathLike)):
        # torch.save's type and message, so code written for it catches this the same way
        raise AttributeError("expected 'f' to be string, path, or a file-like object with a 'write' "
                             f"attribute, got {type(f).__name__}")
    if not is_url(f) and os.path.isfile(f):
        future, store = _save_in_memory(obj, rt, options)
        replace_file(store, f)
        return future
    storage = open_storage(f, **(storage_options or {}))
    attempt = names.new_attempt_id()
    hold = Hold(storage, attempt)
    if incremental:  # read by the writer's first chunk, off the blocking part
        options = dataclasses.replace(options, references=functools.partial(_earlier_references, storage, hold))
    try:
        future = start_save(obj, storage, rt=rt, attempt=attempt, step=None, rank=0,
                            world_size=1, metrics=None, options=options)
    except BaseException:
        hold.release()  # (a worker may have read the references before staging failed)
        raise
    future.add_done_callback(hold.release)
    return lifecycle.track(future)



def _earlier_references(storage: Storage, hold: Hold) -> dict:
    """What a drop-in save may reference of the checkpoint it replaces (none: {}), held
    until the save is done (checkpoint/held.py). One listing when there is none:
    ``latest_manifest`` would list twice more to say why."""
    with references_lock(storage):
        if not generations(storage):
            return {}
        manifest = latest_manifest(storage)
        if manifest.step is not None:  # a store's step, saved over by path: its blobs are the store's
            return {}
        hold.take({manifest.attempt} | manifest.earlier_attempts())
        return index_references(manifest, 0)



def _save_with_torch(obj, f, *args) -> SaveFuture:
    """torch.save itself, to a file or stream (skip_data: a torch zip file with room left
    for the bytes); a settled future with no manifest."""
    if not _is_stream(f):
        if not isinstance(f, (str, os.PathLike)) or is_url(f) or os.path.isdir(f):
            raise ValueError(f"{f}: a save inside torch.serialization.skip_data() is torch.save's: it needs a "
                             "file path or a file object, not a checkpoint directory or URL")
    torch.save(obj, f, *args)
    future = SaveFuture(str(f), None, "")
    future._staged.set()
    future._future.set_result(None)
    return future


def _save_in_memory(obj, rt, options: SaveOptions) -> tuple[SaveFuture, MemoryStorage]:
    """The committed checkpoint of ``obj`` in a new memory store, for a container."""
    store = MemoryStorage()
    future = start_save(obj, store, rt=rt, attempt=names.new_attempt_id(), step=None, rank=0,
                        world_size=1, metrics=None, options=options)
    future.result()
    return future, store


def load(f, map_location=None, pickle_module: Any = None, *, weights_only: bool | None = None,
         mmap: bool | None = None, rank: int | None = None, storage_options: dict | None = None,
         **pickle_load_args) -> Any:
    """Load what ``save`` (or ``torch.save``) wrote, checking every byte read.

    ``map_location`` takes torch.load's forms (str, device, dict, callable). With
    ``weights_only=True`` (the default, unless ``pickle_module`` is given, as in
    torch.load) only torch's allow-list of types is rebuilt; pass ``weights_only=False``
    only for checkpoints you trust. ``pickle_module`` then unpickles the object skeleton.
    A file written by ``torch.save`` is loaded with ``torch.load`` (``mmap`` too). A
    ckptstore checkpoint is read into memory, every byte hash-checked: ``mmap=True``
    cannot apply there, and warns.
    """
    # torch.load's rules for pickle_module and weights_only (its environment variables
    # too), and its error
    weights_only, pickle_module = resolve_weights_only(weights_only, pickle_module)
    torch_kw = {"map_location": map_location, "pickle_module": pickle_module, "weights_only": weights_only,
                **({} if mmap is None else {"mmap": mmap})}

    def ours(storage: Storage):
        if mmap:
            warnings.warn(f"{storage.describe()}: mmap=True does not apply to a ckptstore checkpoint: it is read "
                          "into memory, every byte hash-checked", stacklevel=3)
        return load_checkpoint(storage, map_location, weights_only, rank, pickle_load_args,
                             pickle_module=pickle_module)[0]

    if _is_stream(f):
        head = f.read(len(MAGIC))
        if head == MAGIC:  # a container reads front to back: any stream will do
            return ours(read_container(f, head))
        try:
            f.seek(-len(head), io.SEEK_CUR)
        except (io.UnsupportedOperation, AttributeError) as e:  # torch.load's type and advice
            raise type(e)(f"{e}. A ckptstore container loads from any stream, but this is not one. You can only "
                          "torch.load from a file that is seekable. Please pre-load the data into a buffer "
                          "like io.BytesIO and try to load from it instead.") from e
        return torch.load(f, **torch_kw, **pickle_load_args)
    if not is_url(f):
        path = os.fspath(f)
        if os.path.isfile(path):
            store = read_container_file(path)
            if store is not None:
                return ours(store)
            return torch.load(path, **torch_kw, **pickle_load_args)
        if not os.path.exists(path):
            raise CheckpointNotFoundError(f"{path}: no such file or directory")
        if not os.path.isdir(path):
            raise NotACheckpointError(f"{path}: neither a regular file nor a directory (a FIFO, socket or device)")
    storage = open_storage(f, **(storage_options or {}))
    return ours(storage)


__all__ = ["save", "load", "wait", "prepare", "Store", "SaveFuture", "read_manifest", "NotACheckpointError"]
