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
* **put** is one PutObject; ``if_absent=True`` adds ``If-None-Match: *`` (412 ->
  :class:`AlreadyExistsError`; 409 is retried), which makes manifests and votes
  create-only (I1), once a probe showed the store honours it (``conditional_writes``).
* **open_append** streams the object up while it is written: appends land, in arrival
  order, in a bounded buffer that a blocking file-like reader hands to boto3's transfer
  layer (``s3transfer.TransferManager.upload``), which sends it as a single PutObject
  when small, else as a multipart upload, and aborts the upload when it fails. With a
  size hint every part of an upload has one size, fit to hold the hint in S3's 10,000
  parts (R2 wants equal parts); more writers (ranks) make larger parts and fewer in
  flight, so memory stays near ``(10 + 3) x 16 MiB``. An object that outgrows its plan,
  or has none, gets parts that double every 1,000.
* **delete_many** is DeleteObjects of 1,000 keys; a store that wants Content-MD5 on it
  (older MinIO: 400 MissingContentMD5; botocore >= 1.36 sends a CRC32) gets per-key
  deletes from then on.
* **checksums** (None, "when_required", "when_supported"): botocore's request checksum
  setting; over HTTPS its default sends bodies aws-chunked with a trailing CRC32, which
  R2, GCS, B2 and Wasabi have refused (an error then says which option to pass).
* **readinto** issues ranged GETs, several concurrently for large ranges; a range past
  the end of an object raises :class:`TruncatedObjectError` (a short read). Loads merge
  the reads of small neighbouring blobs into one GET (``read_hints``).
* **Keys** are checked (``check_key``) before any request, so the full key (prefix +
  '/' + key) always lies under the store's prefix; listed objects whose names are not
  valid keys (``a//b``, ``./x``, written by other tools) are left out of ``list`` and
  ``walk`` (``delete_prefix`` still deletes them).
* **No secrets in messages**: an endpoint URL with userinfo (``http://user:password@host``)
  is redacted (``redact_url``) in ``describe()``, ``url``, ``repr`` and the text of every
  error the backend raises or translates, botocore's own (which echo the endpoint) too.

Modules:

| module | holds |
|---|---|
| ``client.py`` | S3 limits and defaults, the process-wide boto3 sessions (:func:`boto3_session`), client construction from the store's settings, ``_Shared`` (client, settings, read pool: what a store shares with its children) |
| ``errors.py`` | error translation (botocore -> the package's storage errors, by retry class), redaction of endpoint secrets, the backoff of the one retry loop of our own |
| ``store.py`` | :class:`S3Storage` |
| ``request_args.py`` | parameters every request carries: ``ExpectedBucketOwner``, ``RequestPayer``, SSE-KMS |
| ``writer.py`` | the streaming multipart append writer (``open_append``) and its part plan (``plan_parts``); it knows of the store only the ``UploadTarget`` it is handed |
"""

from __future__ import annotations

try:  # every third-party module the backend imports
    import boto3  # noqa: F401
    import botocore  # noqa: F401
    import s3transfer  # noqa: F401
    import urllib3  # noqa: F401
except ImportError as _e:  # pragma: no cover - depends on the environment
    raise ImportError(f"s3:// URLs need boto3 (pip install 'ckptstore[s3]'): {_e}") from _e

from . import client
from .client import *  # noqa: F401,F403 - the settings and boto3_session (client.__all__), as asyncio re-exports
from .store import S3Storage

__all__ = [*client.__all__, "S3Storage"]
