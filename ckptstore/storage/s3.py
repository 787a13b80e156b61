"""Amazon S3 (and S3-compatible) backend, through boto3.

Configuration comes from boto3's standard chain (``AWS_ENDPOINT_URL`` /
``AWS_ENDPOINT_URL_S3``, ``AWS_PROFILE``, ``~/.aws/config``, environment credentials,
instance roles), so MinIO, Ceph, R2 or a local test server need no ckptstore-specific
setting; keyword arguments override it. How the pieces work (see docs/s3.md):

* **Retries** are botocore's: ``Config(retries={"mode": "standard", "total_max_attempts":
  N})`` with connect/read timeouts. Throttling, 5xx and connection faults are retried
  with jittered exponential backoff; permanent errors (AccessDenied, NoSuchBucket, bad
  credentials) are not retried and surface at once, naming the ``s3://`` URL. The only
  loop of our own re-requests the rest of a ranged GET whose body broke mid-stream,
  which botocore cannot retry because it has already returned the response.
* **put** is one PutObject; ``if_absent=True`` adds ``If-None-Match: *`` (412 or 409 ->
  :class:`AlreadyExistsError`), which makes manifests and votes create-only (I1).
* **open_append** streams the object up while it is written: appends land, in arrival
  order, in a bounded buffer that a blocking file-like reader hands to boto3's transfer
  layer (``s3transfer.TransferManager.upload``), which sends it as a single PutObject
  when small, else as a multipart upload with ``max_concurrency`` parts in flight, and
  aborts the upload when it fails. Part sizes grow so that no object needs more than
  S3's 10,000 parts.
* **readinto** issues ranged GETs, several concurrently for large ranges; a range past
  the end of an object raises :class:`TruncatedObjectError` (a short read). Loads merge
  the reads of small neighbouring blobs into one GET (``read_coalesce_*``).
* **Keys** are checked (``check_key``) before any request, so the full key (prefix +
  '/' + key) always lies under the store's prefix; listed objects whose names are not
  valid keys (``a//b``, ``./x``, written by other tools) are left out of ``list`` and
  ``walk`` (``delete_prefix`` still deletes them).
* **No secrets in messages**: an endpoint URL with userinfo (``http://user:password@host``)
  is redacted (``redact_url``) in ``describe()``, ``url``, ``repr`` and the text of every
  error the backend raises or translates, botocore's own (which echo the endpoint) too.
"""

from __future__ import annotations

import collections
import http.client
import os
import random
import threading
import time
from concurrent.futures import CancelledError
from contextlib import contextmanager
from typing import Iterator

try:
    import boto3
    import botocore.session
    from boto3.s3.transfer import TransferConfig
    from botocore import exceptions as bexc
    from botocore.config import Config
    from s3transfer.manager import TransferManager
    from urllib3.exceptions import HTTPError as _Urllib3HTTPError
except ImportError as _e:  # pragma: no cover - depends on the environment
    raise ImportError(f"s3:// URLs need boto3 (pip install 'ckptstore[s3]'): {_e}") from _e

from .._threads import DaemonThreadPool
from ..errors import (
    AlreadyExistsError,
    CkptStoreError,
    ObjectNotFoundError,
    StorageError,
    StoragePermissionError,
    TransientStorageError,
    TruncatedObjectError,
)
from .base import AppendWriter, ObjectInfo, Storage, _check_limit, check_key, redact_url

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
_DELETE_BATCH = 1000  # DeleteObjects limit
_READ_BLOCK = 4 * MiB  # bytes read off a response body at a time (and handed to on_piece)

_NOT_FOUND = {"NoSuchKey", "404", "NotFound"}
_PERMISSION = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled",
               "InvalidToken", "ExpiredToken", "TokenRefreshRequired", "AccountProblem",
               "InvalidSecurity", "403", "Forbidden"}
_EXISTS = {"PreconditionFailed", "412", "ConditionalRequestConflict"}
_TRANSIENT = {"SlowDown", "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottled",
              "RequestThrottledException", "RequestLimitExceeded", "TooManyRequestsException",
              "BandwidthLimitExceeded", "PriorRequestNotComplete", "RequestTimeout",
              "RequestTimeoutException", "InternalError", "ServiceUnavailable", "OperationAborted",
              "503", "500", "502", "504"}
