"""Hugging Face ``transformers.Trainer`` checkpoints kept in a ckptstore store.

The Trainer writes ``output_dir/checkpoint-N`` itself (weights, optimizer, scheduler, RNG
state, trainer state). :class:`CheckpointCallback` (a ``TrainerCallback``, the Trainer's
documented hook) then saves that directory into a ckptstore :class:`~ckptstore.Store`
as step N, in the background: the weights as tensors (so incremental saves reference a
frozen base instead of writing it again, and every chunk is hashed), every other file
byte for byte. :func:`restore` writes a step back as ``checkpoint-N`` for
``trainer.train(resume_from_checkpoint=...)``, on the same machine or a new one
(docs/integrations.md).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import TrainerCallback

from .store import Store

LAYOUT = "ckptstore-hf-trainer-1"
_PREFIX = "checkpoint-"


def _pack(directory: Path) -> dict:
    """The state a ``checkpoint-N`` directory becomes: safetensors files as tensors
    (with their metadata), every other file as its bytes (a uint8 tensor)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    weights, metadata, files = {}, {}, {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and not p.is_symlink()):
        name = path.relative_to(directory).as_posix()
        if name.endswith(".safetensors"):
            weights[name] = load_file(str(path))
            with safe_open(str(path), framework="pt") as f:
                metadata[name] = f.metadata() or {}
        else:
            data = bytearray(path.read_bytes())  # (torch.frombuffer refuses an empty one)
            files[name] = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return {"layout": LAYOUT, "weights": weights, "metadata": json.dumps(metadata), "files": files}


def _unpack(state: dict, directory: Path) -> None:
    from safetensors.torch import save_file

    if not isinstance(state, dict) or state.get("layout") != LAYOUT:
        raise ValueError(f"not a Hugging Face Trainer checkpoint saved by ckptstore.hf (layout {LAYOUT})")
    metadata = json.loads(state["metadata"])
    for name, tensors in state["weights"].items():
        out = _inside(directory, name)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out), metadata=metadata.get(name) or None)
    for name, data in state["files"].items():
        _inside(directory, name).write_bytes(data.numpy().tobytes())


def _inside(directory: Path, name: str) -> Path:
    """``directory / name``, refusing a name that would lead outside it."""
    out = (directory / name).resolve()
    if directory.resolve() not in out.parents:
        raise ValueError(f"a file name {name!r} in the checkpoint leads outside {directory}")
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


class CheckpointCallback(TrainerCallback):
    """``Trainer(..., callbacks=[ckptstore.hf.CheckpointCallback(url)])``: each checkpoint
    the Trainer saves is saved again into the store at ``url`` as its step, in the
    background (``Store`` options, e.g. ``keep=Retention(last=3)``, pass through). At the
    end of training every save is committed."""

    def __init__(self, url, **store_options):
        self._url, self._options = url, store_options
        self._store: Store | None = None

    @property
    def store(self) -> Store:
        """The store this process saves into, made on first use. Under torch.distributed
        only the main process saves (the Trainer's directory is its), and a Store's save
        is collective over its group: so the group is that process alone, made by it
        alone (``use_local_synchronization``), never waiting for the other ranks."""
        if self._store is None:
            import torch.distributed as dist

            group = None
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                group = dist.new_group([dist.get_rank()], backend="gloo", use_local_synchronization=True)
            self._store = Store(self._url, process_group=group, **self._options)
        return self._store

    def on_save(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        directory = Path(args.output_dir) / f"{_PREFIX}{state.global_step}"
        if directory.is_dir():
            self.store.save(state.global_step, _pack(directory))

    def on_train_end(self, args, state, control, **kwargs):
        from . import wait

        wait()


def restore(url, output_dir, step: int | None = None, **store_options) -> str:
    """Write step ``step`` (default: the newest) of the store at ``url`` as
    ``output_dir/checkpoint-<step>`` and return that path, for
    ``trainer.train(resume_from_checkpoint=...)``. Every byte read is hash-checked; a
    directory already there is left as it is (it is the Trainer's own copy)."""
    store = Store(url, **store_options)
    if step is None:
        steps = store.steps()
        if not steps:
            raise FileNotFoundError(f"{store.url}: the store holds no committed checkpoint to restore")
        step = steps[-1]
    directory = Path(output_dir) / f"{_PREFIX}{step}"
    if not directory.exists():
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=output_dir, prefix=f".{_PREFIX}{step}.restoring-"))
        try:  # (an earlier restore that failed or was killed left its own: it is no one's)
            _unpack(store.load(step), staging)
            os.replace(staging, directory)  # whole or not at all
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return str(directory)


__all__ = ["CheckpointCallback", "restore"]
