"""The load of one checkpoint location: its visible manifest, the indexes and
references it needs, the restore of this rank's object, a template filled; with the
``LoadInfo`` that says what was found; and the one retry rule of every load
(:func:`with_reloads`). Under ``ckptstore.load`` and ``Store.load`` alike (the save
side of it is save.py)."""

from __future__ import annotations

import dataclasses
import pickle
import warnings
from dataclasses import dataclass, field
from typing import Callable, TypeVar

from .. import format as fmt
from .. import names
from ..errors import CkptStoreError, FormatError
from ..runtime import runtime
from ..storage import Storage
from .group import rank_and_world
from .indexes import for_load
from .references import resolve as resolve_references
from .reshard import fill_template
from .manifests import latest_manifest
from .restore import restore

T = TypeVar("T")


@dataclass(frozen=True)
class LoadInfo:
    """What a load found: which checkpoint, and whether the world size changed."""

    url: str
    step: int | None
    generation: int
    saved_world_size: int
    world_size: int
    rank_state_of: int  # the saved rank whose own (rank-local) object was loaded
    manifest: fmt.Manifest | None = field(default=None, repr=False, compare=False)
    tier: str | None = None  # "local" or "durable" for a Store with two tiers

    @property
    def resharded(self) -> bool:
        return self.saved_world_size != self.world_size


class WorldSizeChangedWarning(UserWarning):
    """Loading a checkpoint saved on another number of ranks."""


RELOADS = 3  # how often a load starts again when what it read was retired under it


class Reading:
    """The manifest one try of a load is reading (where, which generation), for the
    retry rule of :func:`with_reloads`."""

    def __init__(self) -> None:
        self.storage: Storage | None = None
        self.generation = 0

    def note(self, storage: Storage, manifest: fmt.Manifest) -> None:
        self.storage, self.generation = storage, manifest.generation

    def retired(self) -> bool:
        """Whether the manifest being read is gone (a newer generation or retention
        retired it under the load); False when none was being read yet."""
        return self.storage is not None and not self.storage.exists(names.manifest_name(self.generation))


def with_reloads(load_once: Callable[[Reading], T], chosen_gone: Callable[[], bool] | None = None) -> T:
    """``load_once(reading)`` under the one retry rule of a load (format.md, read order
    step 5), the only retry loop of every load: when it fails and the manifest it was
    reading is gone (``reading.retired()``), or ``chosen_gone()`` says the step it chose
    is (``Store.load`` of the latest step, retired by retention), start again from the
    listing, at most ``RELOADS`` tries in all; any other failure is the checkpoint's own
    and is raised as it is."""
    for tries in range(RELOADS):
        reading = Reading()
        try:
            return load_once(reading)
        except CkptStoreError:
            if tries == RELOADS - 1 or not (reading.retired() or (chosen_gone is not None and chosen_gone())):
                raise
    raise AssertionError("unreachable")  # (RELOADS >= 1: the last try returns or raises)


def load_once(storage: Storage, map_location, weights_only: bool, rank: int | None, pickle_load_args,
              template=None, group=None, pickle_module=None, step: int | None = None,
              reading: Reading | None = None):
    """(object, LoadInfo) of the visible checkpoint at ``storage``: one try, which notes
    the manifest it reads in ``reading`` (retries: :func:`with_reloads`)."""
    # restore's default unpickler is pickle's: name only another module
    custom = {} if pickle_module in (None, pickle) else {"pickle_module": pickle_module}
    manifest = latest_manifest(storage)
    if None not in (step, manifest.step) and manifest.step != step:
        raise FormatError(f"{storage.describe()}: the manifest says step {manifest.step}, its directory "
                          f"step {step}")
    info = load_info(storage, manifest, rank, group)
    if info.step is None and step is not None:  # a drop-in save over a step's directory: still that step
        info = dataclasses.replace(info, step=step)
    if reading is not None:
        reading.note(storage, manifest)
    # a version 4 root: the loading rank's index, and the others' that its global tensors need
    manifest = for_load(storage, manifest, info.rank_state_of, template is None, runtime().readers)
    info = dataclasses.replace(info, manifest=manifest)
    source, readable = resolve_references(storage, manifest)  # (as they are, without references)
    obj = restore(source, readable, info.rank_state_of, map_location, weights_only,
                  pickle_load_args=pickle_load_args, globals_as_meta=template is not None, **custom)
    if template is not None:
        obj = fill_template(template, obj, readable, source, runtime().readers)
    return obj, info


def load_checkpoint(storage: Storage, map_location, weights_only: bool, rank: int | None, pickle_load_args,
                    pickle_module=None):
    """(object, LoadInfo) of the visible checkpoint at ``storage`` (a drop-in load),
    started again while what it read is retired under it (:func:`with_reloads`)."""
    return with_reloads(lambda reading: load_once(storage, map_location, weights_only, rank, pickle_load_args,
                                                  pickle_module=pickle_module, reading=reading))


def load_info(storage: Storage, manifest: fmt.Manifest, rank: int | None, group) -> LoadInfo:
    my_rank, world = rank_and_world(group)
    if rank is None:
        rank = my_rank if world > 1 else 0
    if not 0 <= rank:
        raise ValueError(f"rank must be >= 0, got {rank}")
    saved = manifest.world_size
    info = LoadInfo(storage.describe(), manifest.step, manifest.generation, saved, world, rank % saved, manifest)
    # Any change of a training checkpoint's world size warns (a Store step: 1 -> 2 ranks
    # too); a drop-in checkpoint saved by one process and loaded by each rank of a job
    # (pretrained weights, say) is a file load, not a resume: no warning.
    if world != saved and (saved > 1 or manifest.step is not None):
        warnings.warn(
            f"{storage.describe()}: saved by {saved} ranks, loading on {world}: global (sharded) tensors "
            f"are resharded, rank-local state comes from saved rank {info.rank_state_of}; the effective "
            "batch size and the data sharding change",
            WorldSizeChangedWarning, stacklevel=3,
        )
    return info