_CONNECTION_ERRORS = (bexc.ConnectionError, bexc.HTTPClientError, _Urllib3HTTPError,
                      http.client.HTTPException, ConnectionError, TimeoutError)
# Failures while streaming a response body (after botocore handed us the response).
_STREAM_ERRORS = (bexc.HTTPClientError, bexc.IncompleteReadError, bexc.ConnectionError,
                  _Urllib3HTTPError, http.client.HTTPException, ConnectionError, TimeoutError)


# ---------------------------------------------------------------------------- helpers
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


def _configured(profile_name: str | None, env: str, name: str) -> str | None:
    """A setting from the environment or the active profile (boto3's own precedence)."""
    value = os.environ.get(env)
    if value:
        return value
    try:
        return _sessions_for(profile_name)[1].get_scoped_config().get(name)
    except Exception:  # no such profile, unreadable config: boto3 reports it on first use
        return None


def _client_error(e: bexc.ClientError) -> tuple[str, str, int | None, int]:
    err = e.response.get("Error") or {}
    meta = e.response.get("ResponseMetadata") or {}
    return (str(err.get("Code") or ""), str(err.get("Message") or ""), meta.get("HTTPStatusCode"),
            int(meta.get("RetryAttempts") or 0) + 1)


def _as_bytes(data) -> bytes:
    if isinstance(data, bytes):
        return data
    return bytes(memoryview(data).cast("B"))


def _byte_view(out) -> memoryview:
    mv = out if isinstance(out, memoryview) else memoryview(out)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def _secrets_of(url: str | None) -> tuple[str, ...]:
    """The userinfo of an endpoint URL and its password, raw and percent-decoded: texts
    an error message may echo (replaced by *** where redact_url's pattern misses them)."""
    if not url:
        return ()
    from urllib.parse import unquote, urlsplit

    try:
        parts = urlsplit(url)
    except ValueError:
        return ()
    userinfo = parts.netloc.rpartition("@")[0] if "@" in parts.netloc else ""
    found = {userinfo, unquote(userinfo)}
    if parts.password:
        found |= {parts.password, unquote(parts.password)}
    return tuple(sorted((x for x in found if len(x) >= 3), key=len, reverse=True))


def _redact(text: str, secrets: tuple[str, ...]) -> str:
    text = redact_url(text)
    for secret in secrets:
        text = text.replace(secret, "***")
    return text


