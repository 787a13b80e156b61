"""S3 settings, boto3 sessions and clients, and what a store shares with its children.

Configuration comes from boto3's standard chain (``AWS_ENDPOINT_URL`` /
``AWS_ENDPOINT_URL_S3``, ``AWS_PROFILE``, ``~/.aws/config``, environment credentials,
instance roles); :func:`new_client` overrides it with the store's keyword arguments.
Clients come from one process-wide session per profile (:func:`boto3_session`).
"""

from __future__ import annotations

import threading

import boto3
import botocore.session
from botocore.config import Config

from ..._threads import DaemonThreadPool
from ...config import config as process_config
from ..base import ReadHints
from .errors import _redact, _scrub_exception, _secrets_of

MiB = 1 << 20
GiB = 1 << 30
MIN_PART_SIZE = 5 * MiB  # S3: every part but the last
MAX_PART_SIZE = 5 * GiB
MAX_PARTS = 10_000
DEFAULT_PART_SIZE = 16 * MiB
DEFAULT_CONCURRENCY = 10
DEFAULT_READ_PART_SIZE = 8 * MiB  # ranged GET size for large reads (boto3's download default)
# Read coalescing (storage/base.py): a GET costs a round trip (10-50 ms to first byte on
# S3) and a request charge, while one connection streams ~100 MB/s, so reading 64 KiB of
# unneeded bytes (~1 ms) to save a GET is cheap; blobs below ~1 MiB take about as long
# to request as to transfer, so they are merged; larger ones stream on their own straight
# into their tensor. A merged read is at most read_part_size (one GET).
DEFAULT_COALESCE_GAP = 64 * 1024
DEFAULT_COALESCE_BLOB = 1 * MiB
DEFAULT_MAX_ATTEMPTS = 10
DEFAULT_RETRY_MODE = "standard"
DEFAULT_CONNECT_TIMEOUT = 10.0
DEFAULT_READ_TIMEOUT = 60.0

__all__ = ["CHECKSUMS", "DEFAULT_COALESCE_BLOB", "DEFAULT_COALESCE_GAP", "DEFAULT_CONCURRENCY",
           "DEFAULT_CONNECT_TIMEOUT", "DEFAULT_MAX_ATTEMPTS", "DEFAULT_PART_SIZE", "DEFAULT_READ_PART_SIZE",
           "DEFAULT_READ_TIMEOUT", "DEFAULT_RETRY_MODE", "MAX_PARTS", "MAX_PART_SIZE", "MIN_PART_SIZE",
           "boto3_session"]

# ``checksums``: botocore's request_checksum_calculation (and response_checksum_validation).
CHECKSUMS = ("when_supported", "when_required")

_sessions: dict[str | None, tuple[boto3.session.Session, botocore.session.Session]] = {}
_sessions_lock = threading.Lock()


def boto3_session(profile_name: str | None = None) -> boto3.session.Session:
    """The process-wide boto3 session (one per profile) that S3Storage clients come from.

    Clients made from a warm session cost milliseconds instead of reloading the S3
    model, and refreshing credentials (roles, SSO) are shared. Event hooks registered on
    it (``boto3_session().events.register("before-send.s3", fn)``) see every request of
    clients created afterwards. ``AWS_PROFILE`` is read when it is first created."""
    return _sessions_for(profile_name)[0]


def _sessions_for(profile_name: str | None):
    with _sessions_lock:
        pair = _sessions.get(profile_name)
        if pair is None:
            core = botocore.session.get_session()
            pair = _sessions[profile_name] = (boto3.session.Session(botocore_session=core, profile_name=profile_name), core)
        return pair


def _configured(profile_name: str | None, value, name: str) -> str | None:
    """``value`` (from the process config: the AWS_* variable) when set, else the active
    profile's setting ``name`` (boto3's own precedence)."""
    if value:
        return str(value)
    try:
        return _sessions_for(profile_name)[1].get_scoped_config().get(name)
    except Exception:  # no such profile, unreadable config: boto3 reports it on first use
        return None


def check_checksums(checksums: str | None) -> str | None:
    if checksums is not None and checksums not in CHECKSUMS:
        raise ValueError(f"checksums must be None (botocore's setting), {' or '.join(map(repr, CHECKSUMS))}, "
                         f"got {checksums!r}")
    return checksums


