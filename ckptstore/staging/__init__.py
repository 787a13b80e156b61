"""Host staging: the memory that holds tensors' bytes while the background pipeline
encodes and writes them, and the copies that fill it.

* :mod:`.pool`: the :class:`StagingPool` protocol (an ABC) and :class:`StagingBuffer`;
  ``StagingPool(capacity, pin_memory, backend=...)`` returns one of its two
  implementations:
* :mod:`.native_pool`: :class:`NativeStagingPool`, slabs from the extension (pinned with
  CUDA), the default when the extension is built. Its capacity is a soft limit: it
  lends past it after ``overflow_after`` seconds of waiting on fragmented memory
  (``lends_past_capacity``);
* :mod:`.torch_pool`: :class:`TorchStagingPool`, torch tensors cached by size, a
  strict budget;
* :mod:`.cuda`: :func:`stage_to_host` and :class:`StageHandle`, batched device-to-host
  copies (the extension's CUDA path or torch streams); :func:`stage_strided`, copies of
  non-contiguous CUDA tensors in bounded pieces; :func:`check_stream`, the ``stream=``
  argument of a save;
* :mod:`.strided`: :func:`row_major_boxes`, a tensor split into bounded row-major boxes;
* :mod:`.copier`: :class:`StagingCopier`, which fills pool buffers for one save.

See docs/native.md.
"""

from .pool import (
    DEFAULT_BACKEND,
    DEFAULT_OVERFLOW_AFTER,
    DEFAULT_SLAB_BYTES,
    StagingBuffer,
    StagingPool,
    default_capacity,
)
from .native_pool import NativeStagingPool  # registers the "native" backend
from .torch_pool import TorchStagingPool  # registers the "torch" backend
from .cuda import SMALL_COPY_BYTES, STRIDED_PIECE_BYTES, StageHandle, check_stream, stage_strided, stage_to_host
from .strided import row_major_boxes
from .copier import QueuedCopy, StagingCopier

__all__ = [
    "DEFAULT_BACKEND",
    "DEFAULT_OVERFLOW_AFTER",
    "DEFAULT_SLAB_BYTES",
    "NativeStagingPool",
    "QueuedCopy",
    "SMALL_COPY_BYTES",
    "STRIDED_PIECE_BYTES",
    "StageHandle",
    "StagingBuffer",
    "StagingCopier",
    "StagingPool",
    "TorchStagingPool",
    "check_stream",
    "default_capacity",
    "row_major_boxes",
    "stage_strided",
    "stage_to_host",
]
