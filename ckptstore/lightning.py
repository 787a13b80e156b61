"""PyTorch Lightning through ckptstore: ``Trainer(plugins=[ckptstore.lightning.CheckpointIO()])``.

Every checkpoint Lightning writes (``ModelCheckpoint``, ``trainer.save_checkpoint``)
becomes a ckptstore checkpoint at the same path: ``save_checkpoint`` returns once the
tensors are staged, the write, hashing and commit go on in the background (Lightning's
own ``AsyncCheckpointIO`` is not needed), and a resume (``trainer.fit(ckpt_path=...)``)
reads it back with every chunk's hash checked. Paths may be ``s3://`` URLs
(docs/integrations.md).
"""

from __future__ import annotations

import os
from typing import Any

from lightning.pytorch.plugins.io import CheckpointIO as _LightningCheckpointIO

from . import api, lifecycle, names
from .staging.cuda import check_stream
from .storage import is_url, open_storage


class CheckpointIO(_LightningCheckpointIO):
    """Lightning's checkpoint I/O, asynchronous, through ckptstore.

    ``compression``, ``storage_options``, ``incremental`` and ``stream`` (the CUDA
    stream, or ``{device index: stream}``, whose work a save's copies wait for; default
    the saving thread's current stream) as for :func:`ckptstore.save`, and checked as
    it checks them; ``weights_only`` is the default for loads Lightning does
    not decide itself (True: torch's allow-list; Lightning checkpoints holding custom
    hyperparameter objects need False, for checkpoints you trust).
    """

    def __init__(self, *, compression: str = "auto", storage_options: dict | None = None,
                 incremental: bool = True, weights_only: bool = True, stream=None):
        super().__init__()
        self.stream = check_stream(stream, "ckptstore.lightning.CheckpointIO")
        self.compression = compression
        self.storage_options = storage_options
        self.incremental = incremental
        self.weights_only = weights_only

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        lifecycle.raise_earlier_failure()  # a save that failed in the background fails this one
        api.save(checkpoint, os.fspath(path), compression=self.compression,
                 storage_options=storage_options or self.storage_options, incremental=self.incremental,
                 stream=self.stream)

    def load_checkpoint(self, path, map_location: Any | None = None, weights_only: bool | None = None) -> dict:
        api.wait()  # a resume right after a save (by any trainer of this process) reads that save
        return api.load(os.fspath(path), map_location=map_location,
                        weights_only=self.weights_only if weights_only is None else weights_only,
                        storage_options=self.storage_options)

    def remove_checkpoint(self, path) -> None:
        """``ModelCheckpoint`` drops a checkpoint it no longer keeps: its manifests go
        first (from then on it is no checkpoint), then its files."""
        api.wait()  # its save, if still in flight, commits first
        where = os.fspath(path).rstrip("/")
        if not is_url(where) and os.path.isfile(where):  # a single-file container (or torch.save's file)
            os.remove(where)
            return
        parent, name = where.rsplit("/", 1) if "/" in where else (".", where)
        root = open_storage(parent or "/", **(self.storage_options or {}))  # (deleting through it empties the dir too)
        keys = [f"{name}/{info.key}" for info in root.child(name).walk("")]
        for key in sorted(keys, key=lambda k: names.parse_manifest_name(k.rsplit("/", 1)[-1]) is None):
            root.delete(key)

    def teardown(self) -> None:
        """Wait for every save of this process to commit; raise the first failure."""
        api.wait()


__all__ = ["CheckpointIO"]