def _scrub_exception(e: BaseException, redact) -> None:
    """Redact, in place, the text of ``e`` and the exceptions chained to it (botocore's
    connection errors carry the endpoint URL, password included, in their message and
    kwargs), so a logged traceback does not show it either."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        try:
            if any(isinstance(a, str) and redact(a) != a for a in e.args):
                e.args = tuple(redact(a) if isinstance(a, str) else a for a in e.args)
            kwargs = getattr(e, "kwargs", None)
            if isinstance(kwargs, dict):
                for k, v in list(kwargs.items()):
                    if isinstance(v, str):
                        kwargs[k] = redact(v)
        except Exception:  # an exception type that refuses: its text stays, ours is redacted
            pass
        e = e.__cause__ or e.__context__


def _backoff(failure: int) -> None:
    """Jittered exponential backoff for our one hand-made retry loop (body streaming)."""
    time.sleep(random.random() * min(0.5 * 2 ** (failure - 1), 20.0))


# ---------------------------------------------------------------------------- the store
class _Shared:
    """What a store and all its children share: client, settings, read pool."""

    def __init__(self, bucket, client, part_size, max_concurrency, max_attempts, read_part_size, parts_per_tier,
                 coalesce=(0, 0, 0)):
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
        self.coalesce_blob, self.coalesce_gap, self.coalesce_limit = coalesce
        self._pool: DaemonThreadPool | None = None
        self._lock = threading.Lock()

    def redact(self, text: str) -> str:
        return _redact(text, self.secrets)

    def pool(self) -> DaemonThreadPool:
        with self._lock:
            if self._pool is None:
                self._pool = DaemonThreadPool(self.max_concurrency, "ckptstore-s3-read")
            return self._pool


class S3Storage(Storage):
    """Objects under ``s3://bucket/prefix``.

    ``client``: a ready boto3 S3 client (its own retry and timeout settings then apply;
    ``endpoint_url``, ``region_name``, ``profile_name``, ``max_attempts``, ``retry_mode``
    and the timeouts are ignored). Otherwise a client is made from boto3's standard
    configuration, overridden by the arguments given here.

    ``part_size`` (>= 5 MiB, default 16 MiB): multipart part size for appended objects
    (grown past part 1,000 to stay under S3's 10,000 parts). ``read_part_size`` (default
    8 MiB): a ``readinto`` larger than this is split into ranged GETs of this size, run
    concurrently. ``max_concurrency`` (default 10): parts or ranges in flight per object.
    ``max_attempts``: total attempts per request (default: ``AWS_MAX_ATTEMPTS`` or the
    profile's ``max_attempts``, else 10). ``retry_mode``: ``"standard"`` or
    ``"adaptive"`` (default: ``AWS_RETRY_MODE`` or the profile's, else standard).
    ``connect_timeout`` / ``read_timeout``: seconds per attempt (10, 60).

    Loads coalesce the GETs of small blobs close together in one object (storage/base.py):
    ``read_coalesce_blob`` (default 1 MiB): only blobs at most this large are merged;
    ``read_coalesce_gap`` (64 KiB): the most unneeded bytes fetched between two of them;
    ``read_coalesce_limit`` (default ``read_part_size``): the largest merged GET, 0 to
    turn coalescing off.
    """

    def __init__(self, bucket: str, prefix: str = "", *, client=None, endpoint_url: str | None = None,
                 region_name: str | None = None, profile_name: str | None = None,
                 part_size: int = DEFAULT_PART_SIZE, max_concurrency: int = DEFAULT_CONCURRENCY,
                 max_attempts: int | None = None, retry_mode: str | None = None,
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT, read_timeout: float = DEFAULT_READ_TIMEOUT,
                 read_part_size: int | None = None, read_coalesce_blob: int = DEFAULT_COALESCE_BLOB,
                 read_coalesce_gap: int = DEFAULT_COALESCE_GAP, read_coalesce_limit: int | None = None,
                 _parts_per_tier: int = MAX_PARTS // 10, _shared: _Shared | None = None):
        if bucket and "@" in bucket:  # s3://user:password@bucket: never echoed back
            raise ValueError(f"invalid S3 bucket name {'***@' + bucket.rpartition('@')[2]!r}: credentials do "
                             "not belong in an s3:// URL (boto3's configuration provides them)")
        if not bucket or "/" in bucket:
            raise ValueError(f"invalid S3 bucket name {bucket!r}")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = redact_url(f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}")
        if _shared is not None:
            self._shared = _shared
            return
        part_size = int(part_size)
        if not MIN_PART_SIZE <= part_size <= MAX_PART_SIZE:
            raise ValueError(f"part_size must be between 5 MiB and 5 GiB (S3's limits), got {part_size}")
        if int(max_concurrency) < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        read_part_size = int(read_part_size or DEFAULT_READ_PART_SIZE)
        coalesce = (int(read_coalesce_blob), int(read_coalesce_gap),
                    read_part_size if read_coalesce_limit is None else int(read_coalesce_limit))
        if min(coalesce) < 0:
            raise ValueError(f"read_coalesce_blob, _gap and _limit must be >= 0, got {coalesce}")
        if retry_mode is not None and retry_mode not in ("standard", "adaptive", "legacy"):
            raise ValueError(f"retry_mode must be 'standard' or 'adaptive', got {retry_mode!r}")
        if client is None:
            session = boto3_session(profile_name)
            if max_attempts is None:
                configured = _configured(profile_name, "AWS_MAX_ATTEMPTS", "max_attempts")
                max_attempts = int(configured) if configured else DEFAULT_MAX_ATTEMPTS
            if retry_mode is None:
                retry_mode = _configured(profile_name, "AWS_RETRY_MODE", "retry_mode") or DEFAULT_RETRY_MODE
            if int(max_attempts) < 1:
                raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
            config = Config(
                retries={"mode": retry_mode, "total_max_attempts": int(max_attempts)},
                connect_timeout=connect_timeout,
                read_timeout=read_timeout,
                max_pool_connections=max(32, 3 * int(max_concurrency)),
                user_agent_extra="ckptstore",
            )
            try:
                with _sessions_lock:  # boto3 sessions are not thread-safe
                    client = session.client("s3", endpoint_url=endpoint_url, region_name=region_name, config=config)
            except ValueError as e:  # botocore's "Invalid endpoint: <url>"
                secrets = _secrets_of(endpoint_url)
                _scrub_exception(e, lambda text: _redact(text, secrets))
                raise ValueError(_redact(str(e), secrets)) from None
        elif max_attempts is None:
            max_attempts = client.meta.config.retries.get("total_max_attempts") or DEFAULT_MAX_ATTEMPTS
        self._shared = _Shared(bucket, client, part_size, int(max_concurrency), int(max_attempts),
                               read_part_size, max(1, int(_parts_per_tier)), coalesce)

    # -- helpers
    @property
    def client(self):
        """The boto3 S3 client (e.g. to register botocore event hooks)."""
        return self._shared.client

    @property
    def part_size(self) -> int:
        return self._shared.part_size

    @property
    def read_coalesce_blob(self) -> int:
        return self._shared.coalesce_blob

    @property
    def read_coalesce_gap(self) -> int:
        return self._shared.coalesce_gap

    @property
    def read_coalesce_limit(self) -> int:
        return self._shared.coalesce_limit

    def _join(self, name: str) -> str:
        """prefix/name, unchecked (for messages and checked names)."""
        return f"{self.prefix}/{name}" if self.prefix and name else (name or self.prefix)

    def _k(self, key: str) -> str:
        """The full S3 key of a checked ``key``: always below the store's prefix."""
        return self._join(self._check(key))

    def _dir(self, prefix: str) -> str:
        """The S3 prefix that lists what lies below a checked ``prefix`` (ends in '/', or '')."""
        p = self._join(self._check(prefix, prefix=True))
        return f"{p}/" if p else ""

    def _rel(self, full_key: str) -> str:
        return full_key[len(self.prefix) + 1:] if self.prefix else full_key

    def _listed(self, full_key: str) -> str | None:
        """The key of a listed object relative to this root; None when it is not a valid
        key (no method could address it)."""
        rel = self._rel(full_key)
        try:
            return check_key(rel)
        except ValueError:
            return None

    def describe(self, key: str = "") -> str:
        where = f"s3://{self.bucket}/{self._join(key.strip('/'))}" if (key or self.prefix) else f"s3://{self.bucket}"
        return self._shared.redact(where) if hasattr(self, "_shared") else redact_url(where)

    def __repr__(self) -> str:
        endpoint = self._shared.endpoint
        return f"S3Storage({self.url!r}" + (f", endpoint_url={endpoint!r})" if endpoint else ")")

    def part_size_for(self, part_number: int) -> int:
        """Size of part ``part_number`` (1-based) of an appended object: ``part_size``
        for the first tenth of S3's 10,000 parts, then doubling every tenth, so an
        object may reach ``part_size * 1000 * 1023`` bytes (16 TB at 16 MiB)."""
        sh = self._shared
        tier = (part_number - 1) // sh.parts_per_tier
        return min(MAX_PART_SIZE, sh.part_size << min(tier, 40))

    def _translate(self, e: BaseException, key: str = "") -> CkptStoreError:
        """A storage error naming the URL, classed as the interface wants it."""
        if isinstance(e, CkptStoreError):
            return e
        _scrub_exception(e, self._shared.redact)
        err = self._translate_text(e, key)
        err.args = tuple(self._shared.redact(a) if isinstance(a, str) else a for a in err.args)
        return err

    def _translate_text(self, e: BaseException, key: str) -> CkptStoreError:
        where = self.describe(key)
        if isinstance(e, bexc.ClientError):
            code, msg, status, tries = _client_error(e)
            detail = f"{code or status}" + (f": {msg}" if msg and msg != code else "")
            detail += f" ({e.operation_name}, HTTP {status}" + (f", {tries} attempts)" if tries > 1 else ")")
            if code == "NoSuchBucket":
                return StorageError(f"{where}: bucket {self.bucket!r} does not exist ({detail})")
            if code in _NOT_FOUND:
                return ObjectNotFoundError(f"{where}: not found ({detail})")
            if code in _PERMISSION or status == 403:
                return StoragePermissionError(f"{where}: access denied ({detail})")
            if code in _EXISTS or status == 412:
                return AlreadyExistsError(f"{where}: already exists ({detail})")
            if code in _TRANSIENT or status == 429 or (status or 0) >= 500:
                return TransientStorageError(f"{where}: {detail}; gave up after {tries} attempt(s)")
            return StorageError(f"{where}: {detail}")
        if isinstance(e, (bexc.NoCredentialsError, bexc.PartialCredentialsError, bexc.CredentialRetrievalError)):
            return StoragePermissionError(f"{where}: no usable AWS credentials ({e})")
        if isinstance(e, _CONNECTION_ERRORS):
            return TransientStorageError(
                f"{where}: {type(e).__name__}: {e}; gave up after up to {self._shared.max_attempts} attempts")
        if isinstance(e, CancelledError):
            return StorageError(f"{where}: upload cancelled")
        return StorageError(f"{where}: {type(e).__name__}: {e}")

    @contextmanager
    def _errors(self, key: str = ""):
        try:
            yield
        except CkptStoreError:
            raise
        except Exception as e:
            raise self._translate(e, key) from e

    # -- interface
    def child(self, prefix: str) -> "S3Storage":
        return S3Storage(self.bucket, self._join(self._check(prefix, prefix=True)), _shared=self._shared)

    def put(self, key: str, data, *, if_absent: bool = False) -> None:
        full = self._k(key)
        body = _as_bytes(data)
        extra = {"IfNoneMatch": "*"} if if_absent else {}
        try:
            self.client.put_object(Bucket=self.bucket, Key=full, Body=body, **extra)
            return
        except Exception as e:
            cause, err = e, self._translate(e, key)
        # A create-only PUT whose response was lost (reset, stall past the read timeout, a
        # 5xx after the write) may have been stored: botocore's retry then meets its own
        # first attempt (412), or every retry fails too. Either way, read the key back:
        # holding exactly our bytes means the write landed (a manifest names its attempt
        # and commit time, so no other writer produces the same bytes).
        if if_absent and (isinstance(err, TransientStorageError) or (
                isinstance(err, AlreadyExistsError) and isinstance(cause, bexc.ClientError)
                and _client_error(cause)[3] > 1)):
            held = self._holds(key, body)
            if held:
                return
            if held is None:
                raise TransientStorageError(
                    f"{self.describe(key)}: create-only write failed ({err}) and reading the key back "
                    "failed too: whether this write landed is unknown") from cause
        raise err from cause

    def _holds(self, key: str, body: bytes) -> bool | None:
        """Whether ``key`` holds exactly ``body`` (None: could not read it to tell)."""
        for _ in range(3):  # each read has botocore's retries already; this is for the verdict
            try:
                return self.read(key) == body
            except ObjectNotFoundError:
                return False
            except CkptStoreError:
                continue
        return None

    def open_append(self, key: str) -> AppendWriter:
        self._check(key)
        if self.exists(key):
            raise AlreadyExistsError(f"{self.describe(key)}: already exists")
        return _S3AppendWriter(self, key)

    def readinto(self, key: str, offset: int, out, on_piece=None) -> None:
        self._check(key)
        out = _byte_view(out)
        n = out.nbytes
        if n == 0:
            self.stat(key)  # a missing object is still an error
            return
        piece = self._shared.read_part_size
        if n <= piece or self._shared.max_concurrency <= 1:
            self._get_into(key, offset, out, on_piece)
            return
        # Large ranges: the caller's thread reads the first part (handing it to on_piece
        # block by block), the pool the others; on_piece then sees each part in order as
        # soon as it and all before it have arrived, while later parts still download.
        bounds = [(a, min(a + piece, n)) for a in range(0, n, piece)]
        pool = self._shared.pool()
        futures = [pool.submit(self._get_into, key, offset + a, out[a:b]) for a, b in bounds[1:]]
        error: BaseException | None = None
        try:
            self._get_into(key, offset, out[:bounds[0][1]], on_piece)
        except BaseException as e:
            error = e
        for (a, b), f in zip(bounds[1:], futures):
            if error is not None:
                f.cancel()
            try:
                f.result()
            except CancelledError:
                continue
            except BaseException as e:
                error = error or e
                continue
            if error is None and on_piece is not None:
                for c in range(a, b, _READ_BLOCK):
                    on_piece(out[c:min(b, c + _READ_BLOCK)])
        if error is not None:
            raise error

    def _get_into(self, key: str, offset: int, out: memoryview, on_piece=None) -> None:
        """One ranged GET into ``out``; re-requests the remainder when the body breaks."""
        where, n, full = self.describe(key), out.nbytes, self._k(key)
        pos, failures = 0, 0
        while pos < n:
            start = offset + pos
            try:
                resp = self.client.get_object(Bucket=self.bucket, Key=full, Range=f"bytes={start}-{offset + n - 1}")
            except bexc.ClientError as e:
                code, _msg, status, _tries = _client_error(e)
                if code == "InvalidRange" or status == 416:
                    size = (e.response.get("Error") or {}).get("ActualObjectSize", "fewer")
                    raise TruncatedObjectError(f"{where}: short read, wanted {n} bytes at offset {offset}, "
                                               f"object holds {size} bytes") from e
                raise self._translate(e, key) from e
            except Exception as e:
                raise self._translate(e, key) from e
            body = resp["Body"]
            try:
                if "ContentRange" not in resp and start != 0:
                    raise StorageError(f"{where}: the server ignored the Range header")
                if resp["ContentLength"] < n - pos:
                    total = (resp.get("ContentRange") or "").rpartition("/")[2] or "fewer"
                    raise TruncatedObjectError(f"{where}: short read, wanted {n} bytes at offset {offset}, "
                                               f"object holds {total} bytes")
                # botocore retried the request; it cannot retry a body that breaks after
                # the response arrived (reset, stall past the read timeout). That is the
                # one loop of our own: re-request what is still missing, bounded.
                while pos < n:
                    block = out[pos:min(n, pos + _READ_BLOCK)]
                    got = 0
                    while got < len(block):
                        k = body.readinto(block[got:])
                        if not k:
                            raise bexc.IncompleteReadError(actual_bytes=pos + got, expected_bytes=n)
                        got += k
                    if on_piece is not None:
                        on_piece(block)  # whole blocks only: a retry never re-sends bytes
                    pos += got
            except _STREAM_ERRORS as e:
                failures += 1
                if failures >= self._shared.max_attempts:
                    _scrub_exception(e, self._shared.redact)
                    raise TransientStorageError(self._shared.redact(
                        f"{where}: reading {n} bytes at offset {offset} failed {failures} times "
                        f"mid-stream: {type(e).__name__}: {e}")) from e
                _backoff(failures)
            finally:
                body.close()

    def read(self, key: str, offset: int = 0, length: int | None = None, *, limit: int | None = None) -> bytes:
        if length is not None:
            buf = bytearray(length)
            self.readinto(key, offset, memoryview(buf))
            return bytes(buf)
        where, failures, full = self.describe(key), 0, self._k(key)
        # With a limit, one byte more than it is asked for: the answer's ContentRange
        # gives the object's size, so a too large one is refused in the same request.
        ranged = f"bytes={offset}-{offset + limit}" if limit is not None else (f"bytes={offset}-" if offset else None)
        extra = {"Range": ranged} if ranged else {}
        while True:  # one GET for the whole object (manifests, votes): no HEAD first
            try:
                resp = self.client.get_object(Bucket=self.bucket, Key=full, **extra)
            except bexc.ClientError as e:
                code, _msg, status, _tries = _client_error(e)
                if code == "InvalidRange" or status == 416:
                    size = int((e.response.get("Error") or {}).get("ActualObjectSize") or -1)
                    if size == offset:
                        return b""
                    raise TruncatedObjectError(f"{where}: short read at offset {offset}, object holds {size} bytes") from e
                raise self._translate(e, key) from e
            except Exception as e:
                raise self._translate(e, key) from e
            try:
                if limit is not None:
                    total = (resp.get("ContentRange") or "").rpartition("/")[2]
                    size = int(total) - offset if total.isdigit() else resp["ContentLength"]
                    _check_limit(self, key, size, limit)
                return resp["Body"].read()  # botocore checks the length it got
            except _STREAM_ERRORS as e:  # see _get_into
                failures += 1
                if failures >= self._shared.max_attempts:
                    _scrub_exception(e, self._shared.redact)
                    raise TransientStorageError(
                        self._shared.redact(f"{where}: reading failed {failures} times mid-stream: {e}")) from e
                _backoff(failures)
            finally:
                resp["Body"].close()

    def list(self, prefix: str = "") -> list[str]:
        base = self._dir(prefix)
        names: set[str] = set()
        with self._errors(prefix):
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=base, Delimiter="/")
            for page in pages:
                for obj in page.get("Contents", ()):
                    name = obj["Key"][len(base):]
                    if name and self._listed(obj["Key"]) is not None:  # "": a console-made folder marker
                        names.add(name)
                for cp in page.get("CommonPrefixes", ()):
                    name = cp["Prefix"][len(base):]
                    if name.strip("/") and self._listed(cp["Prefix"][:-1]) is not None:
                        names.add(name)
        return sorted(names)

    def walk(self, prefix: str = "") -> Iterator[ObjectInfo]:
        base = self._dir(prefix)  # checked now, not at the first next()
        return self._walk(prefix, base)

    def _walk(self, prefix: str, base: str) -> Iterator[ObjectInfo]:
        with self._errors(prefix):
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base)
            for page in pages:
                for obj in page.get("Contents", ()):
                    key = self._listed(obj["Key"])  # folder markers ("a/") included
                    if key is None:
                        continue
                    yield ObjectInfo(key, int(obj["Size"]), obj["LastModified"].timestamp())

    def stat(self, key: str) -> ObjectInfo:
        full = self._k(key)
        with self._errors(key):
            resp = self.client.head_object(Bucket=self.bucket, Key=full)
        return ObjectInfo(key, int(resp["ContentLength"]), resp["LastModified"].timestamp())

    def delete(self, key: str) -> None:
        full = self._k(key)
        with self._errors(key):
            try:
                self.client.delete_object(Bucket=self.bucket, Key=full)
            except bexc.ClientError as e:
                if _client_error(e)[0] not in _NOT_FOUND:
                    raise

    def delete_prefix(self, prefix: str) -> None:
        """Every object under ``prefix``, in batched DeleteObjects (1,000 keys each)."""
        keys, base = [], self._dir(prefix)
        with self._errors(prefix):  # every key, folder markers and invalid names included
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base)
            for page in pages:
                keys += [obj["Key"] for obj in page.get("Contents", ())]
        for i in range(0, len(keys), _DELETE_BATCH):
            batch = keys[i:i + _DELETE_BATCH]
            with self._errors(prefix):
                resp = self.client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True})
            errors = [e for e in resp.get("Errors", ()) if e.get("Code") not in _NOT_FOUND]
            if errors:
                first = errors[0]
                raise StorageError(self._shared.redact(
                    f"s3://{self.bucket}/{first.get('Key')}: delete failed "
                    f"({first.get('Code')}: {first.get('Message')}); {len(errors)} key(s) not deleted"))

    def abort_stale_uploads(self, older_than: float, dry_run: bool = False) -> list[str]:
        """Abort multipart uploads under this root started ``older_than`` seconds ago or
        earlier (an upload whose writer died keeps its parts, and their cost, forever)."""
        cutoff = time.time() - older_than
        found = []
        with self._errors():
            pages = self.client.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.bucket, Prefix=self._dir(""))
            for page in pages:
                for up in page.get("Uploads", ()):
                    if up["Initiated"].timestamp() > cutoff:
                        continue
                    found.append(self._rel(up["Key"]))
                    if dry_run:
                        continue
                    try:
                        self.client.abort_multipart_upload(Bucket=self.bucket, Key=up["Key"], UploadId=up["UploadId"])
                    except bexc.ClientError as e:
                        if _client_error(e)[0] != "NoSuchUpload":  # someone else finished it
                            raise
        return found

    def is_dir(self) -> bool:
        """Whether anything lies under this root (the bucket root: whether it exists)."""
        with self._errors():
            resp = self.client.list_objects_v2(Bucket=self.bucket, Prefix=self._dir(""), MaxKeys=1)
        return not self.prefix or resp.get("KeyCount", 0) > 0


