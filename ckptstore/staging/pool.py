"""The staging pool's contract: :class:`StagingPool`, the buffers it lends, and the
choice between its two implementations.

A pool lends host buffers of exactly the size asked (no power-of-two rounding) and
keeps them for reuse: the same state saved again asks for the same sizes, so a
training loop allocates (and, on CUDA machines, page-locks) once. ``acquire`` waits
while the bytes lent plus the request would exceed ``capacity``: that back-pressure
lets a pool smaller than the state work, and stops saves from piling up until an OOM.

Two implementations, chosen by ``StagingPool(backend=...)``:

* :class:`~ckptstore.staging.native_pool.NativeStagingPool`: slabs from the
  extension's ``HostPool``. Its capacity is a soft limit: a request that waited
  ``overflow_after`` seconds for fragmented memory is lent past it
  (``lends_past_capacity`` is True).
* :class:`~ckptstore.staging.torch_pool.TorchStagingPool`: one torch tensor per size;
  never lends past its capacity.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from .. import native
from ..config import Config, config

__all__ = ["DEFAULT_BACKEND", "DEFAULT_OVERFLOW_AFTER", "DEFAULT_SLAB_BYTES", "StagingBuffer", "StagingPool",
           "choose_backend", "default_capacity"]

#: Usual slab size of the native pool.
DEFAULT_SLAB_BYTES = 64 << 20
#: The default of ``Config.staging_pool`` (CKPTSTORE_STAGING_POOL), which ``StagingPool(backend=None)`` follows.
DEFAULT_BACKEND: str = Config.__dataclass_fields__["staging_pool"].default
#: Seconds a native ``acquire`` waits for fragmented memory before it lends past the capacity.
DEFAULT_OVERFLOW_AFTER = 1.0


def default_capacity(pinned: bool = False) -> int:
    """The process config's ``staging_capacity``: CKPTSTORE_STAGING_BYTES, else half the
    node's RAM divided by LOCAL_WORLD_SIZE; ``pinned``: its ``pinned_capacity``, capped
    at that share whatever CKPTSTORE_STAGING_BYTES says (docs/configuration.md)."""
    return config().pinned_capacity if pinned else config().staging_capacity


class StagingBuffer:
    """One host buffer lent by the pool.

    ``tensor`` is a 1-D uint8 CPU tensor over the buffer's memory, ``view`` a writable
    memoryview of it, ``ptr`` its address, ``nbytes`` its size. The memory belongs to
    the pool: use it only between ``acquire`` and ``release``.
    """

    __slots__ = ("tensor", "nbytes", "view", "_block")

    def __init__(self, tensor: torch.Tensor, view: memoryview | None = None, block=None):
        self.tensor = tensor
        self.nbytes = tensor.numel()
        if view is None:
            view = memoryview(tensor.numpy()) if self.nbytes else memoryview(bytearray())
        self.view = view
        self._block = block  # the native Block, or None

    @property
    def ptr(self) -> int:
        return self.tensor.data_ptr()


def choose_backend(backend: str | None, pin: bool) -> str:
    """"native" or "torch" for a ``backend`` of None (the process config's
    ``staging_pool``), "auto", "native" or "torch"."""
    if backend is None:
        backend = config().staging_pool
    if backend == "auto":
        if native.NATIVE and (not pin or native.cuda_available()):
            return "native"
        return "torch"
    if backend == "native":
        if not native.NATIVE:
            raise RuntimeError(f"StagingPool: the native backend is unavailable ({native.WHY_NOT})")
        return "native"
    if backend == "torch":
        return "torch"
    raise ValueError(f"StagingPool: unknown backend {backend!r}")


class StagingPool(ABC):
    """Reusable host staging memory with a byte budget (the protocol of both pools).

    ``StagingPool(capacity, pin_memory, backend=..., slab_bytes=...)`` returns the
    implementation that ``backend`` selects: "auto" (native when the extension can
    serve the request: built, and CUDA visible to it if pinning is wanted), "native"
    or "torch"; None means the process config's ``staging_pool``
    (CKPTSTORE_STAGING_POOL, default "auto").

    ``capacity``: bytes lent at once before ``acquire`` waits (default
    :func:`default_capacity`, of the pinned kind when pinning). ``pin_memory``: page-lock the memory (default: when
    CUDA is available). ``slab_bytes``: usual slab size (native pool only).
    ``lends_past_capacity``: whether ``acquire`` may lend beyond ``capacity`` (see
    :meth:`acquire`).
    """

    #: "native" or "torch"
    backend: str = ""
    #: True when ``acquire(overflow_after=...)`` may lend memory beyond ``capacity``.
    lends_past_capacity: bool = False
    #: The CUDA device whose context a pinned pool's memory should be allocated under
    #: (set by ``Runtime.staging_pool``: a device of the state that made it pinned);
    #: None: the caller's current one. Callers that may grow the pool from a thread
    #: without a context make it current first.
    device: int | None = None
    _implementations: dict[str, type["StagingPool"]] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.backend:
            StagingPool._implementations[cls.backend] = cls

    def __new__(cls, capacity: int | None = None, pin_memory: bool | None = None, *,
                backend: str | None = None, slab_bytes: int = DEFAULT_SLAB_BYTES, device: int | None = None):
        if cls is StagingPool:
            cls = StagingPool._implementations[choose_backend(backend, _pin(pin_memory))]
        return super().__new__(cls)

    def __init__(self, capacity: int | None = None, pin_memory: bool | None = None, *,
                 backend: str | None = None, slab_bytes: int = DEFAULT_SLAB_BYTES, device: int | None = None):
        if backend not in (None, "auto", self.backend):
            raise ValueError(f"{type(self).__name__} is the {self.backend!r} backend, not {backend!r}")
        self.pin_memory = _pin(pin_memory)
        if device is not None:
            self.device = int(device)
        self.capacity = default_capacity(self.pin_memory) if capacity is None else int(capacity)
        if self.capacity <= 0:
            raise ValueError(f"staging capacity must be positive, got {self.capacity}")
        self._setup(int(slab_bytes))

    @abstractmethod
    def _setup(self, slab_bytes: int) -> None:
        """Set up the implementation's state (``capacity`` and ``pin_memory`` are set)."""

    # -- reporting
    @property
    @abstractmethod
    def in_use(self) -> int:
        """Bytes lent now."""

    @property
    @abstractmethod
    def held(self) -> int:
        """Bytes the pool holds now (lent or cached, overflow included)."""

    @property
    @abstractmethod
    def peak(self) -> int:
        """Most bytes held at once."""

    @abstractmethod
    def stats(self) -> dict:
        """capacity, in_use (bytes lent), cached (held, not lent), held, peak (most bytes
        held at once), pinned, backend; the native pool adds its slab and overflow figures."""

    # -- lending
    def check_size(self, nbytes: int) -> int:
        nbytes = int(nbytes)
        if nbytes < 0:
            raise ValueError(f"a buffer size must be >= 0, got {nbytes}")
        if nbytes > self.capacity:
            raise ValueError(f"a {nbytes}-byte buffer exceeds the staging capacity {self.capacity}")
        return nbytes

    @abstractmethod
    def acquire(self, nbytes: int, *, overflow_after: float | None = DEFAULT_OVERFLOW_AFTER) -> StagingBuffer:
        """A buffer of exactly ``nbytes``; waits while in_use + nbytes > capacity.

        ``overflow_after`` matters only where ``lends_past_capacity``: seconds to wait
        for releases when the request fits by count but not in any free hole, before
        lending memory beyond the capacity; None waits as long as it takes."""

    @abstractmethod
    def try_acquire(self, nbytes: int) -> StagingBuffer | None:
        """A buffer of exactly ``nbytes`` from the budget at once, or None instead of
        waiting (back-pressure, or native fragmentation). Never lends past the capacity."""

    @abstractmethod
    def release(self, buf: StagingBuffer) -> None:
        """Take back a buffer this pool lent (once)."""

    @abstractmethod
    def trim(self) -> None:
        """Free the memory the pool holds but does not lend."""

    def warm(self, nbytes: int) -> int:
        """Grow the pool to hold ``min(nbytes, capacity)`` bytes with its pages already
        provided by the kernel, lending nothing, so that the next save's copies take
        no page faults; returns the bytes added. Blocking (``ckptstore.prepare`` runs
        it on a worker). This base pool allocates per request size: nothing to warm."""
        return 0


def _pin(pin_memory: bool | None) -> bool:
    return torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