def checksum_config(checksums: str | None) -> dict:
    """botocore ``Config`` keys for ``checksums``: {} for None (botocore's default,
    ``AWS_REQUEST_CHECKSUM_CALCULATION`` / ``AWS_RESPONSE_CHECKSUM_VALIDATION`` or the
    profile's settings decide), and on a botocore older than 1.36, which has no such
    keys and only ever sends a checksum where an operation requires one: what
    "when_required" asks for."""
    if checksums is None or not _config_has("request_checksum_calculation"):
        return {}
    return {"request_checksum_calculation": checksums, "response_checksum_validation": checksums}


def _config_has(name: str) -> bool:
    return name in getattr(Config, "OPTION_DEFAULTS", {})


def sends_checksum_trailers(client) -> bool:
    """Whether ``client`` sends PutObject / UploadPart bodies aws-chunked with a trailing
    checksum (``x-amz-trailer``): botocore does so over HTTPS when it computes checksums
    for every operation that supports one (``when_supported``, its default since 1.36)."""
    meta = getattr(client, "meta", None)
    endpoint = getattr(meta, "endpoint_url", None)
    setting = getattr(getattr(meta, "config", None), "request_checksum_calculation", None)
    return isinstance(endpoint, str) and endpoint.lower().startswith("https://") and setting == "when_supported"


def new_client(*, profile_name: str | None, endpoint_url: str | None, region_name: str | None,
               max_attempts: int | None, retry_mode: str | None, connect_timeout: float,
               read_timeout: float, max_concurrency: int, checksums: str | None = None):
    """(client, max_attempts): a boto3 S3 client from :func:`boto3_session`'s standard
    configuration, overridden by the arguments that are not None, and the total attempts
    per request it makes. ``checksums``: see :func:`checksum_config`. An invalid
    ``endpoint_url`` raises ValueError without echoing its credentials."""
    session = boto3_session(profile_name)
    if max_attempts is None:
        configured = _configured(profile_name, process_config().s3_max_attempts, "max_attempts")
        max_attempts = int(configured) if configured else DEFAULT_MAX_ATTEMPTS
    if retry_mode is None:
        retry_mode = _configured(profile_name, process_config().s3_retry_mode, "retry_mode") or DEFAULT_RETRY_MODE
    if int(max_attempts) < 1:
        raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
    config = Config(
        retries={"mode": retry_mode, "total_max_attempts": int(max_attempts)},
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        max_pool_connections=max(32, 3 * int(max_concurrency)),
        user_agent_extra="ckptstore",
        **checksum_config(check_checksums(checksums)),
    )
    try:
        with _sessions_lock:  # boto3 sessions are not thread-safe
            client = session.client("s3", endpoint_url=endpoint_url, region_name=region_name, config=config)
    except ValueError as e:  # botocore's "Invalid endpoint: <url>"
        secrets = _secrets_of(endpoint_url)
        _scrub_exception(e, lambda text: _redact(text, secrets))
        raise ValueError(_redact(str(e), secrets)) from None
    return client, max_attempts


class _Shared:
    """What a store and all its children share: client, settings, read pool."""

    def __init__(self, bucket, client, part_size, max_concurrency, max_attempts, read_part_size, parts_per_tier,
                 read_hints: ReadHints = ReadHints()):
        self.bucket = bucket
        self.client = client
        endpoint = getattr(getattr(client, "meta", None), "endpoint_url", None)
        self.secrets = _secrets_of(endpoint if isinstance(endpoint, str) else None)
        self.endpoint = self.redact(endpoint) if isinstance(endpoint, str) else None
        self.part_size = part_size
        self.max_concurrency = max_concurrency
        self.max_attempts = max_attempts
        self.read_part_size = read_part_size
        self.parts_per_tier = parts_per_tier
        self.read_hints = read_hints
        self.batch_deletes = True  # False once the store refused a DeleteObjects without Content-MD5
        self._pool: DaemonThreadPool | None = None
        self._lock = threading.Lock()

    def redact(self, text: str) -> str:
        return _redact(text, self.secrets)

    def pool(self) -> DaemonThreadPool:
        with self._lock:
            if self._pool is None:
                self._pool = DaemonThreadPool(self.max_concurrency, "ckptstore-s3-read")
            return self._pool
