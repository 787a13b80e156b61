"""The process configuration: one frozen :class:`Config` that reads every environment
variable ckptstore looks at, in one place.

``config()`` returns the process config, read from the environment on first use (when
``ckptstore`` is imported: ``ckptstore.native`` needs it then).
``ckptstore.configure(...)`` (in :mod:`ckptstore.runtime`) replaces it and rebuilds the
runtime. A module reads a knob as ``config().<field>``, e.g.
``config().max_manifest_bytes``; it never reads ``os.environ`` itself. Every field, its
variable, type, default and reader is listed in docs/configuration.md.

This module imports nothing of the package but the errors, so every layer may use it.
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from .errors import CkptStoreError

__all__ = ["Config", "ConfigError", "config", "set_config"]


class ConfigError(CkptStoreError, ValueError):
    """A configuration value (an environment variable or a ``configure()`` argument) is
    malformed or out of range; the message names the variable or the argument."""


# ---- parsers and checks: raise ValueError(reason); the caller names the knob ----------

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _parse_bool(text: str) -> bool:
    t = text.strip().lower()
    if t in _TRUE:
        return True
    if t in _FALSE:
        return False
    raise ValueError("expected 1/0 (or true/false, yes/no, on/off)")


def _parse_int(text: str) -> int:
    try:
        return int(text.strip().replace("_", ""))
    except ValueError:
        raise ValueError("expected an integer") from None


def _parse_float(text: str) -> float:
    try:
        return float(text.strip())
    except ValueError:
        raise ValueError("expected a number") from None


def _parse_str(text: str) -> str:
    return text.strip()


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _positive_int(v: Any) -> None:
    if not _is_int(v) or v < 1:
        raise ValueError("expected an integer >= 1")


def _optional_positive_int(v: Any) -> None:
    if v is not None:
        _positive_int(v)


def _bool(v: Any) -> None:
    if not isinstance(v, bool):
        raise ValueError("expected True or False")


def _non_negative_number(v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
        raise ValueError("expected a number >= 0")


def _number_at_least(low: float) -> Callable[[Any], None]:
    def check(v: Any) -> None:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= low:
            raise ValueError(f"expected a number >= {low:g}")
    return check


def _one_of(*choices: str | None) -> Callable[[Any], None]:
    def check(v: Any) -> None:
        if v not in choices:
            raise ValueError("expected one of " + ", ".join(repr(c) for c in choices if c is not None))
    return check


def _default_workers() -> int:
    return max(2, min(8, os.cpu_count() or 2))


#: Share of the node's RAM that the default staging budgets of all its ranks add up to,
#: and the most page-locked staging memory they may hold together, whatever
#: ``staging_bytes`` says (page-locked memory cannot be swapped out: pinning too much
#: starves the node).
NODE_STAGING_SHARE = 0.5

#: The least staging memory a rank's share comes to, however many ranks the launcher
#: says share the node: below it a save crawls in tiny pieces instead of failing, and
#: a count that large (e.g. a stray SLURM_NTASKS_PER_NODE) is far more likely wrong
#: than real. 64 MiB is four 16 MiB chunks.
MIN_RANK_SHARE = 64 << 20


def host_memory_bytes() -> int:
    """The node's physical RAM in bytes (16 GiB where the OS cannot tell)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return 16 << 30