# ---------------------------------------------------------------------------- appends
class _Feed:
    """The blocking, non-seekable file object s3transfer reads the appended bytes from."""

    def __init__(self, writer: "_S3AppendWriter"):
        self._writer = writer

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def read(self, amount: int | None = -1) -> bytes:
        return self._writer._take(amount)


class _S3AppendWriter(AppendWriter):
    """Streams appended bytes to S3 while they arrive.

    ``append`` takes an offset and queues the bytes (a copy, unless they are an immutable
    ``bytes``) under one lock, so offsets follow arrival order and the queue is the
    object's byte order. s3transfer's
    submission thread reads parts off the queue (``_take``); its request threads upload
    up to ``max_concurrency`` parts at once. Memory stays bounded: ``append`` waits while
    two parts' worth is queued, and s3transfer holds at most ``max_concurrency`` parts.
    """

    def __init__(self, storage: S3Storage, key: str):
        self.key = key
        self._s = storage
        sh = storage._shared
        self._cv = threading.Condition()
        self._queue: collections.deque[memoryview] = collections.deque()
        self._queued = 0
        self._size = 0
        self._parts = 0  # parts handed to s3transfer so far
        self._eof = False
        self._stop: BaseException | None = None  # raised to s3transfer (abort, too many parts)
        self._closed = False
        self._completed = False
        self._future = None
        config = TransferConfig(
            multipart_threshold=sh.part_size,
            multipart_chunksize=sh.part_size,
            max_concurrency=sh.max_concurrency,
            use_threads=True,
        )
        config.max_in_memory_upload_chunks = sh.max_concurrency  # parts held by s3transfer
        self._manager = TransferManager(sh.client, config, executor_cls=DaemonThreadPool)
        with self._cv:
            self._future = self._manager.upload(_Feed(self), sh.bucket, storage._k(key))

    # -- the producer side (any thread)
    def append(self, data) -> int:
        mv = _byte_view(data)
        n = mv.nbytes
        with self._cv:
            while True:
                if self._closed:
                    raise StorageError(f"{self._s.describe(self.key)}: append after close or abort")
                if self._stop is not None:
                    raise StorageError(str(self._stop))
                if self._future.done():
                    break  # the upload failed: report it below, outside the lock
                if self._queued < self._limit():
                    offset = self._size
                    self._size += n
                    if n:  # bytes are immutable: keep them; anything else may be reused, copy it
                        self._queue.append(mv if isinstance(data, bytes) else memoryview(bytes(mv)))
                        self._queued += n
                        self._cv.notify_all()
                    return offset
                self._cv.wait(0.05)  # back-pressure; also notices a failed upload
        raise self._failure()

    def _limit(self) -> int:
        return 2 * self._s.part_size_for(self._parts + 1)

    def _failure(self) -> CkptStoreError:
        try:
            self._future.result()
        except BaseException as e:
            return self._s._translate(e, self.key)
        return StorageError(f"{self._s.describe(self.key)}: the upload ended before close")

    # -- the consumer side (s3transfer's submission thread)
    def _take(self, amount: int | None) -> bytes:
        with self._cv:
            if amount is None or amount < 0:
                want = None  # everything up to close (the single-PutObject path)
            else:
                self._parts += 1
                if self._parts > MAX_PARTS:
                    self._stop = StorageError(
                        f"{self._s.describe(self.key)}: object exceeds S3's {MAX_PARTS} parts; "
                        "use a larger part_size")
                # Returning more than asked is how parts grow: s3transfer sizes each part
                # by the bytes read (checked by tests/test_s3.py::test_part_sizes_grow...).
                want = max(amount, self._s.part_size_for(self._parts))
            while True:
                if self._stop is not None:
                    raise self._stop
                if self._eof or (want is not None and self._queued >= want):
                    break
                if self._future is not None and self._future.done():
                    raise StorageError("upload failed")  # stop reading; the real error is on the future
                self._cv.wait(0.05)
            pieces, got = [], 0
            while self._queue and (want is None or got < want):
                head = self._queue.popleft()
                if want is not None and got + len(head) > want:
                    k = want - got
                    self._queue.appendleft(head[k:])
                    head = head[:k]
                pieces.append(head)
                got += len(head)
            self._queued -= got
            self._cv.notify_all()
        return b"".join(pieces)

    # -- finishing
    def close(self) -> int:
        with self._cv:
            if self._closed:
                raise StorageError(f"{self._s.describe(self.key)}: closed twice")
            self._eof = True
            self._closed = True
            self._cv.notify_all()
        try:
            self._future.result()
        except BaseException as e:
            raise self._s._translate(e, self.key) from e
        finally:
            self._manager.shutdown()
        self._completed = True
        return self._size

    def abort(self) -> None:
        try:
            with self._cv:
                self._closed = True
                if self._stop is None:
                    self._stop = StorageError(f"{self._s.describe(self.key)}: upload aborted")
                self._queue.clear()
                self._queued = 0
                self._cv.notify_all()
            if not self._future.done():
                self._future.cancel()  # s3transfer then aborts the multipart upload
            try:
                self._future.result()
            except BaseException:
                pass
            self._manager.shutdown()
            if self._completed:
                self._s.delete(self.key)
        except BaseException:
            pass
