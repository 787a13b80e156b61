"""Error translation and retry classes of the S3 backend (docs/s3.md, "Retry classes").

botocore's errors become the package's storage errors, classed as the storage contract
wants them (missing, permission, exists, transient, other), each naming the ``s3://``
URL; their text, and that of botocore's exceptions chained to them, is redacted so no
endpoint credential leaks into a message or a logged traceback. Retries are botocore's;
``_backoff`` paces the one loop of our own (a GET whose body broke mid-stream).
"""

from __future__ import annotations

import http.client
import time
from concurrent.futures import CancelledError

from botocore import exceptions as bexc
from urllib3.exceptions import HTTPError as _Urllib3HTTPError

from ...errors import (
    AlreadyExistsError,
    CkptStoreError,
    ObjectNotFoundError,
    StorageError,
    StoragePermissionError,
    TransientStorageError,
)
from ..._jitter import jitter as _jitter
from ..base import redact_url


_NOT_FOUND = {"NoSuchKey", "404", "NotFound"}
_PERMISSION = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled",
               "InvalidToken", "ExpiredToken", "TokenRefreshRequired", "AccountProblem",
               "InvalidSecurity", "403", "Forbidden"}
EXISTS = {"PreconditionFailed", "412"}
# AWS answers 409 when a conditional write races another in-flight write of the key and
# says to retry it: S3Storage.put retries, then reads the key back (docs/s3.md).
CONFLICT = {"ConditionalRequestConflict", "409"}
# A request the store does not implement (Backblaze B2 answers 501 to If-None-Match):
# no retry changes that.
NOT_IMPLEMENTED = {"NotImplemented", "501"}
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


def _client_error(e: bexc.ClientError) -> tuple[str, str, int | None, int]:
    err = e.response.get("Error") or {}
    meta = e.response.get("ResponseMetadata") or {}
    return (str(err.get("Code") or ""), str(err.get("Message") or ""), meta.get("HTTPStatusCode"),
            int(meta.get("RetryAttempts") or 0) + 1)


def translate(e: BaseException, where: str, bucket: str, max_attempts: int) -> CkptStoreError:
    """The storage error for ``e``, raised at ``where`` (an ``s3://`` URL) in ``bucket``,
    by a client that makes up to ``max_attempts`` attempts per request. Its text is not
    redacted yet: the store does that (it knows the endpoint's secrets)."""
    if isinstance(e, bexc.ClientError):
        code, msg, status, tries = _client_error(e)
        detail = f"{code or status}" + (f": {msg}" if msg and msg != code else "")
        detail += f" ({e.operation_name}, HTTP {status}" + (f", {tries} attempts)" if tries > 1 else ")")
        if code == "NoSuchBucket":
            return StorageError(f"{where}: bucket {bucket!r} does not exist ({detail})")
        if code in _NOT_FOUND:
            return ObjectNotFoundError(f"{where}: not found ({detail})")
        if code in _PERMISSION or status == 403:
            return StoragePermissionError(f"{where}: access denied ({detail})")
        if code in EXISTS or status == 412:
            return AlreadyExistsError(f"{where}: already exists ({detail})")
        if code in NOT_IMPLEMENTED or status == 501:
            return StorageError(f"{where}: the store does not implement this request ({detail})")
        if code in _TRANSIENT or status == 429 or (status or 0) >= 500:
            return TransientStorageError(f"{where}: {detail}; gave up after {tries} attempt(s)")
        return StorageError(f"{where}: {detail}")
    if isinstance(e, bexc.CredentialRetrievalError):  # (throttled instance metadata or STS at job start)
        return TransientStorageError(f"{where}: fetching AWS credentials failed ({e}); retry")
    if isinstance(e, (bexc.NoCredentialsError, bexc.PartialCredentialsError)):
        return StoragePermissionError(f"{where}: no usable AWS credentials ({e})")
    if isinstance(e, _CONNECTION_ERRORS):
        return TransientStorageError(
            f"{where}: {type(e).__name__}: {e}; gave up after up to {max_attempts} attempts")
    if isinstance(e, CancelledError):
        return StorageError(f"{where}: upload cancelled")
    return StorageError(f"{where}: {type(e).__name__}: {e}")


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
    time.sleep(_jitter.random() * min(0.5 * 2 ** (failure - 1), 20.0))