def rank_share_of_node(local_world_size: int, ram: int | None = None) -> int:
    """One rank's part of the node's staging share: NODE_STAGING_SHARE of ``ram``
    (default: this node's) divided by the ranks on the node, at least MIN_RANK_SHARE."""
    ram = host_memory_bytes() if ram is None else ram
    return max(MIN_RANK_SHARE, int(ram * NODE_STAGING_SHARE) // local_world_size)


def _launcher_local_size(environ: Mapping[str, str]) -> int:
    """Ranks on this node as other launchers say it, where LOCAL_WORLD_SIZE (torchrun's)
    is not set: Open MPI, MPICH/Intel MPI, then Slurm ("4" or "4(x2)": the first count);
    1 when none says. Read leniently: these are the launchers' variables, not ours."""
    for name in ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"):
        digits = re.match(r"\s*(\d+)", environ.get(name, ""))
        if digits and int(digits.group(1)) >= 1:
            return int(digits.group(1))
    return 1


def _knob(env: str, parse: Callable[[str], Any], check: Callable[[Any], None], reader: str) -> dict:
    return {"env": env, "parse": parse, "check": check, "reader": reader}


@dataclass(frozen=True)
class Config:
    """Every knob of the process; see docs/configuration.md for the full table.

    Build one from the environment with :meth:`from_env` (what ``config()`` and
    ``configure()`` do), or directly; both validate every field and raise
    :class:`ConfigError` naming the variable or the field. An environment variable set
    to the empty string counts as unset.
    """

    #: Encode/hash/write worker threads (readers: at least 8). Default: CPU count, 2..8.
    workers: int = field(default_factory=_default_workers, metadata=_knob(
        "CKPTSTORE_WORKERS", _parse_int, _positive_int, "ckptstore.runtime"))
    #: Capacity of the process's staging pool, in bytes. None (the default): half the
    #: node's RAM divided by ``local_world_size`` (see :attr:`staging_capacity`).
    staging_bytes: int | None = field(default=None, metadata=_knob(
        "CKPTSTORE_STAGING_BYTES", _parse_int, _optional_positive_int, "ckptstore.runtime, ckptstore.staging.pool"))
    #: Processes (ranks) on this node, which share its staging memory; torchrun sets
    #: LOCAL_WORLD_SIZE. A value that is not an integer >= 1 is an error: guessing 1
    #: would let every rank of the node pin the whole share. Where it is not set, Open
    #: MPI's, MPICH's or Slurm's count of the node's ranks, else 1.
    local_world_size: int = field(default=1, metadata=_knob(
        "LOCAL_WORLD_SIZE", _parse_int, _positive_int, "ckptstore.config (staging_capacity, pinned_capacity)"))
    #: Staging pool backend: "auto" (native slabs when the extension can serve), "native", "torch".
    staging_pool: str = field(default="auto", metadata=_knob(
        "CKPTSTORE_STAGING_POOL", _parse_str, _one_of("auto", "native", "torch"), "ckptstore.staging.pool"))
    #: Use the torch/ctypes fallbacks instead of the extension (read once, at import).
    disable_native: bool = field(default=False, metadata=_knob(
        "CKPTSTORE_DISABLE_NATIVE", _parse_bool, _bool, "ckptstore.native"))
    #: Native CUDA staging copies small tensors with one gather kernel.
    cuda_gather: bool = field(default=True, metadata=_knob(
        "CKPTSTORE_CUDA_GATHER", _parse_bool, _bool, "ckptstore.staging.cuda"))
    #: Seconds to wait for in-flight saves on SIGTERM (default 20: well inside a
    #: launcher's usual 30 s grace before SIGKILL).
    exit_timeout: float = field(default=20.0, metadata=_knob(
        "CKPTSTORE_EXIT_TIMEOUT", _parse_float, _non_negative_number, "ckptstore.lifecycle"))
    #: Seconds to wait for in-flight saves at a normal interpreter exit (nobody is about
    #: to SIGKILL the process: the last save of a run gets its time).
    atexit_timeout: float = field(default=300.0, metadata=_knob(
        "CKPTSTORE_ATEXIT_TIMEOUT", _parse_float, _non_negative_number, "ckptstore.lifecycle"))
    #: Exit mode: seconds a peer's heartbeat may stay unchanged before it is presumed dead.
    exit_liveness: float = field(default=5.0, metadata=_knob(
        "CKPTSTORE_EXIT_LIVENESS", _parse_float, _number_at_least(1.0), "ckptstore.checkpoint.exiting"))
    #: Install the SIGTERM handler that drains in-flight saves.
    handle_sigterm: bool = field(default=True, metadata=_knob(
        "CKPTSTORE_HANDLE_SIGTERM", _parse_bool, _bool, "ckptstore.lifecycle"))
    #: Largest manifest (and vote) a reader accepts, in bytes.
    max_manifest_bytes: int = field(default=256 << 20, metadata=_knob(
        "CKPTSTORE_MAX_MANIFEST_BYTES", _parse_int, _positive_int, "ckptstore.format"))
    #: S3 attempts per request; None: the AWS profile's ``max_attempts``, else 10.
    s3_max_attempts: int | None = field(default=None, metadata=_knob(
        "AWS_MAX_ATTEMPTS", _parse_int, _optional_positive_int, "ckptstore.storage.s3"))
    #: How S3 create-only puts are made safe: "probe", "trust" or "single-writer" (docs/s3.md).
    s3_conditional_writes: str = field(default="probe", metadata=_knob(
        "CKPTSTORE_S3_CONDITIONAL_WRITES", _parse_str, _one_of("probe", "trust", "single-writer"),
        "ckptstore.storage.s3"))
    #: S3 retry mode; None: the AWS profile's ``retry_mode``, else "standard".
    s3_retry_mode: str | None = field(default=None, metadata=_knob(
        "AWS_RETRY_MODE", _parse_str, _one_of(None, "standard", "adaptive", "legacy"), "ckptstore.storage.s3"))

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type == "float" and _is_int(value):  # 300 is as good as 300.0
                object.__setattr__(self, f.name, float(value))
                value = float(value)
            try:
                f.metadata["check"](value)
            except ValueError as e:
                raise ConfigError(f"ckptstore config: {f.name}={value!r}: {e}") from None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> "Config":
        """A config from ``environ`` (default ``os.environ``); ``overrides`` (field=value)
        win over the environment (None: not given), unset fields take their defaults."""
        environ = os.environ if environ is None else environ
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise ConfigError(f"ckptstore config: unknown setting(s) {', '.join(unknown)}; "
                              f"known: {', '.join(sorted(names))}")
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if overrides.get(f.name) is not None:  # None: not given
                values[f.name] = overrides[f.name]
                continue
            env = f.metadata["env"]
            raw = environ.get(env)
            if raw is None or not raw.strip():
                continue
            try:
                value = f.metadata["parse"](raw)
                f.metadata["check"](value)
            except ValueError as e:
                raise ConfigError(f"environment variable {env}={raw!r}: {e}") from None
            values[f.name] = value
        if "local_world_size" not in values:
            values["local_world_size"] = _launcher_local_size(environ)
        return cls(**values)

    @property
    def staging_capacity(self) -> int:
        """The staging pool's capacity in bytes: ``staging_bytes`` when set, else this
        rank's part of the node's share, ``NODE_STAGING_SHARE`` of the RAM divided by
        ``local_world_size``."""
        if self.staging_bytes is not None:
            return self.staging_bytes
        return rank_share_of_node(self.local_world_size)

    @property
    def pinned_capacity(self) -> int:
        """The capacity of a page-locked staging pool: ``staging_capacity``, capped at
        this rank's part of the node's share even when ``staging_bytes`` asks for more,
        so the ranks of a node never pin more than ``NODE_STAGING_SHARE`` of its RAM
        (unless so many run on it that each gets the floor, ``MIN_RANK_SHARE``: more
        than 8 ranks per GiB of RAM)."""
        return min(self.staging_capacity, rank_share_of_node(self.local_world_size))

    def replace(self, **changes: Any) -> "Config":
        """A copy with ``changes`` (field=value), validated."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def knobs(cls) -> list[dict]:
        """One row per field: name, env, type, default, reader (for docs and ``doctor``)."""
        rows = []
        for f in dataclasses.fields(cls):
            default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            rows.append({"name": f.name, "env": f.metadata["env"], "type": f.type, "default": default,
                         "reader": f.metadata["reader"]})
        return rows


_config: Config | None = None
_config_lock = threading.Lock()


def config() -> Config:
    """The process config (read from the environment on first call)."""
    global _config
    cfg = _config
    if cfg is None:
        with _config_lock:
            if _config is None:
                _config = Config.from_env()
            cfg = _config
    return cfg


def set_config(cfg: Config) -> Config:
    """Install ``cfg`` as the process config. ``ckptstore.configure()`` calls this and
    rebuilds the runtime; call that instead, unless only non-runtime knobs change."""
    global _config
    if not isinstance(cfg, Config):
        raise TypeError(f"expected a ckptstore Config, got {type(cfg).__name__}")
    with _config_lock:
        _config = cfg
    return cfg
