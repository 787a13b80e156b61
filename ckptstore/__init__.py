"""ckptstore: asynchronous, sharded, verified checkpoint storage for PyTorch.

Drop-in for torch.save / torch.load::

    fut = ckptstore.save(model.state_dict(), "ckpt/latest.pt")   # returns once staged
    state = ckptstore.load("ckpt/latest.pt")

Managed, for training loops::

    store = ckptstore.Store("runs/exp1")
    store.save(step, {"model": model.state_dict(), "optim": opt.state_dict()})
    state = store.load()            # latest committed step

Fault-tolerant training loops (collective resume, preemption saves)::

    ckpt = ckptstore.Checkpointer(store, model=model, optimizer=opt, state={"sched": sched}, every=100)
    for step in range(ckpt.resume(), total_steps):
        train_step()
        if ckpt.step(step):
            break
"""

from ._version import __version__  # noqa: E402 (one source: _version.py, read by the build too)

from . import errors  # noqa: E402
from .api import load, save, wait  # noqa: E402
from .checkpoint.load import LoadInfo, WorldSizeChangedWarning  # noqa: E402
from .store import Store  # noqa: E402
from .warmup import prepare  # noqa: E402
from .checkpoint.retention import KeepBest, Retention  # noqa: E402
from .checkpoint.save import SaveFuture  # noqa: E402
from .checkpoint.verify import verify  # noqa: E402
from .errors import *  # noqa: E402,F401,F403
from .config import Config, ConfigError  # noqa: E402
from .runtime import configure  # noqa: E402
from .resume import (  # noqa: E402
    CheckpointRejected,
    CheckpointSkippedWarning,
    NoLoadableCheckpointError,
    ResumeError,
    ResumeInfo,
    SkippedStep,
)
from .rng import rng_state, set_rng_state  # noqa: E402
from .training import Checkpointer  # noqa: E402
from . import inprocess  # noqa: E402 (ckptstore.inprocess.run: in-job restart)
from .tiers import PromotionWarning, TierFallbackWarning  # noqa: E402

__all__ = ["CheckpointRejected", "CheckpointSkippedWarning", "Checkpointer", "Config", "ConfigError", "KeepBest",
           "LoadInfo", "NoLoadableCheckpointError", "PromotionWarning", "Retention", "ResumeError", "ResumeInfo", "SkippedStep", "Store", "SaveFuture",
           "TierFallbackWarning", "WorldSizeChangedWarning", "configure", "errors", "load", "prepare", "rng_state", "save", "set_rng_state", "verify",
           "wait", "__version__"]
